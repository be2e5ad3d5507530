"""The benchmark scripts (recipes/benchmarks/*.py) run end to end and write what they promise.

Each script runs once, in a subprocess, at its ``--smoke`` level (tiny sizes: the numbers mean
nothing) and the test checks the JSON (settings, environment, results), the Markdown table and the
PNG plots. No timing is asserted. ``compare_samplers`` trains on a tiny synthetic text written here,
so nothing depends on the shared WikiText-2 copy or the network.
"""

from __future__ import annotations

import json
import random
import subprocess
import sys
from pathlib import Path

import pytest
from _env import offline_env

REPO = Path(__file__).resolve().parents[1]
BENCH = REPO / "recipes" / "benchmarks"

ENV_KEYS = {"device", "device_type", "torch", "transformers", "hf_midx", "git", "timestamp", "cuda", "accelerate",
            "triton", "liger_kernel", "cut_cross_entropy"}  # fmt: skip
ROW_KEYS = {
    "op",
    "provider",
    "metric",
    "unit",
    "x_name",
    "x_value",
    "y_p50",
    "device",
    "hf_midx_version",
    "torch_version",
    "git_commit",
}


def run_bench(name: str, out: Path, *args: str) -> dict:
    env = offline_env(
        OMP_NUM_THREADS="1",  # tiny ops: one thread avoids oversubscribing a small shared runner
        MPLBACKEND="Agg",
    )
    proc = subprocess.run(
        [sys.executable, str(BENCH / f"{name}.py"), "--out", str(out), "--smoke", "--device", "cpu", *args],
        capture_output=True, text=True, env=env, cwd=REPO, timeout=300,
    )  # fmt: skip
    assert proc.returncode == 0, f"{name} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    assert f"== {name} ==" in proc.stdout and "device" in proc.stdout  # the header is printed
    payload = json.loads((out / f"{name}.json").read_text())
    assert payload["benchmark"] == name
    assert ENV_KEYS <= set(payload["environment"]), payload["environment"].keys()
    assert payload["environment"]["git"]["commit"]  # the repository's HEAD
    assert payload["settings"]["smoke"] is True and payload["settings"]["quick"] is True
    md = (out / f"{name}.md").read_text()
    assert md.startswith("# ") and "| --- |" in md and "device:" in md
    return payload


def check_rows(payload: dict) -> None:
    assert payload["rows"], "no result rows"
    for row in payload["rows"]:
        assert ROW_KEYS <= set(row), set(ROW_KEYS) - set(row)


def assert_pngs(out: Path, *names: str) -> None:
    for n in names:
        path = out / n
        assert path.is_file(), f"missing plot {n}; have {sorted(p.name for p in out.iterdir())}"
        assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_bench_head(tmp_path):
    p = run_bench("bench_head", tmp_path, "--default_extra_m", "5")
    check_rows(p)
    cases = {r["case"] for r in p["results"]}
    assert "midx-default-m5/per-query" in cases and p["settings"]["default_extra_m"] == [5]
    assert {
        "hf",
        "torch-chunked",
        "midx-rq/per-query",
        "midx-rq/shared",
        "midx-pq/per-query",
        "midx-pq/shared",
        "uniform/per-query",
        "unigram/shared",
        "midx-default/per-query",
        "midx-default/shared",
    } <= cases
    for r in p["results"]:
        assert "skipped" in r or {"ms", "peak_bytes", "speedup_vs_hf", "memory_ratio_vs_hf"} <= set(r)
        assert "skipped" in r or r["fastest_exact"] in ("hf", "torch-chunked", "torch-chunked-512")
        if r["case"].startswith("midx-default") and "ms" in r:
            assert r["flop_ratio"] > 0 and "sampling_ms" in r
        elif r["case"].startswith("midx") and "ms" in r:
            st = p["settings"]
            n = st["num_samples"] if r["case"].endswith("per-query") else st["pool_size"]
            assert r["flop_ratio"] == pytest.approx((n + 2 * st["codebook_size"]) / r["V"])  # the ideal (M + 2K) / V
            assert "sampling_ms" in r
    assert {b["sampler"] for b in p["index_build"]} == {"midx-rq", "midx-pq", "midx-default"}
    assert {t["status"] for t in p["targets"]} <= {"met", "missed", "not measured"}
    assert_pngs(tmp_path, "bench_head_D64.png")


def test_bench_sampling(tmp_path):
    p = run_bench("bench_sampling", tmp_path)
    check_rows(p)
    import hf_midx

    measured = {r["sampler"] for r in p["results"] if "ms" in r}
    assert measured == set(hf_midx.SAMPLERS)
    # the exhaustive baselines are capped in V, and say so
    assert any("skipped" in r and r["sampler"] in ("sphere", "rff", "midx-exact") for r in p["results"])
    flat = {(f["sampler"], f["T"]) for f in p["summary"]["flatness"]}
    assert ("midx-rq", 64) in flat and ("midx-pq", 64) in flat
    assert {(b["quantizer"], b["backend"]) for b in p["builds"] if b["sampler"].startswith("index-")} >= {
        ("rq", "torch"),
        ("pq", "torch"),
    }
    assert "per_1000_queries" in p["summary"]
    assert_pngs(tmp_path, "bench_sampling_time.png", "bench_sampling_build.png")


def test_bench_kl(tmp_path):
    p = run_bench("bench_kl", tmp_path)
    check_rows(p)
    assert [s["label"] for s in p["sources"]] == ["trained", "random"]
    assert p["settings"]["source"] == "synthetic"  # no --model_dir, and quick does not train
    for s in p["sources"]:
        by = {(r["sampler"], r["K"], r.get("codebooks")) for r in s["results"]}
        assert ("midx-rq", 8, "kmeans") in by and ("midx-rq", 16, "learned") in by and ("uniform", None, None) in by
        for r in s["results"]:
            assert {"kl_qp", "kl_pq", "grad_bias_hidden", "grad_se_hidden", "grad_bias_weight"} <= set(r)
        exact = [r["kl_qp"] for r in s["results"] if r["sampler"] == "midx-exact"]
        assert exact and max(abs(x) for x in exact) < 1e-3  # Theorem 1: the exact sampler is the softmax
    assert_pngs(tmp_path, "bench_kl_cumulative_trained.png", "bench_kl_cumulative_random.png", "bench_kl_vs_K.png")


def _tiny_corpus(tmp_path: Path) -> Path:
    rng = random.Random(0)
    words = [f"w{i}" for i in range(300)]
    zipf = [1.0 / (i + 1) for i in range(len(words))]
    data = tmp_path / "data"
    data.mkdir()
    for split, lines in (("train", 400), ("valid", 60), ("test", 60)):
        text = "\n".join(" ".join(rng.choices(words, zipf, k=rng.randint(3, 15))) for _ in range(lines))
        (data / f"{split}.txt").write_text(text + "\n")
    return data


def test_compare_samplers(tmp_path):
    data = _tiny_corpus(tmp_path)
    out = tmp_path / "out"
    p = run_bench("compare_samplers", out, "--data_dir", str(data))
    check_rows(p)
    samplers = p["settings"]["samplers"]
    assert samplers[0] == "full" and "midx-rq" in samplers and "midx-rq-learned" in samplers
    for s in samplers:
        run = p["equal_epochs"][s]
        assert run["error"] is None, run["error"]
        assert run["test_perplexity"] > 1 and run["curve"] and run["train_time_s"] is not None
        assert (out / s / "results.json").is_file()
        wall = p["equal_wall_clock"][s]
        assert wall.get("error") is None and wall["test_perplexity"] > 1
    assert p["wall_clock_budget_s"] == pytest.approx(p["equal_epochs"]["full"]["train_time_s"])
    assert p["paper_test_perplexity"]["midx-rq"] == pytest.approx(180.9055)
    md = (out / "compare_samplers.md").read_text()
    assert "180.8" in md and "equal wall-clock" in md
    assert_pngs(out, "compare_samplers_valid_ppl.png")


def test_bench_e2e(tmp_path):
    p = run_bench("bench_e2e", tmp_path, "--default_extra_m", "5")
    check_rows(p)
    cases = {r["case"] for r in p["results"] if "tokens_per_s" in r}
    # cce and liger need a GPU: on CPU they are left out with a printed line, not measured.
    assert cases == {"hf-full", "exact-chunked", "midx-default", "midx-default-m5", "midx-rq", "midx-rq-shared",
                     "uniform"}  # fmt: skip
    by_case = {r["case"]: r for r in p["results"]}
    assert by_case["midx-default-m5"]["num_samples"] == 5
    assert by_case["midx-default-m5"]["sampler"] == by_case["midx-default"]["sampler"]
    for r in p["results"]:
        assert r["tokens_per_s"] > 0 and r["peak_bytes"] >= 0 and "speedup_vs_hf" in r
        assert r["best_exact"] in ("hf-full", "exact-chunked") and r["speedup_vs_best_exact"] > 0
    assert_pngs(tmp_path, "bench_e2e.png")


def test_profile_head(tmp_path):
    p = run_bench("profile_head", tmp_path)
    assert p["ops"] and all(o["calls"] >= 1 for o in p["ops"])
    assert p["settings"]["config"]["sampler"].startswith("midx")
    assert "Self CPU" in (tmp_path / "profile_head.md").read_text()


def test_gpu_check_script_is_valid_bash():
    """The one-call GPU script parses (it runs only where a GPU is: recipes/benchmarks/gpu_check.sh)."""
    proc = subprocess.run(["bash", "-n", str(BENCH / "gpu_check.sh")], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr


@pytest.mark.parametrize("bad", ["0", "-5", "two"])
def test_default_extra_m_rejects_what_is_not_a_number_of_negatives(bad, capsys):
    sys.path.insert(0, str(BENCH))
    try:
        import bench_e2e
        import bench_head
    finally:
        sys.path.remove(str(BENCH))
    for bench in (bench_head, bench_e2e):
        with pytest.raises(SystemExit) as stop:
            bench.parse_args(["--default_extra_m", "5", bad])
        assert stop.value.code == 2
        assert f"--default_extra_m: expected an integer >= 1, got '{bad}'" in capsys.readouterr().err
    assert bench_e2e.parse_args(["--default_extra_m", "5"]).cases[-1] == "midx-default-m5"


def test_gpu_summary_tables_the_default_at_fewer_negatives(tmp_path):
    """gpu_summary.py: the acceptance rows, and the default head at --default_extra_m beside the default M and
    the fastest exact loss (head: a time, lower is better; training step: a throughput, higher is better)."""
    sys.path.insert(0, str(BENCH))
    try:
        import gpu_summary
    finally:
        sys.path.remove(str(BENCH))
    mib = 2**20

    def head(case, ms):
        return {"V": 262144, "D": 640, "case": case, "ms": ms, "peak_bytes": 100 * mib}

    head_rows = [head("hf", 80.0), head("cce", 20.0), head("liger", 25.0), head("midx-default/per-query", 4.0),
                 head("midx-default/shared", 2.0), head("midx-default-m5/per-query", 2.5)]  # fmt: skip

    def step(case, tps):
        return {"setting": "gemma3-270m", "case": case, "tokens_per_s": tps, "peak_bytes": 2**30,
                "speedup_vs_best_exact": tps / 1000.0, "best_exact": "cce"}  # fmt: skip

    e2e_rows = [step("hf-full", 500.0), step("cce", 1000.0), step("midx-default", 1500.0),
                step("midx-default-m5", 1800.0)]  # fmt: skip
    env = {"device": "test"}
    (tmp_path / "bench_head.json").write_text(json.dumps({"environment": env, "results": head_rows}))
    (tmp_path / "bench_e2e.json").write_text(json.dumps({"results": e2e_rows}))
    text = gpu_summary.main([str(tmp_path)])
    assert (tmp_path / "summary.md").read_text() == text
    lines = text.splitlines()
    assert "| Gemma-3-270M (262,144 x 640) | 80.0 ms, 100 MiB | 20.0 ms, 100 MiB | 25.0 ms, 100 MiB |" in text
    assert next(x for x in lines if x.startswith("| Gemma-3-270M (")).endswith("| 5.00x (cce) | 10.00x (cce) | 1.00x |")
    m5_head = next(x for x in lines if "midx-default-m5/per-query" in x)
    assert m5_head == "| Gemma-3-270M | midx-default-m5/per-query | 2.5 ms | 100 MiB | 1.60x | 8.00x (cce) |"
    m5_step = next(x for x in lines if "| midx-default-m5 |" in x)
    assert m5_step == "| gemma3-270m | midx-default-m5 | 1,800 tok/s | 1,024 MiB | 1.20x | 1.80x (cce) |"
    # Without extra M the summary has no such table.
    (tmp_path / "bench_head.json").write_text(json.dumps({"environment": env, "results": head_rows[:-1]}))
    (tmp_path / "bench_e2e.json").write_text(json.dumps({"results": e2e_rows[:-1]}))
    assert "fewer negatives" not in gpu_summary.main([str(tmp_path)])


def test_gpu_large_vocab_script_tables_its_runs(tmp_path):
    """gpu_large_vocab.sh at DEVICE=cpu: tiny runs of the three configurations, as parallel processes, and
    synthetic_curves' table of them, with unigram as the paired reference and the full softmax beside it."""
    env = offline_env(DEVICE="cpu", SEEDS="1", RESULTS=str(tmp_path / "out"), OMP_NUM_THREADS="1",
                      PYTHON=sys.executable)  # fmt: skip
    proc = subprocess.run(["bash", str(BENCH / "gpu_large_vocab.sh")], capture_output=True, text=True, env=env,
                          timeout=600)  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "runs finished: 3 of 3" in proc.stdout
    table = json.loads((tmp_path / "out" / "synthetic_curves.json").read_text())
    labels = {r["label"].split()[0] for r in table["runs"]}
    assert labels == {"full", "midx-rq", "unigram"}
    assert all(r["seed"] == 0 and r["vocab_size"] == 3000 for r in table["runs"])
    assert (tmp_path / "out" / "synthetic_curves_v3000.png").stat().st_size > 0


def test_compare_samplers_parallel_runs_and_variants(tmp_path):
    """--parallel trains the equal-epochs runs side by side (subprocesses) with the same perplexities as
    one at a time; midx-rq-shared trains with a shared pool of --pool_size; misuse is refused."""
    data = _tiny_corpus(tmp_path)
    common = ("--data_dir", str(data), "--samplers", "full", "midx-rq-shared", "--pool_size", "64", "--no_plots")
    side = run_bench("compare_samplers", tmp_path / "side", *common, "--parallel", "2", "--wall_clock", "off")
    one = run_bench("compare_samplers", tmp_path / "one", *common, "--launcher", "subprocess", "--wall_clock", "off")
    assert side["settings"]["parallel"] == 2 and side["equal_wall_clock"] == {}
    for s in ("full", "midx-rq-shared"):
        assert side["equal_epochs"][s]["error"] is None
        assert side["equal_epochs"][s]["test_perplexity"] == pytest.approx(one["equal_epochs"][s]["test_perplexity"])
    cfg = json.loads((tmp_path / "side" / "midx-rq-shared" / "midx_config.json").read_text())
    assert (cfg["negatives"], cfg["num_samples"], cfg["sampler"]) == ("shared", 64, "midx-rq")

    script = [sys.executable, str(BENCH / "compare_samplers.py"), "--smoke", "--out", str(tmp_path / "bad")]
    for args, message in (
        (["--parallel", "2"], "--wall_clock off"),
        (["--wall_clock_samplers", "lsh"], "not in --samplers"),
        (["--pool_size", "0"], "--pool_size must be >= 1"),
    ):
        proc = subprocess.run([*script, *args], capture_output=True, text=True, env=offline_env(), cwd=REPO, timeout=120)
        assert proc.returncode != 0 and message in proc.stderr, proc.stderr[-2000:]


def test_bench_refresh(tmp_path):
    p = run_bench("bench_refresh", tmp_path, "--vocab", "5000", "--backends", "torch")
    got = {(r["backend"], r["variant"]) for r in p["results"]}
    assert got == {("torch", "subsample"), ("torch", "all-rows")}
    for r in p["results"]:
        assert r["warm_rebuild_s"] > 0 and r["distortion"] > 0 and r["kl_pq@1.0"] >= 0
    assert (tmp_path / "bench_refresh.md").read_text().count("| torch |") == 2


def test_synthetic_gradient_exact_reference_and_estimates():
    """The yardstick of synthetic_gradient.py: the full softmax's gradients and data noise, and the bias and
    noise read from R draws (a statistical check on draws of known bias and spread)."""
    import math

    import torch

    from recipes.benchmarks import synthetic_gradient as sg

    gen = torch.Generator().manual_seed(0)
    s, v, d = 6, 11, 4
    z, w = torch.randn(s, d, generator=gen), torch.randn(v, d, generator=gen)
    y = torch.randint(v, (s,), generator=gen)
    exact = sg.exact_gradients(z, w, y)
    zr, wr = z.double().requires_grad_(True), w.double().requires_grad_(True)
    torch.nn.functional.cross_entropy(zr @ wr.t(), y, reduction="sum").backward()
    torch.testing.assert_close(exact["g_w"], wr.grad)
    torch.testing.assert_close(exact["g_z"], zr.grad)
    # Data noise: the spread of the batch gradient from the S per-context gradients, computed by brute force.
    per = []
    for t in range(s):
        wt = w.double().clone().requires_grad_(True)
        torch.nn.functional.cross_entropy(z[t : t + 1].double() @ wt.t(), y[t : t + 1]).backward()
        per.append(wt.grad.flatten())
    per = torch.stack(per)
    spread = s * (per - per.mean(0)).pow(2).sum(1).mean()
    assert math.isclose(exact["data_noise"], spread.sqrt().item(), rel_tol=1e-9)

    # Draws of known bias b and per-draw spread sigma^2 (summed over coordinates): the estimates recover both.
    g = exact["g_w"]
    bias = 0.3 * g.norm() * torch.nn.functional.normalize(torch.randn(g.shape, generator=gen, dtype=torch.float64), dim=None)
    sigma = 0.5 * g.norm().item()
    repeats, trials = 8, 40
    got_bias, got_noise = [], []
    for _ in range(trials):
        draws = g + bias + sigma / math.sqrt(g.numel()) * torch.randn((repeats, *g.shape), generator=gen, dtype=torch.float64)
        mean = draws.mean(0)
        var = (draws.pow(2).sum((1, 2)).mean() - mean.pow(2).sum()).item() * repeats / (repeats - 1)
        sampled = {"mean_w": mean, "var_w": var, "mean_z": exact["g_z"], "var_z": torch.zeros(s, dtype=torch.float64)}
        out = sg.compare(exact, sampled, repeats)
        got_bias.append(out["bias_w"])
        got_noise.append(out["noise_w"])
        assert out["bias_z"] == 0 and out["noise_z"] == 0
    # Means over 40 trials: the noise within 2% of 0.5, the bias within 5% of 0.3 (about 3 sd each; without the
    # variance correction the bias would read 0.35 and the noise 0.47).
    assert abs(sum(got_noise) / trials - 0.5) < 0.01, sum(got_noise) / trials
    assert abs(sum(got_bias) / trials - 0.3) < 0.015, sum(got_bias) / trials


def test_synthetic_convergence(tmp_path):
    """Every configuration learns from the same start (paired seeds), and the table's differences are its runs'."""
    configs = ["full", "unigram H0", "midx-rq H0", "midx-rq"]
    p = run_bench("synthetic_convergence", tmp_path, "--seeds", "2", "--configs", *configs)
    assert_pngs(tmp_path, "synthetic_convergence.png")
    runs = {(r["config"], r["seed"]): r for r in p["runs"]}
    assert set(runs) == {(c, s) for c in configs for s in (0, 1)}
    for r in runs.values():
        curve = r["curve"]
        assert curve[0]["step"] == 0 and curve[-1]["step"] == p["settings"]["steps"]
        assert curve[-1]["ratio"] < 0.8 * curve[0]["ratio"], (r["config"], curve[0], curve[-1])  # it learned
    for seed in (0, 1):  # same initial weights for every configuration of a seed; another seed, others
        assert len({runs[(c, seed)]["curve"][0]["ratio"] for c in configs}) == 1
    assert runs[("full", 0)]["curve"][0]["ratio"] != runs[("full", 1)]["curve"][0]["ratio"]
    rows = {row["config"]: row for row in p["summary"]}
    expected = [100 * (runs[("midx-rq H0", s)]["ratio"] / runs[("unigram H0", s)]["ratio"] - 1) for s in (0, 1)]
    assert rows["midx-rq H0"]["vs_unigram_pct"] == pytest.approx(expected, rel=1e-12)
    assert "vs_unigram_pct" not in rows["midx-rq"]  # no unigram with the exact head was trained
    to_full = 100 * (runs[("midx-rq", 0)]["ratio"] / runs[("full", 0)]["ratio"] - 1)
    assert rows["midx-rq"]["vs_full_pct"][0] == pytest.approx(to_full)
    # The chain's own perplexity on the held-out pairs is near its entropy rate (a sample of 1,024 pairs).
    assert 0.85 < p["oracle_test_perplexity"] / p["optimum"] < 1.15

    # Seeds run in separate processes and merged give the table of the single process.
    for seed in (0, 1):
        run_bench("synthetic_convergence", tmp_path / f"s{seed}", "--seed", str(seed), "--configs", *configs[1:3])
    files = [str(tmp_path / f"s{seed}" / "synthetic_convergence.json") for seed in (1, 0)]
    merged = run_bench("synthetic_convergence", tmp_path / "merged", "--merge", *files)
    assert_pngs(tmp_path / "merged", "synthetic_convergence.png")
    assert [(r["config"], r["seed"]) for r in merged["runs"]] == [(c, s) for s in (0, 1) for c in configs[1:3]]
    for r in merged["runs"]:  # the same training (the seconds are timings: not compared)
        ref = runs[(r["config"], r["seed"])]["curve"]
        assert [(q["step"], q["ratio"]) for q in r["curve"]] == [(q["step"], q["ratio"]) for q in ref]
    merged_rows = {row["config"]: row for row in merged["summary"]}
    assert merged_rows["midx-rq H0"]["vs_unigram_pct"] == pytest.approx(expected, rel=1e-12)
    assert [s["seeds"] for s in merged["settings"]["merged_from"]] == [[1], [0]]
    assert merged["optimum"] == p["optimum"] and merged["oracle_test_perplexity"] == p["oracle_test_perplexity"]
    # --configs keeps those configurations only (here the full softmax of the first run).
    files = [str(tmp_path / "synthetic_convergence.json"), *files]
    only = run_bench("synthetic_convergence", tmp_path / "only", "--merge", *files, "--configs", "full", "midx-rq")
    assert [(r["config"], r["seed"]) for r in only["runs"]] == [(c, s) for s in (0, 1) for c in ("full", "midx-rq")]
    assert [s["seeds"] for s in only["settings"]["merged_from"]] == [[0, 1], [], []]


def test_synthetic_convergence_bias_folded_into_the_head(tmp_path):
    """--bias folded is the same model trained by the same steps, with the bias inside the proposal's index:
    the full softmax and unigram (which never look at the index) train exactly as with --bias separate, MIDX
    differs once the proposal is rebuilt from a learned bias, and MIDX runs of both settings do not share a
    table (the others do)."""
    configs = ["full", "unigram H0", "midx-rq H0"]
    out = {b: run_bench("synthetic_convergence", tmp_path / b, "--bias", b, "--refresh_every", "10", "--configs",
                        *configs) for b in ("folded", "separate")}  # fmt: skip
    assert out["folded"]["settings"]["bias"] == "folded" and out["separate"]["settings"]["bias"] == "separate"
    curves = {b: {r["config"]: [q["ratio"] for q in r["curve"]] for r in p["runs"]} for b, p in out.items()}
    for name in ("full", "unigram H0"):
        assert curves["folded"][name] == pytest.approx(curves["separate"][name], rel=1e-6)
    assert curves["folded"]["midx-rq H0"][0] == curves["separate"]["midx-rq H0"][0]  # the same start
    assert curves["folded"]["midx-rq H0"][-1] != curves["separate"]["midx-rq H0"][-1]
    # --tied: E is W's first D columns, so the start differs; tied and untied runs do not share a table.
    tied = run_bench("synthetic_convergence", tmp_path / "tied", "--tied", "--refresh_every", "10", "--configs", "full")
    assert tied["settings"]["tied"] is True and out["folded"]["settings"]["tied"] is False
    curve = [q["ratio"] for q in tied["runs"][0]["curve"]]
    assert curve[-1] < 0.8 * curve[0] and curve[0] != curves["folded"]["full"][0]
    script = [sys.executable, str(BENCH / "synthetic_convergence.py"), "--smoke", "--out", str(tmp_path / "m")]
    files = [str(tmp_path / b / "synthetic_convergence.json") for b in ("folded", "separate")]
    proc = subprocess.run([*script, "--merge", *files, "--configs", "midx-rq H0"], capture_output=True, text=True,
                          env=offline_env(), timeout=120)  # fmt: skip
    assert proc.returncode != 0 and "bias = separate where" in proc.stderr, proc.stderr
    proc = subprocess.run([*script, "--merge", files[0], str(tmp_path / "tied" / "synthetic_convergence.json")],
                          capture_output=True, text=True, env=offline_env(), timeout=120)  # fmt: skip
    assert proc.returncode != 0 and "tied = True where" in proc.stderr, proc.stderr
    assert not (tmp_path / "m").exists()


def test_synthetic_convergence_refuses_impossible_sizes(tmp_path):
    script = [sys.executable, str(BENCH / "synthetic_convergence.py"), "--smoke", "--out", str(tmp_path)]
    proc = subprocess.run([*script, "--num_samples", "400"], capture_output=True, text=True, env=offline_env(),
                          timeout=120)  # fmt: skip
    assert proc.returncode == 2 and "--num_samples 400 must be below half of --vocab_size 500" in proc.stderr
    assert not (tmp_path / "synthetic_convergence.json").exists()


def test_synthetic_convergence_merge_refuses_mismatched_runs(tmp_path):
    """--merge refuses a run tabled twice and runs of other settings, naming the file and the setting."""
    script = [sys.executable, str(BENCH / "synthetic_convergence.py"), "--smoke", "--out", str(tmp_path / "out")]
    env = {"device": "cpu", "device_type": "cpu", "hf_midx": "0", "torch": "0", "transformers": "0", "faiss": None,
           "liger_kernel": None, "python": "3", "git": {"commit": "abc", "dirty": False}, "timestamp": "now"}
    payload = {"benchmark": "synthetic_convergence", "environment": env,
               "settings": {"vocab_size": 500, "dim": 16, "steps": 40, "batch": 256, "lr": 0.01, "num_samples": 20,
                            "codebook_size": 32, "refresh_every": 100, "eval_pairs": 1024, "eval_every": 2},
               "runs": [{"config": "unigram H0", "seed": 0, "ratio": 1.5, "seconds": 1.0,
                         "curve": [{"step": 0, "seconds": 0.0, "ratio": 9.0},
                                   {"step": 40, "seconds": 1.0, "ratio": 1.5}]}]}  # fmt: skip
    a, b, c = (tmp_path / f"{x}.json" for x in "abc")
    a.write_text(json.dumps(payload))
    b.write_text(json.dumps({**payload, "settings": {**payload["settings"], "steps": 80}}))
    c.write_text("{not json")
    # A file written before --bias existed kept the bias out of the index: its MIDX runs do not share a folded
    # table, its unigram runs do (they never read the index).
    old = tmp_path / "old.json"
    old.write_text(json.dumps({**payload, "runs": [{**payload["runs"][0], "config": "midx-rq H0", "seed": 1}]}))
    folded = tmp_path / "folded.json"
    folded.write_text(json.dumps({**payload, "settings": {**payload["settings"], "bias": "folded"},
                                  "runs": [{**payload["runs"][0], "config": "midx-rq H0"}]}))  # fmt: skip
    out = tmp_path / "merged"
    proc = subprocess.run([*script[:-1], str(out), "--merge", str(a), str(folded)], capture_output=True, text=True,
                          env={**offline_env(), "MPLBACKEND": "Agg"}, timeout=120)  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    merged = json.loads((out / "synthetic_convergence.json").read_text())
    assert merged["settings"]["bias"] == "folded"
    assert [(r["config"], r["seed"]) for r in merged["runs"]] == [("unigram H0", 0), ("midx-rq H0", 0)]
    d = tmp_path / "d.json"  # a run entry without its curve
    d.write_text(json.dumps({**payload, "runs": [{"config": "unigram H0", "seed": 0, "ratio": 1.5}]}))
    for files, message in (([a, a], "unigram H0 seed 0 is in both"), ([a, b], "steps = 80 where"),
                           ([c], "not a synthetic_convergence.json output"), ([d], "a run without"),
                           ([old, folded], "bias = folded where")):  # fmt: skip
        proc = subprocess.run([*script, "--merge", *map(str, files)], capture_output=True, text=True,
                              env=offline_env(), timeout=120)  # fmt: skip
        assert proc.returncode != 0 and message in proc.stderr, proc.stderr
    assert not (tmp_path / "out").exists()
