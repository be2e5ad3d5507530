"""A cost model of the default head's GPU step, from the step's real op trace (issue 45, item 5).

No GPU has run the fused kernels; this projects what one H200 would take. One steady-state step of the default
head (``MidxLMHead`` as ``MidxConfig(kernels="fused")`` builds it with class counts: the CUDA path, whatever
device the trace runs on; forward + backward) is traced by a ``TorchDispatchMode`` (``torch.utils._python_dispatch``,
torch's documented way to see every op below autograd with its arguments): each ATen op that launches a kernel
(views, allocations and no-op conversions left out, as ``profile_head.count_ops`` leaves them out), and the
project's Triton launches (the custom ops ``torch.ops.hf_midx.*`` of ``hf_midx/losses/kernels/launch.py``) as single ops.

At the real shapes the step runs under ``FakeTensorMode``: the weight, hidden states and labels are fake
(shapes and dtypes, no data), so that a Llama-3-8B head at T = 8,192 costs no memory nor time; the sampler's
state (the index, the proposal's embedding bags) is real, since the head is built for real at (V, D) (one k-means
iteration, ``--kmeans_iters``: the index's quality changes the bucket sizes, not the launches), so the lengths of
the bags an ``embedding_bag`` walks are read from their real offsets. The Triton ops' fake versions do nothing.

Each launch gets its bytes moved, its FLOPs and the class of its CUDA implementation (:data:`IMPLEMENTATIONS`):
a GEMM (tensor cores for bf16 / fp16; CUDA cores for float32, TF32 being off by default in torch), elementwise /
reduction (bandwidth-bound), ``embedding_bag`` (one thread per (bag, feature) walks its bag: serial in the
longest bag, aten/src/ATen/native/cuda/EmbeddingBag.cu), index_add_ / scatter_add_ (atomics), sort (radix
passes), ops that read a result back to the host (nonzero, masked_select, .item: a sync), the project's
Triton ops (bytes and FLOPs from their arguments' shapes). Its projected time on one H200 is

    max(bytes / bandwidth, FLOPs / peak, serial part) + a fixed cost per kernel launch

with the constants of :data:`H200` (assumptions, stated in the output). Launches are attributed to a part of
the step (draw, candidate loss, tail, bookkeeping) by the innermost ``hf_midx`` function on the Python stack,
as ``count_ops`` attributes them; an op of torch's own backward formulas by the forward op that made it (the
autograd node's forward traceback, recorded under anomaly mode without its NaN checks); a gradient accumulation
outside any hf_midx function is "autograd". Ops whose CUDA implementation serializes (a long bag), uses atomics
or syncs the host are flagged. The total is costed three times: with the peak constants (:data:`H200`), with
the ones fitted on commit 1ca3ce9's profiled H200 step (:data:`H200_CALIBRATED`, ``calibrate_cost_model.py``), and
calibrated with the step replayed as one CUDA graph (:func:`graph_replayed`: no host time per launch). Each stands
beside the exact floor (:func:`exact_floor_ms`: 6 T V D FLOPs at the dense bf16 peak) and the fastest exact loss
measured at the shape (``results/h200/bench_head.json``, read here, not copied).

Run: ``python recipes/benchmarks/cost_model.py --out recipes/benchmarks/results/cost_model`` (about 3 minutes
on 2 CPU cores: the five head builds); ``--models`` picks shapes, ``--tokens`` T; ``--smoke`` a tiny shape.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import dataclasses
import json
import math
import os
import re
import sys
import time
import warnings
from pathlib import Path
from typing import Any, Callable

import torch
from torch._subclasses.fake_tensor import DataDependentOutputException, DynamicOutputShapeException
from torch.utils._python_dispatch import TorchDispatchMode, _disable_current_modes

if __package__:
    from . import common
    from .profile_head import FREE_OPS
else:  # run as a file: this folder is first on sys.path
    import common
    from profile_head import FREE_OPS

NAME = "cost_model"
PACKAGE = "hf_midx/"

#: The machine and the assumptions of the projection. Peaks: NVIDIA's H200 SXM figures (dense, no sparsity);
#: launch_us: the fixed cost of one kernel launch in an eager step (a CUDA graph would take most of it away);
#: load_latency_us: one dependent global-memory load on the critical path of a serial loop (HBM latency is
#: ~0.5 us; an unrolled loop keeps a few loads in flight); sort_bits_per_pass: CUB's radix sort.
H200 = {"name": "NVIDIA H200 (projected)", "bandwidth_bytes_s": 4.8e12, "tensor_core_flops": 990e12,
        "cuda_core_fp32_flops": 67e12, "launch_us": 4.0, "load_latency_us": 0.25, "sort_bits_per_pass": 8}  # fmt: skip
#: The H200 as commit 1ca3ce9's profiled step measured it (``calibrate_cost_model.py`` fits these from
#: ``results/h200/profile_head.*`` and refuses to run when they differ; ``results/cost-model-calibration/``).
#: kernel_floor_us: the device time a kernel takes beyond its bytes (least squares over the profile's elementwise
#: rows); class_bandwidth: bytes a second each class achieved (its bytes over its measured time less the floor);
#: triton, embedding_bag, sort, host_sync: no such kernel in the profile, the nearest measured class's (assumed);
#: launch_us: the host's time per cudaLaunchKernel in the profile. The peaks stay NVIDIA's (nothing measured them).
H200_CALIBRATED = {**H200, "name": "NVIDIA H200 (calibrated on 1ca3ce9's profile)", "launch_us": 6.00,
                   "kernel_floor_us": 0.977,
                   "class_bandwidth": {"elementwise": 1.141e12,  # mul, copy_, sub, searchsorted: least squares
                                       "gather": 2.404e12,  # index (the gathers of rows)
                                       "gemm": 1.766e12,  # bmm (cuBLAS's gemv kernels), mm: bytes-bound here
                                       "atomics": 0.817e12,  # index_add_ (rows added into (V, D))
                                       "scan": 0.432e12,  # cumsum
                                       # assumed, no such kernel in the profile: gather's, elementwise's
                                       "triton": 2.404e12, "embedding_bag": 2.404e12,
                                       "sort": 1.141e12, "host_sync": 1.141e12}}  # fmt: skip
#: The four LLM head shapes of issue 45, in its order (common.MODEL_SHAPES holds their (V, D)).
ISSUE_ORDER = ("gemma3-270m", "qwen2.5-0.5b", "llama3-8b", "gemma2-2b")
#: The shapes the table can project: the four LLM heads and one of a million classes (issue 51).
SHAPES = {**{m: common.MODEL_SHAPES[m] for m in ISSUE_ORDER}, "v1m-d1024": (1048576, 1024)}
#: The exact losses of the H200 head benchmark (``results/h200/bench_head.json``) the step is held against.
EXACT_CASES = ("hf", "torch-chunked", "liger", "cce")
#: A bag longer than this is flagged (issue 45's acceptance bound for a default step).
LONG_BAG = 4096

#: ATen op name -> the class of its CUDA implementation. Anything else is "elementwise" (elementwise or
#: reduction: bandwidth-bound, one launch).
IMPLEMENTATIONS = {
    **dict.fromkeys(("mm", "addmm", "bmm", "baddbmm", "mv", "addmv", "dot", "vdot", "_scaled_mm", "addbmm"), "gemm"),
    **dict.fromkeys(("_embedding_bag", "_embedding_bag_forward_only", "embedding_bag"), "embedding_bag"),
    **dict.fromkeys(("index_add_", "index_add", "scatter_add_", "scatter_add", "scatter_reduce_", "scatter_reduce",
                     "index_put_", "_index_put_impl_", "index_put", "_embedding_bag_backward",
                     "_embedding_bag_dense_backward", "embedding_dense_backward", "index_reduce_",
                     "index_reduce"), "atomics"),  # fmt: skip
    **dict.fromkeys(("sort", "argsort", "msort", "topk", "kthvalue", "median"), "sort"),
    **dict.fromkeys(("cumsum", "cumsum_", "cumprod", "logcumsumexp", "_logcumsumexp", "cummax", "cummin"), "scan"),
    **dict.fromkeys(("nonzero", "nonzero_static", "masked_select", "_local_scalar_dense", "item", "unique",
                     "_unique", "_unique2", "unique_dim", "unique_consecutive", "bincount", "repeat_interleave",
                     "masked_scatter", "is_nonzero", "equal", "allclose"), "host_sync"),  # fmt: skip
    **dict.fromkeys(("index_select", "gather", "embedding", "index", "take", "take_along_dim"), "gather"),
}
#: Ops that host-sync only in some forms: repeat_interleave with output_size and bincount with a minlength
#: still read the data's size on CUDA, so both stay flagged; index.Tensor syncs for a boolean mask.
_BOOL_INDEX_SYNCS = ("index", "index_put_", "_index_put_impl_", "index_put")


def graph_replayed(machine: dict) -> dict:
    """``machine`` with the step replayed as one CUDA graph: no host cost per launch (the graph is one launch);
    each kernel's device floor stays."""
    return {**machine, "name": f"{machine['name']}, CUDA graph replay", "launch_us": 0.0}


def exact_floor_ms(v: int, d: int, t: int, machine: dict = H200) -> float:
    """The exact loss's floor: its 6 T V D FLOPs (the logits, the hidden states' and the weight's gradients) at the
    machine's dense bf16 tensor-core peak, in ms. No exact loss runs faster, whatever its kernels."""
    return 6 * t * v * d / machine["tensor_core_flops"] * 1e3


# ============================================================================ the trace
@dataclasses.dataclass(frozen=True)
class TensorMeta:
    """What the cost model keeps of a tensor argument: no reference to the tensor (one would change what the step
    does: autograd's accumulation steals a gradient only when nothing else holds it). ``key`` tells two arguments
    of one op apart from the same tensor passed twice."""

    shape: tuple[int, ...]
    dtype: torch.dtype
    itemsize: int
    fake: bool
    key: int

    def numel(self) -> int:
        return math.prod(self.shape)

    def element_size(self) -> int:
        return self.itemsize


@dataclasses.dataclass
class TracedOp:
    """One op of a step: its name (``aten.mm`` -> "mm", ``hf_midx.candidate_forward`` -> "hf_midx.candidate_forward"),
    its arguments by schema name (tensors as :class:`TensorMeta`), its outputs, where it ran (the innermost hf_midx
    function, "file(line): function") and whether in the backward; ``longest_bag``: an embedding_bag's longest bag,
    ``most_hits``: the most times one index recurs in an atomic op's index (both None where the op is another or
    the tensor is fake: read from the real tensors when the op runs)."""

    name: str
    args: dict[str, Any]
    out: Any
    where: str
    backward: bool
    longest_bag: int | None = None
    most_hits: int | None = None
    measured_ms: float | None = None


def _op_name(func) -> str:
    ns, op = func.namespace, func._schema.name.split("::")[-1]
    return op if ns == "aten" else f"{ns}.{op}"


def _bind(func, args, kwargs) -> dict[str, Any]:
    """The op's arguments by their schema names."""
    bound = {a.name: v for a, v in zip(func._schema.arguments, args)}
    bound.update(kwargs)
    return bound


_FRAME = re.compile(r'File "([^"]+)", line (\d+), in (\S+)')


def _where_live(package: str) -> str | None:
    """The innermost function of ``package`` on the live Python stack, as "file(first line): function"."""
    frame = sys._getframe(2)
    while frame is not None:
        path = frame.f_code.co_filename.replace(os.sep, "/")
        if package in path:
            code = frame.f_code
            return f"{path.split(package, 1)[1]}({code.co_firstlineno}): {code.co_name}"
        frame = frame.f_back
    return None


def _where_forward(package: str) -> str | None:
    """The innermost function of ``package`` in the forward traceback of the autograd node now running."""
    node = torch._C._current_autograd_node()
    lines = node.metadata.get("traceback_") if node is not None else None
    for line in reversed(lines or []):
        match = _FRAME.search(line)
        if match and package in match.group(1).replace(os.sep, "/"):
            return f"{match.group(1).replace(os.sep, '/').split(package, 1)[1]}: {match.group(3)} (backward)"
    return None


class OpTrace(TorchDispatchMode):
    """Records every op that launches a kernel: not the :data:`FREE_OPS` (views, allocations, no-op conversions)
    nor ``prim`` ops (a tensor's device); ``_to_copy`` is recorded as the ``copy_`` that does its work."""

    def __init__(self, package: str = PACKAGE, timed: bool = False):
        super().__init__()
        self.package, self.ops, self.timed, self.marks = package, [], timed, []

    def _mark(self):
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            return event
        return time.perf_counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        start = self._mark() if self.timed else None
        try:
            out = func(*args, **kwargs)
        except (DataDependentOutputException, DynamicOutputShapeException) as err:
            raise ValueError(
                f"{func} needs the data under FakeTensorMode: on a GPU it reads a result back to the host (a sync) or "
                f"makes a data-dependent shape, at {_where_live(self.package) or 'autograd'}. Take it off the step's "
                "path, or trace the step for real at a small shape (cost_model.head_step(..., fake=False))."
            ) from err
        end = self._mark() if self.timed else None
        name = _op_name(func)
        if func.namespace == "prim" or name in FREE_OPS and name != "_to_copy":
            return out
        if name == "_to_copy":  # a conversion that returns its input never gets here: this one copies
            name = "copy_"
        backward = torch._C._current_autograd_node() is not None
        where = _where_live(self.package) or (_where_forward(self.package) if backward else None) or "autograd"
        bound = _bind(func, args, kwargs)
        impl = IMPLEMENTATIONS.get(name)
        longest = _longest_bag(bound) if impl == "embedding_bag" else None
        hits = _most_hits(bound) if impl == "atomics" else None
        meta = torch.utils._pytree.tree_map(_meta, (bound, out))
        self.ops.append(TracedOp(name, *meta, where, backward, longest, hits))
        self.marks.append((start, end))
        return out

    def measured(self) -> None:
        """Set each op's ``measured_ms`` from its marks (CUDA events: the time on the stream between the op's issue
        and its end, so a GPU left waiting for a launch counts; on the CPU the call's wall time)."""
        if self.timed and torch.cuda.is_available() and torch.cuda.is_initialized():
            torch.cuda.synchronize()
        for op, (start, end) in zip(self.ops, self.marks):
            if start is not None:
                op.measured_ms = start.elapsed_time(end) if hasattr(start, "elapsed_time") else (end - start) * 1e3


def trace(step: Callable[[], Any], mode=None, package: str = PACKAGE, timed: bool = False) -> list[TracedOp]:
    """The ops of one call of ``step()`` (see :class:`OpTrace`), with the backward's ops attributed to their forward.
    ``mode``: the FakeTensorMode the step's tensors belong to, entered below the recorder (the mode entered last
    sees an op first). ``timed``: each op's ``measured_ms`` is set (a real step; the recording's own host time
    slows the launches, so a launch-bound step measures slower than it runs untraced)."""
    recorder = OpTrace(package, timed)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="Anomaly Detection has been enabled")
        with mode or contextlib.nullcontext(), torch.autograd.detect_anomaly(check_nan=False), recorder:
            step()
    recorder.measured()
    return recorder.ops


# ============================================================================ the cost of one launch
def _most_hits(a: dict) -> int | None:
    """How often the most frequent destination recurs in an atomic op's (real) index; None where it is fake."""
    index = a.get("index", a.get("indices"))
    index = index[0] if isinstance(index, (list, tuple)) and index else index
    if not isinstance(index, torch.Tensor) or _is_fake(index) or index.dtype == torch.bool or not index.numel():
        return None
    with _disable_current_modes():
        return int(torch.unique(index.reshape(-1), return_counts=True)[1].max())


def _meta(x):
    if not isinstance(x, torch.Tensor):
        return x
    return TensorMeta(tuple(x.shape), x.dtype, x.element_size(), _is_fake(x), id(x))


def _tensors(x) -> list[TensorMeta]:
    return [t for t in torch.utils._pytree.tree_leaves(x) if isinstance(t, TensorMeta)]


def _nbytes(t: TensorMeta) -> int:
    return t.numel() * t.element_size()


def _is_fake(t: torch.Tensor) -> bool:
    from torch._subclasses.fake_tensor import FakeTensor  # noqa: PLC0415

    return isinstance(t, FakeTensor) or t.device.type == "meta"


def _unique_bytes(tensors) -> int:
    seen, total = set(), 0
    for t in tensors:
        if t.key not in seen:
            seen.add(t.key)
            total += _nbytes(t)
    return total


def _gemm_flops(name: str, a: dict) -> int:
    if name in ("mm", "addmm", "_scaled_mm"):
        m1, m2 = (a["mat1"], a["mat2"]) if "mat1" in a else (a["self"], a["mat2"])
        return 2 * m1.shape[0] * m1.shape[1] * m2.shape[1]
    if name in ("bmm", "baddbmm", "addbmm"):
        b1, b2 = (a["batch1"], a["batch2"]) if "batch1" in a else (a["self"], a["mat2"])
        return 2 * b1.shape[0] * b1.shape[1] * b1.shape[2] * b2.shape[2]
    if name in ("mv", "addmv"):
        mat = a.get("mat", a.get("self"))
        return 2 * mat.numel()
    return 2 * a["self"].numel()  # dot


def _bags(a: dict) -> int:
    """The number of bags of an embedding_bag's arguments."""
    return a["offsets"].shape[0] - (1 if a.get("include_last_offset") else 0)


def _longest_bag(a: dict) -> int | None:
    """The longest bag of an embedding_bag's (real) arguments; None where its offsets or indices are fake."""
    indices, offsets = a["indices"], a["offsets"]
    if _is_fake(offsets) or _is_fake(indices):
        return None
    with _disable_current_modes():  # else these ops would go to the FakeTensorMode below the recorder
        ends = offsets.long()
        if not a.get("include_last_offset"):
            ends = torch.cat([ends, ends.new_full((1,), indices.shape[0])])
        return int((ends[1:] - ends[:-1]).max()) if ends.numel() > 1 else 0


def _triton_cost(name: str, a: dict) -> tuple[int, int, int, str]:
    """(bytes, tensor-core FLOPs, CUDA-core FLOPs, note) of a launch of the project's Triton ops, from their
    arguments' shapes (hf_midx/losses/kernels/launch.py gives the arguments; _candidate_triton.py the loops)."""
    if name == "hf_midx.candidate_forward":
        t, d = a["hidden"].shape
        r = a["rows"].shape[1]  # the label and the M negatives
        gathered = t * r * d * a["weight"].element_size()
        small = [x for k, x in a.items() if isinstance(x, TensorMeta) and k not in ("weight", "head_raw", "g_head")]
        head = [x for k in ("head_raw", "g_head") if isinstance(x := a.get(k), TensorMeta)]
        # The exact head's (T, H) float32 logits are read twice (the logsumexp, then the gradient) and their
        # gradient written once; the candidates' rows are gathered, D-dot products on CUDA cores.
        head_bytes = 3 * _nbytes(head[0]) if head else 0
        note = f"gathers T x R = {t} x {r} rows of D = {d}"
        return gathered + _unique_bytes(small) + head_bytes, 0, 2 * t * r * d, note
    if name == "hf_midx.candidate_grad_hidden":
        t, d = a["out"].shape
        r = a["rows"].shape[1]
        rest = [a["rows"], a["g_cand"], a["out"]] + ([a["base"]] if a.get("base") is not None else [])
        gathered = t * r * d * a["weight"].element_size()
        return gathered + _unique_bytes(rest), 0, 2 * t * r * d, f"gathers T x R = {t} x {r} rows"
    if name == "hf_midx.candidate_grad_weight":
        v, d = a["grad_weight"].shape
        pairs = a["order"].numel()
        # One program per block of classes over all of D: each class's run of sorted (t, r) pairs walked once
        # (a hidden row gathered and one fma per pair and feature, on CUDA cores), each (V, D) row written once,
        # started at the tail's spread (each class reads its bucket's row of the (B + 1, D) table gradient, which
        # stays in L2, and its static row). A class walks at most RUN pairs (ints[5]) itself: where the pairs pass
        # RUN a first kernel reads every pair's class and run start and sums the runs' overflow by chunks of RUN
        # pairs (a few (P / RUN, D) float32 rows, read back by the long classes), so no class is one program's long
        # serial walk (the draws' repeats are unknown under fake tensors: their hidden rows are counted once above).
        rows = pairs * d * a["hidden"].element_size()
        rest = [x for k in ("order", "keys", "starts", "g_cand", "grad_weight", "grad_bias", "grad_table", "bucket",
                            "member", "static") if isinstance(x := a.get(k), TensorMeta)]
        rows += 4 * pairs if pairs > a["ints"][5] else 0  # the first kernel's gather of each pair's run start
        spread = 4 * v * d if isinstance(a.get("grad_table"), TensorMeta) else 0
        note = f"{pairs} (token, class) pairs; writes (V, D) = ({v}, {d}) once" + (", with the tail's spread" if spread else "")
        return rows + _unique_bytes(rest), 0, 2 * pairs * d + spread, note
    if name == "hf_midx.midx_draw":
        t, m = a["bucket"].shape
        k = a["ints"][0]
        # A token's K * K bucket logits stay in registers: the scores, uniforms and tables read once, the buckets, log Z
        # and (for the tail gradient) the probabilities written once; on CUDA cores the logits, exp and scan (~8
        # operations a bucket) and one compare-and-count over the K * K running sums per draw.
        flops = t * k * k * (8 + 2 * m)
        return _unique_bytes(_tensors(a)), 0, flops, f"T = {t} tokens x K * K = {k * k} buckets in registers, M = {m}"
    if name == "hf_midx.counter_rand":
        n = a["out"].numel()
        return _unique_bytes(_tensors(a)), 0, 0, f"{n:,} uniforms hashed in registers (SplitMix64), written once"
    if name == "hf_midx.bucket_partials":
        static = a["ints"][3]
        entries = a["index"].shape[0] // (2 if static else 1)  # with a static part each class is listed twice
        d = a["rows"].shape[1]
        # One program per (chunk, 128 dims): each drawn class's row read once for both sums (the static weight at
        # its twin entry), an fma per weight and feature, the (STRIDE n, D) float32 partials written once.
        rows = entries * d * a["rows"].element_size()
        small = _unique_bytes([a["index"], a["offsets"], a["weights"], a["partials"]])
        note = f"reads {entries:,} rows of D = {d} once ({'member and static' if static else 'member'} sums)"
        return rows + small, 0, 2 * (1 + static) * entries * d, note
    if name == "hf_midx.bucket_sums":
        b, d = a["table"].shape
        # Every partial read once (a bucket's by its row's program, the static ones by row B's), the table written.
        return _unique_bytes([a["partials"], a["chunk_offsets"], a["table"]]), 0, a["partials"].numel(), (
            f"{a['partials'].shape[0]:,} chunk partials into {b:,} rows")
    return _unique_bytes(_tensors(a)), 0, 0, "unmodelled Triton op: the bytes of its arguments only"


@dataclasses.dataclass
class Launch:
    """A traced op with its cost: bytes, FLOPs, implementation class, projected H200 microseconds, flags."""

    op: str
    where: str
    part: str
    backward: bool
    shapes: str
    impl: str
    bytes: int
    flops: int
    kernels: int
    us: float
    flags: list[str]
    note: str = ""
    measured_ms: float | None = None
    #: The class whose achieved bandwidth a calibrated machine applies (an :data:`IMPLEMENTATIONS` value, or
    #: "triton"); ``serial_us``: the serial part (an embedding_bag's longest bag), which no bandwidth shortens.
    klass: str = "elementwise"
    serial_us: float = 0.0


#: The parts of a step, by the hf_midx file an op ran in (first match); anything else in hf_midx is bookkeeping.
PARTS = (("draw", ("samplers/", "rng.py", "indexing/")), ("tail", ("losses/tail_gradient.py",)),
         ("candidate loss", ("losses/",)))  # fmt: skip


def part_of(where: str) -> str:
    if where == "autograd":
        return "autograd"
    return next((part for part, files in PARTS if where.startswith(files)), "bookkeeping")


def _shapes(args: dict) -> str:
    cells = (f"{k}{list(v.shape)}:{str(v.dtype).replace('torch.', '')}" for k, v in args.items()
             if isinstance(v, TensorMeta))  # fmt: skip
    return ", ".join(cells)


def cost(op: TracedOp, machine: dict = H200) -> Launch:
    """The implementation class, bytes, FLOPs and projected time of one traced op on ``machine``."""
    a, name = op.args, op.name
    impl = "triton" if name.startswith("hf_midx.") else IMPLEMENTATIONS.get(name, "elementwise")
    klass = impl
    ins, outs = _tensors(a), _tensors(op.out)
    flops_tc = flops_fp32 = serial_us = 0.0
    kernels, flags, note = 1, [], ""
    nbytes = _unique_bytes(ins + outs)
    if impl == "gemm":
        flops = _gemm_flops(name, a)
        low = a.get("mat2", a.get("self", ins[0])).dtype in (torch.bfloat16, torch.float16)
        flops_tc, flops_fp32 = (flops, 0) if low else (0, flops)
        impl = "gemm (tensor cores)" if low else f"gemm ({str(ins[0].dtype).replace('torch.', '')}, CUDA cores)"
    elif impl == "triton":
        nbytes, flops_tc, flops_fp32, note = _triton_cost(name, a)
        if name == "hf_midx.candidate_grad_weight" and a["order"].numel() > a["ints"][5]:
            kernels = 2  # the long runs' chunks first (hf_midx/losses/kernels/launch.py)
    elif impl == "embedding_bag":
        weight, indices = a["weight"], a["indices"]
        bags, longest = _bags(a), op.longest_bag
        d = weight.shape[1]
        out_bytes = bags * d * weight.element_size()
        nbytes = indices.shape[0] * d * weight.element_size() + _unique_bytes([indices, a["offsets"]]) + out_bytes
        if a.get("per_sample_weights") is not None:
            nbytes += _nbytes(a["per_sample_weights"])
        if longest is None:
            flags.append("serial: bag lengths unknown (fake offsets)")
            note = f"{bags} bags"
        else:
            # One thread per (bag, feature) walks its bag: the longest bag's loads run one after another.
            serial_us = longest * machine["load_latency_us"]
            note = f"{bags} bags, longest {longest:,}"
            if longest > LONG_BAG:
                flags.append(f"serial: a bag of {longest:,} entries (> {LONG_BAG:,})")
    elif impl == "atomics":
        src = a.get("source", a.get("src", a.get("values", a.get("grad"))))
        index = a.get("index", a.get("indices"))
        moved = [t for t in _tensors([src, index]) if t is not None]
        nbytes = 3 * sum(_nbytes(t) for t in moved[:1]) + sum(_nbytes(t) for t in moved[1:])
        if op.most_hits is None:
            flags.append("atomics (contention unknown: fake index)")
        elif op.most_hits > 1:
            flags.append(f"atomics: up to {op.most_hits:,} adds to one row")
        else:
            note = "atomics on distinct rows: no contention"
    elif impl == "sort":
        keys = a["self"]
        passes = math.ceil(keys.element_size() * 8 / machine["sort_bits_per_pass"])
        # Each radix pass reads and writes keys and values (int64 indices), plus a histogram launch per pass.
        nbytes = passes * 2 * keys.numel() * (keys.element_size() + 8)
        kernels = passes + 1
        note = f"{keys.numel():,} keys, {passes} radix passes"
    elif impl == "host_sync":
        flags.append("host sync")
    elif impl == "gather":
        index = a.get("index", a.get("indices"))
        nbytes = 2 * _unique_bytes(outs) + sum(_nbytes(t) for t in _tensors(index))
    if name in _BOOL_INDEX_SYNCS and any(t.dtype == torch.bool for t in _tensors(a.get("indices"))):
        flags.append("host sync (boolean mask)")
    if name.endswith("_") and name not in ("copy_",) and impl == "elementwise":
        nbytes += _nbytes(a["self"]) if isinstance(a.get("self"), TensorMeta) else 0  # read and written
    launch = Launch(name, op.where, part_of(op.where), op.backward, _shapes(a), impl, int(nbytes),
                    int(flops_tc + flops_fp32), kernels, 0.0, flags, note, op.measured_ms, klass, serial_us)  # fmt: skip
    launch.us = launch_us(launch, machine)
    return launch


def launch_us(x: Launch, machine: dict = H200) -> float:
    """The projected microseconds of launch ``x`` on ``machine``: max(bytes / its class's bandwidth, FLOPs / peak,
    serial part) + kernels x (the device's floor per kernel + the host's cost per launch). A machine without a
    ``class_bandwidth`` entry for the class streams at ``bandwidth_bytes_s``."""
    bandwidth = machine.get("class_bandwidth", {}).get(x.klass, machine["bandwidth_bytes_s"])
    low = x.impl == "gemm (tensor cores)"
    peak = machine["tensor_core_flops"] if low else machine["cuda_core_fp32_flops"]
    compute_us = x.flops / peak * 1e6 if x.impl.startswith("gemm") or x.klass == "triton" else 0.0
    per_kernel = machine.get("kernel_floor_us", 0.0) + machine["launch_us"]
    return max(x.bytes / bandwidth * 1e6, compute_us, x.serial_us) + x.kernels * per_kernel


# ============================================================================ the default step
def default_head(v: int, d: int, t: int, *, dtype=torch.bfloat16, device="cpu", kmeans_iters: int = 1, seed: int = 0,
                 config_changes: dict | None = None):  # fmt: skip
    """(head, weight, hidden, labels): the default head (``MidxConfig(kernels="fused")`` with ``config_changes``,
    class counts from a Zipf corpus) over a random (V, D) weight of ``dtype`` on ``device``, T hidden states and
    Zipfian labels."""
    import hf_midx  # noqa: PLC0415

    gen = torch.Generator().manual_seed(seed)
    counts = common.zipf_counts(v, generator=gen)
    labels = common.zipf_labels(counts, t, gen).to(device)
    linear = torch.nn.Linear(d, v, bias=False, device="meta")
    linear.weight = torch.nn.Parameter((torch.randn(v, d, generator=gen) * d**-0.5).to(device=device, dtype=dtype))
    hidden = (torch.randn(t, d, generator=gen) * 0.5).to(device=device, dtype=dtype).requires_grad_()
    config = hf_midx.MidxConfig(kernels="fused", kmeans_iters=kmeans_iters, seed=seed, **(config_changes or {}))
    head = hf_midx.MidxLMHead(linear, config, class_counts=counts)
    return head, head.weight, hidden, labels


def head_step(head, weight, hidden, labels, *, fake: bool = True):
    """(step, mode): one forward + backward of ``head``'s loss, its first call done (the step's lazy state made).
    ``fake``: on FakeTensor copies of ``weight``, ``hidden`` and ``labels``, under their FakeTensorMode ``mode``,
    which the caller enters (:func:`trace` does); the head's sampler (its index, its bags) stays real. Else on the
    tensors themselves (``mode`` None). Without CUDA the fused path's check wants ``TRITON_INTERPRET=1`` at each
    call (:func:`project` sets it while it traces a fake step; a real step needs it before Triton is imported)."""
    mode = None
    if fake:
        from torch._subclasses.fake_tensor import FakeTensorMode  # noqa: PLC0415

        mode = FakeTensorMode(allow_non_fake_inputs=True)
        weight, hidden, labels = (mode.from_tensor(x) for x in (weight, hidden, labels))

    def step():
        hidden.grad = weight.grad = None
        head.loss(hidden, labels, weight=weight).backward()

    with mode or contextlib.nullcontext():
        step()
    return step, mode


def default_step(v: int, d: int, t: int, *, fake: bool = True, **options):
    """(step, head, mode): :func:`head_step` of :func:`default_head` (``options`` go there)."""
    head, *tensors = default_head(v, d, t, **options)
    step, mode = head_step(head, *tensors, fake=fake)
    return step, head, mode


# ============================================================================ projection and tables
@contextlib.contextmanager
def _fused_path_allowed():
    """``TRITON_INTERPRET=1`` for the duration, on a machine without CUDA: the fused path's device check passes
    (a fake step launches nothing, so nothing is interpreted); the variable is restored after."""
    before = os.environ.get("TRITON_INTERPRET")
    if not torch.cuda.is_available():
        os.environ["TRITON_INTERPRET"] = "1"
    try:
        yield
    finally:
        if before is None:
            os.environ.pop("TRITON_INTERPRET", None)
        else:
            os.environ["TRITON_INTERPRET"] = before


def summarize(launches: list[Launch], head) -> dict:
    """The total, the per-part sums (launches, kernels, projected ms, bytes, FLOPs, and measured ms where the
    launches were timed), the flagged launches and every launch, of one step of ``head``."""
    parts = collections.defaultdict(lambda: {"launches": 0, "kernels": 0, "ms": 0.0, "bytes": 0, "flops": 0})
    for x in launches:
        p = parts[x.part]
        p["launches"] += 1
        p["kernels"] += x.kernels
        p["ms"] += x.us / 1e3
        p["bytes"] += x.bytes
        p["flops"] += x.flops
        if x.measured_ms is not None:
            p["measured_ms"] = p.get("measured_ms", 0.0) + x.measured_ms
    cfg = head.config
    return {"config": {"sampler": cfg.sampler, "num_samples": cfg.num_samples, "exact_head": cfg.exact_head,
                       "codebook_size": cfg.codebook_size, "tail_gradient": cfg.tail_gradient, "kernels": cfg.kernels},
            "launches": len(launches), "kernels": sum(x.kernels for x in launches),
            "projected_ms": sum(x.us for x in launches) / 1e3,
            "calibrated_ms": sum(launch_us(x, H200_CALIBRATED) for x in launches) / 1e3,
            "calibrated_graph_ms": sum(launch_us(x, graph_replayed(H200_CALIBRATED)) for x in launches) / 1e3,
            "parts": dict(parts),
            "flagged": [dataclasses.asdict(x) for x in launches if x.flags],
            "ops": [dataclasses.asdict(x) for x in launches]}  # fmt: skip


def project_head(head, weight, hidden, labels, machine: dict = H200) -> dict:
    """:func:`summarize` of one step of ``head`` on these tensors, traced on fake copies of them (nothing runs)."""
    with _fused_path_allowed():
        step, mode = head_step(head, weight, hidden, labels, fake=True)
        return summarize([cost(op, machine) for op in trace(step, mode)], head)


def project(v: int, d: int, t: int, *, machine: dict = H200, **options) -> dict:
    """The launches of one default step at (V, D, T) with their costs, the total and the per-part sums (the head
    built for real on the CPU, the step traced on fake tensors; ``options`` go to :func:`default_head`)."""
    out = project_head(*default_head(v, d, t, **options), machine=machine)
    return {"V": v, "D": d, "T": t, "dtype": str(options.get("dtype", torch.bfloat16)).replace("torch.", ""), **out}


def project_frozen(v: int, d: int, t: int, *, machine: dict = H200, **options) -> dict:
    """A frozen head's step (LoRA: the weight needs no gradient) at (V, D, T), beside the floor of a frozen exact
    loss, 4 T V D FLOPs (the logits' forward and the input gradient) at the dense bf16 peak: the projected ms of
    both (issue 55)."""
    head, weight, hidden, labels = default_head(v, d, t, **options)
    out = project_head(head, weight.detach(), hidden, labels, machine=machine)
    floor_ms = 4 * t * v * d / machine["tensor_core_flops"] * 1e3
    return {"frozen_projected_ms": out["projected_ms"], "frozen_launches": out["launches"],
            "frozen_exact_floor_ms": floor_ms, "frozen_parts": {p: x["ms"] for p, x in out["parts"].items()}}


def project_amp(v: int, d: int, t: int, *, machine: dict = H200, **options) -> dict:
    """The mixed-precision step at (V, D, T) (issues 68, 74): float32 weights and hidden states under bf16 autocast,
    the Trainer's bf16=True for a model trained from scratch. The hidden states are cast to bfloat16; the kernels
    read the float32 weight as it is (rounding its tiles on chip) and write its float32 gradient, so no (V, D) copy
    is traced; the launches that read or write the weight's rows move 4 bytes an element where the bfloat16 step
    moves 2 (``hf_midx.losses.precision``): its projected ms and launches."""
    head, weight, hidden, labels = default_head(v, d, t, dtype=torch.float32, **options)
    with torch.autocast(weight.device.type, dtype=torch.bfloat16):
        out = project_head(head, weight, hidden, labels, machine=machine)
    return {"amp_projected_ms": out["projected_ms"], "amp_calibrated_ms": out["calibrated_ms"],
            "amp_launches": out["launches"], "amp_parts": {p: x["ms"] for p, x in out["parts"].items()}}


def project_exact_forward(v: int, d: int, t: int, *, machine: dict = H200, **options) -> dict:
    """``log_probs="exact-forward"`` at (V, D, T) (issue 74, item 5): one policy call of a GRPO-like trainer, float32
    weights and hidden states under bf16 autocast (TRL's default ``bf16=True``), ``MidxLMHead.exact_log_probs`` and
    the backward of its log-probs and entropies, traced on fake tensors: its launches, projected ms (peak and
    calibrated) and how many ``mm`` / ``bmm`` read float32, beside its floor, the logits' forward (2 T V D FLOPs at
    the dense bf16 peak: the values are exact) and the exact head's (6 T V D)."""
    head, weight, hidden, labels = default_head(v, d, t, dtype=torch.float32, **options)
    from torch._subclasses.fake_tensor import FakeTensorMode  # noqa: PLC0415

    mode = FakeTensorMode(allow_non_fake_inputs=True)
    weight, hidden, labels = (mode.from_tensor(x) for x in (weight, hidden, labels))

    def step():
        hidden.grad = None
        with torch.autocast(weight.device.type, dtype=torch.bfloat16):
            out = head.exact_log_probs(hidden, labels, temperature=0.7)
        (out["log_probs"].sum() + out["entropy"].sum()).backward()

    head.weight = torch.nn.Parameter(weight)  # the fake weight, as a ZeRO-3 gather would hand it
    with mode:
        step()
    out = summarize([cost(op, machine) for op in trace(step, mode)], head)
    float32_products = [x for x in out["ops"] if x["op"] in ("mm", "bmm", "addmm") and "float32" in x["shapes"]]
    return {"exact_forward_projected_ms": out["projected_ms"], "exact_forward_calibrated_ms": out["calibrated_ms"],
            "exact_forward_launches": out["launches"], "exact_forward_float32_products": len(float32_products),
            "exact_forward_floor_ms": 2 * t * v * d / machine["tensor_core_flops"] * 1e3}


def render_exact_forward(shapes: list[dict]) -> str:
    """The exact-forward projections (``--exact_forward``) as a Markdown section."""
    table = common.markdown_table(shapes, [
        ("model", "model"), ("V x D", lambda s: f"{s['V']:,} x {s['D']:,}"),
        ("exact-forward (ms)", lambda s: f"{s['exact_forward_projected_ms']:.2f}"),
        ("calibrated (ms)", lambda s: f"{s['exact_forward_calibrated_ms']:.2f}"),
        ("launches", "exact_forward_launches"), ("float32 GEMMs", "exact_forward_float32_products"),
        ("forward floor 2TVD (ms)", lambda s: f"{s['exact_forward_floor_ms']:.2f}"),
        ("exact floor 6TVD (ms)", lambda s: f"{s['floor_ms']:.2f}")])
    return "\n".join(["## log_probs='exact-forward': one policy call under bf16 autocast (float32 weights)", "",
                       "Exact values (the logits' forward over all V classes, TRL's tiles and rounding) and the "
                       "gradient from the exact head and the draws; temperature 0.7, entropies too.", "", table, ""])


def render_amp(shapes: list[dict]) -> str:
    """The mixed-precision step's projections (``--amp``) as a Markdown section."""
    table = common.markdown_table(shapes, [
        ("model", "model"), ("V x D", lambda s: f"{s['V']:,} x {s['D']:,}"),
        ("bf16 (ms)", lambda s: f"{s['projected_ms']:.2f}"), ("bf16 launches", "launches"),
        ("AMP, fp32 weights (ms)", lambda s: f"{s['amp_projected_ms']:.2f}"),
        ("AMP / bf16", lambda s: common.fmt_ratio(s["amp_projected_ms"] / s["projected_ms"], 2)),
        ("AMP launches", "amp_launches"),
        ("AMP calibrated (ms)", lambda s: f"{s['amp_calibrated_ms']:.2f}")])
    return "\n".join(["## Mixed precision: float32 weights under bf16 autocast beside the bfloat16 head", "",
                       "The head multiplies in bfloat16 as an nn.Linear head under autocast does: the hidden states "
                       "cast to bfloat16, the float32 weight read by the kernels as it is (each tile rounded on chip) "
                       "and its float32 gradient written by the weight-gradient kernel, with no (V, D) copy either "
                       "way; the kernels that read or write the weight's rows move 4 bytes an element instead of 2.",
                       "", table, ""])


def render_frozen(shapes: list[dict]) -> str:
    """The frozen head's projections (``--frozen``) as a Markdown section."""
    table = common.markdown_table(shapes, [
        ("model", "model"), ("V x D", lambda s: f"{s['V']:,} x {s['D']:,}"),
        ("trainable (ms)", lambda s: f"{s['projected_ms']:.2f}"),
        ("frozen (ms)", lambda s: f"{s['frozen_projected_ms']:.2f}"),
        ("frozen exact floor 4TVD (ms)", lambda s: f"{s['frozen_exact_floor_ms']:.2f}"),
        ("floor / frozen", lambda s: common.fmt_ratio(s["frozen_exact_floor_ms"] / s["frozen_projected_ms"], 2))])
    return "\n".join(["## A frozen head (LoRA): projected step beside the frozen exact floor", "",
                       "The floor: 4 T V D FLOPs (forward logits and input gradient, no weight gradient) at the "
                       "dense bf16 peak; no exact loss goes below it.", "", table, ""])


def fastest_exact(path: Path = common.REPO_ROOT / "recipes/benchmarks/results/h200/bench_head.json") -> dict:
    """{(V, D, T): (case, ms)}: the fastest exact loss (of :data:`EXACT_CASES`) measured on an H200 at each shape,
    from ``results/h200/bench_head.json``."""
    if not path.exists():
        return {}
    best = {}
    for r in json.loads(path.read_text())["results"]:
        key = (r["V"], r["D"], r["T"])
        if r["case"] in EXACT_CASES and "ms" in r and (key not in best or r["ms"] < best[key][1]):
            best[key] = (r["case"], r["ms"])
    return best


def step_ms(launches: list[dict], machine: dict) -> float:
    """The projected ms of a step's launches (as :func:`summarize` lists them) on ``machine``."""
    fields = {f.name for f in dataclasses.fields(Launch)}
    return sum(launch_us(Launch(**{k: v for k, v in x.items() if k in fields}), machine) for x in launches) / 1e3


def _flag_text(shape: dict) -> str:
    flags = collections.Counter(f"{x['op']}: {f}" for x in shape["flagged"] for f in x["flags"])
    return "; ".join(f"{k} (x{n})" if n > 1 else k for k, n in flags.items()) or "none"


def render(shapes: list[dict], machine: dict, settings: dict, env: dict) -> str:
    part_names = [p for p, _ in PARTS] + ["bookkeeping", "autograd"]
    cols = [("model", "model"), ("V x D", lambda s: f"{s['V']:,} x {s['D']:,}"), ("launches", "launches"),
            *[(f"{p} (ms)", lambda s, p=p: f"{s['parts'].get(p, {}).get('ms', 0):.2f}") for p in part_names],
            ("projected, peak (ms)", lambda s: f"{s['projected_ms']:.2f}"),
            ("calibrated (ms)", lambda s: f"{s['calibrated_ms']:.2f}"),
            ("calibrated, CUDA graph (ms)", lambda s: f"{s['calibrated_graph_ms']:.2f}"),
            ("exact floor (ms)", lambda s: f"{s['floor_ms']:.2f}"),
            ("calibrated: faster than the floor", lambda s: common.fmt_ratio(s["floor_ms"] / s["calibrated_ms"], 1)),
            ("CUDA graph: faster than the floor", lambda s: common.fmt_ratio(s["floor_ms"] / s["calibrated_graph_ms"], 1)),
            ("fastest exact measured (ms)", lambda s: "-" if not s.get("fastest_exact") else
             f"{s['fastest_exact'][1]:.1f} ({s['fastest_exact'][0]})"),
            ("calibrated: faster than it", lambda s: "-" if not s.get("fastest_exact") else
             common.fmt_ratio(s["fastest_exact"][1] / s["calibrated_ms"], 1)),
            ("flagged", _flag_text)]  # fmt: skip
    assumptions = (f"Assumptions ({machine['name']}): {machine['bandwidth_bytes_s'] / 1e12:.1f} TB/s, "
                   f"{machine['tensor_core_flops'] / 1e12:.0f} TFLOP/s dense bf16 on tensor cores, "
                   f"{machine['cuda_core_fp32_flops'] / 1e12:.0f} TFLOP/s float32 on CUDA cores (TF32 off, torch's "
                   f"default), {machine['launch_us']:.0f} us per kernel launch (eager, no CUDA graph), "
                   f"{machine['load_latency_us']} us per entry of an embedding_bag's longest bag (its serial loop), "
                   f"radix sort {machine['sort_bits_per_pass']} bits a pass. A launch costs max(bytes / bandwidth, "
                   "FLOPs / peak, serial part) + launches x the fixed cost.")  # fmt: skip
    calibrated = ("Calibrated: the same launches with the constants fitted on commit 1ca3ce9's profiled H200 step "
                  "(`cost_model.H200_CALIBRATED`, `results/cost-model-calibration/`: a device floor of "
                  f"{H200_CALIBRATED['kernel_floor_us']:.2f} us per kernel, each class's achieved bandwidth, "
                  f"{H200_CALIBRATED['launch_us']:.2f} us of host time per launch; held there against the eight "
                  "measured H200 steps of an older default, with its error on each); CUDA graph: calibrated, the step replayed as one graph (no host time per "
                  "launch). Exact floor: 6 T V D FLOPs at the dense bf16 peak, which no exact loss can beat.")  # fmt: skip
    parts = ["Projected: every figure but the fastest exact loss's, from the step's op trace (FakeTensorMode at the "
             "real shapes). Measured: the fastest exact loss (HF, torch-chunked, Liger, CCE) at the shape, "
             "`results/h200/bench_head.json` (NVIDIA H200, torch 2.11, T = 8,192, bf16).", "",
             assumptions, "", calibrated, "", common.markdown_table(shapes, cols), ""]  # fmt: skip
    for s in shapes:
        top = sorted(s["ops"], key=lambda x: -x["us"])[:12]
        parts += [f"## {s['model']}: the {len(top)} costliest of {s['launches']} launches", "",
                  common.markdown_table(top, [("op", "op"), ("part", "part"), ("where", "where"), ("implementation", "impl"),
                                              ("MB", lambda x: f"{x['bytes'] / 1e6:,.1f}"),
                                              ("GFLOP", lambda x: f"{x['flops'] / 1e9:,.2f}"),
                                              ("projected", lambda x: f"{x['us'] / 1e3:.3f} ms"),
                                              ("note", "note"), ("flags", lambda x: "; ".join(x["flags"]) or "-")]), ""]  # fmt: skip
    return common.report("Cost model of the default head's step on one H200 (projected)", env, settings, *parts)


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)  # fmt: skip
    p.add_argument("--out", default="recipes/benchmarks/results/cost_model", help="folder for cost_model.json and .md")
    p.add_argument("--models", nargs="+", default=list(SHAPES), choices=list(SHAPES))
    p.add_argument("--tokens", type=int, default=8192, help="T")
    p.add_argument("--kmeans_iters", type=int, default=1, help="k-means iterations of the head's index build")
    p.add_argument("--smoke", action="store_true", help="tiny shapes (V / 64, D / 32, T = 256): checks the script")
    p.add_argument("--frozen", action="store_true", help="also project a frozen head's step (the weight needs no "
                   "gradient, as under LoRA) beside the frozen exact floor 4 T V D FLOPs")  # fmt: skip
    p.add_argument("--amp", action="store_true", help="also project the mixed-precision step (float32 weights "
                   "under bf16 autocast) beside the bfloat16 one")  # fmt: skip
    p.add_argument("--exact_forward", action="store_true", help="also project a log_probs='exact-forward' policy "
                   "call (float32 weights under bf16 autocast) beside its 2 T V D floor")  # fmt: skip
    return p.parse_args(argv)


def main(argv=None) -> dict:
    args = parse_args(argv)
    env = common.environment(torch.device("cpu"))
    t = 256 if args.smoke else args.tokens
    settings = {"tokens": t, "dtype": "bfloat16", "kmeans_iters": args.kmeans_iters, "smoke": args.smoke,
                "trace": "FakeTensorMode at the real shapes; head built for real", "machine": H200}  # fmt: skip
    print(f"== {NAME} ==", *(f"{k:11s} : {v}" for k, v in common.header(env, settings)), sep="\n", flush=True)
    exact = fastest_exact()
    shapes = []
    for model in args.models:
        v, d = SHAPES[model]
        if args.smoke:
            v, d = max(2048, v // 64), max(32, d // 32)
        s = {"model": model, **project(v, d, t, kmeans_iters=args.kmeans_iters)}
        s["floor_ms"] = exact_floor_ms(v, d, t)
        s["fastest_exact"] = exact.get((v, d, t))
        parts = ", ".join(f"{p} {x['ms']:.2f}" for p, x in s["parts"].items())
        print(f"{model:14s} V={v:>7,} D={d:>5,}: {s['launches']} launches, projected {s['projected_ms']:.2f} ms "
              f"({parts}), calibrated {s['calibrated_ms']:.2f} ms, CUDA graph {s['calibrated_graph_ms']:.2f} ms; "
              f"exact floor {s['floor_ms']:.2f} ms; fastest exact measured {s['fastest_exact']}; "
              f"flagged: {_flag_text(s)}", flush=True)  # fmt: skip
        if args.frozen:
            s.update(project_frozen(v, d, t, kmeans_iters=args.kmeans_iters))
            print(f"{'':14s} frozen: projected {s['frozen_projected_ms']:.2f} ms, frozen exact floor "
                  f"{s['frozen_exact_floor_ms']:.2f} ms", flush=True)
        if args.amp:
            s.update(project_amp(v, d, t, kmeans_iters=args.kmeans_iters))
            print(f"{'':14s} AMP (float32 weights, bf16 autocast): projected {s['amp_projected_ms']:.2f} ms, "
                  f"{s['amp_launches']} launches", flush=True)
        if args.exact_forward:
            s.update(project_exact_forward(v, d, t, kmeans_iters=args.kmeans_iters))
            print(f"{'':14s} exact-forward: projected {s['exact_forward_projected_ms']:.2f} ms, "
                  f"{s['exact_forward_launches']} launches, {s['exact_forward_float32_products']} float32 GEMMs",
                  flush=True)
        shapes.append(s)
    md = render(shapes, H200, settings, env) + ("\n" + render_frozen(shapes) if args.frozen else "")
    md += "\n" + render_amp(shapes) if args.amp else ""
    md += "\n" + render_exact_forward(shapes) if args.exact_forward else ""
    payload = {"benchmark": NAME, "settings": settings, "environment": env, "machine": H200,
               "calibrated_machine": H200_CALIBRATED, "shapes": shapes}  # fmt: skip
    common.write_outputs(args.out, NAME, payload, md)
    return payload


if __name__ == "__main__":
    main()
