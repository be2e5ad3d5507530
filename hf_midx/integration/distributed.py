"""The MIDX head across processes: gather its weight, rebuild the index on rank 0, give it to every rank.

One process per GPU: :func:`refuse_data_parallel` refuses ``torch.nn.DataParallel``.

Every function here is collective when a process group of more than one process is up: all ranks call
it together. Single-process runs skip the communication. The head is used through its public methods
(``weight``, ``bias``, ``refresh``, ``set_codebooks``, ``sampler_state``, ``load_sampler_state``); this
module imports no transformers and not the head's module.

Sharded heads: FSDP2 ``DTensor`` weights are gathered with ``full_tensor()``, DeepSpeed ZeRO-3 ones with
``deepspeed.zero.GatheredParameters`` (:mod:`hf_midx.integration.zero`). FSDP1 (flat parameters) is not supported.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterable

import torch
import torch.distributed as dist

from ..rng import CounterRNG
from .state import GENERATOR_KEY
from .zero import gathered, local_part


def is_distributed() -> bool:
    """True when a process group of more than one process is up."""
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def rank() -> int:
    return dist.get_rank() if is_distributed() else 0


def mean_over_ranks(value: torch.Tensor) -> torch.Tensor:
    """The mean of ``value`` over the processes (a copy), or ``value`` itself in one process."""
    if is_distributed():
        value = value.detach().clone()
        dist.all_reduce(value)
        value = value / dist.get_world_size()
    return value


def min_over_ranks(value: torch.Tensor) -> torch.Tensor:
    """The elementwise minimum of ``value`` over the processes, in place; returns it."""
    if is_distributed():
        dist.all_reduce(value, op=dist.ReduceOp.MIN)
    return value


def max_over_ranks(value: torch.Tensor) -> torch.Tensor:
    """The elementwise maximum of ``value`` over the processes, in place; returns it."""
    if is_distributed():
        dist.all_reduce(value, op=dist.ReduceOp.MAX)
    return value


def average_gradients(params: Iterable[torch.nn.Parameter]) -> None:
    """Replace each parameter's gradient by its mean over the processes (in place)."""
    if is_distributed():
        world = dist.get_world_size()
        for p in params:
            dist.all_reduce(p.grad)
            p.grad.div_(world)


@torch.no_grad()
def broadcast_from_rank0(tensors: Iterable[torch.Tensor]) -> None:
    """Overwrite each tensor with rank 0's (in place), in the order given."""
    if is_distributed():
        for tensor in tensors:
            dist.broadcast(tensor, src=0)


def refuse_data_parallel(args) -> None:
    """ValueError when one process sees several GPUs (``args.n_gpu > 1``) without a distributed launch: the
    Trainer would use ``torch.nn.DataParallel``, whose replicas share neither the sampler nor the step data."""
    n_gpu = getattr(args, "n_gpu", 1)
    if n_gpu > 1:
        raise ValueError(
            f"This single process sees {n_gpu} GPUs, so the Trainer would use torch.nn.DataParallel, which the MIDX "
            f"head does not support. Launch one process per GPU (`accelerate launch --multi_gpu --num_processes "
            f"{n_gpu} ...` or `torchrun --nproc_per_node {n_gpu} ...`), or use one GPU (CUDA_VISIBLE_DEVICES=0)."
        )


def _local(weight: torch.Tensor) -> torch.Tensor:
    """This process's part of ``weight``: a ``DTensor``'s local shard, a ZeRO-3 parameter's slice, or itself."""
    return weight.to_local() if callable(getattr(weight, "to_local", None)) else local_part(weight)


def local_device(weight: torch.Tensor) -> torch.device:
    """The device of this process's part of ``weight`` (a ``DTensor``'s local shard, a ZeRO-3 slice)."""
    return _local(weight).device


def weight_finite(weight: torch.Tensor) -> bool:
    """True when this process's part of ``weight`` holds no NaN/Inf (one sync)."""
    local = _local(weight)
    return local.numel() == 0 or bool(torch.isfinite(local.detach()).all())


@contextlib.contextmanager
def full_head_weight(head):
    """The head's full (V, D) weight and (V,) bias (or None), detached; gathered when sharded.

    FSDP2 ``DTensor`` parameters: ``full_tensor()``; DeepSpeed ZeRO-3 partitioned parameters:
    ``deepspeed.zero.GatheredParameters``. Both are collectives: every rank must enter together.
    """
    weight, bias = head.weight, head.bias
    if callable(getattr(weight, "full_tensor", None)):  # FSDP2 / tensor-parallel DTensor
        full_bias = bias.full_tensor() if callable(getattr(bias, "full_tensor", None)) else bias
        yield weight.full_tensor().detach(), None if full_bias is None else full_bias.detach()
    else:
        with gathered([weight, bias]):  # DeepSpeed ZeRO-3; nothing to do for a whole weight
            yield weight.detach(), None if bias is None else bias.detach()


def sampler_device(head) -> torch.device:
    """The device the head's sampler keeps its tables on (that of its size tensors)."""
    return next(v.device for k, v in head.sampler_state().items() if k != GENERATOR_KEY)


def broadcast_sampler(head, *, seed: int | None = None) -> None:
    """Give every rank rank 0's sampler tables (codebooks, codes, bucket tables), not its generator.

    Args:
        seed: also restart this rank's sampler generator from ``seed`` (each rank passes its own).
    """
    if not is_distributed() and seed is None:
        return
    state = {k: v.contiguous().clone() for k, v in head.sampler_state().items() if k != GENERATOR_KEY}
    broadcast_from_rank0(state[key] for key in sorted(state))
    if seed is not None:
        state[GENERATOR_KEY] = CounterRNG(seed).get_state()
    if rank() != 0 or seed is not None:
        head.load_sampler_state(state)


def refresh_head(head, codebooks: tuple[torch.Tensor, torch.Tensor] | None = None) -> float | None:
    """Rebuild the head's index from its gathered weight on rank 0 and broadcast it.

    Args:
        codebooks: learned (K, D1), (K, D2) codebooks to adopt (MIDX samplers) instead of k-means.
    Returns:
        the seconds it took, or None when the weight holds NaN/Inf: then nothing was rebuilt, on any rank.
    """
    start = time.perf_counter()
    with full_head_weight(head) as (weight, _):
        if not bool(torch.isfinite(weight).all()):  # the full weight: every rank sees the same and returns
            return None
        if rank() == 0:
            if codebooks is not None:
                head.set_codebooks(codebooks, weight)
            else:
                head.refresh(weight)
    broadcast_sampler(head)
    head.step_data.calls_since_refresh = 0
    return time.perf_counter() - start


__all__ = [
    "average_gradients",
    "broadcast_from_rank0",
    "broadcast_sampler",
    "full_head_weight",
    "is_distributed",
    "local_device",
    "max_over_ranks",
    "mean_over_ranks",
    "min_over_ranks",
    "rank",
    "refresh_head",
    "refuse_data_parallel",
    "sampler_device",
    "weight_finite",
]
