"""The fused path's Triton kernels built for every GPU users train on, without a GPU (issue 51, item 3).

Each launch of the default fused path (``FusedCandidateLoss``'s forward and backward, the three kernels of
``hf_midx/losses/kernels/``, the tail's bucket table's two, and the MIDX draw's two: the counter generator and the
bucket draw) is captured at its real launch configuration, then built by Triton's own compiler and its bundled ptxas for each target, and the cubin's resources are read by the bundled ``cuobjdump``: registers a
thread, stack and local (spilled) bytes, shared memory a program, and the occupancy these allow on that target.

The capture runs the real launch code on the CPU under a stand-in Triton driver (``triton.runtime.driver
.set_active``) that reports the target, and ``knobs.runtime.jit_cache_hook``, which records each launch's
signature, constexprs, specialization (the divisibility by 16 Triton reads from every pointer and integer) and
options, then skips its compilation and launch: the kernels see exactly the arguments a GPU run passes. The
weight is an untouched ``torch.empty`` of the real (V, D) (no memory is written) and the tile sizes are those
``Blocks.choose`` picks at T = 8,192; the capture runs T = 16 tokens, which Triton specializes as it does 8,192
(both divisible by 16), so that the exact head's GEMMs stay cheap on a CPU. The default path has two kernel sets:
with the expected tail gradient (the bucket table's gradient spread in the weight-gradient kernel), and, for a
soft-capped head (Gemma-2), the sampled tail gradient with the soft-cap; each for a bfloat16 head, a float32 one,
and a mixed-precision step's (float32 weights under bf16 autocast: the kernels read the float32 weight and round its
tiles to the bfloat16 hidden states' dtype on chip, no copy of the weight). Each distinct (kernel, configuration,
target) is built once; Triton's on-disk cache keeps the builds for the next run.

Run: ``python recipes/benchmarks/kernel_builds.py --out recipes/benchmarks/results/kernel-builds`` (about two
minutes on 2 CPU cores cold, seconds with Triton's cache warm); ``--targets 90`` for some targets only.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import importlib
import json
import re
import subprocess
import sys
import tempfile
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

import torch

if __package__:
    from . import common
else:  # run as a file: this folder is first on sys.path
    import common

#: Tokens a step, as the issue's projections take it; the capture itself runs CAPTURE_TOKENS (see the docstring).
TOKENS = 8192
CAPTURE_TOKENS = 16
#: The shapes built: the four LLM heads and a 2^20-class one; Gemma-2's soft-cap (its final_logit_softcapping).
SHAPES = {name: (v, d, 30.0 if name == "gemma2-2b" else None) for name, (v, d) in common.MODEL_SHAPES.items()}
SHAPES["1m-1024"] = (1 << 20, 1024, None)
#: The head's dtypes built. bfloat16: a bfloat16 model; float32: pure float32 training (issue 68: its forward
#: spilled 32 B a thread on sm_80); mixed: float32 weights under bf16 autocast (the Trainer's bf16=True), whose
#: kernels read the float32 weight with bfloat16 hidden states (hf_midx.losses.precision; issue 74).
DTYPES = ("bfloat16", "float32", "mixed")


@dataclasses.dataclass(frozen=True)
class Target:
    """A CUDA architecture and the per-SM limits the occupancy needs (the CUDA C++ Programming Guide's table of
    technical specifications per compute capability): shared memory a block may opt in to and an SM holds,
    resident threads and blocks an SM. 64 K registers an SM and at most 255 a thread on all of them."""

    cc: int
    gpus: str
    shared_per_block: int
    shared_per_sm: int
    threads_per_sm: int
    blocks_per_sm: int


KB = 1024
TARGETS = {
    t.cc: t
    for t in (
        Target(80, "A100", 163 * KB, 164 * KB, 2048, 32),
        Target(86, "A10, RTX 3090", 99 * KB, 100 * KB, 1536, 16),
        Target(89, "L4, RTX 4090", 99 * KB, 100 * KB, 1536, 24),
        Target(90, "H100, H200", 227 * KB, 228 * KB, 2048, 32),
        Target(100, "B200", 227 * KB, 228 * KB, 2048, 32),
        Target(120, "RTX 5090", 99 * KB, 100 * KB, 1536, 32),
    )
}
MAX_REGISTERS = 255


# ====================================================================== capture
@dataclasses.dataclass(frozen=True)
class Launch:
    """One kernel launch as Triton would compile it: the kernel's module and name, and its compile arguments."""

    module: str
    kernel: str
    signature: dict
    constexprs: dict
    attrs: dict
    options: dict

    def key(self) -> str:
        """What makes two launches one build (the same kernel, types, constants, specialization and options)."""
        return json.dumps([self.kernel, self.signature, sorted(map(str, self.constexprs.items())),
                           sorted(map(str, self.attrs.items())), self.options], sort_keys=True)

    def config(self) -> str:
        """The launch's constexprs and warps, as the table prints them."""
        names = list(self.signature)
        consts = ", ".join(f"{names[k[0]]}={v}" for k, v in sorted(self.constexprs.items()))
        return f"{consts}, num_warps={self.options['num_warps']}, maxnreg={self.options['maxnreg']}"


class _TargetDriver:
    """A Triton driver that reports a target and launches nothing (the compile hook stops every launch first)."""

    def __init__(self, cc: int):
        from triton.backends.compiler import GPUTarget

        self.target = GPUTarget("cuda", cc, 32)

    def get_current_target(self):
        return self.target

    def get_current_device(self):
        return f"kernel-builds-sm{self.target.arch}"  # its own per-device cache in each JIT function

    def get_current_stream(self, device=None):
        return 0


@contextlib.contextmanager
def capturing(cc: int):
    """Within: every Triton launch is recorded (the list yielded) for target ``cc`` and neither built nor run."""
    from triton import knobs
    from triton.runtime.driver import driver

    launches = []

    def hook(*, fn, compile, **_):
        every = json.loads(compile["specialization_data"])["options"]  # the launch's options, all of them
        options = {k: every[k] for k in ("num_warps", "num_ctas", "num_stages", "enable_fp_fusion", "maxnreg")}
        launches.append(Launch(fn.module, fn.name, compile["signature"], compile["constants"], compile["configs"][0], options))
        return True  # skip the compilation (and so the launch)

    previous = knobs.runtime.jit_cache_hook
    driver.set_active(_TargetDriver(cc))
    knobs.runtime.jit_cache_hook = hook
    try:
        yield launches
    finally:
        knobs.runtime.jit_cache_hook = previous
        driver.set_active(None)  # back to the default driver, created when next asked for (none without a GPU)


def default_launches(shape: str, cc: int, dtype: str = "bfloat16") -> list[Launch]:
    """The launches of one default training step's candidate loss (forward and backward) at ``shape``, the head in
    ``dtype`` (one of :data:`DTYPES`), with the exact head, M and the codebooks of ``MidxConfig()`` and the tail
    gradient it takes there."""
    from hf_midx import MidxConfig
    from hf_midx.defaults import EXACT_HEAD_MAX
    from hf_midx.losses.kernels import FusedCandidateLoss
    from hf_midx.losses.kernels.blocks import Blocks
    from hf_midx.losses.loss import drops_accidental_hits
    from hf_midx.losses.tail_gradient import asks_closed_form
    from hf_midx.samplers.factors import ProposalFactors, proposal_factors_fixed

    num_classes, dim, softcap = SHAPES[shape]
    cfg = MidxConfig().for_vocabulary(num_classes)
    # exact_head="auto" picks H from the counts, at most min(EXACT_HEAD_MAX, V / 8): the bound, as on a Zipf corpus.
    h = cfg.exact_head if isinstance(cfg.exact_head, int) else min(EXACT_HEAD_MAX, num_classes // 8)
    t, m, b = CAPTURE_TOKENS, cfg.num_samples, cfg.codebook_size**2
    g = torch.Generator().manual_seed(0)
    weight_dtype, hidden_dtype = (torch.float32, torch.bfloat16) if dtype == "mixed" else (getattr(torch, dtype),) * 2
    weight = torch.empty(num_classes, dim, dtype=weight_dtype, requires_grad=True)  # never written
    hidden = torch.randn(t, dim, generator=g).to(hidden_dtype).requires_grad_()
    labels, ids = torch.randint(num_classes, (t,), generator=g), torch.randint(num_classes, (t, m), generator=g)
    log_q, log_q_pos = torch.randn(t, m, generator=g), torch.randn(t, generator=g)
    head = torch.arange(h) * (num_classes // h)  # (H,) sorted, distinct
    corrected = cfg.estimator == "corrected-positive"
    drops = drops_accidental_hits(cfg.remove_accidental_hits, cfg.estimator)
    tail = asks_closed_form(cfg.tail_gradient, cfg.negatives, drops, softcap)
    factors = None
    if tail:  # a MIDX proposal's factors with its unigram component; a few classes drawn keep the table cheap
        member, static = torch.zeros(num_classes), torch.zeros(num_classes)
        member[:64] = static[:64] = 1.0
        fields = proposal_factors_fixed(torch.randint(b, (num_classes,), generator=g), member, static, b)
        factors = ProposalFactors(torch.rand(t, b, generator=g), *fields)
    blocks = Blocks.choose(TOKENS, dim, m + 1, interpreted=False)
    with capturing(cc) as launches:
        out = FusedCandidateLoss.apply(
            hidden, weight, None, labels, ids, log_q, log_q_pos if corrected else None, head, -100, 1.0, softcap,
            corrected, drops, True, "mean", blocks, tail, factors,
        )
        loss = out[0] + out[2].sum() if tail else out
        loss.backward()
    # The MIDX draw's two kernels (the generator, the bucket draw) as midx-rq launches them, the bucket probabilities
    # written where the tail gradient reads them; the ops directly (their entry points want a CUDA tensor).
    from hf_midx.losses.kernels.draw import launch_options

    k = cfg.codebook_size
    u = torch.empty(4, t, m, dtype=torch.float64)
    with capturing(cc) as draw_launches:
        torch.ops.hf_midx.counter_rand(torch.zeros(2, dtype=torch.int64), u, [1024])
        torch.ops.hf_midx.midx_draw(
            torch.randn(t, 2 * k, generator=g), torch.zeros(b), u[0], torch.ones(b), torch.empty(t, m, dtype=torch.long),
            torch.empty(t, 1), torch.empty(t, b) if tail else None, launch_options(TOKENS, k, interpreted=False),
        )
    return draw_launches + launches


# ====================================================================== build
def toolchain_supports(cc: int) -> str | None:
    """None where the installed Triton and its bundled ptxas can build for ``cc``, else why not."""
    try:
        from triton.backends.nvidia.compiler import get_ptxas, sm_arch_from_capability
    except ImportError as e:
        return f"Triton's CUDA backend does not import ({e})"
    ptxas = get_ptxas(cc)
    usage = subprocess.run([ptxas.path, "--help"], capture_output=True, text=True).stdout
    arch = sm_arch_from_capability(cc)
    if f"'{arch}'" not in usage:
        return f"the bundled ptxas {ptxas.version} does not list {arch}"
    return None


def build(launch: Launch, cc: int) -> dict:
    """Build ``launch`` for ``cc`` with Triton's compiler and ptxas: registers, stack, local (spill) and shared
    bytes, and the occupancy on that target; "error" instead where the build fails."""
    import triton
    from triton import knobs
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    fn = getattr(importlib.import_module(launch.module), launch.kernel)  # the @triton.jit function launched
    try:
        binary = triton.compile(ASTSource(fn, launch.signature, launch.constexprs, launch.attrs),
                                target=GPUTarget("cuda", cc, 32), options=launch.options)
    except Exception as e:  # noqa: BLE001 (a build error is a result here)
        return {"error": f"{type(e).__name__}: {str(e)[:2000]}"}
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(binary.asm["cubin"])
        f.flush()
        usage = subprocess.run([knobs.nvidia.cuobjdump.path, "--dump-resource-usage", f.name],
                               capture_output=True, text=True, check=True).stdout
    res = {k: int(v) for k, v in re.findall(r"\b(REG|STACK|SHARED|LOCAL):(\d+)", usage)}
    shared = binary.metadata.shared + res.get("SHARED", 0)  # dynamic (Triton's) + static
    row = {"registers": res["REG"], "stack_bytes": res.get("STACK", 0), "spill_bytes": res.get("LOCAL", 0),
           "shared_bytes": shared, "num_warps": launch.options["num_warps"]}
    return {**row, **occupancy(TARGETS[cc], row["registers"], shared, row["num_warps"])}


def occupancy(target: Target, registers: int, shared: int, warps: int) -> dict:
    """Resident programs an SM and the share of its warp slots they fill, limited by registers (allocated 256 a
    warp, warps 4 at a time), shared memory (1 KB reserved per block) and threads, as the occupancy calculator."""
    per_warp = -(-registers * 32 // 256) * 256
    warps_by_regs = (65536 // per_warp) // 4 * 4
    blocks = min(warps_by_regs // warps, target.shared_per_sm // (shared + KB), target.threads_per_sm // (32 * warps),
                 target.blocks_per_sm)
    return {"programs_per_sm": blocks, "occupancy": round(blocks * warps * 32 / target.threads_per_sm, 3)}


def problems(row: dict, cc: int) -> list[str]:
    """What is wrong with one build: an error, a spill, registers over 255, shared memory over the target's."""
    if "error" in row:
        return [f"build failed: {row['error'][:500]}"]
    found = []
    if row["spill_bytes"] or row["stack_bytes"]:
        found.append(f"spills ({row['spill_bytes']} B local, {row['stack_bytes']} B stack a thread)")
    if row["registers"] > MAX_REGISTERS:
        found.append(f"{row['registers']} registers > {MAX_REGISTERS}")
    if row["shared_bytes"] > TARGETS[cc].shared_per_block:
        found.append(f"shared {row['shared_bytes']} B > {TARGETS[cc].shared_per_block} B")
    if not row["programs_per_sm"]:
        found.append("no program fits an SM")
    return found


def _build_one(args):
    return build(*args)


def run(targets=tuple(TARGETS), shapes=tuple(SHAPES), workers: int | None = None, dtypes=DTYPES) -> dict:
    """Capture every shape's launches for each supported target and build each distinct one once (in ``workers``
    processes, default one a CPU): {"targets": {cc: {"skipped": why} or {"builds": [...]}}, "shapes": ...}."""
    import triton

    out = {"settings": {"triton": triton.__version__, "torch": torch.__version__, "T": TOKENS, "dtypes": list(dtypes),
                        "capture_tokens": CAPTURE_TOKENS}, "targets": {}}
    supported = []
    for cc in targets:
        why = toolchain_supports(cc)
        if why:
            out["targets"][str(cc)] = {"gpus": TARGETS[cc].gpus, "skipped": why}
        else:
            supported.append(cc)
    # Captured once a shape and dtype: Triton's CUDA backend specializes the arguments alike for every target.
    captured = {(shape, dtype): default_launches(shape, supported[0], dtype)
                for shape in shapes for dtype in dtypes} if supported else {}
    jobs, where, which = {}, {}, {}
    for cc in supported:
        for (shape, dtype), launches in captured.items():
            for launch in launches:
                key = (launch.key(), cc)
                jobs.setdefault(key, (launch, cc))
                for found, value in ((where, shape), (which, dtype)):  # a launch alike for both dtypes is built once
                    if value not in found.setdefault(key, []):
                        found[key].append(value)
    keys = list(jobs)
    if workers == 1 or len(keys) < 2:
        rows = [build(*jobs[k]) for k in keys]
    else:
        with ProcessPoolExecutor(workers) as pool:
            rows = list(pool.map(_build_one, [jobs[k] for k in keys]))
    for key, row in zip(keys, rows):
        launch, cc = jobs[key]
        entry = out["targets"].setdefault(str(cc), {"gpus": TARGETS[cc].gpus, "builds": []})
        entry["builds"].append({"kernel": launch.kernel, "config": launch.config(), "shapes": where[key],
                                "dtypes": which[key], **row, "problems": problems(row, cc)})
    return out


# ====================================================================== tables
def markdown(result: dict) -> str:
    s = result["settings"]
    lines = [
        "# The fused kernels built for each GPU target (no GPU: Triton's compiler, its ptxas and cuobjdump)", "",
        f"Triton {s['triton']}, torch {s['torch']}; the default path's launches at T = {s['T']:,}, the head in "
        f"{', '.join(s['dtypes'])} (mixed: float32 weights read by the kernels with bfloat16 hidden states, the "
        "step under bf16 autocast), "
        "captured from the launch code (see `recipes/benchmarks/kernel_builds.py`). Shared: bytes a program; "
        "occupancy: resident warps / the SM's warp slots. Regenerate: "
        "`python recipes/benchmarks/kernel_builds.py --out recipes/benchmarks/results/kernel-builds`.", "",
        "| target | GPUs | kernel | dtypes | configuration | shapes | registers | spill B | shared B | programs / SM "
        "| occupancy | problems |",
        "|---|---|---|---|---|---|---:|---:|---:|---:|---:|---|",
    ]
    for cc, entry in result["targets"].items():
        if "skipped" in entry:
            lines.append(f"| sm_{cc} | {entry['gpus']} | skipped: {entry['skipped']} | | | | | | | | | |")
            continue
        for b in entry["builds"]:
            build_row = f"| sm_{cc} | {entry['gpus']} | {b['kernel']} | {', '.join(b['dtypes'])} | `{b['config']}` "
            if "error" in b:
                lines.append(build_row + f"| {', '.join(b['shapes'])} | | | | | | {'; '.join(b['problems'])} |")
                continue
            lines.append(
                build_row + f"| {', '.join(b['shapes'])} | {b['registers']} | {b['spill_bytes'] + b['stack_bytes']} "
                f"| {b['shared_bytes']:,} | {b['programs_per_sm']} | {b['occupancy']:.0%} "
                f"| {'; '.join(b['problems']) or 'none'} |"
            )
    return "\n".join(lines) + "\n"


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)  # fmt: skip
    p.add_argument("--out", default="recipes/benchmarks/results/kernel-builds", help="folder for the JSON and Markdown")
    p.add_argument("--targets", type=int, nargs="+", default=list(TARGETS), choices=list(TARGETS),
                   help="compute capabilities to build for")
    p.add_argument("--workers", type=int, default=None, help="build processes (default: one a CPU)")
    args = p.parse_args(argv)
    result = run(tuple(args.targets), workers=args.workers)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "kernel_builds.json").write_text(json.dumps(result, indent=1) + "\n")
    (out / "kernel_builds.md").write_text(markdown(result))
    print(markdown(result))
    bad = [(cc, b["kernel"], b["problems"]) for cc, e in result["targets"].items() for b in e.get("builds", [])
           if b["problems"]]
    if bad:
        print(f"problems: {bad}", file=sys.stderr)
    return result


if __name__ == "__main__":
    main()
