"""The fused kernels in the training head: ``MidxConfig(kernels=...)`` and ``sampled_softmax_loss(kernels=...)``.

:mod:`test_kernels` checks the kernels as an op (given draws, against the reference); here they run where
users meet them: the loss drawing its own negatives, and a wrapped transformers model training. Each
fused result is compared with the eager path on the same sampler state (the same counter gives the same
draws), so any difference is the kernels'. As in :mod:`test_kernels`, the interpreted cases run in a child
process started with ``TRITON_INTERPRET=1`` (Triton reads it when it is imported, and a process whose Triton
interprets can no longer compile GPU kernels); the parent runs the validation and the "auto" choice, which
need no kernel. Shapes are small (T 64-96, V 2,000-2,048, D 32, M 12, H 64): the interpreter runs one
program at a time in Python.
"""

from __future__ import annotations

import collections
import contextlib
import json
import math
import os

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import hf_midx
from hf_midx import MidxConfig, build_sampler, sampled_softmax_loss
from hf_midx.config import CONFIG_NAME
from hf_midx.integration.head import find_head
from hf_midx.losses.kernels import candidate, candidate_loss, launch, triton_available

from _models import clone_model, markov_batches, tiny_model
from test_kernels import _FREE, OpCounter, launched_kernels, make_case, run, run_interpreted
from test_hot_path import GraphCounter, check_head_step_is_one_capturable_graph
from test_op_count import _default_head_step

INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"
needs_triton = pytest.mark.skipif(not triton_available(), reason="the fused kernels need Triton (Linux x86_64 wheels)")
interpreted = pytest.mark.skipif(
    not INTERPRETED, reason="runs in the TRITON_INTERPRET=1 child (test_interpreted_fused_head)"
)
compiled = pytest.mark.skipif(INTERPRETED, reason="runs in the parent process, whose Triton compiles")
#: The default head's steps run here with K = 8 (64 buckets), not the default 32: the bucket table launches one
#: interpreted program per chunk and per bucket, about K ** 2 + V / 512 a launch, and K = 32 (1,024 buckets) made
#: this file's child run four times longer (the capturable-graph test alone: 13 steps, about 3 minutes).
INTERPRETED_K = 8

T, V, D, M, H = 96, 2000, 32, 12, 64


@compiled
@needs_triton
def test_interpreted_fused_head():
    """This file again, in a child process whose Triton interprets (see the module docstring)."""
    run_interpreted(__file__)


@pytest.fixture
def fused_calls(monkeypatch):
    """The number of times the fused autograd Function ran (its forward launches the Triton kernels)."""
    calls = collections.Counter()
    forward = candidate.FusedCandidateLoss.forward

    def counted(ctx, *args):
        calls["forward"] += 1
        return forward(ctx, *args)

    monkeypatch.setattr(candidate.FusedCandidateLoss, "forward", staticmethod(counted))
    return calls


# ------------------------------------------------------------------------------------------ the loss
Problem = collections.namedtuple("Problem", "hidden weight bias labels sampler")


def problem(*, head=True, bias=True, seed=0):
    """Inputs of the loss and a default MIDX sampler (its exact head the H most frequent classes): some
    tokens ignored, some labels in the head."""
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(T, D, generator=g).requires_grad_(True)
    weight = (torch.randn(V, D, generator=g) / math.sqrt(D) * 2.0).requires_grad_(True)
    b = (0.5 * torch.randn(V, generator=g)).requires_grad_(True) if bias else None
    counts = torch.randint(1, 50, (V,), generator=g).double()
    exclude = torch.sort(torch.argsort(counts, descending=True)[:H]).values if head else None
    labels = torch.randint(V, (T,), generator=g)
    if head:
        labels[::5] = exclude[torch.randint(H, (len(labels[::5]),), generator=g)]
    labels[::7] = -100
    sampler = build_sampler("midx-rq", weight.detach(), codebook_size=8, kmeans_iters=3, class_counts=counts,
                            exclude=exclude, seed=seed)
    return Problem(hidden, weight, b, labels, sampler)


def loss_and_grads(p, kernels, **options):
    """(loss, grad hidden, grad weight, grad bias) of the loss drawing from the sampler's own generator, which
    starts from the same state for every call; and that generator's state afterwards."""
    start = p.sampler.generator.get_state()
    for x in (p.hidden, p.weight, p.bias):
        if x is not None:
            x.grad = None
    loss = sampled_softmax_loss(p.hidden, p.weight, p.labels, p.sampler, M, bias=p.bias,
                                exact_ids=p.sampler.excluded, kernels=kernels, **options)
    loss.sum().backward()
    after = p.sampler.generator.get_state()
    p.sampler.generator.set_state(start)
    grads = [None if x is None else x.grad.clone() for x in (p.hidden, p.weight, p.bias)]
    return [loss.detach(), *grads], after


def assert_close(got, want, tol=2e-5):
    for name, x, ref in zip(("loss", "grad hidden", "grad weight", "grad bias"), got, want):
        assert (x is None) == (ref is None), name
        if ref is not None:
            err = float((x - ref).abs().max() / ref.abs().max().clamp_min(1e-30))
            assert err < tol, f"{name}: relative error {err:.2e} >= {tol:.0e}"


@interpreted
@pytest.mark.parametrize(
    "setup, options",
    [
        # The default training head: corrected positive, hits kept, the exact-loss estimate, exact head, bias.
        (dict(), dict()),
        # The paper's estimator (hits dropped), soft cap, per-token losses, int32 labels, no head, no bias.
        (dict(head=False, bias=False, seed=1), dict(estimator="exact-positive", logit_softcap=3.0, reduction="none")),
        (dict(seed=2), dict(exact_value=False, remove_accidental_hits=True, reduction="sum")),
        # The expected tail gradient: the kernels give each draw's share back, the expected part is added eagerly.
        (dict(seed=3), dict(tail_gradient="expected")),
        (dict(seed=4, bias=False), dict(tail_gradient="expected", reduction="sum")),
        # Label smoothing and the z-loss (issue 55): the kernels' per-token loss, scaled and completed eagerly.
        (dict(seed=5), dict(z_loss=1e-2, label_smoothing=0.1)),
        (dict(seed=6, bias=False), dict(tail_gradient="sampled", z_loss=1e-2, label_smoothing=0.1, reduction="sum")),
    ],
)
def test_fused_loss_is_the_eager_loss_on_the_same_draws(setup, options, fused_calls):
    p = problem(**setup)
    if setup.get("head") is False:
        p = p._replace(labels=p.labels.int())
    want, eager_state = loss_and_grads(p, "eager", **options)
    assert fused_calls["forward"] == 0
    got, fused_state = loss_and_grads(p, "fused", **options)
    assert fused_calls["forward"] == 1
    assert torch.equal(fused_state, eager_state)  # the same draws consumed the same counters
    assert_close(got, want)


@interpreted
def test_every_launch_runs_under_its_tensors_device(monkeypatch):
    """Triton launches on the current CUDA device and its current stream, not on the tensors' (a head on cuda:1
    while cuda:0 is current, as under device_map): every launch of a step (the random stream, the bucket draw, the
    tail's table, the loss's three) must run inside ``on_device`` of its tensors' device. A spy on that context
    records the device each launch sees; on the CPU it is "cpu" (the CUDA side is the next test)."""
    from triton.runtime import interpreter

    current, seen = [], []
    real_context, real_call = launch.on_device, interpreter.GridExecutor.__call__

    @contextlib.contextmanager
    def spy(device):
        current.append(torch.device(device))
        with real_context(device):
            yield
        current.pop()

    def recorded(self, *args, **kwargs):
        devices = {a.device for a in args if isinstance(a, torch.Tensor)}
        seen.append((self.fn.__name__, current[-1] if current else None, devices))
        with torch.utils._python_dispatch._disable_current_modes():
            return real_call(self, *args, **kwargs)

    monkeypatch.setattr(launch, "on_device", spy)
    monkeypatch.setattr(interpreter.GridExecutor, "__call__", recorded)
    loss_and_grads(problem(seed=3), "fused", tail_gradient="expected")
    names = {name for name, _, _ in seen}
    assert {"counter_rand_kernel", "midx_draw_kernel", "bucket_partials_kernel", "bucket_sums_kernel",
            "candidate_forward_kernel", "candidate_grad_hidden_kernel", "candidate_grad_weight_kernel"} <= names, names
    for name, device, devices in seen:
        assert devices == {device}, f"{name} launched under {device}, its tensors on {devices}"


def test_a_launch_on_a_second_gpu_makes_that_gpu_current(monkeypatch):
    """``on_device`` of cuda:1 enters ``torch.cuda.device(cuda:1)`` (Triton then takes cuda:1 and its current
    stream); of the CPU, nothing."""
    entered = []
    monkeypatch.setattr(torch.cuda, "device", lambda d: entered.append(torch.device(d)) or contextlib.nullcontext())
    with launch.on_device(torch.device("cuda", 1)):
        assert entered == [torch.device("cuda", 1)]
    with launch.on_device(torch.device("cpu")):
        pass
    assert entered == [torch.device("cuda", 1)]


@interpreted
@pytest.mark.parametrize("dtype, product_dtype", [(torch.float32, None), (torch.bfloat16, None),
                                                  (torch.float32, torch.bfloat16)])
def test_the_guard_passes_the_real_kernels(dtype, product_dtype):
    """The first-call probe (the stream, the draw, the loss and its gradients part by part; random tokens hitting the
    exact head, the tail and ignored positions; T = 32 and 21, a per-token upstream gradient, a trainable bias) finds
    the interpreted kernels within its tolerances, for a head of V = 65,536 (the probe's slice: H + 4,096 classes) in
    float32, bfloat16, and float32 under bfloat16 autocast (the step's products, as the loss casts them),
    allocating at most 1.0x V D 4 bytes (V = 65,536, D = 512: 0.26x in both dtypes, 11.5 s and 20 s here)."""
    from hf_midx.integration.kernel_probe import probe_fused
    from test_kernel_probe import LiveBytes

    config = MidxConfig(num_samples=M, codebook_size=INTERPRETED_K, kmeans_iters=3, exact_head=H)
    with LiveBytes() as live:
        assert probe_fused(config, torch.device("cpu"), dtype, (65_536, D, H, True, None), product_dtype) is None
    assert live.peak <= 65_536 * D * 4, live.peak / (65_536 * D * 4)


@interpreted
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_guard_sees_the_real_weight_gradient_without_its_tail_spread(monkeypatch, dtype):
    """The interpreted weight-gradient kernel launched without the bucket table's gradient (HAS_TABLE off: no row
    starts at the expected tail's spread) at V = 65,536: the probe names the rows only the spread reaches (the probe
    before it, comparing the whole gradient by its largest value, passed this in both dtypes)."""
    from hf_midx.integration.kernel_probe import probe_fused

    launch_grad_weight = torch.ops.hf_midx.candidate_grad_weight

    def without_table(hidden, order, keys, starts, g_cand, gscale, grad_table, bucket, member, static, *rest):
        return launch_grad_weight(hidden, order, keys, starts, g_cand, gscale, None, None, None, None, *rest)

    monkeypatch.setattr(torch.ops.hf_midx, "candidate_grad_weight", without_table)
    config = MidxConfig(num_samples=M, codebook_size=INTERPRETED_K, kmeans_iters=3, exact_head=H)
    error = probe_fused(config, torch.device("cpu"), dtype, (65_536, D, H, True, None))
    assert "grad weight's other rows" in str(error), error


@interpreted
@pytest.mark.parametrize("kernels", ["fused", "eager"])
def test_the_loss_under_autocast_multiplies_in_its_dtype(kernels):
    """Under bf16 autocast with a float32 head and an exact head, the loss runs its products in bfloat16 (as an
    nn.Linear head would) and gives float32 gradients: before, the fused backward crashed ("expected m1 and m2 to
    have the same dtype": the head's logit gradient bfloat16 from an autocast GEMM, its weight float32)."""
    p = problem(seed=3)
    want, _ = loss_and_grads(p, kernels)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        got, _ = loss_and_grads(p, kernels)
    assert [x.dtype for x in got] == [torch.float32] * 4
    assert float(got[0]) == pytest.approx(float(want[0]), rel=1e-2)
    for x, ref in zip(got[1:], want[1:]):
        assert torch.nn.functional.cosine_similarity(x.flatten(), ref.flatten(), dim=0) > 0.99


@interpreted
def test_an_autocast_step_launches_the_mixed_kernels_on_the_float32_weight(monkeypatch):
    """With float32 weights under bf16 autocast the fused loss launches its kernels on the float32 weight as it is,
    with bfloat16 hidden states (the "mixed" variants recipes/benchmarks/kernel_builds.py builds): no bfloat16 copy
    of the weight (issue 74, item 4); the bucket table reads the float32 rows too."""
    from triton.runtime import interpreter

    variants, real_call = {}, interpreter.GridExecutor.__call__

    def recorded(self, *args, **kwargs):
        variants[self.fn.__name__] = tuple(str(a.dtype) for a in args if isinstance(a, torch.Tensor))
        with torch.utils._python_dispatch._disable_current_modes():
            return real_call(self, *args, **kwargs)

    monkeypatch.setattr(interpreter.GridExecutor, "__call__", recorded)
    p = problem(seed=3)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss_and_grads(p, "fused", tail_gradient="expected")
    # (hidden, weight, ...) of the forward; (weight, ..., out) of the hidden gradient; (hidden, ...) of the weight's
    assert variants["candidate_forward_kernel"][:2] == ("torch.bfloat16", "torch.float32"), variants
    assert variants["candidate_grad_hidden_kernel"][0] == "torch.float32", variants
    assert variants["candidate_grad_hidden_kernel"][-1] == "torch.bfloat16", variants
    assert variants["candidate_grad_weight_kernel"][0] == "torch.bfloat16", variants
    assert "torch.float32" in variants["candidate_grad_weight_kernel"][-2:], variants  # grad_weight, float32
    assert variants["bucket_partials_kernel"][0] == "torch.float32", variants


@interpreted
def test_default_fused_autocast_step_copies_no_weight_and_is_the_bfloat16_steps():
    """Issue 74 (4): the default head, fused, a float32 weight under bf16 autocast. An op trace of the step (forward
    and backward) finds one op that makes a new (V, D) tensor, the gradient's buffer (written in float32 by the
    kernel): before, a float32 -> bfloat16 copy of the weight in the forward and a bfloat16 -> float32 copy of its
    gradient in the backward (``_to_copy``), 12 bytes an element a step. The loss is the pure bfloat16 step's (the
    kernels round each tile of the weight as the copy was rounded) and the gradient its within bfloat16 rounding."""
    head, _ = _default_head_step(64, V, D, torch.float32, kernels="fused", codebook_size=INTERPRETED_K)
    g = torch.Generator().manual_seed(5)
    hidden = torch.randn(64, D, generator=g, requires_grad=True)
    labels = torch.randint(V, (64,), generator=g)
    start = head.sampler.generator.get_state()
    with NewTensorsOfShape(head.weight.shape) as new, torch.autocast("cpu", dtype=torch.bfloat16):
        head.weight.grad = None
        loss = head.loss(hidden, labels)
    with NewTensorsOfShape(head.weight.shape) as new_backward:
        loss.backward()
    assert new.ops == [] and new_backward.ops == ["empty_like"], (new.ops, new_backward.ops)
    grad = head.weight.grad
    assert grad.dtype == torch.float32 and grad.abs().sum() > 0
    head.sampler.generator.set_state(start)
    half = head.weight.detach().bfloat16().requires_grad_()
    want = head.loss(hidden.bfloat16(), labels, weight=half)
    want.backward()
    torch.testing.assert_close(loss, want, rtol=2e-3, atol=1e-4)
    cosine = torch.nn.functional.cosine_similarity(grad.flatten(), half.grad.float().flatten(), dim=0)
    assert cosine > 0.999, float(cosine)


def test_auto_is_eager_on_the_cpu(fused_calls):
    """"auto" (the config's default) runs the eager path on CPU tensors, bit for bit, in the parent process and
    in the interpreted child alike."""
    p = problem(seed=3)
    want, _ = loss_and_grads(p, "eager")
    got, _ = loss_and_grads(p, "auto")
    assert fused_calls["forward"] == 0
    for x, ref in zip(got, want):
        assert torch.equal(x, ref)


# ------------------------------------------------------------------------------------------ the wrapped model
def train(model, batches, steps):
    """Losses of a few SGD steps on the given batches (train mode, no dropout in these tiny models). SGD keeps the
    parameters' difference that of the gradients; Adam would blow up float rounding in gradients near its eps."""
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    model.train()
    losses = []
    for batch in batches[:steps]:
        loss = model(input_ids=batch, labels=batch).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(float(loss.detach()))
    return losses


def wrapped_pair(arch, first, second):
    """Two copies of one tiny model with V = 2,048, wrapped alike but for ``kernels``, and Markov batches of
    4 x 16 tokens (64 a step) whose counts pick the exact head."""
    vocab = 2048
    batches = markov_batches(vocab, batch=4, seq=16, steps=4, seed=5)
    counts = torch.bincount(torch.cat(batches).view(-1), minlength=vocab)
    models = []
    for kernels, model in ((first, tiny_model(arch, vocab_size=vocab)), (second, None)):
        model = model if model is not None else clone_model(models[0])
        config = MidxConfig(kernels=kernels, num_samples=M, codebook_size=8, kmeans_iters=3, exact_head=H)
        models.append(hf_midx.wrap(model, config, class_counts=counts))
    return models, batches


@interpreted
@pytest.mark.parametrize("arch", ["llama", "phi"])  # phi: an lm_head with a bias
def test_wrapped_model_trains_alike_fused_and_eager(arch, fused_calls):
    (eager, fused), batches = wrapped_pair(arch, "eager", "fused")
    want = train(eager, batches, steps=3)
    got = train(fused, batches, steps=3)
    assert fused_calls["forward"] == 3  # one fused loss a step, none from the eager model
    assert all(abs(a - b) <= 1e-4 * abs(b) for a, b in zip(got, want)), (got, want)
    for (name, a), b in zip(fused.named_parameters(), eager.parameters()):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6, msg=name)
    heads = find_head(fused), find_head(eager)
    assert torch.equal(heads[0].sampler.generator.get_state(), heads[1].sampler.generator.get_state())
    assert heads[0].config.kernels == "fused" and heads[0].exact_ids is not None


@compiled
def test_wrapped_model_with_auto_is_eager_on_the_cpu(fused_calls):
    (auto, eager), batches = wrapped_pair("llama", "auto", "eager")
    assert train(auto, batches, steps=2) == train(eager, batches, steps=2)
    assert fused_calls["forward"] == 0


@interpreted
def test_fused_head_step_is_fewer_ops_and_no_sync(monkeypatch):
    """One forward + backward of the default head's loss (the draw and the step bookkeeping included), counted
    with :mod:`test_kernels`' dispatch-mode counter: the fused path is eight Triton launches (the generator and the
    bucket draw, the loss's four (the weight gradient's long runs' chunks first) and the tail's bucket table's two)
    and fewer ATen ops than the eager path's, none of which reads back to the host."""
    launches = launched_kernels(monkeypatch)
    models, _ = wrapped_pair("llama", "eager", "fused")
    g = torch.Generator().manual_seed(0)
    hidden = torch.randn(128, 32, generator=g).requires_grad_(True)
    labels = torch.randint(2048, (128,), generator=g)
    counts = {}
    for model in models:
        head = find_head(model).train()
        for _ in range(2):  # the first call warms caches up
            launches.clear()
            hidden.grad = head.weight.grad = None
            with OpCounter() as counter:
                head.loss(hidden, labels).backward()
        ops = counter.ops
        real = sum(n for name, n in ops.items() if name not in _FREE)
        syncs = sum(ops[name] for name in ("_local_scalar_dense", "nonzero", "item"))
        counts[head.config.kernels] = (sum(ops.values()), real, len(launches), syncs)
    print(f"\nhead.loss forward + backward, T = 128, V = 2,048, M = {M}, H = {H}: (ATen ops, of which neither views "
          f"nor allocations, Triton launches, sync ops): {counts}")
    (_, eager_real, eager_launches, eager_syncs), (_, fused_real, fused_launches, fused_syncs) = counts.values()
    assert (eager_launches, fused_launches, eager_syncs, fused_syncs) == (0, 8, 0, 0)
    assert fused_real + fused_launches < eager_real


class NewTensorsOfShape(TorchDispatchMode):
    """The ops that create a new tensor of a given shape (not a view, nor an in-place or out= write), by name."""

    def __init__(self, shape):
        super().__init__()
        self.shape, self.ops = tuple(shape), []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        schema = func._schema
        writes = any(a.alias_info is not None for a in schema.arguments) or schema.name.startswith("hf_midx::")
        if not writes and not func.is_view and any(
            isinstance(x, torch.Tensor) and tuple(x.shape) == self.shape for x in torch.utils._pytree.tree_leaves(out)
        ):
            self.ops.append(schema.name.split("::")[-1])
        return out


@interpreted
def test_default_fused_step_makes_one_tensor_the_size_of_the_weight():
    """The default head (the expected tail gradient), fused, bf16: the weight's gradient is written by one kernel,
    the tail's spread included, so that one op of the step creates a new (V, D) tensor (its buffer); before issue
    45 a spread of the table's gradient and autograd's add of the two gradients made two more."""
    head, step = _default_head_step(128, 8192, 64, torch.bfloat16, kernels="fused", codebook_size=INTERPRETED_K)
    with NewTensorsOfShape(head.weight.shape) as new:
        step()
    assert head.weight.grad is not None and head.weight.grad.abs().sum() > 0
    assert new.ops == ["empty_like"], new.ops


@interpreted
def test_a_frozen_fused_step_launches_no_weight_gradient_and_makes_no_weight_sized_tensor(monkeypatch):
    """The default head, fused, with its weight frozen (LoRA): the weight-gradient kernel never launches (the draw's
    two launches, the loss's two, not three, and the bucket table's two) and no op creates a (V, D) tensor; the
    hidden states still get their gradient."""
    head, step = _default_head_step(128, 8192, 64, torch.bfloat16, kernels="fused", codebook_size=INTERPRETED_K)
    head.weight.requires_grad_(False)
    step()
    launches = launched_kernels(monkeypatch)
    with NewTensorsOfShape(head.weight.shape) as new:
        step()
    assert head.weight.grad is None and new.ops == [], new.ops
    draw = ["counter_rand_kernel", "midx_draw_kernel"]
    table = ["bucket_partials_kernel", "bucket_sums_kernel"]  # the expected tail's hidden gradient reads it
    assert launches == [*draw, "candidate_forward_kernel", *table, "candidate_grad_hidden_kernel"], launches


@interpreted
def test_default_fused_step_traces_as_one_graph():
    """The default head's fused step, the proposal's factors passed into the kernels' autograd Function and the
    table's gradient out of it: one graph, 0 graph breaks, and the fullgraph-compiled step trains the weight."""
    head, _ = _default_head_step(64, 2048, 32, torch.bfloat16, kernels="fused", codebook_size=INTERPRETED_K)
    hidden = torch.randn(64, 32, dtype=torch.bfloat16).requires_grad_()
    labels = torch.randint(2048, (64,))
    torch._dynamo.reset()
    explained = torch._dynamo.explain(lambda h, y: head.loss(h, y))(hidden, labels)
    assert (explained.graph_count, explained.graph_break_count) == (1, 0), explained.break_reasons
    torch._dynamo.reset()
    compiled = torch.compile(lambda h, y: head.loss(h, y), fullgraph=True, backend="aot_eager")
    head.weight.grad = None
    compiled(hidden, labels).backward()
    assert torch.isfinite(head.weight.grad).all() and head.weight.grad.abs().sum() > 0


@interpreted
def test_fused_path_traces_as_one_graph_and_compiles_to_the_same_loss():
    """The launches are torch.library custom ops: torch.compile(fullgraph=True) traces the fused path (forward and
    backward) with 0 graph breaks, and the compiled step gives the eager fused step's loss and gradients."""
    case = make_case(64, 500, 16, 5, 8, seed=7)

    def loss(hidden, weight, bias):
        return candidate_loss(hidden, weight, case.labels, case.ids, case.log_q, case.log_q_pos, bias=bias,
                              head_ids=case.head, backend="fused")

    torch._dynamo.reset()
    explained = torch._dynamo.explain(loss)(case.hidden, case.weight, case.bias)
    assert (explained.graph_count, explained.graph_break_count) == (1, 0), explained.break_reasons
    torch._dynamo.reset()
    compiled = torch.compile(loss, fullgraph=True, backend="aot_eager")
    got = run(lambda c: compiled(c.hidden, c.weight, c.bias), case)
    for a, b in zip(got, run(lambda c: loss(c.hidden, c.weight, c.bias), case)):
        torch.testing.assert_close(a, b)


@interpreted
def test_fused_head_step_is_one_capturable_graph():
    """The default head with the fused kernels (custom ops) under torch.compile(fullgraph=True): one graph over
    6 steps, the eager fused step's losses (to rounding: other block sizes), its state at static addresses."""
    mutated = check_head_step_is_one_capturable_graph("fused", num_classes=V, dim=D, tokens=16, exact=False,
                                                      codebook_size=INTERPRETED_K)
    # The centered last stage's running mean of the queries (issue 73) is state added to in place, as the counts are.
    want = {"_state", "_counts", "_flags", "_query_sum", "_query_count"}
    assert {name.rsplit(".", 1)[-1] for name in mutated} == want, mutated


@interpreted
def test_fused_step_with_dynamic_tokens_is_one_graph():
    """Issue 74 (3): the default head's fused step (draw, candidate loss, bucket table: custom ops with fake
    versions) with T marked dynamic compiles one graph for 3 token counts (the draw's and the loss's tiles once
    depended on T: a ConstraintViolationError), each compiled loss and weight gradient the eager fused step's."""
    # V = 512: the traced step launches the GPU's tiles, which the interpreter runs one small program at a time.
    head, _ = _default_head_step(16, 512, D, torch.bfloat16, kernels="fused", codebook_size=INTERPRETED_K)
    counter = GraphCounter()
    compiled = torch.compile(lambda h, y: head.loss(h, y), fullgraph=True, backend=counter)
    g = torch.Generator().manual_seed(1)
    for t in (24, 40, 56):
        hidden = torch.randn(t, D, generator=g, dtype=torch.bfloat16, requires_grad=True)
        labels = torch.randint(512, (t,), generator=g)
        torch._dynamo.mark_dynamic(hidden, 0)
        torch._dynamo.mark_dynamic(labels, 0)
        start = head.sampler.generator.get_state()
        results = []
        for step in (compiled, lambda h, y: head.loss(h, y)):
            head.sampler.generator.set_state(start)
            head.weight.grad = None
            loss = step(hidden, labels)
            loss.backward()
            results.append((loss.detach(), head.weight.grad))
        for a, b in zip(*results):
            torch.testing.assert_close(a, b, rtol=1e-2, atol=1e-5)  # other tiles traced than eager: other sums
    assert counter.graphs == 1


# ------------------------------------------------------------------------------------------ validation
@compiled
def test_config_field_validation_and_json(tmp_path):
    assert MidxConfig().kernels == "auto"
    for kernels in ("eager", "fused", "auto"):
        config = MidxConfig(kernels=kernels)
        config.save_pretrained(tmp_path / kernels)
        assert MidxConfig.from_pretrained(tmp_path / kernels) == config
    with pytest.raises(ValueError, match=r"kernels must be one of \('auto', 'fused', 'eager'\), got 'triton'"):
        MidxConfig(kernels="triton")
    with pytest.raises(ValueError, match="kernels='fused' computes per-query negatives only.*kernels='auto'"):
        MidxConfig(kernels="fused", negatives="shared")
    with pytest.raises(ValueError, match="kernels='fused'"):
        MidxConfig(kernels="fused").replace(negatives="shared")
    assert MidxConfig(kernels="auto", negatives="shared").kernels == "auto"  # eager for shared negatives
    # A midx_config.json written before the field existed loads with the default.
    data = MidxConfig().to_dict()
    del data["kernels"]
    (tmp_path / "old").mkdir()
    (tmp_path / "old" / CONFIG_NAME).write_text(json.dumps(data))
    assert MidxConfig.from_pretrained(tmp_path / "old").kernels == "auto"


@compiled
def test_loss_validation_draws_nothing_when_it_refuses(monkeypatch):
    p = problem(seed=4)
    start = p.sampler.generator.get_state()
    args = (p.hidden, p.weight, p.labels, p.sampler, M)
    with pytest.raises(ValueError, match="kernels must be one of"):
        sampled_softmax_loss(*args, exact_ids=p.sampler.excluded, kernels="triton")
    with pytest.raises(ValueError, match="per-query negatives only"):
        sampled_softmax_loss(*args, exact_ids=p.sampler.excluded, negatives="shared", kernels="fused")
    monkeypatch.setattr(hf_midx.losses.kernels, "triton_available", lambda: False)
    with pytest.raises(ValueError, match="needs Triton.*kernels='auto' or 'eager'"):
        sampled_softmax_loss(*args, exact_ids=p.sampler.excluded, kernels="fused")
    assert torch.equal(p.sampler.generator.get_state(), start)


@compiled
@needs_triton
def test_fused_on_cpu_tensors_outside_the_interpreter_fails_at_the_first_step():
    """wrap accepts kernels='fused' (the model may move to a GPU later); the first sampled step on the CPU says
    what to do."""
    (model, _), batches = wrapped_pair("llama", "fused", "eager")
    model.train()
    with pytest.raises(ValueError, match="CUDA tensors.*TRITON_INTERPRET=1.*kernels='auto' or 'eager'"):
        model(input_ids=batches[0], labels=batches[0])
