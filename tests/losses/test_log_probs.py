"""Exact log-prob statistics against full logits, and the sampled gradient's mean against the exact gradient."""

from __future__ import annotations

import math
import weakref

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import hf_midx
from hf_midx.losses import log_probs as lp
from recipes.benchmarks.profile_head import FREE_OPS

TRANSFORMS = [lp.LogitTransform(), lp.LogitTransform(temperature=0.7, scale=0.5, softcap=2.0)]


def _problem(t=24, vocab=300, dim=16, seed=0, bias=True):
    g = torch.Generator().manual_seed(seed)
    h = torch.randn(t, dim, generator=g)
    w = torch.randn(vocab, dim, generator=g) * 0.7
    b = torch.randn(vocab, generator=g) * 0.3 if bias else None
    y = torch.randint(0, vocab, (t,), generator=g)
    return h, w, b, y


def _reference(h, w, b, y, transform):
    z = transform(h @ w.T + (0 if b is None else b))
    log_p = torch.log_softmax(z, dim=1)
    p = log_p.exp()
    label = z.gather(1, y[:, None])[:, 0]
    return {
        "log_z": torch.logsumexp(z, 1), "label_logit": label, "entropy": -(p * log_p).sum(1),
        "log_sum_sq_probs": torch.log((p * p).sum(1)), "mean_logits": z.mean(1), "is_top1": z.argmax(1) == y,
    }, log_p.gather(1, y[:, None])[:, 0], -(p * log_p).sum(1)


@pytest.mark.parametrize("transform", TRANSFORMS)
def test_statistics_are_the_full_softmax_s_over_several_tiles(monkeypatch, transform):
    monkeypatch.setattr(lp, "CLASS_TILE", 64)  # 5 class tiles, the last one short
    monkeypatch.setattr(lp, "TOKEN_TILE", 10)  # 3 token tiles
    h, w, b, y = _problem()
    y[0] = int((transform(h[0] @ w.T + b)).argmax())  # one label that is the top-1 class
    got = lp.log_prob_statistics(h, w, b, y, transform)
    want, _, _ = _reference(h, w, b, y, transform)
    for key, value in want.items():
        if value.dtype == torch.bool:
            assert torch.equal(got[key], value), key
        else:
            torch.testing.assert_close(got[key], value, rtol=1e-5, atol=1e-5, msg=key)
    assert bool(got["is_top1"][0])


@pytest.mark.parametrize("transform", TRANSFORMS)
def test_the_sampled_gradient_is_unbiased(transform):
    """The mean of 3,000 draws' gradients (hidden, weight, bias) lies within 4.5 standard errors of the exact
    gradient in every coordinate, and the normalized squared errors average about 1 (chi-square)."""
    h, w, b, y = _problem(t=6, vocab=60, dim=4, seed=1)
    valid = torch.ones_like(y, dtype=torch.bool)
    valid[2] = False
    g_lp, g_ent = torch.randn(6, generator=torch.Generator().manual_seed(2)), torch.randn(6)
    head = torch.tensor([3, 7, 11])
    sampler = hf_midx.build_sampler("unigram", w, class_counts=torch.arange(1.0, 61.0), exclude=head)

    def gradients(fn):
        hh, ww, bb = (x.clone().requires_grad_() for x in (h, w, b))
        log_p, ent = fn(hh, ww, bb)
        ((g_lp * log_p).sum() + (g_ent * ent).sum()).backward()
        return torch.cat([hh.grad.flatten(), ww.grad.flatten(), bb.grad.flatten()])

    def exact(hh, ww, bb):
        _, log_p, ent = _reference(hh, ww, bb, y, transform)
        return log_p * valid, ent * valid

    stats = lp.log_prob_statistics(h, w, b, y, transform)
    want = gradients(exact)
    draws = []
    for _ in range(3000):
        ids, log_q = sampler.draw(h, 4)
        draws.append(gradients(lambda hh, ww, bb: lp.SampledGradientLogProbs.apply(
            hh, ww, bb, y, valid, stats, head, ids, log_q, transform)))
    draws = torch.stack(draws)
    mean, se = draws.mean(0), draws.std(0) / math.sqrt(draws.shape[0])
    moving = se > 1e-7
    assert torch.allclose(mean[~moving], want[~moving], atol=1e-5)  # exact coordinates: no variance, no error
    z = (mean[moving] - want[moving]) / se[moving]
    assert z.abs().max() < 4.5 and 0.7 < float((z * z).mean()) < 1.4, (z.abs().max(), (z * z).mean())


def test_values_are_exact_and_zero_where_ignored():
    h, w, b, y = _problem()
    transform = TRANSFORMS[1]
    valid = torch.rand(y.shape[0], generator=torch.Generator().manual_seed(3)) < 0.7
    stats = lp.log_prob_statistics(h, w, b, y, transform)
    ids = torch.randint(0, 300, (y.shape[0], 5))
    log_p, ent = lp.SampledGradientLogProbs.apply(h, w, b, y, valid, stats, None, ids, torch.zeros(y.shape[0], 5),
                                                  transform)
    _, want_lp, want_ent = _reference(h, w, b, y, transform)
    torch.testing.assert_close(log_p, want_lp * valid, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(ent, want_ent * valid, rtol=1e-5, atol=1e-5)


class _OpTrace(TorchDispatchMode):
    """Every ATen op below autograd, with its tensor arguments' (shape, dtype), and the most 3-d float32 tensors of
    at least ``big`` elements ((tokens, draws, D) ones) alive at once (weak references to the ops' outputs)."""

    def __init__(self, big: int) -> None:
        super().__init__()
        self.ops, self.big, self.alive, self.peak_big_float32 = [], big, [], 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        tensors = [a for a in args if isinstance(a, torch.Tensor)]
        self.ops.append((func.overloadpacket.__name__, [(tuple(t.shape), t.dtype) for t in tensors]))
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(t, torch.Tensor) and t.dtype == torch.float32 and t.dim() == 3 and t.numel() >= self.big:
                self.alive.append(weakref.ref(t))
        self.alive = [r for r in self.alive if r() is not None]
        self.peak_big_float32 = max(self.peak_big_float32, len(self.alive))
        return out


def test_exact_forward_is_lean_under_autocast(monkeypatch):
    """A float32 head under bf16 autocast (issue 74, item 5), traced op by op on the CPU: each weight row is cast
    once per call (one cast per class tile, none per token tile); every product (mm, bmm) reads bfloat16; the ops
    per call are a fixed number per tile (no loop over tokens or draws inside a tile); the backward holds at most
    one float32 (n, 1 + M, D) tensor at a time, n = TOKEN_TILE tokens, never a (T, M, D) one."""
    monkeypatch.setattr(lp, "CLASS_TILE", 256)  # 3 class tiles
    monkeypatch.setattr(lp, "TOKEN_TILE", 16)  # 3 token tiles
    t, vocab, dim, m = 40, 700, 16, 8
    h, w, b, y = _problem(t=t, vocab=vocab, dim=dim)
    h, w = h.requires_grad_(), w.requires_grad_()
    sampler = hf_midx.build_sampler("unigram", w.detach(), class_counts=torch.arange(1.0, vocab + 1.0),
                                    exclude=torch.arange(5))
    ids, log_q = sampler.draw(h.detach(), m)
    transform = TRANSFORMS[1]
    valid = torch.ones(t, dtype=torch.bool)
    forward, backward = _OpTrace(16 * (1 + m) * dim), _OpTrace(16 * (1 + m) * dim)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        dtype = lp.logits_dtype(h)
        with forward:
            stats = lp.log_prob_statistics(h, w, b, y, transform, dtype)
            log_p, ent = lp.SampledGradientLogProbs.apply(h, w, b, y, valid, stats, torch.arange(5), ids, log_q,
                                                          transform, dtype)
    with backward:
        (log_p.sum() + ent.sum()).backward()
    assert dtype == torch.bfloat16 and w.grad.dtype == torch.float32 and torch.isfinite(w.grad).all()
    weight_casts = [a for op, a in forward.ops if op == "_to_copy" and a[0][1] == torch.float32 and a[0][0][-1] == dim
                    and a[0][0][0] in (256, vocab - 512)]
    assert len(weight_casts) == 3, weight_casts  # one per class tile, not one per (class tile, token tile)
    products = [a for op, a in forward.ops + backward.ops if op in ("mm", "bmm", "addmm")]
    assert products and all(dt == torch.bfloat16 for a in products for _, dt in a[-2:]), products
    # Launches: the ops that run a kernel (views and allocations left out, casts counted): a fixed number per tile
    # whatever T, M or the tiles' sizes (measured 415 and 261 here: 42 a fold, 80 a backward token tile with the
    # soft-cap's slope; each tile's ops batch all its tokens and draws).
    launches = [[op for op, _ in trace.ops if op not in FREE_OPS - {"_to_copy"}] for trace in (forward, backward)]
    assert len(launches[0]) <= 45 * 3 * 3 + 40 and len(launches[1]) <= 90 * 3 + 20, [len(x) for x in launches]
    assert backward.peak_big_float32 <= 1 and forward.peak_big_float32 == 0
