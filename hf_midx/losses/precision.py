"""The dtype of the sampled losses' products under autocast: what ``nn.Linear`` does, done explicitly.

Under ``torch.autocast`` (the Trainer's ``bf16=True`` / ``fp16=True`` with float32 parameters, the usual way to
train from scratch) an ``nn.Linear`` head multiplies in the autocast dtype: its GEMMs read bfloat16 / float16
operands (tensor cores, half the weight's bytes) and accumulate in float32, and the float32 weight gets a float32
gradient back through the cast. The losses here do the same, but by hand: autocast would otherwise recast some of
their ops and not others (a custom op or a kernel is not autocast's), and a product saved by the forward in one
dtype would meet the other in the backward. So the hidden states (and a bias) are cast once, to the autocast
dtype, and the loss runs with autocast off, told the product dtype (``product_dtype=``); float32 stays where the
numerics need it, inside the loss (the logits' log-sum-exp and the kernels' accumulators are float32, the proposal
scores float32 queries). The weight is not cast here: the fused kernels read a float32 weight as it is, round each
tile to the product dtype on chip and write its float32 gradient directly (no (V, D) copy either way, which at
V D = 2^30 is 12 bytes an element a step); the eager path casts it once (:func:`weight_for_products`).
"""

from __future__ import annotations

import functools

import torch


def product_dtype(weight: torch.Tensor) -> torch.dtype:
    """The dtype in which a sampled loss multiplies hidden states by ``weight`` (V, D): under autocast on its device
    the autocast dtype, for any floating weight but float64 (autocast's own rule), else the weight's."""
    device = weight.device.type
    if torch.is_autocast_enabled(device) and weight.is_floating_point() and weight.dtype != torch.float64:
        return torch.get_autocast_dtype(device)
    return weight.dtype


def autocast_products(loss):
    """Decorate ``loss(hidden, weight, ..., bias=..., product_dtype=None)``: under autocast on the weight's device,
    ``hidden`` (T, D) and ``bias`` (V,) cast to :func:`product_dtype` (differentiably: their gradients come back in
    their own dtypes), the loss run with autocast off and ``product_dtype`` set (the weight as it is: the loss casts
    it where its path needs a copy); without autocast, the loss as is."""

    @functools.wraps(loss)
    def in_product_dtype(hidden, weight, *args, **kwargs):
        if not isinstance(weight, torch.Tensor) or not torch.is_autocast_enabled(weight.device.type):
            return loss(hidden, weight, *args, **kwargs)  # the loss validates its arguments itself
        dtype = product_dtype(weight)
        if isinstance(hidden, torch.Tensor) and hidden.is_floating_point():
            hidden = hidden.to(dtype)
        if isinstance(kwargs.get("bias"), torch.Tensor):
            kwargs["bias"] = kwargs["bias"].to(dtype)  # as nn.Linear's: the kernels then are the pure bf16 step's
        kwargs["product_dtype"] = dtype
        with torch.autocast(weight.device.type, enabled=False):
            return loss(hidden, weight, *args, **kwargs)

    return in_product_dtype


def check_product_dtype(product_dtype, weight: torch.Tensor) -> torch.dtype:
    """The dtype a loss multiplies in: ``product_dtype`` (a floating dtype no wider than the weight's), or the
    weight's for None; else ValueError."""
    if product_dtype is None:
        return weight.dtype
    if not isinstance(product_dtype, torch.dtype) or not product_dtype.is_floating_point or (
        torch.finfo(product_dtype).bits > torch.finfo(weight.dtype).bits
    ):
        raise ValueError(f"product_dtype must be a floating dtype no wider than the weight's ({weight.dtype}), "
                         f"e.g. torch.bfloat16 for a float32 weight, or None for the weight's; got {product_dtype!r}.")
    return product_dtype


def weight_for_products(weight: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``weight`` (V, D) in ``dtype``, for a path that multiplies one dtype (the eager loss): a differentiable
    (V, D) copy where the dtypes differ (its gradient comes back in the weight's dtype), else the weight itself."""
    return weight if weight.dtype == dtype else weight.to(dtype)


__all__ = ["autocast_products", "check_product_dtype", "product_dtype", "weight_for_products"]
