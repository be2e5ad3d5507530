"""A resume with another MidxConfig: refused naming the field and both values where the resumed steps would
compute something else (num_samples, tail_gradient, seed, exact_head...), accepted with one log line where the
run legitimately goes on differently (the refresh schedule); every field classified in one table."""

from __future__ import annotations

import dataclasses
import logging

import pytest
import torch

import hf_midx
from _models import tiny_model
from hf_midx import MidxConfig, MidxTrainer
from hf_midx.integration.resume_fields import FREE, NOTED, REFUSED, config_changes, resume_class
from test_trainer import VOCAB, RowsDataset, markov_rows, training_args

COUNTS = (1000.0 / (torch.arange(VOCAB).double() + 1.0)).floor()
BASE = dict(num_samples=32, codebook_size=8, kmeans_iters=5, exact_head=16, refresh_every_steps=2,
            refresh_every_epoch=False)  # fmt: skip


def test_every_field_is_classified_once():
    """A field added to MidxConfig must be classified in resume_fields (until it is, a resume refuses its change)."""
    names = {f.name for f in dataclasses.fields(MidxConfig)}
    assert not (REFUSED & NOTED or REFUSED & FREE or NOTED & FREE)
    assert REFUSED | NOTED | FREE == names, f"classify in resume_fields: {sorted(names - (REFUSED | NOTED | FREE))}"
    assert resume_class("a_field_of_a_later_version") == "refused"


def test_config_changes_name_each_field_with_both_values():
    saved = MidxConfig(**BASE).to_dict()
    now = MidxConfig(**{**BASE, "num_samples": 16, "tail_gradient": "sampled", "refresh_every_steps": 3,
                        "log_kl": False})  # fmt: skip
    refused, noted = config_changes({**saved, "chosen": {"x": 1}, "a_newer_key": 1}, now)
    assert refused == ["num_samples: checkpoint 32, now 16", "tail_gradient: checkpoint 'auto', now 'sampled'"]
    assert noted == ["refresh_every_steps: checkpoint 2, now 3"]  # log_kl changes what is logged only
    # A field the checkpoint lacks (an older hf-midx) is compared with its default.
    del saved["seed"]
    assert config_changes(saved, MidxConfig(**{**BASE, "seed": 7}))[0] == ["seed: checkpoint 0, now 7"]


def _trainer(output_dir, **config):
    model = hf_midx.wrap(tiny_model("gpt2", vocab_size=VOCAB, seed=0), MidxConfig(**{**BASE, **config}),
                         class_counts=COUNTS)  # fmt: skip
    args = training_args(output_dir, max_steps=4, save_strategy="steps", save_steps=2)
    return MidxTrainer(model=model, args=args, train_dataset=RowsDataset(markov_rows(32)))


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    out = tmp_path_factory.mktemp("run")
    trainer = _trainer(out)
    trainer.args.max_steps = 2
    trainer.train()
    return str(out / "checkpoint-2")


@pytest.mark.parametrize(
    ("change", "said"),
    [
        ({"num_samples": 16}, "num_samples: checkpoint 32, now 16"),
        ({"tail_gradient": "sampled"}, "tail_gradient: checkpoint 'auto', now 'sampled'"),
        ({"seed": 1}, "seed: checkpoint 0, now 1"),
        ({"exact_head": 8}, "exact_head: checkpoint 16, now 8"),  # was: "another vocabulary, hidden size or ..."
    ],
    ids=["num_samples", "tail_gradient", "seed", "exact_head"],
)
def test_a_resume_that_would_compute_another_run_is_refused(tmp_path, checkpoint, change, said):
    trainer = _trainer(tmp_path / "b", **change)
    with pytest.raises(ValueError, match="Cannot resume") as err:
        trainer.train(resume_from_checkpoint=checkpoint)
    assert said in str(err.value) and "another vocabulary" not in str(err.value)
    assert trainer.state.global_step == 0  # refused before anything was loaded or trained


def test_a_new_refresh_schedule_resumes_with_one_line(tmp_path, checkpoint, caplog):
    trainer = _trainer(tmp_path / "b", refresh_every_steps=3)
    with caplog.at_level(logging.INFO, logger="hf_midx"):
        trainer.train(resume_from_checkpoint=checkpoint)
    assert trainer.state.global_step == 4
    lines = [r.getMessage() for r in caplog.records if "no longer the one an uninterrupted run" in r.getMessage()]
    assert len(lines) == 1 and "refresh_every_steps: checkpoint 2, now 3" in lines[0], lines
