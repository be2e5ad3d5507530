"""The default head's step on one GPU against the exact fused losses, with the cost model's projection beside it.

One section per call (``gpu_step.sh`` runs them in this order, each under its own time limit, so that the
window's first minutes bring back the most telling figures):

* ``micro``: ``embedding_bag`` with one bag of V entries against the same weighted sum as a GEMV (and against the
  same entries in 1,024 bags): whether CUDA's one-thread-per-(bag, feature) loop makes the long bag serial;
* ``parts``: the default step at the Gemma-3-270M shape: its plain time, then each launch timed (CUDA events
  around every op of the cost model's trace) and summed per part (draw, candidate loss, tail, bookkeeping) beside
  the projection of the same launches;
* ``head``: head + loss, forward + backward, bf16, T = 8,192, at Gemma-3-270M, Qwen2.5-0.5B, Llama-3-8B, Gemma-2-2B
  and V = 1,048,576 x D = 1,024: the default head (``MidxConfig()``) with its projection (peak and calibrated),
  the same step replayed as CUDA graphs (``midx-default/cuda-graph``, checked against the eager step), Cut Cross-Entropy
  (``cut_cross_entropy.linear_cross_entropy``), Liger (``LigerFusedLinearCrossEntropyLoss``), torch's
  ``F.linear_cross_entropy`` (torch >= 2.13) and TRL's chunked loss (``trl.kernels.ChunkedLogProbFunction``, what
  its SFT trainer's default "nll" loss runs, with its chunk of 32,768 classes);
* ``train``: a Gemma-3-270M-sized training step (``bench_e2e``'s model, batch 4 x 2,048, bf16, AdamW) with the
  body compiled (``torch.compile`` of the decoder), one model for every case: each exact loss from the decoder's
  hidden states, the default head through ``hf_midx.wrap``, and the plain model (full logits);
* ``merge``: every section's rows in ``gpu_step.json`` and ``gpu_step.md``.

Every head row carries the exact floor (6 T V D FLOPs at 990 TFLOP/s) and the table its ratio to the floor. A
competitor that does not import (or needs CUDA) is skipped with its reason in its row. Each section writes
``OUT/gpu_step_<section>.json`` (device, versions of torch / triton / transformers / CCE / Liger / TRL, git commit,
rows with median ms); ``--deadline_s`` skips the section's remaining cases once it has run that long.

Run: ``bash recipes/benchmarks/gpu_step.sh`` (all sections); one section: ``python recipes/benchmarks/gpu_step.py
--section head --out gpu-out/gpu_step``; ``--smoke`` (with ``--device cpu``): tiny sizes, for the test suite.
"""

from __future__ import annotations

import copy
import json
import time
from pathlib import Path

import torch
import torch.nn.functional as F

if __package__:
    from . import common, cost_model
else:  # run as a file: this folder is first on sys.path
    import common
    import cost_model

NAME = "gpu_step"
SECTIONS = ("micro", "parts", "head", "train", "merge")
HEAD_SHAPES = cost_model.SHAPES
COMPETITORS = ("cce", "liger", "torch-lce", "trl-chunked")


def parse_args(argv=None):
    p = common.base_parser(__doc__.splitlines()[0], plots=False, budget_s=(2.0, "seconds of repeats per case"))
    p.add_argument("--section", required=True, choices=SECTIONS)
    p.add_argument("--deadline_s", type=float, default=None, help="skip the section's remaining cases after this long")
    p.add_argument("--tokens", type=int, default=None, help="T of the head cases (default 8192; smoke 64)")
    p.add_argument("--models", nargs="+", default=list(HEAD_SHAPES), choices=list(HEAD_SHAPES), help="head shapes")
    args = common.parse(p, argv)
    if args.smoke:  # one call per case: the test checks that each runs and lands in a row
        args.warmup, args.repeats, args.budget_s = args.warmup or 1, args.repeats or 1, 0.0
    return args


# ============================================================================ the competitors
def competitors(device: torch.device) -> dict[str, tuple]:
    """name -> (loss(hidden (T, D), weight (V, D), labels (T,)) -> scalar, or None; why not; version)."""
    out = {}

    def attempt(name, make, dist, needs_cuda):
        if needs_cuda and device.type != "cuda":
            out[name] = (None, "needs CUDA (a Triton kernel)", common._version(dist))
            return
        try:
            out[name] = (make(), None, common._version(dist))
        except Exception as err:  # noqa: BLE001 (recorded: the comparison goes on)
            out[name] = (None, _why(err), common._version(dist))

    def cce():
        from cut_cross_entropy import linear_cross_entropy  # noqa: PLC0415

        return lambda h, w, y: linear_cross_entropy(h, w, y)

    def liger():
        from liger_kernel.transformers import LigerFusedLinearCrossEntropyLoss  # noqa: PLC0415

        loss = LigerFusedLinearCrossEntropyLoss()
        return lambda h, w, y: loss(w, h, y)

    def torch_lce():
        if not hasattr(F, "linear_cross_entropy"):
            raise ImportError(f"torch {torch.__version__} has no torch.nn.functional.linear_cross_entropy (>= 2.13)")
        return lambda h, w, y: F.linear_cross_entropy(h, w, y)

    def trl_chunked():
        from trl.kernels import ChunkedLogProbFunction  # noqa: PLC0415

        try:  # the chunk its SFT trainer uses
            from trl.trainer.utils import _CHUNKED_LOGPROB_CHUNK_SIZE as chunk  # noqa: PLC0415
        except ImportError:
            chunk = 32768
        return lambda h, w, y: -ChunkedLogProbFunction.apply(h, w, None, y, 1.0, chunk, None, 1.0, ())[0].mean()

    attempt("cce", cce, "cut-cross-entropy", True)
    attempt("liger", liger, "liger-kernel", True)
    attempt("torch-lce", torch_lce, "torch", False)
    attempt("trl-chunked", trl_chunked, "trl", False)
    return out


def _why(err: Exception) -> str:
    """An error in one line: its type and the first 160 characters of its message."""
    return f"{type(err).__name__}: {(str(err).splitlines() or [''])[0][:160]}"


class Deadline:
    """The section's time: ``over()`` once ``seconds`` have passed since it started (None: never)."""

    def __init__(self, seconds: float | None):
        self.end = None if seconds is None else time.perf_counter() + seconds

    def over(self) -> bool:
        return self.end is not None and time.perf_counter() > self.end


def _timed(label, fn, device, args, deadline, reset=lambda: None, **rec) -> dict:
    """One row: ``fn``'s median ms (common.measure, no memory pass), or why it was skipped."""
    if deadline.over():
        out = {"skipped": "the section's deadline passed"}
        print(f"{label:28s} skipped: {out['skipped']}")
    else:
        out = common.measure(label, fn, device, warmup=args.warmup or 1, repeats=args.repeats or 5,
                             budget_s=args.budget_s, reset=reset, memory=False)  # fmt: skip
    return {**rec, "case": label, **out}


def _inputs(v, d, t, device, dtype, seed=0):
    gen = torch.Generator().manual_seed(seed)
    counts = common.zipf_counts(v, generator=gen)
    labels = common.zipf_labels(counts, t, gen).to(device)
    weight = torch.nn.Parameter((torch.randn(v, d, generator=gen) * d**-0.5).to(device=device, dtype=dtype))
    hidden = (torch.randn(t, d, generator=gen) * 0.5).to(device=device, dtype=dtype).requires_grad_()
    return counts, weight, hidden, labels


def _default_head(weight, counts):
    """The head as ``MidxConfig()`` configures it (every default but the seed) over ``weight``."""
    import hf_midx  # noqa: PLC0415

    linear = torch.nn.Linear(weight.shape[1], weight.shape[0], bias=False, device="meta")
    linear.weight = weight
    return hf_midx.MidxLMHead(linear, hf_midx.MidxConfig(seed=0), class_counts=counts)


def _projection(head, weight, hidden, labels) -> dict:
    """The cost model's projection of one step of ``head`` (traced on fake copies of the tensors), or its error:
    on a copy of the head, since the fake step leaves fake tensors in the state it records (the step data)."""
    try:
        return cost_model.project_head(copy.deepcopy(head), weight, hidden, labels)
    except Exception as err:  # noqa: BLE001 (recorded: the measurement goes on without it)
        return {"error": _why(err)}


# ============================================================================ sections
def micro(args, device, dtype, deadline) -> list[dict]:
    """embedding_bag: one bag of V entries, the same sum as a GEMV, the same entries in 1,024 bags."""
    shapes = [common.MODEL_SHAPES[m] for m in ("gemma3-270m", "llama3-8b")]
    if args.smoke:
        shapes = [(2 * cost_model.LONG_BAG, 32)]
    rows = []
    for v, d in shapes:
        w = torch.randn(v, d, device=device, dtype=dtype)
        ids = torch.arange(v, device=device)
        coef = torch.rand(v, device=device, dtype=dtype)
        one, many = ids[:1] * 0, torch.arange(0, v, v // 1024, device=device)  # offsets: 1 bag, 1,024 bags
        cases = {"embedding_bag, one bag of V": lambda: F.embedding_bag(ids, w, one, mode="sum", per_sample_weights=coef),
                 "embedding_bag, 1,024 bags": lambda: F.embedding_bag(ids, w, many, mode="sum", per_sample_weights=coef),
                 "GEMV (coef @ W)": lambda: coef.unsqueeze(0) @ w}  # fmt: skip
        for label, fn in cases.items():
            launches = [cost_model.cost(op) for op in cost_model.trace(fn)]
            rows.append(_timed(label, fn, device, args, deadline, section="micro", V=v, D=d,
                               projected_ms=sum(x.us for x in launches) / 1e3,
                               flags=[f for x in launches for f in x.flags]))  # fmt: skip
    return rows


def parts(args, device, dtype, deadline) -> list[dict]:
    """The default step at the Gemma-3-270M shape: plain time, then each launch timed and summed by part."""
    v, d = (4096, 32) if args.smoke else common.MODEL_SHAPES["gemma3-270m"]
    t = args.tokens or (64 if args.smoke else 8192)
    counts, weight, hidden, labels = _inputs(v, d, t, device, dtype)
    head = _default_head(weight, counts)
    projected = _projection(head, weight, hidden, labels)

    def step():
        hidden.grad = weight.grad = None
        head.loss(hidden, labels).backward()

    row = _timed("midx-default step", step, device, args, deadline, section="parts", V=v, D=d, T=t,
                 projected_ms=projected.get("projected_ms"), projection_error=projected.get("error"))  # fmt: skip
    if "skipped" in row:
        return [row]
    launches = [cost_model.cost(op) for op in cost_model.trace(step, timed=True)]
    timed = cost_model.summarize(launches, head)
    row.update(traced_ms=sum(x.measured_ms or 0 for x in launches), launches=timed["launches"],
               parts={p: {"projected_ms": x["ms"], "measured_ms": x.get("measured_ms"), "launches": x["launches"]}
                      for p, x in timed["parts"].items()},
               ops=[{k: x[k] for k in ("op", "part", "where", "impl", "bytes", "flops", "us", "measured_ms", "flags")}
                    for x in timed["ops"]])  # fmt: skip
    for p, x in row["parts"].items():
        print(f"  {p:16s} projected {x['projected_ms']:8.3f} ms  measured (traced) {x['measured_ms'] or 0:8.3f} ms")
    return [row]


def graphed_loss(midx, weight, hidden, labels):
    """The default head's loss, forward and backward, captured as CUDA graphs (``torch.cuda.make_graphed_callables``:
    static input buffers, one replay each way) and replayed at every call: (hidden, labels) -> loss, gradients
    flowing to ``hidden`` and ``weight`` as the eager call's do. The step has one shape and reads nothing back to
    the host (what tests/test_cost_model.py holds on the CPU); the sampler's tables and its generator's state are
    updated in place, so the graph sees the live ones."""
    fn = torch.cuda.make_graphed_callables(lambda h, w, y: midx.loss(h, y, weight=w), (hidden, weight, labels))
    return lambda h, y: fn(h, weight, y)


def _graphed(midx, weight, hidden, labels, device, args, deadline, clear, rec, projected) -> dict:
    """The ``midx-default/cuda-graph`` row: the replayed step's median, whether its loss and gradients are the
    eager step's from the same generator state, and the calibrated projection of a replayed step."""
    rec = {**rec, "calibrated_ms": projected.get("calibrated_graph_ms")}
    if device.type != "cuda":
        return {**rec, "case": "midx-default/cuda-graph", "skipped": "needs CUDA (torch.cuda.make_graphed_callables)"}
    if deadline.over():  # the capture's warm-up calls take time too
        return {**rec, "case": "midx-default/cuda-graph", "skipped": "the section's deadline passed"}
    try:
        state = midx.sampler_state()["generator_state"]
        clear()
        eager = midx.loss(hidden, labels)
        eager.backward()
        grads = hidden.grad.clone(), weight.grad.clone()
        fn = graphed_loss(midx, weight, hidden, labels)  # its warm-up calls advance the generator
        midx.load_sampler_state({**midx.sampler_state(), "generator_state": state})
        clear()
        replayed = fn(hidden, labels)
        replayed.backward()
        same = bool(torch.equal(eager, replayed) and torch.equal(grads[0], hidden.grad) and torch.equal(grads[1], weight.grad))
    except Exception as err:  # noqa: BLE001 (recorded: the other rows go on)
        return {**rec, "case": "midx-default/cuda-graph", "skipped": f"capture failed: {_why(err)}"}
    return _timed("midx-default/cuda-graph", lambda: (clear(), fn(hidden, labels).backward()), device, args, deadline,
                  clear, **rec, matches_eager=same)  # fmt: skip


def head(args, device, dtype, deadline) -> list[dict]:
    """Head + loss, forward + backward, at each shape: the default head with its projection, then each competitor."""
    t = args.tokens or (64 if args.smoke else 8192)
    kernels = competitors(device)
    rows = []
    for model in args.models:
        v, d = HEAD_SHAPES[model]
        if args.smoke:
            v, d = max(2048, v // 256), max(32, d // 32)
        counts, weight, hidden, labels = _inputs(v, d, t, device, dtype)
        common_rec = {"section": "head", "model": model, "V": v, "D": d, "T": t,
                      "exact_floor_ms": cost_model.exact_floor_ms(v, d, t)}  # fmt: skip

        def clear():
            hidden.grad = weight.grad = None

        if deadline.over():
            rows.append({**common_rec, "case": "midx-default", "skipped": "the section's deadline passed"})
        else:
            midx = _default_head(weight, counts)
            projected = _projection(midx, weight, hidden, labels)
            flags = sorted({f"{x['op']}: {f}" for x in projected.get("flagged", []) for f in x["flags"]})
            rows.append(_timed("midx-default", lambda: (clear(), midx.loss(hidden, labels).backward()), device, args,
                               deadline, clear, **common_rec, projected_ms=projected.get("projected_ms"),
                               calibrated_ms=projected.get("calibrated_ms"),
                               calibrated_graph_ms=projected.get("calibrated_graph_ms"),
                               projected_parts={p: x["ms"] for p, x in projected.get("parts", {}).items()}, flags=flags,
                               projection_error=projected.get("error")))  # fmt: skip
            rows.append(_graphed(midx, weight, hidden, labels, device, args, deadline, clear, common_rec, projected))
            midx = None
        for name in COMPETITORS:
            fn, why, version = kernels[name]
            if fn is None:
                rows.append({**common_rec, "case": name, "version": version, "skipped": why})
                print(f"{name:28s} skipped: {why}")
                continue
            if name == "liger" and v // d >= 1024:
                why = "V / D >= 1,024: Liger chunks T x D / V tokens at a time (3.8 s at T = 2,048 on an H100, results/h100)"
                rows.append({**common_rec, "case": name, "version": version, "skipped": why})
                continue
            rows.append(_timed(name, lambda fn=fn: (clear(), fn(hidden, weight, labels).backward()), device, args,
                               deadline, clear, **common_rec, version=version))  # fmt: skip
        weight = hidden = None
        common.free_memory(device)
    return rows


def train(args, device, dtype, deadline) -> list[dict]:
    """A Gemma-3-270M-sized training step with the decoder compiled, each loss on the same model."""
    import hf_midx  # noqa: PLC0415

    bench_e2e = common.import_recipe("benchmarks.bench_e2e")
    s = dict(bench_e2e.SETTINGS["gemma3-270m"])
    if args.smoke:
        s.update(vocab=2048, batch=2, block=17, config=dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                 num_attention_heads=2, num_key_value_heads=1, head_dim=16, max_position_embeddings=64,
                 tie_word_embeddings=True))  # fmt: skip
    v, batch, block = s["vocab"], s["batch"], s["block"]
    model = bench_e2e.make_model(s, v, block, 0, device)
    model.train()
    decoder, out_weight = model.get_decoder(), model.get_output_embeddings().weight
    # The body compiled once for every case (Inductor on a GPU; the smoke test only checks the calls).
    decoder.compile(backend="inductor" if device.type == "cuda" else "eager")
    gen = torch.Generator().manual_seed(0)
    counts = common.zipf_counts(v, tokens=1e7) + 1
    batches = [torch.multinomial(counts, batch * block, replacement=True, generator=gen).view(batch, block).to(device)
               for _ in range(4)]  # fmt: skip
    rec = {"section": "train", "model": "gemma3-270m", "V": v, "batch": batch, "block": block,
           "parameters": sum(p.numel() for p in model.parameters())}  # fmt: skip
    kernels = competitors(device)

    def exact(fn):
        def loss_of(x):
            hidden = decoder(input_ids=x, attention_mask=torch.ones_like(x)).last_hidden_state
            h = hidden[:, :-1].reshape(-1, hidden.shape[-1]).to(out_weight.dtype)
            return fn(h, out_weight, x[:, 1:].reshape(-1))

        return loss_of

    def plain(x):
        return model(input_ids=x, attention_mask=torch.ones_like(x), labels=x).loss

    def run(label, loss_of, **extra):
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
        it = iter(range(1 << 30))

        def step():
            x = batches[next(it) % len(batches)]
            loss_of(x).backward()
            opt.step()
            opt.zero_grad(set_to_none=True)

        row = _timed(label, step, device, args, deadline, **rec, **extra)
        if "ms" in row:
            row["tokens_per_s"] = batch * block / (row["ms"] / 1e3)
        return row

    rows = []
    name, (fn, why, version) = "cce", kernels["cce"]
    rows.append(run(name, exact(fn), version=version) if fn else {**rec, "case": name, "skipped": why})
    if deadline.over():
        rows.append({**rec, "case": "midx-default", "skipped": "the section's deadline passed"})
    else:
        hf_midx.wrap(model, hf_midx.MidxConfig(seed=0, log_kl=False), class_counts=counts, verify=False)
        rows.append(run("midx-default", plain))
        hf_midx.unwrap(model)
    for name in COMPETITORS[1:]:
        fn, why, version = kernels[name]
        rows.append(run(name, exact(fn), version=version) if fn else {**rec, "case": name, "skipped": why})
    rows.append(run("hf-full", plain))
    best = [r for r in rows if "ms" in r and r["case"] != "midx-default"]
    midx = next((r for r in rows if r["case"] == "midx-default" and "ms" in r), None)
    if best and midx:
        fastest = min(best, key=lambda r: r["ms"])
        midx["fastest_other"], midx["speedup_vs_fastest_other"] = fastest["case"], fastest["ms"] / midx["ms"]
    return rows


# ============================================================================ files
def environment(device: torch.device) -> dict:
    env = common.environment(device)
    env["trl"] = common._version("trl")
    return env


def merge(out: Path) -> dict:
    """Every section's rows in gpu_step.json and a Markdown table in gpu_step.md."""
    sections = [json.loads(p.read_text()) for s in SECTIONS[:-1] if (p := out / f"{NAME}_{s}.json").exists()]
    rows = [r for sec in sections for r in sec["rows"]]
    env = sections[0]["environment"] if sections else environment(torch.device("cpu"))
    cols = [("section", "section"), ("model", lambda r: r.get("model", "-")), ("V x D", lambda r: f"{r['V']:,} x {r.get('D', '-')}"),
            ("case", "case"), ("median", lambda r: common.fmt_ms(r.get("ms")) if "ms" in r else f"skipped: {r['skipped']}"),
            ("projected", lambda r: common.fmt_ms(r.get("projected_ms"))),
            ("measured / projected", lambda r: common.fmt_ratio(r["ms"] / r["projected_ms"], 2)
             if r.get("ms") and r.get("projected_ms") else "-"),
            ("calibrated", lambda r: common.fmt_ms(r.get("calibrated_ms"))),
            ("calibrated, CUDA graph", lambda r: common.fmt_ms(r.get("calibrated_graph_ms"))),
            ("measured / calibrated", lambda r: common.fmt_ratio(r["ms"] / r["calibrated_ms"], 2)
             if r.get("ms") and r.get("calibrated_ms") else "-"),
            ("exact floor", lambda r: common.fmt_ms(r.get("exact_floor_ms"))),
            ("floor / median (> 1: faster than the floor)", lambda r: common.fmt_ratio(r["exact_floor_ms"] / r["ms"], 2)
             if r.get("ms") and r.get("exact_floor_ms") else "-"),
            ("tokens/s", lambda r: f"{r['tokens_per_s']:,.0f}" if "tokens_per_s" in r else "-"),
            ("flags", lambda r: "; ".join(r.get("flags") or []) or "-")]  # fmt: skip
    md = common.report("The default head's step on one GPU, against the exact fused losses", env,
                       {"sections": [s["section"] for s in sections]}, common.markdown_table(rows, cols))
    payload = {"benchmark": NAME, "environment": env, "sections": [s["section"] for s in sections], "rows": rows}
    common.write_outputs(out, NAME, payload, md)
    print(md)
    return payload


def main(argv=None) -> dict:
    args = parse_args(argv)
    out = Path(args.out)
    if args.section == "merge":
        return merge(out)
    device = common.resolve_device(args.device)
    dtype = torch.bfloat16
    env = environment(device)
    settings = {"section": args.section, "smoke": args.smoke, "budget_s": args.budget_s, "deadline_s": args.deadline_s}
    print(f"== {NAME} {args.section} ==", *(f"{k:11s} : {v}" for k, v in common.header(env, settings)), sep="\n", flush=True)
    run = {"micro": micro, "parts": parts, "head": head, "train": train}[args.section]
    rows = run(args, device, dtype, Deadline(args.deadline_s))
    for r in rows:
        r.update(device=env["device"], git_commit=env["git"]["commit"], torch_version=env["torch"])
    payload = {"benchmark": f"{NAME}_{args.section}", "section": args.section, "settings": settings, "environment": env,
               "rows": rows}  # fmt: skip
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{NAME}_{args.section}.json").write_text(json.dumps(payload, indent=2, default=str) + "\n")
    print(f"wrote {out / NAME}_{args.section}.json")
    return payload


if __name__ == "__main__":
    main()
