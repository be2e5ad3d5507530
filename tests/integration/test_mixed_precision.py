"""The head under autocast with float32 weights (the Trainer's bf16=True / fp16=True when training from scratch):
its products in the autocast dtype, as an ``nn.Linear`` head's are, float32 gradients (hf_midx.losses.precision).

A dispatch spy counts the matrix products of one training step (forward and backward) by their operands' dtype,
FLOPs weighted: before, the head turned autocast off and ran every product of its loss in float32.
"""

from __future__ import annotations

import collections

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import hf_midx
from hf_midx import MidxConfig
from hf_midx.integration.head import find_head
from hf_midx.losses.precision import product_dtype

from _models import clone_model, markov_batches, tiny_model

V = 4096


class ProductFlops(TorchDispatchMode):
    """FLOPs of the matrix products (mm, addmm, bmm, baddbmm) by their operands' dtype."""

    def __init__(self):
        super().__init__()
        self.flops = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func._schema.name.split("::")[-1]
        if name in ("mm", "bmm", "addmm", "baddbmm"):
            a, b = args[:2] if name in ("mm", "bmm") else args[1:3]
            self.flops[a.dtype if a.dtype == b.dtype else "mixed"] += 2 * a.numel() * b.shape[-1]
        return func(*args, **(kwargs or {}))


def step(model, batch, autocast):
    """(loss, the head weight's gradient, the product FLOPs by dtype) of one training step."""
    model.train()
    model.zero_grad()
    with ProductFlops() as spy:
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            loss = model(input_ids=batch, labels=batch).loss
        loss.backward()
    return float(loss), find_head(model).weight.grad, spy.flops


def test_a_bf16_autocast_step_runs_the_head_in_bf16():
    """>= 90% of the step's product FLOPs with bfloat16 operands (before: 58% on this model, the head's all float32;
    the proposal's small float32 products remain), float32 weight gradients, the loss within bfloat16's tolerance of
    the float32 step's."""
    batch = markov_batches(V, batch=4, seq=64, steps=1, seed=0)[0]
    counts = torch.bincount(batch.view(-1), minlength=V).double() + 1
    config = MidxConfig(num_samples=64, codebook_size=8, kmeans_iters=2)
    plain = tiny_model("llama", vocab_size=V)
    base, reference = (hf_midx.wrap(clone_model(plain), config, class_counts=counts) for _ in range(2))
    loss, grad, flops = step(base, batch, autocast=True)
    want, want_grad, _ = step(reference, batch, autocast=False)
    share = flops[torch.bfloat16] / sum(flops.values())
    print(f"\nbf16 autocast step: {share:.1%} of {sum(flops.values())} product FLOPs in bfloat16; loss {loss:.5f}, "
          f"float32 step {want:.5f}")
    assert share >= 0.9, dict(flops)
    assert grad.dtype == torch.float32 and torch.isfinite(grad).all()
    assert loss == pytest.approx(want, rel=2e-2)
    cosine = torch.nn.functional.cosine_similarity(grad.flatten(), want_grad.flatten(), dim=0)
    assert cosine > 0.95, float(cosine)


def test_product_dtype_is_autocasts_rule():
    """Under autocast a float32 or float16 weight multiplies in the autocast dtype, float64 keeps its own (autocast
    casts no float64); without autocast, the weight's dtype."""
    for dtype in (torch.float32, torch.float16, torch.bfloat16, torch.float64):
        weight = torch.zeros(4, 2, dtype=dtype)
        assert product_dtype(weight) == dtype
        with torch.autocast("cpu", dtype=torch.bfloat16):
            assert product_dtype(weight) == (dtype if dtype == torch.float64 else torch.bfloat16)


def test_product_dtype_is_what_autocast_passes_and_is_validated():
    """``product_dtype=torch.bfloat16`` with a float32 weight is the loss autocast runs (the same value and
    gradients from the same draws); a dtype wider than the weight's, or not floating, is a ValueError."""
    g = torch.Generator().manual_seed(0)
    weight = torch.randn(300, 16, generator=g, requires_grad=True)
    hidden = torch.randn(24, 16, generator=g, requires_grad=True)
    labels = torch.randint(300, (24,), generator=g)
    sampler = hf_midx.build_sampler("midx-rq", weight.detach(), codebook_size=8)
    start = sampler.generator.get_state()
    results = []
    for autocast in (True, False):
        sampler.generator.set_state(start)
        hidden.grad = weight.grad = None
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            options = {} if autocast else {"product_dtype": torch.bfloat16}
            loss = hf_midx.sampled_softmax_loss(hidden.to(torch.bfloat16) if not autocast else hidden, weight, labels,
                                                sampler, 8, **options)
        loss.backward()
        results.append((loss.detach(), hidden.grad, weight.grad))
    for a, b in zip(*results):
        assert a.dtype == b.dtype and torch.equal(a, b)
    for bad in (torch.float64, torch.int32, "bf16"):
        with pytest.raises(ValueError, match="product_dtype must be a floating dtype no wider than the weight's"):
            hf_midx.sampled_softmax_loss(hidden, weight, labels, sampler, 8, product_dtype=bad)
