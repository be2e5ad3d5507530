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


def test_bench_frozen(tmp_path):
    """The frozen-head timing (issue 55) runs its alternating pairs and writes the speed-up; none is asserted."""
    p = run_bench("bench_frozen", tmp_path)
    check_rows(p)
    assert {r["case"] for r in p["results"]} == {"trainable", "frozen"}
    assert len(p["ratios"]) == p["settings"]["pairs"] and p["speedup"] > 0


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
    `recipe_runs.py curves`' table of them, with unigram as the paired reference and the full softmax beside it."""
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


def test_recipe_runs_takes_one_question_per_call(tmp_path):
    """recipe_runs.py: a subcommand is required; heldout scores run folders or merges earlier outputs, one of the two;
    curves refuses a folder that is not a finished run (the tables of real runs: test_recipes.py, gpu_large_vocab)."""
    from recipes.benchmarks import recipe_runs

    with pytest.raises(SystemExit):
        recipe_runs.main([])
    with pytest.raises(SystemExit, match="not both or neither"):
        recipe_runs.main(["heldout", "--out", str(tmp_path)])
    with pytest.raises(SystemExit, match="not a finished large_vocab or wikitext2 run"):
        recipe_runs.main(["curves", str(tmp_path), "--out", str(tmp_path / "out")])


def test_short_runs_trains_scores_and_merges(tmp_path):
    """short_runs.py at a tiny V: the full softmax and the default from scratch and fine-tuning, then --merge."""
    env = offline_env(OMP_NUM_THREADS="1", MPLBACKEND="Agg")
    script = [sys.executable, str(BENCH / "short_runs.py")]
    common = ["--vocab", "600", "--steps", "4", "--seeds", "0", "--configs", "full", "default", "--log_every", "2"]
    for corpus in ("zipf", "finetune"):
        proc = subprocess.run([*script, "--out", str(tmp_path / corpus), "--corpus", corpus, "--pretrain_steps", "2",
                               *common], capture_output=True, text=True, env=env, cwd=REPO, timeout=300)
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    runs = json.loads((tmp_path / "zipf" / "short_runs.json").read_text())["runs"]
    assert [r["config"] for r in runs] == ["full", "default"]
    for r in runs:
        assert r["perplexity"] > 1 and r["train_seconds"] > 0
        assert any("probe/unseen_mass" in p for p in r["curve"])
    assert any("midx/ess" in p for p in runs[1]["curve"])  # the callback's coverage diagnostics
    files = [str(tmp_path / c / "short_runs.json") for c in ("zipf", "finetune", "zipf")]
    proc = subprocess.run([*script, "--out", str(tmp_path / "merged"), "--merge", *files],
                          capture_output=True, text=True, env=env, cwd=REPO, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    merged = json.loads((tmp_path / "merged" / "short_runs.json").read_text())
    assert len(merged["runs"]) == 4 and len(merged["repeats"]) == 2  # the zipf file twice: its runs once
    rows = {(r["corpus"], r["config"]): r for r in merged["summary"]}
    assert rows[("zipf", "full")]["vs_full_pct"] == 0.0 and rows[("finetune", "default")]["vs_full_pct"] is not None
    assert "| finetune | 600 | 4 | default |" in (tmp_path / "merged" / "short_runs.md").read_text()
    assert (tmp_path / "merged" / "short_runs.png").stat().st_size > 0


def _saved_word_model(folder: Path) -> Path:
    """A tiny random GPT-2 with a word-level tokenizer of the shipped WikiText-2 sample, saved as the recipe saves."""
    from transformers import AutoModelForCausalLM, GPT2Config

    from recipes import lm_data

    tokenizer = lm_data.build_word_level_tokenizer(
        lm_data.read_lines(REPO / "recipes" / "data" / "wikitext2_sample" / "train.txt"))
    config = GPT2Config(vocab_size=len(tokenizer), n_embd=32, n_layer=1, n_head=2, n_positions=64, bos_token_id=1,
                        eos_token_id=1)
    AutoModelForCausalLM.from_config(config).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


def test_loss_bias_and_exact_forward_write_their_figures(tmp_path):
    model_dir = _saved_word_model(tmp_path / "model")
    env = offline_env()
    bias = subprocess.run([sys.executable, str(BENCH / "loss_bias.py"), "--model_dir", str(model_dir), "--draws", "3",
                           "--output", str(tmp_path / "bias")], env=env, capture_output=True, text=True, timeout=300)
    assert bias.returncode == 0, bias.stderr[-3000:]
    result = json.loads((tmp_path / "bias" / "loss_bias.json").read_text())
    assert len(result["differences"]) == 3 and result["vocab_size"] == json.loads(
        (model_dir / "config.json").read_text())["vocab_size"]
    assert "sampled - exact" in bias.stdout and (tmp_path / "bias" / "loss_bias.md").is_file()
    forward = subprocess.run(
        [sys.executable, str(BENCH / "exact_forward.py"), "--model_dir", str(model_dir), "--draws", "3", "--rows", "2",
         "--vocab", "4096", "--dim", "32", "--tokens", "64", "--repeats", "1", "--output", str(tmp_path / "ef")],
        env=env, capture_output=True, text=True, timeout=300)  # fmt: skip
    assert forward.returncode == 0, forward.stderr[-3000:]
    result = json.loads((tmp_path / "ef" / "exact_forward.json").read_text())
    for group in result["gradient"]["groups"].values():  # an untrained model: the draws still point the right way
        assert 0.5 < group["cosine_mean"] <= 1.0 + 1e-6
    assert len(result["head_time"]["seconds_min"]) == 3
    small = subprocess.run([sys.executable, str(BENCH / "loss_bias_small.py"), "--vocab", "512", "--at", "0", "2",
                            "--draws", "3", "--output", str(tmp_path / "small")],
                           env=env, capture_output=True, text=True, timeout=300)  # fmt: skip
    assert small.returncode == 0, small.stderr[-3000:]
    points = json.loads((tmp_path / "small" / "loss_bias_small.json").read_text())["points"]
    assert [p["step"] for p in points] == [0, 2] and all(0 < p["head_mass"] < 1 for p in points)
