"""Where NaN/Inf appeared in MIDX training: the optimizer step and the tensor, found without a sync per step.

The head records, on the device, the first sampled call whose loss was not finite (``head.step_data``;
whether the hidden states were the cause is read from the last kept batch when the check runs). :class:`NonFiniteCheck` keeps a copy of the device call counter at the end of
every optimizer step and, when the callback checks (at logging, evaluation, save and refresh steps,
where the Trainer syncs anyway), maps that call back to its step; the ranks agree on the earliest.
"""

from __future__ import annotations

import torch

from .distributed import is_distributed, local_device, min_over_ranks, weight_finite

_NO_STEP = 1 << 62
ADVICE = "lower the learning rate, clip gradients (max_grad_norm) or check the inputs, then resume from the last " \
         "good checkpoint."  # fmt: skip


class MidxNonFiniteError(FloatingPointError):
    """Training produced NaN or Inf; the message names the step and the tensor (loss, hidden states, head weight)."""


class NonFiniteCheck:
    """The end-of-step call counts since the last check, and the check itself."""

    def __init__(self) -> None:
        self._marks: dict[int, tuple[torch.Tensor | int | None, float | None]] = {}

    def start(self, step: int, epoch: float | None) -> None:
        """Training (re)starts at ``step``: no call of this run before it."""
        self._marks = {step: (0, epoch)}

    def mark(self, step_data, step: int, epoch: float | None) -> None:
        """Step ``step`` ended: keep a copy of the device call counter (reading it would sync)."""
        counter = step_data.call_counter
        self._marks[step] = (None if counter is None else counter.clone(), epoch)

    def check(self, head, state) -> None:
        """Raise :class:`MidxNonFiniteError` if a training call since the last check produced NaN/Inf, naming
        the optimizer step and the tensor, or if the head weight holds NaN/Inf now. One sync; collective."""
        bad = head.step_data.first_nonfinite_call()  # (call index, tensor name) or None
        weight_bad = not weight_finite(head.weight)
        step, epoch = _NO_STEP, None
        if bad is not None:  # the first step whose end-of-step call count passed the bad call
            ends = sorted((s, 0 if c is None else int(c), ep) for s, (c, ep) in self._marks.items())
            step, epoch = next(((s, ep) for s, c, ep in ends if c > bad[0]), (state.global_step, state.epoch))
        if is_distributed():
            flags = min_over_ranks(torch.tensor([step, -int(weight_bad)], device=local_device(head.weight)))
            if int(flags[0]) != step:
                bad, step, epoch = (0, "loss or hidden states of another process"), int(flags[0]), None
            weight_bad = bool(flags[1] < 0)
        if state.global_step not in self._marks:
            self.mark(head.step_data, state.global_step, state.epoch)
        self._marks = {state.global_step: self._marks[state.global_step]}
        if bad is None and not weight_bad:
            return
        head.step_data.clear()
        stopped = "Training was stopped instead of continuing on NaN; " + ADVICE
        if bad is None:
            raise MidxNonFiniteError(
                f"MIDX training hit NaN/Inf after training step {state.global_step}, in the LM head weight. {stopped}"
            )
        cause = bad[1]
        if cause == "loss":  # finite hidden states, a non-finite loss: the head rows (or bias) it read, or overflow
            cause = "LM head weight" if weight_bad else "loss (its input hidden states were finite)"
        where = f"training step {step}" + ("" if epoch is None else f" (epoch {epoch:.2f})")
        raise MidxNonFiniteError(f"MIDX training hit NaN/Inf at {where}, in the {cause}. {stopped}")


__all__ = ["ADVICE", "MidxNonFiniteError", "NonFiniteCheck"]
