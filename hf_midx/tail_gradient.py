"""The expected tail gradient: every tail class moves at every step, by its expected share under the proposal.

The sampled softmax's gradient puts weight pi_m = exp(neg_m - log Z) on each of a token's M draws and nothing on
the other tail classes. In expectation over the draws that mass c = sum_m pi_m is spread over every tail class i
by Q(i | z); a draw alone carries it in a few large, rare steps. Under Adam, whose step is the gradient over its
running RMS, a row drawn at a rate r per step then moves about sqrt(r) as far as a row that gets its expected
gradient every step: at V = 151,936 with M = 20 that is most of the vocabulary moving at a fraction of the full
softmax's pace, and a short run lags it (a quarter higher perplexity at 100 steps).

The control variate here keeps the estimator unbiased and gives each tail class its expectation: the gradient of
``c * (E_Q[s] - mean_m s_m)`` (c detached, s the raw logits) adds c Q(i | z) to every tail class and takes c / M
from each draw, zero in expectation, so the tail's gradient becomes its expectation under Q plus the draws'
deviation from it (which vanishes when Q is the softmax). E_Q[s] = z . E_Q[w] + E_Q[b] comes in closed form from
the proposal's factors (:class:`hf_midx.samplers.factors.ProposalFactors`): the weight's bucket table, each
bucket's (member-weighted) row sum and the static component's mean row, (B + 1, D) from one ``embedding_bag``
over the weight, then one (T, B) x (B, D) product. The weight's gradient is the table's gradient spread back over
the classes, one ``embedding_bag`` too (each class reads its bucket's row and the static one). The eager loss
(:class:`hf_midx.candidate_logits.CandidateLogits`) computes the table with the candidate logits and writes the
spread as the first term of its own (V, D) weight gradient: two light passes over the weight and no second (V, D)
buffer (on the CPU a fresh one costs a pass in page faults); no (tokens x vocab) tensor anywhere.

The default (``tail_gradient="auto"``) takes it wherever it applies: per-query negatives, accidental hits kept, no
logit soft-cap, a proposal with a closed form (:meth:`hf_midx.Sampler.has_closed_form`).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def bucket_table(factors, rows: torch.Tensor) -> torch.Tensor:
    """S @ rows: the (B + 1, C) bucket table of (V, C) ``rows`` (``factors.rows``), float32 (float64 for float64
    rows), summed in the rows' dtype (no float32 copy of a bfloat16 weight: a table of 3 significant digits
    there). No gradient (:func:`bucket_rows` is the differentiable form)."""
    index, offsets, weights = factors.rows
    table = F.embedding_bag(index, rows.detach(), offsets, mode="sum", per_sample_weights=weights.to(rows.dtype))
    return table.to(torch.float64 if rows.dtype == torch.float64 else torch.float32)


def spread(factors, grad_table: torch.Tensor) -> torch.Tensor:
    """S^T @ grad_table, the transpose of :func:`bucket_table`: a new (V, C) tensor of ``grad_table``'s dtype for
    a (B + 1, C) ``grad_table``, in one pass (each class reads its bucket's row and the static one)."""
    index, offsets, weights = factors.columns
    return F.embedding_bag(index, grad_table, offsets, mode="sum", per_sample_weights=weights.to(grad_table.dtype))


def _mix(probs: torch.Tensor | None, table: torch.Tensor) -> torch.Tensor:
    """(T or 1, C) E_Q[rows | z_t] from the (B + 1, C) table: probs @ its bucket rows, plus its static row."""
    if probs is None:
        return table[-1:]
    return torch.addmm(table[-1], probs.to(table.dtype), table[: probs.shape[1]])


def _mix_t(probs: torch.Tensor | None, g: torch.Tensor) -> torch.Tensor:
    """The transpose of :func:`_mix`: the (B + 1, C) table's gradient for the (T, C) gradient g of its output."""
    total = g.sum(0, keepdim=True)
    return total if probs is None else torch.cat([probs.to(g.dtype).t() @ g, total])


class _BucketRows(torch.autograd.Function):
    """:func:`bucket_table` with its gradient, :func:`spread` (a new (V, C) tensor of the rows' dtype)."""

    @staticmethod
    def forward(ctx, rows, factors):
        ctx.factors, ctx.dtype = factors, rows.dtype
        return bucket_table(factors, rows)

    @staticmethod
    def backward(ctx, grad):
        return spread(ctx.factors, grad.to(ctx.dtype)), None


def bucket_rows(factors, rows: torch.Tensor) -> torch.Tensor:
    """(B + 1, C) differentiable :func:`bucket_table` of (V, C) ``rows``: a new (V, C) gradient in the backward (the
    fused kernels' path; the eager loss folds it into its own weight gradient instead)."""
    return _BucketRows.apply(rows, factors)


@torch.no_grad()
def expected_logit(factors, hidden, weight, bias=None) -> torch.Tensor:
    """E_Q[o_t] = z_t . E_Q[w] + E_Q[b] per token under a proposal given by its factors (its value only;
    :func:`expected_share` gives its gradient).

    Args:
        factors: :class:`~hf_midx.samplers.factors.ProposalFactors` of the (T, D) queries (the sampler's
            :meth:`~hf_midx.Sampler.proposal_factors`); hidden: (T, D); weight: (V, D); bias: (V,) or None.
    Returns:
        (T,) float32 (float64 for a float64 weight), with no (T, V) tensor made.
    """
    mean = _mix(factors.probs, bucket_table(factors, weight))
    out = (hidden.to(mean.dtype) * mean).sum(1)
    return out if bias is None else out + _mix(factors.probs, bucket_table(factors, bias.unsqueeze(1))).squeeze(1)


class _ExpectedShare(torch.autograd.Function):
    """The loss as it is, plus the gradient of share_t * E_Q[o_t] (all of it in the backward: no op in the forward),
    through the bucket tables of the weight and the bias."""

    @staticmethod
    def forward(ctx, loss, share, hidden, table, bias_table, probs):
        ctx.save_for_backward(share, hidden, table, bias_table, probs)
        return loss.view_as(loss)

    @staticmethod
    def backward(ctx, grad):
        share, hidden, table, bias_table, probs = ctx.saved_tensors
        # Each token's coefficient: the upstream gradient of its loss (or the reduction's, broadcast) times its share.
        c = (grad * share).to(table.dtype).unsqueeze(1)  # (T, 1)
        grad_hidden = grad_table = grad_bias = None
        if ctx.needs_input_grad[2]:
            grad_hidden = (c * _mix(probs, table)).to(hidden.dtype)
        if ctx.needs_input_grad[3]:
            grad_table = _mix_t(probs, c * hidden.to(table.dtype))
        if bias_table is not None and ctx.needs_input_grad[4]:
            grad_bias = _mix_t(probs, c).to(bias_table.dtype)
        return grad, None, grad_hidden, grad_table, grad_bias, None


def expected_share(loss, share, factors, hidden, weight, bias=None, table=None) -> torch.Tensor:
    """``loss`` unchanged, with the gradient of sum_t share_t * E_Q[o_t] added: the expected part of the tail
    gradient, for a loss whose draws already give share_t / M back each (``tail_control`` of
    :func:`~hf_midx.candidate_logits.sampled_softmax_terms` and of the fused kernels).

    Args:
        loss: (T,) float32 per-token losses, or the reduced scalar (then the share is the reduction's weight
            per token: (T,) float32 already divided by the count for a mean); share: (T,) float32, no gradient;
        factors: :class:`~hf_midx.samplers.factors.ProposalFactors` of the queries; hidden: (T, D); weight: (V, D);
        bias: (V,) or None (autograd flows to all three).
        table: the weight's (B + 1, D) bucket table where the caller made it, differentiable (the eager loss's, from
            :func:`~hf_midx.candidate_logits.candidate_logits`); else :func:`bucket_rows` of ``weight`` here.
    """
    table = bucket_rows(factors, weight) if table is None else table
    bias_table = None if bias is None else bucket_rows(factors, bias.unsqueeze(1))
    return _ExpectedShare.apply(loss, share, hidden, table, bias_table, factors.probs)


def asks_closed_form(tail_gradient: str, negatives: str, drops: bool, logit_softcap) -> bool:
    """Whether a loss asks its sampler for the closed form (:class:`~hf_midx.samplers.factors.ProposalFactors`),
    for the expected tail gradient: "auto" where it applies; a ValueError for "expected" where it cannot (the loss
    would quietly keep the sampled one)."""
    applies = negatives == "per-query" and not drops and logit_softcap is None
    if tail_gradient == "expected" and not applies:
        raise ValueError(
            "tail_gradient='expected' needs per-query negatives, the accidental hits kept and no logit soft-cap; got "
            f"negatives={negatives!r}, drops hits: {drops}, logit_softcap={logit_softcap}. Use 'auto' or 'sampled'."
        )
    return tail_gradient != "sampled" and applies


def check_closed_form(factors, tail_gradient: str, sampler) -> None:
    """A ValueError when "expected" was asked of a sampler without a closed form ("auto" then keeps the sampled
    tail gradient)."""
    if factors is None and tail_gradient == "expected":
        raise ValueError(
            f"tail_gradient='expected' needs a sampler with a closed form (MIDX, unigram, uniform, log-uniform); "
            f"{type(sampler).__name__} has none. Use 'auto' or 'sampled'."
        )


__all__ = ["asks_closed_form", "bucket_rows", "check_closed_form", "bucket_table", "expected_logit", "expected_share", "spread"]
