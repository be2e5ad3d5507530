"""Output layer + loss, forward and backward: the HF way vs exact chunked CE vs MIDX sampled softmax.

For T tokens with D-dim hidden states and a V-class head, one training step of the head is timed (forward + backward;
the sampler's own drawing included, the index build not) and weighed (peak bytes the step allocates). Cases, all on
the same inputs:

* ``hf``: what a transformers ``*ForCausalLM`` does: full (T, V) logits, upcast to float32, ``F.cross_entropy``;
* ``torch-chunked``: exact CE without the (T, V) logits, ``hf_midx.full_softmax_loss`` (torch's
  ``F.linear_cross_entropy`` with the chunking hf_midx chooses);
* ``torch-chunked-512`` (CPU only): torch's op called directly with 512-token chunks and ``acc_policy="accurate"``, a
  yardstick for that choice (torch's own "auto" chunking picked 8-token chunks for float32 on CPU in torch 2.13, 20x
  slower than ``hf``);
* ``liger``: Liger-Kernel's fused linear CE (only on a GPU with ``liger_kernel`` installed);
* ``cce``: Cut Cross-Entropy's ``linear_cross_entropy`` (only on a GPU with ``cut_cross_entropy`` installed);
* ``midx-default/per-query`` and ``/shared``: the head as ``MidxConfig()`` configures it (sampler, M, K, estimator and
  every other default), per-query and with a shared pool of P; ``.../compiled``: the same step under ``torch.compile``
  (``--compile``); ``midx-default-m<M>/per-query``: the same head with M negatives per token instead of the default's
  (``--default_extra_m``; M = 5 is where the adaptive proposal beats unigram on the synthetic corpus);
* ``<sampler>/per-query``: ``hf_midx.sampled_softmax_loss`` with M negatives per token (M=20, the paper's setting),
  for midx-rq, midx-pq, uniform and unigram;
* ``<sampler>/shared``: the same with one pool of P negatives shared by the batch (P=1024).

Each case is reported as a speed-up and a memory ratio against the HF way measured in the same run, next to the FLOP
ratio (M + 2K) / V (P + 2K for shared; M or P alone for static samplers), the ideal for a sampled head. The index
build is timed separately.

Run: ``python recipes/benchmarks/bench_head.py --out bench-out [--quick] [--device cpu|cuda]``. At the head shapes of
real models (bf16, T = 8192 on a GPU): ``python recipes/benchmarks/bench_head.py --out bench-out --models llama3-8b
gemma2-2b qwen2.5-0.5b gemma3-270m``.
"""

from __future__ import annotations

import time

import torch
import torch.nn.functional as F

import hf_midx

if __package__:
    from . import common
else:  # run as a file: this folder is first on sys.path
    import common

NAME = "bench_head"
SAMPLED = ("midx-rq", "midx-pq", "uniform", "unigram")
#: Cases that compute the exact loss.
EXACT_CASES = ("hf", "torch-chunked", "torch-chunked-512", "liger", "cce")
TARGETS = (  # (V, minimum speed-up vs hf, minimum memory ratio vs hf or None)
    (131072, 10.0, None), (524288, 30.0, 10.0))


def parse_args(argv=None):
    p = common.base_parser(
        __doc__.splitlines()[0], vocab=(None, "default 32768 131072 524288 1048576; quick 8192 32768"), num_samples=20,
        pool_size=1024, codebook_size=64, kmeans_iters=20, budget_s=(None, "default 60; quick 5"),
        samplers=list(SAMPLED), default_extra_m=[])  # fmt: skip
    p.add_argument("--tokens", type=int, default=None, help="T (default 2048; quick 512)")
    p.add_argument("--dims", type=int, nargs="+", default=None, help="D values (default 256; 256 1024 on a GPU)")
    p.add_argument("--models", nargs="+", default=None, choices=list(common.MODEL_SHAPES),
                   help="real head shapes (V, D) to run instead of the --dims x --vocab grid (T default 8192 on a GPU)")  # fmt: skip
    p.add_argument("--compile", action="store_true",
                   help="also time the default MIDX head's step under torch.compile (inductor on a GPU, aot_eager on CPU)")  # fmt: skip
    p.add_argument("--kmeans_backend", default="torch", choices=["torch", "faiss"])
    p.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16"],
                   help="parameter dtype (auto: float32 on CPU, bfloat16 on a GPU)")  # fmt: skip
    p.add_argument("--max_mem_gb", type=float, default=20.0,
                   help="skip a case whose estimated peak exceeds this (or 85%% of free memory)")  # fmt: skip
    p.add_argument("--skip_cases", nargs="+", default=[],
                   help="case labels to leave out, e.g. torch-chunked (slow on CPU: see the module doc)")  # fmt: skip
    return common.parse(p, argv)


def estimate_bytes(case: str, t: int, v: int, d: int, elt: int) -> int:
    """Rough peak of a case, used only to skip what will not fit."""
    params = v * d * elt  # the weight's gradient
    if case == "hf":
        # float32: logits + log-softmax + their gradient, 12 bytes per logit (measured: 3.00 GiB at
        # T=2048, V=131072). bf16 adds the bf16 logits and their bf16 gradient: 16 bytes.
        return int(1.1 * t * v * (12 if elt == 4 else 16)) + params
    return 3 * params + (64 << 20)


def main(argv=None) -> dict:
    args = parse_args(argv)
    device = common.resolve_device(args.device)
    auto = torch.bfloat16 if device.type == "cuda" else torch.float32
    dtype = {"auto": auto, "float32": torch.float32, "bfloat16": torch.bfloat16}[args.dtype]
    warmup, repeats = common.repeats_of(args, full=5, quick=1 if args.smoke else 2)
    t = args.tokens or common.by_size(args, 256, 512, 8192 if args.models and device.type == "cuda" else 2048)
    if args.budget_s is None:
        args.budget_s = 5.0 if args.quick else 60.0
    dims = args.dims or common.by_size(args, [64], [256], [256, 1024] if device.type == "cuda" else [256])
    vocab = args.vocab or common.by_size(args, [4096], [8192, 32768], [32768, 131072, 524288, 1048576])
    if args.smoke:
        args.kmeans_iters = min(args.kmeans_iters, 3)
    shapes = [common.MODEL_SHAPES[name] for name in args.models] if args.models else [(v, d) for d in dims for v in vocab]
    if args.smoke and args.models:
        shapes = [(max(2048, v // 64), max(32, d // 32)) for v, d in shapes]
    kernels = common.exact_kernels(device)
    env, settings = common.start(
        NAME, args, device, tokens=t, shapes=[{"V": v, "D": d} for v, d in shapes], models=args.models,
        num_samples=args.num_samples, pool_size=args.pool_size, codebook_size=args.codebook_size,
        kmeans_iters=args.kmeans_iters, kmeans_backend=args.kmeans_backend, dtype=str(dtype), warmup=warmup,
        repeats=repeats, budget_s=args.budget_s, max_mem_gb=args.max_mem_gb, samplers=args.samplers,
        default_extra_m=args.default_extra_m,
        timed="forward + backward of head and loss (sampling included, index build excluded)",
        memory="peak bytes the step allocates (CPU: torch.profiler memory events; GPU: max_memory_allocated)",
    )  # fmt: skip
    builds, results = [], []
    for v, d in shapes:
        results += run_size(args, device, dtype, t, d, v, warmup, repeats, kernels, builds)
        common.free_memory(device)
    rows = common.rows(env, results, op="head_fwd_bwd", provider="case", x_name="V", x="V", extra=("D", "T"),
                       metrics={"ms": ("time", "ms"), "peak_bytes": ("peak_memory", "bytes")})
    rows += common.rows(env, builds, op="index_build", provider="sampler", x_name="V", x="V", extra=("D", "K"),
                        metrics={"build_s": ("time", "s")})  # fmt: skip
    targets = check_targets(results)
    md = render_markdown(env, settings, results, builds, targets)
    return common.finish(args, NAME, env, settings, md, lambda: plot(args.out, results), rows=rows, results=results,
                         index_build=builds, targets=targets)  # fmt: skip


def _default_head_cases(args, hidden, weight, labels, counts, device):
    """Cases of the head as ``MidxConfig()`` configures it: a ``MidxLMHead`` over this weight and its loss
    (sampler, estimator, exact head and every other default but the seed); and the head's build time."""
    def make_head(config):
        linear = torch.nn.Linear(weight.shape[1], weight.shape[0], bias=False, device="meta")
        linear.weight = weight  # the benchmark's own Parameter: gradients land where the other cases' do
        return hf_midx.MidxLMHead(linear, config, class_counts=counts)

    config = hf_midx.MidxConfig(seed=args.seed)
    t0 = time.perf_counter()
    head = make_head(config)
    common.sync(device)
    build_s = time.perf_counter() - t0
    cases = []
    extra = [("per-query", m) for m in args.default_extra_m if m != config.num_samples]
    for mode, n in (("per-query", config.num_samples), ("shared", args.pool_size), *extra):
        same = mode == config.negatives and n == config.num_samples
        head_n = head if same else make_head(config.replace(negatives=mode, num_samples=n))
        name = "midx-default" if (mode, n) not in extra else f"midx-default-m{n}"
        fn = lambda head_n=head_n: head_n.loss(hidden, labels)  # noqa: E731
        q = hidden.detach().float()
        draw = (lambda s=head_n.sampler, n=n: s.draw(q, n)) if mode == "per-query" else \
            (lambda s=head_n.sampler, n=n: s.draw_shared(q, n))  # fmt: skip
        what = f"MidxConfig() defaults ({config.sampler}), {mode}, {'M' if mode == 'per-query' else 'P'}={n}"
        # FLOPs against the full head: the candidates, the codeword scores, the exact head.
        exact = 0 if head_n.exact_ids is None else head_n.exact_ids.numel()
        ratio = (n + 2 * config.codebook_size + exact) / weight.shape[0]
        cases.append((f"{name}/{mode}", what, ratio, fn, draw))
        if args.compile and name == "midx-default":
            backend = "inductor" if device.type == "cuda" else "aot_eager"
            compiled = torch.compile(fn, fullgraph=True, backend=backend)
            cases.append((f"{name}/{mode}/compiled", f"{what}, torch.compile({backend})", ratio, compiled, draw))
    return cases, build_s


def run_size(args, device, dtype, t, d, v, warmup, repeats, kernels, builds):
    """Every case at one (V, D): its result record (time, memory, ratios, or why it was skipped)."""
    gen = torch.Generator().manual_seed(args.seed)
    counts = common.zipf_counts(v, generator=gen)
    labels = common.zipf_labels(counts, t, gen).to(device)
    weight = torch.nn.Parameter((torch.randn(v, d, generator=gen) * d**-0.5).to(device=device, dtype=dtype))
    hidden = torch.randn(t, d, generator=gen).to(device=device, dtype=dtype).requires_grad_()
    budget = common.memory_budget_bytes(device, args.max_mem_gb)
    print(f"\n-- T={t} D={d} V={v} ({dtype}) --")
    cases = [("hf", "full logits + F.cross_entropy", 0, lambda: F.cross_entropy(F.linear(hidden, weight).float(), labels)),
             ("torch-chunked", "hf_midx.full_softmax_loss (F.linear_cross_entropy)", 0,
              lambda: hf_midx.full_softmax_loss(hidden, weight, labels))]  # fmt: skip
    if device.type == "cpu" and hasattr(torch.nn, "LinearCrossEntropyOptions"):
        # The same torch op with 512-token chunks and fp32 accumulation: a yardstick for full_softmax_loss's chunks.
        tuned = torch.nn.LinearCrossEntropyOptions(acc_policy="accurate", batch_chunk_size=512, chunking_method=None)
        cases.append(("torch-chunked-512", "F.linear_cross_entropy, acc_policy=accurate, batch_chunk_size=512", 0,
                      lambda: F.linear_cross_entropy(hidden, weight, labels, options=tuned)))  # fmt: skip
    if kernels["liger"] is not None:
        liger_ce = kernels["liger"]()
        cases.append(("liger", "LigerFusedLinearCrossEntropyLoss", 0, lambda: liger_ce(weight, hidden, labels)))
    if kernels["cce"] is not None:
        cce = kernels["cce"]
        cases.append(("cce", "cut_cross_entropy.linear_cross_entropy", 0, lambda: cce(hidden, weight, labels)))
    default_cases, build_s = _default_head_cases(args, hidden, weight, labels, counts, device)
    builds.append({"V": v, "D": d, "sampler": "midx-default", "build_s": build_s, "K": None})
    print(f"build midx-default : {build_s:.2f} s")
    cases += default_cases
    k = args.codebook_size
    for name in args.samplers:
        midx = name.startswith("midx")
        opts = {"kmeans_iters": args.kmeans_iters, "kmeans_backend": args.kmeans_backend} if midx else {}
        t0 = time.perf_counter()
        smp = common.build_sampler(name, weight.detach(), counts, k, args.seed, **opts)
        common.sync(device)
        if midx:
            builds.append({"V": v, "D": d, "sampler": name, "build_s": time.perf_counter() - t0, "K": k, **opts})
            print(f"build {name:12s}: {builds[-1]['build_s']:.2f} s")
        for mode, n in (("per-query", args.num_samples), ("shared", args.pool_size)):
            fn = lambda smp=smp, n=n, mode=mode: hf_midx.sampled_softmax_loss(hidden, weight, labels, smp, n, negatives=mode)  # noqa: E731
            draw = (lambda smp=smp, n=n: smp.sample(hidden, n)) if mode == "per-query" else \
                (lambda smp=smp, n=n: smp.sample_shared(hidden, n))  # fmt: skip
            what = f"sampled_softmax_loss {name}, {mode}, {'M' if mode == 'per-query' else 'P'}={n}"
            cases.append((f"{name}/{mode}", what, (n + (2 * k if midx else 0)) / v, fn, draw))

    def clear():
        hidden.grad = weight.grad = None

    out = []
    for label, what, flop_ratio, fn, *draw in cases:
        if label in args.skip_cases:
            continue
        rec = {"V": v, "D": d, "T": t, "case": label, "what": what, "flop_ratio": flop_ratio or None}
        est = estimate_bytes(label, t, v, d, torch.finfo(dtype).bits // 8)
        if est > budget:
            rec["skipped"] = f"memory (needs ~{common.fmt_bytes(est)}, budget {common.fmt_bytes(budget)})"
            print(f"{label:24s} skipped: {rec['skipped']}")
        else:
            rec.update(common.measure(label, lambda fn=fn: (clear(), fn().backward()), device, warmup=warmup,
                                      repeats=repeats, budget_s=args.budget_s, reset=clear))  # fmt: skip
        if draw and "ms" in rec:
            rec["sampling_ms"] = common.time_op(draw[0], device, warmup=1, repeats=repeats)["p50"]
        out.append(rec)
    ref = {c: next((r for r in out if r["case"] == c and "ms" in r), None) for c in ("hf", "torch-chunked")}
    exact = [r for r in out if r["case"] in EXACT_CASES and "ms" in r]
    best = min(exact, key=lambda r: r["ms"]) if exact else None  # the yardstick users compare with
    cce_row = next((r for r in exact if r["case"] == "cce"), None)
    for r in (r for r in out if "ms" in r):
        for key, base in (("hf", ref["hf"]), ("chunked", ref["torch-chunked"])):
            r[f"speedup_vs_{key}"] = base["ms"] / r["ms"] if base else None
            r[f"memory_ratio_vs_{key}"] = base["peak_bytes"] / max(r["peak_bytes"], 1) if base else None
        r["ideal_speedup"] = 1.0 / r["flop_ratio"] if r.get("flop_ratio") else None
        if best is not None:
            r["fastest_exact"], r["speedup_vs_fastest_exact"] = best["case"], best["ms"] / r["ms"]
        if cce_row is not None:
            r["extra_bytes_vs_cce"] = r["peak_bytes"] - cce_row["peak_bytes"]
    return out


def check_targets(results):
    """The mission's targets for the midx head against the HF way (met / missed / not measured)."""
    checks = []
    for v, speed, mem in TARGETS:
        for case in ("midx-rq/per-query", "midx-rq/shared", "midx-pq/per-query", "midx-pq/shared"):
            r = next((x for x in results if x["V"] == v and x["case"] == case and x["D"] == 256), None)
            rec = {"V": v, "case": case, "min_speedup": speed, "min_memory_ratio": mem}
            if r is None or r.get("speedup_vs_hf") is None:
                rec["status"] = "not measured"
            else:
                rec["speedup"], rec["memory_ratio"] = r["speedup_vs_hf"], r["memory_ratio_vs_hf"]
                ok = r["speedup_vs_hf"] >= speed and (mem is None or r["memory_ratio_vs_hf"] >= mem)
                rec["status"] = "met" if ok else "missed"
            checks.append(rec)
    return checks


def render_markdown(env, settings, results, builds, targets):
    def skipped_or(fn):
        return lambda r: fn(r) if "skipped" not in r else None

    parts = ["Speed-up and memory ratio are against the HF way (full logits + `F.cross_entropy`) in the same "
             "run; ideal = V / (M + 2K) (per-query) or V / (P + 2K) (shared), the FLOP ratio a sampled head "
             "could reach.\n"]  # fmt: skip
    for d in sorted({r["D"] for r in results}):
        parts.append(f"## D = {d}\n")
        parts.append(common.markdown_table([x for x in results if x["D"] == d], [
            ("V", "V"), ("case", "case"), ("time (p50)", lambda r: f"skipped: {r['skipped']}" if "skipped" in r
             else common.fmt_ms(r["ms"]) + ("" if r.get("warm", True) else " *")),
            ("of which sampling", skipped_or(lambda r: common.fmt_ms(r.get("sampling_ms")))),
            ("peak memory", skipped_or(lambda r: common.fmt_bytes(r["peak_bytes"]))),
            ("speed-up vs HF", skipped_or(lambda r: common.fmt_ratio(r.get("speedup_vs_hf")))),
            ("memory vs HF", skipped_or(lambda r: common.fmt_ratio(r.get("memory_ratio_vs_hf")))),
            ("speed-up vs chunked", skipped_or(lambda r: common.fmt_ratio(r.get("speedup_vs_chunked")))),
            ("vs fastest exact", skipped_or(lambda r: common.fmt_ratio(r.get("speedup_vs_fastest_exact")))),
            ("ideal (FLOPs)", skipped_or(lambda r: common.fmt_ratio(r.get("ideal_speedup"), 0)))]))  # fmt: skip
        if any(not r.get("warm", True) for r in results if r["D"] == d and "ms" in r):
            parts.append("\n\\* a single call: the first one already took longer than --budget_s.")
        parts.append("")
    if builds:
        parts.append("## Index build (k-means, not in the step time)\n")
        parts.append(common.markdown_table(builds, [
            ("V", "V"), ("D", "D"), ("sampler", "sampler"), ("K", "K"), ("k-means iters", "kmeans_iters"),
            ("backend", "kmeans_backend"), ("build time", lambda b: f"{b['build_s']:.2f} s")]) + "\n")  # fmt: skip
    parts.append("## Targets (D = 256)\n")
    parts.append(common.markdown_table(targets, [
        ("V", "V"), ("case", "case"), ("target", lambda c: f">= {c['min_speedup']:.0f}x faster"
                                       + (f", >= {c['min_memory_ratio']:.0f}x less memory" if c["min_memory_ratio"] else "")),
        ("speed-up", lambda c: common.fmt_ratio(c.get("speedup"))),
        ("memory ratio", lambda c: common.fmt_ratio(c.get("memory_ratio"))), ("status", "status")]))  # fmt: skip
    return common.report("Output layer + loss, forward + backward", env, settings, *parts)


def plot(out_dir, results):
    def style(case):
        return {"marker": "o", "linestyle": "-" if case in ("hf", "torch-chunked", "liger") else "--"}

    for d in sorted({r["D"] for r in results}):
        rows = [{**r, "mib": r["peak_bytes"] / 2**20} for r in results if r["D"] == d and "ms" in r]
        axes = dict(style=style, xscale="log", yscale="log", xlabel="V (classes)")
        common.plot_panels(out_dir, f"{NAME}_D{d}.png", [
            {"lines": common.lines(rows, "V", "ms", "case"), "ylabel": "forward + backward (ms)",
             "title": f"Head + loss, D={d}", **axes},
            {"lines": common.lines(rows, "V", "mib", "case"), "ylabel": "peak memory (MiB)",
             "title": "Peak memory of the step", "legend": 0, **axes}], size=(6, 4.5))  # fmt: skip


if __name__ == "__main__":
    main()
