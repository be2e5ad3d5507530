"""The expected tail gradient (hf_midx.losses.tail_gradient): the proposal's closed form against a dense reference, an
unchanged loss value, an unbiased and lower-variance gradient, the exact tail gradient where Q is the softmax,
and every tail row moving at every step."""

from __future__ import annotations

import contextlib
import math

import pytest
import torch

from hf_midx import MidxConfig, build_sampler, full_softmax_loss, sampled_softmax_loss
from hf_midx.integration.head import MidxLMHead
from hf_midx.rng import CounterRNG
from hf_midx.losses.tail_gradient import bucket_table, expected_logit, expected_share, spread

V, D, T = 1500, 12, 24


def _setup(seed=0, dtype=torch.float64, scale=0.6):
    g = torch.Generator().manual_seed(seed)
    weight = (torch.randn(V, D, generator=g) * scale).to(dtype)
    bias = (torch.randn(V, generator=g) * 0.2).to(dtype)
    counts = torch.randint(0, 50, (V,), generator=g)
    return weight, bias, counts


@pytest.mark.parametrize(
    "name, options",
    [
        ("midx-rq", {}),
        ("midx-rq", {"last_stage": "frequency"}),
        ("midx-pq", {"mix_weight": 0.0}),
        ("midx-rq", {"mix_static": "uniform"}),
        ("unigram", {}),
        ("uniform", {}),
    ],
)
@pytest.mark.parametrize("exclude", [False, True])
def test_expected_logit_and_its_gradients_match_the_dense_proposal(name, options, exclude):
    weight, bias, counts = _setup()
    excluded = torch.arange(100, 250) if exclude else None
    sampler = build_sampler(name, weight.float(), class_counts=counts, exclude=excluded, codebook_size=8, **options)
    h = torch.randn(T, D, dtype=torch.float64)
    grad_out = torch.randn(T, dtype=torch.float64)

    factors = sampler.proposal_factors(h.float())
    leaves = [x.clone().requires_grad_() for x in (h, weight, bias)]
    value = expected_logit(factors, *leaves)
    # expected_share's gradient is that of sum_t share_t E_Q[o_t]: with share = grad_out, of the same sum.
    expected_share(torch.zeros(T, dtype=torch.float64), grad_out, factors, *leaves).sum().backward()

    q = sampler.full_log_prob(h.float()).exp().double()  # (T, V): the reference, O(T V)
    if exclude:
        assert float(q[:, excluded].sum()) == 0.0
    ref_leaves = [x.clone().requires_grad_() for x in (h, weight, bias)]
    ref = (q * (ref_leaves[0] @ ref_leaves[1].t() + ref_leaves[2])).sum(1)
    (ref * grad_out).sum().backward()
    torch.testing.assert_close(value.double(), ref.detach(), rtol=1e-5, atol=1e-5)
    for got, want in zip(leaves, ref_leaves):
        torch.testing.assert_close(got.grad, want.grad, rtol=1e-5, atol=1e-6)


def test_samplers_without_a_closed_form_keep_the_sampled_gradient():
    weight, _, counts = _setup(dtype=torch.float32)
    for name in ("midx-exact", "lsh"):
        sampler = build_sampler(name, weight, class_counts=counts)
        assert sampler.proposal_factors(torch.randn(3, D)) is None


def _loss(sampler, h, weight, y, tail, seed, **kw):
    return sampled_softmax_loss(h, weight, y, sampler, 8, generator=CounterRNG(seed), tail_gradient=tail,
                                exact_ids=sampler.excluded, **kw)


def test_the_value_is_unchanged_and_only_the_gradient_moves():
    weight, bias, counts = _setup(dtype=torch.float32)
    sampler = build_sampler("midx-rq", weight, class_counts=counts, codebook_size=8, exclude=torch.arange(64))
    h = torch.randn(T, D)
    y = torch.randint(0, V, (T,))
    grads = {}
    for tail in ("expected", "sampled"):
        w = weight.clone().requires_grad_()
        loss = _loss(sampler, h, w, y, tail, 3, bias=bias)
        loss.backward()
        grads[tail] = (loss.item(), w.grad)
    assert grads["expected"][0] == grads["sampled"][0]
    moved = lambda g: int((g.abs().sum(1) > 0).sum())
    assert moved(grads["sampled"][1]) < V // 2
    assert moved(grads["expected"][1]) == V  # every row, the exact head's included


def test_with_the_labels_in_the_head_and_a_flat_tail_the_tail_gradient_is_the_full_softmax_one():
    # Tail rows of zeros: every tail logit is 0, so the uniform proposal is the tail's softmax and the draws'
    # deviation from their expectation vanishes: each tail row gets exactly the full softmax's gradient.
    torch.manual_seed(0)  # seeded: the data used to come from whatever test ran before it on the worker
    head = torch.arange(50)
    weight = torch.zeros(V, D, dtype=torch.float64)
    weight[head] = torch.randn(50, D, dtype=torch.float64)
    sampler = build_sampler("uniform", weight.float(), exclude=head)
    h = torch.randn(T, D, dtype=torch.float64)
    y = torch.randint(0, 50, (T,))
    w = weight.clone().requires_grad_()
    _loss(sampler, h, w, y, "expected", 0).backward()
    w_full = weight.clone().requires_grad_()
    full_softmax_loss(h, w_full, y).backward()
    # The float32 proposal: about 1e-9 absolute where a tail entry (typically 3e-5) is a sum that cancels; over 40
    # seeds atol=1e-10 failed once (4.2e-10 in CI), 1e-8 is still 1,000x under an entry and 100x under the sampled
    # gradient's distance below.
    torch.testing.assert_close(w.grad[50:], w_full.grad[50:], rtol=2e-3, atol=1e-8)
    w_sampled = weight.clone().requires_grad_()
    _loss(sampler, h, w_sampled, y, "sampled", 0).backward()
    assert not torch.allclose(w_sampled.grad[50:], w_full.grad[50:], atol=1e-6)


def test_the_expected_tail_gradient_is_unbiased_and_less_noisy():
    # Over independent draws, both gradients estimate the same expectation (a two-sample z-test per projection,
    # alpha 1e-4 overall), and the expected one varies less on the tail rows where Q is near the tail's softmax
    # (small logits, as early in training).
    weight, _, counts = _setup(seed=1, dtype=torch.float32, scale=0.15)
    sampler = build_sampler("midx-rq", weight, class_counts=counts, codebook_size=8, exclude=torch.arange(100))
    h = torch.randn(T, D)
    y = torch.randint(0, V, (T,))
    directions = torch.randn(4, V, D, generator=torch.Generator().manual_seed(5))
    draws = {"expected": [], "sampled": []}
    moments = {"expected": [0.0, 0.0], "sampled": [0.0, 0.0]}
    for seed in range(300):
        for tail, out in draws.items():
            w = weight.clone().requires_grad_()
            _loss(sampler, h, w, y, tail, seed).backward()
            out.append((directions * w.grad).sum((1, 2)))
            g = w.grad[100:].double()
            moments[tail] = [moments[tail][0] + g, moments[tail][1] + g**2]
    e, s = (torch.stack(draws[k]).double() for k in ("expected", "sampled"))
    z = (e.mean(0) - s.mean(0)) / ((e.var(0) + s.var(0)) / e.shape[0]).sqrt()
    assert float(z.abs().max()) < 4.42, z  # two-sided 1e-4 / 4 projections
    variance = {k: float((m2 / 300 - (m1 / 300) ** 2).sum()) for k, (m1, m2) in moments.items()}
    assert variance["expected"] < 0.5 * variance["sampled"], variance  # summed over the tail rows' entries


def test_the_config_switches_it_on_for_the_head_and_auto_is_the_default():
    weight, _, counts = _setup(dtype=torch.float32)
    rows = {}
    for tail in ("auto", "expected", "sampled"):
        linear = torch.nn.Linear(D, V, bias=False)
        linear.weight.data.copy_(weight)
        head = MidxLMHead(linear, MidxConfig(tail_gradient=tail, exact_head=64, codebook_size=8), class_counts=counts)
        head.loss(torch.randn(T, D), torch.randint(0, V, (T,))).backward()
        rows[tail] = int((head.weight.grad.abs().sum(1) > 0).sum())
    assert rows["auto"] == rows["expected"] == V and rows["sampled"] < V // 2
    assert MidxConfig().tail_gradient == "auto"


def test_unknown_or_inapplicable_tail_gradient_is_refused():
    with pytest.raises(ValueError, match="tail_gradient"):
        MidxConfig(tail_gradient="dense")
    inapplicable = (dict(negatives="shared"), dict(estimator="exact-positive"), dict(remove_accidental_hits=True),
                    dict(sampler="lsh"), dict(sampler="midx-exact"))
    for changes in inapplicable:
        with pytest.raises(ValueError, match="tail_gradient='expected' needs"):
            MidxConfig(tail_gradient="expected", **changes)
        assert MidxConfig(**changes).tail_gradient == "auto"  # auto: the sampled one there, no error
    assert MidxConfig(tail_gradient="expected", estimator="exact-positive", remove_accidental_hits=False)
    weight, _, counts = _setup(dtype=torch.float32)
    sampler = build_sampler("unigram", weight, class_counts=counts)
    h, y = torch.randn(T, D), torch.randint(0, V, (T,))
    with pytest.raises(ValueError, match="tail_gradient"):
        sampled_softmax_loss(h, weight, y, sampler, 4, tail_gradient="x")
    for kw in (dict(logit_softcap=30.0), dict(negatives="shared"), dict(remove_accidental_hits=True)):
        with pytest.raises(ValueError, match="tail_gradient='expected' needs"):
            sampled_softmax_loss(h, weight, y, sampler, 4, tail_gradient="expected", **kw)
    lsh = build_sampler("lsh", weight)
    with pytest.raises(ValueError, match="LSHSampler"):
        sampled_softmax_loss(h, weight, y, lsh, 4, tail_gradient="expected")
    # "auto" where the expected tail gradient does not apply: the sampled gradient, the same draws and value.
    for sampler_, kw in ((sampler, dict(logit_softcap=30.0)), (lsh, {})):
        grads = []
        for tail in ("auto", "sampled"):
            w = weight.clone().requires_grad_()
            loss = sampled_softmax_loss(h, w, y, sampler_, 4, generator=CounterRNG(1), tail_gradient=tail, **kw)
            loss.backward()
            grads.append((float(loss), w.grad))
        assert grads[0][0] == grads[1][0]
        torch.testing.assert_close(grads[0][1], grads[1][1])


def test_no_tokens_by_vocabulary_tensor_is_made():
    # The closed form's largest temporaries are (T, K*K) and (V, D): check that none is (T, V).
    weight, _, counts = _setup(dtype=torch.float32)
    sampler = build_sampler("midx-rq", weight, class_counts=counts, codebook_size=8)
    h = torch.randn(T, D, requires_grad=True)
    shapes = []

    class Spy(torch.utils._python_dispatch.TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            if isinstance(out, torch.Tensor):
                shapes.append(tuple(out.shape))
            return out

    w = weight.clone().requires_grad_()
    with Spy():
        expected_share(torch.zeros(T), torch.ones(T), sampler.proposal_factors(h.detach()), h, w).sum().backward()
    assert not any(len(s) == 2 and s[0] == T and s[1] == V for s in shapes)
    assert math.prod(max(shapes, key=math.prod)) <= V * D


@pytest.mark.parametrize("with_bias", [False, True])
def test_the_kernels_split_gives_the_eager_gradient(with_bias):
    # candidate_loss(tail_control=True) (the fused path's form, here its eager reference) plus expected_share
    # is the eager loss with the expected tail gradient, on the same draws.
    from hf_midx.losses.kernels import candidate_loss

    weight, bias, counts = _setup(dtype=torch.float32, scale=0.3)
    bias = bias if with_bias else None
    sampler = build_sampler("midx-rq", weight, class_counts=counts, codebook_size=8, exclude=torch.arange(64))
    h = torch.randn(T, D)
    y = torch.randint(0, V, (T,))
    y[3] = -100
    grads = []
    for split in (False, True):
        leaves = [x.clone().requires_grad_() for x in (h, weight)] + ([bias.clone().requires_grad_()] if with_bias else [])
        hb, wb, bb = leaves[0], leaves[1], leaves[2] if with_bias else None
        if split:
            ids, log_q, log_q_pos = sampler.draw_scored(h, 8, y.clamp_min(0).unsqueeze(1), generator=CounterRNG(4))
            loss, share = candidate_loss(hb, wb, y, ids, log_q, log_q_pos.squeeze(1), bias=bb, head_ids=sampler.excluded,
                                         backend="eager", tail_control=True, reduction="sum")
            loss = expected_share(loss, share, sampler.proposal_factors(h), hb, wb, bb)
        else:
            loss = _loss(sampler, hb, wb, y, "expected", 4, bias=bb, reduction="sum")
        loss.backward()
        grads.append([float(loss)] + [x.grad for x in leaves])
    assert grads[0][0] == pytest.approx(grads[1][0], rel=1e-6)
    for a, b in zip(grads[0][1:], grads[1][1:]):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-6)


def _dense(factors, num_classes):
    """S as a dense (B + 1, V) float64 matrix, from the four fields the kernels read."""
    b = 0 if factors.probs is None else factors.probs.shape[1]
    s = torch.zeros(b + 1, num_classes, dtype=torch.float64)
    if b:
        s[factors.bucket, torch.arange(num_classes)] = factors.member.double()
    if factors.static is not None:
        s[b] = factors.static.double()
    return s


@pytest.mark.parametrize("num_buckets, with_static", [(7, True), (7, False), (1, True), (0, True)])
def test_the_chunked_table_and_the_spread_are_s_and_its_transpose(num_buckets, with_static):
    # Odd shapes, empty buckets, a bucket of more than CHUNK classes (cut into chunks), undrawn classes (the exact
    # head: a zero column), rows of one column (a bias): the table and the spread against S built densely.
    from hf_midx.samplers.factors import CHUNK, ProposalFactors, proposal_factors_fixed, static_factors

    v, c = 2 * CHUNK + 301, 5
    g = torch.Generator().manual_seed(0)
    static = torch.rand(v, generator=g)
    static[:37] = 0  # the exact head
    if num_buckets:
        bucket = torch.randint(0, num_buckets, (v,), generator=g)
        bucket[bucket == 3] = 2  # bucket 3 empty
        bucket[: CHUNK + 200] = 5 % num_buckets  # one bucket larger than a chunk
        member = torch.rand(v, generator=g)
        member[:37] = 0
        fixed = proposal_factors_fixed(bucket, member, static if with_static else None, num_buckets)
        factors = ProposalFactors(torch.rand(3, num_buckets, generator=g), *fixed)
        n = num_buckets + v // CHUNK
        assert factors.layout.chunk_ids.shape == (n,)  # a function of (V, B): the same at every refresh
        index, offsets, _ = factors.layout.chunks
        bags = torch.diff(offsets, append=torch.tensor([index.shape[0]]))
        assert int(bags.max()) <= CHUNK and not set(range(37)) & set(index.tolist())  # the head not read
    else:
        factors = static_factors(static)
    s = _dense(factors, v)
    for cols in (c, 1):
        rows = torch.randn(v, cols, dtype=torch.float64, generator=g)
        torch.testing.assert_close(bucket_table(factors, rows), s @ rows, rtol=1e-12, atol=1e-12)
        grad_table = torch.randn(s.shape[0], cols, dtype=torch.float64, generator=g)
        torch.testing.assert_close(spread(factors, grad_table), s.t() @ grad_table, rtol=1e-12, atol=1e-12)
    rows = torch.randn(v, c, generator=g)
    assert bucket_table(factors, rows).dtype == torch.float32
    torch.testing.assert_close(bucket_table(factors, rows).double(), s @ rows.double(), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_tail_products_run_in_the_weight_dtype_against_a_float64_truth(dtype):
    # The expected part's gradients (hidden, weight, bias) from bf16 inputs: both (T x B x D) products in bf16 (float32
    # accumulation), within a few bf16 roundings of the float64 truth on the same rounded inputs; fp32 within float32's.
    weight, bias, counts = _setup(dtype=torch.float32)
    sampler = build_sampler("midx-rq", weight, class_counts=counts, codebook_size=8, exclude=torch.arange(40))
    h = torch.randn(T, D)
    factors = sampler.proposal_factors(h)
    grad_out = torch.rand(T)
    products = []

    class Spy(torch.utils._python_dispatch.TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func.__name__.split(".")[0] in ("mm", "addmm") and args[-1].shape[-1] == D:  # not the bias's
                products.append(args[-1].dtype)
            return func(*args, **(kwargs or {}))

    got, truth = {}, {}
    for out, dt in ((got, dtype), (truth, torch.float64)):
        leaves = [x.to(dtype).to(dt).clone().requires_grad_() for x in (h, weight, bias)]  # the same rounded values
        with Spy() if dt == dtype else contextlib.nullcontext():
            expected_share(torch.zeros(T, dtype=torch.float32), grad_out, factors, *leaves).sum().backward()
        out.update(zip("hwb", (x.grad.double() for x in leaves)))
    assert len(products) == 2 and set(products) == {dtype}  # probs @ table and probs^T @ (c hidden)
    tol = 1e-6 if dtype == torch.float32 else 1e-2  # relative, in norm (measured 2e-7; bf16 3e-3, its ulp 4e-3)
    for k in "hwb":
        assert float((got[k] - truth[k]).norm() / truth[k].norm()) < tol, k
