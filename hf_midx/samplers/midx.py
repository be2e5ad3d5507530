"""The MIDX proposals over an inverted multi-index: midx-rq / midx-pq (fast) and midx-exact (Theorem 1).

:class:`MidxSampler` is what both kinds share: the index over the candidate classes, its refresh, learned
codebooks and checkpoint state. Its two children are siblings: :class:`MidxQuantizedSampler` (midx-rq,
midx-pq: the softmax over the quantized embeddings, O(K D + K^2 + M log V) per query) and
:class:`MidxExactSampler` (midx-exact: exactly the softmax, O(V D) per query, a yardstick). The sampler
name names the quantizer (midx-rq: residual, midx-pq: product); midx-exact takes it as its ``quantizer``
option. Two options make the fast proposal cover the softmax better (issue 9):

* ``last_stage="frequency"``: inside a bucket, draw a class proportionally to its smoothed training
  count w_i = (count_i + unigram_smoothing) ** unigram_power instead of uniformly; a bucket's mass uses
  the summed weights W(k1, k2) instead of |Omega(k1, k2)|, so
  Q(i | z) = exp(s1[k1(i)] + s2[k2(i)]) w_i / sum_{k,k'} W(k,k') exp(s1[k] + s2[k']);
* ``mix_weight=a`` with ``mix_static``: the defensive mixture Q = (1 - a) Q_midx + a Q_static, with
  Q_static the unigram table (smoothed counts) or uniform; each draw comes from the static component
  with probability a, and log Q is the logaddexp of both components (exact).

Both need ``class_counts`` for their frequency tables; without counts they fall back, with a warning,
to the uniform last stage and no mixture (a uniform component was measured to cover the softmax worse
than MIDX alone: ESS 0.06 vs 0.12 of M, on the recipe's WikiText-2 model after 400 steps).
"""

from __future__ import annotations

import math
import warnings

import torch

from .. import defaults
from .._checks import check_positive_int, is_number
from .._ops import row_chunks
from ..defaults import KMEANS_BACKENDS, LAST_STAGES, MIX_STATICS
from ..index import MidxIndex
from ..quantizers import QUANTIZERS
from ..registry import register
from .base import Sampler, mixture_log_prob
from .counts import check_counts, check_unigram_options, unigram_log_table


def check_choice(options: dict, name: str, choices: tuple) -> None:
    """``options[name]``, when given, must be one of ``choices``."""
    if name in options and options[name] not in choices:
        raise ValueError(f"{name} must be one of {choices}, got {options[name]!r}.")


class MidxSampler(Sampler):
    """A proposal over an inverted multi-index of the candidate classes (``index``): what midx-rq, midx-pq and
    midx-exact share. Subclasses implement the draws and ``_after_index_change``."""

    options = ("kmeans_iters", "kmeans_backend")

    def __init__(
        self,
        embeddings: torch.Tensor,
        *,
        quantizer: str,
        codebook_size: int = defaults.CODEBOOK_SIZE,
        kmeans_iters: int = defaults.KMEANS_ITERS,
        kmeans_backend: str = defaults.KMEANS_BACKEND,
        seed: int = defaults.SEED,
        exclude=None,
    ) -> None:
        MidxSampler.check_options(kmeans_iters=kmeans_iters, kmeans_backend=kmeans_backend)
        super().__init__(embeddings, seed=seed, exclude=exclude)
        self.index = MidxIndex.build(
            self._restrict(embeddings.detach()),
            codebook_size,
            quantizer=quantizer,
            kmeans_iters=kmeans_iters,
            kmeans_backend=kmeans_backend,
            seed=seed,
            check=False,  # Sampler.__init__ checked the embeddings
        )

    @classmethod
    def check_options(cls, **options) -> None:
        if "kmeans_iters" in options:
            check_positive_int("kmeans_iters", options["kmeans_iters"], minimum=0)
        check_choice(options, "kmeans_backend", KMEANS_BACKENDS)

    @property
    def quantizer(self) -> str:
        return self.index.quantizer

    def refresh(self, embeddings: torch.Tensor) -> None:
        """Warm-started k-means on the new (V, D) embeddings; O(V K D iters)."""
        emb = self._check_embeddings(embeddings)
        self.index.rebuild(emb, check=False)  # checked once, just here
        self._after_index_change(emb)

    def set_codebooks(self, codebooks: tuple[torch.Tensor, torch.Tensor], embeddings: torch.Tensor) -> None:
        """Adopt (e.g. learned) codebooks for the (V, D) embeddings; recomputes codes and bucket tables in O(V K D)."""
        emb = self._check_embeddings(embeddings)
        self.index.set_codebooks(codebooks, emb)
        self._after_index_change(emb)

    def _after_index_change(self, embeddings: torch.Tensor | None) -> None:
        """Recompute what depends on the index; ``embeddings`` (V', D) float32, or None after a checkpoint load."""
        raise NotImplementedError

    def _codeword_scores(self, q: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """s1 = z1 . c1 and s2 = z2 . c2, (T, K) float32 each."""
        d1, d2 = self.index.dim_slices(q.shape[1])
        c1, c2 = self.index.codebooks
        return q[:, d1] @ c1.t(), q[:, d2] @ c2.t()

    # -- state: the index's tensors under "index.", besides the base's
    def state_dict(self) -> dict[str, torch.Tensor]:
        state = super().state_dict()
        state.update({f"index.{k}": v.contiguous() for k, v in self.index.state_dict().items()})
        return state

    def _load_tables(self, state: dict[str, torch.Tensor]) -> None:
        self.index.load_state_dict({k[len("index.") :]: v for k, v in state.items() if k.startswith("index.")})

    def _after_load(self) -> None:
        self._after_index_change(None)


class MidxQuantizedSampler(MidxSampler):
    """The faster MIDX proposal (the paper's Eq. midx_uni): the softmax over the quantized embeddings.

    Q(i | z) = exp(z1.c1[k1(i)] + z2.c2[k2(i)]) / sum_{k,k'} |Omega(k,k')| exp(z1.c1[k] + z2.c2[k']),
    i.e. softmax over the quantized embeddings q_i - residual_i. A draw takes a bucket (k1, k2) with
    probability P1(k1) P2(k2 | k1), computed as one categorical over the K*K buckets whose logits
    are z1.c1[k1] + z2.c2[k2] + log|Omega(k1,k2)| (empty buckets get -inf and are never drawn),
    then a class from the bucket (uniformly, or by frequency with ``last_stage="frequency"``); with
    ``mix_weight`` > 0 the defensive mixture of the module docstring. Per query:
    O(K D + K^2 + M log V); nothing of size V.
    """

    options = (
        *MidxSampler.options,
        "last_stage",
        "mix_weight",
        "mix_static",
        "unigram_smoothing",
        "unigram_power",
    )
    quantizer_name = "rq"

    def __init__(
        self,
        embeddings: torch.Tensor,
        *,
        last_stage: str = defaults.LAST_STAGE,
        mix_weight: float = defaults.MIX_WEIGHT,
        mix_static: str = defaults.MIX_STATIC,
        unigram_smoothing: float = defaults.UNIGRAM_SMOOTHING,
        unigram_power: float = defaults.UNIGRAM_POWER,
        class_counts=None,
        **index_options,
    ) -> None:
        MidxQuantizedSampler.check_options(
            last_stage=last_stage,
            mix_weight=mix_weight,
            mix_static=mix_static,
            unigram_smoothing=unigram_smoothing,
            unigram_power=unigram_power,
        )
        super().__init__(embeddings, quantizer=self.quantizer_name, **index_options)
        needs_counts = last_stage == "frequency" or (mix_weight > 0 and mix_static == "unigram")
        counts = None
        if class_counts is not None:
            counts = self._restrict(check_counts(class_counts, self.num_classes, self.device))
        elif needs_counts:
            wanted = ["last_stage='frequency'"] if last_stage == "frequency" else []
            wanted += ["mix_static='unigram'"] if mix_weight > 0 and mix_static == "unigram" else []
            warnings.warn(
                f"{self.name}: {' and '.join(wanted)} {'needs' if len(wanted) == 1 else 'need'} class_counts "
                "(training-token frequencies); without them the sampler draws uniformly inside buckets and mixes "
                "in no static component. Pass class_counts= (e.g. hf_midx.wrap(model, config, "
                "class_counts=hf_midx.token_counts(ids, V))) for the measured defaults, or mix_weight=0.0 for "
                "the paper's MIDX alone.",
                UserWarning,
                stacklevel=3,
            )
            last_stage = "uniform"
            if mix_static == "unigram":
                mix_weight = 0.0
        self.last_stage, self.mix_static, self.mix_weight = last_stage, mix_static, float(mix_weight)
        # Per-class log weights of the last stage (None: uniform) and the static component (V',) float32.
        self._log_w = None
        if last_stage == "frequency":
            self._log_w = unigram_log_table(counts, unigram_smoothing, unigram_power)
        self._log_static = None
        if self.mix_weight > 0:
            if mix_static == "unigram":
                self._log_static = unigram_log_table(counts, unigram_smoothing, unigram_power)
            else:
                v = self.num_candidates
                self._log_static = torch.full((v,), -math.log(v), device=self.device)
            self._static_cum = self._log_static.double().exp().cumsum(0)
        self._after_index_change(None)

    @classmethod
    def check_options(cls, **options) -> None:
        super().check_options(**options)
        check_choice(options, "last_stage", LAST_STAGES)
        check_choice(options, "mix_static", MIX_STATICS)
        mix_weight = options.get("mix_weight", 0.0)
        if not (is_number(mix_weight) and 0.0 <= mix_weight < 1.0):
            raise ValueError(f"mix_weight must be a number in [0, 1), got {mix_weight!r}.")
        check_unigram_options(options)
        frequency = options.get("last_stage") == "frequency"
        if frequency and not options.get("unigram_smoothing", defaults.UNIGRAM_SMOOTHING) > 0:
            raise ValueError("last_stage='frequency' needs unigram_smoothing > 0 so that every class stays drawable.")

    def _after_index_change(self, embeddings: torch.Tensor | None) -> None:
        """Bucket masses (K, K) float64 and, for the frequency last stage, the CSR cumulative weights."""
        idx = self.index
        if self._log_w is None:
            self._bucket_mass = idx.bucket_counts.double()
            self._cum_w = None
        else:
            w = self._log_w.double().exp()
            k = idx.codebook_size
            bucket = idx.codes[:, 0] * k + idx.codes[:, 1]
            mass = torch.zeros(k * k, dtype=torch.float64, device=self.device).index_add_(0, bucket, w)
            self._bucket_mass = mass.view(k, k)
            # cum_w[j] = total weight of order[:j]: a bucket's members order[lo:hi] span [cum_w[lo], cum_w[hi]).
            self._cum_w = torch.cat([w.new_zeros(1), w[idx.order].cumsum(0)])
        # Per-step work reads these; they change only with the index.
        self._unused_k2 = self._bucket_mass.sum(0) == 0  # (K,) second-level codewords without classes
        self._bucket_mass_f32 = self._bucket_mass.float()

    # -- the proposal
    def codeword_scores(self, q: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """s1 = z1 . c1 (T, K), s2 = z2 . c2 (T, K) float32 and log Z (T,) float32 of the MIDX component."""
        s1, s2, log_z, *_ = self._proposal(q)
        return s1, s2, log_z

    def _proposal(self, q: torch.Tensor):
        """The per-query quantities of Eq. midx_uni, without any T x K x K tensor.

        With psi(k1) = sum_k2 W(k1,k2) exp(s2[k2]) (one (T,K) x (K,K) matmul; W = |Omega| or the summed
        frequency weights), Z = sum_k1 exp(s1[k1]) psi(k1) and P1(k1) = exp(s1[k1]) psi(k1) / Z.
        Returns s1, s2 (T, K) float32; log Z (T,) float32; and, float64 (T, K), e2 = exp(s2 - m2),
        P1 and psi / exp(m2), so that P(k1, k2) = P1(k1) W(k1,k2) e2[k2] / psi[k1]. m2 is the
        row's largest s2 over codewords that hold classes: psi > 0 for some k1 in every row, and
        float64 loses only buckets more than ~700 nats below the best.
        """
        s1, s2 = self._codeword_scores(q)
        s2_used = s2.masked_fill(self._unused_k2, -math.inf)  # a codeword without classes must not overflow e2
        m2 = s2_used.amax(1, keepdim=True)
        e2 = (s2_used - m2).double().exp()
        psi = e2 @ self._bucket_mass.t()
        logits1 = s1.double() + psi.log() + m2.double()  # -inf for codewords k1 with no class
        log_z = torch.logsumexp(logits1, dim=1, keepdim=True)
        return s1, s2, log_z.squeeze(1).float(), e2, (logits1 - log_z).exp(), psi

    def _draw_buckets(self, e2: torch.Tensor, p1: torch.Tensor, psi: torch.Tensor, m: int, gen) -> torch.Tensor:
        """(T, M) bucket ids b = k1*K + k2 drawn with probability P1(k1) P2(k2 | k1).

        Inverse-CDF draws, whichever is cheaper for M: k1 from P1 and then k2 from
        P2(. | k1) proportional to W(k1,k2) e2[k2], O(M K) per query (the paper's two stages);
        or, for M > K/2, one search per draw over the K*K buckets laid out in (k1, k2) order, which is
        the same two-stage draw at O(K^2) per query whatever M is. Empty buckets have weight 0 and are
        never drawn.
        """
        k = e2.shape[1]
        out = torch.empty(e2.shape[0], m, dtype=torch.long, device=e2.device)
        if 2 * m <= k:
            k1 = gen.categorical(p1, m)
            for rows in row_chunks(e2.shape[0], m * k):
                w2 = self._bucket_mass[k1[rows]] * e2[rows].unsqueeze(1)  # (c, M, K)
                out[rows] = k1[rows] * k + gen.categorical(w2, 1).squeeze(-1)
            return out
        r = torch.where(psi > 0, p1 / psi, torch.zeros_like(psi)).float()
        for rows in row_chunks(e2.shape[0], k * k):
            # (c, K, K) bucket probabilities, float32 (a bucket below e^-87 of the total is never drawn).
            joint = r[rows].unsqueeze(2) * self._bucket_mass_f32.unsqueeze(0) * e2[rows].float().unsqueeze(1)
            out[rows] = gen.categorical(joint.view(-1, k * k), m)
        return out

    def _log_q(self, s1, s2, log_z, ids) -> torch.Tensor:
        """log Q of (T, N) local ids from the codeword scores: the MIDX component, mixed with the static one."""
        codes = self.index.codes[ids]  # (..., 2)
        out = s1.gather(1, codes[..., 0]) + s2.gather(1, codes[..., 1]) - log_z.unsqueeze(1)
        return self._mixed(out if self._log_w is None else out + self._log_w[ids], ids)

    def _mixed(self, log_q_midx: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        if self._log_static is None:
            return log_q_midx
        a = self.mix_weight
        return torch.logaddexp(log_q_midx + math.log1p(-a), self._log_static[ids] + math.log(a))

    def _sample(self, q, m, gen):
        draws, log_q, _ = self._sample_scored(q, m, gen, None)
        return draws, log_q

    def _sample_scored(self, q, m, gen, ids):
        # One proposal for the draws and the scored ids.
        s1, s2, log_z, e2, p1, psi = self._proposal(q)
        buckets = self._draw_buckets(e2, p1, psi, m, gen)
        draws = self.index.draw_members(buckets, gen.rand(*buckets.shape, dtype=torch.float64), self._cum_w)
        if self._log_static is not None:
            # Each draw comes from the static component with probability a (both drawn, one kept: no sync).
            static = gen.categorical(self._static_cum, m, cumulative=True, rows=q.shape[0])
            draws = torch.where(gen.rand(*draws.shape) < self.mix_weight, static, draws)
        log_q_ids = None if ids is None else self._log_q(s1, s2, log_z, ids)
        return draws, self._log_q(s1, s2, log_z, draws), log_q_ids

    def _log_prob(self, q, ids):
        return self._log_q(*self.codeword_scores(q), ids)

    def _log_prob_shared(self, q, ids, log_w):
        # qbar(i) = sum_t w_t Q(i | z_t): T x N gathers from the T x K scores, chunked over queries.
        s1, s2, log_z = self.codeword_scores(q)
        codes = self.index.codes[ids]
        out = mixture_log_prob(
            lambda rows: s1[rows][:, codes[:, 0]] + s2[rows][:, codes[:, 1]] - log_z[rows].unsqueeze(1),
            q.shape[0],
            ids.shape[0],
            log_w,
        )
        # The last-stage weight and the static component are the same for every query: outside the sum over t.
        return self._mixed(out if self._log_w is None else out + self._log_w[ids], ids)


@register
class MidxRQSampler(MidxQuantizedSampler):
    """MIDX with residual quantization (both codebooks in D dims)."""

    name = "midx-rq"
    quantizer_name = "rq"


@register
class MidxPQSampler(MidxQuantizedSampler):
    """MIDX with product quantization (codebook 1 on the first D/2 dims, codebook 2 on the rest)."""

    name = "midx-pq"
    quantizer_name = "pq"


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
