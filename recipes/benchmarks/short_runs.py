"""Short runs at LLM vocabularies: the sampled head against the full softmax over the first 100-1,000 steps.

A tiny Qwen2 (hidden 64, 2 layers, 4 heads, tied head) trains with the plain ``Trainer`` (``MidxCallback.install``
for the sampled configurations, as a user would) on 8 x 128-token blocks at learning rate 2e-3, then its exact
perplexity is scored on 64 held-out blocks with the full softmax. Corpora:

* ``zipf``: context-free tokens, i.i.d. Zipf(1.1) over V (the best model is the unigram distribution);
* ``chain``: the synthetic Zipfian Markov chain of ``recipes/synthetic.py`` (exponent 1.0, its default clusters);
* ``finetune``: a model first trained with the full softmax for ``--pretrain_steps`` on the chain of corpus seed 0,
  then fine-tuned on the chain of corpus seed 1 (same word frequencies, other transitions: a new domain).

Each configuration is a set of ``MidxConfig`` changes on ``MidxConfig().for_vocabulary(V)`` (``CONFIGS``; ``full``
is the unwrapped model). Every ``--log_every`` steps a callback scores 64 fixed held-out queries with the full
softmax and logs the model's mass on the exact head's classes (``head_mass``), on the classes never seen in
training (``unseen_mass``), with ``MidxCallback``'s coverage diagnostics (``midx/ess``, ``midx/kl_pq``,
``midx/mass_p_over_q_gt_10``). Per run: test perplexity, its ratio to the full softmax's of the same seed, training
wall-clock seconds (evaluation excluded) and the curves. Seeds fix the model's initialization, the data order and
the sampler; the held-out blocks are the same for every seed.

Run: ``python recipes/benchmarks/short_runs.py --out DIR --corpus zipf --vocab 151936 --steps 100 --seeds 0 1 2
--configs full default``. Writes ``DIR/short_runs.{json,md}`` (``--append`` adds to an earlier call's JSON); calls
run one per core are tabled together, with the curves in ``short_runs.png``, by ``--merge A/short_runs.json
B/short_runs.json ... --out DIR`` (a run repeated in a later file, same corpus, V, steps, configuration and seed,
is kept under ``repeats``, out of the table; the plot takes whichever has more probe points).
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

if __package__:
    from . import common
    from .. import synthetic
else:  # run as a file: this folder is first on sys.path
    import sys

    import common

    sys.path.insert(0, str(common.RECIPES_DIR))
    import synthetic

NAME = "short_runs"
SEQ, BATCH, LR, EVAL_BLOCKS, PROBE = 128, 8, 2e-3, 64, 64

#: MidxConfig changes of each configuration (None: the full softmax, unwrapped; "default": none, so the tail gradient
#: is "auto", the expected one here); the refresh variants rebuild the index every 50 / 100 steps.
CONFIGS: dict[str, dict | None] = {
    "full": None,
    "default": {},
    "sampled-tail": {"tail_gradient": "sampled"},
    "expected": {"tail_gradient": "expected"},
    "m100": {"num_samples": 100},
    "m100-expected": {"num_samples": 100, "tail_gradient": "expected"},
    "unigram": {"sampler": "unigram"},
    "unigram-expected": {"sampler": "unigram", "tail_gradient": "expected"},
    "shared": {"negatives": "shared"},
    "expected-r50": {"tail_gradient": "expected", "refresh_every_steps": 50},
    "sampled-r50": {"tail_gradient": "sampled", "refresh_every_steps": 50},
    "expected-r100": {"tail_gradient": "expected", "refresh_every_steps": 100},
    # Issue 54: "default" is now refresh_every_steps="auto" and exact_head="auto"; these are what came before it,
    # the library's defaults (no refresh in one epoch, H = 2,048) and the recipes' (a refresh every 100 steps).
    "old-default": {"refresh_every_steps": 0, "exact_head": 2048},
    "old-recipe": {"refresh_every_steps": 100, "exact_head": 2048},
}


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", required=True, help="output folder")
    p.add_argument("--merge", nargs="+", default=None, metavar="JSON",
                   help="no training: table and plot the runs of these short_runs.json files together")
    p.add_argument("--corpus", default="zipf", choices=["zipf", "chain", "finetune"])
    p.add_argument("--vocab", type=int, nargs="+", default=[151_936])
    p.add_argument("--steps", type=int, nargs="+", default=[100])
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    p.add_argument("--configs", nargs="+", default=["full", "default"], help=f"names in {list(CONFIGS)}")
    p.add_argument("--pretrain_steps", type=int, default=300, help="full-softmax steps before fine-tuning")
    p.add_argument("--log_every", type=int, default=10)
    p.add_argument("--append", action="store_true", help="add to DIR/short_runs.json instead of replacing it")
    p.add_argument("--threads", type=int, default=1, help="torch threads (one run per core)")
    args = p.parse_args(argv)
    unknown = sorted(set(args.configs) - set(CONFIGS))
    if unknown:
        p.error(f"unknown configurations {unknown}; known: {list(CONFIGS)}")
    return args


# ---------------------------------------------------------------------------------------------- data
def zipf_blocks(v: int, n: int, seed: int) -> torch.Tensor:
    p = synthetic.zipf_probabilities(v, 1.1)
    return torch.from_numpy(np.random.default_rng(seed).choice(v, size=(n, SEQ), p=p))


_CHAINS: dict = {}


def chain_blocks(v: int, n: int, seed: int, corpus_seed: int) -> torch.Tensor:
    key = (v, corpus_seed)
    if key not in _CHAINS:
        _CHAINS[key] = synthetic.ZipfMarkovChain(v, 1.0, seed=corpus_seed)
    return torch.from_numpy(_CHAINS[key].sample_blocks(n, SEQ, seed=[corpus_seed, seed]))


def corpus(kind: str, v: int, steps: int, seed: int, corpus_seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """(train blocks (steps * BATCH, SEQ), held-out blocks (EVAL_BLOCKS, SEQ)) int64."""
    if kind == "zipf":
        return zipf_blocks(v, steps * BATCH, 1000 + seed), zipf_blocks(v, EVAL_BLOCKS, 99)
    return chain_blocks(v, steps * BATCH, 1000 + seed, corpus_seed), chain_blocks(v, EVAL_BLOCKS, 99, corpus_seed)


# ---------------------------------------------------------------------------------------------- model
def tiny_qwen2(v: int, seed: int):
    from transformers import AutoModelForCausalLM, Qwen2Config

    torch.manual_seed(seed)
    config = Qwen2Config(vocab_size=v, hidden_size=64, intermediate_size=256, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=SEQ,
                         tie_word_embeddings=True)
    return AutoModelForCausalLM.from_config(config)


class Probe:
    """At each log: the model's full-softmax mass on the exact head and on never-seen classes, 64 held-out queries."""

    def __init__(self, blocks: torch.Tensor, counts: torch.Tensor, head: int):
        from transformers import TrainerCallback

        order = torch.argsort(counts, descending=True, stable=True)
        self.head = torch.zeros(counts.shape[0], dtype=torch.bool)
        self.head[order[:head]] = True
        self.unseen = counts == 0
        self.ids = blocks[:1, :PROBE]
        probe = self

        class _Callback(TrainerCallback):
            def on_train_begin(self, args, state, control, model=None, **kwargs):
                probe.start = model.get_output_embeddings().weight.detach().cpu()[probe.unseen].clone()

            def on_log(self, args, state, control, logs=None, model=None, **kwargs):
                if logs is not None and "loss" in logs:
                    # The Trainer appended its copy of logs to log_history before calling on_log.
                    state.log_history[-1].update(probe.masses(model))

        self.callback = _Callback()

    @torch.no_grad()
    def masses(self, model) -> dict:
        was = model.training
        model.eval()
        device = model.get_output_embeddings().weight.device
        p = model(input_ids=self.ids.to(device)).logits.float().softmax(-1)[0].cpu()  # (PROBE, V), 64 rows only
        model.train(was)
        moved = (model.get_output_embeddings().weight.detach().cpu()[self.unseen] - self.start).norm(dim=1).mean()
        return {"probe/head_mass": float(p[:, self.head].sum(1).mean()),
                "probe/unseen_mass": float(p[:, self.unseen].sum(1).mean()),
                "probe/unseen_row_shift": float(moved)}


def train(model, blocks: torch.Tensor, steps: int, seed: int, callbacks=(), midx: bool = False, log_every: int = 10):
    from transformers import Trainer, TrainingArguments

    import hf_midx

    data = [{"input_ids": b, "labels": b} for b in blocks]
    with tempfile.TemporaryDirectory() as tmp:
        args = TrainingArguments(output_dir=tmp, max_steps=steps, per_device_train_batch_size=BATCH,
                                 learning_rate=LR, logging_steps=log_every, save_strategy="no", report_to="none",
                                 seed=seed, data_seed=seed, disable_tqdm=True, use_cpu=not torch.cuda.is_available())
        trainer = Trainer(model=model, args=args, train_dataset=data, callbacks=list(callbacks))
        if midx:
            hf_midx.MidxCallback.install(trainer)
        out = trainer.train()
    return out.metrics["train_runtime"], trainer.state.log_history


@torch.no_grad()
def perplexity(model, blocks: torch.Tensor) -> float:
    model.eval()
    total, n = 0.0, 0
    for chunk in blocks.split(8):
        chunk = chunk.to(model.get_output_embeddings().weight.device)
        loss = model(input_ids=chunk, labels=chunk).loss  # exact: a wrapped head scores the full softmax in eval
        total += float(loss) * chunk.shape[0] * (SEQ - 1)
        n += chunk.shape[0] * (SEQ - 1)
    model.train()
    return math.exp(total / n)


def run(corpus_kind: str, v: int, steps: int, name: str, seed: int, pretrain_steps: int, log_every: int) -> dict:
    import hf_midx
    from hf_midx.losses.exact_head import choose_exact_head

    if corpus_kind == "finetune":
        model = pretrained(v, seed, pretrain_steps)
        train_blocks, test_blocks = corpus("chain", v, steps, seed, corpus_seed=1)
    else:
        model = tiny_qwen2(v, seed)
        train_blocks, test_blocks = corpus(corpus_kind, v, steps, seed)
    counts = hf_midx.token_counts(train_blocks, v)
    config = None
    if CONFIGS[name] is not None:
        config = hf_midx.MidxConfig(seed=seed, **CONFIGS[name]).for_vocabulary(v)
        hf_midx.wrap(model, config, class_counts=counts)
    head = hf_midx.integration.head.find_head(model)
    size = head.config.exact_head if head is not None else choose_exact_head(
        counts, v, share=hf_midx.defaults.EXACT_HEAD_SHARE, most=hf_midx.defaults.EXACT_HEAD_MAX)[0]
    probe = Probe(test_blocks, counts, size)
    seconds, history = train(model, train_blocks, steps, seed, [probe.callback], midx=config is not None,
                             log_every=log_every)
    if config is not None:
        hf_midx.unwrap(model)
    keep = ("step", "loss", "probe/head_mass", "probe/unseen_mass", "probe/unseen_row_shift", "midx/ess", "midx/kl_pq",
            "midx/mass_p_over_q_gt_10", "midx/head_mass", "midx/train_loss_exact")
    curve = [{k: h[k] for k in keep if k in h} for h in history if "loss" in h]
    shares = [h["midx/refresh_share"] for h in history if "midx/refresh_share" in h]
    return {"refreshes": sum("midx/refresh_seconds" in h for h in history), "refresh_share": shares[-1] if shares else 0.0,
            "exact_head": size, "corpus": corpus_kind, "vocab": v, "steps": steps, "config": name, "seed": seed,
            "changes": CONFIGS[name], "perplexity": perplexity(model, test_blocks), "train_seconds": seconds,
            "seconds_per_step": seconds / steps, "curve": curve}


_PRETRAINED: dict = {}


def pretrained(v: int, seed: int, steps: int):
    """A full-softmax model trained ``steps`` steps on the chain of corpus seed 0 (cached per V, seed)."""
    key = (v, seed, steps)
    if key not in _PRETRAINED:
        model = tiny_qwen2(v, seed)
        blocks, _ = corpus("chain", v, steps, seed + 500, corpus_seed=0)
        train(model, blocks, steps, seed)
        _PRETRAINED[key] = {k: t.clone() for k, t in model.state_dict().items()}
    model = tiny_qwen2(v, seed)
    model.load_state_dict(_PRETRAINED[key])
    return model


# ---------------------------------------------------------------------------------------------- report
def summarize(results: list[dict]) -> list[dict]:
    """Per (corpus, V, steps, config): mean +- sd over seeds of the perplexity and of its ratio to full's."""
    full = {(r["corpus"], r["vocab"], r["steps"], r["seed"]): r["perplexity"] for r in results if r["config"] == "full"}
    groups: dict = {}
    for r in results:
        groups.setdefault((r["corpus"], r["vocab"], r["steps"], r["config"]), []).append(r)
    rows = []
    for (c, v, s, name), rs in sorted(groups.items()):
        ppl = [r["perplexity"] for r in rs]
        ratios = [100 * (r["perplexity"] / full[(c, v, s, r["seed"])] - 1) for r in rs if (c, v, s, r["seed"]) in full]
        rows.append({"corpus": c, "vocab": v, "steps": s, "config": name, "seeds": len(rs),
                     "perplexity": statistics.mean(ppl), "perplexity_sd": statistics.stdev(ppl) if len(ppl) > 1 else 0.0,
                     "vs_full_pct": statistics.mean(ratios) if ratios else None,
                     "vs_full_sd": statistics.stdev(ratios) if len(ratios) > 1 else None,
                     "seconds_per_step": statistics.median(r["seconds_per_step"] for r in rs)})
    return rows


def markdown(rows: list[dict]) -> str:
    lines = ["| corpus | V | steps | configuration | seeds | test perplexity | vs full (%) | s / step |",
             "|:--|--:|--:|:--|--:|--:|--:|--:|"]
    for r in rows:
        vs = "" if r["vs_full_pct"] is None else f"{r['vs_full_pct']:+.1f}" + (
            f" ± {r['vs_full_sd']:.1f}" if r["vs_full_sd"] is not None else "")
        lines.append(f"| {r['corpus']} | {r['vocab']:,} | {r['steps']:,} | {r['config']} | {r['seeds']} | "
                     f"{r['perplexity']:.1f} ± {r['perplexity_sd']:.1f} | {vs} | {r['seconds_per_step']:.3f} |")
    return "\n".join(lines) + "\n"


def plot(out: Path, results: list[dict]) -> None:
    """short_runs.png: per (corpus, V, steps) with a full-softmax run, seed 0's curves of the probe's unseen mass
    and of the logged training loss, one line per configuration."""
    groups = sorted({(r["corpus"], r["vocab"], r["steps"]) for r in results if r["config"] == "full"})
    panels = []
    for c, v, n in groups:
        runs = {}
        for r in results:  # per configuration, seed 0's run with the most probe points
            if (r["corpus"], r["vocab"], r["steps"], r["seed"]) == (c, v, n, 0):
                probed = sum("probe/unseen_mass" in p for p in r["curve"])
                if probed >= runs.get(r["config"], (-1, None))[0]:
                    runs[r["config"]] = (probed, r)
        runs = [r for _, r in runs.values()]
        for key, label in (("probe/unseen_mass", "P's mass on classes unseen in training"), ("loss", "training loss")):
            found = {r["config"]: ([p["step"] for p in r["curve"] if key in p], [p[key] for p in r["curve"] if key in p])
                     for r in runs}
            found = {k: xy for k, xy in found.items() if xy[0]}
            if found:
                panels.append({"lines": found, "title": f"{c}, V = {v:,}, {n} steps, seed 0", "xlabel": "step",
                               "ylabel": label, "yscale": "log" if key != "loss" else None})
    if panels:
        common.plot_panels(out, f"{NAME}.png", panels, size=(5.0, 3.6), rows=max(1, len(panels) // 4))


def main(argv=None) -> dict:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"{NAME}.json"
    env = common.environment(torch.device("cpu"))
    if args.merge:
        results, repeats, seen = [], [], set()
        for f in args.merge:
            for r in json.loads(Path(f).read_text())["runs"]:
                key = (r["corpus"], r["vocab"], r["steps"], r["config"], r["seed"])
                # The same run again (another call, e.g. with the probe): the first file's is tabled.
                (repeats if key in seen else results).append({**r, "source": f})
                seen.add(key)
        rows = summarize(results)
        payload = {"name": NAME, "environment": env, "sources": args.merge, "runs": results, "repeats": repeats,
                   "summary": rows}
        path.write_text(json.dumps(payload, indent=1))
        (out / f"{NAME}.md").write_text(markdown(rows))
        plot(out, results + repeats)
        print(markdown(rows))
        return payload
    results = json.loads(path.read_text())["runs"] if args.append and path.exists() else []
    for v in args.vocab:
        for steps in args.steps:
            for seed in args.seeds:
                for name in args.configs:
                    t0 = time.time()
                    r = run(args.corpus, v, steps, name, seed, args.pretrain_steps, args.log_every)
                    results.append(r)
                    print(f"{args.corpus} V={v} steps={steps} seed={seed} {name}: ppl {r['perplexity']:.1f} "
                          f"({r['seconds_per_step']:.3f} s/step, {time.time() - t0:.0f} s)", flush=True)
                    rows = summarize(results)
                    payload = {"name": NAME, "environment": env, "runs": results, "summary": rows}
                    path.write_text(json.dumps(payload, indent=1))
                    (out / f"{NAME}.md").write_text(markdown(rows))
    return payload


if __name__ == "__main__":
    main()
