"""A training loop of the user's own (plain PyTorch, as Accelerate's) refreshes the index on the config's schedule
through :class:`hf_midx.RefreshScheduler`, and is told once when nothing ever refreshes it."""

from __future__ import annotations

import warnings

import pytest
import torch

from _models import VOCAB, markov_batches, tiny_model
import hf_midx
from hf_midx import MidxConfig
from hf_midx.integration.head import find_head

SMALL = dict(num_samples=16, codebook_size=8, kmeans_iters=2)


def _loop(model, steps, scheduler=None):
    """``steps`` SGD steps of the plain loop; the steps after which the index was rebuilt."""
    head, rebuilt, steps_done = find_head(model), [], [0]
    refresh = head.refresh
    head.refresh = lambda *a, **k: (rebuilt.append(scheduler.steps if scheduler else steps_done[0]), refresh(*a, **k))[1]
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    model.train()
    for batch in markov_batches(VOCAB, 2, 8, steps):
        model(input_ids=batch, labels=batch).loss.backward()
        opt.step()
        opt.zero_grad()
        steps_done[0] += 1
        if scheduler is not None:
            scheduler.step()
    return rebuilt


def test_a_plain_loop_refreshes_on_the_fixed_schedule_and_resumes_it():
    model = hf_midx.wrap(tiny_model("llama", seed=0), MidxConfig(refresh_every_steps=4, **SMALL))
    scheduler = hf_midx.RefreshScheduler(model)
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)  # scheduled: no "never rebuilt" warning
        warnings.filterwarnings("ignore", "exact_head='auto' needs class_counts|.*mix_static")
        assert _loop(model, 10, scheduler) == [4, 8]
    state = scheduler.state_dict()
    again = hf_midx.RefreshScheduler(model)
    again.load_state_dict(state)
    assert _loop(model, 6, again) == [12, 16]


def test_a_plain_loop_with_the_default_config_refreshes_at_the_interval_auto_chose():
    model = hf_midx.wrap(tiny_model("llama", seed=0), MidxConfig(**SMALL))  # refresh_every_steps="auto"
    scheduler = hf_midx.RefreshScheduler(model)
    config = find_head(model).config
    steps = 0
    while not scheduler.last_refresh_step and steps < config.refresh_max_steps + 1:
        steps += 1  # one at a time: the first rebuild is the loop's last step
        _loop(model, 1, scheduler)
    # The first rebuild comes at the interval chosen from the first steps' timings (a rebuild then re-chooses it):
    # within the bounds, as every later interval.
    assert config.refresh_min_steps <= scheduler.last_refresh_step == steps <= config.refresh_max_steps
    assert config.refresh_min_steps <= scheduler.schedule.interval <= config.refresh_max_steps


def test_a_loop_that_never_refreshes_is_told_once():
    model = hf_midx.wrap(tiny_model("llama", seed=0), MidxConfig(**SMALL))
    limit = find_head(model).config.refresh_min_steps
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        _loop(model, limit + 5)
    told = [w for w in caught if "nothing schedules its rebuilds" in str(w.message)]
    assert len(told) == 1 and "hf_midx.RefreshScheduler(model)" in str(told[0].message)
    # A loop that rebuilds on its own schedule (refresh_index) is not told.
    model = hf_midx.wrap(tiny_model("llama", seed=0), MidxConfig(**SMALL))
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for step, batch in enumerate(markov_batches(VOCAB, 2, 8, limit + 5), 1):
            model(input_ids=batch, labels=batch).loss.backward()
            opt.step()
            opt.zero_grad()
            if step % 20 == 0:
                hf_midx.refresh_index(model)
    assert not [w for w in caught if "nothing schedules its rebuilds" in str(w.message)]


def test_the_scheduler_refuses_what_it_cannot_schedule():
    with pytest.raises(ValueError, match="hf_midx.wrap"):
        hf_midx.RefreshScheduler(tiny_model("llama", seed=0))
