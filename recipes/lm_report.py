"""What a finished recipe run reports in its model card: the exact results, and the command that made it.

:func:`results_markdown` is the card's results section and :func:`eval_results` its model-index entries
(``huggingface_hub.EvalResult``); ``lm_recipe.train_and_report`` hands both to the Trainer's card
(``model_card_extras``). :func:`launch_command` shows how the run was started, launcher included. Nothing
here holds a path of this machine.
"""

from __future__ import annotations

import math
import os
import shlex
from collections.abc import Mapping, Sequence
from typing import Any


def launch_command(recipe: str, argv: Sequence[str], environ: Mapping[str, str] | None = None) -> str:
    """How this run was started, as a user would type it: ``python``, ``torchrun`` or ``accelerate launch``.

    The launcher is recognised from the environment it gives its processes (accelerate's
    ``ACCELERATE_MIXED_PRECISION``, torchrun's ``TORCHELASTIC_RUN_ID``); its process counts come from
    ``WORLD_SIZE`` and ``LOCAL_WORLD_SIZE``, other launcher flags are not known. ``--hub_token`` is left out, and absolute
    paths are shown relative to the working directory when inside it, else by their last component, so
    that a model card holds no path of this machine.
    """
    env = os.environ if environ is None else environ
    args, skip = [], False
    for arg in argv:
        if skip:
            skip = False
            continue
        if arg.replace("-", "_").startswith("__hub_token"):
            skip = "=" not in arg
            continue
        args.append(_portable_path(arg))
    script = f"recipes/{recipe}.py"
    world = int(env.get("WORLD_SIZE", "1") or 1)
    local = int(env.get("LOCAL_WORLD_SIZE", str(world)) or world)
    if "ACCELERATE_MIXED_PRECISION" in env:  # set by every accelerate launch, single process included
        launcher = ["accelerate", "launch"]
        if world > 1:
            launcher += ["--multi_gpu", "--num_processes", str(world)]
            if world > local:
                launcher += ["--num_machines", str(world // max(local, 1))]
    elif "TORCHELASTIC_RUN_ID" in env or "LOCAL_RANK" in env:
        launcher = ["torchrun", "--nproc_per_node", str(local)]
        if world > local:
            launcher += ["--nnodes", str(world // max(local, 1))]
    else:
        launcher = ["python"]
    return shlex.join([*launcher, script, *args])


def _portable_path(arg: str) -> str:
    """``arg`` (or the value of ``--flag=value``) without this machine's absolute path."""
    flag, eq, value = arg.partition("=") if arg.startswith("--") else ("", "", arg)
    if not os.path.isabs(value):
        return arg
    relative = os.path.relpath(value)
    shown = relative if not relative.startswith("..") else os.path.basename(os.path.normpath(value))
    return f"{flag}{eq}{shown}" if eq else shown


def eval_results(results: dict[str, Any], card: Mapping[str, Any]) -> list:
    """The model-index entries (``huggingface_hub.EvalResult``) of a run: exact perplexity per split."""
    from huggingface_hub import EvalResult

    name = card.get("dataset") or "unnamed dataset"
    entries = []
    for split, key in (("validation", "valid_perplexity"), ("test", "test_perplexity")):
        value = results.get(key)
        if value is None or not math.isfinite(value):
            continue
        entries.append(
            EvalResult(
                task_type="text-generation",
                task_name="Causal language modeling",
                dataset_type=card.get("dataset_tags") or name,
                dataset_name=name,
                dataset_config=card.get("dataset_args"),
                dataset_split=split,
                metric_type="perplexity",
                metric_name="Perplexity (exact full softmax)",
                metric_value=round(float(value), 3),
            )
        )
    return entries


def results_markdown(results: dict[str, Any], argv: Sequence[str] = (), dataset: str | None = None) -> str:
    """The model-card section with a run's final results (appended to README.md); no path of this machine.

    ``dataset`` names the data (default: ``results["data"]["source"]``, which may hold paths).
    """
    data = results["data"]
    rows = [("validation", data["valid_tokens"], results["valid_loss"], results["valid_perplexity"])]
    if results["test_loss"] is not None:
        rows.append(("test", data["test_tokens"], results["test_loss"], results["test_perplexity"]))
    sampler = "full softmax (no sampling)"
    if results["midx_config"] is not None:
        cfg = results["midx_config"]
        sampler = f"`{cfg['sampler']}`, {cfg['num_samples']} negatives ({cfg['negatives']})"
        sampler += f", codebook size {cfg['codebook_size']}"
    lines = [
        f"## Results of recipes/{results['recipe']}.py",
        "",
        f"Exact full-softmax evaluation after training: every block predicts {data['seq_len']} tokens; "
        "perplexity = exp(mean token negative log-likelihood).",
        "",
        "| Split | Predicted tokens | Loss (nats/token) | Perplexity |",
        "|:--|--:|--:|--:|",
        *(
            f"| {name} | {tokens:,} | {loss:.4f} | {math.exp(loss) if loss < 700 else math.inf:.2f} |"
            for name, tokens, loss, _ in rows
        ),
        "",
        f"- Model: {_portable_path(results['model']['source'])}, {results['model']['num_parameters']:,} parameters",
        f"- Data: {dataset or data['source']}; vocabulary {data['vocab_size']:,}",
        f"- Training: {sampler}; {results['global_step']:,} optimizer steps in {results['train_runtime_s']:.1f} s"
        + (
            ""
            if results["tokens_per_second"] is None
            else f" ({results['tokens_per_second']:,.0f} tokens/s without evaluation)"
        )
        + f" on {results['world_size']} process(es), device {results['device']}",
    ]
    if "optimal_perplexity" in results:
        syn = results.get("synthetic", {})
        lines.append(
            f"- Optimal perplexity (the corpus' entropy rate): {results['optimal_perplexity']:.2f}; the generating chain "
            f"scores {syn.get('oracle_test_perplexity', math.nan):.2f} on the test blocks"
        )
    lines += [f"- Command: `{launch_command(results['recipe'], argv)}`", ""]
    return "\n".join(lines)
