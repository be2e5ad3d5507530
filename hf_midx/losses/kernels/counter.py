"""The counter-based random stream of :class:`hf_midx.rng.CounterRNG` in one Triton launch.

``CounterRNG.rand`` hashes a counter with a dozen elementwise integer ops, each a kernel launch on a
GPU; :func:`counter_rand` gives the same numbers, bit for bit, from one kernel and advances the same
state. Its eager reference is ``CounterRNG.rand`` itself.
"""

from __future__ import annotations

import torch

from . import launch  # noqa: F401 (registers torch.ops.hf_midx.counter_rand)
from .launch import check_fused


def counter_rand(state: torch.Tensor, n: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The next ``n`` uniforms in [0, 1) of the stream at ``state``, advancing it in place.

    Args:
        state: (2,) int64 [key, offset] on the device, a ``CounterRNG``'s own state tensor (its offset
            moves by the 64-bit words used: (n + 1) // 2 for float32, n for float64, as ``rand`` moves it).
        n: how many numbers (>= 0).
        dtype: torch.float32 (24 random bits each) or torch.float64 (53).
    Returns:
        (n,) tensor of ``dtype``, equal to ``CounterRNG.rand(n, dtype=dtype)`` from the same state.
    """
    if not isinstance(state, torch.Tensor) or state.dtype != torch.int64 or tuple(state.shape) != (2,):
        raise ValueError("state must be a CounterRNG's (2,) int64 [key, offset] tensor.")
    if isinstance(n, bool) or not isinstance(n, int) or n < 0:
        raise ValueError(f"n must be an integer >= 0, got {n!r}.")
    if dtype not in (torch.float32, torch.float64):
        raise ValueError(f"dtype must be torch.float32 or torch.float64, got {dtype}.")
    if not torch.compiler.is_compiling():
        check_fused(state)
    out = torch.empty(n, device=state.device, dtype=dtype)
    # A custom op (launch.py): torch.compile records one call, and a traced step (FakeTensorMode) sees one launch.
    torch.ops.hf_midx.counter_rand(state, out, [1024])
    return out
