#!/usr/bin/env python
"""Would "exact values, sampled gradient" pay for post-training? A measurement, not a feature.

RL and preference trainers need exact per-token log-probabilities (the forward), but their gradient could be
estimated: with log Z exact from the forward, d log p_y / dz = e_y - p splits into the exact head's classes
(scored exactly) and the tail, whose sum sum_j p_j grad z_j the sampler's M draws estimate without bias,
(1/M) sum_m (p_{j_m} / q_{j_m}) grad z_{j_m} (no self-normalization). The backward, two thirds of the exact head's
FLOPs, becomes O(T (H + M) D). This prototype measures, with the library's default proposal (MIDX, exact head, unigram
mix):

1. on a trained model (the quick start's, ``--model_dir``): the estimated gradient of sum_t g_t log p_t (g_t: one
   random sign per sequence, as advantages or preference signs give) against the exact one, per parameter group
   (the tied output embedding, the rest of the model): cosine of one draw's gradient, and the relative variance
   E ||g_hat - g||^2 / ||g||^2 over ``--draws`` draws;
2. the head's CPU time (one thread) at V = 131,072: TRL's exact tiled head (forward and backward, what
   post-training runs now) against its forward alone plus the sampled backward.

    python recipes/benchmarks/exact_forward.py --model_dir runs/wikitext2 --output recipes/benchmarks/results/exact_forward
"""

from __future__ import annotations

import argparse
import json
import math
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


def log_partition(h: torch.Tensor, weight: torch.Tensor, chunk: int = 8192) -> torch.Tensor:
    """(T,) float32 exact log Z of h (T, D) against weight (V, D), in (T, chunk) tiles."""
    out = torch.full((h.shape[0],), -math.inf)
    for start in range(0, weight.shape[0], chunk):
        out = torch.logaddexp(out, torch.logsumexp(h @ weight[start:start + chunk].T, dim=1))
    return out


class SampledBackwardLogProbs(torch.autograd.Function):
    """log p_y = z_y - log Z with log Z given exact; backward: the head's classes exact, the tail from the draws."""

    @staticmethod
    def forward(ctx, h, weight, labels, log_z, head_ids, ids, log_q):
        ctx.save_for_backward(h, weight, labels, log_z, head_ids, ids, log_q)
        return (h * weight[labels]).sum(-1) - log_z

    @staticmethod
    def backward(ctx, g):
        h, weight, labels, log_z, head_ids, ids, log_q = ctx.saved_tensors
        w_head, w_draw = weight[head_ids], weight[ids]  # (H, D), (T, M, D)
        p_head = torch.exp(h @ w_head.T - log_z[:, None])  # (T, H) exact
        ratio = torch.exp((h[:, None] * w_draw).sum(-1) - log_z[:, None] - log_q) / ids.shape[1]  # (T, M) p / (M q)
        c_head, c_draw = g[:, None] * p_head, g[:, None] * ratio
        grad_h = g[:, None] * weight[labels] - c_head @ w_head - (c_draw[..., None] * w_draw).sum(1)
        grad_w = torch.zeros_like(weight)
        grad_w.index_add_(0, labels, g[:, None] * h)
        grad_w.index_add_(0, head_ids, -(c_head.T @ h))
        grad_w.index_add_(0, ids.reshape(-1), -(c_draw[..., None] * h[:, None]).reshape(-1, h.shape[1]))
        return grad_h, grad_w, None, None, None, None, None


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
    # loss = -sum g log p, the sign a trainer's loss has; the same for the estimate below
    estimates = {k: [] for k in exact}
    head_ids = head.exact_ids
    for _ in range(draws):
        h = hidden()
        with torch.no_grad():
            log_z = log_partition(h, weight)
            ids, log_q = head.sampler.draw(h.detach(), head.config.num_samples)
        log_p = SampledBackwardLogProbs.apply(h, weight, y, log_z, head_ids, ids, log_q)
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
            "exact_head": int(head_ids.numel()), "num_samples": head.config.num_samples, "groups": out}


def head_time(vocab: int, dim: int, tokens: int, repeats: int) -> dict:
    from trl.kernels import ChunkedLogProbFunction

    torch.manual_seed(0)
    weight = (torch.randn(vocab, dim) * 0.05).requires_grad_()
    h = torch.randn(tokens, dim).requires_grad_()
    y = torch.randint(0, vocab, (tokens,))
    g = torch.where(torch.rand(tokens) < 0.5, -1.0, 1.0)
    config = MidxConfig()
    head_ids = torch.arange(min(2048, vocab // 8))  # the "auto" exact head of Zipf-like counts: the first ids
    counts = 1e9 / torch.arange(1, vocab + 1, dtype=torch.float64) ** 1.1
    sampler = hf_midx.build_sampler(config.sampler, weight.detach(), class_counts=counts, exclude=head_ids,
                                    **config.sampler_kwargs())

    def exact_step():
        lp = ChunkedLogProbFunction.apply(h, weight, None, y, 1.0, 32768)[0]
        (-(g * lp).sum()).backward()

    def sampled_backward_step():
        with torch.no_grad():
            lp = ChunkedLogProbFunction.apply(h, weight, None, y, 1.0, 32768)[0]  # the exact values
            log_z = (h * weight[y]).sum(-1) - lp
            ids, log_q = sampler.draw(h, config.num_samples)
        out = SampledBackwardLogProbs.apply(h, weight, y, log_z, head_ids, ids, log_q)
        (-(g * out).sum()).backward()

    def forward_only():
        with torch.no_grad():
            ChunkedLogProbFunction.apply(h, weight, None, y, 1.0, 32768)

    times = {}
    for name, step in (("exact forward and backward (TRL)", exact_step),
                       ("exact forward, sampled backward", sampled_backward_step),
                       ("exact forward alone (TRL)", forward_only)):
        step()  # warm-up
        seconds = []
        for _ in range(repeats):
            h.grad = weight.grad = None
            start = time.perf_counter()
            step()
            seconds.append(time.perf_counter() - start)
        times[name] = min(seconds)
    return {"vocab_size": vocab, "dim": dim, "tokens": tokens, "repeats": repeats, "threads": torch.get_num_threads(),
            "exact_head": int(head_ids.numel()), "num_samples": config.num_samples, "seconds_min": times}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model_dir", required=True, help="a model saved by recipes/wikitext2.py")
    parser.add_argument("--output", required=True)
    parser.add_argument("--draws", type=int, default=20)
    parser.add_argument("--rows", type=int, default=16, help="validation blocks of 50 predicted tokens")
    parser.add_argument("--vocab", type=int, default=131_072)
    parser.add_argument("--dim", type=int, default=256)
    parser.add_argument("--tokens", type=int, default=1024)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    torch.manual_seed(0)
    quality = gradient_quality(args.model_dir, args.draws, 50, args.rows)
    print(json.dumps(quality, indent=1))
    timing = head_time(args.vocab, args.dim, args.tokens, args.repeats)
    print(json.dumps(timing, indent=1))
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True).stdout
    result = {"gradient": quality, "head_time": timing, "commit": commit.strip(), "torch": torch.__version__,
              "transformers": transformers.__version__, "python": platform.python_version()}
    out = Path(args.output)
    out.mkdir(parents=True, exist_ok=True)
    (out / "exact_forward.json").write_text(json.dumps(result, indent=2) + "\n", encoding="utf-8")


if __name__ == "__main__":
    main()
