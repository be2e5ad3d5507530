"""midx-exact: the paper's Theorem 1 over the inverted multi-index, exactly the softmax (a yardstick, O(V D) per query).

Beside the fast MIDX proposals of :mod:`.midx` (whose index, refresh and state it shares through
:class:`~hf_midx.samplers.midx.MidxSampler`): it verifies the three-factor decomposition P1(k1) P2(k2 | k1) P3(i | k1, k2)
with the residual softmax P3, and measures what the fast proposals lose.
"""

from __future__ import annotations

import math

import torch

from .._ops import row_chunks
from ..indexing.quantizers import QUANTIZERS
from ..registry import register
from .midx import MidxSampler, check_choice


@register
class MidxExactSampler(MidxSampler):
    """Theorem 1: P1(k1) P2(k2|k1) P3(i|k1,k2) with the residual softmax P3; exactly softmax(z . q).

    Costs O(V D) per query (it keeps the embeddings): it verifies the decomposition and serves as a
    yardstick, not as a fast sampler. Its ``quantizer`` option ("rq" default or "pq") picks the index.
    """

    name = "midx-exact"
    options = ("quantizer", *MidxSampler.options)
    _state_names = ("embeddings",)

    def __init__(self, embeddings: torch.Tensor, *, quantizer: str = "rq", class_counts=None, **index_options) -> None:
        MidxExactSampler.check_options(quantizer=quantizer)  # the index options: MidxSampler's
        super().__init__(embeddings, quantizer=quantizer, **index_options)
        self._after_index_change(self._restrict(embeddings.detach().float()))

    @classmethod
    def check_options(cls, **options) -> None:
        super().check_options(**options)
        check_choice(options, "quantizer", QUANTIZERS)

    def _after_index_change(self, embeddings: torch.Tensor | None) -> None:
        if embeddings is not None:  # after a load, the embeddings come from the checkpoint
            self.embeddings = embeddings.clone()

    def _log_prob(self, q, ids):
        out = torch.empty(ids.shape, device=self.device)
        for rows in row_chunks(q.shape[0], self.num_candidates):
            logits = q[rows] @ self.embeddings.t()
            out[rows] = logits.gather(1, ids[rows]) - torch.logsumexp(logits, dim=1, keepdim=True)
        return out

    def _sample(self, q, m, gen):
        idx = self.index
        k2 = idx.codebook_size**2
        bucket_of_class = idx.codes[:, 0] * idx.codebook_size + idx.codes[:, 1]
        ids = torch.empty(q.shape[0], m, dtype=torch.long, device=self.device)
        log_q = torch.empty(q.shape[0], m, device=self.device)
        for rows in row_chunks(q.shape[0], 2 * self.num_candidates):
            zq = q[rows]
            s1, s2 = self._codeword_scores(zq)
            logits = zq @ self.embeddings.t()  # (c, V')
            codes = idx.codes.unsqueeze(0).expand(zq.shape[0], -1, -1)
            residual = logits - s1.gather(1, codes[..., 0]) - s2.gather(1, codes[..., 1])  # z . q~_i
            # log omega(k1,k2) = logsumexp of residual logits over the bucket (scatter in log space).
            b_idx = bucket_of_class.expand(zq.shape[0], -1)
            b_max = torch.full((zq.shape[0], k2), -math.inf, device=self.device).scatter_reduce(
                1, b_idx, residual, reduce="amax"
            )
            w = (residual - b_max.gather(1, b_idx)).double().exp()  # each bucket's max weight is 1
            b_sum = torch.zeros(zq.shape[0], k2, dtype=torch.float64, device=self.device).scatter_add_(1, b_idx, w)
            log_omega = (b_max + b_sum.log().float()).view(-1, k2)  # -inf for empty buckets
            joint = (s1.unsqueeze(2) + s2.unsqueeze(1)).view(-1, k2) + log_omega
            log_p12 = torch.log_softmax(joint, dim=1)
            buckets = gen.categorical(log_p12.double().exp(), m)
            # P3: inverse CDF inside the bucket's CSR slice of the per-query cumulative weights.
            cum = torch.cumsum(w.gather(1, idx.order.expand(zq.shape[0], -1)), dim=1)
            cum = torch.cat([cum.new_zeros(zq.shape[0], 1), cum], dim=1)
            drawn = idx.draw_members(buckets, gen.rand(*buckets.shape, dtype=torch.float64), cum)
            ids[rows] = drawn
            log_p3 = residual.gather(1, drawn) - log_omega.gather(1, buckets)
            log_q[rows] = log_p12.gather(1, buckets) + log_p3
        return ids, log_q
