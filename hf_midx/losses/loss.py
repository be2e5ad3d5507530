"""Sampled-softmax loss with proposal correction (the exact full-softmax reference: :mod:`hf_midx.losses.full`).

Shapes: T tokens, D hidden dims, V classes, M negatives per token (per-query mode) or P negatives in
one pool (shared mode), H classes scored exactly for every token (``exact_ids``).

For token t with label y, negatives j ~ Q(. | z_t) over the classes outside H, and n candidates:

    exact-positive:      loss_t = -o_y + log( sum_{i in H} e^o_i + [y not in H] e^o_y + sum_j e^(o_j - log(n q_j)) )
    corrected-positive:  the positive, when it is not in H, is one more candidate: o_y - log(n q_y) replaces
                         o_y in both places and n = M + 1 (Jean et al. 2015; TensorFlow's sampled_softmax_loss)

With H empty the first form is the paper's estimator (the sum estimates the partition function
without bias, the positive exact); the second is invariant to n and to the normalization of Q.

Accidental hits (a negative equal to the label) are dropped from the first form's sum and kept in the
second, a self-normalized importance-sampling estimate of Z in which a draw of the label is an ordinary
term: dropping it biases Z low by about the label's share of Q (trained to convergence without an exact
head at V = 2,000, MIDX ended 6.1% above the full softmax with the hits dropped, 0.5% with them kept).
With H the n-scaled tail estimate adds to the exact head mass, so the proposal only estimates the tail's
share of Z. No path builds a (T, V) tensor or reads back to the host: ignored tokens are masked.
With ``tail_gradient="expected"`` the draws' share of the gradient is also spread over every tail class
by its expectation under Q (:mod:`hf_midx.losses.tail_gradient`), which leaves value and mean alone.

The value and the gradient. The gradient of :func:`sampled_softmax_loss` is always the estimator's above.
Its value, by default (``exact_value=True``), is instead an estimate of the exact cross-entropy from the
same logits: the partition function Z estimated without bias,

    value_t = -o_y + log( sum_{i in H} e^o_i + [y not in H] e^o_y + sum_{j != y} e^(o_j - log(M q_j)) )

(M draws, accidental hits dropped), returned as ``objective + (value - objective).detach()``. So a logged
loss reads like the full softmax's (the corrected-positive objective itself sits well below it, since its
positive is one more candidate), comparable line by line with a full-softmax run; what is optimized does
not change by a bit. With "exact-positive" and the hits dropped, the two are the same number.

Two implementations compute the per-query loss from the draws: the eager PyTorch code below (the
reference and the CPU path) and the fused Triton kernels of :mod:`hf_midx.losses.kernels` (``kernels="fused"``,
or "auto" on CUDA, as ``MidxConfig`` has it), which take the very same draws, so that both give one loss
within float rounding. Shared negatives always run eager.
"""

from __future__ import annotations

import math

import torch

from .. import defaults
from .._checks import check_ids, check_positive_int
from .._ops import soft_cap
from .candidate_logits import candidate_logits, sampled_softmax_terms
from ..defaults import ESTIMATORS, KERNEL_MODES, NEGATIVE_MODES  # noqa: F401 (the label's logit; the negatives)
from .log_z_terms import add_log_z_terms, check_log_z_terms
from .precision import autocast_products, check_product_dtype, weight_for_products
from .full import assert_labels_in_range, check_loss_inputs, reduce_tokens
from .tail_gradient import asks_closed_form, check_closed_form, expected_share

def drops_accidental_hits(remove_accidental_hits: bool | None, estimator: str) -> bool:
    """Whether the loss drops a negative equal to the label: the setting, or for None the estimator's
    unbiased choice (True for "exact-positive", False for "corrected-positive"; see the module docstring)."""
    return estimator == "exact-positive" if remove_accidental_hits is None else remove_accidental_hits


@autocast_products
def sampled_softmax_loss(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    sampler,
    num_samples: int,
    *,
    bias: torch.Tensor | None = None,
    negatives: str = defaults.NEGATIVES,
    ignore_index: int = -100,
    remove_accidental_hits: bool | None = None,
    reduction: str = "mean",
    logit_softcap: float | None = None,
    generator: torch.Generator | None = None,
    estimator: str = defaults.ESTIMATOR,
    exact_ids: torch.Tensor | None = None,
    check_labels: bool = True,
    exact_value: bool = True,
    tail_gradient: str = defaults.TAIL_GRADIENT,
    kernels: str = "eager",
    z_loss: float = 0.0,
    label_smoothing: float = 0.0,
    return_z_loss: bool = False,
    product_dtype: torch.dtype | None = None,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Sampled-softmax cross-entropy corrected by the proposal (an estimator of the full loss).

    Args:
        hidden: (T, D) final hidden states z_t (any float dtype; autograd flows to it). Under autocast, hidden and
            weight multiply in the autocast dtype, as ``nn.Linear`` does (:mod:`hf_midx.losses.precision`).
        weight: (V, D) class embeddings / LM head weight (autograd flows to the rows touched).
        labels: (T,) int64 (or int32) in [0, V), or ``ignore_index``.
        sampler: the proposal, a :class:`hf_midx.Sampler` (see :func:`hf_midx.build_sampler`), of which the
            loss calls the hot path only (``draw``, ``draw_scored``, ``draw_shared``, ``draw_shared_scored``,
            ``num_classes``, ``excluded``), so it imports no sampler module; queried with ``hidden``
            detached, for every token (ignored ones too: masking instead of compaction keeps shapes static).
        num_samples: M negatives per token ("per-query") or the pool size P ("shared").
        bias: optional (V,) output bias.
        negatives: "per-query" (each token its own M draws from Q(. | z_t), the paper) or "shared"
            (one pool of P draws from the mixture qbar of the non-ignored tokens' proposals, scored
            by every token in one matmul; corrected by log(P * qbar)).
        ignore_index: label value that contributes nothing.
        remove_accidental_hits: drop a negative equal to the token's label from the sum. None (the
            default): :func:`drops_accidental_hits` of the estimator (dropped with "exact-positive",
            kept with "corrected-positive"; see the module docstring).
        reduction: "mean" over non-ignored tokens, "sum", or "none" ((T,), zeros at ignored tokens).
        logit_softcap: if set, logits become ``cap * tanh(o / cap)`` (Gemma-2) before correction.
        generator: optional RNG for the draws; defaults to the sampler's own.
        estimator: "corrected-positive" (the default, as ``MidxConfig``'s: a label outside ``exact_ids``
            is one more candidate, corrected by its own log q) or "exact-positive" (the label's logit
            enters as is, the paper); see the module docstring.
        exact_ids: optional (H,) int64 class ids scored exactly for every token (one (T, H) matmul);
            they must be the classes the sampler never draws (build it with ``exclude=exact_ids``;
            ``sampler.excluded`` is the sorted set), else ValueError. None (the default)
            scores no class exactly: choosing the H most frequent classes needs class counts, which
            this function does not see. ``MidxConfig().exact_head`` (2,048) is the head that
            ``MidxLMHead`` builds from ``class_counts``; build the sampler with ``exclude=`` those ids.
        check_labels: range-check the labels with a ValueError, which reads them on the host (one
            device sync). With False a device-side assertion checks them instead (the training path);
            under ``torch.compile`` the device-side assertion is used either way, so that a compiled
            loss has no graph break.
        exact_value: return as the value an estimate of the exact cross-entropy (the default), with the
            gradient of the sampled objective; False returns the objective itself (see the module docstring).
        tail_gradient: "expected": every tail class gets its expected gradient under the proposal plus the
            draws' deviation from it (:mod:`hf_midx.losses.tail_gradient`: same value, unbiased; per-query negatives,
            MIDX/unigram/uniform proposals, no soft-cap, hits kept); "sampled": only the drawn classes; "auto"
            (default): "expected" where it applies, else "sampled".
        kernels: how the loss is computed from the draws. "eager" (the default here): plain PyTorch, the
            reference. "fused": per-query negatives through :func:`hf_midx.losses.kernels.candidate_loss`'s Triton
            kernels, on the same draws (CUDA tensors, or the CPU under ``TRITON_INTERPRET=1``; ValueError
            where they cannot run, before anything is drawn; they accumulate in float32). "auto": fused
            where they can run (CUDA tensors, Triton importable, per-query negatives, a float32, bfloat16
            or float16 weight), else eager: ``MidxConfig``'s default, which the head passes; a direct call
            keeps the reference unless asked, so that a test or benchmark on a GPU measures what it names.
        z_loss: w >= 0, adds w (log Z)^2 per token, log Z the loss's own estimate, with that term's gradient
            (:mod:`hf_midx.losses.log_z_terms`); 0 (the default) adds nothing.
        label_smoothing: eps in [0, 1): the loss becomes (1 - eps) CE + eps (log Z - mean logit), the Trainer's
            ``label_smoothing_factor``, the mean logit exact from the weight's column sum; needs no soft-cap.
        return_z_loss: also return the z-loss term alone (reduced as the loss, no gradient), for logging.
        product_dtype: the dtype of the products (None: the weight's), as autocast sets it: a float32 weight with
            torch.bfloat16 multiplies bfloat16-rounded rows with float32 accumulation, ``nn.Linear``'s mixed
            precision; the fused kernels read the float32 weight and write its float32 gradient (no (V, D) copy),
            the eager path casts the weight once.
    Returns:
        float32 scalar (or (T,) for "none"); with ``return_z_loss``, (that, the z-loss term likewise).
    """
    check_labels = _check_options(
        hidden, weight, labels, sampler, num_samples, bias=bias, negatives=negatives, ignore_index=ignore_index,
        remove_accidental_hits=remove_accidental_hits, reduction=reduction, estimator=estimator,
        exact_ids=exact_ids, check_labels=check_labels, exact_value=exact_value, tail_gradient=tail_gradient,
        kernels=kernels, z_loss=z_loss, label_smoothing=label_smoothing, logit_softcap=logit_softcap,
    )
    with_terms = bool(z_loss or label_smoothing or return_z_loss)
    inner = "none" if with_terms else reduction  # the terms are per token, then reduced
    excluded = sampler.excluded  # (H,) sorted, or None
    num_exact = _check_exact_ids(exact_ids, excluded, check_labels)
    dtype = check_product_dtype(product_dtype, weight)
    if hidden.dtype != dtype:
        # e.g. fp32 hidden states from a norm layer against a bf16 head: one dtype for the matmuls.
        hidden = hidden.to(dtype)
    device = hidden.device
    fused = _runs_fused(kernels, negatives, hidden)  # before the draws: a refused "fused" draws nothing
    weight = weight if fused else weight_for_products(weight, dtype)  # the kernels round its tiles on chip instead
    valid = labels != ignore_index
    # Ignored tokens get label 0: they are scored like any token, then masked out of the reduction.
    y = (labels * valid).long()
    if not check_labels:
        assert_labels_in_range(y, weight.shape[0])
    corrected = estimator == "corrected-positive"
    drops = drops_accidental_hits(remove_accidental_hits, estimator)
    expected = asks_closed_form(tail_gradient, negatives, drops, logit_softcap)
    # 1. the draws: one evaluation of the proposal gives them and, for the corrected positive, the label's log q
    ids, log_q, log_q_pos, factors = _draw(
        sampler, hidden.detach().float(), y, valid, num_samples, negatives, corrected, expected, tail_gradient,
        generator, fused,
    )
    head_ids = excluded.to(device) if num_exact else None  # (H,) sorted
    if fused:
        # The same draws, estimator and head: the kernels take the sorted head (excluded equals exact_ids' set,
        # checked above) and mask the ignored tokens themselves; the labels were range-checked above.
        out = _fused_loss(
            hidden, weight, labels, ids, log_q, log_q_pos, factors, valid, bias=bias, head_ids=head_ids,
            ignore_index=ignore_index, logit_softcap=logit_softcap, corrected=corrected, drops=drops,
            exact_value=exact_value, reduction=inner,
        )
    else:
        # 2. the candidates' logits: the exact head (T, H) and each token's label and negatives (T, R)
        common = (
            torch.empty(0, dtype=torch.long, device=device)
            if not num_exact
            else exact_ids.to(device=device, dtype=torch.long)
        )
        head, cand, log_q, hits, table = _logits(
            hidden, weight, bias, y, ids, log_q, common, factors, negatives, num_exact, logit_softcap
        )
        # 3. the corrections -log(n q) of the candidates, and those of the value
        in_head = _label_in_head(y, log_q_pos, head_ids, valid, corrected)
        value_differs = exact_value and not (estimator == "exact-positive" and drops)  # else the objective is it
        adj, target_adj, value_adj = _corrections(
            log_q, log_q_pos, hits, in_head, num_samples, cand.shape[0], corrected=corrected, drops=drops,
            exact_value=value_differs, has_head=bool(num_exact), device=device,
        )
        # 4. the terms, the tail's expected part, the reduction
        out, share = sampled_softmax_terms(head, cand, adj, target_adj, value_adj, valid, factors is not None)
        if factors is not None:  # the draws gave their share back; each tail class gets its expected part
            out = expected_share(out, share, factors, hidden, weight, bias, table=table[0])
        out = reduce_tokens(out, valid, inner)
    # 5. label smoothing and the z-loss, on the per-token loss of either path
    return _with_log_z_terms(out, hidden, weight, y, valid, bias, z_loss, label_smoothing, logit_softcap, reduction,
                             return_z_loss) if with_terms else out


def _with_log_z_terms(per_token, hidden, weight, y, valid, bias, z_loss, label_smoothing, logit_softcap, reduction,
                      return_z_loss):
    """The (T,) per-token loss with label smoothing and the z-loss (:func:`add_log_z_terms`), reduced; with
    ``return_z_loss`` the z-loss term beside it."""
    loss, z_term = add_log_z_terms(per_token, hidden, weight, y, valid, bias=bias, z_loss=z_loss,
                                   label_smoothing=label_smoothing, logit_softcap=logit_softcap)
    loss = reduce_tokens(loss, valid, reduction)
    return (loss, reduce_tokens(z_term, valid, reduction)) if return_z_loss else loss


def _check_options(hidden, weight, labels, sampler, num_samples, *, bias, negatives, ignore_index,
                   remove_accidental_hits, reduction, estimator, exact_ids, check_labels, exact_value, tail_gradient,
                   kernels, z_loss, label_smoothing, logit_softcap) -> bool:
    """:func:`sampled_softmax_loss`'s arguments, each with a ValueError; returns ``check_labels`` as it runs
    (False under ``torch.compile``)."""
    if check_labels and torch.compiler.is_compiling():
        check_labels = False  # a host read would break the graph: the asynchronous check runs instead
    check_loss_inputs(hidden, weight, labels, bias, ignore_index, reduction, check_labels)
    check_positive_int("num_samples", num_samples)
    check_log_z_terms(z_loss, label_smoothing, logit_softcap)
    if negatives not in NEGATIVE_MODES:
        raise ValueError(f"negatives must be one of {NEGATIVE_MODES}, got {negatives!r}.")
    if estimator not in ESTIMATORS:
        raise ValueError(f"estimator must be one of {ESTIMATORS}, got {estimator!r}.")
    if remove_accidental_hits is not None and not isinstance(remove_accidental_hits, bool):
        raise ValueError(
            "remove_accidental_hits must be True, False or None (the estimator's choice), "
            f"got {remove_accidental_hits!r}."
        )
    if tail_gradient not in defaults.TAIL_GRADIENTS:
        raise ValueError(f"tail_gradient must be one of {defaults.TAIL_GRADIENTS}, got {tail_gradient!r}.")
    if not isinstance(exact_value, bool):
        raise ValueError(f"exact_value must be True or False, got {exact_value!r}.")
    if kernels not in KERNEL_MODES:
        raise ValueError(f"kernels must be one of {KERNEL_MODES}, got {kernels!r}.")
    if sampler.num_classes != weight.shape[0]:
        raise ValueError(
            f"The sampler indexes {sampler.num_classes} classes but weight has {weight.shape[0]} rows; "
            "refresh or rebuild the sampler for this head."
        )
    if exact_ids is not None and (
        not isinstance(exact_ids, torch.Tensor) or exact_ids.dim() != 1 or exact_ids.is_floating_point()
    ):
        raise ValueError("exact_ids must be a 1-D integer tensor of class ids (H,), or None.")
    if exact_ids is not None and check_labels:
        check_ids("exact_ids", exact_ids, weight.shape[0])
    return check_labels


def _check_exact_ids(exact_ids: torch.Tensor | None, excluded: torch.Tensor | None, check_labels: bool) -> int:
    """H, the number of ``exact_ids``, which must be the (H,) sorted classes the sampler ``excluded`` (compared
    when ``check_labels``: a device sync), else ValueError."""
    num_exact = 0 if exact_ids is None else exact_ids.numel()
    if num_exact != (0 if excluded is None else excluded.numel()) or (
        num_exact and check_labels and not torch.equal(torch.sort(exact_ids.to(excluded.device).long()).values, excluded)
    ):
        # A head the sampler may draw is counted twice; classes it excludes but the loss does not score are lost.
        raise ValueError(
            f"exact_ids ({num_exact} ids) must be the classes the sampler excludes "
            f"({0 if excluded is None else excluded.numel()}), each once: build the sampler with exclude=exact_ids "
            "and pass exact_ids=sampler.excluded."
        )
    return num_exact


def _draw(sampler, queries, y, valid, num_samples, negatives, corrected, expected, tail_gradient, generator, fused):
    """The negatives of the (T, D) float32 ``queries``: (ids, log_q, log_q_pos, factors).

    Per-query: ids (T, M) int64 and their log q (T, M); shared: the pool (P,) and log qbar (P,). log_q_pos: (T,)
    the label's log q for the corrected positive, else None. factors: the proposal's closed form for the
    expected tail gradient (per-query, where ``expected``), else None. ``fused``: the loss runs the fused kernels,
    and so does the draw where the sampler has a fused one (:meth:`hf_midx.Sampler.draw_with_factors`).
    """
    if negatives == "per-query":
        # A sampler with a Triton draw takes it with the fused loss; any other is called as before.
        has_fused_draw = getattr(sampler, "has_fused_draw", None)  # absent from a duck-typed sampler
        draw_kernels = {"kernels": "fused"} if fused and has_fused_draw is not None and has_fused_draw() else {}
        if expected:
            scored = y.unsqueeze(1) if corrected else None
            ids, log_q, log_q_pos, factors = sampler.draw_with_factors(
                queries, num_samples, scored, generator=generator, **draw_kernels
            )
            check_closed_form(factors, tail_gradient, sampler)
            return ids, log_q, None if log_q_pos is None else log_q_pos.squeeze(1), factors
        if corrected:
            ids, log_q, log_q_pos = sampler.draw_scored(
                queries, num_samples, y.unsqueeze(1), generator=generator, **draw_kernels
            )
            return ids, log_q, log_q_pos.squeeze(1), None
        ids, log_q = sampler.draw(queries, num_samples, generator=generator)  # (T, M)
        return ids, log_q, None, None
    if corrected:
        pool, log_qbar, log_q_pos = sampler.draw_shared_scored(
            queries, num_samples, y, row_weights=valid.float(), generator=generator
        )
        return pool, log_qbar, log_q_pos, None
    pool, log_qbar = sampler.draw_shared(queries, num_samples, row_weights=valid.float(), generator=generator)
    return pool, log_qbar, None, None


def _fused_loss(hidden, weight, labels, ids, log_q, log_q_pos, factors, valid, *, bias, head_ids, ignore_index,
                logit_softcap, corrected, drops, exact_value, reduction) -> torch.Tensor:
    """The per-query loss of the draws through the fused kernels (:func:`hf_midx.losses.kernels.candidate_loss`)."""
    from .kernels import candidate_loss  # lazily: the kernels' module imports Triton when they run

    # With the factors the kernels also return the weight's bucket table, whose gradient their own weight-gradient
    # kernel spreads: the weight's gradient is written once.
    out = candidate_loss(
        hidden, weight, labels, ids, log_q, log_q_pos, bias=bias,
        head_ids=head_ids, ignore_index=ignore_index,
        logit_softcap=logit_softcap, corrected_positive=corrected, remove_accidental_hits=drops,
        exact_value=exact_value, reduction=reduction, backend="fused", tail_control=factors is not None,
        factors=factors, product_dtype=hidden.dtype,
    )
    # The kernels gave each draw's share back (out[1]); the expected part is added here.
    if factors is None:
        return out
    share = out[1] / valid.sum().clamp_min(1) if reduction == "mean" else out[1]  # per token of the mean
    return expected_share(out[0], share, factors, hidden, weight, bias, table=out[2])


def _logits(hidden, weight, bias, y, ids, log_q, common, factors, negatives, num_exact, logit_softcap):
    """The candidates' soft-capped logits: (head (T, H), cand (T, R), log_q, hits, table).

    Per-query: each token's candidates are its label and its M draws (R = 1 + M), ``common`` the (H,) head.
    Shared: the label alone, and the pool joins the head as common columns (R = 1 + P, log_q (1, P)).
    hits: (T, M) or (T, P) bool, a draw equal to the token's label. table: [the weight's bucket table] with
    the expected tail gradient, else [].
    """
    if negatives == "per-query":
        rows = torch.cat([y.unsqueeze(1), ids], dim=1)  # (T, 1 + M)
        hits = ids == y.unsqueeze(1)
    else:
        rows = y.unsqueeze(1)
        common = torch.cat([common, ids])
        log_q = log_q.unsqueeze(0)  # (1, P)
        hits = ids.unsqueeze(0) == y.unsqueeze(1)
    # With the expected tail gradient the weight's bucket table comes with the logits: its gradient is then
    # written into the candidates' own (V, D) weight gradient, no second one.
    tok_logits, common_logits, *table = candidate_logits(hidden, weight, rows, common, factors)
    if bias is not None:
        tok_logits = tok_logits + bias[rows].float()
        common_logits = common_logits + bias[common].float()
    tok_logits = soft_cap(tok_logits, logit_softcap)
    common_logits = soft_cap(common_logits, logit_softcap)
    head = common_logits[:, :num_exact] if negatives == "shared" else common_logits  # (T, H)
    cand = tok_logits if negatives == "per-query" else torch.cat([tok_logits, common_logits[:, num_exact:]], dim=1)
    return head, cand, log_q, hits, table


def _label_in_head(y, log_q_pos, head_ids, valid, corrected) -> torch.Tensor:
    """(T,) bool: the token's label is in the exact head (``head_ids``, (H,) sorted, or None)."""
    # A label inside the exact head is already one of the head's terms. With the label's log q at hand, a label
    # of log q = -inf is in the head: the sampler excludes exactly exact_ids (checked above) and every sampler
    # keeps its other classes drawable. Else a binary search of the sorted head (torch.isin of a large head
    # sorts and takes unique values, a device sync on CUDA).
    if corrected and head_ids is not None:
        return log_q_pos == -math.inf
    if head_ids is not None:
        return head_ids[torch.searchsorted(head_ids, y).clamp_max(head_ids.numel() - 1)] == y
    return torch.zeros_like(valid)


def _corrections(log_q, log_q_pos, hits, in_head, num_samples, num_tokens, *, corrected, drops, exact_value,
                 has_head, device):
    """(adj (T, R), target_adj (T,) or None, value_adj (T, R) or None): what each candidate's logit gets added in
    the objective, in the target, and in the value (the exact-loss estimate; None: the objective is the value)."""
    # The corrections -log(n q) of the candidates (T, 1 + M), the label's first: n = M, plus the label with the
    # corrected positive when it is not in the head. Inside H the label's term is dropped (-inf: the head holds
    # it) and the target is its exact logit (0); without a head a label the proposal cannot draw keeps both.
    if corrected:
        minus_log_n = (in_head * math.log1p(1 / num_samples)).sub_(math.log(num_samples + 1))  # -log(M + [y not in H])
        pos_adj = (minus_log_n - log_q_pos).nan_to_num_(posinf=-math.inf if has_head else 0.0)
        target_adj = pos_adj.nan_to_num(neginf=0.0)
        neg_adj = minus_log_n.unsqueeze(1) - log_q
    else:
        target_adj, neg_adj = None, -(math.log(num_samples) + log_q)
        pos_adj = torch.zeros(in_head.shape, device=device).masked_fill_(in_head, -math.inf)
    neg_adj = neg_adj.masked_fill(hits, -math.inf) if drops else neg_adj
    adj = torch.cat([pos_adj.unsqueeze(1), neg_adj.expand(num_tokens, -1)], dim=1)  # (T, R)
    if not exact_value:
        return adj, target_adj, None
    # The exact-loss estimate: the label exactly, M draws corrected by log M + log q, hits dropped (no gradient).
    pos_value = pos_adj if target_adj is None else pos_adj - target_adj  # 0, or -inf inside H
    tail = torch.rsub(log_q, -math.log(num_samples))  # (T, M), or (1, P) for a pool
    tail = tail.masked_fill_(hits, -math.inf) if tail.shape == hits.shape else tail.masked_fill(hits, -math.inf)
    return adj, target_adj, torch.cat([pos_value.unsqueeze(1), tail], dim=1)


# The dtypes "auto" hands to the kernels, which accumulate in float32: a float64 head keeps its precision eagerly.
_FUSED_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def _runs_fused(kernels: str, negatives: str, hidden: torch.Tensor) -> bool:
    """Whether :func:`sampled_softmax_loss` takes the fused kernels (see its ``kernels``) for ``hidden`` (already
    in the weight's dtype); for "fused", a ValueError saying what to do where they cannot run. Triton is
    imported only for CUDA tensors or "fused"."""
    device = hidden.device
    if kernels == "eager" or (
        kernels == "auto" and (negatives != "per-query" or device.type != "cuda" or hidden.dtype not in _FUSED_DTYPES)
    ):
        return False
    if negatives != "per-query":
        raise ValueError(
            f"kernels='fused' computes per-query negatives only, got negatives={negatives!r}; "
            "use negatives='per-query', or kernels='auto' (eager for shared negatives)."
        )
    if torch.compiler.is_compiling():
        return True  # a compiled graph runs on a GPU, and torch's CUDA builds ship Triton: nothing to import
    from .kernels import triton_available, triton_interpreting

    if kernels == "auto":
        return triton_available()
    if not triton_available():
        raise ValueError(
            "kernels='fused' needs Triton (it ships with torch's CUDA builds on Linux; else pip install triton); "
            "use kernels='auto' or 'eager'."
        )
    if device.type != "cuda" and not triton_interpreting():
        raise ValueError(
            f"kernels='fused' runs on CUDA tensors (got {device.type}), or on the CPU under TRITON_INTERPRET=1 "
            "(slow, for tests); move the model to a GPU, or use kernels='auto' or 'eager'."
        )
    return True
