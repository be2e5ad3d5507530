#!/usr/bin/env python
"""The logged loss's bias on a small model, at initialisation and as it trains (issue 75, item 9).

The sampled loss is log Ẑ - z_y with Ẑ a self-normalized importance-sampling estimate of Z, so it reads low on
average (Jensen), by about half the relative variance of Ẑ: little where the exact head holds most of the softmax
(the Quick start's model: 0.0003 nats per token, ``loss_bias.py``), more where the tail holds much of it and the
draws cover it badly (a small model whose softmax sharpens on a few tail classes). This trains a tiny Llama
(``--vocab``, D = 64, two layers) wrapped with ``MidxConfig()`` and class counts on a Zipf-Markov token stream in a
plain loop (``hf_midx.RefreshScheduler``), and at each of ``--at`` steps scores held-out tokens: the exact loss, the
sampled loss over ``--draws`` independent draws (eval mode: the same hidden states), the exact head's share of the
softmax and the proposal's effective sample size (``hf_midx.proposal_diagnostics``).

    python recipes/benchmarks/loss_bias_small.py --output recipes/benchmarks/results/post-training

Writes ``loss_bias_small.json`` and ``loss_bias_small.md`` (``_no_counts`` with ``--no_counts``).
"""

from __future__ import annotations

import argparse
import json
import math
import platform
import subprocess
from pathlib import Path

import torch
import transformers
from transformers import AutoModelForCausalLM, LlamaConfig

import hf_midx
from hf_midx import MidxConfig
from hf_midx.integration.head import find_head

if __package__:
    from . import common
else:  # run as a file: this folder is first on sys.path
    import common

ROOT = Path(__file__).resolve().parents[2]


def markov_stream(vocab: int, n: int, gen: torch.Generator) -> torch.Tensor:
    """(n,) int64: each token follows its predecessor's fixed successor with probability 0.6, else a Zipf draw."""
    successor = torch.randperm(vocab, generator=gen)
    noise = common.zipf_labels(common.zipf_counts(vocab), n, gen).tolist()
    keep = (torch.rand(n, generator=gen) < 0.6).tolist()
    succ, out = successor.tolist(), [0]
    for i in range(1, n):
        out.append(succ[out[-1]] if keep[i] else noise[i])
    return torch.tensor(out)


@torch.no_grad()
def measure(model, valid: torch.Tensor, draws: int) -> dict:
    head = find_head(model)
    model.eval()
    hidden = model(input_ids=valid, output_hidden_states=True).hidden_states[-1]
    h, y = hidden[:, :-1].reshape(-1, hidden.shape[-1]), valid[:, 1:].reshape(-1)
    exact = float(head.loss(h, y, exact=True))
    model.train()  # the sampled loss: the head's training path, on the same hidden states
    diffs = [float(head.loss(h, y)) - exact for _ in range(draws)]
    mean = sum(diffs) / draws
    sd = math.sqrt(sum((d - mean) ** 2 for d in diffs) / (draws - 1))
    diag = head.proposal_diagnostics(h[:: max(1, h.shape[0] // 256)], head.weight, head.bias)
    return {"exact_loss": exact, "bias": mean, "sd": sd, "sem": sd / math.sqrt(draws),
            "head_mass": float(diag["head_mass"]), "ess": float(diag["ess"]), "ess_sampled": float(diag["ess_sampled"])}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--vocab", type=int, default=4096)
    parser.add_argument("--at", type=int, nargs="+", default=[0, 60, 200], help="steps at which to measure")
    parser.add_argument("--draws", type=int, default=100)
    parser.add_argument("--no_counts", action="store_true", help="wrap without class counts (no exact head, uniform "
                        "draws inside buckets, no unigram mix: what a wrap without token_counts gives, warned)")
    parser.add_argument("--output", required=True)
    args = parser.parse_args()
    torch.manual_seed(0)
    gen = torch.Generator().manual_seed(0)
    stream = markov_stream(args.vocab, 400_000, gen)
    rows = stream[: (stream.numel() // 65) * 65].view(-1, 65)
    train, valid = rows[:-32], rows[-32:]
    model = AutoModelForCausalLM.from_config(LlamaConfig(
        vocab_size=args.vocab, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=2,
        num_key_value_heads=1, tie_word_embeddings=False))
    counts = None if args.no_counts else hf_midx.token_counts(train, args.vocab)
    hf_midx.wrap(model, MidxConfig().for_vocabulary(args.vocab), class_counts=counts)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    scheduler = hf_midx.RefreshScheduler(model)
    points, step = [], 0
    for target in sorted(args.at):
        while step < target:
            batch = train[torch.randint(0, train.shape[0], (16,), generator=gen)]
            model.train()
            model(input_ids=batch, labels=batch).loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            scheduler.step()
            step += 1
        points.append({"step": step, **measure(model, valid, args.draws)})
        print(json.dumps(points[-1]), flush=True)
    head = find_head(model)
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True).stdout
    result = {"what": "sampled loss (logged `loss`) minus exact cross-entropy, nats per token, same hidden states",
              "vocab_size": args.vocab, "tokens": int(valid[:, 1:].numel()), "draws": args.draws,
              "config": {"num_samples": head.config.num_samples, "exact_head": head.config.exact_head},
              "points": points, "commit": commit.strip(), "torch": torch.__version__,
              "transformers": transformers.__version__, "python": platform.python_version()}
    out, name = Path(args.output), "loss_bias_small" + ("_no_counts" if args.no_counts else "")
    out.mkdir(parents=True, exist_ok=True)
    result["class_counts"] = not args.no_counts
    (out / f"{name}.json").write_text(json.dumps(result, indent=2) + "\n", encoding="utf-8")
    lines = [f"# The logged loss's bias on a small model\n",
             f"A tiny Llama (V = {args.vocab:,}, D = 64, two layers) wrapped with `MidxConfig()` "
             f"{'without class counts ' if args.no_counts else 'and class counts '}(M = {head.config.num_samples}, exact head "
             f"{head.config.exact_head}), trained on a Zipf-Markov stream "
             f"(AdamW 3e-3, 16 x 64 tokens a step, `RefreshScheduler`); {result['tokens']:,} held-out tokens, "
             f"{args.draws} draws per point; commit {result['commit']}, torch {torch.__version__}.\n",
             "| step | exact loss | sampled - exact (sd; sem) | exact head's mass | ESS / M |",
             "|--:|--:|--:|--:|--:|"]
    lines += [f"| {p['step']} | {p['exact_loss']:.4f} | {p['bias']:+.4f} ({p['sd']:.4f}; {p['sem']:.5f}) | "
              f"{p['head_mass']:.3f} | {p['ess']:.3f} |" for p in points]
    at = " ".join(str(a) for a in args.at)
    lines.append(f"\nCommand: `python recipes/benchmarks/loss_bias_small.py --vocab {args.vocab} --at {at} --draws "
                 f"{args.draws}{' --no_counts' if args.no_counts else ''} --output DIR`.")
    (out / f"{name}.md").write_text("\n".join(lines) + "\n", encoding="utf-8")


if __name__ == "__main__":
    main()
