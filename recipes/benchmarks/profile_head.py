"""Where the time of one sampled-head step goes: a torch.profiler table of the top ops.

The head is ``MidxLMHead`` as ``MidxConfig()`` configures it (every default but the seed), over a random (V, D)
weight, on T random hidden states with Zipfian labels; the step is loss forward + backward, the same
step ``bench_head.py`` times as ``midx-default``. After warm-up steps, ``--steps`` steps run under ``torch.profiler``
(CPU, plus CUDA on a GPU), and the ops are listed by self time. Writes ``OUT/profile_head.md`` and
``OUT/profile_head.json``.

``--count`` counts instead what one step launches: :func:`count_ops`, the ATen leaf ops of the profiler's
tree less views and allocations (about one kernel launch each on a GPU), by hf_midx function; on the CPU
this is the figure of issue 36 (at most 120, the same at every T).

Run: ``python recipes/benchmarks/profile_head.py --out bench-out [--device cuda] [--model gemma3-270m] [--count]``.
"""

from __future__ import annotations

import collections

import torch

import hf_midx

if __package__:
    from . import common
else:  # run as a file: this folder is first on sys.path
    import common

NAME = "profile_head"

#: Ops that launch no kernel: views, allocations, and the conversions that return their input (a real
#: conversion's copy is its child ``copy_``, which counts). Decided once for every op count of the project.
FREE_OPS = frozenset({
    "empty", "empty_strided", "empty_like", "new_empty", "new_empty_strided", "resize_", "view", "reshape",
    "_reshape_alias", "as_strided", "expand", "expand_as", "detach", "detach_", "alias", "_unsafe_view", "t",
    "transpose", "unsqueeze", "squeeze", "select", "slice", "permute", "narrow", "view_as", "lift_fresh", "unbind",
    "split", "split_with_sizes", "chunk", "diagonal", "unfold", "to", "_to_copy", "contiguous", "resolve_conj",
    "resolve_neg",
})


def count_ops(step, package: str = "hf_midx/") -> list[tuple[str, str]]:
    """The ATen ops one call of ``step()`` runs, as (op, where) pairs: the leaves of the profiler's op tree
    once the :data:`FREE_OPS` are taken out, so that no op hides inside another (``matmul`` counts as its
    ``mm``, ``logsumexp`` as the ops it runs); ``where`` is the innermost function of ``package`` on the
    Python stack ("file(line): function"), "autograd" for the ops of torch's own backward formulas."""
    cpu = [torch.profiler.ProfilerActivity.CPU]
    with torch.profiler.profile(activities=cpu, with_stack=True) as prof:
        step()
    ops = []

    def walk(node, where) -> bool:  # True when node or one of its descendants counted
        if node.tag.name == "PyCall" and package in node.name:
            where = node.name.split(package, 1)[1]
        counted = False
        for child in node.children:
            counted |= walk(child, where)
        if not counted and node.tag.name == "TorchOp" and node.name.startswith("aten::"):
            if node.name[6:] not in FREE_OPS:
                ops.append((node.name[6:], where))
                return True
        return counted

    for root in prof.profiler.kineto_results.experimental_event_tree():
        walk(root, "autograd")
    return ops


def count_table(ops: list[tuple[str, str]]) -> str:
    """A markdown table of :func:`count_ops`'s pairs by function, with each function's ops."""
    rows = collections.defaultdict(collections.Counter)
    for op, where in ops:
        rows[where][op] += 1
    lines = ["| where | ops | which |", "|:--|--:|:--|"]
    for where, c in sorted(rows.items(), key=lambda kv: -sum(kv[1].values())):
        which = ", ".join(f"{op} {n}" if n > 1 else op for op, n in c.most_common())
        lines.append(f"| {where} | {sum(c.values())} | {which} |")
    return "\n".join(lines + [f"| total | {len(ops)} | |"])


def parse_args(argv=None):
    p = common.base_parser(__doc__.splitlines()[0])
    p.add_argument("--model", default="gemma3-270m", choices=list(common.MODEL_SHAPES), help="head shape (V, D)")
    p.add_argument("--tokens", type=int, default=None, help="T (default 8192 on a GPU, 2048 on CPU)")
    p.add_argument("--steps", type=int, default=5, help="profiled steps")
    p.add_argument("--top", type=int, default=20, help="ops listed")
    p.add_argument("--count", action="store_true", help="count the ATen ops of one step (count_ops) instead")
    return common.parse(p, argv)


def main(argv=None) -> dict:
    args = parse_args(argv)
    device = common.resolve_device(args.device)
    v, d = common.MODEL_SHAPES[args.model]
    if args.smoke:
        v, d = max(2048, v // 64), max(32, d // 32)
    t = args.tokens or (256 if args.smoke else 8192 if device.type == "cuda" else 2048)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    gen = torch.Generator().manual_seed(args.seed)
    counts = common.zipf_counts(v, generator=gen)
    labels = common.zipf_labels(counts, t, gen).to(device)
    weight = torch.nn.Parameter((torch.randn(v, d, generator=gen) * d**-0.5).to(device=device, dtype=dtype))
    hidden = torch.randn(t, d, generator=gen).to(device=device, dtype=dtype).requires_grad_()
    linear = torch.nn.Linear(d, v, bias=False, device="meta")
    linear.weight = weight
    config = hf_midx.MidxConfig(seed=args.seed)
    head = hf_midx.MidxLMHead(linear, config, class_counts=counts)
    env, settings = common.start(NAME, args, device, model=args.model, V=v, D=d, T=t, dtype=str(dtype), config=config.to_dict())

    def step():
        hidden.grad = weight.grad = None
        head.loss(hidden, labels).backward()

    for _ in range(3):
        step()
    common.sync(device)
    if args.count:
        ops = count_ops(step)
        md = common.report("ATen ops of one sampled-head step (forward + backward), less views and allocations", env,
                           settings, count_table(ops))
        by_function = collections.Counter(where for _, where in ops)
        return common.finish(args, NAME, env, settings, md, op_count=len(ops), ops_by_function=dict(by_function))
    activities = [torch.profiler.ProfilerActivity.CPU]
    if device.type == "cuda":
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    with torch.profiler.profile(activities=activities) as prof:
        for _ in range(args.steps):
            step()
        common.sync(device)
    sort_by = "self_cuda_time_total" if device.type == "cuda" else "self_cpu_time_total"
    table = prof.key_averages().table(sort_by=sort_by, row_limit=args.top)
    events = sorted(prof.key_averages(), key=lambda e: getattr(e, "self_device_time_total", 0) or e.self_cpu_time_total,
                    reverse=True)  # fmt: skip
    ops = [{"op": e.key, "calls": e.count // args.steps, "self_cpu_us_per_step": e.self_cpu_time_total / args.steps,
            "self_device_us_per_step": getattr(e, "self_device_time_total", 0) / args.steps} for e in events[: args.top]]  # fmt: skip
    columns = [("op", "op"), ("calls per step", "calls"),
               ("self CPU", lambda o: f"{o['self_cpu_us_per_step'] / 1e3:.3f} ms"),
               ("self device", lambda o: f"{o['self_device_us_per_step'] / 1e3:.3f} ms")]  # fmt: skip
    md = common.report("One sampled-head step (forward + backward), top ops", env, settings,
                       f"Per step (mean of {args.steps}), by self time:", "", common.markdown_table(ops, columns), "",
                       f"torch.profiler's table ({args.steps} steps, sorted by {sort_by}):", "", "```", table, "```")  # fmt: skip
    return common.finish(args, NAME, env, settings, md, ops=ops)

if __name__ == "__main__":
    main()
