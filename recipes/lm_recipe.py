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
with status 2. ``results.json`` is the last file written (atomically) and only after a complete run.
An output directory that holds a finished run (``results.json``) or an unfinished one (``checkpoint-*``)
is refused unless ``--overwrite_output_dir`` or ``--resume_from_checkpoint`` says what to do with it;
then the old ``results.json`` (and, overwriting, the old checkpoints) is removed when training starts.
Ctrl-C stops with one line naming the last checkpoint (exit status 130).
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
import warnings
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from recipes.lm_data import DataError, TokenBlocks, collate_blocks

logger = logging.getLogger("recipes")

#: The model of the paper's language-model experiments: a 2-layer, 4-head decoder-only transformer with
#: 200-dimensional embeddings and 1024-wide feed-forward layers, input and output embeddings tied.
PAPER_GPT2 = {"n_embd": 200, "n_layer": 2, "n_head": 4, "n_inner": 1024}

#: Positions of the from-scratch model: GPT-2's 1024, so the exported model generates well past a training block
#: (positions beyond ``seq_len + 1`` are not trained; a prompt plus new tokens must stay within them).
GENERATION_POSITIONS = 1024

#: ``--sampler full`` trains without sampling (the plain Trainer and full softmax): the baseline.
FULL = "full"

RESULTS_NAME = "results.json"


class RecipeError(Exception):
    """A problem with the user's input; reported as one line on stderr (no traceback), exit status 2."""


class Interrupted(Exception):
    """Ctrl-C (SIGINT) or SIGTERM during a recipe; the message says where the last checkpoint is.

    Exit status 130 (SIGINT) or 143 (SIGTERM), as a shell reports a process killed by the signal.
    """


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


@dataclass
class OutputArguments:
    """What to do with an earlier run in --output_dir."""

    overwrite_output_dir: bool = field(
        default=False,
        metadata={
            "help": "Start over in an --output_dir that holds an earlier run: its results.json and checkpoint-* "
            "folders are removed when training starts, the other files are replaced. Without it such a directory is "
            "refused, unless --resume_from_checkpoint continues the run."
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
        # argparse %-formats help strings (for %(default)s): a literal percent sign must be doubled.
        specs.append((f.name, kind, field(default=default, metadata={"help": help_text.replace("%", "%%")})))
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


#: TrainingArguments flags that ``--help`` describes, in a line each; the others are listed by name
#: (``--help_all`` gives transformers' own help for all).
MAIN_TRAINING_FLAGS = {
    "output_dir": "Where the model, tokenizer, card, checkpoints and results.json go.",
    "num_train_epochs": "Epochs to train.",
    "max_steps": "Optimizer steps to train (overrides --num_train_epochs when > 0).",
    "learning_rate": "Peak learning rate of AdamW.",
    "per_device_train_batch_size": "Blocks per batch and process.",
    "eval_strategy": "When to evaluate on the validation blocks: no, steps, epoch.",
    "save_strategy": "When to save a checkpoint-N folder: no, steps, epoch.",
    "logging_steps": "Log the loss (and the midx/* values) every N steps.",
    "seed": "Seed of the model's initialization, the data order and the sampler.",
    "bf16": "bfloat16 mixed precision.",
    "report_to": "Also log to these integrations, e.g. tensorboard (pip install 'hf-midx[tensorboard]').",
    "resume_from_checkpoint": "'last' (the newest checkpoint-N of --output_dir) or a checkpoint folder.",
    "push_to_hub": "Push the output folder to the Hub (with --hub_model_id user/name).",
}


def _one_line_parser(dataclass_types, description: str = ""):
    """``HfArgumentParser`` whose errors raise RecipeError (one line) instead of printing usage and exiting."""
    import argparse

    from transformers import HfArgumentParser

    class OneLineParser(HfArgumentParser):
        def error(self, message):  # argparse's hook for bad command lines
            raise RecipeError(message)

    class Formatter(argparse.ArgumentDefaultsHelpFormatter, argparse.RawDescriptionHelpFormatter):
        """Defaults in the help (as HfArgumentParser shows them), the description's example lines as written."""

    # allow_abbrev=False: "--num_sample 5" is an error, not "--num_samples 5" taken silently.
    return OneLineParser(dataclass_types, description=description, formatter_class=Formatter, allow_abbrev=False)


def _short_help(parser, argv: Sequence[str]) -> None:
    """``--help`` describes the recipe's flags and the main TrainingArguments ones; it names the others.

    The Trainer's ~120 flags with their help would be 600 lines. ``--help_all`` shows them all.
    """
    import argparse

    from transformers import TrainingArguments

    import textwrap

    parser.add_argument("--help_all", action="help", help="Show every flag with its help, TrainingArguments' included.")
    if "--help_all" in argv:
        return
    parser.usage = "%(prog)s [--output_dir DIR] [--flag value ...]   (--help: the main flags; --help_all: all)"
    for action in parser._actions:
        negated = action.option_strings[0][len("--no_") :] if action.option_strings[0].startswith("--no_") else None
        if negated and action.help is not argparse.SUPPRESS:
            action.help = f"Turn --{negated} off."
    training = {f.name for f in dataclasses.fields(TrainingArguments)}
    named = []
    for action in parser._actions:  # argparse keeps no public list of its actions
        if action.dest in MAIN_TRAINING_FLAGS:
            action.help = MAIN_TRAINING_FLAGS[action.dest]
        elif action.dest in training:
            if action.help is not argparse.SUPPRESS and action.option_strings[0].startswith("--"):
                named.append(action.option_strings[0])
            action.help = argparse.SUPPRESS
    text = "Every other transformers TrainingArguments flag works too (--help_all describes them): "
    parser.epilog = textwrap.fill(text + ", ".join(sorted(set(named))) + ".", width=78)


def parse_arguments(
    dataclass_types: Sequence[type], training_defaults: dict[str, Any], argv: Sequence[str] | None = None, doc: str = ""
) -> tuple:
    """Parse ``argv`` into instances of ``dataclass_types`` plus ``TrainingArguments`` (last).

    ``training_defaults`` replace TrainingArguments defaults (they show in ``--help``); anything given
    on the command line wins. Raises RecipeError for unknown flags and invalid values.
    """
    from transformers import TrainingArguments

    argv = sys.argv[1:] if argv is None else list(argv)
    parser = _one_line_parser([*dataclass_types, TrainingArguments], description=_description(doc))
    _short_help(parser, argv)
    parser.set_defaults(**training_defaults)
    if launched_without_gpu():
        # A torchrun / accelerate launch of several processes on a machine without a GPU: without use_cpu the
        # Trainer's PartialState finds no GPU backend, so every process trains alone (world size 1).
        parser.set_defaults(use_cpu=True)
    try:
        return tuple(parser.parse_args_into_dataclasses(args=argv))
    except (ValueError, TypeError) as err:
        raise RecipeError(str(err)) from None


def _description(doc: str) -> str:
    """A recipe docstring's first two paragraphs (what it does, the example commands), for ``--help``."""
    return "\n\n".join(doc.strip().split("\n\n")[:2]).replace("``", "")


def launched_without_gpu() -> bool:
    """True in one of several processes started by torchrun / accelerate launch on a machine without a GPU.

    Such a launch sets WORLD_SIZE (> 1) and LOCAL_RANK; ``TrainingArguments`` then needs ``use_cpu`` to set up
    one DDP job over gloo, since accelerate only looks for a CPU process group when told to use the CPU.
    """
    world_size = int(os.environ.get("WORLD_SIZE", "1") or 1)
    return world_size > 1 and "LOCAL_RANK" in os.environ and not torch.cuda.is_available()


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
        # Progress bars on a terminal only: redrawn with carriage returns, they would fill a log file
        # with control characters (the Trainer then prints each log entry as a line instead).
        "disable_tqdm": not sys.stderr.isatty(),
    }


def setup_logging(training_args) -> None:
    """The recipe's and hf_midx's INFO messages on stderr from the main process; WARNING elsewhere.

    stderr, as transformers logs: one stream for progress, logs, warnings and errors, and stdout stays free.
    """
    import transformers

    logging.basicConfig(
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        datefmt="%H:%M:%S",
        handlers=[logging.StreamHandler(sys.stderr)],
        force=True,
    )
    level = logging.INFO if training_args.should_log else logging.WARNING
    for name in ("recipes", "hf_midx"):
        logging.getLogger(name).setLevel(level)
    if training_args.log_level != "passive":
        transformers.utils.logging.set_verbosity(training_args.get_process_log_level())
    # Python warnings as one log line, without the source path and line that warnings.showwarning prints.
    warnings.showwarning = _log_warning
    if training_args.disable_tqdm:
        # No terminal: the saving bars ("Writing model shards") would write carriage returns into the log.
        from huggingface_hub.utils import disable_progress_bars

        disable_progress_bars()
        transformers.utils.logging.disable_progress_bar()


def _log_warning(message, category, filename, lineno, file=None, line=None) -> None:
    logging.getLogger("py.warnings").warning("%s: %s", category.__name__, message)


def check_output_and_resume(training_args, overwrite: bool = False) -> str | None:
    """Validate ``--output_dir`` and ``--resume_from_checkpoint``; returns the checkpoint to resume or None.

    ``--resume_from_checkpoint last`` (or ``true``) picks the newest ``checkpoint-*`` in output_dir. Without a
    checkpoint to resume and without ``overwrite`` (``--overwrite_output_dir``), an output_dir holding a
    finished run (``results.json``) or an unfinished one (``checkpoint-*``) is a RecipeError: the earlier
    run is left as it is.
    """
    from transformers.trainer_utils import get_last_checkpoint

    out = training_args.output_dir
    if os.path.exists(out) and not os.path.isdir(out):
        raise RecipeError(f"--output_dir {out!r} is a file; give a directory.")
    resume = training_args.resume_from_checkpoint
    if resume is None or resume == "":
        if not overwrite and os.path.isdir(out):
            if os.path.exists(os.path.join(out, RESULTS_NAME)):
                raise RecipeError(
                    f"--output_dir {out!r} holds a finished run ({RESULTS_NAME}); give another --output_dir, "
                    "--resume_from_checkpoint last to continue it, or --overwrite_output_dir to replace it."
                )
            last = get_last_checkpoint(out)
            if last is not None:
                raise RecipeError(
                    f"--output_dir {out!r} holds an unfinished run ({os.path.basename(last)}); pass "
                    "--resume_from_checkpoint last to continue it, --overwrite_output_dir to start over, or another "
                    "--output_dir."
                )
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
    from huggingface_hub import constants

    if constants.HF_HUB_OFFLINE or os.environ.get("HF_DATASETS_OFFLINE", "").upper() in ("1", "ON", "YES", "TRUE"):
        return None
    return _probe_hub()


def _probe_hub() -> str | None:
    """One HEAD request to the Hub endpoint (10 s at most): why it failed, or None."""
    from huggingface_hub import constants, get_session

    try:
        get_session().head(constants.ENDPOINT, timeout=10)
    except Exception as err:  # any transport error means "not reachable"
        return f"{type(err).__name__}: {' '.join(str(err).split())}"
    return None


def check_hub_source(name: str | None, flag: str) -> None:
    """RecipeError now, in one line, if ``name`` (not a local directory) cannot come from the Hub or its cache.

    Without this, an unreachable Hub costs a minute of download retries before the error. Offline
    (HF_HUB_OFFLINE) only the local cache is used, so the name must be in it.
    """
    if not name or os.path.isdir(name):
        return
    from huggingface_hub import constants, try_to_load_from_cache

    try:
        cached = isinstance(try_to_load_from_cache(name, "config.json"), str) or isinstance(
            try_to_load_from_cache(name, "tokenizer_config.json"), str
        )
    except ValueError:  # huggingface_hub's HFValidationError: neither a directory nor a repository id
        raise RecipeError(f"{flag} {name!r} is not a directory, nor a Hugging Face Hub model id.") from None
    if constants.HF_HUB_OFFLINE:
        if not cached:
            raise RecipeError(
                f"{flag} {name!r} is not a directory and not in the Hugging Face cache, and HF_HUB_OFFLINE is set; "
                "give a local model directory or download it first."
            )
        return
    reason = _probe_hub()
    if reason is not None:
        hint = "set HF_HUB_OFFLINE=1 to use the cached copy" if cached else "it is not in the local cache either"
        raise RecipeError(f"{flag} {name!r}: the Hugging Face Hub cannot be reached ({reason[:200]}); {hint}.")


def check_reporting(training_args) -> None:
    """RecipeError now, in one line, for a ``--report_to`` integration that is not installed.

    Without this the Trainer stops with a long traceback once the model is built.
    """
    from transformers.integrations import is_tensorboard_available

    wanted = training_args.report_to or []
    if "tensorboard" in wanted and not is_tensorboard_available():
        raise RecipeError("--report_to tensorboard needs TensorBoard: pip install 'hf-midx[tensorboard]'.")


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
    check_hub_source(model_args.model_name_or_path, "--model_name_or_path")


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
            n_positions=max(block_len, GENERATION_POSITIONS),
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
        """The recipe's model card: the Trainer's (transformers' or the MIDX one) with the recipe's exact results.

        ``recipe_card`` (set by :func:`train_and_report` once the results are known) holds the MIDX config, the
        vocabulary size, the ``huggingface_hub.EvalResult`` list and the results section; until then the
        Trainer's own card is written. The card holds no path of this machine (see :func:`results_markdown`).
        """

        recipe_card: dict[str, Any] | None = None
        from_scratch = False

        def create_model_card(self, *args, **kwargs):
            if self.recipe_card is None:
                return super().create_model_card(*args, **kwargs)
            if not self.is_world_process_zero():
                return None
            from hf_midx.model_card import save_model_card

            config = self.model.config
            name = getattr(config, "_name_or_path", "")
            if self.from_scratch:
                # transformers takes a _name_or_path that is not a directory ("" here) for the base model
                # and writes "fine-tuned version of []"; a directory makes it say "trained from scratch".
                config._name_or_path = self.args.output_dir
            try:
                card = self._base_card(**kwargs)
            finally:
                config._name_or_path = name
            info = self.recipe_card
            card.data.model_name = kwargs.get("model_name") or card.data.model_name or "model"
            card.data.eval_results = info["eval_results"] or None
            card.data.metrics = ["perplexity"] if info["eval_results"] else None
            if kwargs.get("dataset_tags"):
                card.data.datasets = [kwargs["dataset_tags"]]
            card.text = card.text.rstrip("\n") + "\n\n" + info["section"]
            return save_model_card(card, self.args.output_dir)  # atomically: never a card without its results

        def _base_card(self, **kwargs):
            """transformers' card, loaded back as a ``huggingface_hub.ModelCard``."""
            from huggingface_hub import ModelCard

            super().create_model_card(**kwargs)
            return ModelCard.load(os.path.join(self.args.output_dir, "README.md"))

    class RecipeMidxTrainer(RecipeCard, MidxTrainer):
        """MidxTrainer with the recipe's results in the model card."""

        def _base_card(self, **kwargs):
            """The MIDX card, rendered from this run's facts; the recipe's section carries the throughput."""
            from transformers.modelcard import TrainingSummary, make_markdown_table

            from hf_midx.model_card import render_model_card

            info = self.recipe_card
            tags = kwargs.pop("tags", None)
            summary = TrainingSummary.from_trainer(self, tags=[tags] if isinstance(tags, str) else tags, **kwargs)
            return render_model_card(
                info["midx_config"],
                metadata=summary.create_metadata(),
                model_name=summary.model_name,
                base_model=kwargs.get("finetuned_from"),
                hyperparameters=summary.hyperparameters,
                eval_table=make_markdown_table(summary.eval_lines),
                log_history=self.state.log_history,
                num_classes=info["vocab_size"],
                dataset_name=kwargs.get("dataset"),
                eval_results=info["eval_results"],
                throughput={},  # one figure, in the recipe's section (tokens/s without the evaluations)
            )

    class FullSoftmaxTrainer(RecipeCard, PerplexityMixin, Trainer):
        """The baseline: the plain Trainer, plus ``<prefix>_perplexity`` in evaluation metrics."""

    class TokenCounter(TrainerCallback):
        """Time and tokens of the training, the earlier sessions of a resumed run included; progress lines.

        It records the tokens seen when training starts (after a resumed state is loaded) and the seconds that
        evaluations took during ``train()`` (they count in the Trainer's ``train_runtime``). Every checkpoint gets
        ``recipe_time.json`` (the training seconds so far), which a resume reads back, so ``results.json`` gives
        the whole run's time. With ``quiet_progress`` (no progress bar: stderr is not a terminal) it logs a
        progress line at the first step and then every :data:`PROGRESS_SECONDS`.
        """

        def __init__(self, resume: str | None = None, quiet_progress: bool = False):
            self.resume, self.quiet_progress = resume, quiet_progress
            self.start_tokens, self.eval_seconds, self.training = 0, 0.0, False
            self.earlier = _read_time(resume)  # {"train_runtime_s", "eval_during_training_s"} of earlier sessions
            self.began = self.last_line = time.perf_counter()
            self.start_step = 0

        def on_train_begin(self, args, state, control, **kwargs):
            self.start_tokens, self.eval_seconds, self.training = state.num_input_tokens_seen, 0.0, True
            self.began, self.start_step = time.perf_counter(), state.global_step
            self.last_line = self.began - PROGRESS_SECONDS  # the first step logs a line
            if self.resume is not None and state.is_world_process_zero:
                logger.info(
                    "resuming from %s (step %d of %d)", os.path.basename(self.resume), state.global_step, state.max_steps
                )

        def on_train_end(self, args, state, control, **kwargs):
            self.training = False

        def on_evaluate(self, args, state, control, metrics=None, **kwargs):
            if self.training and metrics:
                self.eval_seconds += sum(v for k, v in metrics.items() if k.endswith("_runtime"))

        def on_step_end(self, args, state, control, **kwargs):
            now = time.perf_counter()
            if not self.quiet_progress or not state.is_world_process_zero or now - self.last_line < PROGRESS_SECONDS:
                return
            self.last_line = now
            done = state.global_step - self.start_step
            left = (now - self.began) / done * (state.max_steps - state.global_step) if done else float("nan")
            logger.info(
                "step %d of %d (%.0f%%), %s elapsed, about %s left",
                state.global_step,
                state.max_steps,
                100 * state.global_step / max(state.max_steps, 1),
                _duration(now - self.began),
                _duration(left),
            )

        def on_save(self, args, state, control, **kwargs):
            folder = os.path.join(args.output_dir, f"checkpoint-{state.global_step}")
            if state.is_world_process_zero and os.path.isdir(folder):
                _write_json_atomic(os.path.join(folder, TIME_NAME), self.totals())

        def totals(self) -> dict[str, float]:
            """Training and in-training evaluation seconds of the whole run so far (earlier sessions included)."""
            return {
                "train_runtime_s": self.earlier["train_runtime_s"] + time.perf_counter() - self.began,
                "eval_during_training_s": self.earlier["eval_during_training_s"] + self.eval_seconds,
            }

    class LogLines(TrainerCallback):
        """The Trainer's log entries as lines on stderr, where the recipe logs (transformers' PrinterCallback
        prints them to stdout)."""

        def on_log(self, args, state, control, logs=None, **kwargs):
            if state.is_world_process_zero and logs:
                shown = {k: (f"{v:.4g}" if isinstance(v, float) else v) for k, v in logs.items() if k != "total_flos"}
                logger.info("%s", shown)

    return RecipeMidxTrainer, FullSoftmaxTrainer, TokenCounter, LogLines


#: With no progress bar (stderr not a terminal: tee, nohup, CI), a progress line at least this often, in seconds.
PROGRESS_SECONDS = 20.0
#: Written into every checkpoint-N: the training seconds so far, for results.json after a resume.
TIME_NAME = "recipe_time.json"


def _read_time(checkpoint: str | None) -> dict[str, float]:
    totals = {"train_runtime_s": 0.0, "eval_during_training_s": 0.0}
    path = None if checkpoint is None else os.path.join(checkpoint, TIME_NAME)
    if path is not None and os.path.isfile(path):
        with open(path, encoding="utf-8") as f:
            saved = json.load(f)
        totals.update({k: float(saved[k]) for k in totals if k in saved})
    return totals


def _duration(seconds: float) -> str:
    if not math.isfinite(seconds):
        return "?"
    seconds = int(round(seconds))
    return f"{seconds // 3600}h{seconds // 60 % 60:02d}m" if seconds >= 3600 else f"{seconds // 60}m{seconds % 60:02d}s"


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
    overwrite: bool = False,
) -> dict[str, Any]:
    """Build, train, evaluate, save and (optionally) push; returns what ``results.json`` holds.

    ``argv`` (default ``sys.argv[1:]``) is quoted in the model card as the command that made the model.
    ``overwrite`` (``--overwrite_output_dir``, without ``resume``): the earlier run's ``checkpoint-*`` folders
    go when training starts, so that none is taken for this run's (``--resume_from_checkpoint last``, the
    Trainer's rotation of old checkpoints).

    Raises RecipeError for problems found before the Trainer exists (model config, head wrapping);
    anything later propagates with its traceback, and no ``results.json`` is written.
    """
    from transformers import set_seed

    from hf_midx import MidxLMHead

    MidxTrainer, FullSoftmaxTrainer, TokenCounter, LogLines = _trainer_classes()
    set_seed(training_args.seed)
    if midx_config is not None and training_args.n_gpu > 1:
        raise RecipeError(
            f"this single process sees {training_args.n_gpu} GPUs, and the Trainer would use torch.nn.DataParallel, which "
            "the MIDX head does not support; launch one process per GPU with `accelerate launch --multi_gpu "
            f"--num_processes {training_args.n_gpu} ...`, or use one GPU (CUDA_VISIBLE_DEVICES=0)."
        )
    model = build_model(model_args, data, seq_len)
    positions = getattr(model.config, "n_positions", None) or getattr(model.config, "max_position_embeddings", None)
    if data.tokenizer is not None and positions and data.tokenizer.model_max_length > positions:
        data.tokenizer.model_max_length = positions  # saved with it: pipelines truncate prompts to what fits
    if midx_config is not None:
        # exact_head above V/8 is lowered: the head, its saved midx_config.json and the card get the value in use.
        midx_config = midx_config.for_vocabulary(data.vocab_size)
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

    # Everything is checked; from here on the output directory is written. A run stopped before its first
    # checkpoint removes it again if this run made it (see _interrupted).
    out_existed = os.path.isdir(training_args.output_dir)
    results_path = os.path.join(training_args.output_dir, RESULTS_NAME)
    if training_args.process_index == 0 and os.path.exists(results_path):
        # Only with --overwrite_output_dir or --resume_from_checkpoint (check_output_and_resume refuses
        # otherwise): this run replaces it, and a failure must not leave the old one claiming success.
        os.remove(results_path)
    if training_args.process_index == 0 and overwrite and resume is None:
        _remove_checkpoints(training_args.output_dir)
    counter = TokenCounter(resume, quiet_progress=training_args.disable_tqdm)
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
    if training_args.disable_tqdm:  # the log entries on stderr with the recipe's lines, not on stdout
        from transformers.trainer_callback import PrinterCallback

        trainer.remove_callback(PrinterCallback)
        trainer.add_callback(LogLines())
    try:
        train_output = trainer.train(resume_from_checkpoint=resume)
        metrics = train_output.metrics
        valid = _split_metrics(trainer, data.valid, "eval")
        test = _split_metrics(trainer, data.test, "test") if data.test is not None else None
        trainer.save_model()
        trainer.save_state()
    except KeyboardInterrupt as err:  # Ctrl-C, or SIGTERM (see run)
        raise _interrupted(err, training_args, out_existed) from None

    runtime = float(metrics.get("train_runtime", float("nan")))
    train_seconds = runtime - counter.eval_seconds  # without the evaluations during training
    totals = counter.totals()
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
        # The whole run's, earlier sessions of a resumed run included; tokens_per_second is this session's.
        "train_runtime_s": totals["train_runtime_s"] if resume else runtime,
        "eval_during_training_s": totals["eval_during_training_s"],
        "resumed_from": None if resume is None else os.path.basename(os.path.normpath(resume)),
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
    trainer.recipe_card = {
        "midx_config": midx_config,
        "vocab_size": data.vocab_size,
        "eval_results": eval_results(results, data.card),
        "section": results_markdown(results, sys.argv[1:] if argv is None else argv, dataset=data.card.get("dataset")),
    }
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
            results["train_runtime_s"],
            results["wall_time_s"],
            results_path,
        )
    if training_args.push_to_hub:
        trainer.push_to_hub(**card)
    return results


def _checkpoints(output_dir: str) -> list[tuple[int, str]]:
    """(step, path) of the ``checkpoint-N`` folders of ``output_dir``, newest first."""
    from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR

    if not os.path.isdir(output_dir):
        return []
    found = []
    for name in os.listdir(output_dir):
        prefix, _, step = name.partition("-")
        path = os.path.join(output_dir, name)
        if prefix == PREFIX_CHECKPOINT_DIR and step.isdigit() and os.path.isdir(path):
            found.append((int(step), path))
    return sorted(found, reverse=True)


def _remove_checkpoints(output_dir: str) -> None:
    import shutil

    for _, path in _checkpoints(output_dir):
        shutil.rmtree(path)


def last_complete_checkpoint(output_dir: str) -> str | None:
    """The newest ``checkpoint-N`` folder of ``output_dir`` that holds ``trainer_state.json`` (the Trainer writes
    it last), or None: a checkpoint interrupted while being written is skipped."""
    for _, path in _checkpoints(output_dir):
        if os.path.isfile(os.path.join(path, "trainer_state.json")):
            return path
    return None


class Terminated(KeyboardInterrupt):
    """SIGTERM (``kill``, a scheduler's stop): handled as Ctrl-C is, with the exit status 143 of SIGTERM."""


def _interrupted(err: KeyboardInterrupt, training_args, out_existed: bool) -> Interrupted:
    """The Interrupted error for a run stopped by Ctrl-C or SIGTERM; removes what a run without a checkpoint wrote.

    With no complete checkpoint there is nothing to resume, so the output folder goes if this run created it
    (an existing folder is left as it is: it may hold the user's files).
    """
    import shutil

    out = training_args.output_dir
    how = "terminated (SIGTERM)" if isinstance(err, Terminated) else "interrupted"
    last = last_complete_checkpoint(out)
    if last is None:
        if training_args.process_index == 0 and not out_existed and os.path.isdir(out):
            shutil.rmtree(out, ignore_errors=True)
            return Interrupted(f"{how} before the first checkpoint; {out!r} is removed.", err)
        return Interrupted(f"{how}; no checkpoint was saved in {out!r} yet, so there is nothing to resume.", err)
    return Interrupted(
        f"{how}; the last checkpoint is {last!r}: continue with the same command plus --resume_from_checkpoint last.",
        err,
    )


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


# ---------------------------------------------------------------------- entry point
def run(main: Callable[[Sequence[str] | None], Any], argv: Sequence[str] | None = None) -> None:
    """Run a recipe's ``main``; a RecipeError or DataError becomes one line on stderr and exit status 2.

    Ctrl-C becomes one line too, naming the last checkpoint (exit status 130, the shell's for SIGINT), and
    so does SIGTERM (status 143). In a multi-process launch only the first process prints the line; every
    process exits with the status.
    """
    import signal

    def terminate(signum, frame):
        raise Terminated()

    import threading

    in_main = threading.current_thread() is threading.main_thread()  # only the main thread may set handlers
    previous = signal.signal(signal.SIGTERM, terminate) if in_main else None
    try:
        main(argv)
    except (RecipeError, DataError) as err:
        _say("error: " + str(err))
        sys.exit(2)
    except Interrupted as err:
        _say(str(err.args[0]))
        sys.exit(143 if isinstance(err.args[-1], Terminated) else 130)
    except Terminated:  # outside training (loading data)
        _say("terminated (SIGTERM).")
        sys.exit(143)
    except KeyboardInterrupt:  # outside training (loading data)
        _say("interrupted.")
        sys.exit(130)
    finally:
        if in_main:
            signal.signal(signal.SIGTERM, signal.SIG_DFL if previous is None else previous)
        end_process_group()


def end_process_group() -> None:
    """Destroy this process's process group, if one is up, while the interpreter is still whole.

    Left to interpreter exit, the objects of a finished multi-process run (trainer, model, DDP reducer, the
    group itself) are freed during finalization, where gloo's worker threads can drop tensors that need the
    GIL and abort the process (SIGABRT, "terminate called without an active exception") after its results
    were written; seen on CPU runs under torchrun and accelerate launch.
    """
    import gc

    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
    gc.collect()


def _say(message: str) -> None:
    if int(os.environ.get("RANK", "0")) == 0:
        prog = os.path.basename(sys.argv[0]) or "recipe"
        print(f"{prog}: {' '.join(message.split())}", file=sys.stderr, flush=True)
