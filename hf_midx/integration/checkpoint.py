"""The head's MIDX state in a checkpoint folder and back: what :class:`hf_midx.MidxCallback` hands to
:mod:`hf_midx.integration.state` (the sampler's tensors, the exact head, the learned codebooks') and loads from it.

The head is reached through its public methods (``sampler_state``, ``load_sampler_state``, ``config``,
``num_classes``, ``in_features``, ``exact_ids``); :mod:`hf_midx.integration.state` never sees it.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

from ..rng import CounterRNG
from .state import GENERATOR_KEY, SavedState, checkpoint_facts, read_state, save_state

logger = logging.getLogger(__name__)


def read_head_state(folder: str, head, *, rank: int = 0, world_size: int = 1,
                    check_extra: Callable[[dict, dict, str], None] | None = None, config=None) -> SavedState:
    """Read ``folder``'s MIDX state and check it against ``head`` (and its learned codebooks); loads nothing.

    ``check_extra(extra, metadata, folder)`` checks the tensors and strings saved beside the sampler's: with
    ``codebooks="learned"``, :meth:`hf_midx.integration.learned_codebooks.CodebookTraining.check_saved`.
    ``config``: the MidxConfig the resumed run will train with, where it is not yet the head's (MidxTrainer checks
    before the callback hands the Trainer's ``label_smoothing_factor`` to the head); default ``head.config``.

    Raises:
        ValueError: no MIDX state, one made for another vocabulary, hidden size, sampler, codebook size,
            quantizer, codebook mode or exact head, or a config field changed that a resume refuses
            (:mod:`hf_midx.integration.resume_fields`).
    """
    sampler = head.sampler_state()
    facts = checkpoint_facts(head.config, head.num_classes, head.in_features, sampler)
    saved = read_state(folder, facts=facts, sampler=sampler, exact_ids=head.exact_ids, rank=rank, world_size=world_size,
                       config=head.config if config is None else config)
    if check_extra is not None:
        check_extra(saved.extra, saved.metadata, folder)
    return saved


def load_head_state(saved: SavedState, head, codebooks, *, seed: int, rank: int = 0) -> None:
    """Load a :func:`read_head_state` result into the head's sampler (and ``codebooks``, the callback's
    :class:`~hf_midx.integration.learned_codebooks.CodebookTraining` or None: handed in, so this module stays below it).

    ``seed`` restarts this rank's generator when the checkpoint has no generator file for it (warned). Config
    changes a resume accepts (``saved.changes``) are said in one log line, by rank 0.
    """
    if saved.changes and rank == 0:
        logger.warning(
            "hf_midx: resuming from %s with another MidxConfig (%s): the run goes on, but it is no longer the one an "
            "uninterrupted run would have been.", saved.checkpoint, "; ".join(saved.changes))
    rng = CounterRNG(seed).get_state() if saved.rng is None else saved.rng
    head.load_sampler_state({**saved.sampler, GENERATOR_KEY: rng})
    if codebooks is not None:
        codebooks.load(saved.extra, saved.metadata)


def save_head_state(folder: str, head, codebooks, *, last_refresh_step: int, args,
                    schedule: dict[str, str] | None = None, chosen: dict[str, int] | None = None) -> None:
    """Write this rank's MIDX state into ``folder`` (every rank calls it; ``args``: the TrainingArguments;
    ``codebooks``: as in :func:`load_head_state`; ``schedule``: the refresh schedule's state, strings;
    ``chosen``: what the config's ``"auto"`` fields became, for ``midx_config.json``)."""
    sampler = head.sampler_state()
    save_state(
        folder,
        config=head.config,
        facts=checkpoint_facts(head.config, head.num_classes, head.in_features, sampler),
        sampler=sampler,
        generator_state=sampler[GENERATOR_KEY],
        last_refresh_step=last_refresh_step,
        exact_ids=head.exact_ids,
        extra=None if codebooks is None else codebooks.tensors(),
        extra_metadata={**(schedule or {}), **({} if codebooks is None else codebooks.metadata())},
        chosen=chosen,
        rank=args.process_index,
        world_size=args.world_size,
        write_shared=args.should_save,
    )


def explain_tied_weights(model, head) -> None:
    """One line of ours after transformers' "missing keys ['lm_head.weight']" on resuming a tied model."""
    embeddings = model.get_input_embeddings() if callable(getattr(model, "get_input_embeddings", None)) else None
    if getattr(embeddings, "weight", None) is head.weight:
        logger.warning(
            "hf_midx: the 'missing keys' warning for the LM head weight on resuming is expected: the head is tied "
            "to the input embeddings, which the checkpoint stores once and which were restored."
        )


__all__ = ["explain_tied_weights", "load_head_state", "read_head_state", "save_head_state"]
