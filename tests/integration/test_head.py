"""MidxLMHead on tiny random transformers models: wrapping, exactness, training, export, integrations."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import textwrap

os.environ["HF_HUB_OFFLINE"] = "1"

import pytest  # noqa: E402
import torch  # noqa: E402
from safetensors import safe_open  # noqa: E402
from torch import nn  # noqa: E402
from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402
from transformers import AutoModel, LlamaForCausalLM  # noqa: E402
from transformers.loss.loss_utils import ForCausalLMLoss  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from _models import ARCHITECTURES, VOCAB, clone_model, markov_batches, tiny_config, tiny_model  # noqa: E402

import hf_midx  # noqa: E402
from hf_midx import MidxConfig, MidxLMHead  # noqa: E402
from hf_midx.integration.binding import UNSHIFTED_EVAL_COUNT, shifted_eval_count  # noqa: E402
from hf_midx.integration.head import find_head  # noqa: E402

SMALL = dict(num_samples=24, codebook_size=8, kmeans_iters=5)
BATCH, SEQ = 2, 16
REPORT: dict[str, float] = {}  # figures printed at the end of the session (pytest -s shows them)


def _ids(vocab=VOCAB, batch=BATCH, seq=SEQ, seed=1):
    return torch.randint(vocab, (batch, seq), generator=torch.Generator().manual_seed(seed))


def _wrapped(arch, **overrides):
    model = tiny_model(arch)
    reference = clone_model(model)
    hf_midx.wrap(model, **{**SMALL, **overrides})
    return model, reference


def _rel(a, b) -> float:
    return abs(float(a) - float(b)) / max(abs(float(b)), 1e-12)


@pytest.fixture(scope="module", autouse=True)
def _print_report():
    yield
    if REPORT:
        print("\n[hf-midx head figures] " + json.dumps(REPORT, indent=1, sort_keys=True))


# ====================================================================== every architecture
@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_wrap_keeps_keys_ties_and_exact_eval(arch):
    model = tiny_model(arch)
    reference = clone_model(model)
    keys = list(model.state_dict().keys())
    linear = model.get_output_embeddings()
    tied = linear.weight is model.get_input_embeddings().weight
    weight, bias = linear.weight, linear.bias
    hf_midx.wrap(model, **SMALL)
    head = find_head(model)

    assert isinstance(head, MidxLMHead) and model.get_output_embeddings() is head
    assert head.weight is weight and head.bias is bias
    assert head.linear is linear and linear.weight is None and linear.bias is None  # the head holds them
    assert list(model.state_dict().keys()) == keys
    assert not any("linear" in k or "midx" in k for k in model.state_dict())
    assert (head.weight is model.get_input_embeddings().weight) == tied
    assert head.num_classes == VOCAB and head.config.num_samples == SMALL["num_samples"]

    ids = _ids()
    # Training mode with labels: a finite sampled loss, zero-width logits.
    model.train()
    out = model(input_ids=ids, labels=ids)
    assert out.logits.shape == (BATCH, SEQ, 0)
    assert torch.isfinite(out.loss) and out.loss.dtype == torch.float32
    out.loss.backward()
    assert head.weight.grad is not None and torch.isfinite(head.weight.grad).all()
    assert not head.binding.capture(torch.zeros(1, head.in_features))  # the call is over: full logits again
    model.zero_grad()

    # Eval mode: the original head; same logits and loss as the unwrapped model.
    model.eval()
    with torch.no_grad():
        got, want = model(input_ids=ids, labels=ids), reference(input_ids=ids, labels=ids)
        assert torch.equal(got.logits, want.logits)
        assert _rel(got.loss, want.loss) < 1e-5
        REPORT[f"eval_loss_rel_diff/{arch}"] = _rel(got.loss, want.loss)
        with head.exact_loss_only():
            exact = model(input_ids=ids, labels=ids)
            no_labels = model(input_ids=ids)
        assert exact.logits.shape[-1] == 0 and no_labels.logits.shape[-1] == VOCAB
        assert _rel(exact.loss, want.loss) < 1e-5
        REPORT[f"exact_loss_rel_diff/{arch}"] = _rel(exact.loss, want.loss)
        # Training mode without labels: full logits too.
        model.train()
        assert model(input_ids=ids).logits.shape == (BATCH, SEQ, VOCAB)
        model.eval()

    gen_kwargs = dict(max_new_tokens=4, do_sample=False, pad_token_id=0)
    assert torch.equal(model.generate(ids[:, :5], **gen_kwargs), reference.generate(ids[:, :5], **gen_kwargs))


@pytest.mark.parametrize("mode", ["eval", "train"])
def test_wrap_keeps_the_model_mode(mode):
    """from_pretrained returns eval-mode models: right after wrap, their loss is the exact one (and
    deterministic), not a sampled estimate; a model in training mode keeps a head in training mode."""
    model = tiny_model("gpt2").train(mode == "train")
    reference = clone_model(model)  # eval mode
    hf_midx.wrap(model, **SMALL)
    assert find_head(model).training == (mode == "train")
    if mode == "eval":
        ids = _ids()
        with torch.no_grad():
            want = reference(input_ids=ids, labels=ids).loss
            for _ in range(2):
                assert _rel(model(input_ids=ids, labels=ids).loss, want) < 1e-5


def test_gemma2_softcap_is_applied():
    model, reference = _wrapped("gemma2")
    head = find_head(model)
    assert head.logit_softcap == 0.5
    ids = _ids()
    with torch.no_grad():
        for m in (model, reference):  # logits of order 1, so that the 0.5 cap bends them
            m.get_output_embeddings().weight.mul_(20.0)
        want = reference(input_ids=ids, labels=ids).loss
        with head.exact_loss_only():
            assert _rel(model(input_ids=ids, labels=ids).loss, want) < 1e-5
            head.logit_softcap = None  # without the cap the loss would differ
            assert _rel(model(input_ids=ids, labels=ids).loss, want) > 1e-3


# ====================================================================== no (T, V) tensor
class _LargestTensor(TorchDispatchMode):
    """Records the shapes of every tensor an op returns."""

    def __init__(self):
        super().__init__()
        self.shapes = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(t, torch.Tensor):
                self.shapes.append(tuple(t.shape))
        return out


def test_sampled_training_step_builds_no_tokens_by_vocab_tensor():
    model, _ = _wrapped("llama")
    model.train()
    ids = _ids(seq=40)  # T = 80 tokens, so T*V (32000) exceeds every V x D (12800) tensor
    tokens = ids.numel()
    with _LargestTensor() as probe:
        model(input_ids=ids, labels=ids).loss.backward()
    big = [s for s in probe.shapes if VOCAB in s and torch.Size(s).numel() >= tokens * VOCAB]
    assert not big, f"a (tokens x vocab) tensor was built: {big[:3]}"
    # the unwrapped model does build one (the probe works)
    hf_midx.unwrap(model)
    with _LargestTensor() as probe:
        model(input_ids=ids, labels=ids).loss.backward()
    assert any(VOCAB in s and torch.Size(s).numel() >= tokens * VOCAB for s in probe.shapes)


# ====================================================================== label semantics
def test_num_items_in_batch_normalisation():
    model, reference = _wrapped("qwen2")
    ids = _ids()
    labels = ids.clone()
    labels[0, :5] = -100
    count = int((labels[:, 1:] != -100).sum())
    model.train()
    with torch.no_grad():
        head = find_head(model)
        state = head.sampler.generator.get_state()
        mean = model(input_ids=ids, labels=labels).loss
        for num_items in (torch.tensor(7), 7):
            head.sampler.generator.set_state(state)
            summed = model(input_ids=ids, labels=labels, num_items_in_batch=num_items).loss
            assert torch.allclose(summed, mean * count / 7, rtol=1e-5)
        # Eval and exact mode follow ForCausalLMLoss exactly, but for the count: on the transformers whose Trainer
        # counts num_items_in_batch of evaluation over the unshifted labels, the rows' first labels come off it.
        model.eval()
        count = torch.tensor(7 - int(UNSHIFTED_EVAL_COUNT) * int((labels[:, 0] != -100).sum()))
        want = reference(input_ids=ids, labels=labels, num_items_in_batch=count).loss
        assert _rel(model(input_ids=ids, labels=labels, num_items_in_batch=torch.tensor(7)).loss, want) < 1e-5
        with head.exact_loss_only():
            got = model(input_ids=ids, labels=labels, num_items_in_batch=torch.tensor(7)).loss
        assert _rel(got, want) < 1e-5


def test_the_shifted_eval_count_takes_the_rows_first_labels_off():
    """The binding's reading of an evaluation count over unshifted labels (transformers 4.57-5.10.0): one process,
    so the count is this process's whether or not it equals its own labels' count."""
    labels = torch.tensor([[-100, 3, 4], [5, 6, -100]])
    assert int(shifted_eval_count(labels, torch.tensor(4), -100)) == 3
    assert int(shifted_eval_count(labels, 9, -100)) == 8
    assert int(shifted_eval_count(labels.masked_fill(labels == -100, 0), 6, 0)) == 5


def test_shift_labels_and_ignore_index_match_for_causal_lm_loss():
    model, reference = _wrapped("llama")
    head = find_head(model)
    ids = _ids()
    shift = torch.roll(ids, -1, dims=1)
    shift[:, -1] = -100
    shift[1, ::3] = -100
    with torch.no_grad():
        logits = reference(input_ids=ids).logits
        want = ForCausalLMLoss(logits, None, VOCAB, shift_labels=shift)
        with head.exact_loss_only():
            got = model(input_ids=ids, labels=ids, shift_labels=shift).loss
        assert _rel(got, want) < 1e-5
        # all positions ignored: a zero loss, not NaN
        model.train()
        assert float(model(input_ids=ids, labels=torch.full_like(ids, -100)).loss) == 0.0


def test_sampled_loss_is_close_to_exact_loss_with_many_samples():
    # The exact-positive form estimates the full loss: with many negatives from the near-exact proposal
    # it is close. (The corrected-positive form does not estimate the loss's value: with the exact
    # proposal every candidate's weight is Z / (M + 1) and the loss is log(M + 1) whatever the model.)
    model, reference = _wrapped("llama", sampler="midx-exact", num_samples=300, estimator="exact-positive")
    ids = _ids(batch=4)
    model.train()
    reference.train()
    with torch.no_grad():
        got = torch.stack([model(input_ids=ids, labels=ids).loss for _ in range(4)]).mean()
        want = reference(input_ids=ids, labels=ids).loss
    assert _rel(got, want) < 0.05


# ====================================================================== training
def test_training_loop_loss_falls():
    torch.manual_seed(0)
    vocab = VOCAB
    model = tiny_model("llama", vocab_size=vocab)
    hf_midx.wrap(model, num_samples=32, codebook_size=8, kmeans_iters=5)
    head = find_head(model)
    batches = markov_batches(vocab, batch=16, seq=SEQ, steps=60, seed=3)
    train, held_out = batches[:50], batches[50:]

    def eval_loss():
        model.eval()
        with torch.no_grad(), head.exact_loss_only():
            loss = sum(float(model(input_ids=b, labels=b).loss) for b in held_out) / len(held_out)
        model.train()
        return loss

    before = eval_loss()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model.train()
    losses = []
    for step, batch in enumerate(train):
        loss = model(input_ids=batch, labels=batch).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(float(loss.detach()))
        if step % 10 == 9:
            head.refresh()
    after = eval_loss()
    first, last = sum(losses[:5]) / 5, sum(losses[-5:]) / 5
    REPORT.update(
        {
            "train_sampled_loss_first5": first,
            "train_sampled_loss_last5": last,
            "eval_exact_before": before,
            "eval_exact_after": after,
        }
    )
    assert all(math.isfinite(x) for x in losses)
    assert last < first - 1.0, (first, last)
    assert after < before - 1.0, (before, after)
    assert head.last_queries is not None and head.last_queries.shape == (head.config.kl_queries, 32)


# ====================================================================== export
_EXPORT_SCRIPT = textwrap.dedent(
    """
    import os, sys, json
    os.environ["HF_HUB_OFFLINE"] = "1"
    import torch
    from transformers import AutoModelForCausalLM
    ids = torch.load(sys.argv[2])
    out = {}
    for path in sys.argv[3:]:
        model = AutoModelForCausalLM.from_pretrained(path, attn_implementation="eager").eval()
        with torch.no_grad():
            out[path] = model(input_ids=ids).logits
    assert "hf_midx" not in sys.modules, "the exported model needed hf_midx"
    torch.save(out, sys.argv[1])
    """
)


def test_save_pretrained_loads_in_plain_transformers(tmp_path):
    ids = _ids()
    dirs, expected, reference_keys = [], {}, {}
    for arch in ("gpt2", "llama"):
        model, reference = _wrapped(arch)
        model.train()
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        model(input_ids=ids, labels=ids).loss.backward()  # weights move away from the reference
        opt.step()
        model.eval()
        path = str(tmp_path / arch)
        model.save_pretrained(path)
        reference.save_pretrained(str(tmp_path / f"{arch}-ref"))
        dirs.append(path)
        with torch.no_grad():
            expected[path] = model(input_ids=ids).logits
        with safe_open(os.path.join(path, "model.safetensors"), "pt") as f:
            keys = set(f.keys())
        with safe_open(os.path.join(str(tmp_path / f"{arch}-ref"), "model.safetensors"), "pt") as f:
            reference_keys[arch] = set(f.keys())
        assert keys == reference_keys[arch]
        assert not any("midx" in k or "linear" in k or "sampler" in k for k in keys)
    torch.save(ids, tmp_path / "ids.pt")
    result = tmp_path / "logits.pt"
    # The same intra-op thread count as this process, so both sides reduce in the same order.
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONPATH": "", "OMP_NUM_THREADS": str(torch.get_num_threads())}
    proc = subprocess.run(
        [sys.executable, "-c", _EXPORT_SCRIPT, str(result), str(tmp_path / "ids.pt"), *dirs],
        capture_output=True, text=True, env=env, cwd=str(tmp_path), timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    loaded = torch.load(result)
    for path in dirs:
        diff = float((loaded[path] - expected[path]).abs().max())
        REPORT[f"export_max_abs_logit_diff/{os.path.basename(path)}"] = diff
        # float32 tolerance: a reordered reduction moves logits by ~1e-7; a wrong weight by far more.
        torch.testing.assert_close(loaded[path], expected[path], rtol=1e-5, atol=1e-6)


# ====================================================================== unwrap
def test_unwrap_restores_the_original_model():
    model = tiny_model("llama")
    reference = clone_model(model)
    linear = model.lm_head
    param_ids = {n: id(p) for n, p in model.named_parameters()}
    pre_hooks, hooks = dict(model._forward_pre_hooks), dict(model._forward_hooks)
    hf_midx.wrap(model, **SMALL)
    model.train()
    model(input_ids=_ids(), labels=_ids()).loss.backward()
    model.zero_grad()

    assert hf_midx.unwrap(model) is model
    assert model.lm_head is linear and type(model.lm_head) is nn.Linear
    assert {n: id(p) for n, p in model.named_parameters()} == param_ids
    assert dict(model._forward_pre_hooks) == pre_hooks and dict(model._forward_hooks) == hooks
    assert "_loss_function" not in model.__dict__ and model.loss_function is ForCausalLMLoss
    assert "resize_token_embeddings" not in model.__dict__
    assert find_head(model) is None
    ids = _ids()
    model.train()
    reference.train()
    with torch.no_grad():
        got, want = model(input_ids=ids, labels=ids), reference(input_ids=ids, labels=ids)
    assert torch.equal(got.logits, want.logits) and torch.equal(got.loss, want.loss)
    # and it can be wrapped again
    hf_midx.wrap(model, **SMALL)
    assert find_head(model) is not None


@pytest.mark.parametrize("through_peft", [False, True], ids=["model", "peft"])
def test_resizing_a_wrapped_model_says_unwrap_resize_wrap(through_peft):
    """transformers' own resize raised "Old language model head is of type MidxLMHead, which is not an instance of
    nn.Linear"; the wrapped instance says the order that works, and after unwrap the resize is transformers' own."""
    model = tiny_model("gpt2")
    outer = model
    if through_peft:
        peft = pytest.importorskip("peft")
        outer = peft.get_peft_model(model, peft.LoraConfig(r=2, target_modules=["c_attn"]))
    hf_midx.wrap(outer, **SMALL)
    with pytest.raises(ValueError, match=r"hf_midx.unwrap\(model\), then model.resize_token_embeddings"):
        outer.resize_token_embeddings(VOCAB + 8)
    assert find_head(outer).num_classes == VOCAB  # nothing changed
    hf_midx.unwrap(outer)
    outer.resize_token_embeddings(VOCAB + 8)
    assert model.get_output_embeddings().weight.shape[0] == VOCAB + 8
    hf_midx.wrap(outer, **SMALL)
    assert find_head(outer).num_classes == VOCAB + 8


def test_unwrap_keeps_a_custom_loss_function():
    model = tiny_model("llama")
    custom = lambda *args, **kwargs: ForCausalLMLoss(*args, **kwargs) * 2  # noqa: E731
    model.loss_function = custom
    with pytest.warns(UserWarning, match="custom loss_function"):
        hf_midx.wrap(model, **SMALL)
    hf_midx.unwrap(model)
    assert model.loss_function is custom


def test_refresh_and_device_agnostic_refresh_argument():
    model, _ = _wrapped("llama")
    head = find_head(model)
    before = head.sampler.index.codebooks[0].clone()
    with torch.no_grad():
        head.weight.mul_(3.0)
    head.refresh()
    assert not torch.allclose(before, head.sampler.index.codebooks[0])
    head.refresh(weight=head.weight.detach().clone())
    with pytest.raises(ValueError, match="full"):
        head.refresh(weight=head.weight[:10])


# ====================================================================== integrations
def test_bf16_autocast_training_step():
    model, _ = _wrapped("llama")
    model.train()
    ids = _ids()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = model(input_ids=ids, labels=ids)
    assert out.loss.dtype == torch.float32 and torch.isfinite(out.loss)
    out.loss.backward()
    assert all(torch.isfinite(p.grad).all() for p in model.parameters() if p.grad is not None)
    assert model.lm_head.weight.grad.abs().sum() > 0


def test_bf16_model_training_step():
    model = tiny_model("llama").to(torch.bfloat16)
    hf_midx.wrap(model, **SMALL)  # the wrap-time check runs in bf16 too
    model.train()
    ids = _ids()
    out = model(input_ids=ids, labels=ids)
    assert out.loss.dtype == torch.float32 and torch.isfinite(out.loss)
    out.loss.backward()
    assert model.lm_head.weight.grad.dtype == torch.bfloat16 and torch.isfinite(model.lm_head.weight.grad).all()


def test_gradient_checkpointing_gives_the_same_step():
    ids = _ids()
    grads = []
    for checkpointing in (False, True):
        model, _ = _wrapped("llama")
        if checkpointing:
            model.gradient_checkpointing_enable()
        model.train()
        loss = model(input_ids=ids, labels=ids).loss  # same seed: same draws
        loss.backward()
        grads.append((float(loss.detach()), model.model.layers[0].self_attn.q_proj.weight.grad.clone()))
    assert grads[0][0] == pytest.approx(grads[1][0], rel=1e-6)
    assert torch.allclose(grads[0][1], grads[1][1], atol=1e-6)


@pytest.mark.parametrize("whole_model", [False, True], ids=["backbone", "whole-model"])
def test_torch_compile_training_step(whole_model):
    # backend="aot_eager" traces with dynamo and AOTAutograd like the default backend but skips
    # inductor's C++ code generation, which takes minutes on a 2-core CPU runner.
    model, _ = _wrapped("llama")
    model.train()
    if whole_model:
        model.compile(backend="aot_eager")
    else:
        model.model.compile(backend="aot_eager")
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    batches = markov_batches(VOCAB, batch=8, seq=SEQ, steps=8, seed=5)
    losses = []
    for batch in batches:
        out = model(input_ids=batch, labels=batch)
        assert out.logits.shape[-1] == 0
        out.loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(float(out.loss.detach()))
    assert all(torch.isfinite(torch.tensor(losses)))
    assert sum(losses[-3:]) < sum(losses[:3])
    model.eval()
    with torch.no_grad():
        assert model(input_ids=batches[0]).logits.shape[-1] == VOCAB


def test_lora_backbone_train_merge_unwrap():
    peft = pytest.importorskip("peft")
    # A larger init than the default 0.02 so that the frozen random head gives logits that the
    # adapters can move (a pretrained head would); otherwise the loss sits at log V.
    model = tiny_model("llama", initializer_range=0.2)
    base = model
    lora_config = peft.LoraConfig(r=8, lora_alpha=16, target_modules=["q_proj", "v_proj", "o_proj"])
    lora = peft.get_peft_model(model, lora_config)
    hf_midx.wrap(lora, **SMALL)
    head = find_head(lora)
    assert head is not None and base.lm_head is head
    batches = markov_batches(VOCAB, batch=16, seq=SEQ, steps=26, seed=7)
    train, held = batches[:24], batches[24:]

    def exact_eval():
        lora.eval()
        with torch.no_grad(), head.exact_loss_only():
            v = sum(float(lora(input_ids=b, labels=b).loss) for b in held) / len(held)
        lora.train()
        return v

    before = exact_eval()
    opt = torch.optim.AdamW([p for p in lora.parameters() if p.requires_grad], lr=3e-2)
    lora.train()
    losses = []
    for batch in train:
        out = lora(input_ids=batch, labels=batch)
        assert out.logits.shape[-1] == 0
        out.loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(float(out.loss.detach()))
    after = exact_eval()
    REPORT.update({"lora_eval_exact_before": before, "lora_eval_exact_after": after})
    assert all(torch.isfinite(torch.tensor(losses)))
    assert after < before - 0.2, (before, after)
    assert sum(losses[-4:]) < sum(losses[:4])

    merged = lora.merge_and_unload()  # the base model, its head still the MIDX one (documented in wrap)
    assert find_head(merged) is head
    merged.train()
    assert merged(input_ids=held[0], labels=held[0]).logits.shape[-1] == 0  # still trains sampled
    hf_midx.unwrap(merged)
    assert type(merged.lm_head) is nn.Linear
    merged.eval()
    with torch.no_grad():
        loss = merged(input_ids=held[0], labels=held[0]).loss
    assert torch.isfinite(loss) and float(loss) < before


def test_a_deep_copy_is_an_independent_wrapped_model():
    import copy

    model, _ = _wrapped("gpt2")
    twin = copy.deepcopy(model)
    head, twin_head = find_head(model), find_head(twin)
    assert twin_head is not head and twin_head.binding.host is twin
    assert twin_head.weight is twin.transformer.wte.weight
    twin.train()
    ids = _ids()
    assert twin(input_ids=ids, labels=ids).logits.shape[-1] == 0
    hf_midx.unwrap(twin)
    assert find_head(model) is head
    # The twin's hook handles were its own: unwrapping it left the original's hooks in place.
    model.train()
    assert model(input_ids=ids, labels=ids).logits.shape[-1] == 0


# ====================================================================== bad input
def test_wrap_rejects_a_backbone_without_output_embeddings():
    backbone = AutoModel.from_config(tiny_config("llama"))
    with pytest.raises(ValueError, match="get_output_embeddings"):
        hf_midx.wrap(backbone, **SMALL)
    with pytest.raises(ValueError, match="get_output_embeddings"):
        hf_midx.wrap(nn.Linear(4, 4), **SMALL)


def test_wrap_rejects_a_non_linear_head():
    model = tiny_model("llama")
    model.lm_head = nn.Sequential(nn.Linear(32, VOCAB))
    with pytest.raises(ValueError, match="not an nn.Linear"):
        hf_midx.wrap(model, **SMALL)


def test_double_wrap_is_refused():
    model, _ = _wrapped("llama")
    with pytest.raises(ValueError, match="already wrapped"):
        hf_midx.wrap(model, **SMALL)


def test_unwrap_without_wrap_is_refused():
    with pytest.raises(ValueError, match="no MidxLMHead"):
        hf_midx.unwrap(tiny_model("llama"))


def test_num_samples_not_below_vocab_is_refused():
    model = tiny_model("llama")
    with pytest.raises(ValueError, match="lower num_samples"):
        hf_midx.wrap(model, num_samples=VOCAB, codebook_size=8)
    assert type(model.lm_head) is nn.Linear  # nothing changed


def test_unknown_sampler_and_unknown_override_are_refused():
    model = tiny_model("llama")
    with pytest.raises(ValueError, match="Unknown sampler 'nope'.*midx-rq"):
        hf_midx.wrap(model, sampler="nope")
    with pytest.raises(ValueError, match="Unknown MidxConfig field"):
        hf_midx.wrap(model, num_sample=10)
    with pytest.raises(ValueError, match="MidxConfig"):
        hf_midx.wrap(model, config={"num_samples": 10})
    assert type(model.lm_head) is nn.Linear


def test_unigram_sampler_needs_class_counts_and_accepts_them():
    model = tiny_model("llama")
    with pytest.raises(ValueError, match="class_counts"):
        hf_midx.wrap(model, sampler="unigram", num_samples=24)
    counts = torch.bincount(_ids().flatten(), minlength=VOCAB)
    hf_midx.wrap(model, MidxConfig(sampler="unigram", num_samples=24), class_counts=counts)
    model.train()
    assert torch.isfinite(model(input_ids=_ids(), labels=_ids()).loss)


def test_labels_out_of_range_are_named():
    """Training checks the label range on the device (no host sync; on CPU it raises at once, on CUDA at
    the next sync); the exact loss checks it on the host and names the value."""
    model, _ = _wrapped("llama")
    head = find_head(model)
    ids = _ids()
    labels = ids.clone()
    for bad in (VOCAB + 5, -3):
        labels[1, 7] = bad
        model.train()
        with pytest.raises(RuntimeError, match=rf"labels outside \[0, {VOCAB}\)"):
            model(input_ids=ids, labels=labels)
        assert not head.binding.capture(torch.zeros(1, head.in_features))  # reset after the failed call
        model.eval()
        with torch.no_grad(), head.exact_loss_only(), pytest.raises(ValueError, match=str(bad)):
            model(input_ids=ids, labels=labels)


def test_logits_to_keep_with_labels_is_explained():
    model, _ = _wrapped("llama")
    model.train()
    ids = _ids()
    with pytest.raises(ValueError, match="logits_to_keep"):
        model(input_ids=ids, labels=ids, logits_to_keep=1)


def test_wrap_refuses_models_that_post_process_logits():
    class DoubledLogits(LlamaForCausalLM):
        def forward(self, *args, **kwargs):
            out = super().forward(*args, **kwargs)
            out.logits = out.logits * 2.0
            return out

    torch.manual_seed(0)
    model = DoubledLogits(tiny_config("llama")).eval()
    with pytest.raises(ValueError, match="transforms the LM head's output"):
        hf_midx.wrap(model, **SMALL)
    assert type(model.lm_head) is nn.Linear and not model._forward_pre_hooks


# ====================================================================== layer and surgery apart
def test_wrap_and_unwrap_are_free_functions_and_the_head_has_no_aliases_of_them():
    import hf_midx
    import hf_midx.integration.wrap  # noqa: F401  (the module of the same name does not shadow the function)

    assert callable(hf_midx.wrap) and hf_midx.wrap.__module__ == "hf_midx.integration.wrap"
    model = tiny_model("llama")
    assert hf_midx.wrap(model, **SMALL) is model
    head = find_head(model)
    assert head.binding is not None and len(head.binding.handles) == 2
    assert hf_midx.unwrap(model) is model and head.binding is None and find_head(model) is None
    assert hf_midx.wrap(model, **SMALL) is model and hf_midx.unwrap(model) is model
    assert not any(hasattr(MidxLMHead, name) for name in ("wrap", "unwrap", "find"))  # removed in 0.x


def test_the_binding_shifts_the_labels_once_and_the_head_takes_them_shifted():
    """The hand-off: the binding keeps the head's (B, S, D) input and shifts the labels; ``head.loss`` takes
    (N,) labels already shifted, so calling it on the kept input reproduces the model's exact loss."""
    model, reference = _wrapped("llama")
    head = find_head(model)
    kept = []
    capture = head.binding.capture
    head.binding.capture = lambda hidden: kept.append(hidden) or capture(hidden)
    ids = _ids()
    model.eval()
    with torch.no_grad(), head.exact_loss_only():
        got = model(input_ids=ids, labels=ids).loss
        want = reference(input_ids=ids, labels=ids).loss
        hidden = kept[-1]
        assert hidden.shape == (BATCH, SEQ, head.in_features)
        direct = head.loss(hidden[:, :-1].reshape(-1, head.in_features), ids[:, 1:].reshape(-1), exact=True)
        mean_of_unshifted = head.loss(hidden, ids, exact=True)
    assert _rel(got, want) < 1e-5 and _rel(direct, want) < 1e-5
    assert _rel(mean_of_unshifted, want) > 1e-3  # no second shift inside the head


def test_the_transformers_names_the_binding_relies_on_still_hold():
    """hf_midx.integration.binding touches two names transformers does not export, each in one function: the loss registry
    (``_loss_registry``) and the instance's own loss function (``_own_loss_function``). This fails, naming the
    function to update, when a transformers release changes either."""
    import inspect

    from transformers import PreTrainedModel

    from hf_midx.integration import binding

    try:
        registry = binding._loss_registry()
    except ImportError as err:
        pytest.fail(f"transformers.loss.loss_utils.LOSS_MAPPING moved ({err}); update hf_midx.integration.binding._loss_registry.")
    causal = registry.get("ForCausalLM")
    assert causal is not None and causal.__name__ == "ForCausalLMLoss", (
        "transformers' LOSS_MAPPING no longer maps 'ForCausalLM' to ForCausalLMLoss; update hf_midx.integration.binding."
    )
    needed = {"logits", "labels", "num_items_in_batch", "ignore_index", "shift_labels"}
    assert needed <= set(inspect.signature(causal).parameters), (
        f"ForCausalLMLoss no longer takes {sorted(needed)}: HostBinding.loss_function binds the host's loss "
        "arguments by these names."
    )
    assert isinstance(inspect.getattr_static(PreTrainedModel, "loss_function"), property)
    model = tiny_model("llama")
    assert binding._own_loss_function(model) is None and model.loss_function is causal
    custom = lambda *args, **kwargs: causal(*args, **kwargs)  # noqa: E731
    model.loss_function = custom
    assert binding._own_loss_function(model) is custom, (
        "PreTrainedModel.loss_function's setter no longer stores the function as _loss_function; update "
        "hf_midx.integration.binding._own_loss_function."
    )
    assert binding._own_loss_function(model, remove=True) is custom and model.loss_function is causal, (
        "Removing _loss_function no longer gives the model its loss_type's loss back; update "
        "hf_midx.integration.binding._own_loss_function."
    )


def test_the_layer_imports_nothing_of_the_surgery():
    """head.py imports nothing from wrap.py or binding.py (which import it), no file reads another's private
    names or looks the package's own modules up in sys.modules, and the head keeps no capture state."""
    import ast
    import pathlib
    import re

    import hf_midx

    package = pathlib.Path(hf_midx.__file__).parent
    tree = ast.parse((package / "integration" / "head.py").read_text())
    imported = {n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)}
    imported |= {a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
    assert not {m for m in imported if m and m.split(".")[-1] in ("wrap", "binding")}, imported
    for name in ("wrap.py", "binding.py", "callback.py", "trainer.py", "state.py"):
        text = (package / "integration" / name).read_text()
        assert not re.findall(r"\bhead\._[a-z]", text), name
    assert "_forward_hooks" not in (package / "integration" / "wrap.py").read_text()
    for path in package.rglob("*.py"):
        assert "sys.modules" not in path.read_text(), path
    model, _ = _wrapped("llama")
    model.train()
    model(input_ids=_ids(), labels=_ids())
    head = find_head(model)
    assert not {"capturing", "_hidden", "take_hidden", "loss_from_hidden"} & set(dir(head))


