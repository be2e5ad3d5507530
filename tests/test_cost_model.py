"""recipes/benchmarks/cost_model.py: its launch list is the default step's real trace, and what serializes, uses
atomics or syncs the host is flagged.

The cost model traces the step under FakeTensorMode (no data) with a TorchDispatchMode and anomaly mode (to
attribute the backward's ops); here the same step runs for real (the fused kernels under the Triton interpreter)
and a plain dispatch counter, written here, lists what it launches: the two lists must be the same ops in the same
order, and the model's GEMM FLOPs must be torch's own FlopCounterMode's.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.flop_counter import FlopCounterMode

from recipes.benchmarks import cost_model
from recipes.benchmarks.profile_head import FREE_OPS
from _env import REPO, offline_env, skip_without_interpreter

pytest.importorskip("triton")
INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"


class _Count(TorchDispatchMode):
    """Op names that launch a kernel: not views or allocations, a conversion counted as its copy."""

    def __init__(self):
        super().__init__()
        self.names = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func._schema.name.split("::")[-1]
        name = name if func.namespace == "aten" else f"{func.namespace}.{name}"
        if func.namespace != "prim" and name not in FREE_OPS:
            self.names.append(name)
        elif name == "_to_copy":
            self.names.append("copy_")
        return func(*args, **(kwargs or {}))


@pytest.mark.skipif(INTERPRETED, reason="the parent of test_the_launch_list_is_the_real_steps_trace")
def test_interpreted_real_step():
    """The next test, in a child process whose Triton interprets (Triton reads TRITON_INTERPRET at import)."""
    skip_without_interpreter()
    child = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", f"{__file__}::test_the_launch_list_is_the_real_steps_trace"],
        cwd=REPO, env=offline_env(TRITON_INTERPRET="1"), capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert child.returncode == 0 and "1 passed" in child.stdout, child.stdout[-6000:] + child.stderr[-2000:]


@pytest.mark.skipif(not INTERPRETED, reason="runs in the TRITON_INTERPRET=1 child (test_interpreted_real_step)")
def test_the_launch_list_is_the_real_steps_trace():
    v, d, t = 3000, 48, 64
    projected = cost_model.project(v, d, t, dtype=torch.float32)  # fake tensors, as at the real shapes
    step, head, mode = cost_model.default_step(v, d, t, dtype=torch.float32, fake=False)
    assert mode is None and head.exact_ids is not None and head.config.tail_gradient == "auto"
    counter = _Count()
    with FlopCounterMode(display=False) as flops, counter:
        step()
    names = [op["op"] for op in projected["ops"]]
    assert names == counter.names
    assert projected["launches"] == len(counter.names)
    # the fused path: the draw (generator, buckets), the loss (forward, grad_hidden, grad_weight), the table (2)
    assert sum(n.startswith("hf_midx.") for n in names) == 7
    gemm = sum(op["flops"] for op in projected["ops"] if op["impl"].startswith("gemm"))
    assert gemm == flops.get_total_flops() > 0
    assert {op["part"] for op in projected["ops"]} >= {"draw", "candidate loss", "tail"}
    assert sum(p["launches"] for p in projected["parts"].values()) == len(names)


def _costs(step):
    return [cost_model.cost(op) for op in cost_model.trace(step)]


def test_a_long_bag_and_a_host_sync_are_flagged():
    v, d = 3 * cost_model.LONG_BAG, 8
    w = torch.randn(v, d)
    ids = torch.arange(v)
    one_bag = _costs(lambda: F.embedding_bag(ids, w, torch.zeros(1, dtype=torch.long), mode="sum"))
    (bag,) = [x for x in one_bag if x.impl == "embedding_bag"]
    assert bag.flags and "serial" in bag.flags[0] and f"{v:,}" in bag.flags[0]
    assert bag.us >= v * cost_model.H200["load_latency_us"]  # its loop: one entry after another
    short = _costs(lambda: F.embedding_bag(ids, w, torch.arange(0, v, 64), mode="sum"))
    assert [x.flags for x in short if x.impl == "embedding_bag"] == [[]]
    syncs = _costs(lambda: (w[:, 0] > 0).nonzero().sum().item())
    assert [x.op for x in syncs if x.flags] == ["nonzero", "_local_scalar_dense"]
    assert all(f.startswith("host sync") for x in syncs for f in x.flags)
    dup = _costs(lambda: torch.zeros(v, d).index_add_(0, torch.zeros(5, dtype=torch.long), torch.ones(5, d)))
    distinct = _costs(lambda: torch.zeros(v, d).index_add_(0, torch.arange(5), torch.ones(5, d)))
    assert [x.flags for x in dup if x.impl == "atomics"] == [["atomics: up to 5 adds to one row"]]
    assert [x.flags for x in distinct if x.impl == "atomics"] == [[]]


def test_a_host_sync_under_fake_tensors_says_so():
    from torch._subclasses.fake_tensor import FakeTensorMode

    mode = FakeTensorMode()
    with mode:
        x = torch.empty(16)
    with pytest.raises(ValueError, match="reads a result back to the host"):
        cost_model.trace(lambda: x.nonzero(), mode)


def test_a_gemm_runs_on_tensor_cores_in_bf16_only():
    a, b = torch.randn(64, 32), torch.randn(32, 128)
    (f32,) = _costs(lambda: a @ b)
    (bf16,) = [x for x in _costs(lambda: a.bfloat16() @ b.bfloat16()) if x.impl.startswith("gemm")]
    assert f32.flops == bf16.flops == 2 * 64 * 32 * 128
    assert f32.impl.startswith("gemm (float32, CUDA cores") and bf16.impl == "gemm (tensor cores)"
    assert f32.us == pytest.approx(max(f32.bytes / cost_model.H200["bandwidth_bytes_s"] * 1e6,
                                       f32.flops / cost_model.H200["cuda_core_fp32_flops"] * 1e6) + cost_model.H200["launch_us"])  # fmt: skip


def test_the_script_writes_its_table(tmp_path):
    before = os.environ.get("TRITON_INTERPRET")
    payload = cost_model.main(["--smoke", "--models", "gemma3-270m", "--out", str(tmp_path)])
    (shape,) = payload["shapes"]
    assert shape["projected_ms"] == pytest.approx(sum(p["ms"] for p in shape["parts"].values()))
    assert json.loads((tmp_path / "cost_model.json").read_text())["shapes"][0]["launches"] == shape["launches"]
    assert shape["floor_ms"] == cost_model.exact_floor_ms(shape["V"], shape["D"], shape["T"])
    assert shape["calibrated_graph_ms"] < shape["calibrated_ms"]  # the graph drops each launch's host time
    assert "calibrated: faster than the floor" in (tmp_path / "cost_model.md").read_text()
    assert os.environ.get("TRITON_INTERPRET") == before  # the fake trace's setting is undone


def test_a_frozen_head_projects_below_the_trainable_one_beside_the_4tvd_floor(tmp_path):
    """--frozen (issue 55): the frozen step has no weight-gradient launches, so it projects below the trainable one;
    the floor is 4 T V D FLOPs at the dense bf16 peak."""
    payload = cost_model.main(["--smoke", "--frozen", "--models", "gemma3-270m", "--out", str(tmp_path)])
    (s,) = payload["shapes"]
    assert s["frozen_launches"] < s["launches"] and s["frozen_projected_ms"] < s["projected_ms"]
    floor = 4 * s["T"] * s["V"] * s["D"] / cost_model.H200["tensor_core_flops"] * 1e3
    assert s["frozen_exact_floor_ms"] == pytest.approx(floor)
    assert "frozen exact floor" in (tmp_path / "cost_model.md").read_text()


def test_exact_forward_is_projected_in_bf16_products_beside_its_floor(tmp_path):
    """--exact_forward (issue 74, item 5): a policy call of float32 weights under bf16 autocast, no float32 GEMM,
    a bounded number of launches, projected above its 2 T V D floor."""
    payload = cost_model.main(["--smoke", "--exact_forward", "--models", "gemma3-270m", "--out", str(tmp_path)])
    (s,) = payload["shapes"]
    assert s["exact_forward_float32_products"] == 0 and 0 < s["exact_forward_launches"] < 1000
    assert s["exact_forward_projected_ms"] > s["exact_forward_floor_ms"] > 0
    assert "exact-forward" in (tmp_path / "cost_model.md").read_text()


def test_the_default_step_can_be_one_cuda_graph():
    """What a CUDA graph of the step needs, on the CPU: nothing read back to the host (the trace under fake tensors
    raises on a sync or a data-dependent shape) and the same launches on the same shapes whatever the data (the
    graph's static buffers and kernels are then valid at every step)."""
    v, d, t = 3000, 48, 64

    def signature(seed):
        ops = cost_model.project(v, d, t, dtype=torch.float32, seed=seed)["ops"]
        assert not [f for x in ops for f in x["flags"] if "host sync" in f]
        return [(x["op"], x["shapes"], x["kernels"]) for x in ops]

    assert signature(0) == signature(1)
