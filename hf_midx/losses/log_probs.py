"""Exact per-token log-probabilities and softmax statistics, with a sampled gradient.

RL and preference losses use log-probs as values (ratios, KL penalties, margins), so the forward must be exact; their
gradient need not be. With log Z exact from the forward, the gradient of log p_y = z_y - log Z is e_y - p, and
sum_j p_j grad z_j splits into the exact head's classes (scored exactly) and the tail, which the sampler's M draws
estimate as (1/M) sum_m (p_{j_m} / q_{j_m}) grad z_{j_m}: unbiased, since p is normalized exactly (no self-normalized
ratio). The same holds for the entropy's gradient, -p_j (log p_j + H). The backward costs O(T (H + M) D) instead of
the exact head's two (T, V, D) GEMMs, two thirds of its FLOPs.

The logits follow TRL's fused head: z = soft_cap(scale * (h @ W^T + b), cap) / temperature.

Shapes: T tokens, D hidden dims, V classes, H exact-head classes, M draws per token, C classes per tile.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from .._ops import soft_cap

#: Classes and tokens per tile of the exact forward: (1024, 8192) float32 logits, 32 MiB.
CLASS_TILE, TOKEN_TILE = 8192, 1024


@dataclass(frozen=True)
class LogitTransform:
    """z = soft_cap(scale * (h @ W^T + b), cap) / temperature, as TRL's fused head computes it."""

    temperature: float = 1.0
    scale: float = 1.0
    softcap: float | None = None

    def __call__(self, raw: torch.Tensor) -> torch.Tensor:
        """Transformed logits of float32 ``raw`` (any shape)."""
        return soft_cap(raw * self.scale, self.softcap) / self.temperature

    def slope(self, raw: torch.Tensor) -> torch.Tensor:
        """dz / d raw, elementwise (float32, the shape of ``raw``)."""
        if self.softcap is None:
            return torch.full_like(raw, self.scale / self.temperature)
        t = torch.tanh(raw * self.scale / self.softcap)
        return (1 - t * t) * (self.scale / self.temperature)


@torch.no_grad()
def log_prob_statistics(hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, labels: torch.Tensor,
                        transform: LogitTransform) -> dict[str, torch.Tensor]:
    """Exact softmax statistics of the transformed logits, tiled (no (T, V) tensor), without gradient.

    Args:
        hidden: (T, D) float; weight: (V, D); bias: (V,) or None; labels: (T,) int64 in [0, V) (ignored
            positions replaced by any class by the caller).
    Returns:
        (T,) float32 each: ``log_z``, ``label_logit`` (z_y), ``entropy``, ``log_sum_sq_probs`` (log sum_v p_v^2),
        ``mean_logits`` (the mean z over V), and bool ``is_top1`` (the label is the first most likely class).
    """
    t, vocab = hidden.shape[0], weight.shape[0]
    names = ("log_z", "label_logit", "entropy", "log_sum_sq_probs", "mean_logits")
    stats = {name: torch.zeros(t, device=hidden.device) for name in names}
    stats["is_top1"] = torch.zeros(t, dtype=torch.bool, device=hidden.device)
    for start in range(0, t, TOKEN_TILE):
        h, y = hidden[start:start + TOKEN_TILE].float(), labels[start:start + TOKEN_TILE]
        n = h.shape[0]
        peak = torch.full((n,), -math.inf, device=h.device)
        peak_before_label = torch.full((n,), -math.inf, device=h.device)
        total, moment, square, z_sum, z_label = (torch.zeros(n, device=h.device) for _ in range(5))
        for c in range(0, vocab, CLASS_TILE):
            raw = h @ weight[c:c + CLASS_TILE].float().T  # (n, C)
            if bias is not None:
                raw += bias[c:c + CLASS_TILE].float()
            z = transform(raw)
            cols = torch.arange(c, c + z.shape[1], device=h.device)
            new_peak = torch.maximum(peak, z.amax(1))
            rescale = torch.exp(peak - new_peak)
            e = torch.exp(z - new_peak[:, None])
            total = total * rescale + e.sum(1)
            moment = moment * rescale + (e * z).sum(1)
            square = square * rescale * rescale + (e * e).sum(1)
            z_sum += z.sum(1)
            before = cols[None] < y[:, None]
            peak_before_label = torch.maximum(peak_before_label, z.masked_fill(~before, -math.inf).amax(1))
            inside = (y >= c) & (y < c + z.shape[1])
            z_label = torch.where(inside, z.gather(1, (y - c).clamp(0, z.shape[1] - 1)[:, None])[:, 0], z_label)
            peak = new_peak
        log_z = peak + torch.log(total)
        rows = slice(start, start + n)
        stats["log_z"][rows], stats["label_logit"][rows] = log_z, z_label
        stats["entropy"][rows] = log_z - moment / total
        stats["log_sum_sq_probs"][rows] = torch.log(square) - 2 * torch.log(total)
        stats["mean_logits"][rows] = z_sum / vocab
        stats["is_top1"][rows] = (z_label >= peak) & (z_label > peak_before_label)
    return stats


class SampledGradientLogProbs(torch.autograd.Function):
    """(log p_y, entropy) per token, values exact (from :func:`log_prob_statistics`), gradient estimated.

    forward(hidden (T, D), weight (V, D), bias (V,) or None, labels (T,) int64, valid (T,) bool, stats (the dict of
    :func:`log_prob_statistics`), head_ids (H,) int64 or None, ids (T, M) int64 draws of the tail, log_q (T, M)
    float32, transform) -> (log_probs (T,), entropy (T,)), float32, 0 where not ``valid``.
    """

    @staticmethod
    def forward(ctx, hidden, weight, bias, labels, valid, stats, head_ids, ids, log_q, transform):
        log_z, entropy = stats["log_z"], stats["entropy"]
        ctx.save_for_backward(hidden, weight, bias, labels, valid, log_z, entropy, head_ids, ids, log_q)
        ctx.transform = transform
        zero = torch.zeros_like(log_z)
        return torch.where(valid, stats["label_logit"] - log_z, zero), torch.where(valid, entropy, zero)

    @staticmethod
    def backward(ctx, g_log_probs, g_entropy):
        hidden, weight, bias, labels, valid, log_z, entropy, head_ids, ids, log_q = ctx.saved_tensors
        transform = ctx.transform
        g_lp = torch.zeros_like(log_z) if g_log_probs is None else g_log_probs.float() * valid
        g_h = torch.zeros_like(log_z) if g_entropy is None else g_entropy.float() * valid
        h = hidden.float()
        grad_h = torch.zeros_like(h)
        grad_w = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device)
        grad_b = None if bias is None else torch.zeros(bias.shape, dtype=torch.float32, device=bias.device)

        def p_terms(raw, log_weight):
            # The coefficient of grad z_j for classes scored with weight w_j (1: exact head; 1 / (M q_j): a draw):
            # -w_j p_j (g_lp + g_h (log p_j + H)), times dz / d raw.
            log_p = transform(raw) - log_z[:, None]
            pw = torch.exp(log_p + log_weight)
            return -pw * (g_lp[:, None] + g_h[:, None] * (log_p + entropy[:, None])) * transform.slope(raw)

        def gathered(cls, grad_raw, w):  # classes per token: (T, K) ids, (T, K) grads, (T, K, D) rows
            grad_h.add_((grad_raw[..., None] * w).sum(1))
            grad_w.index_add_(0, cls.reshape(-1), (grad_raw[..., None] * h[:, None]).reshape(-1, h.shape[1]))
            if grad_b is not None:
                grad_b.index_add_(0, cls.reshape(-1), grad_raw.reshape(-1))

        def raw_of(cls, w):
            raw = (h[:, None] * w).sum(-1)
            return raw if bias is None else raw + bias[cls].float()

        # The label's delta term, exact.
        w_label = weight[labels].float()[:, None]  # (T, 1, D)
        gathered(labels[:, None], g_lp[:, None] * transform.slope(raw_of(labels[:, None], w_label)), w_label)
        # The exact head: GEMMs over its (H, D) rows, shared by every token.
        if head_ids is not None and head_ids.numel():
            w_head = weight[head_ids].float()
            raw = h @ w_head.T + (0 if bias is None else bias[head_ids].float())
            grad_raw = p_terms(raw, 0.0)  # (T, H)
            grad_h.add_(grad_raw @ w_head)
            grad_w.index_add_(0, head_ids, grad_raw.T @ h)
            if grad_b is not None:
                grad_b.index_add_(0, head_ids, grad_raw.sum(0))
        # The tail: each token's M draws, weighted 1 / (M q).
        w_draw = weight[ids].float()  # (T, M, D)
        gathered(ids, p_terms(raw_of(ids, w_draw), -log_q - math.log(ids.shape[1])), w_draw)
        grad_b = None if grad_b is None else grad_b.to(bias.dtype)
        return grad_h.to(hidden.dtype), grad_w.to(weight.dtype), grad_b, None, None, None, None, None, None, None


__all__ = ["CLASS_TILE", "LogitTransform", "SampledGradientLogProbs", "TOKEN_TILE", "log_prob_statistics"]
