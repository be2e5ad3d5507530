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
the proposal's factors (:class:`hf_midx.samplers.factors.ProposalFactors`: Q(i | z_t) = sum_b probs[t, b] S[b, i] +
S[B, i], each class i in one bucket with its member weight, plus its static weight in row B): the weight's (B + 1, D)
bucket table S @ W, then one (T, B) x (B, D) product.

The table's layout. A bucket's row is a sum over its classes and the static row one over all V; summed as one bag
each, the static row would be a chain of V dependent loads on one thread (CUDA's ``embedding_bag`` walks a bag with
one thread per feature; the CPU's gives a bag to one core). So S is laid out at each refresh
(:class:`~hf_midx.samplers.factors.TableLayout`) as the drawn classes in bucket order, cut into chunks of at most
:data:`~hf_midx.samplers.factors.CHUNK` classes (B + V // CHUNK chunks, padded with empty ones: shapes fixed by
(V, B), no host sync, no data-dependent shape in a step): one ``embedding_bag`` gives every chunk's member- and
static-weighted sums (each chunk twice in a row, its rows read once from memory), a second adds each bucket's
chunk sums into its row, and a sum of the static partials gives row B; a static proposal's one row is a GEMV. The
exact head's classes (weight 0) are not read.

The weight's gradient is the table's gradient G (B + 1, D) spread back over the classes, each class v
member[v] G[bucket[v]] + static[v] G[B] (:func:`spread`, one ``embedding_bag`` of V bags of two rows). The eager
loss (:class:`hf_midx.losses.candidate_logits.CandidateLogits`) computes the table with the candidate logits and writes
the spread as the first term of its own (V, D) weight gradient, into which the candidates' pairs are then added: the
gradient written once, no second (V, D) tensor and no add of two (on the CPU a fresh one costs a pass in page
faults). The fused kernels (:mod:`hf_midx.losses.kernels`) read ``bucket``, ``member``, ``static`` and G the same way in
their weight gradient's pass; :func:`bucket_rows` (the table with a spread in its backward) serves a caller that
folds nothing. The tail's two (T x B x D) products (probs @ table, probs^T @ (c hidden)) run in the weight's dtype:
bfloat16 / float16 with float32 accumulation on tensor cores, float32 otherwise. No (tokens x vocab) tensor
anywhere.

The default (``tail_gradient="auto"``) takes it wherever it applies: per-query negatives, accidental hits kept, no
logit soft-cap, a proposal with a closed form (:meth:`hf_midx.Sampler.has_closed_form`).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def bucket_table(factors, rows: torch.Tensor) -> torch.Tensor:
    """S @ rows: the (B + 1, C) bucket table of (V, C) ``rows``, float32 (float64 for float64 rows), no gradient
    (:func:`bucket_rows` is the differentiable form).

    Summed in the rows' dtype (no float32 copy of a bfloat16 weight) in parallel pieces (see the module docstring):
    one ``embedding_bag`` of chunks of at most :data:`~hf_midx.samplers.factors.CHUNK` classes (each chunk's member-
    and static-weighted sums), one of the chunks' partials into their buckets' rows, one sum of the static
    partials into row B; a static proposal's one row is a GEMV. The classes the proposal never draws are not read
    (but by that GEMV)."""
    rows = rows.detach()
    acc = torch.float64 if rows.dtype == torch.float64 else torch.float32
    chunks, chunk_ids, chunk_offsets, _ = factors.layout
    if chunks is None:  # B = 0: S is the static row
        return torch.mv(rows.t(), factors.static.to(rows.dtype)).unsqueeze(0).to(acc)
    index, offsets, weights = chunks
    partials = F.embedding_bag(index, rows, offsets, mode="sum", per_sample_weights=weights.to(rows.dtype))
    # (B + 1, C): bucket b's chunks added into row b; row B sums the padding chunks (zeros) until the static row.
    table = F.embedding_bag(chunk_ids, partials, chunk_offsets, mode="sum")
    if factors.static is not None:  # the odd partials: each chunk's classes static-weighted
        torch.sum(partials[1::2], 0, out=table[-1])
    return table.to(acc)


def spread(factors, grad_table: torch.Tensor) -> torch.Tensor:
    """S^T @ grad_table, the transpose of :func:`bucket_table`: a new (V, C) tensor of ``grad_table``'s dtype for
    a (B + 1, C) ``grad_table``, each class member[v] * grad_table[bucket[v]] + static[v] * grad_table[B], in one
    pass (one ``embedding_bag`` of V bags of at most 2 rows: measured on the CPU faster than a gather and a
    multiply-add, which make two more passes over the (V, C) output)."""
    index, offsets, weights = factors.layout.columns
    return F.embedding_bag(index, grad_table, offsets, mode="sum", per_sample_weights=weights.to(grad_table.dtype))


def _mix(probs: torch.Tensor | None, table: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """(T or 1, C) E_Q[rows | z_t] in ``dtype`` from the (B + 1, C) table: probs @ its bucket rows, plus its static
    row (a bfloat16 or float16 product accumulates in float32, as torch's matmuls do)."""
    if probs is None:
        return table[-1:].to(dtype)
    return torch.addmm(table[-1].to(dtype), probs.to(dtype), table[: probs.shape[1]].to(dtype))


def _mix_t(probs: torch.Tensor | None, g: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The transpose of :func:`_mix`: the (B + 1, C) table's gradient in ``dtype`` (float32 or float64) for the
    (T, C) gradient g of its output, the product in g's dtype; each part written in place, no concatenation."""
    out = g.new_empty((1 if probs is None else probs.shape[1] + 1, g.shape[1]), dtype=dtype)
    torch.sum(g, 0, dtype=dtype, out=out[-1])
    if probs is not None and g.dtype == dtype:
        torch.mm(probs.t().to(dtype), g, out=out[:-1])
    elif probs is not None:  # a bfloat16 / float16 product (float32 accumulation), then widened
        out[:-1] = probs.t().to(g.dtype) @ g
    return out


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
    table = bucket_table(factors, weight)
    mean = _mix(factors.probs, table, table.dtype)
    out = (hidden.to(mean.dtype) * mean).sum(1)
    if bias is None:
        return out
    bias_table = bucket_table(factors, bias.unsqueeze(1))
    return out + _mix(factors.probs, bias_table, bias_table.dtype).squeeze(1)


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
        # The two (T x B x C) products in the weight's dtype (hidden is already in it): bfloat16 / float16 on tensor
        # cores, accumulated in float32; float32 or float64 in the table's.
        dt = hidden.dtype if hidden.dtype in (torch.bfloat16, torch.float16) else table.dtype
        # The (T, B) probabilities in that dtype once, for both products (each would cast them again).
        probs = None if probs is None else probs.to(dt)
        grad_hidden = grad_table = grad_bias = None
        if ctx.needs_input_grad[2]:
            grad_hidden = (c.to(dt) * _mix(probs, table, dt)).to(hidden.dtype)
        if ctx.needs_input_grad[3]:
            grad_table = _mix_t(probs, c.to(dt) * hidden.to(dt), table.dtype)
        if bias_table is not None and ctx.needs_input_grad[4]:
            grad_bias = _mix_t(probs, c.to(bias_table.dtype), bias_table.dtype)
        return grad, None, grad_hidden, grad_table, grad_bias, None


def expected_share(loss, share, factors, hidden, weight, bias=None, table=None) -> torch.Tensor:
    """``loss`` unchanged, with the gradient of sum_t share_t * E_Q[o_t] added: the expected part of the tail
    gradient, for a loss whose draws already give share_t / M back each (``tail_control`` of
    :func:`~hf_midx.losses.candidate_logits.sampled_softmax_terms` and of the fused kernels).

    Args:
        loss: (T,) float32 per-token losses, or the reduced scalar (then the share is the reduction's weight
            per token: (T,) float32 already divided by the count for a mean); share: (T,) float32, no gradient;
        factors: :class:`~hf_midx.samplers.factors.ProposalFactors` of the queries; hidden: (T, D); weight: (V, D);
        bias: (V,) or None (autograd flows to all three).
        table: the weight's (B + 1, D) bucket table where the caller made it, differentiable (the eager loss's, from
            :func:`~hf_midx.losses.candidate_logits.candidate_logits`); else :func:`bucket_rows` of ``weight`` here.
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
