"""How far each proposal's training gradient is from the full softmax's, on a model trained by ``large_vocab.py``.

Coverage (``synthetic_coverage.py``) says how well a proposal matches the softmax; this says whether that
reaches the gradient the optimizer sees. For S held-out contexts of the run's own chain (hidden states Z,
the chain's next words y as labels) and each proposal, R independent draws of the training loss
(``hf_midx.sampled_softmax_loss`` as ``MidxLMHead`` calls it: the exact head of the H most frequent
classes, M negatives per token, each estimator) give gradients Ĝ of the summed loss
with respect to the head weight W (V, D) and to the hidden states Z (S, D). Against the exact gradient G
of the full softmax over the same batch:

* bias = ||E Ĝ - G|| / ||G||: what no number of steps averages away (E Ĝ over the R draws, with the
  draws' own variance / R taken out of ||mean Ĝ - G||^2);
* sampling noise = sqrt(E ||Ĝ - E Ĝ||^2) / ||G||: what the draws add to each step;
* data noise = the same for the exact gradient of a batch of S contexts drawn afresh, estimated from the
  per-context gradients (sqrt(S (mean_t ||g_t||^2 - ||mean_t g_t||^2)) / ||G||): the noise SGD already
  has at this batch size, the yardstick for the two above. Both noises grow as sqrt(batch), so their
  ratio holds at any batch; the bias grows with the batch itself, so its ratio to the data noise is
  reported at the training batch B (``--batch_tokens``): (bias / data noise at S) * sqrt(B / S).

Both estimators are measured (``--estimators``): "corrected-positive" (the default) and "exact-positive"
(the paper's); see ``hf_midx.loss``.

With the head scoring most of the mass exactly, every proposal only estimates the tail's share of the
partition function, and the table shows how much of the gradient that leaves to the proposal.

Run: ``python recipes/benchmarks/synthetic_gradient.py RUN_DIR --out results/cpu-synthetic``.
"""

from __future__ import annotations

import itertools
import math

import torch

import hf_midx
from hf_midx.loss import ESTIMATORS

if __package__:
    from . import common, synthetic_coverage
else:  # run as a file: this folder is first on sys.path
    import common
    import synthetic_coverage

NAME = "synthetic_gradient"
#: name -> (sampler, options, K), as in synthetic_coverage, plus the uniform proposal as the floor.
PROPOSALS = {"uniform": ("uniform", {}, None), **synthetic_coverage.PROPOSALS}
DEFAULT_PROPOSALS = ("uniform", "unigram", "midx-rq K=64 mix=0.5 (default)", "midx-rq K=64", "midx-rq K=256")


def exact_gradients(z: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor) -> dict:
    """The full softmax's gradients of the summed cross-entropy over S contexts.

    z: (S, D), weight: (V, D) float32, labels (S,) int64. Returns ``g_w`` (V, D) and ``g_z`` (S, D) float64,
    the mean cross-entropy ``loss`` (float) and ``data_noise``: sqrt(S (mean_t ||g_t||^2 - ||mean_t g_t||^2))
    for the per-context weight gradients g_t = (p_t - e_y) z_t^T, the spread of G over fresh batches of S.
    """
    zd, wd = z.double(), weight.double()
    log_p = torch.log_softmax(zd @ wd.t(), dim=1)
    delta = log_p.exp()
    rows = torch.arange(z.shape[0])
    delta[rows, labels] -= 1.0  # (S, V): d loss_t / d logits_t
    g_w = delta.t() @ zd
    per_context = (delta * delta).sum(1) * (zd * zd).sum(1)  # ||g_t||^2 = ||delta_t||^2 ||z_t||^2
    s = z.shape[0]
    spread = s * (per_context.mean() - (g_w / s).pow(2).sum())
    return {
        "g_w": g_w,
        "g_z": delta @ wd,
        "loss": -log_p[rows, labels].mean().item(),
        "data_noise": math.sqrt(max(spread.item(), 0.0)),
    }


def sampled_gradients(z, weight, labels, sampler, num_samples: int, head, repeats: int, estimator: str) -> dict:
    """Mean and spread of R draws of the sampled loss's gradients (float64 accumulators).

    Returns ``mean_w`` (V, D), ``var_w`` (E ||Ĝ_w - E Ĝ_w||^2, unbiased over the R draws, float), ``mean_z``
    (S, D) and ``var_z`` (S,) per context.
    """
    sum_w = torch.zeros(weight.shape, dtype=torch.float64)
    sum_z = torch.zeros(z.shape, dtype=torch.float64)
    sq_w, sq_z = 0.0, torch.zeros(z.shape[0], dtype=torch.float64)
    for _ in range(repeats):
        zr, wr = z.clone().requires_grad_(True), weight.clone().requires_grad_(True)
        loss = hf_midx.sampled_softmax_loss(
            zr, wr, labels, sampler, num_samples, exact_ids=head, reduction="sum", check_labels=False, estimator=estimator
        )
        loss.backward()
        gw, gz = wr.grad.double(), zr.grad.double()
        sum_w += gw
        sum_z += gz
        sq_w += gw.pow(2).sum().item()
        sq_z += gz.pow(2).sum(1)
    mean_w, mean_z = sum_w / repeats, sum_z / repeats
    unbias = repeats / (repeats - 1)
    return {
        "mean_w": mean_w,
        "var_w": max(sq_w / repeats - mean_w.pow(2).sum().item(), 0.0) * unbias,
        "mean_z": mean_z,
        "var_z": (sq_z / repeats - mean_z.pow(2).sum(1)).clamp_min(0) * unbias,
    }


def compare(exact: dict, sampled: dict, repeats: int) -> dict:
    """Relative bias and sampling noise of the weight and hidden-state gradients."""
    norm_w = exact["g_w"].pow(2).sum().item()
    bias_w = (sampled["mean_w"] - exact["g_w"]).pow(2).sum().item() - sampled["var_w"] / repeats
    norm_z = exact["g_z"].pow(2).sum().item()
    bias_z = (sampled["mean_z"] - exact["g_z"]).pow(2).sum().item() - sampled["var_z"].sum().item() / repeats
    cos = torch.nn.functional.cosine_similarity(sampled["mean_w"].flatten(), exact["g_w"].flatten(), dim=0)
    return {
        "bias_w": math.sqrt(max(bias_w, 0.0) / norm_w),
        "noise_w": math.sqrt(sampled["var_w"] / norm_w),
        "cos_w": cos.item(),
        "bias_z": math.sqrt(max(bias_z, 0.0) / norm_z),
        "noise_z": math.sqrt(sampled["var_z"].sum().item() / norm_z),
    }


def main(argv=None) -> dict:
    p = synthetic_coverage.run_parser(__doc__.split("\n\n")[0])  # S contexts are the batch here
    p.add_argument("--repeats", type=int, default=16, help="R independent draws of the loss per proposal (>= 2)")
    p.add_argument("--batch_tokens", type=int, default=1600, help="B: the training batch in tokens (large_vocab: 32 x 50)")
    p.add_argument("--exact_heads", type=int, nargs="+", default=[2048, 0], help="H values (0: no exact head)")
    p.add_argument("--estimators", nargs="+", default=["corrected-positive", "exact-positive"], choices=ESTIMATORS,
                   help="how the label enters the loss (hf_midx.loss)")
    p.add_argument("--proposals", nargs="+", default=list(DEFAULT_PROPOSALS), choices=list(PROPOSALS), metavar="NAME")
    args = common.parse(p, argv)
    if args.contexts < 2 or args.repeats < 2 or args.num_samples < 1 or args.batch_tokens < 1 or min(args.exact_heads) < 0:
        raise SystemExit("--contexts and --repeats must be >= 2, --num_samples and --batch_tokens >= 1, --exact_heads >= 0.")
    run = synthetic_coverage.load_run(args.run_dir, args.contexts, args.seed)
    z, weight, labels, counts = run["z"], run["weight"], run["next"], run["counts"]
    v = weight.shape[0]
    if max(args.exact_heads) + args.num_samples >= v:
        raise SystemExit(f"--exact_heads + --num_samples must stay below V = {v}.")
    exact = exact_gradients(z, weight, labels)
    data_noise = exact["data_noise"] / math.sqrt(exact["g_w"].pow(2).sum().item())
    print(f"full softmax: loss {exact['loss']:.4f}, data noise of the weight gradient {data_noise:.4f}", flush=True)
    rows = []
    for h in args.exact_heads:
        head = torch.topk(counts.double(), h).indices if h else None
        head_mass = torch.softmax(z @ weight.t(), dim=1)[:, head].sum(1).mean().item() if h else 0.0
        for name, estimator in itertools.product(args.proposals, args.estimators):
            sampler_name, options, k = PROPOSALS[name]
            kwargs = {"codebook_size": k} if k else {}
            sampler = hf_midx.build_sampler(
                sampler_name, weight, class_counts=counts, exclude=head, seed=args.seed, **kwargs, **options
            )
            sampled = sampled_gradients(z, weight, labels, sampler, args.num_samples, head, args.repeats, estimator)
            row = {"exact_head": h, "head_mass": head_mass, "proposal": name, "estimator": estimator,
                   **compare(exact, sampled, args.repeats)}  # fmt: skip
            row["noise_w_over_data"] = row["noise_w"] / data_noise
            row["bias_w_over_data_at_batch"] = row["bias_w"] / data_noise * math.sqrt(args.batch_tokens / args.contexts)
            rows.append(row)
            print({key: round(val, 4) if isinstance(val, float) else val for key, val in row.items()}, flush=True)
    results = run["results"]
    settings = {"run_dir": str(args.run_dir), "contexts": args.contexts, "repeats": args.repeats,
                "num_samples": args.num_samples, "exact_heads": args.exact_heads, "batch_tokens": args.batch_tokens,
                "seed": args.seed,
                "model_tokens": results["train_tokens_seen"], "model_sampler": results["sampler"],
                "full_loss": exact["loss"], "data_noise_w": data_noise}  # fmt: skip
    fmt = lambda x: f"{x:.3f}" if isinstance(x, float) else str(x)  # noqa: E731
    columns = [("H", "exact_head"), ("head mass", "head_mass"), ("proposal", "proposal"), ("estimator", "estimator"),
               ("W: bias", "bias_w"), ("W: sampling noise", "noise_w"), ("W: cos(E Ĝ, G)", "cos_w"),
               ("W: sampling / data noise", "noise_w_over_data"),
               (f"W: bias / data noise at B = {args.batch_tokens:,}", "bias_w_over_data_at_batch"),
               ("Z: bias", "bias_z"), ("Z: sampling noise", "noise_z")]  # fmt: skip
    md = (
        f"# {NAME}: {args.run_dir.name}\n\nModel: {results['sampler']} after {results['train_tokens_seen']:,} tokens "
        f"(V = {v:,}); a batch of S = {args.contexts} held-out contexts, R = {args.repeats} draws of the loss, "
        f"M = {args.num_samples}. Full softmax: loss {exact['loss']:.3f} nats; data noise of the weight "
        f"gradient at this batch {data_noise:.3f} of its norm. Bias and noise are relative to the exact "
        "gradient's norm.\n\n" + common.markdown_table([{k: fmt(r[k]) for _, k in columns} for r in rows], columns)
    )
    payload = {"settings": settings, "rows": rows}
    common.write_outputs(args.out, f"{NAME}_{args.tag or args.run_dir.name}", payload, md)
    return payload


if __name__ == "__main__":
    main()
