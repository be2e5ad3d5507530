"""The sampled-softmax loss against a naive reference (same draws), its reductions and masking, the
full-softmax reference, dtype handling, validation, and the gradient bias of the estimator."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from hf_midx import build_sampler, full_softmax_loss, sampled_softmax_loss
from hf_midx.samplers import Sampler

V, D = 200, 12


class FixedDraws(Sampler):
    """A stub proposal that returns given draws: (T, M) ids / log_q per query, (P,) for the pool.

    It lets a test feed the loss and the reference the very same negatives. ``log_q_of`` (V,) gives
    the log-probability of any class for :meth:`score` (the corrected-positive estimator).
    """

    name = "fixed"

    def __init__(self, num_classes, dim, ids, log_q, pool=None, log_qbar=None, log_q_of=None, exclude=None):
        super().__init__(torch.zeros(num_classes, dim), exclude=exclude)
        self.ids, self.log_q, self.pool, self.log_qbar = ids, log_q, pool, log_qbar
        self.log_q_of = log_q_of
        self.calls = []

    def draw(self, queries, num_samples, generator=None):
        self.calls.append(queries.clone())
        return self.ids[: queries.shape[0], :num_samples], self.log_q[: queries.shape[0], :num_samples]

    def draw_shared(self, queries, num_samples, row_weights=None, generator=None):
        self.calls.append(queries.clone())
        return self.pool[:num_samples], self.log_qbar[:num_samples]

    def score(self, queries, ids):
        return self.log_q_of[ids]

    def score_shared(self, queries, ids, row_weights=None):
        return self.log_q_of[ids]

    def draw_scored(self, queries, num_samples, ids, generator=None):
        return (*self.draw(queries, num_samples), self.score(queries, ids))

    def draw_shared_scored(self, queries, num_samples, ids, row_weights=None, generator=None):
        return (*self.draw_shared(queries, num_samples, row_weights), self.score_shared(queries, ids))


def _inputs(t=10, *, seed=0, dtype=torch.float32, bias=True):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(t, D, generator=g).to(dtype).requires_grad_(True)
    weight = (0.5 * torch.randn(V, D, generator=g)).to(dtype).requires_grad_(True)
    b = (0.3 * torch.randn(V, generator=g)).to(dtype).requires_grad_(True) if bias else None
    labels = torch.randint(V, (t,), generator=g)
    return hidden, weight, b, labels


def _draws(t, m, *, seed=1, labels=None):
    """Random ids with some forced accidental hits, and arbitrary (negative) log-probabilities."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(V, (t, m), generator=g)
    if labels is not None:
        ids[::3, 0] = labels[::3]  # every third token draws its own label once
    log_q = -math.log(V) + 0.5 * torch.randn(t, m, generator=g)
    return ids, log_q


def reference_loss(hidden, weight, labels, ids, log_q, *, bias=None, shared=False, ignore_index=-100,
                   remove_accidental_hits=True, reduction="mean", logit_softcap=None):
    """The estimator written out naively in float64 from the full (T, V) logits.

    ``ids``/``log_q``: (T', M) for the T' non-ignored tokens (per-query), or (P,) (shared).
    """
    valid = labels != ignore_index
    h, y = hidden.double()[valid], labels[valid]
    logits = h @ weight.double().t()
    if bias is not None:
        logits = logits + bias.double()
    if logit_softcap is not None:
        logits = logit_softcap * torch.tanh(logits / logit_softcap)
    pos = logits.gather(1, y.unsqueeze(1)).squeeze(1)
    if shared:
        neg = logits[:, ids] - math.log(ids.shape[0]) - log_q.double().unsqueeze(0)
        hits = ids.unsqueeze(0) == y.unsqueeze(1)
    else:
        neg = logits.gather(1, ids) - math.log(ids.shape[1]) - log_q.double()
        hits = ids == y.unsqueeze(1)
    if remove_accidental_hits:
        neg = neg.masked_fill(hits, -math.inf)
    per_token = torch.logsumexp(torch.cat([pos.unsqueeze(1), neg], 1), 1) - pos
    if reduction == "none":
        return torch.zeros(labels.shape, dtype=torch.float64).masked_scatter(valid, per_token)
    return per_token.sum() if reduction == "sum" else per_token.sum() / max(int(valid.sum()), 1)


def _grads(loss, tensors):
    return torch.autograd.grad(loss.sum(), [x for x in tensors if x is not None])


def _compare(loss, ref, leaves):
    """Loss and gradients (hidden, weight, bias) of the engine against the float64 reference."""
    assert loss.dtype == torch.float32
    torch.testing.assert_close(loss.double(), ref, atol=1e-5, rtol=1e-5)
    for got, want in zip(_grads(loss, leaves), _grads(ref, leaves), strict=True):
        torch.testing.assert_close(got.double(), want.double(), atol=1e-5, rtol=1e-5)


# ------------------------------------------------------------------------------------------ vs reference
@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@pytest.mark.parametrize("with_bias", [True, False])
@pytest.mark.parametrize("remove", [True, False])
def test_per_query_matches_reference(reduction, with_bias, remove):
    hidden, weight, bias, labels = _inputs(bias=with_bias)
    labels[[2, 5]] = -100
    valid = labels != -100
    ids, log_q = _draws(10, 16, labels=labels.clamp_min(0))
    sampler = FixedDraws(V, D, ids, log_q)
    loss = sampled_softmax_loss(hidden, weight, labels, sampler, 16, bias=bias, reduction=reduction,
                                remove_accidental_hits=remove, estimator="exact-positive", exact_value=False)
    ref = reference_loss(hidden, weight, labels, ids[valid], log_q[valid], bias=bias, reduction=reduction,
                         remove_accidental_hits=remove)
    _compare(loss, ref, (hidden, weight, bias))
    # The sampler was queried with every hidden state (ignored ones are masked, not removed), detached.
    assert torch.equal(sampler.calls[0], hidden.detach()) and not sampler.calls[0].requires_grad


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@pytest.mark.parametrize("with_bias", [True, False])
def test_shared_matches_reference(reduction, with_bias):
    hidden, weight, bias, labels = _inputs(bias=with_bias)
    labels[4] = -100
    pool, log_qbar = _draws(1, 40)
    pool, log_qbar = pool[0], log_qbar[0]
    pool[:3] = labels[:3]  # accidental hits in the pool
    sampler = FixedDraws(V, D, None, None, pool, log_qbar)
    loss = sampled_softmax_loss(hidden, weight, labels, sampler, 40, bias=bias, negatives="shared",
                                reduction=reduction, estimator="exact-positive")
    ref = reference_loss(hidden, weight, labels, pool, log_qbar, bias=bias, shared=True, reduction=reduction)
    _compare(loss, ref, (hidden, weight, bias))


@pytest.mark.parametrize("negatives", ["per-query", "shared"])
def test_logit_softcap_matches_reference(negatives):
    hidden, weight, bias, labels = _inputs()
    hidden.data *= 4.0  # logits of tens of nats, where the cap bites
    ids, log_q = _draws(10, 12, labels=labels)
    sampler = FixedDraws(V, D, ids, log_q, ids[0], log_q[0])
    shared = negatives == "shared"
    loss = sampled_softmax_loss(hidden, weight, labels, sampler, 12, bias=bias, negatives=negatives,
                                logit_softcap=5.0, estimator="exact-positive")
    ref = reference_loss(hidden, weight, labels, ids[0] if shared else ids, log_q[0] if shared else log_q,
                         bias=bias, shared=shared, logit_softcap=5.0)
    _compare(loss, ref, (hidden, weight, bias))
    uncapped = sampled_softmax_loss(hidden, weight, labels, sampler, 12, bias=bias, negatives=negatives, estimator="exact-positive")
    assert not torch.allclose(loss, uncapped)


def test_accidental_hits_are_removed():
    """A token whose every draw is its own label has only the positive left: loss exactly 0."""
    hidden, weight, _, labels = _inputs(4, bias=False)
    ids = labels.unsqueeze(1).repeat(1, 5)
    log_q = torch.full((4, 5), -1.0)
    sampler = FixedDraws(V, D, ids, log_q)
    loss = sampled_softmax_loss(hidden, weight, labels, sampler, 5, reduction="none", estimator="exact-positive")
    torch.testing.assert_close(loss, torch.zeros(4), atol=0, rtol=0)
    kept = sampled_softmax_loss(hidden, weight, labels, sampler, 5, reduction="none", remove_accidental_hits=False,
                                estimator="exact-positive", exact_value=False)
    # Kept, the 5 copies add 5 exp(o_y - log(5 q)) = exp(o_y + 1) to exp(o_y): loss = log(1 + e).
    torch.testing.assert_close(kept, torch.full((4,), math.log1p(math.e)), atol=1e-6, rtol=1e-6)
    # The value estimates the exact loss whatever the objective: the hits are dropped there.
    value = sampled_softmax_loss(hidden, weight, labels, sampler, 5, reduction="none", remove_accidental_hits=False,
                                 estimator="exact-positive")
    torch.testing.assert_close(value, torch.zeros(4), atol=1e-6, rtol=0)


def test_mean_is_sum_over_valid_tokens():
    hidden, weight, bias, labels = _inputs()
    labels[[0, 7]] = -1
    sampler = build_sampler("midx-rq", weight.detach(), codebook_size=8)

    def run(reduction):
        return sampled_softmax_loss(hidden, weight, labels, sampler, 8, bias=bias, ignore_index=-1,
                                    reduction=reduction, generator=torch.Generator().manual_seed(3), estimator="exact-positive")

    mean, total, none = run("mean"), run("sum"), run("none")
    assert none.shape == (10,) and float(none[0].detach()) == 0.0 and float(none[7].detach()) == 0.0
    torch.testing.assert_close(total, none.sum())
    torch.testing.assert_close(mean, total / 8)


def test_ignored_tokens_change_nothing():
    """Loss and gradients with ignored positions equal those of the valid tokens alone (same draws)."""
    hidden, weight, bias, labels = _inputs()
    labels[[1, 2, 9]] = -100
    valid = labels != -100
    ids, log_q = _draws(10, 8, labels=labels.clamp_min(0))
    loss = sampled_softmax_loss(hidden, weight, labels, FixedDraws(V, D, ids, log_q), 8, bias=bias, estimator="exact-positive")
    g_hidden, g_weight, g_bias = _grads(loss, (hidden, weight, bias))
    h_valid = hidden.detach()[valid].clone().requires_grad_(True)
    loss_valid = sampled_softmax_loss(h_valid, weight, labels[valid], FixedDraws(V, D, ids[valid], log_q[valid]), 8,
                                      bias=bias, estimator="exact-positive")
    torch.testing.assert_close(loss, loss_valid)
    g_valid, gw_valid, gb_valid = _grads(loss_valid, (h_valid, weight, bias))
    assert bool((g_hidden[~valid] == 0).all())
    torch.testing.assert_close(g_hidden[valid], g_valid)
    torch.testing.assert_close(g_weight, gw_valid)
    torch.testing.assert_close(g_bias, gb_valid)


@pytest.mark.parametrize("negatives", ["per-query", "shared"])
@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@pytest.mark.parametrize("estimator", ["exact-positive", "corrected-positive"])
@pytest.mark.parametrize("name", ["uniform", "midx-rq", "sphere", "lsh"])  # static, and query-dependent ones
def test_all_ignored_batch_gives_zero_loss_and_zero_gradient(negatives, reduction, estimator, name):
    hidden, weight, bias, labels = _inputs()
    labels[:] = -100
    sampler = build_sampler(name, weight.detach(), **({"codebook_size": 8} if name == "midx-rq" else {}))
    loss = sampled_softmax_loss(hidden, weight, labels, sampler, 8, bias=bias, negatives=negatives,
                                reduction=reduction, estimator=estimator)
    assert loss.dtype == torch.float32 and loss.shape == ((10,) if reduction == "none" else ())
    assert bool((loss == 0).all())
    for g in _grads(loss, (hidden, weight, bias)):
        assert bool(torch.isfinite(g).all()) and bool((g == 0).all())


def test_same_generator_gives_same_loss():
    hidden, weight, bias, labels = _inputs()
    sampler = build_sampler("midx-pq", weight.detach(), codebook_size=8)
    a = sampled_softmax_loss(hidden, weight, labels, sampler, 8, generator=torch.Generator().manual_seed(9), estimator="exact-positive")
    b = sampled_softmax_loss(hidden, weight, labels, sampler, 8, generator=torch.Generator().manual_seed(9), estimator="exact-positive")
    c = sampled_softmax_loss(hidden, weight, labels, sampler, 8, estimator="exact-positive")  # the sampler's own generator
    assert torch.equal(a, b) and not torch.equal(a, c)


@pytest.mark.parametrize("negatives", ["per-query", "shared"])
def test_bf16_inputs_give_a_finite_float32_loss(negatives):
    hidden, weight, bias, labels = _inputs(32)
    sampler = build_sampler("midx-rq", weight.detach(), codebook_size=8)

    def run(h, w, b):
        return sampled_softmax_loss(h, w, labels, sampler, 16, bias=b, negatives=negatives,
                                    generator=torch.Generator().manual_seed(5), estimator="exact-positive")

    h16, w16, b16 = (x.detach().bfloat16().requires_grad_(True) for x in (hidden, weight, bias))
    loss16 = run(h16, w16, b16)
    assert loss16.dtype == torch.float32 and bool(torch.isfinite(loss16))
    grads16 = _grads(loss16, (h16, w16, b16))
    assert all(g.dtype == torch.bfloat16 and bool(torch.isfinite(g).all()) for g in grads16)
    # Against float32 on the bf16-rounded inputs: the only extra error is bf16 arithmetic in the
    # D = 12 dot products (unit roundoff 2^-8 = 0.4% per product, ~1% for the loss).
    loss32 = run(*(x.detach().float().requires_grad_(True) for x in (h16, w16, b16)))
    torch.testing.assert_close(loss16, loss32, atol=0.02, rtol=0.02)


# ------------------------------------------------------------------------------------------ full softmax
@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@pytest.mark.parametrize("with_bias", [True, False])
@pytest.mark.parametrize("softcap", [None, 3.0])
def test_full_softmax_loss_equals_cross_entropy(reduction, with_bias, softcap):
    """Both paths (torch's linear_cross_entropy without softcap, the chunked fallback with it)."""
    hidden, weight, bias, labels = _inputs(23, bias=with_bias)
    labels[[3, 11]] = -7
    kwargs = {"chunk_size": 5} if softcap is not None else {}  # several chunks in the fallback
    loss = full_softmax_loss(hidden, weight, labels, bias=bias, ignore_index=-7, reduction=reduction,
                             logit_softcap=softcap, **kwargs)
    logits = F.linear(hidden.double(), weight.double(), None if bias is None else bias.double())
    if softcap is not None:
        logits = softcap * torch.tanh(logits / softcap)
    ref = F.cross_entropy(logits, labels, ignore_index=-7, reduction=reduction)
    assert loss.dtype == torch.float32 and loss.shape == ref.shape
    torch.testing.assert_close(loss.double(), ref, atol=1e-5, rtol=1e-5)
    for got, want in zip(_grads(loss, (hidden, weight, bias)), _grads(ref, (hidden, weight, bias)), strict=True):
        torch.testing.assert_close(got.double(), want.double(), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("softcap", [None, 3.0])
def test_full_softmax_loss_all_ignored_is_zero(softcap):
    hidden, weight, bias, labels = _inputs()
    labels[:] = -100
    loss = full_softmax_loss(hidden, weight, labels, bias=bias, logit_softcap=softcap)
    assert float(loss.detach()) == 0.0
    for g in _grads(loss, (hidden, weight, bias)):
        assert bool((g == 0).all())


@pytest.mark.parametrize("softcap", [None, 3.0])
def test_full_softmax_loss_bf16_is_float32(softcap):
    """bf16 inputs: a float32 loss as close to the float64 reference as bf16 logits allow.

    T = 2048 tokens: a bf16 running sum of ~1750 x 6.8 nats has a spacing of 64 near its end, so a
    loss reduced in bf16 is off by ~0.3% here (11% for 4096 tokens of 12 nats). Per-token errors
    (bf16 logits: relative 2^-9, about 0.01 nats, random sign) average out in a float32 reduction to
    ~0.01 / sqrt(1750) = 2.5e-4 nats = 4e-5 relative, so rtol = 1e-3 is 25 times that.
    """
    hidden, weight, bias, labels = _inputs(2048, dtype=torch.bfloat16)
    labels[::7] = -100
    logits = F.linear(hidden.double(), weight.double(), bias.double())
    if softcap is not None:
        logits = softcap * torch.tanh(logits / softcap)
    for reduction in ("mean", "sum", "none"):
        loss = full_softmax_loss(hidden, weight, labels, bias=bias, reduction=reduction, logit_softcap=softcap)
        ref = F.cross_entropy(logits, labels, reduction=reduction)
        assert loss.dtype == torch.float32 and bool(torch.isfinite(loss).all())
        if reduction == "none":
            torch.testing.assert_close(loss.double(), ref, atol=0.05, rtol=0.02)
        else:
            torch.testing.assert_close(loss.double(), ref, atol=0, rtol=1e-3)
    grads = _grads(loss, (hidden, weight, bias))
    assert all(g.dtype == torch.bfloat16 and bool(torch.isfinite(g).all()) for g in grads)


# ------------------------------------------------------------------------------------------ validation
def test_invalid_arguments_are_refused():
    hidden, weight, bias, labels = _inputs()
    sampler = build_sampler("uniform", weight.detach())
    call = sampled_softmax_loss
    with pytest.raises(ValueError, match=r"labels contains 200, outside \[0, 200\) \(or -100 to ignore"):
        call(hidden, weight, torch.full((10,), V), sampler, 4)
    with pytest.raises(ValueError, match=r"labels contains -5, outside \[0, 200\)"):
        call(hidden, weight, torch.full((10,), -5), sampler, 4)
    with pytest.raises(ValueError, match="weight has 7 dims but 12 were expected"):
        call(hidden, torch.randn(V, 7), labels, sampler, 4)
    with pytest.raises(ValueError, match=r"labels must have shape \(T,\) = \(10,\)"):
        call(hidden, weight, labels[:6], sampler, 4)
    with pytest.raises(ValueError, match=r"labels must have shape \(T,\) = \(10,\)"):
        call(hidden, weight, labels.view(2, 5), sampler, 4)
    with pytest.raises(ValueError, match="labels must be an integer tensor"):
        call(hidden, weight, labels.float(), sampler, 4)
    with pytest.raises(ValueError, match=r"bias must have shape \(200,\)"):
        call(hidden, weight, labels, sampler, 4, bias=torch.zeros(V + 1))
    for m in (0, -3):
        with pytest.raises(ValueError, match="num_samples must be an integer >= 1"):
            call(hidden, weight, labels, sampler, m)
    with pytest.raises(ValueError, match="negatives must be one of"):
        call(hidden, weight, labels, sampler, 4, negatives="batch")
    with pytest.raises(ValueError, match="reduction must be one of"):
        call(hidden, weight, labels, sampler, 4, reduction="avg")
    with pytest.raises(ValueError, match="The sampler indexes 100 classes but weight has 200 rows"):
        call(hidden, weight, labels, build_sampler("uniform", torch.randn(100, D)), 4)
    with pytest.raises(ValueError, match="hidden must be 2-D"):
        call(hidden.unsqueeze(0), weight, labels, sampler, 4)
    with pytest.raises(ValueError, match=r"labels contains 200, outside \[0, 200\)"):
        full_softmax_loss(hidden, weight, torch.full((10,), V))
    with pytest.raises(ValueError, match="weight has 7 dims but 12 were expected"):
        full_softmax_loss(hidden, torch.randn(V, 7), labels)


# ------------------------------------------------------------------------------------------ gradient bias
def test_gradient_bias_shrinks_with_m_and_is_smaller_for_midx(make_clustered):
    """E[grad_h sampled loss] -> grad_h full loss as M grows, and faster for midx-rq than uniform.

    For each of S = 8 queries z_s (label: its top class) the sampled loss is evaluated on R = 4000
    copies of z_s at once (reduction "sum", so copy r's gradient is one independent draw g_r). With
    g the full-softmax gradient, the bias estimate is b_s = ||mean_r g_r - g||, its Monte Carlo
    standard error se_s = sqrt(tr Cov(g_r) / R), and the reported bias is B = mean_s b_s.

    Threshold: |b_s - true bias_s| <= ||eps_s||, eps_s the mean of R centred draws. By the CLT
    eps_s ~ N(0, Cov / R), with E||eps_s|| <= se_s, and the norm is 1-Lipschitz, so Gaussian
    concentration over the S independent queries gives
    P(mean_s ||eps_s|| >= mean_s se_s + z sqrt(sum_s se_s^2) / S) <= exp(-z^2 / 2); z = 4.3 -> 1e-4.
    ``B - margin > B' + margin'`` therefore means the true mean bias is larger, at alpha ~ 2e-4.
    """
    weight, queries = make_clustered(1000, 16, num_queries=8, seed=0)
    labels = (queries @ weight.t()).argmax(1)
    full_grad = torch.func.grad(lambda h: F.cross_entropy(h @ weight.t(), labels, reduction="sum"))(queries)
    reps, z = 4000, 4.3
    samplers = {name: build_sampler(name, weight, codebook_size=16) for name in ("uniform", "midx-rq")}
    stats = {}
    for name, sampler in samplers.items():
        for m in (2, 16, 128):
            h = queries.repeat_interleave(reps, 0).requires_grad_(True)
            loss = sampled_softmax_loss(h, weight, labels.repeat_interleave(reps), sampler, m, reduction="sum",
                                        generator=torch.Generator().manual_seed(m), estimator="exact-positive")
            (g,) = torch.autograd.grad(loss, h)
            g = g.view(queries.shape[0], reps, -1).double()
            b = (g.mean(1) - full_grad.double()).norm(dim=1)
            se = (g.var(1).sum(1) / reps).sqrt()
            margin = float(se.mean() + z * se.square().sum().sqrt() / se.numel())
            stats[name, m] = (float(b.mean()), margin)
    print("[grad-bias] ||E[grad] - full grad|| (mean over 8 queries; +- margin at alpha 1e-4), V=1000 D=16 K=16:")
    grad_norm = float(full_grad.norm(dim=1).mean())
    for (name, m), (b, margin) in stats.items():
        print(f"[grad-bias]   {name:8s} M={m:4d}: bias={b:.5f}  margin={margin:.5f}  ({b / grad_norm:.2%} of ||grad||)")

    def clearly_larger(a, b):
        return stats[a][0] - stats[a][1] > stats[b][0] + stats[b][1]

    for name in samplers:
        assert clearly_larger((name, 2), (name, 128)), (name, stats)
    for m in (2, 16, 128):
        assert clearly_larger(("uniform", m), ("midx-rq", m)), (m, stats)


@pytest.mark.parametrize("softcap", [None, 3.0])
def test_int32_labels_are_accepted(softcap):
    hidden, weight, bias, labels = _inputs()
    want = full_softmax_loss(hidden, weight, labels, bias=bias, logit_softcap=softcap)
    got = full_softmax_loss(hidden, weight, labels.int(), bias=bias, logit_softcap=softcap)
    torch.testing.assert_close(got, want)
    sampler = build_sampler("midx-rq", weight.detach(), codebook_size=8)
    a = sampled_softmax_loss(hidden, weight, labels.int(), sampler, 8, generator=torch.Generator().manual_seed(0), estimator="exact-positive")
    b = sampled_softmax_loss(hidden, weight, labels, sampler, 8, generator=torch.Generator().manual_seed(0), estimator="exact-positive")
    torch.testing.assert_close(a, b)


def test_frozen_weight_gets_no_gradient_and_hidden_does():
    hidden, weight, _, labels = _inputs(bias=False)
    frozen = weight.detach()
    sampler = build_sampler("midx-rq", frozen, codebook_size=8)
    for negatives in ("per-query", "shared"):
        loss = sampled_softmax_loss(hidden, frozen, labels, sampler, 8, negatives=negatives, estimator="exact-positive")
        (g,) = torch.autograd.grad(loss, hidden)
        assert bool(torch.isfinite(g).all()) and float(g.abs().sum()) > 0


# ------------------------------------------------------------------------------------------ estimators, exact head
def general_reference(hidden, weight, labels, ids, log_q, log_q_of, *, bias=None, shared=False, exact_ids=None,
                      estimator="exact-positive", remove=None, reduction="mean"):
    """Both estimators with an optional exact head, token by token in float64 from the full logits.

    ``remove`` None: the loss's default, accidental hits dropped with exact-positive only."""
    if remove is None:
        remove = estimator == "exact-positive"
    valid = labels != -100
    logits = hidden.double() @ weight.double().t()
    if bias is not None:
        logits = logits + bias.double()
    head = set() if exact_ids is None else set(exact_ids.tolist())
    per = []
    for t in range(labels.shape[0]):
        if not valid[t]:
            per.append(logits[t, 0] * 0)
            continue
        o, y = logits[t], int(labels[t])
        negs, lq = (ids, log_q) if shared else (ids[t], log_q[t])
        corrected = estimator == "corrected-positive" and y not in head
        n = negs.shape[0] + (1 if corrected else 0)
        keep = [j for j in range(negs.shape[0]) if not (remove and int(negs[j]) == y)]
        terms = [o[negs[j]] - math.log(n) - lq[j].double() for j in keep]
        terms += [o[i] for i in sorted(head)]
        if y in head:
            target = o[y]
        else:
            target = o[y] - math.log(n) - log_q_of[y].double() if corrected else o[y]
            terms.append(target)
        per.append(torch.logsumexp(torch.stack(terms), 0) - target)
    per = torch.stack(per)
    if reduction == "none":
        return per
    return per.sum() if reduction == "sum" else per.sum() / valid.sum()


def _tail_draws(t, m, exact_ids, *, seed=2):
    g = torch.Generator().manual_seed(seed)
    tail = torch.tensor([i for i in range(V) if exact_ids is None or i not in set(exact_ids.tolist())])
    ids = tail[torch.randint(tail.shape[0], (t, m), generator=g)]
    log_q_of = torch.full((V,), -math.inf)
    log_q_of[tail] = -math.log(tail.shape[0]) + 0.3 * torch.randn(tail.shape[0], generator=g)
    return ids, log_q_of[ids], log_q_of


@pytest.mark.parametrize("estimator", ["exact-positive", "corrected-positive"])
@pytest.mark.parametrize("with_head", [False, True])
@pytest.mark.parametrize("negatives", ["per-query", "shared"])
@pytest.mark.parametrize("reduction", ["mean", "none"])
def test_estimators_with_exact_head_match_reference(estimator, with_head, negatives, reduction):
    hidden, weight, bias, labels = _inputs(12)
    labels[3] = -100
    exact_ids = torch.tensor([0, 5, 17, 33, 99, 150]) if with_head else None
    if with_head:
        labels[[0, 1, 2]] = torch.tensor([5, 99, 0])  # labels inside the exact head too
    ids, log_q, log_q_of = _tail_draws(12, 9, exact_ids)
    ids[::4, 0] = labels[::4].clamp_min(0)  # accidental hits (a head label's hit cannot happen: ids avoid H)
    ids = torch.where(torch.isin(ids, exact_ids) if with_head else torch.zeros_like(ids, dtype=torch.bool), 1, ids)
    log_q = log_q_of[ids]
    shared = negatives == "shared"
    sampler = FixedDraws(V, D, ids, log_q, ids[0], log_q[0], log_q_of=log_q_of, exclude=exact_ids)

    def run(exact_value):
        return sampled_softmax_loss(hidden, weight, labels, sampler, 9, bias=bias, negatives=negatives,
                                    reduction=reduction, estimator=estimator, exact_ids=exact_ids,
                                    exact_value=exact_value)

    draws = (ids[0], log_q[0]) if shared else (ids, log_q)
    kwargs = dict(bias=bias, shared=shared, exact_ids=exact_ids, reduction=reduction)
    _compare(run(False), general_reference(hidden, weight, labels, *draws, log_q_of, estimator=estimator, **kwargs),
             (hidden, weight, bias))
    # The default value is the unbiased partition-function form (the exact-positive one, hits dropped)...
    value = run(True)
    estimate = general_reference(hidden, weight, labels, *draws, log_q_of, estimator="exact-positive", remove=True,
                                 **kwargs)
    torch.testing.assert_close(value.double(), estimate, atol=1e-5, rtol=1e-5)
    # ...with the objective's gradient, to the bit.
    leaves = [x for x in (hidden, weight, bias) if x is not None]
    for got, want in zip(_grads(value, leaves), _grads(run(False), leaves), strict=True):
        assert torch.equal(got, want)


def test_exact_positive_form_reduces_to_the_paper_when_nothing_is_exact():
    hidden, weight, bias, labels = _inputs()
    ids, log_q = _draws(10, 7, labels=labels)
    sampler = FixedDraws(V, D, ids, log_q)
    a = sampled_softmax_loss(hidden, weight, labels, sampler, 7, bias=bias, estimator="exact-positive")
    b = sampled_softmax_loss(hidden, weight, labels, sampler, 7, bias=bias, exact_ids=torch.empty(0, dtype=torch.long), estimator="exact-positive")
    torch.testing.assert_close(a, b, atol=0, rtol=0)
    torch.testing.assert_close(a.double(), reference_loss(hidden, weight, labels, ids, log_q, bias=bias))


def test_exact_proposal_with_exact_head_gives_the_full_loss_plus_the_known_term():
    """With Q the exact softmax of the tail, every corrected term is Z_tail / M: the sum is Z_tail.

    So, keeping accidental hits, loss_t = -o_y + log(Z + [y not in H] e^o_y) exactly, the full
    cross-entropy plus log(1 + p_y) for tail labels and exactly the full cross-entropy for head labels.
    """
    hidden, weight, bias, labels = _inputs(16)
    exact_ids = torch.arange(0, V, 7)
    logits = (hidden @ weight.t() + bias).detach()
    tail = torch.ones(V, dtype=torch.bool)
    tail[exact_ids] = False
    log_tail = torch.log_softmax(logits.masked_fill(~tail, -math.inf), dim=1)  # (T, V), -inf on H
    g = torch.Generator().manual_seed(0)
    ids = torch.multinomial(log_tail.exp(), 5, replacement=True, generator=g)
    sampler = FixedDraws(V, D, ids, log_tail.gather(1, ids), exclude=exact_ids)
    loss = sampled_softmax_loss(hidden, weight, labels, sampler, 5, bias=bias, exact_ids=exact_ids,
                                remove_accidental_hits=False, reduction="none", estimator="exact-positive",
                                exact_value=False)
    log_z = torch.logsumexp(logits, 1)
    o_y = logits.gather(1, labels.unsqueeze(1)).squeeze(1)
    in_head = torch.isin(labels, exact_ids)
    want = torch.where(in_head, log_z - o_y, torch.logaddexp(log_z, o_y) - o_y)
    torch.testing.assert_close(loss.detach(), want, atol=1e-5, rtol=1e-5)


def test_unknown_estimator_and_bad_exact_ids_are_refused():
    hidden, weight, bias, labels = _inputs()
    sampler = build_sampler("uniform", weight.detach())
    with pytest.raises(ValueError, match="estimator must be one of"):
        sampled_softmax_loss(hidden, weight, labels, sampler, 4, estimator="tf")
    with pytest.raises(ValueError, match="exact_ids must be a 1-D integer tensor"):
        sampled_softmax_loss(hidden, weight, labels, sampler, 4, exact_ids=torch.zeros(2, 2, dtype=torch.long), estimator="exact-positive")
    with pytest.raises(ValueError, match=r"exact_ids contains 200, outside \[0, 200\)"):
        sampled_softmax_loss(hidden, weight, labels, sampler, 4, exact_ids=torch.tensor([3, V]), estimator="exact-positive")


def test_exact_ids_must_be_the_classes_the_sampler_excludes():
    hidden, weight, bias, labels = _inputs()
    head = torch.tensor([4, 9, 30])
    excluding = build_sampler("uniform", weight.detach(), exclude=head)
    plain = build_sampler("uniform", weight.detach())
    for sampler, exact_ids in [(excluding, None), (plain, head), (excluding, torch.tensor([4, 9])),
                               (excluding, torch.tensor([4, 9, 31])), (excluding, torch.tensor([4, 9, 9]))]:
        with pytest.raises(ValueError, match=r"exact_ids \(\d ids\) must be the classes the sampler excludes"):
            sampled_softmax_loss(hidden, weight, labels, sampler, 4, exact_ids=exact_ids)
    shuffled = sampled_softmax_loss(hidden, weight, labels, excluding, 4, exact_ids=torch.tensor([30, 4, 9]),
                                    generator=torch.Generator().manual_seed(0))
    ordered = sampled_softmax_loss(hidden, weight, labels, excluding, 4, exact_ids=excluding.excluded,
                                   generator=torch.Generator().manual_seed(0))
    torch.testing.assert_close(shuffled, ordered)


def test_the_training_path_finds_head_labels_without_isin(monkeypatch):
    """torch.isin of a large head sorts and takes unique values: a device sync on CUDA. The loss uses a binary
    search of the sorted head instead, and finds the labels inside it alike."""
    hidden, weight, bias, labels = _inputs(16)
    head = torch.arange(0, V, 5)
    labels[:6] = head[:6]
    sampler = build_sampler("unigram", weight.detach(), exclude=head, class_counts=torch.ones(V))
    want = sampled_softmax_loss(hidden, weight, labels, sampler, 4, exact_ids=head, reduction="none",
                                generator=torch.Generator().manual_seed(0))
    monkeypatch.setattr(torch, "isin", lambda *a, **k: pytest.fail("torch.isin in the loss"))
    got = sampled_softmax_loss(hidden, weight, labels, sampler, 4, exact_ids=sampler.excluded, reduction="none",
                               generator=torch.Generator().manual_seed(0), check_labels=False)
    torch.testing.assert_close(got, want)  # (the reference tests above check head labels' terms)


def test_unchecked_labels_use_a_device_side_assertion():
    hidden, weight, bias, labels = _inputs()
    sampler = build_sampler("uniform", weight.detach())
    for bad in (V, -5):
        with pytest.raises(RuntimeError, match="labels outside"):
            sampled_softmax_loss(hidden, weight, torch.full((10,), bad), sampler, 4, check_labels=False,
                                 estimator="exact-positive")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_candidate_logits_gradients_match_autograd_through_a_gather(dtype):
    """The backward (the gather again, one batched product and one index_add_) against autograd through
    a plain gather, with repeated classes within and across tokens and a common block."""
    from hf_midx.losses.candidate_logits import CandidateLogits

    g = torch.Generator().manual_seed(0)
    v, d, t, r = 50, 12, 33, 7
    weight = torch.randn(v, d, generator=g).to(dtype).requires_grad_()
    hidden = torch.randn(t, d, generator=g).to(dtype).requires_grad_()
    rows = torch.randint(v, (t, r), generator=g)
    rows[:, 1] = rows[:, 2]  # the same class twice in a token
    rows[3] = rows[4]  # and two tokens with the same candidates
    common = torch.tensor([3, 7, 49, 0])
    go = torch.randn(t, r, generator=g)
    gs = torch.randn(t, common.numel(), generator=g)
    out, shared = CandidateLogits.apply(hidden, weight, rows, common, 5)  # several forward chunks
    (out * go).sum().add((shared * gs).sum()).backward()
    got = hidden.grad.clone(), weight.grad.clone()
    hidden.grad = weight.grad = None
    ref = torch.einsum("trd,td->tr", weight.float()[rows], hidden.float())
    ref_s = hidden.float() @ weight.float()[common].t()
    torch.testing.assert_close(out, ref, **_tol(dtype))
    torch.testing.assert_close(shared, ref_s, **_tol(dtype))
    (ref * go).sum().add((ref_s * gs).sum()).backward()
    for a, b in zip(got, (hidden.grad, weight.grad)):
        assert a.dtype == dtype
        torch.testing.assert_close(a.float(), b.float(), **_tol(dtype))


def _tol(dtype):
    # bf16 keeps 8 bits of mantissa: sums of ~10 products carry ~1e-2 relative error.
    return {"rtol": 2e-2, "atol": 5e-2} if dtype == torch.bfloat16 else {"rtol": 1e-5, "atol": 1e-5}


# ------------------------------------------------------------------------------------------ accidental hits
@pytest.mark.parametrize("remove", [None, True])
def test_corrected_positive_keeps_accidental_hits_and_is_then_unbiased(remove):
    """With Q the model's own softmax (midx-exact, Theorem 1) every corrected candidate logit is log Z - log n,
    so the expected hidden-state gradient is M / (M + 1) times the full softmax's, W^T p - w_y: the default
    (None: hits kept with corrected-positive) has it, within 5 standard errors over 4,000 tokens. Dropping
    the label's draws (True) leaves fewer candidates than n and overweights the label: far from it."""
    g = torch.Generator().manual_seed(0)
    v, d, m, t = 40, 6, 10, 4000
    weight = torch.randn(v, d, generator=g)
    z = torch.randn(d, generator=g) * 1.5
    p = torch.softmax(weight @ z, 0)
    y = int(p.argmax())  # a label Q draws often: the case where dropping its draws matters
    assert p[y] > 0.2
    sampler = build_sampler("midx-exact", weight, codebook_size=4, seed=0)
    hidden = z.expand(t, d).clone().requires_grad_()
    labels = torch.full((t,), y)
    loss = sampled_softmax_loss(hidden, weight, labels, sampler, m, reduction="sum", remove_accidental_hits=remove,
                                generator=torch.Generator().manual_seed(1))  # fmt: skip
    (grad,) = torch.autograd.grad(loss, hidden)  # (T, D): one independent draw per token
    expected = m / (m + 1) * (weight.t() @ p - weight[y])
    z_scores = (grad.mean(0) - expected) / (grad.std(0) / math.sqrt(t))
    if remove is None:
        assert z_scores.abs().max() < 5, z_scores
    else:
        assert z_scores.abs().max() > 20, z_scores


def test_exact_positive_drops_accidental_hits_by_default():
    hidden, weight, _, labels = _inputs(bias=False)
    ids, log_q = _draws(labels.shape[0], 8, labels=labels)
    sampler = FixedDraws(V, D, ids, log_q)
    default = sampled_softmax_loss(hidden, weight, labels, sampler, 8, reduction="none", estimator="exact-positive")
    ref = reference_loss(hidden, weight, labels, ids, log_q, reduction="none", remove_accidental_hits=True)
    torch.testing.assert_close(default.double(), ref, atol=1e-5, rtol=1e-5)


def test_remove_accidental_hits_must_be_a_bool_or_none():
    hidden, weight, _, labels = _inputs(bias=False)
    ids, log_q = _draws(labels.shape[0], 8, labels=labels)
    with pytest.raises(ValueError, match="remove_accidental_hits must be True, False or None"):
        sampled_softmax_loss(hidden, weight, labels, FixedDraws(V, D, ids, log_q), 8, remove_accidental_hits="yes")


# ------------------------------------------------------------------------------------------ the value
def _peaked_problem(v=500, d=16, t=256, seed=0):
    """Clustered class embeddings and labels drawn from the model's own softmax (so the exact loss is its entropy)."""
    g = torch.Generator().manual_seed(seed)
    centers = torch.randn(10, d, generator=g)
    weight = centers[torch.randint(10, (v,), generator=g)] + 0.5 * torch.randn(v, d, generator=g)
    hidden = torch.randn(t, d, generator=g)
    labels = torch.multinomial(torch.softmax(hidden @ weight.t(), 1), 1, generator=g).squeeze(1)
    return hidden, weight, labels


def test_the_value_estimates_the_exact_loss_and_the_objective_does_not():
    """With Q the softmax itself (midx-exact) every importance weight is Z / M: the value is within 1% of the
    full softmax's loss for every seed, while the corrected-positive objective sits > 5% below it. With the
    default midx-rq proposal (M = 20, a peaked softmax) the value is within 10% (log of an unbiased Z: a
    little low), the objective about half."""
    hidden, weight, labels = _peaked_problem()
    exact = float(full_softmax_loss(hidden, weight, labels))
    counts = torch.bincount(labels, minlength=weight.shape[0])
    for name, value_tol, objective_gap in (("midx-exact", 0.01, 0.05), ("midx-rq", 0.10, 0.30)):
        sampler = build_sampler(name, weight, codebook_size=8, class_counts=counts)
        for seed in range(5):
            def run(exact_value):
                gen = torch.Generator().manual_seed(seed)
                return float(sampled_softmax_loss(hidden, weight, labels, sampler, 20, generator=gen,
                                                  exact_value=exact_value))
            value, objective = run(True), run(False)
            assert abs(value - exact) < value_tol * exact, (name, seed, value, exact)
            assert objective < (1 - objective_gap) * exact, (name, seed, objective, exact)


@pytest.mark.parametrize("negatives", ["per-query", "shared"])
def test_the_per_token_value_estimates_each_tokens_exact_loss(negatives):
    """reduction="none": each token's value is its own estimate; with the exact proposal and many draws, each
    is within 2% of that token's full-softmax loss (shared: qbar, the batch mixture, is still a fair proposal)."""
    hidden, weight, labels = _peaked_problem(t=32)
    exact = full_softmax_loss(hidden, weight, labels, reduction="none")
    sampler = build_sampler("midx-exact", weight, codebook_size=8)
    num = 2000 if negatives == "per-query" else 20000
    value = sampled_softmax_loss(hidden, weight, labels, sampler, num, negatives=negatives, reduction="none",
                                 generator=torch.Generator().manual_seed(0))
    torch.testing.assert_close(value, exact, atol=0.02 * float(exact.mean()), rtol=0.02)
