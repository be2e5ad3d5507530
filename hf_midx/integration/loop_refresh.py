"""RefreshScheduler: the index refresh schedule for a training loop of your own (plain PyTorch, Accelerate).

A Trainer gets the schedule from :class:`~hf_midx.MidxCallback`; a loop of your own gets the same one from this
object, used as an LR scheduler is: one :meth:`RefreshScheduler.step` after each optimizer step::

    scheduler = hf_midx.RefreshScheduler(model)
    for batch in loader:
        model(**batch).loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        scheduler.step()  # rebuilds the index when MidxConfig.refresh_every_steps says so

It follows ``refresh_every_steps`` (a fixed N, or ``"auto"``: N from the measured seconds of a rebuild and a step,
:mod:`hf_midx.integration.refresh_schedule`), rebuilds through :func:`hf_midx.refresh_index` (gathered, rank 0,
broadcast: every process calls ``step``) and logs each rebuild with its reason. A loop that trains a wrapped model
without it (and calls no :func:`hf_midx.refresh_index`) is told so once by the model (the binding).
"""

from __future__ import annotations

import logging

from .callback import refresh_index
from .distributed import local_device
from .head import find_head
from .refresh_schedule import RefreshSchedule

logger = logging.getLogger(__name__)


class RefreshScheduler:
    """The MIDX index refresh schedule of a wrapped model in a training loop of your own.

    Args:
        model: a model wrapped by :func:`hf_midx.wrap` (through PEFT, Accelerate or compile wrappers too).
    Attributes:
        head: the model's :class:`~hf_midx.MidxLMHead`. schedule: its
            :class:`~hf_midx.integration.refresh_schedule.RefreshSchedule`. steps: the optimizer steps counted.
        last_refresh_step: the step of the last rebuild (0: none yet).
    Raises:
        ValueError: no MIDX head; ``codebooks="learned"`` (their training steps run in MidxCallback only).
    """

    def __init__(self, model) -> None:
        head = find_head(model)
        if head is None:
            raise ValueError("RefreshScheduler needs a model whose LM head was wrapped with hf_midx.wrap(model, ...).")
        if head.config.codebooks == "learned":
            raise ValueError("RefreshScheduler: codebooks='learned' trains its codebooks at every step inside "
                             "MidxCallback; train with a Trainer and MidxCallback.install(trainer), or use 'kmeans'.")
        self.model, self.head, self.steps, self.last_refresh_step = model, head, 0, 0
        self.schedule = RefreshSchedule(head.config)
        self.schedule.start(0, head.build_seconds, local_device(head.weight))
        head.step_data.scheduled = True  # the binding's "never refreshed" warning stays quiet

    def step(self) -> float | None:
        """Count one optimizer step; rebuild the index when the schedule says so (every process calls it: a rebuild
        is collective). Returns the rebuild's seconds, or None. A frozen head, or one no call has drawn from, is
        never rebuilt."""
        self.steps += 1
        head = self.head
        head.step_data.scheduled = True
        if head.frozen or head.step_data.last_batch is None:
            return None
        chosen = self.schedule.choose(self.steps)
        if chosen is not None:
            logger.info("hf_midx: %s.", chosen)
        reason = self.schedule.due(self.steps)
        return None if reason is None else self.refresh(reason)

    def refresh(self, reason: str = "called") -> float:
        """Rebuild the index now (collective), e.g. at an epoch's start; returns and logs the seconds it took."""
        seconds = refresh_index(self.model)
        self.last_refresh_step = self.steps
        chosen = self.schedule.refreshed(self.steps, seconds)
        if chosen is not None:
            logger.info("hf_midx: %s.", chosen)
        logger.info("hf_midx: index rebuilt after step %d in %.3g s: %s.", self.steps, seconds, reason)
        return seconds

    def state_dict(self) -> dict:
        """The step count, the last rebuild's step and the interval (``accelerator.register_for_checkpointing``
        saves it); the sampler's tables are the head's (:meth:`~hf_midx.MidxLMHead.sampler_state`)."""
        return {"steps": self.steps, "last_refresh_step": self.last_refresh_step, **self.schedule.state()}

    def load_state_dict(self, state: dict) -> None:
        """Resume from :meth:`state_dict`: the next rebuild comes at the step an uninterrupted loop's would."""
        self.steps, self.last_refresh_step = int(state["steps"]), int(state["last_refresh_step"])
        saved = {"last_refresh_step": self.last_refresh_step, "refresh_interval": state.get("refresh_interval", 0)}
        self.schedule.start(self.steps, self.head.build_seconds, local_device(self.head.weight), saved)


__all__ = ["RefreshScheduler"]
