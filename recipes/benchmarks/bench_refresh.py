"""Index refresh cost at a real head shape: first build against warm rebuild, and what it keeps.

The default sampler (``MidxConfig()``: midx-rq, K = 64, exact head 2,048, 50% unigram mixture) over
V = 262,144 classes of D = 640 (the Gemma-3-270M head). The weight is clustered (1,024 centres), as a
trained head is, and moves slightly between the build and the rebuild, as a few hundred steps move
it. Variants: k-means on K * 256 rows then one encode of every row (the default, faiss's rule) or on
all rows (``--all_rows``, the previous behaviour), with torch or faiss. For each: first build, warm
rebuild (seconds), quantization distortion, and the coverage diagnostics of the rebuilt proposal
(``hf_midx.proposal_diagnostics``: KL(P||Q), ESS) on 128 held queries at three softmax temperatures.

Run: ``python recipes/benchmarks/bench_refresh.py --out bench-out [--quick]``; alone on the machine.
"""

from __future__ import annotations

import time

import torch

import hf_midx
from hf_midx import quantizers
from hf_midx.diagnostics import proposal_diagnostics

if __package__:
    from . import common
else:  # run as a file: this folder is first on sys.path
    import common

NAME = "bench_refresh"
SCALES = (0.5, 1.0, 2.0)  # query norms relative to a class embedding's: flat to peaked softmax


def parse_args(argv=None):
    p = common.base_parser(__doc__.splitlines()[0])
    p.add_argument("--vocab", type=int, default=None, help="V (default 262144; quick 65536)")
    p.add_argument("--dim", type=int, default=640, help="D")
    p.add_argument("--backends", nargs="+", default=["torch", "faiss"], choices=list(quantizers.KMEANS_BACKENDS))
    p.add_argument("--variants", nargs="+", default=["subsample", "all-rows"], choices=["subsample", "all-rows"])
    return common.parse(p, argv)


def problem(v: int, d: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    centres = torch.randn(1024, d, generator=g)
    w = (centres[torch.randint(1024, (v,), generator=g)] + 0.6 * torch.randn(v, d, generator=g)) * d**-0.5
    moved = w + 0.05 * torch.randn(v, d, generator=g) * d**-0.5
    counts = common.zipf_counts(v, tokens=1e7)
    queries = w[torch.randint(v, (128,), generator=g)] * d**0.5 / 4
    return w, moved, counts, queries


def run_variant(w, moved, counts, queries, backend: str, variant: str, seed: int) -> dict:
    linear = torch.nn.Linear(w.shape[1], w.shape[0], bias=False)
    with torch.no_grad():
        linear.weight.copy_(w)
    config = hf_midx.MidxConfig(seed=seed, kmeans_backend=backend)
    mppc = quantizers.MAX_POINTS_PER_CENTROID if variant == "subsample" else None
    original = quantizers.train_quantizer.__kwdefaults__["max_points_per_centroid"]
    quantizers.train_quantizer.__kwdefaults__["max_points_per_centroid"] = mppc  # the variant, for this run only
    try:
        t0 = time.perf_counter()
        head = hf_midx.MidxLMHead(linear, config, class_counts=counts)
        first = time.perf_counter() - t0
        with torch.no_grad():
            head.weight.copy_(moved)
        t0 = time.perf_counter()
        head.refresh()
        warm = time.perf_counter() - t0
    finally:
        quantizers.train_quantizer.__kwdefaults__["max_points_per_centroid"] = original
    idx = head.sampler.index
    cand = moved if head.sampler.candidates is None else moved[head.sampler.candidates]
    distortion = quantizers.distortion(idx.quantizer, cand, quantizers.TwoLevelCodes(idx.codebooks, idx.codes))
    rec = {"backend": backend, "variant": variant, "first_build_s": first, "warm_rebuild_s": warm, "distortion": distortion}
    for scale in SCALES:
        d = proposal_diagnostics(head.sampler, queries * scale, head.weight.detach(), num_samples=config.num_samples)
        rec[f"kl_pq@{scale}"] = float(d["kl_pq"])
        rec[f"ess_sampled@{scale}"] = float(d["ess_sampled"])
    return rec


def main(argv=None) -> dict:
    args = parse_args(argv)
    device = common.resolve_device(args.device)
    v = args.vocab or (2048 if args.smoke else 65536 if args.quick else 262144)
    d = 16 if args.smoke else args.dim
    env, settings = common.start(NAME, args, device, V=v, D=d, config="MidxConfig() defaults", scales=SCALES)
    w, moved, counts, queries = problem(v, d, args.seed)
    results = []
    for backend in args.backends:
        if backend == "faiss":
            try:
                import faiss  # noqa: F401, PLC0415
            except ImportError:
                print("faiss: not installed, skipped (pip install 'hf-midx[faiss]')")
                continue
        for variant in args.variants:
            rec = run_variant(w, moved, counts, queries, backend, variant, args.seed)
            results.append(rec)
            print(f"{backend:6s} {variant:10s} first build {rec['first_build_s']:6.2f} s  warm rebuild "
                  f"{rec['warm_rebuild_s']:6.2f} s  distortion {rec['distortion']:.4f}  "
                  + "  ".join(f"KL(P||Q)@{s} {rec[f'kl_pq@{s}']:.3f}" for s in SCALES))  # fmt: skip
    columns = [("k-means", "backend"), ("rows in Lloyd's iterations", "variant"), ("first build (s)", "first_build_s"),
               ("warm rebuild (s)", "warm_rebuild_s"), ("distortion", "distortion")]  # fmt: skip
    columns += [(f"KL(P‖Q), scale {s}", f"kl_pq@{s}") for s in SCALES] + [(f"ESS/M, scale {s}", f"ess_sampled@{s}") for s in SCALES]
    table = [{k: (f"{v:.3f}" if isinstance(v, float) else v) for k, v in r.items()} for r in results]
    return common.finish(args, NAME, env, settings, common.report(NAME, env, settings, common.markdown_table(table, columns)),
                         results=results)  # fmt: skip

if __name__ == "__main__":
    main()
