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
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

from _models import tiny_model
import hf_midx
from hf_midx import MidxConfig, MidxLMHead, build_sampler, sampled_softmax_loss
from hf_midx.integration.head import find_head
from hf_midx.integration.step_data import StepData

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
        dict(sampler="midx-rq", exact_head=0, mix_weight=0.0, last_stage="centered"),
    ],
    ids=["midx-rq", "midx-rq-shared", "midx-pq-corrected", "unigram", "exact-head-frequency", "exact-head-shared",
         "expected-tail", "expected-tail-frequency", "centered"],
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


class DevicelessFactories(TorchFunctionMode):
    """Records the factory calls (``torch.zeros``, ``arange``, ``tensor``, ...) made without a device: on a GPU
    they make CPU tensors, and Inductor does not capture a CUDA graph with CPU tensors in it."""

    FACTORIES = (torch.tensor, torch.as_tensor, torch.zeros, torch.ones, torch.empty, torch.full, torch.arange,
                 torch.linspace, torch.eye, torch.scalar_tensor, torch.rand, torch.randn, torch.randint)

    def __init__(self):
        super().__init__()
        self.calls: list[str] = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in self.FACTORIES and kwargs.get("device") is None:
            self.calls.append(func.__name__)
        return func(*args, **kwargs)


class GraphRecorder:
    """A ``torch.compile`` backend (``aot_eager``'s ATen graphs) that keeps, for each graph it compiles, the inputs
    its forward mutates and whether each is a static address: CUDA graph trees (``mode="reduce-overhead"``)
    replay a graph that mutates only static inputs (parameters, buffers, ``mark_static_address``), and skip
    the capture of one that mutates another. The flags are AOTAutograd's, the ones Inductor's check reads."""

    #: The flags are private to torch (placeholders' ``_dynamo_source``, ``ViewAndMutationMeta``'s
    #: ``static_input_indices``): read as here on torch 2.13 and later. On 2.7 the placeholders carry no source
    #: and the static inputs are numbered otherwise, so the check skips there (releases between: not run).
    SINCE_TORCH = (2, 13)

    def __init__(self):
        if tuple(int(p) for p in torch.__version__.split("+")[0].split(".")[:2]) < self.SINCE_TORCH:
            pytest.skip(f"reads AOTAutograd's private metadata as torch >= 2.13 has it; torch {torch.__version__}")
        self.graphs: list[dict[str, bool]] = []  # per compiled graph: {mutated input's source: static}

    def __call__(self, gm, example_inputs):
        from functorch.compile import make_boxed_func
        from torch._dynamo.backends.common import aot_autograd

        names = [n._dynamo_source.name for n in gm.graph.find_nodes(op="placeholder")]

        def forward(fx, inputs):
            meta = torch._guards.TracingContext.get().fw_metadata
            lifted = len(meta.input_info) - len(names)  # parameters AOTAutograd lifted ahead of Dynamo's inputs
            self.graphs.append({
                names[i - lifted] if i >= lifted else f"lifted {i}": i in meta.static_input_indices
                for i, info in enumerate(meta.input_info) if info.mutates_data or info.mutates_metadata
            })
            return make_boxed_func(fx)

        return aot_autograd(fw_compiler=forward, bw_compiler=lambda fx, _: make_boxed_func(fx))(gm, example_inputs)


def check_head_step_is_one_capturable_graph(kernels="auto", num_classes=2000, dim=32, tokens=48, steps=6, exact=True,
                                            **config):
    """The default head's step (bf16 weight) under ``torch.compile(fullgraph=True)``, ``steps`` times: one graph
    from the first call on (no recompile; fullgraph turns a graph break into an error), the eager step's
    losses and gradients bit for bit from the same generator state, the per-step state (the generator's
    counter, the step data's call counts) advanced in place at static addresses, and neither a host sync nor
    a device-less factory call in the step. Returns the mutated inputs.
    ``exact=False``: losses and gradients close, not equal (the interpreted fused kernels pick smaller blocks
    in eager mode than while traced, and so sum in another order). ``config``: other ``MidxConfig`` fields."""
    torch._dynamo.reset()
    g = torch.Generator().manual_seed(0)
    counts = torch.randint(1, 1000, (num_classes,), generator=g).double()
    linear = torch.nn.Linear(dim, num_classes, bias=False).to(torch.bfloat16)
    head = MidxLMHead(linear, MidxConfig(kernels=kernels, **config), class_counts=counts)
    assert head.exact_ids is not None and head.config.tail_gradient == "auto"  # the default head, in full
    hidden = torch.randn(tokens, dim, generator=g, dtype=torch.bfloat16, requires_grad=True)
    labels = torch.multinomial(counts.float(), tokens, replacement=True, generator=g)
    labels[::9] = -100
    recorder = GraphRecorder()
    compiled = torch.compile(lambda h, y: head.loss(h, y), fullgraph=True, backend=recorder)
    with DevicelessFactories() as factories, SyncCounter() as syncs:  # an eager step: what a capture forbids
        head.loss(hidden, labels).backward()
    assert not factories.calls and not syncs.counts, (factories.calls, dict(syncs.counts))
    start = head.sampler.generator.get_state()
    state = (head.sampler.generator._state, head.step_data._counts, head.step_data._flags)
    runs = []
    for step in (lambda h, y: head.loss(h, y), compiled):
        head.sampler.generator.set_state(start)
        head.step_data.clear()
        results = []
        for _ in range(steps):
            hidden.grad = head.weight.grad = None
            loss = step(hidden, labels)
            loss.backward()
            results.append((loss.detach(), hidden.grad, head.weight.grad))
        runs.append(results)
        assert head.sampled_calls == steps and head.last_queries is not None
    assert len(recorder.graphs) == 1, f"{len(recorder.graphs)} graphs compiled over {steps} steps"
    for want, got in zip(*runs):
        assert torch.isfinite(got[0])
        for a, b in zip(got, want):
            if exact:
                assert torch.equal(a, b)
            else:
                torch.testing.assert_close(a, b, rtol=1e-2, atol=1e-5)
    assert len({float(loss) for loss, *_ in runs[1]}) > 1  # the draws moved on from step to step
    # The state tensors are the ones made at construction, advanced in place; each mutated input is static.
    assert (head.sampler.generator._state, head.step_data._counts, head.step_data._flags) == state
    mutated = recorder.graphs[0]
    assert mutated and all(mutated.values()), mutated
    return mutated


def test_default_head_step_is_one_capturable_graph():
    """Issue 45 (4): the first call's lazily made step data compiled a second graph; now they are made with the
    head. The CPU default (eager kernels, expected tail gradient); test_fused_head runs the fused kernels."""
    mutated = check_head_step_is_one_capturable_graph()
    # The centered last stage's running mean of the queries (issue 73) is state added to in place, as the counts are.
    want = {"_state", "_counts", "_flags", "_query_sum", "_query_count"}
    assert {name.rsplit(".", 1)[-1] for name in mutated} == want, mutated


def test_a_functional_loss_advances_a_static_generator():
    """Outside a module (``sampled_softmax_loss`` with a sampler of one's own) Dynamo marks nothing static by
    itself: the generator marks its counter, so a CUDA graph of such a step still replays its draws."""
    torch._dynamo.reset()
    g = torch.Generator().manual_seed(0)
    weight = torch.randn(300, 16, generator=g, requires_grad=True)
    hidden = torch.randn(24, 16, generator=g, requires_grad=True)
    labels = torch.randint(300, (24,), generator=g)
    sampler = build_sampler("midx-rq", weight.detach(), codebook_size=8, mix_weight=0.0)
    recorder = GraphRecorder()

    def loss_fn(h, w, y):
        return sampled_softmax_loss(h, w, y, sampler, 8, check_labels=False)

    for _ in range(3):
        torch.compile(loss_fn, fullgraph=True, backend=recorder)(hidden, weight, labels).backward()
    assert len(recorder.graphs) == 1 and list(recorder.graphs[0].values()) == [True], recorder.graphs


def test_step_data_resets_in_place_and_follows_the_head():
    """clear() zeroes the call counts where they are (a captured step keeps their address); a call on another
    device (the head moved: "meta" stands in for the GPU) or clear(device) moves them there."""
    data = StepData(4, "cpu")
    counts = data._counts
    h, y = torch.randn(6, 3), torch.arange(6)
    data.record(h, y, -100, torch.tensor(float("nan")))
    data.record(h, y, -100, torch.tensor(1.0))
    assert data.calls == 2 and data.first_nonfinite_call() == (0, "loss")
    data.clear()
    assert data._counts is counts and data.calls == 0 and data.first_nonfinite_call() is None
    data.record(h.to("meta"), y.to("meta"), -100, torch.tensor(1.0, device="meta"))
    assert data._counts.device.type == data.call_counter.device.type == "meta"
    data.clear("cpu")
    assert data._counts.device.type == "cpu" and data.calls == 0


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


class GraphCounter:
    """A ``torch.compile`` backend that runs each graph as traced and counts the graphs it was given."""

    def __init__(self):
        self.graphs = 0

    def __call__(self, gm, example_inputs):
        self.graphs += 1
        return gm.forward


def _graphs_over_lengths(model, lengths, vocab):
    """Graphs a compiled ``model`` makes over training steps of ``lengths`` tokens a row, and the graph breaks."""
    torch._dynamo.reset()
    counters = torch._dynamo.utils.counters
    counters.clear()
    counter = GraphCounter()
    compiled = torch.compile(model, backend=counter)
    g = torch.Generator().manual_seed(3)
    for seq in lengths:
        ids = torch.randint(vocab, (2, seq), generator=g)
        loss = compiled(input_ids=ids, labels=ids).loss
        assert torch.isfinite(loss)
        loss.backward()
    return counter.graphs, sum(counters["graph_break"].values())


def test_wrapped_model_compiles_no_more_graphs_over_lengths_than_the_plain_model():
    """Issue 74 (3): over 5 sequence lengths torch.compile makes one graph, then one with the length symbolic
    (automatic dynamic shapes); the wrapped model's loss made one graph per length (a Python loop over the symbolic T
    in the candidate logits' backward specialized it), up to torch's recompile limit. Now no more graphs than the
    plain model's plus one, and no graph break."""
    vocab, lengths = 256, (8, 12, 16, 20, 24)
    plain = _graphs_over_lengths(tiny_model("llama", vocab).train(), lengths, vocab)
    model = tiny_model("llama", vocab)
    hf_midx.wrap(model, num_samples=16, codebook_size=8, exact_head=32, class_counts=torch.arange(vocab) + 1.0)
    wrapped = _graphs_over_lengths(model.train(), lengths, vocab)
    assert plain[1] == wrapped[1] == 0, (plain, wrapped)
    assert wrapped[0] <= plain[0] + 1 and plain[0] < len(lengths), (plain, wrapped)


@pytest.mark.parametrize("exact", [False, True], ids=["sampled", "exact"])
def test_head_loss_with_dynamic_tokens_is_one_graph_and_the_eager_loss(exact):
    """T marked dynamic (``torch._dynamo.mark_dynamic``): one graph serves 3 token counts, with no
    ConstraintViolationError (nothing specializes T to a Python int), and each compiled loss is the eager one from
    the same generator state. ``exact``: the full softmax (evaluation), whose label check no longer reads the host."""
    torch._dynamo.reset()
    g = torch.Generator().manual_seed(0)
    counts = torch.randint(1, 1000, (500,), generator=g).double()
    head = MidxLMHead(torch.nn.Linear(16, 500, bias=False), MidxConfig(codebook_size=8), class_counts=counts)
    head.loss(torch.randn(8, 16), torch.randint(500, (8,)))  # the first call's kernel choice, eagerly (as training)
    counter = GraphCounter()
    compiled = torch.compile(lambda h, y: head.loss(h, y, exact=exact), fullgraph=True, backend=counter)
    for t in (24, 40, 72):
        hidden = torch.randn(t, 16, generator=g, requires_grad=True)
        labels = torch.multinomial(counts.float(), t, replacement=True, generator=g)
        labels[::7] = -100
        torch._dynamo.mark_dynamic(hidden, 0)
        torch._dynamo.mark_dynamic(labels, 0)
        start = head.sampler.generator.get_state()
        got = compiled(hidden, labels)
        head.sampler.generator.set_state(start)
        torch.testing.assert_close(got, head.loss(hidden, labels, exact=exact))
        got.backward()
    assert counter.graphs == 1
