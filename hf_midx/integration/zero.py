"""DeepSpeed ZeRO-3 partitioned parameters, read outside the model's forward.

Under ZeRO-3 each process holds a slice of every parameter; the Parameter itself is an empty (0,) tensor
except while DeepSpeed gathers it, which it does around each module's forward (and, for a parameter read
by another module's forward, such as the head's weight read by the host's loss, around the host's). What
hf_midx reads outside a forward (wrap's build and check, the refresh, learned codebooks, the diagnostics)
goes through :func:`gathered`, DeepSpeed's public ``deepspeed.zero.GatheredParameters``, and what only
needs the sizes through :func:`full_shape`.

A ZeRO-3 parameter is recognised by the attributes DeepSpeed gives it (``ds_id``, ``ds_shape``: the full
shape, ``ds_tensor``: this process's slice), as transformers recognises it; ZeRO-1/2 leave parameters whole,
so they need nothing here. Nothing imports deepspeed unless such a parameter is met.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Iterator

import torch


def is_partitioned(param: torch.Tensor | None) -> bool:
    """True for a DeepSpeed ZeRO-3 parameter (gathered or not at this moment)."""
    return param is not None and getattr(param, "ds_id", None) is not None


def full_shape(param: torch.Tensor) -> tuple[int, ...]:
    """The full shape of ``param``: ``ds_shape`` for a ZeRO-3 parameter (whose own shape is (0,)), else its shape."""
    return tuple(param.ds_shape) if is_partitioned(param) else tuple(param.shape)


def local_part(param: torch.Tensor) -> torch.Tensor:
    """This process's part of ``param``: the slice ``ds_tensor`` of a ZeRO-3 parameter, else ``param``."""
    return param.ds_tensor if is_partitioned(param) and getattr(param, "ds_tensor", None) is not None else param


def check_whole(weight: torch.Tensor) -> None:
    """A ValueError for a (V, D) head weight that is a ZeRO-3 slice: DeepSpeed gathers it only inside the
    engine's forward (and :func:`gathered`), so a loss computed elsewhere (a custom loop) would read the slice."""
    if weight.dim() != 2:
        raise ValueError(
            f"The head's weight is a partitioned slice of shape {tuple(weight.shape)} (DeepSpeed ZeRO-3): compute "
            "the loss inside the model's forward, within deepspeed.zero.GatheredParameters([head.weight]), or pass "
            "the full weight= (and bias=)."
        )


@contextlib.contextmanager
def gathered(params: Iterable[torch.Tensor | None]) -> Iterator[None]:
    """Within this context the ZeRO-3 parameters among ``params`` hold their full data (read only: changes
    are not written back to the slices); others (and None) are left alone. Collective when any is
    partitioned: every rank must enter with the same parameters."""
    partitioned = [p for p in params if is_partitioned(p)]
    if not partitioned:
        yield
        return
    import deepspeed  # only when a ZeRO-3 parameter exists, so deepspeed is installed and in use

    with deepspeed.zero.GatheredParameters(partitioned, modifier_rank=None):
        yield


__all__ = ["check_whole", "full_shape", "gathered", "is_partitioned", "local_part"]
