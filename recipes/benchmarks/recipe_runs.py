"""Tables of finished LM recipe runs (``recipes/large_vocab.py``, ``recipes/wikitext2.py``): one tool, two questions.

``curves RUN_DIR... --out DIR``: seed tables and learning curves. Runs are grouped by corpus, vocabulary size and
configuration (sampler, M, exact head H, mixture, K); seeds are the groups' repeats. On the synthetic corpus
perplexities are divided by the chain's optimal (entropy-rate) perplexity exp(H); on WikiText-2, which has no known
optimum, they are reported as they are. Per corpus and V: the final test perplexity per seed and as mean +- sd; each
configuration's paired difference to ``unigram`` with the same M and H (per-seed differences in % of unigram's
perplexity, their mean and sd) and its mean's difference to the full softmax's; the test perplexity over the chain's
own on the same test tokens; and ``synthetic_curves_v<V>.png`` (``synthetic_curves_<corpus>_v<V>.png`` for
WikiText-2): validation perplexity against training tokens and wall-clock (the Trainer's ``train_runtime`` at each
log, evaluation excluded; a resumed run's sessions end to end) and the coverage diagnostics ``MidxCallback`` logs (ESS
/ M, KL(P || Q), the exact head's share of the mass, P's mass with p / q > 10) against tokens. Writes
``DIR/synthetic_curves.{json,md}``.

``heldout RUN_DIR... --tokens 100000 --out DIR``: finished ``large_vocab.py`` runs scored on N fresh tokens of their
chain (blocks of the recipe's length, from a seed stream no recipe split uses), with the exact softmax, since a
10,000-token test split cannot rank runs a few tenths of a percent apart. Per run: NLL, perplexity and its ratio to
the true chain's on the same tokens; per configuration and seed: the paired difference to ``unigram`` (same M, H) and
to ``full`` in % of perplexity with a 95% interval from the blocks (independent runs of the chain), then mean and sd
over seeds; and where each difference lies, split by the next word's frequency band (ranks [0, H), [H, 10H), [10H, V))
in nats per token of the whole sample (summing to the difference) and, in brackets, per token of the band. The JSON
keeps each run's per-block scores, so ``heldout --merge OUT1/synthetic_heldout.json OUT2/...`` tables separate calls
on the same tokens together without scoring again. Writes ``DIR/synthetic_heldout[_TAG].{json,md}``.

Run: ``python recipes/benchmarks/recipe_runs.py {curves,heldout} ...`` (``--help`` on each).
"""

from __future__ import annotations

import argparse
import json
import math
import re
import statistics
from pathlib import Path

import torch

if __package__:
    from . import common
else:  # run as a file: this folder is first on sys.path
    import common

synthetic = common.import_recipe("synthetic")

CURVES = "synthetic_curves"
HELDOUT = "synthetic_heldout"
CORPORA = {"large_vocab": "synthetic", "wikitext2": "wikitext2"}
TITLES = {"synthetic": "synthetic Zipf-Markov corpus", "wikitext2": "WikiText-2"}
DIAGNOSTICS = (("midx/ess", "ESS / M"), ("midx/kl_pq", "KL(P || Q), nats"), ("midx/head_mass", "exact head's share of "
               "the mass"), ("midx/mass_p_over_q_gt_10", "P's mass with p / q > 10"))


def config_label(results: dict) -> str:
    """'full', or the sampler with the settings that tell runs apart (M, H, K, mixture, last stage, estimator)."""
    cfg = results.get("midx_config")
    if cfg is None:
        return results["sampler"]
    parts = [cfg["sampler"], f"M={cfg['num_samples']}", f"H={cfg['exact_head']}"]
    if cfg["sampler"].startswith("midx"):
        parts.append(f"K={cfg['codebook_size']}")
        if cfg.get("mix_weight"):
            parts.append(f"mix={cfg['mix_weight']:g}")
        if cfg.get("last_stage", "uniform") != "uniform":
            parts.append(f"last={cfg['last_stage']}")
    if cfg.get("negatives", "per-query") != "per-query":
        parts.append(cfg["negatives"])
    if cfg.get("estimator", "corrected-positive") != "corrected-positive":
        parts.append(cfg["estimator"])
    return " ".join(parts)


def run_seed(results: dict, run_dir: Path) -> int:
    if results.get("seed") is not None:
        return int(results["seed"])
    if results.get("midx_config"):
        return int(results["midx_config"]["seed"])
    found = re.search(r"(?:^|[_-])s(?:eed)?(\d+)$", run_dir.name)
    if found is None:
        raise SystemExit(f"{run_dir}: no seed in results.json and none in the folder name (..._s<seed>).")
    return int(found.group(1))


def unigram_of(label: str) -> str | None:
    m_h = re.search(r"( M=\d+ H=\d+)", label)
    return f"unigram{m_h.group(1)}" if m_h and not label.startswith("unigram") else None


def wall_clock(history: list[dict]) -> tuple[list[int], list[float]]:
    """Steps and training seconds, evaluation excluded, at each training log of a Trainer's ``log_history``.

    Starts at (0, 0.0). A training log's ``train_runtime`` counts from the start of its own session, the
    evaluations logged before it included (an evaluation follows the log of its step). A resumed run's history
    holds the earlier sessions' logs up to the checkpoint it resumed from, then the new session's: where the
    runtime falls back a session begins, and it is put after the one before. Exact when checkpoints are saved at
    log steps, as in the recipes; otherwise the steps between a session's last log and its checkpoint are left out.
    """
    steps, seconds = [0], [0.0]
    offset = runtime = evaluated = 0.0  # earlier sessions' seconds; this session's runtime and evaluation so far
    pending: list[tuple[int, float]] = []  # (step, seconds) of the evaluations since the last training log
    for e in history:
        if "eval_runtime" in e:
            pending.append((e["step"], e["eval_runtime"]))
        elif "loss" in e and "train_runtime" in e:
            if e["train_runtime"] < runtime:
                offset, evaluated = seconds[-1], 0.0
                pending = [(step, t) for step, t in pending if step > steps[-1]]  # the rest were the last session's
            evaluated += sum(t for _, t in pending)
            pending, runtime = [], e["train_runtime"]
            steps.append(e["step"])
            seconds.append(offset + runtime - evaluated)
    return steps, seconds


def load_run(run_dir: Path) -> dict:
    """One run: label, seed, corpus, V, optimum (None on WikiText-2), final test perplexity and its curves."""
    try:
        results = json.loads((run_dir / "results.json").read_text())
        state = json.loads((run_dir / "trainer_state.json").read_text())
        history = state["log_history"]
    except (OSError, ValueError, KeyError) as err:
        raise SystemExit(f"{run_dir}: not a finished large_vocab or wikitext2 run ({err}).") from None
    if results.get("recipe") not in CORPORA or not results.get("complete"):
        raise SystemExit(f"{run_dir}: results.json is not a complete large_vocab or wikitext2 run.")
    if results.get("test_perplexity") is None:
        raise SystemExit(f"{run_dir}: the run has no test perplexity (it was run without a test split).")
    optimum = results.get("optimal_perplexity")  # the synthetic chain's; WikiText-2 has none
    scale = optimum or 1.0
    split_oracle = (results.get("synthetic") or {}).get("oracle_test_perplexity")
    train = [e for e in history if "loss" in e and "train_runtime" in e]
    # Wall-clock at a step: the training seconds at each log, interpolated between logs.
    steps, runtimes = wall_clock(history)

    def seconds_at(step: int) -> float:
        for (s0, t0), (s1, t1) in zip(zip(steps, runtimes), zip(steps[1:], runtimes[1:])):
            if s0 <= step <= s1:
                return t0 + (t1 - t0) * (step - s0) / max(s1 - s0, 1)
        return runtimes[-1]

    # The whole run's, also where results.json predates whole-run tokens or gives a resumed session's speed.
    tokens = state.get("num_input_tokens_seen") or results["train_tokens_seen"]
    tokens_per_second = results["tokens_per_second"]
    if results.get("resumed_from") and tokens:
        tokens_per_second = tokens / (results["train_runtime_s"] - results.get("eval_during_training_s", 0.0))
    evals = [{"step": e["step"], "tokens": e["num_input_tokens_seen"], "seconds": seconds_at(e["step"]),
              "ratio": e["eval_perplexity"] / scale} for e in history if "eval_perplexity" in e]
    diagnostics = {key: [(e["num_input_tokens_seen"], e[key]) for e in train if key in e] for key, _ in DIAGNOSTICS}
    return {"dir": str(run_dir), "label": config_label(results), "seed": run_seed(results, run_dir),
            "corpus": CORPORA[results["recipe"]], "vocab_size": results["data"]["vocab_size"], "optimum": optimum,
            "test_perplexity": results["test_perplexity"], "test_ratio": results["test_perplexity"] / scale,
            # Over the chain's own perplexity on the same test tokens: a finite split is easier or harder than exp(H).
            "test_vs_split_oracle": None if split_oracle is None else results["test_perplexity"] / split_oracle,
            "tokens": tokens, "train_seconds": results["train_runtime_s"], "tokens_per_second": tokens_per_second,
            "evals": evals, "diagnostics": diagnostics}


def seed_table(runs: list[dict]) -> list[dict]:
    """One row per configuration: per-seed ratios, mean +- sd, the paired difference to unigram, and the
    difference of its mean test perplexity to the full softmax's (``vs_full_pct``, when a full run is there)."""
    groups: dict[str, dict[int, dict]] = {}
    for r in runs:
        groups.setdefault(r["label"], {})[r["seed"]] = r
    full = groups.get("full")
    full_mean = statistics.fmean(r["test_perplexity"] for r in full.values()) if full else None
    rows = []
    for label, by_seed in sorted(groups.items()):
        ratios = [by_seed[s]["test_ratio"] for s in sorted(by_seed)]
        row = {"config": label, "seeds": sorted(by_seed), "test_ratio": ratios, "mean": statistics.fmean(ratios),
               "sd": statistics.stdev(ratios) if len(ratios) > 1 else None,
               "tokens": max(r["tokens"] for r in by_seed.values()),
               "tokens_per_second": statistics.fmean(r["tokens_per_second"] for r in by_seed.values())}
        split = [by_seed[s].get("test_vs_split_oracle") for s in sorted(by_seed)]
        if all(x is not None for x in split):
            row["test_vs_split_oracle"] = split
        if full_mean is not None and label != "full":
            mean = statistics.fmean(r["test_perplexity"] for r in by_seed.values())
            row["vs_full_pct"] = 100 * (mean / full_mean - 1)
        baseline = groups.get(unigram_of(label))
        if baseline:
            shared = sorted(set(by_seed) & set(baseline))
            diffs = [100 * (by_seed[s]["test_perplexity"] / baseline[s]["test_perplexity"] - 1) for s in shared]
            if diffs:
                row["vs_unigram_pct"] = diffs
                row["vs_unigram_mean"] = statistics.fmean(diffs)
                row["vs_unigram_sd"] = statistics.stdev(diffs) if len(diffs) > 1 else None
        rows.append(row)
    return rows


def _fmt(x: float | None, digits: int = 3) -> str:
    return "-" if x is None or math.isnan(x) else f"{x:.{digits}f}"


def markdown(corpus: str, v: int, rows: list[dict], optimum: float | None) -> str:
    def vs_unigram(r):
        if "vs_unigram_pct" not in r:
            return "-"
        mean = "" if r["vs_unigram_sd"] is None else f" (mean {r['vs_unigram_mean']:+.2f}% +- {r['vs_unigram_sd']:.2f})"
        return ", ".join(f"{d:+.2f}%" for d in r["vs_unigram_pct"]) + mean

    digits, unit = (3, "test ppl / optimum") if optimum else (1, "test perplexity")

    def split_ratios(r):
        return ", ".join(_fmt(x, digits) for x in r["test_vs_split_oracle"]) if "test_vs_split_oracle" in r else "-"

    columns = [
        ("configuration", "config"), ("seeds", lambda r: ", ".join(map(str, r["seeds"]))),
        (f"{unit}, per seed", lambda r: ", ".join(_fmt(x, digits) for x in r["test_ratio"])),
        ("mean +- sd", lambda r: _fmt(r["mean"], digits) + ("" if r["sd"] is None else f" +- {_fmt(r['sd'], digits)}")),
        ("vs unigram (same M, H), paired", vs_unigram),
        ("vs full (means)", lambda r: f"{r['vs_full_pct']:+.2f}%" if "vs_full_pct" in r else "-"),
        ("test ppl / the chain's on the test split, per seed", split_ratios),
        ("training tokens", lambda r: f"{r['tokens']:,}"), ("tokens/s", lambda r: f"{r['tokens_per_second']:,.0f}")]  # fmt: skip
    title = f"## {TITLES[corpus]}, V = {v:,}" + (f" (optimal perplexity {optimum:.2f})" if optimum else "")
    return title + "\n\n" + common.markdown_table(rows, columns)


def plot(corpus: str, v: int, runs: list[dict], out: Path) -> Path:
    plt = common.pyplot()
    fig, axes = plt.subplots(2, 3, figsize=(16, 8.5))
    labels = sorted({r["label"] for r in runs})
    colors = {label: f"C{i}" for i, label in enumerate(labels)}
    panels = [("tokens", "training tokens"), ("seconds", "training wall-clock, s")]
    for ax, (x, xlabel) in zip(axes[0][:2], panels):
        for r in runs:
            pts = r["evals"]
            ax.plot([p[x] for p in pts], [p["ratio"] for p in pts], color=colors[r["label"]], alpha=0.8, marker=".",
                    label=f"{r['label']} (seed {r['seed']})")
        ylabel = "validation perplexity" + (" / optimum" if runs[0]["optimum"] else "")
        ax.set(xlabel=xlabel, ylabel=ylabel, yscale="log")
        ax.grid(alpha=0.3)
    axes[0][0].legend(fontsize=7)
    for ax, (key, ylabel) in zip([axes[0][2], *axes[1]], DIAGNOSTICS):
        for r in runs:
            pts = r["diagnostics"][key]
            if pts:
                ax.plot([p[0] for p in pts], [p[1] for p in pts], color=colors[r["label"]], alpha=0.7)
        ax.set(xlabel="training tokens", ylabel=ylabel)
        ax.grid(alpha=0.3)
    fig.suptitle(f"{TITLES[corpus]}, V = {v:,}")
    stem = f"{CURVES}_v{v}" if corpus == "synthetic" else f"{CURVES}_{corpus}_v{v}"  # earlier results keep their names
    return common.save_figure(fig, out, f"{stem}.png")


def curves(args) -> dict:
    """The seed tables and learning curves of finished runs (``args.runs``): writes synthetic_curves.{json,md,png}."""
    runs = [load_run(d) for d in args.runs]
    by_v: dict[tuple[str, int], list[dict]] = {}
    for r in runs:
        by_v.setdefault((r["corpus"], r["vocab_size"]), []).append(r)
    payload, sections = {"runs": runs, "summary": {}}, [f"# {CURVES}"]
    for (corpus, v), group in sorted(by_v.items()):
        rows = seed_table(group)
        # Synthetic runs keep the key of earlier results (V alone); WikiText-2's names its corpus.
        payload["summary"][str(v) if corpus == "synthetic" else f"{corpus}_{v}"] = rows
        sections.append(markdown(corpus, v, rows, group[0]["optimum"]))
    common.write_outputs(args.out, CURVES, payload, "\n\n".join(sections))  # first: a failing plot keeps the table
    print("\n\n".join(sections))
    if not args.no_plots:
        for (corpus, v), group in sorted(by_v.items()):
            plot(corpus, v, group, Path(args.out))
    return payload


#: Seed stream of the fresh blocks: the recipe's splits use [corpus_seed, 0..2], synthetic_coverage [.., 99, ..].
STREAM = 98
#: Logits per forward pass, at most (float32: 256 MB).
LOGITS_PER_BATCH = 2**26


def load_runs(run_dirs: list[Path]) -> tuple[list[dict], dict, int]:
    """The runs' ``results.json`` with their label and seed; the chain settings and block length they share."""
    runs, chains, keys = [], set(), synthetic.ZipfMarkovChain.FACT_KEYS
    for run_dir in run_dirs:
        try:
            results = json.loads((run_dir / "results.json").read_text())
            facts, seq_len = tuple(results["synthetic"][k] for k in keys), results["data"]["seq_len"]
        except (OSError, ValueError, KeyError) as err:
            raise SystemExit(f"{run_dir}: not a large_vocab run ({err}).") from None
        if not results.get("complete") or not (run_dir / "config.json").is_file():
            raise SystemExit(f"{run_dir}: the run did not finish (no complete results.json and saved model).")
        chains.add((facts, seq_len))
        label = config_label(results)
        runs.append({"dir": run_dir, "label": label, "seed": run_seed(results, run_dir)})
    if len(chains) != 1:
        raise SystemExit(f"The runs come from {len(chains)} different chains or block lengths; score one at a time.")
    (settings, seq_len), = chains
    return runs, dict(zip(keys, settings)), seq_len


@torch.no_grad()
def token_nll(run_dir: Path, blocks: torch.Tensor) -> torch.Tensor:
    """(B, L) float64 exact NLL of each predicted token of (B, L + 1) int64 ``blocks`` under the run's model."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(run_dir).eval()
    vocab, length = model.get_output_embeddings().weight.shape[0], blocks.shape[1] - 1
    step = max(1, LOGITS_PER_BATCH // (vocab * length))
    out = []
    for chunk in blocks.split(step):
        logits = model(chunk[:, :-1]).logits.float().flatten(0, 1)  # (b * L, V)
        nll = torch.nn.functional.cross_entropy(logits, chunk[:, 1:].flatten(), reduction="none")
        out.append(nll.double().view(-1, length))
    return torch.cat(out)


def band_edges(vocab: int, head: int) -> list[int]:
    return [0, head, min(10 * head, vocab), vocab] if head else [0, vocab // 100, vocab // 10, vocab]


def block_scores(nll: torch.Tensor, nexts: torch.Tensor, edges: list[int]) -> dict:
    """What the comparisons need of a (B, L) NLL: each block's mean (B,) and its sum per band of the next
    word's rank (B, bands), as lists (JSON, for --merge)."""
    bands = torch.stack([(nll * ((nexts >= lo) & (nexts < hi))).sum(1) for lo, hi in zip(edges, edges[1:])], 1)
    return {"block_nll": nll.mean(1).tolist(), "block_band_nll": bands.tolist()}


def paired(run: dict, base: dict, length: int) -> dict:
    """The difference of two runs on the same blocks: in % of perplexity with a 95% interval from the block
    means, and in nats per token by the next word's band (the bands sum to the total)."""
    def minus(key: str) -> torch.Tensor:
        return torch.tensor(run[key], dtype=torch.float64) - torch.tensor(base[key], dtype=torch.float64)

    per_block = minus("block_nll")
    diff, se = per_block.mean().item(), per_block.std().item() / math.sqrt(per_block.numel())
    bands = minus("block_band_nll").sum(0)
    pct = lambda d: 100 * math.expm1(d)  # noqa: E731
    return {"pct": pct(diff), "low": pct(diff - 1.96 * se), "high": pct(diff + 1.96 * se), "nats": diff,
            "se_nats": se, "bands_nats": (bands / (per_block.numel() * length)).tolist()}  # fmt: skip


def paired_summary(runs: list[dict], baseline_of) -> list[dict]:
    """Per configuration other than its baseline: the per-seed paired differences and their mean +- sd."""
    groups: dict[str, dict[int, dict]] = {}
    for r in runs:
        groups.setdefault(r["label"], {})[r["seed"]] = r
    rows = []
    for label, by_seed in sorted(groups.items()):
        base_label = baseline_of(label)
        if base_label is None or base_label not in groups or base_label == label:
            continue
        seeds = sorted(set(by_seed) & set(groups[base_label]))
        diffs = [by_seed[s]["vs"][base_label] for s in seeds]
        if not diffs:
            continue
        pcts = [d["pct"] for d in diffs]
        rows.append({"config": label, "baseline": base_label, "seeds": seeds, "pct": pcts,
                     "mean": statistics.fmean(pcts), "sd": statistics.stdev(pcts) if len(pcts) > 1 else None,
            "bands_nats": [statistics.fmean(band) for band in zip(*(d["bands_nats"] for d in diffs))]})  # fmt: skip
    return rows


def check_unique(runs: list[dict]) -> None:
    seen = {}
    for r in runs:
        other = seen.setdefault((r["label"], r["seed"]), r["dir"])
        if other != r["dir"]:
            raise SystemExit(f"{r['dir']} and {other} are both {r['label']}, seed {r['seed']}: give one of them.")


def score(args) -> tuple[dict, list[dict]]:
    """Draw the fresh blocks and score every run on them: (settings, runs with their block scores)."""
    runs, syn, seq_len = load_runs(args.run_dirs)
    check_unique(runs)  # before minutes of scoring
    chain = synthetic.ZipfMarkovChain.from_facts(syn)
    num_blocks = max(2, math.ceil(args.tokens / seq_len))
    blocks = chain.sample_blocks(num_blocks, seq_len + 1, seed=[syn["corpus_seed"], STREAM, args.seed])
    oracle = -torch.from_numpy(chain.log_prob(blocks))  # (B, L) float64
    blocks = torch.from_numpy(blocks)
    nexts, edges = blocks[:, 1:], band_edges(chain.vocab_size, args.exact_head)
    settings = {"synthetic": syn, "seq_len": seq_len, "blocks": num_blocks, "tokens": num_blocks * seq_len,
                "seed": args.seed, "exact_head": args.exact_head, "bands": edges,
                "exp_entropy_rate": math.exp(chain.entropy_rate()),
                "label_share": [((nexts >= lo) & (nexts < hi)).double().mean().item()
                                for lo, hi in zip(edges, edges[1:])],
                "oracle": block_scores(oracle, nexts, edges)}  # fmt: skip
    for r in runs:
        r.update(block_scores(token_nll(r["dir"], blocks), nexts, edges))
        r["dir"] = str(r["dir"])
        print(f"{r['dir']}: {r['label']} seed {r['seed']}: scored", flush=True)
    return settings, runs


def merge(paths: list[Path]) -> tuple[dict, list[dict]]:
    """Earlier outputs of this script on the same tokens, as one set of runs."""
    settings, runs = None, []
    for path in paths:
        try:
            payload = json.loads(path.read_text())
            these, more = payload["settings"], payload["runs"]
        except (OSError, ValueError, KeyError) as err:
            raise SystemExit(f"{path}: not a synthetic_heldout output ({err}).") from None
        these = {k: v for k, v in these.items() if k not in ("run_dirs", "merged")}
        if settings is not None and these != settings:
            raise SystemExit(f"{path} scored other tokens (chain, blocks, stream seed or bands) than {paths[0]}.")
        settings = these
        runs += [{k: v for k, v in r.items() if k != "vs"} for r in more]
    return settings, runs


def heldout(args) -> dict:
    """Score finished large_vocab runs (``args.run_dirs``) on fresh tokens, or ``--merge`` earlier outputs:
    writes synthetic_heldout[_TAG].{json,md}."""
    if args.tokens < 2 or args.exact_head < 0:
        raise SystemExit("--tokens must be >= 2 and --exact_head >= 0.")
    if bool(args.merge) == bool(args.run_dirs):
        raise SystemExit("Give either run folders to score or --merge with earlier outputs, not both or neither.")
    settings, runs = merge(args.merge) if args.merge else score(args)
    if args.merge:
        check_unique(runs)
    oracle, length = settings["oracle"], settings["seq_len"]
    oracle_nll = statistics.fmean(oracle["block_nll"])
    for r in runs:
        r["nll"] = statistics.fmean(r["block_nll"])
        r["perplexity"], r["ratio"] = math.exp(r["nll"]), math.exp(r["nll"] - oracle_nll)
    by_key = {(r["label"], r["seed"]): r for r in runs}
    for r in runs:
        r["vs"] = {}
        for base_label in {unigram_of(r["label"]), "full"} - {None, r["label"]}:
            base = by_key.get((base_label, r["seed"]))
            if base is not None:
                r["vs"][base_label] = paired(r, base, length)
    summary = {"vs unigram": paired_summary(runs, unigram_of), "vs full": paired_summary(runs, lambda label: "full")}
    for row in summary["vs unigram"] + summary["vs full"]:
        # A band's contribution over the band's own share of the tokens: the difference per word of that band.
        shares = settings["label_share"]
        row["bands_nats_per_band_token"] = [c / s if s else None for c, s in zip(row["bands_nats"], shares)]

    edges = settings["bands"]
    bands = [f"[{lo:,}, {hi:,})" for lo, hi in zip(edges, edges[1:])]
    fmt_vs = lambda d: f"{d['pct']:+.2f}% [{d['low']:+.2f}, {d['high']:+.2f}]"  # noqa: E731
    vs_unigram = lambda r: next((fmt_vs(d) for k, d in r["vs"].items() if k != "full"), None)  # noqa: E731
    vs_full = lambda r: fmt_vs(r["vs"]["full"]) if "full" in r["vs"] else None  # noqa: E731
    columns = [("run", lambda r: Path(r["dir"]).name), ("configuration", "label"), ("seed", "seed"),
               ("perplexity", lambda r: f"{r['perplexity']:.2f}"), ("/ chain's", lambda r: f"{r['ratio']:.4f}"),
               ("vs unigram, same seed (95%)", vs_unigram), ("vs full, same seed (95%)", vs_full)]  # fmt: skip
    mean_sd = lambda r: f"{r['mean']:+.2f}%" + ("" if r["sd"] is None else f" ± {r['sd']:.2f}")  # noqa: E731

    def band_cell(r, i):
        per_band = r["bands_nats_per_band_token"][i]
        return f"{r['bands_nats'][i]:+.4f}" + ("" if per_band is None else f" ({per_band:+.4f})")

    summary_columns = [("configuration", "config"), ("against", "baseline"),
                       ("seeds", lambda r: ", ".join(map(str, r["seeds"]))),
                       ("per seed", lambda r: ", ".join(f"{x:+.2f}%" for x in r["pct"])), ("mean ± sd", mean_sd),
                       *[(f"next word in {b}: nats per token (per token of the band)", lambda r, i=i: band_cell(r, i))
                         for i, b in enumerate(bands)]]  # fmt: skip
    pairs = summary["vs unigram"] + summary["vs full"]
    no_pairs = ("No run has its unigram or full-softmax partner of the same seed here: score the partners together, "
                "or `--merge` their outputs.")  # fmt: skip
    syn = settings["synthetic"]
    md = (
        f"# {HELDOUT}\n\n{settings['tokens']:,} fresh tokens ({settings['blocks']:,} blocks of {length}) of the chain "
        f"(V = {syn['vocab_size']:,}, corpus seed {syn['corpus_seed']}, stream seed {settings['seed']}); the chain's "
        f"own perplexity on them {math.exp(oracle_nll):.2f} (exp(H) = {settings['exp_entropy_rate']:.2f}). Share of "
        "the tokens by the next word's rank: "
        + ", ".join(f"{b} {s:.3f}" for b, s in zip(bands, settings["label_share"])) + ".\n\n"
        + common.markdown_table(runs, columns)
        + "\n\n## Paired differences over seeds (in % of the baseline's perplexity; by band in nats per token)\n\n"
        + (common.markdown_table(pairs, summary_columns) if pairs else no_pairs))
    sources = {"merged": [str(x) for x in args.merge]} if args.merge else {"run_dirs": [str(d) for d in args.run_dirs]}
    payload = {"settings": {**settings, **sources}, "oracle_perplexity": math.exp(oracle_nll), "runs": runs,
               "summary": summary}  # fmt: skip
    common.write_outputs(args.out, HELDOUT + (f"_{args.tag}" if args.tag else ""), payload, md)
    print(md)
    return payload


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="command", required=True)
    c = sub.add_parser("curves", help="seed tables and learning curves of large_vocab.py / wikitext2.py runs")
    c.add_argument("runs", nargs="+", type=Path, help="output folders of recipes/large_vocab.py or wikitext2.py runs")
    h = sub.add_parser("heldout", help="large_vocab.py runs scored on fresh tokens of their chain, paired")
    h.add_argument("run_dirs", type=Path, nargs="*", help="output folders of finished recipes/large_vocab.py runs")
    h.add_argument("--tokens", type=int, default=100_000, help="N fresh predicted tokens (rounded up to blocks)")
    h.add_argument("--exact_head", type=int, default=2048, help="H of the frequency bands (0: V/100 and V/10)")
    h.add_argument("--merge", type=Path, nargs="+", default=None, metavar="JSON",
                   help="table earlier heldout outputs (same tokens) together instead of scoring runs")  # fmt: skip
    h.add_argument("--tag", default=None, help="suffix of the output names")
    h.add_argument("--seed", type=int, default=0, help="seed of the fresh tokens' stream")
    for q in (c, h):
        q.add_argument("--out", default="bench-out", help="output folder")
    c.add_argument("--no_plots", action="store_true", help="skip the PNG plots (no matplotlib needed)")
    return p.parse_args(argv)


def main(argv=None) -> dict:
    args = parse_args(argv)
    return curves(args) if args.command == "curves" else heldout(args)


if __name__ == "__main__":
    main()
