"""MidxTrainer: a transformers ``Trainer`` that keeps the MIDX sampler of a wrapped LM head fresh.

Use it exactly like ``Trainer`` on a model whose LM head was wrapped with
``MidxLMHead.wrap(model, MidxConfig(...))``. On top of ``Trainer`` it

* refreshes the sampler from the current head weight every ``refresh_every_steps`` optimizer steps
  and/or at the start of every epoch (warm-started k-means, or the learned codebooks' hard codes) and
  logs ``midx/refresh_seconds``;
* logs the sampler's measured KL(Q || softmax) on ``kl_queries`` recent training hidden states as
  ``midx/kl`` at every logging step (the same log entry as ``loss``, so progress bars, TensorBoard and
  W&B show it);
* with ``codebooks="learned"`` trains a :class:`~hf_midx.LearnableCodebooks` every optimizer step
  (its own Adam, ``codebook_learning_rate``, on the detached head weight and the step's ``kl_queries``
  hidden states) and logs its objective, ``midx/codebook_loss`` and ``midx/codebook_kl`` (this
  process's values; ``midx/kl`` is averaged over processes);
* saves the sampler, the learned codebooks and their optimizer in every ``checkpoint-N/`` (safetensors)
  and restores them with ``resume_from_checkpoint``, so a resumed run repeats an uninterrupted one;
* evaluates with the exact full-softmax loss and adds ``eval_perplexity``;
* writes a plain transformers model plus a MIDX model card (``README.md``) and ``midx_config.json``
  from ``save_model`` and ``push_to_hub``;
* stops with :class:`MidxNonFiniteError`, naming the step and the tensor, when training produces NaN/Inf.

Checkpoint files (beside the Trainer's own, in ``checkpoint-N/``):

* ``midx_state.safetensors`` (written by the main process): ``sampler.*`` the sampler's tensors (for
  MIDX ``sampler.index.codebook1``, ``sampler.index.codebook2``, ``sampler.index.codes``);
  ``codebooks.codebook1`` / ``codebooks.codebook2`` the learned codewords and
  ``codebook_optimizer.state.<i>.<name>`` their Adam state; the metadata holds the sampler name, V, D, K,
  the codebook mode, the last refresh step and the Adam ``param_groups`` (JSON);
* ``midx_rng_state.safetensors`` (one process) or ``midx_rng_state_<rank>.safetensors`` (one per
  process): the sampler generator of that rank, since every rank draws its own negatives;
* ``midx_config.json``: the :class:`~hf_midx.MidxConfig`.

Every file is written to a temporary name and renamed into place. Resuming checks the saved V, D, K,
sampler and codebook mode against the model's head before anything is loaded and raises ``ValueError``
on a mismatch. ``load_best_model_at_end`` restores the weights only; call :meth:`MidxTrainer.refresh_index`
before training on from them.

Distributed training uses the process group that the Trainer's accelerator set up (``torch.distributed``
collectives; ``self.accelerator`` says which process is the main one). A refresh is computed on the main
process and its tensors are broadcast, so every rank holds bit-identical codebooks, codes and bucket tables; each
rank's sampler generator is seeded with ``config.seed + rank``, so ranks draw different negatives. The
learned codebooks' gradients are averaged over ranks every step and their values are broadcast at every
refresh, so they stay identical too. Tested: one process and DDP over gloo on CPU. Planned but untested
(no GPU was available): FSDP (the full head weight is gathered with ``summon_full_params`` for FSDP1, or
``DTensor.full_tensor()`` for FSDP2, on every rank at every refresh, KL measurement and codebook step)
and DeepSpeed ZeRO-3 (``deepspeed.zero.GatheredParameters``).

The NaN/Inf check reads the loss of every micro-batch (one device sync per micro-batch); a process that
raises ends a ``torchrun`` job, which stops the other processes.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import time
import warnings
from typing import Any

import torch
import torch.distributed as dist
from safetensors import safe_open
from safetensors.torch import save_file
from transformers import Trainer, TrainerCallback
from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR, get_last_checkpoint

from . import model_card as _model_card
from ._io import atomic_write
from .codebooks import LearnableCodebooks
from .config import MidxConfig
from .head import MidxLMHead
from .samplers import MidxSampler, kl_to_softmax
from .version import __version__

#: The sampler, learned codebooks and their optimizer, written by the main process.
MIDX_STATE_NAME = "midx_state.safetensors"
#: The sampler generator of a single-process run.
MIDX_RNG_STATE_NAME = "midx_rng_state.safetensors"
#: The sampler generator of rank ``r`` in a multi-process run (formatted with ``rank``).
MIDX_RNG_STATE_PATTERN = "midx_rng_state_{rank}.safetensors"

_FORMAT = "hf-midx-trainer-state"
_GENERATOR_KEY = "generator_state"


class MidxNonFiniteError(FloatingPointError):
    """Training produced NaN or Inf; the message names the step and the tensor (loss, hidden states, head weight)."""


def _atomic_save_file(tensors: dict[str, torch.Tensor], path: str, metadata: dict[str, str]) -> None:
    atomic_write(path, lambda tmp: save_file(tensors, tmp, metadata=metadata))


def _load_file(path: str) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    with safe_open(path, framework="pt") as f:
        return {key: f.get_tensor(key) for key in f.keys()}, dict(f.metadata() or {})


def _cpu_copy(tensor: torch.Tensor) -> torch.Tensor:
    """A contiguous CPU copy that shares no storage (safetensors refuses shared tensors)."""
    return tensor.detach().to("cpu", copy=True).contiguous()


def _perplexity(loss: float) -> float:
    return math.exp(loss) if loss < 700 else math.inf


class _MidxCallback(TrainerCallback):
    """Forwards the Trainer's events to the MidxTrainer that owns it (the schedule lives there)."""

    def __init__(self, trainer: "MidxTrainer") -> None:
        self.trainer = trainer

    def on_train_begin(self, args, state, control, **kwargs):
        self.trainer._midx_on_train_begin()

    def on_epoch_begin(self, args, state, control, **kwargs):
        self.trainer._midx_on_epoch_begin()

    def on_step_end(self, args, state, control, **kwargs):
        self.trainer._midx_on_step_end(control)


class PerplexityMixin:
    """Adds ``<prefix>_perplexity`` = exp(``<prefix>_loss``) to a ``Trainer``'s evaluation metrics.

    MidxTrainer has it; put it before ``Trainer`` in a plain Trainer subclass (a full-softmax baseline)
    to report the same metric.
    """

    def evaluation_loop(
        self, dataloader, description, prediction_loss_only=None, ignore_keys=None, metric_key_prefix="eval"
    ):
        """``Trainer.evaluation_loop`` plus ``<prefix>_perplexity`` = exp(``<prefix>_loss``)."""
        output = super().evaluation_loop(
            dataloader,
            description,
            prediction_loss_only=prediction_loss_only,
            ignore_keys=ignore_keys,
            metric_key_prefix=metric_key_prefix,
        )
        loss = output.metrics.get(f"{metric_key_prefix}_loss")
        if loss is not None:
            output.metrics[f"{metric_key_prefix}_perplexity"] = _perplexity(float(loss))
        return output


class MidxTrainer(PerplexityMixin, Trainer):
    """``transformers.Trainer`` for models whose LM head was wrapped by :meth:`MidxLMHead.wrap`.

    Takes every argument ``Trainer`` takes. The MIDX options come from the head's
    :class:`~hf_midx.MidxConfig` (``trainer.midx_config``).

    Raises:
        ValueError: the model has no MIDX head, or an option needs the full logits during training
            (``label_smoothing_factor``, ``compute_loss_func``).
    """

    def __init__(self, *args, **kwargs) -> None:
        self._midx_head: MidxLMHead | None = None
        self._midx_hook = None
        self._midx_queries: torch.Tensor | None = None  # (S, D) float32, recent training hidden states
        self._midx_hidden_finite: torch.Tensor | None = None  # 0-dim bool of the last training forward
        self._midx_pending: dict[str, float] = {}  # MIDX values for the next training log entry
        self._midx_last_refresh_step = -1
        self._midx_steps_per_epoch: int | None = None
        self._midx_resume: dict[str, Any] | None = None
        self._midx_tokens = 0  # tokens this process trained on in the current train() call
        self.codebook_learner: LearnableCodebooks | None = None
        self.codebook_optimizer: torch.optim.Optimizer | None = None
        super().__init__(*args, **kwargs)
        if self.args.label_smoothing_factor:
            raise ValueError(
                "MidxTrainer cannot use label_smoothing_factor: it needs the full logits, which the MIDX head does "
                "not compute during training. Set label_smoothing_factor=0."
            )
        if self.compute_loss_func is not None:
            raise ValueError(
                "MidxTrainer cannot use compute_loss_func: the MIDX head computes the sampled-softmax loss itself "
                "and returns no full logits during training."
            )
        self._midx_attach(self.model)
        # The MIDX head always applies ForCausalLMLoss semantics (labels shifted by one), whatever the
        # model's loss_type says (GPT-2 has none in transformers 5.x): the Trainer must then count
        # num_items_in_batch over labels[..., 1:], or every loss comes out scaled by S/(S+1).
        self._loss_shifts_labels = True
        self.add_callback(_MidxCallback(self))

    # ------------------------------------------------------------------ public
    @property
    def midx_head(self) -> MidxLMHead:
        """The wrapped LM head being trained."""
        return self._midx_head

    @property
    def midx_config(self) -> MidxConfig:
        """The head's :class:`~hf_midx.MidxConfig`."""
        return self._midx_head.config

    def refresh_index(self) -> float:
        """Rebuild the sampler from the current head weight now; returns the seconds it took.

        k-means mode: warm-started k-means (``sampler.refresh``); learned mode: the learned codebooks'
        hard codes and bucket tables (``sampler.set_codebooks``). Computed on the main process and
        broadcast to the others; every process must call it (it is collective when distributed).
        """
        head = self._midx_head
        start = time.perf_counter()
        with self._full_head_weight() as weight:
            self._check_weight_finite(weight, "the index refresh")  # on every rank, so all of them stop
            if self.accelerator.is_main_process:
                if self.codebook_learner is not None:
                    # Clones: the index must not alias the learner's parameters, which Adam updates in place.
                    codebooks = tuple(c.clone() for c in self.codebook_learner.codebooks)
                    head.sampler.set_codebooks(codebooks, weight)
                else:
                    head.sampler.refresh(weight)
        self._broadcast_sampler()
        if self.codebook_learner is not None and self._distributed():
            with torch.no_grad():
                for p in self.codebook_learner.parameters():
                    dist.broadcast(p.data, src=0)
        seconds = time.perf_counter() - start
        self._midx_last_refresh_step = self.state.global_step
        self._midx_pending["midx/refresh_seconds"] = seconds
        return seconds

    def measure_kl(self) -> float | None:
        """KL(Q || softmax) of the sampler on the latest training hidden states, averaged over processes.

        None before the first training step. Collective when distributed.
        """
        queries = self._recent_queries()
        if queries is None:
            return None
        head = self._midx_head
        with self._full_head_weight() as weight:
            self._check_weight_finite(weight, "the KL measurement")
            kl = kl_to_softmax(head.sampler, queries, weight, head.bias)
        if self._distributed():
            dist.all_reduce(kl)
            kl = kl / dist.get_world_size()
        return float(kl)

    # ------------------------------------------------------------------ Trainer overrides
    def train(self, resume_from_checkpoint=None, trial=None, ignore_keys_for_eval=None):
        """``Trainer.train``; a MIDX checkpoint is checked against the model before anything is loaded.

        Raises:
            ValueError: the checkpoint's MIDX state was made with another vocabulary, hidden size,
                sampler, codebook size or codebook mode, or it has no MIDX state.
        """
        self._midx_resume = None
        checkpoint = resume_from_checkpoint
        if checkpoint is True:
            checkpoint = get_last_checkpoint(self.args.output_dir)  # None: Trainer raises its own error
        if isinstance(checkpoint, (str, os.PathLike)):
            self._midx_attach(self.model)
            self._midx_resume = self._read_checkpoint(os.fspath(checkpoint))
        return super().train(
            resume_from_checkpoint=resume_from_checkpoint, trial=trial, ignore_keys_for_eval=ignore_keys_for_eval
        )

    def set_initial_training_values(self, args, dataloader):
        values = super().set_initial_training_values(args, dataloader)
        self._midx_steps_per_epoch = values[1]  # num_update_steps_per_epoch: for the per-epoch refresh
        return values

    def training_step(self, model, inputs, num_items_in_batch=None):
        """``Trainer.training_step``, then a check that the loss is finite (else :class:`MidxNonFiniteError`)."""
        self._count_tokens(inputs)
        try:
            loss = super().training_step(model, inputs, num_items_in_batch)
        except ValueError as err:
            # The engine rejects NaN inputs with a ValueError; say which tensor and at which step.
            cause = self._non_finite_cause()
            if cause is not None:
                raise self._non_finite_error(cause, None) from err
            raise
        if not bool(torch.isfinite(loss).all()):
            raise self._non_finite_error(self._non_finite_cause() or "loss", loss)
        return loss

    def prediction_step(self, model, inputs, prediction_loss_only, ignore_keys=None):
        """With ``prediction_loss_only`` the exact loss is computed without materializing the logits."""
        head = self._midx_head
        has_labels = bool(self.label_names) and all(inputs.get(k) is not None for k in self.label_names)
        if prediction_loss_only and has_labels and head is not None:
            with head.exact_loss_only():
                return super().prediction_step(model, inputs, prediction_loss_only, ignore_keys=ignore_keys)
        return super().prediction_step(model, inputs, prediction_loss_only, ignore_keys=ignore_keys)

    def log(self, logs: dict[str, float], start_time: float | None = None) -> None:
        """``Trainer.log``; the MIDX values gathered since the last training log join the entry with ``loss``."""
        if self._midx_pending and ("loss" in logs or "train_runtime" in logs):
            logs.update(self._midx_pending)
            self._midx_pending = {}
        if "train_runtime" in logs and "train_tokens_per_second" not in logs and self._midx_tokens:
            # Per-process token count times the data-parallel processes (each sees its own batches).
            tokens = self._midx_tokens * max(self.args.world_size, 1)
            logs["train_tokens_per_second"] = round(tokens / max(logs["train_runtime"], 1e-9), 3)
        super().log(logs, start_time)

    def _save_checkpoint(self, model, trial) -> None:
        run_dir = self._get_output_dir(trial=trial)
        folder = os.path.join(run_dir, f"{PREFIX_CHECKPOINT_DIR}-{self.state.global_step}")
        # Written before the Trainer's files, so a checkpoint pushed to the Hub already holds them.
        self._save_midx_state(folder)
        super()._save_checkpoint(model, trial)

    def save_model(self, output_dir: str | None = None, _internal_call: bool = False) -> None:
        """``Trainer.save_model`` (a plain transformers model) plus ``midx_config.json`` and, when called by
        the user, a MIDX model card ``README.md``."""
        super().save_model(output_dir, _internal_call=_internal_call)
        output_dir = output_dir if output_dir is not None else self.args.output_dir
        if self.args.should_save and self._midx_head is not None:
            self.midx_config.save_pretrained(output_dir)
            if not _internal_call:
                self._write_model_card(output_dir)

    def create_model_card(
        self,
        language: str | None = None,
        license: str | None = None,
        tags: str | list[str] | None = None,
        model_name: str | None = None,
        finetuned_from: str | None = None,
        tasks: str | list[str] | None = None,
        dataset_tags: str | list[str] | None = None,
        dataset: str | list[str] | None = None,
        dataset_args: str | list[str] | None = None,
    ) -> None:
        """Write the MIDX model card to ``args.output_dir/README.md`` (``push_to_hub`` calls this).

        Same arguments as ``Trainer.create_model_card``; the card holds transformers' metadata and
        hyperparameters plus the MIDX training facts (see :func:`hf_midx.model_card.render_model_card`).
        """
        if not self.is_world_process_zero():
            return
        self._write_model_card(
            self.args.output_dir,
            language=language,
            license=license,
            tags=tags,
            model_name=model_name,
            finetuned_from=finetuned_from,
            tasks=tasks,
            dataset_tags=dataset_tags,
            dataset=dataset,
            dataset_args=dataset_args,
        )

    # ------------------------------------------------------------------ schedule (from _MidxCallback)
    def _midx_on_train_begin(self) -> None:
        self._midx_attach(self.model)
        self._midx_tokens = 0
        self._midx_pending = {}
        self._midx_queries = None
        head = self._midx_head
        head.last_queries = None
        if head.sampler.device != head.weight.device:
            head.refresh()  # the model moved (e.g. to the GPU): rebuild the sampler where the weight lives
        resume, self._midx_resume = self._midx_resume, None
        if resume is None:
            # All ranks start from the main process's index; each draws its own negatives.
            self._broadcast_sampler()
            head.sampler.generator.manual_seed(self.midx_config.seed + self.args.process_index)
            self._midx_last_refresh_step = -1
        self.codebook_learner = self.codebook_optimizer = None
        if self.midx_config.codebooks == "learned":
            if not isinstance(head.sampler, MidxSampler):
                raise ValueError(
                    f"codebooks='learned' needs a MIDX sampler, but the head's sampler is {head.sampler.name!r}."
                )
            index = head.sampler.index
            self.codebook_learner = LearnableCodebooks(
                tuple(c.clone() for c in index.codebooks), index.quantizer, kl_weight=self.midx_config.kl_weight
            ).to(index.device)
            self.codebook_optimizer = torch.optim.Adam(
                self.codebook_learner.parameters(), lr=self.midx_config.codebook_learning_rate
            )
        if resume is not None:
            self._apply_checkpoint(resume)

    def _midx_on_epoch_begin(self) -> None:
        step = self.state.global_step
        per_epoch = self._midx_steps_per_epoch
        if (
            self.midx_config.refresh_every_epoch
            and step > 0
            and per_epoch
            and step % per_epoch == 0
            and step != self._midx_last_refresh_step
        ):
            self.refresh_index()

    def _midx_on_step_end(self, control) -> None:
        config = self.midx_config
        if self.codebook_learner is not None:
            self._codebook_step()
        if config.refresh_every_steps and self.state.global_step % config.refresh_every_steps == 0:
            self.refresh_index()
        if config.log_kl and control.should_log:
            kl = self.measure_kl()
            if kl is not None:
                self._midx_pending["midx/kl"] = kl

    def _codebook_step(self) -> None:
        """One Adam step of the learned codebooks on the head weight and the step's hidden states."""
        queries = self._recent_queries()
        if queries is None:
            return
        learner, optimizer = self.codebook_learner, self.codebook_optimizer
        with self._full_head_weight() as weight:
            self._check_weight_finite(weight, "the codebook step")
            out = learner(weight, queries.to(weight.device))
        optimizer.zero_grad(set_to_none=True)
        out["loss"].backward()
        if self._distributed():
            world = dist.get_world_size()
            for p in learner.parameters():
                dist.all_reduce(p.grad)
                p.grad.div_(world)
        optimizer.step()
        self._midx_pending["midx/codebook_loss"] = float(out["loss"].detach())
        self._midx_pending["midx/codebook_kl"] = float(out["kl"])

    # ------------------------------------------------------------------ head, hook, weight
    def _midx_attach(self, model) -> None:
        """Find the wrapped head (again, e.g. after model_init) and hook its input."""
        head = None
        if model is not None:
            head = MidxLMHead.find(model)
            if head is None:
                head = MidxLMHead.find(self.accelerator.unwrap_model(model))
        if head is None:
            raise ValueError(
                "MidxTrainer needs a model whose LM head is a MidxLMHead: call MidxLMHead.wrap(model, ...) first "
                "(for model_init, wrap the model inside it)."
            )
        if head is self._midx_head and self._midx_hook is not None:
            return
        if self._midx_hook is not None:
            self._midx_hook.remove()
        self._midx_head = head
        self._midx_hook = head.register_forward_pre_hook(self._capture_hidden, with_kwargs=True)

    def _recent_queries(self) -> torch.Tensor | None:
        """Up to kl_queries hidden states of the last training step: the head's (non-ignored tokens) or ours."""
        queries = getattr(self._midx_head, "last_queries", None)
        if queries is None or queries.shape[0] == 0:
            queries = self._midx_queries
        return queries

    def _capture_hidden(self, module, args, kwargs) -> None:
        """Keep kl_queries evenly spaced training hidden states (detached copies) and a finiteness flag."""
        if not (module.training and torch.is_grad_enabled()):
            return
        hidden = args[0] if args else kwargs.get("hidden_states", kwargs.get("input"))
        if not isinstance(hidden, torch.Tensor) or hidden.dim() < 2:
            return
        flat = hidden.detach().reshape(-1, hidden.shape[-1])
        if flat.shape[0] == 0:
            return
        count = min(self.midx_config.kl_queries, flat.shape[0])
        rows = torch.linspace(0, flat.shape[0] - 1, count, device=flat.device).round().long()
        self._midx_queries = flat[rows].float().clone()
        self._midx_hidden_finite = torch.isfinite(flat).all()

    @contextlib.contextmanager
    def _full_head_weight(self):
        """The full (V, D) head weight, detached; gathered when sharded (collective under FSDP/ZeRO-3)."""
        weight = self._midx_head.weight
        full_tensor = getattr(weight, "full_tensor", None)
        if callable(full_tensor):  # FSDP2 / tensor parallel DTensor (untested)
            yield full_tensor().detach()
        elif getattr(weight, "ds_id", None) is not None:  # DeepSpeed ZeRO-3 partitioned parameter (untested)
            import deepspeed

            with deepspeed.zero.GatheredParameters([weight], modifier_rank=None):
                yield weight.detach()
        elif getattr(self, "is_fsdp_enabled", False):  # FSDP1 flat parameters (untested)
            from torch.distributed.fsdp import FullyShardedDataParallel

            with FullyShardedDataParallel.summon_full_params(self.model_wrapped, writeback=False, recurse=True):
                yield self._midx_head.weight.detach()
        else:
            yield weight.detach()

    def _distributed(self) -> bool:
        return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1

    def _sampler_tensors(self) -> dict[str, torch.Tensor]:
        """The sampler's state tensors without its generator (which is per rank)."""
        return {k: v for k, v in self._midx_head.sampler.state_dict().items() if k != _GENERATOR_KEY}

    def _broadcast_sampler(self) -> None:
        """Give every rank the main process's sampler tensors (codebooks, codes; bucket tables follow)."""
        if not self._distributed():
            return
        state = {k: v.contiguous().clone() for k, v in self._sampler_tensors().items()}
        for key in sorted(state):
            dist.broadcast(state[key], src=0)
        if not self.accelerator.is_main_process:
            self._midx_head.sampler.load_state_dict(state)

    # ------------------------------------------------------------------ non-finite values
    def _step_text(self) -> str:
        epoch = self.state.epoch
        where = f"training step {self.state.global_step + 1}"
        return where if epoch is None else f"{where} (epoch {epoch:.2f})"

    def _non_finite_cause(self) -> str | None:
        weight = self._midx_head.weight
        if weight.numel() and not bool(torch.isfinite(weight.detach()).all()):
            return "LM head weight"
        if self._midx_hidden_finite is not None and not bool(self._midx_hidden_finite):
            return "hidden states (the LM head's input)"
        return None

    def _non_finite_error(self, what: str, loss: torch.Tensor | None) -> MidxNonFiniteError:
        value = "" if loss is None else f" (loss = {float(loss.detach().float().reshape(-1)[0])})"
        return MidxNonFiniteError(
            f"MIDX training hit NaN/Inf at {self._step_text()}, in the {what}{value}. Training was stopped "
            "instead of continuing on NaN; lower the learning rate, clip gradients (max_grad_norm) or check the "
            "inputs, then resume from the last good checkpoint."
        )

    def _check_weight_finite(self, weight: torch.Tensor, during: str) -> None:
        if not bool(torch.isfinite(weight).all()):
            raise MidxNonFiniteError(
                f"MIDX training hit NaN/Inf after training step {self.state.global_step}, in the LM head weight "
                f"(found during {during}). Lower the learning rate or clip gradients (max_grad_norm), then resume "
                "from the last good checkpoint."
            )

    def _count_tokens(self, inputs) -> None:
        mask = inputs.get("attention_mask") if hasattr(inputs, "get") else None
        ids = inputs.get(getattr(self.model, "main_input_name", "input_ids")) if hasattr(inputs, "get") else None
        if isinstance(mask, torch.Tensor):
            self._midx_tokens += int(mask.sum())
        elif isinstance(ids, torch.Tensor):
            self._midx_tokens += ids.numel()

    # ------------------------------------------------------------------ checkpoints
    def _rng_file(self, checkpoint: str) -> str:
        if self.args.world_size <= 1:
            return os.path.join(checkpoint, MIDX_RNG_STATE_NAME)
        return os.path.join(checkpoint, MIDX_RNG_STATE_PATTERN.format(rank=self.args.process_index))

    def _describe(self) -> dict[str, str]:
        head, config = self._midx_head, self.midx_config
        sampler = head.sampler
        described = {
            "sampler": config.sampler,
            "num_classes": str(head.num_classes),
            "dim": str(sampler.dim),
            "codebooks": config.codebooks,
        }
        if isinstance(sampler, MidxSampler):
            described["codebook_size"] = str(sampler.index.codebook_size)
            described["quantizer"] = sampler.index.quantizer
        return described

    def _save_midx_state(self, folder: str) -> None:
        os.makedirs(folder, exist_ok=True)
        if self.args.should_save:
            tensors = {f"sampler.{k}": _cpu_copy(v) for k, v in self._sampler_tensors().items()}
            metadata = {
                "format": _FORMAT,
                "hf_midx_version": __version__,
                "last_refresh_step": str(self._midx_last_refresh_step),
                **self._describe(),
            }
            if self.codebook_learner is not None:
                for name, p in self.codebook_learner.named_parameters():
                    tensors[f"codebooks.{name}"] = _cpu_copy(p)
                opt_state = self.codebook_optimizer.state_dict()
                extras = {}
                for pid, entries in opt_state["state"].items():
                    for name, value in entries.items():
                        if isinstance(value, torch.Tensor):
                            tensors[f"codebook_optimizer.state.{pid}.{name}"] = _cpu_copy(value)
                        else:
                            extras[f"{pid}.{name}"] = value
                metadata["codebook_optimizer.param_groups"] = json.dumps(opt_state["param_groups"])
                metadata["codebook_optimizer.extra_state"] = json.dumps(extras)
            _atomic_save_file(tensors, os.path.join(folder, MIDX_STATE_NAME), metadata)
            self.midx_config.save_pretrained(folder)
        generator = self._midx_head.sampler.generator.get_state()
        _atomic_save_file(
            {_GENERATOR_KEY: generator},
            self._rng_file(folder),
            {"format": _FORMAT, "rank": str(self.args.process_index), "world_size": str(self.args.world_size)},
        )

    def _read_checkpoint(self, checkpoint: str) -> dict[str, Any]:
        """Load and validate a checkpoint's MIDX state against the current head; changes nothing."""
        path = os.path.join(checkpoint, MIDX_STATE_NAME)
        if not os.path.isfile(path):
            raise ValueError(
                f"Cannot resume from {checkpoint!r}: it has no {MIDX_STATE_NAME}, so it was not written by "
                "MidxTrainer. To start MIDX training from those weights, load them with from_pretrained, wrap the "
                "head and call train() without resume_from_checkpoint."
            )
        tensors, metadata = _load_file(path)
        if metadata.get("format") != _FORMAT:
            raise ValueError(f"{path!r} is not an hf-midx trainer state (format {metadata.get('format')!r}).")
        current = self._describe()
        differ = [
            f"{k}: checkpoint {metadata.get(k)!r}, model {v!r}" for k, v in current.items() if metadata.get(k) != v
        ]
        if differ:
            raise ValueError(
                f"Cannot resume from {checkpoint!r}: its MIDX state does not match this model's head ("
                + "; ".join(differ)
                + "). Resume with the same vocabulary, hidden size and MidxConfig(sampler, codebook_size, "
                "codebooks), or start a new run without resume_from_checkpoint."
            )
        sampler_state = {k[len("sampler.") :]: v for k, v in tensors.items() if k.startswith("sampler.")}
        expected = self._sampler_tensors()
        if set(sampler_state) != set(expected):
            raise ValueError(
                f"Cannot resume from {checkpoint!r}: its sampler state has tensors {sorted(sampler_state)}, this "
                f"sampler has {sorted(expected)}."
            )
        for key, have in expected.items():
            if tuple(sampler_state[key].shape) != tuple(have.shape):
                raise ValueError(
                    f"Cannot resume from {checkpoint!r}: sampler tensor {key!r} has shape "
                    f"{tuple(sampler_state[key].shape)} in the checkpoint but {tuple(have.shape)} in this model "
                    "(another vocabulary, hidden size or codebook size)."
                )
        learned = {k[len("codebooks.") :]: v for k, v in tensors.items() if k.startswith("codebooks.")}
        if self.midx_config.codebooks == "learned" and set(learned) != {"codebook1", "codebook2"}:
            raise ValueError(f"Cannot resume from {checkpoint!r}: it lacks the learned codebooks.")
        rng = None
        rng_path = self._rng_file(checkpoint)
        if os.path.isfile(rng_path):
            rng = _load_file(rng_path)[0][_GENERATOR_KEY]
        else:
            warnings.warn(
                f"{rng_path!r} is missing (the checkpoint was made with another number of processes?): this "
                "process's sampler generator restarts from its seed, so the resumed run draws other negatives.",
                UserWarning,
                stacklevel=2,
            )
        return {
            "checkpoint": checkpoint,
            "sampler": sampler_state,
            "rng": rng,
            "learned": learned,
            "optimizer": {k: v for k, v in tensors.items() if k.startswith("codebook_optimizer.")},
            "metadata": metadata,
        }

    def _apply_checkpoint(self, resume: dict[str, Any]) -> None:
        sampler = self._midx_head.sampler
        state = dict(resume["sampler"])
        if resume["rng"] is not None:
            state[_GENERATOR_KEY] = resume["rng"]
        else:
            sampler.generator.manual_seed(self.midx_config.seed + self.args.process_index)
        sampler.load_state_dict(state)
        self._midx_last_refresh_step = int(resume["metadata"].get("last_refresh_step", -1))
        if self.codebook_learner is not None:
            with torch.no_grad():
                for name, p in self.codebook_learner.named_parameters():
                    p.copy_(resume["learned"][name].to(p.device))
            meta = resume["metadata"]
            opt_state: dict[int, dict[str, Any]] = {}
            for key, value in resume["optimizer"].items():
                pid, name = key[len("codebook_optimizer.state.") :].split(".", 1)
                opt_state.setdefault(int(pid), {})[name] = value
            for key, value in json.loads(meta.get("codebook_optimizer.extra_state", "{}")).items():
                pid, name = key.split(".", 1)
                opt_state.setdefault(int(pid), {})[name] = value
            groups = json.loads(meta["codebook_optimizer.param_groups"])
            self.codebook_optimizer.load_state_dict({"state": opt_state, "param_groups": groups})

    # ------------------------------------------------------------------ model card
    def _write_model_card(self, output_dir: str, **card_args) -> str:
        from transformers.modelcard import TrainingSummary, make_markdown_table

        tags = card_args.pop("tags", None)
        tags = [tags] if isinstance(tags, str) else list(tags or [])
        summary = TrainingSummary.from_trainer(self, tags=tags, **card_args)
        metadata = summary.create_metadata()
        model = self.accelerator.unwrap_model(self.model)
        peft_config = getattr(model, "peft_config", None)  # a PEFT model saves an adapter, not a full model
        base_model = None
        if isinstance(peft_config, dict) and peft_config:
            base_model = getattr(next(iter(peft_config.values())), "base_model_name_or_path", None)
            if base_model and os.path.isdir(base_model):
                base_model = None
        card = _model_card.render_model_card(
            self.midx_config,
            metadata=metadata,
            library_name="peft" if peft_config else "transformers",
            base_model=base_model,
            model_name=summary.model_name,
            hyperparameters=summary.hyperparameters,
            eval_table=make_markdown_table(summary.eval_lines),
            log_history=self.state.log_history,
            num_classes=self._midx_head.num_classes,
        )
        return _model_card.save_model_card(card, output_dir)


__all__ = ["MIDX_RNG_STATE_NAME", "MIDX_STATE_NAME", "MidxNonFiniteError", "MidxTrainer"]
