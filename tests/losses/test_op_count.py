"""The eager training step in few ATen ops, the same at every T (issue 36: at most 120 with the sampled tail
gradient; the default ``tail_gradient="auto"``, the expected tail gradient here, adds its own 19: at most 140;
issue 73's centered last stage, the default, adds the weighted draw inside a bucket (the frequency last stage's
9 ops: two gathers of the bucket's cumulative weights, a searchsorted and its clamps) and the queries' running
mean (3 ops): 130 and 148, limits 132 and 150).

On a GPU one ATen op is about one kernel launch, and a step made of hundreds of small ops is launch-bound.
``recipes/benchmarks/profile_head.py``'s :func:`count_ops` counts the leaf ops of the profiler's tree (so that
no op hides inside another), less views and allocations, over one steady-state forward + backward of the
default head, ``MidxLMHead`` as ``MidxConfig()`` builds it with class counts (the exact head on): the draw, the
loss and the step bookkeeping included. The count must not grow with T: no loop over token chunks at these
shapes (nor at the Gemma-3-270M shape, where ``profile_head.py --count`` gives the same figure).
"""

from __future__ import annotations

import pytest
import torch

import hf_midx
from recipes.benchmarks.profile_head import FREE_OPS, count_ops

MAX_OPS = 132
#: With the expected tail gradient: the draws' share, the proposal's factors, the bucket table (its chunks, their
#: buckets, the static row) and the expected part (18 ops: 148 in all with the centered last stage).
MAX_OPS_EXPECTED_TAIL = 150


def _default_head_step(num_tokens: int, num_classes: int = 3000, dim: int = 48, dtype=torch.float32, **changes):
    """A steady-state step function of the default head (every ``MidxConfig`` default but ``changes``, class
    counts given), its weight and hidden states of ``dtype``."""
    g = torch.Generator().manual_seed(0)
    counts = torch.randint(1, 1000, (num_classes,), generator=g).double()
    linear = torch.nn.Linear(dim, num_classes, bias=False).to(dtype)
    head = hf_midx.MidxLMHead(linear, hf_midx.MidxConfig(**changes), class_counts=counts)
    hidden = torch.randn(num_tokens, dim, generator=g, dtype=dtype).requires_grad_()
    labels = torch.multinomial(counts.float(), num_tokens, replacement=True, generator=g)
    labels[::9] = -100

    def step():
        hidden.grad = head.weight.grad = None
        head.loss(hidden, labels).backward()

    step()  # a warm-up, as training runs (the head makes no state at its first call: test_hot_path)
    return head, step


@pytest.mark.parametrize("tail, limit", [("sampled", MAX_OPS), ("auto", MAX_OPS_EXPECTED_TAIL)])
def test_default_head_step_is_few_ops_at_every_t(tail, limit):
    counts = {}
    for t in (64, 256):
        head, step = _default_head_step(t, tail_gradient=tail)
        assert head.exact_ids is not None and head.config.mix_weight > 0  # the default head, in full
        ops = count_ops(step)
        counts[t] = len(ops)
    assert counts[64] == counts[256] <= limit, counts


def test_the_counter_counts_leaves_and_not_views():
    """A matmul counts as its mm, a view or an allocation not at all, a logsumexp as the ops it runs."""
    x = torch.randn(8, 4)
    ops = count_ops(lambda: (x @ x.t()).view(-1).unsqueeze(0).clone(), package="test_op_count.py")
    assert [op for op, _ in ops] == ["mm", "copy_"]
    assert "view" in FREE_OPS and "empty" in FREE_OPS and "copy_" not in FREE_OPS
    assert len(count_ops(lambda: torch.logsumexp(x, 1))) > 1


def test_default_step_has_no_long_bag_and_one_new_vocabulary_sized_tensor():
    """What a GPU would serialize or pay in passes over the weight: no ``embedding_bag`` bag walks more than 4,096
    classes (CUDA gives a bag one thread per feature; the static row of all V classes was one bag), and one op of
    the step creates a new (V, D) tensor (the weight gradient, written once; the expected tail's spread is its
    first term, not a second tensor added to it)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    v, d = 16384, 12
    head, step = _default_head_step(64, num_classes=v, dim=d)
    bags, created = [], []

    class Trace(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            name = func.__name__.split(".")[0]
            if name in ("_embedding_bag", "_embedding_bag_forward_only"):
                index, offsets = args[1], args[2]
                last = index.shape[0] if not (len(args) > 7 and args[7]) else int(offsets[-1])  # include_last_offset
                bags.append(int(torch.diff(offsets, append=offsets.new_tensor([last])).max()))
            inputs = {a.untyped_storage().data_ptr() for a in args if isinstance(a, torch.Tensor)}
            for o in out if isinstance(out, (tuple, list)) else (out,):
                if isinstance(o, torch.Tensor) and tuple(o.shape) == (v, d) and o.untyped_storage().data_ptr() not in inputs:
                    created.append(name)
            return out

    with Trace():
        step()
    assert bags and max(bags) <= 4096, bags
    assert len(created) <= 1, created
