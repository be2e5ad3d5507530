"""The refresh schedule of issue 54 on a clock of the test's own: the interval chosen from the measured cost
(the formula, its bounds), the fixed schedule and never, and the state that a checkpoint carries."""

from __future__ import annotations

import pytest
import torch

from hf_midx import MidxConfig
from hf_midx.integration.refresh_schedule import PROBE_STEPS, RECHOOSE_FACTOR, RefreshSchedule, cost_interval


class Clock:
    def __init__(self):
        self.now = 0.0

    def __call__(self):
        return self.now


def _run(schedule, clock, steps, step_seconds, rebuild_seconds, start=0):
    """Steps ``start+1 .. steps`` of ``step_seconds`` each, rebuilds of ``rebuild_seconds``; the steps rebuilt."""
    rebuilt = []
    for step in range(start + 1, steps + 1):
        clock.now += step_seconds
        schedule.choose(step)
        if schedule.due(step):
            clock.now += rebuild_seconds
            schedule.refreshed(step, rebuild_seconds)
            rebuilt.append(step)
    return rebuilt


def test_cost_interval_keeps_the_rebuilds_at_the_budget_within_the_bounds():
    # 2 s rebuilds, 0.1 s steps, 3%: N = ceil(2 * 0.97 / (0.03 * 0.1)) = 647, and 2 / (647 * 0.1 + 2) = 3.0%.
    n = cost_interval(2.0, 0.1, 0.03, 50, 1000)
    assert n == 647 and 2.0 / (n * 0.1 + 2.0) <= 0.03 < 2.0 / ((n - 1) * 0.1 + 2.0)
    assert cost_interval(0.01, 0.1, 0.03, 50, 1000) == 50
    assert cost_interval(60.0, 0.1, 0.03, 50, 1000) == 1000
    assert cost_interval(1.0, 0.0, 0.03, 50, 1000) == 1000


def test_auto_chooses_after_the_probe_steps_and_keeps_the_share_at_the_budget():
    clock = Clock()
    schedule = RefreshSchedule(MidxConfig(), clock=clock)
    schedule.start(0, rebuild_seconds=1.0, device=torch.device("cpu"))
    rebuilt = _run(schedule, clock, 2000, step_seconds=0.125, rebuild_seconds=1.0)  # exact binary fractions
    n = cost_interval(1.0, 0.125, 0.03, 50, 1000)  # 259
    assert schedule.interval == n and rebuilt == list(range(n, 2001, n))
    assert schedule.share() == pytest.approx(len(rebuilt) * 1.0 / (2000 * 0.125 + len(rebuilt)))
    assert schedule.share() <= 0.03
    # Rebuilds that turn dearer lengthen the interval (re-chosen after each rebuild).
    _run(schedule, clock, 3000, step_seconds=0.125, rebuild_seconds=3.0, start=2000)
    assert schedule.interval == cost_interval(3.0, 0.125, 0.03, 50, 1000)


def test_auto_keeps_its_interval_through_the_jitter_of_a_shared_machine():
    clock = Clock()
    schedule = RefreshSchedule(MidxConfig(), clock=clock)
    schedule.start(0, rebuild_seconds=1.0, device=torch.device("cpu"))
    first = _run(schedule, clock, 1000, step_seconds=0.125, rebuild_seconds=1.0)
    n = cost_interval(1.0, 0.125, 0.03, 50, 1000)  # 259
    # Rebuilds 1.3x dearer (the cost's interval 337, within the factor): the rebuilds stay on the same steps.
    assert cost_interval(1.3, 0.125, 0.03, 50, 1000) < n * RECHOOSE_FACTOR
    later = _run(schedule, clock, 3000, step_seconds=0.125, rebuild_seconds=1.3, start=1000)
    assert schedule.interval == n and first + later == list(range(n, 3001, n))
    # Steps 2x faster (the cost's interval 518, beyond it): re-chosen at the next rebuild.
    _run(schedule, clock, 4000, step_seconds=0.0625, rebuild_seconds=1.0, start=3000)
    assert schedule.interval == cost_interval(1.0, 0.0625, 0.03, 50, 1000) == 518
    assert schedule.share() <= 0.03 * RECHOOSE_FACTOR


def test_auto_leaves_the_first_step_out_of_the_timing():
    clock = Clock()
    schedule = RefreshSchedule(MidxConfig(), clock=clock)
    schedule.start(0, rebuild_seconds=1.0, device=torch.device("cpu"))
    clock.now += 30.0  # step 1: warm-up, compilation
    schedule.choose(1)
    for step in range(2, PROBE_STEPS + 1):
        clock.now += 0.125
        schedule.choose(step)
    assert schedule.interval == cost_interval(1.0, 0.125, 0.03, 50, 1000)


@pytest.mark.parametrize(("every", "rebuilt"), [(0, []), (7, [7, 14, 21, 28])])
def test_an_integer_keeps_the_fixed_schedule(every, rebuilt):
    clock = Clock()
    schedule = RefreshSchedule(MidxConfig(refresh_every_steps=every), clock=clock)
    schedule.start(0, rebuild_seconds=5.0, device=torch.device("cpu"))
    assert _run(schedule, clock, 30, step_seconds=0.1, rebuild_seconds=5.0) == rebuilt


def test_a_resumed_schedule_rebuilds_at_the_steps_of_an_uninterrupted_one():
    config = MidxConfig(refresh_min_steps=5, refresh_max_steps=40)
    clock = Clock()
    full = RefreshSchedule(config, clock=clock)
    full.start(0, rebuild_seconds=0.05, device=torch.device("cpu"))
    rebuilt = _run(full, clock, 100, step_seconds=0.1, rebuild_seconds=0.05)
    # Every 17 steps (ceil(0.05 * 0.97 / 0.003)). A checkpoint after step 50: the callback saves the last rebuild's step beside the schedule's state.
    first = RefreshSchedule(config, clock=Clock())
    first.start(0, rebuild_seconds=0.05, device=torch.device("cpu"))
    before = _run(first, first._clock, 50, step_seconds=0.1, rebuild_seconds=0.05)
    saved = {**first.state(), "last_refresh_step": str(first.last_refresh_step)}
    resumed = RefreshSchedule(config, clock=Clock())
    resumed.start(50, rebuild_seconds=0.05, device=torch.device("cpu"), saved=saved)
    after = _run(resumed, resumed._clock, 100, step_seconds=0.1, rebuild_seconds=0.05, start=50)
    assert before + after == rebuilt and len(rebuilt) >= 5, rebuilt
