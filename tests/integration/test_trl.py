"""TRL: SFTTrainer asks the model for fused_lm_head=True outputs for its plain next-token NLL; the MIDX head must
answer them from the sampled softmax in training (never the full softmax) and let TRL's exact path run in evaluation.

Offline: a word-level tokenizer built with ``tokenizers``, a pre-tokenized dataset, a tiny GPT-2.
"""

from __future__ import annotations

import importlib.util
import math

import pytest
import torch
from packaging.version import Version

trl = pytest.importorskip("trl")
datasets = pytest.importorskip("datasets")

from tokenizers import Tokenizer, models, pre_tokenizers  # noqa: E402
from transformers import PreTrainedTokenizerFast  # noqa: E402
from trl.trainer.utils import add_fused_lm_head  # noqa: E402

from _models import clone_model, tiny_model  # noqa: E402
import hf_midx  # noqa: E402
from hf_midx import MidxCallback, MidxConfig  # noqa: E402
from hf_midx.integration.head import find_head  # noqa: E402
from hf_midx.integration.wrap import MidxFusedOutput  # noqa: E402
from test_trainer import SEQ, VOCAB, markov_rows  # noqa: E402

TRITON = importlib.util.find_spec("triton") is not None


def _tokenizer() -> PreTrainedTokenizerFast:
    """Word-level: token i is the word "w<i>"; id 0 doubles as <eos> (the tiny GPT-2's eos) and padding."""
    vocab = {"<eos>": 0, **{f"w{i}": i for i in range(1, VOCAB)}}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<eos>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<eos>", pad_token="<eos>", unk_token="<eos>")


def _wrapped(**config):
    model = tiny_model("gpt2", vocab_size=VOCAB, seed=0)
    return hf_midx.wrap(model, MidxConfig(num_samples=32, codebook_size=8, kmeans_iters=5, **config))


def test_sft_trainer_trains_through_the_sampler(tmp_path, recwarn):
    model = _wrapped(refresh_every_steps=3)
    head = find_head(model)
    rows = markov_rows(48)
    train = datasets.Dataset.from_dict({"input_ids": rows.tolist()})
    args = trl.SFTConfig(
        output_dir=str(tmp_path),
        max_steps=6,
        per_device_train_batch_size=8,
        learning_rate=1e-2,
        logging_steps=2,
        save_strategy="no",
        report_to=[],
        use_cpu=True,
        disable_tqdm=True,
        seed=0,
        max_length=SEQ,
        dataset_num_proc=None,
    )
    trainer = trl.SFTTrainer(
        model=model, args=args, train_dataset=train, processing_class=_tokenizer(), callbacks=[MidxCallback()]
    )
    forwards, draws = [], []
    hook = model.register_forward_pre_hook(
        lambda m, a, kw: forwards.append(bool(kw.get("fused_lm_head"))) if m.training else None,
        with_kwargs=True,
        prepend=True,  # before the head's own hook, which takes fused_lm_head out of the call
    )
    # The default (corrected-positive estimator, expected tail gradient) draws, scores the labels and gives the
    # proposal's closed form in one call.
    sampler_draw = head.sampler.draw_with_factors

    def counting_draw(*args, **kwargs):
        # The logged diagnostics draw too, with a generator of their own; the training draws use the sampler's.
        if kwargs.get("generator") is None:
            draws.append(args[0].shape[0])
        return sampler_draw(*args, **kwargs)

    setattr(head.sampler, sampler_draw.__name__, counting_draw)
    codes = head.sampler.state_dict()["index.codes"].clone()
    trainer.train()
    hook.remove()

    history = trainer.state.log_history
    losses = [e["loss"] for e in history if "loss" in e]
    refreshes = [e["step"] for e in history if "midx/refresh_seconds" in e]
    print(f"[sft] {len(forwards)} training forwards, {len(draws)} draws; losses {losses}; refreshes {refreshes}")
    # SFTTrainer called the model with fused_lm_head=True in every training forward, and every one of them
    # drew negatives (one draw of T = 8 x 16 tokens each): the full softmax never trained.
    assert len(forwards) == 6 and all(forwards)
    assert len(draws) == 6 and set(draws) == {8 * SEQ} and head.sampled_calls == 6
    assert len(losses) == 3 and all(math.isfinite(x) for x in losses)
    # Refreshed after steps 3 and 6 (logged with the next log entry: steps 4 and 6).
    assert refreshes == [4, 6] and not torch.equal(codes, head.sampler.state_dict()["index.codes"])
    exact = [e["midx/train_loss_exact"] for e in history if "midx/train_loss_exact" in e]
    assert len(exact) == 3 and all(math.isfinite(x) for x in exact)
    # Entropy and top-1 accuracy need the full softmax: left out of the training logs with one warning, not
    # logged as NaN nor made up.
    assert not any("entropy" in e or "mean_token_accuracy" in e for e in history if "loss" in e)
    assert not any(isinstance(v, float) and math.isnan(v) for e in history for v in e.values())
    assert sum("left out of the training logs" in str(w.message) for w in recwarn) == 1


def test_the_final_summary_has_no_nan_when_no_step_was_logged(tmp_path, recwarn):
    """With no per-step log (logging_steps past max_steps), TRL puts the steps' NaN entropy and token accuracy into
    the training summary (train_runtime, train_loss): left out there too, with the one warning."""
    train = datasets.Dataset.from_dict({"input_ids": markov_rows(16).tolist()})
    args = trl.SFTConfig(output_dir=str(tmp_path), max_steps=2, per_device_train_batch_size=8, logging_steps=10,
                         save_strategy="no", report_to=[], use_cpu=True, disable_tqdm=True, max_length=SEQ,
                         dataset_num_proc=None)  # fmt: skip
    trainer = trl.SFTTrainer(model=_wrapped(), args=args, train_dataset=train, processing_class=_tokenizer())
    MidxCallback.install(trainer)
    trainer.train()
    summary = trainer.state.log_history[-1]
    assert "train_runtime" in summary and "loss" not in summary
    assert not any(isinstance(v, float) and math.isnan(v) for v in summary.values()), summary
    assert "entropy" not in summary and "mean_token_accuracy" not in summary
    assert sum("left out of the training logs" in str(w.message) for w in recwarn) == 1


def test_fused_output_is_the_sampled_loss_in_training_and_exact_in_eval():
    """Under log_probs="sampled" (what "auto" makes of SFTTrainer's plain NLL; tests/integration/test_post_training.py
    has the exact calls of the other trainers)."""
    model = _wrapped(log_probs="sampled")
    reference = clone_model(model)  # a plain GPT-2 with the same weights
    for m in (model, reference):
        add_fused_lm_head(m, outputs=("log_probs", "entropy", "is_top1"))
    head = find_head(model)
    ids = markov_rows(4)
    labels = ids.clone()
    labels[0, :5] = -100

    model.train()
    state = head.sampler.generator.get_state()
    torch.manual_seed(5)  # the same dropout masks in both calls
    out = model(input_ids=ids, labels=labels, fused_lm_head=True)
    assert isinstance(out, MidxFusedOutput)
    assert out.log_probs.shape == out.label_mask.shape == (4, SEQ - 1)
    assert torch.equal(out.label_mask, labels[:, 1:] != -100)
    assert bool((out.log_probs[~out.label_mask] == 0).all()) and bool((out.log_probs <= 0).all())
    assert torch.isnan(out.entropy).all() and torch.isnan(out.is_top1).all()
    # The same draws through the plain call give the same loss: the fused output is the sampled loss.
    head.sampler.generator.set_state(state)
    torch.manual_seed(5)
    plain = model(input_ids=ids, labels=labels).loss
    fused_loss = -out.log_probs.sum() / out.label_mask.sum()
    assert float(out.loss) == pytest.approx(float(plain), rel=1e-6)
    assert float(fused_loss) == pytest.approx(float(plain), rel=1e-6)
    out.loss.backward()
    assert head.weight.grad is not None and torch.isfinite(head.weight.grad).all()
    # Pre-shifted labels only (TRL under context parallelism): one entry per position, still sampled.
    shifted = torch.nn.functional.pad(labels, (0, 1), value=-100)[:, 1:]
    head.sampler.generator.set_state(state)
    torch.manual_seed(5)
    out_shifted = model(input_ids=ids, shift_labels=shifted, fused_lm_head=True)
    assert isinstance(out_shifted, MidxFusedOutput) and out_shifted.log_probs.shape == (4, SEQ)
    assert float(out_shifted.loss) == pytest.approx(float(plain), rel=1e-6)

    # Evaluation: TRL's own exact log-probabilities, the same as for the unwrapped model.
    if Version(trl.__version__) < Version("1.16") and ids.device.type == "cpu" and TRITON:
        pytest.skip("TRL < 1.16's chunked log-prob kernel launches Triton on CPU tensors (TRL's fused eval, not ours)")
    model.eval()
    reference.eval()
    with torch.no_grad():
        got = model(input_ids=ids, labels=labels, fused_lm_head=True)
        want = reference(input_ids=ids, labels=labels, fused_lm_head=True)
    assert not isinstance(got, MidxFusedOutput)
    torch.testing.assert_close(got.log_probs, want.log_probs, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(got.is_top1, want.is_top1)


def test_readme_sft_block_trains_through_the_sampler(tmp_path, monkeypatch):
    """The README's SFTTrainer block, as written: every training step went through the sampled softmax
    (tests/test_readme.py runs every block; this one also looks inside)."""
    from test_readme import README, fenced_blocks, readme

    snippet = next(b for b in fenced_blocks(readme(), "python") if "SFTTrainer(" in b)
    monkeypatch.chdir(tmp_path)
    namespace: dict = {}
    exec(compile(snippet, str(README), "exec"), namespace)
    trainer, head = namespace["trainer"], find_head(namespace["model"])
    assert head is not None and head.sampled_calls == trainer.state.global_step > 0
