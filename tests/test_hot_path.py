"""The training hot path: no host synchronization and no graph break.

On CUDA a host sync stalls the launch queue; the ops that force one are the scalar reads
(``aten._local_scalar_dense``: ``.item()``, ``int(t)``, ``bool(t)``, ``if t:``) and the ops whose
output shape depends on the data (boolean-mask indexing, ``nonzero``, ``masked_select``, ``unique``,
...). A ``TorchDispatchMode`` counts them on CPU, where every op is visible the same way, in one
steady-state training forward+backward of a wrapped model and of the same model unwrapped.
"""

from __future__ import annotations

import collections

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from _models import tiny_model
import hf_midx
from hf_midx import MidxConfig, MidxLMHead, build_sampler, sampled_softmax_loss
from hf_midx.head import find_head

_SYNC_OPS = {
    "_local_scalar_dense",
    "nonzero",
    "masked_select",
    "unique",
    "_unique",
    "_unique2",
    "unique_dim",
    "unique_consecutive",
    "repeat_interleave",
    "bincount",
    "histc",
}


def _is_sync(func, args) -> bool:
    name = func._schema.name.split("::")[-1]
    if name in _SYNC_OPS:
        # repeat_interleave with output_size given knows its shape without reading the data.
        return not (name == "repeat_interleave" and func._schema.overload_name.endswith("output_size"))
    if name in ("index", "index_put", "index_put_", "_index_put_impl_"):
        # A boolean (mask) index is compacted with nonzero: its result's shape depends on the data.
        indices = args[1] if len(args) > 1 else ()
        return any(isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in indices or ())
    return False


class SyncCounter(TorchDispatchMode):
    """Counts the dispatched ops that would force a device-to-host sync on CUDA, by op name."""

    def __init__(self):
        super().__init__()
        self.counts: collections.Counter[str] = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if _is_sync(func, args):
            self.counts[str(func._schema.name)] += 1
        return func(*args, **(kwargs or {}))


def _count_step(model, batch) -> collections.Counter:
    """Sync-forcing ops in one training forward+backward, after a warm-up step."""
    model.train()
    for _ in range(2):  # the first call may build caches (rotary tables, masks): not steady state
        model.zero_grad(set_to_none=True)
        with SyncCounter() as counter:
            model(input_ids=batch, labels=batch).loss.backward()
    return counter.counts


@pytest.mark.parametrize("model_type", ["llama", "gpt2"])
@pytest.mark.parametrize(
    "options",
    [
        dict(sampler="midx-rq"),
        dict(sampler="midx-rq", negatives="shared", num_samples=64),
        dict(sampler="midx-pq", estimator="corrected-positive"),
        dict(sampler="unigram"),
        dict(sampler="midx-rq", exact_head=64, last_stage="frequency"),
        dict(sampler="midx-rq", negatives="shared", num_samples=64, exact_head=64),
        dict(sampler="midx-rq", exact_head=64, tail_gradient="expected"),
        dict(sampler="midx-rq", exact_head=64, last_stage="frequency", tail_gradient="expected"),
    ],
    ids=["midx-rq", "midx-rq-shared", "midx-pq-corrected", "unigram", "exact-head-frequency", "exact-head-shared",
         "expected-tail", "expected-tail-frequency"],
)
def test_sampled_training_step_adds_no_host_sync(model_type, options):
    base = tiny_model(model_type)
    vocab = base.config.vocab_size
    batch = torch.randint(vocab, (2, 16), generator=torch.Generator().manual_seed(0))
    batch[1, 12:] = 5  # a second sequence with repeated tokens: padding-like content
    plain = _count_step(base, batch)

    model = tiny_model(model_type)
    counts = torch.bincount(batch.flatten(), minlength=vocab).float() + 1.0
    hf_midx.wrap(model, MidxConfig(codebook_size=8, **{"num_samples": 16, **options}), class_counts=counts)
    wrapped = _count_step(model, batch)
    assert find_head(model).sampled_calls == 2, "the steps did not go through the sampled loss"
    extra = wrapped - plain
    assert not extra, f"the MIDX head added host-sync ops to a training step: {dict(extra)} (model alone: {dict(plain)})"


def test_loss_with_ignored_tokens_adds_no_host_sync():
    """Masked (ignored) labels are handled by masking, not by compaction."""
    g = torch.Generator().manual_seed(0)
    weight = torch.randn(300, 16, generator=g, requires_grad=True)
    hidden = torch.randn(40, 16, generator=g, requires_grad=True)
    labels = torch.randint(300, (40,), generator=g)
    labels[::3] = -100
    sampler = build_sampler("midx-rq", weight.detach(), codebook_size=8)
    for negatives in ("per-query", "shared"):
        sampled_softmax_loss(hidden, weight, labels, sampler, 8, negatives=negatives, check_labels=False).backward()
        with SyncCounter() as counter:
            loss = sampled_softmax_loss(hidden, weight, labels, sampler, 8, negatives=negatives, check_labels=False)
            loss.backward()
        assert not counter.counts, (negatives, dict(counter.counts))


def test_counter_sees_the_syncs_it_looks_for():
    """The counter is not blind: .item(), a boolean mask and nonzero are each counted."""
    x = torch.arange(6.0)
    with SyncCounter() as counter:
        _ = x.sum().item()
        _ = x[x > 2]
        _ = torch.nonzero(x)
        _ = x[torch.tensor([0, 1])]  # an integer index is not a sync
    assert sum(counter.counts.values()) == 3, dict(counter.counts)


@pytest.mark.parametrize("negatives", ["per-query", "shared"])
def test_sampled_loss_compiles_without_graph_break(negatives):
    """The sampled head's forward (draws included) traces as one graph; AOTAutograd derives its backward.

    fullgraph=True turns any graph break into an error. The compiled step gives the eager step's loss
    and gradients from the same generator state, and the device-side generator advances in both.
    """
    torch._dynamo.reset()
    g = torch.Generator().manual_seed(0)
    weight = torch.randn(300, 16, generator=g, requires_grad=True)
    hidden = torch.randn(24, 16, generator=g, requires_grad=True)
    labels = torch.randint(300, (24,), generator=g)
    labels[::5] = -100
    sampler = build_sampler("midx-rq", weight.detach(), codebook_size=8)

    def loss_fn(h, w, y):
        return sampled_softmax_loss(h, w, y, sampler, 8, negatives=negatives, check_labels=False)

    compiled = torch.compile(loss_fn, fullgraph=True, backend="aot_eager")
    start = sampler.generator.get_state()
    results = []
    for fn in (loss_fn, compiled):
        sampler.generator.set_state(start)
        hidden.grad = weight.grad = None
        loss = fn(hidden, weight, labels)
        loss.backward()
        results.append((loss.detach(), hidden.grad.clone(), weight.grad.clone(), sampler.generator.get_state()))
    (eager, gh, gw, state_e), (comp, gh_c, gw_c, state_c) = results
    assert torch.isfinite(comp) and float(gw_c.abs().sum()) > 0
    torch.testing.assert_close(comp, eager)
    torch.testing.assert_close(gh_c, gh)
    torch.testing.assert_close(gw_c, gw)
    assert torch.equal(state_c, state_e) and not torch.equal(state_c, start)


def test_head_loss_compiles_and_stops_recompiling():
    """``MidxLMHead.loss`` (sampler, estimator, step data) under fullgraph compile.

    Its per-call bookkeeping lives in device tensors: after the first call (which creates them) no
    guard changes, so five calls fit in two compiled versions.
    """
    torch._dynamo.reset()
    torch.manual_seed(0)
    weight = torch.nn.Parameter(torch.randn(300, 16))
    linear = torch.nn.Linear(16, 300, bias=False)
    linear.weight = weight
    counts = torch.arange(300, 0, -1).float()
    config = MidxConfig(codebook_size=8, num_samples=8, exact_head=16)
    head = MidxLMHead(linear, config, class_counts=counts)
    hidden = torch.randn(24, 16, requires_grad=True)
    labels = torch.randint(300, (24,))
    labels[::7] = -100
    step = torch.compile(lambda h, y: head.loss(h, y), fullgraph=True, backend="aot_eager")
    with torch._dynamo.config.patch(recompile_limit=2):
        for _ in range(5):
            loss = step(hidden, labels)
            loss.backward()
    assert torch.isfinite(loss) and head.sampled_calls == 5
    assert head.last_queries is not None and head.last_queries.shape == (min(config.kl_queries, 24), 16)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (CPU has no device-to-host syncs to catch)")
@pytest.mark.parametrize("negatives", ["per-query", "shared"])
def test_cuda_training_step_makes_no_sync(negatives):
    """On a GPU, torch's sync debug mode turns any synchronizing call of the sampled step into an error."""
    model = tiny_model("llama").cuda()
    vocab = model.config.vocab_size
    batch = torch.randint(vocab, (2, 16), generator=torch.Generator().manual_seed(0)).cuda()
    counts = torch.bincount(batch.flatten().cpu(), minlength=vocab).float() + 1.0
    config = MidxConfig(codebook_size=8, num_samples=16 if negatives == "per-query" else 64, negatives=negatives,
                        exact_head=32)
    hf_midx.wrap(model, config, class_counts=counts)
    model.train()
    model(input_ids=batch, labels=batch).loss.backward()  # warm-up: caches, first-call state
    torch.cuda.synchronize()
    head = find_head(model)
    # The model's own forward may sync (e.g. mask construction); only the head's loss is checked here.
    hidden = torch.randn(32, model.config.hidden_size, device="cuda", requires_grad=True)
    labels = batch.flatten()
    torch.cuda.set_sync_debug_mode("error")
    try:
        head.loss(hidden, labels).backward()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    torch.cuda.synchronize()


class _ScanCounter(TorchDispatchMode):
    """Counts finiteness scans of tensors of one shape: a full reduction (``x.sum()``, whose finiteness
    is tested, or ``isfinite(x).all()``) of a tensor of that shape."""

    def __init__(self, shape):
        super().__init__()
        self.shape, self.scans = tuple(shape), 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        full = func._schema.name == "aten::all" or (func._schema.name == "aten::sum" and func._overloadname == "default")
        if full and tuple(args[0].shape) == self.shape:
            self.scans += 1
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("name", ["midx-rq", "midx-pq"])
def test_a_refresh_scans_the_weight_for_nan_once(name):
    """Validation at the entry point only: the index and k-means inside trust the sampler's check."""
    weight = torch.randn(500, 16, generator=torch.Generator().manual_seed(0))
    sampler = build_sampler(name, weight, codebook_size=8, kmeans_iters=2)
    with _ScanCounter(weight.shape) as counter:
        sampler.refresh(weight + 0.01)
    assert counter.scans == 1
    with pytest.raises(ValueError, match="NaN or Inf"):
        sampler.refresh(torch.full_like(weight, float("nan")))


def test_sampled_loss_with_default_arguments_compiles_fullgraph():
    """A user's own compiled loss: the public function with its defaults (labels checked) has no graph
    break, because under compilation the label check runs on the device."""
    torch._dynamo.reset()
    g = torch.Generator().manual_seed(1)
    weight = torch.randn(200, 8, generator=g, requires_grad=True)
    hidden = torch.randn(10, 8, generator=g, requires_grad=True)
    labels = torch.randint(200, (10,), generator=g)
    sampler = build_sampler("midx-rq", weight.detach(), codebook_size=4)

    def loss_fn(h, w, y):
        return sampled_softmax_loss(h, w, y, sampler, 5)

    loss = torch.compile(loss_fn, fullgraph=True, backend="aot_eager")(hidden, weight, labels)
    loss.backward()
    assert torch.isfinite(loss) and float(weight.grad.abs().sum()) > 0
    with pytest.raises(ValueError, match="outside"):
        loss_fn(hidden, weight, labels + 200)  # eager calls keep the ValueError
