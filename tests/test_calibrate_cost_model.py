"""recipes/benchmarks/calibrate_cost_model.py: the fit recovers constants it was given, reads the committed H200
profile as its table says, the model's calibrated constants are the committed fit's, and the committed errors on
the eight measured H200 steps the fit did not see are the rows' own."""

from __future__ import annotations

import json

import pytest

from recipes.benchmarks import calibrate_cost_model as calibrate
from recipes.benchmarks import cost_model

COMMITTED = calibrate.RESULTS / "cost-model-calibration/calibration.json"


def _launch(op, klass, nbytes, kernels=1):
    return {"op": op, "klass": klass, "bytes": nbytes, "kernels": kernels, "us": 0.0, "impl": klass, "flops": 0}


def test_the_fit_recovers_the_constants_that_made_the_times():
    floor, bw = 1.5, {"elementwise": 1.0e12, "gather": 2.0e12, "atomics": 0.5e12}
    launches = [_launch("mul", "elementwise", 4e6, 3), _launch("copy_", "elementwise", 1e6, 10),
                _launch("sub", "elementwise", 9e6, 2), _launch("index", "gather", 8e6, 4),
                _launch("index_add_", "atomics", 2e6, 2), _launch("nonzero", "host_sync", 1e3)]  # fmt: skip
    ops = {}
    for x in launches:
        calls, us = ops.get(x["op"], (0, 0.0))
        ops[x["op"]] = (calls + x["kernels"], us + x["kernels"] * floor + x["bytes"] / bw[x["klass"]] * 1e6
                        if x["klass"] in bw else us)  # fmt: skip
    ops = {k: v for k, v in ops.items() if v[1] > 0}
    fitted = calibrate.fit(launches, {"ops": ops, "launch_cpu_us": 7.0})
    machine = fitted["machine"]
    assert machine["kernel_floor_us"] == pytest.approx(floor, rel=1e-6)
    for klass, value in bw.items():
        assert machine["class_bandwidth"][klass] == pytest.approx(value, rel=1e-6)
    assert machine["class_bandwidth"]["triton"] == machine["class_bandwidth"]["gather"]  # the stated analog
    assert machine["launch_us"] == 7.0 and "assumed" in fitted["sources"]["class_bandwidth.triton"]


def test_the_profile_is_read_as_its_table_says():
    profile = calibrate.profile_rows()
    assert profile["ops"]["index_add_"] == pytest.approx((65, 3969.0), rel=1e-3)
    assert profile["ops"]["mm"] == pytest.approx((9, 207.4), rel=1e-3)  # a row of the table only, not the JSON
    assert profile["device_us"] == pytest.approx(11775.2, rel=1e-4) and profile["launches"] == 1027
    assert profile["launch_cpu_us"] == pytest.approx(6167 / 1027, rel=1e-3)


def test_the_model_holds_the_committed_fit_and_its_errors_on_the_unseen_steps():
    payload = json.loads(COMMITTED.read_text())
    assert calibrate.drifted(payload["fitted"]["machine"], cost_model.H200_CALIBRATED) == []
    rows = payload["validation"]
    assert len(rows) == 8 and all(r["measured ms"] for r in rows)
    worst = {k: max(max(r[f"{k} / measured"], 1 / r[f"{k} / measured"]) for r in rows) for k in ("peak", "calibrated")}
    assert payload["worst_error"] == pytest.approx(worst)  # what the docs quote


def test_a_graph_replay_drops_the_host_cost_and_nothing_else():
    x = cost_model.Launch("mul", "-", "draw", False, "", "elementwise", 10**6, 0, 3, 0.0, [], klass="elementwise")
    eager = cost_model.launch_us(x, cost_model.H200_CALIBRATED)
    replayed = cost_model.launch_us(x, cost_model.graph_replayed(cost_model.H200_CALIBRATED))
    assert eager - replayed == pytest.approx(3 * cost_model.H200_CALIBRATED["launch_us"])
    assert replayed == pytest.approx(10**6 / cost_model.H200_CALIBRATED["class_bandwidth"]["elementwise"] * 1e6
                                     + 3 * cost_model.H200_CALIBRATED["kernel_floor_us"])  # fmt: skip
    assert cost_model.exact_floor_ms(262144, 640, 8192) == pytest.approx(6 * 8192 * 262144 * 640 / 990e12 * 1e3)
