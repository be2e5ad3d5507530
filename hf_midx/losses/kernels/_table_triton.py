"""Triton side of the tail's bucket table (see :mod:`hf_midx.losses.kernels.table` for what it computes).

Two kernels over the refresh's :class:`~hf_midx.samplers.factors.TableLayout`: one program per (chunk, block of
dims) sums a chunk's rows, each row read once for both its member and its static weight, into float32 partials;
one program per (table row, block of dims) adds a bucket's chunk partials into its row, and row B's program adds
every chunk's static partial. Both accumulate in float32, in a fixed order: no atomics, the same table every run.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def bucket_partials_kernel(
    rows_ptr, index_ptr, offsets_ptr, weights_ptr, partials_ptr,
    num_entries, num_chunks, dim, stride_rows,
    STATIC: tl.constexpr, BLOCK_J: tl.constexpr, BLOCK_D: tl.constexpr,
):
    """Chunk c's member-weighted row sum into partials[STRIDE c] and, with STATIC, its static-weighted sum into
    partials[2 c + 1] (STRIDE = 2 with STATIC, else 1), dims pid(1) * BLOCK_D ..; (STRIDE n, D) float32.

    The layout's bags: with STATIC, chunk c's classes are index[lo:hi] with their member weights, lo = offsets[2 c],
    hi = offsets[2 c + 1], and the same classes' static weights follow at weights[hi:2 hi - lo]; without, the chunk
    is index[offsets[c]:offsets[c + 1]] (the last one ends at num_entries)."""
    c = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    col_ok = cols < dim
    if STATIC:
        lo = tl.load(offsets_ptr + 2 * c)
        hi = tl.load(offsets_ptr + 2 * c + 1)
    else:
        lo = tl.load(offsets_ptr + c)
        hi = tl.load(offsets_ptr + c + 1, mask=c + 1 < num_chunks, other=num_entries)
    acc_m = tl.zeros((BLOCK_D,), dtype=tl.float32)
    acc_s = tl.zeros((BLOCK_D,), dtype=tl.float32)
    for j0 in range(lo, hi, BLOCK_J):
        j = j0 + tl.arange(0, BLOCK_J)
        ok = j < hi
        idx = tl.load(index_ptr + j, mask=ok, other=0)
        w_m = tl.load(weights_ptr + j, mask=ok, other=0.0)
        tile = tl.load(rows_ptr + idx[:, None] * stride_rows + cols[None, :], mask=ok[:, None] & col_ok[None, :],
                       other=0.0).to(tl.float32)
        acc_m += tl.sum(tile * w_m[:, None], axis=0)
        if STATIC:
            w_s = tl.load(weights_ptr + j + (hi - lo), mask=ok, other=0.0)
            acc_s += tl.sum(tile * w_s[:, None], axis=0)
    if STATIC:
        tl.store(partials_ptr + (2 * c).to(tl.int64) * dim + cols, acc_m, mask=col_ok)
        tl.store(partials_ptr + (2 * c + 1).to(tl.int64) * dim + cols, acc_s, mask=col_ok)
    else:
        tl.store(partials_ptr + c.to(tl.int64) * dim + cols, acc_m, mask=col_ok)


@triton.jit
def bucket_sums_kernel(
    partials_ptr, chunk_offsets_ptr, table_ptr, num_buckets, num_chunks, dim,
    STATIC: tl.constexpr, BLOCK_C: tl.constexpr, BLOCK_D: tl.constexpr,
):
    """Row b < B of the (B + 1, D) float32 table: the member partials of bucket b's chunks
    chunk_offsets[b] .. chunk_offsets[b + 1]; row B: the static partials of all chunks with STATIC, else 0."""
    b = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    col_ok = cols < dim
    last = b == num_buckets
    # Row B walks every chunk's static partial (odd rows); a bucket row its own chunks' member partials.
    lo = tl.where(last, 0, tl.load(chunk_offsets_ptr + b))
    if STATIC:
        stride = 2
        hi = tl.where(last, num_chunks, tl.load(chunk_offsets_ptr + b + 1, mask=b < num_buckets, other=0))
    else:
        stride = 1
        hi = tl.where(last, 0, tl.load(chunk_offsets_ptr + b + 1, mask=b < num_buckets, other=0))
    first = tl.where(last, 1, 0)
    acc = tl.zeros((BLOCK_C, BLOCK_D), dtype=tl.float32)
    for c0 in range(lo, hi, BLOCK_C):
        c = c0 + tl.arange(0, BLOCK_C)
        ok = c < hi
        part = (stride * c + first).to(tl.int64)
        acc += tl.load(partials_ptr + part[:, None] * dim + cols[None, :], mask=ok[:, None] & col_ok[None, :], other=0.0)
    tl.store(table_ptr + b.to(tl.int64) * dim + cols, tl.sum(acc, axis=0), mask=col_ok)
