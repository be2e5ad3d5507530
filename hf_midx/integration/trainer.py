"""MidxTrainer: ``transformers.Trainer`` with the MIDX schedule installed, exact evaluation and a MIDX card.

The schedule (index refresh, learned codebooks, ``midx/`` logging, checkpointed sampler state, NaN
checks) is :class:`~hf_midx.MidxCallback`, which works with any Trainer; checkpoint files are
:mod:`hf_midx.integration.state`. What only a subclass can do stays here:

* evaluation with the exact full-softmax loss, without materializing the logits when only the loss
  is needed, plus ``eval_perplexity``;
* a check of the checkpoint's MIDX state before ``train(resume_from_checkpoint=...)`` loads anything,
  and that folder handed to the callback;
* ``train_tokens_per_second`` in the final metrics, counted on the device (no sync per micro-batch);
* :attr:`MidxTrainer.model_card_extras`, what a script adds to the MIDX card (final results: model-index
  entries, Markdown sections). The card and ``midx_config.json`` themselves come with the callback's
  :meth:`~hf_midx.MidxCallback.install`, as for any Trainer.

Only public Trainer methods are overridden. The token count of the gradient-accumulation
normalization over ``labels[..., 1:]`` comes from the wrapped model's ``loss_type``
(:class:`hf_midx.integration.wrap.HostBinding`), so a plain Trainer counts the same way.
"""

from __future__ import annotations

import contextlib
import os
from typing import Any

import torch
from transformers import Trainer
from transformers.trainer_utils import get_last_checkpoint

from .callback import MidxCallback, MidxNonFiniteError
from .checkpoint import read_head_state
from ..indexing.codebooks import LearnableCodebooks
from ..config import MidxConfig
from .distributed import refuse_data_parallel
from .head import MidxLMHead, find_head
from .learned_codebooks import CodebookTraining
from .model_card import CARD_EXTRAS, perplexity, write_model_card
from .state import MIDX_RNG_STATE_NAME, MIDX_STATE_NAME


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
            output.metrics[f"{metric_key_prefix}_perplexity"] = perplexity(loss)
        return output


class ExactEvaluationMixin:
    """A ``Trainer``'s evaluation of a wrapped model: the exact loss, without the (tokens x V) logits when only
    the loss is asked for (the token count the Trainer passes is set right by the binding,
    :data:`~hf_midx.integration.binding.UNSHIFTED_EVAL_COUNT`, for any Trainer)."""

    def prediction_step(self, model, inputs, prediction_loss_only, ignore_keys=None):
        """With ``prediction_loss_only`` the exact loss is computed without materializing the logits."""
        head = find_head(model) or find_head(self.model)
        has_labels = bool(self.label_names) and all(inputs.get(k) is not None for k in self.label_names)
        with head.exact_loss_only() if prediction_loss_only and has_labels and head else contextlib.nullcontext():
            return super().prediction_step(model, inputs, prediction_loss_only, ignore_keys=ignore_keys)


class MidxTrainer(PerplexityMixin, ExactEvaluationMixin, Trainer):
    """``transformers.Trainer`` for models whose LM head was wrapped by :func:`hf_midx.wrap`.

    Takes every argument ``Trainer`` takes and installs a :class:`~hf_midx.MidxCallback` (the one in
    ``callbacks``, if any). The MIDX options come from the head's :class:`~hf_midx.MidxConfig`.

    ``model_card_extras`` (empty): more :func:`~hf_midx.integration.model_card.render_model_card` arguments for every card
    it writes (:data:`CARD_EXTRAS`: a script's final results, as ``eval_results`` and Markdown ``sections``).

    Raises:
        ValueError: no MIDX head; one process on several GPUs (DataParallel, see ``MidxCallback.install``).
    A ``compute_loss_func`` is the plain Trainer's: the Trainer takes the labels from the model's call, which then
    computes full logits and trains the full softmax, warned once, as with any Trainer (``label_smoothing_factor``
    instead becomes the head's ``MidxConfig.label_smoothing``, see ``MidxCallback.install``).
    """

    def __init__(self, model=None, args=None, *more, **kwargs) -> None:
        # Checked before the Trainer creates output_dir (and, with push_to_hub, the Hub repository).
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
        return None if self.midx_callback.codebooks is None else self.midx_callback.codebooks.learner

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
            ValueError: no MIDX state (a plain Trainer's checkpoint), one made for another vocabulary, hidden
                size, sampler, codebook size, quantizer or codebook mode, or another number of processes, or a
                MidxConfig field changed that a resume refuses (:mod:`hf_midx.integration.resume_fields`).
        """
        config = self.midx_head.config
        factor = float(self.args.label_smoothing_factor or 0.0)
        if factor and config.label_smoothing == 0.0:  # what the callback hands the head at train start
            config = config.replace(label_smoothing=factor)
        read_head_state(os.fspath(checkpoint), self.midx_head, rank=self.args.process_index,
                        world_size=self.args.world_size, config=config,
                        check_extra=CodebookTraining.check_saved if config.codebooks == "learned" else None)

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

    def log(self, logs: dict[str, float], start_time: float | None = None) -> None:
        """``Trainer.log`` plus ``train_tokens_per_second`` in the final metrics."""
        if "train_runtime" in logs and "train_tokens_per_second" not in logs and self._midx_tokens is not None:
            # Per-process token count times the data-parallel processes (each sees its own batches).
            tokens = int(self._midx_tokens) * max(self.args.world_size, 1)
            logs["train_tokens_per_second"] = round(tokens / max(logs["train_runtime"], 1e-9), 3)
        super().log(logs, start_time)


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


__all__ = [
    "CARD_EXTRAS",
    "ExactEvaluationMixin",
    "MIDX_RNG_STATE_NAME",
    "MIDX_STATE_NAME",
    "MidxNonFiniteError",
    "MidxTrainer",
    "PerplexityMixin",
    "write_model_card",
]
