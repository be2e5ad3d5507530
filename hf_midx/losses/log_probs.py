"""Exact per-token log-probabilities and softmax statistics, with a sampled gradient.

RL and preference losses use log-probs as values (ratios, KL penalties, margins), so the forward must be exact; their
gradient need not be. With log Z exact from the forward, the gradient of log p_y = z_y - log Z is e_y - p, and
sum_j p_j grad z_j splits into the exact head's classes (scored exactly) and the tail, which the sampler's M draws
estimate as (1/M) sum_m (p_{j_m} / q_{j_m}) grad z_{j_m}: unbiased, since p is normalized exactly (no self-normalized
ratio). The same holds for the entropy's gradient, -p_j (log p_j + H). The backward costs O(T (H + M) D) instead of
the exact head's two (T, V, D) GEMMs, two thirds of its FLOPs.

The logits follow TRL's fused head, in its order of ops and rounding: z = soft_cap(scale * (h @ W^T + b), cap) / temperature,
the product (and the bias) in the autocast dtype under autocast, the rest in float32.

Shapes: T tokens, D hidden dims, V classes, H exact-head classes, M draws per token, C classes per tile.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from .._ops import soft_cap

#: Classes per tile of the exact forward: TRL's (the 32,768 its fused head passes to ``ChunkedLogProbFunction``), so that
#: each token's online log-sum-exp folds the same tiles in the same order and rounds as TRL's does.
CLASS_TILE = 32768
#: Tokens per tile: (2048, 32768) logits, 128 MiB in bfloat16 and each float32 temporary of the fold 256 MiB (TRL's
#: tile is 4,096 tokens; a token's values do not depend on which other tokens share its tile: a GEMM row's
#: reduction is its own). The backward's (n, 1 + M, D) tensors are per tile of as many tokens.
TOKEN_TILE = 2048


def logits_dtype(hidden: torch.Tensor) -> torch.dtype:
    """The dtype the logits are computed in: TRL's fused head's rule, the autocast dtype under autocast on the hidden
    states' device, else the hidden states' dtype."""
    device = hidden.device.type
    return torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else hidden.dtype


@dataclass(frozen=True)
class LogitTransform:
    """z = soft_cap(scale * raw, cap) * (1 / temperature), raw = h @ W^T + b, in TRL's fused head's order of ops."""

    temperature: float = 1.0
    scale: float = 1.0
    softcap: float | None = None

    def __call__(self, raw: torch.Tensor) -> torch.Tensor:
        """Transformed logits of float32 ``raw`` (any shape). TRL multiplies by 1 / temperature (it does not divide),
        so this does too: the two round differently in float32 (up to 8e-4 nats per token at temperature 0.7)."""
        return soft_cap(raw * self.scale, self.softcap) * (1 / self.temperature)

    def slope(self, raw: torch.Tensor) -> torch.Tensor:
        """dz / d raw, elementwise (float32, the shape of ``raw``)."""
        if self.softcap is None:
            return torch.full_like(raw, self.scale / self.temperature)
        t = torch.tanh(raw * self.scale / self.softcap)
        return (1 - t * t) * (self.scale / self.temperature)


@torch.no_grad()
def log_prob_statistics(hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, labels: torch.Tensor,
                        transform: LogitTransform, dtype: torch.dtype | None = None) -> dict[str, torch.Tensor]:
    """Exact softmax statistics of the transformed logits, tiled (no (T, V) tensor), without gradient.

    The values are TRL's fused head's (``trl.kernels.ChunkedLogProbFunction``), rounded as it rounds them: the logits
    tile is the product of ``hidden`` and ``weight`` cast to ``dtype`` (the autocast dtype under autocast:
    :func:`logits_dtype`), the bias added in that dtype, and only then float32 for the transform and the online
    log-sum-exp, folded over the same (C = :data:`CLASS_TILE`) class tiles in the same order. On a CPU the results
    are TRL's bit for bit, so a ratio of a policy's log-probs to TRL's old-policy ones is exactly 1 where the two
    models are one; on a GPU, where TRL folds each tile in a Triton kernel, they would differ by float32 summation
    order and make ~20 float32 passes per tile, so there the head takes TRL's function itself
    (:mod:`hf_midx.integration.trl_log_probs`) and this is the CPU's and the reference.

    The weight is cast one class tile at a time, once per call (the class tiles are the outer loop), and each tile
    costs a fixed number of launches: about 42 x ceil(V / C) x ceil(T / :data:`TOKEN_TILE`) per call (with a soft-cap;
    tests/losses/test_log_probs.py counts them).

    Args:
        hidden: (T, D) float; weight: (V, D); bias: (V,) or None; labels: (T,) int64 in [0, V) (ignored
            positions replaced by any class by the caller); dtype: of the products (default :func:`logits_dtype`).
    Returns:
        (T,) float32 each: ``log_z``, ``label_logit`` (z_y), ``entropy``, ``log_sum_sq_probs`` (log sum_v p_v^2),
        ``mean_logits`` (the mean z over V), and bool ``is_top1`` (the label is the first most likely class).
    """
    dtype = logits_dtype(hidden) if dtype is None else dtype
    vocab, device = weight.shape[0], hidden.device
    with torch.autocast(device.type, enabled=False):
        h_all = hidden.to(dtype)  # (T, D)
        # Each token tile's running statistics, updated in place tile by tile (TRL's fold, op for op).
        tiles = [_RunningStats(h_all[start:start + TOKEN_TILE], labels[start:start + TOKEN_TILE])
                 for start in range(0, h_all.shape[0], TOKEN_TILE)]
        for c in range(0, vocab, CLASS_TILE):
            w = weight[c:c + CLASS_TILE].to(dtype)  # (C, D): each weight row cast once per call
            b = None if bias is None else bias[c:c + CLASS_TILE].to(dtype)
            cols = torch.arange(w.shape[0], device=device)
            for tile in tiles:
                tile.fold(w, b, c, cols, transform)
        stats = {k: torch.cat([getattr(tile, k) for tile in tiles]) for k in _RunningStats.FIELDS}
        log_z = stats["peak"] + torch.log(stats["total"])
        z_label, total = stats["z_label"], stats["total"]
        return {
            "log_z": log_z, "label_logit": z_label, "entropy": log_z - stats["moment"] / total,
            "log_sum_sq_probs": torch.log(stats["square"]) - 2 * torch.log(total), "mean_logits": stats["z_sum"] / vocab,
            "is_top1": (z_label >= stats["peak"]) & (z_label > stats["peak_before_label"]),
        }


class _RunningStats:
    """One token tile's online log-sum-exp statistics over the class tiles folded so far: (n,) float32 each."""

    FIELDS = ("peak", "peak_before_label", "total", "moment", "square", "z_sum", "z_label")

    def __init__(self, hidden: torch.Tensor, labels: torch.Tensor) -> None:
        n, device = hidden.shape[0], hidden.device
        self.hidden, self.labels = hidden, labels
        self.peak = torch.full((n,), -math.inf, device=device)
        self.peak_before_label = torch.full((n,), -math.inf, device=device)
        self.total, self.moment, self.square, self.z_sum, self.z_label = (torch.zeros(n, device=device) for _ in range(5))

    def fold(self, w: torch.Tensor, b: torch.Tensor | None, start: int, cols: torch.Tensor,
             transform: LogitTransform) -> None:
        """Fold the classes ``start .. start + C`` (``w`` (C, D) and ``b`` (C,) in the products' dtype, ``cols``
        arange(C)) into the statistics, as TRL's ``_forward_tile`` does, op for op."""
        tile = self.hidden @ w.T  # (n, C) in the products' dtype, as TRL's torch.mm into its tile buffer
        if b is not None:
            tile += b
        z = transform(tile.float())
        local = self.labels - start
        self.z_sum += z.sum(-1)
        before = cols < local[:, None]
        torch.maximum(self.peak_before_label, z.masked_fill(~before, -math.inf).amax(-1), out=self.peak_before_label)
        new_peak = torch.maximum(self.peak, z.amax(-1))
        rescale = torch.exp(self.peak - new_peak)
        e = torch.exp(z - new_peak[:, None])
        self.total.mul_(rescale).add_(e.sum(-1))
        self.moment.mul_(rescale).add_((e * z).sum(-1))
        self.square.mul_(rescale * rescale).add_((e * e).sum(-1))
        self.peak = new_peak
        inside = (local >= 0) & (local < w.shape[0])
        label_z = z.gather(-1, local.clamp(0, w.shape[0] - 1)[:, None])[:, 0]
        self.z_label = torch.where(inside, label_z, self.z_label)


class SampledGradientLogProbs(torch.autograd.Function):
    """(log p_y, entropy) per token, values exact (from :func:`log_prob_statistics`), gradient estimated.

    forward(hidden (T, D), weight (V, D), bias (V,) or None, labels (T,) int64, valid (T,) bool, stats (the dict of
    :func:`log_prob_statistics`, or the same fields from another exact fold with its ``log_probs``), head_ids (H,) int64 or None, ids (T, M) int64 draws of the tail, log_q (T, M)
    float32, transform, dtype (of the products; default: hidden's)) -> (log_probs (T,), entropy (T,)), float32, 0 where
    not ``valid``.

    The backward multiplies in ``dtype`` (the forward's) with float32 coefficients and accumulators, by token tiles
    of :data:`TOKEN_TILE`: per tile one (n, 1 + M, D) gather of the label's and the draws' rows in ``dtype`` and one
    float32 (n, 1 + M, D) product for the weight gradient; the scores and the hidden states' gradient are batched
    matrix products (no (T, M, D) float32 temporary), the exact head's two GEMMs per tile.
    """

    @staticmethod
    def forward(ctx, hidden, weight, bias, labels, valid, stats, head_ids, ids, log_q, transform, dtype=None):
        log_z, entropy = stats["log_z"], stats["entropy"]
        ctx.save_for_backward(hidden, weight, bias, labels, valid, log_z, entropy, head_ids, ids, log_q)
        ctx.transform, ctx.dtype = transform, hidden.dtype if dtype is None else dtype
        zero = torch.zeros_like(log_z)
        log_probs = stats["log_probs"] if "log_probs" in stats else stats["label_logit"] - log_z  # given: as is
        return torch.where(valid, log_probs, zero), torch.where(valid, entropy, zero)

    @staticmethod
    def backward(ctx, g_log_probs, g_entropy):
        hidden, weight, bias, labels, valid, log_z, entropy, head_ids, ids, log_q = ctx.saved_tensors
        transform, dtype = ctx.transform, ctx.dtype
        with torch.autocast(hidden.device.type, enabled=False):
            grads = _estimated_gradients(hidden, weight, bias, labels, valid, log_z, entropy, head_ids, ids, log_q,
                                         transform, dtype, g_log_probs, g_entropy)
        return (*grads, None, None, None, None, None, None, None, None)


def _estimated_gradients(hidden, weight, bias, labels, valid, log_z, entropy, head_ids, ids, log_q, transform, dtype,
                         g_log_probs, g_entropy):
    """The backward of :class:`SampledGradientLogProbs`: (grad hidden, grad weight, grad bias or None)."""
    g_lp = torch.zeros_like(log_z) if g_log_probs is None else g_log_probs.float() * valid
    g_h = torch.zeros_like(log_z) if g_entropy is None else g_entropy.float() * valid
    grad_h = torch.zeros(hidden.shape, dtype=torch.float32, device=hidden.device)
    grad_w = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device)
    grad_b = None if bias is None else torch.zeros(bias.shape, dtype=torch.float32, device=bias.device)
    log_m = math.log(ids.shape[1])

    def p_terms(raw, log_weight, rows):
        # The coefficient of grad z_j for classes scored with weight w_j (1: exact head; 1 / (M q_j): a draw):
        # -w_j p_j (g_lp + g_h (log p_j + H)), times dz / d raw.
        log_p = transform(raw) - log_z[rows, None]
        pw = torch.exp(log_p + log_weight)
        return -pw * (g_lp[rows, None] + g_h[rows, None] * (log_p + entropy[rows, None])) * transform.slope(raw)

    has_head = head_ids is not None and head_ids.numel() > 0
    if has_head:
        w_head = weight[head_ids].to(dtype)  # (H, D)
        b_head = None if bias is None else bias[head_ids].to(dtype)
        grad_head = torch.zeros(w_head.shape, dtype=torch.float32, device=weight.device)
    for start in range(0, hidden.shape[0], TOKEN_TILE):
        rows = slice(start, start + TOKEN_TILE)
        h = hidden[rows].to(dtype)  # (n, D)
        # The label (its delta term, exact) and the tail's M draws, weighted 1 / (M q), in one batch.
        cls = torch.cat([labels[rows, None], ids[rows]], 1)  # (n, 1 + M)
        w = weight[cls].to(dtype)  # (n, 1 + M, D)
        scores = torch.bmm(w, h[:, :, None])[..., 0]  # (n, 1 + M) in dtype, as the forward's tile
        if bias is not None:
            scores = scores + bias[cls].to(dtype)
        raw = scores.float()
        coef = torch.cat([(g_lp[rows] * transform.slope(raw[:, 0]))[:, None],
                          p_terms(raw[:, 1:], -log_q[rows] - log_m, rows)], 1)  # (n, 1 + M) float32
        grad_h[rows] += torch.bmm(coef.to(dtype)[:, None], w)[:, 0].float()
        grad_w.index_add_(0, cls.reshape(-1), (coef[..., None] * h.float()[:, None]).reshape(-1, h.shape[1]))
        if grad_b is not None:
            grad_b.index_add_(0, cls.reshape(-1), coef.reshape(-1))
        if has_head:  # GEMMs over the (H, D) rows every token shares
            scores = h @ w_head.T if b_head is None else h @ w_head.T + b_head
            coef = p_terms(scores.float(), 0.0, rows)  # (n, H)
            grad_h[rows] += (coef.to(dtype) @ w_head).float()
            grad_head += (coef.T.to(dtype) @ h).float()  # bfloat16 operands under autocast, as nn.Linear's
            if grad_b is not None:
                grad_b.index_add_(0, head_ids, coef.sum(0))
    if has_head:
        grad_w.index_add_(0, head_ids, grad_head)
    grad_b = None if grad_b is None else grad_b.to(bias.dtype)
    return grad_h.to(hidden.dtype), grad_w.to(weight.dtype), grad_b


__all__ = ["CLASS_TILE", "LogitTransform", "SampledGradientLogProbs", "TOKEN_TILE", "log_prob_statistics", "logits_dtype"]
