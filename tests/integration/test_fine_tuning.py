"""Fine-tuning as users run it (issue 55): a frozen head (LoRA) does no weight-gradient work and keeps its index;
plain Trainer + MidxCallback and TRL's SFTTrainer train LoRA adapters, refresh nothing, save the adapter and
evaluate exactly; the Trainer's label_smoothing_factor and MidxConfig(z_loss=...) train and log."""

from __future__ import annotations

import json
import logging
import math
import os

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from transformers import Trainer

import hf_midx
from _models import tiny_model
from hf_midx import MidxCallback, MidxConfig
from hf_midx.integration.head import find_head
from recipes.benchmarks.profile_head import count_ops
from test_op_count import _default_head_step
from test_trainer import SEQ, VOCAB, RowsDataset, eval_rows, markov_rows, training_args

peft = pytest.importorskip("peft")


def _new_vocabulary_sized(step, v, d) -> list[str]:
    """The ops of one step that create a new (V, D) tensor (not a view of an input)."""
    created = []

    class Trace(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            inputs = {a.untyped_storage().data_ptr() for a in args if isinstance(a, torch.Tensor)}
            for o in out if isinstance(out, (tuple, list)) else (out,):
                new = isinstance(o, torch.Tensor) and o.untyped_storage().data_ptr() not in inputs
                if new and tuple(o.shape) == (v, d):
                    created.append(func.__name__)
            return out

    with Trace():
        step()
    return created


def test_a_frozen_head_step_makes_no_vocabulary_sized_tensor_and_fewer_ops():
    """The default head (exact head, expected tail gradient): trainable, the step writes the weight gradient and
    the expected tail spreads its table's gradient; frozen, neither runs (nor the table gradient's (T x B x D)
    product), and no op makes a (V, D) tensor."""
    v, d = 16384, 12
    counts, made = {}, {}
    for frozen in (False, True):
        head, step = _default_head_step(64, num_classes=v, dim=d)
        head.weight.requires_grad_(not frozen)
        assert head.frozen is frozen
        step()
        counts[frozen], made[frozen] = len(count_ops(step)), _new_vocabulary_sized(step, v, d)
    print(f"\n[frozen] ops: trainable {counts[False]}, frozen {counts[True]}; (V, D) made: {made}")
    assert made[True] == [] and made[False]
    assert counts[True] <= counts[False] - 5, counts


# ------------------------------------------------------------------------------------------ LoRA
def _lora_model(**config):
    # A larger init than the default 0.02: a frozen random head then gives logits the adapters can move.
    model = tiny_model("llama", vocab_size=VOCAB, initializer_range=0.2)
    lora = peft.get_peft_model(model, peft.LoraConfig(r=8, lora_alpha=16, target_modules=["q_proj", "v_proj"]))
    config = {"num_samples": 24, "codebook_size": 8, "kmeans_iters": 5, "refresh_every_steps": 2, **config}
    hf_midx.wrap(lora, MidxConfig(**config))
    return lora


def _exact_mean_nll(model, rows: torch.Tensor) -> float:
    """The next-token cross-entropy of ``rows`` from the full logits (the head's forward without labels)."""
    model.eval()
    with torch.no_grad():
        logits = model(input_ids=rows).logits[:, :-1].float()
    return float(torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), rows[:, 1:].reshape(-1)))


def _check_lora_run(trainer, lora, tmp_path, caplog):
    head = find_head(lora)
    codes = head.sampler.state_dict()["index.codes"].clone()
    assert head.frozen
    with caplog.at_level(logging.WARNING, logger="hf_midx"):
        trainer.train()
    said = [r for r in caplog.records if "is frozen" in r.getMessage()]
    losses = [e["loss"] for e in trainer.state.log_history if "loss" in e]
    assert len(said) == 1
    assert not [e for e in trainer.state.log_history if "midx/refresh_seconds" in e]  # refresh_every_steps=2
    assert torch.equal(codes, head.sampler.state_dict()["index.codes"])
    assert head.sampled_calls == trainer.state.global_step and all(math.isfinite(x) for x in losses)
    assert losses[-1] < losses[0], losses
    trainer.save_model(str(tmp_path / "adapter"))
    assert "adapter_model.safetensors" in os.listdir(tmp_path / "adapter")
    card = (tmp_path / "adapter" / "README.md").read_text()
    assert "| LM head | frozen" in card  # the card says so
    # An adapter: not "trained from scratch", and loaded with peft (was: AutoModelForCausalLM).
    assert "This model is a PEFT adapter for the base model its `adapter_config.json` names." in card, card[:1500]
    assert "trained from scratch" not in card and "AutoPeftModelForCausalLM.from_pretrained" in card
    assert "load it with `AutoModelForCausalLM" not in card and "library_name: peft" in card
    return losses


def test_lora_with_a_plain_trainer_trains_keeps_the_index_saves_the_adapter_and_evaluates_exactly(tmp_path, caplog):
    lora = _lora_model()
    evals = eval_rows(16)
    args = training_args(tmp_path, max_steps=8, logging_steps=2, learning_rate=3e-2, per_device_eval_batch_size=16)
    trainer = Trainer(model=lora, args=args, train_dataset=RowsDataset(markov_rows(64)),
                      eval_dataset=RowsDataset(evals))
    MidxCallback.install(trainer)
    before = _exact_mean_nll(lora, evals)
    losses = _check_lora_run(trainer, lora, tmp_path, caplog)
    with find_head(lora).exact_loss_only():
        metrics = trainer.evaluate()
    exact = _exact_mean_nll(lora, evals)
    print(f"\n[lora trainer] train loss {losses}; exact eval {before:.4f} -> {exact:.4f}; "
          f"Trainer {metrics['eval_loss']:.4f}")
    assert metrics["eval_loss"] == pytest.approx(exact, rel=1e-5)
    assert exact < before


def test_a_frozen_head_under_the_auto_schedule_chooses_no_interval(tmp_path, caplog):
    """The frozen head is never rebuilt, so refresh_every_steps='auto' says no interval: nothing in the log, the
    log entries, midx_config.json or the card contradicts the one 'never refreshed' line."""
    lora = _lora_model(refresh_every_steps="auto", refresh_min_steps=2, refresh_max_steps=2)
    args = training_args(tmp_path, max_steps=6, logging_steps=2, learning_rate=3e-2)
    trainer = Trainer(model=lora, args=args, train_dataset=RowsDataset(markov_rows(64)))
    MidxCallback.install(trainer)
    with caplog.at_level(logging.INFO, logger="hf_midx"):
        trainer.train()
    said = [r.getMessage() for r in caplog.records]
    assert len([m for m in said if "is frozen" in m]) == 1 and not [m for m in said if "index rebuilt" in m]
    assert not [m for m in said if "refresh_every_steps='auto'" in m]
    trainer.save_model(str(tmp_path / "adapter"))
    assert not [e for e in trainer.state.log_history if "midx/refresh_interval" in e]
    assert "chosen" not in json.loads((tmp_path / "adapter" / "midx_config.json").read_text())
    assert "last chosen" not in (tmp_path / "adapter" / "README.md").read_text()


def test_lora_with_trls_sft_trainer_trains_keeps_the_index_and_saves_the_adapter(tmp_path, caplog):
    trl = pytest.importorskip("trl")
    datasets = pytest.importorskip("datasets")
    from test_trl import _tokenizer

    lora = _lora_model()
    args = trl.SFTConfig(output_dir=str(tmp_path), max_steps=8, per_device_train_batch_size=8, learning_rate=3e-2,
                         logging_steps=2, save_strategy="no", report_to=[], use_cpu=True, disable_tqdm=True, seed=0,
                         max_length=SEQ, dataset_num_proc=None)
    train = datasets.Dataset.from_dict({"input_ids": markov_rows(64).tolist()})
    trainer = trl.SFTTrainer(model=lora, args=args, train_dataset=train, processing_class=_tokenizer())
    MidxCallback.install(trainer)
    _check_lora_run(trainer, lora, tmp_path, caplog)


# ------------------------------------------------------------------------------------------ smoothing, z-loss
def test_the_trainers_label_smoothing_and_the_z_loss_train_and_log(tmp_path):
    """label_smoothing_factor becomes the head's smoothing (the Trainer's smoother, which would take the labels and
    smooth full logits, is off); z_loss is logged as midx/z_loss; evaluation stays the plain exact cross-entropy."""
    model = hf_midx.wrap(tiny_model("gpt2", vocab_size=VOCAB), MidxConfig(num_samples=32, codebook_size=8,
                                                                          kmeans_iters=5, z_loss=1e-3))
    evals = RowsDataset(eval_rows(16))
    args = training_args(tmp_path, max_steps=10, logging_steps=5, label_smoothing_factor=0.1)
    trainer = Trainer(model=model, args=args, train_dataset=RowsDataset(markov_rows(80)), eval_dataset=evals)
    MidxCallback.install(trainer)
    assert trainer.label_smoother is None
    trainer.train()
    head = find_head(model)
    assert head.config.label_smoothing == 0.1
    entries = [e for e in trainer.state.log_history if "loss" in e]
    assert len(entries) == 2 and all(e["midx/z_loss"] > 0 and math.isfinite(e["loss"]) for e in entries)
    with head.exact_loss_only():
        metrics = trainer.evaluate()
    exact = _exact_mean_nll(model, evals.rows)
    assert metrics["eval_loss"] == pytest.approx(exact, rel=1e-5)
    trainer.save_model(str(tmp_path / "model"))
    card = (tmp_path / "model" / "README.md").read_text()
    assert "| Label smoothing | eps = 0.1" in card and "| z-loss | 0.001" in card and "LM head | frozen" not in card


class _DirectCaller(torch.nn.Module):
    """A wrapper that runs its model as ``self.model.forward(...)``, past the model's hooks, as PEFT's tuner does in
    peft 0.20 (``BaseTuner.forward``), which Axolotl 0.19 pins: its LoRA runs trained the full softmax (one warning)."""

    def __init__(self, model):
        super().__init__()
        self.model = model

    def forward(self, *args, **kwargs):
        return self.model.forward(*args, **kwargs)

    def get_output_embeddings(self):
        return self.model.get_output_embeddings()


def test_a_wrapper_that_calls_the_models_forward_directly_still_trains_sampled():
    host = tiny_model("llama", VOCAB)
    outer = _DirectCaller(host)
    hf_midx.wrap(outer, MidxConfig(num_samples=16), class_counts=torch.ones(VOCAB))
    head = find_head(outer)
    outer.train()
    ids = torch.randint(0, VOCAB, (2, 9), generator=torch.Generator().manual_seed(0))
    out = outer(input_ids=ids, labels=ids)
    assert out.logits.shape[-1] == 0 and head.sampled_calls == 1  # the sampled softmax, not full logits
    host(input_ids=ids, labels=ids)  # the model called on its own: its own hooks, one call
    assert head.sampled_calls == 2
    outer.eval()
    assert outer(input_ids=ids, labels=ids).logits.shape[-1] == VOCAB  # evaluation: the full logits
    hf_midx.unwrap(outer)
    outer.train()
    out = outer(input_ids=ids, labels=ids)  # unwrapped: the plain model again
    assert out.logits.shape[-1] == VOCAB and not outer._forward_pre_hooks and not host._forward_pre_hooks
