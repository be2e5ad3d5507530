"""One process of the two-process DeepSpeed ZeRO-3 test in tests/integration/test_zero3.py (torchrun, gloo, CPU).

Usage: DS_ACCELERATOR=cpu python -m torch.distributed.run --standalone --nproc_per_node 2 \
           tests/_zero3_worker.py OUT_DIR ARCH [ARCH ...]

For each architecture (``llama``: untied head, per-query negatives; ``gpt2``: tied head, shared negatives, learned
codebooks), V = 4,096, both ranks load the same saved tiny model and train 6 steps in each of these runs:

* ``ddp``: the reference, plain DDP (no DeepSpeed) with MidxTrainer;
* ``zero2``: ZeRO-2 (whole parameters), MidxTrainer;
* ``before``: ZeRO-3, the model loaded *before* ``TrainingArguments`` (DeepSpeed partitions it at train
  start), MidxTrainer; a checkpoint at step 3, ``evaluate()`` and ``save_model`` at the end;
* ``after``: ZeRO-3, ``TrainingArguments`` first, so that transformers loads the model already partitioned
  (the head weight is a (0,) slice when it is wrapped), a plain ``Trainer`` with ``MidxCallback.install``;
* ``resume``: as ``after``, MidxTrainer resumed from ``before``'s checkpoint at step 3 (steps 4-6); then a
  model of another ``codebook_size`` is checked against that checkpoint (one ``ValueError``).

Then the model ``before`` saved is loaded with plain transformers (no hf_midx, no DeepSpeed) and its exact
loss on the evaluation rows is computed. Rank 0 writes OUT_DIR/result.json with the per-step losses, the
sampler states' equality, the saved model's loss, the ``repr`` of the partitioned wrapped model and what ``unwrap`` gives
back; the test compares them. Exits non-zero on an exception.
"""

from __future__ import annotations

import json
import os
import sys
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("DS_ACCELERATOR", "cpu")
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import deepspeed  # noqa: E402
import deepspeed.ops  # noqa: E402
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from transformers import AutoModelForCausalLM, Trainer, TrainingArguments  # noqa: E402
from transformers.integrations.deepspeed import unset_hf_deepspeed_config  # noqa: E402

from recipes.lm_recipe import end_process_group  # noqa: E402
from _ddp_worker import Rows  # noqa: E402
from _models import markov_batches, tiny_model  # noqa: E402
import hf_midx  # noqa: E402
from hf_midx import MidxCallback, MidxConfig, MidxTrainer  # noqa: E402
from hf_midx.integration.head import find_head  # noqa: E402
from hf_midx.integration.zero import full_shape  # noqa: E402

VOCAB, SEQ, STEPS, CHECKPOINT_STEP = 4096, 16, 6, 3
OPTIONS = {"llama": dict(negatives="per-query"), "gpt2": dict(negatives="shared", codebooks="learned")}


def zero(stage: int = 3) -> dict:
    """A DeepSpeed config as users write it; "auto" values come from the TrainingArguments."""
    optimization = {"stage": stage}
    if stage == 3:  # save_model then gathers and writes the whole weights
        optimization["stage3_gather_16bit_weights_on_model_save"] = True
    return {
        "zero_optimization": optimization,
        "train_micro_batch_size_per_gpu": "auto",
        "gradient_accumulation_steps": "auto",
        "train_batch_size": "auto",
        "gradient_clipping": "auto",
        # DeepSpeed 0.19.0 enables bf16 on the CPU accelerator by default, which transformers 4.57 refuses
        # against bf16=False: "auto" takes the TrainingArguments' setting.
        "bf16": {"enabled": "auto"},
    }


def training_args(out_dir: str, deepspeed_config: dict | None) -> TrainingArguments:
    return TrainingArguments(
        output_dir=out_dir, use_cpu=True, ddp_backend="gloo", deepspeed=deepspeed_config, max_steps=STEPS,
        per_device_train_batch_size=4, per_device_eval_batch_size=4, learning_rate=3e-2, logging_steps=1,
        save_strategy="steps", save_steps=CHECKPOINT_STEP, report_to=[], disable_tqdm=True, seed=0,
    )


def losses(trainer) -> dict[int, float]:
    return {e["step"]: e["loss"] for e in trainer.state.log_history if "loss" in e}


def sampler_state(trainer) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in find_head(trainer.model).sampler.state_dict().items()}


def run_architecture(arch: str, out_dir: str, rank: int) -> dict:
    base = os.path.join(out_dir, arch, "base")
    if rank == 0:
        tiny_model(arch, vocab_size=VOCAB, seed=0).save_pretrained(base)
    dist.barrier()
    train_rows, eval_rows = torch.cat(markov_batches(VOCAB, 64 + 16, SEQ, 1, seed=1)).split([64, 16])
    data = dict(train_dataset=Rows(train_rows), eval_dataset=Rows(eval_rows))
    config = MidxConfig(num_samples=64, codebook_size=16, kmeans_iters=5, refresh_every_steps=2,
                        **OPTIONS[arch])
    load = lambda: AutoModelForCausalLM.from_pretrained(base, attn_implementation="eager")  # noqa: E731
    result, seconds = {"negatives": config.negatives}, {}

    with torch.no_grad():
        result["initial_eval_loss"] = float(load()(input_ids=eval_rows, labels=eval_rows).loss)

    start = time.perf_counter()  # DDP: the reference
    model = hf_midx.wrap(load(), config)
    trainer = MidxTrainer(model=model, args=training_args(os.path.join(out_dir, arch, "ddp"), None), **data)
    trainer.train()
    result["ddp"] = losses(trainer)
    result["ddp_eval_loss"] = trainer.evaluate()["eval_loss"]
    seconds["ddp"] = time.perf_counter() - start

    start = time.perf_counter()  # ZeRO-2: whole parameters, sharded optimizer state
    model = hf_midx.wrap(load(), config)
    trainer = MidxTrainer(model=model, args=training_args(os.path.join(out_dir, arch, "zero2"), zero(2)), **data)
    trainer.train()
    result["zero2"] = losses(trainer)
    seconds["zero2"] = time.perf_counter() - start

    start = time.perf_counter()  # ZeRO-3, the model loaded before the TrainingArguments
    model = hf_midx.wrap(load(), config)
    args = training_args(os.path.join(out_dir, arch, "before"), zero())
    trainer = MidxTrainer(model=model, args=args, **data)
    trainer.train()
    result["before"] = losses(trainer)
    result["eval_loss"] = trainer.evaluate()["eval_loss"]
    final_state = sampler_state(trainer)
    saved = os.path.join(out_dir, arch, "saved")
    trainer.save_model(saved)
    result["repr_after_training"] = repr(find_head(model))
    seconds["before"] = time.perf_counter() - start
    checkpoint = os.path.join(args.output_dir, f"checkpoint-{CHECKPOINT_STEP}")
    result["checkpoint_files"] = sorted(os.listdir(checkpoint))

    start = time.perf_counter()  # ZeRO-3, TrainingArguments first: transformers loads the model partitioned
    args = training_args(os.path.join(out_dir, arch, "after"), zero())
    model = load()
    result["partitioned_at_wrap"] = tuple(model.lm_head.weight.shape) == (0,)
    hf_midx.wrap(model, config)
    result["repr_partitioned"] = repr(model.lm_head)
    trainer = Trainer(model=model, args=args, **data)
    MidxCallback.install(trainer)
    trainer.train()
    result["after"] = losses(trainer)
    head = find_head(model)
    hf_midx.unwrap(model)
    result["unwrapped"] = {"type": type(model.lm_head).__name__, "same_weight": model.lm_head.weight is head.weight,
                           "full_shape": list(full_shape(model.lm_head.weight))}
    seconds["after"] = time.perf_counter() - start

    start = time.perf_counter()  # resumed from "before"'s checkpoint
    args = training_args(os.path.join(out_dir, arch, "resume"), zero())
    model = hf_midx.wrap(load(), config)
    trainer = MidxTrainer(model=model, args=args, **data)
    trainer.train(resume_from_checkpoint=checkpoint)
    result["resume"] = losses(trainer)
    resumed_state = sampler_state(trainer)
    equal = sorted(resumed_state) == sorted(final_state) and all(
        torch.equal(resumed_state[k], final_state[k]) for k in final_state
    )  # on every rank: each has its own generator
    flag = torch.tensor([int(equal)])
    dist.all_reduce(flag, op=dist.ReduceOp.MIN)
    result["resumed_sampler_equal"] = bool(flag)
    other = hf_midx.wrap(load(), config.replace(codebook_size=8))
    try:  # a checkpoint of another config: one clear error, before anything is loaded
        args = training_args(os.path.join(out_dir, arch, "other"), zero())
        MidxTrainer(model=other, args=args, **data).check_checkpoint(checkpoint)
        result["other_config_error"] = None
    except ValueError as err:
        result["other_config_error"] = str(err)
    seconds["resume"] = time.perf_counter() - start

    unset_hf_deepspeed_config()  # what a user's plain script does: no DeepSpeed, no hf_midx
    plain = AutoModelForCausalLM.from_pretrained(saved, attn_implementation="eager").eval()
    result["saved_head_type"] = type(plain.lm_head).__name__
    with torch.no_grad():
        result["saved_exact_loss"] = float(plain(input_ids=eval_rows, labels=eval_rows).loss)
    result["seconds"] = seconds
    return result


def main(out_dir: str, archs: list[str]) -> None:
    torch.set_num_threads(1)
    # DeepSpeed's CPU accelerator compiles a shared-memory all-reduce op (g++, ~45 s) when it starts its
    # communication backend; that op serves inference all-reduces only, and training runs over gloo without
    # it. DeepSpeed has no setting to skip it; marking it incompatible (its probe's cache) does.
    deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False
    # On a CPU DeepSpeed needs its process group before the TrainingArguments (its batch-size check).
    deepspeed.init_distributed(dist_backend="gloo")
    if dist.get_world_size() != 2:
        raise SystemExit(f"expected 2 processes, got world_size={dist.get_world_size()}")
    rank = dist.get_rank()
    results = {arch: run_architecture(arch, out_dir, rank) for arch in archs}
    dist.barrier()
    if rank == 0:
        with open(os.path.join(out_dir, "result.json"), "w") as f:
            json.dump({"world_size": dist.get_world_size(), "backend": dist.get_backend(), **results}, f, indent=1)


if __name__ == "__main__":
    try:
        main(sys.argv[1], sys.argv[2:])
    finally:
        end_process_group()
