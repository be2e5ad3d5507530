"""MidxCallback: the MIDX schedule for any transformers ``Trainer`` (plain, TRL's SFTTrainer, MidxTrainer).

Install it on a Trainer whose model was wrapped with :func:`hf_midx.wrap`: ``MidxCallback.install(trainer)``
(MidxTrainer does this itself). It decides *when*; the work is in the modules it calls. It rebuilds the index
on the schedule of :mod:`hf_midx.integration.refresh_schedule` (``refresh_every_steps``: an interval chosen from the
measured cost by default, a fixed one, or never; each rebuild logged with its reason) and/or at each epoch start (:mod:`hf_midx.integration.distributed`: gathered,
rebuilt on rank 0, broadcast); trains learned codebooks every step (:mod:`hf_midx.integration.learned_codebooks`); adds to
each log entry with ``loss`` the proposal diagnostics (``midx/kl``...) and ``midx/train_loss_exact``, the exact
loss of the last micro-batch on the weights its loss saw (measured before the optimizer step; the Trainer's ``loss``
is the *sampled* objective's estimate), averaged over processes;
adds ``eval_perplexity`` to evaluation metrics and leaves TRL's NaN ``entropy`` / ``mean_token_accuracy`` out of
training logs (:mod:`hf_midx.integration.log_entries`);
writes the sampler state into every checkpoint and restores it on resume (:mod:`hf_midx.integration.checkpoint`), so a
resumed run repeats an uninterrupted one bit for bit; stops on NaN/Inf with :class:`MidxNonFiniteError`,
naming the step and the tensor (:mod:`hf_midx.integration.nonfinite`). With :meth:`install`, ``trainer.save_model`` also
writes ``midx_config.json`` and the MIDX card, and ``create_model_card`` (``push_to_hub``) that card, whatever
the Trainer class; ``callbacks=[MidxCallback()]`` writes the checkpoint state only.

No host sync per micro-batch: the head records its per-call data on the device, read at logging, evaluation,
save and refresh steps, where the Trainer syncs anyway. :meth:`install` places the callback right after the
flow callback, so that the reporting integrations see the ``midx/`` keys. Every rank runs the callback.
"""

from __future__ import annotations

import logging
import os
import warnings

import torch
from transformers import TrainerCallback
from transformers.trainer_callback import DefaultFlowCallback
from transformers.trainer_utils import IntervalStrategy

from .checkpoint import explain_tied_weights, load_head_state, read_head_state, save_head_state
from .distributed import (broadcast_sampler, full_head_weight, local_device, mean_over_ranks, refresh_head,
                          refuse_data_parallel, sampler_device)  # fmt: skip
from .head import MidxLMHead, find_head
from .learned_codebooks import CodebookTraining
from .log_prob_calls import decide_log_probs
from .log_entries import FullSoftmaxMetrics, add_perplexity
from .nonfinite import ADVICE, MidxNonFiniteError, NonFiniteCheck
from .refresh_schedule import RefreshSchedule
from .state import find_resume_folder, has_state
from .trainer_methods import wrap_trainer_methods

logger = logging.getLogger(__name__)


def refresh_index(model, *, codebooks: tuple[torch.Tensor, torch.Tensor] | None = None) -> float:
    """Rebuild a wrapped model's index from its head weight (gathered when sharded, rebuilt on rank 0, broadcast);
    returns the seconds it took. Collective. ``codebooks``: learned (K, D1), (K, D2) codebooks to adopt instead
    of k-means. Raises ValueError (no MIDX head) or MidxNonFiniteError (NaN/Inf in the head weight)."""
    head = find_head(model)
    if head is None:
        raise ValueError("refresh_index needs a model whose LM head was wrapped with hf_midx.wrap(model, ...).")
    seconds = refresh_head(head, codebooks)
    if seconds is None:
        raise MidxNonFiniteError(
            f"The LM head weight holds NaN/Inf (found during the index refresh); the index was not rebuilt. To go on, "
            f"{ADVICE}"
        )
    return seconds


class MidxCallback(TrainerCallback):
    """The MIDX schedule (refresh, learned codebooks, logging, checkpoints, NaN checks) as a ``TrainerCallback``.

    The options come from the head's :class:`~hf_midx.MidxConfig`. Put it on a Trainer with :meth:`install`.

    Args:
        resume_from_checkpoint: the folder ``trainer.train(resume_from_checkpoint=...)`` loads (read once; MidxTrainer
            sets it); else ``args.resume_from_checkpoint``, else ``<output_dir>/checkpoint-<step>``.
    Attributes:
        head: the wrapped head being trained (found at train start).
        codebooks: the :class:`~hf_midx.integration.learned_codebooks.CodebookTraining` (``codebooks="learned"``), or None.
        last_refresh_step: the optimizer step of the last refresh (-1: none since training started).
        schedule: the :class:`~hf_midx.integration.refresh_schedule.RefreshSchedule` (set at train start).
        installed: True when :meth:`install` placed it.
    """

    def __init__(self, resume_from_checkpoint: str | os.PathLike | None = None) -> None:
        if resume_from_checkpoint is not None and not isinstance(resume_from_checkpoint, (str, os.PathLike)):
            raise ValueError(
                f"resume_from_checkpoint must be a checkpoint folder path, got {type(resume_from_checkpoint).__name__}."
            )
        self.head: MidxLMHead | None = None
        self.codebooks: CodebookTraining | None = None
        self.last_refresh_step = -1
        self.schedule: RefreshSchedule | None = None
        self.resume_from_checkpoint = None if resume_from_checkpoint is None else os.fspath(resume_from_checkpoint)
        self.installed = False
        self._pending: dict[str, torch.Tensor | float] = {}
        self._nonfinite = NonFiniteCheck()
        self._saved_folder: str | None = None
        self._full_softmax = FullSoftmaxMetrics()
        self._trainer_name: str | None = None
        self._exact_before_step: torch.Tensor | None = None  # this step's midx/train_loss_exact, on the device
        self._decision = None  # the LogProbDecision of the current run, in force inside its steps

    @classmethod
    def install(cls, trainer, *, resume_from_checkpoint: str | os.PathLike | None = None) -> "MidxCallback":
        """Put a MidxCallback on ``trainer`` right after its flow callback (ahead of the reporting integrations)
        and return it; the one the trainer already has is moved rather than doubled. Also makes this trainer's
        ``save_model`` write ``midx_config.json`` and the MIDX card, and its ``create_model_card`` write that card
        (the instance's methods are wrapped; the class is untouched). Call it before ``trainer.train()``.
        ValueError when this process sees several GPUs without a distributed launch (``args.n_gpu > 1``).
        """
        refuse_data_parallel(trainer.args)
        handler = trainer.callback_handler
        callback = next((cb for cb in handler.callbacks if isinstance(cb, cls)), None) or cls()
        if resume_from_checkpoint is not None:
            callback.resume_from_checkpoint = os.fspath(resume_from_checkpoint)
        flow = next((i for i, cb in enumerate(handler.callbacks) if isinstance(cb, DefaultFlowCallback)), -1)
        later = [cb for cb in handler.callbacks[flow + 1 :] if cb is not callback]
        for cb in [callback, *later]:
            handler.pop_callback(cb)
        for cb in [callback, *later]:
            handler.add_callback(cb)
        wrap_trainer_methods(trainer, callback)  # save_model, create_model_card, train: once per instance
        if getattr(trainer, "label_smoother", None) is not None:
            # The Trainer's smoother would take the labels away from the model and smooth full logits; the head
            # smooths its sampled loss instead (MidxConfig.label_smoothing, set from the factor at train start).
            trainer.label_smoother = None
        callback.installed = True
        callback._trainer_name = type(trainer).__name__
        return callback

    # ------------------------------------------------------------------ events
    def on_train_begin(self, args, state, control, model=None, **kwargs):
        head = find_head(model)
        if head is None:
            raise ValueError(
                "MidxCallback needs a model whose LM head is a MidxLMHead: call hf_midx.wrap(model, ...) before "
                "creating the Trainer (for model_init, wrap the model inside it)."
            )
        refuse_data_parallel(args)
        # May refuse: before any step. In force only inside this run's steps (_open_step), so that it ends with the
        # run, finished or interrupted.
        self._decision = decide_log_probs(head.config.log_probs, args, self._trainer_name)
        logger.info(self._decision.reason)
        if args.label_smoothing_factor:
            self._take_label_smoothing(head, float(args.label_smoothing_factor))
        self.head, config = head, head.config
        if head.frozen:  # its weight never changes: the index built at wrap time stays right
            logger.warning("MidxCallback: the LM head is frozen (its weight and bias require no grad), so its index "
                           "is kept as built and never refreshed.")
        report_to = [args.report_to] if isinstance(args.report_to, str) else args.report_to or []
        reporters = [r for r in report_to if r != "none"]
        if reporters and not self.installed:
            warnings.warn(
                f"MidxCallback was not placed with MidxCallback.install(trainer), so the reporting integrations "
                f"{reporters} may run before it and miss the midx/ keys it adds to each log entry (log_history "
                "has them). Call MidxCallback.install(trainer) instead of passing callbacks=[MidxCallback()].",
                stacklevel=2,
            )
        self._pending, self._saved_folder, self._exact_before_step = {}, None, None
        head.step_data.clear(local_device(head.weight))  # where the model now trains
        self._nonfinite.start(state.global_step, state.epoch)
        rebuild_seconds = head.build_seconds
        if sampler_device(head) != local_device(head.weight):
            # The model moved (e.g. to the GPU): rebuild the sampler where the weight lives (and time it there).
            rebuild_seconds = refresh_head(head)
        # "auto" decided before the first step, which torch.compile may trace (where no probe runs); under bf16 /
        # fp16 mixed precision the head's products run in that dtype too.
        head.prepare_kernels(torch.bfloat16 if args.bf16 else torch.float16 if args.fp16 else None)
        seed = config.seed + args.process_index  # all ranks share rank 0's index; each draws its own negatives
        if state.global_step == 0:
            broadcast_sampler(head, seed=seed)
        self.last_refresh_step, saved = -1, None
        self.codebooks = CodebookTraining(head.sampler_state(), config) if config.codebooks == "learned" else None
        if state.global_step > 0:
            candidates = [self.resume_from_checkpoint, getattr(args, "resume_from_checkpoint", None),
                          os.path.join(args.output_dir, f"checkpoint-{state.global_step}")]  # fmt: skip
            folder = find_resume_folder(candidates, state.global_step)
            saved = read_head_state(folder, head, rank=args.process_index, world_size=args.world_size,
                                    check_extra=None if self.codebooks is None else self.codebooks.check_saved)
            load_head_state(saved, head, self.codebooks, seed=seed, rank=args.process_index)
            self.last_refresh_step = saved.last_refresh_step
            explain_tied_weights(model, head)
        self.schedule = RefreshSchedule(config)
        self.schedule.start(state.global_step, rebuild_seconds, local_device(head.weight),
                            None if saved is None else saved.metadata)
        self.resume_from_checkpoint = None

    def on_train_end(self, args, state, control, **kwargs):
        self.end_run()

    def on_step_begin(self, args, state, control, **kwargs):
        head = self.head
        if head is None:
            return
        # The run's decisions hold from here to the step's end: a run interrupted inside a step (an exception, a
        # KeyboardInterrupt) leaves nothing behind for the next one on this model once the step's forward raised
        # (the binding ends it) or train() returned (install's wrapper); outside steps nothing of it is left.
        head.step_data.scheduled = True  # the host binding's "no MidxCallback" warning stays quiet
        if head.binding is not None:
            head.binding.log_prob_decision = self._decision

    def end_run(self) -> None:
        """End this run's hold on the head: the trainer's log-prob decision and the "scheduled" mark. Called at each
        step's end and train end, and by ``install``'s ``train`` wrapper when a run stops with an exception; a later
        call with gradients and no callback then gets the exact log-probs and the warnings of a run without one."""
        head = self.head
        if head is not None and head.binding is not None:
            head.binding.end_run()
        elif head is not None:  # unwrapped since
            head.step_data.scheduled = False

    def on_epoch_begin(self, args, state, control, **kwargs):
        # A new epoch after a finished one: the Trainer sets epoch = e + 1.0 exactly at the end of epoch e
        # (a run resumed in the middle of an epoch starts with a fractional epoch and does not refresh).
        if (self.head is not None and self.head.config.refresh_every_epoch and state.global_step > 0
                and not self._idle() and state.epoch is not None and float(state.epoch).is_integer()
                and state.global_step != self.last_refresh_step):  # fmt: skip
            self.refresh(state, reason="the start of an epoch (refresh_every_epoch)")

    def on_pre_optimizer_step(self, args, state, control, **kwargs):
        # midx/train_loss_exact on the weights the step's loss saw, at the steps that will log it; kept on the
        # device until the log (no sync here). DeepSpeed's engine steps inside backward: there it is after the step.
        head = self.head
        if head is not None and head.step_data.last_batch is not None and logs_after_step(args, state):
            with full_head_weight(head) as (weight, bias):
                self._exact_before_step = mean_over_ranks(head.last_batch_exact_loss(weight, bias))

    def on_step_end(self, args, state, control, **kwargs):
        head = self.head
        if head is None:
            return
        self.end_run()  # until the next step begins (on_step_begin)
        self._nonfinite.mark(head.step_data, state.global_step, state.epoch)
        # A frozen head, or one no call has sampled from, is never rebuilt: "auto" chooses (and logs) no interval.
        idle = self._idle()
        chosen = None if idle else self.schedule.choose(state.global_step)
        if chosen is not None:
            self._chose(chosen)
        reason = self.schedule.due(state.global_step)
        refresh = reason is not None and not idle
        if refresh or control.should_log or control.should_save or control.should_evaluate \
                or control.should_training_stop or state.global_step >= state.max_steps:  # fmt: skip
            self.check_finite(state)
        if self.codebooks is not None and head.step_data.queries is not None:
            self._codebook_step(state)
        if refresh:
            self.refresh(state, reason=reason)
        if control.should_log:
            self._measure()
            if self.schedule.refresh_seconds:
                self._pending["midx/refresh_share"] = self.schedule.share()

    def on_epoch_end(self, args, state, control, **kwargs):
        if self.head is not None and control.should_log:  # logging_strategy="epoch"
            self.check_finite(state)
            self._measure()

    def on_log(self, args, state, control, logs=None, **kwargs):
        if logs is None:
            return
        # The Trainer appended a copy of this entry to log_history before calling the callbacks.
        entry = state.log_history[-1] if state.log_history else {}
        if entry.get("step") != state.global_step or any(entry.get(k) is not v for k, v in logs.items()):
            entry = {}
        values = add_perplexity(logs)
        for key in self._full_softmax.drop(logs):
            entry.pop(key, None)
        if self._pending and ("loss" in logs or "train_runtime" in logs):
            values.update({k: float(v) for k, v in self._pending.items()})
            self._pending = {}
        logs.update(values)
        entry.update(values)

    def on_predict(self, args, state, control, metrics=None, **kwargs):
        if metrics is not None:  # predict() logs nothing: its metrics get <prefix>_perplexity here
            add_perplexity(metrics)

    def on_save(self, args, state, control, **kwargs):
        folder = os.path.join(args.output_dir, f"checkpoint-{state.global_step}")
        if self.head is not None and not (self._saved_folder == os.path.abspath(folder) and has_state(folder)):
            self.save(folder, args)  # unless written before the Trainer's files (install's save_model)

    # ------------------------------------------------------------------ actions
    def refresh(self, state=None, *, reason: str = "called") -> float:
        """Rebuild the index now (collective; k-means, or the learned codebooks' hard codes); returns and logs
        the seconds it took, with ``reason``.

        Nothing else runs here, so that the seconds the schedule's budget sees are all a rebuild costs: measuring
        the proposal's ESS before and after (two O(S V) passes) cost about 5 s a rebuild at V = 262,144 on a CPU
        core, against 0.6 s for the rebuild itself. The ESS and KL stay in the logging steps' entries."""
        seconds = refresh_head(self.head, None if self.codebooks is None else self.codebooks.codebooks())
        if seconds is None:
            where = "" if state is None else f" after training step {state.global_step}"
            raise MidxNonFiniteError(
                f"MIDX training hit NaN/Inf{where}, in the LM head weight (found during the index refresh); the index "
                f"was not rebuilt. To go on, {ADVICE}"
            )
        if self.codebooks is not None:
            self.codebooks.broadcast()
        where = ""
        if state is not None:
            self.last_refresh_step = state.global_step
            where = f" after step {state.global_step}"
            if self.schedule is not None:
                chosen = self.schedule.refreshed(state.global_step, seconds)
                if chosen is not None:
                    self._chose(chosen)
        logger.info("hf_midx: index rebuilt%s in %.3g s: %s.", where, seconds, reason)
        self._pending["midx/refresh_seconds"] = seconds
        return seconds

    def save(self, folder: str, args) -> None:
        """Write the MIDX state of this rank into ``folder`` (every rank calls it)."""
        save_head_state(folder, self.head, self.codebooks, last_refresh_step=self.last_refresh_step, args=args,
                        schedule=None if self.schedule is None else self.schedule.state(), chosen=self.chosen_fields())
        self._saved_folder = os.path.abspath(folder)

    def check_finite(self, state) -> None:
        """:class:`MidxNonFiniteError` naming the step and tensor if NaN/Inf came since the last check (one sync)."""
        self._nonfinite.check(self.head, state)

    # ------------------------------------------------------------------ internals
    def _take_label_smoothing(self, head: MidxLMHead, factor: float) -> None:
        """The Trainer's ``label_smoothing_factor`` as the head's ``MidxConfig.label_smoothing``: the sampled loss
        smooths with the exact mean logit (evaluation stays the plain cross-entropy)."""
        if not self.installed:
            raise ValueError(
                "label_smoothing_factor with MIDX needs MidxCallback.install(trainer) (MidxTrainer does it), which "
                "hands the factor to the head: with callbacks=[MidxCallback()] the Trainer's label smoother takes the "
                "labels away and smooths the full logits. Install the callback, or set MidxConfig(label_smoothing=...)."
            )
        if head.config.label_smoothing not in (0.0, factor):
            raise ValueError(
                f"label_smoothing_factor={factor} and MidxConfig(label_smoothing={head.config.label_smoothing}) "
                "differ; set one of them."
            )
        head.config = head.config.replace(label_smoothing=factor)

    def _codebook_step(self, state) -> None:
        """One Adam step of the learned codebooks on the head weight and the step's hidden states."""
        head = self.head
        try:
            with full_head_weight(head) as (weight, _):
                out = self.codebooks.step(weight, head.step_data.queries * head.logit_scale)
        except ValueError:
            self.check_finite(state)  # NaN in the weight or the queries: say where it came from
            raise
        self._pending["midx/codebook_loss"], self._pending["midx/codebook_kl"] = out["loss"], out["kl"]

    def _idle(self) -> bool:
        """True where an index rebuild would serve nothing: the head is frozen (its weight never changes), or no
        training call of this run has drawn from the sampler (e.g. DPO or GRPO, whose log-prob calls are exact)."""
        return self.head.frozen or self.head.step_data.last_batch is None

    def chosen_fields(self) -> dict[str, int]:
        """What the config's ``"auto"`` fields became in training, for ``midx_config.json`` (``exact_head`` is a
        number from the wrap on)."""
        return {} if self.schedule is None else self.schedule.chosen()

    def _chose(self, message: str) -> None:
        """An interval chosen by the ``"auto"`` schedule: in the log, and in the next log entry."""
        logger.info("hf_midx: %s.", message)
        self._pending["midx/refresh_interval"] = float(self.schedule.interval)

    def _measure(self) -> None:
        """The proposal diagnostics and the exact loss of the last micro-batch (measured before the optimizer
        step where :func:`logs_after_step` foresaw the log), for the next log entry."""
        head = self.head
        if head.step_data.queries is None:
            return
        with full_head_weight(head) as (weight, bias):
            if head.config.log_kl:
                # KL(Q||P) stays "midx/kl"; what predicts training quality is the missed mass of P:
                # KL(P||Q), the effective sample size, P's mass where p/q > 10 (hf_midx.integration.diagnostics).
                for key, value in head.proposal_diagnostics(head.step_data.queries, weight, bias).items():
                    if key != "head_mass" or head.exact_ids is not None:
                        self._pending["midx/kl" if key == "kl_qp" else f"midx/{key}"] = mean_over_ranks(value)
            if self._exact_before_step is None:  # a log no step foresaw (logging_strategy="epoch")
                self._exact_before_step = mean_over_ranks(head.last_batch_exact_loss(weight, bias))
            self._pending["midx/train_loss_exact"] = self._exact_before_step
        self._exact_before_step = None
        if head.step_data.z_loss is not None:  # the last micro-batch's, as the exact loss
            self._pending["midx/z_loss"] = mean_over_ranks(head.step_data.z_loss.float())


def logs_after_step(args, state) -> bool:
    """True when the optimizer step about to be taken (``state.global_step + 1``) is one the Trainer's flow
    callback logs after: the first with ``logging_first_step``, or a multiple of ``logging_steps``. A
    ``logging_strategy="epoch"`` log is not foreseen (the epoch's last step is not known here)."""
    step = state.global_step + 1
    if step == 1 and args.logging_first_step:
        return True
    return args.logging_strategy == IntervalStrategy.STEPS and step % state.logging_steps == 0


__all__ = ["MidxCallback", "MidxNonFiniteError", "logs_after_step", "refresh_index"]
