"""A frozen head's step against a trainable one: the default MIDX head, forward + backward, on the same inputs.

LoRA and other adapters leave ``lm_head`` frozen. The head then does no weight-gradient work (issue 55): no (V, D)
weight gradient, no spread of the expected tail's table gradient, nor that table gradient's (T x B x D) product.
This measures what that saves: ``MidxLMHead`` as ``MidxConfig()`` builds it (class counts of a Zipf corpus, so the
exact head is on), hidden states (T, D) that need a gradient, one step = ``head.loss(hidden, labels).backward()``
with the gradients set to None before it (as ``zero_grad`` does), the weight's ``requires_grad`` on or off. The two
cases alternate in pairs (the order swapped every pair, so that drift and caches fall on both), and the speed-up is
the median of the pairs' ratios; a run on a quiet machine is the one that counts (issue 55's target: >= 1.3x at
V = 131,072, D = 256, T = 2,048 on the CPU).

Run: ``python recipes/benchmarks/bench_frozen.py --out bench-out [--pairs 5] [--device cpu]``.
"""

from __future__ import annotations

import statistics
import time

import torch

import hf_midx

if __package__:
    from . import common
else:  # run as a file: this folder is first on sys.path
    import common

NAME = "bench_frozen"
TARGET = 1.3


def parse_args(argv=None):
    p = common.base_parser(__doc__.splitlines()[0], plots=False)
    p.add_argument("--vocab", type=int, default=None, help="V (default 131072; quick 32768; smoke 4096)")
    p.add_argument("--dim", type=int, default=None, help="D (default 256; smoke 16)")
    p.add_argument("--tokens", type=int, default=None, help="T (default 2048; quick 512; smoke 64)")
    p.add_argument("--pairs", type=int, default=None, help="alternating (trainable, frozen) pairs (default 5; quick 3)")
    return common.parse(p, argv)


def head_step(v: int, d: int, t: int, device: torch.device, seed: int):
    """(head, step): the default head at (V, D) and a step of T tokens (hidden states and Zipf labels fixed)."""
    g = torch.Generator().manual_seed(seed)
    counts = common.zipf_counts(v, generator=g)
    linear = torch.nn.Linear(d, v, bias=False)
    torch.nn.init.normal_(linear.weight, std=d**-0.5, generator=g)
    head = hf_midx.MidxLMHead(linear.to(device), hf_midx.MidxConfig(), class_counts=counts)
    hidden = torch.randn(t, d, generator=g).to(device).requires_grad_()
    labels = common.zipf_labels(counts, t, generator=g).to(device)

    def step():
        hidden.grad = head.weight.grad = None
        head.loss(hidden, labels).backward()

    return head, step


def timed(step, device) -> float:
    common.sync(device)
    start = time.perf_counter()
    step()
    common.sync(device)
    return (time.perf_counter() - start) * 1e3


def main(argv=None) -> dict:
    args = parse_args(argv)
    device = common.resolve_device(args.device)
    v = args.vocab or common.by_size(args, 4096, 32768, 131072)
    d = args.dim or common.by_size(args, 16, 256, 256)
    t = args.tokens or common.by_size(args, 64, 512, 2048)
    pairs = args.pairs or common.by_size(args, 2, 3, 5)
    env, settings = common.start(NAME, args, device, vocab=v, dim=d, tokens=t, pairs=pairs,
                                 threads=torch.get_num_threads())
    head, step = head_step(v, d, t, device, args.seed)
    times = {"trainable": [], "frozen": []}

    def run(case: str) -> float:
        head.weight.requires_grad_(case == "trainable")
        return timed(step, device)

    for case in ("trainable", "frozen"):  # warm-up: first calls, caches, allocator
        run(case)
    ratios = []
    for i in range(pairs):
        order = ("trainable", "frozen") if i % 2 == 0 else ("frozen", "trainable")
        got = {case: run(case) for case in order}
        for case, ms in got.items():
            times[case].append(ms)
        ratios.append(got["trainable"] / got["frozen"])
        print(f"pair {i}: trainable {common.fmt_ms(got['trainable'])}, frozen {common.fmt_ms(got['frozen'])}, "
              f"{ratios[-1]:.2f}x", flush=True)
    speedup = statistics.median(ratios)
    results = [{"case": case, "ms": statistics.median(ms), "ms_p20": min(ms), "ms_p80": max(ms), "repeats": len(ms),
                "vocab": v} for case, ms in times.items()]  # fmt: skip
    table = common.markdown_table(results, [("case", "case"), ("median", lambda r: common.fmt_ms(r["ms"])),
                                            ("min", lambda r: common.fmt_ms(r["ms_p20"])),
                                            ("max", lambda r: common.fmt_ms(r["ms_p80"])), ("steps", "repeats")])
    verdict = f"speed-up (median of {pairs} pair ratios): {speedup:.2f}x (target >= {TARGET}x)"
    markdown = common.report(f"Frozen vs trainable head step, V = {v:,}, D = {d}, T = {t:,}", env, settings, table, "",
                             verdict)
    rows = common.rows(env, results, op="head_step", provider="case", x_name="V", x="vocab",
                       metrics={"ms": ("time", "ms")})
    return common.finish(args, NAME, env, settings, markdown, results=results, ratios=ratios, speedup=speedup,
                         rows=rows)


if __name__ == "__main__":
    main()
