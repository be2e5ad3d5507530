"""The engine and the integration on an accelerator: samplers, losses, the wrapped head and MidxTrainer
with bf16, run on ``HF_MIDX_TEST_DEVICE`` (default ``cuda``; skipped when that device is absent).

The rest of the suite runs on CPU; these tests repeat its key claims where the kernels, the random
generators and the dtypes differ: draws fit their claimed probabilities (same statistics as
test_samplers.py), the sampled loss has its closed form under an exact proposal, evaluation stays
exact, no (tokens x vocab) tensor is built, and MidxTrainer trains in bf16 and exports a plain model.
``HF_MIDX_TEST_DEVICE=cpu`` runs them on CPU (to check the tests themselves).
"""

from __future__ import annotations

import math
import os

import pytest
import torch
from transformers import AutoModelForCausalLM

from _models import clone_model, tiny_model
import hf_midx
from hf_midx import SAMPLERS, MidxConfig, MidxTrainer, build_sampler
from hf_midx.integration.head import find_head
from hf_midx.losses import full_softmax_loss, sampled_softmax_loss
from test_head import _LargestTensor
from test_trainer import VOCAB, RowsDataset, eval_rows, markov_rows, training_args

DEVICE = torch.device(os.environ.get("HF_MIDX_TEST_DEVICE", "cuda"))
pytestmark = pytest.mark.skipif(
    DEVICE.type == "cuda" and not torch.cuda.is_available(),
    reason="no CUDA device (HF_MIDX_TEST_DEVICE=cpu runs these tests on CPU)",
)
V, D, K = 300, 16, 8


@pytest.fixture(scope="module")
def problem(make_clustered):
    emb, queries = make_clustered(V, D, num_queries=8, center_scale=0.5, spread=0.15, seed=1)
    counts = torch.randint(0, 50, (V,), generator=torch.Generator().manual_seed(3))
    return emb.to(DEVICE), queries.to(DEVICE), counts.to(DEVICE)


# ------------------------------------------------------------------------------------------ samplers
@pytest.mark.parametrize("name", sorted(SAMPLERS))
def test_draws_on_device_fit_their_log_prob(name, problem, fits):
    """100k draws per query, made by the device's generator, fit exp(log_prob) (alpha = 1e-4)."""
    emb, queries, counts = problem
    s = build_sampler(name, emb, codebook_size=K, class_counts=counts, seed=0)
    assert s.device.type == DEVICE.type
    q = queries[:2]
    gen = torch.Generator(device=DEVICE).manual_seed(11)
    ids, log_q = s.sample(q, 100_000, generator=gen)
    assert ids.device.type == DEVICE.type and log_q.dtype == torch.float32
    torch.testing.assert_close(log_q, s.log_prob(q, ids), atol=1e-4, rtol=1e-5)
    lp = s.full_log_prob(q).double()
    torch.testing.assert_close(lp.exp().sum(1), torch.ones(2, dtype=torch.float64, device=DEVICE), atol=1e-4, rtol=0)
    for t in range(2):
        fits(torch.bincount(ids[t], minlength=V).cpu(), lp[t].exp().cpu(), f"{name} on {DEVICE.type}, query {t}")
    # Shared pools: the batch mixture.
    pool, log_qbar = s.sample_shared(queries, 100_000, generator=gen)
    torch.testing.assert_close(log_qbar, s.score_shared(queries, pool), atol=1e-4, rtol=1e-5)
    qbar = s.full_log_prob(queries).double().exp().mean(0)
    fits(torch.bincount(pool, minlength=V).cpu(), qbar.cpu(), f"{name} shared pool on {DEVICE.type}")


# ------------------------------------------------------------------------------------------ losses
@pytest.mark.parametrize("estimator", ["exact-positive", "corrected-positive"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_sampled_loss_under_the_exact_proposal_has_its_closed_form(dtype, estimator, problem):
    """With Q = softmax (midx-exact) every corrected negative logit is log Z - log M, so without
    accidental-hit removal the paper's estimator gives log(exp(o_y) + Z) - o_y = full loss + log(1 + p_y)
    exactly, whatever was drawn. With the corrected positive the label is one more candidate, o_y - log((M + 1)
    p_y) = log Z - log(M + 1) like each negative, in the sum and as the target: the loss is log(M + 1) for
    every token (its gradient, not its value, estimates the full loss's). A deterministic check of the gather,
    the correction and the dtypes."""
    emb, queries, _ = problem
    g = torch.Generator().manual_seed(5)
    hidden = (queries[torch.randint(8, (64,), generator=g)].cpu() + 0.1 * torch.randn(64, D, generator=g)).to(DEVICE)
    labels = torch.randint(V, (64,), generator=g).to(DEVICE)
    labels[::9] = -100
    weight, hidden = emb.to(dtype), hidden.to(dtype)
    sampler = build_sampler("midx-exact", weight.float(), codebook_size=K, seed=0)
    got = sampled_softmax_loss(hidden, weight, labels, sampler, 50, reduction="none", remove_accidental_hits=False,
                               estimator=estimator, exact_value=False)  # fmt: skip
    logits = hidden.double() @ weight.double().T  # the reference from the same (rounded) inputs
    full = torch.nn.functional.cross_entropy(logits, labels, reduction="none")
    p_y = (-full).exp()
    keep = labels != -100
    closed = full + torch.log1p(p_y) if estimator == "exact-positive" else torch.full_like(full, math.log(51))
    want = torch.where(keep, closed, torch.zeros_like(full))
    # bf16 logits carry a relative rounding error of 2^-8 (|logit| ~ 1 here); fp32 far less.
    atol = 2e-2 if dtype == torch.bfloat16 else 1e-4
    assert got.dtype == torch.float32 and bool((got[~keep] == 0).all())
    torch.testing.assert_close(got.double(), want, atol=atol, rtol=0)
    exact = full_softmax_loss(hidden, weight, labels, reduction="mean")
    torch.testing.assert_close(exact.double(), full[keep].mean(), atol=atol, rtol=0)


def test_sampled_loss_backward_on_device(problem):
    emb, queries, _ = problem
    weight = emb.clone().requires_grad_(True)
    hidden = queries.repeat(8, 1).clone().requires_grad_(True)
    labels = torch.arange(hidden.shape[0], device=DEVICE) % V
    sampler = build_sampler("midx-rq", emb, codebook_size=K, seed=0)
    for negatives in ("per-query", "shared"):
        weight.grad = hidden.grad = None
        loss = sampled_softmax_loss(hidden, weight, labels, sampler, 32, negatives=negatives)
        loss.backward()
        assert torch.isfinite(loss) and torch.isfinite(hidden.grad).all() and torch.isfinite(weight.grad).all()
        assert weight.grad.abs().sum() > 0 and hidden.grad.abs().sum() > 0


# ------------------------------------------------------------------------------------------ wrapped head
@pytest.mark.parametrize("arch", ["gpt2", "llama"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_wrapped_model_on_device(arch, dtype):
    """Exact evaluation, identical generate(), a finite training step and no (tokens x V) tensor."""
    model = tiny_model(arch)
    reference = clone_model(model).to(DEVICE, dtype)
    model.to(DEVICE, dtype)
    hf_midx.wrap(model, num_samples=24, codebook_size=8, kmeans_iters=5)
    head = find_head(model)
    ids = torch.randint(400, (2, 40), generator=torch.Generator().manual_seed(1)).to(DEVICE)
    with torch.no_grad():
        got, want = model(input_ids=ids, labels=ids).loss, reference(input_ids=ids, labels=ids).loss
        assert head.sampler.device.type == DEVICE.type
        # fp32: the same math in another order; bf16: logits rounded at 2^-8 relative either way.
        assert abs(float(got) - float(want)) <= (2e-2 if dtype == torch.bfloat16 else 1e-5) * abs(float(want))
        torch.testing.assert_close(model(input_ids=ids).logits, reference(input_ids=ids).logits)
        prompt = ids[:, :5]
        kwargs = dict(max_new_tokens=8, do_sample=False, pad_token_id=0)
        assert torch.equal(model.generate(prompt, **kwargs), reference.generate(prompt, **kwargs))
    model.train()
    tokens = ids.numel()
    with _LargestTensor() as probe:
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
    assert loss.dtype == torch.float32 and torch.isfinite(loss)
    assert torch.isfinite(model.get_output_embeddings().weight.grad.float()).all()
    big = [s for s in probe.shapes if 400 in s and math.prod(s) >= tokens * 400]
    assert not big, f"a (tokens x vocab) tensor was built on {DEVICE.type}: {big[:3]}"


@pytest.mark.skipif(DEVICE.type != "cuda", reason="kernels='auto' takes the fused kernels on CUDA only")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_default_head_on_cuda_takes_the_fused_kernels(dtype, monkeypatch):
    """MidxConfig()'s kernels="auto" runs hf_midx.losses.kernels on CUDA, with the eager path's loss and gradients."""
    kernels = pytest.importorskip("hf_midx.losses.kernels")
    if not kernels.triton_available():
        pytest.skip("Triton is not installed")
    calls = []
    fused_loss = kernels.candidate_loss
    monkeypatch.setattr(kernels, "candidate_loss", lambda *a, **k: calls.append(1) or fused_loss(*a, **k))
    ids = torch.randint(400, (2, 40), generator=torch.Generator().manual_seed(1)).to(DEVICE)
    runs = {}
    for mode in ("auto", "eager"):
        model = tiny_model("llama").to(DEVICE, dtype)
        hf_midx.wrap(model, num_samples=24, codebook_size=8, kmeans_iters=5, kernels=mode)
        model.train()
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        runs[mode] = (loss.detach(), model.get_output_embeddings().weight.grad.float())
    assert len(calls) == 1, "kernels='auto' did not take the fused path on CUDA"
    tol = dict(rtol=2e-2, atol=2e-3) if dtype == torch.bfloat16 else dict(rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(runs["auto"][0], runs["eager"][0], **tol)
    torch.testing.assert_close(runs["auto"][1], runs["eager"][1], **tol)


# ------------------------------------------------------------------------------------------ trainer
def test_trainer_bf16_trains_evaluates_exactly_and_exports(tmp_path):
    train, evals = RowsDataset(markov_rows(400)), RowsDataset(eval_rows(64))
    model = hf_midx.wrap(
        tiny_model("gpt2", vocab_size=VOCAB),
        MidxConfig(num_samples=32, codebook_size=8, kmeans_iters=10, refresh_every_steps=10),
    )
    args = training_args(tmp_path / "run", max_steps=50, bf16=True, use_cpu=DEVICE.type == "cpu")
    trainer = MidxTrainer(model=model, args=args, train_dataset=train, eval_dataset=evals)
    before = trainer.evaluate()
    trainer.train()
    after = trainer.evaluate()
    head = find_head(trainer.model)
    assert head.sampler.device.type == DEVICE.type
    losses = [e["loss"] for e in trainer.state.log_history if "loss" in e]
    refreshes = [e for e in trainer.state.log_history if "midx/refresh_seconds" in e]
    print(f"[{DEVICE.type} bf16] train loss {losses[0]:.3f} -> {losses[-1]:.3f}; eval {before['eval_loss']:.3f} -> "
          f"{after['eval_loss']:.3f}; refreshes {len(refreshes)}")
    assert all(math.isfinite(x) for x in losses) and len(refreshes) == 5
    exact = [e["midx/train_loss_exact"] for e in trainer.state.log_history if "loss" in e]
    assert len(exact) == len(losses) and all(math.isfinite(x) for x in exact)  # the exact loss, logged beside
    assert losses[-1] < losses[0] - 0.5 and after["eval_loss"] < before["eval_loss"] - 0.5

    out = tmp_path / "saved"
    trainer.save_model(str(out))
    plain = AutoModelForCausalLM.from_pretrained(str(out), attn_implementation="eager").to(DEVICE).eval()
    hf_midx.unwrap(model)
    model.eval()
    with torch.no_grad(), torch.autocast(DEVICE.type, dtype=torch.bfloat16):
        logits = plain(evals.rows.to(DEVICE)).logits[:, :-1].float()
        nll = torch.nn.functional.cross_entropy(logits.reshape(-1, VOCAB), evals.rows[:, 1:].reshape(-1).to(DEVICE))
    # The exported model under the same bf16 autocast reproduces the Trainer's exact eval loss.
    assert after["eval_loss"] == pytest.approx(float(nll), rel=2e-2)
