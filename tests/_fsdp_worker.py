"""One process of the two-process FSDP2 test in tests/integration/test_fsdp.py (run by torchrun, gloo backend, CPU).

Usage: python -m torch.distributed.run --standalone --nproc_per_node 2 tests/_fsdp_worker.py OUT_DIR

Both ranks build the same tiny Llama (untied head), wrap its head, then shard it with
``torch.distributed.fsdp.fully_shard`` (each decoder layer, then the root), so the head weight is a
DTensor sharded by rows. A custom loop trains 20 steps on per-rank batches with the sampled loss, calls
``hf_midx.refresh_index`` every 4 steps, and compares the index across ranks bit for bit; at the end the
exact (chunked, loss-only) evaluation of the same batch is compared across ranks and with the full-logits
loss. Writes OUT_DIR/rank<r>.json; exits non-zero on a failed check.
"""

from __future__ import annotations

import gc
import json
import math
import os
import sys
import weakref

os.environ.setdefault("HF_HUB_OFFLINE", "1")
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from torch.distributed.fsdp import fully_shard  # noqa: E402
from torch.distributed.tensor import DTensor, Shard  # noqa: E402

from recipes.lm_recipe import end_process_group  # noqa: E402
from _models import markov_batches, tiny_model  # noqa: E402
import hf_midx  # noqa: E402
from hf_midx import MidxConfig, refresh_index  # noqa: E402
from hf_midx.integration.head import find_head  # noqa: E402
from hf_midx.integration.distributed import full_head_weight  # noqa: E402


def gathered_equal(tensor: torch.Tensor) -> bool:
    parts = [torch.empty_like(tensor) for _ in range(dist.get_world_size())]
    dist.all_gather(parts, tensor.contiguous())
    return all(torch.equal(parts[0], p) for p in parts[1:])


def index_state(head) -> dict[str, torch.Tensor]:
    return {k: v for k, v in head.sampler.state_dict().items() if k != "generator_state"}


def main(out_dir: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    if world != 2:
        raise SystemExit(f"expected 2 processes, got world_size={world}")

    model = tiny_model("llama", seed=0)  # same weights on both ranks; lm_head untied
    vocab = model.config.vocab_size
    full_weight = weakref.ref(model.lm_head.weight)
    hf_midx.wrap(model, MidxConfig(num_samples=24, codebook_size=8, kmeans_iters=5, seed=0))
    head = find_head(model)
    for layer in model.model.layers:
        fully_shard(layer)
    fully_shard(model)
    gc.collect()
    released = full_weight() is None  # nothing of the head keeps the unsharded weight alive
    weight = head.weight
    sharded = isinstance(weight, DTensor) and weight.placements == (Shard(0),)
    local_rows = weight.to_local().shape[0] if isinstance(weight, DTensor) else -1
    head.sampler.generator.manual_seed(100 + rank)  # each rank its own negatives
    with full_head_weight(head) as (w, _):  # a collective: both ranks gather
        if rank == 1:  # a different index on rank 1, so that agreement after refresh_index is its doing
            head.refresh(w * 2.0)
    differ_before = not all(gathered_equal(v) for v in index_state(head).values())

    batches = markov_batches(vocab, 8, 16, 41, seed=10)  # one Markov chain (the seed fixes it)
    train, held = batches[rank:40:2], batches[40]  # each rank its own 20 batches; held out: the same on both
    model.eval()
    with torch.no_grad(), head.exact_loss_only():
        exact_before = float(model(input_ids=held, labels=held).loss)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model.train()
    losses, checks = [], []
    for step, batch in enumerate(train, 1):
        out = model(input_ids=batch, labels=batch)
        out.loss.backward()
        grad = head.weight.grad
        grad_ok = isinstance(grad, DTensor) and bool(torch.isfinite(grad.to_local()).all())
        opt.step()
        opt.zero_grad()
        losses.append(float(out.loss.detach()))
        if step % 4 == 0:
            seconds = refresh_index(model)
            checks.append(
                {
                    "step": step,
                    "seconds": seconds,
                    "grad_sharded_finite": grad_ok,
                    **{k: gathered_equal(v) for k, v in index_state(head).items()},
                }
            )
    with full_head_weight(head) as (w, b):
        exact_train = float(head.last_batch_exact_loss(w, b))

    model.eval()
    with torch.no_grad():
        with head.exact_loss_only():
            exact = model(input_ids=held, labels=held)
        full = model(input_ids=held, labels=held)
    exact_loss = exact.loss.detach().reshape(1)
    report = {
        "rank": rank,
        "world_size": world,
        "backend": dist.get_backend(),
        "head_sharded": sharded,
        "full_weight_released": released,
        "index_differs_before_refresh": differ_before,
        "exact_eval_loss_before": exact_before,
        "local_rows": local_rows,
        "vocab": vocab,
        "losses": losses,
        "checks": checks,
        "exact_train_loss_last_batch": exact_train,
        "exact_eval_loss": float(exact_loss),
        "exact_logits_width": exact.logits.shape[-1],
        "full_eval_loss": float(full.loss),
        "exact_equal_across_ranks": gathered_equal(exact_loss),
    }
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
        json.dump(report, f, indent=1)
    ok = (
        sharded
        and differ_before
        and all(math.isfinite(x) for x in losses)
        and checks
        and all(all(v for k, v in c.items() if k not in ("step", "seconds")) for c in checks)
        and report["exact_equal_across_ranks"]
    )
    dist.barrier()
    if not ok:
        raise SystemExit(f"rank {rank}: FSDP2 checks failed: {json.dumps(report)}")


if __name__ == "__main__":
    try:
        main(sys.argv[1])
    finally:
        end_process_group()  # free the model's reference cycles now, not in a gloo thread at exit
