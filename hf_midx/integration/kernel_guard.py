"""The guarded first call of the fused kernels: ``kernels="auto"`` falls back to the eager path where they cannot run
or where they compute something else.

``kernels="auto"`` takes the Triton kernels on any CUDA device, but they may fail there before the first step
ends (a torch whose ``torch.library.custom_op`` rejects the kernels' signatures, an architecture the installed
Triton cannot build for, a driver too old for its PTX, no Triton at all), or, worse, run and be wrong (a
miscompilation, a kernel variant no test ran). So before the head's first sampled loss on a device and dtype,
:func:`probe_fused` runs the fused loss on the real head (the same sampler, weight, dtype, bias and options: the
very kernels and launch configurations the step then uses, which Triton keeps compiled), backward included, and
the eager path on the same draws in float32, and compares the loss and every gradient. Where the fused call raises
or differs, the head warns once, naming the error, the device and ``MidxConfig(kernels="eager")``, and takes the
eager path there for good; ``kernels="fused"``, asked for explicitly, is never probed and still raises.

The probe runs outside the training step's hot path (its device syncs included), under ``enable_grad`` (a first
call under ``no_grad`` or ``inference_mode`` probes as any other). It cannot run while ``torch.compile`` traces or
a CUDA graph captures: :meth:`KernelGuard.prepare` probes before such a step, at wrap time and at train begin.
"""

from __future__ import annotations

import warnings

import torch

from ..losses import sampled_softmax_loss

#: Tokens of the probe's two calls: a multiple of 16 and one that is not (Triton specializes integer arguments on
#: their divisibility by 16, so a step compiles either variant); the second call also takes a per-token upstream
#: gradient (as z-loss and label smoothing give; the first, a mean's scalar one).
PROBE_TOKENS = (32, 21)

#: The largest error the probe accepts, per output (the loss, the gradients of hidden, weight and bias): max |fused -
#: eager| / max |eager|, the eager path in float32 on the same inputs and draws. The kernels accumulate in float32;
#: what differs is the rounding of the head's GEMMs and of the stored gradients in the head's dtype (bfloat16: 2^-9
#: a value, float16: 2^-12, float32 with TF32 GEMMs: 2^-11), with a margin; NaN, a gradient scaled by 2 or a row
#: written to its neighbour are errors of 1 or more.
TOLERANCE = {torch.float32: 5e-3, torch.bfloat16: 5e-2, torch.float16: 2e-2}

# The head dtypes for which "auto" takes the kernels (hf_midx.losses.loss decides the same for the loss).
_FUSED_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
_OUTPUTS = ("loss", "grad hidden", "grad weight", "grad bias")


class KernelMismatch(RuntimeError):
    """The fused loss ran but its value or a gradient differs from the eager path's."""


def auto_takes_fused(weight: torch.Tensor, negatives: str) -> bool:
    """Whether ``kernels="auto"`` would run the fused kernels for a head of ``weight`` (a CUDA, float32, bfloat16
    or float16 weight, per-query negatives): where the probe is needed."""
    return weight.device.type == "cuda" and weight.dtype in _FUSED_DTYPES and negatives == "per-query"


def graph_capturing(weight: torch.Tensor) -> bool:
    """Whether a CUDA graph is being captured on ``weight``'s device (no sync, so no probe, may run there)."""
    return weight.is_cuda and torch.cuda.is_current_stream_capturing()


class _Replay:
    """The head's sampler, each draw method's result recorded at its first call and given back at the next: the
    probe's fused and eager losses score the same negatives (the fused draw's, from the probe's own generator)."""

    def __init__(self, sampler) -> None:
        self._sampler, self._draws = sampler, {}

    def __getattr__(self, name):
        found = getattr(self._sampler, name)
        if not name.startswith("draw"):
            return found

        def replayed(*args, **kwargs):
            if name not in self._draws:
                self._draws[name] = found(*args, **kwargs)
            return self._draws[name]

        return replayed


def probe_fused(sampler, weight: torch.Tensor, bias: torch.Tensor | None, config, *,
                logit_softcap: float | None = None) -> Exception | None:
    """Check the fused loss on the head's (V, D) ``weight`` (``bias`` (V,) or None) with ``sampler`` and
    ``config``'s options: the exception raised, a :class:`KernelMismatch`, or None where it matched.

    Two calls of :data:`PROBE_TOKENS` random hidden states (the weight's dtype and device) whose labels hit the exact
    head, the drawn tail and ``ignore_index``; each runs the fused loss and its backward, then the eager loss on the
    same draws in float32, and compares the loss and the gradients of hidden, weight and bias within
    :data:`TOLERANCE`. The draws use a generator of their own (the sampler's stream is
    not advanced); the weight and bias are not changed (their gradients here are detached copies', freed on return).
    """
    try:
        with torch.inference_mode(False), torch.enable_grad():
            for num_tokens, per_token in zip(PROBE_TOKENS, (False, True)):
                _probe_call(sampler, weight, bias, config, logit_softcap, num_tokens, per_token)
    except Exception as error:  # noqa: BLE001 (any failure of the kernels is the answer)
        return error
    return None


def _probe_call(sampler, weight, bias, config, logit_softcap, num_tokens, per_token) -> None:
    """One call of :func:`probe_fused`: KernelMismatch where the fused and the eager results differ."""
    device = weight.device
    generator = torch.Generator(device=device).manual_seed(num_tokens)
    hidden = torch.randn(num_tokens, weight.shape[1], device=device, generator=generator).to(weight.dtype)
    labels = torch.randint(weight.shape[0], (num_tokens,), device=device, generator=generator)
    head = sampler.excluded
    if head is not None and head.numel():
        labels[::3] = head.to(device)[torch.arange(0, num_tokens, 3, device=device) % head.numel()]
    labels[1::5] = -100
    upstream = torch.rand(num_tokens, device=device, generator=generator) + 0.5 if per_token else None
    replay = _Replay(sampler)
    got = _loss_and_grads(replay, hidden, weight, bias, labels, upstream, config, logit_softcap, "fused")
    want = _loss_and_grads(replay, hidden.float(), weight.float(), None if bias is None else bias.float(), labels,
                           upstream, config, logit_softcap, "eager")
    if device.type == "cuda":
        torch.cuda.synchronize(device)  # a launch error surfaces here, not at the first step
    tolerance = TOLERANCE[weight.dtype]
    for name, x, ref in zip(_OUTPUTS, got, want):
        if (x is None) != (ref is None):
            raise KernelMismatch(f"the fused path gave {'no ' if x is None else ''}{name}, the eager path did not")
        if ref is None:
            continue
        x, ref = x.float(), ref.float()
        error = float((x - ref).abs().max() / ref.abs().max().clamp_min(1e-30))
        if not (error <= tolerance):  # NaN fails too
            raise KernelMismatch(
                f"the fused {name} differs from the eager path's on {num_tokens} probe tokens"
                f"{' with a per-token upstream gradient' if per_token else ''}: relative error {error:.2e} > "
                f"{tolerance:.0e} ({weight.dtype})"
            )


def _loss_and_grads(sampler, hidden, weight, bias, labels, upstream, config, logit_softcap, kernels):
    """(loss, grad hidden, grad weight, grad bias) of one sampled loss of detached copies, all differentiable (the
    weight-gradient kernel with the bias's, even for a head that trains neither: one more variant built); the
    upstream gradient (T,) per token, or the mean's."""
    hidden, weight, bias = _leaf(hidden), _leaf(weight), _leaf(bias)
    loss = sampled_softmax_loss(
        hidden, weight, labels, sampler, config.num_samples, bias=bias, negatives=config.negatives,
        remove_accidental_hits=config.remove_accidental_hits, check_labels=False, estimator=config.estimator,
        exact_ids=sampler.excluded, kernels=kernels, tail_gradient=config.tail_gradient,
        logit_softcap=logit_softcap, z_loss=config.z_loss, label_smoothing=config.label_smoothing,
        reduction="mean" if upstream is None else "none", generator=torch.Generator(device=weight.device).manual_seed(0),
    )
    loss.backward(upstream)
    grads = [None if x is None else x.grad for x in (hidden, weight, bias)]
    return [loss.detach(), *grads]


def _leaf(x: torch.Tensor | None) -> torch.Tensor | None:
    """A detached leaf of x's values that requires grad (a copy only for a tensor made under ``inference_mode``,
    which cannot take a gradient)."""
    if x is None:
        return None
    x = x.detach()
    return (x.clone() if x.is_inference() else x).requires_grad_()


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
    the fused kernels failed their probe (probed once each, warned once), "eager". Held by each head."""

    def __init__(self) -> None:
        self.choices: dict[tuple[str, str], str] = {}  # (device, dtype) -> what "auto" takes there, once probed

    def kernels(self, config, sampler, weight: torch.Tensor, bias: torch.Tensor | None,
                logit_softcap: float | None = None) -> str:
        """The ``kernels`` for a sampled loss of ``weight`` (V, D) and ``bias`` with ``config`` and ``sampler``."""
        mode = config.kernels
        if mode != "auto":
            return mode  # "fused" asked for explicitly raises where it cannot run; "eager" needs nothing
        key = _key(weight)
        if key not in self.choices and not torch.compiler.is_compiling() and not graph_capturing(weight):
            # A compiled or captured first call keeps "auto" until an eager one: prepare() probes before those.
            self.prepare(config, sampler, weight, bias, logit_softcap)
        return self.choices.get(key, mode)

    def prepare(self, config, sampler, weight: torch.Tensor, bias: torch.Tensor | None,
                logit_softcap: float | None = None) -> None:
        """Decide for ``weight``'s device and dtype now (probing where "auto" takes the kernels), unless decided:
        before a step that ``torch.compile`` traces or a CUDA graph captures, where no probe can run."""
        key = _key(weight)
        if config.kernels != "auto" or key in self.choices:
            return
        error = None
        if auto_takes_fused(weight, config.negatives):
            error = probe_fused(sampler, weight, bias, config, logit_softcap=logit_softcap)
        if error is not None:
            warn_fallback(error, weight.device)
        self.choices[key] = "auto" if error is None else "eager"


def _key(weight: torch.Tensor) -> tuple[str, str]:
    return str(weight.device), str(weight.dtype).removeprefix("torch.")


__all__ = ["PROBE_TOKENS", "TOLERANCE", "KernelGuard", "KernelMismatch", "auto_takes_fused", "graph_capturing",
           "probe_fused", "warn_fallback"]
