#!/usr/bin/env python
"""How well each proposal covers a trained WikiText-2 model's softmax (issue 73), and which classes it misses.

    python recipes/benchmarks/results/paper_setting/coverage.py MODEL_DIR OUT.json [--data_dir D]

MODEL_DIR: a model trained by recipes/wikitext2.py (a checkpoint folder works). The index is k-means over its head
weight (K = 32, 20 iterations, seed 0, as a refresh builds it); the mean query mu is that of 3,200 training-text
hidden states, fed to the library's sampler through its draws before the rebuild (what training does); the coverage
is measured on 512 validation hidden states: ESS / M = 1 / E_Q[(p/q)^2], KL(P || Q), and P's mass on classes with
p/q > 10, by class frequency rank. The library's samplers give the rows "uniform", "frequency", "centered" and
"unigram"; the other rows are candidates computed here from their formulas (log Q up to normalization over V).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[4]
sys.path.insert(0, str(ROOT))

from hf_midx import build_sampler  # noqa: E402
from recipes import lm_data  # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("model_dir")
    p.add_argument("out")
    p.add_argument("--data_dir", default=str(ROOT.parent / "shared" / "data" / "wikitext-2"))
    args = p.parse_args()
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(args.model_dir).eval()
    tok = AutoTokenizer.from_pretrained(args.model_dir)
    w = model.get_output_embeddings().weight.detach().float()
    v, d = w.shape
    counts = lm_data.token_counts(lm_data.encode_lines(tok, lm_data.read_lines(f"{args.data_dir}/train.txt")), v).double()

    def hidden(split: str, blocks: int, seed: int) -> torch.Tensor:
        ids = lm_data.encode_lines(tok, lm_data.read_lines(f"{args.data_dir}/{split}.txt"))
        data = lm_data.TokenBlocks.from_stream(ids, 50).data
        pick = data[torch.randperm(len(data), generator=torch.Generator().manual_seed(seed))[:blocks]]
        with torch.no_grad():
            return torch.cat([model(input_ids=c, output_hidden_states=True).hidden_states[-1][:, :-1].reshape(-1, d)
                              for c in pick.split(32)]).float()  # fmt: skip

    train_h = hidden("train", 64, 1)
    valid_h = hidden("valid", 16, 2)[torch.randperm(800, generator=torch.Generator().manual_seed(3))[:512]]
    log_p = torch.log_softmax(valid_h @ w.t(), 1)
    p_ = log_p.exp()
    order = counts.argsort(descending=True)
    bands = ((0, 100), (100, 1000), (1000, 5000), (5000, v))

    def coverage(log_q: torch.Tensor) -> dict:
        lr = log_p - log_q
        missed = (p_ * (lr > math.log(10))).mean(0)
        return {"ess": float((1 / (p_ * lr.exp()).sum(1)).mean()), "kl_pq": float((p_ * lr).sum(1).mean()),
                "mass_p_over_q_gt_10": float((p_ * (lr > math.log(10))).sum(1).mean()),
                "missed_by_rank": {f"{lo}-{hi}": float(missed[order[lo:hi]].sum()) for lo, hi in bands}}  # fmt: skip

    rows = {}
    for stage in ("uniform", "frequency", "centered"):
        s = build_sampler("midx-rq", w, codebook_size=32, seed=0, mix_weight=0.0, last_stage=stage, class_counts=counts)
        s.sample(train_h, 1, generator=torch.Generator().manual_seed(4))  # the queries a training interval draws for
        s.refresh(w)
        rows[f"midx-rq {stage}"] = coverage(s.full_log_prob(valid_h))
        index = s.index
    rows["unigram"] = coverage(build_sampler("unigram", w, class_counts=counts).full_log_prob(valid_h))
    quantized = index.reconstruct()
    mu = train_h.mean(0)
    base, residual, log_f = valid_h @ quantized.t(), w - quantized, torch.log(counts + 1.0).float()
    candidates = {"residual under the mean query, exp(z.q~ + mu.r)": base + residual @ mu,
                  "residual, mean and diagonal variance": base + residual @ mu + 0.5 * (residual**2) @ train_h.var(0)}
    for name, logits in candidates.items():
        rows[name] = coverage(torch.log_softmax(logits, 1))
    for name, r in rows.items():
        print(f"{name:55s} ESS/M {r['ess']:.4f}  KL(P||Q) {r['kl_pq']:.3f}  p/q>10 {r['mass_p_over_q_gt_10']:.3f}  "
              f"missed by rank {r['missed_by_rank']}")
    Path(args.out).write_text(json.dumps({"model_dir": args.model_dir, "V": v, "D": d, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
