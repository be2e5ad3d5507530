"""Finished ``recipes/large_vocab.py`` runs scored on many fresh tokens of their chain, with standard errors.

A test split of 10,000 tokens (the recipe's before ``--test_tokens``) cannot rank runs a few tenths of a percent
apart: on one, two runs read 0.43% apart that are 0.03% +- 0.18 apart on 100,000 fresh tokens. This script draws
N fresh tokens from the runs' own chain (blocks of the recipe's length, from a seed stream that no recipe
split uses) and scores every run's saved model on them with the exact softmax:

* per run: NLL in nats per token, perplexity, and its ratio to the true chain's perplexity on the same
  tokens (exp(NLL - the chain's NLL on them): the sample's own optimum, beside exp(H));
* per configuration (sampler, M, H, K, ...; ``synthetic_curves.config_label``) and seed: the paired
  difference to ``unigram`` with the same M and H and to ``full``, in % of perplexity, with a 95% interval
  from the blocks (blocks are independent runs of the chain: their mean NLLs are i.i.d.), then the mean and
  standard deviation of the per-seed differences;
* where each difference lies: its split by the next word's frequency band (ranks [0, H), [H, 10H), [10H, V)),
  in nats per token of the whole sample, summing to the whole difference; and, in brackets, per token of that
  band (the contribution over the band's share of the tokens): what a word of the band gains or loses.

The JSON keeps each run's per-block scores, so ``--merge`` tables outputs of separate calls on the same tokens
(same chain, ``--tokens``, ``--seed`` and ``--exact_head``) together without scoring again.

Run: ``python recipes/benchmarks/synthetic_heldout.py runs/v100k/*_s* --tokens 100000 --out results/cpu-synthetic``,
or ``--merge OUT1/synthetic_heldout.json OUT2/synthetic_heldout.json --out OUT``.
"""

from __future__ import annotations

import json
import math
import re
import statistics
from pathlib import Path

import torch

if __package__:
    from . import common, synthetic_curves
else:  # run as a file: this folder is first on sys.path
    import common
    import synthetic_curves

synthetic = common.import_recipe("synthetic")

NAME = "synthetic_heldout"
#: Seed stream of the fresh blocks: the recipe's splits use [corpus_seed, 0..2], synthetic_coverage [.., 99, ..].
STREAM = 98
#: Logits per forward pass, at most (float32: 256 MB).
LOGITS_PER_BATCH = 2**26


def load_runs(run_dirs: list[Path]) -> tuple[list[dict], dict, int]:
    """The runs' ``results.json`` with their label and seed; the chain settings and block length they share."""
    runs, chains, keys = [], set(), synthetic.ZipfMarkovChain.FACT_KEYS
    for run_dir in run_dirs:
        try:
            results = json.loads((run_dir / "results.json").read_text())
            facts, seq_len = tuple(results["synthetic"][k] for k in keys), results["data"]["seq_len"]
        except (OSError, ValueError, KeyError) as err:
            raise SystemExit(f"{run_dir}: not a large_vocab run ({err}).") from None
        if not results.get("complete") or not (run_dir / "config.json").is_file():
            raise SystemExit(f"{run_dir}: the run did not finish (no complete results.json and saved model).")
        chains.add((facts, seq_len))
        label = synthetic_curves.config_label(results)
        runs.append({"dir": run_dir, "label": label, "seed": synthetic_curves.run_seed(results, run_dir)})
    if len(chains) != 1:
        raise SystemExit(f"The runs come from {len(chains)} different chains or block lengths; score one at a time.")
    (settings, seq_len), = chains
    return runs, dict(zip(keys, settings)), seq_len


@torch.no_grad()
def token_nll(run_dir: Path, blocks: torch.Tensor) -> torch.Tensor:
    """(B, L) float64 exact NLL of each predicted token of (B, L + 1) int64 ``blocks`` under the run's model."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(run_dir).eval()
    vocab, length = model.get_output_embeddings().weight.shape[0], blocks.shape[1] - 1
    step = max(1, LOGITS_PER_BATCH // (vocab * length))
    out = []
    for chunk in blocks.split(step):
        logits = model(chunk[:, :-1]).logits.float().flatten(0, 1)  # (b * L, V)
        nll = torch.nn.functional.cross_entropy(logits, chunk[:, 1:].flatten(), reduction="none")
        out.append(nll.double().view(-1, length))
    return torch.cat(out)


def band_edges(vocab: int, head: int) -> list[int]:
    return [0, head, min(10 * head, vocab), vocab] if head else [0, vocab // 100, vocab // 10, vocab]


def block_scores(nll: torch.Tensor, nexts: torch.Tensor, edges: list[int]) -> dict:
    """What the comparisons need of a (B, L) NLL: each block's mean (B,) and its sum per band of the next
    word's rank (B, bands), as lists (JSON, for --merge)."""
    bands = torch.stack([(nll * ((nexts >= lo) & (nexts < hi))).sum(1) for lo, hi in zip(edges, edges[1:])], 1)
    return {"block_nll": nll.mean(1).tolist(), "block_band_nll": bands.tolist()}


def paired(run: dict, base: dict, length: int) -> dict:
    """The difference of two runs on the same blocks: in % of perplexity with a 95% interval from the block
    means, and in nats per token by the next word's band (the bands sum to the total)."""
    def minus(key: str) -> torch.Tensor:
        return torch.tensor(run[key], dtype=torch.float64) - torch.tensor(base[key], dtype=torch.float64)

    per_block = minus("block_nll")
    diff, se = per_block.mean().item(), per_block.std().item() / math.sqrt(per_block.numel())
    bands = minus("block_band_nll").sum(0)
    pct = lambda d: 100 * math.expm1(d)  # noqa: E731
    return {"pct": pct(diff), "low": pct(diff - 1.96 * se), "high": pct(diff + 1.96 * se), "nats": diff,
            "se_nats": se, "bands_nats": (bands / (per_block.numel() * length)).tolist()}  # fmt: skip


def summarize(runs: list[dict], baseline_of) -> list[dict]:
    """Per configuration other than its baseline: the per-seed paired differences and their mean +- sd."""
    groups: dict[str, dict[int, dict]] = {}
    for r in runs:
        groups.setdefault(r["label"], {})[r["seed"]] = r
    rows = []
    for label, by_seed in sorted(groups.items()):
        base_label = baseline_of(label)
        if base_label is None or base_label not in groups or base_label == label:
            continue
        seeds = sorted(set(by_seed) & set(groups[base_label]))
        diffs = [by_seed[s]["vs"][base_label] for s in seeds]
        if not diffs:
            continue
        pcts = [d["pct"] for d in diffs]
        rows.append({
            "config": label, "baseline": base_label, "seeds": seeds, "pct": pcts,
            "mean": statistics.fmean(pcts), "sd": statistics.stdev(pcts) if len(pcts) > 1 else None,
            "bands_nats": [statistics.fmean(band) for band in zip(*(d["bands_nats"] for d in diffs))],
        })  # fmt: skip
    return rows


def unigram_of(label: str) -> str | None:
    m_h = re.search(r"( M=\d+ H=\d+)", label)
    return f"unigram{m_h.group(1)}" if m_h and not label.startswith("unigram") else None


def check_unique(runs: list[dict]) -> None:
    seen = {}
    for r in runs:
        other = seen.setdefault((r["label"], r["seed"]), r["dir"])
        if other != r["dir"]:
            raise SystemExit(f"{r['dir']} and {other} are both {r['label']}, seed {r['seed']}: give one of them.")


def score(args) -> tuple[dict, list[dict]]:
    """Draw the fresh blocks and score every run on them: (settings, runs with their block scores)."""
    runs, syn, seq_len = load_runs(args.run_dirs)
    check_unique(runs)  # before minutes of scoring
    chain = synthetic.ZipfMarkovChain.from_facts(syn)
    num_blocks = max(2, math.ceil(args.tokens / seq_len))
    blocks = chain.sample_blocks(num_blocks, seq_len + 1, seed=[syn["corpus_seed"], STREAM, args.seed])
    oracle = -torch.from_numpy(chain.log_prob(blocks))  # (B, L) float64
    blocks = torch.from_numpy(blocks)
    nexts, edges = blocks[:, 1:], band_edges(chain.vocab_size, args.exact_head)
    settings = {"synthetic": syn, "seq_len": seq_len, "blocks": num_blocks, "tokens": num_blocks * seq_len,
                "seed": args.seed, "exact_head": args.exact_head, "bands": edges,
                "exp_entropy_rate": math.exp(chain.entropy_rate()),
                "label_share": [((nexts >= lo) & (nexts < hi)).double().mean().item()
                                for lo, hi in zip(edges, edges[1:])],
                "oracle": block_scores(oracle, nexts, edges)}  # fmt: skip
    for r in runs:
        r.update(block_scores(token_nll(r["dir"], blocks), nexts, edges))
        r["dir"] = str(r["dir"])
        print(f"{r['dir']}: {r['label']} seed {r['seed']}: scored", flush=True)
    return settings, runs


def merge(paths: list[Path]) -> tuple[dict, list[dict]]:
    """Earlier outputs of this script on the same tokens, as one set of runs."""
    settings, runs = None, []
    for path in paths:
        try:
            payload = json.loads(path.read_text())
            these, more = payload["settings"], payload["runs"]
        except (OSError, ValueError, KeyError) as err:
            raise SystemExit(f"{path}: not a synthetic_heldout output ({err}).") from None
        these = {k: v for k, v in these.items() if k not in ("run_dirs", "merged")}
        if settings is not None and these != settings:
            raise SystemExit(f"{path} scored other tokens (chain, blocks, stream seed or bands) than {paths[0]}.")
        settings = these
        runs += [{k: v for k, v in r.items() if k != "vs"} for r in more]
    return settings, runs


def main(argv=None) -> dict:
    p = common.base_parser(__doc__.split("\n\n")[0], timed=False, plots=False)
    p.add_argument("run_dirs", type=Path, nargs="*", help="output folders of finished recipes/large_vocab.py runs")
    p.add_argument("--tokens", type=int, default=100_000, help="N fresh predicted tokens (rounded up to blocks)")
    p.add_argument("--exact_head", type=int, default=2048, help="H of the frequency bands (0: V/100 and V/10)")
    p.add_argument("--merge", type=Path, nargs="+", default=None, metavar="JSON",
                   help="table earlier outputs of this script (same tokens) together instead of scoring runs")
    p.add_argument("--tag", default=None, help="suffix of the output names")
    args = common.parse(p, argv)
    if args.tokens < 2 or args.exact_head < 0:
        raise SystemExit("--tokens must be >= 2 and --exact_head >= 0.")
    if bool(args.merge) == bool(args.run_dirs):
        raise SystemExit("Give either run folders to score or --merge with earlier outputs, not both or neither.")
    settings, runs = merge(args.merge) if args.merge else score(args)
    if args.merge:
        check_unique(runs)
    oracle, length = settings["oracle"], settings["seq_len"]
    oracle_nll = statistics.fmean(oracle["block_nll"])
    for r in runs:
        r["nll"] = statistics.fmean(r["block_nll"])
        r["perplexity"], r["ratio"] = math.exp(r["nll"]), math.exp(r["nll"] - oracle_nll)
    by_key = {(r["label"], r["seed"]): r for r in runs}
    for r in runs:
        r["vs"] = {}
        for base_label in {unigram_of(r["label"]), "full"} - {None, r["label"]}:
            base = by_key.get((base_label, r["seed"]))
            if base is not None:
                r["vs"][base_label] = paired(r, base, length)
    summary = {"vs unigram": summarize(runs, unigram_of), "vs full": summarize(runs, lambda label: "full")}
    for row in summary["vs unigram"] + summary["vs full"]:
        # A band's contribution over the band's own share of the tokens: the difference per word of that band.
        shares = settings["label_share"]
        row["bands_nats_per_band_token"] = [c / s if s else None for c, s in zip(row["bands_nats"], shares)]

    edges = settings["bands"]
    bands = [f"[{lo:,}, {hi:,})" for lo, hi in zip(edges, edges[1:])]
    fmt_vs = lambda d: f"{d['pct']:+.2f}% [{d['low']:+.2f}, {d['high']:+.2f}]"  # noqa: E731
    vs_unigram = lambda r: next((fmt_vs(d) for k, d in r["vs"].items() if k != "full"), None)  # noqa: E731
    vs_full = lambda r: fmt_vs(r["vs"]["full"]) if "full" in r["vs"] else None  # noqa: E731
    columns = [("run", lambda r: Path(r["dir"]).name), ("configuration", "label"), ("seed", "seed"),
               ("perplexity", lambda r: f"{r['perplexity']:.2f}"), ("/ chain's", lambda r: f"{r['ratio']:.4f}"),
               ("vs unigram, same seed (95%)", vs_unigram), ("vs full, same seed (95%)", vs_full)]  # fmt: skip
    mean_sd = lambda r: f"{r['mean']:+.2f}%" + ("" if r["sd"] is None else f" ± {r['sd']:.2f}")  # noqa: E731

    def band_cell(r, i):
        per_band = r["bands_nats_per_band_token"][i]
        return f"{r['bands_nats'][i]:+.4f}" + ("" if per_band is None else f" ({per_band:+.4f})")

    summary_columns = [("configuration", "config"), ("against", "baseline"),
                       ("seeds", lambda r: ", ".join(map(str, r["seeds"]))),
                       ("per seed", lambda r: ", ".join(f"{x:+.2f}%" for x in r["pct"])), ("mean ± sd", mean_sd),
                       *[(f"next word in {b}: nats per token (per token of the band)", lambda r, i=i: band_cell(r, i))
                         for i, b in enumerate(bands)]]  # fmt: skip
    pairs = summary["vs unigram"] + summary["vs full"]
    no_pairs = ("No run has its unigram or full-softmax partner of the same seed here: score the partners together, "
                "or `--merge` their outputs.")  # fmt: skip
    syn = settings["synthetic"]
    md = (
        f"# {NAME}\n\n{settings['tokens']:,} fresh tokens ({settings['blocks']:,} blocks of {length}) of the chain "
        f"(V = {syn['vocab_size']:,}, corpus seed {syn['corpus_seed']}, stream seed {settings['seed']}); the chain's "
        f"own perplexity on them {math.exp(oracle_nll):.2f} (exp(H) = {settings['exp_entropy_rate']:.2f}). Share of "
        "the tokens by the next word's rank: "
        + ", ".join(f"{b} {s:.3f}" for b, s in zip(bands, settings["label_share"])) + ".\n\n"
        + common.markdown_table(runs, columns)
        + "\n\n## Paired differences over seeds (in % of the baseline's perplexity; by band in nats per token)\n\n"
        + (common.markdown_table(pairs, summary_columns) if pairs else no_pairs)
    )
    sources = {"merged": [str(x) for x in args.merge]} if args.merge else {"run_dirs": [str(d) for d in args.run_dirs]}
    payload = {"settings": {**settings, **sources}, "oracle_perplexity": math.exp(oracle_nll), "runs": runs,
               "summary": summary}  # fmt: skip
    common.write_outputs(args.out, NAME + (f"_{args.tag}" if args.tag else ""), payload, md)
    print(md)
    return payload


if __name__ == "__main__":
    main()
