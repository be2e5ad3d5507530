#!/usr/bin/env python
"""The paper's LM table beside ours (issue 73, item 2): rows of ``compare_samplers.py --profile paper`` gathered.

    python recipes/benchmarks/results/paper_setting/paper_table.py ROW_DIR [ROW_DIR ...] --out table/

Each ROW_DIR holds one ``compare_samplers.json`` (one sampler, one seed: the rows run one per core, each from a
worktree of a fixed commit, and finish at different times). Writes ``table.json`` (every row: its commit, test
perplexity by epoch, validation perplexity by epoch, tokens/s, the proposal's coverage at the end; each row's mean
and sd over its seeds), ``table.md`` (the table beside the paper's figures; every pair of rows the paper orders,
said to hold here or not by the means over the seeds both rows ran, and counted seed by seed; our rows against
the rows they change) and ``table_valid_ppl.png`` (validation perplexity by epoch). Rows run before the by-epoch
test perplexity and the coverage were recorded (commit ae829c5) take the coverage from the last logged ``midx/``
entry of their recipe log (``<sampler>.recipe.log`` beside the JSON) and have no test perplexity by epoch; an epoch
whose checkpoint the run did not keep shows "-".
"""

from __future__ import annotations

import argparse
import ast
import json
import statistics
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[4]
sys.path.insert(0, str(ROOT / "recipes" / "benchmarks"))

import common  # noqa: E402
from compare_samplers import COVERAGE_KEYS, PAPER_PPL  # noqa: E402

#: Row -> what it is (the paper's rows first, in the paper's order; ours after).
ROWS = {
    "full": "full softmax",
    "midx-rq-uniform": "the paper's MIDX-rq (uniform inside a bucket)",
    "midx-pq-uniform": "the paper's MIDX-pq",
    "unigram-logcount": "the paper's unigram (log(count + 1))",
    "lsh": "LSH",
    "uniform": "uniform",
    "sphere": "sphere",
    "rff": "RFF",
    "unigram": "our unigram (count + 1)",
    "midx-rq": "our MIDX-rq (centered last stage)",
    "midx-rq-learned": "our MIDX-rq, learned codebooks",
}


def load_row(path: Path) -> list[dict]:
    """The seeds of the one sampler in ``path`` (a compare_samplers.json or its folder)."""
    path = path / "compare_samplers.json" if path.is_dir() else path
    payload = json.loads(path.read_text())
    commit = payload["environment"]["git"]["commit"][:7]
    out = []
    for sampler, run in payload["equal_epochs"].items():
        by_epoch = {str(round(e["epoch"])): e["test_perplexity"] for e in run.get("test_by_epoch") or []}
        best = _best_epoch(run)
        if best is not None and run.get("test_perplexity") is not None:
            by_epoch.setdefault(str(round(best)), run["test_perplexity"])  # the recipe's test is the best epoch's
        coverage = run.get("coverage_at_end")
        if coverage is None and sampler != "full":
            coverage = _coverage_from_log(path.parent / f"{sampler}.recipe.log", path.parent / sampler / "recipe.log")
        out.append({
            "sampler": sampler, "seed": run.get("seed", payload["settings"]["seed"]), "commit": commit,
            "test_perplexity": run.get("test_perplexity"), "error": run.get("error"),
            "valid_by_epoch": [p["valid_perplexity"] for p in run.get("curve", [])],
            "test_by_epoch": by_epoch, "best_epoch": best, "tokens_per_second": run.get("tokens_per_second"),
            "train_time_s": run.get("train_time_s"), "coverage_at_end": coverage,
        })  # fmt: skip
    return out


def _best_epoch(run: dict):
    curve = run.get("curve") or []
    return None if not curve else min(curve, key=lambda p: p["valid_loss"])["epoch"]


def _coverage_from_log(*logs: Path) -> dict | None:
    """The last training log line's ``midx/`` coverage figures (the recipe logs each entry as a dict)."""
    for log in logs:
        if not log.is_file():
            continue
        entries = [ast.literal_eval(line.split("INFO recipes: ", 1)[1]) for line in log.read_text().splitlines()
                   if "INFO recipes: {" in line and "'midx/kl_pq'" in line]  # fmt: skip
        if entries:
            last = entries[-1]
            return {"step": None, **{k: float(last[f"midx/{k}"]) for k in COVERAGE_KEYS if f"midx/{k}" in last}}
    return None


#: The rows that are the paper's own methods in its setting: only their orderings are the paper's to check.
PAPER_ROWS = ("full", "midx-rq-uniform", "midx-pq-uniform", "unigram-logcount", "lsh", "uniform", "sphere", "rff")


def test_by_seed(rows: list[dict], sampler: str) -> dict[int, float]:
    """Test perplexity of ``sampler``'s rows by seed (rows without one left out)."""
    ran = [r for r in rows if r["sampler"] == sampler and r["test_perplexity"] is not None]
    return {r["seed"]: r["test_perplexity"] for r in ran}


def by_sampler(rows: list[dict]) -> list[dict]:
    """One line per sampler (in :data:`ROWS` order): its seeds, their mean test perplexity and sample sd."""
    out = []
    for s in sorted({r["sampler"] for r in rows}, key=lambda s: list(ROWS).index(s) if s in ROWS else 99):
        ppl = test_by_seed(rows, s)
        vals = list(ppl.values())
        out.append({"sampler": s, "seeds": sorted(ppl), "mean": statistics.fmean(vals) if vals else None,
                    "sd": statistics.stdev(vals) if len(vals) > 1 else None,
                    "paper": PAPER_PPL[s] if s in PAPER_ROWS else None})  # fmt: skip
    return out


def paired_means(rows: list[dict], a: str, b: str) -> tuple[list[int], float, float] | None:
    """The seeds both ``a`` and ``b`` ran and each one's mean test perplexity over them (a seed fixes the data
    order and the initial weights, so rows are compared on the same seeds); None if either has none."""
    pa, pb = test_by_seed(rows, a), test_by_seed(rows, b)
    seeds = sorted(set(pa) & set(pb))
    if not seeds:
        return None
    return seeds, statistics.fmean(pa[k] for k in seeds), statistics.fmean(pb[k] for k in seeds)


def orderings(rows: list[dict]) -> list[dict]:
    """Every pair of the paper's rows (:data:`PAPER_ROWS`, both run here on a common seed) it orders: which the
    paper puts lower, whether ours does (by the means over the seeds both rows ran), and on how many of them."""
    pairs = []
    for i, a in enumerate(PAPER_ROWS):
        for b in PAPER_ROWS[i + 1 :]:
            lo, hi = (a, b) if PAPER_PPL[a] < PAPER_PPL[b] else (b, a)
            paired = paired_means(rows, lo, hi)
            if PAPER_PPL[a] == PAPER_PPL[b] or paired is None:
                continue
            seeds, m_lo, m_hi = paired
            by_seed_lo, by_seed_hi = test_by_seed(rows, lo), test_by_seed(rows, hi)
            pairs.append({"lower_in_paper": lo, "higher_in_paper": hi, "paper": (PAPER_PPL[lo], PAPER_PPL[hi]),
                          "ours": (m_lo, m_hi), "holds": m_lo < m_hi, "seeds": seeds,
                          "seeds_holding": sum(by_seed_lo[k] < by_seed_hi[k] for k in seeds)})  # fmt: skip
    return pairs


#: Our rows against the rows they change: (ours, theirs), compared on the seeds both ran.
OUR_PAIRS = (("midx-rq", "midx-rq-uniform"), ("midx-rq", "unigram"), ("midx-rq", "full"),
             ("midx-rq-learned", "midx-rq"), ("unigram", "unigram-logcount"))  # fmt: skip


def our_pairs(rows: list[dict]) -> list[dict]:
    """:data:`OUR_PAIRS` run on a common seed: the relative difference of their mean test perplexities over the
    seeds both ran."""
    out = []
    for a, b in OUR_PAIRS:
        paired = paired_means(rows, a, b)
        if paired is not None:
            seeds, ma, mb = paired
            out.append({"row": a, "against": b, "seeds": seeds, "ours": (ma, mb), "relative": ma / mb - 1})
    return out


def render(rows: list[dict], pairs: list[dict]) -> str:
    def f(x, d=1):
        return "-" if x is None else f"{x:.{d}f}"

    def cov(r):
        c = r["coverage_at_end"]
        return "-" if not c else f"{f(c.get('kl_pq'), 2)} / {f(c.get('ess'), 3)} / {f(c.get('mass_p_over_q_gt_10'), 3)}"

    order = {s: i for i, s in enumerate(ROWS)}
    rows = sorted(rows, key=lambda r: (order.get(r["sampler"], 99), r["seed"]))
    table = common.markdown_table(rows, [
        ("row", lambda r: r["sampler"]), ("what", lambda r: ROWS.get(r["sampler"], "")),
        ("paper test ppl", lambda r: f(PAPER_PPL[r["sampler"]]) if r["sampler"] in PAPER_ROWS else "-"), ("seed", "seed"),
        ("test ppl (best epoch)", lambda r: f(r["test_perplexity"])),
        ("test ppl by epoch", lambda r: " / ".join(f(r["test_by_epoch"].get(str(e))) for e in range(1, len(r["valid_by_epoch"]) + 1))),
        ("valid ppl by epoch", lambda r: " / ".join(f(x) for x in r["valid_by_epoch"])),
        ("tokens/s", lambda r: f(r["tokens_per_second"], 0)),
        ("KL(P‖Q) / ESS/M / p/q>10 at end", cov), ("commit", "commit")])  # fmt: skip
    held = [p for p in pairs if p["holds"]]
    mean_table = common.markdown_table(by_sampler(rows), [
        ("row", "sampler"), ("paper test ppl", lambda m: f(m["paper"])), ("seeds", lambda m: ", ".join(map(str, m["seeds"]))),
        ("test ppl, mean", lambda m: f(m["mean"])), ("sd", lambda m: f(m["sd"]))])  # fmt: skip
    lines = [
        "# The paper's LM table beside ours (issue 73)", "",
        "Transformer on WikiText-2 in the paper's setting (`compare_samplers.py --profile paper`: pure sampling, M = 20, "
        "K = 32, batch 256, Adam 1e-3, dropout 0.5, 3 epochs, the best epoch by validation loss), one core and one "
        "thread per run on a 2-core CPU. The paper trained 100 epochs with early stopping: compare orderings, not "
        "values. Test perplexity is exact (full softmax).", "", table, "",
        "## By row: mean over seeds", "", mean_table, "",
        f"## The paper's orderings here: {len(held)} of {len(pairs)} pairs hold", "",
        "Mean test perplexity over the seeds both rows ran (the paper's figure in brackets); then on how many of "
        "those seeds the pair holds.", "",
    ]  # fmt: skip
    for p in pairs:
        lines.append(f"- {'holds' if p['holds'] else 'does not hold'}: {p['lower_in_paper']} {f(p['ours'][0])} "
                     f"({f(p['paper'][0])}) below {p['higher_in_paper']} {f(p['ours'][1])} ({f(p['paper'][1])}); "
                     f"on {p['seeds_holding']} of {len(p['seeds'])} seeds run by both")  # fmt: skip
    ours = our_pairs(rows)
    if ours:
        lines += ["", "## Our rows against the rows they change", "", "Mean test perplexity over the seeds both rows ran.",
                  ""]  # fmt: skip
        lines += [f"- {o['row']} {f(o['ours'][0])} against {o['against']} {f(o['ours'][1])}: {100 * o['relative']:+.1f}% "
                  f"(seeds {', '.join(map(str, o['seeds']))})" for o in ours]  # fmt: skip
    return "\n".join(lines) + "\n"


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("rows", nargs="+", type=Path, help="folders (or files) of compare_samplers.json, one row each")
    p.add_argument("--out", type=Path, required=True)
    args = p.parse_args(argv)
    rows = [r for path in args.rows for r in load_row(path)]
    pairs = orderings(rows)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "table.json").write_text(json.dumps({"rows": rows, "by_row": by_sampler(rows),
                                                     "paper_test_perplexity": PAPER_PPL, "orderings": pairs,
                                                     "our_pairs": our_pairs(rows)},
                                                    indent=1) + "\n")  # fmt: skip
    md = render(rows, pairs)
    (args.out / "table.md").write_text(md)
    lines = {f"{r['sampler']} s{r['seed']}": (list(range(1, len(r["valid_by_epoch"]) + 1)), r["valid_by_epoch"])
             for r in rows if r["valid_by_epoch"]}  # fmt: skip
    common.plot_panels(args.out, "table_valid_ppl.png", [{
        "lines": lines, "yscale": "log", "xlabel": "epoch", "ylabel": "validation perplexity (exact)",
        "title": "WikiText-2, the paper's setting", "style": lambda s: {"marker": "o", "color": "black" if s.startswith("full") else None}}],
        size=(7.5, 5.0))  # fmt: skip
    print(md)


if __name__ == "__main__":
    main()
