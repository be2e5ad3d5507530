"""The MIDX training state in a checkpoint folder: the sampler, its random stream, learned codebooks.

Files (beside the Trainer's own, in ``checkpoint-N/``), each written to a temporary name and renamed
into place:

* ``midx_state.safetensors`` (one process writes it): ``sampler.*`` the sampler's tensors (for MIDX
  ``sampler.index.codebook1``, ``sampler.index.codebook2``, ``sampler.index.codes``);
  ``codebooks.codebook1`` / ``codebooks.codebook2`` the learned codewords and
  ``codebook_optimizer.state.<i>.<name>`` their Adam state. The metadata holds the format, the
  hf-midx version, the sampler name, V, D, K, the quantizer, the codebook mode, the last refresh step
  and the Adam ``param_groups`` (JSON).
* ``midx_rng_state.safetensors`` (one process) or ``midx_rng_state_<rank>.safetensors`` (one per
  process): the sampler generator of that rank, since every rank draws its own negatives.
* ``midx_config.json``: the :class:`~hf_midx.MidxConfig`.

:func:`read_state` checks V, D, K, the sampler, the quantizer and the codebook mode against the
model's head before anything is loaded and raises ``ValueError`` on a mismatch; :func:`apply_state`
then loads what :func:`read_state` returned.
"""

from __future__ import annotations

import json
import os
import warnings
from dataclasses import dataclass, field
from typing import Any

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from ._io import atomic_write
from .head import MidxLMHead
from .samplers import MidxSampler
from .version import __version__

#: The sampler, learned codebooks and their optimizer, written by one process.
MIDX_STATE_NAME = "midx_state.safetensors"
#: The sampler generator of a single-process run.
MIDX_RNG_STATE_NAME = "midx_rng_state.safetensors"
#: The sampler generator of rank ``r`` in a multi-process run (formatted with ``rank``).
MIDX_RNG_STATE_PATTERN = "midx_rng_state_{rank}.safetensors"

_FORMAT = "hf-midx-trainer-state"
_GENERATOR_KEY = "generator_state"


@dataclass
class SavedState:
    """What :func:`read_state` found in a checkpoint, validated against the head; nothing loaded yet."""

    checkpoint: str
    sampler: dict[str, torch.Tensor]
    rng: torch.Tensor | None
    learned: dict[str, torch.Tensor]
    optimizer: dict[str, torch.Tensor]
    metadata: dict[str, str] = field(default_factory=dict)

    @property
    def last_refresh_step(self) -> int:
        return int(self.metadata.get("last_refresh_step", -1))


def rng_file(folder: str, rank: int, world_size: int) -> str:
    """The path of ``rank``'s generator file in ``folder``."""
    if world_size <= 1:
        return os.path.join(folder, MIDX_RNG_STATE_NAME)
    return os.path.join(folder, MIDX_RNG_STATE_PATTERN.format(rank=rank))


def sampler_tensors(head: MidxLMHead) -> dict[str, torch.Tensor]:
    """The sampler's state tensors without its generator (which is per rank)."""
    return {k: v for k, v in head.sampler.state_dict().items() if k != _GENERATOR_KEY}


def describe(head: MidxLMHead) -> dict[str, str]:
    """The facts a checkpoint must share with the head it is loaded into."""
    sampler, config = head.sampler, head.config
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


def _cpu_copy(tensor: torch.Tensor) -> torch.Tensor:
    """A contiguous CPU copy that shares no storage (safetensors refuses shared tensors)."""
    return tensor.detach().to("cpu", copy=True).contiguous()


def _save(tensors: dict[str, torch.Tensor], path: str, metadata: dict[str, str]) -> None:
    atomic_write(path, lambda tmp: save_file(tensors, tmp, metadata=metadata))


def _load(path: str) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    with safe_open(path, framework="pt") as f:
        return {key: f.get_tensor(key) for key in f.keys()}, dict(f.metadata() or {})


#: The exact head's (H,) class ids in the shared state file.
_EXACT_IDS_KEY = "exact_ids"


def save_state(
    folder: str,
    head: MidxLMHead,
    *,
    last_refresh_step: int,
    learner: torch.nn.Module | None = None,
    optimizer: torch.optim.Optimizer | None = None,
    rank: int = 0,
    world_size: int = 1,
    write_shared: bool = True,
) -> None:
    """Write the head's MIDX state into ``folder`` (created if needed).

    Every process calls it: each writes its generator file; the process with ``write_shared`` also
    writes ``midx_state.safetensors`` and ``midx_config.json`` (the same on every rank).
    """
    os.makedirs(folder, exist_ok=True)
    if write_shared:
        tensors = {f"sampler.{k}": _cpu_copy(v) for k, v in sampler_tensors(head).items()}
        if head.exact_ids is not None:
            # Which classes: the sampler's own ids index the others only.
            tensors[_EXACT_IDS_KEY] = _cpu_copy(head.exact_ids)
        metadata = {
            "format": _FORMAT,
            "hf_midx_version": __version__,
            "last_refresh_step": str(last_refresh_step),
            **describe(head),
        }
        if learner is not None:
            for name, p in learner.named_parameters():
                tensors[f"codebooks.{name}"] = _cpu_copy(p)
            opt_state = optimizer.state_dict()
            extras = {}
            for pid, entries in opt_state["state"].items():
                for name, value in entries.items():
                    if isinstance(value, torch.Tensor):
                        tensors[f"codebook_optimizer.state.{pid}.{name}"] = _cpu_copy(value)
                    else:
                        extras[f"{pid}.{name}"] = value
            metadata["codebook_optimizer.param_groups"] = json.dumps(opt_state["param_groups"])
            metadata["codebook_optimizer.extra_state"] = json.dumps(extras)
        _save(tensors, os.path.join(folder, MIDX_STATE_NAME), metadata)
        head.config.save_pretrained(folder)
    _save(
        {_GENERATOR_KEY: head.sampler.generator.get_state()},
        rng_file(folder, rank, world_size),
        {"format": _FORMAT, "rank": str(rank), "world_size": str(world_size)},
    )


def has_state(folder: str) -> bool:
    return os.path.isfile(os.path.join(folder, MIDX_STATE_NAME))


def read_state(folder: str, head: MidxLMHead, *, rank: int = 0, world_size: int = 1) -> SavedState:
    """Load and validate ``folder``'s MIDX state against ``head``; changes nothing.

    Raises:
        ValueError: no MIDX state in the folder, another format, or a state made for another
            vocabulary, hidden size, sampler, codebook size, quantizer or codebook mode.
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
    current = describe(head)
    differ = [f"{k}: checkpoint {metadata.get(k)!r}, model {v!r}" for k, v in current.items() if metadata.get(k) != v]
    if differ:
        raise ValueError(
            f"Cannot resume from {folder!r}: its MIDX state does not match this model's head ("
            + "; ".join(differ)
            + "). Resume with the same vocabulary, hidden size and MidxConfig(sampler, codebook_size, "
            "codebooks), or start a new run without resume_from_checkpoint."
        )
    sampler_state = {k[len("sampler.") :]: v for k, v in tensors.items() if k.startswith("sampler.")}
    expected = sampler_tensors(head)
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
    saved_head = tensors.get(_EXACT_IDS_KEY)  # absent from checkpoints of hf-midx before this check
    if saved_head is not None and (head.exact_ids is None or not torch.equal(saved_head, head.exact_ids.cpu())):
        raise ValueError(
            f"Cannot resume from {folder!r}: its exact head is another set of {saved_head.numel()} classes than this "
            "model's (class_counts of other data?). Resume with the class counts the run was wrapped with, or start "
            "a new run without resume_from_checkpoint."
        )
    learned = {k[len("codebooks.") :]: v for k, v in tensors.items() if k.startswith("codebooks.")}
    if head.config.codebooks == "learned" and set(learned) != {"codebook1", "codebook2"}:
        raise ValueError(f"Cannot resume from {folder!r}: it lacks the learned codebooks.")
    rng = None
    path = rng_file(folder, rank, world_size)
    if os.path.isfile(path):
        rng = _load(path)[0][_GENERATOR_KEY]
    else:
        warnings.warn(
            f"{path!r} is missing (the checkpoint was made with another number of processes?): this "
            "process's sampler generator restarts from its seed, so the resumed run draws other negatives.",
            UserWarning,
            stacklevel=2,
        )
    return SavedState(
        checkpoint=folder,
        sampler=sampler_state,
        rng=rng,
        learned=learned,
        optimizer={k: v for k, v in tensors.items() if k.startswith("codebook_optimizer.")},
        metadata=metadata,
    )


def apply_state(
    saved: SavedState,
    head: MidxLMHead,
    *,
    seed: int,
    learner: torch.nn.Module | None = None,
    optimizer: torch.optim.Optimizer | None = None,
) -> None:
    """Load a validated :class:`SavedState` into the head (and the learned codebooks and their Adam).

    ``seed`` seeds this rank's generator when the checkpoint has no generator file for it.
    """
    sampler = head.sampler
    state = dict(saved.sampler)
    if saved.rng is not None:
        state[_GENERATOR_KEY] = saved.rng
    else:
        sampler.generator.manual_seed(seed)
    sampler.load_state_dict(state)
    if learner is None:
        return
    with torch.no_grad():
        for name, p in learner.named_parameters():
            p.copy_(saved.learned[name].to(p.device))
    opt_state: dict[int, dict[str, Any]] = {}
    for key, value in saved.optimizer.items():
        pid, name = key[len("codebook_optimizer.state.") :].split(".", 1)
        opt_state.setdefault(int(pid), {})[name] = value
    for key, value in json.loads(saved.metadata.get("codebook_optimizer.extra_state", "{}")).items():
        pid, name = key.split(".", 1)
        opt_state.setdefault(int(pid), {})[name] = value
    groups = json.loads(saved.metadata["codebook_optimizer.param_groups"])
    optimizer.load_state_dict({"state": opt_state, "param_groups": groups})


__all__ = [
    "MIDX_RNG_STATE_NAME",
    "MIDX_RNG_STATE_PATTERN",
    "MIDX_STATE_NAME",
    "SavedState",
    "apply_state",
    "describe",
    "has_state",
    "read_state",
    "rng_file",
    "save_state",
]
