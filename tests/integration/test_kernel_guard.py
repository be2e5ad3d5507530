"""The guarded first call of the fused kernels (:mod:`hf_midx.integration.kernel_guard`), on the CPU.

A device where the kernels cannot build is simulated: the head's guard is told the fused path applies to this
CPU model (as it does to a CUDA one), the loss lets "fused" reach the kernels on the CPU (as under the
interpreter), and the kernels (the draw's and the loss's autograd Function) raise what a failed build raises. With ``kernels="auto"`` the
head must warn once, run the fused path no more after its probe, and train exactly as the eager head does (the
probe draws from a generator of its own); an explicit ``kernels="fused"`` must raise.
"""

from __future__ import annotations

import collections
import warnings

import pytest
import torch

import hf_midx
import hf_midx.losses.kernels as kernels
from hf_midx import MidxConfig
from hf_midx.integration.head import MidxLMHead
from hf_midx.integration import kernel_guard
from hf_midx.losses.kernels import candidate, counter, draw

from _models import clone_model, markov_batches, tiny_model
from test_fused_head import train

VOCAB, STEPS = 256, 3
BUILD_ERROR = "PTXASError: simulated: ptxas fatal: Value 'sm_999' is not defined for option 'gpu-name'"


@pytest.fixture
def broken_kernels(monkeypatch):
    """Calls of the fused kernels' Function, each of which fails as a build for an unknown architecture does."""
    calls = collections.Counter()

    def fail(*args, **kwargs):
        calls["fused"] += 1
        raise RuntimeError(BUILD_ERROR)

    # The step's first kernels are the draw's (the generator, then the bucket draw), then the loss's.
    monkeypatch.setattr(counter, "counter_rand", fail)
    monkeypatch.setattr(draw, "midx_bucket_draw", fail)
    monkeypatch.setattr(candidate.FusedCandidateLoss, "apply", fail)
    monkeypatch.setattr(kernel_guard, "auto_takes_fused", lambda weight, negatives: True)
    monkeypatch.setattr(kernels, "triton_available", lambda: True)
    monkeypatch.setattr(kernels, "triton_interpreting", lambda: True)
    monkeypatch.setattr(candidate, "triton_available", lambda: True)
    monkeypatch.setattr(candidate, "triton_interpreting", lambda: True)
    return calls


def _wrapped(model, kernels_mode):
    return hf_midx.wrap(model, num_samples=16, codebook_size=8, kmeans_iters=2, kernels=kernels_mode)


def test_auto_warns_once_and_trains_on_the_eager_path(broken_kernels):
    base = tiny_model("llama", vocab_size=VOCAB)
    batches = markov_batches(VOCAB, batch=4, seq=16, steps=STEPS, seed=1)
    auto, eager = _wrapped(clone_model(base), "auto"), _wrapped(clone_model(base), "eager")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        got = train(auto, batches, STEPS)
    ours = [w for w in caught if "fused Triton kernels cannot run" in str(w.message)]
    assert len(ours) == 1, [str(w.message) for w in caught]
    message = str(ours[0].message)
    assert BUILD_ERROR in message and "cpu" in message and 'MidxConfig(kernels="eager")' in message
    assert broken_kernels["fused"] == 1  # the probe only: every step ran eagerly
    # The probe left the sampler's stream alone: the same draws, losses and weights as the eager head's.
    assert got == train(eager, batches, STEPS) and all(torch.isfinite(torch.tensor(got)))
    for a, b in zip(auto.parameters(), eager.parameters()):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_explicit_fused_still_raises(broken_kernels):
    model = _wrapped(tiny_model("llama", vocab_size=VOCAB), "fused").train()
    batch = markov_batches(VOCAB, batch=4, seq=16, steps=1, seed=1)[0]
    with warnings.catch_warnings(record=True) as caught, pytest.raises(RuntimeError, match="sm_999"):
        warnings.simplefilter("always")
        model(input_ids=batch, labels=batch).loss.backward()
    assert not [w for w in caught if "fused Triton kernels cannot run" in str(w.message)]


def test_no_probe_where_auto_runs_eagerly(monkeypatch):
    """On the CPU "auto" is the eager path already: nothing is probed, nothing warned."""
    monkeypatch.setattr(kernel_guard, "probe_fused", lambda *a, **k: pytest.fail("probed on the CPU"))
    model = _wrapped(tiny_model("llama", vocab_size=VOCAB), "auto")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        train(model, markov_batches(VOCAB, batch=4, seq=16, steps=1, seed=1), 1)
    assert not [w for w in caught if "fused Triton kernels cannot run" in str(w.message)]


def test_a_compiled_first_call_traces_the_guard_in_one_graph():
    """Under torch.compile the guard probes nothing and adds no graph break, before or after its decision."""
    torch._dynamo.reset()
    g = torch.Generator().manual_seed(0)
    counts = torch.randint(1, 100, (VOCAB,), generator=g).double()
    head = MidxLMHead(torch.nn.Linear(16, VOCAB, bias=False), MidxConfig(num_samples=8, codebook_size=4),
                      class_counts=counts)
    hidden = torch.randn(32, 16, generator=g, requires_grad=True)
    labels = torch.randint(VOCAB, (32,), generator=g)
    compiled = torch.compile(lambda h, y: head.loss(h, y), fullgraph=True, backend="eager")
    compiled(hidden, labels).backward()  # first call compiled: nothing decided yet
    assert head.kernel_guard.choices == {}
    head.loss(hidden, labels)  # an eager call decides (the CPU: "auto", nothing to probe)
    assert head.kernel_guard.choices == {"cpu": "auto"}
    compiled(hidden, labels).backward()
