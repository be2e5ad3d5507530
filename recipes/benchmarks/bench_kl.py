"""How close each proposal is to the softmax (the paper's "Sampling Distribution Analysis").

On two sets of class embeddings and queries --

* **trained**: a language model's head weight (V, D) and the final hidden states of held-out text, from (in this order
  of preference) ``--model_dir`` (a model saved by ``recipes/wikitext2.py``), a model the recipe trains here for
  ``--train_steps`` steps on ``--data_dir`` (``--source train``), or structured synthetic embeddings (``--source
  synthetic``: clustered, Zipf-frequency classes and queries near their label's cluster). The report says which was
  used;
* **random**: the same V and D at initialization: weights N(0, 0.02^2) (GPT-2's initializer_range) and N(0, 1) queries
  (a LayerNorm output), where every softmax is nearly uniform --

every sampler of ``hf_midx.SAMPLERS`` is measured by

* the coverage diagnostics of ``hf_midx.proposal_diagnostics`` (mean over S queries): KL(Q || P), KL(P ||
  Q), the effective sample size of the importance weights as a fraction of M (analytic, 1 / E_Q[(p/q)^2], and measured
  on M draws) and P's mass on classes with p/q > 10 (with an exact head, P is the softmax over the tail and the head's
  mass is reported);
* the gradient bias of the sampled-softmax loss (M = 20 negatives per token): the relative distance ||mean_R
  grad_sampled - grad_full|| / ||grad_full|| over R independent draws, for the gradient w.r.t. the hidden states and
  w.r.t. the head weight, with the Monte-Carlo noise of that mean (``se``) and the bias with the noise removed
  (``debiased``: sqrt(max(0, d^2 - se^2)));

for the MIDX samplers at K in {8, 16, 32, 64, 128} and for the variants of issue 9 that are a proposal alone
(``common.VARIANTS``: defensive mixtures, the frequency last stage, an exact head) at ``--plot_k``; k-means codebooks
against ``hf_midx.LearnableCodebooks`` trained for ``--learn_steps`` steps (the paper: KL 1.56 -> 1.29 for rq); and
plots the cumulative sampling distributions (mean over queries) against the softmax, classes ordered by training
frequency and by softmax probability, like the paper's figures.

With ``--ppl_json FILE`` (a JSON object: sampler or variant name -> exact test perplexity of a training run with it,
e.g. from compare_samplers), it also reports how well each diagnostic predicts that perplexity (Spearman rank
correlation over the samplers measured on the trained source) and plots each diagnostic against it.

Run: ``python recipes/benchmarks/bench_kl.py --out bench-out [--quick] [--model_dir runs/wikitext2]``.
"""

from __future__ import annotations

import json
import math
import shlex
import time
from pathlib import Path

import torch

import hf_midx
from hf_midx import LearnableCodebooks

if __package__:
    from . import common
else:  # run as a file: this folder is first on sys.path
    import common

NAME = "bench_kl"
MIDX = ("midx-rq", "midx-pq", "midx-exact")
PAPER_LEARNED = {"midx-pq": (2.2421, 1.6625), "midx-rq": (1.5551, 1.2905)}  # KL k-means -> learned (PTB, LSTM)
DIAGNOSTICS = ("kl_qp", "kl_pq", "ess", "ess_sampled", "mass_p_over_q_gt_10")


def parse_args(argv=None):
    p = common.base_parser(__doc__.splitlines()[0], num_samples=20,
                           samplers=(None, "default: all of hf_midx.SAMPLERS and the proposal variants"))  # fmt: skip
    p.add_argument("--source", default="auto", choices=["auto", "model", "train", "synthetic"],
                   help="trained embeddings: auto = model with --model_dir, else train when the data exists "
                   "(not in --quick), else synthetic")  # fmt: skip
    p.add_argument("--model_dir", default=None, help="a model saved by recipes/wikitext2.py (head weight + tokenizer)")
    p.add_argument("--data_dir", default=None,
                   help="WikiText-style folder (train.txt, valid.txt); default ../shared/data/wikitext-2 if present")  # fmt: skip
    p.add_argument("--train_steps", type=int, default=400, help="--source train: optimizer steps of the recipe")
    p.add_argument("--train_sampler", default="full", help="--source train: the recipe's --sampler")
    p.add_argument("--recipe_args", default="", help="--source train: extra flags for recipes/wikitext2.py")
    p.add_argument("--vocab", type=int, default=None, help="synthetic V (default 33278; quick 4000)")
    p.add_argument("--dim", type=int, default=None, help="synthetic D (default 200; quick 64)")
    p.add_argument("--queries", type=int, default=None, help="S queries for KL and gradients (default 256; quick 64)")
    p.add_argument("--codebook_sizes", type=int, nargs="+", default=None, help="K values (default 8 16 32 64 128)")
    p.add_argument("--grad_repeats", type=int, default=None, help="R draws averaged (default 50; quick 6)")
    p.add_argument("--learn_k", type=int, default=32, help="K of the learned-codebook comparison")
    p.add_argument("--learn_steps", type=int, default=None, help="LearnableCodebooks Adam steps (default 300; quick 20)")
    p.add_argument("--learn_lr", type=float, default=1e-3, help="their learning rate (MidxConfig's default)")
    p.add_argument("--learn_queries", type=int, default=64, help="queries per step in the KL term (kl_queries)")
    p.add_argument("--plot_k", type=int, default=None, help="K of the cumulative-distribution plot (default 32)")
    p.add_argument("--estimator", default=None, help="the sampled loss's estimator for the gradient bias (default: MidxConfig's)")
    p.add_argument("--ppl_json", default=None, help="JSON object: sampler/variant name -> test perplexity of a run "
                   "with it; adds the 'predicts perplexity' table")  # fmt: skip
    return common.parse(p, argv)


# ---------------------------------------------------------------------------- sources
def synthetic_source(v: int, d: int, n: int, seed: int) -> dict:
    """Clustered classes with Zipf frequencies; queries near their label's cluster.

    Class i sits in cluster c(i) (64 clusters): q_i = center[c(i)] + 0.5 noise + 0.35 log(freq_i) u, with
    u a fixed "frequency" direction, so frequent words score higher everywhere, as in trained LM heads.
    A query for label y is s (center[c(y)] + 0.6 noise + 0.4 u), the scale s set so that the mean
    softmax entropy is half of log V (about what a WikiText-2 model reaches: ~5 of 10.4 nats).
    Ids are frequency ranks.
    """
    g = torch.Generator().manual_seed(seed)
    counts = common.zipf_counts(v, tokens=2e6) + 1
    clusters = 64
    centers = torch.randn(clusters, d, generator=g) / math.sqrt(d) * 3.0
    u = torch.nn.functional.normalize(torch.randn(d, generator=g), dim=0)
    assign = torch.randint(clusters, (v,), generator=g)
    logf = (counts / counts.sum()).log().float()
    noise = 0.5 * torch.randn(v, d, generator=g) / math.sqrt(d)
    weight = centers[assign] + noise + 0.35 * (logf - logf.mean()).unsqueeze(1) * u
    labels = torch.multinomial(counts.float(), n, replacement=True, generator=g)
    base = centers[assign[labels]] + 0.6 * torch.randn(n, d, generator=g) / math.sqrt(d) + 0.4 * u
    target = 0.5 * math.log(v)
    probe = base[: min(n, 256)]

    def entropy(scale: float) -> float:
        lp = torch.log_softmax(scale * probe @ weight.t(), dim=1)
        return float(-(lp.exp() * lp).sum(1).mean())

    lo, hi = 1e-3, 1e3  # entropy falls as the scale grows
    for _ in range(40):
        mid = math.sqrt(lo * hi)
        lo, hi = (mid, hi) if entropy(mid) > target else (lo, mid)
    scale = math.sqrt(lo * hi)
    return {"weight": weight, "queries": scale * base, "labels": labels, "counts": counts,
            "description": f"structured synthetic embeddings (V={v}, D={d}, 64 clusters, Zipf(1) frequencies, "
            f"query scale {scale:.2f} for a mean softmax entropy of log(V)/2)"}  # fmt: skip


def random_source(v: int, d: int, n: int, counts: torch.Tensor, seed: int) -> dict:
    g = torch.Generator().manual_seed(seed + 1)
    return {"weight": torch.randn(v, d, generator=g) * 0.02, "queries": torch.randn(n, d, generator=g),
            "labels": torch.multinomial(counts.float(), n, replacement=True, generator=g), "counts": counts,
            "description": f"random initialization (V={v}, D={d}): weights N(0, 0.02^2), queries N(0, 1)"}  # fmt: skip


def model_source(model_dir: str, data_dir: str | None, n: int, seed: int) -> dict:
    """Head weight of a saved recipe model, and final hidden states of validation text with their next tokens."""
    from transformers import AutoModelForCausalLM, AutoTokenizer  # noqa: PLC0415

    lm_data = common.import_recipe("lm_data")
    model = AutoModelForCausalLM.from_pretrained(model_dir).eval()
    tok = AutoTokenizer.from_pretrained(model_dir)
    sample = {"train": common.SAMPLE_DATA_DIR / "train.txt", "validation": common.SAMPLE_DATA_DIR / "valid.txt"}
    files = common.data_files(data_dir) or sample
    weight = model.get_output_embeddings().weight.detach().float()
    v = weight.shape[0]
    counts = lm_data.token_counts(lm_data.encode_lines(tok, lm_data.read_lines(files["train"])), v).double()
    valid_ids = lm_data.encode_lines(tok, lm_data.read_lines(files["validation"]))
    seq = min(50, int(getattr(model.config, "n_positions", 51)) - 1)
    blocks = lm_data.TokenBlocks.from_stream(valid_ids, seq).data
    g = torch.Generator().manual_seed(seed)
    pick = blocks[torch.randperm(len(blocks), generator=g)[: max(1, math.ceil(4 * n / seq))]]
    with torch.no_grad():
        hidden = torch.cat([model(input_ids=chunk, output_hidden_states=True).hidden_states[-1][:, :-1]
                            .reshape(-1, weight.shape[1]).float() for chunk in pick.split(32)])  # fmt: skip
    labels = pick[:, 1:].reshape(-1)
    keep = torch.randperm(hidden.shape[0], generator=g)[: 2 * n]
    return {"weight": weight, "queries": hidden[keep], "labels": labels[keep], "counts": counts,
            "description": f"model {model_dir} (V={v}, D={weight.shape[1]}): head weight and final hidden states "
            f"of {files['validation'].name}"}  # fmt: skip


def train_model(args, out_dir: Path, files: dict) -> str:
    """Train the paper's WikiText-2 model with the recipe for ``--train_steps`` steps; returns its folder."""
    wikitext2 = common.import_recipe("wikitext2")
    folder = out_dir / "bench_kl_model"
    argv = ["--train_file", str(files["train"]), "--validation_file", str(files["validation"]),
            "--output_dir", str(folder), "--sampler", args.train_sampler, "--max_steps", str(args.train_steps),
            "--eval_strategy", "no", "--save_strategy", "no", "--logging_steps", "50", "--disable_tqdm", "true",
            "--max_eval_samples", "64", "--seed", str(args.seed), *shlex.split(args.recipe_args)]  # fmt: skip
    print(f"training the recipe's model for the 'trained' embeddings: wikitext2.py {' '.join(argv)}")
    t0 = time.perf_counter()
    wikitext2.main(argv)
    print(f"trained in {time.perf_counter() - t0:.0f} s")
    return str(folder)


# ---------------------------------------------------------------------------- measurements
def measure(smp, src: dict, s_idx, g_idx, full_grads, args) -> tuple[dict, torch.Tensor]:
    weight, queries, labels = src["weight"], src["queries"], src["labels"]
    q = queries[s_idx]
    diagnostics = hf_midx.proposal_diagnostics(smp, q, weight, num_samples=args.num_samples)
    rec = {key: float(value) for key, value in diagnostics.items()}
    rec.update(grad_bias(smp, weight, queries[g_idx], labels[g_idx], full_grads, args))
    return rec, smp.full_log_prob(q).exp().mean(0)


def full_gradients(weight, hidden, labels):
    h, w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    gh, gw = torch.autograd.grad(hf_midx.full_softmax_loss(h, w, labels), (h, w))
    return {"hidden": gh, "weight": gw}


def grad_bias(smp, weight, hidden, labels, full, args) -> dict:
    h, w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    sums = {k: torch.zeros_like(v, dtype=torch.float64) for k, v in full.items()}
    sq = {k: torch.zeros_like(v, dtype=torch.float64) for k, v in full.items()}
    r = args.grad_repeats
    for _ in range(r):
        loss = hf_midx.sampled_softmax_loss(h, w, labels, smp, args.num_samples, estimator=args.estimator,
                                            exact_ids=smp.excluded)  # fmt: skip
        for key, g in zip(("hidden", "weight"), torch.autograd.grad(loss, (h, w))):
            g = g.double()
            sums[key] += g
            sq[key] += g * g
    out = {}
    for key, ref in full.items():
        mean = sums[key] / r
        var = (sq[key] / r - mean * mean).clamp_min(0) * r / max(r - 1, 1)
        norm = float(ref.double().norm())
        dist2 = float(((mean - ref.double()) ** 2).sum())
        se2 = float(var.sum()) / r
        out[f"grad_bias_{key}"] = math.sqrt(dist2) / norm
        out[f"grad_se_{key}"] = math.sqrt(se2) / norm
        out[f"grad_bias_{key}_debiased"] = math.sqrt(max(0.0, dist2 - se2)) / norm
    return out


def learn_codebooks(smp, src, train_idx, args) -> dict:
    """Train LearnableCodebooks from the sampler's k-means codebooks; install them; return the curve."""
    cb = LearnableCodebooks(smp.index.codebooks, smp.quantizer)
    opt = torch.optim.Adam(cb.parameters(), lr=args.learn_lr)
    g = torch.Generator().manual_seed(args.seed + 11)
    weight, queries = src["weight"], src["queries"][train_idx]
    history = []
    t0 = time.perf_counter()
    for step in range(args.learn_steps):
        out = cb(weight, queries[torch.randint(queries.shape[0], (args.learn_queries,), generator=g)])
        opt.zero_grad()
        out["loss"].backward()
        opt.step()
        if step == 0 or (step + 1) % max(1, args.learn_steps // 10) == 0:
            history.append({"step": step + 1, **{k: float(out[k]) for k in ("loss", "recon", "kl")}})
    smp.set_codebooks(cb.codebooks, weight)
    return {"history": history, "seconds": time.perf_counter() - t0}


def run_source(label: str, src: dict, args, samplers, ks) -> dict:
    weight, queries = src["weight"].float(), src["queries"].float()
    src["weight"], src["queries"] = weight, queries
    v, d = weight.shape
    perm = torch.randperm(queries.shape[0], generator=torch.Generator().manual_seed(args.seed + 5))
    s = min(args.queries, queries.shape[0] // 2)
    s_idx, train_idx = perm[:s], perm[s:]
    g_idx = s_idx  # the gradient bias uses the same held-out queries, with their labels
    print(f"\n-- {label}: {src['description']} --")
    log_p = torch.log_softmax(queries[s_idx] @ weight.t(), dim=1)
    entropy = float(-(log_p.exp() * log_p).sum(1).mean())
    print(f"mean softmax entropy {entropy:.3f} nats (uniform: {math.log(v):.3f})")
    full = full_gradients(weight, queries[g_idx], src["labels"][g_idx])
    results, mean_q = [], {}
    mean_p = log_p.exp().mean(0)
    for name in samplers:
        for k in ks if name in MIDX else [args.plot_k if name in common.VARIANTS else None]:
            t0 = time.perf_counter()
            rq = {"midx-rq": common.build_sampler("midx-rq", weight, src["counts"], k, args.seed)} if name == "midx-exact" else None
            smp = common.build_sampler(name, weight, src["counts"], k or 64, args.seed, rq)
            rec, mq = measure(smp, src, s_idx, g_idx, full, args)
            rec.update({"source": label, "sampler": name, "K": k, "codebooks": "kmeans" if k else None,
                        "seconds": time.perf_counter() - t0})  # fmt: skip
            if name in ("midx-rq", "midx-pq"):
                rec["distortion"] = smp.index.distortion(weight)
            results.append(rec)
            if k is None or k == args.plot_k:
                mean_q[name] = mq
            print(f"{name:12s} K={k or '-':>4}: KL(Q||P) {rec['kl_qp']:.4f}  KL(P||Q) {rec['kl_pq']:.4f}  "
                  f"ESS {rec['ess']:.3f} (sampled {rec['ess_sampled']:.3f})  p/q>10 mass {rec['mass_p_over_q_gt_10']:.3f}  "
                  f"grad bias hidden {rec['grad_bias_hidden']:.4f} (se {rec['grad_se_hidden']:.4f})  "
                  f"weight {rec['grad_bias_weight']:.4f}")  # fmt: skip
            if name in ("midx-rq", "midx-pq") and k == args.learn_k and len(train_idx) > 0:
                learned = learn_codebooks(smp, src, train_idx, args)
                lrec, lq = measure(smp, src, s_idx, g_idx, full, args)
                lrec.update({"source": label, "sampler": name, "K": k, "codebooks": "learned", "learn": learned,
                             "distortion": smp.index.distortion(weight), "kmeans_kl_qp": rec["kl_qp"]})  # fmt: skip
                results.append(lrec)
                mean_q[f"{name} (learned)"] = lq
                print(f"{name:12s} K={k:>4} learned ({args.learn_steps} steps, {learned['seconds']:.0f} s): "
                      f"KL(Q||P) {rec['kl_qp']:.4f} -> {lrec['kl_qp']:.4f}")  # fmt: skip
    orders = {"by_frequency": torch.argsort(src["counts"].double(), descending=True, stable=True),
              "by_softmax": torch.argsort(mean_p, descending=True, stable=True)}  # fmt: skip
    curves = {"softmax": mean_p, **mean_q}
    cumulative = {o: {n: torch.cumsum(c[idx].double(), 0).float() for n, c in curves.items()} for o, idx in orders.items()}
    return {"label": label, "description": src["description"], "V": v, "D": d, "queries": s,
            "softmax_entropy": entropy, "results": results, "cumulative": cumulative}  # fmt: skip


# ---------------------------------------------------------------------------- main
def main(argv=None) -> dict:
    args = parse_args(argv)
    if common.resolve_device(args.device).type != "cpu":
        print("bench_kl measures distributions, not speed: it runs on the CPU.")
    device, q = torch.device("cpu"), args.quick
    args.queries = args.queries or common.by_size(args, 32, 64, 256)
    args.grad_repeats = args.grad_repeats or common.by_size(args, 3, 6, 50)
    args.learn_steps = args.learn_steps if args.learn_steps is not None else common.by_size(args, 5, 20, 300)
    ks = args.codebook_sizes or common.by_size(args, [8, 16], [8, 32], [8, 16, 32, 64, 128])
    args.plot_k = args.plot_k or (32 if 32 in ks else ks[-1])
    if args.learn_k not in ks:
        args.learn_k = ks[-1] if q else args.learn_k
    known = [*hf_midx.SAMPLERS, *common.proposal_variants()]
    samplers = args.samplers or known
    unknown = sorted(set(samplers) - set(known))
    if unknown:
        raise SystemExit(f"unknown sampler(s) {unknown}; choose from {', '.join(known)}.")
    args.estimator = args.estimator or hf_midx.MidxConfig().estimator
    ppl = json.loads(Path(args.ppl_json).read_text()) if args.ppl_json else None
    files = common.data_files(args.data_dir)
    source = args.source
    if source == "auto":
        source = "model" if args.model_dir else ("train" if files and not q else "synthetic")
    if source == "model" and not args.model_dir:
        raise SystemExit("--source model needs --model_dir (a folder saved by recipes/wikitext2.py).")
    if source == "train" and not files:
        raise SystemExit("--source train needs WikiText-2 text: pass --data_dir (train.txt, valid.txt).")
    torch.manual_seed(args.seed)
    training = {"train_steps": args.train_steps, "train_sampler": args.train_sampler, "recipe_args": args.recipe_args}
    env, settings = common.start(
        NAME, args, device, source=source, model_dir=args.model_dir, data_dir=str(args.data_dir or common.DEFAULT_DATA_DIR),
        queries=args.queries, codebook_sizes=ks, num_samples=args.num_samples, grad_repeats=args.grad_repeats,
        learn_k=args.learn_k, learn_steps=args.learn_steps, learn_lr=args.learn_lr, learn_queries=args.learn_queries,
        plot_k=args.plot_k, samplers=samplers, estimator=args.estimator, ppl=ppl, **(training if source == "train" else {}),
    )  # fmt: skip

    n = 2 * args.queries + 4 * args.learn_queries
    if source in ("model", "train"):
        model_dir = args.model_dir if source == "model" else train_model(args, Path(args.out), files)
        trained = model_source(model_dir, args.data_dir, n, args.seed)
        if source == "train":
            trained["description"] = (f"the recipe's model trained here for {args.train_steps} steps "
                                      f"(--sampler {args.train_sampler}); " + trained["description"])  # fmt: skip
    else:
        trained = synthetic_source(args.vocab or common.by_size(args, 1000, 4000, 33278),
                                   args.dim or common.by_size(args, 32, 64, 200), n, args.seed)  # fmt: skip
    v, d = trained["weight"].shape
    randomized = random_source(v, d, n, trained["counts"], args.seed)
    sources = [run_source("trained", trained, args, samplers, ks), run_source("random", randomized, args, samplers, ks)]

    named = [{**r, "provider": r["sampler"] + ("" if r["K"] is None else f"/K={r['K']}")
              + ("/learned" if r.get("codebooks") == "learned" else "")} for s in sources for r in s["results"]]  # fmt: skip
    rows = common.rows(env, named, op="kl", provider="provider", x_name="source", x="source",
                       metrics={"kl_qp": ("kl_q_p", "nats"), "kl_pq": ("kl_p_q", "nats"), "ess": ("ess", "fraction")})
    cumulative_tail = {  # a few points of each curve, for readers of the JSON
        s["label"]: {order: {n: [float(c[min(i, len(c) - 1)]) for i in (0, 9, 99, 999, 9999)] for n, c in curves.items()}
                     for order, curves in s["cumulative"].items()} for s in sources}  # fmt: skip
    extra = {"predicts_perplexity": predictiveness(sources[0], ppl, args.plot_k)} if ppl else {}
    md = render_markdown(env, settings, sources)
    if ppl:
        md += "\n\n" + predictiveness_markdown(extra["predicts_perplexity"])

    def plots():
        plot(args.out, sources, samplers, args.plot_k)
        if ppl:
            plot_predictiveness(args.out, extra["predicts_perplexity"])

    return common.finish(
        args, NAME, env, settings, md, plots, sources=[{k: v for k, v in s.items() if k != "cumulative"} for s in sources],
        rows=rows, paper_learned_codebooks={k: {"kmeans": a, "learned": b} for k, (a, b) in PAPER_LEARNED.items()},
        cumulative_tail=cumulative_tail, **extra)  # fmt: skip


def _spearman(x: list[float], y: list[float]) -> float | None:
    """Spearman rank correlation (average ranks for ties); None for fewer than 3 points or a constant side."""
    if len(x) < 3:
        return None

    def ranks(v):  # 0-based: the values below, plus half the other equal values
        t = torch.tensor(v, dtype=torch.float64)
        return (t[None] < t[:, None]).sum(1) + ((t[None] == t[:, None]).sum(1) - 1) / 2

    r = torch.corrcoef(torch.stack([ranks(x), ranks(y)]))[0, 1]
    return float(r) if torch.isfinite(r) else None


def predictiveness(source: dict, ppl: dict, plot_k: int) -> dict:
    """Each diagnostic (trained source, MIDX at K = plot_k) against the test perplexity of a run with that sampler."""
    points = {}
    for r in source["results"]:
        name = r["sampler"]
        if name in ppl and r.get("codebooks") != "learned" and r["K"] in (None, plot_k):
            points[name] = {"test_perplexity": float(ppl[name]), **{d: r[d] for d in DIAGNOSTICS}}
    names = sorted(points)
    ys = [math.log(points[n]["test_perplexity"]) for n in names]
    # ESS: larger is better, so its correlation with perplexity should be negative; the others positive.
    corr = {d: _spearman([points[n][d] for n in names], ys) for d in DIAGNOSTICS}
    return {"points": points, "spearman_vs_log_ppl": corr}


def predictiveness_markdown(pred: dict) -> str:
    corr = pred["spearman_vs_log_ppl"]
    rows = [{"sampler": n, "ppl": f"{p['test_perplexity']:.1f}", **{d: _f4(p[d]) for d in DIAGNOSTICS}}
            for n, p in sorted(pred["points"].items(), key=lambda kv: kv[1]["test_perplexity"])]  # fmt: skip
    rows.append({"sampler": "**Spearman vs ppl**", "ppl": "",
                 **{d: "-" if corr[d] is None else f"{corr[d]:+.2f}" for d in DIAGNOSTICS}})  # fmt: skip
    cols = [("sampler", "sampler"), ("test ppl of its run", "ppl")] + [(d, d) for d in DIAGNOSTICS]
    return "## Which diagnostic predicts perplexity\n\n" + common.markdown_table(rows, cols)


def plot_predictiveness(out_dir, pred: dict) -> None:
    def panel(d):
        def extra(ax):
            for name, p in pred["points"].items():
                ax.scatter([p[d]], [p["test_perplexity"]], label=name)
                ax.annotate(name, (p[d], p["test_perplexity"]), fontsize=6)

        c = pred["spearman_vs_log_ppl"][d]
        return {"lines": {}, "extra": extra, "legend": 0, "xlabel": d, "ylabel": "test perplexity of a run",
                "title": f"{d} (Spearman {'-' if c is None else f'{c:+.2f}'})"}  # fmt: skip

    common.plot_panels(out_dir, f"{NAME}_predicts_ppl.png", [panel(d) for d in DIAGNOSTICS], size=(4, 3.8))


def _f4(x: float) -> str:
    return f"{0.0 if abs(x) < 5e-5 else x:.4f}"  # no "-0.0000" from rounding noise


def render_markdown(env, settings, sources):
    parts = []
    for s in sources:
        parts.append(f"## {s['label']}: {s['description']}\n")
        parts.append(f"Mean softmax entropy {s['softmax_entropy']:.3f} nats (uniform {math.log(s['V']):.3f}); "
                     f"{s['queries']} held-out queries; gradient bias over {settings['grad_repeats']} draws of "
                     f"M={settings['num_samples']} negatives per token.\n")  # fmt: skip
        parts.append(common.markdown_table(s["results"], [
            ("sampler", "sampler"), ("K", "K"), ("codebooks", "codebooks"),
            ("KL(Q‖P)", lambda r: _f4(r["kl_qp"])), ("KL(P‖Q)", lambda r: _f4(r["kl_pq"])),
            ("ESS/M analytic / sampled", lambda r: f"{_f4(r['ess'])} / {_f4(r['ess_sampled'])}"),
            ("P mass p/q>10", lambda r: _f4(r["mass_p_over_q_gt_10"])),
            ("grad bias, hidden (± MC se)", lambda r: f"{_f4(r['grad_bias_hidden'])} ± {_f4(r['grad_se_hidden'])}"),
            ("hidden, noise removed", lambda r: _f4(r["grad_bias_hidden_debiased"])),
            ("grad bias, weight (± MC se)", lambda r: f"{_f4(r['grad_bias_weight'])} ± {_f4(r['grad_se_weight'])}"),
            ("weight, noise removed", lambda r: _f4(r["grad_bias_weight_debiased"]))]) + "\n")  # fmt: skip
        learned = [r for r in s["results"] if r.get("codebooks") == "learned"]
        if learned:
            parts.append(f"### k-means vs learned codebooks ({s['label']}, K={settings['learn_k']}, "
                         f"{settings['learn_steps']} Adam steps at lr {settings['learn_lr']})\n")  # fmt: skip
            parts.append(common.markdown_table(learned, [
                ("sampler", "sampler"), ("KL(Q‖P) k-means", lambda r: _f4(r["kmeans_kl_qp"])),
                ("KL(Q‖P) learned", lambda r: _f4(r["kl_qp"])),
                ("paper (PTB LSTM, its KL-loss)", lambda r: "{:.4f} -> {:.4f}".format(*PAPER_LEARNED[r["sampler"]])),
            ]) + "\n")  # fmt: skip
    parts.append("KL(Q‖P) = Σ Q log(Q/P) over all V classes (hf_midx.kl_to_softmax). The gradient bias is "
                 "‖mean of R sampled gradients − full gradient‖ / ‖full gradient‖; '±' is the Monte-Carlo "
                 "standard error of that mean, which the 'noise removed' column subtracts in quadrature.")  # fmt: skip
    return common.report("Sampling distributions vs the softmax", env, settings, *parts)


def plot(out_dir, sources, samplers, plot_k):
    def style(name):
        if name == "softmax":
            return {"linewidth": 3, "color": "black", "zorder": 0}
        return {"linewidth": 1, "linestyle": ":"} if name == "midx-exact" else {"linewidth": 1.2}

    for s in sources:
        panels = [{"lines": {n: (torch.arange(1, len(c) + 1).numpy(), c.numpy()) for n, c in curves.items()},
                   "style": style, "xscale": "log", "ylabel": "cumulative probability (mean over queries)",
                   "xlabel": "classes, " + ("most frequent first" if order == "by_frequency" else "most probable first"),
                   "title": f"{s['label']}: ordered by training frequency (MIDX K={plot_k})" if order == "by_frequency"
                   else f"{s['label']}: ordered by softmax probability", "legend": 0 if order == "by_frequency" else 7}
                  for order, curves in s["cumulative"].items()]  # fmt: skip
        common.plot_panels(out_dir, f"{NAME}_cumulative_{s['label']}.png", panels)

    def vs_k(s):
        kmeans = [r for r in s["results"] if r.get("codebooks") != "learned"]
        fixed = {r["sampler"]: r["kl_qp"] for r in kmeans if r["K"] is None and r["sampler"] in samplers}

        def extra(ax):  # samplers without codebooks as horizontal lines, learned codebooks as stars
            for name, kl in fixed.items():
                ax.axhline(kl, linestyle="--", linewidth=1, label=name)
            for r in s["results"]:
                if r.get("codebooks") == "learned":
                    ax.plot([r["K"]], [r["kl_qp"]], marker="*", markersize=12, linestyle="none", label=f"{r['sampler']} learned")

        lines = common.lines([r for r in kmeans if r["K"] is not None], "K", "kl_qp", "sampler")
        return {"lines": {n: lines[n] for n in samplers if n in lines}, "extra": extra, "xscale": ("log", {"base": 2}),
                "yscale": ("symlog", {"linthresh": 1e-3}), "xlabel": "K (codewords per codebook)",
                "ylabel": "KL(Q || softmax), nats", "title": f"{s['label']} embeddings"}  # fmt: skip

    common.plot_panels(out_dir, f"{NAME}_vs_K.png", [vs_k(s) for s in sources])


if __name__ == "__main__":
    main()
