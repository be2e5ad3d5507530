"""Sampling time vs number of classes (the paper's "Sampling Time vs #Class"), and index build time.

For every sampler of ``hf_midx.SAMPLERS`` (and, named with ``--samplers``, the MIDX variants of issue 9 in
``common.VARIANTS``: the defensive unigram mixture, the frequency last stage), the time of ``sampler.sample(queries, M)`` (M = 100 draws
and their log-probabilities for each of T = 256 and T = 2048 queries) as V grows from 10k to 1M,
with K = 64 codewords. The build (k-means, tables) is not in that time; it is reported on its own,
for the torch and the faiss k-means and for residual (rq) and product (pq) quantization.

MIDX should stay nearly flat in V: the report gives t(V_max) / t(V_min) for every sampler (target
<= 1.3 for midx-rq and midx-pq from 10k to 1M), and what a MIDX draw costs per 1,000 queries at
V = 33,278 (WikiText-2) and V = 1M.

The exhaustive baselines (sphere, rff, midx-exact) cost O(V D) per query; ``--exhaustive_max_v``
caps their V range (10,000 in ``--quick``, which also uses 5 k-means iterations).

Embeddings are i.i.d. Gaussian (V, D); queries i.i.d. Gaussian (T, D); unigram counts are Zipf(1).

Run: ``python recipes/benchmarks/bench_sampling.py --out bench-out [--quick] [--device cpu|cuda]``.
"""

from __future__ import annotations

import time

import torch

import hf_midx
from hf_midx import MidxIndex

if __package__:
    from . import common
else:  # run as a file: its folder, recipes/benchmarks, is first on sys.path
    import common

NAME = "bench_sampling"
EXHAUSTIVE = ("sphere", "rff", "midx-exact")
WIKITEXT2_V = 33278
FLAT_TARGET = 1.3
def parse_args(argv=None):
    p = common.base_parser(__doc__.splitlines()[0])
    p.add_argument(
        "--vocab",
        type=int,
        nargs="+",
        default=None,
        help="V values (default 10000 33278 100000 330000 1000000; quick 10000 33278)",
    )
    p.add_argument("--queries", type=int, nargs="+", default=[256, 2048], help="T values (queries per call)")
    p.add_argument("--num_samples", type=int, default=100, help="M draws per query")
    p.add_argument("--dim", type=int, default=256, help="D")
    p.add_argument("--codebook_size", type=int, default=64, help="K")
    p.add_argument("--kmeans_iters", type=int, default=None, help="Lloyd iterations per codebook (default 20; quick 5)")
    p.add_argument(
        "--samplers", nargs="+", default=None, help="default: all of hf_midx.SAMPLERS; also common.VARIANTS such as midx-rq-mix, midx-rq-frequency"
    )
    p.add_argument(
        "--exhaustive_max_v",
        type=int,
        default=None,
        help="largest V for sphere/rff/midx-exact (default: all; quick 10000)",
    )
    p.add_argument(
        "--build_backends",
        nargs="+",
        default=None,
        help="k-means backends for the build-time table (default: torch, and faiss when installed)",
    )
    p.add_argument(
        "--budget_s",
        type=float,
        default=None,
        help="stop repeating a case after this many seconds (default 20; quick 1)",
    )
    return common.parse(p, argv)


def _faiss_available() -> bool:
    try:
        import faiss  # noqa: F401, PLC0415
    except ImportError:
        return False
    return True


def main(argv=None) -> dict:
    args = parse_args(argv)
    device = common.resolve_device(args.device)
    warmup, repeats = common.repeats_of(args, full=10, quick=1 if args.smoke else 3)  # the paper: 10 trials
    vocab = args.vocab or (
        [2000, 5000]
        if args.smoke
        else [10000, WIKITEXT2_V]
        if args.quick
        else [10000, WIKITEXT2_V, 100000, 330000, 1000000]
    )
    if args.smoke and args.queries == [256, 2048]:
        args.queries = [64]
    ex_max = args.exhaustive_max_v or (2000 if args.smoke else 10000 if args.quick else max(vocab))
    if args.kmeans_iters is None:
        args.kmeans_iters = 2 if args.smoke else 5 if args.quick else 20
    if args.budget_s is None:
        args.budget_s = 1.0 if args.quick else 20.0
    samplers = args.samplers or list(hf_midx.SAMPLERS)
    backends = args.build_backends or (["torch", "faiss"] if _faiss_available() else ["torch"])
    if "faiss" in backends and not _faiss_available():
        raise SystemExit("--build_backends faiss needs faiss: pip install 'hf-midx[faiss]'.")
    k, d, m = args.codebook_size, args.dim, args.num_samples
    env = common.environment(device)
    settings = common.run_settings(
        args,
        vocab=vocab,
        queries=args.queries,
        num_samples=m,
        dim=d,
        codebook_size=k,
        kmeans_iters=args.kmeans_iters,
        samplers=samplers,
        exhaustive_max_v=ex_max,
        build_backends=backends,
        warmup=warmup,
        repeats=repeats,
        budget_s=args.budget_s,
        timed="sampler.sample(queries, M): ids and log Q of M draws per query (build excluded)",
        data="i.i.d. Gaussian embeddings and queries, Zipf(1) unigram counts",
    )
    common.print_header(NAME, env, settings)

    results, builds, rows = [], [], []
    for v in vocab:
        gen = torch.Generator().manual_seed(args.seed)
        emb = (torch.randn(v, d, generator=gen) * d**-0.5).to(device)
        counts = common.zipf_counts(v, tokens=1e7, generator=gen)
        queries = {t: torch.randn(t, d, generator=gen).to(device) for t in args.queries}
        print(f"\n-- V={v} --")
        built = {}
        for name in samplers:
            if name in EXHAUSTIVE and v > ex_max:
                for t in args.queries:
                    results.append(
                        {"V": v, "T": t, "sampler": name, "skipped": f"O(V) baseline capped at V <= {ex_max}"}
                    )
                continue
            t0 = time.perf_counter()
            built[name] = build(name, emb, counts, k, args, built)
            common.sync(device)
            secs = time.perf_counter() - t0
            builds.append(
                {
                    "V": v,
                    "sampler": name,
                    "backend": "torch" if name.startswith("midx") else None,
                    "build_s": secs,
                    "note": "index copied from midx-rq" if name == "midx-exact" else None,
                }
            )
            for t in args.queries:
                smp, q = built[name], queries[t]
                stats = common.time_op(
                    lambda smp=smp, q=q: smp.sample(q, m),
                    device,
                    warmup=warmup,
                    repeats=repeats,
                    budget_s=args.budget_s,
                )
                results.append(
                    {
                        "V": v,
                        "T": t,
                        "sampler": name,
                        "ms": stats["p50"],
                        "ms_p20": stats["p20"],
                        "ms_p80": stats["p80"],
                        "repeats": stats["n"],
                        "ms_per_1000_queries": stats["p50"] / t * 1000,
                    }
                )
                rows.append(
                    common.row(
                        env,
                        op="sample",
                        provider=name,
                        metric="time",
                        unit="ms",
                        x_name="V",
                        x_value=v,
                        stats=stats,
                        T=t,
                        M=m,
                        K=k,
                        D=d,
                    )
                )
                print(f"{name:12s} T={t:5d}: {common.fmt_ms(stats['p50']):>9s}   (build {secs:.2f} s)")
        del built
        # Index build alone: rq vs pq, torch vs faiss k-means.
        for backend in backends:
            for quantizer in ("rq", "pq"):
                t0 = time.perf_counter()
                index = MidxIndex.build(
                    emb, k, quantizer=quantizer, kmeans_iters=args.kmeans_iters, kmeans_backend=backend, seed=args.seed
                )
                common.sync(device)
                secs = time.perf_counter() - t0
                rec = {
                    "V": v,
                    "quantizer": quantizer,
                    "backend": backend,
                    "build_s": secs,
                    "distortion": index.distortion(emb),
                    "nonempty_buckets": int((index.bucket_counts > 0).sum()),
                }
                builds.append({**rec, "sampler": f"index-{quantizer}"})
                rows.append(
                    common.row(
                        env,
                        op="index_build",
                        provider=f"{quantizer}/{backend}",
                        metric="time",
                        unit="s",
                        x_name="V",
                        x_value=v,
                        value=secs,
                        K=k,
                        D=d,
                        kmeans_iters=args.kmeans_iters,
                    )
                )
                print(f"index {quantizer}/{backend:5s}: {secs:7.2f} s  distortion {rec['distortion']:.4f}")
        common.free_memory(device)

    summary = summarize(results, vocab, args.queries, samplers)
    payload = {
        "benchmark": NAME,
        "settings": settings,
        "environment": env,
        "rows": rows,
        "results": results,
        "builds": builds,
        "summary": summary,
    }
    md = render_markdown(env, settings, results, builds, summary, vocab, args.queries, samplers)
    common.write_outputs(args.out, NAME, payload, md)
    if not args.no_plots:
        plot(args.out, results, builds, args.queries, samplers, m)
    print(md)
    return payload


def build(name, emb, counts, k, args, built):
    if name == "midx-exact" and "midx-rq" in built:
        # Same index as midx-rq (no second k-means): build with 0 iterations, then load rq's tables.
        smp = hf_midx.build_sampler(name, emb, codebook_size=k, seed=args.seed, kmeans_iters=0)
        state = built["midx-rq"].state_dict()
        state["embeddings"] = emb
        smp.load_state_dict(state)
        return smp
    base = common.VARIANTS.get(name, {}).get("sampler", name)
    opts = {"kmeans_iters": args.kmeans_iters} if base.startswith("midx") else {}
    return common.build_sampler(name, emb, counts, codebook_size=k, seed=args.seed, **opts)


def summarize(results, vocab, queries, samplers):
    """Flatness t(V_max)/t(V_min) per sampler and T, and the per-1,000-query cost of MIDX."""
    flat = []
    for name in samplers:
        for t in queries:
            pts = sorted((r["V"], r["ms"]) for r in results if r["sampler"] == name and r["T"] == t and "ms" in r)
            if len(pts) < 2:
                continue
            (v0, t0), (v1, t1) = pts[0], pts[-1]
            rec = {"sampler": name, "T": t, "V_min": v0, "V_max": v1, "ratio": t1 / t0}
            if name in ("midx-rq", "midx-pq"):
                full_range = v0 <= 10000 and v1 >= 1_000_000
                rec["target"] = f"<= {FLAT_TARGET} from 10k to 1M"
                rec["status"] = (
                    ("met" if t1 / t0 <= FLAT_TARGET else "missed")
                    if full_range
                    else (("met" if t1 / t0 <= FLAT_TARGET else "missed") + f" (range {v0}-{v1} only)")
                )
            flat.append(rec)
    per_1000 = []
    for name in ("midx-rq", "midx-pq", "uniform", "unigram"):
        for v in (WIKITEXT2_V, 1_000_000):
            for t in queries:
                r = next(
                    (x for x in results if x["sampler"] == name and x["V"] == v and x["T"] == t and "ms" in x), None
                )
                if r:
                    per_1000.append({"sampler": name, "V": v, "T": t, "ms_per_1000_queries": r["ms_per_1000_queries"]})
    return {"flatness": flat, "per_1000_queries": per_1000}


def render_markdown(env, settings, results, builds, summary, vocab, queries, samplers):
    sections = []
    for t in queries:
        table = []
        for name in samplers:
            rec = {"sampler": name}
            for v in vocab:
                r = next((x for x in results if x["sampler"] == name and x["V"] == v and x["T"] == t), None)
                rec[str(v)] = "-" if r is None else ("skipped" if "skipped" in r else common.fmt_ms(r["ms"]))
            f = next((x for x in summary["flatness"] if x["sampler"] == name and x["T"] == t), None)
            rec["ratio"] = f and f["ratio"]
            table.append(rec)
        columns = [("sampler", "sampler"), *((f"V={v}", str(v)) for v in vocab), ("t(Vmax)/t(Vmin)", "ratio", _ratio)]
        sections.append(f"## {settings['num_samples']} draws for each of {t} queries (p50 of repeats)\n")
        sections.append(common.markdown_table(table, columns))
    if any("skipped" in r for r in results):
        sections.append(f"'skipped': the exhaustive O(V) baselines ran only up to V = {settings['exhaustive_max_v']}.")
    idx = [b for b in builds if b["sampler"].startswith("index-")]
    secs = lambda x: f"{x:.2f} s"  # noqa: E731
    return common.report(
        "Sampling time vs number of classes",
        env,
        settings,
        *sections,
        "## Flatness of MIDX (target t(1M)/t(10k) <= 1.3)\n",
        common.markdown_table(
            [f for f in summary["flatness"] if "status" in f],
            [("sampler", "sampler"), ("T", "T"), ("V range", "V_min"), ("to", "V_max"), ("ratio", "ratio", ".2f"),
             ("status", "status")],
        ),  # fmt: skip
        f"## Cost per 1,000 queries ({settings['num_samples']} draws each, measured in batches of T)\n",
        common.markdown_table(
            summary["per_1000_queries"],
            [("sampler", "sampler"), ("V", "V"), ("batch T", "T"), ("time per 1,000 queries", "ms_per_1000_queries", common.fmt_ms)],
        ),
        "## Build time (not in the sampling time)\n",
        common.markdown_table(
            idx,
            [("V", "V"), ("quantizer", "quantizer"), ("k-means", "backend"), ("build", "build_s", secs),
             ("distortion", "distortion", ".4f"), ("non-empty buckets", "nonempty_buckets")],
        ),  # fmt: skip
        "faiss k-means trains on at most 256 K points (its default sampling), then every class is "
        "assigned in torch; torch k-means uses every class.\n",
        "Sampler construction (what `build_sampler` costs, k-means included for MIDX):\n",
        common.markdown_table(
            [b for b in builds if not b["sampler"].startswith("index-")],
            [("V", "V"), ("sampler", "sampler"), ("build", "build_s", secs), ("note", "note")],
        ),
    )


def _ratio(x: float) -> str:
    return common.fmt_ratio(x, 2)


def plot(out_dir, results, builds, queries, samplers, m):
    common.line_plot(out_dir, f"{NAME}_time.png", [
        dict(
            series={n: [(r["V"], r["ms"]) for r in results if r["sampler"] == n and r["T"] == t and "ms" in r]
                    for n in samplers},
            dashed=[n for n in samplers if not n.startswith("midx")],
            title=f"Sampling time vs #class (T={t}, M={m})", xlabel="V (classes)", ylabel="ms per call",
        )
        for t in queries
    ])  # fmt: skip
    idx = [b for b in builds if b["sampler"].startswith("index-")]
    series = {}
    for b in idx:
        series.setdefault(f"{b['quantizer']} / {b['backend']} k-means", []).append((b["V"], b["build_s"]))
    common.line_plot(out_dir, f"{NAME}_build.png", [
        dict(series=series, title="Index build time", xlabel="V (classes)", ylabel="index build (s)", legend=8)
    ])  # fmt: skip


if __name__ == "__main__":
    main()
