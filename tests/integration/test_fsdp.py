"""FSDP2 on CPU: two processes (gloo) started by torchrun run tests/_fsdp_worker.py.

``torch.distributed.fsdp.fully_shard`` on the decoder layers and the root of a wrapped tiny Llama (untied
head): the head weight is a DTensor sharded by rows (and nothing keeps the unsharded one alive), the sampled loss trains (finite losses and sharded
gradients, the exact held-out loss falls), ``hf_midx.refresh_index`` gathers the weight, rebuilds on rank 0
and leaves both ranks with the same index (they differed before), and the exact evaluation agrees across
ranks and with the full-logits loss. (The Trainer's own FSDP plugin does not shard on CPU, so the loop is a
custom one.) DeepSpeed ZeRO-3 is not tested (no GPU here).
"""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest
import torch.distributed as dist

from _env import offline_env

WORKER = Path(__file__).resolve().parents[1] / "_fsdp_worker.py"


@pytest.mark.skipif(not dist.is_available() or not dist.is_gloo_available(), reason="torch built without gloo")
def test_fsdp2_sharded_head_trains_refreshes_and_evaluates(tmp_path):
    pytest.importorskip("torch.distributed.fsdp", reason="torch without FSDP2").fully_shard
    env = offline_env(OMP_NUM_THREADS="1", CUDA_VISIBLE_DEVICES="")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2", str(WORKER)]
    proc = subprocess.run(
        [*cmd, str(tmp_path)], env=env, cwd=WORKER.parent.parent, capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0, f"torchrun exited with {proc.returncode}:\n{(proc.stdout + proc.stderr)[-6000:]}"
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1)]
    for r in ranks:
        assert r["world_size"] == 2 and r["backend"] == "gloo"
        assert r["head_sharded"] and r["local_rows"] == r["vocab"] // 2 and r["full_weight_released"]
        assert r["index_differs_before_refresh"]
        assert [c["step"] for c in r["checks"]] == [4, 8, 12, 16, 20]
        for check in r["checks"]:
            assert all(v for k, v in check.items() if k not in ("step", "seconds")), check
        assert all(math.isfinite(x) for x in r["losses"]) and math.isfinite(r["exact_train_loss_last_batch"])
        assert r["exact_logits_width"] == 0
        assert r["exact_eval_loss"] == pytest.approx(r["full_eval_loss"], rel=1e-5)
        assert r["exact_eval_loss"] < r["exact_eval_loss_before"] - 0.1
    assert ranks[0]["exact_eval_loss"] == ranks[1]["exact_eval_loss"]
    assert ranks[0]["losses"] != ranks[1]["losses"]  # each rank trained on its own batches
    print(
        f"[fsdp2] sharded head {ranks[0]['local_rows']}/{ranks[0]['vocab']} rows per rank; sampled loss "
        f"{ranks[0]['losses'][0]:.3f} -> {ranks[0]['losses'][-1]:.3f}; exact held-out "
        f"{ranks[0]['exact_eval_loss_before']:.3f} -> {ranks[0]['exact_eval_loss']:.3f} on both ranks; "
        "index identical after each refresh_index"
    )
