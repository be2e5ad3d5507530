"""Where sampling bias remains after training: proposals trained to convergence on a bigram model of the chain.

The learning curves of ``recipes/large_vocab.py`` compare proposals long before convergence, where every
sampled softmax trains about as well as the full one. The paper's gap (midx-rq 180.9 against unigram
218.4 on WikiText-2) is measured at convergence, where what remains is the bias of the sampled objective:
its optimum is not the full softmax's, and the closer Q is to the model's softmax, the closer the two
optima. This benchmark reaches that regime on one CPU core: the model is a bigram model of the synthetic
Zipf-Markov chain of ``recipes/synthetic.py`` (input embedding E (V, D), head W (V, D) and bias b (V,):
logits = E[x] W^T + b), trained on fresh pairs (x_t, x_t+1) of the chain, with Adam and a cosine decay to
zero, so that the end of every run is near the optimum of its own objective. The chain is first-order,
so the optimal perplexity of any model is its entropy rate exp(H); a bigram model of rank D can reach it
up to its rank.

The bias b learns the log-frequency of the next word, a large part of every logit. By default
(``--bias folded``) it is the last column of the head, W' = [W, b] (V, D + 1), scored with h' = [E[x], 1]:
the same model and the same Adam steps, but the proposal is built from W', so MIDX sees the whole logit,
as it does for the bias-free heads of current LMs. ``--bias separate`` keeps b out of the index (how
``MidxLMHead`` treats a head with a bias: the proposal sees W only), the setting of the runs before it.
``--tied`` ties E to W, as GPT-2 (the model of ``recipes/large_vocab.py``) ties its embeddings.

Every configuration (``--configs``) trains from the same initial weights on the same pairs (per seed):
``full`` (the exact softmax), or a proposal as ``MidxLMHead`` builds it from a ``MidxConfig`` (the exact
head of the H most frequent classes, M negatives per token, the estimator). The proposal is rebuilt from
the head weight every ``--refresh_every`` steps. The exact test perplexity on held-out pairs is divided
by exp(H), evaluated every ``--eval_every`` steps; the table gives the final ratio per seed, the paired
difference of each proposal to unigram with the same head and estimator, and to the full softmax.

Run: ``python recipes/benchmarks/synthetic_convergence.py --seeds 2 --out results/cpu-synthetic/convergence``
(one CPU core: about 30 minutes per seed at the defaults, most of it the full softmax). Seeds run in separate
processes (one per core, ``--seed S --out DIR_S``) are tabled together with ``--merge DIR_0/... DIR_1/...``:
the held-out pairs do not depend on the seed, so a merged table is the one a single process would give.
"""

from __future__ import annotations

import json
import math
import statistics
import time
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

import hf_midx

if __package__:
    from . import common
else:  # run as a file: this folder is first on sys.path
    import common

ZipfMarkovChain = common.import_recipe("synthetic").ZipfMarkovChain

NAME = "synthetic_convergence"
#: name -> MidxConfig fields (None: the full softmax). H0: no exact head; "paper": exact positive, no mixture;
#: "drop-hits": corrected positive with accidental hits dropped.
CONFIGS = {
    "full": None,
    "unigram H0": {"sampler": "unigram", "exact_head": 0},
    "midx-rq H0": {"sampler": "midx-rq", "exact_head": 0},
    "unigram H0 paper": {"sampler": "unigram", "exact_head": 0, "estimator": "exact-positive"},
    "midx-rq H0 paper": {"sampler": "midx-rq", "exact_head": 0, "estimator": "exact-positive", "mix_weight": 0.0},
    "unigram": {"sampler": "unigram"},
    "midx-rq": {"sampler": "midx-rq"},
    # The corrected-positive estimator with the label's draws dropped: the bias remove_accidental_hits=None avoids.
    "unigram H0 drop-hits": {"sampler": "unigram", "exact_head": 0, "remove_accidental_hits": True},
    "midx-rq H0 drop-hits": {"sampler": "midx-rq", "exact_head": 0, "remove_accidental_hits": True},
}
EVAL_CHUNK = 4096
#: Settings that must agree for runs to share a table (--merge).
MERGE_KEYS = ("vocab_size", "dim", "steps", "batch", "lr", "num_samples", "codebook_size", "refresh_every",
              "eval_pairs", "tied")  # fmt: skip
#: What every run entry holds (--merge refuses a file whose runs lack one).
RUN_KEYS = frozenset({"config", "seed", "ratio", "seconds", "curve"})
#: --bias changes only the runs whose proposal is built from the head weight (MIDX): the full softmax and
#: unigram train identically with either, so --merge checks it on those runs only. Outputs written before
#: --bias existed kept the bias out of the index.
BIAS_BEFORE_THE_FLAG = "separate"


def parse_args(argv=None):
    p = common.base_parser(__doc__.split("\n\n")[0])
    p.add_argument("--configs", nargs="+", default=list(CONFIGS), choices=list(CONFIGS),
                   help="what to train: 'full', or a proposal (H0: no exact head; 'paper': the paper's estimator, "
                   "exact positive, and no mixture; 'drop-hits': accidental hits dropped from the corrected-positive "
                   "estimator; otherwise MidxConfig's defaults: exact head 2,048, mixture 0.5)")
    p.add_argument("--seeds", type=int, default=1, help="seeds --seed .. --seed + N - 1 (init, pairs and draws)")
    p.add_argument("--vocab_size", type=int, default=None, help="V of the chain (default 10,000; quick 5,000)")
    p.add_argument("--dim", type=int, default=32, help="D: the rank of the bigram model")
    p.add_argument("--steps", type=int, default=None, help="training steps (default 4,000; quick 600)")
    p.add_argument("--batch", type=int, default=1024, help="pairs per step, fresh from the chain")
    p.add_argument("--lr", type=float, default=1e-2,
                   help="Adam's peak learning rate (warm-up over min(100, steps / 10) steps, then cosine to 0)")
    p.add_argument("--num_samples", type=int, default=20, help="M negatives per token (the paper's 20)")
    p.add_argument("--codebook_size", type=int, default=32, help="K of midx-rq (the paper's 32)")
    p.add_argument("--refresh_every", type=int, default=100, help="rebuild the proposal from W every this many steps")
    p.add_argument("--eval_every", type=int, default=None, help="evaluate every this many steps (default steps / 16)")
    p.add_argument("--eval_pairs", type=int, default=None, help="held-out pairs (default 32,768; quick 8,192)")
    p.add_argument("--bias", choices=("folded", "separate"), default="folded",
                   help="'folded': b is the head's last column, so the proposal's index sees the whole logit (as with "
                   "a bias-free LM head); 'separate': the proposal is built from W alone (runs before this flag)")
    p.add_argument("--tied", action="store_true",
                   help="tie the input embedding to the head's weight (E = W, as GPT-2's tie_word_embeddings)")
    p.add_argument("--merge", nargs="+", default=None, metavar="JSON",
                   help="train nothing: table the runs of these synthetic_convergence.json files together (for "
                   "example seeds run in parallel processes), those of --configs only; their settings must agree")
    args = common.parse(p, argv)
    args.vocab_size = args.vocab_size or common.by_size(args, 500, 5_000, 10_000)
    args.steps = args.steps or common.by_size(args, 40, 600, 4_000)
    args.eval_pairs = args.eval_pairs or common.by_size(args, 1_024, 8_192, 32_768)
    args.eval_every = args.eval_every or max(1, args.steps // 16)
    if args.smoke:
        args.dim, args.batch = min(args.dim, 16), min(args.batch, 256)
    for name in ("seeds", "vocab_size", "dim", "steps", "batch", "num_samples", "codebook_size", "refresh_every",
                 "eval_every", "eval_pairs"):  # fmt: skip
        if getattr(args, name) < 1:
            p.error(f"--{name} must be at least 1, got {getattr(args, name)}")
    if args.num_samples >= args.vocab_size // 2:
        p.error(f"--num_samples {args.num_samples} must be below half of --vocab_size {args.vocab_size}")
    if not args.lr > 0:
        p.error(f"--lr must be positive, got {args.lr}")
    return args


def pairs(chain: ZipfMarkovChain, n: int, seed: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """(n,) int64 words x_t and (n,) int64 next words x_t+1, from the chain started at its stationary mu."""
    block = torch.from_numpy(chain.sample_blocks(n, 2, seed=seed))
    return block[:, 0].contiguous(), block[:, 1].contiguous()


def test_nll(emb: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, x: torch.Tensor,
             y: torch.Tensor) -> float:  # fmt: skip
    """Exact mean cross-entropy (nats) of the (N,) pairs, in chunks (no (N, V) tensor). ``weight`` is (V, D)
    with a (V,) ``bias``, or (V, D + 1) with the bias as its last column and ``bias`` None."""
    total = 0.0
    with torch.no_grad():
        for i in range(0, x.shape[0], EVAL_CHUNK):
            logits = features(emb, x[i : i + EVAL_CHUNK], weight) @ weight.T
            if bias is not None:
                logits = logits + bias
            total += float(F.cross_entropy(logits, y[i : i + EVAL_CHUNK], reduction="sum"))
    return total / x.shape[0]


def features(emb: torch.Tensor, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """(N, D) rows E[x], or (N, D + 1) rows [E[x], 1] when the bias is the last column of ``weight``."""
    h = emb[x]
    if weight.shape[1] == h.shape[1]:
        return h
    return torch.cat([h, h.new_ones(h.shape[0], 1)], dim=1)


def proposal(config: dict, weight: torch.Tensor, counts: torch.Tensor, seed: int, args) -> tuple:
    """(sampler, exact_ids, MidxConfig) of a configuration, as MidxLMHead builds them."""
    cfg = hf_midx.MidxConfig(**config, num_samples=args.num_samples, codebook_size=args.codebook_size,
                             seed=seed).for_vocabulary(weight.shape[0])  # fmt: skip
    exact = None
    if cfg.exact_head:
        exact = torch.sort(torch.argsort(counts, descending=True, stable=True)[: cfg.exact_head]).values
    sampler = hf_midx.build_sampler(cfg.sampler, weight, class_counts=counts, exclude=exact, **cfg.sampler_kwargs())
    return sampler, exact, cfg


def train(name: str, seed: int, chain: ZipfMarkovChain, counts: torch.Tensor, held_out, optimum: float,
          device: torch.device, args) -> dict:  # fmt: skip
    """One configuration, one seed: the curve of test perplexity / optimum against steps and seconds."""
    v, d = args.vocab_size, args.dim
    gen = torch.Generator().manual_seed(seed)
    emb = (torch.randn(v, d, generator=gen) * 0.1).to(device).requires_grad_()
    weight = torch.randn(v, d, generator=gen) * 0.1
    if args.bias == "folded":  # the same start and, Adam being per coordinate, the same steps as "separate"
        weight = torch.cat([weight, torch.zeros(v, 1)], dim=1).to(device).requires_grad_()
        bias = None
        params = [emb, weight]
    else:
        weight = weight.to(device).requires_grad_()
        bias = torch.zeros(v, device=device, requires_grad=True)
        params = [emb, weight, bias]
    if args.tied:  # GPT-2's tie_word_embeddings: the input embedding is the head's weight (its first D columns)
        params.remove(emb)
        emb = None

    def inputs() -> torch.Tensor:  # (V, D) input embedding
        return weight[:, :d] if emb is None else emb

    opt = torch.optim.Adam(params, lr=args.lr)
    warmup = min(100, args.steps // 10)

    def lr_at(step: int) -> float:  # step in [0, steps)
        if step < warmup:
            return (step + 1) / warmup
        return 0.5 * (1 + math.cos(math.pi * (step - warmup) / max(1, args.steps - warmup)))

    sched = torch.optim.lr_scheduler.LambdaLR(opt, lr_at)
    config = CONFIGS[name]
    sampler = exact = cfg = None
    if config is not None:
        sampler, exact, cfg = proposal(config, weight.detach(), counts, seed, args)
    x_test, y_test = held_out
    curve = [{"step": 0, "seconds": 0.0, "ratio": math.exp(test_nll(inputs(), weight, bias, x_test, y_test)) / optimum}]
    seconds = 0.0
    for step in range(args.steps):
        started = time.perf_counter()
        if sampler is not None and step and step % args.refresh_every == 0:
            sampler.refresh(weight.detach())
        x, y = pairs(chain, args.batch, [seed, 1, step])  # the same pairs for every configuration
        x, y = x.to(device), y.to(device)
        h = features(inputs(), x, weight)
        if sampler is None:
            logits = h @ weight.T
            loss = F.cross_entropy(logits if bias is None else logits + bias, y)
        else:
            loss = hf_midx.sampled_softmax_loss(
                h, weight, y, sampler, cfg.num_samples, bias=bias, estimator=cfg.estimator, exact_ids=exact,
                remove_accidental_hits=cfg.remove_accidental_hits, check_labels=False,
            )  # fmt: skip
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        sched.step()
        common.sync(device)
        seconds += time.perf_counter() - started
        if (step + 1) % args.eval_every == 0 or step + 1 == args.steps:
            nll = test_nll(inputs(), weight, bias, x_test, y_test)
            if not math.isfinite(nll):
                raise SystemExit(f"{name}, seed {seed}: the test loss is {nll} at step {step + 1}.")
            curve.append({"step": step + 1, "seconds": seconds, "ratio": math.exp(nll) / optimum})
    print(f"  {name:18s} seed {seed}: ratio {curve[-1]['ratio']:.4f} ({seconds:.0f} s)", flush=True)
    return {"config": name, "seed": seed, "ratio": curve[-1]["ratio"], "seconds": seconds,
            "best_ratio": min(p["ratio"] for p in curve), "curve": curve}  # fmt: skip


def summarize(runs: list[dict]) -> list[dict]:
    """Per configuration: final ratios per seed, mean +- sd, paired % to unigram (same H and estimator) and full."""
    by: dict[str, dict[int, dict]] = {}
    for r in runs:
        by.setdefault(r["config"], {})[r["seed"]] = r
    rows = []
    for name in (c for c in CONFIGS if c in by):
        seeds = sorted(by[name])
        ratios = [by[name][s]["ratio"] for s in seeds]
        row = {"config": name, "seeds": seeds, "ratio": ratios, "mean": statistics.fmean(ratios),
               "sd": statistics.stdev(ratios) if len(ratios) > 1 else None,
               "seconds": statistics.fmean(by[name][s]["seconds"] for s in seeds)}  # fmt: skip
        for key, ref in (("unigram", name.replace("midx-rq", "unigram")), ("full", "full")):
            if ref == name or ref not in by:
                continue
            diffs = [100 * (by[name][s]["ratio"] / by[ref][s]["ratio"] - 1) for s in seeds if s in by[ref]]
            if diffs:
                row[f"vs_{key}_pct"] = diffs
                row[f"vs_{key}_mean"] = statistics.fmean(diffs)
                row[f"vs_{key}_sd"] = statistics.stdev(diffs) if len(diffs) > 1 else None
        rows.append(row)
    return rows


def markdown(rows: list[dict], settings: dict, env: dict, optimum: float, oracle: float) -> str:
    def paired(key):
        def cell(r):
            if f"vs_{key}_pct" not in r:
                return "-"
            sd = r[f"vs_{key}_sd"]
            mean = "" if sd is None else f" (mean {r[f'vs_{key}_mean']:+.2f}% +- {sd:.2f})"
            return ", ".join(f"{x:+.2f}%" for x in r[f"vs_{key}_pct"]) + mean

        return cell

    columns = [
        ("configuration", "config"), ("seeds", lambda r: ", ".join(map(str, r["seeds"]))),
        ("test ppl / optimum, per seed", lambda r: ", ".join(f"{x:.4f}" for x in r["ratio"])),
        ("mean +- sd", lambda r: f"{r['mean']:.4f}" + ("" if r["sd"] is None else f" +- {r['sd']:.4f}")),
        ("vs unigram (same H, estimator), paired", paired("unigram")), ("vs full, paired", paired("full")),
        ("training s", lambda r: f"{r['seconds']:.0f}"),
    ]  # fmt: skip
    note = (
        f"Optimal perplexity exp(H) = {optimum:.2f}; the true chain scores {oracle:.2f} on the held-out pairs "
        f"({oracle / optimum:.4f} x). Bigram model of rank D = {settings['dim']}, {settings['steps']:,} steps of "
        f"{settings['batch']:,} fresh pairs, Adam (peak lr {settings['lr']:g}, cosine to 0); M = "
        f"{settings['num_samples']}, K = {settings['codebook_size']}, refresh every {settings['refresh_every']} steps"
        + ("; E tied to W" if settings["tied"] else "") + "; the bias "
        + ("folded into the head, so the index sees it." if settings["bias"] == "folded" else "kept out of the index.")
    )
    return common.report(f"{NAME}: V = {settings['vocab_size']:,}", env, settings, note, "",
                         common.markdown_table(rows, columns))  # fmt: skip


def plot(runs: list[dict], args) -> None:
    plt = common.pyplot()
    fig, axes = plt.subplots(1, 2, figsize=(13, 4.8))
    colors = {name: f"C{i}" for i, name in enumerate(CONFIGS)}
    for ax, x, xlabel in ((axes[0], "step", "training step"), (axes[1], "seconds", "training wall-clock, s")):
        labelled = set()
        for r in runs:
            label = None if r["config"] in labelled else r["config"]
            labelled.add(r["config"])
            ax.plot([p[x] for p in r["curve"]], [p["ratio"] for p in r["curve"]], color=colors[r["config"]],
                    alpha=0.8, label=label)  # fmt: skip
        ax.set(xlabel=xlabel, ylabel="test perplexity / optimum", yscale="log")
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=8)
    # The end of the curves, where the bias shows: zoom on the last half of the steps, on the runs that end
    # within 1.5x of the best (a diverging estimator would flatten the others).
    best = min(r["ratio"] for r in runs)
    tail = [p["ratio"] for r in runs if r["ratio"] < 1.5 * best for p in r["curve"] if p["step"] >= args.steps // 2]
    if tail:
        axes[0].set_ylim(min(tail) * 0.995, max(tail) * 1.005)
        axes[0].set_xlim(args.steps // 2, args.steps)
    tied = ", E tied to W" if args.tied else ""
    fig.suptitle(f"bigram model of the synthetic chain, V = {args.vocab_size:,}, D = {args.dim}, "
                 f"bias {args.bias}{tied}")  # fmt: skip
    common.save_figure(fig, args.out, f"{NAME}.png")


def reads_index(name: str) -> bool:
    """Whether configuration ``name`` builds its proposal from the head weight (so --bias changes it)."""
    return CONFIGS[name] is not None and CONFIGS[name]["sampler"].startswith("midx")


def load_runs(paths: list[str], configs: list[str]) -> tuple[list[dict], dict, dict, list[dict]]:
    """The runs of ``configs`` in several outputs of this benchmark, checked to share a chain and training
    settings (and, for the MIDX runs, --bias); returns (runs, the first file's settings with the MIDX runs'
    bias, its environment, one source entry per file)."""
    runs, sources, first, seen, index_bias = [], [], None, {}, None
    for path in paths:
        try:
            payload = json.loads(Path(path).read_text())
            settings, env, file_runs = payload["settings"], payload["environment"], payload["runs"]
            settings.setdefault("bias", BIAS_BEFORE_THE_FLAG)
            settings.setdefault("tied", False)
        except (OSError, ValueError, KeyError, TypeError) as err:
            raise SystemExit(f"--merge {path}: not a {NAME}.json output ({err}).") from None
        if payload.get("benchmark") != NAME:
            raise SystemExit(f"--merge {path}: written by {payload.get('benchmark')!r}, not {NAME}.")
        if first is None:
            first = (settings, env)
        for key in MERGE_KEYS:
            if settings.get(key) != first[0].get(key):
                raise SystemExit(f"--merge {path}: {key} = {settings.get(key)} where {paths[0]} has "
                                 f"{first[0].get(key)}; only runs of the same settings share a table.")  # fmt: skip
        kept = []
        for r in file_runs:
            if not isinstance(r, dict) or not RUN_KEYS <= r.keys():
                raise SystemExit(f"--merge {path}: a run without {', '.join(sorted(RUN_KEYS))}: {str(r)[:80]}.")
            if r["config"] not in CONFIGS:
                raise SystemExit(f"--merge {path}: unknown configuration {r['config']!r}.")
            if r["config"] not in configs:
                continue
            if reads_index(r["config"]):
                if index_bias is None:
                    index_bias = (settings["bias"], path)
                elif settings["bias"] != index_bias[0]:
                    raise SystemExit(f"--merge {path}: bias = {settings['bias']} where {index_bias[1]} has "
                                     f"{index_bias[0]}; MIDX runs of both settings do not share a table.")  # fmt: skip
            key = (r["config"], r["seed"])
            if key in seen:
                raise SystemExit(f"--merge: {r['config']} seed {r['seed']} is in both {seen[key]} and {path}.")
            seen[key] = path
            kept.append(r)
        runs += kept
        git = env.get("git", {})
        seeds = sorted({r["seed"] for r in kept})
        sources.append({"file": str(path), "commit": git.get("commit"), "dirty": git.get("dirty"),
                        "timestamp": env.get("timestamp"), "seeds": seeds})  # fmt: skip
    trained = first[0] if index_bias is None else {**first[0], "bias": index_bias[0]}
    return runs, trained, first[1], sources


def main(argv=None) -> dict:
    args = parse_args(argv)
    device = common.resolve_device(args.device)
    if args.merge:
        runs, trained, env, sources = load_runs(args.merge, args.configs)
        if not runs:
            raise SystemExit(f"--merge: none of {args.merge} holds a run of {args.configs}.")
        for key in (*MERGE_KEYS, "eval_every", "bias"):  # the table's note and the plot describe the merged runs
            setattr(args, key, trained[key])
        settings = {**trained, "configs": [c for c in CONFIGS if any(r["config"] == c for r in runs)],
                    "seeds": len({r["seed"] for r in runs}), "merged_from": sources}  # fmt: skip
        common.print_header(NAME, env, settings)
    else:
        env, settings = common.start(NAME, args, device, **{k: getattr(args, k) for k in (
            "configs", "seeds", "vocab_size", "dim", "steps", "batch", "lr", "num_samples", "codebook_size",
            "refresh_every", "eval_every", "eval_pairs", "bias", "tied")})  # fmt: skip
    chain = ZipfMarkovChain(args.vocab_size, seed=0)
    optimum = chain.entropy_rate_perplexity()
    # The same held-out pairs for every seed, so that seeds run in separate processes can share a table.
    held_out = pairs(chain, args.eval_pairs, [10_000, 2])
    oracle = math.exp(-float(chain.log_prob(torch.stack(held_out, 1).numpy()).mean()))
    if args.merge:
        runs.sort(key=lambda r: (r["seed"], list(CONFIGS).index(r["config"])))
        rows = summarize(runs)
        md = markdown(rows, settings, env, optimum, oracle)
    else:
        held_out = tuple(t.to(device) for t in held_out)
        # The proposal's class counts: what the run's pairs give in expectation (mu times the tokens seen).
        counts = torch.from_numpy(np.round(chain.mu * args.steps * args.batch)).to(device, torch.int64)
        runs = []
        for seed in range(args.seed, args.seed + args.seeds):
            runs += [train(name, seed, chain, counts, held_out, optimum, device, args) for name in args.configs]
            rows = summarize(runs)
            md = markdown(rows, settings, env, optimum, oracle)
            if seed + 1 < args.seed + args.seeds:  # a long run keeps the seeds done so far if it is stopped
                common.write_outputs(args.out, NAME, {"benchmark": NAME, "settings": settings, "environment": env,
                                                      "partial": True, "summary": rows, "runs": runs}, md)  # fmt: skip
    return common.finish(args, NAME, env, settings, md, plot=lambda: plot(runs, args), optimum=optimum,
                         oracle_test_perplexity=oracle, summary=rows, runs=runs)  # fmt: skip


if __name__ == "__main__":
    main()
