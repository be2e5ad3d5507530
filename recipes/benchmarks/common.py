"""The benchmark runner every script under ``recipes/benchmarks`` shares, laid out as Liger-Kernel's.

A benchmark is the question it asks plus calls to this module: ``base_parser`` / ``parse`` (one command
line: ``--out DIR [--quick|--smoke] [--device cpu|cuda]``), ``start`` (the header: device, versions,
commit, settings), ``measure`` (one case: time and peak memory, or why it was skipped), ``rows`` (Liger's
rows: one per case and metric, with device, versions and the 20/50/80 % quantiles), ``finish`` (writes
``OUT/<name>.json`` and ``OUT/<name>.md``, then the PNGs of ``plot_panels``).

Timing (:func:`time_op`): ``warmup`` untimed calls, then ``repeats`` timed ones with ``time.perf_counter``,
bracketed by ``torch.cuda.synchronize`` on a GPU. A case whose first timed call is slow gets fewer repeats
(``budget_s``), never fewer than one.

Peak memory (:func:`peak_memory`), always in a separate, untimed call. GPU: ``max_memory_allocated`` after
``reset_peak_memory_stats``, minus what was allocated before: the op's own peak, outputs and gradients
included. CPU: torch has no CPU allocator statistics, so the call runs under ``torch.profiler`` with
``profile_memory=True``, and the peak is the largest running sum of its allocation events: torch tensors
only, as on a GPU (``ru_maxrss`` is a process-wide high-water mark that an earlier, larger step hides).
"""

from __future__ import annotations

import argparse
import datetime as _dt
import gc
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
RECIPES_DIR = REPO_ROOT / "recipes"
DEFAULT_DATA_DIR = REPO_ROOT.parent / "shared" / "data" / "wikitext-2"
SAMPLE_DATA_DIR = RECIPES_DIR / "data" / "wikitext2_sample"
#: (V, D) of the output layers of real models (their configs' vocab_size and hidden_size).
MODEL_SHAPES = {"llama3-8b": (128256, 4096), "gemma2-2b": (256000, 2304), "qwen2.5-0.5b": (151936, 896),
                "gemma3-270m": (262144, 640)}  # fmt: skip


# ---------------------------------------------------------------------------- command line
def positive_int(text: str) -> int:
    """An argparse type: an integer >= 1 (anything else is a parser error naming the flag)."""
    value = int(text) if text.lstrip("-").isdigit() else 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected an integer >= 1, got {text!r}")
    return value


#: Flags several benchmarks take: name -> (type, nargs, help). A script asks for them by name in
#: base_parser, with its own default.
SHARED_FLAGS = {
    "samplers": (str, "+", "proposals to run: names of hf_midx.SAMPLERS or of common.VARIANTS"),
    "vocab": (int, "+", "V values (classes)"), "queries": (int, "+", "T values (queries per call)"),
    "dim": (int, None, "D (hidden size)"), "num_samples": (int, None, "M negatives per token"),
    "pool_size": (int, None, "P negatives in a shared pool"), "codebook_size": (int, None, "K codewords per codebook"),
    "kmeans_iters": (int, None, "Lloyd iterations per codebook"),
    "budget_s": (float, None, "stop repeating a case after this many seconds"),
    "default_extra_m": (positive_int, "+", "also run the default head (MidxConfig()) with these M negatives per "
                        "token, per-query: cases midx-default-m<M>")}  # fmt: skip


def base_parser(description: str, *, timed: bool = True, seed: bool = True, plots: bool = True, **shared):
    """The flags every benchmark takes, then the ``SHARED_FLAGS`` named in ``shared``; scripts add their own.

    ``shared`` maps a flag to its default, or to ``(default, note)`` where the note (e.g. "default 60; quick 5")
    says what None picks. ``timed=False``: a script that reads runs instead of timing (no --quick, --smoke,
    --device, --warmup, --repeats); ``seed`` / ``plots`` False: no --seed / --no_plots.
    """
    p = argparse.ArgumentParser(description=description, formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--out", default="bench-out", help="output folder for <name>.json, <name>.md and the PNG plots")
    if timed:
        p.add_argument("--quick", action="store_true", help="small sizes and few repeats (about a minute on 2 CPU cores)")
        p.add_argument("--smoke", action="store_true", help="tiny sizes for the test suite: checks that everything "
                       "runs and writes its files; implies --quick; the numbers mean nothing")  # fmt: skip
        p.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"], help="auto = cuda when available")
        p.add_argument("--warmup", type=int, default=None, help="untimed calls before timing (default 1)")
        p.add_argument("--repeats", type=int, default=None, help="timed calls per case (default: the script's)")
    if seed:
        p.add_argument("--seed", type=int, default=0)
    if plots:
        p.add_argument("--no_plots", action="store_true", help="skip the PNG plots (no matplotlib needed)")
    for name, default in shared.items():
        kind, nargs, help_ = SHARED_FLAGS[name]
        default, note = default if isinstance(default, tuple) else (default, None)
        p.add_argument(f"--{name}", type=kind, nargs=nargs, default=default, help=f"{help_} ({note})" if note else help_)
    return p


def parse(parser: argparse.ArgumentParser, argv=None) -> argparse.Namespace:
    """``parser.parse_args`` with ``--smoke`` implying ``--quick``."""
    args = parser.parse_args(argv)
    if getattr(args, "smoke", False):
        args.quick = True
    return args


def by_size(args: argparse.Namespace, smoke, quick, full):
    """The value of a size for this run: ``smoke``, ``quick`` or ``full``."""
    return smoke if args.smoke else quick if args.quick else full


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name == "cuda" and not torch.cuda.is_available():
        raise SystemExit("--device cuda was asked for but torch.cuda.is_available() is False; use --device cpu.")
    return torch.device(name)


def repeats_of(args, full: int = 5, quick: int = 2) -> tuple[int, int]:
    """(warmup, repeats) from the flags, with the script's defaults."""
    repeats = (quick if args.quick else full) if args.repeats is None else args.repeats
    return (1 if args.warmup is None else args.warmup), max(1, repeats)


# ---------------------------------------------------------------------------- environment
def git_commit() -> dict[str, Any]:
    """HEAD of the repository the benchmarks live in, and whether the tree had local changes."""
    def git(*argv: str) -> str:
        return subprocess.run(["git", *argv], cwd=REPO_ROOT, capture_output=True, text=True, timeout=10, check=True).stdout

    try:
        return {"commit": git("rev-parse", "HEAD").strip(), "dirty": bool(git("status", "--porcelain", "--untracked-files=no").strip())}
    except (OSError, subprocess.SubprocessError):
        return {"commit": None, "dirty": None}


def _proc(path: str, key: str) -> str | None:
    """The value of ``key:`` in a /proc file (cpuinfo, meminfo), or None."""
    try:
        with open(path) as f:
            return next((line.split(":", 1)[1].strip() for line in f if line.split(":")[0].strip() == key), None)
    except OSError:
        return None


def _version(dist: str) -> str | None:
    """An optional package's version (faiss, Liger): hf_midx.versions() lists only what a run needs."""
    from importlib.metadata import PackageNotFoundError, version  # noqa: PLC0415

    try:
        return version(dist)
    except PackageNotFoundError:
        return None


def environment(device: torch.device) -> dict[str, Any]:
    """Device, library versions, git commit and time: stored in every JSON and printed first."""
    import hf_midx  # noqa: PLC0415

    v = hf_midx.versions()
    cpu = _proc("/proc/cpuinfo", "model name") or platform.processor() or platform.machine()
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else \
        f"{cpu} ({os.cpu_count()} cores, {torch.get_num_threads()} torch threads)"  # fmt: skip
    total = _proc("/proc/meminfo", "MemTotal")
    env = {"device_type": device.type, "device": name, "python": v["python"], "platform": platform.platform(),
           "torch": v.get("torch", torch.__version__), "transformers": v.get("transformers"), "hf_midx": v["hf_midx"],
           "faiss": _version("faiss-cpu") or _version("faiss-gpu") or _version("faiss"),
           "liger_kernel": _version("liger-kernel"), "cut_cross_entropy": _version("cut-cross-entropy"),
           "accelerate": v.get("accelerate"), "triton": _version("triton") or _version("pytorch-triton"),
           "cuda": torch.version.cuda, "torch_threads": torch.get_num_threads(), "cpu_count": os.cpu_count(),
           "mem_total_gb": round(int(total.split()[0]) / 2**20, 1) if total else None,
           "git": git_commit(), "timestamp": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds")}  # fmt: skip
    if device.type == "cuda":
        env["gpu_memory_gb"] = round(torch.cuda.get_device_properties(device).total_memory / 2**30, 1)
    return env


def header(env: dict, settings: dict) -> list[tuple[str, str]]:
    """(key, value) lines of a run's header: printed first and written at the top of its Markdown."""
    git = env["git"]
    versions = (f"hf_midx {env['hf_midx']}, torch {env['torch']} (CUDA {env.get('cuda')}), transformers "
                f"{env['transformers']}, accelerate {env.get('accelerate')}, triton {env.get('triton')}, faiss "
                f"{env['faiss']}, liger_kernel {env['liger_kernel']}, cut_cross_entropy {env.get('cut_cross_entropy')}")
    return [("device", env["device"]), ("versions", versions),
            ("git commit", f"{git['commit']}{' (local changes)' if git['dirty'] else ''}"),
            ("date", env["timestamp"]), ("settings", json.dumps(settings, default=str))]


def start(name: str, args: argparse.Namespace, device: torch.device, **settings) -> tuple[dict, dict]:
    """A run's environment and settings (the script's, then --quick, --smoke, --seed), printed as its header."""
    env = environment(device)
    settings = {**settings, "quick": args.quick, "smoke": args.smoke, "seed": args.seed}
    print(f"== {name} ==", *(f"{k:11s} : {v}" for k, v in header(env, settings)), sep="\n", flush=True)
    return env, settings


def memory_budget_bytes(device: torch.device, max_gb: float) -> int:
    """Bytes a single case may use: ``max_gb``, capped by 85 % of the free device (or host) memory."""
    avail = _proc("/proc/meminfo", "MemAvailable")  # "N kB"
    free = torch.cuda.mem_get_info(device)[0] if device.type == "cuda" else avail and int(avail.split()[0]) * 1024
    return int(min(max_gb * 2**30, 0.85 * free)) if free else int(max_gb * 2**30)


# ---------------------------------------------------------------------------- inputs
def zipf_counts(v: int, tokens: float = 1e6, generator: torch.Generator | None = None) -> torch.Tensor:
    """(V,) float64 token counts of a Zipf(1) corpus of ``tokens`` tokens (rare classes may count 0).

    With ``generator``, class ids are shuffled, so that frequency is not the id; without, class 0 is the
    most frequent. The one generator of synthetic frequencies for every benchmark.
    """
    p = 1.0 / torch.arange(1, v + 1, dtype=torch.float64)
    counts = (p / p.sum() * tokens).floor()
    return counts if generator is None else counts[torch.randperm(v, generator=generator)]


def zipf_labels(counts: torch.Tensor, n: int, generator: torch.Generator | None = None) -> torch.Tensor:
    """(n,) int64 labels drawn i.i.d. in proportion to ``counts`` + 1 (every class can occur)."""
    return torch.multinomial(counts.float() + 1, n, replacement=True, generator=generator)


# ---------------------------------------------------------------------------- timing, memory: the runner
def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def free_memory(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def quantiles(values: Sequence[float]) -> dict[str, float]:
    """20 / 50 / 80 % quantiles (Liger-Kernel's y_values_20/50/80), mean and min."""
    v = sorted(values)
    qs = statistics.quantiles(v, n=10, method="inclusive") if len(v) > 1 else [v[0]] * 9
    return {"p20": qs[1], "p50": statistics.median(v), "p80": qs[7], "mean": statistics.fmean(v), "min": v[0], "n": len(v)}


def time_op(fn: Callable[[], Any], device: torch.device, *, warmup: int = 1, repeats: int = 5,
            budget_s: float | None = None) -> dict[str, float]:  # fmt: skip
    """Milliseconds per call of ``fn`` (quantiles over ``repeats`` calls after ``warmup`` calls).

    With ``budget_s``, repeats stop once their total passes the budget (at least one timed call). On a CPU, a
    warmup call that alone takes longer than the budget is taken as the single measurement (``"warm": False``);
    on a GPU never, since there the first call of a Triton kernel or a compiled step includes its compilation.
    """
    def once() -> float:
        sync(device)
        t0 = time.perf_counter()
        fn()
        sync(device)
        return time.perf_counter() - t0

    for i in range(warmup):
        dt = once()
        if i == 0 and budget_s is not None and dt >= budget_s and device.type == "cpu":
            return {**quantiles([dt * 1e3]), "warm": False}  # one call fills the budget: it is the measurement
    times: list[float] = []
    while len(times) < max(1, repeats) and (budget_s is None or sum(times) < budget_s * 1e3 or not times):
        times.append(once() * 1e3)
    return {**quantiles(times), "warm": True}


def peak_memory(fn: Callable[[], Any], device: torch.device) -> dict[str, Any]:
    """Peak bytes that one call of ``fn`` allocates above what was allocated before it (see the module doc)."""
    sync(device)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
        before = torch.cuda.memory_allocated(device)
        fn()
        sync(device)
        return {"peak_bytes": int(torch.cuda.max_memory_allocated(device) - before), "method": "cuda.max_memory_allocated"}
    from torch.profiler import ProfilerActivity, profile  # noqa: PLC0415

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True, record_shapes=False) as prof:
        fn()
    events = [e for e in prof.profiler.kineto_results.events() if e.name() == "[memory]" and e.device_type().name == "CPU"]
    running = peak = 0
    for e in sorted(events, key=lambda e: e.start_ns()):
        running += e.nbytes()
        peak = max(peak, running)
    return {"peak_bytes": int(peak), "method": "torch.profiler(profile_memory=True): max running sum of CPU allocations"}


def measure(label: str, fn: Callable[[], Any], device: torch.device, *, warmup: int, repeats: int,
            budget_s: float | None = None, memory: Callable[[], Any] | None | bool = True,
            reset: Callable[[], None] = lambda: None) -> dict:  # fmt: skip
    """One case: ``ms`` (p50), ``ms_p20``, ``ms_p80``, ``repeats``, ``warm`` and, unless ``memory`` is False,
    ``peak_bytes`` of one more call (of ``memory`` when it is a function, else of ``fn``); or ``skipped``
    with the error (an out-of-memory an estimate missed, a kernel's own error), so that the next case runs.
    ``reset`` runs after each part (e.g. clearing gradients). Prints one line."""
    try:
        stats = time_op(fn, device, warmup=warmup, repeats=repeats, budget_s=budget_s)
        reset()
        free_memory(device)
        rec = {"ms": stats["p50"], "ms_p20": stats["p20"], "ms_p80": stats["p80"], "repeats": stats["n"], "warm": stats["warm"]}
        if memory is not False:
            mem = peak_memory(memory if callable(memory) else fn, device)
            rec.update(peak_bytes=mem["peak_bytes"], memory_method=mem["method"])
    except Exception as err:  # noqa: BLE001 (recorded: the comparison goes on)
        rec = {"skipped": f"error: {type(err).__name__}: {(str(err).splitlines() or [''])[0][:160]}"}
    reset()
    free_memory(device)
    print(f"{label:24s} " + (f"skipped: {rec['skipped']}" if "skipped" in rec else f"{fmt_ms(rec['ms']):>10s}"
          + (f"  peak {fmt_bytes(rec['peak_bytes']):>10s}" if "peak_bytes" in rec else "")), flush=True)  # fmt: skip
    return rec


def rows(env: dict, results: Iterable[dict], *, op: str, provider: str, x_name: str, x: str, metrics: dict,
         extra: Sequence[str] = ()) -> list[dict]:  # fmt: skip
    """Liger-style rows of ``results``: one per result and metric (``metrics``: result key -> (metric, unit)),
    with the device, versions and commit; ``provider``, ``x`` and ``extra`` name keys of the result. A time in
    ``ms`` carries its p20 / p80 and repeats."""
    out = []
    for r in results:
        for key, (metric, unit) in metrics.items():
            if r.get(key) is None:
                continue
            row = {"op": op, "provider": r[provider], "metric": metric, "unit": unit, "x_name": x_name, "x_value": r[x],
                   "y_p50": r[key], "device": env["device"], "hf_midx_version": env["hf_midx"],
                   "torch_version": env["torch"], "git_commit": env["git"]["commit"], "timestamp": env["timestamp"],
                   **{k: r[k] for k in extra if k in r}}  # fmt: skip
            if key == "ms":
                row.update(y_p20=r["ms_p20"], y_p80=r["ms_p80"], repeats=r["repeats"])
            out.append(row)
    return out


# ---------------------------------------------------------------------------- tables and files
def fmt_ms(ms: float | None) -> str:
    if ms is None or (isinstance(ms, float) and math.isnan(ms)):
        return "-"
    return f"{ms / 1e3:.1f} s" if ms >= 10_000 else f"{ms:.0f} ms" if ms >= 100 else f"{ms:.2f} ms" if ms >= 1 else f"{ms * 1e3:.0f} us"


def fmt_bytes(n: float | None) -> str:
    if n is None:
        return "-"
    unit, scale = next(((u, s) for u, s in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)) if abs(n) >= s), ("B", 1))
    return f"{int(n)} B" if scale == 1 else f"{n / scale:.2f} {unit}"


def fmt_ratio(x: float | None, digits: int = 1) -> str:
    if x is None or (isinstance(x, float) and not math.isfinite(x)):
        return "-"
    return f"{x:.0f}x" if x >= 100 else f"{x:.{digits}f}x"


def markdown_table(rows: Iterable[dict], columns: Sequence[tuple[str, Any]]) -> str:
    """A GitHub table; ``columns`` are (header, key) pairs, a key being a row's key or a function of the row;
    None (or a missing key) prints as '-'."""
    lines = ["| " + " | ".join(h for h, _ in columns) + " |", "|" + "|".join(" --- " for _ in columns) + "|"]
    for r in rows:
        cells = (key(r) if callable(key) else r.get(key) for _, key in columns)
        lines.append("| " + " | ".join("-" if c is None else str(c) for c in cells) + " |")
    return "\n".join(lines)


def report(title: str, env: dict, settings: dict, *parts: str) -> str:
    """A benchmark's Markdown: the header (device, versions, commit, settings), then ``parts``, one a line."""
    head = [f"- {k}: `{v}`" if k == "settings" else f"- {k}: {v}" for k, v in header(env, settings)]
    return "\n".join([f"# {title}", "", *head, "", *parts])


def write_outputs(out_dir: str | Path, name: str, payload: dict, markdown: str) -> None:
    """Write ``<out>/<name>.json`` and ``<out>/<name>.md``."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    default = lambda o: o.tolist() if isinstance(o, torch.Tensor) else str(o)  # noqa: E731
    (out / f"{name}.json").write_text(json.dumps(payload, indent=2, default=default) + "\n")
    (out / f"{name}.md").write_text(markdown.rstrip() + "\n")
    print(f"wrote {out / name}.json and .md")


def finish(args: argparse.Namespace, name: str, env: dict, settings: dict, markdown: str, plot=None, **fields) -> dict:
    """Write ``<out>/<name>.json`` (the benchmark's name, settings, environment, then ``fields``) and
    ``<out>/<name>.md``, call ``plot()`` unless --no_plots, print the Markdown; returns the JSON payload."""
    payload = {"benchmark": name, "settings": settings, "environment": env, **fields}
    write_outputs(args.out, name, payload, markdown)
    if plot is not None and not args.no_plots:
        plot()
    print(markdown)
    return payload


def pyplot():
    """matplotlib.pyplot on the Agg backend (files only), imported on first use."""
    try:
        import matplotlib  # noqa: PLC0415

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt  # noqa: PLC0415
    except ImportError as err:
        raise ImportError("The benchmark plots need matplotlib: pip install 'hf-midx[bench]' (or pass --no_plots).") from err
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


def plot_panels(out_dir: str | Path, filename: str, panels: Sequence[dict], *, size=(6.0, 4.5), rows: int = 1) -> Path:
    """One PNG of line panels, one line per provider (Liger-Kernel's visualizer), on ``rows`` rows.

    A panel is a dict: ``lines`` ({label: (xs, ys)}), and optionally ``title``, ``xlabel``, ``ylabel``,
    ``xscale`` / ``yscale`` (a name, or (name, options) such as ("log", {"base": 2})), ``style`` (label ->
    plot options, or options for every line; default a marker per point), ``legend`` (font size, 0: none),
    ``ylim`` / ``xlim`` and ``extra`` (a function of the axes: a reference line, single points, bars).
    """
    plt = pyplot()
    cols = math.ceil(len(panels) / rows)
    fig, axes = plt.subplots(rows, cols, figsize=(size[0] * cols, size[1] * rows), squeeze=False)
    for ax, p in zip(axes.flat, panels):
        style = p.get("style", {"marker": "o"})
        for label, (xs, ys) in p["lines"].items():
            ax.plot(xs, ys, label=label, **(style(label) if callable(style) else style))
        for axis in ("x", "y"):
            scale = p.get(axis + "scale")
            if scale:
                name, options = (scale, {}) if isinstance(scale, str) else scale
                getattr(ax, f"set_{axis}scale")(name, **options)
            if p.get(axis + "lim"):
                getattr(ax, f"set_{axis}lim")(*p[axis + "lim"])
        ax.set(xlabel=p.get("xlabel", ""), ylabel=p.get("ylabel", ""), title=p.get("title", ""))
        ax.grid(True, which="both", alpha=0.3)
        if "extra" in p:
            p["extra"](ax)
        if p.get("legend", 7):
            ax.legend(fontsize=p.get("legend", 7))
    return save_figure(fig, out_dir, filename)


# ---------------------------------------------------------------------------- variants and exact kernels
_NO_HEAD, _NO_MIX, _MIX = {"exact_head": 0}, {"mix_weight": 0.0}, {"mix_weight": 0.5, "mix_static": "unigram"}
#: Issue 9's proposals by name: (sampler, MidxConfig fields on top of MidxConfig()'s defaults). Without "head" a name
#: has no exact head, without "mix" no mixture, except "learned" / "shared" (the default plus that change) and
#: "midx-rq-nomix" (earlier results' "midx-rq-head2k-nomix"); written out, so that a later default leaves a name's
#: meaning alone. compare_samplers passes them as recipe flags (variant_flags); others build them (build_variant).
VARIANTS = {
    # midx-rq before issue 9: the paper's estimator as its text writes it, MIDX's uniform last stage alone.
    "midx-rq-paper": ("midx-rq", {"estimator": "exact-positive", "last_stage": "uniform", **_NO_MIX, **_NO_HEAD}),
    # The paper's MIDX (uniform inside a bucket) beside ours (issue 73's centered last stage, the default).
    "midx-rq-uniform": ("midx-rq", {"last_stage": "uniform", **_NO_MIX, **_NO_HEAD}),
    "midx-pq-uniform": ("midx-pq", {"last_stage": "uniform", **_NO_MIX, **_NO_HEAD}),
    "midx-rq-nomix": ("midx-rq", {**_NO_MIX, "exact_head": 2048}), "midx-rq-mix": ("midx-rq", {**_MIX, **_NO_HEAD}),
    "midx-rq-mix-uniform": ("midx-rq", {**_MIX, "mix_static": "uniform", **_NO_HEAD}),
    "midx-rq-frequency": ("midx-rq", {"last_stage": "frequency", **_NO_MIX, **_NO_HEAD}),
    "midx-rq-frequency-mix": ("midx-rq", {"last_stage": "frequency", **_MIX, **_NO_HEAD}),
    "midx-rq-head2k": ("midx-rq", {"exact_head": 2048, **_MIX}),
    "midx-rq-head2k-nomix": ("midx-rq", {"exact_head": 2048, **_NO_MIX}),
    "midx-rq-head2k-frequency-mix": ("midx-rq", {"exact_head": 2048, "last_stage": "frequency", **_MIX}),
    "midx-rq-head512": ("midx-rq", {"exact_head": 512, **_MIX}),
    "midx-rq-head1k": ("midx-rq", {"exact_head": 1024, **_MIX}),
    "midx-rq-head4k": ("midx-rq", {"exact_head": 4096, **_MIX}), "unigram-head2k": ("unigram", {"exact_head": 2048}),
    "unigram-exact-positive": ("unigram", {"estimator": "exact-positive"}),
    # The paper code's unigram: proportional to log(count + 1), flatter than our count-proportional one.
    "unigram-logcount": ("unigram", {"sampler_options": {"unigram_weighting": "log-count", "unigram_smoothing": 0.0},
                                     **_NO_HEAD}),
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
    flags = [arg for key, value in fields.items()
             for arg in (f"--{key}", json.dumps(value) if isinstance(value, dict) else str(value))]  # fmt: skip
    return flags + (["--num_samples", str(pool_size)] if fields.get("negatives") == "shared" else [])


def build_variant(name: str, weight: torch.Tensor, counts: torch.Tensor, **changes):
    """The proposal of ``VARIANTS[name]`` over (V, D) ``weight``, as the head builds it from its MidxConfig.

    ``changes`` are more MidxConfig fields (codebook_size, seed, kmeans_iters); the exact head is the
    ``exact_head`` most frequent classes by ``counts``, at most V/4 of them (a small test vocabulary keeps a tail).
    """
    import hf_midx  # noqa: PLC0415

    sampler, fields = VARIANTS[name]
    config = hf_midx.MidxConfig(sampler=sampler, **fields, **changes)
    head = min(config.exact_head, weight.shape[0] // 4)
    exclude = torch.sort(torch.argsort(counts.double(), descending=True, stable=True)[:head]).values if head else None
    return hf_midx.build_sampler(sampler, weight, class_counts=counts, exclude=exclude, **config.sampler_kwargs())


def build_sampler(name: str, weight, counts, k: int, seed: int, built: dict | None = None, **options):
    """A sampler or variant by name over (V, D) ``weight`` with K = ``k``; ``midx-exact`` reuses midx-rq's index
    from ``built`` when it is there (no second k-means). ``options`` go to the samplers that take them; a sampler
    name is the plain proposal (``mix_weight`` 0, whatever build_sampler's default): the variants name the rest."""
    import hf_midx  # noqa: PLC0415

    if name in VARIANTS:
        return build_variant(name, weight, counts, codebook_size=k, seed=seed, **options)
    if name == "midx-exact" and built and "midx-rq" in built:
        smp = hf_midx.build_sampler(name, weight, codebook_size=k, seed=seed, kmeans_iters=0)
        smp.load_state_dict({**built["midx-rq"].state_dict(), "embeddings": weight})
        return smp
    opts = {key: v for key, v in {"mix_weight": 0.0, **options}.items() if key in hf_midx.SAMPLERS[name].options}
    return hf_midx.build_sampler(name, weight, codebook_size=k, class_counts=counts, seed=seed, **opts)


def exact_kernels(device: torch.device) -> dict[str, Any]:
    """``cce`` / ``liger`` -> Cut Cross-Entropy's ``linear_cross_entropy`` / Liger's fused linear CE class, or
    None where the package is missing or there is no GPU (their kernels are Triton's)."""
    kernels: dict[str, Any] = {"cce": None, "liger": None}
    if device.type != "cuda":
        return kernels
    for key, module, attr, dist in (("cce", "cut_cross_entropy", "linear_cross_entropy", "cut-cross-entropy"),
                                    ("liger", "liger_kernel.transformers", "LigerFusedLinearCrossEntropyLoss",
                                     "liger-kernel")):  # fmt: skip
        try:
            kernels[key] = getattr(__import__(module, fromlist=[attr]), attr)
        except Exception as err:  # noqa: BLE001 (missing, or failing to import against this torch / triton)
            print(f"{module} unusable ({type(err).__name__}: {err}): the {key} case is left out (pip install {dist}).")
    return kernels


# ---------------------------------------------------------------------------- the recipes
def import_recipe(name: str):
    """Import ``recipes/<name>.py`` as ``recipes.<name>``.

    The one ``sys.path`` edit of the benchmarks: a benchmark run as a file has only its own folder on
    ``sys.path``, and the recipes import their siblings as the package ``recipes``, so the repository root
    must be there too; run as ``python -m recipes.benchmarks.x`` (or under pytest) it already is.
    """
    import importlib  # noqa: PLC0415

    if str(REPO_ROOT) not in sys.path:
        sys.path.insert(0, str(REPO_ROOT))
    return importlib.import_module(f"recipes.{name}")


def data_files(data_dir: str | Path | None) -> dict[str, Path] | None:
    """``{"train", "validation", "test"}`` text files of a WikiText-style folder (train.txt, valid.txt, test.txt).

    ``None`` picks ``../shared/data/wikitext-2`` beside the repository when it exists. Returns None when there
    is no such folder; raises SystemExit when a given folder lacks train.txt or valid.txt.
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
