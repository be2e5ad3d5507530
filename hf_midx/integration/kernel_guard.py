"""The guarded first call of the fused kernels: ``kernels="auto"`` falls back to the eager path where they cannot run.

``kernels="auto"`` takes the Triton kernels on any CUDA device, but they may fail there before the first step
ends: a torch whose ``torch.library.custom_op`` rejects the kernels' signatures (at their registration), an
architecture the installed Triton cannot build for, a driver too old for its PTX, no Triton at all. So before the
head's first sampled loss on a device, :func:`probe_fused` runs the fused loss once on a few tokens of the real
head (the same sampler, weight, dtype and options: the very kernels and launch configurations the step then
uses, which Triton keeps compiled), backward included, and waits for the device. Where it raises, the head
warns once, naming the error, the device and ``MidxConfig(kernels="eager")``, and takes the eager path on that
device for good; ``kernels="fused"``, asked for explicitly, is never probed and still raises.

The probe runs once per device outside the training step's hot path (its one device sync included); under
``torch.compile`` it is not run (a compiled step keeps the decision made before, or ``"auto"``).
"""

from __future__ import annotations

import warnings

import torch

from ..losses import sampled_softmax_loss

#: Tokens of the probe: a multiple of 16, as a step's token count usually is (Triton specializes on it).
PROBE_TOKENS = 16

# The head dtypes for which "auto" takes the kernels (hf_midx.losses.loss decides the same for the loss).
_FUSED_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def auto_takes_fused(weight: torch.Tensor, negatives: str) -> bool:
    """Whether ``kernels="auto"`` would run the fused kernels for a head of ``weight`` (a CUDA, float32, bfloat16
    or float16 weight, per-query negatives): where the probe is needed."""
    return weight.device.type == "cuda" and weight.dtype in _FUSED_DTYPES and negatives == "per-query"


def probe_fused(sampler, weight: torch.Tensor, bias: torch.Tensor | None, config, *,
                logit_softcap: float | None = None) -> Exception | None:
    """Run the fused loss (forward and backward) once on :data:`PROBE_TOKENS` zero hidden states of the head's
    (V, D) ``weight`` (``bias`` (V,) or None) with ``sampler`` and ``config``'s options, on the weight's device,
    and wait for it: the exception raised, or None where the kernels registered, built and ran.

    The draws use a generator of their own (the sampler's stream is not advanced); the weight is not changed
    (its gradient here is a detached copy's, freed on return)."""
    device = weight.device
    try:
        hidden = torch.zeros(PROBE_TOKENS, weight.shape[1], device=device, dtype=weight.dtype, requires_grad=True)
        w = weight.detach().requires_grad_()
        labels = torch.arange(PROBE_TOKENS, device=device) % weight.shape[0]
        generator = torch.Generator(device=device).manual_seed(0)
        loss = sampled_softmax_loss(
            hidden, w, labels, sampler, config.num_samples, bias=None if bias is None else bias.detach(),
            negatives=config.negatives, remove_accidental_hits=config.remove_accidental_hits, check_labels=False,
            estimator=config.estimator, exact_ids=sampler.excluded, kernels="fused",
            tail_gradient=config.tail_gradient, logit_softcap=logit_softcap, generator=generator,
        )
        loss.backward()
        if device.type == "cuda":
            torch.cuda.synchronize(device)  # a launch error surfaces here, not at the first step
    except Exception as error:  # noqa: BLE001 (any failure of the kernels is the answer)
        return error
    return None


def warn_fallback(error: Exception, device: torch.device) -> None:
    """The one warning of a failed probe: the error, the device and the setting that skips the kernels."""
    name = ""
    if device.type == "cuda":
        major, minor = torch.cuda.get_device_capability(device)
        name = f" ({torch.cuda.get_device_name(device)}, sm_{major}{minor})"
    warnings.warn(
        f"hf_midx: the fused Triton kernels cannot run on {device}{name}: {type(error).__name__}: {error}. "
        "Training on the eager PyTorch path instead (the same loss and gradients, slower). Set "
        'MidxConfig(kernels="eager") to skip the kernels (and this check), or kernels="fused" to raise instead.',
        RuntimeWarning,
        stacklevel=4,
    )


class KernelGuard:
    """The ``kernels`` a head passes to its sampled loss: the config's, but for "auto" on a device where the fused
    kernels failed their first call (probed once per device, warned once), "eager". Held by each head."""

    def __init__(self) -> None:
        self.choices: dict[str, str] = {}  # device -> what "auto" takes there, once probed

    def kernels(self, config, sampler, weight: torch.Tensor, bias: torch.Tensor | None,
                logit_softcap: float | None = None) -> str:
        """The ``kernels`` for a sampled loss of ``weight`` (V, D) and ``bias`` with ``config`` and ``sampler``."""
        mode = config.kernels
        if mode != "auto":
            return mode  # "fused" asked for explicitly raises where it cannot run; "eager" needs nothing
        device = str(weight.device)
        if device not in self.choices and not torch.compiler.is_compiling():
            # Once per device, outside any compiled graph; a compiled first call keeps "auto" until an eager one.
            error = None
            if auto_takes_fused(weight, config.negatives):
                error = probe_fused(sampler, weight, bias, config, logit_softcap=logit_softcap)
            if error is not None:
                warn_fallback(error, weight.device)
            self.choices[device] = "auto" if error is None else "eager"
        return self.choices.get(device, mode)


__all__ = ["PROBE_TOKENS", "KernelGuard", "auto_takes_fused", "probe_fused", "warn_fallback"]
