"""A counter-based random generator that lives on the device: traceable, capturable, resumable.

``torch.Generator`` objects stop ``torch.compile`` (a graph break at every ``generator=`` call) and
CUDA graphs need their own seed handling. :class:`CounterRNG` instead derives every random number
from a key and a position in the stream with SplitMix64 (Steele, Lea and Flood, 2014): the i-th
64-bit word is ``mix(key + (offset + i + 1) * gamma)``, so a draw of ``n`` numbers is a handful of
elementwise integer ops over ``offset + arange(n)``, and ``offset`` (an int64 tensor on the device)
advances by ``n`` in place. The whole state is (key, offset): saving and restoring it continues the
stream bit for bit, and two generators with different seeds give independent-looking streams.

Every draw has a shape known from its arguments; nothing is read back to the host.
"""

from __future__ import annotations

import torch

from ._ops import step_state

# SplitMix64 constants as signed int64 (torch has no uint64 arithmetic on every device).
_GAMMA = 0x9E3779B97F4A7C15 - (1 << 64)
_MUL1 = 0xBF58476D1CE4E5B9 - (1 << 64)
_MUL2 = 0x94D049BB133111EB - (1 << 64)


def _shr(x: torch.Tensor, k: int) -> torch.Tensor:
    """Logical right shift of int64 words (``>>`` on a signed tensor is arithmetic)."""
    return (x >> k) & ((1 << (64 - k)) - 1)


def _mix(z: torch.Tensor) -> torch.Tensor:
    """SplitMix64's finalizer; int64 multiplication wraps modulo 2^64 as the algorithm needs."""
    z = (z ^ _shr(z, 30)) * _MUL1
    z = (z ^ _shr(z, 27)) * _MUL2
    return z ^ _shr(z, 31)


class CounterRNG:
    """SplitMix64 stream on a device, with the ``torch.Generator`` methods the samplers use.

    Args:
        seed: any Python int; it is mixed into the key.
        device: where the counter lives and the numbers are made.
    """

    def __init__(self, seed: int = 0, device: torch.device | str = "cpu") -> None:
        self.device = torch.device(device)
        # [key, offset]: one tensor, so state save/restore and in-place advance touch one buffer.
        self._state = torch.zeros(2, dtype=torch.int64, device=self.device)
        step_state(self._state)  # every draw advances it in place: a CUDA graph of the step replays the stream
        self.manual_seed(seed)

    # ------------------------------------------------------------------ state (torch.Generator-like)
    def manual_seed(self, seed: int) -> "CounterRNG":
        """Restart the stream of ``seed`` (in place); returns self."""
        # seed + gamma: the finalizer maps 0 to 0, and seed 0 should not get the all-zero key.
        key = _mix(torch.tensor([int(seed) & ((1 << 62) - 1)], dtype=torch.int64) + _GAMMA)
        self._state.copy_(torch.cat([key, torch.zeros(1, dtype=torch.int64)]).to(self.device))
        return self

    def get_state(self) -> torch.Tensor:
        """(2,) int64 CPU copy of [key, offset]."""
        return self._state.detach().to("cpu", copy=True)

    def set_state(self, state: torch.Tensor) -> None:
        """Restore a state from :meth:`get_state`; raises ValueError for anything else."""
        if not isinstance(state, torch.Tensor) or state.dtype != torch.int64 or tuple(state.shape) != (2,):
            raise ValueError(
                "A CounterRNG state is a (2,) int64 tensor [key, offset] from CounterRNG.get_state(), got "
                f"{getattr(state, 'dtype', type(state).__name__)} {tuple(getattr(state, 'shape', ()))}."
            )
        self._state.copy_(state.to(self.device))

    def to(self, device: torch.device | str) -> "CounterRNG":
        """A generator on ``device`` that continues the same stream."""
        other = CounterRNG(device=device)
        other._state.copy_(self._state.to(other.device))
        return other

    # ------------------------------------------------------------------ draws
    def _words(self, n: int) -> torch.Tensor:
        """n fresh 64-bit words, (n,) int64; advances the offset by n."""
        key, offset = self._state[0], self._state[1]
        # key + (offset + 1 + i) * gamma as two multiply-adds (the op count of a step is what a GPU pays).
        start = torch.add(key, offset, alpha=_GAMMA)
        words = _mix(torch.add(start, torch.arange(1, n + 1, dtype=torch.int64, device=self.device), alpha=_GAMMA))
        self._state[1:].add_(n)
        return words

    def rand(self, *shape: int, dtype: torch.dtype = torch.float32, fused: bool = False) -> torch.Tensor:
        """Uniform numbers in [0, 1) of ``shape``: 24 random bits for float32 (two per 64-bit word), 53 for float64.

        ``fused``: the same numbers from one Triton launch (:func:`hf_midx.losses.kernels.counter_rand`) instead of
        a dozen elementwise ops (a CUDA generator, or any under ``TRITON_INTERPRET=1``)."""
        n = 1
        for s in shape:
            n *= int(s)
        if fused:
            from .losses.kernels.counter import counter_rand  # noqa: PLC0415 (lazily: Triton)

            return counter_rand(self._state, n, dtype).view(*shape)
        if dtype == torch.float64:
            u = _shr(self._words(n), 11).double() * (1.0 / (1 << 53))
        else:
            # Two 24-bit uniforms per 64-bit word (bits 40-63 and 8-31): half the integer work.
            words = self._words((n + 1) // 2)
            bits = torch.stack([_shr(words, 40), (words >> 8) & 0xFFFFFF], dim=1).reshape(-1)[:n]
            u = (bits.float() * (1.0 / (1 << 24))).to(dtype)
        return u.view(*shape)

    def randint(self, high: int, shape: tuple[int, ...]) -> torch.Tensor:
        """Integers uniform in [0, high), int64 of ``shape`` (53-bit uniforms: bias < high / 2^53)."""
        u = self.rand(*shape, dtype=torch.float64)
        return torch.clamp((u * high).long(), max=high - 1)

    def categorical(
        self, weights: torch.Tensor, num: int, *, cumulative: bool = False, rows: int | None = None
    ) -> torch.Tensor:
        """``num`` i.i.d. draws per row from unnormalized non-negative ``weights`` (..., K): (..., num) int64.

        Inverse CDF by ``searchsorted`` in the weights' precision (use float64 for long rows); a zero-weight
        category is never returned, because the target stays strictly below the total.

        Args:
            cumulative: ``weights`` already are their cumulative sum (a table kept between calls).
            rows: draw for this many rows from one (K,) table: (rows, num).
        """
        cum = weights if cumulative else weights.cumsum(-1)
        total = cum[..., -1:]
        shape = cum.shape[:-1] if rows is None else (rows,)
        u = self.rand(*shape, num, dtype=cum.dtype)
        target = torch.minimum(u * total, torch.nextafter(total, torch.zeros_like(total)))
        # The clamp only matters for a NaN weight (from NaN queries): searchsorted then returns K, and an
        # index out of range would crash before the caller can say which tensor went NaN.
        last = cum.shape[-1] - 1
        if rows is None:
            return torch.searchsorted(cum, target, right=True).clamp_max(last)
        return torch.searchsorted(cum, target.reshape(-1), right=True).clamp_max(last).view(rows, num)

    def __repr__(self) -> str:
        return f"CounterRNG(device={self.device})"


def as_counter_rng(generator, default: CounterRNG) -> CounterRNG:
    """``default`` for None; a CounterRNG as is; a ``torch.Generator`` seeds a new CounterRNG from its stream.

    The conversion reads one number from the ``torch.Generator`` (on its device), so the same
    generator state always gives the same draws.
    """
    if generator is None:
        return default
    if isinstance(generator, CounterRNG):
        return generator
    if isinstance(generator, torch.Generator):
        seed = int(torch.randint(1 << 62, (1,), generator=generator, device=generator.device))
        return CounterRNG(seed, device=default.device)
    raise ValueError(f"generator must be a torch.Generator, an hf_midx CounterRNG or None, got {type(generator).__name__}.")
