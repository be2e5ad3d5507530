"""When :class:`hf_midx.MidxCallback` rebuilds the index: never, every N steps, or at an interval chosen from cost.

``MidxConfig.refresh_every_steps``: 0 never, an integer N every N optimizer steps, ``"auto"`` (the default)
every N steps with N chosen from what a rebuild and a step cost on this machine: the smallest N whose
rebuilds take at most ``refresh_budget`` of the training time,

    N = ceil(rebuild_seconds * (1 - budget) / (budget * step_seconds)),

kept within [``refresh_min_steps``, ``refresh_max_steps``]. The rebuild's seconds are the last build's
(the one at wrap, then each refresh's, gathered and broadcast included); a step's are the wall-clock
seconds between optimizer steps since the last choice, rebuilds left out. N is chosen first after
``min(10, refresh_min_steps)`` steps and again after every rebuild, and it is the maximum over the
processes (each times its own steps), so every rank rebuilds at the same steps. A re-chosen N replaces
the current one only when it is more than :data:`RECHOOSE_FACTOR` times larger or smaller: on a shared
machine a rebuild's and a step's seconds jitter by tens of percent (a V = 100,000 run's interval went
50 -> 64 -> 50 while tests shared its core), and a schedule that followed them would make the same seeded run
rebuild at other steps; the share of time stays within the budget times that factor (4.5% at 3%).

Why a fixed interval and not a rebuild "when the index has gone stale" (the proposal's ESS against its
value after the last build): the budget already bounds the interval from below, so a staleness test could
only delay rebuilds, which saves at most the budget (a few % of the time) and can only lose quality. The
proposal's ESS and KL(P‖Q) in the logging steps' entries are the evidence that the interval was not too long;
a rebuild itself measures nothing (its seconds are all the budget sees).

The state that fixes the next rebuild (the interval, :meth:`RefreshSchedule.state`, and the step of the last
rebuild, which the callback saves anyway) goes into every checkpoint, so a resumed run rebuilds at the steps of an uninterrupted one.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable

import torch

from .distributed import max_over_ranks

#: How far (a ratio) a re-chosen interval must move from the current one to replace it (see the module docstring).
RECHOOSE_FACTOR = 1.5

#: Steps timed before the first choice (fewer when ``refresh_min_steps`` is smaller); step 1 is left out
#: where there are more (it holds the warm-up: allocations, compilation).
PROBE_STEPS = 10


def cost_interval(rebuild_seconds: float, step_seconds: float, budget: float, low: int, high: int) -> int:
    """The interval N (steps) at which rebuilds of ``rebuild_seconds`` take ``budget`` of the time of steps of
    ``step_seconds``, within [``low``, ``high``]: the module docstring's formula."""
    if step_seconds <= 0:
        return high
    steps = math.ceil(rebuild_seconds * (1.0 - budget) / (budget * step_seconds))
    return min(max(steps, low), high)


class RefreshSchedule:
    """The refresh schedule of one training run (every rank holds one and decides the same).

    Args:
        config: the head's :class:`~hf_midx.MidxConfig` (``refresh_every_steps``, ``refresh_budget``,
            ``refresh_min_steps``, ``refresh_max_steps``).
        clock: seconds, monotonic (``time.perf_counter``; a test passes its own).
    Attributes:
        interval: N, the steps between rebuilds; 0 for never, and in ``"auto"`` until chosen.
        last_refresh_step: the optimizer step of the last rebuild (0: none since the start of training).
        refresh_seconds: the seconds of this process's rebuilds since training (re)started.
    """

    def __init__(self, config, clock: Callable[[], float] = time.perf_counter) -> None:
        every = config.refresh_every_steps
        self.auto = every == "auto"
        self.budget, self.low, self.high = config.refresh_budget, config.refresh_min_steps, config.refresh_max_steps
        self.interval = 0 if self.auto else int(every)
        self.last_refresh_step = 0
        self.refresh_seconds = 0.0
        self.rebuild_seconds: float | None = None
        self._clock = clock
        self._timer: tuple[int, float] | None = None  # (step, clock) where step timing started
        self._device = torch.device("cpu")
        self._started = 0.0

    def start(self, step: int, rebuild_seconds: float | None, device: torch.device, saved: dict | None = None) -> None:
        """Training (re)starts after ``step`` optimizer steps; ``rebuild_seconds``: the last build's seconds;
        ``device``: where this process's collectives run; ``saved``: a checkpoint's :meth:`state`."""
        self.rebuild_seconds, self._device = rebuild_seconds, device
        self.last_refresh_step, self.refresh_seconds = 0, 0.0
        if saved:
            self.last_refresh_step = max(int(saved.get("last_refresh_step", 0)), 0)  # -1: none before
            if self.auto and "refresh_interval" in saved:
                self.interval = int(saved["refresh_interval"])
        self._started = self._clock()
        self._timer = (step, self._started)

    def choose(self, step: int) -> str | None:
        """Called after each optimizer step (every rank): in ``"auto"``, chooses the first interval at the probe
        step (a collective, at the same step on every rank) and returns what it chose, for the log; else None."""
        if not self.auto or self.interval:
            return None
        probe = min(PROBE_STEPS, self.low)
        if step == 1 and probe > 1:
            self._timer = (1, self._clock())  # leave step 1's warm-up out
        return self._choose(step, first=True) if step >= probe else None

    def due(self, step: int) -> str | None:
        """Why to rebuild after optimizer step ``step``, or None (the same answer on every rank)."""
        if not self.interval:
            return None
        if not self.auto:  # today's fixed schedule: the multiples of N, whatever rebuilt in between
            return f"step {step} is a multiple of refresh_every_steps={self.interval}" if step % self.interval == 0 else None
        if step - self.last_refresh_step >= self.interval:
            return (f"{step - self.last_refresh_step} steps since the last rebuild (refresh_every_steps='auto': every "
                    f"{self.interval}, chosen from the measured cost)")
        return None

    def refreshed(self, step: int, seconds: float) -> str | None:
        """A rebuild after ``step`` took ``seconds``; in ``"auto"``, re-chooses the interval (collective) and
        returns a message when it changed."""
        self.last_refresh_step = step
        self.refresh_seconds += seconds
        self.rebuild_seconds = seconds
        if not self.auto or self.interval == 0:
            return None
        before = self.interval
        message = self._choose(step, first=False)
        return message if self.interval != before else None

    def share(self) -> float:
        """The rebuilds' share of this process's wall-clock time since training (re)started."""
        elapsed = self._clock() - self._started
        return self.refresh_seconds / elapsed if elapsed > 0 else 0.0

    def chosen(self) -> dict[str, int]:
        """What ``"auto"`` became, for ``midx_config.json``: ``{"refresh_every_steps": N}``; empty before the first
        choice and for a fixed schedule."""
        return {"refresh_every_steps": self.interval} if self.auto and self.interval else {}

    def state(self) -> dict[str, str]:
        """What a checkpoint keeps (strings, for the safetensors metadata)."""
        return {"refresh_interval": str(self.interval)}  # the step of the last rebuild is saved beside it

    # ------------------------------------------------------------------ internals
    def _choose(self, step: int, *, first: bool) -> str | None:
        start_step, start_time = self._timer
        now = self._clock()
        steps = max(step - start_step, 1)
        # A rebuild just measured is not a training step: leave its seconds out of the step time.
        spent = 0.0 if first else (self.rebuild_seconds or 0.0)
        step_seconds = max(now - start_time - spent, 0.0) / steps
        rebuild = self.rebuild_seconds if self.rebuild_seconds is not None else 0.0
        local = cost_interval(rebuild, step_seconds, self.budget, self.low, self.high)
        # Each rank timed its own steps: the maximum, so that every rank rebuilds at the same steps (and takes
        # the same decision below).
        chosen = int(max_over_ranks(torch.tensor([local], dtype=torch.long, device=self._device)).item())
        self._timer = (step, now)
        if not first and self.interval and self.interval / RECHOOSE_FACTOR <= chosen <= self.interval * RECHOOSE_FACTOR:
            return None  # within the measurements' jitter: the rebuild steps stay as they were
        self.interval = chosen
        bound = {self.low: " (the floor, refresh_min_steps)", self.high: " (the ceiling, refresh_max_steps)"}
        return (f"refresh_every_steps='auto': every {self.interval} steps{bound.get(self.interval, '')}, from a "
                f"rebuild of {rebuild:.3g} s and a step of {step_seconds:.3g} s at a budget of {self.budget:.0%} "
                f"of training time (chosen after step {step})")


__all__ = ["PROBE_STEPS", "RECHOOSE_FACTOR", "RefreshSchedule", "cost_interval"]
