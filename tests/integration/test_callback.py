"""MidxCallback with a plain transformers.Trainer: refresh, midx/ logging (ahead of the reporters), the
exact training loss, checkpointed sampler state and an identical resumed run (from a checkpoint outside
output_dir); install(); the warning of a Trainer without the callback; refresh_index alone."""

from __future__ import annotations

import json
import math
import os
import warnings

import pytest
import torch
from transformers import Trainer, TrainerCallback

import hf_midx
from _models import clone_model, tiny_model
from hf_midx import MidxCallback, MidxConfig, refresh_index
from hf_midx.integration.head import find_head
from hf_midx.integration.state import MIDX_RNG_STATE_NAME, MIDX_STATE_NAME
from test_trainer import VOCAB, RowsDataset, markov_rows, training_args


class LogRecorder(TrainerCallback):
    """Stands where a reporting integration stands (before the user's callbacks): what it sees is what
    TensorBoard or W&B would receive."""

    def __init__(self):
        self.entries = []

    def on_log(self, args, state, control, logs=None, **kwargs):
        self.entries.append(dict(logs))


# A fixed schedule, and "auto" pinned by its bounds to every 3 steps (whatever the timings).
FIXED, AUTO = {"refresh_every_steps": 4}, {"refresh_min_steps": 3, "refresh_max_steps": 3}


def _plain_trainer(output_dir, max_steps=8, resume_from_checkpoint=None, schedule=FIXED):
    torch.manual_seed(0)
    model = tiny_model("gpt2", vocab_size=VOCAB, seed=0)
    hf_midx.wrap(model, MidxConfig(num_samples=32, codebook_size=8, kmeans_iters=5, **schedule))
    recorder = LogRecorder()
    args = training_args(output_dir, max_steps=max_steps, logging_steps=2, save_strategy="steps", save_steps=4)
    callbacks = [recorder, MidxCallback(resume_from_checkpoint=resume_from_checkpoint)]
    trainer = Trainer(model=model, args=args, train_dataset=RowsDataset(markov_rows(48)), callbacks=callbacks)
    assert MidxCallback.install(trainer) is callbacks[1]  # moved ahead of the recorder, not doubled
    return trainer, recorder


def _per_step(trainer, key, after=0):
    return {e["step"]: e[key] for e in trainer.state.log_history if key in e and e["step"] > after}


@pytest.mark.parametrize(("schedule", "refreshes"), [(FIXED, {4, 8}), (AUTO, {4, 6})], ids=["fixed", "auto"])
def test_plain_trainer_refreshes_logs_checkpoints_and_resumes_identically(tmp_path, caplog, schedule, refreshes):
    full, recorder = _plain_trainer(tmp_path / "full", schedule=schedule)
    head = find_head(full.model)
    calls = []
    hook = full.model.register_forward_pre_hook(lambda m, a: calls.append(m.training) if m.training else None)
    refreshed = head.sampler.state_dict()["index.codes"].clone()
    full.train()
    hook.remove()

    # Every training forward drew from the sampler (8 steps, no accumulation).
    assert len(calls) == 8 and head.sampled_calls == 8
    losses = _per_step(full, "loss")
    kls, exact = _per_step(full, "midx/kl"), _per_step(full, "midx/train_loss_exact")
    refresh = _per_step(full, "midx/refresh_seconds")
    print(f"[callback] sampled loss {losses}; exact train loss {exact}; KL {kls}; refreshes at {sorted(refresh)}")
    # The midx/ keys join the entries that hold the Trainer's loss, in log_history and in what a
    # reporting callback placed before MidxCallback receives.
    assert kls.keys() == exact.keys() == losses.keys() == {2, 4, 6, 8}
    assert refresh.keys() == refreshes and all(0 < s < 60 for s in refresh.values())
    assert all(math.isfinite(v) for v in (*losses.values(), *kls.values(), *exact.values()))
    seen = [e for e in recorder.entries if "loss" in e]
    assert len(seen) == 4 and all("midx/kl" in e and "midx/train_loss_exact" in e for e in seen)
    # The coverage diagnostics that predict training quality come with every logged KL.
    for e in seen:
        assert {"midx/kl_pq", "midx/ess", "midx/ess_sampled", "midx/mass_p_over_q_gt_10"} <= set(e)
        assert 0 < e["midx/ess"] <= 1 and e["midx/kl_pq"] >= 0 and 0 <= e["midx/mass_p_over_q_gt_10"] <= 1
    assert not torch.equal(refreshed, head.sampler.state_dict()["index.codes"])

    checkpoint = tmp_path / "full" / "checkpoint-4"
    names = set(os.listdir(checkpoint))
    assert {MIDX_STATE_NAME, MIDX_RNG_STATE_NAME, "midx_config.json", "model.safetensors"} <= names
    assert not [n for n in names if n.endswith(".tmp")]
    # midx_config.json says what "auto" became; loading it keeps "auto" (a run chooses again), without a warning.
    saved = json.loads((checkpoint / "midx_config.json").read_text())
    assert saved.get("chosen") == ({"refresh_every_steps": 3} if schedule is AUTO else None)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert MidxConfig.from_pretrained(checkpoint).refresh_every_steps == saved["refresh_every_steps"]

    # A checkpoint outside the resumed run's output_dir: the callback is told where it is.
    # (With "auto", the resumed run rebuilds after step 6, 3 steps after the saved rebuild, not 3 after resuming.
    # The rebuild after step 3 is in the log entry of step 4; the log lines name the steps. 6 steps an epoch.)
    resumed, _ = _plain_trainer(tmp_path / "resumed", resume_from_checkpoint=checkpoint, schedule=schedule)
    caplog.clear()
    with caplog.at_level("INFO", logger="hf_midx"):
        resumed.train(resume_from_checkpoint=str(checkpoint))
    rebuilt = [r.getMessage().split(" in ")[0] for r in caplog.records if "index rebuilt" in r.getMessage()]
    assert rebuilt == [f"hf_midx: index rebuilt after step {s}" for s in ((6, 8) if schedule is FIXED else (6,))]
    # transformers' "missing keys ['lm_head.weight']" of a tied model gets one line of ours.
    assert [r for r in caplog.records if "tied to the input embeddings" in r.getMessage()]
    for key in ("loss", "midx/kl", "midx/train_loss_exact", "grad_norm"):
        a, b = _per_step(full, key, after=4), _per_step(resumed, key, after=4)
        assert a.keys() == b.keys() and a, key
        assert a == b, f"{key}: uninterrupted {a} != resumed {b}"
    assert _per_step(resumed, "midx/refresh_seconds", after=4).keys() == {s for s in refreshes if s > 4}
    worst = max(float((p - q).abs().max()) for p, q in zip(full.model.parameters(), resumed.model.parameters()))
    assert worst <= 1e-6, worst
    s_full = find_head(full.model).sampler.state_dict()
    s_res = find_head(resumed.model).sampler.state_dict()
    assert all(torch.equal(s_full[k], s_res[k]) for k in s_full)
    print(f"[callback resume] steps 5-8 losses {_per_step(resumed, 'loss', after=4)}; max param diff {worst}")


def test_resume_needs_the_midx_state(tmp_path):
    trainer, _ = _plain_trainer(tmp_path / "a", max_steps=4)
    trainer.train()
    os.remove(tmp_path / "a" / "checkpoint-4" / MIDX_STATE_NAME)
    again, _ = _plain_trainer(tmp_path / "b", max_steps=6, resume_from_checkpoint=tmp_path / "a" / "checkpoint-4")
    with pytest.raises(ValueError, match="has no midx_state.safetensors"):
        again.train(resume_from_checkpoint=str(tmp_path / "a" / "checkpoint-4"))


def test_label_smoothing_needs_the_installed_callback(tmp_path):
    """Without install() the Trainer's label smoother would take the labels and smooth full logits: refused."""
    model = hf_midx.wrap(tiny_model("gpt2", vocab_size=VOCAB), num_samples=32, codebook_size=8)
    args = training_args(tmp_path, max_steps=2, label_smoothing_factor=0.1)
    trainer = Trainer(model=model, args=args, train_dataset=RowsDataset(markov_rows(16)), callbacks=[MidxCallback()])
    with pytest.raises(ValueError, match=r"label_smoothing_factor with MIDX needs MidxCallback\.install"):
        trainer.train()


def test_one_process_on_several_gpus_is_refused(tmp_path, monkeypatch):
    """n_gpu > 1 without a distributed launch means torch.nn.DataParallel: refused by MidxTrainer (before it
    creates output_dir), by install() and at train start, with the launch that works.

    (Trainer.train itself cannot run with a faked n_gpu on a CPU, so the event is called directly.)"""
    from transformers import TrainingArguments

    from hf_midx import MidxTrainer

    model = hf_midx.wrap(tiny_model("gpt2", vocab_size=VOCAB), num_samples=32, codebook_size=8, verify=False)
    args = training_args(tmp_path / "out", max_steps=2)
    callback = MidxCallback()
    plain = Trainer(model=model, args=args, train_dataset=RowsDataset(markov_rows(16)), callbacks=[callback])
    monkeypatch.setattr(TrainingArguments, "n_gpu", property(lambda self: 2))
    message = r"DataParallel.*--num_processes 2"
    with pytest.raises(ValueError, match=message):
        MidxTrainer(model=model, args=training_args(tmp_path / "never", max_steps=2))
    assert not (tmp_path / "never").exists()
    with pytest.raises(ValueError, match=message):
        MidxCallback.install(plain)
    with pytest.raises(ValueError, match=message):  # passed in callbacks=: at train start
        callback.on_train_begin(plain.args, plain.state, plain.control, model=model)


def test_a_one_epoch_run_with_the_defaults_rebuilds_the_index_and_says_why(tmp_path, recwarn, caplog):
    """The case of the old warning (one epoch, no step refreshes: the initial index for the whole run) is gone:
    refresh_every_steps='auto' rebuilds within [refresh_min_steps, refresh_max_steps] and logs each choice."""
    config = MidxConfig(num_samples=16, codebook_size=8, kmeans_iters=2, refresh_min_steps=2, refresh_max_steps=3)
    model = hf_midx.wrap(tiny_model("gpt2", vocab_size=VOCAB), config)
    args = training_args(tmp_path, max_steps=-1, num_train_epochs=1, logging_steps=1)
    trainer = Trainer(model=model, args=args, train_dataset=RowsDataset(markov_rows(48)), callbacks=[MidxCallback()])
    with caplog.at_level("INFO", logger="hf_midx"):
        trainer.train()
    assert not [w for w in recwarn if "only rebuilt at epoch starts" in str(w.message)]
    rebuilt = _per_step(trainer, "midx/refresh_seconds")
    intervals = _per_step(trainer, "midx/refresh_interval")
    lines = [r.getMessage() for r in caplog.records]
    print(f"[auto refresh] {trainer.state.global_step} steps: rebuilt after {sorted(rebuilt)}, intervals {intervals}")
    assert sorted(rebuilt)[0] in (2, 3) and len(rebuilt) >= 2 and set(intervals.values()) <= {2.0, 3.0}
    assert len([m for m in lines if m.startswith("hf_midx: index rebuilt")]) == len(rebuilt)
    assert any("refresh_every_steps='auto': every" in m and "budget of 3%" in m for m in lines)
    assert all(0 < e["midx/refresh_share"] < 1 for e in trainer.state.log_history if "midx/refresh_share" in e)


def test_logged_exact_loss_is_of_the_weights_the_step_saw(tmp_path):
    """midx/train_loss_exact is measured before the optimizer step: one step at a large learning rate, one batch
    (the whole dataset), and the logged value is the exact loss of the weights as they were (llama: no dropout)."""
    model = tiny_model("llama", vocab_size=VOCAB)
    reference = clone_model(model)
    rows = markov_rows(8)
    hf_midx.wrap(model, num_samples=24, codebook_size=8, kmeans_iters=5)
    args = training_args(tmp_path, max_steps=1, logging_steps=1, learning_rate=0.1)
    trainer = Trainer(model=model, args=args, train_dataset=RowsDataset(rows))
    MidxCallback.install(trainer)
    trainer.train()
    with torch.no_grad():
        before = float(reference(input_ids=rows, labels=rows).loss)
        after = float(clone_model(model)(input_ids=rows, labels=rows).loss)
    logged = _per_step(trainer, "midx/train_loss_exact")[1]
    assert abs(after - before) > 0.01  # the step moved the loss: a value measured after it would show
    assert logged == pytest.approx(before, rel=1e-4), (logged, before, after)


def test_exact_loss_of_the_last_batch_matches_the_model():
    """The logged midx/train_loss_exact: the exact loss of the last sampled call's tokens (llama: no dropout)."""
    model = tiny_model("llama")
    reference = clone_model(model)
    hf_midx.wrap(model, num_samples=24, codebook_size=8, kmeans_iters=5)
    head = find_head(model)
    assert head.last_batch_exact_loss() is None
    ids = torch.randint(model.config.vocab_size, (2, 16), generator=torch.Generator().manual_seed(3))
    labels = ids.clone()
    labels[0, :6] = -100
    model.train()
    sampled = model(input_ids=ids, labels=labels).loss
    with torch.no_grad():
        want = reference(input_ids=ids, labels=labels).loss
    got = head.last_batch_exact_loss()
    assert got.dtype == torch.float32 and float(got) == pytest.approx(float(want), rel=1e-5)
    assert float(sampled) != pytest.approx(float(want), rel=1e-6)  # the sampled estimate is another number
    # The kept queries are hidden states of non-ignored tokens only (16 - 1 - 6 + 15 = 24 of them).
    assert head.last_queries.shape == (min(head.config.kl_queries, 32), 32)


@pytest.mark.parametrize("arch", ["granite", "gemma2"])
def test_logged_coverage_is_of_the_softmax_the_model_trains(arch, tmp_path):
    """Granite divides its logits by logits_scaling, Gemma-2 soft-caps them: the logged diagnostics compare the
    proposal with that softmax, and query the sampler as training does (queries times the logit scale)."""
    from hf_midx.integration.diagnostics import proposal_diagnostics

    model = tiny_model(arch, vocab_size=VOCAB)
    hf_midx.wrap(model, MidxConfig(num_samples=16, codebook_size=8, kmeans_iters=5))
    head = find_head(model)
    assert (head.logit_scale != 1.0) == (arch == "granite") and (head.logit_softcap is not None) == (arch == "gemma2")
    args = training_args(tmp_path, max_steps=1, logging_steps=1)
    trainer = Trainer(model=model, args=args, train_dataset=RowsDataset(markov_rows(16)), callbacks=[MidxCallback()])
    trainer.train()
    logged = next(e for e in trainer.state.log_history if "midx/kl_pq" in e)
    queries, weight, bias, scale = head.last_queries, head.weight.detach(), head.bias, head.logit_scale
    want = proposal_diagnostics(head.sampler, queries * scale, weight, None if bias is None else bias * scale,
                                num_samples=16, logit_softcap=head.logit_softcap)  # fmt: skip
    plain = proposal_diagnostics(head.sampler, queries, weight, bias, num_samples=16)
    for key in ("kl_pq", "ess", "mass_p_over_q_gt_10"):
        assert logged[f"midx/{key}"] == pytest.approx(float(want[key]), rel=1e-5), key
    assert logged["midx/kl_pq"] != pytest.approx(float(plain["kl_pq"]), rel=1e-3)


def test_a_scheduled_rebuild_measures_nothing_the_budget_does_not_see(tmp_path, monkeypatch):
    """A rebuild's timed seconds are what "auto" budgets: the callback runs no proposal diagnostics (O(S V))
    at a rebuild, only at logging steps."""
    model = hf_midx.wrap(tiny_model("llama", vocab_size=VOCAB), num_samples=16, codebook_size=8, kmeans_iters=5,
                         refresh_every_steps=2)  # fmt: skip
    head = find_head(model)
    steps, real = [], head.proposal_diagnostics
    args = training_args(tmp_path, max_steps=6, logging_steps=3)
    trainer = Trainer(model=model, args=args, train_dataset=RowsDataset(markov_rows(32)), callbacks=[MidxCallback()])
    monkeypatch.setattr(head, "proposal_diagnostics",
                        lambda *a, **k: steps.append(trainer.state.global_step) or real(*a, **k))  # fmt: skip
    trainer.train()
    assert steps == [3, 6]  # the two logging steps; none at the rebuilds after steps 2 and 4 (and 6)


def test_refresh_index_rebuilds_from_the_current_weight():
    model = hf_midx.wrap(tiny_model("llama"), num_samples=24, codebook_size=8, kmeans_iters=5)
    head = find_head(model)
    before = head.sampler.state_dict()["index.codebook1"].clone()
    with torch.no_grad():
        head.weight.mul_(3.0)
    seconds = refresh_index(model)
    assert seconds > 0 and not torch.allclose(before, head.sampler.state_dict()["index.codebook1"])
    with pytest.raises(ValueError, match="hf_midx.wrap"):
        refresh_index(tiny_model("llama"))


def test_no_host_sync_between_checks(tmp_path):
    """Between logging / save / refresh steps the callback reads nothing back from the device; at a logging
    step it does (the NaN check, the KL and the exact loss), where the Trainer syncs anyway."""
    from test_hot_path import SyncCounter
    from transformers import TrainerControl, TrainerState

    model = hf_midx.wrap(tiny_model("llama"), num_samples=24, codebook_size=8, kmeans_iters=5, refresh_every_steps=5)
    callback = MidxCallback()
    args = training_args(tmp_path)
    state, control = TrainerState(), TrainerControl()
    state.max_steps, state.logging_steps = 10, 2
    callback.on_train_begin(args, state, control, model=model)
    ids = torch.randint(model.config.vocab_size, (2, 16), generator=torch.Generator().manual_seed(0))
    model.train()
    counts = []
    for step in (1, 2):
        model(input_ids=ids, labels=ids).loss.backward()
        with SyncCounter() as counter:
            callback.on_pre_optimizer_step(args, state, control)  # the exact loss of a logging step, before it
            state.global_step = step
            control.should_log = step == 2
            callback.on_step_end(args, state, control)
        counts.append(sum(counter.counts.values()))
    assert counts[0] == 0, counts
    assert counts[1] > 0 and {"midx/kl", "midx/train_loss_exact"} <= set(callback._pending)


# ---------------------------------------------------------------------------------------- public ways in
def test_install_places_the_callback_ahead_of_the_reporters(tmp_path):
    from transformers.trainer_callback import DefaultFlowCallback

    model = hf_midx.wrap(tiny_model("gpt2", vocab_size=VOCAB), num_samples=32, codebook_size=8, kmeans_iters=2)
    recorder = LogRecorder()
    trainer = Trainer(model=model, args=training_args(tmp_path, max_steps=2), callbacks=[recorder])
    callback = MidxCallback.install(trainer, resume_from_checkpoint=tmp_path / "elsewhere")
    callbacks = trainer.callback_handler.callbacks
    flow = next(i for i, cb in enumerate(callbacks) if isinstance(cb, DefaultFlowCallback))
    assert callbacks.index(callback) == flow + 1 < callbacks.index(recorder)
    assert callback.installed and callback.resume_from_checkpoint == str(tmp_path / "elsewhere")
    # Installing again keeps the one callback in its place.
    assert MidxCallback.install(trainer) is callback
    assert sum(isinstance(cb, MidxCallback) for cb in callbacks) == 1 and callbacks.index(callback) == flow + 1
    with pytest.raises(ValueError, match="checkpoint folder path"):
        MidxCallback(resume_from_checkpoint=True)


def test_a_resume_outside_output_dir_without_the_folder_is_explained(tmp_path):
    first, _ = _plain_trainer(tmp_path / "a", max_steps=4)
    first.train()
    again = Trainer(
        model=hf_midx.wrap(tiny_model("gpt2", vocab_size=VOCAB, seed=0), num_samples=32, codebook_size=8),
        args=training_args(tmp_path / "b", max_steps=6),
        train_dataset=RowsDataset(markov_rows(48)),
    )
    MidxCallback.install(again)
    with pytest.raises(ValueError, match=r"MidxCallback\(resume_from_checkpoint=\.\.\.\)"):
        again.train(resume_from_checkpoint=str(tmp_path / "a" / "checkpoint-4"))


@pytest.mark.parametrize("with_callback", [False, True])
def test_a_trainer_without_the_callback_warns_once(tmp_path, with_callback, recwarn):
    model = hf_midx.wrap(
        tiny_model("gpt2", vocab_size=VOCAB), num_samples=32, codebook_size=8, kmeans_iters=2, refresh_every_steps=2
    )
    args = training_args(tmp_path, max_steps=4)
    trainer = Trainer(model=model, args=args, train_dataset=RowsDataset(markov_rows(32)))
    if with_callback:
        MidxCallback.install(trainer)
    trainer.train()
    messages = [str(w.message) for w in recwarn if "without MidxCallback" in str(w.message)]
    if with_callback:
        assert messages == []
        return
    assert len(messages) == 1, messages  # once, at the first training forward, not at each of the 4 steps
    for part in ("never refreshed", "midx/ diagnostics", "no sampler state", "MidxCallback.install(trainer)"):
        assert part in messages[0], part


def test_no_frame_walks_in_the_library():
    """The callback takes what it needs as arguments; nothing in hf_midx/ reads its callers' frames."""
    import pathlib
    import re

    package = pathlib.Path(hf_midx.__file__).parent
    pattern = re.compile(r"sys\._getframe|inspect\.currentframe|inspect\.stack|\bf_back\b|\bf_locals\b")
    hits = [f"{p.name}:{i}" for p in package.rglob("*.py") for i, line in enumerate(p.read_text().splitlines(), 1)
            if pattern.search(line)]
    assert hits == []


def test_the_wrapped_model_declares_a_causal_lm_loss(tmp_path):
    """GPT-2 declares no loss_type; wrapped, it declares ForCausalLM (the head always shifts the labels),
    so a plain Trainer counts num_items_in_batch over labels[..., 1:]; unwrap gives the old value back."""
    model = tiny_model("gpt2", vocab_size=VOCAB)
    before = model.loss_type
    hf_midx.wrap(model, num_samples=32, codebook_size=8, kmeans_iters=2)
    assert model.loss_type == "ForCausalLM"
    trainer = Trainer(model=model, args=training_args(tmp_path), train_dataset=RowsDataset(markov_rows(8)))
    MidxCallback.install(trainer)
    batch = {"input_ids": markov_rows(2), "labels": markov_rows(2).clone()}
    batch["labels"][0, :5] = -100
    if not hasattr(trainer, "get_batch_samples"):  # transformers < 4.48 counts the unshifted labels
        pytest.skip("this transformers has no Trainer.get_batch_samples")
    _, count = trainer.get_batch_samples(iter([batch]), 1, torch.device("cpu"))
    if count is not None and "_loss_shifts_labels" in vars(trainer):  # transformers that shift the count
        assert int(count) == int(batch["labels"][..., 1:].ne(-100).sum())
    hf_midx.unwrap(model)
    assert model.loss_type == before


def test_a_plain_resume_finds_the_checkpoint_in_output_dir(tmp_path):
    """The fallback: resume_from_checkpoint=True loads <output_dir>/checkpoint-<step>, and so does the callback."""
    first, _ = _plain_trainer(tmp_path / "run", max_steps=4)
    first.train()
    again, _ = _plain_trainer(tmp_path / "run", max_steps=6)
    head = find_head(again.model)
    again.train(resume_from_checkpoint=True)
    assert again.state.global_step == 6 and head.step_data.calls == 2


def test_a_callback_not_installed_says_the_reporters_may_miss_its_keys(tmp_path):
    model = hf_midx.wrap(tiny_model("gpt2", vocab_size=VOCAB), num_samples=32, codebook_size=8, kmeans_iters=2)
    trainer = Trainer(
        model=model, args=training_args(tmp_path, max_steps=1), train_dataset=RowsDataset(markov_rows(8)),
        callbacks=[MidxCallback()],
    )
    trainer.args.report_to = ["wandb"]  # as if the integration were installed (the reporters are already built)
    with pytest.warns(UserWarning, match=r"\['wandb'\] may run before it.*MidxCallback.install\(trainer\)"):
        trainer.train()


def test_plain_trainer_save_model_writes_midx_config_and_card(tmp_path):
    """Issue 39: a plain Trainer with MidxCallback.install saves midx_config.json and the MIDX card with the model,
    into output_dir and into any folder given to save_model; checkpoints get no card. Both say the interval the
    "auto" refresh chose."""
    trainer, _ = _plain_trainer(tmp_path / "run", max_steps=4, schedule=AUTO)
    trainer.train()
    assert not os.path.exists(tmp_path / "run" / "checkpoint-4" / "README.md")
    for folder in (None, tmp_path / "elsewhere"):
        trainer.save_model(None if folder is None else str(folder))
        folder = folder or tmp_path / "run"
        assert {"midx_config.json", "README.md", "model.safetensors"} <= set(os.listdir(folder)), folder
        assert MidxConfig.from_pretrained(str(folder)).codebook_size == 8
        assert json.loads((folder / "midx_config.json").read_text())["chosen"] == {"refresh_every_steps": 3}
        card = (folder / "README.md").read_text()
        assert "| Sampler | `midx-rq` |" in card and "trained from scratch" in card and "(last chosen: 3)" in card
    again = MidxCallback.install(trainer)  # a second install wraps save_model once
    assert again is next(cb for cb in trainer.callback_handler.callbacks if isinstance(cb, MidxCallback))
    assert not getattr(trainer.save_model.__wrapped__, "midx_wrapped", False)
    # Unwrapped, the model is a plain one: saved without midx_config.json nor a MIDX card (both were written).
    hf_midx.unwrap(trainer.model)
    trainer.save_model(str(tmp_path / "plain"))
    saved = set(os.listdir(tmp_path / "plain"))
    assert "model.safetensors" in saved and "midx_config.json" not in saved, saved
    assert "README.md" not in saved or "hf-midx" not in (tmp_path / "plain" / "README.md").read_text()
    trainer.create_model_card()
    assert "hf-midx" not in (tmp_path / "run" / "README.md").read_text()


@pytest.mark.parametrize("name", sorted(hf_midx.SAMPLERS))
def test_every_sampler_state_tells_its_device_and_reloads_with_a_new_seed(name):
    """The callback reads the sampler only through the head's sampler_state / load_sampler_state: the state
    names the sampler's device (to rebuild it where a moved weight lives) and takes another generator state."""
    from types import SimpleNamespace

    from hf_midx.integration.distributed import broadcast_sampler, sampler_device
    from hf_midx.integration.state import GENERATOR_KEY

    sampler = hf_midx.build_sampler(name, torch.randn(64, 8), codebook_size=4, class_counts=torch.arange(1.0, 65.0))
    head = SimpleNamespace(sampler_state=sampler.state_dict, load_sampler_state=sampler.load_state_dict)
    assert sampler_device(head) == torch.device("cpu")
    tables = {k: v.clone() for k, v in sampler.state_dict().items() if k != GENERATOR_KEY}
    broadcast_sampler(head, seed=123)  # one process: keeps the tables, restarts the generator from the seed
    after = sampler.state_dict()
    assert all(torch.equal(tables[k], after[k]) for k in tables)
    assert torch.equal(after[GENERATOR_KEY], hf_midx.CounterRNG(123).get_state())


def test_any_trainer_with_the_callback_reports_the_exact_eval_perplexity(tmp_path):
    """A plain Trainer has no eval_perplexity of its own; the installed callback adds exp(eval_loss) to the metrics
    evaluate() returns, to log_history and to what the reporting integrations see."""
    model = hf_midx.wrap(tiny_model("gpt2", vocab_size=VOCAB), num_samples=32, codebook_size=8, kmeans_iters=2)
    recorder = LogRecorder()
    args = training_args(tmp_path, max_steps=2, per_device_eval_batch_size=8)
    rows = markov_rows(24)
    trainer = Trainer(model=model, args=args, train_dataset=RowsDataset(rows[:16]),
                      eval_dataset=RowsDataset(rows[16:]), callbacks=[recorder])  # fmt: skip
    MidxCallback.install(trainer)
    trainer.train()
    metrics = trainer.evaluate()
    model.eval()
    with torch.no_grad():  # the full softmax's loss over the same 8 rows, one batch
        exact = model(input_ids=rows[16:], labels=rows[16:]).loss.item()
    assert math.isclose(metrics["eval_perplexity"], math.exp(exact), rel_tol=1e-4)
    assert math.isclose(metrics["eval_perplexity"], math.exp(metrics["eval_loss"]), rel_tol=1e-9)
    assert trainer.state.log_history[-1]["eval_perplexity"] == metrics["eval_perplexity"]
    assert recorder.entries[-1]["eval_perplexity"] == metrics["eval_perplexity"]
    assert not any("train_perplexity" in e for e in trainer.state.log_history)  # the sampled estimate: not exp'd
