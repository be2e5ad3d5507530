#!/usr/bin/env python
"""``MidxConfig(log_probs="exact-forward")`` measured: exact log-probs with a sampled gradient, for RL and preference.

RL and preference trainers need exact per-token log-probabilities (the forward), but their gradient can be estimated
(:mod:`hf_midx.losses.log_probs`): with log Z exact, the tail's share of the gradient comes from the sampler's M draws
without self-normalization, the exact head's classes scored exactly. This measures, with the default proposal:

1. on a trained model (the quick start's, ``--model_dir``): the estimated gradient of sum_t g_t log p_t (g_t: one
   random sign per sequence, as advantages or preference signs give) against the exact one, per parameter group
   (the tied output embedding, the rest of the model): cosine of one draw's gradient, the relative variance
   E ||g_hat - g||^2 / ||g||^2 and the mean's distance, over ``--draws`` draws;
2. the head's CPU time at V = 131,072: TRL's exact tiled head (forward and backward, what post-training runs under
   log_probs="auto"), its forward alone, and exact-forward through ``MidxLMHead.exact_log_probs`` (the path users
   run; ``--time_only`` measures this alone);
3. short DPO and GRPO runs (``--steps``, seed 0, a tiny Llama on random words) under "auto" (exact) and
   "exact-forward": the logged loss and reward/margin at every step.

    python recipes/benchmarks/exact_forward.py --model_dir runs/wikitext2 --output recipes/benchmarks/results/post-training
"""

from __future__ import annotations

import argparse
import json
import platform
import subprocess
import time
from pathlib import Path

import torch
import transformers
from transformers import AutoModelForCausalLM, AutoTokenizer

import hf_midx
from hf_midx import MidxConfig
from hf_midx.integration.head import find_head

if __package__:
    from .. import lm_data
else:  # run as a file: this folder is first on sys.path
    import sys

    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    import lm_data

ROOT = Path(__file__).resolve().parents[2]


def _grads(model, loss) -> dict[str, torch.Tensor]:
    model.zero_grad()
    loss.backward()
    head = model.get_output_embeddings().weight
    body = [p.grad.flatten() for p in model.parameters() if p.grad is not None and p is not head]
    return {"output embedding": head.grad.flatten().clone(), "rest of the model": torch.cat(body)}


def gradient_quality(model_dir: str, draws: int, seq_len: int, rows: int) -> dict:
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir).eval()  # eval: no dropout between the two gradients
    vocab = model.get_output_embeddings().weight.shape[0]
    sample = ROOT / "recipes" / "data" / "wikitext2_sample"
    counts_stream = lm_data.encode_lines(tokenizer, lm_data.read_lines(sample / "train.txt"))
    stream = lm_data.encode_lines(tokenizer, lm_data.read_lines(sample / "valid.txt"))
    blocks = torch.stack([stream[i * seq_len: i * seq_len + seq_len + 1] for i in range(rows)])
    signs = torch.where(torch.rand(rows, generator=torch.Generator().manual_seed(0)) < 0.5, -1.0, 1.0)
    g = signs[:, None].expand(rows, seq_len).reshape(-1)
    hf_midx.wrap(model, MidxConfig().for_vocabulary(vocab), class_counts=hf_midx.token_counts(counts_stream, vocab))
    head = find_head(model)
    weight = model.get_output_embeddings().weight
    y = blocks[:, 1:].reshape(-1)

    def hidden():
        return model.transformer(input_ids=blocks).last_hidden_state[:, :-1].reshape(-1, weight.shape[1])

    h = hidden()
    exact = _grads(model, -(g * -torch.nn.functional.cross_entropy(h @ weight.T, y, reduction="none")).sum())
    estimates = {k: [] for k in exact}
    for _ in range(draws):  # loss = -sum g log p, the sign a trainer's loss has
        log_p = head.exact_log_probs(hidden(), y)["log_probs"]
        for k, v in _grads(model, -(g * log_p).sum()).items():
            estimates[k].append(v)
    out = {}
    for k, ref in exact.items():
        est = torch.stack(estimates[k])
        cos = torch.nn.functional.cosine_similarity(est, ref[None], dim=1)
        out[k] = {
            "cosine_mean": float(cos.mean()), "cosine_min": float(cos.min()),
            "relative_variance": float(((est - ref) ** 2).sum(1).mean() / (ref ** 2).sum()),
            "relative_bias": float((est.mean(0) - ref).norm() / ref.norm()),
        }
    return {"model_dir": Path(model_dir).name, "vocab_size": vocab, "tokens": int(y.numel()), "draws": draws,
            "exact_head": int(head.exact_ids.numel()), "num_samples": head.config.num_samples, "groups": out}


def head_time(vocab: int, dim: int, tokens: int, repeats: int) -> dict:
    """Seconds of one forward + backward of each head at (V, D, T): TRL's exact tiled head, and "exact-forward"
    through the path users run, ``MidxLMHead.exact_log_probs`` of a head wrapped with ``MidxConfig()`` and Zipf
    class counts (its draw, bookkeeping and label checks included); TRL's forward alone beside them."""
    from trl.kernels import ChunkedLogProbFunction

    torch.manual_seed(0)
    linear = torch.nn.Linear(dim, vocab, bias=False)
    with torch.no_grad():
        linear.weight.normal_(0.0, 0.05)
    counts = 1e9 / torch.arange(1, vocab + 1, dtype=torch.float64) ** 1.1
    head = hf_midx.MidxLMHead(linear, MidxConfig().for_vocabulary(vocab), class_counts=counts)
    weight = head.weight
    h = torch.randn(tokens, dim).requires_grad_()
    y = torch.randint(0, vocab, (tokens,))
    g = torch.where(torch.rand(tokens) < 0.5, -1.0, 1.0)

    def exact_step():
        lp = ChunkedLogProbFunction.apply(h, weight, None, y, 1.0, 32768)[0]
        (-(g * lp).sum()).backward()

    def exact_forward_step():
        lp = head.exact_log_probs(h, y)["log_probs"]
        (-(g * lp).sum()).backward()

    def forward_only():
        with torch.no_grad():
            ChunkedLogProbFunction.apply(h, weight, None, y, 1.0, 32768)

    steps = {"exact forward and backward (TRL)": exact_step,
             "exact-forward through MidxLMHead: exact values, sampled gradient": exact_forward_step,
             "exact forward alone (TRL)": forward_only}
    seconds = {name: [] for name in steps}
    for step in steps.values():
        step()  # warm-up
    for _ in range(repeats):  # interleaved: on a shared machine each round's heads meet the same load
        for name, step in steps.items():
            h.grad = weight.grad = None
            start = time.perf_counter()
            step()
            seconds[name].append(time.perf_counter() - start)
    exact, ours = (seconds[name] for name in list(steps)[:2])
    ratios = sorted(e / o for e, o in zip(exact, ours))
    return {"vocab_size": vocab, "dim": dim, "tokens": tokens, "repeats": repeats, "threads": torch.get_num_threads(),
            "exact_head": int(head.exact_ids.numel()), "num_samples": head.config.num_samples,
            "seconds_min": {k: min(v) for k, v in seconds.items()}, "seconds": seconds,
            "exact_over_exact_forward_per_round": {"min": ratios[0], "median": ratios[len(ratios) // 2],
                                                   "max": ratios[-1]}}


def short_runs(steps: int, folder: Path) -> dict:
    """DPO and GRPO on a tiny Llama for ``steps`` steps, seed 0, log_probs "auto" (exact) and "exact-forward"."""
    import datasets
    import trl
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import LlamaConfig, PreTrainedTokenizerFast

    vocab = 256
    backend = Tokenizer(models.WordLevel(vocab={"<eos>": 0, **{f"w{i}": i for i in range(1, vocab)}}, unk_token="<eos>"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, eos_token="<eos>", pad_token="<eos>")

    def texts(n, words, seed):
        ids = torch.randint(1, vocab, (n, words), generator=torch.Generator().manual_seed(seed))
        return [" ".join(f"w{i}" for i in row) for row in ids.tolist()]

    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(LlamaConfig(
        vocab_size=vocab, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
        num_key_value_heads=1, pad_token_id=0, tie_word_embeddings=False)).save_pretrained(folder / "base")
    pairs = datasets.Dataset.from_dict({"prompt": texts(64, 5, 1), "chosen": texts(64, 6, 2),
                                        "rejected": texts(64, 6, 3)})
    prompts = datasets.Dataset.from_dict({"prompt": texts(64, 5, 4)})
    out = {}
    for kind in ("dpo", "grpo"):
        for mode in ("auto", "exact-forward"):
            model = AutoModelForCausalLM.from_pretrained(folder / "base")
            hf_midx.wrap(model, MidxConfig(num_samples=32, codebook_size=8, log_probs=mode))
            common = dict(output_dir=str(folder / kind / mode), max_steps=steps, per_device_train_batch_size=4,
                          learning_rate=1e-3, logging_steps=1, save_strategy="no", report_to=[], use_cpu=True,
                          disable_tqdm=True, seed=0)
            if kind == "dpo":
                trainer = trl.DPOTrainer(model=model, ref_model=AutoModelForCausalLM.from_pretrained(folder / "base"),
                                         args=trl.DPOConfig(**common, max_length=32), train_dataset=pairs,
                                         processing_class=tokenizer)
                keys = ("loss", "rewards/margins", "rewards/accuracies")
            else:
                trainer = trl.GRPOTrainer(
                    model=model, reward_funcs=lambda completions, **kw: [float(len(c)) for c in completions],
                    args=trl.GRPOConfig(**common, num_generations=2, max_completion_length=6, beta=0.1,
                                        generation_batch_size=4, temperature=0.7),
                    train_dataset=prompts, processing_class=tokenizer)
                keys = ("loss", "reward", "kl")
            hf_midx.MidxCallback.install(trainer)
            trainer.train()
            history = [e for e in trainer.state.log_history if "loss" in e]
            out.setdefault(kind, {})[mode] = {k: [e[k] for e in history] for k in keys}
            out[kind][mode]["train_runtime"] = trainer.state.log_history[-1]["train_runtime"]
    return out


def _provenance() -> dict:
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True).stdout
    return {"commit": commit.strip(), "torch": torch.__version__, "transformers": transformers.__version__,
            "python": platform.python_version()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model_dir", help="a model saved by recipes/wikitext2.py (all but --time_only)")
    parser.add_argument("--time_only", action="store_true", help="only the heads' times (exact_forward_time.json)")
    parser.add_argument("--output", required=True)
    parser.add_argument("--draws", type=int, default=20)
    parser.add_argument("--rows", type=int, default=16, help="validation blocks of 50 predicted tokens")
    parser.add_argument("--vocab", type=int, default=131_072)
    parser.add_argument("--dim", type=int, default=256)
    parser.add_argument("--tokens", type=int, default=1024)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--steps", type=int, default=20, help="steps of each short DPO and GRPO run (0: none)")
    args = parser.parse_args()
    torch.manual_seed(0)
    out = Path(args.output)
    out.mkdir(parents=True, exist_ok=True)
    if args.time_only:  # the heads' times alone (no model needed): exact_forward_time.json
        timing = head_time(args.vocab, args.dim, args.tokens, args.repeats)
        print(json.dumps(timing, indent=1))
        (out / "exact_forward_time.json").write_text(json.dumps({**timing, **_provenance()}, indent=2) + "\n")
        return
    quality = gradient_quality(args.model_dir, args.draws, 50, args.rows)
    print(json.dumps(quality, indent=1))
    timing = head_time(args.vocab, args.dim, args.tokens, args.repeats)
    print(json.dumps(timing, indent=1))
    runs = short_runs(args.steps, out / "runs") if args.steps else {}
    print(json.dumps(runs, indent=1))
    result = {"gradient": quality, "head_time": timing, "short_runs": runs, **_provenance()}
    (out / "exact_forward.json").write_text(json.dumps(result, indent=2) + "\n", encoding="utf-8")


if __name__ == "__main__":
    main()
