"""The tail's bucket table S @ W in two Triton launches: the fused path's form of
:func:`hf_midx.losses.tail_gradient.bucket_table`.

The eager table sums each chunk of a bucket's classes twice, once with their member weights and once with their
static weights (two bags of ``embedding_bag``, the second read from cache at best), in the weight's dtype, then
adds the chunks' partials into their buckets' rows with a second ``embedding_bag``, whose row B walks the padding
chunks one after another on one thread a feature. Here each chunk's rows are read once for both sums, accumulated
in float32, and a bucket's row adds only its own chunks (row B, where the proposal has a static part, adds every
chunk's static partial as a parallel tile walk): the (V, D) weight read once a step, no serial walk longer than a
bucket's chunk count. The layout is the refresh's (:class:`~hf_midx.samplers.factors.TableLayout`), unchanged.

The numbers are the eager table's up to float rounding: float32 sums of the bfloat16 / float16 rows here, sums in
the rows' dtype there (float32 and float64 rows: the same sums, in another order).
"""

from __future__ import annotations

import torch

from .launch import pow2, triton_interpreting


def fused_bucket_table(factors, rows: torch.Tensor) -> torch.Tensor:
    """S @ rows: the (B + 1, C) float32 bucket table of (V, C) ``rows`` (bfloat16, float16 or float32, on CUDA or
    under the Triton interpreter), no gradient, for a proposal with buckets (``factors.layout.chunks`` set: B > 0).

    Args:
        factors: :class:`~hf_midx.samplers.factors.ProposalFactors` (its ``layout`` and ``static`` are read).
        rows: (V, C), the head's weight (its rows are read through their stride: a row-major slice is fine).
    Returns:
        (B + 1, C) float32: row b < B the member-weighted sum of bucket b's classes, row B the static-weighted sum
        of every drawn class (zeros without a static part).
    """
    (index, offsets, weights), _, chunk_offsets, _ = factors.layout
    rows = rows.detach()
    if rows.stride(1) != 1:
        rows = rows.contiguous()
    static = factors.static is not None
    num_chunks = offsets.shape[0] // (2 if static else 1)
    num_buckets, dim = chunk_offsets.shape[0] - 1, rows.shape[1]
    partials = torch.empty(((2 if static else 1) * num_chunks, dim), device=rows.device, dtype=torch.float32)
    table = torch.empty((num_buckets + 1, dim), device=rows.device, dtype=torch.float32)
    interpreted = not torch.compiler.is_compiling() and triton_interpreting()
    torch.ops.hf_midx.bucket_partials(rows, index, offsets, weights.float(), partials,
                                      launch_options(dim, interpreted) + [int(static)])
    torch.ops.hf_midx.bucket_sums(partials, chunk_offsets, table, launch_options(dim, interpreted) + [int(static)])
    return table


def launch_options(dim: int, interpreted: bool) -> list[int]:
    """[BLOCK_J (rows or chunk partials a step), BLOCK_D, warps] of both launches. On a GPU a (32, 128) tile over 8
    warps: 256 B of a bfloat16 row per gathered class (Cut Cross-Entropy gathers rows 128 to 256 wide), 32 classes
    a step, so a chunk of at most 512 classes takes 16 steps; one program per (chunk, 128 dims). Built by ptxas for
    sm_80 to sm_120 (``recipes/benchmarks/results/kernel-builds/``) it takes 64 registers a thread (the sums 40-48)
    and no stack; at 4 warps the same tile had 8 B of stack a thread on sm_86 and sm_89 (16 rows at 4 warps: none,
    the same occupancy). Not timed on a GPU. The interpreter runs a program at a time in Python, so there the tiles
    are as large as the problem allows."""
    if interpreted:
        block_d = min(pow2(dim), 1024)
        return [max(1, min(512, (1 << 16) // block_d)), block_d, 4]
    return [32, min(pow2(dim), 128), 8]


__all__ = ["fused_bucket_table", "launch_options"]
