"""One process of the two-process CPU test in tests/integration/test_distributed.py (run by torchrun, gloo backend).

Usage: python -m torch.distributed.run --standalone --nproc_per_node 2 tests/_ddp_worker.py OUT_DIR

Each rank builds a tiny GPT-2 from a *different* seed (DDP then syncs the weights, and MidxTrainer must
sync the samplers built from the different initial weights), trains 6 steps with learned codebooks and
the default refresh schedule, ``refresh_every_steps="auto"``, whose cost measurement is made to differ
between the ranks (rank 0's timing gives an interval of 1 step, rank 1's of 2: :data:`LOCAL_INTERVAL`), so
both must rebuild at steps 2, 4 and 6, the maximum; after every refresh it compares its sampler tensors and
learned codebooks with the other rank's, bit for bit. At the end it checks that the ranks draw different negatives and
writes OUT_DIR/rank<r>.json; rank 0 also writes OUT_DIR/result.json. Exits non-zero on any failure.
"""

from __future__ import annotations

import json
import os
import sys

os.environ.setdefault("HF_HUB_OFFLINE", "1")
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from transformers import TrainerCallback, TrainingArguments  # noqa: E402

from recipes.lm_recipe import end_process_group  # noqa: E402
from _models import markov_batches, tiny_model  # noqa: E402
import hf_midx  # noqa: E402
from hf_midx import MidxConfig  # noqa: E402
from hf_midx.integration import refresh_schedule  # noqa: E402
from hf_midx.integration.head import find_head  # noqa: E402
from hf_midx import MidxTrainer  # noqa: E402

VOCAB, SEQ = 256, 16
#: The interval each rank's own measurement of a rebuild and a step gives ("auto" takes the maximum).
LOCAL_INTERVAL = {0: 1, 1: 2}


def measure_differently(rank: int) -> list[int]:
    """Makes this rank's cost-based choice :data:`LOCAL_INTERVAL`'s, whatever its clock says (wall-clock times
    of tiny steps are noise); returns the list of the choices made, filled as training runs."""
    chosen = []

    def local_interval(rebuild_seconds, step_seconds, budget, low, high):
        chosen.append(LOCAL_INTERVAL[rank])
        return LOCAL_INTERVAL[rank]

    refresh_schedule.cost_interval = local_interval
    return chosen


class Rows(torch.utils.data.Dataset):
    def __init__(self, rows):
        self.rows = rows

    def __len__(self):
        return self.rows.shape[0]

    def __getitem__(self, i):
        return {"input_ids": self.rows[i], "labels": self.rows[i]}


def gathered_equal(tensor: torch.Tensor) -> bool:
    """True if every rank holds exactly this tensor (same shape assumed)."""
    parts = [torch.empty_like(tensor) for _ in range(dist.get_world_size())]
    dist.all_gather(parts, tensor.contiguous())
    return all(torch.equal(parts[0], p) for p in parts[1:])


def sync_state(trainer: MidxTrainer) -> dict[str, torch.Tensor]:
    index = trainer.midx_head.sampler.index
    state = {
        "codebook1": index.codebooks[0],
        "codebook2": index.codebooks[1],
        "codes": index.codes,
        "bucket_counts": index.bucket_counts,
        "order": index.order,
        "offsets": index.offsets,
    }
    if trainer.codebook_learner is not None:
        for name, p in trainer.codebook_learner.named_parameters():
            state[f"learned.{name}"] = p.detach()
    return state


class CompareAfterRefresh(TrainerCallback):
    """At each log (after the refresh of that step, since logging_steps == refresh_every_steps)."""

    def __init__(self):
        self.trainer = None
        self.checks = []

    def on_log(self, args, state, control, logs=None, **kwargs):
        if "loss" not in logs:
            return
        equal = {k: gathered_equal(v) for k, v in sync_state(self.trainer).items()}
        kl = torch.tensor([logs["midx/kl"]], dtype=torch.float64)
        equal["logged_kl"] = gathered_equal(kl)
        exact = torch.tensor([logs["midx/train_loss_exact"]], dtype=torch.float64)
        equal["logged_train_loss_exact"] = gathered_equal(exact)  # averaged over the ranks' micro-batches
        self.checks.append({"step": state.global_step, "refreshed": "midx/refresh_seconds" in logs, **equal})


def main(out_dir: str) -> None:
    torch.set_num_threads(1)
    args = TrainingArguments(
        output_dir=out_dir,
        use_cpu=True,
        ddp_backend="gloo",
        ddp_timeout=120,
        max_steps=6,
        per_device_train_batch_size=4,
        learning_rate=1e-2,
        logging_steps=2,
        save_strategy="steps",
        save_steps=4,
        report_to=[],
        disable_tqdm=True,
        seed=0,
    )
    # TrainingArguments set up the process group; a single process must not pass for two.
    if not (dist.is_initialized() and dist.get_world_size() == 2):
        world = dist.get_world_size() if dist.is_initialized() else 1
        raise SystemExit(f"expected 2 processes, got world_size={world}")
    rank = dist.get_rank()

    model = tiny_model("gpt2", vocab_size=VOCAB, seed=100 + rank)  # different on each rank on purpose
    config = MidxConfig(
        num_samples=16,
        codebook_size=8,
        kmeans_iters=5,
        codebooks="learned",
        refresh_every_steps="auto",
        refresh_min_steps=1,
        codebook_learning_rate=0.01,
    )
    local_choices = measure_differently(rank)
    hf_midx.wrap(model, config)
    built_equal = gathered_equal(find_head(model).sampler.index.codes)

    rows = torch.cat(markov_batches(VOCAB, 64, SEQ, 1, seed=1))
    compare = CompareAfterRefresh()
    trainer = MidxTrainer(model=model, args=args, train_dataset=Rows(rows), callbacks=[compare])
    compare.trainer = trainer
    trainer.train()

    sampler = trainer.midx_head.sampler
    final = {k: gathered_equal(v) for k, v in sync_state(trainer).items()}
    weights_equal = all(gathered_equal(p.detach()) for p in trainer.model.parameters())
    # Same queries on both ranks: the draws differ only through the per-rank generators.
    queries = torch.randn(32, model.config.n_embd, generator=torch.Generator().manual_seed(7))
    ids, _ = sampler.sample(queries, 16)
    negatives_equal = gathered_equal(ids)
    generators_equal = gathered_equal(sampler.generator.get_state())
    checkpoint = os.path.join(out_dir, "checkpoint-4")

    report = {
        "rank": rank,
        "world_size": dist.get_world_size(),
        "backend": dist.get_backend(),
        "samplers_equal_before_training": built_equal,
        "checks_after_refresh": compare.checks,
        "final_state_equal": final,
        "model_weights_equal": weights_equal,
        "negatives_equal": negatives_equal,
        "generators_equal": generators_equal,
        "refreshes": len([e for e in trainer.state.log_history if "midx/refresh_seconds" in e]),
        "local_intervals": local_choices,
        "logged_intervals": [e["midx/refresh_interval"] for e in trainer.state.log_history if "midx/refresh_interval" in e],
        "checkpoint_files": sorted(os.listdir(checkpoint)) if os.path.isdir(checkpoint) else [],
    }
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
        json.dump(report, f, indent=1)
    ok = (
        compare.checks
        and all(all(v for k, v in c.items() if k not in ("step", "refreshed")) for c in compare.checks)
        and all(final.values())
        and weights_equal
        and not negatives_equal
        and not generators_equal
    )
    dist.barrier()
    if rank == 0:
        with open(os.path.join(out_dir, "result.json"), "w") as f:
            json.dump({**report, "ok": bool(ok)}, f, indent=1)
    if not ok:
        raise SystemExit(f"rank {rank}: distributed checks failed: {json.dumps(report)}")


if __name__ == "__main__":
    try:
        main(sys.argv[1])
    finally:
        end_process_group()  # free the model's reference cycles now, not in a gloo thread at exit
