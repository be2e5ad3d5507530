"""The non-sampling baseline of compare_samplers: torch's nn.AdaptiveLogSoftmaxWithLoss (Grave et al. 2017).

The same WikiText-2 data, tokenizer, blocks and transformer as ``recipes/wikitext2.py`` (GPT-2
architecture, 2 layers, 4 heads, d 200, ff 1024, 50 predicted tokens per block), with the LM head
replaced by an adaptive softmax over the vocabulary sorted by training frequency (cutoffs 2k and 10k
by default, as Grave et al. use for WikiText-scale vocabularies, ``div_value`` 4). Its input
embedding is untied (the adaptive softmax has no (V, D) matrix to tie). The adaptive softmax is a
normalized model of its own, so its perplexity is exact.

The training loop follows the recipe's Trainer settings: AdamW (lr 1e-3, weight decay 0.01 except
biases and LayerNorm weights), linear warm-up over 2% of the steps then linear decay, gradient norm
clipped at 1, shuffled batches of 32 blocks, seeded. Training time excludes evaluation.

Writes ``--output_dir/results.json`` with the keys compare_samplers reads (``test_perplexity``,
``valid_perplexity``, ``tokens_per_second``, ``global_step``, ``epoch``, ``train_runtime_s``) and
``curve`` (validation perplexity against training time).

Run: ``python recipes/benchmarks/adaptive_softmax.py --train_file T --validation_file V --test_file S
--output_dir OUT [--max_steps N | --num_train_epochs E] [--seed S]``.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import time
from pathlib import Path

import torch
from torch import nn

if __package__:
    from . import common
else:  # run as a file: this folder is first on sys.path
    import common

lm_data = common.import_recipe("lm_data")
PAPER_GPT2 = common.import_recipe("lm_recipe").PAPER_GPT2


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--train_file", required=True)
    p.add_argument("--validation_file", required=True)
    p.add_argument("--test_file", default=None)
    p.add_argument("--output_dir", required=True)
    p.add_argument("--seed", type=int, default=42)
    p.add_argument("--max_steps", type=int, default=-1)
    p.add_argument("--num_train_epochs", type=float, default=1.0)
    p.add_argument("--per_device_train_batch_size", type=int, default=32)
    p.add_argument("--per_device_eval_batch_size", type=int, default=64)
    p.add_argument("--seq_len", type=int, default=50)
    p.add_argument("--learning_rate", type=float, default=1e-3)
    p.add_argument("--weight_decay", type=float, default=0.01)
    p.add_argument("--warmup_ratio", type=float, default=0.02)
    p.add_argument("--cutoffs", default="2000,10000", help="comma-separated cluster boundaries in frequency ranks")
    p.add_argument("--div_value", type=float, default=4.0)
    p.add_argument("--evals", type=int, default=4, help="validation points along training")
    p.add_argument("--max_eval_samples", type=int, default=None)
    p.add_argument("--max_train_samples", type=int, default=None)
    p.add_argument("--config_overrides", default=None, help="GPT-2 config overrides, as the recipe's flag")
    return p.parse_args(argv)


class AdaptiveLM(nn.Module):
    """A GPT-2 decoder whose head is an ``nn.AdaptiveLogSoftmaxWithLoss`` over frequency-ranked ids."""

    def __init__(self, config, cutoffs: list[int], div_value: float) -> None:
        super().__init__()
        from transformers import GPT2Model

        self.body = GPT2Model(config)
        self.head = nn.AdaptiveLogSoftmaxWithLoss(config.n_embd, config.vocab_size, cutoffs, div_value=div_value)

    def nll_sum(self, blocks: torch.Tensor) -> tuple[torch.Tensor, int]:
        """Summed negative log-likelihood of the next-token targets of (B, S + 1) blocks, and their count."""
        hidden = self.body(input_ids=blocks[:, :-1]).last_hidden_state
        out = self.head(hidden.reshape(-1, hidden.shape[-1]), blocks[:, 1:].reshape(-1))
        n = blocks[:, 1:].numel()
        return out.loss * n, n


@torch.no_grad()
def evaluate(model: AdaptiveLM, blocks: lm_data.TokenBlocks, batch: int) -> float:
    model.eval()
    total, count = 0.0, 0
    for s in range(0, len(blocks), batch):
        loss, n = model.nll_sum(blocks.data[s : s + batch])
        total += float(loss)
        count += n
    model.train()
    return total / max(count, 1)


def main(argv=None) -> dict:
    args = parse_args(argv)
    torch.manual_seed(args.seed)
    files = {"train": args.train_file, "validation": args.validation_file, "test": args.test_file}
    lines = {k: lm_data.read_lines(f) for k, f in files.items() if f}
    tokenizer = lm_data.build_word_level_tokenizer(lines["train"])
    streams = {k: lm_data.encode_lines(tokenizer, v) for k, v in lines.items()}
    vocab = len(tokenizer)
    # Frequency ranks: the adaptive softmax needs the frequent words first.
    counts = torch.bincount(streams["train"], minlength=vocab)[:vocab]
    rank_of = torch.empty(vocab, dtype=torch.long)
    rank_of[torch.sort(-counts.double(), stable=True).indices] = torch.arange(vocab)
    blocks = {}
    for name, stream in streams.items():
        limit = args.max_train_samples if name == "train" else args.max_eval_samples
        blocks[name] = lm_data.TokenBlocks.from_stream(rank_of[stream], args.seq_len, limit=limit)

    from transformers import GPT2Config

    eos = int(rank_of[tokenizer.eos_token_id])
    config = GPT2Config(vocab_size=vocab, n_positions=args.seq_len + 1, tie_word_embeddings=False, bos_token_id=eos,
                        eos_token_id=eos, pad_token_id=eos, **PAPER_GPT2)  # fmt: skip
    if args.config_overrides:
        config.update_from_string(args.config_overrides)
    cutoffs = [c for c in (int(x) for x in args.cutoffs.split(",")) if 0 < c < vocab - 1]
    if not cutoffs:  # a tiny vocabulary (tests, --quick): the same shape at its scale
        cutoffs = sorted({max(1, vocab // 16), max(2, vocab // 4)} - {vocab - 1})
    model = AdaptiveLM(config, cutoffs, args.div_value)
    model.train()

    decay = [p for n, p in model.named_parameters() if not (n.endswith("bias") or ".ln_" in n or n.startswith("body.ln_f"))]
    no_decay = [p for n, p in model.named_parameters() if n.endswith("bias") or ".ln_" in n or n.startswith("body.ln_f")]
    opt = torch.optim.AdamW(
        [{"params": decay, "weight_decay": args.weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
        lr=args.learning_rate,
    )
    train = blocks["train"]
    steps_per_epoch = math.ceil(len(train) / args.per_device_train_batch_size)
    total = args.max_steps if args.max_steps > 0 else math.ceil(steps_per_epoch * args.num_train_epochs)
    warmup = math.ceil(args.warmup_ratio * total)
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: (s + 1) / max(warmup, 1) if s < warmup else max(0.0, (total - s) / max(total - warmup, 1))
    )
    every = max(1, total // max(args.evals, 1))
    gen = torch.Generator().manual_seed(args.seed)
    curve, train_time, tokens, step = [], 0.0, 0, 0
    while step < total:
        order = torch.randperm(len(train), generator=gen)
        for s in range(0, len(train), args.per_device_train_batch_size):
            if step >= total:
                break
            t0 = time.perf_counter()
            batch = train.data[order[s : s + args.per_device_train_batch_size]]
            loss, n = model.nll_sum(batch)
            (loss / n).backward()
            nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            sched.step()
            opt.zero_grad(set_to_none=True)
            train_time += time.perf_counter() - t0
            tokens += batch.numel()
            step += 1
            if step % every == 0 or step == total:
                valid = evaluate(model, blocks["validation"], args.per_device_eval_batch_size)
                curve.append(
                    {"step": step, "epoch": step / steps_per_epoch, "valid_loss": valid,
                     "valid_perplexity": math.exp(valid), "train_time_s": train_time}
                )  # fmt: skip
                print(f"step {step}/{total}: valid ppl {math.exp(valid):.2f}, {train_time:.0f} s", flush=True)
    valid = curve[-1]["valid_loss"]
    test = evaluate(model, blocks["test"], args.per_device_eval_batch_size) if "test" in blocks else None
    results = {
        "sampler": "adaptive-softmax", "cutoffs": cutoffs, "div_value": args.div_value, "seed": args.seed,
        "global_step": step, "epoch": step / steps_per_epoch, "valid_loss": valid, "valid_perplexity": math.exp(valid),
        "test_loss": test, "test_perplexity": None if test is None else math.exp(test), "train_runtime_s": train_time,
        "tokens_per_second": tokens / train_time if train_time > 0 else None,
        "parameters": sum(p.numel() for p in model.parameters()), "curve": curve,
    }  # fmt: skip
    os.makedirs(args.output_dir, exist_ok=True)
    path = Path(args.output_dir) / "results.json"
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(results, indent=2) + "\n")
    os.replace(tmp, path)
    print(json.dumps({k: v for k, v in results.items() if k != "curve"}))
    return results


if __name__ == "__main__":
    main()
