"""The recipes' command line: flags, ``--help``, defaults, logging, and the checks made before anything is written.

A recipe parses its dataclasses plus a :func:`midx_arguments` class, :class:`OutputArguments` and
``TrainingArguments`` with :func:`parse_arguments`, turns the MIDX flags into a :class:`hf_midx.MidxConfig`
with :func:`midx_config_from`, and checks ``--output_dir`` / ``--resume_from_checkpoint``, ``--push_to_hub``
and ``--report_to`` before it reads any data. Every problem is a :class:`RecipeError` with a one-line
message (``lm_recipe.run`` prints it and exits with status 2).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import re
import sys
import typing
import warnings
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

#: ``--sampler full`` trains without sampling (the plain Trainer and full softmax): the baseline.
FULL = "full"

#: The file a finished run writes last (see ``lm_recipe.train_and_report``).
RESULTS_NAME = "results.json"


#: The oldest transformers the recipes run on (the library's own bound is lower: hf_midx.version.MINIMUM_VERSIONS).
RECIPES_TRANSFORMERS = "5.0"


class RecipeError(Exception):
    """A problem with the user's input; reported as one line on stderr (no traceback), exit status 2."""


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
        if _auto_or_int(kind):
            kind, default = str, str(default)  # "auto" or a number, made an int by midx_config_from
        elif kind is dict or typing.get_origin(kind) is dict:
            kind, default = str, json.dumps(default)
            help_text += " Given as JSON, e.g. '{\"rff_temperature\": 2.0}'."
        if f.name == "sampler":
            help_text += f" Or '{FULL}': no sampling, the plain Trainer with the full softmax (the baseline)."
        specs.append((f.name, kind, field(default=default, metadata={"help": help_text})))
    cls = dataclasses.make_dataclass("MidxArguments", specs)
    cls.__doc__ = "MIDX options (hf_midx.MidxConfig's fields), or --sampler full for the full-softmax baseline."
    return cls


def _auto_or_int(kind) -> bool:
    """A ``MidxConfig`` field typed ``int | str``: ``"auto"`` or a number (``refresh_every_steps``, ``exact_head``)."""
    return set(typing.get_args(kind)) == {int, str}


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
    for name, kind in hints.items():
        if name in values and _auto_or_int(kind) and isinstance(values[name], str) and values[name] != "auto":
            try:
                values[name] = int(values[name])
            except ValueError:
                raise RecipeError(f"--{name} must be 'auto' or an integer, got {values[name]!r}.") from None
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
    "max_steps": "Optimizer steps to train; -1: train --num_train_epochs instead (other values < 1 are refused).",
    "learning_rate": "Peak learning rate of AdamW.",
    "per_device_train_batch_size": "Blocks per batch and process.",
    "eval_strategy": "When to evaluate on the validation blocks.",
    "save_strategy": "When to save a checkpoint-N folder ('best': when --metric_for_best_model improves).",
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
        """Keeps every action it adds in ``recipe_actions`` (argparse has no public list of its actions).

        argparse %-formats help strings (for %(default)s): a literal percent sign in any dataclass's help text
        ("100%") would break --help unless doubled, so one is doubled as the argument is added; one already
        doubled or starting %(...) is kept.
        """

        def add_argument(self, *args, **kwargs):
            return self.keep_action(super().add_argument, args, kwargs)

        def add_argument_group(self, *args, **kwargs):
            # HfArgumentParser adds the fields of a dataclass with _argument_group_name to a group.
            group = super().add_argument_group(*args, **kwargs)
            add_to_group = group.add_argument
            group.add_argument = lambda *a, **k: self.keep_action(add_to_group, a, k)
            return group

        def keep_action(self, add, args, kwargs):
            if isinstance(kwargs.get("help"), str):
                kwargs["help"] = re.sub(r"(?<!%)%(?![(%])", "%%", kwargs["help"])
            action = add(*args, **kwargs)
            if not hasattr(self, "recipe_actions"):  # argparse adds --help before a subclass's __init__ could run
                self.recipe_actions = []
            self.recipe_actions.append(action)
            return action

        def error(self, message):  # argparse's hook for bad command lines
            raise RecipeError(message)

    class Formatter(argparse.RawDescriptionHelpFormatter):
        """The description's example lines as written; the defaults are added by :func:`_state_defaults`."""

    # allow_abbrev=False: "--num_sample 5" is an error, not "--num_samples 5" taken silently.
    parser = OneLineParser(dataclass_types, description=description, formatter_class=Formatter, allow_abbrev=False)
    return parser


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
    for action in parser.recipe_actions:
        negated = action.option_strings[0][len("--no_") :] if action.option_strings[0].startswith("--no_") else None
        if negated and action.help is not argparse.SUPPRESS:
            action.help = f"Turn --{negated} off."
    training = {f.name for f in dataclasses.fields(TrainingArguments)}
    named = []
    for action in parser.recipe_actions:
        if action.dest in MAIN_TRAINING_FLAGS:
            action.help = MAIN_TRAINING_FLAGS[action.dest]
        elif action.dest in training:
            if action.help is not argparse.SUPPRESS and action.option_strings[0].startswith("--"):
                named.append(action.option_strings[0])
            action.help = argparse.SUPPRESS
    text = "Every other transformers TrainingArguments flag works too (--help_all describes them): "
    parser.epilog = textwrap.fill(text + ", ".join(sorted(set(named))) + ".", width=78)


#: A help text that says its default in its own words ("Default: 20 per query", "'auto' (default): ..."),
#: or asks for it with %(default)s: argparse's "(default: None)" after it would contradict it.
STATES_DEFAULT = re.compile(r"\bDefault\b|\(default\)|%\(default\)")


def _state_defaults(parser) -> None:
    """End every flag's help with ``(default: X)`` (as HfArgumentParser's formatter does), unless its text
    already says its default (:data:`STATES_DEFAULT`): one statement per flag, from the parser's own default."""
    import argparse

    for action in parser.recipe_actions:
        text = action.help
        if not isinstance(text, str) or text is argparse.SUPPRESS or action.default is argparse.SUPPRESS:
            continue
        if action.option_strings and not STATES_DEFAULT.search(text):
            action.help = f"{text} (default: %(default)s)"


def parse_arguments(
    dataclass_types: Sequence[type], training_defaults: dict[str, Any], argv: Sequence[str] | None = None, doc: str = ""
) -> tuple:
    """Parse ``argv`` into instances of ``dataclass_types`` plus ``TrainingArguments`` (last).

    ``training_defaults`` replace TrainingArguments defaults (they show in ``--help``); anything given
    on the command line wins. Raises RecipeError for unknown flags and invalid values.
    """
    import transformers
    from packaging.version import Version
    from transformers import TrainingArguments

    from hf_midx.version import MINIMUM_VERSIONS

    if Version(transformers.__version__) < Version(RECIPES_TRANSFORMERS):
        # 4.x's TrainingArguments has its own --overwrite_output_dir (the recipes' OutputArguments flag collides).
        raise RecipeError(
            f"the recipes need transformers >= {RECIPES_TRANSFORMERS} (installed: {transformers.__version__}; the "
            f"library itself runs on {MINIMUM_VERSIONS['transformers']} and later): pip install -U 'transformers>={RECIPES_TRANSFORMERS}'"
        )
    argv = sys.argv[1:] if argv is None else list(argv)
    parser = _one_line_parser([*dataclass_types, TrainingArguments], description=_description(doc))
    _short_help(parser, argv)
    _state_defaults(parser)
    parser.set_defaults(**training_defaults)
    if launched_without_gpu():
        # A torchrun / accelerate launch of several processes on a machine without a GPU: without use_cpu the
        # Trainer's PartialState finds no GPU backend, so every process trains alone (world size 1).
        parser.set_defaults(use_cpu=True)
    try:
        parsed = tuple(parser.parse_args_into_dataclasses(args=argv))
    except (ValueError, TypeError) as err:
        raise RecipeError(str(err)) from None
    check_max_steps(parsed[-1])
    return parsed


def check_max_steps(training_args) -> None:
    """RecipeError for ``--max_steps`` below 1 other than -1: the Trainer reads every value <= 0 as "train
    --num_train_epochs", so ``--max_steps -5`` would silently train 3 epochs."""
    if training_args.max_steps < 1 and training_args.max_steps != -1:
        raise RecipeError(
            f"--max_steps {training_args.max_steps}: give a number of steps >= 1, or -1 (the default) to train "
            f"--num_train_epochs ({training_args.num_train_epochs:g})."
        )


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


def warn_single_process_launch() -> None:
    """One warning line when ``accelerate launch --num_processes N`` (N > 1) started a single process.

    On a machine without GPUs accelerate starts several processes only with ``--multi_gpu``; without it, it runs
    the script once, with its rendezvous address (MASTER_PORT) set for the processes it was asked for, but no
    WORLD_SIZE: the one sign of the mismatch in the environment (otherwise only results.json's world_size shows it).
    """
    launched_by_accelerate = "ACCELERATE_DYNAMO_BACKEND" in os.environ  # set by every accelerate launch
    if launched_by_accelerate and "MASTER_PORT" in os.environ and "WORLD_SIZE" not in os.environ:
        logging.getLogger("recipes").warning(
            "accelerate launch was asked for several processes but started one (on a machine without GPUs it needs "
            "--multi_gpu: accelerate launch --multi_gpu --num_processes N ...); training in this one process."
        )


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


def checkpoints(output_dir: str) -> list[tuple[int, str]]:
    """(step, path) of the ``checkpoint-N`` folders of ``output_dir``, newest first (complete or not)."""
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


def checkpoint_step(path: str) -> int:
    """N of a ``checkpoint-N`` folder."""
    return int(os.path.basename(os.path.normpath(path)).rpartition("-")[2])


def last_complete_checkpoint(output_dir: str) -> str | None:
    """The newest ``checkpoint-N`` folder of ``output_dir`` that holds ``trainer_state.json`` (the Trainer writes
    it after the weights, optimizer and RNG states), or None: a checkpoint cut short while being saved is skipped."""
    for _, path in checkpoints(output_dir):
        if os.path.isfile(os.path.join(path, "trainer_state.json")):
            return path
    return None


def check_output_and_resume(training_args, overwrite: bool = False) -> str | None:
    """Validate ``--output_dir`` and ``--resume_from_checkpoint``; returns the checkpoint to resume or None.

    ``--resume_from_checkpoint last`` (or ``true``) picks the newest complete ``checkpoint-*`` in output_dir
    (one cut short while being saved, e.g. by a killed process, is passed over with a warning); a folder given
    by path must be a complete checkpoint; either must be below ``--max_steps``. Without a checkpoint to resume
    and without ``overwrite`` (``--overwrite_output_dir``), an output_dir holding a finished run
    (``results.json``) or an unfinished one (``checkpoint-*``) is a RecipeError: the earlier run is left as it is.
    """
    out = training_args.output_dir
    if os.path.exists(out) and not os.path.isdir(out):
        raise RecipeError(f"--output_dir {out!r} is a file; give a directory.")
    resume = training_args.resume_from_checkpoint
    found = checkpoints(out)
    if resume is None or resume == "":
        if not overwrite and os.path.isdir(out):
            if os.path.exists(os.path.join(out, RESULTS_NAME)):
                raise RecipeError(
                    f"--output_dir {out!r} holds a finished run ({RESULTS_NAME}); give another --output_dir, "
                    "--resume_from_checkpoint last with a larger --max_steps to train it on, or --overwrite_output_dir "
                    "to replace it."
                )
            if found:
                raise RecipeError(
                    f"--output_dir {out!r} holds an unfinished run ({os.path.basename(found[0][1])}); pass "
                    "--resume_from_checkpoint last to continue it, --overwrite_output_dir to start over, or another "
                    "--output_dir."
                )
        return None
    if resume.lower() in ("last", "true"):
        last = last_complete_checkpoint(out)
        partial = [os.path.basename(path) for step, path in found if last is None or step > checkpoint_step(last)]
        if last is None:
            why = f" ({', '.join(partial)}: cut short while being saved, no trainer_state.json)" if partial else ""
            raise RecipeError(
                f"--resume_from_checkpoint {resume}: no complete checkpoint-* folder in {out!r} to resume from{why}; "
                "start over with --overwrite_output_dir."
            )
        if partial:
            logging.getLogger("recipes").warning(
                "%s cut short while being saved (no trainer_state.json): resuming from %s instead; the next save "
                "of that step replaces it.",
                ", ".join(partial),
                os.path.basename(last),
            )
        return _check_steps_left(last, training_args)
    if not os.path.isdir(resume):
        raise RecipeError(f"--resume_from_checkpoint {resume!r} is not a checkpoint directory.")
    if os.path.isfile(os.path.join(resume, RESULTS_NAME)):
        raise RecipeError(
            f"--resume_from_checkpoint {resume!r} is a finished run's output folder, not a checkpoint: give one of "
            "its checkpoint-N folders, or --output_dir with --resume_from_checkpoint last."
        )
    if not os.path.isfile(os.path.join(resume, "trainer_state.json")):
        raise RecipeError(
            f"--resume_from_checkpoint {resume!r} has no trainer_state.json: not a complete checkpoint (one cut "
            "short while being saved, or a saved model); give a complete checkpoint-N folder, or last."
        )
    return _check_steps_left(resume, training_args)


def _check_steps_left(checkpoint: str, training_args) -> str:
    """``checkpoint``, or a RecipeError when it is already at ``--max_steps`` (the Trainer would train one more
    step past it)."""
    if training_args.max_steps is None or training_args.max_steps <= 0:
        return checkpoint  # --num_train_epochs: the steps depend on the data
    path = os.path.join(checkpoint, "trainer_state.json")
    try:
        with open(path, encoding="utf-8") as f:
            step = int(json.load(f)["global_step"])
    except (OSError, ValueError, TypeError, KeyError) as err:
        raise RecipeError(f"--resume_from_checkpoint: cannot read the step of {path!r} ({err}).") from None
    if step >= training_args.max_steps:
        raise RecipeError(
            f"nothing to train: {os.path.basename(os.path.normpath(checkpoint))} is at step {step}, --max_steps is "
            f"{training_args.max_steps}; raise --max_steps to train it on."
        )
    return checkpoint


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


def check_model_arguments(model_args) -> None:
    """RecipeError for contradictory model flags (checked before any data is read)."""
    if model_args.model_name_or_path and model_args.config_overrides:
        raise RecipeError(
            "--config_overrides only applies to a model trained from scratch, not with --model_name_or_path."
        )
    check_hub_source(model_args.model_name_or_path, "--model_name_or_path")
