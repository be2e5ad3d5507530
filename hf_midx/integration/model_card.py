"""Model cards for models trained with MIDX: transformers' metadata plus the MIDX training facts.

The template is ``model_cards/midx_model_card.md`` at the repository's top level (the one copy), shipped
inside the package as ``hf_midx.model_cards`` (see pyproject.toml) and rendered with
``huggingface_hub.ModelCard.from_template``.
A Trainer with :meth:`hf_midx.MidxCallback.install` (MidxTrainer too) writes the card as ``README.md`` from
``save_model`` (unless the folder's README.md is the user's own text: :func:`user_readme`), ``create_model_card``
and ``push_to_hub`` through :func:`write_model_card`;
:func:`render_model_card` is usable on its own.

The metadata are ``huggingface_hub.ModelCardData`` fields, as on Hub cards: ``datasets`` (Hub dataset ids),
``metrics`` and the ``model-index`` evaluation results (:class:`huggingface_hub.EvalResult`), by default the
last exact evaluation perplexity on the named dataset. The text names the dataset and links nothing but the
base model's Hub page.
"""

from __future__ import annotations

import math
import os
from collections.abc import Iterable, Mapping, Sequence
from importlib import resources
from pathlib import Path
from typing import Any

from .._io import atomic_write
from ..config import EXACT_HEAD_FRACTION, MidxConfig
from ..losses.loss import drops_accidental_hits
from ..registry import SAMPLERS  # any hf_midx import runs hf_midx/__init__, which registers the samplers
from .head import find_head
from .state import index_quantizer
from ..version import __version__, versions


def _template_path() -> Path:
    # A wheel holds model_cards/ as the subpackage hf_midx.model_cards; an editable install of a
    # checkout imports hf_midx from the repository, where the folder sits beside the package.
    try:
        return Path(str(resources.files("hf_midx.model_cards").joinpath("midx_model_card.md")))
    except ModuleNotFoundError:
        return Path(__file__).resolve().parents[2] / "model_cards" / "midx_model_card.md"


#: The Jinja template of the card.
TEMPLATE_PATH = _template_path()

#: Tags every MIDX card carries (the sampler's name is added to them).
DEFAULT_TAGS = ("hf-midx", "sampled-softmax", "midx")

_QUANTIZERS = {"rq": "residual (rq)", "pq": "product (pq)"}

# Trainer metrics reported as training throughput, with their labels in the card.
_THROUGHPUT_KEYS = {
    "train_tokens_per_second": "Training throughput (tokens/s)",
    "train_samples_per_second": "Training throughput (samples/s)",
    "train_steps_per_second": "Training throughput (optimizer steps/s)",
    "train_runtime": "Training time (s)",
}


#: Above this loss (nats) exp() is reported as inf rather than overflowing float64 (exp(709.8) is its largest).
_PERPLEXITY_CUTOFF = 700.0


def perplexity(loss: float) -> float:
    """exp(``loss``), inf above :data:`_PERPLEXITY_CUTOFF` nats; NaN stays NaN."""
    loss = float(loss)
    return math.inf if loss >= _PERPLEXITY_CUTOFF else math.exp(loss)


def _round(value: float, digits: int = 4) -> float | str:
    if value is None:
        return None
    value = float(value)
    if math.isinf(value) or math.isnan(value):
        return str(value)
    return float(f"{value:.{digits}g}")


def _refresh_schedule(config: MidxConfig, history: list) -> str:
    parts = []
    if config.refresh_every_steps == "auto":
        chosen = [int(e["midx/refresh_interval"]) for e in history if "midx/refresh_interval" in e]
        last = f" (last chosen: {chosen[-1]})" if chosen else ""
        parts.append(f"every N optimizer steps, N chosen from the measured cost at a budget of "
                     f"{config.refresh_budget:.0%} of training time{last}")
    elif config.refresh_every_steps:
        parts.append(f"every {config.refresh_every_steps} optimizer steps")
    if config.refresh_every_epoch:
        parts.append("at the start of every epoch")
    if not parts:
        return "never (the sampler built when the head was wrapped was kept)"
    if config.codebooks == "learned":
        how = "hard codes recomputed from the learned codebooks"
    else:
        how = "warm-started k-means"
    return " and ".join(parts) + f" ({how})"


def midx_training_facts(
    config: MidxConfig,
    log_history: Iterable[Mapping[str, Any]] = (),
    *,
    num_classes: int | None = None,
    tokenizer_size: int | None = None,
    head_frozen: bool = False,
) -> dict[str, Any]:
    """The MIDX facts a card reports, from the config and a Trainer's ``state.log_history``.

    ``num_classes`` is V, the LM head's rows; ``tokenizer_size`` the tokenizer's length, shown beside V when
    they differ (models often pad V to a multiple of 64 or more); ``head_frozen``: the head trained frozen (LoRA).

    Returns a dict with the sampler settings, the refresh schedule, the last exact evaluation
    (``eval_loss`` / ``eval_perplexity``, None if never evaluated), the logged KL and refresh times,
    and the training throughput the Trainer measured (``train_*_per_second``).
    """
    history = list(log_history)
    is_midx = config.sampler.startswith("midx")
    own = SAMPLERS[config.sampler].options  # the fields this sampler reads (midx-exact: no mixture, no last stage)
    quantizer = index_quantizer(config)
    eval_entries = [e for e in history if "eval_loss" in e]
    last_eval = eval_entries[-1] if eval_entries else None
    eval_loss = None if last_eval is None else last_eval["eval_loss"]
    eval_ppl = None
    if last_eval is not None:
        eval_ppl = last_eval.get("eval_perplexity")
        if eval_ppl is None:
            eval_ppl = perplexity(eval_loss)
    kls = [e["midx/kl"] for e in history if "midx/kl" in e]
    refresh_times = [e["midx/refresh_seconds"] for e in history if "midx/refresh_seconds" in e]
    final = next((e for e in reversed(history) if "train_runtime" in e), {})
    throughput = {label: _round(final[key]) for key, label in _THROUGHPUT_KEYS.items() if key in final}
    if config.codebooks == "learned":
        codebooks_text = (
            f"learned (reconstruction + {config.kl_weight:g} x KL objective, Adam lr "
            f"{config.codebook_learning_rate:g}, {config.kl_queries} hidden states per step), initialised by k-means"
        )
    else:
        codebooks_text = f"k-means ({config.kmeans_iters} Lloyd iterations, {config.kmeans_backend} backend)"
    return {
        "sampler": config.sampler,
        "is_midx": is_midx,
        "quantizer": _QUANTIZERS[quantizer],
        "codebook_size": config.codebook_size,
        "buckets": config.codebook_size**2,
        "num_samples": config.num_samples,
        "negatives": config.negatives,
        "negatives_text": (
            "per token (each token draws its own from its proposal, the paper's setting)"
            if config.negatives == "per-query"
            else "in one pool shared by the batch (drawn from the batch's mixture proposal)"
        ),
        "negatives_short": "per token" if config.negatives == "per-query" else "shared by each batch",
        "remove_accidental_hits": drops_accidental_hits(config.remove_accidental_hits, config.estimator),
        "estimator": config.estimator,
        # The value in use: a head of V classes scores at most V / 8 exactly (MidxConfig.for_vocabulary).
        "exact_head": (min(config.exact_head, num_classes // EXACT_HEAD_FRACTION)
                       if num_classes and config.exact_head != "auto" else config.exact_head),
        "mixture_text": (
            f"{config.mix_weight:g} x {config.mix_static} + {1 - config.mix_weight:g} x MIDX"
            if "mix_weight" in own and config.mix_weight > 0
            else "none"
        ),
        "last_stage": config.last_stage if "last_stage" in own else "exact (Theorem 1)" if is_midx else "-",
        "ess_last": _round(next((e["midx/ess"] for e in reversed(history) if "midx/ess" in e), None)),
        "kl_pq_last": _round(next((e["midx/kl_pq"] for e in reversed(history) if "midx/kl_pq" in e), None)),
        "codebooks": config.codebooks,
        "codebooks_text": codebooks_text,
        "refresh_every_steps": config.refresh_every_steps,
        "refresh_every_epoch": config.refresh_every_epoch,
        "refresh_schedule": _refresh_schedule(config, history),
        "num_classes": num_classes,
        "tokenizer_size": tokenizer_size if tokenizer_size not in (None, num_classes) else None,
        "eval_loss": _round(eval_loss),
        "eval_perplexity": _round(eval_ppl),
        "kl_first": _round(kls[0]) if kls else None,
        "kl_last": _round(kls[-1]) if kls else None,
        "refreshes": len(refresh_times),
        "refresh_seconds_mean": _round(sum(refresh_times) / len(refresh_times), 3) if refresh_times else None,
        "throughput": throughput,
        "z_loss": config.z_loss,
        "z_loss_last": _round(next((e["midx/z_loss"] for e in reversed(history) if "midx/z_loss" in e), None)),
        "label_smoothing": config.label_smoothing,
        "head_frozen": head_frozen,
    }


def _dataset_name(metadata: Mapping[str, Any]) -> str | None:
    """The dataset a card's metadata names: a model-index result's dataset, else the first Hub dataset id."""
    for entry in metadata.get("model-index") or []:
        for result in entry.get("results") or []:
            name = (result.get("dataset") or {}).get("name")
            if name:
                return str(name)
    datasets = metadata.get("datasets") or []
    datasets = [datasets] if isinstance(datasets, str) else list(datasets)
    return str(datasets[0]) if datasets else None


def _default_eval_results(metadata: Mapping[str, Any], dataset_name: str | None, facts: Mapping[str, Any]) -> list:
    """One model-index result, the last exact evaluation perplexity, when the dataset is known."""
    from huggingface_hub import EvalResult

    if dataset_name is None or facts["eval_perplexity"] is None or isinstance(facts["eval_perplexity"], str):
        return []
    datasets = metadata.get("datasets") or []
    datasets = [datasets] if isinstance(datasets, str) else list(datasets)
    return [
        EvalResult(
            task_type="text-generation",
            task_name="Causal language modeling",
            dataset_type=str(datasets[0]) if datasets else dataset_name,
            dataset_name=dataset_name,
            metric_type="perplexity",
            metric_name="Perplexity (exact full softmax, last evaluation)",
            metric_value=facts["eval_perplexity"],
        )
    ]


def render_model_card(
    config: MidxConfig,
    *,
    metadata: Mapping[str, Any] | None = None,
    model_name: str | None = None,
    base_model: str | None = None,
    base_model_path: str | None = None,
    tags: Iterable[str] = (),
    hyperparameters: Mapping[str, Any] | None = None,
    eval_table: str | None = None,
    log_history: Iterable[Mapping[str, Any]] = (),
    num_classes: int | None = None,
    tokenizer_size: int | None = None,
    library_name: str = "transformers",
    template_path: str | os.PathLike | None = None,
    dataset_name: str | None = None,
    eval_results: Sequence[Any] | None = None,
    throughput: Mapping[str, Any] | None = None,
    command: str | None = None,
    sections: Sequence[str] = (),
    head_frozen: bool = False,
):
    """Render the MIDX model card.

    Args:
        config: the :class:`~hf_midx.MidxConfig` the model was trained with.
        metadata: YAML metadata to start from, e.g. ``transformers.modelcard.TrainingSummary.create_metadata()``
            (library_name, license, language, datasets, model-index...). ``library_name`` is set
            from the argument of that name; ``pipeline_tag`` defaults to "text-generation".
        model_name: the card's title.
        base_model: the Hub id the model was fine-tuned from, if any (overrides ``metadata["base_model"]``).
        base_model_path: the local folder it was fine-tuned from, named in the text (not in the metadata).
        tags: extra tags; :data:`DEFAULT_TAGS` and the sampler's name are always added.
        hyperparameters: name -> value, listed under "Training hyperparameters".
        eval_table: a Markdown table of the evaluations during training.
        log_history: a Trainer's ``state.log_history`` (for eval perplexity, KL, refresh times, throughput).
        num_classes: V, the LM head's rows. tokenizer_size: the tokenizer's length, shown beside V if it differs.
        library_name: "transformers" for a full model, "peft" for an adapter saved by a PEFT model.
        template_path: another Jinja template (default :data:`TEMPLATE_PATH`).
        dataset_name: the training data, named in the text (a Hub dataset's name or a description without
            paths). Default: the dataset of the metadata's model-index, else its first ``datasets`` id.
        eval_results: ``huggingface_hub.EvalResult`` entries for the model-index (they replace the
            metadata's). Default: the last exact evaluation perplexity on ``dataset_name``, if both are known.
        throughput: label -> value lines shown instead of the throughput the Trainer logged (e.g. one
            tokens/s figure measured without the evaluations).
        command: the command that trained the model (launcher included), shown in the card.
        sections: Markdown sections appended to the card (e.g. a script's final results), see
            :func:`extend_model_card`.
        head_frozen: the LM head trained frozen (LoRA): no weight gradient, its index never refreshed.
    Returns:
        a ``huggingface_hub.ModelCard``; ``card.save(path)`` writes it.
    """
    from huggingface_hub import ModelCard, ModelCardData

    meta = dict(metadata or {})
    facts = midx_training_facts(config, log_history, num_classes=num_classes, tokenizer_size=tokenizer_size,
                                head_frozen=head_frozen)
    if throughput is not None:
        facts["throughput"] = dict(throughput)
    if dataset_name is None:
        dataset_name = _dataset_name(meta)
    model_index = meta.get("model-index")
    has_results = bool(model_index) and any(entry.get("results") for entry in model_index)
    if eval_results is None and not has_results:
        eval_results = _default_eval_results(meta, dataset_name, facts)
    if eval_results:
        meta.pop("model-index", None)  # ModelCardData writes the model-index from eval_results and model_name
        meta["eval_results"] = list(eval_results)
        meta["model_name"] = model_name or "model"
        metrics = [*(meta.get("metrics") or []), *(r.metric_type for r in eval_results)]
        meta["metrics"] = list(dict.fromkeys(metrics))
    meta["library_name"] = library_name
    meta.setdefault("pipeline_tag", "text-generation")
    if base_model:
        meta["base_model"] = base_model
    base_model = meta.get("base_model") or None
    all_tags = [*(meta.get("tags") or []), *DEFAULT_TAGS, config.sampler, *tags]
    meta["tags"] = list(dict.fromkeys(str(t) for t in all_tags))
    if meta.get("model-index") and not any(entry.get("results") for entry in meta["model-index"]):
        meta.pop("model-index")  # a name without results is rejected by the Hub's metadata check
    card_data = ModelCardData(ignore_metadata_errors=True, **meta)
    card = ModelCard.from_template(
        card_data,
        template_path=str(template_path or TEMPLATE_PATH),
        model_name=model_name,
        base_model=base_model,
        base_model_path=None if base_model else base_model_path,
        dataset_name=dataset_name,
        command=command,
        midx=facts,
        hyperparameters=dict(hyperparameters or {}),
        eval_table=eval_table or "",
        versions=versions(),
        hf_midx_version=__version__,
        adapter=library_name == "peft",  # a PEFT adapter: loaded with peft, on its base model
    )
    return extend_model_card(card, sections=sections)


def extend_model_card(card, *, eval_results: Sequence[Any] | None = None, sections: Sequence[str] = ()):
    """Add model-index results and Markdown sections to a ``huggingface_hub.ModelCard`` (in place); returns it.

    Works on any card: the MIDX one, or the card a plain ``Trainer`` wrote (``ModelCard.load(path)``), e.g.
    a full-softmax baseline's, so that both report their results the same way.

    Args:
        card: the ``huggingface_hub.ModelCard``.
        eval_results: ``huggingface_hub.EvalResult`` entries; they replace the card's model-index, and
            their metric types join its ``metrics``.
        sections: Markdown text appended to the card, each after a blank line.
    """
    if isinstance(sections, str):
        raise ValueError("sections must be a list of Markdown strings, not one string.")
    if eval_results:
        card.data.eval_results = list(eval_results)
        card.data.model_name = card.data.model_name or "model"  # the model-index needs a name
        metrics = [*(card.data.metrics or []), *(r.metric_type for r in eval_results)]
        card.data.metrics = list(dict.fromkeys(metrics))
    for section in sections:
        card.text = card.text.rstrip("\n") + "\n\n" + section.strip("\n") + "\n"
    return card


#: The render_model_card arguments that a trainer's ``model_card_extras`` may set.
CARD_EXTRAS = ("eval_results", "sections", "throughput", "command", "dataset_name")


def base_model_of(name_or_path: str | None) -> tuple[str | None, str | None]:
    """(Hub id, None) or (None, local path) for a model's ``name_or_path``; (None, None) when it has none."""
    from huggingface_hub.utils import HFValidationError, validate_repo_id

    if not name_or_path:
        return None, None
    if os.path.exists(name_or_path):
        return None, name_or_path
    try:
        validate_repo_id(name_or_path)
    except HFValidationError:
        return None, name_or_path  # a path that is gone: still not a Hub id
    return name_or_path, None


def write_model_card(trainer, output_dir: str, config: MidxConfig, *, num_classes: int, **card_args) -> str:
    """Write the MIDX model card of ``trainer``'s run into ``output_dir/README.md`` (atomically); returns its path.

    The card names the base model: a Hub id (``base_model`` metadata and a link) or a local folder (in the text),
    from the model's ``config.name_or_path`` (a PEFT adapter's ``base_model_name_or_path``); V (``num_classes``,
    the head's rows) with the tokenizer's length beside it when ``trainer.processing_class`` has another.

    Args:
        trainer: any ``transformers.Trainer``; its ``model_card_extras`` (if it has them) go into the card.
        output_dir: the folder to write to. config: the head's :class:`~hf_midx.MidxConfig`.
        num_classes: V, the LM head's rows.
        **card_args: the keyword arguments of ``Trainer.create_model_card`` (``language``, ``license``, ``tags``,
            ``model_name``, ``finetuned_from``, ``tasks``, ``dataset_tags``, ``dataset``, ``dataset_args``);
            ``dataset`` names the data in the text.
    Raises:
        ValueError: ``model_card_extras`` holds a key other than :data:`CARD_EXTRAS`.
    """
    from transformers.modelcard import TrainingSummary, make_markdown_table

    extras = dict(getattr(trainer, "model_card_extras", None) or {})
    unknown = sorted(set(extras) - set(CARD_EXTRAS))
    if unknown:
        raise ValueError(f"model_card_extras has unknown keys {unknown}; allowed: {', '.join(CARD_EXTRAS)}.")
    if isinstance(card_args.get("dataset"), str):
        extras.setdefault("dataset_name", card_args["dataset"])
    model = trainer.accelerator.unwrap_model(trainer.model)
    peft_config = getattr(model, "peft_config", None)  # a PEFT model saves an adapter, not a full model
    if isinstance(peft_config, dict) and peft_config:
        name = getattr(next(iter(peft_config.values())), "base_model_name_or_path", None)
    else:
        name = getattr(getattr(model, "config", None), "name_or_path", None) or getattr(model, "name_or_path", None)
    hub_id, local_path = base_model_of(card_args.pop("finetuned_from", None) or name)
    tags = card_args.pop("tags", None)
    tags = [tags] if isinstance(tags, str) else list(tags or [])
    # finetuned_from given: transformers would otherwise take any name that is not a folder for a Hub id.
    summary = TrainingSummary.from_trainer(trainer, tags=tags, finetuned_from=hub_id or "", **card_args)
    tokenizer = getattr(trainer, "processing_class", None)
    tokenizer = getattr(tokenizer, "tokenizer", tokenizer)  # a processor holds its tokenizer
    card = render_model_card(
        config,
        metadata=summary.create_metadata(),
        library_name="peft" if peft_config else "transformers",
        base_model=hub_id,
        base_model_path=local_path,
        model_name=summary.model_name,
        hyperparameters=summary.hyperparameters,
        eval_table=make_markdown_table(summary.eval_lines),
        log_history=trainer.state.log_history,
        num_classes=num_classes,
        tokenizer_size=len(tokenizer) if callable(getattr(tokenizer, "__len__", None)) else None,
        head_frozen=bool(getattr(find_head(model), "frozen", False)),
        **extras,
    )
    return save_model_card(card, output_dir)


#: Lines that mark a README.md as a generated card (hf-midx's template, transformers' Trainer card), which a later
#: save may replace; any other README.md is the user's text.
GENERATED_CARD_MARKS = ("<!-- Generated by hf-midx", "<!-- This model card has been generated automatically")


def user_readme(directory: str | os.PathLike) -> str | None:
    """The path of ``directory/README.md`` where it holds the user's own text (no :data:`GENERATED_CARD_MARKS`), else
    None (no file, or a generated card)."""
    path = os.path.join(os.fspath(directory), "README.md")
    if not os.path.isfile(path):
        return None
    with open(path, encoding="utf-8", errors="replace") as f:
        text = f.read()
    return None if any(mark in text for mark in GENERATED_CARD_MARKS) else path


def save_model_card(card, directory: str | os.PathLike, filename: str = "README.md") -> str:
    """Write ``card`` to ``directory/filename`` atomically (temporary file, then rename); returns the path."""
    return atomic_write(os.path.join(os.fspath(directory), filename), card.save)
