"""The dtype of the sampled losses' products under autocast: what ``nn.Linear`` does, done explicitly.

Under ``torch.autocast`` (the Trainer's ``bf16=True`` / ``fp16=True`` with float32 parameters, the usual way to
train from scratch) an ``nn.Linear`` head multiplies in the autocast dtype: its GEMMs read bfloat16 / float16
operands (tensor cores, half the weight's bytes) and accumulate in float32, and the float32 weight gets a float32
gradient back through the cast. The losses here do the same, but by hand: autocast would otherwise recast some of
their ops and not others (a custom op or a kernel is not autocast's), and a product saved by the forward in one
dtype would meet the other in the backward. So the hidden states and the weight are cast once, to the autocast
dtype, and the loss runs with autocast off; float32 stays where the numerics need it, inside the loss (the logits'
log-sum-exp and the kernels' accumulators are float32, the proposal scores float32 queries).
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
    """Decorate ``loss(hidden, weight, ..., bias=...)``: under autocast on the weight's device, ``hidden`` (T, D),
    ``weight`` (V, D) and ``bias`` (V,) cast to :func:`product_dtype` (differentiably: their gradients come back in
    their own dtypes) and the loss run with autocast off; without autocast, the loss as is."""

    @functools.wraps(loss)
    def in_product_dtype(hidden, weight, *args, **kwargs):
        if not isinstance(weight, torch.Tensor) or not torch.is_autocast_enabled(weight.device.type):
            return loss(hidden, weight, *args, **kwargs)  # the loss validates its arguments itself
        dtype = product_dtype(weight)
        if isinstance(hidden, torch.Tensor) and hidden.is_floating_point():
            hidden = hidden.to(dtype)
        if isinstance(kwargs.get("bias"), torch.Tensor):
            kwargs["bias"] = kwargs["bias"].to(dtype)  # as nn.Linear's: the kernels then are the pure bf16 step's
        with torch.autocast(weight.device.type, enabled=False):
            return loss(hidden, weight.to(dtype), *args, **kwargs)

    return in_product_dtype


__all__ = ["autocast_products", "product_dtype"]
