"""Issue 9's quality benchmark (compare_samplers --seeds) and the
bench_kl diagnostics table, on a tiny synthetic corpus (no network, no shared data). Nothing timed."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from _env import offline_env
from test_benchmarks import REPO, _tiny_corpus, run_bench


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
    proc = subprocess.run([sys.executable, str(REPO / "recipes/benchmarks/results/paper_setting/paper_table.py"),
                           str(out), "--out", str(table)], capture_output=True, text=True, env=offline_env(MPLBACKEND="Agg"))  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-2000:]
    rows = {r["sampler"]: r for r in json.loads((table / "table.json").read_text())["rows"]}
    assert set(rows) == {"full", "midx-pq-uniform"} and len(rows["midx-pq-uniform"]["test_by_epoch"]) == 3
    full, other = (p["equal_epochs"][s]["test_perplexity"] for s in ("full", "midx-pq-uniform"))
    holds = "holds" if full < other else "does not hold"
    line = f"- {holds}: full {full:.1f} (180.8) below midx-pq-uniform {other:.1f} (199.7)"
    assert line in (table / "table.md").read_text()
    assert (table / "table_valid_ppl.png").stat().st_size > 0


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
