"""CounterRNG: uniform and independent-looking draws, exact categorical draws, state, and tracing."""

from __future__ import annotations

import math

import pytest
import torch

from conftest import ALPHA, assert_fits
from hf_midx.rng import CounterRNG, as_counter_rng


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_uniforms_fit_the_uniform_distribution(dtype):
    u = CounterRNG(3).rand(200_000, dtype=dtype)
    assert u.dtype == dtype and float(u.min()) >= 0.0 and float(u.max()) < 1.0
    bins = torch.bincount((u * 64).long(), minlength=64)
    assert_fits(bins, torch.full((64,), 1 / 64), f"uniform {dtype}")


def test_consecutive_pairs_fit_the_uniform_square():
    """Lag-1 pairs over an 8 x 8 grid: a weak counter hash would show as structure here."""
    u = CounterRNG(5).rand(2 * 100_000).view(-1, 2)
    cells = (u[:, 0] * 8).long() * 8 + (u[:, 1] * 8).long()
    assert_fits(torch.bincount(cells, minlength=64), torch.full((64,), 1 / 64), "pairs")


def test_seeds_give_unrelated_streams():
    """Two seeds' streams are uncorrelated: |r| below the alpha-level bound z / sqrt(n)."""
    n = 100_000
    a, b = CounterRNG(0).rand(n, dtype=torch.float64), CounterRNG(1).rand(n, dtype=torch.float64)
    r = float(torch.corrcoef(torch.stack([a, b]))[0, 1])
    z = float(torch.special.ndtri(torch.tensor(1 - ALPHA / 2, dtype=torch.float64)))
    assert abs(r) < z / math.sqrt(n), r


def test_categorical_fits_its_weights_and_never_draws_a_zero():
    w = torch.tensor([[0.5, 0.0, 3.0, 1.5, 0.0, 5.0]], dtype=torch.float64)
    draws = CounterRNG(7).categorical(w, 60_000)
    assert draws.shape == (1, 60_000)
    assert_fits(torch.bincount(draws.flatten(), minlength=6), w[0], "categorical")


def test_randint_covers_its_range():
    x = CounterRNG(9).randint(10, (50_000,))
    assert x.dtype == torch.int64 and int(x.min()) == 0 and int(x.max()) == 9
    assert_fits(torch.bincount(x, minlength=10), torch.full((10,), 0.1), "randint")


def test_state_restores_the_stream_and_rejects_foreign_states():
    rng = CounterRNG(11)
    rng.rand(17)
    state = rng.get_state()
    first = rng.rand(5)
    rng.set_state(state)
    assert torch.equal(rng.rand(5), first)
    assert torch.equal(CounterRNG(11).to("cpu").rand(3), CounterRNG(11).rand(3))
    with pytest.raises(ValueError, match=r"a \(2,\) int64 tensor"):
        rng.set_state(torch.Generator().get_state())  # a torch.Generator's uint8 state


def test_a_torch_generator_seeds_the_same_stream_every_time():
    default = CounterRNG(0)
    a = as_counter_rng(torch.Generator().manual_seed(4), default).rand(4)
    b = as_counter_rng(torch.Generator().manual_seed(4), default).rand(4)
    c = as_counter_rng(torch.Generator().manual_seed(5), default).rand(4)
    assert torch.equal(a, b) and not torch.equal(a, c)
    assert as_counter_rng(None, default) is default
    with pytest.raises(ValueError, match="generator must be"):
        as_counter_rng(3, default)


def test_draws_trace_without_graph_break_and_match_eager():
    torch._dynamo.reset()
    rng = CounterRNG(2)

    def f(w):
        return rng.categorical(w, 4), rng.rand(3)

    w = torch.rand(5, 7)
    start = rng.get_state()
    eager = f(w)
    rng.set_state(start)
    compiled = torch.compile(f, fullgraph=True, backend="aot_eager")(w)
    assert all(torch.equal(a, b) for a, b in zip(eager, compiled))
    assert int(rng.get_state()[1]) == 5 * 4 // 2 + (3 + 1) // 2  # two float32 uniforms per word
