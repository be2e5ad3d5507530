"""MidxTrainer on tiny GPT-2 models from configs: convergence, exact evaluation, index refresh and KL
logging, learned codebooks, bit-identical resume, checkpoint validation, model cards and NaN handling.

Everything runs on CPU and offline; the corpus is a fixed Markov chain (tests/_models.markov_batches),
so a model that learns it lowers its loss well below log(V).
"""

from __future__ import annotations

import json
import math
import os
import warnings

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, TrainerCallback, TrainingArguments

from _models import markov_batches, tiny_model
import hf_midx
from hf_midx import MidxConfig, refresh_index
from hf_midx.integration.head import find_head
from hf_midx.integration.trainer import MIDX_RNG_STATE_NAME, MIDX_STATE_NAME, MidxNonFiniteError, MidxTrainer

VOCAB = 256
SEQ = 16


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    """Tiny models: one intra-op thread is faster and far steadier on a shared CPU than several."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


class RowsDataset(torch.utils.data.Dataset):
    """(N, S) token rows as causal-LM examples (labels = input_ids; the model shifts them)."""

    def __init__(self, rows: torch.Tensor) -> None:
        self.rows = rows

    def __len__(self) -> int:
        return self.rows.shape[0]

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.rows[i], "labels": self.rows[i]}


def markov_rows(n: int, vocab: int = VOCAB) -> torch.Tensor:
    """n rows of one fixed Markov chain (markov_batches' seed fixes the chain, so it stays 1)."""
    return torch.cat(markov_batches(vocab, n, SEQ, 1, seed=1))


def eval_rows(n: int, vocab: int = VOCAB) -> torch.Tensor:
    """Other rows of the same chain (the last rows of a longer draw)."""
    return markov_rows(1000 + n, vocab=vocab)[-n:]


def wrapped_model(seed: int = 0, vocab: int = VOCAB, **config):
    model = tiny_model("gpt2", vocab_size=vocab, seed=seed)
    defaults = dict(num_samples=32, codebook_size=8, kmeans_iters=10)
    return hf_midx.wrap(model, MidxConfig(**{**defaults, **config}))


def training_args(output_dir, **overrides) -> TrainingArguments:
    defaults = dict(
        per_device_train_batch_size=8,
        per_device_eval_batch_size=32,
        learning_rate=1e-2,
        max_steps=20,
        logging_steps=5,
        save_strategy="no",
        report_to=[],
        use_cpu=True,
        disable_tqdm=True,
        seed=0,
        dataloader_num_workers=0,
    )
    return TrainingArguments(output_dir=str(output_dir), **{**defaults, **overrides})


def history(trainer, key: str) -> list[float]:
    return [entry[key] for entry in trainer.state.log_history if key in entry]


# ------------------------------------------------------------------------------------- training
def test_training_lowers_loss_and_evaluation_is_exact(tmp_path):
    train, evals = RowsDataset(markov_rows(400)), RowsDataset(eval_rows(64))
    model = wrapped_model(refresh_every_steps=10)
    args = training_args(tmp_path, max_steps=50, logging_steps=5)
    trainer = MidxTrainer(model=model, args=args, train_dataset=train, eval_dataset=evals)
    before = trainer.evaluate()
    trainer.train()
    after = trainer.evaluate()

    losses = history(trainer, "loss")
    kls = history(trainer, "midx/kl")
    refresh = history(trainer, "midx/refresh_seconds")
    print(
        f"[trainer] train loss {losses[0]:.3f} -> {losses[-1]:.3f}; eval loss {before['eval_loss']:.3f} -> "
        f"{after['eval_loss']:.3f} (ppl {before['eval_perplexity']:.1f} -> {after['eval_perplexity']:.1f}); "
        f"exact train loss {history(trainer, 'midx/train_loss_exact')[0]:.3f} -> "
        f"{history(trainer, 'midx/train_loss_exact')[-1]:.3f}; "
        f"KL {kls[0]:.4f} -> {kls[-1]:.4f}; "
        f"refresh {min(refresh) * 1e3:.2f}-{max(refresh) * 1e3:.2f} ms x{len(refresh)}"
    )
    # log(256) = 5.55 at the start; the chain's entropy (90% deterministic) is far lower.
    assert losses[-1] < losses[0] - 0.5
    assert after["eval_loss"] < before["eval_loss"] - 0.5
    assert after["eval_perplexity"] == pytest.approx(math.exp(after["eval_loss"]), rel=1e-12)
    # refresh_every_steps=10 over 50 steps: refreshes at 10, 20, 30, 40, 50, each logged with its time.
    assert len(refresh) == 5 and all(0 < s < 60 for s in refresh)
    assert len(kls) == len(losses) == 10 and all(math.isfinite(k) and k >= -1e-6 for k in kls)
    # The exact loss of the logged micro-batches (the sampled `loss` is an estimate) falls as the eval loss does.
    exact = history(trainer, "midx/train_loss_exact")
    assert len(exact) == 10 and exact[-1] < exact[0] - 0.5, exact
    # The MIDX values share the training log entries (what progress bars / TensorBoard receive).
    assert all("loss" in e for e in trainer.state.log_history if "midx/kl" in e)
    final = next(e for e in trainer.state.log_history if "train_runtime" in e)
    assert final["train_tokens_per_second"] > 0

    # The exact eval loss (no logits materialized) equals the unwrapped GPT-2's mean next-token NLL,
    # computed here from full logits. (A plain Trainer on GPT-2 reports that times S/(S+1) in
    # transformers 5.x, counting num_items_in_batch over unshifted labels; MidxTrainer must not.)
    hf_midx.unwrap(model)
    model.eval()
    with torch.no_grad():
        logits = model(evals.rows).logits[:, :-1].float()
        nll = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), evals.rows[:, 1:].reshape(-1))
    assert after["eval_loss"] == pytest.approx(float(nll), rel=1e-5, abs=1e-6)


def test_prediction_with_logits_matches_loss_only(tmp_path):
    """Loss-only evaluation never builds the (tokens x V) logits; with compute_metrics the model returns
    the full logits, and both give the same exact loss."""
    evals = RowsDataset(eval_rows(32))
    model = wrapped_model()
    trainer = MidxTrainer(model=model, args=training_args(tmp_path), eval_dataset=evals)
    widths = []
    hook = trainer.midx_head.register_forward_hook(lambda module, args, out: widths.append(out.shape[-1]))
    loss_only = trainer.evaluate()["eval_loss"]
    assert widths and set(widths) == {0}
    seen = {}

    def metrics(pred):
        seen["shape"] = tuple(pred.predictions.shape)
        return {}

    widths.clear()
    trainer.compute_metrics = metrics
    with_logits = trainer.evaluate()["eval_loss"]
    hook.remove()
    assert set(widths) == {VOCAB} and seen["shape"] == (32, SEQ, VOCAB)
    assert with_logits == pytest.approx(loss_only, rel=1e-5)


@pytest.mark.parametrize("trainer_class", ["MidxTrainer", "Trainer + install"])
def test_predict_reports_test_perplexity_with_every_trainer(tmp_path, trainer_class):
    from transformers import Trainer

    model, args = wrapped_model(), training_args(tmp_path)
    if trainer_class == "MidxTrainer":
        trainer = MidxTrainer(model=model, args=args)
    else:
        trainer = Trainer(model=model, args=args)
        hf_midx.MidxCallback.install(trainer)
    metrics = trainer.predict(RowsDataset(eval_rows(8))).metrics
    assert metrics["test_perplexity"] == pytest.approx(math.exp(metrics["test_loss"]), rel=1e-6)


def test_bf16_eval_loss_is_one_computation_with_or_without_compute_metrics(tmp_path):
    """Under bf16=True (autocast, also on a CPU) the loss-only evaluation multiplies in bfloat16 as the logits path
    and the unwrapped model do: the three eval_loss agree to float32 summation order (they differed by 6e-4)."""
    from transformers import Trainer

    evals = RowsDataset(eval_rows(32))
    # Llama: its loss type counts the shifted labels, as the binding's does (GPT-2 declares none, and the plain
    # Trainer then divides its eval_loss by S rather than S - 1 tokens a row).
    model = hf_midx.wrap(tiny_model("llama", vocab_size=VOCAB, seed=0), MidxConfig(num_samples=32, codebook_size=8))
    with torch.no_grad():  # logits of a trained model's size, where bfloat16 rounding shows
        find_head(model).weight.mul_(20.0)
    args = training_args(tmp_path, bf16=True)
    trainer = MidxTrainer(model=model, args=args, eval_dataset=evals)
    loss_only = trainer.evaluate()["eval_loss"]
    trainer.compute_metrics = lambda pred: {}
    with_logits = trainer.evaluate()["eval_loss"]
    hf_midx.unwrap(model)
    unwrapped = Trainer(model=model, args=args, eval_dataset=evals).evaluate()["eval_loss"]
    assert with_logits == pytest.approx(unwrapped, abs=2e-6)
    assert loss_only == pytest.approx(unwrapped, abs=2e-6), (loss_only, with_logits, unwrapped)


def test_learned_codebooks_lower_their_kl(tmp_path):
    """codebooks='learned': the codebooks' KL objective (the paper's KL loss) and the sampler's own
    KL(Q || softmax) (midx/kl) both fall while the model is fixed.

    learning_rate=0 keeps the model, hence the target softmax, fixed, so a falling KL is the codebook
    learning's doing. The head weights are clustered, as trained embeddings are.
    """
    train = RowsDataset(markov_rows(320))
    # mix_weight=0: the learned codebooks shape the MIDX proposal; a defensive mixture's static half
    # would bound how far Q's KL can fall, whatever the codebooks.
    model = wrapped_model(codebooks="learned", refresh_every_steps=5, codebook_learning_rate=0.05, mix_weight=0.0)
    with torch.no_grad():
        weight = model.lm_head.weight
        g = torch.Generator().manual_seed(0)
        centers = torch.randn(20, weight.shape[1], generator=g) * 0.5
        members = centers[torch.randint(20, (weight.shape[0],), generator=g)]
        weight.copy_(members + 0.1 * torch.randn(weight.shape, generator=g))
    args = training_args(tmp_path, max_steps=40, logging_steps=5, learning_rate=0.0)
    trainer = MidxTrainer(model=model, args=args, train_dataset=train)
    initial = [c.clone() for c in trainer.midx_head.sampler.index.codebooks]
    trainer.train()

    objective_kl = history(trainer, "midx/codebook_kl")
    sampler_kl = history(trainer, "midx/kl")
    print(
        f"[learned] codebook KL objective {objective_kl[0]:.4f} -> {objective_kl[-1]:.4f}; "
        f"sampler KL(Q||P) {sampler_kl[0]:.4f} -> {sampler_kl[-1]:.4f}"
    )
    assert len(objective_kl) == 8 and len(sampler_kl) == 8
    assert objective_kl[-1] < 0.7 * objective_kl[0]
    assert sampler_kl[-1] < 0.7 * sampler_kl[0]
    learner = trainer.codebook_learner
    index = trainer.midx_head.sampler.index
    # The last refresh (step 40) adopted the learner's codewords, which moved away from their start.
    assert all(torch.equal(a, b) for a, b in zip(index.codebooks, learner.codebooks))
    assert not torch.equal(index.codebooks[0], initial[0])
    # The index does not alias the learner's parameters (Adam updates those in place).
    assert index.codebooks[0].data_ptr() != learner.codebook1.data_ptr()


# ------------------------------------------------------------------------------------- resume
def _resume_setup(tmp_path, name, **config):
    # 48 rows / batch 8 = 6 steps per epoch: over 8 steps the sampler is refreshed at step 5 (steps) and
    # 6 (epoch), learned codebooks step every step, and checkpoints are written at steps 4 and 8.
    model = wrapped_model(refresh_every_steps=5, refresh_every_epoch=True, **config)
    args = training_args(tmp_path / name, max_steps=8, logging_steps=1, save_strategy="steps", save_steps=4)
    return MidxTrainer(model=model, args=args, train_dataset=RowsDataset(markov_rows(48)))


RESUME_CASES = {
    "rq-learned": dict(codebooks="learned"),
    "pq-shared": dict(sampler="midx-pq", negatives="shared"),
    "uniform": dict(sampler="uniform"),
}


@pytest.mark.parametrize("case", list(RESUME_CASES))
def test_resume_is_bit_identical(tmp_path, case):
    config = RESUME_CASES[case]
    learned = config.get("codebooks") == "learned"
    full = _resume_setup(tmp_path, "full", **config)
    full.train()
    checkpoint = tmp_path / "full" / "checkpoint-4"
    names = set(os.listdir(checkpoint))
    assert {MIDX_STATE_NAME, MIDX_RNG_STATE_NAME, "midx_config.json", "model.safetensors"} <= names
    assert not [n for n in names if n.endswith(".tmp")]
    with safe_open(str(checkpoint / MIDX_STATE_NAME), framework="pt") as f:
        keys, meta = set(f.keys()), f.metadata()
    assert meta["num_classes"] == str(VOCAB) and meta["sampler"] == full.midx_config.sampler
    if case != "uniform":
        assert {"sampler.index.codebook1", "sampler.index.codebook2", "sampler.index.codes"} <= keys
        assert meta["codebook_size"] == "8"
    if learned:
        assert {"codebooks.codebook1", "codebooks.codebook2"} <= keys
        assert any(k.startswith("codebook_optimizer.state.0.") for k in keys)

    resumed = _resume_setup(tmp_path, "resumed", **config)
    resumed.train(resume_from_checkpoint=str(checkpoint))

    def per_step(trainer, key):
        return {e["step"]: e[key] for e in trainer.state.log_history if key in e and e["step"] > 4}

    for key in ("loss", "midx/kl", "grad_norm") + (("midx/codebook_loss",) if learned else ()):
        a, b = per_step(full, key), per_step(resumed, key)
        assert a and a == b, f"{key}: uninterrupted {a} != resumed {b}"
    # Refreshes after step 5 (steps) and at the start of epoch 2 (after step 6, logged with step 7).
    assert per_step(full, "midx/refresh_seconds").keys() == per_step(resumed, "midx/refresh_seconds").keys() == {5, 7}
    for (name, p), q in zip(full.model.named_parameters(), resumed.model.parameters()):
        assert torch.equal(p, q), name
    s_full, s_res = full.midx_head.sampler.state_dict(), resumed.midx_head.sampler.state_dict()
    assert s_full.keys() == s_res.keys() and all(torch.equal(s_full[k], s_res[k]) for k in s_full)
    if learned:
        for p, q in zip(full.codebook_learner.parameters(), resumed.codebook_learner.parameters()):
            assert torch.equal(p, q)
    print(f"[resume {case}] steps 5-8 losses identical: {per_step(full, 'loss')}")


@pytest.mark.parametrize("change", [{"codebook_size": 4}, {"vocab": VOCAB + 8}])
def test_resume_from_mismatched_checkpoint_raises(tmp_path, change):
    model = wrapped_model(refresh_every_epoch=False)
    args = training_args(tmp_path / "a", max_steps=2, save_strategy="steps", save_steps=2)
    MidxTrainer(model=model, args=args, train_dataset=RowsDataset(markov_rows(32))).train()
    checkpoint = tmp_path / "a" / "checkpoint-2"

    other = wrapped_model(refresh_every_epoch=False, **change)
    before = {k: v.clone() for k, v in other.state_dict().items()}
    sampler_before = {k: v.clone() for k, v in find_head(other).sampler.state_dict().items()}
    trainer = MidxTrainer(
        model=other, args=training_args(tmp_path / "b", max_steps=4), train_dataset=RowsDataset(markov_rows(32))
    )
    expected = "codebook_size" if "codebook_size" in change else "num_classes"
    with pytest.raises(ValueError, match=f"Cannot resume.*{expected}"):
        trainer.train(resume_from_checkpoint=str(checkpoint))
    # Nothing was loaded: weights and sampler are untouched, and no checkpoint was written.
    assert all(torch.equal(before[k], v) for k, v in other.state_dict().items())
    after = find_head(other).sampler.state_dict()
    assert all(torch.equal(sampler_before[k], after[k]) for k in after)
    assert not (tmp_path / "b").exists() or not any(p.name.startswith("checkpoint") for p in (tmp_path / "b").iterdir())


def test_resume_with_another_exact_head_raises(tmp_path):
    """The sampler's state indexes the classes outside the exact head: other counts, other head, other ids."""
    counts = (1000.0 / (torch.arange(VOCAB).double() + 1.0)).floor()

    def model_with(class_counts):
        config = MidxConfig(num_samples=32, codebook_size=8, kmeans_iters=10, exact_head=16, refresh_every_epoch=False)
        return hf_midx.wrap(tiny_model("gpt2", vocab_size=VOCAB), config, class_counts=class_counts)

    args = training_args(tmp_path / "a", max_steps=2, save_strategy="steps", save_steps=2)
    MidxTrainer(model=model_with(counts), args=args, train_dataset=RowsDataset(markov_rows(32))).train()
    checkpoint = str(tmp_path / "a" / "checkpoint-2")
    train = RowsDataset(markov_rows(32))
    other = MidxTrainer(model=model_with(counts.flip(0)), args=training_args(tmp_path / "b"), train_dataset=train)
    with pytest.raises(ValueError, match="its exact head is another set of 16 classes"):
        other.check_checkpoint(checkpoint)
    MidxTrainer(model=model_with(counts), args=training_args(tmp_path / "c"), train_dataset=train).check_checkpoint(
        checkpoint
    )  # the run's own counts


def test_resume_from_plain_checkpoint_raises(tmp_path):
    checkpoint = tmp_path / "plain"
    checkpoint.mkdir()
    train = RowsDataset(markov_rows(16))
    trainer = MidxTrainer(model=wrapped_model(), args=training_args(tmp_path / "b"), train_dataset=train)
    with pytest.raises(ValueError, match="not written by MidxTrainer"):
        trainer.train(resume_from_checkpoint=str(checkpoint))


# ------------------------------------------------------------------------------------- saving and cards
def _card_fields(card: str) -> None:
    for text in (
        "library_name: transformers",
        "- hf-midx",
        "- sampled-softmax",
        "- midx-rq",
        "pipeline_tag: text-generation",
        "| Sampler | `midx-rq` |",
        "| Codewords per codebook (K) | 8 (64 buckets) |",
        "| Negatives (M) | 32 per token",
        "| Codebooks | k-means",
        "| Sampler refresh | every 3 optimizer steps and at the start of every epoch",
        "Final exact evaluation perplexity:",
        "Training throughput (tokens/s):",
        "Training throughput (samples/s):",
        "- learning_rate: 0.01",
    ):
        assert text in card, f"model card lacks {text!r}:\n{card}"


def test_save_model_writes_plain_model_and_card(tmp_path):
    train, evals = RowsDataset(markov_rows(64)), RowsDataset(eval_rows(32))
    model = wrapped_model(refresh_every_steps=3)
    args = training_args(tmp_path / "run", max_steps=6)
    trainer = MidxTrainer(model=model, args=args, train_dataset=train, eval_dataset=evals)
    trainer.train()
    metrics = trainer.evaluate()
    out = tmp_path / "saved"
    trainer.save_model(str(out))

    card = (out / "README.md").read_text()
    _card_fields(card)
    assert f"{metrics['eval_perplexity']:.4g}" in card
    assert json.loads((out / "midx_config.json").read_text())["codebook_size"] == 8
    # Plain transformers weights: exactly the unwrapped model's keys, loadable without hf-midx.
    saved = load_file(str(out / "model.safetensors"))
    hf_midx.unwrap(model)
    assert set(saved) <= set(model.state_dict()) and not any("midx" in k or "sampler" in k for k in saved)
    reloaded = AutoModelForCausalLM.from_pretrained(str(out), attn_implementation="eager").eval()
    assert type(reloaded) is type(model)
    model.eval()
    x = eval_rows(2)
    with torch.no_grad():
        assert torch.allclose(reloaded(x).logits, model(x).logits, rtol=0, atol=1e-6)


def test_save_model_keeps_the_user_s_readme_and_replaces_its_own_card(tmp_path):
    """A README.md of the user's in the output folder survives save_model (plain transformers leaves it), with one
    warning naming create_model_card; the MIDX card a previous save wrote is replaced by the new one."""
    model = wrapped_model(refresh_every_steps=0)
    trainer = MidxTrainer(model=model, args=training_args(tmp_path / "run", max_steps=1),
                          train_dataset=RowsDataset(markov_rows(8)))
    mine, generated = tmp_path / "mine", tmp_path / "generated"
    mine.mkdir()
    (mine / "README.md").write_text("# My model\n\nNotes I wrote by hand.\n")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.save_model(str(mine))
        trainer.save_model(str(mine))
    assert (mine / "README.md").read_text() == "# My model\n\nNotes I wrote by hand.\n"
    assert (mine / "midx_config.json").exists()
    assert len([w for w in caught if "create_model_card" in str(w.message)]) == 1
    trainer.save_model(str(generated))
    first = (generated / "README.md").read_text()
    trainer.train()
    trainer.save_model(str(generated))
    assert "Generated by hf-midx" in first and (generated / "README.md").read_text() != first


@pytest.mark.parametrize("trainer_class", ["MidxTrainer", "Trainer + install"])
def test_a_subclass_reading_training_logits_is_told_what_happened_and_the_fix(tmp_path, trainer_class):
    """A compute_loss that reads outputs.logits in training meets the (B, S, 0) placeholder: its error says so."""
    from transformers import Trainer

    base = MidxTrainer if trainer_class == "MidxTrainer" else Trainer

    class AccuracyTrainer(base):
        def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
            outputs = model(**inputs)
            self.accuracy = (outputs.logits.argmax(-1)[:, :-1] == inputs["labels"][:, 1:]).float().mean()
            return (outputs.loss, outputs) if return_outputs else outputs.loss

    model = wrapped_model(refresh_every_steps=0)
    trainer = AccuracyTrainer(model=model, args=training_args(tmp_path / "run", max_steps=1),
                              train_dataset=RowsDataset(markov_rows(8)))
    if base is Trainer:
        hf_midx.MidxCallback.install(trainer)
    with pytest.raises((IndexError, RuntimeError)) as caught:
        trainer.train()
    said = "\n".join([str(caught.value), *getattr(caught.value, "__notes__", [])])
    assert "placeholder" in said and "build your loss from outputs.loss" in said and "hf_midx.unwrap" in said


def test_push_to_hub_uploads_model_and_card(tmp_path, monkeypatch):
    import transformers.trainer as hf_trainer

    calls = {}

    class FakeApi:
        def create_repo(self, repo_id, **kwargs):
            calls["create_repo"] = repo_id
            return type("RepoUrl", (), {"repo_id": f"user/{repo_id}"})()

        def upload_folder(self, **kwargs):
            folder = kwargs["folder_path"]
            calls["upload"] = kwargs
            calls["files"] = sorted(os.listdir(folder))
            calls["card"] = open(os.path.join(folder, "README.md"), encoding="utf-8").read()
            return "commit-info"

    if hasattr(hf_trainer, "hf_api"):  # transformers >= 5: one HfApi
        monkeypatch.setattr(hf_trainer, "hf_api", lambda: FakeApi())
    else:  # 4.57: huggingface_hub's functions, imported by name
        fake = FakeApi()
        monkeypatch.setattr(hf_trainer, "create_repo", lambda repo_id, **kwargs: fake.create_repo(repo_id, **kwargs))
        monkeypatch.setattr(hf_trainer, "upload_folder", fake.upload_folder)
    train, evals = RowsDataset(markov_rows(64)), RowsDataset(eval_rows(32))
    args = training_args(tmp_path / "midx-gpt2", max_steps=6)
    model = wrapped_model(refresh_every_steps=3)
    model.config._name_or_path = "openai-community/gpt2"  # as if fine-tuned from the Hub (HF_HUB_OFFLINE=1)
    trainer = MidxTrainer(model=model, args=args, train_dataset=train, eval_dataset=evals)
    trainer.train()
    trainer.evaluate()
    assert trainer.push_to_hub(commit_message="done") == "commit-info"
    assert calls["create_repo"] == "midx-gpt2" and calls["upload"]["repo_id"] == "user/midx-gpt2"
    assert {"README.md", "midx_config.json", "model.safetensors", "config.json"} <= set(calls["files"])
    _card_fields(calls["card"])
    assert "# midx-gpt2" in calls["card"]
    assert "base_model: openai-community/gpt2" in calls["card"]
    assert "fine-tuned version of [openai-community/gpt2]" in calls["card"]


def test_model_card_extras_add_results_and_sections(tmp_path):
    """A script's final results go into every card the trainer writes (save_model, push_to_hub's)."""
    from huggingface_hub import EvalResult

    import hf_midx

    model = wrapped_model()
    args = training_args(tmp_path / "run", max_steps=2)
    trainer = MidxTrainer(model=model, args=args, train_dataset=RowsDataset(markov_rows(16)))
    trainer.train()
    result = EvalResult(
        task_type="text-generation", dataset_type="markov", dataset_name="Markov chain", dataset_split="test",
        metric_type="perplexity", metric_value=12.5,
    )  # fmt: skip
    trainer.model_card_extras = {"eval_results": [result], "sections": ["## Results of my script\n\nall good"]}
    trainer.create_model_card(model_name="tiny", dataset="Markov chain")
    card = (tmp_path / "run" / "README.md").read_text()
    assert card.rstrip().endswith("## Results of my script\n\nall good")
    assert "value: 12.5" in card and "name: Markov chain" in card and "- perplexity" in card
    assert "on Markov chain." in card  # the dataset named in the text
    for name, version in hf_midx.versions().items():
        assert f"- {name} {version}" in card  # the framework versions, as results files list them
    trainer.model_card_extras = {"section": "typo"}
    with pytest.raises(ValueError, match="unknown keys \\['section'\\]"):
        trainer.create_model_card()


class FakeTokenizer:
    """A processing_class with a length (the tokenizer's vocabulary) and nothing to save."""

    def __len__(self) -> int:
        return VOCAB - 6

    def save_pretrained(self, folder, **kwargs):
        return ()


def test_card_names_a_local_base_model_and_the_tokenizer_size(tmp_path):
    """Issue 39: a model fine-tuned from a local folder is not "trained from scratch"; V is the head's rows, with
    the tokenizer's size beside it when they differ."""
    base = tmp_path / "my-base"
    base.mkdir()
    model = wrapped_model()
    model.config.name_or_path = str(base)  # as from_pretrained(local folder) sets it
    args = training_args(tmp_path / "run", max_steps=2)
    trainer = MidxTrainer(model=model, args=args, train_dataset=RowsDataset(markov_rows(16)),
                          processing_class=FakeTokenizer())  # fmt: skip
    trainer.train()
    trainer.save_model()
    card = (tmp_path / "run" / "README.md").read_text()
    assert f"fine-tuned version of the local model `{base}`" in card and "from scratch" not in card
    assert "base_model:" not in card  # a local folder is no Hub id
    assert f"| Vocabulary (V, the LM head's rows) | {VOCAB} (the tokenizer has {VOCAB - 6} tokens) |" in card


def test_card_base_model_of_hub_ids_and_paths(tmp_path):
    from hf_midx.integration.model_card import base_model_of

    assert base_model_of("openai-community/gpt2") == ("openai-community/gpt2", None)
    assert base_model_of("gpt2") == ("gpt2", None)
    assert base_model_of(str(tmp_path)) == (None, str(tmp_path))
    assert base_model_of("/no/such/folder/model") == (None, "/no/such/folder/model")
    assert base_model_of("") == (None, None) and base_model_of(None) == (None, None)


def test_the_perplexity_cutoff_is_one_setting(tmp_path, monkeypatch):
    """Issue 38: the evaluation metric and the card read one cutoff (hf_midx.integration.model_card); NaN stays NaN."""
    import hf_midx.integration.model_card as card
    from hf_midx.integration.model_card import midx_training_facts, perplexity

    assert perplexity(2.0) == math.exp(2.0) and perplexity(1e4) == math.inf and math.isnan(perplexity(math.nan))
    monkeypatch.setattr(card, "_PERPLEXITY_CUTOFF", 1.0)
    trainer = MidxTrainer(model=wrapped_model(), args=training_args(tmp_path),
                          eval_dataset=RowsDataset(eval_rows(8)))  # fmt: skip
    metrics = trainer.evaluate()
    assert metrics["eval_loss"] > 1.0 and metrics["eval_perplexity"] == math.inf
    assert midx_training_facts(MidxConfig(), [{"eval_loss": 1.5}])["eval_perplexity"] == "inf"


# ------------------------------------------------------------------------------------- errors
def test_requires_a_wrapped_model(tmp_path):
    with pytest.raises(ValueError, match=r"hf_midx\.wrap\(model, \.\.\.\) first"):
        MidxTrainer(model=tiny_model("gpt2", vocab_size=VOCAB), args=training_args(tmp_path))


@pytest.mark.parametrize("trainer_class", ["MidxTrainer", "Trainer + install"])
def test_a_compute_loss_func_trains_the_full_softmax_warned_once_with_every_trainer(tmp_path, trainer_class):
    """One behaviour: the Trainer takes the labels from the model's call, the model computes full logits, and the
    compute_loss_func trains the full softmax; one warning names compute_loss_func and the fix; nothing is drawn."""
    from transformers import Trainer

    def loss_func(outputs, labels, num_items_in_batch=None):
        logits = outputs.logits[:, :-1].reshape(-1, outputs.logits.shape[-1])
        return torch.nn.functional.cross_entropy(logits, labels[:, 1:].reshape(-1))

    model = wrapped_model(refresh_every_steps=0)
    args, data = training_args(tmp_path, max_steps=2), RowsDataset(markov_rows(16))
    if trainer_class == "MidxTrainer":
        trainer = MidxTrainer(model=model, args=args, train_dataset=data, compute_loss_func=loss_func)
    else:
        trainer = Trainer(model=model, args=args, train_dataset=data, compute_loss_func=loss_func)
        hf_midx.MidxCallback.install(trainer)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.train()
    told = [w for w in caught if "drop compute_loss_func" in str(w.message)]
    assert len(told) == 1 and find_head(model).sampled_calls == 0
    assert all(math.isfinite(e["loss"]) for e in trainer.state.log_history if "loss" in e)


class _PoisonAt(TrainerCallback):
    """Sets one tensor to NaN after optimizer step ``step``."""

    def __init__(self, step: int, tensor) -> None:
        self.step, self.tensor = step, tensor

    def on_step_end(self, args, state, control, **kwargs):
        if state.global_step == self.step:
            with torch.no_grad():
                self.tensor.fill_(float("nan"))


@pytest.mark.parametrize(
    "where, logging_steps, refresh_every_steps",
    [
        ("head", 2, 0),  # found at the logging step 4
        ("block", 2, 0),
        ("head", 100, 4),  # no logging step before 10: found at the refresh step 4
    ],
)
def test_non_finite_values_stop_training_with_the_step(tmp_path, where, logging_steps, refresh_every_steps):
    """NaN is looked for at logging / refresh / save steps (no sync per micro-batch), and the message names
    the optimizer step whose forward first produced it and the tensor."""
    # An untied head: poisoning a tied one would poison the input embeddings, hence the hidden states.
    model = hf_midx.wrap(
        tiny_model("gpt2", vocab_size=VOCAB, tie_word_embeddings=False),
        MidxConfig(num_samples=32, codebook_size=8, kmeans_iters=10, refresh_every_epoch=False),
        refresh_every_steps=refresh_every_steps,
    )
    tensor = model.lm_head.weight if where == "head" else model.transformer.h[1].mlp.c_proj.weight
    args = training_args(tmp_path, max_steps=10, logging_steps=logging_steps)
    train = RowsDataset(markov_rows(80))  # 10 steps per epoch
    trainer = MidxTrainer(model=model, args=args, train_dataset=train, callbacks=[_PoisonAt(3, tensor)])
    cause = "LM head weight" if where == "head" else r"hidden states \(the LM head's input\)"
    with pytest.raises(MidxNonFiniteError, match=rf"at training step 4 \(epoch 0.40\), in the {cause}"):
        trainer.train()
    assert trainer.state.global_step == 4


def test_refresh_of_a_non_finite_head_weight_is_refused():
    model = wrapped_model()
    head = find_head(model)
    before = {k: v.clone() for k, v in head.sampler.state_dict().items()}
    with torch.no_grad():
        model.lm_head.weight[3, 1] = float("inf")
    with pytest.raises(MidxNonFiniteError, match="found during the index refresh"):
        refresh_index(model)
    assert all(torch.equal(before[k], v) for k, v in head.sampler.state_dict().items())
