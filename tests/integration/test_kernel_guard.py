"""The guarded first call of the fused kernels (:mod:`hf_midx.integration.kernel_guard`), on the CPU.

A device where the kernels cannot build is simulated: the head's guard is told the fused path applies to this
CPU model (as it does to a CUDA one), the loss lets "fused" reach the kernels on the CPU (as under the
interpreter), and the kernels (the draw's and the loss's autograd Function) raise what a failed build raises. With ``kernels="auto"`` the
head must warn once, run the fused path no more after its probe, and train exactly as the eager head does (the
probe builds a head and sampler of its own); an explicit ``kernels="fused"`` must raise. Kernels that run but are
wrong in other ways (the draw, the stream, the tail's spread, a loss 3% off) are in ``test_kernel_probe.py``.
"""

from __future__ import annotations

import collections
import warnings

import pytest
import torch

import hf_midx
import hf_midx.losses.kernels as kernels
from hf_midx import MidxConfig
from hf_midx.integration.head import MidxLMHead, find_head
from hf_midx.integration import kernel_guard
from hf_midx.losses.kernels import candidate, counter, draw, launch
from hf_midx.samplers.midx import MidxQuantizedSampler

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
    monkeypatch.setattr(kernel_guard, "auto_takes_fused", lambda device, dtype, negatives: True)
    monkeypatch.setattr(kernels, "triton_available", lambda: True)
    monkeypatch.setattr(kernels, "triton_interpreting", lambda: True)
    monkeypatch.setattr(candidate, "triton_available", lambda: True)
    monkeypatch.setattr(candidate, "triton_interpreting", lambda: True)
    return calls


def _wrapped(model, kernels_mode):
    """The model wrapped with an exact head of 32 classes (the probe's labels hit it, the tail and ignored tokens)."""
    counts = torch.randint(1, 100, (VOCAB,), generator=torch.Generator().manual_seed(0)).double()
    return hf_midx.wrap(model, num_samples=16, codebook_size=8, kmeans_iters=2, kernels=kernels_mode, exact_head=32,
                        class_counts=counts)


def _warned_and_trained(kernels_mode="auto"):
    """(the guard's warnings, losses, model) of a tiny model wrapped with ``kernels_mode`` (the probe runs at wrap)
    and trained STEPS steps; and the same of the eager head (losses, model)."""
    base = tiny_model("llama", vocab_size=VOCAB)
    batches = markov_batches(VOCAB, batch=4, seq=16, steps=STEPS, seed=1)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        auto = _wrapped(clone_model(base), kernels_mode)
        got = train(auto, batches, STEPS)
    eager = _wrapped(clone_model(base), "eager")
    ours = [str(w.message) for w in caught if "fused Triton kernels cannot run" in str(w.message)]
    return ours, got, auto, train(eager, batches, STEPS), eager


def _same_training(got, auto, want, eager):
    """The probe left the sampler's stream alone: the same draws, losses and weights as the eager head's, bit for
    bit."""
    assert got == want and all(torch.isfinite(torch.tensor(got)))
    for a, b in zip(auto.parameters(), eager.parameters()):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_auto_warns_once_and_trains_on_the_eager_path(broken_kernels):
    ours, got, auto, want, eager = _warned_and_trained()
    assert len(ours) == 1, ours
    message = ours[0]
    assert BUILD_ERROR in message and "cpu" in message and 'MidxConfig(kernels="eager")' in message
    assert broken_kernels["fused"] == 1  # the probe only: every step ran eagerly
    _same_training(got, auto, want, eager)


class _Corrupt(torch.autograd.Function):
    """x as is, its gradient changed by ``wrong``."""

    @staticmethod
    def forward(ctx, x, wrong):
        ctx.wrong = wrong
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return ctx.wrong(grad), None


WRONG = {
    "nan": dict(loss=lambda x: x * float("nan"), hidden=lambda g: g * float("nan")),
    "scaled gradient": dict(hidden=lambda g: 2.0 * g),
    "wrong weight row": dict(weight=lambda g: g.roll(1, 0)),  # each class's gradient on its neighbour's row
}


@pytest.fixture
def kernels_as(monkeypatch):
    """``kernels_as(wrong)``: the fused loss's Function replaced by the eager reference (the kernels' numbers where
    they are right), its loss or a gradient changed by ``wrong`` (a WRONG entry; {} for right kernels); the fused
    path reaches it on the CPU; the draws stay eager. Returns the count of its calls."""
    calls = collections.Counter()

    def install(wrong):
        def apply(hidden, weight, bias, labels, ids, log_q, log_q_pos, head_ids, ignore_index, scale, softcap,
                  corrected, drop_hits, exact_value, reduction, blocks, tail_control, factors=None):
            calls["fused"] += 1
            if "hidden" in wrong:
                hidden = _Corrupt.apply(hidden, wrong["hidden"])
            if "weight" in wrong:
                weight = _Corrupt.apply(weight, wrong["weight"])
            out = candidate.candidate_loss_reference(
                hidden, weight, labels, ids, log_q, log_q_pos, bias=bias, head_ids=head_ids,
                ignore_index=ignore_index, logit_scale=scale, logit_softcap=softcap, corrected=corrected,
                drop_hits=drop_hits, exact_value=exact_value, reduction=reduction, tail_control=tail_control,
                factors=factors,
            )
            change = wrong.get("loss", lambda x: x)
            return (change(out[0]), *out[1:]) if isinstance(out, tuple) else change(out)

        monkeypatch.setattr(candidate.FusedCandidateLoss, "apply", apply)
        monkeypatch.setattr(MidxQuantizedSampler, "has_fused_draw", classmethod(lambda cls: False))
        monkeypatch.setattr(kernel_guard, "auto_takes_fused", lambda device, dtype, negatives: True)
        for module in (kernels, candidate, launch):
            monkeypatch.setattr(module, "triton_available", lambda: True)
            monkeypatch.setattr(module, "triton_interpreting", lambda: True)
        return calls

    return install


@pytest.mark.parametrize("wrong", list(WRONG))
def test_kernels_that_compute_something_else_warn_once_and_fall_back(kernels_as, wrong):
    """Kernels that run but are wrong (NaN, a gradient scaled by 2, each row's gradient on its neighbour's): the
    probe compares them with the eager path, warns once, and every step then equals the eager head's bit for bit."""
    calls = kernels_as(WRONG[wrong])
    ours, got, auto, want, eager = _warned_and_trained()
    assert len(ours) == 1 and "KernelMismatch" in ours[0] and "differs from the eager path" in ours[0], ours
    assert calls["fused"] == 1  # the probe's first call only
    assert set(find_head(auto).kernel_guard.choices.values()) == {"eager"}
    _same_training(got, auto, want, eager)


def test_right_kernels_pass_the_probe(kernels_as):
    """Kernels that compute the eager numbers pass both probe calls, no warning, "auto" kept (which on the CPU runs
    the eager path: the steps are the eager head's)."""
    calls = kernels_as({})
    ours, got, auto, want, eager = _warned_and_trained()
    assert not ours
    assert calls["fused"] == len(kernel_guard.PROBE_TOKENS)
    assert set(find_head(auto).kernel_guard.choices.values()) == {"auto"}
    _same_training(got, auto, want, eager)


@pytest.mark.parametrize("context", [torch.no_grad, torch.inference_mode])
def test_a_first_call_without_grad_probes_as_any_other(kernels_as, context):
    """A first sampled loss under no_grad or inference_mode (an evaluation before training) probes with gradients:
    it must not turn the kernels off for good."""
    kernels_as({})
    head = MidxLMHead(torch.nn.Linear(16, VOCAB, bias=True), MidxConfig(num_samples=8, codebook_size=4),
                      class_counts=torch.randint(1, 100, (VOCAB,), generator=torch.Generator().manual_seed(0)).double())
    with warnings.catch_warnings(record=True) as caught, context():
        warnings.simplefilter("always")
        head.loss(torch.randn(32, 16), torch.randint(VOCAB, (32,)))
    assert not [w for w in caught if "fused Triton kernels cannot run" in str(w.message)]
    assert head.kernel_guard.choices == {("cpu", "float32"): "auto"}


def test_no_probe_while_a_cuda_graph_captures(kernels_as, monkeypatch):
    """During CUDA-graph capture no sync can run: the guard keeps "auto" undecided; prepare() decides before."""
    kernels_as({})
    monkeypatch.setattr(kernel_guard, "probe_fused", lambda *a, **k: pytest.fail("probed while capturing"))
    monkeypatch.setattr(kernel_guard, "graph_capturing", lambda device: True)
    head = MidxLMHead(torch.nn.Linear(16, VOCAB, bias=False), MidxConfig(num_samples=8, codebook_size=4))
    head.loss(torch.randn(32, 16), torch.randint(VOCAB, (32,)))
    assert head.kernel_guard.choices == {}


def test_a_device_fault_says_the_context_may_be_unusable():
    with pytest.warns(RuntimeWarning) as caught:
        kernel_guard.warn_fallback(RuntimeError("CUDA error: an illegal memory access was encountered"),
                                   torch.device("cpu"))
    message = str(caught[0].message)
    assert "CUDA context may be unusable" in message and 'MidxConfig(kernels="eager")' in message


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
    """Under torch.compile the guard decides while tracing (on the CPU: "auto", nothing to probe) and adds no graph
    break, before or after its decision."""
    torch._dynamo.reset()
    g = torch.Generator().manual_seed(0)
    counts = torch.randint(1, 100, (VOCAB,), generator=g).double()
    head = MidxLMHead(torch.nn.Linear(16, VOCAB, bias=False), MidxConfig(num_samples=8, codebook_size=4),
                      class_counts=counts)
    hidden = torch.randn(32, 16, generator=g, requires_grad=True)
    labels = torch.randint(VOCAB, (32,), generator=g)
    compiled = torch.compile(lambda h, y: head.loss(h, y), fullgraph=True, backend="eager")
    compiled(hidden, labels).backward()  # first call compiled: decided at trace time
    assert head.kernel_guard.choices == {("cpu", "float32"): "auto"}
    head.loss(hidden, labels)
    compiled(hidden, labels).backward()
