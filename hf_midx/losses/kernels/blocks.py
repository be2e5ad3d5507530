"""The tile sizes and register caps of the fused candidate loss's kernels
(:class:`~hf_midx.losses.kernels.FusedCandidateLoss`): one :class:`Blocks` a step, chosen from its shape, for a GPU or
for Triton's CPU interpreter. The reasons for each number (ptxas builds, spills, occupancy) stay beside it."""

from __future__ import annotations

import dataclasses

from .launch import pow2


@dataclasses.dataclass(frozen=True)
class Blocks:
    """Tile sizes of the fused kernels (powers of two; tokens ``t``, dims ``d``, head columns ``h``; for the
    weight gradient, classes ``v`` per program, pairs ``p`` of each class per step and dims ``vd`` per tile),
    warps per program, and the registers a thread of the forward kernel (``registers``; ``float32_registers`` for a
    float32 weight) and of the weight-gradient kernel (``grad_registers``) may use (ptxas's ``maxnreg``, ignored by
    the interpreter)."""

    t: int
    d: int
    h: int
    v: int
    p: int
    warps: int = 8
    vd: int = 32
    # The pairs of a class the weight gradient's program walks itself (a multiple of p); a longer run's rest is summed
    # by chunks of ``run`` sorted pairs in parallel first (candidate_long_runs_kernel). 256 on a GPU: 64 steps of 4
    # pairs at most, where a class drawn 10,000 times (a popular bucket of T M = 160 K draws) walked 2,500.
    run: int = 256
    # Left to itself, ptxas (CUDA 12.9 / 13.4, as Triton 3.9 bundles them) gives these kernels 64 registers at 8
    # warps and spills 8 B a thread at two of the default path's builds (the soft-capped forward on sm_90 to sm_120,
    # the weight gradient on sm_80); at most 80 it takes 78-80 and spills none, 3 programs an SM
    # (recipes/benchmarks/results/kernel-builds/, not timed on a GPU).
    registers: int = 80
    # The weight gradient's cap: Triton 3.8 (torch 2.14's CUDA wheels pin it) fills 80 and spills 24 B of stack a
    # thread on sm_80 to sm_89 with the tail's table; at most 96 it takes 96 there, 83 on sm_90, and spills none.
    # Triton 3.9 then takes 83-96 (80 without a spill at a cap of 80): 2 programs an SM instead of 3 on either.
    # A spill-free build on the toolchains users get is the rule here; neither was timed on a GPU.
    grad_registers: int = 96
    # The forward's cap for a float32 weight (pure float32 training; AMP too, whose kernels read the float32 weight):
    # at 80 it spilled 32 B of stack a thread on sm_80, at 96 8 B on sm_120, at 104 16 B on sm_90; at 128 it takes
    # 115-122 and spills none on sm_80 to sm_120 (Triton 3.9, a one-off build with kernel_builds.py's capture, the
    # weight float32), two programs an SM. Not timed on a GPU.
    float32_registers: int = 128

    @classmethod
    def choose(cls, num_tokens: int, dim: int, rows: int, interpreted: bool) -> "Blocks":
        """On a GPU a (t, R, d) gather tile of about 8 K floats over 8 warps: compiled for sm_90 (not yet
        timed), the forward then needs ~210 registers a thread and spills none, where 4 warps spilled.
        The interpreter runs one program at a time in Python, so there the tiles are as large as the
        problem allows, to keep the programs few.

        The weight gradient's (v, p, vd) = (8, 4, 128) gather tile over 8 warps is a guess, not timed: 128
        dims (256 B of a bf16 row) per gathered row, as Cut Cross-Entropy's indexed dot gathers rows 128 to
        256 wide (its ``_indexed_dot_best_config``; its weight gradient, a dense (128 x 128) ``tl.dot`` tile
        per 32 dims with locked adds, has no sorted pairs to walk); 8 classes a program so that typical
        classes (about T R / V ~ 1 pair each) share a tile, 4 pairs a class a step so that a class drawn
        hundreds of times (frequent labels, popular buckets) takes a quarter of the steps. Compiled for
        sm_90 it needs ~120 registers a thread and spills none (cuobjdump), two programs an SM; (16, 4, 128)
        needed ~180 (one program an SM) and an int64 walk 255 with spills. 128 divides D at the four LLM
        shapes (640 to 4,096).

        On a GPU no tile depends on ``num_tokens``: under ``torch.compile`` with dynamic shapes it is a symbolic
        size, and one graph serves every sequence length (a block past T is masked). The interpreter sees a
        concrete T and caps the token tile at it."""
        budget = 1 << (19 if interpreted else 13)
        d = min(pow2(dim), 128 if interpreted else 32)
        t = max(1, budget // (pow2(rows) * d))
        if interpreted:
            t = min(pow2(num_tokens), t)
        t = 1 << (t.bit_length() - 1)  # a power of two below the budget
        if interpreted:  # within the interpreter's 2^20 elements a tile
            return cls(t=t, d=d, h=max(16, min(1024, (1 << 20) // t)), v=1024, p=8, vd=min(pow2(dim), 128))
        return cls(t=t, d=d, h=128, v=8, p=4, vd=128)


__all__ = ["Blocks"]
