"""Sampled-softmax loss with proposal correction, and the exact full-softmax reference.

Shapes: T tokens, D hidden dims, V classes, M negatives per token (per-query mode) or P negatives in
one pool (shared mode).

For token t with label y and negatives j ~ Q(. | z_t):

    loss_t = -o_ty + log( exp(o_ty) + sum_j exp(o_tj - log(M * q_tj)) )

The positive logit is exact; each negative is corrected by its proposal probability, so the sum
estimates the partition function without bias. Neither path ever builds a (T, V) tensor.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from ._checks import check_ids, check_matrix, check_positive_int
from .samplers import Sampler

NEGATIVE_MODES = ("per-query", "shared")
REDUCTIONS = ("mean", "sum", "none")

# Elements of one (chunk, M, D) gather of negative embeddings; bounds the per-query path's memory.
_GATHER_ELEMENTS = 1 << 23


class _GatheredLogits(torch.autograd.Function):
    """o[t, m] = hidden[t] . weight[ids[t, m]] without keeping the (T, M, D) gather for backward.

    Forward and backward both walk over token chunks, so extra memory is O(chunk * M * D); only
    hidden, weight and ids are saved. Logits are returned in float32.
    """

    @staticmethod
    def forward(ctx, hidden: torch.Tensor, weight: torch.Tensor, ids: torch.Tensor, chunk: int) -> torch.Tensor:
        ctx.save_for_backward(hidden, weight, ids)
        ctx.chunk = chunk
        out = torch.empty(ids.shape, device=hidden.device, dtype=torch.float32)
        for s in range(0, ids.shape[0], chunk):
            w = weight[ids[s : s + chunk]]  # (c, M, D)
            out[s : s + chunk] = torch.bmm(w, hidden[s : s + chunk].unsqueeze(2)).squeeze(2).float()
        return out

    @staticmethod
    def backward(ctx, grad_out: torch.Tensor):
        hidden, weight, ids = ctx.saved_tensors
        chunk = ctx.chunk
        grad_hidden = torch.empty_like(hidden) if ctx.needs_input_grad[0] else None
        grad_weight = torch.zeros_like(weight) if ctx.needs_input_grad[1] else None
        g_all = grad_out.to(hidden.dtype)
        for s in range(0, ids.shape[0], chunk):
            idx, g = ids[s : s + chunk], g_all[s : s + chunk]  # (c, M)
            if grad_hidden is not None:
                grad_hidden[s : s + chunk] = torch.bmm(g.unsqueeze(1), weight[idx]).squeeze(1)
            if grad_weight is not None:
                contrib = g.unsqueeze(2) * hidden[s : s + chunk].unsqueeze(1)  # (c, M, D)
                grad_weight.index_add_(0, idx.reshape(-1), contrib.reshape(-1, hidden.shape[1]).to(weight.dtype))
        return grad_hidden, grad_weight, None, None


def _softcap(logits: torch.Tensor, cap: float | None) -> torch.Tensor:
    return logits if cap is None else cap * torch.tanh(logits / cap)


def _validate(hidden, weight, labels, bias, ignore_index, reduction):
    check_matrix("hidden", hidden, finite=False)
    check_matrix("weight", weight, dim=hidden.shape[1], finite=False)
    if labels.dim() != 1 or labels.shape[0] != hidden.shape[0]:
        raise ValueError(
            f"labels must have shape (T,) = ({hidden.shape[0]},) to match hidden {tuple(hidden.shape)}, "
            f"got {tuple(labels.shape)}; flatten (batch, seq) first."
        )
    check_ids("labels", labels, weight.shape[0], ignore_index=ignore_index)
    if bias is not None and tuple(bias.shape) != (weight.shape[0],):
        raise ValueError(f"bias must have shape ({weight.shape[0]},), got {tuple(bias.shape)}.")
    if reduction not in REDUCTIONS:
        raise ValueError(f"reduction must be one of {REDUCTIONS}, got {reduction!r}.")


def _reduce(per_token: torch.Tensor, valid: torch.Tensor, reduction: str) -> torch.Tensor:
    """per_token: (T',) losses of the valid tokens; valid: (T,) bool."""
    if reduction == "none":
        out = per_token.new_zeros(valid.shape)
        return out.masked_scatter(valid, per_token)
    total = per_token.sum()
    if reduction == "sum":
        return total
    # An all-ignored batch gives 0 (with a zero gradient) rather than 0/0.
    return total / max(int(valid.sum()), 1)


def sampled_softmax_loss(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    sampler: Sampler,
    num_samples: int,
    *,
    bias: torch.Tensor | None = None,
    negatives: str = "per-query",
    ignore_index: int = -100,
    remove_accidental_hits: bool = True,
    reduction: str = "mean",
    logit_softcap: float | None = None,
    generator: torch.Generator | None = None,
) -> torch.Tensor:
    """Sampled-softmax cross-entropy corrected by the proposal (an estimator of the full loss).

    Args:
        hidden: (T, D) final hidden states z_t (any float dtype; autograd flows to it).
        weight: (V, D) class embeddings / LM head weight (autograd flows to the rows touched).
        labels: (T,) int64 in [0, V), or ``ignore_index``.
        sampler: the proposal (see :func:`hf_midx.build_sampler`); queried with ``hidden`` detached.
        num_samples: M negatives per token ("per-query") or the pool size P ("shared").
        bias: optional (V,) output bias.
        negatives: "per-query" (each token its own M draws from Q(. | z_t), the paper) or "shared"
            (one pool of P draws from the batch mixture qbar, scored by every token in one matmul;
            corrected by log(P * qbar)).
        ignore_index: label value that contributes nothing.
        remove_accidental_hits: drop a negative equal to the token's label from the sum.
        reduction: "mean" over non-ignored tokens, "sum", or "none" ((T,), zeros at ignored tokens).
        logit_softcap: if set, logits become ``cap * tanh(o / cap)`` (Gemma-2) before correction.
        generator: optional RNG for the draws; defaults to the sampler's own.
    Returns:
        float32 scalar (or (T,) for "none").
    """
    _validate(hidden, weight, labels, bias, ignore_index, reduction)
    check_positive_int("num_samples", num_samples)
    if negatives not in NEGATIVE_MODES:
        raise ValueError(f"negatives must be one of {NEGATIVE_MODES}, got {negatives!r}.")
    if sampler.num_classes != weight.shape[0]:
        raise ValueError(
            f"The sampler indexes {sampler.num_classes} classes but weight has {weight.shape[0]} rows; "
            "refresh or rebuild the sampler for this head."
        )
    if hidden.dtype != weight.dtype:
        # e.g. fp32 hidden states from a norm layer against a bf16 head: one dtype for the matmuls.
        hidden = hidden.to(weight.dtype)
    valid = labels != ignore_index
    h = hidden[valid]
    y = labels[valid]
    if h.shape[0] == 0:
        # No token counts: a zero that still belongs to the graph (bias included), so backward gives
        # zero gradients, not None or an "unused tensor" error.
        zero = (hidden.sum() * 0.0 + weight.sum() * 0.0).float()
        if bias is not None:
            zero = zero + (bias.sum() * 0.0).float()
        return _reduce(zero.reshape(1)[:0], valid, reduction) if reduction == "none" else zero

    # The label's row and the negatives' rows are read in one gather, so backward writes a single
    # dense (V, D) gradient buffer for the weight (two buffers and their sum cost ~45% of a step).
    if negatives == "per-query":
        ids, log_q = sampler.sample(h, num_samples, generator=generator)
        rows = torch.cat([y.unsqueeze(1), ids], dim=1)  # (T', 1 + M)
        chunk = max(1, _GATHER_ELEMENTS // ((num_samples + 1) * h.shape[1]))
        logits = _GatheredLogits.apply(h, weight, rows, chunk)
        if bias is not None:
            logits = logits + bias[rows].float()
        hits = ids == y.unsqueeze(1)
    else:
        ids, log_q = sampler.sample_shared(h, num_samples, generator=generator)
        n = y.shape[0]
        rows = torch.cat([y, ids])  # (T' + P,): labels' rows, then the pool's
        w = weight[rows]
        pos = (h * w[:n]).sum(-1, keepdim=True)
        neg = h @ w[n:].t()  # (T', P): one matmul against the pool
        logits = torch.cat([pos, neg], dim=1).float()
        if bias is not None:
            b = bias[rows].float()
            logits = logits + torch.cat([b[:n].unsqueeze(1), b[n:].expand(n, -1)], dim=1)
        log_q = log_q.unsqueeze(0)
        hits = ids.unsqueeze(0) == y.unsqueeze(1)
    logits = _softcap(logits, logit_softcap)
    pos = logits[:, 0]
    neg = logits[:, 1:] - (math.log(num_samples) + log_q)
    if remove_accidental_hits:
        neg = neg.masked_fill(hits, -math.inf)
    per_token = torch.logsumexp(torch.cat([pos.unsqueeze(1), neg], dim=1), dim=1) - pos
    return _reduce(per_token, valid, reduction)


def full_softmax_loss(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    *,
    bias: torch.Tensor | None = None,
    ignore_index: int = -100,
    reduction: str = "mean",
    logit_softcap: float | None = None,
    chunk_size: int | None = None,
) -> torch.Tensor:
    """Exact cross-entropy of ``hidden @ weight.T (+ bias)`` without materializing the (T, V) logits.

    Uses torch's chunked ``linear_cross_entropy`` where it exists (torch >= 2.13) and no softcap is
    asked for; otherwise a chunked fallback that recomputes each chunk's logits in backward.

    Args:
        hidden: (T, D); weight: (V, D); labels: (T,) int64 or ``ignore_index``; bias: optional (V,).
        chunk_size: tokens per chunk (default: about 2^24 logits a chunk, 64 to 1024 tokens).
    Returns:
        float32 scalar ("mean"/"sum") or (T,) ("none").
    """
    _validate(hidden, weight, labels, bias, ignore_index, reduction)
    labels = labels.long()  # cross_entropy (and the chunked path) need int64 targets; int32 ids are common
    if logit_softcap is None and hasattr(F, "linear_cross_entropy") and hasattr(torch.nn, "LinearCrossEntropyOptions"):
        # float32 inputs: torch reduces inside its chunked kernel ("sum": no per-token backward
        # pass, measured 2.0 s vs 3.4 s at T=2048, V=131k). Low precision: per-token losses summed here
        # in float32, since torch's bf16 running sum is off by ~10% after a few thousand tokens.
        fused_sum = reduction != "none" and hidden.dtype == torch.float32 and weight.dtype == torch.float32
        per_token = F.linear_cross_entropy(
            hidden,
            weight,
            labels,
            linear_bias=bias,
            reduction="sum" if fused_sum else "none",
            ignore_index=ignore_index,
            # An explicit chunk: on CPU the "auto" chunking of torch 2.13 ran 10-30x slower than
            # plain chunks (10.1 s vs 0.37 s for T=5100, V=33k, no grad).
            options=torch.nn.LinearCrossEntropyOptions(
                batch_chunk_size=_token_chunk(weight.shape[0], chunk_size), chunking_method=None
            ),
        ).float()
    else:
        per_token = _chunked_ce(hidden, weight, bias, labels, ignore_index, logit_softcap, chunk_size)
    if reduction == "none":
        return per_token
    total = per_token.sum()  # a no-op on the fused sum (0-dim)
    if reduction == "sum":
        return total
    return total / max(int((labels != ignore_index).sum()), 1)


def _token_chunk(num_classes: int, chunk_size: int | None) -> int:
    """Tokens per chunk: 512 (fastest measured at V=33k-131k) unless the chunk's logits pass 2^27
    floats (512 MiB), then fewer, down to 128 at V=1M."""
    return chunk_size or max(128, min(512, (1 << 27) // max(num_classes, 1)))


def _chunked_ce(hidden, weight, bias, labels, ignore_index, logit_softcap, chunk_size):
    """(T,) float32 per-token cross-entropy, chunk by chunk, each chunk's logits recomputed in backward."""
    chunk = _token_chunk(weight.shape[0], chunk_size)
    pieces = []
    for s in range(0, hidden.shape[0], chunk):
        pieces.append(
            torch.utils.checkpoint.checkpoint(
                _chunk_ce,
                hidden[s : s + chunk],
                weight,
                bias,
                labels[s : s + chunk],
                ignore_index,
                logit_softcap,
                use_reentrant=False,
            )
        )
    return torch.cat(pieces) if pieces else hidden.new_zeros(0, dtype=torch.float32)


def _chunk_ce(hidden, weight, bias, labels, ignore_index, cap):
    logits = F.linear(hidden, weight, bias).float()
    return F.cross_entropy(_softcap(logits, cap), labels, ignore_index=ignore_index, reduction="none")
