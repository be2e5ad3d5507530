"""The MIDX training state in a checkpoint folder: the sampler, its random stream, learned codebooks.

Files (beside the Trainer's own, in ``checkpoint-N/``), each written to a temporary name and renamed
into place:

* ``midx_state.safetensors`` (one process writes it): ``sampler.*`` the sampler's tensors (for MIDX
  ``sampler.index.codebook1``, ``sampler.index.codebook2``, ``sampler.index.codes``), ``exact_ids``
  the exact head's class ids, and the tensors of the learned codebooks
  (:mod:`hf_midx.integration.learned_codebooks`: ``codebooks.*``, ``codebook_optimizer.state.*``). The metadata
  holds the format, the hf-midx version, the facts a resumed model must share (:func:`checkpoint_facts`:
  sampler, V, D, K, quantizer, codebook mode), the last refresh step and the learned codebooks' metadata.
* ``midx_rng_state.safetensors`` (one process) or ``midx_rng_state_<rank>.safetensors`` (one per
  process): the sampler generator of that rank, since every rank draws its own negatives.
* ``midx_config.json``: the :class:`~hf_midx.MidxConfig`, and what its ``"auto"`` fields became (``"chosen"``).

This module takes what it saves (tensors, strings, the config) and knows nothing of the head:
:class:`hf_midx.MidxCallback` hands them over. :func:`read_state` checks the facts, the sampler's
tensor names and shapes and the exact head against the model's before anything is loaded and raises
``ValueError`` on a mismatch.
"""

from __future__ import annotations

import json
import os
import warnings
from collections.abc import Mapping
from dataclasses import dataclass, field

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from .._io import atomic_write
from ..config import CONFIG_NAME
from ..version import __version__
from .resume_fields import config_changes

#: The sampler, learned codebooks and their optimizer, written by one process.
MIDX_STATE_NAME = "midx_state.safetensors"
#: The sampler generator of a single-process run.
MIDX_RNG_STATE_NAME = "midx_rng_state.safetensors"
#: The sampler generator of rank ``r`` in a multi-process run (formatted with ``rank``).
MIDX_RNG_STATE_PATTERN = "midx_rng_state_{rank}.safetensors"
#: The key of the generator's (2,) int64 state in a sampler's ``state_dict`` (saved per rank).
GENERATOR_KEY = "generator_state"

_FORMAT = "hf-midx-trainer-state"
#: The exact head's (H,) class ids in the shared state file.
_EXACT_IDS_KEY = "exact_ids"


@dataclass
class SavedState:
    """What :func:`read_state` found in a checkpoint, validated; nothing loaded yet.

    ``sampler``: the sampler's tensors without the generator; ``rng``: this rank's (2,) int64 generator
    state, or None; ``extra``: the other tensors (the learned codebooks'); ``metadata``: the strings;
    ``changes``: the config fields changed since the checkpoint that a resume accepts
    (:mod:`hf_midx.integration.resume_fields`), each ``"name: checkpoint <value>, now <value>"``.
    """

    checkpoint: str
    sampler: dict[str, torch.Tensor]
    rng: torch.Tensor | None
    extra: dict[str, torch.Tensor]
    metadata: dict[str, str] = field(default_factory=dict)
    changes: list[str] = field(default_factory=list)

    @property
    def last_refresh_step(self) -> int:
        return int(self.metadata.get("last_refresh_step", -1))


def index_quantizer(config) -> str:
    """The quantizer a MIDX sampler of ``config`` indexes with: "pq" for midx-pq, else its option (default "rq")."""
    return config.sampler_options.get("quantizer", "pq" if config.sampler == "midx-pq" else "rq")


def checkpoint_facts(config, num_classes: int, dim: int, sampler: Mapping[str, torch.Tensor]) -> dict[str, str]:
    """The facts a checkpoint must share with the model it is loaded into.

    Args:
        config: the head's :class:`~hf_midx.MidxConfig`; num_classes, dim: V and D of the head weight.
        sampler: the sampler's tensors (a MIDX index's ``index.codebook1`` (K, D1) gives K).
    """
    facts = {"sampler": config.sampler, "num_classes": str(num_classes), "dim": str(dim), "codebooks": config.codebooks}
    if "index.codebook1" in sampler:
        facts["codebook_size"] = str(sampler["index.codebook1"].shape[0])
        facts["quantizer"] = index_quantizer(config)
    return facts


def rng_file(folder: str, rank: int, world_size: int) -> str:
    """The path of ``rank``'s generator file in ``folder``."""
    if world_size <= 1:
        return os.path.join(folder, MIDX_RNG_STATE_NAME)
    return os.path.join(folder, MIDX_RNG_STATE_PATTERN.format(rank=rank))


def _cpu_copy(tensor: torch.Tensor) -> torch.Tensor:
    """A contiguous CPU copy that shares no storage (safetensors refuses shared tensors)."""
    return tensor.detach().to("cpu", copy=True).contiguous()


def _save(tensors: dict[str, torch.Tensor], path: str, metadata: dict[str, str]) -> None:
    atomic_write(path, lambda tmp: save_file({k: _cpu_copy(v) for k, v in tensors.items()}, tmp, metadata=metadata))


def _load(path: str) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    with safe_open(path, framework="pt") as f:
        return {key: f.get_tensor(key) for key in f.keys()}, dict(f.metadata() or {})


def save_state(
    folder: str,
    *,
    config,
    facts: Mapping[str, str],
    sampler: Mapping[str, torch.Tensor],
    generator_state: torch.Tensor,
    last_refresh_step: int,
    exact_ids: torch.Tensor | None = None,
    extra: Mapping[str, torch.Tensor] | None = None,
    extra_metadata: Mapping[str, str] | None = None,
    chosen: Mapping[str, int] | None = None,
    rank: int = 0,
    world_size: int = 1,
    write_shared: bool = True,
) -> None:
    """Write a MIDX state into ``folder`` (created if needed).

    Every process calls it: each writes its ``generator_state`` ((2,) int64); the process with
    ``write_shared`` also writes ``midx_state.safetensors`` (``sampler`` tensors without the generator,
    ``exact_ids`` (H,) int64, ``extra`` tensors, ``facts`` and ``extra_metadata``) and ``midx_config.json``
    (``config``, the :class:`~hf_midx.MidxConfig`, with ``chosen``: what its ``"auto"`` fields became).
    """
    os.makedirs(folder, exist_ok=True)
    if write_shared:
        tensors = {f"sampler.{k}": v for k, v in sampler.items() if k != GENERATOR_KEY}
        if exact_ids is not None:
            tensors[_EXACT_IDS_KEY] = exact_ids  # which classes: the sampler's own ids index the others only
        tensors.update(extra or {})
        metadata = {
            "format": _FORMAT,
            "hf_midx_version": __version__,
            "last_refresh_step": str(last_refresh_step),
            **facts,
            **(extra_metadata or {}),
        }
        _save(tensors, os.path.join(folder, MIDX_STATE_NAME), metadata)
        config.save_pretrained(folder, chosen=chosen)
    _save(
        {GENERATOR_KEY: generator_state},
        rng_file(folder, rank, world_size),
        {"format": _FORMAT, "rank": str(rank), "world_size": str(world_size)},
    )


def has_state(folder: str) -> bool:
    return os.path.isfile(os.path.join(folder, MIDX_STATE_NAME))


def read_state(
    folder: str,
    *,
    facts: Mapping[str, str],
    sampler: Mapping[str, torch.Tensor],
    exact_ids: torch.Tensor | None = None,
    config=None,
    rank: int = 0,
    world_size: int = 1,
) -> SavedState:
    """Load and validate ``folder``'s MIDX state against the model's; changes nothing.

    Args:
        facts: the model's :func:`checkpoint_facts`.
        sampler: the model's sampler tensors (names and shapes are compared; the generator is ignored).
        exact_ids: the model's (H,) exact-head ids, or None.
        config: the model's :class:`~hf_midx.MidxConfig` as its head uses it, compared with the checkpoint's
            ``midx_config.json`` field by field (:mod:`hf_midx.integration.resume_fields`), or None.
    Raises:
        ValueError: no MIDX state in the folder, another format, a config field changed that the resumed run
            would compute differently (each named with both values), or a state made for another
            vocabulary, hidden size, sampler, codebook size, quantizer, codebook mode or exact head.
    """
    path = os.path.join(folder, MIDX_STATE_NAME)
    if not os.path.isfile(path):
        raise ValueError(
            f"Cannot resume from {folder!r}: it has no {MIDX_STATE_NAME}, so it was not written by "
            "MidxTrainer or MidxCallback. To start MIDX training from those weights, load them with "
            "from_pretrained, wrap the head and call train() without resume_from_checkpoint."
        )
    tensors, metadata = _load(path)
    if metadata.get("format") != _FORMAT:
        raise ValueError(f"{path!r} is not an hf-midx trainer state (format {metadata.get('format')!r}).")
    refused, noted = [], []
    config_file = os.path.join(folder, CONFIG_NAME)
    if config is not None and os.path.isfile(config_file):
        with open(config_file, encoding="utf-8") as f:
            refused, noted = config_changes(json.load(f), config)
    named = {entry.split(":", 1)[0] for entry in refused}
    refused += [f"{k}: checkpoint {metadata.get(k)!r}, now {v!r}" for k, v in facts.items()
                if metadata.get(k) != v and k not in named]  # fmt: skip
    if refused:
        raise ValueError(
            f"Cannot resume from {folder!r}: its MIDX state was made for another head or MidxConfig, so the resumed "
            "run would not be the uninterrupted one (" + "; ".join(refused) + "). Resume with the checkpoint's "
            f"vocabulary, hidden size and MidxConfig (its {CONFIG_NAME}), or start a new run without "
            "resume_from_checkpoint."
        )
    sampler_state = {k[len("sampler.") :]: v for k, v in tensors.items() if k.startswith("sampler.")}
    expected = {k: v for k, v in sampler.items() if k != GENERATOR_KEY}
    if set(sampler_state) != set(expected):
        raise ValueError(
            f"Cannot resume from {folder!r}: its sampler state has tensors {sorted(sampler_state)}, this "
            f"sampler has {sorted(expected)}."
        )
    for key, have in expected.items():
        if tuple(sampler_state[key].shape) != tuple(have.shape):
            raise ValueError(
                f"Cannot resume from {folder!r}: sampler tensor {key!r} has shape "
                f"{tuple(sampler_state[key].shape)} in the checkpoint but {tuple(have.shape)} in this model "
                "(another vocabulary, hidden size or codebook size)."
            )
    saved_head = tensors.pop(_EXACT_IDS_KEY, None)  # absent from checkpoints of hf-midx before this check
    if saved_head is not None and (exact_ids is None or not torch.equal(saved_head, exact_ids.cpu())):
        raise ValueError(
            f"Cannot resume from {folder!r}: its exact head is another set of {saved_head.numel()} classes than this "
            "model's (class_counts of other data?). Resume with the class counts the run was wrapped with, or start "
            "a new run without resume_from_checkpoint."
        )
    rng = None
    path = rng_file(folder, rank, world_size)
    if os.path.isfile(path):
        rng = _load(path)[0][GENERATOR_KEY]
    else:
        warnings.warn(
            f"{path!r} is missing (the checkpoint was made with another number of processes?): this "
            "process's sampler generator restarts from its seed, so the resumed run draws other negatives.",
            UserWarning,
            stacklevel=2,
        )
    extra = {k: v for k, v in tensors.items() if not k.startswith("sampler.")}
    return SavedState(checkpoint=folder, sampler=sampler_state, rng=rng, extra=extra, metadata=metadata, changes=noted)


def find_resume_folder(candidates: list, step: int) -> str:
    """The first existing folder of ``candidates`` whose ``trainer_state.json`` (if any) is at ``step``.

    Raises:
        ValueError: none is; the message names the folders looked at.
    """
    for folder in candidates:
        if not isinstance(folder, (str, os.PathLike)) or not os.path.isdir(folder):
            continue
        folder = os.fspath(folder)
        trainer_state = os.path.join(folder, "trainer_state.json")
        if os.path.isfile(trainer_state):
            with open(trainer_state, encoding="utf-8") as f:
                if json.load(f).get("global_step") != step:
                    continue
        return folder
    looked = [os.fspath(c) for c in candidates if isinstance(c, (str, os.PathLike))]
    raise ValueError(
        f"Training resumes at step {step}, but MidxCallback found no checkpoint folder of that step with "
        f"{MIDX_STATE_NAME} (looked at {looked}); pass the folder given to "
        "train(resume_from_checkpoint=...) to MidxCallback(resume_from_checkpoint=...) or "
        "MidxCallback.install(trainer, resume_from_checkpoint=...)."
    )


__all__ = [
    "GENERATOR_KEY",
    "MIDX_RNG_STATE_NAME",
    "MIDX_RNG_STATE_PATTERN",
    "MIDX_STATE_NAME",
    "SavedState",
    "checkpoint_facts",
    "find_resume_folder",
    "has_state",
    "index_quantizer",
    "read_state",
    "rng_file",
    "save_state",
]
