"""MidxTrainer under DDP: two CPU processes (gloo) started by torchrun run tests/_ddp_worker.py.

The worker checks, after every refresh, that both ranks hold bit-identical sampler tensors (codebooks,
codes, bucket tables) and learned codebooks although their samplers were built from different initial
weights, that under the default ``refresh_every_steps="auto"`` they rebuild at the same steps although their
own measurements choose different intervals, and that the ranks draw different negatives. ``accelerate launch --cpu --num_processes 2``
would start a single process, so torchrun is used, and each worker refuses to run with world size 1.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch.distributed as dist

from _env import offline_env

WORKER = Path(__file__).resolve().parents[1] / "_ddp_worker.py"


@pytest.mark.skipif(not dist.is_available() or not dist.is_gloo_available(), reason="torch built without gloo")
def test_two_processes_share_the_index_and_draw_their_own_negatives(tmp_path):
    # A plain CPU run: no accelerator settings inherited from the calling shell.
    env = offline_env(OMP_NUM_THREADS="1", CUDA_VISIBLE_DEVICES="")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2"]
    cmd += [str(WORKER), str(tmp_path)]
    proc = subprocess.run(cmd, env=env, cwd=WORKER.parent.parent, capture_output=True, text=True, timeout=300)
    output = (proc.stdout + proc.stderr)[-6000:]
    assert proc.returncode == 0, f"torchrun exited with {proc.returncode}:\n{output}"

    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1)]
    result = json.loads((tmp_path / "result.json").read_text())
    assert [r["rank"] for r in ranks] == [0, 1]
    assert result["ok"] and result["world_size"] == 2 and result["backend"] == "gloo"
    # The samplers started different (different initial weights), so equality is the trainer's doing.
    assert not result["samplers_equal_before_training"]
    checks = result["checks_after_refresh"]
    assert [c["step"] for c in checks] == [2, 4, 6] and all(c["refreshed"] for c in checks)
    for check in checks:
        keys = ("codebook1", "codebook2", "codes", "bucket_counts", "order", "offsets", "logged_kl")
        for key in (*keys, "logged_train_loss_exact"):
            assert check[key], f"step {check['step']}: {key} differs between ranks"
        assert check["learned.codebook1"] and check["learned.codebook2"], f"step {check['step']}: learned codebooks"
    assert all(result["final_state_equal"].values()) and result["model_weights_equal"]
    assert not result["negatives_equal"] and not result["generators_equal"]
    assert result["refreshes"] == 3
    # "auto": rank 0 measured an interval of 1, rank 1 of 2 (at the first choice and after each rebuild); both
    # rebuilt every 2 steps (the checks above) and logged that interval once.
    assert ranks[0]["local_intervals"] == [1] * 4 and ranks[1]["local_intervals"] == [2] * 4
    assert ranks[0]["logged_intervals"] == ranks[1]["logged_intervals"] == [2.0]
    files = set(result["checkpoint_files"])
    assert {"midx_state.safetensors", "midx_rng_state_0.safetensors", "midx_rng_state_1.safetensors"} <= files
    steps = [c["step"] for c in checks]
    print(f"[ddp] world_size=2 gloo; 'auto' refreshes at steps {steps} on both ranks (local choices 1 and 2); "
          "identical after them; negatives differ")
