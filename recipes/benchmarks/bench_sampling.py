"""Sampling time vs number of classes (the paper's "Sampling Time vs #Class"), and index build time.

For every sampler of ``hf_midx.SAMPLERS`` (and, named with ``--samplers``, the variants of issue 9 in
``common.VARIANTS`` that are a proposal alone: the defensive mixtures, the frequency last stage, an exact head), the
time of ``sampler.sample(queries, M)`` (M = 100 draws and their log-probabilities for each of T = 256 and T = 2048
queries) as V grows from 10k to 1M, with K = 64 codewords. The build (k-means, tables) is not in that time; it is
reported on its own, for the torch and the faiss k-means and for residual (rq) and product (pq) quantization.

MIDX should stay nearly flat in V: the report gives t(V_max) / t(V_min) for every sampler (target <= 1.3 for midx-rq
and midx-pq from 10k to 1M), and what a MIDX draw costs per 1,000 queries at V = 33,278 (WikiText-2) and V = 1M.

The exhaustive baselines (sphere, rff, midx-exact) cost O(V D) per query; ``--exhaustive_max_v`` caps their V range
(10,000 in ``--quick``, which also uses 5 k-means iterations).

Embeddings are i.i.d. Gaussian (V, D); queries i.i.d. Gaussian (T, D); unigram counts are Zipf(1).

Run: ``python recipes/benchmarks/bench_sampling.py --out bench-out [--quick] [--device cpu|cuda]``.
"""

from __future__ import annotations

import importlib.util
import time

import torch

import hf_midx
from hf_midx import MidxIndex

if __package__:
    from . import common
else:  # run as a file: this folder is first on sys.path
    import common

NAME = "bench_sampling"
EXHAUSTIVE = ("sphere", "rff", "midx-exact")
WIKITEXT2_V = 33278
FLAT_TARGET = 1.3


def parse_args(argv=None):
    p = common.base_parser(
        __doc__.splitlines()[0], vocab=(None, "default 10000 33278 100000 330000 1000000; quick 10000 33278"),
        queries=[256, 2048], num_samples=100, dim=256, codebook_size=64, kmeans_iters=(None, "default 20; quick 5"),
        samplers=(None, "default: all of hf_midx.SAMPLERS; also " + ", ".join(common.proposal_variants())),
        budget_s=(None, "default 20; quick 1"))  # fmt: skip
    p.add_argument("--exhaustive_max_v", type=int, default=None,
                   help="largest V for sphere/rff/midx-exact (default: all; quick 10000)")  # fmt: skip
    p.add_argument("--build_backends", nargs="+", default=None,
                   help="k-means backends for the build-time table (default: torch, and faiss when installed)")  # fmt: skip
    return common.parse(p, argv)


def _faiss_available() -> bool:
    return importlib.util.find_spec("faiss") is not None


def main(argv=None) -> dict:
    args = parse_args(argv)
    device = common.resolve_device(args.device)
    warmup, repeats = common.repeats_of(args, full=10, quick=1 if args.smoke else 3)  # the paper: 10 trials
    vocab = args.vocab or common.by_size(args, [2000, 5000], [10000, WIKITEXT2_V], [10000, WIKITEXT2_V, 100000, 330000, 1000000])
    if args.smoke and args.queries == [256, 2048]:
        args.queries = [64]
    ex_max = args.exhaustive_max_v or common.by_size(args, 2000, 10000, max(vocab))
    if args.kmeans_iters is None:
        args.kmeans_iters = common.by_size(args, 2, 5, 20)
    if args.budget_s is None:
        args.budget_s = 1.0 if args.quick else 20.0
    samplers = args.samplers or list(hf_midx.SAMPLERS)
    backends = args.build_backends or (["torch", "faiss"] if _faiss_available() else ["torch"])
    if "faiss" in backends and not _faiss_available():
        raise SystemExit("--build_backends faiss needs faiss: pip install 'hf-midx[faiss]'.")
    k, d, m = args.codebook_size, args.dim, args.num_samples
    env, settings = common.start(
        NAME, args, device, vocab=vocab, queries=args.queries, num_samples=m, dim=d, codebook_size=k,
        kmeans_iters=args.kmeans_iters, samplers=samplers, exhaustive_max_v=ex_max, build_backends=backends,
        warmup=warmup, repeats=repeats, budget_s=args.budget_s,
        timed="sampler.sample(queries, M): ids and log Q of M draws per query (build excluded)",
        data="i.i.d. Gaussian embeddings and queries, Zipf(1) unigram counts")  # fmt: skip

    results, builds = [], []
    for v in vocab:
        gen = torch.Generator().manual_seed(args.seed)
        emb = (torch.randn(v, d, generator=gen) * d**-0.5).to(device)
        counts = common.zipf_counts(v, tokens=1e7, generator=gen)
        queries = {t: torch.randn(t, d, generator=gen).to(device) for t in args.queries}
        print(f"\n-- V={v} --")
        built = {}
        for name in samplers:
            if name in EXHAUSTIVE and v > ex_max:
                results += [{"V": v, "T": t, "sampler": name, "skipped": f"O(V) baseline capped at V <= {ex_max}"}
                            for t in args.queries]  # fmt: skip
                continue
            t0 = time.perf_counter()
            built[name] = common.build_sampler(name, emb, counts, k, args.seed, built, kmeans_iters=args.kmeans_iters)
            common.sync(device)
            builds.append({"V": v, "sampler": name, "backend": "torch" if name.startswith("midx") else None,
                           "build_s": time.perf_counter() - t0,
                           "note": "index copied from midx-rq" if name == "midx-exact" else None})  # fmt: skip
            for t in args.queries:
                rec = common.measure(f"{name} T={t}", lambda s=built[name], q=queries[t]: s.sample(q, m), device,
                                     warmup=warmup, repeats=repeats, budget_s=args.budget_s, memory=False)  # fmt: skip
                per_1000 = {"ms_per_1000_queries": rec["ms"] / t * 1000} if "ms" in rec else {}
                results.append({"V": v, "T": t, "sampler": name, **rec, **per_1000})
        del built
        for backend in backends:  # the index build alone: rq vs pq, torch vs faiss k-means
            for quantizer in ("rq", "pq"):
                t0 = time.perf_counter()
                index = MidxIndex.build(emb, k, quantizer=quantizer, kmeans_iters=args.kmeans_iters,
                                        kmeans_backend=backend, seed=args.seed)  # fmt: skip
                common.sync(device)
                builds.append({"V": v, "sampler": f"index-{quantizer}", "quantizer": quantizer, "backend": backend,
                               "provider": f"{quantizer}/{backend}", "build_s": time.perf_counter() - t0,
                               "distortion": index.distortion(emb),
                               "nonempty_buckets": int((index.bucket_counts > 0).sum())})  # fmt: skip
                print(f"index {quantizer}/{backend:5s}: {builds[-1]['build_s']:7.2f} s  distortion {builds[-1]['distortion']:.4f}")
        common.free_memory(device)

    rows = common.rows(env, results, op="sample", provider="sampler", x_name="V", x="V", extra=("T",),
                       metrics={"ms": ("time", "ms")})
    rows += common.rows(env, [b for b in builds if "provider" in b], op="index_build", provider="provider", x_name="V",
                        x="V", metrics={"build_s": ("time", "s")})  # fmt: skip
    summary = summarize(results, args.queries, samplers)
    md = render_markdown(env, settings, results, builds, summary, vocab, args.queries, samplers)
    return common.finish(args, NAME, env, settings, md, lambda: plot(args.out, results, builds, args.queries, samplers, m),
                         rows=rows, results=results, builds=builds, summary=summary)  # fmt: skip


def summarize(results, queries, samplers):
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
                status = "met" if t1 / t0 <= FLAT_TARGET else "missed"
                full_range = v0 <= 10000 and v1 >= 1_000_000
                rec.update(target=f"<= {FLAT_TARGET} from 10k to 1M", status=status if full_range else f"{status} (range {v0}-{v1} only)")
            flat.append(rec)
    per_1000 = []
    for name in ("midx-rq", "midx-pq", "uniform", "unigram"):
        for v in (WIKITEXT2_V, 1_000_000):
            for t in queries:
                r = next((x for x in results if (x["sampler"], x["V"], x["T"]) == (name, v, t) and "ms" in x), None)
                if r:
                    per_1000.append({"sampler": name, "V": v, "T": t, "ms_per_1000_queries": r["ms_per_1000_queries"]})
    return {"flatness": flat, "per_1000_queries": per_1000}


def render_markdown(env, settings, results, builds, summary, vocab, queries, samplers):
    parts = []
    for t in queries:
        parts.append(f"## {settings['num_samples']} draws for each of {t} queries (p50 of repeats)\n")
        table = []
        for name in samplers:
            rec = {"sampler": name}
            for v in vocab:
                r = next((x for x in results if x["sampler"] == name and x["V"] == v and x["T"] == t), None)
                rec[str(v)] = "-" if r is None else ("skipped" if "skipped" in r else common.fmt_ms(r["ms"]))
            f = next((x for x in summary["flatness"] if x["sampler"] == name and x["T"] == t), None)
            rec["ratio"] = common.fmt_ratio(f["ratio"], 2) if f else "-"
            table.append(rec)
        cols = [("sampler", "sampler")] + [(f"V={v}", str(v)) for v in vocab] + [("t(Vmax)/t(Vmin)", "ratio")]
        parts.append(common.markdown_table(table, cols) + "\n")
    if any("skipped" in r for r in results):
        parts.append(f"'skipped': the exhaustive O(V) baselines ran only up to V = {settings['exhaustive_max_v']}.\n")
    parts.append("## Flatness of MIDX (target t(1M)/t(10k) <= 1.3)\n")
    parts.append(common.markdown_table([f for f in summary["flatness"] if "status" in f], [
        ("sampler", "sampler"), ("T", "T"), ("V range", "V_min"), ("to", "V_max"),
        ("ratio", lambda f: f"{f['ratio']:.2f}"), ("status", "status")]) + "\n")  # fmt: skip
    parts.append(f"## Cost per 1,000 queries ({settings['num_samples']} draws each, measured in batches of T)\n")
    parts.append(common.markdown_table(summary["per_1000_queries"], [
        ("sampler", "sampler"), ("V", "V"), ("batch T", "T"),
        ("time per 1,000 queries", lambda p: common.fmt_ms(p["ms_per_1000_queries"]))]) + "\n")  # fmt: skip
    parts.append("## Build time (not in the sampling time)\n")
    parts.append(common.markdown_table([b for b in builds if b["sampler"].startswith("index-")], [
        ("V", "V"), ("quantizer", "quantizer"), ("k-means", "backend"), ("build", lambda b: f"{b['build_s']:.2f} s"),
        ("distortion", lambda b: f"{b['distortion']:.4f}"), ("non-empty buckets", "nonempty_buckets")]))  # fmt: skip
    parts.append("\nfaiss k-means trains on at most 256 K points (its default sampling), then every class is "
                 "assigned in torch; torch k-means uses every class.\n")  # fmt: skip
    parts.append("Sampler construction (what `build_sampler` costs, k-means included for MIDX):\n")
    parts.append(common.markdown_table([b for b in builds if not b["sampler"].startswith("index-")], [
        ("V", "V"), ("sampler", "sampler"), ("build", lambda b: f"{b['build_s']:.2f} s"), ("note", "note")]))  # fmt: skip
    return common.report("Sampling time vs number of classes", env, settings, *parts)


def plot(out_dir, results, builds, queries, samplers, m):
    def style(name):
        return {"marker": "o", "linestyle": "-" if name.startswith("midx") else "--"}

    panels = []
    for t in queries:
        lines = common.lines(results, "V", "ms", "sampler", T=t)
        panels.append({"lines": {n: lines[n] for n in samplers if n in lines}, "style": style, "xscale": "log",
                       "yscale": "log", "xlabel": "V (classes)", "ylabel": "ms per call",
                       "title": f"Sampling time vs #class (T={t}, M={m})"})  # fmt: skip
    common.plot_panels(out_dir, f"{NAME}_time.png", panels)
    idx = [{**b, "key": f"{b['quantizer']} / {b['backend']} k-means"} for b in builds if b["sampler"].startswith("index-")]
    common.plot_panels(out_dir, f"{NAME}_build.png", [{
        "lines": common.lines(idx, "V", "build_s", "key"), "xscale": "log", "yscale": "log", "xlabel": "V (classes)",
        "ylabel": "index build (s)", "title": "Index build time", "legend": 8}])  # fmt: skip


if __name__ == "__main__":
    main()
