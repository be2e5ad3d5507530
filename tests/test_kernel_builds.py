"""recipes/benchmarks/kernel_builds.py: the default fused path's kernels build for every target users train on.

Each launch of the default path at the four LLM shapes and V = 2^20 (captured from the launch code) is built by
Triton's compiler and its bundled ptxas for sm_80, 86, 89, 90, 100 and 120 (no GPU needed); a build error, a
spill, more than 255 registers or shared memory over the target's limit fails the target's case; a target the
installed toolchain cannot build for is skipped with the reason. The distinct builds (they do not depend on
the shape; the head's bfloat16 and float32 variants apart) are made once for all cases, in one process a CPU;
Triton's on-disk cache keeps them.
"""

from __future__ import annotations

import os

import pytest

from recipes.benchmarks import kernel_builds

pytest.importorskip("triton", reason="the fused kernels need Triton (Linux x86_64 wheels)")
pytest.importorskip("triton.backends.nvidia", reason="Triton's CUDA backend is not installed")
pytestmark = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") == "1",
                                reason="a process whose Triton interprets cannot compile GPU kernels")


@pytest.fixture(scope="module")
def builds():
    return kernel_builds.run()


@pytest.mark.parametrize("cc", list(kernel_builds.TARGETS))
def test_default_kernels_build_without_spills(builds, cc):
    entry = builds["targets"][str(cc)]
    if "skipped" in entry:
        pytest.skip(f"sm_{cc}: {entry['skipped']}")
    bad = {f"{b['kernel']} ({b['config']})": b["problems"] for b in entry["builds"] if b["problems"]}
    assert not bad, bad
    every = set(kernel_builds.SHAPES)
    # The tail's bucket table serves the expected tail gradient, which a soft-capped head (Gemma-2) does not take.
    uncapped = {shape for shape, (_, _, softcap) in kernel_builds.SHAPES.items() if softcap is None}
    kernels = {"candidate_forward_kernel": every, "candidate_grad_hidden_kernel": every,
               "candidate_grad_weight_kernel": every, "candidate_long_runs_kernel": every,
               "counter_rand_kernel": every, "midx_draw_kernel": every,
               "bucket_partials_kernel": uncapped, "bucket_sums_kernel": uncapped}
    for kernel, shapes in kernels.items():
        built = {shape for b in entry["builds"] if b["kernel"] == kernel for shape in b["shapes"]}
        assert built == shapes, (kernel, built)
        # Each kernel for a bfloat16 head, a float32 one and a mixed-precision step's (a float32 weight, bf16 hidden).
        assert {d for b in entry["builds"] if b["kernel"] == kernel for d in b["dtypes"]} == set(kernel_builds.DTYPES)


def test_launches_are_captured_alike_for_every_target():
    """run() captures each shape once: the launches do not depend on the target the driver reports."""
    keys = [[launch.key() for launch in kernel_builds.default_launches("qwen2.5-0.5b", cc)] for cc in (80, 120)]
    # The loss's four kernels (the long runs' chunks before the weight gradient), the table's two, the draw's two.
    assert keys[0] == keys[1] and len(keys[0]) == 8


def test_occupancy_follows_the_calculator():
    """A100 (sm_80) and RTX 4090 (sm_89) at 8 warps: by registers, then by threads, then by shared memory."""
    a100, ada = kernel_builds.TARGETS[80], kernel_builds.TARGETS[89]
    assert kernel_builds.occupancy(a100, 64, 3072, 8)["programs_per_sm"] == 4  # 65,536 / (64 x 256)
    assert kernel_builds.occupancy(a100, 80, 3072, 8)["programs_per_sm"] == 3  # 80 x 32 -> 2,560 a warp: 25 warps
    assert kernel_builds.occupancy(ada, 32, 3072, 8)["programs_per_sm"] == 6  # 1,536 threads
    assert kernel_builds.occupancy(ada, 32, 40 * 1024, 8)["programs_per_sm"] == 2  # 100 KB / 41 KB
