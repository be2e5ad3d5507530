"""The Triton launches of the fused path as ``torch.library`` custom ops: the three of
:class:`~hf_midx.losses.kernels.FusedCandidateLoss`, the MIDX draw's and the random stream's, and the tail's
bucket table's two.

``torch.compile`` does not trace into a custom op: it records one call with the declared mutations and
runs the launch as is. So the fused path traces as one graph (no graph break at the kernel module's
import, at the launch, or, under ``TRITON_INTERPRET=1``, inside the interpreter), on a GPU and in the
CPU tests alike. Each op writes only into the tensors it declares mutated and returns nothing; its
fake (meta) version does nothing. Integer and float options travel as lists (a custom op's schema
takes no Python objects); tile sizes are ``Blocks`` fields.
"""

from __future__ import annotations

import contextlib
import importlib
import os

import torch
from torch import Tensor

_LIB = "hf_midx"


# ====================================================================== triton availability
def triton_available() -> bool:
    """True when Triton imports (it ships with torch's CUDA builds on Linux)."""
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


def triton_interpreting() -> bool:
    """True when Triton runs kernels in its CPU interpreter (``TRITON_INTERPRET=1``)."""
    try:
        from triton import knobs

        return bool(knobs.runtime.interpret)
    except (ImportError, AttributeError):
        return os.environ.get("TRITON_INTERPRET", "0") == "1"


def _kernels_module(name: str):
    """The kernel module ``name`` of this package, (re)imported so that its ``@triton.jit`` functions match
    the interpreter setting: Triton decides at decoration time whether a function is compiled or interpreted."""
    module = importlib.import_module(f"{__package__}.{name}")
    if torch.compiler.is_compiling():
        return module  # a compiled graph runs on a GPU, never in the interpreter: nothing to check while tracing
    from triton.runtime.interpreter import InterpretedFunction

    jitted = next(v for v in vars(module).values() if hasattr(v, "arg_names"))  # any @triton.jit function
    if isinstance(jitted, InterpretedFunction) != triton_interpreting():
        module = importlib.reload(module)
    return module


def _kernels():
    return _kernels_module("_candidate_triton")


def on_device(device: torch.device):
    """The context of a launch on ``device``: that CUDA device made current, so that Triton launches there and on
    its current stream (Triton takes both from the current device, not from the tensors), as the ATen ops on the
    same tensors run; nothing on the CPU (the interpreter). Without it, a head on cuda:1 while cuda:0 is current
    (a model spread by ``device_map``) launches on cuda:0: a fault without peer access, or with it a launch on
    cuda:0's stream, unordered against the cuda:1 work that produces its inputs."""
    if device.type != "cuda":
        return contextlib.nullcontext()
    return torch.cuda.device(device)


def check_fused(tensor) -> None:
    """ValueError unless ``backend='fused'`` can run on ``tensor``: Triton installed, and the tensor on CUDA (or the
    CPU under ``TRITON_INTERPRET=1``)."""
    if not triton_available():
        raise ValueError("backend='fused' needs Triton (pip install triton, Linux x86_64); use backend='eager'.")
    if not tensor.is_cuda and not triton_interpreting():
        raise ValueError(
            "backend='fused' runs on CUDA tensors, or on the CPU under TRITON_INTERPRET=1 (slow, for tests); "
            "use backend='eager' on the CPU."
        )


def pow2(n: int) -> int:
    """The power of two at or above n (1 for n <= 1): a Triton block size."""
    return 1 << max(0, int(n) - 1).bit_length()


def cdiv(a: int, b: int) -> int:
    """ceil(a / b): programs of a launch grid."""
    return -(-a // b)


@torch.library.custom_op(
    f"{_LIB}::candidate_forward",
    mutates_args=("head_raw", "g_head", "per_token", "stats", "rows", "g_cand", "share"),
)
def candidate_forward(
    hidden: Tensor, weight: Tensor, bias: Tensor | None, labels: Tensor, ids: Tensor, log_q: Tensor,
    log_q_pos: Tensor | None, head_ids: Tensor | None, head_raw: Tensor | None, g_head: Tensor | None,
    per_token: Tensor, stats: Tensor, rows: Tensor, g_cand: Tensor, share: Tensor | None,
    ints: list[int], floats: list[float], flags: list[bool],
) -> None:
    """The forward kernel: ints = [ignore_index, BLOCK_T, BLOCK_D, BLOCK_H, warps, registers], floats = [scale, cap],
    flags = [has softcap, corrected, drop hits, exact value]. The head's logit gradient goes into ``g_head``,
    or over ``head_raw`` where it is None (both float32). With ``share`` (T,) float32, the tail control."""
    ignore_index, block_t, block_d, block_h, warps, registers = ints
    softcap, corrected, drop_hits, exact_value = flags
    num_tokens, dim = hidden.shape
    m = ids.shape[1]
    num_head = 0 if head_ids is None else head_ids.numel()
    if num_head:
        g_head = head_raw if g_head is None else g_head
    else:
        head_ids = head_raw = g_head = labels  # never read: every loop over H is empty
    with on_device(hidden.device):
        _kernels().candidate_forward_kernel[(cdiv(num_tokens, block_t),)](
            hidden, weight, bias if bias is not None else hidden, labels, ids, log_q,
            log_q_pos if log_q_pos is not None else log_q, head_ids, head_raw,
            per_token, stats, rows, g_cand, g_head, share if share is not None else per_token,
            num_tokens, dim, m, num_head, weight.shape[0],
            hidden.stride(0), weight.stride(0), head_raw.stride(0) if num_head else 0,
            ignore_index, floats[0], floats[1],
            HAS_BIAS=bias is not None, SOFTCAP=softcap, CORRECTED=corrected, DROP_HITS=drop_hits,
            EXACT_VALUE=exact_value, TAIL_CONTROL=share is not None, SEARCH_STEPS=max(0, num_head).bit_length(),
            BLOCK_T=block_t, BLOCK_R=pow2(m + 1), BLOCK_D=block_d, BLOCK_H=block_h,
            num_warps=warps, maxnreg=registers,
        )


@candidate_forward.register_fake
def _(*args, **kwargs) -> None:
    return None


@torch.library.custom_op(f"{_LIB}::candidate_grad_hidden", mutates_args=("out",))
def candidate_grad_hidden(
    weight: Tensor, rows: Tensor, g_cand: Tensor, gscale: Tensor, base: Tensor | None, out: Tensor, ints: list[int]
) -> None:
    """grad_hidden = base + gscale * sum_r g_cand[t, r] weight[rows[t, r]]; ints = [BLOCK_T, BLOCK_D, warps]."""
    block_t, block_d, warps = ints
    num_tokens, dim = out.shape
    r = rows.shape[1]
    with on_device(out.device):
        _kernels().candidate_grad_hidden_kernel[(cdiv(num_tokens, block_t), cdiv(dim, block_d))](
            weight, rows, g_cand, gscale, base if base is not None else out, out,
            num_tokens, dim, r, weight.shape[0],
            weight.stride(0), gscale.stride(0) if gscale.dim() else 0, base.stride(0) if base is not None else 0,
            out.stride(0),
            HAS_BASE=base is not None, BLOCK_T=block_t, BLOCK_R=pow2(r), BLOCK_D=block_d, num_warps=warps,
        )


@candidate_grad_hidden.register_fake
def _(*args, **kwargs) -> None:
    return None


@torch.library.custom_op(f"{_LIB}::candidate_grad_weight", mutates_args=("grad_weight", "grad_bias"))
def candidate_grad_weight(
    hidden: Tensor, order: Tensor, keys: Tensor, starts: Tensor, g_cand: Tensor, gscale: Tensor,
    grad_table: Tensor | None, bucket: Tensor | None, member: Tensor | None, static: Tensor | None, grad_weight: Tensor,
    grad_bias: Tensor | None, ints: list[int],
) -> None:
    """Every row of grad_weight (and grad_bias) from the (t, r) pairs sorted by class (``order``, their classes
    ``keys``, each class's run from ``starts`` (V + 1,)), each row started at the tail's spread of ``grad_table``
    (B + 1, D) float32 when given (``bucket``, ``member``, ``static`` (V,); static may be None); ints = [BLOCK_V,
    BLOCK_P, BLOCK_D, warps, registers, RUN]. Where the pairs pass RUN, a first launch sums the overflow of the
    runs longer than RUN by chunks of RUN pairs (``candidate_long_runs_kernel``), which the second adds."""
    block_v, block_p, block_d, warps, registers, run = ints
    if run < 1 or run & (run - 1):
        raise ValueError(f"Blocks.run must be a power of two (the long runs' chunks are walked in its blocks), got {run}.")
    num_classes, dim = grad_weight.shape
    pairs = g_cand.numel()
    if max(pairs, hidden.shape[0] * hidden.stride(0)) >= 1 << 31:
        raise ValueError(
            f"The fused weight gradient indexes the (t, r) pairs and the hidden states in int32: T = {hidden.shape[0]} "
            f"tokens of D = {dim} or R = {g_cand.shape[1]} is too many; split the tokens into chunks."
        )
    has_table = grad_table is not None
    kernels = _kernels()
    long_runs = pairs > run  # else no run can pass RUN pairs
    partial = partial_bias = grad_weight
    with on_device(grad_weight.device):
        if long_runs:
            chunks = cdiv(pairs, run)
            partial = torch.empty((chunks, dim), device=grad_weight.device, dtype=torch.float32)
            partial_bias = torch.empty(chunks, device=grad_weight.device, dtype=torch.float32)
            kernels.candidate_long_runs_kernel[(chunks,)](
                hidden, order, keys, starts, g_cand, gscale, partial, partial_bias,
                pairs, dim, g_cand.shape[1], num_classes, hidden.stride(0), gscale.stride(0) if gscale.dim() else 0,
                HAS_BIAS=grad_bias is not None, RUN=run, BLOCK_K=min(run, 1024), BLOCK_P=min(run, 32),
                BLOCK_D=block_d, num_warps=warps,
            )
        kernels.candidate_grad_weight_kernel[(cdiv(num_classes, block_v),)](
            hidden, order, starts, g_cand, gscale,
            # Row B by its own pointer: B * stride (K^2 buckets of D dims) may pass int32.
            grad_table if has_table else g_cand, grad_table[-1] if has_table else g_cand,
            bucket if has_table else starts, member if has_table else g_cand,
            static if static is not None and has_table else g_cand, partial, partial_bias,
            grad_weight, grad_bias if grad_bias is not None else grad_weight,
            num_classes, dim, g_cand.shape[1],
            hidden.stride(0), gscale.stride(0) if gscale.dim() else 0, grad_table.stride(0) if has_table else 0,
            grad_weight.stride(0),
            HAS_BIAS=grad_bias is not None, HAS_TABLE=has_table, HAS_STATIC=has_table and static is not None,
            LONG_RUNS=long_runs, RUN=run, BLOCK_V=block_v, BLOCK_P=block_p, BLOCK_D=block_d, num_warps=warps,
            maxnreg=registers,
        )


@candidate_grad_weight.register_fake
def _(*args, **kwargs) -> None:
    return None


@torch.library.custom_op(f"{_LIB}::midx_draw", mutates_args=("bucket", "log_z", "probs"))
def midx_draw(
    scores: Tensor, log_mass: Tensor, u: Tensor, share: Tensor | None, bucket: Tensor, log_z: Tensor,
    probs: Tensor | None, ints: list[int],
) -> None:
    """The MIDX bucket draw (:func:`hf_midx.losses.kernels.draw.midx_bucket_draw`); ints = [K, BLOCK_T, warps]."""
    k, block_t, warps = ints
    num_tokens, m = bucket.shape
    with on_device(bucket.device):
        _kernels_module("_draw_triton").midx_draw_kernel[(cdiv(num_tokens, block_t),)](
            scores, log_mass, u, share if share is not None else log_mass, bucket, log_z,
            probs if probs is not None else log_z, num_tokens, m, scores.stride(0),
            K=k, HAS_SHARE=share is not None, WRITE_PROBS=probs is not None, BLOCK_T=block_t, BLOCK_B=pow2(k * k),
            num_warps=warps,
        )


@midx_draw.register_fake
def _(*args, **kwargs) -> None:
    return None


@torch.library.custom_op(f"{_LIB}::counter_rand", mutates_args=("state", "out"))
def counter_rand(state: Tensor, out: Tensor, ints: list[int]) -> None:
    """out = the next out.numel() uniforms of the CounterRNG stream at ``state`` (its dtype's), the state advanced;
    ints = [BLOCK] (:func:`hf_midx.losses.kernels.counter.counter_rand`)."""
    (block,) = ints
    n = out.numel()
    f64 = out.dtype == torch.float64
    if n:
        with on_device(out.device):
            kernel = _kernels_module("_counter_triton").counter_rand_kernel
            kernel[(cdiv(n, block),)](state, out, n, F64=f64, BLOCK=block)
    state[1:].add_(n if f64 else (n + 1) // 2)


@counter_rand.register_fake
def _(*args, **kwargs) -> None:
    return None


@torch.library.custom_op(f"{_LIB}::bucket_partials", mutates_args=("partials",))
def bucket_partials(
    rows: Tensor, index: Tensor, offsets: Tensor, weights: Tensor, partials: Tensor, ints: list[int]
) -> None:
    """Each chunk's weighted row sums (:func:`hf_midx.losses.kernels.table.fused_bucket_table`, its first launch);
    ints = [BLOCK_J, BLOCK_D, warps, static]."""
    block_j, block_d, warps, static = ints
    num_chunks = offsets.shape[0] // (2 if static else 1)
    dim = rows.shape[1]
    if num_chunks:
        with on_device(partials.device):
            _kernels_module("_table_triton").bucket_partials_kernel[(num_chunks, cdiv(dim, block_d))](
                rows, index, offsets, weights, partials, index.shape[0], num_chunks, dim, rows.stride(0),
                STATIC=bool(static), BLOCK_J=block_j, BLOCK_D=block_d, num_warps=warps,
            )


@bucket_partials.register_fake
def _(*args, **kwargs) -> None:
    return None


@torch.library.custom_op(f"{_LIB}::bucket_sums", mutates_args=("table",))
def bucket_sums(partials: Tensor, chunk_offsets: Tensor, table: Tensor, ints: list[int]) -> None:
    """The (B + 1, D) table from the chunk partials (:func:`hf_midx.losses.kernels.table.fused_bucket_table`, its
    second launch); ints = [BLOCK_C, BLOCK_D, warps, static]."""
    block_c, block_d, warps, static = ints
    rows, dim = table.shape
    num_chunks = partials.shape[0] // (2 if static else 1)
    with on_device(table.device):
        _kernels_module("_table_triton").bucket_sums_kernel[(rows, cdiv(dim, block_d))](
            partials, chunk_offsets, table, rows - 1, num_chunks, dim,
            STATIC=bool(static), BLOCK_C=block_c, BLOCK_D=block_d, num_warps=warps,
        )


@bucket_sums.register_fake
def _(*args, **kwargs) -> None:
    return None
