"""The runner shared by the language-model recipes (``wikitext2.py``, ``large_vocab.py``).

A recipe

1. parses its dataclasses plus :class:`ModelArguments`, a :func:`midx_arguments` class and
   ``TrainingArguments`` with :func:`parse_arguments` (recipe defaults for the Trainer flags);
2. prepares its token blocks (:class:`PreparedData`), checking everything it can;
3. calls :func:`train_and_report`, which builds the model, wraps its head (unless ``--sampler full``),
   trains with :class:`hf_midx.MidxTrainer` (or the plain ``Trainer`` for ``full``), evaluates the exact
   full-softmax loss on the validation and test blocks, saves a plain transformers model with its
   tokenizer and model card, writes ``results.json`` and pushes with ``--push_to_hub``.

Nothing is written before step 3 creates the Trainer, so bad input leaves the output directory as it
was. User errors raise :class:`RecipeError`; :func:`run` prints them as one line on stderr and exits
with status 2. ``results.json`` is the last file written (atomically) and only after a complete run;
a stale one from an earlier run in the same directory is removed when training starts.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import os
import platform
import shlex
import sys
import time
import typing
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from lm_data import DataError, TokenBlocks, collate_blocks

logger = logging.getLogger("recipes")

#: The model of the paper's language-model experiments: a 2-layer, 4-head decoder-only transformer with
#: 200-dimensional embeddings and 1024-wide feed-forward layers, input and output embeddings tied.
PAPER_GPT2 = {"n_embd": 200, "n_layer": 2, "n_head": 4, "n_inner": 1024}

#: ``--sampler full`` trains without sampling (the plain Trainer and full softmax): the baseline.
FULL = "full"

RESULTS_NAME = "results.json"


class RecipeError(Exception):
    """A problem with the user's input; reported as one line on stderr (no traceback), exit status 2."""


# ---------------------------------------------------------------------- arguments
@dataclass
class ModelArguments:
    """Which causal LM to train."""

    model_name_or_path: str | None = field(
        default=None,
        metadata={
            "help": "A causal LM to start from (Hub id or directory, e.g. a previous run's output_dir). Default: "
            "train from scratch the paper's model (GPT-2 architecture: 2 layers, 4 heads, embeddings 200, "
            "feed-forward 1024, tied input/output embeddings)."
        },
    )
    config_overrides: str | None = field(
        default=None,
        metadata={
            "help": "Override the from-scratch GPT-2 config, e.g. 'n_embd=256,n_layer=4,resid_pdrop=0.2' (the "
            "run_clm.py syntax). Not with --model_name_or_path."
        },
    )


def midx_arguments(**defaults: Any) -> type:
    """A ``MidxArguments`` dataclass for the command line, made from :class:`hf_midx.MidxConfig`'s fields.

    Same names, types and help as ``MidxConfig`` (one place per fact), with these changes: ``defaults``
    replace some defaults (the recipes use the paper's); ``--sampler`` also accepts ``full``; dict
    fields (``sampler_options``) are given as JSON; fields that ``TrainingArguments`` also has
    (``seed``) are left out and taken from it by :func:`midx_config_from`.
    """
    from transformers import TrainingArguments

    from hf_midx import MidxConfig

    hints = typing.get_type_hints(MidxConfig)
    taken = {f.name for f in dataclasses.fields(TrainingArguments)}
    unknown = sorted(set(defaults) - {f.name for f in dataclasses.fields(MidxConfig)})
    if unknown:
        raise ValueError(f"midx_arguments got defaults for unknown MidxConfig fields {unknown}.")
    specs = []
    for f in dataclasses.fields(MidxConfig):
        if f.name in taken:
            continue
        kind = hints[f.name]
        help_text = f.metadata.get("help", "")
        if f.default is not dataclasses.MISSING:
            default = f.default
        else:
            default = f.default_factory()
        default = defaults.get(f.name, default)
        if kind is dict or typing.get_origin(kind) is dict:
            kind, default = str, json.dumps(default)
            help_text += " Given as JSON, e.g. '{\"rff_temperature\": 2.0}'."
        if f.name == "sampler":
            help_text += f" Or '{FULL}': no sampling, the plain Trainer with the full softmax (the baseline)."
        specs.append((f.name, kind, field(default=default, metadata={"help": help_text})))
    cls = dataclasses.make_dataclass("MidxArguments", specs)
    cls.__doc__ = "MIDX options (hf_midx.MidxConfig's fields), or --sampler full for the full-softmax baseline."
    return cls


def midx_config_from(midx_args: Any, seed: int):
    """The validated :class:`hf_midx.MidxConfig` of parsed ``MidxArguments``; None for ``--sampler full``.

    With ``full`` the other MIDX options are still checked (a typo should not pass silently).
    Raises RecipeError on any invalid value.
    """
    from hf_midx import SAMPLERS, MidxConfig

    values = dataclasses.asdict(midx_args)
    sampler = values["sampler"]
    if sampler != FULL and sampler not in SAMPLERS:
        raise RecipeError(f"--sampler {sampler!r} is not known; choose one of: {FULL}, {', '.join(sorted(SAMPLERS))}.")
    hints = typing.get_type_hints(MidxConfig)
    for name, kind in hints.items():
        if name in values and (kind is dict or typing.get_origin(kind) is dict) and isinstance(values[name], str):
            try:
                values[name] = json.loads(values[name])
            except json.JSONDecodeError as err:
                raise RecipeError(
                    f"--{name} must be a JSON object, e.g. '{{\"rff_temperature\": 2.0}}' ({err})."
                ) from None
    values["seed"] = seed
    if sampler == FULL:
        values["sampler"] = MidxConfig.sampler  # validate the rest as if sampling
    try:
        config = MidxConfig(**values)
    except (TypeError, ValueError) as err:
        raise RecipeError(f"invalid MIDX option: {err}") from None
    return None if sampler == FULL else config


def _one_line_parser(dataclass_types):
    """``HfArgumentParser`` whose errors raise RecipeError (one line) instead of printing usage and exiting."""
    from transformers import HfArgumentParser

    class OneLineParser(HfArgumentParser):
        def error(self, message):  # argparse's hook for bad command lines
            raise RecipeError(message)

    return OneLineParser(dataclass_types)


def parse_arguments(
    dataclass_types: Sequence[type], training_defaults: dict[str, Any], argv: Sequence[str] | None = None, doc: str = ""
) -> tuple:
    """Parse ``argv`` into instances of ``dataclass_types`` plus ``TrainingArguments`` (last).

    ``training_defaults`` replace TrainingArguments defaults (they show in ``--help``); anything given
    on the command line wins. Raises RecipeError for unknown flags and invalid values.
    """
    from transformers import TrainingArguments

    parser = _one_line_parser([*dataclass_types, TrainingArguments])
    parser.description = doc
    parser.set_defaults(**training_defaults)
    try:
        return tuple(parser.parse_args_into_dataclasses(args=argv))
    except (ValueError, TypeError) as err:
        raise RecipeError(str(err)) from None


def recipe_training_defaults(output_dir: str) -> dict[str, Any]:
    """Trainer settings for the small word-level transformers of the recipes (all overridable)."""
    return {
        "output_dir": output_dir,
        "learning_rate": 1e-3,
        "warmup_steps": 0.02,  # a ratio of the total steps
        "weight_decay": 0.01,
        "per_device_train_batch_size": 32,
        "per_device_eval_batch_size": 64,
        "eval_strategy": "epoch",
        "save_strategy": "epoch",
        "save_total_limit": 2,
        "logging_steps": 50,
        "report_to": "none",
        "include_num_input_tokens_seen": True,  # "all" (the flag parses as a bool)
        "dataloader_pin_memory": torch.cuda.is_available(),
        "ddp_find_unused_parameters": False,  # every parameter gets a gradient
    }


def setup_logging(training_args) -> None:
    """The recipe's and hf_midx's INFO messages on stdout from the main process; WARNING elsewhere."""
    import transformers

    logging.basicConfig(
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        datefmt="%H:%M:%S",
        handlers=[logging.StreamHandler(sys.stdout)],
        force=True,
    )
    level = logging.INFO if training_args.should_log else logging.WARNING
    for name in ("recipes", "hf_midx"):
        logging.getLogger(name).setLevel(level)
    if training_args.log_level != "passive":
        transformers.utils.logging.set_verbosity(training_args.get_process_log_level())


def check_output_and_resume(training_args) -> str | None:
    """Validate ``--output_dir`` and ``--resume_from_checkpoint``; returns the checkpoint to resume or None.

    ``--resume_from_checkpoint last`` (or ``true``) picks the newest ``checkpoint-*`` in output_dir.
    """
    from transformers.trainer_utils import get_last_checkpoint

    out = training_args.output_dir
    if os.path.exists(out) and not os.path.isdir(out):
        raise RecipeError(f"--output_dir {out!r} is a file; give a directory.")
    resume = training_args.resume_from_checkpoint
    if resume is None or resume == "":
        return None
    if resume.lower() in ("last", "true"):
        last = get_last_checkpoint(out) if os.path.isdir(out) else None
        if last is None:
            raise RecipeError(f"--resume_from_checkpoint {resume}: no checkpoint-* folder in {out!r} to resume from.")
        return last
    if not os.path.isdir(resume):
        raise RecipeError(f"--resume_from_checkpoint {resume!r} is not a checkpoint directory.")
    return resume


def hub_unreachable() -> str | None:
    """Why the Hugging Face Hub cannot be reached (a quick request), or None.

    None also in offline mode (HF_HUB_OFFLINE / HF_DATASETS_OFFLINE): then the caller tries its
    local cache, which fails fast if the files are not there.
    """
    from huggingface_hub import constants, get_session

    if constants.HF_HUB_OFFLINE or os.environ.get("HF_DATASETS_OFFLINE", "").upper() in ("1", "ON", "YES", "TRUE"):
        return None
    try:
        get_session().head(constants.ENDPOINT, timeout=10)
    except Exception as err:  # any transport error means "not reachable"
        return f"{type(err).__name__}: {' '.join(str(err).split())}"
    return None


def check_push(training_args) -> None:
    """With ``--push_to_hub``, fail now (one line) if the Hub cannot be reached or no token is known."""
    if not training_args.push_to_hub:
        return
    from huggingface_hub import constants, get_token

    if constants.HF_HUB_OFFLINE:
        raise RecipeError("--push_to_hub needs the Hugging Face Hub, but HF_HUB_OFFLINE is set.")
    reason = hub_unreachable()
    if reason is not None:
        raise RecipeError(f"--push_to_hub needs the Hugging Face Hub, which cannot be reached ({reason}).")
    if not (training_args.hub_token or get_token()):
        raise RecipeError("--push_to_hub needs a Hugging Face token: run `hf auth login` or pass --hub_token.")


# ---------------------------------------------------------------------- data handed to the runner
@dataclass
class PreparedData:
    """What a recipe hands to :func:`train_and_report`.

    Attributes:
        train, valid, test: token blocks (test may be None).
        vocab_size: V, the number of token ids.
        class_counts: (V,) training-token counts (for the unigram / log-uniform samplers).
        tokenizer: saved with the model (may be None).
        eos_token_id: for the from-scratch config's bos/eos/pad ids (may be None).
        description: one phrase naming the data (logged and written to results.json).
        card: keyword arguments for the Trainer's model card (dataset names, tags).
        extra: more entries for results.json (e.g. the synthetic corpus' entropy rate).
    """

    train: TokenBlocks
    valid: TokenBlocks
    test: TokenBlocks | None
    vocab_size: int
    class_counts: torch.Tensor
    tokenizer: Any = None
    eos_token_id: int | None = None
    description: str = ""
    card: dict[str, Any] = field(default_factory=dict)
    extra: dict[str, Any] = field(default_factory=dict)


def check_blocks(name: str, blocks: TokenBlocks, num_tokens: int) -> None:
    """RecipeError when a split yields no block of ``seq_len + 1`` tokens."""
    if len(blocks) == 0:
        need = blocks.seq_len + 1
        raise RecipeError(
            f"the {name} split has {num_tokens} token(s), fewer than the {need} (--seq_len + 1) of one block; "
            "give more text or a smaller --seq_len."
        )


# ---------------------------------------------------------------------- model
def check_model_arguments(model_args: ModelArguments) -> None:
    """RecipeError for contradictory model flags (checked before any data is read)."""
    if model_args.model_name_or_path and model_args.config_overrides:
        raise RecipeError(
            "--config_overrides only applies to a model trained from scratch, not with --model_name_or_path."
        )


def build_model(model_args: ModelArguments, data: PreparedData, seq_len: int):
    """The causal LM to train (see :class:`ModelArguments`); its vocabulary covers ``data.vocab_size``."""
    from transformers import AutoModelForCausalLM, GPT2Config

    block_len = seq_len + 1
    check_model_arguments(model_args)
    if model_args.model_name_or_path:
        try:
            model = AutoModelForCausalLM.from_pretrained(model_args.model_name_or_path)
        except (OSError, ValueError) as err:
            raise RecipeError(f"cannot load --model_name_or_path {model_args.model_name_or_path!r}: {err}") from None
        if model.get_input_embeddings().weight.shape[0] < data.vocab_size:
            model.resize_token_embeddings(data.vocab_size)
    else:
        eos = data.eos_token_id
        config = GPT2Config(
            vocab_size=data.vocab_size,
            n_positions=block_len,
            tie_word_embeddings=True,
            bos_token_id=eos,
            eos_token_id=eos,
            pad_token_id=eos,
            **PAPER_GPT2,
        )
        if model_args.config_overrides:
            try:
                config.update_from_string(model_args.config_overrides)
            except (ValueError, AttributeError) as err:
                raise RecipeError(f"--config_overrides {model_args.config_overrides!r}: {err}") from None
            if config.vocab_size < data.vocab_size:
                raise RecipeError(
                    f"--config_overrides sets vocab_size={config.vocab_size}, below the data's {data.vocab_size}."
                )
        try:
            model = AutoModelForCausalLM.from_config(config)
        except (ValueError, TypeError) as err:
            raise RecipeError(f"cannot build the model from its config: {err}") from None
    if getattr(model, "loss_type", None) is None:
        # transformers derives loss_type from the class name, and "GPT2LMHeadModel" matches none, so
        # the Trainer would count num_items_in_batch over the unshifted labels (seq_len + 1 per block
        # instead of seq_len) and report eval_loss * seq_len / (seq_len + 1). The loss *is* the causal-LM
        # one (the model falls back to ForCausalLMLoss); saying so makes the Trainer count shifted labels.
        model.loss_type = "ForCausalLM"
    positions = getattr(model.config, "n_positions", None) or getattr(model.config, "max_position_embeddings", None)
    if positions is not None and positions < block_len:
        raise RecipeError(
            f"the model has {positions} positions but blocks need {block_len} (--seq_len + 1); lower --seq_len."
        )
    return model


# ---------------------------------------------------------------------- training
def _trainer_classes():
    from transformers import Trainer, TrainerCallback

    from hf_midx import MidxTrainer
    from hf_midx.trainer import PerplexityMixin

    class RecipeCard:
        """Appends ``recipe_section`` (the recipe's final results) to the card ``create_model_card`` writes."""

        recipe_section: str | None = None
        from_scratch = False

        def create_model_card(self, *args, **kwargs):
            config = self.model.config
            name = getattr(config, "_name_or_path", "")
            if self.from_scratch:
                # transformers takes a _name_or_path that is not a directory ("" here) for the base model
                # and writes "fine-tuned version of []"; a directory makes it say "trained from scratch".
                config._name_or_path = self.args.output_dir
            try:
                super().create_model_card(*args, **kwargs)
            finally:
                config._name_or_path = name
            path = os.path.join(self.args.output_dir, "README.md")
            if self.recipe_section and self.is_world_process_zero() and os.path.isfile(path):
                from hf_midx._io import atomic_write

                with open(path, encoding="utf-8") as f:
                    card = f.read()
                # A reader never sees a card without its results section.
                atomic_write(path, lambda tmp: Path(tmp).write_text(card + "\n" + self.recipe_section, encoding="utf-8"))

    class RecipeMidxTrainer(RecipeCard, MidxTrainer):
        """MidxTrainer with the recipe's results in the model card."""

    class FullSoftmaxTrainer(RecipeCard, PerplexityMixin, Trainer):
        """The baseline: the plain Trainer, plus ``<prefix>_perplexity`` in evaluation metrics."""

    class TokenCounter(TrainerCallback):
        """The tokens seen when training starts (after a resumed state is loaded), and the seconds that
        evaluations took during ``train()`` (they count in the Trainer's ``train_runtime``)."""

        start_tokens = 0
        eval_seconds = 0.0
        training = False

        def on_train_begin(self, args, state, control, **kwargs):
            self.start_tokens, self.eval_seconds, self.training = state.num_input_tokens_seen, 0.0, True

        def on_train_end(self, args, state, control, **kwargs):
            self.training = False

        def on_evaluate(self, args, state, control, metrics=None, **kwargs):
            if self.training and metrics:
                self.eval_seconds += sum(v for k, v in metrics.items() if k.endswith("_runtime"))

    return RecipeMidxTrainer, FullSoftmaxTrainer, TokenCounter


def _split_metrics(trainer, blocks: TokenBlocks, prefix: str) -> dict[str, Any]:
    """Exact full-softmax loss / perplexity of ``blocks``: the Trainer's evaluation, reused if it just ran.

    Every block predicts ``seq_len`` tokens, so the Trainer's per-block average is the per-token average.
    """
    state = trainer.state
    last = next((e for e in reversed(state.log_history) if f"{prefix}_loss" in e), None)
    if (
        prefix == "eval"
        and last is not None
        and last.get("step") == state.global_step
        and not trainer.args.load_best_model_at_end
    ):
        loss = float(last["eval_loss"])
    else:
        loss = float(trainer.evaluate(eval_dataset=blocks, metric_key_prefix=prefix)[f"{prefix}_loss"])
    return {
        "loss": loss,
        "perplexity": math.exp(loss) if loss < 700 else math.inf,
        "tokens": blocks.num_predicted_tokens,
    }


def _write_json_atomic(path: str, data: dict[str, Any]) -> None:
    from hf_midx._io import atomic_write

    def write(tmp: str) -> None:
        with open(tmp, "w", encoding="utf-8") as f:
            json.dump(data, f, indent=2, sort_keys=False, allow_nan=True)
            f.write("\n")
            f.flush()
            os.fsync(f.fileno())

    atomic_write(path, write)


def _versions() -> dict[str, str]:
    import accelerate
    import transformers

    import hf_midx

    return {
        "hf_midx": hf_midx.__version__,
        "transformers": transformers.__version__,
        "torch": torch.__version__,
        "accelerate": accelerate.__version__,
        "python": platform.python_version(),
    }


def _describe_sampler(midx_config) -> str:
    if midx_config is None:
        return FULL
    return f"{midx_config.sampler} (num_samples={midx_config.num_samples}, codebook_size={midx_config.codebook_size})"


def train_and_report(
    recipe: str,
    model_args: ModelArguments,
    midx_config,
    training_args,
    data: PreparedData,
    *,
    seq_len: int,
    resume: str | None,
    started: float,
    argv: Sequence[str] | None = None,
) -> dict[str, Any]:
    """Build, train, evaluate, save and (optionally) push; returns what ``results.json`` holds.

    ``argv`` (default ``sys.argv[1:]``) is quoted in the model card as the command that made the model.

    Raises RecipeError for problems found before the Trainer exists (model config, head wrapping);
    anything later propagates with its traceback, and no ``results.json`` is written.
    """
    from transformers import set_seed

    from hf_midx import MidxLMHead

    MidxTrainer, FullSoftmaxTrainer, TokenCounter = _trainer_classes()
    set_seed(training_args.seed)
    if midx_config is not None and training_args.n_gpu > 1:
        raise RecipeError(
            f"this single process sees {training_args.n_gpu} GPUs, and the Trainer would use torch.nn.DataParallel, which "
            "the MIDX head does not support; launch one process per GPU with `accelerate launch --multi_gpu "
            f"--num_processes {training_args.n_gpu} ...`, or use one GPU (CUDA_VISIBLE_DEVICES=0)."
        )
    model = build_model(model_args, data, seq_len)
    if midx_config is not None:
        try:
            MidxLMHead.wrap(model, midx_config, class_counts=data.class_counts)
        except ValueError as err:
            raise RecipeError(f"cannot train with --sampler {midx_config.sampler}: {err}") from None
    num_params = sum(p.numel() for p in model.parameters())
    logger.info(
        "%s: %s, V=%d, %d train / %d valid / %s test blocks of %d tokens; model %s with %.2fM parameters; sampler %s",
        recipe,
        data.description,
        data.vocab_size,
        len(data.train),
        len(data.valid),
        len(data.test) if data.test is not None else "no",
        seq_len + 1,
        model.config.model_type,
        num_params / 1e6,
        _describe_sampler(midx_config),
    )

    # Everything is checked; from here on the output directory is written.
    results_path = os.path.join(training_args.output_dir, RESULTS_NAME)
    if training_args.process_index == 0 and os.path.exists(results_path):
        os.remove(results_path)  # this run replaces it; a failure must not leave the old one claiming success
    counter = TokenCounter()
    trainer_cls = FullSoftmaxTrainer if midx_config is None else MidxTrainer
    trainer = trainer_cls(
        model=model,
        args=training_args,
        train_dataset=data.train,
        eval_dataset=data.valid,
        data_collator=collate_blocks,
        processing_class=data.tokenizer,
        callbacks=[counter],
    )
    train_output = trainer.train(resume_from_checkpoint=resume)
    metrics = train_output.metrics
    valid = _split_metrics(trainer, data.valid, "eval")
    test = _split_metrics(trainer, data.test, "test") if data.test is not None else None

    trainer.save_model()
    trainer.save_state()

    runtime = float(metrics.get("train_runtime", float("nan")))
    train_seconds = runtime - counter.eval_seconds  # without the evaluations during training
    tokens = None
    if training_args.include_num_input_tokens_seen != "no":
        tokens = int(trainer.state.num_input_tokens_seen - counter.start_tokens)
    results = {
        "recipe": recipe,
        "complete": True,
        "sampler": FULL if midx_config is None else midx_config.sampler,
        "midx_config": None if midx_config is None else midx_config.to_dict(),
        "data": {
            "source": data.description,
            "vocab_size": data.vocab_size,
            "seq_len": seq_len,
            "train_blocks": len(data.train),
            "train_tokens": data.train.num_predicted_tokens,
            "valid_tokens": data.valid.num_predicted_tokens,
            "test_tokens": None if data.test is None else data.test.num_predicted_tokens,
        },
        "model": {
            "source": model_args.model_name_or_path or "from scratch (GPT-2 architecture)",
            "model_type": model.config.model_type,
            "num_parameters": num_params,
            "config_overrides": model_args.config_overrides,
        },
        "valid_loss": valid["loss"],
        "valid_perplexity": valid["perplexity"],
        "test_loss": None if test is None else test["loss"],
        "test_perplexity": None if test is None else test["perplexity"],
        "train_loss": metrics.get("train_loss"),
        "global_step": trainer.state.global_step,
        "epoch": trainer.state.epoch,
        "train_tokens_seen": tokens,
        "train_runtime_s": runtime,
        "eval_during_training_s": counter.eval_seconds,
        "tokens_per_second": None if tokens is None or not train_seconds > 0 else tokens / train_seconds,
        "wall_time_s": time.perf_counter() - started,
        "world_size": training_args.world_size,
        "device": str(training_args.device),
        "bf16": bool(training_args.bf16),
        "versions": _versions(),
        **data.extra,
    }
    card = {"model_name": os.path.basename(os.path.normpath(training_args.output_dir)), **data.card}
    if training_args.hub_model_id:
        card["model_name"] = training_args.hub_model_id.split("/")[-1]
    if model_args.model_name_or_path and not os.path.isdir(model_args.model_name_or_path):
        card["finetuned_from"] = model_args.model_name_or_path
    trainer.recipe_section = results_markdown(results, sys.argv[1:] if argv is None else argv)
    trainer.from_scratch = not model_args.model_name_or_path
    if trainer.is_world_process_zero():
        trainer.create_model_card(**card)
        _write_json_atomic(results_path, results)
        logger.info(
            "%s done: valid perplexity %.3f%s, %s tokens/s, train %.1f s, wall %.1f s; results in %s",
            recipe,
            results["valid_perplexity"],
            "" if test is None else f", test perplexity {results['test_perplexity']:.3f}",
            "n/a" if results["tokens_per_second"] is None else f"{results['tokens_per_second']:.0f}",
            runtime,
            results["wall_time_s"],
            results_path,
        )
    if training_args.push_to_hub:
        trainer.push_to_hub(**card)
    return results


def _command_line(recipe: str, argv: Sequence[str]) -> str:
    """How this run was started, without secrets (``--hub_token``)."""
    args, skip = [], False
    for arg in argv:
        if skip:
            skip = False
            continue
        if arg.replace("-", "_").startswith("__hub_token"):
            skip = "=" not in arg
            continue
        args.append(arg)
    return shlex.join(["python", f"recipes/{recipe}.py", *args])


def results_markdown(results: dict[str, Any], argv: Sequence[str] = ()) -> str:
    """The model-card section with a run's final results (appended to README.md)."""
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
        f"- Model: {results['model']['source']}, {results['model']['num_parameters']:,} parameters",
        f"- Data: {data['source']}; vocabulary {data['vocab_size']:,}",
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
    lines += [f"- Command: `{_command_line(results['recipe'], argv)}`", ""]
    return "\n".join(lines)


# ---------------------------------------------------------------------- entry point
def run(main: Callable[[Sequence[str] | None], Any], argv: Sequence[str] | None = None) -> None:
    """Run a recipe's ``main``; a RecipeError or DataError becomes one line on stderr and exit status 2.

    In a multi-process launch only the first process prints the line; every process exits with 2.
    """
    try:
        main(argv)
    except (RecipeError, DataError) as err:
        if int(os.environ.get("RANK", "0")) == 0:
            prog = os.path.basename(sys.argv[0]) or "recipe"
            message = " ".join(str(err).split())
            print(f"{prog}: error: {message}", file=sys.stderr, flush=True)
        sys.exit(2)
