"""The guarded first call of the fused kernels: ``kernels="auto"`` falls back to the eager path where they cannot run
or where they compute something else.

``kernels="auto"`` takes the Triton kernels on any CUDA device, but they may fail there before the first step
ends (a torch whose ``torch.library.custom_op`` rejects the kernels' signatures, an architecture the installed
Triton cannot build for, a driver too old for its PTX, no Triton at all), or, worse, run and be wrong (a
miscompilation, a kernel variant no test ran). So before the head's first sampled loss on a device and dtype,
:func:`~hf_midx.integration.kernel_probe.probe_fused` checks each kernel the step runs (the random stream, the
draw, the loss forward and backward) against its reference, on a head of the same shape, options and dtype but a
slice of the vocabulary (its memory does not grow with V; it reads no weight of the user's). Where a kernel raises
or differs, the head warns once, naming the error, the device and ``MidxConfig(kernels="eager")``, and takes the
eager path there for good; ``kernels="fused"``, asked for explicitly, is never probed and still raises.

The probe runs outside the training step's hot path (its device syncs included), under ``enable_grad`` (a first
call under ``no_grad`` or ``inference_mode`` probes as any other). :meth:`KernelGuard.prepare` runs it at wrap time
and at train begin, a sharded head (FSDP, ZeRO-3) included; a first call that ``torch.compile`` traces runs it at
trace time, outside the graph (:func:`torch.compiler.assume_constant_result`), and the graph takes its decision;
a CUDA graph's capture, where no sync may run, leaves "auto" undecided (capture follows eager warm-up calls,
which decide).
"""

from __future__ import annotations

import warnings

import torch

from .kernel_probe import PROBE_TOKENS, TOLERANCE, KernelMismatch, probe_fused

# The head dtypes for which "auto" takes the kernels (hf_midx.losses.loss decides the same for the loss).
_FUSED_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def auto_takes_fused(device: torch.device, dtype: torch.dtype, negatives: str) -> bool:
    """Whether ``kernels="auto"`` would run the fused kernels for a head on ``device`` in ``dtype`` (CUDA; float32,
    bfloat16 or float16; per-query negatives): where the probe is needed."""
    return device.type == "cuda" and dtype in _FUSED_DTYPES and negatives == "per-query"


def graph_capturing(device: torch.device) -> bool:
    """Whether a CUDA graph is being captured on ``device`` (no sync, so no probe, may run there)."""
    return device.type == "cuda" and torch.cuda.is_current_stream_capturing()


def warn_fallback(error: Exception, device: torch.device) -> None:
    """The one warning of a failed probe: the error, the device and the setting that skips the kernels."""
    name = ""
    if device.type == "cuda":
        major, minor = torch.cuda.get_device_capability(device)
        name = f" ({torch.cuda.get_device_name(device)}, sm_{major}{minor})"
    fault = ""
    if _device_fault(error):
        fault = ("The device reported a fault: its CUDA context may be unusable, so the eager path may fail too; "
                 'restart the process with MidxConfig(kernels="eager"). ')
    warnings.warn(
        f"hf_midx: the fused Triton kernels cannot run on {device}{name}: {type(error).__name__}: {error}. {fault}"
        "Training on the eager PyTorch path instead (the same loss and gradients, slower). Set "
        'MidxConfig(kernels="eager") to skip the kernels (and this check), or kernels="fused" to raise instead.',
        RuntimeWarning,
        stacklevel=4,
    )


def _device_fault(error: Exception) -> bool:
    """Whether ``error`` is an asynchronous CUDA error (an illegal address, a device-side assertion), after which
    the process's CUDA context is usually unusable: every later CUDA call raises it again."""
    accelerator_error = getattr(torch, "AcceleratorError", None)  # torch >= 2.8 raises it for CUDA errors
    return (accelerator_error is not None and isinstance(error, accelerator_error)) or "CUDA error" in str(error)


class KernelGuard:
    """The ``kernels`` a head passes to its sampled loss: the config's, but for "auto" on a device and dtype where
    the fused kernels failed their probe (probed once each, warned once), "eager". Held by each head.

    ``shape`` below is what the probe takes of the head: (V, D, H exact classes, whether it has a bias, its logit
    soft-cap or None), plain values (a compiled first call hands them to the probe as constants)."""

    def __init__(self) -> None:
        self.choices: dict[tuple[str, str], str] = {}  # (device, dtype) -> what "auto" takes there, once probed

    def kernels(self, config, shape: tuple, weight: torch.Tensor, product_dtype: torch.dtype | None = None) -> str:
        """The ``kernels`` for a sampled loss of ``weight`` (V, D) (its device and dtype) with ``config``, its
        products in ``product_dtype`` (a mixed-precision step's autocast dtype; None: the weight's)."""
        mode = config.kernels
        if mode != "auto":
            return mode  # "fused" asked for explicitly raises where it cannot run; "eager" needs nothing
        if torch.compiler.is_compiling():
            # Decided (probed if need be) as Python while tracing; the graph reads no guard's state.
            return _decide_while_tracing(self, config, shape, weight.device, weight.dtype, product_dtype)
        key = _key(weight.device, weight.dtype, product_dtype)
        if key not in self.choices and not graph_capturing(weight.device):
            self.prepare(config, shape, weight.device, weight.dtype, product_dtype)
        return self.choices.get(key, mode)

    def prepare(self, config, shape: tuple, device: torch.device, dtype: torch.dtype,
                product_dtype: torch.dtype | None = None) -> str:
        """Decide for ``device``, ``dtype`` and ``product_dtype`` now (probing where "auto" takes the kernels),
        unless decided; returns the choice. Before a step that ``torch.compile`` traces or a CUDA graph captures."""
        key = _key(device, dtype, product_dtype)
        if config.kernels != "auto" or key in self.choices:
            return self.choices.get(key, config.kernels)
        error = None
        if auto_takes_fused(device, dtype, config.negatives):
            error = probe_fused(config, device, dtype, shape, product_dtype)
        if error is not None:
            warn_fallback(error, device)
        self.choices[key] = "auto" if error is None else "eager"
        return self.choices[key]


@torch.compiler.assume_constant_result
def _decide_while_tracing(guard: KernelGuard, config, shape: tuple, device: torch.device, dtype: torch.dtype,
                          product_dtype: torch.dtype | None) -> str:
    """:meth:`KernelGuard.prepare` called by ``torch.compile`` while it traces: run as Python once, at trace time,
    not traced; the graph takes the answer as a constant (a later trace gets the decision made)."""
    return guard.prepare(config, shape, device, dtype, product_dtype)


def _key(device: torch.device, dtype: torch.dtype, product_dtype: torch.dtype | None = None) -> tuple[str, str]:
    """("cuda:0", "bfloat16"), or ("cuda:0", "float32->bfloat16") for a float32 weight with bfloat16 products."""
    name = str(dtype).removeprefix("torch.")
    if product_dtype is not None and product_dtype != dtype:
        name += "->" + str(product_dtype).removeprefix("torch.")
    return str(device), name


__all__ = ["PROBE_TOKENS", "TOLERANCE", "KernelGuard", "KernelMismatch", "auto_takes_fused", "graph_capturing",
           "probe_fused", "warn_fallback"]
