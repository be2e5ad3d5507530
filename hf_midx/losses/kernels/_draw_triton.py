"""Triton side of the MIDX bucket draw (see :mod:`hf_midx.losses.kernels.draw` for what it computes).

One program per block of tokens holds each token's K * K bucket logits in registers, from the (T, 2K) codeword
scores and the (K * K,) log bucket masses, and everything the eager draw (``MidxQuantizedSampler._draw``) makes of
them as (T, K * K) tensors in global memory is done there: the row's max, the exponentials, their running sum,
log Z, the inverse-CDF search of each of the M uniforms, and the bucket probabilities of the proposal's factors.
Each step of that is a pass over T x K * K floats in the eager draw (about ten of them, the scan among them).
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def midx_draw_kernel(
    scores_ptr, log_mass_ptr, u_ptr, share_ptr, bucket_ptr, log_z_ptr, probs_ptr,
    num_tokens, m, stride_scores,
    K: tl.constexpr, HAS_SHARE: tl.constexpr, WRITE_PROBS: tl.constexpr,
    BLOCK_T: tl.constexpr, BLOCK_B: tl.constexpr,
):
    """Tokens pid * BLOCK_T ..: bucket (T, M) int64, log_z (T,) float32 and, with WRITE_PROBS, probs (T, K * K)
    float32 (times share (K * K,) with HAS_SHARE). Bucket b = k1 * K + k2 has logit s[t, k1] + s[t, K + k2] +
    log_mass[b], summed in that order as the eager draw sums it."""
    rows = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    row_ok = rows < num_tokens
    r64 = rows.to(tl.int64)
    cols = tl.arange(0, BLOCK_B)
    col_ok = cols < K * K
    ok = row_ok[:, None] & col_ok[None, :]
    base = scores_ptr + r64[:, None] * stride_scores
    s1 = tl.load(base + (cols // K)[None, :], mask=ok, other=0.0)
    s2 = tl.load(base + (K + cols % K)[None, :], mask=ok, other=0.0)
    # Padding columns and empty buckets are -inf: never drawn, zero probability. A row past T keeps finite
    # logits (its scores read as 0) and is never stored.
    log_mass = tl.load(log_mass_ptr + cols, mask=col_ok, other=float("-inf"))
    joint = (s1 + s2) + log_mass[None, :]
    top = tl.max(joint, axis=1)
    e = tl.exp(joint - top[:, None])
    cum = tl.cumsum(e, axis=1)
    total = tl.max(cum, axis=1)  # the last running sum: adding non-negative numbers never decreases it
    tl.store(log_z_ptr + rows, tl.log(total) + top, mask=row_ok)
    # A target strictly below the row's total (the eager draw's rule): a trailing empty bucket is never drawn.
    scale = (total * (1.0 - 2.0**-23)).to(tl.float64)
    for j in range(m):
        u = tl.load(u_ptr + r64 * m + j, mask=row_ok, other=0.0)
        target = (u * scale).to(tl.float32)
        # searchsorted(cum, target, right=True): how many running sums are at or below the target.
        found = tl.sum((cum <= target[:, None]).to(tl.int32), axis=1)
        found = tl.minimum(found, K * K - 1)  # a NaN row counts none or all; an index in range either way
        tl.store(bucket_ptr + r64 * m + j, found.to(tl.int64), mask=row_ok)
    if WRITE_PROBS:
        probs = e * (1.0 / total)[:, None]
        if HAS_SHARE:
            share = tl.load(share_ptr + cols, mask=col_ok, other=0.0)
            probs = probs * share[None, :]
        tl.store(probs_ptr + r64[:, None] * (K * K) + cols[None, :], probs, mask=ok)
