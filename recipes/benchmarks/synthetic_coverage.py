"""Why a proposal covers the softmax well or badly, on a model trained by ``recipes/large_vocab.py``.

For held-out contexts of the run's own chain (S queries: one random position per fresh block), P is the
trained model's softmax over the classes outside the exact head (the H most frequent training classes,
as ``MidxConfig.for_vocabulary`` picks them), renormalized: the share the sampled estimator estimates.
Every proposal is built on the tail's rows of the head weight and measured by

* ESS / M, KL(P || Q) and P's mass on classes with p / q > 10 (``hf_midx.diagnostics``' definitions);
* for the MIDX proposals, KL(P || Q) split in two exact parts over the K * K buckets,
  KL(P || Q) = KL(P_B || Q_B) + E_{b ~ P_B} KL(P(. | b) || Q(. | b)): the bucket stage (does the index
  put mass in the right buckets?) and the last stage (what the draw inside a bucket loses); P's mass in
  buckets with P_B / Q_B > 10 (buckets that Q weights lightly);
* what an exact last stage would give (inside a drawn bucket, the residual softmax, i.e. P(. | b)):
  Q'(i) = Q_B(b(i)) P(i | b(i)), mixed with the static component as the proposal mixes it; its ESS and
  KL(P || Q') = KL(P_B || Q_B) are computed exactly, without building that sampler;
* how well the buckets follow the chain's clusters: the stationary-mass-weighted purity
  sum_b max_c mu(b and c) / sum_b mu(b) over the tail classes;
* where the model's own error lies, by frequency band of the next word (ranks [0, H), [H, 10H), [10H, V)):
  the mass the model puts on the band against the true chain's, and the band's share of the test
  cross-entropy in excess of the chain's (a sampled softmax biased towards rare words shows as more mass
  on the tail than the full softmax's model puts there).

Run: ``python recipes/benchmarks/synthetic_coverage.py RUN_DIR --out results/cpu-synthetic``.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import torch

import hf_midx
from hf_midx.diagnostics import proposal_diagnostics

if __package__:
    from . import common
else:  # run as a file: this folder is first on sys.path
    import common

synthetic = common.import_recipe("synthetic")

NAME = "synthetic_coverage"
#: name -> (sampler, options, K); every proposal draws from the tail only (the exact head is excluded).
PROPOSALS = {
    "unigram": ("unigram", {}, None),
    "midx-rq K=64": ("midx-rq", {}, 64),
    "midx-rq K=64 mix=0.5 (default)": ("midx-rq", {"mix_weight": 0.5}, 64),
    "midx-rq K=64 last=frequency": ("midx-rq", {"last_stage": "frequency"}, 64),
    "midx-rq K=64 last=frequency mix=0.5": ("midx-rq", {"last_stage": "frequency", "mix_weight": 0.5}, 64),
    "midx-rq K=128": ("midx-rq", {}, 128),
    "midx-rq K=128 mix=0.5": ("midx-rq", {"mix_weight": 0.5}, 128),
    "midx-rq K=256": ("midx-rq", {}, 256),
    "midx-pq K=64": ("midx-pq", {}, 64),
}


def queries_of(run_dir: Path, chain: synthetic.ZipfMarkovChain, seq_len: int, contexts: int, seed: int):
    """(S, D) float32 final hidden states at one random position of each of S fresh blocks, the (V, D) head
    weight, and the (S,) words at and after those positions."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(run_dir).eval()
    blocks = torch.from_numpy(chain.sample_blocks(contexts, seq_len + 1, seed=[chain.settings.seed, 99, seed]))
    gen = torch.Generator().manual_seed(seed)
    position = torch.randint(0, seq_len, (contexts,), generator=gen)
    with torch.no_grad():
        hidden = model(blocks[:, :-1], output_hidden_states=True).hidden_states[-1]  # (S, L, D), after the final norm
    weight = model.get_output_embeddings().weight.detach().float()
    rows = torch.arange(contexts)
    return hidden[rows, position].float(), weight, blocks[rows, position], blocks[rows, position + 1]


def load_run(run_dir: Path, contexts: int, seed: int) -> dict:
    """A finished large_vocab run, read back: its ``results`` (dict), the ``chain``, the training ``counts``
    (V,) int64, and at S = ``contexts`` held-out positions the hidden states ``z`` (S, D) float32, the head
    ``weight`` (V, D) float32 and the words at (``prev``) and after (``next``) them, (S,) int64.
    SystemExit when ``run_dir`` holds no large_vocab results."""
    try:
        results = json.loads((run_dir / "results.json").read_text())
        syn = results["synthetic"]
    except (OSError, ValueError, KeyError) as err:
        raise SystemExit(f"{run_dir}: not a large_vocab run ({err}).") from None
    chain = synthetic.ZipfMarkovChain.from_facts(syn)
    seq_len = results["data"]["seq_len"]
    counts = hf_midx.token_counts(
        torch.from_numpy(chain.sample_blocks(results["data"]["train_blocks"], seq_len + 1, seed=[syn["corpus_seed"], 0])),
        syn["vocab_size"],
    )
    z, weight, prev, nxt = queries_of(run_dir, chain, seq_len, contexts, seed)
    return {"results": results, "chain": chain, "counts": counts, "z": z, "weight": weight, "prev": prev, "next": nxt}


def bucket_terms(sampler, log_p: torch.Tensor, log_q: torch.Tensor, log_static: torch.Tensor | None, mix: float):
    """Per-query bucket-stage KL, last-stage KL, P's mass in buckets with P_B/Q_B > 10, and the exact-last-stage
    proposal's ESS and KL. log_p, log_q: (S, V') over the sampler's classes; log_q is the MIDX component only."""
    index = sampler.index
    k = index.codebook_size
    bucket = index.codes[:, 0] * k + index.codes[:, 1]  # (V',)
    s = log_p.shape[0]
    p, q = log_p.exp().double(), log_q.exp().double()
    p_b = torch.zeros(s, k * k, dtype=torch.float64).index_add_(1, bucket, p)
    q_b = torch.zeros(s, k * k, dtype=torch.float64).index_add_(1, bucket, q)
    ratio_b = torch.where(p_b > 0, p_b / q_b, torch.zeros_like(p_b))
    kl_bucket = torch.where(p_b > 0, p_b * ratio_b.log(), torch.zeros_like(p_b)).sum(1)
    kl_total = torch.where(p > 0, p * (log_p.double() - log_q.double()), torch.zeros_like(p)).sum(1)
    light = torch.where(ratio_b > 10, p_b, torch.zeros_like(p_b)).sum(1)
    # Q'(i) = Q_B(b) P(i | b): the MIDX component with an exact last stage, then the same mixture.
    q_exact_last = q_b.gather(1, bucket.expand(s, -1)) * p / p_b.gather(1, bucket.expand(s, -1)).clamp_min(1e-300)
    if log_static is not None:
        q_exact_last = (1 - mix) * q_exact_last + mix * log_static.exp().double()
    chi = torch.where(p > 0, p * p / q_exact_last, torch.zeros_like(p)).sum(1)
    kl_exact_last = torch.where(p > 0, p * (p / q_exact_last).log(), torch.zeros_like(p)).sum(1)
    return {
        "kl_bucket_stage": kl_bucket.mean().item(),
        "kl_last_stage": (kl_total - kl_bucket).mean().item(),
        "mass_in_light_buckets": light.mean().item(),
        "exact_last_stage_ess": (1 / chi).mean().item(),
        "exact_last_stage_kl_pq": kl_exact_last.mean().item(),
    }


def purity(sampler, chain: synthetic.ZipfMarkovChain, tail: torch.Tensor) -> float:
    """sum_b max_c mu(b and c) / sum_b mu(b) over the tail classes (1: every bucket within one chain cluster)."""
    index = sampler.index
    k = index.codebook_size
    bucket = (index.codes[:, 0] * k + index.codes[:, 1]).numpy()
    cluster = chain.cluster_of[tail.numpy()]
    mu = chain.mu[tail.numpy()]
    joint = torch.zeros(k * k, chain.num_clusters, dtype=torch.float64)
    joint.index_put_((torch.from_numpy(bucket), torch.from_numpy(cluster)), torch.from_numpy(mu), accumulate=True)
    return float(joint.amax(1).sum() / joint.sum())


def frequency_bands(z, weight, blocks_prev, blocks_next, chain, head: int) -> list[dict]:
    """Per band of next-word ranks: mean predicted mass, the chain's true mass, and the excess NLL share.

    z: (S, D) hidden states at the positions whose previous word is ``blocks_prev`` (S,) and next word
    ``blocks_next`` (S,); the chain's P(. | prev) is built per context from its cluster structure.
    """
    import numpy as np

    v = weight.shape[0]
    edges = [0, head, min(10 * head, v), v] if head else [0, v // 100, v // 10, v]
    log_p = torch.log_softmax(z @ weight.t(), dim=1).double()
    words = np.arange(v)
    true = np.stack([chain.transition_prob(np.full(v, prev), words) for prev in blocks_prev.tolist()])  # (S, V)
    nll_model = -log_p[torch.arange(z.shape[0]), blocks_next]
    nll_chain = -torch.from_numpy(np.log(true[np.arange(z.shape[0]), blocks_next.numpy()]))
    excess = (nll_model - nll_chain).sum().item()
    rows = []
    for lo, hi in zip(edges, edges[1:]):
        in_band = (blocks_next >= lo) & (blocks_next < hi)
        rows.append({
            "band": f"ranks [{lo:,}, {hi:,})",
            "model_mass": log_p[:, lo:hi].exp().sum(1).mean().item(),
            "true_mass": float(true[:, lo:hi].sum(1).mean()),
            "label_share": in_band.double().mean().item(),
            "excess_nll_share": ((nll_model - nll_chain)[in_band].sum().item() / excess) if excess else 0.0,
        })
    return rows


def run_parser(description: str):
    """The flags of a script that reads one large_vocab run (this one and ``synthetic_gradient.py``)."""
    p = common.base_parser(description, timed=False, plots=False)
    p.add_argument("run_dir", type=Path, help="output folder of a finished recipes/large_vocab.py run")
    p.add_argument("--contexts", type=int, default=256, help="S held-out contexts, one position each")
    p.add_argument("--num_samples", type=int, default=100, help="M negatives per token")
    p.add_argument("--tag", default=None, help="suffix of the output names (default: the run folder's name)")
    return p


def main(argv=None) -> dict:
    p = run_parser(__doc__.split("\n\n")[0])
    p.add_argument("--exact_head", type=int, default=2048, help="H (0: no exact head)")
    p.add_argument("--proposals", nargs="+", default=list(PROPOSALS), choices=list(PROPOSALS), metavar="NAME")
    args = common.parse(p, argv)
    if args.contexts < 1 or args.num_samples < 1 or args.exact_head < 0:
        raise SystemExit("--contexts and --num_samples must be >= 1 and --exact_head >= 0.")
    run = load_run(args.run_dir, args.contexts, args.seed)
    results, chain, counts = run["results"], run["chain"], run["counts"]
    z, weight, prev, nxt = run["z"], run["weight"], run["prev"], run["next"]
    v = weight.shape[0]
    head = torch.topk(counts.double(), args.exact_head).indices if args.exact_head else torch.empty(0, dtype=torch.long)
    in_head = torch.zeros(v, dtype=torch.bool)
    in_head[head] = True
    tail = (~in_head).nonzero().squeeze(1)
    log_p_all = torch.log_softmax(z @ weight.t(), dim=1)
    head_mass = log_p_all[:, head].exp().sum(1).mean().item() if args.exact_head else 0.0
    w_tail, counts_tail = weight[tail], counts[tail]
    log_p = torch.log_softmax(z @ w_tail.t(), dim=1)  # P over the tail, renormalized
    rows = []
    for name in args.proposals:
        sampler_name, options, k = PROPOSALS[name]
        kwargs = {"codebook_size": k} if k else {}
        sampler = hf_midx.build_sampler(
            sampler_name, w_tail, class_counts=counts_tail, seed=args.seed, **kwargs, **options
        )
        d = proposal_diagnostics(sampler, z, w_tail, num_samples=args.num_samples)
        row = {"proposal": name, **{key: d[key].item() for key in ("ess", "kl_pq", "mass_p_over_q_gt_10")}}
        if sampler_name.startswith("midx"):
            mix = options.get("mix_weight", 0.0)
            component = sampler
            if mix:  # the MIDX component alone: the same index without the mixture
                component = hf_midx.build_sampler(
                    sampler_name, w_tail, class_counts=counts_tail, seed=args.seed, **kwargs,
                    **{key: val for key, val in options.items() if key != "mix_weight"},
                )
            log_static = None
            if mix:
                log_static = hf_midx.build_sampler("unigram", w_tail, class_counts=counts_tail).full_log_prob(z)
            row.update(bucket_terms(component, log_p, component.full_log_prob(z), log_static, mix))
            row["cluster_purity"] = purity(component, chain, tail)
            row["nonempty_buckets"] = int((component.index.bucket_counts > 0).sum())
        rows.append(row)
        print({key: round(val, 4) if isinstance(val, float) else val for key, val in row.items()}, flush=True)
    bands = frequency_bands(z, weight, prev, nxt, chain, args.exact_head)
    tag = args.tag or args.run_dir.name
    settings = {"run_dir": str(args.run_dir), "contexts": args.contexts, "num_samples": args.num_samples,
                "exact_head": args.exact_head, "seed": args.seed, "model_tokens": results["train_tokens_seen"],
                "model_sampler": results["sampler"], "head_mass": head_mass}  # fmt: skip
    fmt = lambda x: "-" if x is None else (f"{x:.3f}" if isinstance(x, float) else str(x))  # noqa: E731
    columns = [("proposal", "proposal"), ("ESS / M", "ess"), ("KL(P‖Q)", "kl_pq"), ("mass p/q > 10", "mass_p_over_q_gt_10"),
               ("MIDX part: KL bucket stage", "kl_bucket_stage"), ("MIDX part: KL last stage", "kl_last_stage"),
               ("P mass in buckets P_B/Q_B > 10", "mass_in_light_buckets"),
               ("exact last stage: ESS / M", "exact_last_stage_ess"),
               ("exact last stage: KL(P‖Q)", "exact_last_stage_kl_pq"), ("cluster purity", "cluster_purity"),
               ("non-empty buckets", "nonempty_buckets")]  # fmt: skip
    md = (
        f"# {NAME}: {args.run_dir.name}\n\nModel: {results['sampler']} after {results['train_tokens_seen']:,} "
        f"tokens (V = {v:,}); {args.contexts} held-out contexts; exact head H = {args.exact_head} holds "
        f"{head_mass:.3f} of the softmax's mass; P = the softmax over the other {tail.numel():,} classes.\n\n"
        + common.markdown_table([{k: fmt(r.get(k)) for _, k in columns} for r in rows], columns)
    )
    band_columns = [("next word", "band"), ("model's mass", "model_mass"), ("true mass", "true_mass"),
                    ("share of labels", "label_share"), ("share of the excess NLL", "excess_nll_share")]  # fmt: skip
    md += "\n\n## Where the model's error lies\n\n" + common.markdown_table(
        [{k: fmt(r[k]) for _, k in band_columns} for r in bands], band_columns
    )
    payload = {"settings": settings, "rows": rows, "bands": bands}
    common.write_outputs(args.out, f"{NAME}_{tag}", payload, md)
    return payload


if __name__ == "__main__":
    main()
