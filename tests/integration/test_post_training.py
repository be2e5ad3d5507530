"""TRL's post-training trainers on a wrapped model compute what the unwrapped model computes.

DPO, KTO, GRPO, RLOO, ORPO and CPO read per-token log-probabilities of the policy (and of a reference) as exact values:
ratios, KL penalties and preference margins are built on them. A wrapped model answers those calls exactly
(TRL's own tiled head over all V classes), so every run here logs, step for step, the numbers of the same run
with the unwrapped model; with learning rate 0 they are also the known values (DPO's loss log 2, rewards 0, KL 0).
SFTTrainer (the plain next-token NLL) and the plain Trainer keep the sampled softmax: the sampler draws at
every step. Offline: a word-level tokenizer, tiny Llama / GPT-2 models saved to a temporary folder.
"""

from __future__ import annotations

import math
import warnings

import pytest
import torch
from packaging.version import Version

trl = pytest.importorskip("trl")
datasets = pytest.importorskip("datasets")

from tokenizers import Tokenizer, models, pre_tokenizers  # noqa: E402
from transformers import AutoModelForCausalLM, PreTrainedTokenizerFast, TrainerCallback, TrainingArguments  # noqa: E402
from trl.trainer.utils import add_fused_lm_head  # noqa: E402

from _models import tiny_model  # noqa: E402
import hf_midx  # noqa: E402
from hf_midx import MidxCallback, MidxConfig, MidxTrainer  # noqa: E402
from hf_midx.integration.head import find_head  # noqa: E402
from hf_midx.integration.log_prob_calls import decide_log_probs  # noqa: E402

V = 256
# TRL 1.15's tiled log-prob head is Triton only (it imports triton and launches its kernel on CPU tensors): there its
# DPO, KTO, GRPO and RLOO do not run on a CPU, unwrapped models neither. TRL 1.16 folds the tiles in torch off the GPU.
needs_trl_fused = pytest.mark.skipif(Version(trl.__version__) < Version("1.16"), reason="TRL < 1.16's fused head runs "
                                     "on GPUs only (unwrapped models too)")


def _tokenizer() -> PreTrainedTokenizerFast:
    """Word-level: token i is the word "w<i>"; id 0 doubles as <eos> and padding."""
    tok = Tokenizer(models.WordLevel(vocab={"<eos>": 0, **{f"w{i}": i for i in range(1, V)}}, unk_token="<eos>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<eos>", pad_token="<eos>", unk_token="<eos>")


def _texts(n: int, words: int, seed: int) -> list[str]:
    ids = torch.randint(1, V, (n, words), generator=torch.Generator().manual_seed(seed))
    return [" ".join(f"w{i}" for i in row) for row in ids.tolist()]


def _length_reward(completions, **kwargs) -> list[float]:
    return [float(len(c)) for c in completions]


@pytest.fixture(scope="module")
def base_dir(tmp_path_factory) -> str:
    """A tiny Llama saved to disk: policy and reference load the same weights the same way (GRPO and RLOO load
    their reference from the policy's ``name_or_path``)."""
    folder = tmp_path_factory.mktemp("base")
    model = tiny_model("llama", vocab_size=V, seed=0)
    model.config.pad_token_id = 0
    model.save_pretrained(folder)
    return str(folder)


def _train(kind: str, base_dir: str, out: str, *, wrapped: bool, lr: float, lora: bool = False,
           log_probs: str = "auto", steps: int = 3, bf16: bool = False):
    """``steps`` logged steps of ``kind`` from the saved model; returns (log_history, the head or None)."""
    torch.manual_seed(0)  # LoRA's initialization: the same in both runs
    model = AutoModelForCausalLM.from_pretrained(base_dir)
    if lora:
        peft = pytest.importorskip("peft")
        model = peft.get_peft_model(model, peft.LoraConfig(r=4, target_modules=["q_proj", "v_proj"]))
    if wrapped:
        hf_midx.wrap(model, MidxConfig(num_samples=32, codebook_size=8, kmeans_iters=5, log_probs=log_probs))
    common = dict(output_dir=out, max_steps=steps, per_device_train_batch_size=4, learning_rate=lr, logging_steps=1,
                  save_strategy="no", report_to=[], use_cpu=True, disable_tqdm=True, seed=0, bf16=bf16)
    pairs = datasets.Dataset.from_dict({"prompt": _texts(12, 5, 1), "chosen": _texts(12, 6, 2),
                                        "rejected": _texts(12, 6, 3)})
    prompts = datasets.Dataset.from_dict({"prompt": _texts(12, 5, 4)})
    # A temperature other than 1: TRL's head divides the logits by it, and so must an exact-forward answer.
    rl = dict(num_generations=2, max_completion_length=6, beta=0.1, generation_batch_size=4, temperature=0.7)
    reference = None if lora else AutoModelForCausalLM.from_pretrained(base_dir)
    if kind == "dpo":
        trainer = trl.DPOTrainer(model=model, ref_model=reference, args=trl.DPOConfig(**common, max_length=32),
                                 train_dataset=pairs, processing_class=_tokenizer())
    elif kind == "kto":
        data = datasets.Dataset.from_dict({"prompt": _texts(12, 5, 1), "completion": _texts(12, 6, 2),
                                           "label": [i % 2 == 0 for i in range(12)]})
        trainer = trl.KTOTrainer(model=model, ref_model=reference, args=trl.KTOConfig(**common, max_length=32),
                                 train_dataset=data, processing_class=_tokenizer())
    elif kind == "grpo":
        trainer = trl.GRPOTrainer(model=model, reward_funcs=_length_reward, args=trl.GRPOConfig(**common, **rl),
                                  train_dataset=prompts, processing_class=_tokenizer())
    elif kind == "rloo":
        trainer = trl.RLOOTrainer(model=model, reward_funcs=_length_reward, args=trl.RLOOConfig(**common, **rl),
                                  train_dataset=prompts, processing_class=_tokenizer())
    elif kind == "orpo":  # ORPO and CPO read full logits (no labels): the plain logits path
        from trl.experimental.orpo import ORPOConfig, ORPOTrainer

        trainer = ORPOTrainer(model=model, args=ORPOConfig(**common, max_length=32), train_dataset=pairs,
                              processing_class=_tokenizer())
    else:
        from trl.experimental.cpo import CPOConfig, CPOTrainer

        trainer = CPOTrainer(model=model, args=CPOConfig(**common, max_length=32), train_dataset=pairs,
                             processing_class=_tokenizer())
    if wrapped:
        MidxCallback.install(trainer)
    trainer.train()
    return trainer.state.log_history, find_head(model)


@pytest.mark.parametrize(
    "kind, lr, lora",
    [*(pytest.param(*case, marks=needs_trl_fused) for case in (
        ("dpo", 0.0, False), ("kto", 0.0, False), ("grpo", 0.0, False), ("dpo", 0.0, True), ("dpo", 1e-3, False),
        ("grpo", 1e-3, False), ("rloo", 1e-3, False))),
     ("orpo", 1e-3, False), ("cpo", 1e-3, False)],  # full logits: no fused head
)
def test_post_training_logs_what_the_unwrapped_model_logs(tmp_path, base_dir, kind, lr, lora):
    want, _ = _train(kind, base_dir, str(tmp_path / "plain"), wrapped=False, lr=lr, lora=lora)
    got, head = _train(kind, base_dir, str(tmp_path / "wrapped"), wrapped=True, lr=lr, lora=lora)
    steps = [e for e in want if "loss" in e]
    assert len(steps) == 3 and len([e for e in got if "loss" in e]) == 3
    tolerance = 1e-6 if lr == 0 else 1e-4
    for expected, logged in zip(want, got):
        for key, value in expected.items():
            if key.startswith(("train_runtime", "train_samples", "train_steps", "step_time")) or key == "epoch":
                continue
            if isinstance(value, float) and math.isfinite(value):
                assert logged[key] == pytest.approx(value, abs=tolerance), (kind, key, logged.get("step"))
    assert head.sampled_calls == 0  # no log-prob came from the sampler
    if lr == 0:
        for entry in steps:  # the policy is the reference: the known values
            if kind == "dpo":
                assert entry["loss"] == pytest.approx(math.log(2), abs=1e-6)
                assert entry["rewards/margins"] == pytest.approx(0, abs=1e-6)
            if kind in ("dpo", "kto"):
                assert entry["rewards/chosen"] == pytest.approx(0, abs=1e-6)
                assert entry["rewards/rejected"] == pytest.approx(0, abs=1e-6)
            if kind == "grpo":
                assert entry["kl"] == pytest.approx(0, abs=1e-6)


def _count_draws(sampler) -> list[int]:
    """Counts the draws of ``sampler`` (its instance methods wrapped; a draw that calls another counts once): [draws]."""
    count, depth = [0], [0]
    for name in ("draw", "draw_scored", "draw_with_factors", "draw_shared", "draw_shared_scored"):
        method = getattr(sampler, name)

        def counted(*args, _method=method, **kwargs):
            count[0] += depth[0] == 0
            depth[0] += 1
            try:
                return _method(*args, **kwargs)
            finally:
                depth[0] -= 1

        setattr(sampler, name, counted)
    return count


@pytest.mark.parametrize("trainer_kind", ["sft", "plain"])
def test_sft_and_the_plain_trainer_draw_from_the_sampler_every_step(tmp_path, trainer_kind):
    model = tiny_model("gpt2", vocab_size=V, seed=0)
    hf_midx.wrap(model, MidxConfig(num_samples=32, codebook_size=8, kmeans_iters=5, refresh_every_steps=0,
                                   log_kl=False))  # the logged diagnostics draw too
    head = find_head(model)
    draws = _count_draws(head.sampler)
    rows = torch.randint(1, V, (16, 17), generator=torch.Generator().manual_seed(0))
    common = dict(output_dir=str(tmp_path), max_steps=3, per_device_train_batch_size=4, save_strategy="no",
                  report_to=[], use_cpu=True, disable_tqdm=True, logging_steps=1)
    if trainer_kind == "sft":
        data = datasets.Dataset.from_dict({"input_ids": rows.tolist()})
        trainer = trl.SFTTrainer(model=model, args=trl.SFTConfig(**common, max_length=17), train_dataset=data,
                                 processing_class=_tokenizer())
        MidxCallback.install(trainer)
    else:
        data = [{"input_ids": r, "labels": r} for r in rows]
        trainer = MidxTrainer(model=model, args=TrainingArguments(**common), train_dataset=data)
    trainer.train()
    assert draws[0] == 3 == head.sampled_calls  # one draw per training call, one call per step


@needs_trl_fused
@pytest.mark.parametrize("kind", ["dpo", "grpo"])
def test_exact_forward_logs_exact_values_and_trains_close_to_the_exact_run(tmp_path, base_dir, kind):
    """log_probs="exact-forward": with learning rate 0 every logged value is the exact run's (the values are exact);
    with 1e-3 the losses and rewards of 3 steps stay close to it (the gradient is an unbiased estimate)."""
    for lr, tolerance in ((0.0, 1e-5), (1e-3, 2e-3)):
        want, _ = _train(kind, base_dir, str(tmp_path / f"exact{lr}"), wrapped=True, lr=lr)
        got, head = _train(kind, base_dir, str(tmp_path / f"forward{lr}"), wrapped=True, lr=lr,
                           log_probs="exact-forward")
        assert head.sampled_calls > 0  # the gradient came from the draws
        for expected, logged in zip(want, got):
            for key in ("loss", "rewards/chosen", "rewards/rejected", "rewards/margins", "kl", "reward"):
                if key in expected and lr == 0 or key in ("loss", "reward", "rewards/margins") and key in expected:
                    assert logged[key] == pytest.approx(expected[key], abs=tolerance), (kind, lr, key)


FIELDS = ("log_probs", "entropy", "log_sum_sq_probs", "mean_logits", "is_top1")


def _exact_forward_pair(arch: str, **extra):
    """A model wrapped for exact-forward (decided as GRPO at temperature 0.7) and its unwrapped twin, both with TRL's
    fused head at that temperature; and (2, 12) input ids."""
    model, reference = tiny_model(arch, vocab_size=V, seed=0, **extra), tiny_model(arch, vocab_size=V, seed=0)
    for m in (model, reference):
        add_fused_lm_head(m, temperature=0.7, outputs=FIELDS)
    hf_midx.wrap(model, MidxConfig(num_samples=8, codebook_size=8, kmeans_iters=5, log_probs="exact-forward"))
    find_head(model).binding.log_prob_decision = decide_log_probs(
        "exact-forward", trl.GRPOConfig(output_dir="unused", temperature=0.7, report_to=[], use_cpu=True, bf16=False))
    return model, reference, torch.randint(1, V, (2, 12), generator=torch.Generator().manual_seed(0))


@needs_trl_fused
@pytest.mark.parametrize("arch", ["gemma2", "cohere", "phi"])  # soft-capped logits, scaled logits, a head bias
def test_exact_forward_fields_are_trl_s_exact_fields(arch):
    fields = FIELDS
    model, reference, ids = _exact_forward_pair(arch, **({"hidden_dropout": 0.0} if arch == "cohere" else {}))
    labels = ids.clone()
    labels[:, :4] = -100
    model.train(), reference.train()
    torch.manual_seed(0)
    got = model(input_ids=ids, labels=labels, fused_lm_head=True)
    torch.manual_seed(0)
    want = reference(input_ids=ids, labels=labels, fused_lm_head=True)
    for name in fields:
        torch.testing.assert_close(getattr(got, name).float(), getattr(want, name).float(), rtol=1e-5, atol=2e-5,
                                   msg=name)
    got.log_probs.sum().backward()
    assert find_head(model).weight.grad is not None and find_head(model).sampled_calls == 1


@needs_trl_fused
@pytest.mark.parametrize("arch", ["llama", "gemma2"])
def test_exact_forward_values_are_trl_s_bit_for_bit_under_bf16_autocast(arch):
    """Under autocast (TRL's default bf16=True, also on a CPU) at temperature 0.7: the same values as TRL's exact head
    in the same rounding (products in bfloat16, transform and fold in float32), so that a ratio is exactly 1."""
    fields = FIELDS
    model, reference, ids = _exact_forward_pair(arch)
    model.train(), reference.train()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        got = model(input_ids=ids, labels=ids, fused_lm_head=True)
        want = reference(input_ids=ids, labels=ids, fused_lm_head=True)
    for name in fields:
        assert torch.equal(getattr(got, name), getattr(want, name)), (name, (getattr(got, name).float()
                                                                             - getattr(want, name).float()).abs().max())
    with torch.autocast("cpu", dtype=torch.bfloat16):
        (got.log_probs.sum() + got.entropy.sum()).backward()
    assert all(p.grad is None or torch.isfinite(p.grad).all() for p in model.parameters())


@needs_trl_fused
def test_on_gpus_exact_forward_takes_trl_s_own_fold(monkeypatch):
    """Where TRL folds in Triton (CUDA), the values come from TRL's function called as its head calls it (ignored
    positions left out): forced here on the CPU, the policy's fields are TRL's bit for bit under bf16 autocast,
    ignored positions 0, and the sampled backward runs from the derived log Z."""
    from hf_midx.integration import head as head_module
    from hf_midx.integration.trl_log_probs import trl_statistics

    calls = []

    def forced(*args, **kwargs):
        calls.append(1)
        return trl_statistics(*args, **kwargs, force=True)

    monkeypatch.setattr(head_module, "trl_statistics", forced)
    model, reference, ids = _exact_forward_pair("gemma2")
    labels = ids.clone()
    labels[:, :5] = -100
    model.train(), reference.train()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        got = model(input_ids=ids, labels=labels, fused_lm_head=True)
        want = reference(input_ids=ids, labels=labels, fused_lm_head=True)
    assert calls
    for name in FIELDS:
        assert torch.equal(getattr(got, name), getattr(want, name)), name
    with torch.autocast("cpu", dtype=torch.bfloat16):
        (got.log_probs.sum() + got.entropy.sum()).backward()
    assert torch.isfinite(find_head(model).weight.grad).all() and find_head(model).sampled_calls == 1


@needs_trl_fused
@pytest.mark.parametrize("autocast", [False, True])
def test_statistics_fold_trl_s_tiles_in_trl_s_rounding(monkeypatch, autocast):
    """Five class tiles (the last one short), two token tiles, a bias, a scale and a soft-cap at temperature 0.7:
    log_prob_statistics gives TRL's ``ChunkedLogProbFunction`` values bit for bit, in float32 and under autocast."""
    from trl.kernels import ChunkedLogProbFunction
    from hf_midx.losses import log_probs as lp

    monkeypatch.setattr(lp, "CLASS_TILE", 64)
    monkeypatch.setattr(lp, "TOKEN_TILE", 10)
    g = torch.Generator().manual_seed(0)
    h, w, b = torch.randn(17, 16, generator=g), torch.randn(300, 16, generator=g), torch.randn(300, generator=g)
    y = torch.randint(0, 300, (17,), generator=g)
    transform = lp.LogitTransform(temperature=0.7, scale=0.5, softcap=3.0)
    fields = ("entropy", "log_sum_sq_probs", "mean_logits", "is_top1")
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast), torch.no_grad():
        stats = lp.log_prob_statistics(h, w, b, y, transform)
        want = ChunkedLogProbFunction.apply(h, w, b, y, 0.7, 64, 3.0, 0.5, fields)
    got = (stats["label_logit"] - stats["log_z"], *(stats[k] for k in fields))
    for name, x, x_trl in zip(("log_probs", *fields), got, want):
        assert torch.equal(x, x_trl), (name, (x.float() - x_trl.float()).abs().max())


@needs_trl_fused
def test_exact_forward_under_bf16_logs_rloo_s_zero_loss_at_learning_rate_0(tmp_path, base_dir):
    """RLOO (bf16=True, temperature 0.7, learning rate 0): the old policy's log-probs come from TRL's head and the
    policy's from exact-forward; being the same values, every ratio is 1 and the loss 0 (the unwrapped run's)."""
    got, head = _train("rloo", base_dir, str(tmp_path), wrapped=True, lr=0.0, log_probs="exact-forward", bf16=True,
                       steps=2)
    losses = [e["loss"] for e in got if "loss" in e]
    assert len(losses) == 2 and all(loss == 0.0 for loss in losses), losses
    assert head.sampled_calls > 0  # the policy's calls went through exact-forward


class _LargestTensor(torch.overrides.TorchFunctionMode):
    """The largest number of elements of any tensor a torch function returns while active."""

    def __init__(self) -> None:
        super().__init__()
        self.largest = 0

    def __torch_function__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(t, torch.Tensor):
                self.largest = max(self.largest, t.numel())
        return out


@needs_trl_fused
@pytest.mark.parametrize("log_probs", ["exact", "exact-forward"])
def test_exact_log_probs_build_no_tokens_by_vocabulary_tensor(log_probs):
    """At V = 65,536 (two of TRL's 32,768-wide vocabulary tiles, eight of exact-forward's), a training call for exact
    log-probs and its backward never hold a (tokens x V) tensor; an evaluation call for logits does (the watch can
    see one)."""
    vocab, tokens = 65_536, 2 * 40
    model = tiny_model("llama", vocab_size=vocab, seed=0)
    add_fused_lm_head(model, outputs=("log_probs", "entropy", "mean_logits", "is_top1"))
    hf_midx.wrap(model, MidxConfig(num_samples=32, codebook_size=8, kmeans_iters=2, log_probs=log_probs))
    find_head(model).binding.log_prob_decision = decide_log_probs(
        log_probs, TrainingArguments(output_dir="unused", report_to=[], use_cpu=True))
    ids = torch.randint(0, vocab, (2, 41))
    model.train()
    with _LargestTensor() as watch:
        out = model(input_ids=ids, labels=ids, fused_lm_head=True)
        (out.log_probs.sum() + out.entropy.sum()).backward()
    assert out.log_probs.shape == (2, 40) and find_head(model).sampled_calls == (log_probs == "exact-forward")
    assert watch.largest < tokens * vocab
    model.eval()
    with _LargestTensor() as watch, torch.no_grad():
        model(input_ids=ids)
    assert watch.largest >= tokens * vocab


@needs_trl_fused
def test_undecided_log_prob_calls_are_exact_and_say_why_once():
    """Without MidxCallback nothing says the loss is a plain NLL: TRL's exact values, one warning."""
    model = tiny_model("llama", vocab_size=V, seed=0)  # no dropout: training-mode calls are deterministic
    reference = tiny_model("llama", vocab_size=V, seed=0)
    for m in (model, reference):
        add_fused_lm_head(m, outputs=("log_probs", "entropy"))
    hf_midx.wrap(model, MidxConfig(num_samples=32, codebook_size=8, kmeans_iters=5))
    model.train(), reference.train()
    ids = torch.randint(1, V, (2, 12), generator=torch.Generator().manual_seed(0))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        got = [model(input_ids=ids, labels=ids, fused_lm_head=True) for _ in range(2)]
    said = [w for w in caught if "nothing says its loss is the plain next-token NLL" in str(w.message)]
    assert len(said) == 1
    want = reference(input_ids=ids, labels=ids, fused_lm_head=True)
    for out in got:
        torch.testing.assert_close(out.log_probs, want.log_probs, rtol=0, atol=1e-6)
        torch.testing.assert_close(out.entropy, want.entropy, rtol=0, atol=1e-6)
    assert find_head(model).sampled_calls == 0


def test_sampled_log_probs_for_a_preference_loss_are_refused_before_the_first_step(tmp_path):
    model = tiny_model("gpt2", vocab_size=V, seed=0)
    hf_midx.wrap(model, MidxConfig(num_samples=32, codebook_size=8, kmeans_iters=5, log_probs="sampled"))
    pairs = datasets.Dataset.from_dict({"prompt": _texts(4, 5, 1), "chosen": _texts(4, 6, 2),
                                        "rejected": _texts(4, 6, 3)})
    args = trl.DPOConfig(output_dir=str(tmp_path), max_steps=1, per_device_train_batch_size=2, report_to=[],
                         use_cpu=True, disable_tqdm=True, max_length=32)
    trainer = trl.DPOTrainer(model=model, ref_model=tiny_model("gpt2", vocab_size=V, seed=0), args=args,
                             train_dataset=pairs, processing_class=_tokenizer())
    MidxCallback.install(trainer)
    head = find_head(model)
    with pytest.raises(ValueError, match=r"log_probs='sampled'\) with DPOTrainer .*Use log_probs='auto'"):
        trainer.train()
    assert head.sampled_calls == 0 and trainer.state.global_step == 0


def test_liger_fused_cross_entropy_is_refused_naming_the_fix(tmp_path):
    """Liger's fused linear cross-entropy replaces the model's forward: the head would never run."""
    args = TrainingArguments(output_dir=str(tmp_path), report_to=[], use_cpu=True)
    args.use_liger_kernel = True  # set after construction: Liger itself is not installed here
    with pytest.raises(ValueError, match="fused_linear_cross_entropy': False"):
        decide_log_probs("auto", args, "Trainer")
    args.liger_kernel_config = {"fused_linear_cross_entropy": False}
    assert decide_log_probs("auto", args, "Trainer").route == "exact"


def test_exact_log_probs_refuses_what_it_cannot_score():
    model = hf_midx.wrap(tiny_model("llama", vocab_size=V, seed=0), MidxConfig(num_samples=8, codebook_size=8))
    head, hidden = find_head(model), torch.randn(2, 5, 32)
    with pytest.raises(ValueError, match="temperature must be a positive number"):
        head.exact_log_probs(hidden, torch.zeros(2, 5, dtype=torch.long), temperature=0.0)
    with pytest.raises(ValueError, match="one label per hidden state"):
        head.exact_log_probs(hidden, torch.zeros(2, 4, dtype=torch.long))
    with pytest.raises(RuntimeError, match="labels outside"):
        head.exact_log_probs(hidden, torch.full((2, 5), V, dtype=torch.long))


class _Interrupt(Exception):
    """What stops the first run (a KeyboardInterrupt or an error in the user's code, in a test)."""


class _StopBeforeTheOptimizer(TrainerCallback):
    def on_pre_optimizer_step(self, args, state, control, **kwargs):
        raise _Interrupt("stopped inside the step, after the forward")


@needs_trl_fused
@pytest.mark.parametrize("where", ["installed, inside the step", "callbacks=[...], in the forward"])
def test_a_decision_ends_with_its_run_even_when_interrupted(tmp_path, base_dir, where):
    """An SFT run (the sampled route) stopped by an exception, then GRPO and DPO on the same model without the
    callback: their calls with gradients are exact (GRPO at learning rate 0 logs KL 0, nothing drawn, one warning)
    and DPO runs (it crashed at ``outputs.mean_logits`` on the sampled route's output)."""
    model = AutoModelForCausalLM.from_pretrained(base_dir)
    hf_midx.wrap(model, MidxConfig(num_samples=32, codebook_size=8, kmeans_iters=5))
    head = find_head(model)
    common = dict(max_steps=2, per_device_train_batch_size=4, learning_rate=0.0, logging_steps=1, save_strategy="no",
                  report_to=[], use_cpu=True, disable_tqdm=True, seed=0)
    rows = torch.randint(1, V, (8, 9), generator=torch.Generator().manual_seed(0))
    sft_args = trl.SFTConfig(output_dir=str(tmp_path / "sft"), max_length=9, **common)
    data = datasets.Dataset.from_dict({"input_ids": rows.tolist()})
    if where.startswith("installed"):
        sft = trl.SFTTrainer(model=model, args=sft_args, train_dataset=data, processing_class=_tokenizer(),
                             callbacks=[_StopBeforeTheOptimizer()])
        MidxCallback.install(sft)
        hook = None
    else:
        sft = trl.SFTTrainer(model=model, args=sft_args, train_dataset=data, processing_class=_tokenizer(),
                             callbacks=[MidxCallback()])

        def fail(module, args, output):
            raise _Interrupt("stopped in the forward")

        hook = model.model.layers[-1].register_forward_hook(fail)
    with pytest.raises(_Interrupt):
        sft.train()
    assert head.binding.log_prob_decision is None and not head.step_data.scheduled
    if hook is not None:
        hook.remove()
    calls_before = head.sampled_calls
    prompts = datasets.Dataset.from_dict({"prompt": _texts(8, 5, 4)})
    rl = dict(num_generations=2, max_completion_length=6, beta=0.1, generation_batch_size=4, temperature=0.7)
    grpo = trl.GRPOTrainer(model=model, reward_funcs=_length_reward, processing_class=_tokenizer(),
                           args=trl.GRPOConfig(output_dir=str(tmp_path / "grpo"), **common, **rl), train_dataset=prompts)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        grpo.train()
    assert any("nothing says its loss is the plain next-token NLL" in str(w.message) for w in caught)
    kls = [e["kl"] for e in grpo.state.log_history if "kl" in e]
    assert len(kls) == 2 and all(kl == 0.0 for kl in kls), kls
    pairs = datasets.Dataset.from_dict({"prompt": _texts(4, 5, 1), "chosen": _texts(4, 6, 2),
                                        "rejected": _texts(4, 6, 3)})
    dpo = trl.DPOTrainer(model=model, ref_model=AutoModelForCausalLM.from_pretrained(base_dir), train_dataset=pairs,
                         args=trl.DPOConfig(output_dir=str(tmp_path / "dpo"), max_length=32, **common),
                         processing_class=_tokenizer())
    dpo.train()
    # (Not log 2: after GRPO's head, TRL's DPO head differs from the fresh reference's by 1e-5, unwrapped models too.)
    losses = [e["loss"] for e in dpo.state.log_history if "loss" in e]
    assert len(losses) == 2 and all(math.isfinite(loss) for loss in losses)
    assert head.sampled_calls == calls_before  # nothing after the interrupted run drew
