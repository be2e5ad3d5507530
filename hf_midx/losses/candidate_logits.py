"""The eager sampled softmax: the candidate logits (per-token rows and rows every token scores) and the loss
from them, each one autograd Function whose backward is a few whole-tensor ops (the op count of a step is
what a GPU pays: about one kernel launch an op).

Shapes: T tokens, D hidden dims, V classes, R candidate rows per token, C common rows, H exact-head rows.
"""

from __future__ import annotations

import torch

from .tail_gradient import bucket_table, spread

# Bytes of one (chunk, R, D) gather of candidate embeddings in the forward: bounds its memory, and keeps the
# chunks few, since each costs kernel launches: one at the Gemma-3-270M shape (T = 8192, M = 20, D = 640:
# 440 MB in float32), 3 at D = 4096 in bf16.
GATHER_BYTES = 512 << 20


class CandidateLogits(torch.autograd.Function):
    """o[t, r] = hidden[t] . weight[rows[t, r]] and s[t, c] = hidden[t] . weight[common[c]].

    ``rows`` (T, R) are per-token candidates (the label, its own negatives), ``common`` (C,) are rows
    every token scores (the exact head, a shared pool). Logits are float32. The forward gathers the
    (T, R, D) candidate rows in token chunks of at most ``GATHER_BYTES`` (one chunk up to the Gemma-3-270M
    shape), and keeps them for the backward when they fit in one (else the backward gathers again):
    grad_hidden is one batched product with them, and grad_weight one ``index_add_`` of the (T R, D)
    products g[t, r] hidden[t] into a float32 (V, D) zero tensor (float64 for a float64 weight). Two ops
    a chunk each: fewer launches than sorting the pairs by class for ``embedding_bag`` (13 leaf ops,
    measured), at the cost of atomic adds on a GPU, where the fused kernels of :mod:`hf_midx.losses.kernels`
    run instead.

    With ``factors`` (a proposal's :class:`~hf_midx.samplers.factors.ProposalFactors`) it also returns the
    weight's (B + 1, D) bucket table (:func:`hf_midx.losses.tail_gradient.bucket_table`) for the expected tail gradient,
    whose gradient, spread over the classes, is written first into the (V, D) weight gradient instead of zeros.
    """

    @staticmethod
    def forward(ctx, hidden, weight, rows, common, chunk, factors=None):
        def gathered(part: slice) -> tuple[torch.Tensor, torch.Tensor]:  # (chunk, R, D) rows, (chunk, R) float32
            w = weight.index_select(0, rows[part].reshape(-1)).view(-1, rows.shape[1], weight.shape[1])
            return w, torch.bmm(w, hidden[part].unsqueeze(2)).squeeze(2).float()

        kept = None
        if chunk >= rows.shape[0]:  # one chunk: the backward reuses the gather (at most GATHER_BYTES)
            kept, out = gathered(slice(None))
        else:
            out = torch.empty(rows.shape, device=hidden.device, dtype=torch.float32)
            for s in range(0, rows.shape[0], chunk):
                out[s : s + chunk] = gathered(slice(s, s + chunk))[1]
        common_rows = weight[common]  # (C, D), kept for the backward
        ctx.save_for_backward(hidden, weight, rows, common, common_rows, kept)
        ctx.chunk, ctx.factors = chunk, factors
        shared = (hidden @ common_rows.t()).float()  # (T, C): one GEMM
        if factors is None:
            return out, shared
        table = bucket_table(factors, weight)
        if not ctx.needs_input_grad[1]:
            # A frozen weight: no gradient for the table, so the expected tail skips its (T x B x D) product too.
            ctx.mark_non_differentiable(table)
        return out, shared, table

    @staticmethod
    def backward(ctx, grad_out, grad_shared, grad_table=None):
        hidden, weight, rows, common, common_rows, kept = ctx.saved_tensors
        need_h, need_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        t, r, d = rows.shape[0], rows.shape[1], weight.shape[1]
        acc = torch.float64 if weight.dtype == torch.float64 else torch.float32  # it sums many pairs
        g = grad_out.to(weight.dtype)  # (T, R)
        h = hidden.to(weight.dtype)
        grad_hidden = torch.empty_like(hidden) if need_h and ctx.chunk < t else None
        grad_weight = None
        if need_w and grad_table is not None:  # the bucket table's gradient: every class's first term
            grad_weight = spread(ctx.factors, grad_table.to(acc))
        elif need_w:
            grad_weight = weight.new_zeros(weight.shape, dtype=acc)
        # One chunk (up to GATHER_BYTES) walks no range over T: a symbolic T under torch.compile stays symbolic.
        parts = [slice(None)] if ctx.chunk >= t else [slice(s, s + ctx.chunk) for s in range(0, t, ctx.chunk)]
        for part in parts:
            if need_h:  # grad_hidden[t] = sum_r g[t, r] weight[rows[t, r]]: the forward's gather, kept or again
                w = kept if kept is not None else weight.index_select(0, rows[part].reshape(-1)).view(-1, r, d)
                gh = torch.bmm(g[part].unsqueeze(1), w).squeeze(1).to(hidden.dtype)
                if grad_hidden is None:
                    grad_hidden = gh
                else:
                    grad_hidden[part] = gh
            if need_w:  # grad_weight[v] = sum over the pairs (t, r) of class v of g[t, r] hidden[t]
                # Into the kept gather, read for the last time above: no fresh (T, R, D) buffer (on the CPU its
                # page faults cost as much as the products). Autograd's version check refuses a second backward.
                into = kept if kept is not None and need_h else None
                pairs = torch.mul(g[part].unsqueeze(2), h[part].unsqueeze(1), out=into).reshape(-1, d)
                grad_weight.index_add_(0, rows[part].reshape(-1), pairs.to(acc))
        if common.shape[0]:
            gs = grad_shared.to(weight.dtype)  # (T, C)
            if need_h:
                grad_hidden = torch.addmm(grad_hidden, gs.to(hidden.dtype), common_rows.to(hidden.dtype))
            if need_w:
                grad_weight.index_add_(0, common, (gs.t() @ h).to(acc))
        if grad_weight is not None:
            grad_weight = grad_weight.to(weight.dtype)
        return grad_hidden, grad_weight, None, None, None, None


def candidate_logits(
    hidden: torch.Tensor, weight: torch.Tensor, rows: torch.Tensor, common: torch.Tensor, factors=None
) -> tuple[torch.Tensor, ...]:
    """(T, R) and (T, C) float32 logits of ``hidden`` (T, D) against ``weight`` (V, D) rows ``rows`` (T, R) int64
    and ``common`` (C,) int64, differentiable in ``hidden`` and ``weight`` (see :class:`CandidateLogits`); with a
    proposal's ``factors``, also the weight's (B + 1, D) float32 bucket table, differentiable."""
    chunk = max(1, GATHER_BYTES // (rows.shape[1] * hidden.shape[1] * weight.element_size()))
    return CandidateLogits.apply(hidden, weight, rows, common, chunk, factors)


class SampledSoftmaxTerms(torch.autograd.Function):
    """Per-token loss logsumexp([head, cand + adj]) - (cand[:, 0] + target_adj), 0 at ignored tokens.

    Its gradient is softmax(terms) minus 1 at the target (the label, always ``cand[:, 0]``), scaled by the
    upstream gradient: the forward keeps the exponentials, the backward is four products. With ``value_adj``
    the value returned is instead logsumexp([head, cand + value_adj]) - cand[:, 0] (the exact-loss estimate
    of :mod:`hf_midx.losses.loss`), with the same gradient: what is optimized does not change.
    """

    @staticmethod
    def forward(ctx, head, cand, adj, target_adj, value_adj, valid, tail_control):
        terms = cand + adj
        top = terms.amax(1)
        if head.shape[1]:
            top = torch.maximum(top, head.amax(1))
        top = top.unsqueeze(1)  # every exponential below 1: no overflow
        e = (terms - top).exp()
        total = e.sum(1)
        e_head = None
        if head.shape[1]:
            e_head = (head - top).exp()
            head_total = e_head.sum(1)
            total = total + head_total
        if value_adj is None:
            target = cand[:, 0] if target_adj is None else cand[:, 0] + target_adj
            out = total.log() + top.squeeze(1) - target
        else:
            # Terms within log(n q_y) <= log(M + 1) of the objective's, so exp(terms - top) stays small too.
            est = ((cand + value_adj) - top).exp().sum(1)
            out = (est if e_head is None else est + head_total).log() + top.squeeze(1) - cand[:, 0]
        scale = valid / total
        share = e[:, 1:].sum(1).mul_(scale) if tail_control else None  # the draws' share of the softmax
        ctx.save_for_backward(e, e_head, scale, valid, share)
        out = out.where(valid, 0.0)
        if share is None:
            return out, None
        ctx.mark_non_differentiable(share)
        return out, share

    @staticmethod
    def backward(ctx, grad, _grad_share):
        e, e_head, scale, valid, share = ctx.saved_tensors
        g = (grad * scale).unsqueeze(1)
        grad_cand = e * g
        grad_cand[:, 0].sub_(grad * valid)
        if share is not None:  # the expected tail gradient's sampled part: each draw gives share / M back
            grad_cand[:, 1:].sub_((grad * share).div_(e.shape[1] - 1).unsqueeze(1))
        return None if e_head is None else e_head * g, grad_cand, None, None, None, None, None


def sampled_softmax_terms(
    head: torch.Tensor,
    cand: torch.Tensor,
    adj: torch.Tensor,
    target_adj: torch.Tensor | None,
    value_adj: torch.Tensor | None,
    valid: torch.Tensor,
    tail_control: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(T,) float32 per-token sampled-softmax losses (see :class:`SampledSoftmaxTerms`), and with ``tail_control``
    the draws' share of each token's softmax (T,) float32 (0 at ignored tokens, no gradient), else None.

    Args:
        head: (T, H) float32 logits scored exactly (H may be 0); cand: (T, R) float32 candidate logits, the
            label's first; adj: (T, R) float32 their corrections (-log(n q), -inf for a dropped term).
        target_adj: (T,) float32 correction of the label's logit in the target, or None for none.
        value_adj: (T, R) float32 corrections of the value's terms, or None: the value is the objective.
        valid: (T,) bool, False at ignored tokens (loss and gradient 0).
        tail_control: each of the R - 1 draws gives share / (R - 1) of its gradient back, the sampled part of the
            expected tail gradient (:mod:`hf_midx.losses.tail_gradient`), whose expected part the caller adds.
    """
    return SampledSoftmaxTerms.apply(head, cand, adj, target_adj, value_adj, valid, tail_control)
