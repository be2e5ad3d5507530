"""The cost model held against the GPU step we measured: calibrated on commit 1ca3ce9's profiled H200 step,
validated on the eight H200 totals the fit did not see (issue 51, item 1).

``results/h200/profile_head.json`` (and its table in ``profile_head.md``) holds commit 1ca3ce9's head step on an
H200 per ATen op: calls and device time a step, and the host's time in ``cudaLaunchKernel``. This script traces
that same step with today's cost model (``cost_model.trace`` / ``cost_model.cost``: the same op list and bytes),
run in a child process whose ``hf_midx`` is a git worktree of 1ca3ce9 (created if missing), at the profile's
settings (``MidxConfig(seed=0)``, Gemma-3-270M's 262,144 x 640, T = 8,192, bf16; one k-means iteration, which
changes bucket sizes, not launches). It then fits only what the profile determines:

* the device's floor per kernel and the achieved bandwidth of elementwise ops: least squares over the profile's
  elementwise rows (time = kernels x floor + bytes / bandwidth);
* the achieved bandwidth of each other measured class (gathers, atomics, GEMMs, scans): the class's projected
  bytes over its measured time less its kernels' floor;
* the host's cost per launch: the profile's ``cudaLaunchKernel`` CPU time per call.

Classes the profile holds no kernel of (the project's Triton ops, embedding_bag, sort) take the bandwidth of the
measured class nearest in access pattern (stated in the output: an assumption, not a fit). The fitted constants
are ``cost_model.H200_CALIBRATED``'s (the test holds the two equal); the fit never sees a total.

Validation: the same trace at the eight (shape, negatives) cases of ``results/h200/bench_head.json``
(``midx-default/per-query``, M = 100, and ``/shared``, P = 1,024, at the four LLM shapes), projected with the peak
and the calibrated constants beside the measured step time. Then the current default (this tree) at the four
shapes and V = 1,048,576 x 1,024: peak, calibrated, calibrated with the step replayed as a CUDA graph (no host cost
per launch), the exact floor (6 T V D FLOPs at 990 TFLOP/s) and the fastest exact loss measured there.

The H100 rows (``results/h100/``) are not used: they time ``sampled_softmax_loss`` at T = 2,048 of commit 34164c9,
with no profile and no default-head case.

Run: ``python recipes/benchmarks/calibrate_cost_model.py`` (about 20 minutes on 2 busy CPU cores: 10 head builds);
``--old-tree`` names the worktree of 1ca3ce9 (made with ``git worktree add --detach`` if missing).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

if __package__:
    from . import common, cost_model
else:  # run as a file: this folder is first on sys.path
    import common
    import cost_model

NAME = "calibration"
OLD_COMMIT = "1ca3ce9"
RESULTS = common.REPO_ROOT / "recipes/benchmarks/results"
PROFILE_MD = RESULTS / "h200/profile_head.md"
PROFILE_JSON = RESULTS / "h200/profile_head.json"
BENCH_JSON = RESULTS / "h200/bench_head.json"
#: Classes without a kernel in the profile -> the measured class nearest in access pattern.
ANALOGS = {"triton": "gather", "embedding_bag": "gather", "sort": "elementwise", "host_sync": "elementwise"}
#: The exact losses of bench_head.json whose time is the yardstick "fastest exact measured".
EXACT_CASES = ("hf", "torch-chunked", "liger", "cce")
CURRENT_SHAPES = {**{m: common.MODEL_SHAPES[m] for m in cost_model.ISSUE_ORDER}, "v1m-d1024": (1048576, 1024)}


# ============================================================================ the old step's trace (child process)
def trace_old(tree: str, v: int, d: int, t: int, cases: list[tuple[str, int]], kmeans_iters: int) -> dict:
    """{negatives: [Launch as dict]}: the launches of 1ca3ce9's ``MidxLMHead.loss_from_hidden`` step (forward +
    backward) at (V, D, T), bf16, as its ``bench_head.py`` builds it, one head per (negatives, n) of ``cases``.
    Runs where ``hf_midx`` is the old tree's (the caller's child process)."""
    import hf_midx  # noqa: PLC0415

    if not hf_midx.__file__.startswith(tree):
        raise RuntimeError(f"hf_midx is {hf_midx.__file__}, not the tree {tree}")
    gen = torch.Generator().manual_seed(0)
    p = 1.0 / torch.arange(1, v + 1, dtype=torch.float64)  # bench_head.zipf_counts of 1ca3ce9
    counts = (p / p.sum() * 1_000_000).floor()[torch.randperm(v, generator=gen)]
    labels = torch.multinomial(counts.float() + 1, t, replacement=True, generator=gen)
    weight = torch.nn.Parameter((torch.randn(v, d, generator=gen) * d**-0.5).to(torch.bfloat16))
    hidden = torch.randn(t, d, generator=gen).to(torch.bfloat16).requires_grad_()
    config = hf_midx.MidxConfig(seed=0, kmeans_iters=kmeans_iters)
    out = {}
    for negatives, n in cases:
        linear = torch.nn.Linear(d, v, bias=False, device="meta")  # one a head: the head takes its weight over
        linear.weight = weight
        head = hf_midx.MidxLMHead(linear, config.replace(negatives=negatives, num_samples=n), class_counts=counts)
        from torch._subclasses.fake_tensor import FakeTensorMode  # noqa: PLC0415

        mode = FakeTensorMode(allow_non_fake_inputs=True)
        w, h, y = (mode.from_tensor(x) for x in (weight, hidden, labels))

        def step(head=head, w=w, h=h, y=y):
            h.grad = w.grad = None
            head.loss_from_hidden(h, None, shift_labels=y, weight=w).backward()

        with mode:
            step()  # the first call makes the step's lazy state
        out[negatives] = [dataclasses.asdict(cost_model.cost(op)) for op in cost_model.trace(step, mode)]
    return out


def ensure_old_tree(path: Path) -> Path:
    """A git worktree of :data:`OLD_COMMIT` at ``path`` (added, detached, if missing)."""
    if not (path / "hf_midx").is_dir():
        subprocess.run(["git", "-C", str(common.REPO_ROOT), "worktree", "add", "--detach", str(path), OLD_COMMIT],
                       check=True)  # fmt: skip
    return path


def old_launches(tree: Path, v: int, d: int, t: int, cases, kmeans_iters: int) -> dict:
    """:func:`trace_old` in a child process whose ``sys.path`` puts ``tree`` first."""
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "launches.json"
        cmd = [sys.executable, __file__, "--trace-old", str(tree), "--shape", str(v), str(d), str(t),
               "--kmeans_iters", str(kmeans_iters), "--json", str(out),
               "--cases", *(f"{neg}:{n}" for neg, n in cases)]  # fmt: skip
        env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tree), str(Path(__file__).parent)])}
        subprocess.run(cmd, check=True, env=env, cwd=tree)
        return json.loads(out.read_text())


# ============================================================================ the measurements
def profile_rows(md: Path = PROFILE_MD, js: Path = PROFILE_JSON) -> dict:
    """{"ops": {aten op: (calls a step, device us a step)}, "device_us": the step's kernel time, "launch_cpu_us":
    the host's time per cudaLaunchKernel, "launches": cudaLaunchKernel calls a step}, from the profile's torch.profiler
    table (5 steps: every ATen row of it) and its JSON (per step)."""
    text = md.read_text()
    steps = json.loads(js.read_text())["settings"].get("steps", 5)
    ops = {}
    for line in text.splitlines():
        cells = line.split()
        if cells and cells[0].startswith("aten::"):
            cuda, calls = cells[-5], int(cells[-1])
            ops[cells[0][6:]] = (calls / steps, _us(cuda) / steps)
    total = re.search(r"Self CUDA time total: ([\d.]+)(ms|us)", text)
    launch = next(o for o in json.loads(js.read_text())["ops"] if o["op"] == "cudaLaunchKernel")
    return {"ops": ops, "device_us": _us(total.group(1) + total.group(2)) / steps,
            "launch_cpu_us": launch["self_cpu_us_per_step"] / launch["calls"], "launches": launch["calls"]}


def _us(cell: str) -> float:
    value = float(re.sub(r"[a-z]+$", "", cell))
    return value * 1e3 if cell.endswith("ms") else value


def bench_totals(path: Path = BENCH_JSON) -> dict:
    """{(V, D, T, case): ms} of every case of the H200 head benchmark."""
    return {(r["V"], r["D"], r["T"], r["case"]): r["ms"] for r in json.loads(path.read_text())["results"] if "ms" in r}


# ============================================================================ the fit
def _by_op(launches: list[dict]) -> dict:
    """{op: {"kernels", "bytes", "klass", "peak_us"}} of a step's launches."""
    out = {}
    for x in launches:
        o = out.setdefault(x["op"], {"kernels": 0, "launches": 0, "bytes": 0, "klass": x["klass"], "peak_us": 0.0})
        o["kernels"] += x["kernels"]
        o["launches"] += 1
        o["bytes"] += x["bytes"]
        o["peak_us"] += x["us"]
    return out


def fit(launches: list[dict], profile: dict) -> dict:
    """The calibrated machine (``cost_model.H200`` with the fitted constants) and the source of each constant."""
    ops = _by_op(launches)
    measured = {k: v for k, v in profile["ops"].items() if k in ops and v[1] > 0}
    # Elementwise: time = kernels x floor + bytes / bandwidth, least squares over the profile's elementwise rows.
    rows = [(ops[k]["kernels"], ops[k]["bytes"], us) for k, (_, us) in measured.items() if ops[k]["klass"] == "elementwise"]
    a = torch.tensor([[n, b / 1e6] for n, b, _ in rows], dtype=torch.float64)
    y = torch.tensor([us for *_, us in rows], dtype=torch.float64)
    floor_us, us_per_mb = torch.linalg.lstsq(a, y.unsqueeze(1)).solution.squeeze(1).tolist()
    floor_us = max(floor_us, 0.0)
    bandwidth = {"elementwise": 1e6 / us_per_mb * 1e6}
    sources = {"kernel_floor_us": f"least squares over the profile's elementwise rows ({', '.join(k for k in measured if ops[k]['klass'] == 'elementwise')})",
               "class_bandwidth.elementwise": "the same least squares"}  # fmt: skip
    for klass in sorted({ops[k]["klass"] for k in measured} - {"elementwise"}):
        names = [k for k in measured if ops[k]["klass"] == klass]
        nbytes = sum(ops[k]["bytes"] for k in names)
        spent = sum(measured[k][1] for k in names) - floor_us * sum(ops[k]["kernels"] for k in names)
        bandwidth[klass] = nbytes / max(spent, 1.0) * 1e6
        sources[f"class_bandwidth.{klass}"] = f"projected bytes / (measured time - kernels x floor) of {', '.join(names)}"
    for klass, analog in ANALOGS.items():
        bandwidth.setdefault(klass, bandwidth[analog])
        sources[f"class_bandwidth.{klass}"] = f"assumed: no such kernel in the profile; {analog}'s"
    sources["launch_us"] = "the profile's cudaLaunchKernel CPU time per call (under the profiler)"
    machine = {**cost_model.H200, "name": "NVIDIA H200 (calibrated on 1ca3ce9's profile)",
               "launch_us": profile["launch_cpu_us"], "kernel_floor_us": floor_us,
               "class_bandwidth": dict(sorted(bandwidth.items()))}  # fmt: skip
    return {"machine": machine, "sources": sources}


def drifted(fitted: dict, model: dict, rel: float = 0.005) -> list[str]:
    """The constants of ``model`` more than ``rel`` away from ``fitted``'s, as "key: model vs fit"."""
    pairs = [("launch_us", fitted["launch_us"], model["launch_us"]),
             ("kernel_floor_us", fitted["kernel_floor_us"], model["kernel_floor_us"]),
             *((f"class_bandwidth.{k}", x, model["class_bandwidth"].get(k, 0.0)) for k, x in fitted["class_bandwidth"].items())]  # fmt: skip
    return [f"{k}: {m:.4g} vs {f:.4g}" for k, f, m in pairs if abs(m - f) > rel * abs(f)]


def per_op_table(launches: list[dict], profile: dict, machines: dict) -> list[dict]:
    """Per ATen op of the profile: measured calls and device time beside the projected ones (device time: the
    machine's per-launch host cost left out), with the rest of the step as "other"."""
    ops, rows = _by_op(launches), []
    device_only = {k: {**m, "launch_us": 0.0} for k, m in machines.items()}
    for name, (calls, us) in sorted(profile["ops"].items(), key=lambda kv: -kv[1][1]):
        mine = [x for x in launches if x["op"] == name]
        rows.append({"op": name, "class": ops.get(name, {}).get("klass", "-"), "measured calls": calls,
                     "traced calls": sum(x["kernels"] for x in mine), "measured us": us,
                     **{f"{k} us": cost_model.step_ms(mine, m) * 1e3 for k, m in device_only.items()}})  # fmt: skip
    listed = set(profile["ops"])
    rest = [x for x in launches if x["op"] not in listed]
    rows.append({"op": "other", "class": "-", "measured calls": None, "traced calls": sum(x["kernels"] for x in rest),
                 "measured us": profile["device_us"] - sum(us for _, us in profile["ops"].values()),
                 **{f"{k} us": cost_model.step_ms(rest, m) * 1e3 for k, m in device_only.items()}})  # fmt: skip
    rows.append({"op": "total (device)", "class": "-", "measured calls": None,
                 "traced calls": sum(x["kernels"] for x in launches), "measured us": profile["device_us"],
                 **{f"{k} us": cost_model.step_ms(launches, m) * 1e3 for k, m in device_only.items()}})  # fmt: skip
    return rows


def per_class_table(launches: list[dict], profile: dict, machines: dict) -> list[dict]:
    ops = _by_op(launches)
    classes = {}
    for name, (_, us) in profile["ops"].items():
        classes.setdefault(ops.get(name, {}).get("klass", "unmatched"), []).append((name, us))
    rows = []
    for klass, names in sorted(classes.items()):
        mine = [x for x in launches if x["op"] in {n for n, _ in names}]
        rows.append({"class": klass, "ops": ", ".join(n for n, _ in names), "measured us": sum(us for _, us in names),
                     **{f"{k} us": cost_model.step_ms(mine, {**m, "launch_us": 0.0}) * 1e3 for k, m in machines.items()}})  # fmt: skip
    return rows


# ============================================================================ the report
def _validation(tree: Path, machines: dict, kmeans_iters: int, t: int) -> list[dict]:
    totals, rows = bench_totals(), []
    for model in cost_model.ISSUE_ORDER:
        v, d = common.MODEL_SHAPES[model]
        traced = old_launches(tree, v, d, t, [("per-query", 100), ("shared", 1024)], kmeans_iters)
        for negatives, launches in traced.items():
            ms = totals.get((v, d, t, f"midx-default/{negatives}"))
            row = {"model": model, "V": v, "D": d, "negatives": negatives, "launches": len(launches), "measured ms": ms}
            for k, m in machines.items():
                row[f"{k} ms"] = cost_model.step_ms(launches, m)
                row[f"{k} / measured"] = row[f"{k} ms"] / ms if ms else None
            rows.append(row)
            print(f"{model} {negatives}: measured {ms} ms, " + ", ".join(f"{k} {row[f'{k} ms']:.2f} ms" for k in machines), flush=True)
    return rows


def current_default(machines: dict, kmeans_iters: int, t: int) -> list[dict]:
    """The current default (this tree's ``MidxConfig(kernels="fused")``) at :data:`CURRENT_SHAPES`: its projection on
    each machine, the exact floor, the fastest exact loss of bench_head.json at the shape, and the ratios."""
    totals, rows = bench_totals(), []
    for model, (v, d) in CURRENT_SHAPES.items():
        shape = cost_model.project(v, d, t, kmeans_iters=kmeans_iters)
        launches = shape["ops"]
        floor = cost_model.exact_floor_ms(v, d, t)
        exact = {c: totals[(v, d, t, c)] for c in EXACT_CASES if (v, d, t, c) in totals}
        best = min(exact, key=exact.get) if exact else None
        row = {"model": model, "V": v, "D": d, "launches": shape["launches"], "exact floor ms": floor,
               "fastest exact": best, "fastest exact ms": exact.get(best)}  # fmt: skip
        for k, m in machines.items():
            row[f"{k} ms"] = cost_model.step_ms(launches, m)
            row[f"floor / {k}"] = floor / row[f"{k} ms"]
            row[f"fastest exact / {k}"] = exact[best] / row[f"{k} ms"] if best else None
        top = sorted(launches, key=lambda x: -cost_model.step_ms([x], machines["calibrated, graph"]))
        row["costliest (calibrated, graph)"] = [
            f"{x['op']} ({x['where']}): {cost_model.step_ms([x], machines['calibrated, graph']) * 1e3:.0f} us"
            for x in top[:3]]  # fmt: skip
        rows.append(row)
        print(f"current {model}: floor {floor:.2f} ms, " + ", ".join(f"{k} {row[f'{k} ms']:.2f} ms" for k in machines), flush=True)
    return rows


def render(payload: dict) -> str:
    machines = list(payload["machines"])
    fitted = payload["fitted"]
    const_rows = [{"constant": k, "value": _value(k, fitted["machine"]), "source": src} for k, src in fitted["sources"].items()]
    val, cur = payload["validation"], payload["current_default"]
    errors = {k: [r[f"{k} / measured"] for r in val if r[f"{k} / measured"]] for k in machines}
    lines = [
        f"Calibrated on commit {OLD_COMMIT}'s profiled H200 step (`results/h200/profile_head.json`: Gemma-3-270M's "
        "head, 262,144 x 640, T = 8,192, bf16, `MidxConfig(seed=0)`: M = 100 per query, K = 64), traced with "
        "today's cost model in a worktree of that commit. Measured: the profile's per-op device time and the "
        "eight step times of `results/h200/bench_head.json`; projected: everything else.", "",
        "## The fitted constants", "", common.markdown_table(const_rows, [("constant", "constant"), ("value", "value"), ("source", "source")]), "",
        "## Per ATen op of the profiled step (device time, us a step; host launch cost left out)", "",
        common.markdown_table(payload["per_op"], [(k, (lambda r, k=k: _cell(r.get(k)))) for k in payload["per_op"][0]]), "",
        "## Per class", "",
        common.markdown_table(payload["per_class"], [(k, (lambda r, k=k: _cell(r.get(k)))) for k in payload["per_class"][0]]), "",
        "## Validation: the eight H200 totals the fit did not see (step time, launches' host cost included)", "",
        "The Gemma-3-270M per-query case is the profiled configuration, timed in another run (its total never "
        "entered the fit); the other seven differ in shape or negatives.", "",
        common.markdown_table(val, [(k, (lambda r, k=k: _cell(r.get(k)))) for k in val[0]]), "",
        *(f"- {k}: projected / measured {min(e):.2f}-{max(e):.2f} (worst {max(max(e), 1 / min(e)):.2f}x off)"
          for k, e in errors.items() if e), "",
        "## The current default against the exact floor (6 T V D FLOPs at 990 TFLOP/s) and the fastest exact loss measured", "",
        "Projected: every time but the fastest exact loss's (`results/h200/bench_head.json`, H200, T = 8,192, bf16; "
        "none measured at V = 1,048,576). \"graph\": the step replayed as one CUDA graph (no host cost per launch; "
        "each kernel's device floor stays).", "",
        "A ratio a / b here is how many times faster b is than a: floor / calibrated = 3.0x, a step three times "
        "faster than the exact floor.", "",
        common.markdown_table(cur, [(k, (lambda r, k=k: common.fmt_ratio(r.get(k), 1) if " / " in k else _cell(r.get(k))))
                                    for k in cur[0]]), "",  # fmt: skip
        "What keeps the step from 10x under the floor (the costliest launches above): it reads the weight and writes "
        "its gradient, O(V D) bytes each, while the floor's FLOPs grow with T V D. One pass (a read or a write) over "
        "a bf16 (V, D) tensor at the gathers' calibrated 2.4 TB/s costs 2 V D bytes / 2.4 TB/s, 1/60 of the floor "
        "at T = 8,192 (6 T / 990 TFLOP/s against 2 / 2.4 TB/s), so a step 10x under the floor affords about six "
        "such passes, every other launch included; the tail's bucket table (two bags over the weight's rows) and the "
        "weight gradient's kernel (its hidden rows read, the (V, D) gradient written) take three to four.", "",
    ]
    return common.report("The cost model calibrated on the measured H200 step", payload["environment"], payload["settings"], *lines)


def _value(key: str, machine: dict) -> str:
    if key.startswith("class_bandwidth."):
        return f"{machine['class_bandwidth'][key.split('.', 1)[1]] / 1e12:.3f} TB/s"
    return f"{machine[key]:.2f} us"


def _cell(x) -> str:
    if isinstance(x, float):
        return f"{x:,.2f}" if abs(x) < 1000 else f"{x:,.0f}"
    if isinstance(x, list):
        return "; ".join(x)
    return "-" if x is None else str(x)


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--out", default="recipes/benchmarks/results/cost-model-calibration", help="folder for calibration.json and .md")
    p.add_argument("--old-tree", default=str(Path(tempfile.gettempdir()) / f"hf-midx-{OLD_COMMIT}"),
                   help=f"a git worktree of {OLD_COMMIT} (added if missing)")
    p.add_argument("--tokens", type=int, default=8192, help="T")
    p.add_argument("--kmeans_iters", type=int, default=1, help="k-means iterations of each head's index build")
    p.add_argument("--render-only", action="store_true", help="rewrite calibration.md from --out's calibration.json")
    p.add_argument("--trace-old", default=None, help=argparse.SUPPRESS)
    p.add_argument("--shape", type=int, nargs=3, default=None, help=argparse.SUPPRESS)
    p.add_argument("--cases", nargs="+", default=None, help=argparse.SUPPRESS)
    p.add_argument("--json", default=None, help=argparse.SUPPRESS)
    return p.parse_args(argv)


def main(argv=None) -> dict:
    args = parse_args(argv)
    if args.render_only:  # the tables again from a calibration.json (nothing traced)
        payload = json.loads((Path(args.out) / f"{NAME}.json").read_text())
        common.write_outputs(args.out, NAME, payload, render(payload))
        return payload
    if args.trace_old:  # the child: hf_midx is the old tree's
        cases = [(c.split(":")[0], int(c.split(":")[1])) for c in args.cases]
        Path(args.json).write_text(json.dumps(trace_old(args.trace_old, *args.shape, cases, args.kmeans_iters)))
        return {}
    tree = ensure_old_tree(Path(args.old_tree).resolve())
    t = args.tokens
    profile = profile_rows()
    v, d = common.MODEL_SHAPES["gemma3-270m"]
    profiled = old_launches(tree, v, d, t, [("per-query", 100)], args.kmeans_iters)["per-query"]
    fitted = fit(profiled, profile)
    print("fitted:", json.dumps(fitted["machine"], indent=1), flush=True)
    drift = drifted(fitted["machine"], cost_model.H200_CALIBRATED)
    if drift:
        raise SystemExit(f"cost_model.H200_CALIBRATED differs from the fit ({'; '.join(drift)}): set it to the fit above.")
    machines = {"peak": cost_model.H200, "calibrated": cost_model.H200_CALIBRATED,
                "calibrated, graph": cost_model.graph_replayed(cost_model.H200_CALIBRATED)}  # fmt: skip
    env = common.environment(torch.device("cpu"))
    settings = {"old_commit": OLD_COMMIT, "tokens": t, "dtype": "bfloat16", "kmeans_iters": args.kmeans_iters,
                "profile_launches": profile["launches"], "traced_launches": len(profiled)}  # fmt: skip
    payload = {"benchmark": NAME, "settings": settings, "environment": env, "fitted": fitted,
               "machines": machines, "per_op": per_op_table(profiled, profile, machines),
               "per_class": per_class_table(profiled, profile, machines),
               "validation": _validation(tree, machines, args.kmeans_iters, t),
               "current_default": current_default(machines, args.kmeans_iters, t)}  # fmt: skip
    payload["worst_error"] = {k: max(max(r[f"{k} / measured"], 1 / r[f"{k} / measured"]) for r in payload["validation"])
                              for k in ("peak", "calibrated")}  # fmt: skip
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{NAME}.json").write_text(json.dumps(payload, indent=2, default=str) + "\n")  # before the table
    common.write_outputs(out, NAME, payload, render(payload))
    return payload


if __name__ == "__main__":
    main()
