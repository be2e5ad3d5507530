"""The fused candidate-loss kernels (hf_midx.losses.kernels) against the eager loss on the same draws.

The Triton kernels run on the CPU in Triton's interpreter, in a child process started with
``TRITON_INTERPRET=1``: Triton reads it when each ``@triton.jit`` function is decorated (its own
standard library included, at ``import triton``), and a process whose Triton was imported interpreted
can no longer compile GPU kernels, which other tests of the suite may need. So this module runs
twice: here, the float64 reference checks, the compile check for sm_90 and one test that runs this
file again in the child; there, the interpreted kernels. Each case compares the loss and the
gradients of hidden, weight and bias with :func:`hf_midx.sampled_softmax_loss` given the very same
drawn ids, and with a float64 ground truth: fp32 within float32 rounding, bf16 no worse than the
eager bf16 loss is itself (as Cut Cross-Entropy's tests measure it). The interpreter runs one program
at a time in Python: the shapes are small (T 64-256, V a few thousand) and the cases few.
"""

from __future__ import annotations

import collections
import math
import os
import subprocess
import sys

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from hf_midx import build_sampler, sampled_softmax_loss
from hf_midx.losses.kernels import FusedCandidateLoss, candidate_loss, candidate_loss_reference, triton_available
from hf_midx.losses.kernels.blocks import Blocks
from hf_midx.rng import CounterRNG

from _env import REPO, offline_env, skip_without_interpreter

INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"
needs_triton = pytest.mark.skipif(not triton_available(), reason="the fused kernels need Triton (Linux x86_64 wheels)")
interpreted = pytest.mark.skipif(
    not INTERPRETED, reason="runs in the TRITON_INTERPRET=1 child (test_interpreted_kernels)"
)
compiled = pytest.mark.skipif(INTERPRETED, reason="runs in the parent process, whose Triton compiles")


def run_interpreted(test_file: str) -> None:
    """Run a test file in a child process whose Triton interprets (see the module docstring); fail with its output."""
    skip_without_interpreter()
    child = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", test_file],
        cwd=REPO, env=offline_env(TRITON_INTERPRET="1"), capture_output=True, text=True, timeout=600,
    )
    print(child.stdout[-2000:])
    assert child.returncode == 0, child.stdout[-6000:] + child.stderr[-2000:]


@compiled
@needs_triton
def test_interpreted_kernels():
    """This file again, in a child process whose Triton interprets."""
    run_interpreted(__file__)


class FixedDraws:
    """A proposal stub with the hot-path methods the loss calls, returning given draws: the eager loss then
    sees the fused path's ids."""

    def __init__(self, num_classes, ids, log_q, log_q_pos, exclude):
        self.num_classes, self.excluded = num_classes, exclude  # exclude: sorted (H,) ids or None
        self.ids, self.log_q, self.log_q_pos = ids, log_q, log_q_pos.unsqueeze(1)

    def draw(self, queries, num_samples, generator=None):
        return self.ids, self.log_q

    def draw_scored(self, queries, num_samples, ids, generator=None):
        return self.ids, self.log_q, self.log_q_pos

    def draw_with_factors(self, queries, num_samples, ids=None, generator=None):
        # No closed form of the proposal (the table is the test's): the loss keeps the sampled tail gradient.
        return self.ids, self.log_q, None if ids is None else self.log_q_pos, None


Case = collections.namedtuple("Case", "hidden weight bias labels ids log_q log_q_pos head")


def make_case(t, v, d, m, h, *, dtype=torch.float32, bias=True, seed=0, ignored=0.1, in_head=0.15, hits=0.05):
    """Inputs and draws from a fixed random proposal over the classes outside the (H,) head: some tokens
    ignored, some labels in the head, some draws equal to the label (accidental hits)."""
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(t, d, generator=g)
    weight = torch.randn(v, d, generator=g) / math.sqrt(d) * 2.0
    b = 0.5 * torch.randn(v, generator=g) if bias else None
    head = torch.sort(torch.randperm(v, generator=g)[:h]).values
    p = torch.rand(v, generator=g) + 0.05
    p[head] = 0.0
    log_p = (p / p.sum()).log()
    labels = torch.multinomial(p, t, replacement=True, generator=g)
    if h:
        pick = torch.rand(t, generator=g) < in_head
        labels[pick] = head[torch.randint(h, (int(pick.sum()),), generator=g)]
    y = labels.clone()
    labels[torch.rand(t, generator=g) < ignored] = -100
    y[labels == -100] = 0  # the loss scores ignored tokens as class 0
    ids = torch.multinomial(p, t * m, replacement=True, generator=g).view(t, m)
    hit = (torch.rand(t, m, generator=g) < hits) & (log_p[y] > -math.inf).unsqueeze(1)
    ids = torch.where(hit, y.unsqueeze(1), ids)
    cast = (lambda x: None if x is None else x.to(dtype).requires_grad_(True))
    return Case(cast(hidden), cast(weight), cast(b), labels, ids, log_p[ids], log_p[y], head if h else None)


def run(fn, case, **kwargs):
    """(loss, grad hidden, grad weight, grad bias) of fn(case), all float64, gradients of loss.sum()."""
    for x in (case.hidden, case.weight, case.bias):
        if x is not None:
            x.grad = None
    loss = fn(case, **kwargs)
    loss.sum().backward()
    grads = [x.grad.double() if x is not None else None for x in (case.hidden, case.weight, case.bias)]
    return [loss.detach().double(), *grads]


def fused(case, blocks=None, **kw):
    if blocks is not None:  # the autograd Function itself, with given tile sizes
        hidden = case.hidden.to(case.weight.dtype)
        return FusedCandidateLoss.apply(
            hidden, case.weight, case.bias, case.labels, case.ids, case.log_q.float(),
            case.log_q_pos.float() if kw.get("corrected_positive", True) else None, case.head, -100,
            kw.get("logit_scale", 1.0), kw.get("logit_softcap"), kw.get("corrected_positive", True),
            kw.get("remove_accidental_hits", False), kw.get("exact_value", True), kw.get("reduction", "mean"), blocks,
            kw.get("tail_control", False), kw.get("factors"),
        )
    return candidate_loss(
        case.hidden, case.weight, case.labels, case.ids, case.log_q, case.log_q_pos, bias=case.bias,
        head_ids=case.head, backend="fused", **kw,
    )


def fixed_draws(case):
    return FixedDraws(case.weight.shape[0], case.ids, case.log_q, case.log_q_pos, case.head)


def eager(case, logit_scale=1.0, logit_softcap=None, corrected_positive=True, remove_accidental_hits=False,
          exact_value=True, reduction="mean", sampler=None):
    """hf_midx.sampled_softmax_loss with the case's draws; the logit scale as the head applies it."""
    sampler = sampler or fixed_draws(case)
    hidden, bias = case.hidden, case.bias
    if logit_scale != 1.0:
        hidden, bias = hidden * logit_scale, None if bias is None else bias * logit_scale
    return sampled_softmax_loss(
        hidden, case.weight, case.labels, sampler, case.ids.shape[1], bias=bias, logit_softcap=logit_softcap,
        estimator="corrected-positive" if corrected_positive else "exact-positive",
        remove_accidental_hits=remove_accidental_hits, reduction=reduction, exact_ids=sampler.excluded,
        check_labels=False, exact_value=exact_value,
    )


def truth(case, **kw):
    """The reference in float64 on the same (rounded) input values."""
    wide = Case(*[x.detach().double().requires_grad_(True) if isinstance(x, torch.Tensor) and x.is_floating_point()
                  and x.requires_grad else x for x in case])
    return run(reference, wide, **kw)


def reference(case, logit_scale=1.0, logit_softcap=None, corrected_positive=True, remove_accidental_hits=False,
              exact_value=True, reduction="mean", tail_control=False, factors=None):
    return candidate_loss_reference(
        case.hidden, case.weight, case.labels, case.ids, case.log_q, case.log_q_pos, bias=case.bias,
        head_ids=case.head, ignore_index=-100, logit_scale=logit_scale, logit_softcap=logit_softcap,
        corrected=corrected_positive, drop_hits=remove_accidental_hits, exact_value=exact_value, reduction=reduction,
        tail_control=tail_control, factors=factors,
    )


def rel_err(x, ref):
    """max |x - ref| / max |ref| (0 for two absent gradients)."""
    if ref is None:
        return 0.0
    return float((x - ref).abs().max() / ref.abs().max().clamp_min(1e-30))


def check_fp32(got, want, tol=2e-5):
    for name, x, ref in zip(("loss", "grad hidden", "grad weight", "grad bias"), got, want):
        assert (x is None) == (ref is None), name
        assert rel_err(x, ref) < tol, f"{name}: relative error {rel_err(x, ref):.2e} >= {tol:.0e}"


def check_no_worse(got, eager_got, want, ulp=2.0 ** -8):
    """bf16: the fused error against the float64 truth at most the eager bf16 path's (plus one bf16 ulp of the
    largest value, the rounding of a stored result)."""
    for name, x, e, ref in zip(("loss", "grad hidden", "grad weight", "grad bias"), got, eager_got, want):
        if ref is None:
            continue
        assert rel_err(x, ref) <= 1.25 * rel_err(e, ref) + ulp, (
            f"{name}: fused error {rel_err(x, ref):.2e}, eager {rel_err(e, ref):.2e}"
        )


# ------------------------------------------------------------------------------------------ the reference
@pytest.mark.parametrize(
    "options",
    [
        dict(exact_value=False),
        dict(logit_softcap=5.0, reduction="sum", exact_value=False),
        dict(corrected_positive=False, remove_accidental_hits=True, reduction="none", exact_value=False),
        dict(remove_accidental_hits=True, exact_value=False),
        dict(reduction="none"),  # the value estimate
    ],
)
def test_reference_is_the_eager_loss_in_float64(options):
    """The kernels' reference computes what sampled_softmax_loss computes on the same draws (which keeps its
    logits in float32 whatever the input dtype: hence a float32 tolerance on float64 inputs)."""
    case = make_case(97, 1000, 24, 9, 40, dtype=torch.float64)
    check_fp32(run(reference, case, **options), run(eager, case, **options), tol=1e-6)


# ------------------------------------------------------------------------------------------ fused, interpreted
@interpreted
def test_default_head_fp32():
    """The default training head: corrected positive, accidental hits kept, the exact-loss estimate as the
    value, exact head, bias, mean; odd T."""
    case = make_case(203, 3001, 48, 20, 64)
    got = run(fused, case)
    check_fp32(got, truth(case), tol=1e-5)
    check_fp32(got, run(eager, case))


@interpreted
def test_default_head_bf16():
    case = make_case(160, 2500, 64, 20, 64, dtype=torch.bfloat16, seed=1)
    got, want = run(fused, case, exact_value=False), truth(case, exact_value=False)
    check_no_worse(got, run(eager, case, exact_value=False), want)
    assert got[2].abs().sum() > 0 and torch.isfinite(got[2]).all()


@interpreted
@pytest.mark.parametrize(
    "shape, options",
    [
        # Gemma-2's soft cap and a Cohere-style logit scale, sum.
        ((128, 2048, 32, 20, 48), dict(logit_softcap=3.0, logit_scale=0.5, reduction="sum", exact_value=False)),
        # The paper's estimator without a head or bias: hits dropped, per-token losses, odd D and M.
        ((64, 1531, 37, 7, 0), dict(corrected_positive=False, remove_accidental_hits=True, reduction="none",
                                    exact_value=False)),
    ],
)
def test_options_fp32(shape, options):
    t, v, d, m, h = shape
    case = make_case(t, v, d, m, h, bias=h > 0, seed=2)
    got = run(fused, case, **options)
    check_fp32(got, run(eager, case, **options))
    check_fp32(got, truth(case, **options), tol=1e-5)


@interpreted
@pytest.mark.parametrize("blocks", [None, Blocks(t=16, d=16, h=16, v=64, p=16)])
def test_tail_control_gives_each_draw_its_share_back(blocks):
    """tail_control (the expected tail gradient's sampled part): the share per token and the gradients
    equal the reference's; without it the gradients differ."""
    case = make_case(90, 1200, 32, 8, 40, seed=6)
    got = {}
    for name, fn, kw in (("fused", fused, dict(blocks=blocks)), ("reference", reference, {}),
                         ("plain", fused, dict(blocks=blocks, tail_control=False))):
        for x in (case.hidden, case.weight, case.bias):
            x.grad = None
        out = fn(case, **{"tail_control": True, "reduction": "sum", **kw})
        loss, share = out if isinstance(out, tuple) else (out, None)
        loss.backward()
        got[name] = [loss.detach().double(), *(x.grad.double() for x in (case.hidden, case.weight, case.bias))]
        got[name + "_share"] = share
    check_fp32(got["fused"], got["reference"], tol=1e-5)
    torch.testing.assert_close(got["fused_share"], got["reference_share"], rtol=1e-5, atol=1e-7)
    assert got["fused_share"].min() >= 0 and got["fused_share"].max() <= 1 and got["fused_share"].sum() > 0
    assert float(got["fused"][0]) == float(got["plain"][0])  # the value is untouched
    assert rel_err(got["plain"][2], got["fused"][2]) > 1e-3


def tail_factors(case, num_buckets, static=True, seed=0):
    """Random :class:`~hf_midx.samplers.factors.ProposalFactors` of a proposal with ``num_buckets`` buckets (0: a
    static one, probs None) over the case's classes, the exact head's at weight 0 in every row, some classes never
    drawn by the bucket terms."""
    from hf_midx.samplers.factors import ProposalFactors, proposal_factors_fixed, static_factors

    g = torch.Generator().manual_seed(seed)
    (t, _), v = case.hidden.shape, case.weight.shape[0]
    bucket = torch.randint(max(num_buckets, 1), (v,), generator=g)
    member = torch.rand(v, generator=g) * (torch.rand(v, generator=g) > 0.2)
    weight = torch.rand(v, generator=g) / v if static or not num_buckets else None
    if case.head is not None:
        member[case.head] = 0.0
        if weight is not None:
            weight[case.head] = 0.0
    if not num_buckets:  # B = 0: the static row is the only one
        return static_factors(weight)
    fixed = proposal_factors_fixed(bucket, member, weight, num_buckets)
    probs = torch.softmax(torch.randn(t, num_buckets, generator=g), 1)
    return ProposalFactors(probs, *fixed)


def tail_step(case, loss_fn, factors, **kw):
    """The expected tail gradient's step as the loss takes it: the candidate loss with the draws' share given back
    and the weight's bucket table, then the expected part through that table (no spread of its own when fused)."""
    from hf_midx.losses.tail_gradient import expected_share

    if factors.probs is not None and case.weight.dtype == torch.float64:
        factors = factors._replace(probs=factors.probs.double())
    loss, share, table = loss_fn(case, tail_control=True, factors=factors, **kw)
    return expected_share(loss, share, factors, case.hidden, case.weight, case.bias, table=table)


@interpreted
@pytest.mark.parametrize(
    "dtype, shape, buckets, static, blocks",
    [
        # Odd V and D, small tiles: classes past V in the last program, partial D tiles, several pair steps; the
        # heavy class's run (3 T pairs and more) split into chunks of 16 (issue 74, item 6).
        (torch.float32, (64, 1001, 37, 8, 16), 5, True, Blocks(t=16, d=16, h=16, v=64, p=4, vd=16, run=16)),
        (torch.float32, (48, 700, 24, 6, 0), 3, False, None),  # no static row, no exact head, no bias
        (torch.float32, (40, 513, 20, 5, 8), 0, True, Blocks(t=16, d=16, h=16, v=32, p=2, vd=8, run=4)),  # B = 0
        (torch.bfloat16, (64, 1001, 48, 8, 16), 5, True, None),
        (torch.bfloat16, (64, 1001, 40, 8, 16), 4, False, Blocks(t=16, d=16, h=16, v=64, p=4, vd=16, run=8)),
    ],
)
def test_weight_gradient_writes_the_tail_spread_once(dtype, shape, buckets, static, blocks):
    """The weight-gradient kernel with the tail's spread (each class starts at member G[bucket] + static G[B]):
    the whole step's loss and gradients against the float64 truth; most classes without a pair, one class drawn
    3 T times, classes past V in the last program, D not a power of two. Where ``blocks.run`` is small the long
    runs are split: their chunks summed in parallel first, then added in order by the class's program."""
    t, v, d, m, h = shape
    case = make_case(t, v, d, m, h, dtype=dtype, bias=h > 0, seed=8)
    heavy = int(torch.isin(torch.arange(v), case.head, invert=True).nonzero()[3]) if h else 3
    case = case._replace(ids=case.ids.clone())
    case.ids[:, :3] = heavy
    factors = tail_factors(case, buckets, static)
    got = run(tail_step, case, loss_fn=lambda c, **kw: fused(c, blocks=blocks, **kw), factors=factors)
    wide = Case(*[x.detach().double().requires_grad_(True) if isinstance(x, torch.Tensor) and x.is_floating_point()
                  and x.requires_grad else x for x in case])
    want = run(tail_step, wide, loss_fn=reference, factors=factors)
    pairs = torch.bincount(torch.cat([case.labels.clamp_min(0).view(-1, 1), case.ids], 1).view(-1), minlength=v)
    assert (pairs == 0).sum() > v // 3 and pairs.max() >= 3 * t  # the shapes the kernel is tested at
    eager_got = run(tail_step, case, loss_fn=reference, factors=factors)  # the eager path in the same dtype
    print(f"\n{dtype}, (T, V, D, M, H) = {shape}, B = {buckets}, static: {static}: errors against float64 (loss, "
          f"grad hidden, grad weight, grad bias), fused {[f'{rel_err(x, r):.1e}' for x, r in zip(got, want)]}, "
          f"eager {[f'{rel_err(x, r):.1e}' for x, r in zip(eager_got, want)]}")
    if dtype == torch.float32:
        check_fp32(got, want, tol=1e-5)
    else:
        check_no_worse(got, eager_got, want)
    other = run(tail_step, wide, loss_fn=reference, factors=tail_factors(case, buckets, static, seed=1))
    assert rel_err(got[2], other[2]) > 1e-3  # the spread is in the weight's gradient


class OpArgs(TorchDispatchMode):
    """The arguments of each call of one op, by its name."""

    def __init__(self, name):
        super().__init__()
        self.name, self.calls = name, []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func._schema.name == self.name:
            self.calls.append([a.clone() if isinstance(a, torch.Tensor) else a for a in args])
        return func(*args, **(kwargs or {}))


@interpreted
def test_weight_gradient_walks_only_pairs_with_a_gradient():
    """Labels in the exact head (the most frequent classes: the longest runs) give their gradient through the head's
    GEMMs, and ignored tokens have none: the weight-gradient kernel's runs leave both out, so every head class has an
    empty run (they are never drawn) and the walked pairs are the valid tokens' draws and labels outside the head."""
    case = make_case(96, 900, 16, 6, 24, seed=10, in_head=0.4)
    with OpArgs("hf_midx::candidate_grad_weight") as seen:
        run(fused, case)
    starts = seen.calls[0][3].long()
    runs = starts[1:] - starts[:-1]
    in_head = torch.isin(case.labels, case.head)
    valid = case.labels != -100
    assert int(in_head.sum()) > 20 and int((~valid).sum()) > 0
    assert int(runs[case.head].sum()) == 0
    assert int(starts[-1]) == int(valid.sum()) * 6 + int((valid & ~in_head).sum())  # the draws, labels outside H


@interpreted
def test_small_tiles_cover_every_mask():
    """Tiles smaller than every dimension: several programs, partial D / head / class / pair blocks."""
    case = make_case(70, 500, 40, 5, 20, seed=3)
    blocks = Blocks(t=16, d=16, h=16, v=64, p=16)
    got = run(fused, case, blocks=blocks, logit_softcap=4.0, reduction="none")
    check_fp32(got, truth(case, logit_softcap=4.0, reduction="none"), tol=1e-5)


@interpreted
def test_int32_ids_and_all_ignored():
    case = make_case(64, 800, 32, 6, 16, seed=4)
    case = case._replace(labels=case.labels.int(), ids=case.ids.int())
    check_fp32(run(fused, case, exact_value=False),
               run(eager, case._replace(labels=case.labels.long(), ids=case.ids.long()), exact_value=False))
    case = case._replace(labels=torch.full_like(case.labels, -100))
    loss, *grads = run(fused, case)
    assert loss.item() == 0.0 and all(bool((g == 0).all()) for g in grads)


def noncontiguous(x):
    """x's values in a view that is not contiguous (every other element of a buffer twice as wide along the last
    dim, so that a matrix's rows are strided too), a leaf that requires grad where x does."""
    wide = torch.zeros(*x.shape[:-1], 2 * x.shape[-1], dtype=x.dtype)
    view = wide[..., ::2]
    view.copy_(x.detach())
    return view.requires_grad_(x.requires_grad)


def sampled_fused(case, **kw):
    """hf_midx.sampled_softmax_loss on the case's draws through the fused kernels."""
    return sampled_softmax_loss(case.hidden, case.weight, case.labels, fixed_draws(case), case.ids.shape[1],
                                bias=case.bias, exact_ids=case.head, check_labels=False, kernels="fused", **kw)


@interpreted
@pytest.mark.parametrize(
    "loss, name",
    [(fused, name) for name in Case._fields] + [(sampled_fused, name) for name in ("hidden", "weight", "bias", "labels",
                                                                                   "head")],
    ids=lambda x: x if isinstance(x, str) else x.__name__,
)
def test_a_strided_argument_is_read_as_its_contiguous_copy(loss, name):
    """Every tensor argument of the public losses as a strided view (stride 2; a matrix's rows strided too) gives
    the loss and gradients of its contiguous copy, bit for bit: before, the kernels read labels and bias with
    stride 1 (a stride-2 labels view moved this case's summed loss)."""
    case = make_case(64, 1000, 32, 8, 32, seed=3)
    want = run(loss, case, reduction="sum")
    got = run(loss, case._replace(**{name: noncontiguous(getattr(case, name))}), reduction="sum")
    print(f"\n{loss.__name__}, strided {name}: summed loss {float(got[0]):.4f}, contiguous {float(want[0]):.4f}")
    for what, x, ref in zip(("loss", "grad hidden", "grad weight", "grad bias"), got, want):
        assert torch.equal(x, ref), what


@interpreted
def test_float16_head_gradient_does_not_overflow():
    """The exact head's weight gradient sums g_head[t] hidden[t] over the T tokens: in float16 before the mean's
    1 / T, that sum overflows 65,504 where every label is one head class (g ~ -1) and the hidden states are 3.0
    (T = 32,768: -inf before). The eager path's autograd scales before its sum; so must the kernels' backward."""
    t, v, d, h, m = 32768, 64, 16, 16, 1
    g = torch.Generator().manual_seed(0)
    hidden = torch.full((t, d), 3.0, dtype=torch.float16, requires_grad=True)
    weight = (0.1 * torch.randn(v, d, generator=g)).half().requires_grad_(True)
    head = torch.arange(h)
    labels = torch.zeros(t, dtype=torch.long)
    ids = torch.randint(h, v, (t, m), generator=g)
    log_q = torch.full((t, m), -math.log(v - h))
    log_q_pos = torch.full((t,), -math.inf)  # labels in the head: the proposal never draws them
    case = Case(hidden, weight, None, labels, ids, log_q, log_q_pos, head)
    got = run(fused, case)
    want = truth(case)
    print(f"\nfloat16 grad_weight[0, 0]: fused {float(got[2][0, 0]):.4f}, float64 {float(want[2][0, 0]):.4f}")
    assert torch.isfinite(got[2]).all()
    check_fp32(got, want, tol=2e-3)  # float16 rounding of the stored gradients


@interpreted
def test_midx_draws():
    """Draws of the default MIDX proposal (its own log q, labels' log q from the same evaluation)."""
    case = make_case(96, 1200, 32, 20, 32, seed=5)
    counts = torch.randint(1, 50, (1200,)).double()
    sampler = build_sampler("midx-rq", case.weight.detach(), codebook_size=8, class_counts=counts, exclude=case.head,
                            kmeans_iters=3, mix_weight=0.5)
    y = torch.where(case.labels == -100, torch.zeros_like(case.labels), case.labels)
    queries = case.hidden.detach().float()
    ids, log_q, log_q_pos = sampler.draw_scored(queries, 20, y.unsqueeze(1), generator=CounterRNG(7))
    drawn = case._replace(ids=ids, log_q=log_q, log_q_pos=log_q_pos.squeeze(1))
    got = run(fused, drawn, exact_value=True)

    def eager_midx(c):  # the loss draws for itself, from the same counter
        return sampled_softmax_loss(c.hidden, c.weight, c.labels, sampler, 20, bias=c.bias, exact_ids=sampler.excluded,
                                    generator=CounterRNG(7), check_labels=False, tail_gradient="sampled")

    check_fp32(got, run(eager_midx, case))


@interpreted
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_counter_rand_is_the_eager_stream(dtype):
    """counter_rand gives CounterRNG.rand's numbers bit for bit and moves the state as it does."""
    from hf_midx.losses.kernels import counter_rand

    eager_rng, fused_rng = CounterRNG(1234), CounterRNG(1234)
    for n in (1001, 1, 0, 4096 + 7):  # odd counts leave a half-used word behind, as rand does
        assert torch.equal(counter_rand(fused_rng._state, n, dtype), eager_rng.rand(n, dtype=dtype))
        assert torch.equal(fused_rng.get_state(), eager_rng.get_state())


@interpreted
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("static", [True, False], ids=["static", "buckets-only"])
def test_fused_bucket_table_is_the_eager_table(monkeypatch, dtype, static):
    """The tail's bucket table in two launches (each chunk's rows read once, float32 partials, each bucket its own
    chunks, row B every chunk's static part) against the eager embedding_bag table and the float64 product S @ W:
    chunks cut small, so buckets span several chunks and padding chunks follow; empty buckets; a strided weight."""
    from hf_midx.losses.kernels.table import fused_bucket_table
    from hf_midx.losses.tail_gradient import bucket_table
    from hf_midx.samplers import factors as factors_module

    monkeypatch.setattr(factors_module, "CHUNK", 16)
    g = torch.Generator().manual_seed(4)
    v, d, b = 1000, 37, 12
    bucket = torch.randint(b - 2, (v,), generator=g)  # buckets b - 2 and b - 1 stay empty
    bucket[:300] = 0  # a bucket of 19 chunks
    member = torch.rand(v, generator=g) * (torch.rand(v, generator=g) > 0.2)
    weights = torch.rand(v, generator=g) / v if static else None
    fixed = factors_module.proposal_factors_fixed(bucket, member, weights, b)
    layout = fixed[3]
    assert layout.chunks[1].shape[0] == (2 if static else 1) * (b + v // 16)  # padding chunks at the end
    factors = factors_module.ProposalFactors(None, *fixed)
    wide = torch.randn(v, d + 5, generator=g)
    weight = wide[:, :d].to(dtype)  # a row-major slice: rows read through their stride
    got = fused_bucket_table(factors, weight)
    dense = torch.zeros(b + 1, v, dtype=torch.float64)
    dense[bucket, torch.arange(v)] = member.double()
    if static:
        dense[b] = weights.double()
    want = dense @ weight.double()
    eager = bucket_table(factors, weight)
    assert got.dtype == torch.float32 and got.shape == (b + 1, d)
    assert torch.all(got[b - 2 : b] == 0) and (static or torch.all(got[b] == 0))
    tol = 1e-5 if dtype == torch.float32 else 1e-6  # float32 sums of the same bfloat16 rows: no wider error
    err, eager_err = (got.double() - want).abs().max(), (eager.double() - want).abs().max()
    print(f"\n{dtype}, static {static}: max |error| against float64: fused {err:.2e}, eager {eager_err:.2e}")
    assert err <= tol * want.abs().max() + 1e-6 and err <= eager_err + 1e-6


@interpreted
@pytest.mark.parametrize("options", [{}, {"last_stage": "frequency", "mix_weight": 0.1}, {"last_stage": "centered"}],
                         ids=["uniform", "mixture", "centered"])  # fmt: skip
def test_fused_draw_is_the_eager_draw(options):
    """The MIDX draw with kernels="fused" (the generator and the bucket draw in Triton) against the eager one from the
    same stream: the same draws but where a target falls within a rounding of a bucket boundary (the scan sums in
    another order), log q and the factors within float32 rounding, the stream advanced alike."""
    from hf_midx.samplers.midx import MidxRQSampler

    g = torch.Generator().manual_seed(3)
    v, d, t, m = 3000, 16, 256, 20
    counts = torch.randint(1, 100, (v,), generator=g)
    emb = torch.randn(v, d, generator=g)
    sampler = MidxRQSampler(emb, codebook_size=16, class_counts=counts, exclude=torch.arange(50), **options)
    queries = torch.randn(t, d, generator=g) * 2
    labels = torch.randint(50, v, (t, 1), generator=g)
    eager_rng, fused_rng = CounterRNG(5), CounterRNG(5)
    for step in range(2):
        if step == 1 and sampler.last_stage == "centered":  # the first draws' mean query enters the tables
            sampler.refresh(emb)
        eager = sampler.draw_with_factors(queries, m, labels, generator=eager_rng)
        fused = sampler.draw_with_factors(queries, m, labels, generator=fused_rng, kernels="fused")
        same = eager[0] == fused[0]
        assert same.float().mean() >= 0.999, same.float().mean()
        torch.testing.assert_close(fused[1][same], eager[1][same], rtol=0, atol=1e-5)
        torch.testing.assert_close(fused[2], eager[2], rtol=0, atol=1e-5)
        torch.testing.assert_close(fused[3].probs, eager[3].probs, rtol=1e-5, atol=1e-7)
        assert torch.equal(fused_rng.get_state(), eager_rng.get_state())
    # Nothing excluded or out of range is drawn, and every draw's bucket is a non-empty one.
    assert not torch.isin(fused[0], torch.arange(50)).any() and int(fused[0].max()) < v


@interpreted
def test_fused_draw_keeps_the_eager_draw_beyond_its_codebook_bound(monkeypatch):
    """K * K above MAX_BUCKETS: kernels="fused" draws eagerly (no launch); a bad kernels name raises."""
    from hf_midx.losses.kernels.draw import MAX_BUCKETS, fits
    from hf_midx.samplers.midx import MidxRQSampler

    assert fits(64) and not fits(65) and MAX_BUCKETS == 4096
    launches = launched_kernels(monkeypatch)
    g = torch.Generator().manual_seed(0)
    sampler = MidxRQSampler(torch.randn(400, 8, generator=g), codebook_size=80, kmeans_iters=1)
    sampler.draw_with_factors(torch.randn(4, 8, generator=g), 3, kernels="fused")
    assert launches == []
    with pytest.raises(ValueError, match="kernels must be 'eager' or 'fused'"):
        sampler.draw_with_factors(torch.randn(4, 8), 3, kernels="triton")


def test_fused_draw_validates_its_inputs():
    """midx_bucket_draw's shapes and dtypes, checked before anything runs (no Triton needed to raise)."""
    from hf_midx.losses.kernels.draw import midx_bucket_draw

    s, lm, u = torch.zeros(4, 8), torch.zeros(16), torch.rand(4, 3, dtype=torch.float64)
    with pytest.raises(ValueError, match=r"scores must be \(T, 2K\) float32"):
        midx_bucket_draw(s.double(), lm, u)
    with pytest.raises(ValueError, match="K \\* K <= 4096"):
        midx_bucket_draw(torch.zeros(4, 130), torch.zeros(65 * 65), u)
    with pytest.raises(ValueError, match=r"log_mass must be \(16,\) float32"):
        midx_bucket_draw(s, torch.zeros(15), u)
    with pytest.raises(ValueError, match=r"u must be \(T, M\) = \(4, M\) float64"):
        midx_bucket_draw(s, lm, u.float())
    with pytest.raises(ValueError, match=r"share must be \(16,\) float32"):
        midx_bucket_draw(s, lm, u, torch.zeros(16, dtype=torch.float64))


# ------------------------------------------------------------------------------------------ entry point
@interpreted
def test_validation_and_backend_choice(monkeypatch):
    case = make_case(8, 50, 4, 3, 0, bias=False)
    args = (case.hidden, case.weight, case.labels, case.ids, case.log_q, case.log_q_pos)
    with pytest.raises(ValueError, match="log_q_pos"):
        candidate_loss(*args[:5])
    with pytest.raises(ValueError, match="ids must be"):
        candidate_loss(case.hidden, case.weight, case.labels, case.ids[:, :0], case.log_q[:, :0], case.log_q_pos)
    with pytest.raises(ValueError, match="backend"):
        candidate_loss(*args, backend="cuda")
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(ValueError, match="TRITON_INTERPRET=1"):
        candidate_loss(*args, backend="fused")
    # "auto" on CPU tensors is the eager reference.
    torch.testing.assert_close(candidate_loss(*args), reference(case))


@compiled
def test_without_triton_the_fused_backend_says_so(monkeypatch):
    from hf_midx.losses.kernels import candidate, launch

    for module in (candidate, launch):  # "auto"'s choice, and check_fused's refusal
        monkeypatch.setattr(module, "triton_available", lambda: False)
    case = make_case(8, 50, 4, 3, 0, bias=False)
    args = (case.hidden, case.weight, case.labels, case.ids, case.log_q, case.log_q_pos)
    with pytest.raises(ValueError, match="needs Triton"):
        candidate_loss(*args, backend="fused")
    torch.testing.assert_close(candidate_loss(*args), reference(case))  # "auto": the reference


@compiled
def test_eager_backend_traces_without_graph_breaks():
    """On the CPU ("auto" picks the reference) candidate_loss is one graph for torch.compile."""
    case = make_case(64, 500, 16, 5, 8, seed=7)

    def loss(hidden, weight, bias):
        return candidate_loss(hidden, weight, case.labels, case.ids, case.log_q, case.log_q_pos, bias=bias,
                              head_ids=case.head)

    explained = torch._dynamo.explain(loss)(case.hidden, case.weight, case.bias)
    assert (explained.graph_count, explained.graph_break_count) == (1, 0), explained.break_reasons


# ------------------------------------------------------------------------------------------ what the GPU runs
@compiled
def test_kernels_compile_for_sm90():
    """The real compiler (no GPU needed) types the kernels more strictly than the interpreter does."""
    triton = pytest.importorskip("triton", reason="the fused kernels need Triton (Linux x86_64 wheels)")
    pytest.importorskip("triton.backends.nvidia", reason="Triton's CUDA backend is not installed")
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from hf_midx.losses.kernels import _candidate_triton as k
    from hf_midx.losses.kernels import _counter_triton as c

    types = dict(
        hidden_ptr="*bf16", weight_ptr="*bf16", bias_ptr="*bf16", labels_ptr="*i64", ids_ptr="*i64", log_q_ptr="*fp32",
        log_q_pos_ptr="*fp32", head_ids_ptr="*i64", head_raw_ptr="*bf16", loss_ptr="*fp32", rows_ptr="*i32",
        g_cand_ptr="*fp32", g_head_ptr="*fp32", gscale_ptr="*fp32", base_ptr="*bf16", out_ptr="*bf16",
        starts_ptr="*i32", order_ptr="*i64", grad_weight_ptr="*bf16", grad_bias_ptr="*bf16", stats_ptr="*fp32",
        grad_table_ptr="*fp32", grad_static_ptr="*fp32", bucket_ptr="*i64", member_ptr="*fp32", static_ptr="*fp32",
        scale="fp32", softcap="fp32", state_ptr="*i64", share_ptr="*fp32", keys_ptr="*i32", partial_ptr="*fp32",
        partial_bias_ptr="*fp32",
    )
    b = Blocks.choose(8192, 640, 21, interpreted=False)  # what a GPU runs at the Gemma-3-270M shape, M = 20
    kernels = [
        (k.candidate_forward_kernel, dict(HAS_BIAS=True, SOFTCAP=True, CORRECTED=True, DROP_HITS=True, EXACT_VALUE=True,
                                          TAIL_CONTROL=True, SEARCH_STEPS=12, BLOCK_T=b.t, BLOCK_R=32, BLOCK_D=b.d, BLOCK_H=b.h)),
        (k.candidate_grad_hidden_kernel, dict(HAS_BASE=True, BLOCK_T=b.t, BLOCK_R=32, BLOCK_D=b.d)),
        (k.candidate_grad_weight_kernel, dict(HAS_BIAS=True, HAS_TABLE=True, HAS_STATIC=True, LONG_RUNS=True,
                                              RUN=b.run, BLOCK_V=b.v, BLOCK_P=b.p, BLOCK_D=b.vd)),
        (k.candidate_long_runs_kernel, dict(HAS_BIAS=True, RUN=b.run, BLOCK_K=b.run, BLOCK_P=32, BLOCK_D=b.vd)),
        (c.counter_rand_kernel, dict(F64=False, BLOCK=1024)),
        (c.counter_rand_kernel, dict(F64=True, BLOCK=1024)),
    ]
    for fn, constants in kernels:
        own = dict(types, out_ptr="*fp64" if constants.get("F64") else "*fp32") if "F64" in constants else types
        signature = {n: "constexpr" if n in constants else own.get(n, "i32") for n in fn.arg_names}
        binary = triton.compile(
            ASTSource(fn, signature, constants), target=GPUTarget("cuda", 90, 32),
            options={"num_warps": b.warps, "enable_fp_fusion": True},
        )
        assert binary.asm["cubin"], fn.__name__


# ------------------------------------------------------------------------------------------ launches
class OpCounter(TorchDispatchMode):
    """ATen ops by name (one op is about one GPU kernel launch)."""

    def __init__(self):
        super().__init__()
        self.ops = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops[func._schema.name.split("::")[-1]] += 1
        return func(*args, **(kwargs or {}))


_FREE = {"view", "_unsafe_view", "t", "transpose", "unsqueeze", "squeeze", "expand", "alias", "slice", "select",
         "as_strided", "detach", "empty", "empty_like", "empty_strided", "_to_copy", "reshape",
         # the torch.library ops that wrap the Triton launches, which are counted as launches
         "candidate_forward", "candidate_grad_hidden", "candidate_grad_weight", "midx_draw", "counter_rand",
         "bucket_partials", "bucket_sums"}


def launched_kernels(monkeypatch) -> list[str]:
    """The list to which every Triton launch from now on appends its kernel's name (interpreter only)."""
    from triton.runtime import interpreter

    launches = []
    call = interpreter.GridExecutor.__call__

    def counted(self, *args, **kwargs):
        launches.append(self.fn.__name__)
        with torch.utils._python_dispatch._disable_current_modes():  # the interpreter's own copies are not ops
            return call(self, *args, **kwargs)

    monkeypatch.setattr(interpreter.GridExecutor, "__call__", counted)
    return launches


def count_ops(fn, case, monkeypatch):
    """(ATen ops, of which neither views nor allocations, Triton launches, sync ops) of one forward + backward."""
    launches = launched_kernels(monkeypatch)
    run(fn, case)  # warm-up (imports, caches)
    launches.clear()
    for x in (case.hidden, case.weight, case.bias):
        x.grad = None  # else the backward's accumulation into .grad counts
    with OpCounter() as counter:
        loss = fn(case)
        loss.backward()
    ops = counter.ops
    # _to_copy of a float32 tensor to float32 is free; a real cast is not: counted below by dtype would need the
    # tensors, so casts count as ops unless the tensor was already of that dtype (none are on the fp32 path).
    total = sum(ops.values())
    real = sum(n for name, n in ops.items() if name not in _FREE)
    syncs = sum(ops[name] for name in ("_local_scalar_dense", "nonzero", "item"))
    return total, real, len(launches), syncs


@interpreted
def test_fused_path_is_few_launches(monkeypatch):
    """One forward + backward of the default head: ATen ops plus Triton launches, against the eager loss."""
    case = make_case(128, 2000, 32, 20, 64, seed=6)
    f_total, f_real, f_launch, f_sync = count_ops(lambda c: fused(c, exact_value=True), case, monkeypatch)
    sampler = fixed_draws(case)  # built outside the count: the loss's own ops only
    e_total, e_real, _, _ = count_ops(lambda c: eager(c, exact_value=True, sampler=sampler), case, monkeypatch)
    print(f"\nfused: {f_total} ATen ops ({f_real} not views/allocations) + {f_launch} Triton launches; "
          f"eager sampled_softmax_loss: {e_total} ATen ops ({e_real} not views/allocations)")
    # Four launches: the forward, grad_hidden, and the weight gradient's two (the long runs' chunks first, issue 74).
    assert f_launch == 4 and f_sync == 0
    assert f_real + f_launch <= 21 and f_real + f_launch < e_real / 3
