"""The candidate loss of the per-query sampled softmax, fused (Triton) and eager (the reference).

Given the drawn negatives, this is the part of :func:`hf_midx.sampled_softmax_loss` that runs for
every token: gather the label's and the M negatives' rows, their logits, the proposal correction, the
logsumexp with the exact head, the loss and its gradients. Shapes: T tokens, D dims, V classes, M
negatives per token, R = 1 + M candidate rows (the label first), H exact-head classes.

For token t with label y (ignored tokens count 0), logits o = softcap(scale * (hidden_t . w + b)),
n = M + [corrected positive and y not in H]:

    terms_t = [ o_h for h in H ;  o_y - c_y (dropped when y in H) ;  o_j - log n - log q_j for each draw j ]
    loss_t  = logsumexp(terms_t) - (o_y - c_y)

with c_y = log n + log q_y for the corrected positive (0 when y is in H, or its log q is not finite)
and c_y = 0 for the exact positive; a draw equal to y stays a term unless ``remove_accidental_hits``.
With ``exact_value`` (the default, as :func:`hf_midx.sampled_softmax_loss` has it) the value returned is
instead an estimate of the exact cross-entropy from the same logits, the gradient still the objective's:

    value_t = logsumexp([ o_h for h in H ;  o_y (dropped when y in H) ;  o_j - log M - log q_j, draws j != y ]) - o_y

The gradient of loss_t with respect to the terms is softmax(terms_t) minus 1 at the target, which is
always o_y: the fused forward computes it (times d o / d x) while the logits are in registers, so the
backward only scales it by the upstream gradient and gathers (Liger and Cut Cross-Entropy do the same).

The fused path is three Triton kernels and a few library calls:
  forward    the exact head's logits, one GEMM (hidden @ weight[H].T); then one kernel per block of
             tokens: logits, logsumexp, loss, gradient w.r.t. every candidate and head logit; with the
             proposal's factors (the expected tail gradient), the weight's (B + 1, D) bucket table too
             (:func:`hf_midx.losses.kernels.table.fused_bucket_table`: two launches), an output whose gradient comes
             back here;
  backward   grad_hidden: one GEMM for the head, one kernel for the candidates (each row written once);
             grad_weight: the T R (t, r) pairs sorted by class (``torch.sort``; the forward stores a pair
             of zero gradient as class V, past every run: ignored tokens, and labels in the head, whose
             gradient it moves to the head's column, so that the most frequent classes, the head's, have
             no run to walk) and each class's first pair found once (``torch.searchsorted`` of the V + 1
             class ids), then one kernel, one program per block of classes over all of D: each row
             starts at the tail's spread of the table's gradient (member[v] G[bucket[v]] + static[v]
             G[B]), adds its class's pairs (g times the hidden row, float32) and is written once (zeros
             included), no atomics: the weight's whole gradient is one new (V, D) tensor; the head's
             rows then add one GEMM by ``index_add_`` (distinct ids, in place).
"""

from __future__ import annotations

import math

import torch

from ..precision import autocast_products, check_product_dtype, weight_for_products
from ..tail_gradient import bucket_rows, bucket_table

from .blocks import Blocks

# Importing launch registers the kernels' launches as torch.ops.hf_midx custom ops.
from .launch import cdiv, check_fused, pow2, triton_available, triton_interpreting
from .table import fused_bucket_table

REDUCTIONS = ("mean", "sum", "none")
BACKENDS = ("auto", "fused", "eager")


# ====================================================================== fused
class FusedCandidateLoss(torch.autograd.Function):
    """The candidate loss as Triton kernels; see the module docstring. Inputs as :func:`candidate_loss`,
    already validated, ``hidden`` in the products' dtype (``weight``'s, or a narrower one: a float32 weight under bf16
    autocast is read as is, each tile rounded to ``hidden``'s dtype on chip, its gradient written in float32);
    returns the reduced loss (float32), with
    ``tail_control`` (loss, share), and with ``factors`` too (loss, share, the weight's bucket table)."""

    @staticmethod
    def forward(
        ctx, hidden, weight, bias, labels, ids, log_q, log_q_pos, head_ids,
        ignore_index, logit_scale, logit_softcap, corrected, drop_hits, exact_value, reduction, blocks, tail_control,
        factors=None,
    ):
        num_tokens, dim = hidden.shape
        m = ids.shape[1]
        rows_per_token = m + 1
        num_head = 0 if head_ids is None else head_ids.numel()
        interpreted = not torch.compiler.is_compiling() and triton_interpreting()
        blocks = blocks or Blocks.choose(num_tokens, dim, rows_per_token, interpreted)
        # The kernels read hidden's and weight's rows through their stride but every other tensor, and the elements
        # of a row, with stride 1: a strided view (labels[::2], a bias sliced from a wider one) is copied once here,
        # where it reaches the kernels; a contiguous tensor passes as is.
        hidden, weight, labels, ids, log_q = (x.contiguous() for x in (hidden, weight, labels, ids, log_q))
        bias, log_q_pos = (None if x is None else x.contiguous() for x in (bias, log_q_pos))
        device = hidden.device
        f32 = torch.float32
        if num_head:
            head_ids = head_ids.contiguous()
            # (H, D) in the products' dtype, kept for the backward GEMMs: the one cast of weight rows (H, not V).
            w_head = weight.index_select(0, head_ids).to(hidden.dtype)
            head_raw = hidden @ w_head.t()  # (T, H): cuBLAS, in the products' dtype
            # The gradient overwrites the logits, in their dtype (each read before written; the backward's GEMMs
            # take it in that dtype): g_head None.
            g_head = None
        else:
            head_ids = w_head = head_raw = g_head = None
        programs = cdiv(num_tokens, blocks.t)
        per_token = torch.empty(num_tokens, device=device, dtype=f32)
        stats = torch.empty((programs, 2), device=device, dtype=f32)  # per block: loss sum, valid tokens
        rows = torch.empty((num_tokens, rows_per_token), device=device, dtype=torch.int32)
        g_cand = torch.empty((num_tokens, rows_per_token), device=device, dtype=f32)
        share = torch.empty(num_tokens, device=device, dtype=f32) if tail_control else None
        torch.ops.hf_midx.candidate_forward(
            hidden, weight, bias, labels, ids, log_q, log_q_pos, head_ids, head_raw, g_head,
            per_token, stats, rows, g_cand, share,
            [int(ignore_index), blocks.t, blocks.d, min(blocks.h, pow2(num_head)), blocks.warps,
             blocks.float32_registers if weight.dtype == torch.float32 else blocks.registers],
            [float(logit_scale), float(logit_softcap or 1.0)],
            # The paper's estimator with the hits dropped is the value estimate already.
            [logit_softcap is not None, corrected, drop_hits, exact_value and (corrected or not drop_hits)],
        )
        if num_head and g_head is None:
            g_head = head_raw
        count = None
        if reduction == "none":
            out = per_token
        else:
            total = stats.sum(0)  # (loss sum, valid tokens)
            out = total[0]
            if reduction == "mean":
                # An all-ignored batch gives 0 with a zero gradient, not 0 / 0; the count stays on the device.
                count = total[1].clamp_min(1)
                out = out / count
        spread = (None, None, None) if factors is None else (factors.bucket, factors.member, factors.static)
        spread = tuple(None if x is None else x.contiguous() for x in spread)
        ctx.save_for_backward(hidden, weight, w_head, head_ids, rows, g_cand, g_head, count, *spread)
        ctx.num_head, ctx.blocks = num_head, blocks
        ctx.bias_dtype = bias.dtype if bias is not None else None
        if not tail_control:
            return out
        ctx.mark_non_differentiable(share)
        if factors is None:
            return out, share
        # The table's gradient is spread back over the classes inside the weight-gradient kernel (the backward).
        # A static proposal's one row (B = 0) is a GEMV; a bucketed one is read once in two launches.
        table = bucket_table(factors, weight) if factors.layout.chunks is None else fused_bucket_table(factors, weight)
        if not ctx.needs_input_grad[1]:
            ctx.mark_non_differentiable(table)  # a frozen weight: the expected tail skips the table's gradient
        return out, share, table

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_out, _grad_share=None, grad_table=None):
        hidden, weight, w_head, head_ids, rows, g_cand, g_head, count, bucket, member, static = ctx.saved_tensors
        blocks = ctx.blocks
        need_h, need_w, need_b = ctx.needs_input_grad[:3]
        num_classes = weight.shape[0]
        gscale = (grad_out / count if count is not None else grad_out).float()  # () or (T,)
        grad_hidden = grad_weight = grad_bias = None
        # The head's (T, H) logit gradient, in the weight's dtype, enters its GEMMs unscaled: the upstream scale goes
        # on their (T, D) and (H, D) outputs (the grad_hidden kernel scales its tile), not on a (T, H) pass of its own.
        if need_h:
            base = g_head @ w_head if ctx.num_head else None  # (T, D), unscaled
            grad_hidden = torch.empty_like(hidden)
            torch.ops.hf_midx.candidate_grad_hidden(
                weight, rows, g_cand, gscale, base, grad_hidden, [blocks.t, blocks.d, blocks.warps]
            )
        if need_w or need_b:
            # The (t, r) pairs by class; those of zero gradient (rows = V: ignored tokens, labels in the head, whose
            # gradient the head's GEMM carries) after the last class, out of every run: no long run of a frequent class.
            keys, order = rows.view(-1).sort(stable=True)
            # Where each class's run of pairs begins, for all V + 1 boundaries at once (no search per program).
            classes = torch.arange(num_classes + 1, device=keys.device, dtype=keys.dtype)
            starts = torch.searchsorted(keys, classes, out_int32=True)
            grad_weight = torch.empty_like(weight)
            grad_bias = torch.empty(num_classes, device=weight.device, dtype=ctx.bias_dtype) if need_b else None
            if bucket is None or grad_table is None or not need_w:
                grad_table = bucket = member = static = None
            torch.ops.hf_midx.candidate_grad_weight(
                hidden, order, keys, starts, g_cand, gscale, grad_table, bucket, member, static, grad_weight, grad_bias,
                [blocks.v, blocks.p, blocks.vd, blocks.warps, blocks.grad_registers, blocks.run],
            )
            if ctx.num_head:
                # Head ids are distinct: index_add_ adds each row once, deterministically. A per-token scale goes on
                # the hidden states' rows (T, D), a scalar one on the (H, D) product; either in float32 (a bfloat16
                # copy of the scale would bias every head row by its rounding). In float16 a scalar one goes on the
                # rows too, before the sum over T tokens, as the eager path's autograd puts it: the sum unscaled
                # tops float16's 65,504 (T = 32,768 tokens of gradient ~ -1 against hidden states of 3.0: -inf).
                per_token = gscale.dim() > 0
                if per_token or hidden.dtype == torch.float16:
                    scale = gscale.unsqueeze(1) if per_token else gscale
                    head_grad = (g_head.t() @ (hidden.float() * scale).to(hidden.dtype)).to(weight.dtype)
                else:
                    head_grad = (g_head.t() @ hidden).float().mul_(gscale).to(weight.dtype)
                if need_b and per_token:
                    head_bias = g_head.t().float() @ gscale
                elif need_b:
                    head_bias = g_head.sum(0, dtype=torch.float32) * gscale
                grad_weight.index_add_(0, head_ids, head_grad)
                if need_b:
                    grad_bias.index_add_(0, head_ids, head_bias.to(grad_bias.dtype))
            if not need_w:
                grad_weight = None
        return (grad_hidden, grad_weight, grad_bias) + (None,) * 15


# ====================================================================== eager reference
def candidate_loss_reference(
    hidden, weight, labels, ids, log_q, log_q_pos, *, bias, head_ids, ignore_index, logit_scale, logit_softcap,
    corrected, drop_hits, exact_value, reduction, tail_control=False, factors=None,
):
    """The same loss in plain differentiable PyTorch (autograd does the backward): the reference of the
    fused kernels and their CPU fallback. Logits in float32 (float64 for float64 inputs), as the
    kernels accumulate them; it gathers a (T, R, D) tensor, so it suits moderate T only. With ``factors``
    the weight's bucket table is :func:`hf_midx.losses.tail_gradient.bucket_rows` (its gradient a spread of its own)."""
    acc = torch.promote_types(weight.dtype, torch.float32)
    valid = labels != ignore_index
    y = torch.where(valid, labels, torch.zeros_like(labels)).long()
    rows = torch.cat([y.unsqueeze(1), ids.long()], dim=1)  # (T, R)
    # A float32 weight under autocast (hidden states in bfloat16): its rows rounded to the products' dtype, as the
    # kernels round each tile on chip; the same dtype is no copy.
    x = (weight[rows].to(hidden.dtype).to(acc) * hidden.to(acc).unsqueeze(1)).sum(-1)  # (T, R)
    if bias is not None:
        x = x + bias[rows].to(acc)
    o = _finish(x, logit_scale, logit_softcap)
    m = ids.shape[1]
    num_head = 0 if head_ids is None else head_ids.numel()
    if num_head:
        xh = (hidden @ weight[head_ids].to(hidden.dtype).t()).to(acc)  # the fused path's GEMM, in hidden's dtype
        if bias is not None:
            xh = xh + bias[head_ids].to(acc)
        oh = _finish(xh, logit_scale, logit_softcap)
        in_head = head_ids[torch.searchsorted(head_ids, y).clamp_max(num_head - 1)] == y
    else:
        oh = x.new_zeros((x.shape[0], 0))
        in_head = torch.zeros_like(valid)
    n = m + (in_head.logical_not().to(acc) if corrected else torch.zeros_like(x[:, 0]))
    if corrected:
        lq_pos = log_q_pos.to(acc)
        pos_corr = torch.where(~in_head & torch.isfinite(lq_pos), n.log() + lq_pos, torch.zeros_like(lq_pos))
    else:
        pos_corr = torch.zeros_like(n)
    target = o[:, 0] - pos_corr
    neg = o[:, 1:] - (n.log().unsqueeze(1) + log_q.to(acc))
    if drop_hits:
        neg = neg.masked_fill(ids == y.unsqueeze(1), -math.inf)
    terms = torch.cat([oh, target.masked_fill(in_head, -math.inf).unsqueeze(1), neg], dim=1)
    log_z = torch.logsumexp(terms, dim=1)
    per_token = log_z - target
    share = None
    if tail_control:
        # The expected tail gradient's sampled part (hf_midx.losses.tail_gradient): each draw gives back share / M.
        share = torch.where(valid, (neg - log_z.unsqueeze(1)).exp().sum(1), torch.zeros_like(log_z)).detach()
        control = share * o[:, 1:].mean(1)
        per_token = per_token - (control - control.detach())
    if exact_value:
        # The exact-loss estimate (hits dropped, M draws corrected by log M + log q) with the objective's gradient.
        tail = (o[:, 1:] - (math.log(m) + log_q.to(acc))).masked_fill(ids == y.unsqueeze(1), -math.inf)
        value = torch.cat([oh, o[:, :1].masked_fill(in_head.unsqueeze(1), -math.inf), tail], 1).logsumexp(1) - o[:, 0]
        per_token = per_token + (value - per_token).detach()
    per_token = torch.where(valid, per_token, torch.zeros_like(per_token)).float()
    if reduction == "none":
        out = per_token
    else:
        total = per_token.sum()
        out = total if reduction == "sum" else total / valid.sum().clamp_min(1)
    if share is None:
        return out
    return (out, share.float()) if factors is None else (out, share.float(), bucket_rows(factors, weight))


def _finish(x, scale, cap):
    o = x * scale if scale != 1.0 else x
    return o if cap is None else cap * torch.tanh(o / cap)


# ====================================================================== public entry point
@autocast_products
def candidate_loss(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    ids: torch.Tensor,
    log_q: torch.Tensor,
    log_q_pos: torch.Tensor | None = None,
    *,
    bias: torch.Tensor | None = None,
    head_ids: torch.Tensor | None = None,
    ignore_index: int = -100,
    logit_scale: float = 1.0,
    logit_softcap: float | None = None,
    corrected_positive: bool = True,
    remove_accidental_hits: bool = False,
    exact_value: bool = True,
    reduction: str = "mean",
    backend: str = "auto",
    tail_control: bool = False,
    factors=None,
    product_dtype: torch.dtype | None = None,
) -> torch.Tensor | tuple[torch.Tensor, ...]:
    """Per-query sampled-softmax loss of drawn negatives, with the exact head (see the module docstring).

    No host sync and no (T, V) tensor. The defaults are the default training head's estimator
    ("corrected-positive", accidental hits kept). Ids are not range-checked here (that would read them
    on the host): the fused kernels read out of bounds for a label or draw outside [0, V), so a caller
    checks them first, as :func:`hf_midx.sampled_softmax_loss` does with a device-side assertion.

    Args:
        hidden: (T, D) float hidden states (cast to ``weight``'s dtype; autograd flows to them).
        weight: (V, D) float class embeddings (fp32, bf16 or fp16; autograd flows to them).
        labels: (T,) int64 or int32 in [0, V), or ``ignore_index`` (such tokens contribute 0).
        ids: (T, M) int64 or int32 drawn negatives in [0, V), never in ``head_ids``.
        log_q: (T, M) float32 log Q(ids | z_t), finite.
        log_q_pos: (T,) float32 log Q(label | z_t) (-inf for a label in the head); required when
            ``corrected_positive``, else ignored.
        bias: optional (V,) output bias (autograd flows to it).
        head_ids: optional (H,) int64 sorted, distinct class ids scored exactly for every token.
        logit_scale: logits are ``logit_scale * (hidden . w + b)`` before the soft cap.
        logit_softcap: if set, logits become ``cap * tanh(logits / cap)`` (Gemma-2).
        corrected_positive: the label outside the head is one more candidate corrected by its own
            log q ("corrected-positive"); False: its logit enters as is ("exact-positive").
        remove_accidental_hits: drop a draw equal to the label from the sum.
        exact_value: the value is an estimate of the exact cross-entropy from the same logits (log Z
            estimated without bias: the label exactly, the M draws corrected by log M + log q, hits
            dropped), the gradient the objective's, as :func:`hf_midx.sampled_softmax_loss` returns it
            by default; False: the objective's value.
        reduction: "mean" over non-ignored tokens, "sum", or "none" ((T,), 0 at ignored tokens).
        backend: "fused" (Triton: CUDA tensors, or any under ``TRITON_INTERPRET=1``), "eager"
            (:func:`candidate_loss_reference`), or "auto": fused on CUDA when Triton imports.
        tail_control: the sampled part of the expected tail gradient (:mod:`hf_midx.losses.tail_gradient`): each
            draw's gradient less share_t / M, where share_t is the draws' share of token t's softmax; the
            caller adds the expected part, the gradient of share_t * E_Q[o_t] (value 0). Needs no soft-cap and
            ``remove_accidental_hits=False``.
        factors: with ``tail_control``, the proposal's factors (``probs``, and per class ``bucket`` (V,) int64,
            ``member`` (V,) float32, ``static`` (V,) float32 or None, as
            :class:`~hf_midx.samplers.factors.ProposalFactors` keeps them): the weight's (B + 1, D) bucket table is
            returned too, for :func:`hf_midx.losses.tail_gradient.expected_share`'s ``table=``; its gradient is spread
            over the classes in the fused weight-gradient kernel, so that the weight's gradient is written once.
        product_dtype: the dtype of the products (None: the weight's; autocast sets it): ``hidden`` is cast to it;
            the fused kernels read a wider weight (float32 under bf16 autocast) as it is, round each tile to it on
            chip and write the weight's gradient in the weight's dtype (no (V, D) copy either way); the eager
            reference multiplies a cast copy.
    Returns:
        float32 scalar, or (T,) for "none"; with ``tail_control``, (that, share (T,) float32, 0 at ignored
        tokens, no gradient); with ``factors`` too, (that, share, table (B + 1, D) float32, differentiable).
    """
    _validate(hidden, weight, labels, ids, log_q, log_q_pos, bias, head_ids, corrected_positive, reduction, backend)
    if tail_control and (logit_softcap is not None or remove_accidental_hits):
        raise ValueError("tail_control needs logit_softcap=None and remove_accidental_hits=False.")
    if factors is not None and not tail_control:
        raise ValueError("factors are the expected tail gradient's: pass them with tail_control=True (or drop them).")
    dtype = check_product_dtype(product_dtype, weight)
    if hidden.dtype != dtype:
        hidden = hidden.to(dtype)  # one dtype for the products, as sampled_softmax_loss does
    if backend == "auto":
        # While torch.compile traces, no import is tried: CUDA builds of torch ship Triton.
        backend = "fused" if hidden.is_cuda and (torch.compiler.is_compiling() or triton_available()) else "eager"
    if backend == "fused":
        if not torch.compiler.is_compiling():
            check_fused(hidden)
        return FusedCandidateLoss.apply(
            hidden, weight, bias, labels, ids, log_q.float(), None if not corrected_positive else log_q_pos.float(),
            head_ids, int(ignore_index), float(logit_scale), logit_softcap,
            bool(corrected_positive), bool(remove_accidental_hits), bool(exact_value), reduction, None,
            bool(tail_control), factors,
        )
    return candidate_loss_reference(
        hidden, weight_for_products(weight, dtype), labels, ids, log_q, log_q_pos, bias=bias, head_ids=head_ids,
        ignore_index=ignore_index, logit_scale=logit_scale, logit_softcap=logit_softcap, corrected=corrected_positive,
        drop_hits=remove_accidental_hits, exact_value=exact_value, reduction=reduction, tail_control=tail_control,
        factors=factors,
    )


def _validate(hidden, weight, labels, ids, log_q, log_q_pos, bias, head_ids, corrected, reduction, backend):
    """Shapes, dtypes and options; nothing is read from the device."""
    for name, x in (("hidden", hidden), ("weight", weight)):
        if not isinstance(x, torch.Tensor) or x.dim() != 2 or not x.is_floating_point():
            raise ValueError(f"{name} must be a 2-D float tensor, got {getattr(x, 'shape', type(x).__name__)}.")
    num_tokens, dim = hidden.shape
    if weight.shape[1] != dim:
        raise ValueError(f"weight has {weight.shape[1]} dims, hidden has {dim}; pass the head's (V, D) weight.")
    _check_int_tensor("labels", labels, (num_tokens,))
    if not isinstance(ids, torch.Tensor) or ids.dim() != 2 or ids.shape[0] != num_tokens or ids.shape[1] < 1:
        raise ValueError(
            f"ids must be (T, M) = ({num_tokens}, M >= 1) drawn negatives, got {getattr(ids, 'shape', ids)}."
        )
    _check_int_tensor("ids", ids, tuple(ids.shape))
    if not isinstance(log_q, torch.Tensor) or tuple(log_q.shape) != tuple(ids.shape) or not log_q.is_floating_point():
        raise ValueError(
            f"log_q must be a float tensor shaped like ids {tuple(ids.shape)}, got {getattr(log_q, 'shape', log_q)}."
        )
    pos_ok = isinstance(log_q_pos, torch.Tensor) and tuple(log_q_pos.shape) == (num_tokens,)
    if corrected and not (pos_ok and log_q_pos.is_floating_point()):
        raise ValueError(
            f"corrected_positive needs log_q_pos, the (T,) = ({num_tokens},) float log Q of the labels "
            "(the sampler's draw_scored gives it); pass corrected_positive=False for the exact positive."
        )
    if bias is not None and (not isinstance(bias, torch.Tensor) or tuple(bias.shape) != (weight.shape[0],)):
        raise ValueError(f"bias must have shape ({weight.shape[0]},), got {tuple(getattr(bias, 'shape', ()))}.")
    if head_ids is not None:
        _check_int_tensor("head_ids", head_ids, (head_ids.numel(),) if isinstance(head_ids, torch.Tensor) else None)
    devices = {x.device for x in (hidden, weight, labels, ids, log_q, log_q_pos, bias, head_ids) if x is not None}
    if len(devices) > 1:
        raise ValueError(f"All tensors must be on one device, got {sorted(map(str, devices))}.")
    if reduction not in REDUCTIONS:
        raise ValueError(f"reduction must be one of {REDUCTIONS}, got {reduction!r}.")
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}.")


def _check_int_tensor(name, x, shape):
    if not isinstance(x, torch.Tensor) or x.is_floating_point() or x.is_complex() or x.dtype == torch.bool:
        raise ValueError(f"{name} must be an integer tensor, got {getattr(x, 'dtype', type(x).__name__)}.")
    if shape is not None and tuple(x.shape) != tuple(shape):
        raise ValueError(f"{name} must have shape {tuple(shape)}, got {tuple(x.shape)}.")

