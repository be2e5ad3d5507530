"""Triton side of the counter-based stream of :class:`hf_midx.rng.CounterRNG` (SplitMix64).

The i-th 64-bit word after offset o is ``mix(key + (o + 1 + i) * gamma)``, modulo 2^64; float32 uniforms
take two 24-bit halves of a word (bits 40-63, then 8-31), float64 ones the top 53 bits of one word, in
the order ``CounterRNG.rand`` uses, so a kernel draws the very numbers the eager stream gives. The
``uniform_*`` helpers are for kernels that draw where they use the numbers.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def _mix(z):
    """SplitMix64's finalizer on uint64 (multiplication wraps modulo 2^64, shifts are logical)."""
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9
    z = (z ^ (z >> 27)) * 0x94D049BB133111EB
    return z ^ (z >> 31)


@triton.jit
def _word(key, offset, i):
    """Word i (int) of the stream at (key, offset) (uint64 scalars), as uint64."""
    return _mix(key + (offset + 1 + i.to(tl.uint64)) * 0x9E3779B97F4A7C15)


@triton.jit
def uniform_f32(key, offset, e):
    """Float32 uniform number e (int) in [0, 1): CounterRNG.rand(..., dtype=float32)'s element e."""
    word = _word(key, offset, e // 2)
    bits = tl.where(e % 2 == 0, word >> 40, (word >> 8) & 0xFFFFFF)
    return bits.to(tl.float32) * (1.0 / (1 << 24))


@triton.jit
def uniform_f64(key, offset, e):
    """Float64 uniform number e (int) in [0, 1): CounterRNG.rand(..., dtype=float64)'s element e."""
    return (_word(key, offset, e) >> 11).to(tl.float64) * (1.0 / (1 << 53))


@triton.jit
def counter_rand_kernel(state_ptr, out_ptr, n, F64: tl.constexpr, BLOCK: tl.constexpr):
    """out[e] = uniform e of the stream whose (2,) int64 state [key, offset] is at state_ptr, e < n."""
    e = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    key = tl.load(state_ptr).to(tl.uint64, bitcast=True)
    offset = tl.load(state_ptr + 1).to(tl.uint64, bitcast=True)
    if F64:
        u = uniform_f64(key, offset, e)
    else:
        u = uniform_f32(key, offset, e)
    tl.store(out_ptr + e, u, mask=e < n)
