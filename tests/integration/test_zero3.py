"""DeepSpeed ZeRO-3 as users run it: two CPU processes (gloo, ``DS_ACCELERATOR=cpu``) started by torchrun run
tests/_zero3_worker.py once for a tiny Llama (untied head, per-query negatives) and a tiny GPT-2 (tied head,
shared negatives, learned codebooks), V = 4,096.

Per architecture the worker trains the same 6 steps under DDP (the reference), ZeRO-2, ZeRO-3 with the model
loaded before the ``TrainingArguments`` (MidxTrainer) and ZeRO-3 with the ``TrainingArguments`` first (so that
the head weight is already partitioned when it is wrapped; a plain Trainer with ``MidxCallback.install``),
resumes ZeRO-3 from a mid-run checkpoint, and loads the saved model with plain transformers.
"""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

import hf_midx
from _env import offline_env
from _models import tiny_model
from hf_midx.integration.head import find_head
from hf_midx.integration.zero import full_shape, gathered, is_partitioned, local_part

WORKER = Path(__file__).resolve().parents[1] / "_zero3_worker.py"
ARCHS = ("llama", "gpt2")
STEPS = range(1, 7)


def _max_diff(a: dict, b: dict, steps) -> float:
    return max(abs(a[str(s)] - b[str(s)]) for s in steps)


@pytest.fixture(scope="module")
def zero3_result(tmp_path_factory):
    if importlib.util.find_spec("deepspeed") is None:  # found, not imported: the workers import it
        pytest.skip("deepspeed is not installed (pip install -e '.[dev]')")
    if not dist.is_available() or not dist.is_gloo_available():
        pytest.skip("torch built without gloo")
    out = tmp_path_factory.mktemp("zero3")
    env = offline_env(OMP_NUM_THREADS="1", CUDA_VISIBLE_DEVICES="", DS_ACCELERATOR="cpu")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2"]
    cmd += [str(WORKER), str(out), *ARCHS]
    proc = subprocess.run(cmd, env=env, cwd=WORKER.parent.parent, capture_output=True, text=True, timeout=400)
    output = (proc.stdout + proc.stderr)[-6000:]
    assert proc.returncode == 0, f"torchrun exited with {proc.returncode}:\n{output}"
    result = json.loads((out / "result.json").read_text())
    assert result["world_size"] == 2 and result["backend"] == "gloo"
    return result


@pytest.mark.parametrize("arch", ARCHS)
def test_zero3_trains_as_ddp_in_both_orders(zero3_result, arch):
    r = zero3_result[arch]
    assert r["partitioned_at_wrap"], "TrainingArguments first: transformers should have loaded the model partitioned"
    for run in ("zero2", "before", "after"):
        assert sorted(r[run], key=int) == [str(s) for s in STEPS], run
        diff = _max_diff(r[run], r["ddp"], STEPS)
        assert diff <= 1e-4, f"{arch} {run}: losses differ from DDP's by {diff:.2e}"
    # The runs trained: the weights moved (equal eval losses then compare trained weights, not initial ones).
    assert abs(r["eval_loss"] - r["initial_eval_loss"]) > 1e-3
    assert abs(r["eval_loss"] - r["ddp_eval_loss"]) <= 1e-4
    print(f"[zero3 {arch}] max |loss - DDP|: before {_max_diff(r['before'], r['ddp'], STEPS):.1e}, after "
          f"{_max_diff(r['after'], r['ddp'], STEPS):.1e}, zero2 {_max_diff(r['zero2'], r['ddp'], STEPS):.1e}; "
          f"seconds {r['seconds']}")


@pytest.mark.parametrize("arch", ARCHS)
def test_zero3_checkpoint_resumes_the_uninterrupted_run(zero3_result, arch):
    r = zero3_result[arch]
    files = set(r["checkpoint_files"])
    assert {"midx_state.safetensors", "midx_rng_state_0.safetensors", "midx_rng_state_1.safetensors"} <= files
    resumed = range(4, 7)  # the checkpoint is at step 3
    diff = _max_diff(r["resume"], r["before"], resumed)
    assert diff <= 1e-4, f"{arch}: the resumed run's losses differ from the uninterrupted run's by {diff:.2e}"
    assert r["resumed_sampler_equal"], "the resumed sampler state differs from the uninterrupted run's"
    assert "codebook_size: checkpoint 16, now 8" in r["other_config_error"]


@pytest.mark.parametrize("arch", ARCHS)
def test_zero3_saves_a_plain_model_and_prints(zero3_result, arch):
    r = zero3_result[arch]
    assert r["saved_head_type"] == "Linear"
    assert abs(r["saved_exact_loss"] - r["eval_loss"]) <= 1e-3
    for key in ("repr_partitioned", "repr_after_training"):
        assert "in_features=32, out_features=4096" in r[key], r[key]
    assert f"negatives='{r['negatives']}'" in r["repr_partitioned"]
    assert r["unwrapped"] == {"type": "Linear", "same_weight": True, "full_shape": [4096, 32]}


def test_whole_parameters_need_no_deepspeed(monkeypatch):
    monkeypatch.setitem(sys.modules, "deepspeed", None)  # any `import deepspeed` now raises ImportError
    weight = torch.nn.Parameter(torch.randn(5, 3))
    assert not is_partitioned(weight) and not is_partitioned(None)
    assert full_shape(weight) == (5, 3) and local_part(weight) is weight
    with gathered([weight, None]):  # nothing partitioned: a no-op that imports nothing
        pass


def test_the_head_keeps_its_sizes_when_its_weight_is_a_slice():
    # What ZeRO-3 does to the Parameter between forwards (its data becomes a (0,) slice), without DeepSpeed.
    model = hf_midx.wrap(tiny_model("llama"), num_samples=16, codebook_size=8, exact_head=0, mix_weight=0.0)
    head = find_head(model)
    head.weight.data = torch.empty(0)
    assert (head.num_classes, head.in_features, head.out_features) == (400, 32, 400)
    assert "in_features=32, out_features=400" in repr(model)
    # A custom loop calling the loss outside the engine's forward (where DeepSpeed gathers it): one clear error.
    with pytest.raises(ValueError, match="partitioned slice of shape \\(0,\\).*GatheredParameters"):
        head.loss(torch.randn(4, 32), torch.randint(400, (4,)))
