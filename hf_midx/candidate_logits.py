"""The eager candidate logits of the sampled softmax: per-token rows and rows every token scores.

Shapes: T tokens, D hidden dims, V classes, R candidate rows per token, C common rows.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

# Bytes of one (chunk, R, D) gather of candidate embeddings in the forward: bounds its memory, and
# keeps the chunks few (16 at T = 8192, M = 100, D = 640 in bf16), since each costs kernel launches.
GATHER_BYTES = 64 << 20


class CandidateLogits(torch.autograd.Function):
    """o[t, r] = hidden[t] . weight[rows[t, r]] and s[t, c] = hidden[t] . weight[common[c]].

    ``rows`` (T, R) are per-token candidates (the label, its own negatives), ``common`` (C,) are rows
    every token scores (the exact head, a shared pool). Logits are float32. The (T, R, D) gather is
    never kept: the forward walks over token chunks (extra memory O(chunk R D + T C)), and the
    backward needs none of it. There, grad_hidden[t] = sum_r g[t, r] weight[rows[t, r]] is one
    ``embedding_bag`` (bags of R rows, weighted by g), and the weight gradient is the transposed
    bag: the (t, r) pairs sorted by class, so that grad_weight[v] = sum over v's pairs of g[t, r]
    hidden[t] is one ``embedding_bag`` over ``hidden`` with V bags. Both write every output row
    once: no (T R, D) products and no atomic adds, whose launches per chunk dominated a GPU step.
    """

    @staticmethod
    def forward(ctx, hidden, weight, rows, common, chunk):
        ctx.save_for_backward(hidden, weight, rows, common)
        out = torch.empty(rows.shape, device=hidden.device, dtype=torch.float32)
        for s in range(0, rows.shape[0], chunk):
            w = weight.index_select(0, rows[s : s + chunk].reshape(-1)).view(-1, rows.shape[1], weight.shape[1])
            out[s : s + chunk] = torch.bmm(w, hidden[s : s + chunk].unsqueeze(2)).squeeze(2).float()
        shared = (hidden @ weight[common].t()).float()  # (T, C): one GEMM
        return out, shared

    @staticmethod
    def backward(ctx, grad_out, grad_shared):
        hidden, weight, rows, common = ctx.saved_tensors
        need_h, need_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        grad_hidden = grad_weight = None
        g = grad_out.to(weight.dtype)  # (T, R)
        if need_h:
            grad_hidden = F.embedding_bag(rows, weight, per_sample_weights=g, mode="sum").to(hidden.dtype)
        if need_w:
            v, r = weight.shape[0], rows.shape[1]
            by_class, order = rows.reshape(-1).sort()
            # Bag v holds the pairs of class v: offsets from a search, so every shape is static (V,).
            offsets = torch.searchsorted(by_class, torch.arange(v, device=rows.device, dtype=by_class.dtype))
            grad_weight = F.embedding_bag(
                order.div(r, rounding_mode="floor"),  # the token of each pair
                hidden.to(weight.dtype),
                offsets,
                per_sample_weights=g.reshape(-1)[order],
                mode="sum",
            )
        if common.shape[0]:
            gs = grad_shared.to(weight.dtype)  # (T, C)
            if need_h:
                grad_hidden = grad_hidden + (gs @ weight[common]).to(hidden.dtype)
            if need_w:
                grad_weight.index_add_(0, common, gs.t() @ hidden.to(weight.dtype))
        return grad_hidden, grad_weight, None, None, None


def candidate_logits(
    hidden: torch.Tensor, weight: torch.Tensor, rows: torch.Tensor, common: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """(T, R) and (T, C) float32 logits of ``hidden`` (T, D) against ``weight`` (V, D) rows ``rows`` (T, R) int64
    and ``common`` (C,) int64, differentiable in ``hidden`` and ``weight`` (see :class:`CandidateLogits`)."""
    chunk = max(1, GATHER_BYTES // (rows.shape[1] * hidden.shape[1] * weight.element_size()))
    return CandidateLogits.apply(hidden, weight, rows, common, chunk)
