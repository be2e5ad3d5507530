"""Training the learned codebooks (``MidxConfig(codebooks="learned")``) beside the model.

:class:`CodebookTraining` holds a :class:`~hf_midx.LearnableCodebooks`, started from the MIDX index's
k-means codebooks, and its own Adam (``codebook_learning_rate``). :class:`hf_midx.MidxCallback` calls
:meth:`~CodebookTraining.step` every optimizer step on the detached head weight and the step's
``kl_queries`` hidden states (gradients averaged over ranks), hands :meth:`~CodebookTraining.codebooks`
to the index at each refresh, and checkpoints :meth:`~CodebookTraining.tensors` and
:meth:`~CodebookTraining.metadata` through :mod:`hf_midx.integration.state`.

Checkpoint names: ``codebooks.codebook1`` / ``codebooks.codebook2`` the codewords,
``codebook_optimizer.state.<i>.<name>`` Adam's tensors, and in the metadata
``codebook_optimizer.param_groups`` and ``codebook_optimizer.extra_state`` (JSON).
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

import torch

from ..indexing.codebooks import LearnableCodebooks
from .distributed import average_gradients, broadcast_from_rank0
from .state import index_quantizer

_CODEBOOKS = "codebooks."
_OPTIMIZER = "codebook_optimizer.state."
_GROUPS = "codebook_optimizer.param_groups"
_EXTRA = "codebook_optimizer.extra_state"


class CodebookTraining:
    """Learned codebooks and their Adam.

    Args:
        sampler_state: the MIDX sampler's tensors (``index.codebook1`` (K, D1), ``index.codebook2`` (K, D2)
            start the codebooks, on their device).
        config: the head's :class:`~hf_midx.MidxConfig` (``kl_weight``, ``codebook_learning_rate``, the quantizer).
    Attributes:
        learner: the :class:`~hf_midx.LearnableCodebooks`; optimizer: its ``torch.optim.Adam``.
    """

    def __init__(self, sampler_state: Mapping[str, torch.Tensor], config) -> None:
        names = ("index.codebook1", "index.codebook2")
        if not all(name in sampler_state for name in names):
            raise ValueError(f"codebooks='learned' needs a MIDX sampler, but the head's sampler is {config.sampler!r}.")
        first, second = (sampler_state[name].clone() for name in names)
        self.learner = LearnableCodebooks((first, second), index_quantizer(config), kl_weight=config.kl_weight)
        self.learner.to(first.device)
        self.optimizer = torch.optim.Adam(self.learner.parameters(), lr=config.codebook_learning_rate)

    def step(self, weight: torch.Tensor, queries: torch.Tensor) -> dict[str, torch.Tensor]:
        """One Adam step on the full (V, D) ``weight`` and (S, D) ``queries`` (scaled as the loss scales them).

        Returns the detached float32 scalars ``loss`` and ``kl``. Raises ValueError on NaN/Inf inputs.
        """
        out = self.learner(weight, queries.to(weight.device))
        self.optimizer.zero_grad(set_to_none=True)
        out["loss"].backward()
        average_gradients(self.learner.parameters())
        self.optimizer.step()
        return {"loss": out["loss"].detach(), "kl": out["kl"].detach()}

    def codebooks(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Copies of the (K, D1), (K, D2) codewords: the index must not alias what Adam updates in place."""
        return tuple(c.detach().clone() for c in self.learner.codebooks)

    def broadcast(self) -> None:
        """Give every rank rank 0's codewords (after a refresh, so that all ranks go on alike)."""
        broadcast_from_rank0(p.data for p in self.learner.parameters())

    # ------------------------------------------------------------------ checkpoint
    def tensors(self) -> dict[str, torch.Tensor]:
        """The codewords and Adam's tensors, under their checkpoint names."""
        tensors = {f"{_CODEBOOKS}{name}": p for name, p in self.learner.named_parameters()}
        for pid, entries in self.optimizer.state_dict()["state"].items():
            for name, value in entries.items():
                if isinstance(value, torch.Tensor):
                    tensors[f"{_OPTIMIZER}{pid}.{name}"] = value
        return tensors

    def metadata(self) -> dict[str, str]:
        """Adam's ``param_groups`` and its non-tensor state, as JSON strings."""
        opt_state = self.optimizer.state_dict()
        extras = {
            f"{pid}.{name}": value
            for pid, entries in opt_state["state"].items()
            for name, value in entries.items()
            if not isinstance(value, torch.Tensor)
        }
        return {_GROUPS: json.dumps(opt_state["param_groups"]), _EXTRA: json.dumps(extras)}

    @staticmethod
    def check_saved(tensors: Mapping[str, torch.Tensor], metadata: Mapping[str, str], folder: str) -> None:
        """ValueError when a checkpoint's tensors and metadata lack the learned codebooks."""
        if {f"{_CODEBOOKS}codebook1", f"{_CODEBOOKS}codebook2"} - set(tensors) or _GROUPS not in metadata:
            raise ValueError(f"Cannot resume from {folder!r}: it lacks the learned codebooks.")

    def load(self, tensors: Mapping[str, torch.Tensor], metadata: Mapping[str, str]) -> None:
        """Restore the codewords and Adam from :meth:`tensors` and :meth:`metadata` of a checkpoint."""
        with torch.no_grad():
            for name, p in self.learner.named_parameters():
                p.copy_(tensors[f"{_CODEBOOKS}{name}"].to(p.device))
        state: dict[int, dict[str, Any]] = {}
        for key, value in tensors.items():
            if key.startswith(_OPTIMIZER):
                pid, name = key[len(_OPTIMIZER) :].split(".", 1)
                state.setdefault(int(pid), {})[name] = value
        for key, value in json.loads(metadata.get(_EXTRA, "{}")).items():
            pid, name = key.split(".", 1)
            state.setdefault(int(pid), {})[name] = value
        self.optimizer.load_state_dict({"state": state, "param_groups": json.loads(metadata[_GROUPS])})


__all__ = ["CodebookTraining"]
