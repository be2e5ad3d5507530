"""MidxCallback: the MIDX schedule for any transformers ``Trainer`` (plain, TRL's SFTTrainer, MidxTrainer).

Install it on a Trainer whose model was wrapped with :func:`hf_midx.wrap`:
``MidxCallback.install(trainer)`` (MidxTrainer does this itself). It

* refreshes the index from the current head weight every ``refresh_every_steps`` optimizer steps
  and/or at the start of every epoch (warm-started k-means, or the learned codebooks' hard codes), on
  rank 0, broadcast to the other ranks (:func:`refresh_index`), and logs ``midx/refresh_seconds``;
* with ``codebooks="learned"`` trains a :class:`~hf_midx.LearnableCodebooks` every optimizer step
  (its own Adam, ``codebook_learning_rate``, on the detached head weight and the step's
  ``kl_queries`` hidden states; gradients averaged over ranks) and logs ``midx/codebook_loss`` and
  ``midx/codebook_kl``;
* at every logging step adds to the Trainer's log entry (the one with ``loss``): ``midx/kl``, the
  sampler's KL(Q || softmax) on ``kl_queries`` recent training hidden states, and
  ``midx/train_loss_exact``, the exact full-softmax loss of the last micro-batch (one chunked pass,
  no (tokens x V) tensor), both averaged over processes. The Trainer's own ``loss`` is the *sampled*
  estimate that MIDX trains on; compare ``midx/train_loss_exact`` with a full-softmax run's ``loss``;
* writes the sampler state into every ``checkpoint-N/`` (:mod:`hf_midx.state`) and restores it when
  training resumes, so a resumed run repeats an uninterrupted one bit for bit;
* stops training with :class:`MidxNonFiniteError`, naming the optimizer step and the tensor (the
  LM head's input hidden states, the loss, the LM head weight), when NaN/Inf appears.

No host sync per micro-batch: the head records its per-call data on the device, and the callback reads
it at logging, evaluation, save and refresh steps (where the Trainer syncs anyway) and at the last step.
The learned codebooks' step (``codebooks="learned"``) validates its inputs, one sync per optimizer step.

A callback gets no handle on its Trainer, and this one looks at no call frames: what it needs beyond
the event arguments is given to it. :meth:`MidxCallback.install` places it right after the Trainer's
flow callback, so that the reporting integrations (TensorBoard, W&B, ...), which run in list order,
see the ``midx/`` keys it adds to a log entry (``callbacks=[MidxCallback()]`` puts it after them). A
resumed run's sampler state is read from ``MidxCallback(resume_from_checkpoint=...)`` (MidxTrainer
sets it from ``train``'s argument), else ``args.resume_from_checkpoint``, else
``<output_dir>/checkpoint-<step>``: the first of these whose ``trainer_state.json`` has the step
training resumes at.

Distributed: every rank must run the callback (the Trainer does). FSDP2 heads (``DTensor`` weights)
are gathered with ``full_tensor()`` and DeepSpeed ZeRO-3 ones with ``GatheredParameters`` for each
refresh, KL measurement, codebook step and exact loss. Tested on CPU with DDP (gloo) and with FSDP2
(``fully_shard``, gloo, custom loop); DeepSpeed ZeRO-3 is untested. FSDP1 (flat parameters) is not
supported.
"""

from __future__ import annotations

import contextlib
import json
import os
import time
import warnings

import torch
import torch.distributed as dist
from torch import nn
from transformers import TrainerCallback
from transformers.trainer_callback import DefaultFlowCallback

from .codebooks import LearnableCodebooks
from .diagnostics import proposal_diagnostics
from .head import MidxLMHead, find_head
from .samplers import MidxSampler
from .state import MIDX_STATE_NAME, apply_state, has_state, read_state, sampler_tensors, save_state

_NO_STEP = 1 << 62


def _counter_copy(head) -> torch.Tensor | None:
    """A copy of the head's device call counter (None before its first sampled call); no sync."""
    counter = head.step_data.call_counter
    return None if counter is None else counter.clone()


class MidxNonFiniteError(FloatingPointError):
    """Training produced NaN or Inf; the message names the step and the tensor (loss, hidden states, head weight)."""


# ---------------------------------------------------------------------------------------- distributed
def _distributed() -> bool:
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def _rank() -> int:
    return dist.get_rank() if _distributed() else 0


def _mean_over_ranks(value: torch.Tensor) -> torch.Tensor:
    if _distributed():
        value = value.detach().clone()
        dist.all_reduce(value)
        value = value / dist.get_world_size()
    return value


@contextlib.contextmanager
def full_head_weight(head: MidxLMHead):
    """The head's full (V, D) weight and (V,) bias (or None), detached; gathered when sharded.

    FSDP2 ``DTensor`` parameters: ``full_tensor()``; DeepSpeed ZeRO-3 partitioned parameters:
    ``deepspeed.zero.GatheredParameters``. Both are collectives: every rank must enter together.
    """
    weight, bias = head.weight, head.bias
    if callable(getattr(weight, "full_tensor", None)):  # FSDP2 / tensor-parallel DTensor
        full_bias = bias.full_tensor() if callable(getattr(bias, "full_tensor", None)) else bias
        yield weight.full_tensor().detach(), None if full_bias is None else full_bias.detach()
    elif getattr(weight, "ds_id", None) is not None:  # DeepSpeed ZeRO-3 (untested)
        import deepspeed

        params = [p for p in (weight, bias) if p is not None]
        with deepspeed.zero.GatheredParameters(params, modifier_rank=None):
            yield weight.detach(), None if bias is None else bias.detach()
    else:
        yield weight.detach(), None if bias is None else bias.detach()


def broadcast_sampler(head: MidxLMHead) -> None:
    """Give every rank rank 0's sampler tensors (codebooks, codes, bucket tables); not the generator."""
    if not _distributed():
        return
    state = {k: v.contiguous().clone() for k, v in sampler_tensors(head).items()}
    for key in sorted(state):
        dist.broadcast(state[key], src=0)
    if dist.get_rank() != 0:
        head.sampler.load_state_dict(state)


def _weight_finite(weight: torch.Tensor) -> bool:
    local = weight.to_local() if callable(getattr(weight, "to_local", None)) else weight
    return local.numel() == 0 or bool(torch.isfinite(local.detach()).all())


def _refresh_head(head: MidxLMHead, codebooks: tuple[torch.Tensor, torch.Tensor] | None = None) -> float:
    start = time.perf_counter()
    with full_head_weight(head) as (weight, _):
        if not bool(torch.isfinite(weight).all()):  # on every rank, so that all of them stop
            raise MidxNonFiniteError(
                "The LM head weight holds NaN/Inf (found during the index refresh); the index was not rebuilt. "
                "Lower the learning rate or clip gradients (max_grad_norm), then resume from the last good "
                "checkpoint."
            )
        if _rank() == 0:
            if codebooks is not None:
                head.sampler.set_codebooks(codebooks, weight)
            else:
                head.refresh(weight)
    broadcast_sampler(head)
    return time.perf_counter() - start


def refresh_index(model: nn.Module, *, codebooks: tuple[torch.Tensor, torch.Tensor] | None = None) -> float:
    """Rebuild a wrapped model's index from its current head weight; returns the seconds it took.

    Gathers a sharded weight (FSDP2 ``DTensor``: ``full_tensor()``; DeepSpeed ZeRO-3: gathered
    parameters), rebuilds on rank 0 and broadcasts the sampler tensors when a process group is up, so
    every rank holds the same index. Collective: every rank must call it. For custom training loops
    (:class:`MidxCallback` calls it on its schedule).

    Args:
        model: a model wrapped with :func:`hf_midx.wrap` (or any module containing its head).
        codebooks: the learned codebooks to adopt (MIDX samplers) instead of re-running k-means.
    Raises:
        ValueError: the model has no MIDX head.
        MidxNonFiniteError: the head weight holds NaN/Inf.
    """
    head = find_head(model)
    if head is None:
        raise ValueError("refresh_index needs a model whose LM head was wrapped with hf_midx.wrap(model, ...).")
    return _refresh_head(head, codebooks)


def refuse_data_parallel(args) -> None:
    """ValueError when one process sees several GPUs (``args.n_gpu > 1``) without a distributed launch.

    The Trainer would then wrap the model in ``torch.nn.DataParallel``, whose replicas share neither the
    head's sampler nor its per-step data; one process per GPU (DDP) is the supported way.
    """
    n_gpu = getattr(args, "n_gpu", 1)
    if n_gpu > 1:
        raise ValueError(
            f"This single process sees {n_gpu} GPUs, so the Trainer would use torch.nn.DataParallel, which the MIDX "
            f"head does not support. Launch one process per GPU (`accelerate launch --multi_gpu --num_processes "
            f"{n_gpu} ...` or `torchrun --nproc_per_node {n_gpu} ...`), or use one GPU (CUDA_VISIBLE_DEVICES=0)."
        )


# ---------------------------------------------------------------------------------------- the callback
class MidxCallback(TrainerCallback):
    """The MIDX schedule (refresh, learned codebooks, logging, checkpoints, NaN checks) as a ``TrainerCallback``.

    The options come from the head's :class:`~hf_midx.MidxConfig`. Put it on a Trainer with
    :meth:`install`, which places it ahead of the reporting integrations.

    Args:
        resume_from_checkpoint: the checkpoint folder that ``trainer.train(resume_from_checkpoint=...)``
            loads, when it is not ``<output_dir>/checkpoint-<step>``: the sampler state is read from it
            when training resumes (once; MidxTrainer sets it from ``train``'s argument).

    Attributes:
        head: the wrapped head being trained (found at train start).
        codebook_learner, codebook_optimizer: the learned codebooks and their Adam, or None.
        last_refresh_step: the optimizer step of the last refresh (-1: none since training started).
        resume_from_checkpoint: as the argument; cleared once training has started.
        installed: True when :meth:`install` placed it.
    """

    def __init__(self, resume_from_checkpoint: str | os.PathLike | None = None) -> None:
        if resume_from_checkpoint is not None and not isinstance(resume_from_checkpoint, (str, os.PathLike)):
            raise ValueError(
                f"resume_from_checkpoint must be a checkpoint folder path, got {type(resume_from_checkpoint).__name__}."
            )
        self.head: MidxLMHead | None = None
        self.codebook_learner: LearnableCodebooks | None = None
        self.codebook_optimizer: torch.optim.Optimizer | None = None
        self.last_refresh_step = -1
        self.resume_from_checkpoint = None if resume_from_checkpoint is None else os.fspath(resume_from_checkpoint)
        self.installed = False
        self._pending: dict[str, torch.Tensor | float] = {}
        self._marks: dict[int, tuple[int, float | None]] = {}  # step -> (head.sampled_calls, epoch) at its end
        self._saved_folder: str | None = None
        self._rank, self._world = 0, 1

    @classmethod
    def install(cls, trainer, *, resume_from_checkpoint: str | os.PathLike | None = None) -> "MidxCallback":
        """Put a MidxCallback on ``trainer`` right after its flow callback, ahead of the reporting
        integrations, and return it; the one the trainer already has is moved rather than doubled.

        Uses only ``trainer.callback_handler``'s public ``callbacks``, ``pop_callback`` and
        ``add_callback``. Call it before ``trainer.train()``.

        Args:
            trainer: a ``transformers.Trainer`` (or subclass: TRL's SFTTrainer, MidxTrainer).
            resume_from_checkpoint: as the constructor's argument.
        Raises:
            ValueError: this process sees several GPUs without a distributed launch (``args.n_gpu > 1``):
                the Trainer would use ``torch.nn.DataParallel``, which the MIDX head does not support.
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
        callback.installed = True
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
        if args.label_smoothing_factor:
            raise ValueError(
                "MIDX training cannot use label_smoothing_factor: the Trainer's label smoother needs the full logits, "
                "so it would train the full softmax. Set label_smoothing_factor=0."
            )
        self.head = head
        self._rank, self._world = args.process_index, args.world_size
        if (
            state.global_step == 0
            and head.sampler.query_dependent
            and not head.config.refresh_every_steps
            and state.num_train_epochs <= 1
        ):
            # Epoch-start refreshes never fire in a run of one epoch or less: the index would stay the one
            # built on the initial weights, and the proposal would drift away from the model's softmax.
            warnings.warn(
                f"MidxCallback: this run is {state.max_steps} steps, at most one epoch, and the {head.sampler.name} "
                "index is only rebuilt at epoch starts, so it would keep the initial weights' index for the whole "
                "run. Set MidxConfig(refresh_every_steps=N) (e.g. 100).",
                stacklevel=2,
            )
        report_to = args.report_to or []
        reporters = [r for r in ([report_to] if isinstance(report_to, str) else report_to) if r != "none"]
        if reporters and not self.installed:
            warnings.warn(
                f"MidxCallback was not placed with MidxCallback.install(trainer), so the reporting integrations "
                f"{reporters} may run before it and miss the midx/ keys it adds to each log entry (log_history "
                "has them). Call MidxCallback.install(trainer) instead of passing callbacks=[MidxCallback()].",
                stacklevel=2,
            )
        self._pending, self._saved_folder = {}, None
        head.step_data.clear()
        head.step_data.scheduled = True  # the host binding's "no MidxCallback" warning stays quiet
        self._marks = {state.global_step: (0, state.epoch)}
        if head.sampler.device != _local_device(head.weight):
            _refresh_head(head)  # the model moved (e.g. to the GPU): rebuild the sampler where the weight lives
        saved = None
        if state.global_step > 0:
            folder = self._resume_folder(args, state)
            saved = read_state(folder, head, rank=self._rank, world_size=self._world)
        else:
            # All ranks start from rank 0's index; each draws its own negatives.
            broadcast_sampler(head)
            head.sampler.generator.manual_seed(head.config.seed + self._rank)
            self.last_refresh_step = -1
        self.codebook_learner = self.codebook_optimizer = None
        if head.config.codebooks == "learned":
            if not isinstance(head.sampler, MidxSampler):
                raise ValueError(
                    f"codebooks='learned' needs a MIDX sampler, but the head's sampler is {head.sampler.name!r}."
                )
            index = head.sampler.index
            self.codebook_learner = LearnableCodebooks(
                tuple(c.clone() for c in index.codebooks), index.quantizer, kl_weight=head.config.kl_weight
            ).to(index.device)
            self.codebook_optimizer = torch.optim.Adam(
                self.codebook_learner.parameters(), lr=head.config.codebook_learning_rate
            )
        if saved is not None:
            apply_state(
                saved,
                head,
                seed=head.config.seed + self._rank,
                learner=self.codebook_learner,
                optimizer=self.codebook_optimizer,
            )
            self.last_refresh_step = saved.last_refresh_step
        self.resume_from_checkpoint = None

    def on_train_end(self, args, state, control, **kwargs):
        if self.head is not None:
            self.head.step_data.scheduled = False

    def on_epoch_begin(self, args, state, control, **kwargs):
        # A new epoch after a finished one: the Trainer sets epoch = e + 1.0 exactly at the end of epoch e
        # (a run resumed in the middle of an epoch starts with a fractional epoch and does not refresh).
        if (
            self.head is not None
            and self.head.config.refresh_every_epoch
            and state.global_step > 0
            and state.epoch is not None
            and float(state.epoch).is_integer()
            and state.global_step != self.last_refresh_step
        ):
            self.refresh(state)

    def on_step_end(self, args, state, control, **kwargs):
        head = self.head
        if head is None:
            return
        # The device counter itself (a copy), not its value: reading it here would sync every step.
        self._marks[state.global_step] = (_counter_copy(head), state.epoch)
        config = head.config
        refresh = bool(config.refresh_every_steps) and state.global_step % config.refresh_every_steps == 0
        if (
            refresh
            or control.should_log
            or control.should_save
            or control.should_evaluate
            or control.should_training_stop
            or state.global_step >= state.max_steps
        ):
            self.check_finite(state)
        if self.codebook_learner is not None:
            self._codebook_step(state)
        if refresh:
            self.refresh(state)
        if control.should_log:
            self._measure(log_kl=config.log_kl)

    def on_epoch_end(self, args, state, control, **kwargs):
        if self.head is not None and control.should_log:  # logging_strategy="epoch"
            self.check_finite(state)
            self._measure(log_kl=self.head.config.log_kl)

    def on_log(self, args, state, control, logs=None, **kwargs):
        if not self._pending or logs is None or not ("loss" in logs or "train_runtime" in logs):
            return
        values = {k: float(v) for k, v in self._pending.items()}
        self._pending = {}
        logs.update(values)
        # The Trainer appended a copy of this entry to log_history before calling the callbacks.
        entry = state.log_history[-1] if state.log_history else None
        if entry is not None and entry.get("step") == state.global_step and entry.get("loss") == logs.get("loss"):
            entry.update(values)

    def on_save(self, args, state, control, **kwargs):
        if self.head is None:
            return
        folder = os.path.join(args.output_dir, f"checkpoint-{state.global_step}")
        if self._saved_folder == os.path.abspath(folder) and has_state(folder):
            return  # already written before the Trainer's files (MidxTrainer)
        self.save(folder, args)

    # ------------------------------------------------------------------ actions
    def refresh(self, state=None) -> float:
        """Rebuild the index now (collective); returns the seconds it took and logs them.

        k-means mode: warm-started k-means; learned mode: the learned codebooks' hard codes.
        """
        codebooks = None
        if self.codebook_learner is not None:
            # Clones: the index must not alias the learner's parameters, which Adam updates in place.
            codebooks = tuple(c.clone() for c in self.codebook_learner.codebooks)
        try:
            seconds = _refresh_head(self.head, codebooks)
        except MidxNonFiniteError as err:
            where = "" if state is None else f" after training step {state.global_step}"
            raise MidxNonFiniteError(
                f"MIDX training hit NaN/Inf{where}, in the LM head weight (found during the index refresh). "
                "Lower the learning rate or clip gradients (max_grad_norm), then resume from the last good checkpoint."
            ) from err
        if self.codebook_learner is not None and _distributed():
            with torch.no_grad():
                for p in self.codebook_learner.parameters():
                    dist.broadcast(p.data, src=0)
        if state is not None:
            self.last_refresh_step = state.global_step
        self._pending["midx/refresh_seconds"] = seconds
        return seconds

    def save(self, folder: str, args) -> None:
        """Write the MIDX state of this rank into ``folder`` (every rank calls it)."""
        save_state(
            folder,
            self.head,
            last_refresh_step=self.last_refresh_step,
            learner=self.codebook_learner,
            optimizer=self.codebook_optimizer,
            rank=args.process_index,
            world_size=args.world_size,
            write_shared=args.should_save,
        )
        self._saved_folder = os.path.abspath(folder)

    def check_finite(self, state) -> None:
        """Raise :class:`MidxNonFiniteError` if a training call since the last check produced NaN/Inf,
        naming the optimizer step and the tensor; or if the head weight holds NaN/Inf now. One sync."""
        head = self.head
        bad = head.step_data.first_nonfinite_call()
        weight_bad = not _weight_finite(head.weight)
        step, epoch = _NO_STEP, None
        if bad is not None:
            marks = {s: (int(c) if c is not None else 0, ep) for s, (c, ep) in self._marks.items()}
            for s in sorted(marks):
                calls, ep = marks[s]
                if calls > bad[0]:
                    step, epoch = s, ep
                    break
            else:
                step, epoch = state.global_step, state.epoch
        if _distributed():
            flags = torch.tensor([step, -int(weight_bad)], dtype=torch.long, device=_local_device(head.weight))
            dist.all_reduce(flags, op=dist.ReduceOp.MIN)
            if int(flags[0]) != step:
                bad, step, epoch = (0, "loss or hidden states of another process"), int(flags[0]), None
            weight_bad = bool(flags[1] < 0)
        self._marks = {state.global_step: self._marks.get(state.global_step, (_counter_copy(head), state.epoch))}
        if bad is None and not weight_bad:
            return
        head.step_data.clear()
        advice = (
            "Training was stopped instead of continuing on NaN; lower the learning rate, clip gradients "
            "(max_grad_norm) or check the inputs, then resume from the last good checkpoint."
        )
        if bad is None:
            raise MidxNonFiniteError(
                f"MIDX training hit NaN/Inf after training step {state.global_step}, in the LM head weight. {advice}"
            )
        cause = bad[1]
        if cause == "loss":
            # Finite hidden states and a non-finite loss: the head rows (or bias) the loss read, or overflow.
            cause = "LM head weight" if weight_bad else "loss (its input hidden states were finite)"
        where = f"training step {step}" + ("" if epoch is None else f" (epoch {epoch:.2f})")
        raise MidxNonFiniteError(f"MIDX training hit NaN/Inf at {where}, in the {cause}. {advice}")

    # ------------------------------------------------------------------ internals
    def _codebook_step(self, state) -> None:
        """One Adam step of the learned codebooks on the head weight and the step's hidden states."""
        queries = self.head.step_data.queries
        if queries is None:
            return
        learner, optimizer = self.codebook_learner, self.codebook_optimizer
        try:
            with full_head_weight(self.head) as (weight, _):
                out = learner(weight, queries.to(weight.device) * self.head.logit_scale)
        except ValueError:
            self.check_finite(state)  # NaN in the weight or the queries: say where it came from
            raise
        optimizer.zero_grad(set_to_none=True)
        out["loss"].backward()
        if _distributed():
            world = dist.get_world_size()
            for p in learner.parameters():
                dist.all_reduce(p.grad)
                p.grad.div_(world)
        optimizer.step()
        self._pending["midx/codebook_loss"] = out["loss"].detach()
        self._pending["midx/codebook_kl"] = out["kl"].detach()

    def _measure(self, *, log_kl: bool) -> None:
        """The KL and the exact loss of the last micro-batch, for the next log entry (one weight gather)."""
        head = self.head
        queries = head.step_data.queries
        if queries is None:
            return
        with full_head_weight(head) as (weight, bias):
            if log_kl:
                # KL(Q||P) stays "midx/kl"; what predicts training quality is the missed mass of P:
                # KL(P||Q), the effective sample size, P's mass where p/q > 10 (hf_midx.diagnostics).
                # As the sampler sees them in training: the queries (and bias) times the model's logit scale.
                scale = head.logit_scale
                diag = proposal_diagnostics(
                    head.sampler, queries.to(weight.device) * scale, weight, None if bias is None else bias * scale,
                    num_samples=head.config.num_samples, logit_softcap=head.logit_softcap,
                )
                for key, value in diag.items():
                    if key == "head_mass" and head.exact_ids is None:
                        continue
                    self._pending["midx/kl" if key == "kl_qp" else f"midx/{key}"] = _mean_over_ranks(value)
            exact = head.last_batch_exact_loss(weight, bias)
            self._pending["midx/train_loss_exact"] = _mean_over_ranks(exact)

    def _resume_folder(self, args, state) -> str:
        candidates = [self.resume_from_checkpoint, getattr(args, "resume_from_checkpoint", None)]
        candidates.append(os.path.join(args.output_dir, f"checkpoint-{state.global_step}"))
        for folder in candidates:
            if not isinstance(folder, (str, os.PathLike)) or not os.path.isdir(folder):
                continue
            folder = os.fspath(folder)
            trainer_state = os.path.join(folder, "trainer_state.json")
            if os.path.isfile(trainer_state):
                with open(trainer_state, encoding="utf-8") as f:
                    if json.load(f).get("global_step") != state.global_step:
                        continue
            return folder
        raise ValueError(
            f"Training resumes at step {state.global_step}, but MidxCallback found no checkpoint folder of that "
            f"step with {MIDX_STATE_NAME} (looked at {[c for c in candidates if c]}); pass the folder given to "
            "train(resume_from_checkpoint=...) to MidxCallback(resume_from_checkpoint=...) or "
            "MidxCallback.install(trainer, resume_from_checkpoint=...)."
        )


def _local_device(weight: torch.Tensor) -> torch.device:
    local = weight.to_local() if callable(getattr(weight, "to_local", None)) else weight
    return local.device


__all__ = ["MidxCallback", "MidxNonFiniteError", "broadcast_sampler", "full_head_weight", "refresh_index"]
