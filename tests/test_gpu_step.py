"""recipes/benchmarks/gpu_step.py and gpu_step.sh on the CPU, tiny sizes: every section runs and writes its rows
(the figures mean nothing here); a competitor that cannot run is a row with its reason, and each hf_midx row
carries the cost model's projection."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from recipes.benchmarks import gpu_step

REPO = Path(__file__).resolve().parents[1]


def test_every_section_writes_its_rows(tmp_path):
    base = ["--smoke", "--device", "cpu", "--out", str(tmp_path)]
    micro = gpu_step.main(["--section", "micro", *base])["rows"]
    one_bag, many, gemv = micro
    assert "one bag" in one_bag["case"] and any("serial" in f for f in one_bag["flags"]) and not many["flags"]
    assert all(r["ms"] > 0 and r["projected_ms"] > 0 for r in micro)
    (parts,) = gpu_step.main(["--section", "parts", *base])["rows"]
    assert parts["ms"] > 0 and {"draw", "tail", "candidate loss"} <= set(parts["parts"])
    assert all(p["measured_ms"] is not None for p in parts["parts"].values()) and len(parts["ops"]) == parts["launches"]
    head = gpu_step.main(["--section", "head", "--models", "gemma3-270m", *base])["rows"]
    cases = {r["case"]: r for r in head}
    assert set(cases) == {"midx-default", "midx-default/cuda-graph", *gpu_step.COMPETITORS}
    assert cases["midx-default"]["ms"] > 0 and cases["midx-default"]["projected_ms"] > 0
    default, graph = cases["midx-default"], cases["midx-default/cuda-graph"]
    assert 0 < graph["calibrated_ms"] < default["calibrated_ms"] and "needs CUDA" in graph["skipped"]
    assert all(r["exact_floor_ms"] == 6 * r["T"] * r["V"] * r["D"] / 990e12 * 1e3 for r in head)
    assert "needs CUDA" in cases["cce"]["skipped"] and "needs CUDA" in cases["liger"]["skipped"]
    assert all(r["git_commit"] == head[0]["git_commit"] and r["device"] for r in head)
    merged = gpu_step.main(["--section", "merge", "--out", str(tmp_path)])
    assert merged["sections"] == ["micro", "parts", "head"] and len(merged["rows"]) == len(micro) + 1 + len(head)
    assert "midx-default" in (tmp_path / "gpu_step.md").read_text() and "exact floor" in (tmp_path / "gpu_step.md").read_text()


def test_the_training_step_section(tmp_path):
    rows = gpu_step.main(["--section", "train", "--smoke", "--device", "cpu", "--out", str(tmp_path)])["rows"]
    cases = {r["case"]: r for r in rows}
    assert set(cases) == {"midx-default", "hf-full", *gpu_step.COMPETITORS}
    assert cases["midx-default"]["tokens_per_s"] > 0 and cases["hf-full"]["tokens_per_s"] > 0
    assert "speedup_vs_fastest_other" in cases["midx-default"]


def test_the_shell_command_on_the_cpu(tmp_path):
    env = {**os.environ, "DEVICE": "cpu", "RESULTS": str(tmp_path), "SECTIONS": "micro", "PYTHON": sys.executable}
    run = subprocess.run(["bash", "recipes/benchmarks/gpu_step.sh"], cwd=REPO, env=env, capture_output=True, text=True,
                         timeout=300)  # fmt: skip
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-2000:]
    merged = json.loads((tmp_path / "gpu_step.json").read_text())
    assert merged["sections"] == ["micro"] and merged["rows"][0]["device"]
