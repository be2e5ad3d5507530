"""Issue 9's quality benchmark (compare_samplers --seeds) and the
bench_kl diagnostics table, on a tiny synthetic corpus (no network, no shared data). Nothing timed."""

from __future__ import annotations

import importlib.util
import json
import sys

import pytest

from test_benchmarks import REPO, _tiny_corpus, run_bench

PAPER_TABLE = REPO / "recipes/benchmarks/results/paper_setting/paper_table.py"


def _paper_table(*argv: str) -> None:
    """paper_table.py's ``main`` in this process: a fresh Python spends most of the test importing what this one
    already has (torch and transformers, through compare_samplers). The script puts recipes/benchmarks on sys.path to
    import its siblings; that entry is taken off again so no later test imports a benchmark by accident."""
    before = list(sys.path)
    spec = importlib.util.spec_from_file_location("paper_table", PAPER_TABLE)
    module = importlib.util.module_from_spec(spec)
    try:
        spec.loader.exec_module(module)
    finally:
        sys.path[:] = before
    module.main(list(argv))


def test_compare_samplers_seeds(tmp_path):
    data = _tiny_corpus(tmp_path)
    out = tmp_path / "out"
    p = run_bench(
        "compare_samplers", out, "--data_dir", str(data), "--samplers", "full", "midx-rq-paper", "--seeds", "2",
        "--max_steps", "4", "--wall_clock", "off", "--no_plots",
    )  # fmt: skip
    assert p["settings"]["seeds"] == [0, 1] and p["settings"]["max_steps"] == 4
    for name in ("full", "midx-rq-paper"):
        run = p["equal_epochs"][name]
        assert run["error"] is None, run["error"]
        assert [s["seed"] for s in run["seeds"]] == [0, 1] and run["global_step"] == 4
        ppl = [s["test_perplexity"] for s in run["seeds"]]
        assert run["test_ppl_mean"] == pytest.approx(sum(ppl) / 2) and run["test_ppl_sd"] is not None
        for seed in (0, 1):
            assert (out / name / f"seed{seed}" / "results.json").is_file()
    # The variant's flags reached the recipe.
    cfg = json.loads((out / "midx-rq-paper" / "seed0" / "midx_config.json").read_text())
    assert (cfg["estimator"], cfg["mix_weight"]) == ("exact-positive", 0.0)
    rows = {(r["provider"], r["x_value"]) for r in p["rows"]}
    assert rows == {("full", "equal_epochs"), ("midx-rq-paper", "equal_epochs")}
    md = (out / "compare_samplers.md").read_text()
    assert "Equal steps: 4" in md and " ± " in md


def test_paper_profile_reports_test_perplexity_by_epoch_and_coverage(tmp_path):
    """--profile paper keeps a checkpoint per epoch and measures each one's test perplexity (the best one's equal to
    the recipe's: --smoke re-measures it and raises otherwise), and reports the proposal's last logged coverage."""
    data = _tiny_corpus(tmp_path)
    out = tmp_path / "out"
    p = run_bench(
        "compare_samplers", out, "--data_dir", str(data), "--profile", "paper", "--samplers", "full", "midx-pq-uniform",
        "--epochs", "3", "--batch_size", "8", "--no_plots",
    )  # fmt: skip
    assert "--save_strategy epoch" in p["settings"]["recipe_args"]
    for name in ("full", "midx-pq-uniform"):
        run = p["equal_epochs"][name]
        assert run["error"] is None, run["error"]
        by_epoch = run["test_by_epoch"]
        assert [round(e["epoch"]) for e in by_epoch] == [1, 2, 3] and sum(e["best"] for e in by_epoch) == 1
        best = next(e for e in by_epoch if e["best"])
        assert best["test_perplexity"] == pytest.approx(run["test_perplexity"])
        assert not list((out / name).glob("checkpoint-*")) or name == "full"  # pruned unless kept
    assert p["equal_epochs"]["full"]["coverage_at_end"] is None
    cov = p["equal_epochs"]["midx-pq-uniform"]["coverage_at_end"]
    assert cov["kl_pq"] >= 0 and 0 < cov["ess"] <= 1 and 0 <= cov["mass_p_over_q_gt_10"] <= 1
    md = (out / "compare_samplers.md").read_text()
    assert "test ppl by epoch" in md and f"{cov['kl_pq']:.2f}, {cov['ess']:.3f}" in md
    # paper_table.py sets the rows beside the paper's figures and says whether its ordering (full below its MIDX-pq)
    # holds.
    table = tmp_path / "table"
    _paper_table(str(out), "--out", str(table))
    rows = {r["sampler"]: r for r in json.loads((table / "table.json").read_text())["rows"]}
    assert set(rows) == {"full", "midx-pq-uniform"} and len(rows["midx-pq-uniform"]["test_by_epoch"]) == 3
    full, other = (p["equal_epochs"][s]["test_perplexity"] for s in ("full", "midx-pq-uniform"))
    holds = "holds" if full < other else "does not hold"
    line = f"- {holds}: full {full:.1f} (180.8) below midx-pq-uniform {other:.1f} (199.7)"
    assert line in (table / "table.md").read_text()
    assert (table / "table_valid_ppl.png").stat().st_size > 0


def _paper_row(folder, sampler, seed, test_ppl):
    """A compare_samplers.json of one sampler and seed, as ``--profile paper`` writes it (3 epochs)."""
    curve = [{"epoch": float(e), "valid_loss": 7.0 - e, "valid_perplexity": 1000.0 / e} for e in (1, 2, 3)]
    run = {"seed": seed, "test_perplexity": test_ppl, "error": None, "curve": curve, "tokens_per_second": 1000.0,
           "train_time_s": 10.0, "coverage_at_end": None if sampler == "full" else {"kl_pq": 1.0, "ess": 0.1,
           "mass_p_over_q_gt_10": 0.3},
           "test_by_epoch": [{"epoch": e, "test_perplexity": test_ppl * (4 - e)} for e in (1.0, 2.0, 3.0)]}  # fmt: skip
    folder.mkdir(parents=True)
    payload = {"environment": {"git": {"commit": "0123456789"}}, "settings": {"seed": seed}, "equal_epochs": {sampler: run}}
    (folder / "compare_samplers.json").write_text(json.dumps(payload))
    return folder


def test_paper_table_orders_rows_by_their_mean_and_counts_the_seeds_where_each_ordering_holds(tmp_path):
    # Seed 0 has the paper's MIDX-rq below its MIDX-pq, seed 1 not; the means (315 < 316) keep the paper's order.
    # Rows of different seeds are compared on the seeds both ran: midx-rq (seed 0) against the others' seed 0.
    runs = [("full", 0, 280.0), ("full", 1, 290.0), ("midx-rq-uniform", 0, 300.0), ("midx-rq-uniform", 1, 330.0),
            ("midx-pq-uniform", 0, 310.0), ("midx-pq-uniform", 1, 322.0), ("midx-rq", 0, 285.0)]  # fmt: skip
    dirs = [str(_paper_row(tmp_path / f"{s}-s{k}", s, k, v)) for s, k, v in runs]
    _paper_table(*dirs, "--out", str(tmp_path / "table"))
    table = json.loads((tmp_path / "table" / "table.json").read_text())
    by_row = {r["sampler"]: r for r in table["by_row"]}
    assert by_row["midx-rq-uniform"]["seeds"] == [0, 1] and by_row["midx-rq-uniform"]["mean"] == pytest.approx(315.0)
    assert by_row["midx-rq-uniform"]["sd"] == pytest.approx(21.2132, rel=1e-4) and by_row["midx-rq"]["sd"] is None
    pair = next(p for p in table["orderings"] if p["lower_in_paper"] == "midx-rq-uniform" and p["higher_in_paper"] == "midx-pq-uniform")
    assert pair["holds"] and pair["seeds"] == [0, 1] and pair["seeds_holding"] == 1
    assert all(p["holds"] and p["seeds_holding"] == 2 for p in table["orderings"] if p is not pair)
    assert len(table["orderings"]) == 3  # our midx-rq is not one of the paper's rows
    ours = {(o["row"], o["against"]): o["relative"] for o in table["our_pairs"]}
    assert ours == {("midx-rq", "midx-rq-uniform"): pytest.approx(285 / 300 - 1), ("midx-rq", "full"): pytest.approx(285 / 280 - 1)}
    md = (tmp_path / "table" / "table.md").read_text()
    assert "midx-rq-uniform 315.0 (180.9) below midx-pq-uniform 316.0 (199.7); on 1 of 2 seeds run by both" in md
    assert "| midx-rq-uniform | 180.9 | 0, 1 | 315.0 | 21.2 |" in md


def test_bench_kl_reports_the_diagnostics_and_their_prediction(tmp_path):
    ppl = tmp_path / "ppl.json"
    ppl.write_text(json.dumps({"midx-rq": 500.0, "unigram": 390.0, "midx-rq-mix": 383.0, "uniform": 900.0}))
    p = run_bench(
        "bench_kl", tmp_path / "out", "--samplers", "midx-rq", "unigram", "uniform", "midx-rq-mix", "midx-rq-head2k",
        "--ppl_json", str(ppl), "--no_plots",
    )  # fmt: skip
    trained = p["sources"][0]["results"]
    for r in trained:
        assert {"kl_qp", "kl_pq", "ess", "ess_sampled", "mass_p_over_q_gt_10", "head_mass"} <= set(r)
        assert 0 < r["ess"] <= 1 and 0 <= r["mass_p_over_q_gt_10"] <= 1
    head = [r for r in trained if r["sampler"] == "midx-rq-head2k"]
    assert head and head[0]["head_mass"] > 0
    pred = p["predicts_perplexity"]
    assert set(pred["points"]) == {"midx-rq", "unigram", "uniform", "midx-rq-mix"}
    assert set(pred["spearman_vs_log_ppl"]) == {"kl_qp", "kl_pq", "ess", "ess_sampled", "mass_p_over_q_gt_10"}
    assert "Which diagnostic predicts perplexity" in (tmp_path / "out" / "bench_kl.md").read_text()
