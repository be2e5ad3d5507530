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
def base_parser(description: str, *, timed: bool = True, seed: bool = True, plots: bool = True) -> argparse.ArgumentParser:
    """The flags every benchmark takes; scripts add their own. ``timed=False``: a script that reads runs
    instead of timing (no --quick, --smoke, --device, --warmup, --repeats)."""
    p = argparse.ArgumentParser(description=description, formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--out", default="bench-out", help="output folder for <name>.json, <name>.md and the PNG plots")
    if timed:
        p.add_argument("--quick", action="store_true", help="small sizes and few repeats (about a minute on 2 CPU cores)")
        p.add_argument(
            "--smoke",
            action="store_true",
            help="tiny sizes for the test suite: checks that everything runs and writes its files; implies "
            "--quick; the numbers mean nothing",
        )
        p.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"], help="auto = cuda when available")
        p.add_argument("--warmup", type=int, default=None, help="untimed calls before timing (default: 1, quick: 1)")
        p.add_argument("--repeats", type=int, default=None, help="timed calls per case (default: 5, quick: 2)")
    if seed:
        p.add_argument("--seed", type=int, default=0)
    if plots:
        p.add_argument("--no_plots", action="store_true", help="skip the PNG plots (no matplotlib needed)")
    return p


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
    info: dict[str, Any] = {"commit": None, "dirty": None}
    try:
        info["commit"] = subprocess.run(
            ["git", "rev-parse", "HEAD"], cwd=REPO_ROOT, capture_output=True, text=True, timeout=10, check=True
        ).stdout.strip()
        status = subprocess.run(
            ["git", "status", "--porcelain", "--untracked-files=no"],
            cwd=REPO_ROOT,
            capture_output=True,
            text=True,
            timeout=10,
            check=True,
        ).stdout
        info["dirty"] = bool(status.strip())
    except (OSError, subprocess.SubprocessError):
        pass
    return info


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
        "device_type": device.type,
        "device": device_name(device),
        "python": versions["python"],
        "platform": platform.platform(),
        "torch": versions.get("torch", torch.__version__),
        "transformers": versions.get("transformers"),
        "hf_midx": versions["hf_midx"],
        "faiss": _version("faiss-cpu") or _version("faiss-gpu") or _version("faiss"),
        "liger_kernel": _version("liger-kernel"),
        "cuda": torch.version.cuda,
        "torch_threads": torch.get_num_threads(),
        "cpu_count": os.cpu_count(),
        "mem_total_gb": round(mem_total_bytes() / 2**30, 1) if mem_total_bytes() else None,
        "git": git_commit(),
        "timestamp": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
    }
    if device.type == "cuda":
        env["gpu_memory_gb"] = round(torch.cuda.get_device_properties(device).total_memory / 2**30, 1)
    return env


def print_header(name: str, env: dict, settings: dict) -> None:
    git = env["git"]
    print(f"== {name} ==")
    print(f"device      : {env['device']}")
    print(
        f"versions    : hf_midx {env['hf_midx']}, torch {env['torch']}, transformers {env['transformers']}, "
        f"faiss {env['faiss']}, liger_kernel {env['liger_kernel']}, python {env['python']}"
    )
    print(f"git commit  : {git['commit']}{' (local changes)' if git['dirty'] else ''}")
    print(f"settings    : {json.dumps(settings, default=str)}")
    sys.stdout.flush()


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


# ---------------------------------------------------------------------------- variants
#: Benchmark-only proposals, one name for one configuration in every script: ``MidxConfig`` overrides,
#: the fields left out keep ``MidxConfig()``'s values (a 50 % unigram mixture, an exact head of 2,048,
#: the corrected-positive estimator). A variant that does not want the head says ``exact_head=0``: a name
#: without "head" in it has none, except ``midx-rq-nomix``, kept as the name earlier results use for
#: ``midx-rq-head2k-nomix``. (Before this table, compare_samplers gave ``midx-rq-mix-uniform``,
#: ``midx-rq-frequency`` and ``midx-rq-frequency-mix`` the recipe's exact head; bench_kl gave them none.) compare_samplers passes each override to the recipe as
#: ``--field value``; bench_kl and bench_sampling build the sampler from them (:func:`build_sampler`).
VARIANTS: dict[str, dict[str, Any]] = {
    # midx-rq before issue 9: the positive's logit exact, no defensive mixture, no exact head.
    "midx-rq-paper": dict(sampler="midx-rq", estimator="exact-positive", mix_weight=0.0, exact_head=0),
    "midx-rq-learned": dict(sampler="midx-rq", codebooks="learned"),
    "midx-rq-shared": dict(sampler="midx-rq", negatives="shared"),  # num_samples: the script's --pool_size
    "midx-rq-nomix": dict(sampler="midx-rq", mix_weight=0.0),
    "midx-rq-mix": dict(sampler="midx-rq", exact_head=0),
    "midx-rq-mix-uniform": dict(sampler="midx-rq", mix_static="uniform", exact_head=0),
    "midx-rq-frequency": dict(sampler="midx-rq", last_stage="frequency", mix_weight=0.0, exact_head=0),
    "midx-rq-frequency-mix": dict(sampler="midx-rq", last_stage="frequency", exact_head=0),
    "midx-rq-head2k": dict(sampler="midx-rq", exact_head=2048),
    "midx-rq-head2k-nomix": dict(sampler="midx-rq", mix_weight=0.0, exact_head=2048),
    "midx-rq-head2k-frequency-mix": dict(sampler="midx-rq", last_stage="frequency", exact_head=2048),
    "midx-rq-head512": dict(sampler="midx-rq", exact_head=512),
    "midx-rq-head1k": dict(sampler="midx-rq", exact_head=1024),
    "midx-rq-head4k": dict(sampler="midx-rq", exact_head=4096),
    "unigram-head2k": dict(sampler="unigram", exact_head=2048),
    "unigram-exact-positive": dict(sampler="unigram", estimator="exact-positive"),
}
#: The MidxConfig fields a sampler built on its own takes; the others only matter to a training run.
_SAMPLER_FIELDS = ("sampler", "exact_head", "mix_weight", "mix_static", "last_stage")


def variant_flags(name: str) -> list[str]:
    """The recipe flags of a variant (``--field value``), without ``--sampler``."""
    return [a for k, v in VARIANTS[name].items() if k != "sampler" for a in (f"--{k}", str(v))]


def build_sampler(name: str, weight: torch.Tensor, counts: torch.Tensor, *, codebook_size: int, seed: int, **options):
    """``hf_midx.build_sampler`` for a registered name or a :data:`VARIANTS` entry over the (V, D) ``weight``.

    A variant's exact head is its H most frequent classes by ``counts``, at most V/4 (so that a
    small test vocabulary keeps a tail to sample), excluded from the proposal.
    """
    import hf_midx  # noqa: PLC0415

    if name not in VARIANTS:
        return hf_midx.build_sampler(name, weight, codebook_size=codebook_size, class_counts=counts, seed=seed, **options)
    training_only = sorted(set(VARIANTS[name]) - set(_SAMPLER_FIELDS))
    if training_only:
        raise SystemExit(f"{name} sets {training_only}, which only a training run uses (compare_samplers.py).")
    config = hf_midx.MidxConfig(**VARIANTS[name])
    if config.sampler.startswith("midx"):
        options = {"mix_weight": config.mix_weight, "mix_static": config.mix_static, "last_stage": config.last_stage, **options}
    head = min(config.exact_head, weight.shape[0] // 4)
    exclude = torch.sort(torch.argsort(counts.double(), descending=True, stable=True)[:head]).values if head else None
    return hf_midx.build_sampler(
        config.sampler, weight, codebook_size=codebook_size, class_counts=counts, seed=seed, exclude=exclude, **options
    )


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
        "op": op,
        "provider": provider,
        "metric": metric,
        "unit": unit,
        "x_name": x_name,
        "x_value": x_value,
        "device": env["device"],
        "hf_midx_version": env["hf_midx"],
        "torch_version": env["torch"],
        "git_commit": env["git"]["commit"],
        "timestamp": env["timestamp"],
    }
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


def markdown_table(rows: Iterable[dict], columns: Sequence[tuple]) -> str:
    """A GitHub table; ``columns`` are (header, key) or (header, key, format) triples, ``format`` applied
    to the value (a callable, or a format spec such as ``".2f"``); missing values print as '-'."""
    lines = ["| " + " | ".join(c[0] for c in columns) + " |", "|" + "|".join(" --- " for _ in columns) + "|"]
    for r in rows:
        lines.append("| " + " | ".join(_cell(r.get(c[1]), *c[2:]) for c in columns) + " |")
    return "\n".join(lines)


def _cell(value: Any, fmt: Any = None) -> str:
    if value is None:
        return "-"
    if fmt is None:
        return str(value)
    return fmt(value) if callable(fmt) else format(value, fmt)


def report(title: str, env: dict, settings: dict, *sections: str) -> str:
    """A benchmark's Markdown: the header, then its sections (headings, tables, notes) a blank line apart."""
    return "\n\n".join([header_markdown(title, env, settings), *(s.strip("\n") for s in sections if s)]) + "\n"


def header_markdown(name: str, env: dict, settings: dict) -> str:
    git = env["git"]
    commit = (git["commit"] or "unknown")[:12] + (" (local changes)" if git["dirty"] else "")
    lines = [
        f"# {name}",
        "",
        f"- device: {env['device']}",
        f"- versions: hf_midx {env['hf_midx']}, torch {env['torch']}, transformers {env['transformers']}, "
        f"faiss {env['faiss']}, liger_kernel {env['liger_kernel']}",
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


def subplots(panels: int = 1, width: float = 6, height: float = 4.5):
    """A figure of ``panels`` side by side, each ``width`` x ``height`` inches; returns (fig, list of axes)."""
    fig, axes = pyplot().subplots(1, panels, figsize=(width * panels, height), squeeze=False)
    return fig, list(axes[0])


def style(ax, title: str, xlabel: str, ylabel: str, *, log: str = "", legend: float | None = 7, grid: str = "both"):
    """The one look of every benchmark plot: labels, log axes (``log`` in "x", "y", "xy"), grid, legend."""
    if "x" in log:
        ax.set_xscale("log")
    if "y" in log:
        ax.set_yscale("log")
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    ax.grid(True, which="both", axis=grid if grid in ("x", "y") else "both", alpha=0.3)
    if legend:
        ax.legend(fontsize=legend)


def line_plot(out_dir: str | Path, filename: str, panels: Sequence[dict], *, width: float = 6, height: float = 4.5) -> Path:
    """One PNG of line-plot panels: each panel a dict of ``series`` ({label: [(x, y), ...]}, drawn
    with markers; a label in ``dashed`` is drawn dashed), ``title``, ``xlabel``, ``ylabel`` and
    optionally ``log`` and ``legend`` (see :func:`style`)."""
    fig, axes = subplots(len(panels), width, height)
    for ax, panel in zip(axes, panels):
        for label, points in panel["series"].items():
            if points:
                xs, ys = zip(*sorted(points))
                ax.plot(xs, ys, "--" if label in panel.get("dashed", ()) else "-", marker="o", label=label)
        style(ax, panel["title"], panel["xlabel"], panel["ylabel"], log=panel.get("log", "xy"), legend=panel.get("legend", 7))
    return save_figure(fig, out_dir, filename)


def save_figure(fig, out_dir: str | Path, filename: str) -> Path:
    path = Path(out_dir) / filename
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    pyplot().close(fig)
    print(f"wrote {path}")
    return path


def free_memory(device: torch.device) -> None:
    import gc  # noqa: PLC0415

    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


# ---------------------------------------------------------------------------- the recipes
RECIPES_DIR = REPO_ROOT / "recipes"
DEFAULT_DATA_DIR = REPO_ROOT.parent / "shared" / "data" / "wikitext-2"
SAMPLE_DATA_DIR = RECIPES_DIR / "data" / "wikitext2_sample"


def import_recipe(name: str):
    """Import ``recipes/<name>.py`` as ``recipes.<name>``.

    The one ``sys.path`` edit of the benchmarks: a script run as a file (``python
    recipes/benchmarks/bench_kl.py``) has only its own folder on the path, and a relative import cannot
    climb above the top-level package it was not imported from, so the repository root, which holds
    the ``recipes`` package, goes on the path here (once) when it is not there already.
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
