"""What :meth:`hf_midx.MidxCallback.install` changes on one Trainer instance (the class is untouched).

* ``save_model`` also writes ``midx_config.json``, the MIDX state first into a checkpoint folder, and (called by the
  user) the MIDX model card as ``README.md``, unless the folder's README.md is the user's own text
  (:func:`~hf_midx.integration.model_card.user_readme`): that is kept, as transformers' ``save_model`` keeps it,
  with one warning;
* ``create_model_card`` (``push_to_hub``) writes the MIDX card;
* ``train`` ends the run's hold on the head however it returns (:meth:`~hf_midx.MidxCallback.end_run`), so that an
  exception inside a step leaves no log-prob decision behind for the next run on the model;
* ``compute_loss`` explains an error raised by reading a training output's placeholder logits (a subclass's loss).
"""

from __future__ import annotations

import functools
import os
import warnings

from .head import find_head
from .model_card import user_readme, write_model_card


#: What an error raised while a subclass's ``compute_loss`` read a training output's placeholder logits means.
PLACEHOLDER_ADVICE = (
    "hf_midx: in training, a wrapped model called with labels computes the sampled-softmax loss itself "
    "(outputs.loss) and its outputs.logits is a (batch, seq, 0) placeholder: no (tokens x V) logits are built. A "
    "compute_loss that reads outputs.logits fails on it (this error). Fix: build your loss from outputs.loss; or, "
    "for a loss that needs every logit, call the model without labels (the full softmax trains, at its cost) or "
    "train the unwrapped model (hf_midx.unwrap(model))."
)


def wrap_trainer_methods(trainer, callback) -> None:
    """Wrap ``trainer``'s ``save_model``, ``create_model_card``, ``train`` and ``compute_loss`` for ``callback`` (a
    :class:`~hf_midx.MidxCallback`), each once per instance."""
    if not getattr(trainer.save_model, "midx_wrapped", False):
        _wrap_saving(trainer, callback)
    if not getattr(trainer.train, "midx_wrapped", False):
        _wrap_train(trainer, callback)
    if not getattr(trainer.compute_loss, "midx_wrapped", False):
        _wrap_compute_loss(trainer)


def _wrap_compute_loss(trainer) -> None:
    """``compute_loss`` says what happened (:data:`PLACEHOLDER_ADVICE`) when it raises after the model returned the
    placeholder logits: a subclass that reads ``outputs.logits`` in training (an ``IndexError`` from ``argmax``...)."""
    compute_loss = trainer.compute_loss

    @functools.wraps(compute_loss)
    def compute_loss_explained(*args, **kwargs):
        try:
            return compute_loss(*args, **kwargs)
        except (IndexError, RuntimeError, ValueError) as error:
            head = find_head(trainer.model)
            if head is None or head.binding is None or not head.binding.placeholder_returned:
                raise
            if hasattr(error, "add_note"):  # Python 3.11: the original error, with the explanation under it
                error.add_note(PLACEHOLDER_ADVICE)
                raise
            raise RuntimeError(f"{error}\n{PLACEHOLDER_ADVICE}") from error

    compute_loss_explained.midx_wrapped = True
    trainer.compute_loss = compute_loss_explained


def _wrap_train(trainer, callback) -> None:
    train = trainer.train

    @functools.wraps(train)
    def train_then_end_run(*args, **kwargs):
        try:
            return train(*args, **kwargs)
        finally:
            callback.end_run()

    train_then_end_run.midx_wrapped = True
    trainer.train = train_then_end_run


def _wrap_saving(trainer, callback) -> None:
    save_model, create_model_card = trainer.save_model, trainer.create_model_card
    warned = []  # the user's README kept: said once per trainer

    @functools.wraps(save_model)
    def save_model_with_midx(output_dir: str | None = None, _internal_call: bool = False) -> None:
        output_dir = os.fspath(trainer.args.output_dir if output_dir is None else output_dir)
        head = find_head(trainer.model)  # None after hf_midx.unwrap: a plain model, saved as one
        ours = head is not None and callback.head is head
        if ours and os.path.basename(os.path.normpath(output_dir)) == f"checkpoint-{trainer.state.global_step}":
            callback.save(output_dir, trainer.args)  # before the Trainer's files, so that a pushed checkpoint has it
        # Read before the Trainer writes: PEFT's save_pretrained writes (or updates) a README.md card of its own.
        kept = None if _internal_call else user_readme(output_dir)
        save_model(output_dir, _internal_call=_internal_call)
        if head is None or not trainer.args.should_save:
            return
        head.config.save_pretrained(output_dir, chosen=callback.chosen_fields() if ours else None)
        if _internal_call:
            return
        if kept is None:
            write_model_card(trainer, output_dir, head.config, num_classes=head.num_classes)
        elif not warned:
            warned.append(kept)
            warnings.warn(
                f"hf_midx: save_model kept {kept}, the folder's own README.md, and wrote no MIDX model card there "
                "(transformers' save_model leaves a README alone too). trainer.create_model_card() or push_to_hub "
                "writes the MIDX card over it: move your text elsewhere first to keep both.",
                UserWarning,
                stacklevel=2,
            )

    @functools.wraps(create_model_card)
    def create_midx_model_card(**card_args) -> None:
        head = find_head(trainer.model)
        if head is None:
            return create_model_card(**card_args)
        if trainer.is_world_process_zero():
            write_model_card(trainer, trainer.args.output_dir, head.config, num_classes=head.num_classes, **card_args)

    save_model_with_midx.midx_wrapped = True
    trainer.save_model, trainer.create_model_card = save_model_with_midx, create_midx_model_card


__all__ = ["PLACEHOLDER_ADVICE", "wrap_trainer_methods"]
