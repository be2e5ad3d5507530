"""Seed tables and learning curves of LM recipe runs: ``recipes/large_vocab.py`` and ``recipes/wikitext2.py``.

Each run directory (the recipe's ``--output_dir``) holds ``results.json`` and ``trainer_state.json``.
Runs are grouped by corpus, vocabulary size and configuration (sampler, M, exact head H, mixture, K);
seeds are the groups' repeats. On the synthetic corpus perplexities are divided by the chain's optimal
(entropy-rate) perplexity exp(H); on WikiText-2, which has no known optimum, they are reported as they are. A
test split is easier or harder than exp(H) says (the recipe's at its defaults, V = 100,000: 109.2 against
119.1), so the table also gives the test perplexity over the chain's own on the same tokens
(``oracle_test_perplexity``), the comparator ``synthetic_heldout.py`` uses on 100,000 fresh tokens.
For every corpus and vocabulary size this writes

* a table of the final test perplexity, per seed and as mean +- standard deviation; each configuration's
  paired difference to ``unigram`` with the same M and H (same seeds: mean and standard deviation of the
  per-seed differences, in % of unigram's perplexity; "below by more than twice the paired sd" is the
  claim these figures test); and its mean's difference to the full softmax's mean (in %);
* ``<name>_<corpus>_v<V>.png``: validation perplexity (/ optimum) against training tokens and against
  training wall-clock (the Trainer's ``train_runtime`` at each log, evaluation excluded; a resumed run's
  sessions end to end), and the training-time coverage diagnostics that ``MidxCallback`` logs (ESS / M,
  KL(P || Q), the exact head's share of the softmax mass, P's mass on classes with p / q > 10) against tokens.

Run: ``python recipes/benchmarks/synthetic_curves.py runs/syn/* --out recipes/benchmarks/results/cpu-synthetic``
(or the output folders of ``recipes/wikitext2.py`` runs).
"""

from __future__ import annotations

import json
import math
import re
import statistics
from pathlib import Path

if __package__:
    from . import common
else:  # run as a file: this folder is first on sys.path
    import common

NAME = "synthetic_curves"
CORPORA = {"large_vocab": "synthetic", "wikitext2": "wikitext2"}
TITLES = {"synthetic": "synthetic Zipf-Markov corpus", "wikitext2": "WikiText-2"}
DIAGNOSTICS = (
    ("midx/ess", "ESS / M"),
    ("midx/kl_pq", "KL(P || Q), nats"),
    ("midx/head_mass", "exact head's share of the mass"),
    ("midx/mass_p_over_q_gt_10", "P's mass with p / q > 10"),
)


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
    evals = [
        {
            "step": e["step"],
            "tokens": e["num_input_tokens_seen"],
            "seconds": seconds_at(e["step"]),
            "ratio": e["eval_perplexity"] / scale,
        }
        for e in history
        if "eval_perplexity" in e
    ]
    diagnostics = {
        key: [(e["num_input_tokens_seen"], e[key]) for e in train if key in e] for key, _ in DIAGNOSTICS
    }
    return {
        "dir": str(run_dir),
        "label": config_label(results),
        "seed": run_seed(results, run_dir),
        "corpus": CORPORA[results["recipe"]],
        "vocab_size": results["data"]["vocab_size"],
        "optimum": optimum,
        "test_perplexity": results["test_perplexity"],
        "test_ratio": results["test_perplexity"] / scale,
        # Over the chain's own perplexity on the same test tokens: a finite split is easier or harder than exp(H).
        "test_vs_split_oracle": None if split_oracle is None else results["test_perplexity"] / split_oracle,
        "tokens": tokens,
        "train_seconds": results["train_runtime_s"],
        "tokens_per_second": tokens_per_second,
        "evals": evals,
        "diagnostics": diagnostics,
    }


def summarize(runs: list[dict]) -> list[dict]:
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
        row = {
            "config": label,
            "seeds": sorted(by_seed),
            "test_ratio": ratios,
            "mean": statistics.fmean(ratios),
            "sd": statistics.stdev(ratios) if len(ratios) > 1 else None,
            "tokens": max(r["tokens"] for r in by_seed.values()),
            "tokens_per_second": statistics.fmean(r["tokens_per_second"] for r in by_seed.values()),
        }
        split = [by_seed[s].get("test_vs_split_oracle") for s in sorted(by_seed)]
        if all(x is not None for x in split):
            row["test_vs_split_oracle"] = split
        if full_mean is not None and label != "full":
            mean = statistics.fmean(r["test_perplexity"] for r in by_seed.values())
            row["vs_full_pct"] = 100 * (mean / full_mean - 1)
        m_h = re.search(r"( M=\d+ H=\d+)", label)
        baseline = groups.get(f"unigram{m_h.group(1)}") if m_h and not label.startswith("unigram") else None
        if baseline:
            shared = sorted(set(by_seed) & set(baseline))
            diffs = [
                100 * (by_seed[s]["test_perplexity"] / baseline[s]["test_perplexity"] - 1) for s in shared
            ]
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
        ("training tokens", lambda r: f"{r['tokens']:,}"), ("tokens/s", lambda r: f"{r['tokens_per_second']:,.0f}"),
    ]  # fmt: skip
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
    stem = f"{NAME}_v{v}" if corpus == "synthetic" else f"{NAME}_{corpus}_v{v}"  # earlier results keep their names
    return common.save_figure(fig, out, f"{stem}.png")


def main(argv=None) -> dict:
    p = common.base_parser(__doc__.split("\n\n")[0], timed=False, seed=False)
    p.add_argument("runs", nargs="+", type=Path, help="output folders of recipes/large_vocab.py or wikitext2.py runs")
    args = common.parse(p, argv)
    runs = [load_run(d) for d in args.runs]
    by_v: dict[tuple[str, int], list[dict]] = {}
    for r in runs:
        by_v.setdefault((r["corpus"], r["vocab_size"]), []).append(r)
    payload, sections = {"runs": runs, "summary": {}}, [f"# {NAME}"]
    for (corpus, v), group in sorted(by_v.items()):
        rows = summarize(group)
        # Synthetic runs keep the key of earlier results (V alone); WikiText-2's names its corpus.
        payload["summary"][str(v) if corpus == "synthetic" else f"{corpus}_{v}"] = rows
        sections.append(markdown(corpus, v, rows, group[0]["optimum"]))
    common.write_outputs(args.out, NAME, payload, "\n\n".join(sections))  # first: a failing plot keeps the table
    print("\n\n".join(sections))
    if not args.no_plots:
        for (corpus, v), group in sorted(by_v.items()):
            plot(corpus, v, group, Path(args.out))
    return payload


if __name__ == "__main__":
    main()
