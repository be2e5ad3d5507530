"""MidxTrainer: ``transformers.Trainer`` with the MIDX schedule installed, exact evaluation and a MIDX card.

The schedule (index refresh, learned codebooks, ``midx/`` logging, checkpointed sampler state, NaN
checks) is :class:`~hf_midx.MidxCallback`, which works with any Trainer; checkpoint files are
:mod:`hf_midx.state`. What only a subclass can do stays here:

* evaluation with the exact full-softmax loss, without materializing the logits when only the loss
  is needed, plus ``eval_perplexity``;
* a check of the checkpoint's MIDX state before ``train(resume_from_checkpoint=...)`` loads anything,
  and that folder handed to the callback;
* ``train_tokens_per_second`` in the final metrics, counted on the device (no sync per micro-batch);
* the MIDX sampler state written by ``save_model`` into a checkpoint folder, before the Trainer's
  optimizer and state files (so a checkpoint pushed to the Hub holds it), and a MIDX model card plus
  ``midx_config.json`` from ``save_model`` / ``push_to_hub``, with what :attr:`MidxTrainer.model_card_extras`
  adds (a script's final results: model-index entries, Markdown sections).

Only public Trainer methods are overridden. The token count of the gradient-accumulation
normalization over ``labels[..., 1:]`` comes from the wrapped model's ``loss_type``
(:class:`hf_midx.wrap.HostBinding`), so a plain Trainer counts the same way.
"""

from __future__ import annotations

import contextlib
import inspect
import math
import os
from typing import Any

import torch
from transformers import Trainer
from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR, get_last_checkpoint

from . import model_card as _model_card
from .callback import MidxCallback, MidxNonFiniteError, refuse_data_parallel
from .codebooks import LearnableCodebooks
from .config import MidxConfig
from .head import MidxLMHead, find_head
from .state import MIDX_RNG_STATE_NAME, MIDX_STATE_NAME, read_state


def _perplexity(loss: float) -> float:
    return math.exp(loss) if loss < 700 else math.inf


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
    """``transformers.Trainer`` for models whose LM head was wrapped by :func:`hf_midx.wrap`.

    Takes every argument ``Trainer`` takes and installs a :class:`~hf_midx.MidxCallback` (the one in
    ``callbacks``, if any). The MIDX options come from the head's :class:`~hf_midx.MidxConfig`.

    ``model_card_extras`` (empty): more :func:`~hf_midx.model_card.render_model_card` arguments for every card
    it writes (:data:`CARD_EXTRAS`: a script's final results, as ``eval_results`` and Markdown ``sections``).

    Raises:
        ValueError: no MIDX head; an option that needs the full logits (``label_smoothing_factor``,
            ``compute_loss_func``); one process on several GPUs (DataParallel, see ``MidxCallback.install``).
    """

    def __init__(self, model=None, args=None, *more, **kwargs) -> None:
        # Checked before the Trainer creates output_dir (and, with push_to_hub, the Hub repository).
        given = inspect.signature(Trainer.__init__).bind_partial(self, model, args, *more, **kwargs).arguments
        for option, value in (("label_smoothing_factor", getattr(args, "label_smoothing_factor", 0.0)),
                              ("compute_loss_func", given.get("compute_loss_func"))):  # fmt: skip
            if value:
                raise ValueError(
                    f"MidxTrainer cannot use {option}: it needs the full logits, which the MIDX head does not "
                    "compute during training (it computes the sampled-softmax loss itself)."
                )
        if args is not None:
            refuse_data_parallel(args)
        self._midx_tokens: torch.Tensor | None = None  # tokens this process trained on in this train() call
        self.model_card_extras: dict[str, Any] = {}
        super().__init__(model, args, *more, **kwargs)
        _head_of(self)
        self.midx_callback: MidxCallback = MidxCallback.install(self)

    @property
    def midx_head(self) -> MidxLMHead:
        """The wrapped LM head being trained."""
        return _head_of(self)

    @property
    def midx_config(self) -> MidxConfig:
        """The head's :class:`~hf_midx.MidxConfig`."""
        return self.midx_head.config

    @property
    def codebook_learner(self) -> LearnableCodebooks | None:
        """The learned codebooks (``codebooks="learned"``, during and after training), else None."""
        return self.midx_callback.codebook_learner

    def refresh_index(self) -> float:
        """Rebuild the index from the current head weight now (collective); returns the seconds it took.

        Use it after ``load_best_model_at_end`` before training on from the restored weights.
        """
        self.midx_callback.head = self.midx_callback.head or self.midx_head
        return self.midx_callback.refresh(self.state)

    def check_checkpoint(self, checkpoint: str | os.PathLike) -> None:
        """Check that ``checkpoint`` holds a MIDX state this trainer can resume from; loads nothing.

        ``train(resume_from_checkpoint=...)`` calls it first; call it yourself to refuse a checkpoint before
        anything is written.

        Raises:
            ValueError: no MIDX state (a plain Trainer's checkpoint), or one made for another vocabulary,
                hidden size, sampler, codebook size, quantizer or codebook mode, or another number of processes.
        """
        read_state(os.fspath(checkpoint), self.midx_head, rank=self.args.process_index,
                   world_size=self.args.world_size)  # fmt: skip

    def train(self, resume_from_checkpoint=None, trial=None, ignore_keys_for_eval=None):
        """``Trainer.train``; a MIDX checkpoint is checked against the model before anything is loaded
        (``ValueError``: no MIDX state, or another V, D, sampler or codebooks), then handed to the callback."""
        checkpoint = resume_from_checkpoint
        if checkpoint is True:
            checkpoint = get_last_checkpoint(self.args.output_dir)  # None: Trainer raises its own error
        self.midx_callback.resume_from_checkpoint = None
        if isinstance(checkpoint, (str, os.PathLike)):
            checkpoint = os.fspath(checkpoint)
            self.check_checkpoint(checkpoint)
            self.midx_callback.resume_from_checkpoint = checkpoint
        self._midx_tokens = None
        kwargs = dict(trial=trial, ignore_keys_for_eval=ignore_keys_for_eval)
        return super().train(resume_from_checkpoint=resume_from_checkpoint, **kwargs)

    def training_step(self, model, inputs, num_items_in_batch=None):
        """``Trainer.training_step``, counting the tokens for ``train_tokens_per_second`` on the device."""
        mask = inputs.get("attention_mask") if hasattr(inputs, "get") else None
        ids = inputs.get(getattr(self.model, "main_input_name", "input_ids")) if hasattr(inputs, "get") else None
        count = mask.sum() if isinstance(mask, torch.Tensor) else ids.numel() if isinstance(ids, torch.Tensor) else None
        if count is not None:
            self._midx_tokens = count if self._midx_tokens is None else self._midx_tokens + count
        return super().training_step(model, inputs, num_items_in_batch)

    def prediction_step(self, model, inputs, prediction_loss_only, ignore_keys=None):
        """With ``prediction_loss_only`` the exact loss is computed without materializing the logits."""
        head = find_head(model) or find_head(self.model)
        has_labels = bool(self.label_names) and all(inputs.get(k) is not None for k in self.label_names)
        with head.exact_loss_only() if prediction_loss_only and has_labels and head else contextlib.nullcontext():
            return super().prediction_step(model, inputs, prediction_loss_only, ignore_keys=ignore_keys)

    def log(self, logs: dict[str, float], start_time: float | None = None) -> None:
        """``Trainer.log`` plus ``train_tokens_per_second`` in the final metrics."""
        if "train_runtime" in logs and "train_tokens_per_second" not in logs and self._midx_tokens is not None:
            # Per-process token count times the data-parallel processes (each sees its own batches).
            tokens = int(self._midx_tokens) * max(self.args.world_size, 1)
            logs["train_tokens_per_second"] = round(tokens / max(logs["train_runtime"], 1e-9), 3)
        super().log(logs, start_time)

    def save_model(self, output_dir: str | None = None, _internal_call: bool = False) -> None:
        """``Trainer.save_model`` (a plain transformers model) plus ``midx_config.json``; into this step's
        checkpoint folder also the MIDX state (every process); when called by the user, a MIDX card."""
        output_dir = output_dir if output_dir is not None else self.args.output_dir
        checkpoint = f"{PREFIX_CHECKPOINT_DIR}-{self.state.global_step}"
        if self.midx_callback.head is not None and os.path.basename(os.path.normpath(output_dir)) == checkpoint:
            # A checkpoint's model comes first, then the Trainer's files, then the push: the state is in it.
            self.midx_callback.save(output_dir, self.args)
        super().save_model(output_dir, _internal_call=_internal_call)
        if self.args.should_save:
            self.midx_config.save_pretrained(output_dir)
            if not _internal_call:
                write_model_card(self, output_dir)

    def create_model_card(self, **card_args) -> None:
        """Write the MIDX model card to ``args.output_dir/README.md`` (``push_to_hub`` calls this); the
        keyword arguments of ``Trainer.create_model_card`` (see :func:`write_model_card`)."""
        if self.is_world_process_zero():
            write_model_card(self, self.args.output_dir, **card_args)


def _head_of(trainer: MidxTrainer) -> MidxLMHead:
    """The trainer's MidxLMHead, looked up through accelerate's wrappers too; ValueError without one."""
    head = find_head(trainer.model)
    if head is None and trainer.model is not None:
        head = find_head(trainer.accelerator.unwrap_model(trainer.model))
    if head is None:
        raise ValueError(
            "MidxTrainer needs a model whose LM head is a MidxLMHead: call hf_midx.wrap(model, ...) first "
            "(for model_init, wrap the model inside it)."
        )
    return head


#: The render_model_card arguments that MidxTrainer.model_card_extras may set.
CARD_EXTRAS = ("eval_results", "sections", "throughput", "command", "dataset_name")


def write_model_card(trainer: MidxTrainer, output_dir: str, **card_args) -> str:
    """Write a MidxTrainer's model card into ``output_dir/README.md`` (atomically); returns its path.

    Args:
        trainer: the trainer whose run the card describes; its ``model_card_extras`` go into the card.
        output_dir: the folder to write to.
        **card_args: the keyword arguments of ``Trainer.create_model_card`` (``language``, ``license``,
            ``tags``, ``model_name``, ``finetuned_from``, ``tasks``, ``dataset_tags``, ``dataset``,
            ``dataset_args``); the card holds transformers' metadata and hyperparameters plus the MIDX
            training facts (see :func:`hf_midx.model_card.render_model_card`). ``dataset`` names the data
            in the text.
    Raises:
        ValueError: ``model_card_extras`` holds a key other than :data:`CARD_EXTRAS`.
    """
    from transformers.modelcard import TrainingSummary, make_markdown_table

    extras = dict(getattr(trainer, "model_card_extras", None) or {})
    unknown = sorted(set(extras) - set(CARD_EXTRAS))
    if unknown:
        raise ValueError(f"model_card_extras has unknown keys {unknown}; allowed: {', '.join(CARD_EXTRAS)}.")
    if isinstance(card_args.get("dataset"), str):
        extras.setdefault("dataset_name", card_args["dataset"])
    tags = card_args.pop("tags", None)
    tags = [tags] if isinstance(tags, str) else list(tags or [])
    summary = TrainingSummary.from_trainer(trainer, tags=tags, **card_args)
    model = trainer.accelerator.unwrap_model(trainer.model)
    peft_config = getattr(model, "peft_config", None)  # a PEFT model saves an adapter, not a full model
    base_model = None
    if isinstance(peft_config, dict) and peft_config:
        base_model = getattr(next(iter(peft_config.values())), "base_model_name_or_path", None)
        if base_model and os.path.isdir(base_model):
            base_model = None
    card = _model_card.render_model_card(
        trainer.midx_config,
        metadata=summary.create_metadata(),
        library_name="peft" if peft_config else "transformers",
        base_model=base_model,
        model_name=summary.model_name,
        hyperparameters=summary.hyperparameters,
        eval_table=make_markdown_table(summary.eval_lines),
        log_history=trainer.state.log_history,
        num_classes=trainer.midx_head.num_classes,
        **extras,
    )
    return _model_card.save_model_card(card, output_dir)


__all__ = [
    "MIDX_RNG_STATE_NAME",
    "MIDX_STATE_NAME",
    "MidxNonFiniteError",
    "MidxTrainer",
    "PerplexityMixin",
    "write_model_card",
]
