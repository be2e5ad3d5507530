"""What every hf-midx benchmark shares: one command line, one header, one way to time and to weigh.

Each script under ``recipes/benchmarks`` runs as ``python recipes/benchmarks/<name>.py --out DIR
[--quick] [--device cpu|cuda]`` and writes ``DIR/<name>.json`` (settings, environment, every row),
``DIR/<name>.md`` (the tables) and PNG plots.

Rows follow Liger-Kernel's benchmark rows: one per (case, metric), with the device, the library
versions and the 20/50/80 % quantiles of the repeats.

Timing (:func:`time_op`): ``warmup`` untimed calls, then ``repeats`` timed ones with
``time.perf_counter``, bracketed by ``torch.cuda.synchronize`` on a GPU. A case whose first timed
call is slow gets fewer repeats (``budget_s``), never fewer than one.

Peak memory (:func:`peak_memory`), always in a separate, untimed call:

* GPU: ``torch.cuda.max_memory_allocated`` after ``reset_peak_memory_stats``, minus what was
  allocated before the call: the op's own peak, outputs and gradients included.
* CPU: torch has no CPU allocator statistics, so the call runs under ``torch.profiler`` with
  ``profile_memory=True``; the profiler records every allocation and free of torch's CPU allocator
  with a timestamp, and the peak is the largest running sum of those since the call began. It counts
  torch tensors only (not the Python heap, not faiss's or BLAS's private buffers), the same things
  ``max_memory_allocated`` counts on a GPU. (``ru_maxrss`` was not used: it is a process-wide high
  water mark that an earlier, larger step -- e.g. building the index -- hides.)
"""

from __future__ import annotations

import argparse
import datetime as _dt
import json
import math
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Callable, Iterable, Sequence

import torch

REPO_ROOT = Path(__file__).resolve().parents[2]


# ---------------------------------------------------------------------------- command line
def positive_int(text: str) -> int:
    """An argparse type: an integer >= 1 (anything else is a parser error naming the flag)."""
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected an integer >= 1, got {text!r}")
    return value


#: Flags that several benchmarks take: name -> (type, nargs, help). A script asks for them by name in
#: base_parser with its own default, and, where the default depends on --quick, the help says which.
SHARED_FLAGS = {
    "samplers": (str, "+", "proposals to run: names of hf_midx.SAMPLERS or of common.VARIANTS"),
    "vocab": (int, "+", "V values (classes)"),
    "queries": (int, "+", "T values (queries per call)"),
    "dim": (int, None, "D (hidden size)"),
    "num_samples": (int, None, "M negatives per token"),
    "pool_size": (int, None, "P negatives in a shared pool"),
    "codebook_size": (int, None, "K codewords per codebook"),
    "kmeans_iters": (int, None, "Lloyd iterations per codebook"),
    "budget_s": (float, None, "stop repeating a case after this many seconds"),
    "default_extra_m": (positive_int, "+", "also run the default head (MidxConfig()) with these M negatives per "
                        "token, per-query: cases midx-default-m<M>"),
}


def base_parser(description: str, *, timed: bool = True, seed: bool = True, plots: bool = True, **shared) -> argparse.ArgumentParser:
    """The flags every benchmark takes, then the ``SHARED_FLAGS`` named in ``shared``; scripts add their own.

    ``shared`` maps a flag to its default, or to ``(default, note)`` where the note (e.g. "default 60;
    quick 5") says what None picks. ``timed=False``: a script that reads runs instead of timing (no
    --quick, --smoke, --device, --warmup, --repeats); ``seed`` / ``plots`` False: no --seed / --no_plots.
    """
    p = argparse.ArgumentParser(description=description, formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--out", default="bench-out", help="output folder for <name>.json, <name>.md and the PNG plots")
    if timed:
        p.add_argument("--quick", action="store_true", help="small sizes and few repeats (about a minute on 2 CPU cores)")
        p.add_argument("--smoke", action="store_true", help="tiny sizes for the test suite: checks that everything "
                       "runs and writes its files; implies --quick; the numbers mean nothing")  # fmt: skip
        p.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"], help="auto = cuda when available")
        p.add_argument("--warmup", type=int, default=None, help="untimed calls before timing (default: 1, quick: 1)")
        p.add_argument("--repeats", type=int, default=None, help="timed calls per case (default: 5, quick: 2)")
    if seed:
        p.add_argument("--seed", type=int, default=0)
    if plots:
        p.add_argument("--no_plots", action="store_true", help="skip the PNG plots (no matplotlib needed)")
    for name, default in shared.items():
        kind, nargs, help_ = SHARED_FLAGS[name]
        default, note = default if isinstance(default, tuple) else (default, None)
        p.add_argument(f"--{name}", type=kind, nargs=nargs, default=default, help=f"{help_} ({note})" if note else help_)
    return p


def by_size(args: argparse.Namespace, smoke, quick, full):
    """The value of a size for this run: ``smoke``, ``quick`` or ``full``."""
    return smoke if args.smoke else quick if args.quick else full


def parse(parser: argparse.ArgumentParser, argv=None) -> argparse.Namespace:
    """``parser.parse_args`` with ``--smoke`` implying ``--quick``."""
    args = parser.parse_args(argv)
    if getattr(args, "smoke", False):
        args.quick = True
    return args


def run_settings(args: argparse.Namespace, **specific) -> dict:
    """A run's settings for the header and the JSON: the script's own, then the flags of base_parser."""
    return {**specific, "quick": args.quick, "smoke": args.smoke, "seed": args.seed}


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name == "cuda" and not torch.cuda.is_available():
        raise SystemExit("--device cuda was asked for but torch.cuda.is_available() is False; use --device cpu.")
    return torch.device(name)


def repeats_of(args, full: int = 5, quick: int = 2) -> tuple[int, int]:
    """(warmup, repeats) from the flags, with the script's defaults."""
    warmup = 1 if args.warmup is None else args.warmup
    repeats = (quick if args.quick else full) if args.repeats is None else args.repeats
    return warmup, max(1, repeats)


# ---------------------------------------------------------------------------- environment
def git_commit() -> dict[str, Any]:
    """HEAD of the repository the benchmarks live in, and whether the tree had local changes."""
    def git(*argv: str) -> str:
        return subprocess.run(["git", *argv], cwd=REPO_ROOT, capture_output=True, text=True, timeout=10, check=True).stdout

    try:
        return {"commit": git("rev-parse", "HEAD").strip(), "dirty": bool(git("status", "--porcelain", "--untracked-files=no").strip())}
    except (OSError, subprocess.SubprocessError):
        return {"commit": None, "dirty": None}


def _cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return f"{_cpu_name()} ({os.cpu_count()} cores, {torch.get_num_threads()} torch threads)"


def _version(module: str) -> str | None:
    """An optional package's version (faiss, Liger): hf_midx.versions() lists only what a run needs."""
    from importlib.metadata import PackageNotFoundError, version  # noqa: PLC0415

    try:
        return version(module)
    except PackageNotFoundError:
        return None


def environment(device: torch.device) -> dict[str, Any]:
    """Device, library versions, git commit and time: stored in every JSON and printed first."""
    import hf_midx  # noqa: PLC0415

    versions = hf_midx.versions()
    env = {
        "device_type": device.type, "device": device_name(device), "python": versions["python"],
        "platform": platform.platform(), "torch": versions.get("torch", torch.__version__),
        "transformers": versions.get("transformers"), "hf_midx": versions["hf_midx"],
        "faiss": _version("faiss-cpu") or _version("faiss-gpu") or _version("faiss"),
        "liger_kernel": _version("liger-kernel"), "cut_cross_entropy": _version("cut-cross-entropy"),
        "accelerate": versions.get("accelerate"), "triton": _version("triton") or _version("pytorch-triton"),
        "cuda": torch.version.cuda, "torch_threads": torch.get_num_threads(),
        "cpu_count": os.cpu_count(), "mem_total_gb": round(mem_total_bytes() / 2**30, 1) if mem_total_bytes() else None,
        "git": git_commit(), "timestamp": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
    }  # fmt: skip
    if device.type == "cuda":
        env["gpu_memory_gb"] = round(torch.cuda.get_device_properties(device).total_memory / 2**30, 1)
    return env


def print_header(name: str, env: dict, settings: dict) -> None:
    git = env["git"]
    print(f"== {name} ==")
    print(f"device      : {env['device']}")
    print(
        f"versions    : hf_midx {env['hf_midx']}, torch {env['torch']} (CUDA {env.get('cuda')}), transformers "
        f"{env['transformers']}, accelerate {env.get('accelerate')}, triton {env.get('triton')}, faiss {env['faiss']}, "
        f"liger_kernel {env['liger_kernel']}, cut_cross_entropy {env.get('cut_cross_entropy')}, python {env['python']}"
    )
    print(f"git commit  : {git['commit']}{' (local changes)' if git['dirty'] else ''}")
    print(f"settings    : {json.dumps(settings, default=str)}")
    sys.stdout.flush()


def start(name: str, args: argparse.Namespace, device: torch.device, **settings) -> tuple[dict, dict]:
    """A run's environment and settings (``run_settings``), printed as its header; returns both."""
    env = environment(device)
    settings = run_settings(args, **settings)
    print_header(name, env, settings)
    return env, settings


def _meminfo(key: str) -> int | None:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith(key + ":"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def mem_total_bytes() -> int | None:
    return _meminfo("MemTotal")


def mem_available_bytes() -> int | None:
    return _meminfo("MemAvailable")


def memory_budget_bytes(device: torch.device, max_gb: float) -> int:
    """Bytes a single case may use: ``max_gb``, capped by 85 % of the free device (or host) memory."""
    cap = max_gb * 2**30
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return int(min(cap, 0.85 * free))
    avail = mem_available_bytes()
    return int(min(cap, 0.85 * avail)) if avail else int(cap)


# ---------------------------------------------------------------------------- timing and memory
def zipf_counts(v: int, tokens: float = 1e6, generator: torch.Generator | None = None) -> torch.Tensor:
    """(V,) float64 token counts of a Zipf(1) corpus of ``tokens`` tokens (rare classes may count 0).

    With ``generator``, class ids are shuffled, so that frequency is not the id; without, class 0 is
    the most frequent. The one generator of synthetic frequencies for every benchmark.
    """
    p = 1.0 / torch.arange(1, v + 1, dtype=torch.float64)
    counts = (p / p.sum() * tokens).floor()
    return counts if generator is None else counts[torch.randperm(v, generator=generator)]


def zipf_labels(counts: torch.Tensor, n: int, generator: torch.Generator | None = None) -> torch.Tensor:
    """(n,) int64 labels drawn i.i.d. in proportion to ``counts`` + 1 (every class can occur)."""
    return torch.multinomial(counts.float() + 1, n, replacement=True, generator=generator)


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def quantiles(values: Sequence[float]) -> dict[str, float]:
    """20 / 50 / 80 % quantiles (Liger-Kernel's y_values_20/50/80), mean and min."""
    v = sorted(values)
    if len(v) == 1:
        q20 = q50 = q80 = v[0]
    else:
        qs = statistics.quantiles(v, n=10, method="inclusive")
        q20, q50, q80 = qs[1], statistics.median(v), qs[7]
    return {"p20": q20, "p50": q50, "p80": q80, "mean": statistics.fmean(v), "min": v[0], "n": len(v)}


def time_op(
    fn: Callable[[], Any],
    device: torch.device,
    *,
    warmup: int = 1,
    repeats: int = 5,
    budget_s: float | None = None,
) -> dict[str, float]:
    """Milliseconds per call of ``fn`` (quantiles over ``repeats`` calls after ``warmup`` calls).

    With ``budget_s``, repeats stop once their total passes the budget (at least one timed call). On
    a CPU, a warmup call that alone takes longer than the budget is taken as the single measurement
    (``"warm": False`` in the result); on a GPU never, since there the first call of a Triton kernel
    (Liger, Cut Cross-Entropy) or of a compiled step includes its compilation (seconds to a minute).
    """
    times: list[float] = []
    spent = 0.0
    for i in range(warmup):
        sync(device)
        t0 = time.perf_counter()
        fn()
        sync(device)
        dt = time.perf_counter() - t0
        if i == 0 and budget_s is not None and dt >= budget_s and device.type == "cpu":
            # One call already fills the budget: it is the measurement (its one-time costs are noise here).
            return {**quantiles([dt * 1e3]), "warm": False}
    for _ in range(max(1, repeats)):
        sync(device)
        t0 = time.perf_counter()
        fn()
        sync(device)
        dt = time.perf_counter() - t0
        times.append(dt * 1e3)
        spent += dt
        if budget_s is not None and spent >= budget_s:
            break
    return {**quantiles(times), "warm": True}


def peak_memory(fn: Callable[[], Any], device: torch.device) -> dict[str, Any]:
    """Peak bytes that one call of ``fn`` allocates above what was allocated before it (see module doc)."""
    sync(device)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
        before = torch.cuda.memory_allocated(device)
        fn()
        sync(device)
        return {
            "peak_bytes": int(torch.cuda.max_memory_allocated(device) - before),
            "method": "cuda.max_memory_allocated",
        }
    from torch.profiler import ProfilerActivity, profile  # noqa: PLC0415

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True, record_shapes=False) as prof:
        fn()
    events = [
        e for e in prof.profiler.kineto_results.events() if e.name() == "[memory]" and e.device_type().name == "CPU"
    ]
    events.sort(key=lambda e: e.start_ns())
    running = peak = 0
    for e in events:
        running += e.nbytes()
        peak = max(peak, running)
    return {
        "peak_bytes": int(peak),
        "method": "torch.profiler(profile_memory=True): max running sum of CPU allocations",
    }


# ---------------------------------------------------------------------------- rows, tables, files
def row(
    env: dict,
    *,
    op: str,
    provider: str,
    metric: str,
    unit: str,
    x_name: str,
    x_value: Any,
    stats: dict[str, float] | None = None,
    value: float | None = None,
    **extra: Any,
) -> dict[str, Any]:
    """One Liger-style result row: what was measured, on which device and versions, and the numbers."""
    r: dict[str, Any] = {
        "op": op, "provider": provider, "metric": metric, "unit": unit, "x_name": x_name, "x_value": x_value,
        "device": env["device"], "hf_midx_version": env["hf_midx"], "torch_version": env["torch"],
        "git_commit": env["git"]["commit"], "timestamp": env["timestamp"],
    }  # fmt: skip
    if stats is not None:
        r.update({"y_p20": stats["p20"], "y_p50": stats["p50"], "y_p80": stats["p80"], "repeats": stats["n"]})
    elif value is not None:
        r["y_p50"] = value
    r.update(extra)
    return r


def fmt_ms(ms: float | None) -> str:
    if ms is None or (isinstance(ms, float) and math.isnan(ms)):
        return "-"
    if ms >= 10_000:
        return f"{ms / 1e3:.1f} s"
    if ms >= 100:
        return f"{ms:.0f} ms"
    if ms >= 1:
        return f"{ms:.2f} ms"
    return f"{ms * 1e3:.0f} us"


def fmt_bytes(n: float | None) -> str:
    if n is None:
        return "-"
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(n) >= scale:
            return f"{n / scale:.2f} {unit}"
    return f"{int(n)} B"


def fmt_ratio(x: float | None, digits: int = 1) -> str:
    if x is None or (isinstance(x, float) and (math.isnan(x) or math.isinf(x))):
        return "-"
    if x >= 100:
        return f"{x:.0f}x"
    return f"{x:.{digits}f}x"


def markdown_table(rows: Iterable[dict], columns: Sequence[tuple[str, Any]]) -> str:
    """A GitHub table; ``columns`` are (header, key) pairs, a key being a row's key or a function of the
    row; None (or a missing key) prints as '-'."""
    lines = ["| " + " | ".join(h for h, _ in columns) + " |", "|" + "|".join(" --- " for _ in columns) + "|"]
    for r in rows:
        cells = (key(r) if callable(key) else r.get(key) for _, key in columns)
        lines.append("| " + " | ".join("-" if c is None else str(c) for c in cells) + " |")
    return "\n".join(lines)


def report(title: str, env: dict, settings: dict, *parts: str) -> str:
    """A benchmark's Markdown: the header (device, versions, commit, settings), then ``parts``, one a line."""
    return "\n".join([header_markdown(title, env, settings), "", *parts])


def header_markdown(name: str, env: dict, settings: dict) -> str:
    git = env["git"]
    commit = (git["commit"] or "unknown")[:12] + (" (local changes)" if git["dirty"] else "")
    lines = [
        f"# {name}",
        "",
        f"- device: {env['device']}",
        f"- versions: hf_midx {env['hf_midx']}, torch {env['torch']} (CUDA {env.get('cuda')}), transformers "
        f"{env['transformers']}, accelerate {env.get('accelerate')}, triton {env.get('triton')}, faiss {env['faiss']}, "
        f"liger_kernel {env['liger_kernel']}, cut_cross_entropy {env.get('cut_cross_entropy')}",
        f"- git commit: {commit}",
        f"- date: {env['timestamp']}",
        f"- settings: `{json.dumps(settings, default=str)}`",
    ]
    return "\n".join(lines)


def write_outputs(out_dir: str | Path, name: str, payload: dict, markdown: str) -> tuple[Path, Path]:
    """Write ``<out>/<name>.json`` and ``<out>/<name>.md``; returns both paths."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    js, md = out / f"{name}.json", out / f"{name}.md"
    js.write_text(json.dumps(payload, indent=2, default=_json_default) + "\n")
    md.write_text(markdown.rstrip() + "\n")
    print(f"wrote {js} and {md}")
    return js, md


def finish(args: argparse.Namespace, name: str, env: dict, settings: dict, markdown: str, plot=None, **fields) -> dict:
    """Write ``<out>/<name>.json`` (the benchmark's name, settings, environment, then ``fields``) and
    ``<out>/<name>.md``, call ``plot()`` unless --no_plots, print the Markdown; returns the JSON payload."""
    payload = {"benchmark": name, "settings": settings, "environment": env, **fields}
    write_outputs(args.out, name, payload, markdown)
    if plot is not None and not args.no_plots:
        plot()
    print(markdown)
    return payload


def _json_default(obj):
    if isinstance(obj, (torch.device, Path)):
        return str(obj)
    if isinstance(obj, torch.Tensor):
        return obj.tolist()
    return str(obj)


def pyplot():
    """matplotlib.pyplot on the Agg backend (files only), imported on first use."""
    try:
        import matplotlib  # noqa: PLC0415

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt  # noqa: PLC0415
    except ImportError as err:
        raise ImportError(
            "The benchmark plots need matplotlib: pip install 'hf-midx[bench]' (or pass --no_plots)."
        ) from err
    return plt


def save_figure(fig, out_dir: str | Path, filename: str) -> Path:
    path = Path(out_dir) / filename
    path.parent.mkdir(parents=True, exist_ok=True)  # a script may plot before it writes its tables
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    pyplot().close(fig)
    print(f"wrote {path}")
    return path


def lines(rows: Iterable[dict], x: str, y: str, by: str, **where) -> dict[str, tuple[list, list]]:
    """{row[by]: (xs, ys)}, sorted by x, over the rows that have ``y`` and whose fields equal ``where``."""
    out: dict[str, list] = {}
    for r in rows:
        if r.get(y) is not None and all(r.get(k) == v for k, v in where.items()):
            out.setdefault(r[by], []).append((r[x], r[y]))
    return {k: tuple(map(list, zip(*sorted(pts, key=lambda p: p[0])))) for k, pts in out.items()}


def plot_panels(out_dir: str | Path, filename: str, panels: Sequence[dict], *, size=(6.0, 4.5)) -> Path:
    """One PNG of side-by-side line panels, one line per provider (Liger-Kernel's visualizer).

    A panel is a dict: ``lines`` ({label: (xs, ys)}), and optionally ``title``, ``xlabel``, ``ylabel``,
    ``xscale`` / ``yscale`` (a name, or (name, options) such as ("log", {"base": 2})), ``style`` (label
    -> plot options; default a marker per point), ``legend`` (font size, 0: none) and ``extra`` (a
    function of the axes, for what one panel adds: a reference line, single points).
    """
    plt = pyplot()
    fig, axes = plt.subplots(1, len(panels), figsize=(size[0] * len(panels), size[1]), squeeze=False)
    for ax, p in zip(axes[0], panels):
        for label, (xs, ys) in p["lines"].items():
            ax.plot(xs, ys, label=label, **(p["style"](label) if "style" in p else {"marker": "o"}))
        for axis in ("x", "y"):
            scale = p.get(axis + "scale")
            if scale:
                name, options = (scale, {}) if isinstance(scale, str) else scale
                getattr(ax, f"set_{axis}scale")(name, **options)
        ax.set_xlabel(p.get("xlabel", ""))
        ax.set_ylabel(p.get("ylabel", ""))
        ax.set_title(p.get("title", ""))
        ax.grid(True, which="both", alpha=0.3)
        if "extra" in p:
            p["extra"](ax)
        if p.get("legend", 7):
            ax.legend(fontsize=p.get("legend", 7))
    return save_figure(fig, out_dir, filename)


def free_memory(device: torch.device) -> None:
    import gc  # noqa: PLC0415

    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


# ---------------------------------------------------------------------------- shapes
#: (V, D) of the output layers of real models (their configs' vocab_size and hidden_size).
MODEL_SHAPES = {
    "llama3-8b": (128256, 4096),
    "gemma2-2b": (256000, 2304),
    "qwen2.5-0.5b": (151936, 896),
    "gemma3-270m": (262144, 640),
}


# ---------------------------------------------------------------------------- variants
_NO_HEAD, _NO_MIX, _MIX = {"exact_head": 0}, {"mix_weight": 0.0}, {"mix_weight": 0.5, "mix_static": "unigram"}
#: Issue 9's proposals, one name each for every benchmark: name -> (sampler, MidxConfig fields set on top
#: of MidxConfig()'s defaults). A name says its whole recipe: without "head" it has no exact head, without
#: "mix" no defensive mixture, except "learned" and "shared" (the default plus that one change) and
#: "midx-rq-nomix", kept as the name earlier results use for "midx-rq-head2k-nomix". The head and the
#: mixture are written out, so that a later change of a MidxConfig default does not change what a name
#: measures. (Before this table, compare_samplers gave "midx-rq-mix-uniform", "-frequency" and
#: "-frequency-mix" the recipe's exact head; bench_kl gave them none.) compare_samplers passes the fields
#: to the recipe as its flags (variant_flags); bench_kl and bench_sampling build the proposal from them
#: (build_variant), as the head would.
VARIANTS = {
    "midx-rq-paper": ("midx-rq", {"estimator": "exact-positive", **_NO_MIX, **_NO_HEAD}),  # midx-rq before issue 9
    "midx-rq-nomix": ("midx-rq", {**_NO_MIX, "exact_head": 2048}),  # earlier results' name for head2k-nomix
    "midx-rq-mix": ("midx-rq", {**_MIX, **_NO_HEAD}),
    "midx-rq-mix-uniform": ("midx-rq", {**_MIX, "mix_static": "uniform", **_NO_HEAD}),
    "midx-rq-frequency": ("midx-rq", {"last_stage": "frequency", **_NO_MIX, **_NO_HEAD}),
    "midx-rq-frequency-mix": ("midx-rq", {"last_stage": "frequency", **_MIX, **_NO_HEAD}),
    "midx-rq-head2k": ("midx-rq", {"exact_head": 2048, **_MIX}),
    "midx-rq-head2k-nomix": ("midx-rq", {"exact_head": 2048, **_NO_MIX}),
    "midx-rq-head2k-frequency-mix": ("midx-rq", {"exact_head": 2048, "last_stage": "frequency", **_MIX}),
    "midx-rq-head512": ("midx-rq", {"exact_head": 512, **_MIX}),
    "midx-rq-head1k": ("midx-rq", {"exact_head": 1024, **_MIX}),
    "midx-rq-head4k": ("midx-rq", {"exact_head": 4096, **_MIX}),
    "unigram-head2k": ("unigram", {"exact_head": 2048}),
    "unigram-exact-positive": ("unigram", {"estimator": "exact-positive"}),
    "midx-rq-learned": ("midx-rq", {"codebooks": "learned"}),
    "midx-rq-shared": ("midx-rq", {"negatives": "shared"}),  # the pool size is the benchmark's --pool_size
}
#: Fields that only a training run has: a variant that sets one is not a proposal of its own.
TRAINING_FIELDS = ("estimator", "codebooks", "negatives")


def proposal_variants() -> list[str]:
    """The variants that are a proposal alone (no training-only field): what bench_kl and bench_sampling build."""
    return [name for name, (_, fields) in VARIANTS.items() if not set(fields) & set(TRAINING_FIELDS)]


def variant_flags(name: str, pool_size: int) -> list[str]:
    """The recipe's flags for a variant: ``--<field> <value>`` for each of its MidxConfig fields."""
    fields = VARIANTS[name][1]
    flags = [arg for key, value in fields.items() for arg in (f"--{key}", str(value))]
    return flags + (["--num_samples", str(pool_size)] if fields.get("negatives") == "shared" else [])


def build_variant(name: str, weight: torch.Tensor, counts: torch.Tensor, **changes):
    """The proposal of ``VARIANTS[name]`` over (V, D) ``weight``, as the head builds it from its MidxConfig.

    ``changes`` are more MidxConfig fields (codebook_size, seed, kmeans_iters); the exact head is the
    ``exact_head`` most frequent classes by ``counts``, at most V/4 of them (so that a small test
    vocabulary keeps a tail to sample).
    """
    import hf_midx  # noqa: PLC0415

    sampler, fields = VARIANTS[name]
    config = hf_midx.MidxConfig(sampler=sampler, **fields, **changes)
    head = min(config.exact_head, weight.shape[0] // 4)
    exclude = torch.sort(torch.argsort(counts.double(), descending=True, stable=True)[:head]).values if head else None
    return hf_midx.build_sampler(sampler, weight, class_counts=counts, exclude=exclude, **config.sampler_kwargs())


def exact_kernels(device: torch.device) -> dict[str, Any]:
    """``cce`` / ``liger`` -> Cut Cross-Entropy's ``linear_cross_entropy`` / Liger's fused linear CE class, or
    None where the package is missing or there is no GPU (their kernels are Triton's)."""
    kernels: dict[str, Any] = {"cce": None, "liger": None}
    if device.type != "cuda":
        return kernels
    try:
        from cut_cross_entropy import linear_cross_entropy  # noqa: PLC0415

        kernels["cce"] = linear_cross_entropy
    except Exception as err:  # noqa: BLE001 (missing, or failing to import against this torch / triton)
        print(f"cut_cross_entropy unusable ({type(err).__name__}: {err}): the cce case is left out "
              "(pip install cut-cross-entropy).")  # fmt: skip
    try:
        from liger_kernel.transformers import LigerFusedLinearCrossEntropyLoss  # noqa: PLC0415

        kernels["liger"] = LigerFusedLinearCrossEntropyLoss
    except Exception as err:  # noqa: BLE001
        print(f"liger_kernel unusable ({type(err).__name__}: {err}): the liger case is left out "
              "(pip install liger-kernel).")  # fmt: skip
    return kernels


# ---------------------------------------------------------------------------- the recipes
RECIPES_DIR = REPO_ROOT / "recipes"
DEFAULT_DATA_DIR = REPO_ROOT.parent / "shared" / "data" / "wikitext-2"
SAMPLE_DATA_DIR = RECIPES_DIR / "data" / "wikitext2_sample"


def import_recipe(name: str):
    """Import ``recipes/<name>.py`` as ``recipes.<name>``.

    The one ``sys.path`` edit of the benchmarks: a benchmark run as a file (``python
    recipes/benchmarks/x.py``) has only its own folder on ``sys.path``, and the recipes import their
    siblings as the package ``recipes`` (see recipes/__init__.py), so the repository root must be there
    too; run as ``python -m recipes.benchmarks.x`` (or under pytest) it already is.
    """
    import importlib  # noqa: PLC0415

    if str(REPO_ROOT) not in sys.path:
        sys.path.insert(0, str(REPO_ROOT))
    return importlib.import_module(f"recipes.{name}")


def data_files(data_dir: str | Path | None) -> dict[str, Path] | None:
    """``{"train", "validation", "test"}`` text files of a WikiText-style folder (train.txt, valid.txt, test.txt).

    ``None`` picks ``../shared/data/wikitext-2`` beside the repository when it exists. Returns None when
    there is no such folder; raises SystemExit when a given folder lacks train.txt or valid.txt.
    """
    folder = Path(data_dir) if data_dir else DEFAULT_DATA_DIR
    if not folder.is_dir():
        if data_dir:
            raise SystemExit(f"--data_dir {data_dir} is not a directory.")
        return None
    files = {"train": folder / "train.txt", "validation": folder / "valid.txt", "test": folder / "test.txt"}
    for key in ("train", "validation"):
        if not files[key].is_file():
            raise SystemExit(f"{folder} has no {files[key].name}; a data folder holds train.txt, valid.txt [test.txt].")
    if not files["test"].is_file():
        del files["test"]
    return files
