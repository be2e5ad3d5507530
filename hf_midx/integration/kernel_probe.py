"""The first-call probe of the fused kernels: each kernel the step runs against a reference that does not reuse its
output, on a head of the user's shape but a slice of its vocabulary.

:func:`probe_fused` builds a problem of its own: (V', D) random class embeddings in the head's dtype on its device,
where V' is the exact head's H classes and :data:`TAIL_ROWS` tail classes (V' = V for a smaller vocabulary, and
V' = V modulo 16 always: Triton specializes an integer argument on its divisibility by 16), a bias where the head
has one, and a sampler of the config's kind and options over them (its own index, the same codebook size, H classes
excluded). So the kernels run the variants and launch configurations the step runs (the same dtype, D, H, M, K,
options, bias and softcap), without reading the user's weight: the probe's memory does not grow with V, and a
sharded head (FSDP, ZeRO-3) is probed at wrap or train begin like a whole one. Then, for two calls of
:data:`PROBE_TOKENS` random tokens (labels in the head, the tail, and ignored):

- the counter random stream's kernel against ``CounterRNG``'s eager stream, bit for bit (where the draw is fused);
- the fused draw against the eager draw from the same stream (the same uniforms): its classes (the buckets drawn),
  their log q and the labels' (the log Z), the bucket probabilities (the expected tail's factors);
- the fused loss and its backward (under ``torch.autocast`` for a mixed-precision step, as the step runs it) against
  the eager path on the fused draws (checked above), computed in float32 from the same rounded inputs (those of
  the products' dtype, cast up): the loss, the hidden states' gradient, and the weight's
  and bias's gradients part by part, each relative to its own largest value: the exact head's rows, the drawn rows
  (labels and draws), and the other rows, which only the expected tail's spread reaches (over a whole gradient,
  a tail row's share shrinks like 1/V and a spread the kernels dropped could not be seen).

Nothing here advances the sampler's stream or touches the head's parameters. What a slice cannot see: an error
that needs V's size (an int32 offset past 2^31) or the user's values (a float16 weight whose norms overflow), and a
variant that only another integer's divisibility by 16 selects (the bucket table's chunk counts are the probe's).
"""

from __future__ import annotations

import contextlib
import math

import torch

from ..losses import sampled_softmax_loss
from ..registry import build_sampler
from ..rng import CounterRNG

#: Tokens of the probe's two calls: a multiple of 16 and one that is not (Triton specializes integer arguments on
#: their divisibility by 16, so a step compiles either variant); the second call also takes a per-token upstream
#: gradient (as z-loss and label smoothing give; the first, a mean's scalar one).
PROBE_TOKENS = (32, 21)

#: Tail classes of the probe's vocabulary beside the exact head: about 4 a bucket at K = 32, 16 rows of each
#: weight-gradient program; the kernels read them as they read a full vocabulary's.
TAIL_ROWS = 4096

#: The largest errors the probe accepts, (the loss's, each gradient part's), per head dtype: max |fused - eager| /
#: max |eager| over the output or part, the eager path in float32 from the same rounded inputs. The kernels
#: accumulate in float32; what differs is the rounding of the exact head's GEMM (its logits and their gradient are
#: stored in the head's dtype) and of the stored gradients (bfloat16: 2^-9 a value, float16: 2^-12, float32 with
#: TF32 GEMMs: 2^-11), which a gradient's cancellations (softmax minus one-hot) magnify. Under Triton's interpreter
#: the real kernels gave at most 4.5e-5 and 1.1e-2 in bfloat16, 2.8e-6 and 8.8e-4 in float16, 2.0e-7 and 8.1e-7 in
#: float32 (V = 3,000 to 65,536, D = 16 to 64, with and without exact head, soft-cap and bias). A loss 3% off, NaN,
#: a gradient scaled by 2, a row written to its neighbour or a dropped tail spread are errors of 0.03 to 1.
TOLERANCE = {torch.float32: (1e-3, 5e-3), torch.bfloat16: (5e-3, 4e-2), torch.float16: (1e-3, 5e-3)}

#: The draw's tolerances: the share of draws that must agree, less 2 draws (a target within a rounding of a bucket
#: boundary falls on the other side of it, as the kernel's running sum is a parallel scan: about 2 K^2 2^-23 of
#: draws, 2.4e-4 at K = 32), the largest difference in log q (nats) where the draws agree, and of the bucket
#: probabilities relative to the largest.
DRAW_AGREEMENT, LOG_Q_TOLERANCE, PROBS_TOLERANCE = 0.99, 1e-4, 1e-4


class KernelMismatch(RuntimeError):
    """A fused kernel ran but its result differs from its reference's."""


def probe_vocabulary(num_classes: int, num_exact: int) -> int:
    """V', the probe's classes for a head of V = ``num_classes`` with H = ``num_exact`` exact classes: V where
    V <= H + :data:`TAIL_ROWS` + 16, else H + TAIL_ROWS plus V's remainder modulo 16."""
    base = num_exact + TAIL_ROWS
    return num_classes if num_classes <= base + 16 else base + (num_classes - base) % 16


def probe_fused(config, device: torch.device, dtype: torch.dtype, shape: tuple,
                product_dtype: torch.dtype | None = None) -> Exception | None:
    """Check the fused kernels for a head of ``shape`` = (V, D, H, has_bias, logit_softcap) in ``dtype`` on
    ``device`` with ``config``'s options (see the module docstring): the exception raised, a
    :class:`KernelMismatch`, or None where every kernel matched its reference. ``product_dtype``: the autocast dtype
    of a mixed-precision step (a float32 weight, bfloat16 products), whose fused loss the probe then runs under
    ``torch.autocast`` as the step does, against the eager path on the inputs rounded to it; None: the weight's."""
    try:
        with torch.inference_mode(False), torch.enable_grad(), torch.autocast(device.type, enabled=False):
            problem = _Problem(config, device, dtype, product_dtype or dtype, *shape)
            for num_tokens, per_token in zip(PROBE_TOKENS, (False, True)):
                problem.check(num_tokens, per_token)
    except Exception as error:  # noqa: BLE001 (any failure of the kernels is the answer)
        return error
    return None


class _Problem:
    """The probe's head: (V', D) weights, bias, exact head and sampler, from a generator of its own."""

    def __init__(self, config, device, dtype, product_dtype, num_classes, dim, num_exact, has_bias,
                 logit_softcap) -> None:
        self.config, self.device, self.dtype, self.logit_softcap = config, device, dtype, logit_softcap
        self.product_dtype = product_dtype
        v = probe_vocabulary(num_classes, num_exact)
        self.generator = torch.Generator(device=device).manual_seed(0)
        g = self.generator
        self.weight = (torch.randn(v, dim, device=device, generator=g) / math.sqrt(dim)).to(dtype)
        self.bias = (torch.randn(v, device=device, generator=g) / 4).to(dtype) if has_bias else None
        head = torch.randperm(v, device=device, generator=g)[:num_exact].sort().values if num_exact else None
        counts = torch.randint(1, 1000, (v,), device=device, generator=g).double()  # for options that read them
        self.sampler = build_sampler(config.sampler, self.weight.float(), class_counts=counts, exclude=head,
                                     **config.sampler_kwargs())

    def check(self, num_tokens: int, per_token: bool) -> None:
        """One call: KernelMismatch where a kernel's result differs from its reference's."""
        device, g, v = self.device, self.generator, self.weight.shape[0]
        hidden = (torch.randn(num_tokens, self.weight.shape[1], device=device, generator=g) * 2).to(self.product_dtype)
        labels = torch.randint(v, (num_tokens,), device=device, generator=g)
        head = self.sampler.excluded
        if head is not None:
            labels[::3] = head[torch.arange(0, num_tokens, 3, device=device) % head.numel()]
        labels[1::5] = -100
        upstream = torch.rand(num_tokens, device=device, generator=g) + 0.5 if per_token else None
        where = (f"{num_tokens} probe tokens{' with a per-token upstream gradient' if per_token else ''} "
                 f"({self.dtype}{'' if self.product_dtype == self.dtype else f', {self.product_dtype} products'})")
        draws = _Draws(self.sampler)
        got = self._loss_and_grads(draws, hidden, self.weight, self.bias, labels, upstream, "fused", num_tokens)
        if device.type == "cuda":
            torch.cuda.synchronize(device)  # a launch error surfaces here, not at the first step
        draws.check(where)
        inputs = (x if x is None else x.to(self.product_dtype).float() for x in (hidden, self.weight, self.bias))
        want = self._loss_and_grads(draws, *inputs, labels, upstream, "eager", num_tokens)
        parts = _parts(v, head, labels, draws.drawn())
        for name, x, ref in zip(("loss", "grad hidden", "grad weight", "grad bias"), got, want):
            tolerance = TOLERANCE[self.product_dtype][name != "loss"]
            if (x is None) != (ref is None):
                raise KernelMismatch(f"the fused path gave {'no ' if x is None else ''}{name}, the eager path did not")
            if ref is None:
                continue
            for part, rows in (parts if name in ("grad weight", "grad bias") else {"": None}).items():
                error = _relative_error(x, ref, rows)
                if not (error <= tolerance):  # NaN fails too
                    raise KernelMismatch(f"the fused {name}{part} differs from the eager path's on {where}: "
                                         f"relative error {error:.2e} > {tolerance:.0e}")

    def _loss_and_grads(self, sampler, hidden, weight, bias, labels, upstream, kernels, seed):
        """(loss, grad hidden, grad weight, grad bias) of one sampled loss of detached leaves, all differentiable
        (the weight-gradient kernel with the bias's, even for a head that trains neither: one more variant built);
        the upstream gradient (T,) per token, or the mean's. The draws from a CounterRNG of ``seed``."""
        hidden, weight, bias = (None if x is None else x.detach().requires_grad_() for x in (hidden, weight, bias))
        config, mixed = self.config, kernels == "fused" and self.product_dtype != self.dtype
        with torch.autocast(weight.device.type, dtype=self.product_dtype) if mixed else contextlib.nullcontext():
            loss = sampled_softmax_loss(
                hidden, weight, labels, sampler, config.num_samples, bias=bias, negatives=config.negatives,
                remove_accidental_hits=config.remove_accidental_hits, check_labels=False, estimator=config.estimator,
                exact_ids=self.sampler.excluded, kernels=kernels, tail_gradient=config.tail_gradient,
                logit_softcap=self.logit_softcap, z_loss=config.z_loss, label_smoothing=config.label_smoothing,
                reduction="mean" if upstream is None else "none", generator=CounterRNG(seed, device=weight.device),
            )
        loss.backward(upstream)
        return [loss.detach(), *(None if x is None else x.grad for x in (hidden, weight, bias))]


class _Draws:
    """The probe's sampler: each draw method's call recorded at its first call (with the stream's state before it)
    and given back at the next, so that the eager loss scores the fused loss's draws; :meth:`check` compares each
    fused draw with the eager draw from the same state of the stream."""

    def __init__(self, sampler) -> None:
        self._sampler, self._calls = sampler, {}

    def __getattr__(self, name):
        found = getattr(self._sampler, name)
        if not name.startswith("draw"):
            return found

        def recorded(*args, **kwargs):
            if name not in self._calls:
                state = kwargs["generator"].get_state()
                self._calls[name] = (args, kwargs, state, found(*args, **kwargs), kwargs["generator"].get_state())
            return self._calls[name][3]

        return recorded

    def drawn(self) -> torch.Tensor:
        """(N,) the classes drawn (every recorded draw's ids)."""
        ids = [result[0].reshape(-1) for _, _, _, result, _ in self._calls.values()]
        return torch.cat(ids) if ids else torch.empty(0, dtype=torch.long, device=self._sampler.device)

    def check(self, where: str) -> None:
        """KernelMismatch where a fused draw (or the stream's kernel it ran) differs from the eager one."""
        for name, (args, kwargs, state, fused, after) in self._calls.items():
            if kwargs.get("kernels") != "fused":
                continue  # an eager draw: nothing of the kernels in it
            stream = CounterRNG(device=self._sampler.device)
            stream.set_state(state)
            _check_counter_rng(stream, int(after[1] - state[1]), where)
            stream.set_state(state)
            eager = getattr(self._sampler, name)(*args, **{**kwargs, "kernels": "eager", "generator": stream})
            if not torch.equal(stream.get_state(), after):
                raise KernelMismatch(f"the fused draw advanced the random stream by {int(after[1] - state[1])} words, "
                                     f"the eager one by {int(stream.get_state()[1] - state[1])}, on {where}")
            _check_draw(fused, eager, where)


def _check_counter_rng(stream: CounterRNG, words: int, where: str) -> None:
    """The stream's kernel against CounterRNG's eager stream, bit for bit: the ``words`` float64 numbers a draw
    read, from ``stream``'s state (left as it was)."""
    state = stream.get_state()
    want = stream.rand(words, dtype=torch.float64)
    stream.set_state(state)
    got = stream.rand(words, dtype=torch.float64, fused=True)
    stream.set_state(state)
    differ = int((got != want).sum())
    if differ:
        raise KernelMismatch(f"the random stream's kernel differs from the eager stream in {differ} of {words} "
                             f"numbers on {where}")


def _check_draw(fused: tuple, eager: tuple, where: str) -> None:
    """A draw's results (ids (T, M), log q (T, M), the labels' log q (T, 1) or None, and factors or nothing),
    fused against eager from the same uniforms."""
    same = fused[0] == eager[0]
    differ = int((~same).sum())
    if differ > 2 + (1 - DRAW_AGREEMENT) * same.numel():
        raise KernelMismatch(f"the fused draw picked other classes than the eager draw from the same uniforms in "
                             f"{differ} of {same.numel()} draws (at most 2 + {1 - DRAW_AGREEMENT:.0%}) on {where}")
    pairs = [("draws' log q", fused[1][same], eager[1][same])]
    if fused[2] is not None:
        pairs.append(("labels' log q", fused[2], eager[2]))
    for name, x, ref in pairs:
        error = float(torch.where(x == ref, 0.0, (x - ref).abs()).max()) if x.numel() else 0.0  # -inf alike: 0
        if not (error <= LOG_Q_TOLERANCE):
            raise KernelMismatch(f"the fused draw's {name} differs from the eager draw's by {error:.2e} nats "
                                 f"(log Z) on {where}")
    if len(fused) > 3 and fused[3].probs is not None:
        error = _relative_error(fused[3].probs, eager[3].probs, None)
        if not (error <= PROBS_TOLERANCE):
            raise KernelMismatch(f"the fused draw's bucket probabilities differ from the eager draw's: relative error "
                                 f"{error:.2e} on {where}")


def _parts(v: int, head: torch.Tensor | None, labels: torch.Tensor, drawn: torch.Tensor) -> dict[str, torch.Tensor]:
    """The classes of a weight's (V', D) gradient, each (V',) bool: the exact head's, the drawn ones (labels and
    draws outside the head) and the others (the expected tail's spread only)."""
    in_head = torch.zeros(v, dtype=torch.bool, device=labels.device)
    if head is not None:
        in_head[head] = True
    touched = torch.zeros_like(in_head)
    touched[drawn] = True
    touched[labels[labels >= 0]] = True
    touched &= ~in_head
    return {"'s head rows": in_head, "'s drawn rows": touched, "'s other rows": ~(in_head | touched)}


def _relative_error(x: torch.Tensor, ref: torch.Tensor, rows: torch.Tensor | None) -> float:
    """max |x - ref| / max |ref| over ``rows`` of the first dimension (all where None), in float32; 0 for no rows or
    both all zero. One (V', D) temporary at a time: each row's largest error and value first, then the parts."""
    x, ref = x.float(), ref.float()
    if ref.dim() > 1:
        errors, scale = (torch.linalg.vector_norm(y, math.inf, dim=1) for y in (x - ref, ref.flatten(1)))
    else:
        errors, scale = (x - ref).abs(), ref.abs()
    if rows is not None:
        errors, scale = errors[rows], scale[rows]
    if not scale.numel():
        return 0.0
    return float(errors.max() / scale.max().clamp_min(torch.finfo(torch.float32).tiny))


__all__ = ["DRAW_AGREEMENT", "LOG_Q_TOLERANCE", "PROBE_TOKENS", "PROBS_TOLERANCE", "TAIL_ROWS", "TOLERANCE",
           "KernelMismatch", "probe_fused", "probe_vocabulary"]
