"""The MIDX proposal's bucket draw in one Triton launch: the hot part of ``MidxQuantizedSampler``'s draw.

For T queries with codeword scores s = [z1 . c1, z2 . c2] (T, 2K) and the index's log bucket masses log W
(K * K,), the proposal over the K * K buckets has logits s[t, k1] + s[t, K + k2] + log W[k1 * K + k2]; the
sampler draws M buckets a query by inverse CDF over their running sum (the two-stage P1(k1) P2(k2 | k1) draw
in one search), and the expected tail gradient reads the bucket probabilities. Eagerly that is a chain of
(T, K * K) tensors in global memory (the logits, their max, the exponentials, the scan, the search, two scalings):
at T = 8,192 and K = 32 about ten passes over 32 MB each, a third of the default step's device time
(``recipes/benchmarks/results/cost_model/``). :func:`midx_bucket_draw` keeps a token's K * K logits in registers
and writes only what the step reads: the (T, M) buckets, log Z and, when asked, the (T, K * K) probabilities.

The numbers are the eager draw's up to float rounding: the running sum is a parallel scan here, a sequential
one in PyTorch's CPU cumsum, and Triton's exp is the device's; a target within a rounding of a bucket boundary can
fall on the other side of it (rare, and both are draws of the same proposal). The uniforms are the caller's, so the
random stream (:class:`hf_midx.rng.CounterRNG`) advances exactly as in the eager draw.
"""

from __future__ import annotations

import torch

from .launch import check_fused, pow2, triton_interpreting

#: The largest K * K the kernel takes: a token's bucket logits, exponentials and running sums stay in registers
#: (BLOCK_T x K * K floats each, over 4 warps). K = 64 (4,096 buckets) fits; a larger codebook keeps the eager draw.
MAX_BUCKETS = 4096


def fits(codebook_size: int) -> bool:
    """Whether :func:`midx_bucket_draw` takes a codebook of ``codebook_size`` (K * K <= :data:`MAX_BUCKETS`)."""
    return codebook_size * codebook_size <= MAX_BUCKETS


def midx_bucket_draw(
    scores: torch.Tensor, log_mass: torch.Tensor, u: torch.Tensor, share: torch.Tensor | None = None, *,
    probs: bool = True,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """M buckets per query from the MIDX proposal over K * K buckets, its log Z and its bucket probabilities.

    Args:
        scores: (T, 2K) float32 codeword scores [z1 . c1, z2 . c2].
        log_mass: (K * K,) float32 log bucket masses (-inf for an empty bucket, which is never drawn).
        u: (T, M) float64 uniforms in [0, 1), one per draw.
        share: optional (K * K,) float32 factor on each bucket's probability (the uniform last stage's
            (1 - a) / |Omega|, 0 for an empty bucket).
        probs: whether to return the probabilities (the expected tail gradient's factors).
    Returns:
        bucket (T, M) int64 in [0, K * K), log_z (T, 1) float32 (the logsumexp of the bucket logits), and
        probs (T, K * K) float32 P(bucket | z_t) (times ``share``) or None.
    """
    if not (isinstance(scores, torch.Tensor) and scores.dim() == 2 and scores.dtype == torch.float32
            and scores.shape[1] % 2 == 0 and scores.shape[1] > 0):
        raise ValueError(f"scores must be (T, 2K) float32, got {getattr(scores, 'dtype', None)} {tuple(getattr(scores, 'shape', ()))}.")
    num_tokens, k = scores.shape[0], scores.shape[1] // 2
    if not fits(k):
        raise ValueError(f"midx_bucket_draw takes K * K <= {MAX_BUCKETS} buckets, got K = {k}; use the eager draw.")
    if not (isinstance(log_mass, torch.Tensor) and log_mass.dtype == torch.float32 and tuple(log_mass.shape) == (k * k,)):
        raise ValueError(f"log_mass must be ({k * k},) float32, got {tuple(getattr(log_mass, 'shape', ()))}.")
    if not (isinstance(u, torch.Tensor) and u.dtype == torch.float64 and u.dim() == 2 and u.shape[0] == num_tokens):
        raise ValueError(f"u must be (T, M) = ({num_tokens}, M) float64, got {tuple(getattr(u, 'shape', ()))}.")
    if share is not None and not (share.dtype == torch.float32 and tuple(share.shape) == (k * k,)):
        raise ValueError(f"share must be ({k * k},) float32 or None, got {tuple(share.shape)}.")
    if not torch.compiler.is_compiling():
        check_fused(scores)
    device, m = scores.device, u.shape[1]
    bucket = torch.empty((num_tokens, m), device=device, dtype=torch.int64)
    log_z = torch.empty((num_tokens, 1), device=device, dtype=torch.float32)
    out = torch.empty((num_tokens, k * k), device=device, dtype=torch.float32) if probs else None
    interpreted = not torch.compiler.is_compiling() and triton_interpreting()
    torch.ops.hf_midx.midx_draw(
        scores.contiguous(), log_mass.contiguous(), u.contiguous(), None if share is None else share.contiguous(),
        bucket, log_z, out, launch_options(num_tokens, k, interpreted),
    )
    return bucket, log_z, out


def launch_options(num_tokens: int, codebook_size: int, interpreted: bool) -> list[int]:
    """The ``ints`` of ``torch.ops.hf_midx.midx_draw``: [K, BLOCK_T, warps]. On a GPU a (BLOCK_T, K * K) tile of
    4,096 floats a tensor over 4 warps (K = 32: 4 tokens a program). Built by ptxas for sm_80 to sm_120
    (``recipes/benchmarks/results/kernel-builds/``, not timed on a GPU) it takes 95-96 registers a thread and no
    stack, 5 programs an SM; at 8 warps it takes 64-78 but 8 B of stack a thread on sm_86 and later, at any register
    cap. The interpreter runs a program at a time in Python, so there the tiles are as large as the problem allows.

    On a GPU the tile does not depend on T, a symbolic size under ``torch.compile`` with dynamic shapes (one graph
    for every sequence length; tokens past T are masked); the interpreter sees a concrete T."""
    block_b = pow2(codebook_size * codebook_size)
    if not interpreted:
        return [codebook_size, max(1, 4096 // block_b), 4]
    return [codebook_size, max(1, min(pow2(num_tokens), (1 << 18) // block_b)), 4]


__all__ = ["MAX_BUCKETS", "fits", "launch_options", "midx_bucket_draw"]
