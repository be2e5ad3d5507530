#!/usr/bin/env python
"""How far the logged training ``loss`` (the sampled softmax's estimate) reads from the exact cross-entropy.

The sampled loss is log Ẑ - z_y, Ẑ a self-normalized importance-sampling estimate of the partition function Z; by
Jensen's inequality E[log Ẑ] <= log Z, so the logged loss reads low on average. This measures by how much on a
trained model: the quick start's model (``recipes/wikitext2.py``, saved to ``--model_dir``), its validation split
cut in the recipe's blocks (``lm_data``), scored with the default :class:`hf_midx.MidxConfig` (index built from the trained
weight, counts from the training split) by ``--draws`` independent draws against the exact full softmax, on the
same hidden states (eval mode: no dropout between the two).

    python recipes/wikitext2.py --output_dir runs/wikitext2 --max_steps 200
    python recipes/benchmarks/loss_bias.py --model_dir runs/wikitext2 --output recipes/benchmarks/results/loss_bias

Writes ``loss_bias.json`` (per-draw differences, their mean and sd, commit and versions) and ``loss_bias.md``.
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
from transformers import AutoModelForCausalLM, AutoTokenizer

import hf_midx
from hf_midx import MidxConfig
from hf_midx.integration.head import find_head

if __package__:  # python -m recipes.benchmarks.loss_bias
    from .. import lm_data
else:  # run as a file: this folder is first on sys.path
    import sys

    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    import lm_data

ROOT = Path(__file__).resolve().parents[2]
SAMPLE = ROOT / "recipes" / "data" / "wikitext2_sample"


def _blocks(tokenizer, path: Path, seq_len: int) -> torch.Tensor:
    """(B, seq_len + 1) int64 blocks of the file's token stream, cut as the recipe cuts them (stride seq_len)."""
    stream = lm_data.encode_lines(tokenizer, lm_data.read_lines(path))
    n = lm_data.num_blocks(stream.numel(), seq_len)
    return torch.stack([stream[i * seq_len: i * seq_len + seq_len + 1] for i in range(n)])


def _commit() -> str:
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True,
                              check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model_dir", required=True, help="a model saved by recipes/wikitext2.py (with its tokenizer)")
    parser.add_argument("--data_dir", default=str(SAMPLE), help="folder with train.txt and valid.txt")
    parser.add_argument("--draws", type=int, default=20, help="independent draws of the sampled loss")
    parser.add_argument("--seq_len", type=int, default=50, help="predicted tokens per block (the recipe's 50)")
    parser.add_argument("--output", required=True, help="folder for loss_bias.json and loss_bias.md")
    args = parser.parse_args()
    torch.manual_seed(0)
    tokenizer = AutoTokenizer.from_pretrained(args.model_dir)
    model = AutoModelForCausalLM.from_pretrained(args.model_dir).eval()
    vocab = model.get_output_embeddings().weight.shape[0]
    train = _blocks(tokenizer, Path(args.data_dir) / "train.txt", args.seq_len)
    valid = _blocks(tokenizer, Path(args.data_dir) / "valid.txt", args.seq_len)
    hf_midx.wrap(model, MidxConfig().for_vocabulary(vocab), class_counts=hf_midx.token_counts(train, vocab))
    head = find_head(model)
    with torch.no_grad():
        hidden = model(input_ids=valid, output_hidden_states=True).hidden_states[-1]  # (B, S + 1, D), eval mode
        h, y = hidden[:, :-1].reshape(-1, hidden.shape[-1]), valid[:, 1:].reshape(-1)
        exact = float(head.loss(h, y, exact=True))
        sampled = [float(head.loss(h, y)) for _ in range(args.draws)]  # each call draws anew
    diffs = [s - exact for s in sampled]
    mean = sum(diffs) / len(diffs)
    sd = math.sqrt(sum((d - mean) ** 2 for d in diffs) / (len(diffs) - 1))
    result = {
        "what": "sampled loss (logged `loss`) minus exact cross-entropy, nats per token, same hidden states",
        "model_dir": Path(args.model_dir).name, "vocab_size": vocab, "tokens": int(y.numel()),
        "config": {"num_samples": head.config.num_samples, "exact_head": head.config.exact_head,
                   "sampler": head.config.sampler},
        "exact_loss": exact, "sampled_losses": sampled, "differences": diffs,
        "mean_difference": mean, "sd_difference": sd, "sem_difference": sd / math.sqrt(len(diffs)),
        "perplexity_ratio": math.exp(mean), "draws": args.draws,
        "commit": _commit(), "torch": torch.__version__, "transformers": transformers.__version__,
        "python": platform.python_version(),
    }
    out = Path(args.output)
    out.mkdir(parents=True, exist_ok=True)
    (out / "loss_bias.json").write_text(json.dumps(result, indent=2) + "\n", encoding="utf-8")
    (out / "loss_bias.md").write_text(
        f"# The logged loss against the exact cross-entropy\n\n"
        f"Model: `{result['model_dir']}` (V = {vocab:,}), {result['tokens']:,} validation tokens, the default "
        f"config (M = {head.config.num_samples}, exact head {head.config.exact_head}), {args.draws} draws; commit "
        f"{result['commit']}, torch {torch.__version__}, transformers {transformers.__version__}.\n\n"
        f"| exact loss | sampled loss, mean of {args.draws} | difference (sd over draws) | perplexity ratio |\n"
        f"|--:|--:|--:|--:|\n"
        f"| {exact:.4f} | {sum(sampled) / len(sampled):.4f} | {mean:+.4f} ({sd:.4f}) | {math.exp(mean):.4f} |\n",
        encoding="utf-8",
    )
    print(f"exact {exact:.4f}, sampled - exact {mean:+.4f} ± {sd:.4f} nats/token over {args.draws} draws "
          f"(perplexity x{math.exp(mean):.4f})")


if __name__ == "__main__":
    main()
