"""The paper's language-model table: test perplexity of every sampler on WikiText-2, with recipes/wikitext2.py.

Each sampler trains the paper's transformer (GPT-2 architecture, 2 layers, 4 heads, d 200, ff 1024, 50 tokens per
block, 20 negatives, K = 32; the recipe's defaults) with ``recipes/wikitext2.py``, in ``--out/<sampler>`` (and
``--out/<sampler>-wallclock``), and is compared

* at **equal epochs** (``--epochs``, default 1): exact full-softmax test perplexity after the same number of passes
  over the data;
* at **equal wall-clock**: every sampler trains for as long as ``full`` needed for those epochs (its training time
  without evaluations): ``--max_steps`` = that budget / the sampler's own measured time per step in the equal-epochs
  run.

The adaptive samplers are rebuilt from the current head weight ``--refreshes_per_epoch`` times per epoch (the recipe's
``--refresh_every_steps``): the recipe's default refresh at each epoch start never happens in a 1-epoch run, which
would leave the index built on the random initial weights (and the learned codebooks of ``midx-rq-learned`` unused, as
they are installed at refreshes). Refresh time counts as training time.

The validation perplexity is evaluated ``--evals_per_run`` times per run and plotted against the training time
(evaluation time subtracted, read from the Trainer's log history). The paper's figures (Transformer on WikiText-2, 100
epochs with early stopping) are quoted beside ours; at 1 epoch ours are far from converged, so compare the ordering,
not the values.

Seeds: ``--seeds N`` repeats every equal-epochs run with seeds ``--seed`` .. ``--seed + N - 1`` and reports the mean
and sample standard deviation of the exact test perplexity (the equal-wall-clock runs and the plotted curves use the
first seed).

Profile ``paper`` (issue 73) is the paper's own setting as its code runs it (results/paper_setting/README.md: each
point, matched or not). Profiles ``cpu-quick`` and ``gpu-3epochs`` fix the settings of issue 9's quality benchmark: ``cpu-quick`` (400 steps of the paper's
model, the issue's acceptance run, at equal steps; equal wall-clock off) and ``gpu-3epochs`` (3 epochs, 3 seeds, equal
wall-clock on). Both compare the full softmax, the static unigram proposal, midx-rq as it was before issue 9
(``midx-rq-paper``: exact positive, no mixture), the current default ``midx-rq`` and each new variant. (The
non-sampling adaptive-softmax row of the README was trained by ``adaptive_softmax.py``, retired after commit 9426078,
where ``--samplers adaptive-softmax`` still runs it.)

Data: ``--data_dir`` (train.txt, valid.txt, test.txt), default ``../shared/data/wikitext-2`` beside the repository;
without it (and in ``--quick`` unless ``--data_dir`` is given), the small WikiText-2 sample shipped in recipes/data
(said in the report). ``--quick`` also shrinks the model (d 32, 1 layer), the blocks (20 tokens) and the data (64
training blocks, 16 evaluation blocks), and runs in-process.

Run: ``python recipes/benchmarks/compare_samplers.py --out bench-out [--quick] [--epochs 1]``.
"""

from __future__ import annotations

import json
import math
import os
import shlex
import shutil
import statistics
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

if __package__:
    from . import common
else:  # run as a file: this folder is first on sys.path
    import common

NAME = "compare_samplers"
DEFAULT_SAMPLERS = ("full", "uniform", "unigram", "log-uniform", "lsh", "sphere", "rff", "midx-pq", "midx-rq", "midx-rq-learned")
#: Test perplexity of the paper's Transformer on WikiText-2 (its LM table).
PAPER_PPL = {
    "full": 180.8331, "uniform": 259.4951, "unigram": 218.4348, "lsh": 221.4062, "sphere": 273.8121, "rff": 278.9223,
    "midx-pq": 199.7429, "midx-rq": 180.9055,
    "midx-rq-paper": 180.9055,  # the paper's midx-rq itself: exact positive, no mixture
    "midx-pq-uniform": 199.7429, "midx-rq-uniform": 180.9055,  # its MIDX (uniform inside a bucket) in its own setting
    "unigram-logcount": 218.4348,  # its code's unigram (log(count + 1))
}  # fmt: skip
#: --profile presets (issue 9): the rows and the settings of the quality benchmark.
PROFILE_SAMPLERS = ("full", "unigram", "midx-rq-paper", "midx-rq", "midx-rq-nomix", "midx-rq-frequency",
                    "midx-rq-frequency-mix", "midx-rq-head2k")  # fmt: skip
PROFILES = {"cpu-quick": dict(max_steps=400, seeds=1, wall_clock="off"),
            "gpu-3epochs": dict(epochs=3.0, seeds=3, wall_clock="on")}
#: --profile paper (issue 73): the paper's own setting, point by point as its code runs it (results/paper_setting/
#: README.md lists each point, matched or not): pure sampling (no exact head, no mixture, the sampled tail
#: gradient), the corrected label (its loss_func.py), batch 256, Adam at a constant 1e-3 with no weight decay, no
#: warm-up and no clipping, dropout 0.5, 100 k-means iterations rebuilt at each epoch start, and the best epoch by
#: validation perplexity (what its early stopping reports).
PAPER_SAMPLERS = ("full", "uniform", "unigram", "unigram-logcount", "lsh", "sphere", "rff", "midx-pq-uniform",
                  "midx-rq-uniform", "midx-rq", "midx-rq-learned")  # fmt: skip
PAPER_RECIPE_ARGS = (
    "--exact_head 0 --mix_weight 0 --tail_gradient sampled --estimator corrected-positive --kmeans_iters 100 "
    "--refresh_every_epoch true --learning_rate 1e-3 --lr_scheduler_type constant --warmup_steps 0 "
    "--weight_decay 0 --max_grad_norm 0 --config_overrides resid_pdrop=0.5,embd_pdrop=0.5,attn_pdrop=0.5 "
    "--eval_strategy epoch --save_strategy epoch --save_total_limit 100 --load_best_model_at_end true "
    "--metric_for_best_model eval_loss"  # every epoch's checkpoint kept (the recipe keeps 2) for --test_by_epoch
)
PROFILES["paper"] = dict(epochs=3.0, seeds=1, wall_clock="off", batch_size=256, refreshes_per_epoch=0,
                         samplers=PAPER_SAMPLERS, recipe_args=PAPER_RECIPE_ARGS, test_by_epoch=True)  # fmt: skip
#: The proposal's coverage as the recipe logs it (``midx/<key>``): KL(P||Q), KL(Q||P), ESS / M (exact and from the
#: draws) and P's mass where p/q > 10 (``hf_midx.integration.diagnostics``).
COVERAGE_KEYS = ("kl_pq", "kl", "ess", "ess_sampled", "mass_p_over_q_gt_10")
KEEP_MODELS = ("full", "midx-rq")  # their weights stay (e.g. for bench_kl.py --model_dir); others are deleted
QUICK_OVERRIDES = "n_embd=32,n_layer=1,n_head=2,n_inner=64"
SMOKE_OVERRIDES = "n_embd=16,n_layer=1,n_head=2,n_inner=32"
SMOKE_SAMPLERS = ("full", "uniform", "midx-rq", "midx-rq-learned")


def parse_args(argv=None):
    p = common.base_parser(__doc__.splitlines()[0], num_samples=20, codebook_size=32,
                           pool_size=(1024, "of midx-rq-shared"))  # fmt: skip
    p.add_argument("--data_dir", default=None,
                   help="folder with train.txt, valid.txt, test.txt (default ../shared/data/wikitext-2 beside the repository)")  # fmt: skip
    p.add_argument("--samplers", nargs="+", default=list(DEFAULT_SAMPLERS),
                   help=f"'full', any hf_midx sampler or a variant (sampler + flags: {', '.join(common.VARIANTS)})")
    p.add_argument("--epochs", type=float, default=1.0, help="epochs of the equal-epochs comparison")
    p.add_argument("--max_steps", type=int, default=None, help="train every sampler for this many steps instead of --epochs (equal steps)")
    p.add_argument("--seeds", type=int, default=1,
                   help="seeds per equal-epochs run (--seed, --seed + 1, ...): mean and sd of the test perplexity")  # fmt: skip
    p.add_argument("--profile", default=None, choices=sorted(PROFILES),
                   help="presets: 'cpu-quick' (400 steps, issue 9's acceptance run), 'gpu-3epochs' (3 epochs, 3 seeds), "
                   "'paper' (the paper's own setting, issue 73: its batch, optimizer, dropout, rebuilds, pure sampling, "
                   "the best epoch; 3 epochs unless --epochs); they set --samplers (unless given), --max_steps/--epochs, "
                   "--seeds and --wall_clock, and 'paper' also --batch_size, --refreshes_per_epoch and recipe flags "
                   "put before --recipe_args")  # fmt: skip
    p.add_argument("--batch_size", type=int, default=None, help="per-device train batch (default 32; quick 8)")
    p.add_argument("--evals_per_run", type=int, default=None, help="validation points per run (default 4; quick 2)")
    p.add_argument("--refreshes_per_epoch", type=int, default=None,
                   help="rebuild adaptive samplers this many times per epoch (--refresh_every_steps; default 10, "
                   "quick 2; 0: only the recipe's per-epoch refresh, which never happens in a 1-epoch run)")  # fmt: skip
    p.add_argument("--wall_clock", default="on", choices=["on", "off"], help="also run the equal-wall-clock comparison")
    p.add_argument("--wall_clock_samplers", nargs="+", default=None,
                   help="samplers of the equal-wall-clock comparison (default: all of --samplers)")  # fmt: skip
    p.add_argument("--wall_clock_budget_s", type=float, default=None,
                   help="training-time budget of the equal-wall-clock runs (default: what full needed)")  # fmt: skip
    p.add_argument("--launcher", default=None, choices=["subprocess", "inprocess"],
                   help="run the recipe in a fresh process per run (default) or import it (default with --quick)")  # fmt: skip
    p.add_argument("--recipe_args", default="",
                   help='extra flags for recipes/wikitext2.py, e.g. "--config_overrides n_layer=4 --learning_rate 5e-4"')  # fmt: skip
    p.add_argument("--parallel", type=int, default=1,
                   help="equal-epochs runs at a time (subprocesses sharing the machine, e.g. a GPU that one small run leaves "
                   "idle); their perplexities are unaffected but their timings are not comparable, so it needs --wall_clock off")  # fmt: skip
    p.add_argument("--keep_models", action="store_true", help=f"keep every run's weights (default: only {KEEP_MODELS})")
    p.add_argument("--test_by_epoch", action="store_true",
                   help="the exact test perplexity of every checkpoint a run saved (with the recipe's --save_strategy "
                   "epoch: one per epoch); set by --profile paper")  # fmt: skip
    args = common.parse(p, argv)
    if args.profile:
        given = set(argv if argv is not None else sys.argv[1:])
        preset = PROFILES[args.profile]
        if "--samplers" not in given:
            args.samplers = list(preset.get("samplers", PROFILE_SAMPLERS))
        for key, value in preset.items():
            if key == "recipe_args":  # the profile's flags first: the user's own, after them, win
                args.recipe_args = f"{value} {args.recipe_args}".strip()
            elif key != "samplers" and f"--{key}" not in given:
                setattr(args, key, value)
    return args


# ---------------------------------------------------------------------------- running the recipe
def recipe_argv(args, files, out_dir: Path, sampler: str, *, epochs=None, max_steps=None, every=1, refresh_every=0
                ) -> list[str]:
    name = common.VARIANTS[sampler][0] if sampler in common.VARIANTS else sampler
    argv = ["--train_file", str(files["train"]), "--validation_file", str(files["validation"])]
    argv += ["--test_file", str(files["test"])] if "test" in files else []
    argv += ["--output_dir", str(out_dir), "--sampler", name, "--num_samples", str(args.num_samples),
             "--codebook_size", str(args.codebook_size), "--per_device_train_batch_size", str(args.batch_size),
             "--seed", str(args.seed), "--disable_tqdm", "true", "--save_strategy", "no", "--eval_strategy", "steps",
             "--eval_steps", str(every), "--logging_steps", str(every), "--refresh_every_steps", str(refresh_every)]  # fmt: skip
    argv += ["--num_train_epochs", str(epochs)] if epochs is not None else ["--max_steps", str(max_steps)]
    if args.quick:
        argv += [*_quick_argv(args), "--per_device_eval_batch_size", "16", "--logging_first_step", "false"]
    # The variant's flags come last, so that they win over the shared ones.
    variant = common.variant_flags(sampler, args.pool_size) if sampler in common.VARIANTS else []
    return _merge_config_overrides(argv + variant + shlex.split(args.recipe_args))


def _merge_config_overrides(argv: list[str]) -> list[str]:
    """One ``--config_overrides`` joining every one given (--quick's model and a profile's dropout), later
    values winning: the recipe would keep only the last flag."""
    values = [argv[i + 1] for i, a in enumerate(argv[:-1]) if a == "--config_overrides"]
    if len(values) < 2:
        return argv
    out, skip = [], False
    for i, a in enumerate(argv):
        if skip:
            skip = False
        elif a == "--config_overrides":
            skip = True
        else:
            out.append(a)
    return [*out, "--config_overrides", ",".join(values)]


def _quick_argv(args) -> list[str]:
    """--quick's model, blocks and data."""
    train, evals = (16, 4) if args.smoke else (64, 16)
    return ["--config_overrides", SMOKE_OVERRIDES if args.smoke else QUICK_OVERRIDES, "--seq_len", "20",
            "--max_train_samples", str(train), "--max_eval_samples", str(evals)]  # fmt: skip


def run_recipe(argv: list[str], out_dir: Path, launcher: str, threads: int | None = None) -> dict:
    """One recipe run; returns its results.json, log history, wall time and error (None when it worked).

    ``threads`` caps the subprocess's intra-op threads (for runs that share the machine)."""
    out_dir.mkdir(parents=True, exist_ok=True)
    stale = out_dir / "results.json"
    stale.unlink(missing_ok=True)
    print(f"\n$ wikitext2.py {' '.join(shlex.quote(a) for a in argv)}", flush=True)
    error, t0 = None, time.perf_counter()
    if launcher == "subprocess":
        env = None if threads is None else {**os.environ, "OMP_NUM_THREADS": str(threads)}
        with open(out_dir / "recipe.log", "w") as log:
            proc = subprocess.run([sys.executable, str(common.RECIPES_DIR / "wikitext2.py"), *argv], stdout=log,
                                  stderr=subprocess.STDOUT, cwd=common.REPO_ROOT, env=env)  # fmt: skip
        if proc.returncode != 0:
            tail = (out_dir / "recipe.log").read_text().strip().splitlines()[-1:] or [""]
            error = f"exit status {proc.returncode}: {tail[0][:200]} (log: {out_dir / 'recipe.log'})"
    else:
        try:
            common.import_recipe("wikitext2").main(argv)
        except SystemExit as err:
            error = f"exit {err.code}"
        except Exception as err:  # noqa: BLE001 - one sampler failing must not stop the comparison
            error = f"{type(err).__name__}: {' '.join(str(err).split())[:200]}"
    wall = time.perf_counter() - t0
    results = json.loads(stale.read_text()) if stale.exists() else None
    state = out_dir / "trainer_state.json"
    history = json.loads(state.read_text()).get("log_history", []) if state.exists() else []
    if results is None and error is None:
        error = "no results.json written"
    if error:
        print(f"   failed: {error}")
    return {"results": results, "history": history, "wall_s": wall, "error": error}


def training_curve(history: list[dict], results: dict | None) -> tuple[list[dict], float | None]:
    """Validation points with training time (evaluation time subtracted), and the run's training time.

    The Trainer logs the elapsed ``train_runtime`` in every training log entry; with logging_steps =
    eval_steps the entry just before each evaluation gives its time.
    """
    points, eval_time, runtime_at, train_time = [], 0.0, {}, None
    for e in history:
        if "train_loss" in e and "train_runtime" in e:  # the end-of-training summary
            train_time = float(e["train_runtime"]) - eval_time
            continue
        if "train_runtime" in e:
            runtime_at[e.get("step")] = float(e["train_runtime"])
        if "eval_loss" in e:
            t = runtime_at.get(e.get("step"))
            if train_time is None:
                loss = float(e["eval_loss"])
                points.append({"step": e.get("step"), "epoch": e.get("epoch"), "valid_loss": loss, "valid_perplexity": _ppl(loss),
                               "train_time_s": None if t is None else t - eval_time})  # fmt: skip
                eval_time += float(e.get("eval_runtime", 0.0))
    if results is not None:
        step = results.get("global_step")
        if not points or points[-1]["step"] != step:
            points.append({"step": step, "epoch": results.get("epoch"), "valid_loss": results["valid_loss"],
                           "valid_perplexity": results["valid_perplexity"], "train_time_s": train_time})  # fmt: skip
        # An evaluation without a training log at its step (e.g. the Trainer's final one): interpolate in steps.
        known = [(0, 0.0)] + [(p["step"], p["train_time_s"]) for p in points if p["train_time_s"] is not None]
        if train_time is not None:
            known.append((step, train_time))
        known.sort()
        for p in points:
            if p["train_time_s"] is None and p["step"] is not None:
                lo = max((k for k in known if k[0] <= p["step"]), default=None)
                hi = min((k for k in known if k[0] >= p["step"]), default=None)
                if lo and hi:
                    frac = 0.0 if hi[0] == lo[0] else (p["step"] - lo[0]) / (hi[0] - lo[0])
                    p["train_time_s"] = lo[1] + frac * (hi[1] - lo[1])
                    p["time_interpolated"] = True
    return points, train_time


def _ppl(loss: float) -> float:
    return math.exp(loss) if loss < 700 else math.inf


def summarize(run: dict) -> dict:
    res = run["results"]
    curve, train_time = training_curve(run["history"], res)
    out = {"error": run["error"], "wall_s": run["wall_s"], "curve": curve, "train_time_s": train_time}
    if res:
        keys = ("test_perplexity", "valid_perplexity", "test_loss", "valid_loss", "global_step", "epoch",
                "tokens_per_second", "train_runtime_s")  # fmt: skip
        out.update({k: res.get(k) for k in keys})
        out["data"] = res.get("data")
        out["coverage_at_end"] = coverage_at_end(run["history"])
        if train_time and res.get("global_step"):
            out["seconds_per_step"] = train_time / res["global_step"]
    return out


def coverage_at_end(history: list[dict]) -> dict | None:
    """The proposal's coverage (:data:`COVERAGE_KEYS`) at the last training log entry that has it, with its step;
    None for the full softmax."""
    last = next((e for e in reversed(history) if "midx/kl_pq" in e), None)
    return None if last is None else {"step": last.get("step"), **{k: last.get(f"midx/{k}") for k in COVERAGE_KEYS}}


def checkpoint_test_perplexities(run_dir: Path, test_file, seq_len: int, run: dict, verify: bool = False) -> list[dict]:
    """Exact (full-softmax) test perplexity of every ``checkpoint-*`` in ``run_dir``, in step order.

    The blocks are the recipe's: its saved tokenizer over ``test_file``, ``seq_len`` predicted tokens per block, as
    many blocks as the recipe's results say it evaluated; the mean of the per-block losses (every block predicts as
    many tokens). The checkpoint the run ended on (``best_model_checkpoint`` with ``--load_best_model_at_end``)
    takes the recipe's own figure; ``verify`` measures it here too and raises RuntimeError if the two differ by
    more than 1e-4 nats."""
    import torch  # noqa: PLC0415
    from transformers import AutoModelForCausalLM, AutoTokenizer  # noqa: PLC0415

    lm_data = common.import_recipe("lm_data")
    tokenizer = AutoTokenizer.from_pretrained(run_dir)
    ids = lm_data.encode_lines(tokenizer, lm_data.read_lines(test_file))
    blocks = lm_data.TokenBlocks.from_stream(ids, seq_len, limit=run["data"]["test_tokens"] // seq_len).data
    state = run_dir / "trainer_state.json"
    best = json.loads(state.read_text()).get("best_model_checkpoint") if state.exists() else None
    out = []
    for ckpt in sorted(run_dir.glob("checkpoint-*"), key=lambda d: int(d.name.split("-")[-1])):
        is_best = best is not None and Path(best).name == ckpt.name
        loss = run["test_loss"] if is_best else None
        if loss is None or verify:
            model = AutoModelForCausalLM.from_pretrained(ckpt).eval()
            with torch.no_grad():
                total = sum(float(model(input_ids=b, labels=b).loss) * len(b) for b in blocks.split(64))
            loss, recipe_loss = total / len(blocks), loss
            if recipe_loss is not None and abs(loss - recipe_loss) > 1e-4:
                raise RuntimeError(f"{ckpt}: test loss {loss:.6f} here, {recipe_loss:.6f} in the recipe's results.json")
        meta = json.loads((ckpt / "trainer_state.json").read_text())
        out.append({"step": meta.get("global_step"), "epoch": meta.get("epoch"), "test_loss": loss,
                    "test_perplexity": _ppl(loss), "best": is_best})  # fmt: skip
        print(f"   test perplexity at {ckpt.name} (epoch {_f(meta.get('epoch'), 2)}): {_f(_ppl(loss))}", flush=True)
    return out


# ---------------------------------------------------------------------------- main
def main(argv=None) -> dict:
    args = parse_args(argv)
    for flag in ("parallel", "pool_size", "seeds"):
        if getattr(args, flag) < 1:
            raise SystemExit(f"--{flag} must be >= 1, got {getattr(args, flag)}.")
    if args.parallel > 1 and (args.wall_clock == "on" or args.launcher == "inprocess"):
        raise SystemExit("--parallel > 1 runs recipe subprocesses side by side, whose timings are not comparable: "
                         "add --wall_clock off (and do not pass --launcher inprocess).")
    if args.device == "cuda":
        print("compare_samplers runs the recipe, which picks its device itself (the Trainer uses a GPU when present).")
    q = args.quick
    if args.smoke and tuple(args.samplers) == DEFAULT_SAMPLERS:
        args.samplers = list(SMOKE_SAMPLERS)
    args.batch_size = args.batch_size or (4 if args.smoke else 8 if q else 32)
    args.evals_per_run = args.evals_per_run or (1 if args.smoke else 2 if q else 4)
    if args.refreshes_per_epoch is None:
        args.refreshes_per_epoch = 1 if args.smoke else 2 if q else 10
    launcher = args.launcher or ("inprocess" if q and args.parallel == 1 else "subprocess")
    files = common.data_files(args.data_dir) if (args.data_dir or not q) else None
    data_note = None
    if files is None:
        files = {"train": common.SAMPLE_DATA_DIR / "train.txt", "validation": common.SAMPLE_DATA_DIR / "valid.txt",
                 "test": common.SAMPLE_DATA_DIR / "test.txt"}  # fmt: skip
        if q:
            data_note = f"--quick without --data_dir: the small WikiText-2 sample in {common.SAMPLE_DATA_DIR}"
        else:
            data_note = (f"WikiText-2 not found at {common.DEFAULT_DATA_DIR}: the small sample in {common.SAMPLE_DATA_DIR} "
                         "was used (not comparable with the paper)")  # fmt: skip
            print(data_note)
    if args.max_steps is not None and args.max_steps < 1:
        raise SystemExit(f"--max_steps must be >= 1, got {args.max_steps}.")
    import hf_midx  # noqa: PLC0415

    known = {"full", *common.VARIANTS, *hf_midx.SAMPLERS}
    unknown = [s for s in args.samplers if s not in known]
    if unknown:
        raise SystemExit(f"unknown sampler(s) {unknown}; choose from full, {', '.join(common.VARIANTS)}, "
                         f"{', '.join(sorted(hf_midx.SAMPLERS))}.")
    stray = sorted(set(args.wall_clock_samplers or ()) - set(args.samplers))
    if stray:
        raise SystemExit(f"--wall_clock_samplers {stray} are not in --samplers; add them there too.")
    out = Path(args.out)
    import torch  # noqa: PLC0415

    train_text = Path(files["train"]).read_text(encoding="utf-8")
    train_tokens = sum(len(line.split()) + 1 for line in train_text.split("\n")[:-1])
    # Evaluation frequency from the steps of one epoch (blocks of seq_len + 1 tokens, stride seq_len).
    seq_len = 20 if q else 50
    blocks = max(1, (train_tokens - 1) // seq_len)
    if q:
        blocks = min(blocks, 16 if args.smoke else 64)
    steps_per_epoch = math.ceil(blocks / args.batch_size)
    steps_equal_epochs = args.max_steps or max(1, steps_per_epoch * args.epochs)
    every = max(1, int(steps_equal_epochs // args.evals_per_run))
    refresh_every = max(1, steps_per_epoch // args.refreshes_per_epoch) if args.refreshes_per_epoch > 0 else 0
    model = (SMOKE_OVERRIDES if args.smoke else QUICK_OVERRIDES) if q else "the paper's: GPT-2 architecture, 2 layers, 4 heads, d 200, ff 1024"
    env, settings = common.start(
        NAME, args, torch.device("cuda" if torch.cuda.is_available() else "cpu"),
        data={k: str(v) for k, v in files.items()}, data_note=data_note, train_tokens=train_tokens, samplers=args.samplers,
        profile=args.profile, seeds=list(range(args.seed, args.seed + args.seeds)),
        epochs=None if args.max_steps else args.epochs, max_steps=args.max_steps, num_samples=args.num_samples,
        codebook_size=args.codebook_size, pool_size=args.pool_size, batch_size=args.batch_size,
        evals_per_run=args.evals_per_run, wall_clock=args.wall_clock, wall_clock_budget_s=args.wall_clock_budget_s,
        wall_clock_samplers=args.wall_clock_samplers, launcher=launcher, parallel=args.parallel,
        refreshes_per_epoch=args.refreshes_per_epoch, recipe_args=args.recipe_args, model=model,
        refresh_every_steps=refresh_every)  # fmt: skip

    equal_epochs, wall = {}, {}
    order = ["full"] + [s for s in args.samplers if s != "full"] if "full" in args.samplers else list(args.samplers)

    def equal_epochs_run(sampler: str, threads: int | None = None) -> None:
        per_seed = []
        for k in range(args.seeds):
            run_dir = out / sampler if args.seeds == 1 else out / sampler / f"seed{args.seed + k}"
            argv = recipe_argv(args, files, run_dir, sampler, epochs=None if args.max_steps else args.epochs,
                               max_steps=args.max_steps, every=every, refresh_every=refresh_every)  # fmt: skip
            argv[argv.index("--seed") + 1] = str(args.seed + k)
            run = summarize(run_recipe(argv, run_dir, launcher, threads))
            if args.test_by_epoch and not run["error"]:
                run["test_by_epoch"] = checkpoint_test_perplexities(run_dir, files["test"], seq_len, run, verify=args.smoke)
            per_seed.append({**run, "seed": args.seed + k})
            _prune(run_dir, sampler, args.keep_models)
        equal_epochs[sampler] = aggregate_seeds(per_seed)
        _print_run(sampler, equal_epochs[sampler])

    if args.parallel > 1:
        threads = max(1, (os.cpu_count() or 1) // args.parallel)
        with ThreadPoolExecutor(args.parallel) as pool:
            list(pool.map(lambda s: equal_epochs_run(s, threads), order))
        equal_epochs = {s: equal_epochs[s] for s in order}
    else:
        for sampler in order:
            equal_epochs_run(sampler)

    budget = args.wall_clock_budget_s
    if budget is None and "full" in equal_epochs:
        budget = equal_epochs["full"].get("train_time_s")
    if args.wall_clock == "on" and budget:
        for sampler in order:
            if args.wall_clock_samplers is not None and sampler not in args.wall_clock_samplers and sampler != "full":
                continue
            if sampler == "full" and args.wall_clock_budget_s is None:
                wall[sampler] = {**equal_epochs["full"], "same_as_equal_epochs": True}
                continue
            per_step = equal_epochs[sampler].get("seconds_per_step")
            if not per_step:
                wall[sampler] = {"error": "no step time from the equal-epochs run"}
                continue
            steps = max(1, round(budget / per_step))
            run_dir = out / f"{sampler}-wallclock"
            argv = recipe_argv(args, files, run_dir, sampler, max_steps=steps, every=max(1, steps // args.evals_per_run),
                               refresh_every=refresh_every)  # fmt: skip
            wall[sampler] = {**summarize(run_recipe(argv, run_dir, launcher)), "max_steps": steps}
            _prune(run_dir, sampler + "-wallclock", args.keep_models)
            _print_run(sampler + " (wall clock)", wall[sampler])
    elif args.wall_clock == "on":
        print("equal wall-clock skipped: no budget (run 'full' or pass --wall_clock_budget_s).")

    md = render_markdown(env, settings, equal_epochs, wall, budget, order)
    return common.finish(args, NAME, env, settings, md, lambda: plot(out, equal_epochs, wall, order, budget),
                         wall_clock_budget_s=budget, equal_epochs=equal_epochs, equal_wall_clock=wall,
                         paper_test_perplexity=PAPER_PPL, rows=_rows(env, equal_epochs, wall))  # fmt: skip


def aggregate_seeds(runs: list[dict]) -> dict:
    """One row from the runs of several seeds: the first seed's fields (curve, timings) plus the mean and
    sample standard deviation of the test perplexity and the mean tokens/s over the seeds that worked."""
    first = dict(runs[0])
    ok = [r for r in runs if not r.get("error") and r.get("test_perplexity") is not None]
    ppl = [r["test_perplexity"] for r in ok]
    tps = [r["tokens_per_second"] for r in ok if r.get("tokens_per_second")]
    keys = ("seed", "test_perplexity", "valid_perplexity", "tokens_per_second", "train_time_s", "error")
    first["seeds"] = [{k: r.get(k) for k in keys} for r in runs]
    first["test_ppl_mean"] = statistics.fmean(ppl) if ppl else None
    first["test_ppl_sd"] = statistics.stdev(ppl) if len(ppl) > 1 else None
    first["tokens_per_second_mean"] = statistics.fmean(tps) if tps else None
    if not first.get("error") and len(ok) < len(runs):
        first["error"] = f"{len(runs) - len(ok)} of {len(runs)} seeds failed"
    return first


def _mean_sd(run: dict) -> str:
    if run.get("test_ppl_mean") is None:
        return "-"
    sd = run.get("test_ppl_sd")
    return _f(run["test_ppl_mean"]) + ("" if sd is None else f" ± {_f(sd)}")


def _prune(run_dir: Path, label: str, keep: bool) -> None:
    if keep or label in KEEP_MODELS:
        return
    for f in run_dir.glob("*.safetensors"):
        f.unlink()
    for d in run_dir.glob("checkpoint-*"):
        shutil.rmtree(d, ignore_errors=True)


def _print_run(label: str, s: dict) -> None:
    print(f"{label}: failed ({s['error']})" if s.get("error") else f"{label}: test ppl {_f(s.get('test_perplexity'))}, "
          f"valid ppl {_f(s.get('valid_perplexity'))}, {s.get('global_step')} steps, training "
          f"{_f(s.get('train_time_s'), 0)} s", flush=True)


def _f(x, digits: int = 1) -> str:
    return "-" if x is None or (isinstance(x, float) and math.isnan(x)) else f"{x:.{digits}f}"


def _rows(env, equal_epochs, wall):
    results = [{**s, "sampler": sampler, "setting": setting, "steps": s.get("global_step")}
               for setting, runs in (("equal_epochs", equal_epochs), ("equal_wall_clock", wall)) for sampler, s in runs.items()]
    return common.rows(env, results, op="wikitext2_lm", provider="sampler", x_name="setting", x="setting",
                       metrics={"test_perplexity": ("test_perplexity", "ppl")}, extra=("train_time_s", "steps"))


def render_markdown(env, settings, equal_epochs, wall, budget, order):
    parts = [f"**Data:** {settings['data_note']}.\n"] if settings["data_note"] else []
    equal = f"Equal steps: {settings['max_steps']} each. " if settings.get("max_steps") else f"Equal epochs: {settings['epochs']:g} epoch(s) each. "
    parts.append("Exact (full-softmax) perplexity. " + equal
                 + f"Seeds {settings['seeds']}: test perplexity as mean ± sample sd. Equal wall-clock (first seed): "
                 f"every sampler trains for {_f(budget, 0)} s, what `full` needed (training time without evaluation). "
        "The paper trained 100 epochs with early stopping: compare the ordering, not the values.\n")  # fmt: skip
    full = equal_epochs.get("full", {})
    table = [(s, equal_epochs.get(s, {}), wall.get(s, {})) for s in order]
    parts.append(common.markdown_table(table, [
        ("sampler", lambda t: t[0]), ("paper test ppl", lambda t: _f(PAPER_PPL.get(t[0]))),
        ("test ppl, equal epochs/steps", lambda t: t[1].get("error") and "failed" or _mean_sd(t[1])),
        ("vs full", lambda t: _vs(t[1], full)), ("valid ppl", lambda t: _f(t[1].get("valid_perplexity"))),
        ("training s", lambda t: _f(t[1].get("train_time_s"), 0)),
        ("tokens/s", lambda t: _f(t[1].get("tokens_per_second_mean") or t[1].get("tokens_per_second"), 0)),
        ("test ppl by epoch", lambda t: " / ".join(_f(e["test_perplexity"]) for e in t[1].get("test_by_epoch") or ()) or "-"),
        ("KL(P‖Q), ESS/M, p/q>10 at end", lambda t: _coverage(t[1].get("coverage_at_end"))),
        ("test ppl, equal wall-clock", lambda t: (t[2].get("error") and "failed") or _f(t[2].get("test_perplexity"))),
        ("steps (epochs)", lambda t: "-" if not t[2] or t[2].get("global_step") is None
         else f"{t[2]['global_step']} ({_f(t[2].get('epoch'), 2)} ep)"),
        ("training s ", lambda t: _f(t[2].get("train_time_s"), 0))]))  # fmt: skip
    errors = [(s, r["error"]) for runs in (equal_epochs, wall) for s, r in runs.items() if r.get("error")]
    if errors:
        parts.append("\nFailed runs:\n")
        parts.extend(f"- {s}: {e}" for s, e in errors)
    return common.report("Samplers on WikiText-2 (the paper's LM table)", env, settings, *parts)


def _coverage(c: dict | None) -> str:
    return "-" if not c else f"{_f(c['kl_pq'], 2)}, {_f(c['ess'], 3)}, {_f(c['mass_p_over_q_gt_10'], 3)}"


def _vs(run: dict, full: dict) -> str:
    a, b = run.get("test_ppl_mean"), full.get("test_ppl_mean")
    return "-" if a is None or b is None else f"{100.0 * (a / b - 1.0):+.1f}%"


def plot(out_dir, equal_epochs, wall, order, budget):
    def style(s):
        return {"marker": "o", "linewidth": 2.5 if s == "full" else 1.3, "color": "black" if s == "full" else None}

    def panel(title, runs):
        curves = {s: [p for p in runs.get(s, {}).get("curve", []) if p["train_time_s"] is not None
                      and math.isfinite(p["valid_perplexity"])] for s in order}  # fmt: skip
        return {"lines": {s: ([p["train_time_s"] for p in c], [p["valid_perplexity"] for p in c]) for s, c in curves.items() if c},
                "style": style, "yscale": "log", "xlabel": "training time (s, evaluation excluded)",
                "ylabel": "validation perplexity (exact)", "title": f"WikiText-2, {title}",
                "extra": (lambda ax: ax.axvline(budget, color="grey", linestyle=":", linewidth=1))
                if budget and title == "equal wall-clock" else (lambda ax: None)}  # fmt: skip

    panels = [panel("equal epochs", equal_epochs)] + ([panel("equal wall-clock", wall)] if wall else [])
    common.plot_panels(out_dir, f"{NAME}_valid_ppl.png", panels, size=(6.5, 4.8))

if __name__ == "__main__":
    main()
