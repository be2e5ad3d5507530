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
the proposal's factors (:class:`hf_midx.samplers.factors.ProposalFactors`): for MIDX one (T, K*K) x (K*K, D) product
with the buckets' row sums and the static component's mean row; the weight's gradient is a gather of a (K*K, D)
table and a rank-one term, O(V D) like the weight gradient itself, with no (tokens x vocab) tensor.

Opt-in (``MidxConfig(tail_gradient="expected")``): it is what short runs from scratch need; in fine-tuning and in
longer runs the sampled gradient did as well or better, and these passes over the (V, D) weight cost a head-bound
step 44% more time (docs/performance.md, "Short runs").
"""

from __future__ import annotations

import torch


def _bucket_means(probs, bucket, member, static, rows):
    """(T or 1, C) float32 E_Q[rows[i] | z_t] from the factors, for (V, C) float32 rows."""
    mean = None
    if probs is not None:
        src = rows if member is None else rows * member.unsqueeze(1)
        mean = torch.mm(probs, rows.new_zeros(probs.shape[1], rows.shape[1]).index_add_(0, bucket, src))
    if static is not None:
        spread = torch.mm(static.unsqueeze(0), rows)  # (1, C)
        mean = spread if mean is None else mean.add_(spread)
    return mean


def _spread(probs, bucket, member, static, g):
    """(V, C) float32 sum_t Q(i | z_t) g[t] for every class i, for (T, C) float32 g: the transpose of the above."""
    out = None
    if probs is not None:
        table = torch.mm(probs.t(), g)  # (B, C): each bucket's share of the tokens
        out = torch.index_select(table, 0, bucket)
        out = out if member is None else out.mul_(member.unsqueeze(1))
    if static is not None:
        total = g.sum(0)
        out = torch.outer(static, total) if out is None else out.addr_(static, total)
    return out


@torch.no_grad()
def expected_logit(factors, hidden, weight, bias=None) -> torch.Tensor:
    """E_Q[o_t] = z_t . E_Q[w] + E_Q[b] per token under a proposal given by its factors (its value only;
    :func:`expected_share` gives its gradient).

    Args:
        factors: :class:`~hf_midx.samplers.factors.ProposalFactors` of the (T, D) queries (the sampler's
            :meth:`~hf_midx.Sampler.proposal_factors`); hidden: (T, D); weight: (V, D); bias: (V,) or None.
    Returns:
        (T,) float32, with no (T, V) tensor made.
    """
    out = (hidden.float() * _bucket_means(*factors, weight.float())).sum(1)
    return out if bias is None else out + _bucket_means(*factors, bias.float().unsqueeze(1)).squeeze(1)


class _ExpectedShare(torch.autograd.Function):
    """The loss as it is, plus the gradient of share_t * E_Q[o_t] (all of it in the backward: no op in the forward)."""

    @staticmethod
    def forward(ctx, loss, share, hidden, weight, bias, probs, bucket, member, static):
        ctx.save_for_backward(share, hidden, weight, bias, probs, bucket, member, static)
        return loss.view_as(loss)

    @staticmethod
    def backward(ctx, grad):
        share, hidden, weight, bias, probs, bucket, member, static = ctx.saved_tensors
        factors = (probs, bucket, member, static)
        # Each token's coefficient: the upstream gradient of its loss (or the reduction's, broadcast) times its share.
        c = (grad * share).float().unsqueeze(1)  # (T, 1)
        grad_hidden = grad_weight = grad_bias = None
        if ctx.needs_input_grad[2]:
            grad_hidden = (c * _bucket_means(*factors, weight.float())).to(hidden.dtype)
        if ctx.needs_input_grad[3]:
            grad_weight = _spread(*factors, c * hidden.float()).to(weight.dtype)
        if bias is not None and ctx.needs_input_grad[4]:
            grad_bias = _spread(*factors, c).squeeze(1).to(bias.dtype)
        return grad, None, grad_hidden, grad_weight, grad_bias, None, None, None, None


def expected_share(loss, share, factors, hidden, weight, bias=None) -> torch.Tensor:
    """``loss`` unchanged, with the gradient of sum_t share_t * E_Q[o_t] added: the expected part of the tail
    gradient, for a loss whose draws already give share_t / M back each (``tail_control`` of
    :func:`~hf_midx.candidate_logits.sampled_softmax_terms` and of the fused kernels).

    Args:
        loss: (T,) float32 per-token losses, or the reduced scalar (then the share is the reduction's weight
            per token: (T,) float32 already divided by the count for a mean); share: (T,) float32, no gradient;
        factors: :class:`~hf_midx.samplers.factors.ProposalFactors` of the queries; hidden: (T, D); weight: (V, D);
        bias: (V,) or None (autograd flows to all three).
    """
    return _ExpectedShare.apply(loss, share, hidden, weight, bias, *factors)


__all__ = ["expected_logit", "expected_share"]
