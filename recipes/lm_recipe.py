"""The runner shared by the language-model recipes (``wikitext2.py``, ``large_vocab.py``).

A recipe

1. parses its dataclasses plus :class:`ModelArguments` and ``lm_args``' ``MidxArguments``,
   ``OutputArguments`` and ``TrainingArguments``, and checks them (``lm_args``);
2. prepares its token blocks (:class:`PreparedData`), checking everything it can;
3. calls :func:`train_and_report`, which builds the model, wraps its head with :func:`hf_midx.wrap` (unless
   ``--sampler full``), trains with :class:`hf_midx.MidxTrainer` (or the plain ``Trainer`` for ``full``),
   evaluates the exact full-softmax loss on the validation and test blocks, saves a plain transformers
   model with its tokenizer and model card, writes ``results.json`` and pushes with ``--push_to_hub``.

Nothing is written before step 3 creates the Trainer, so bad input leaves the output directory as it
was. User errors raise ``RecipeError``; :func:`run` prints them as one line on stderr and exits
with status 2. ``results.json`` is the last file written (atomically) and only after a complete run.
An output directory that holds a finished run (``results.json``) or an unfinished one (``checkpoint-*``)
is refused unless ``--overwrite_output_dir`` or ``--resume_from_checkpoint`` says what to do with it;
then the old ``results.json`` (and, overwriting, the old checkpoints) is removed when training starts.
Ctrl-C stops with one line naming the last checkpoint (exit status 130), SIGTERM too (143).
"""

from __future__ import annotations

import json
import logging
import math
import os
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from transformers import Trainer, TrainerCallback

import hf_midx
from hf_midx._io import atomic_write
from hf_midx.integration.model_card import extend_model_card, save_model_card
from hf_midx.integration.state import has_state
from hf_midx.integration.trainer import MidxTrainer, PerplexityMixin

if __package__:  # imported as recipes.lm_recipe (python -m recipes.wikitext2, the tests, the benchmarks)
    from . import lm_args, lm_data, lm_report
else:  # imported by a recipe run as a file: Python put the recipe's folder, this one, first on sys.path
    import lm_args
    import lm_data
    import lm_report

logger = logging.getLogger("recipes")

#: The model of the paper's language-model experiments: a 2-layer, 4-head decoder-only transformer with
#: 200-dimensional embeddings and 1024-wide feed-forward layers, input and output embeddings tied.
PAPER_GPT2 = {"n_embd": 200, "n_layer": 2, "n_head": 4, "n_inner": 1024}

#: Positions of the from-scratch model: GPT-2's 1024, so the exported model generates well past a training block
#: (positions beyond ``seq_len + 1`` are not trained; a prompt plus new tokens must stay within them).
GENERATION_POSITIONS = 1024


class Interrupted(Exception):
    """Ctrl-C (SIGINT) or SIGTERM during a recipe; the message says where the last checkpoint is. Exit status 130
    (SIGINT) or 143 (SIGTERM), as a shell reports a process killed by the signal."""


class Terminated(KeyboardInterrupt):
    """SIGTERM (``kill``, a scheduler's stop): handled as Ctrl-C is, with the exit status 143 of SIGTERM."""


# ---------------------------------------------------------------------- model
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
class PreparedData:
    """What a recipe hands to :func:`train_and_report`.

    Attributes:
        train, valid, test: token blocks (test may be None).
        vocab_size: V, the number of token ids.
        class_counts: (V,) training-token counts (``hf_midx.token_counts``; for the exact head and samplers).
        tokenizer: saved with the model (may be None).
        eos_token_id: for the from-scratch config's bos/eos/pad ids (may be None).
        description: one phrase naming the data (logged and written to results.json).
        card: keyword arguments for the Trainer's model card (dataset names, tags).
        extra: more entries for results.json (e.g. the synthetic corpus' entropy rate).
    """

    train: lm_data.TokenBlocks
    valid: lm_data.TokenBlocks
    test: lm_data.TokenBlocks | None
    vocab_size: int
    class_counts: torch.Tensor
    tokenizer: Any = None
    eos_token_id: int | None = None
    description: str = ""
    card: dict[str, Any] = field(default_factory=dict)
    extra: dict[str, Any] = field(default_factory=dict)


def check_blocks(name: str, blocks: lm_data.TokenBlocks, num_tokens: int) -> None:
    """RecipeError when a split yields no block of ``seq_len + 1`` tokens."""
    if len(blocks) == 0:
        raise lm_args.RecipeError(
            f"the {name} split has {num_tokens} token(s), fewer than the {blocks.seq_len + 1} (--seq_len + 1) of one "
            "block; give more text or a smaller --seq_len."
        )


def build_model(model_args: ModelArguments, data: PreparedData, seq_len: int):
    """The causal LM to train (see :class:`ModelArguments`); its vocabulary covers ``data.vocab_size``."""
    from transformers import AutoModelForCausalLM, GPT2Config

    block_len = seq_len + 1
    lm_args.check_model_arguments(model_args)
    if model_args.model_name_or_path:
        try:
            model = AutoModelForCausalLM.from_pretrained(model_args.model_name_or_path)
        except (OSError, ValueError) as err:
            raise lm_args.RecipeError(
                f"cannot load --model_name_or_path {model_args.model_name_or_path!r}: {err}"
            ) from None
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
                raise lm_args.RecipeError(f"--config_overrides {model_args.config_overrides!r}: {err}") from None
            if config.vocab_size < data.vocab_size:
                raise lm_args.RecipeError(
                    f"--config_overrides sets vocab_size={config.vocab_size}, below the data's {data.vocab_size}."
                )
        try:
            model = AutoModelForCausalLM.from_config(config)
        except (ValueError, TypeError) as err:
            raise lm_args.RecipeError(f"cannot build the model from its config: {err}") from None
    if getattr(model, "loss_type", None) is None:
        # transformers derives loss_type from the class name, and "GPT2LMHeadModel" matches none, so the
        # Trainer would count num_items_in_batch over the unshifted labels and report eval_loss * seq_len /
        # (seq_len + 1). hf_midx.wrap says so for a wrapped model; the full-softmax baseline needs it here.
        model.loss_type = "ForCausalLM"
    positions = getattr(model.config, "n_positions", None) or getattr(model.config, "max_position_embeddings", None)
    if positions is not None and positions < block_len:
        raise lm_args.RecipeError(
            f"the model has {positions} positions but blocks need {block_len} (--seq_len + 1); lower --seq_len."
        )
    return model


# ---------------------------------------------------------------------- training
class FullSoftmaxTrainer(PerplexityMixin, Trainer):
    """The baseline: the plain Trainer, plus ``<prefix>_perplexity`` in evaluation metrics.

    Its card is transformers' with what ``model_card_extras`` holds (``eval_results``, ``sections``), as
    :class:`hf_midx.MidxTrainer` adds them to the MIDX card, so that both runs report alike.
    """

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.model_card_extras: dict[str, Any] = {}

    def create_model_card(self, **kwargs):
        config = self.model.config
        name = config.name_or_path or ""
        if not name:
            # transformers takes a name_or_path that is not a directory ("" for a model built from a config)
            # for the base model and writes "fine-tuned version of []"; a directory makes it "trained from scratch".
            config.name_or_path = self.args.output_dir
        try:
            super().create_model_card(**kwargs)
        finally:
            config.name_or_path = name
        if self.is_world_process_zero() and self.model_card_extras:
            from huggingface_hub import ModelCard

            card = ModelCard.load(os.path.join(self.args.output_dir, "README.md"))
            save_model_card(extend_model_card(card, **self.model_card_extras), self.args.output_dir)


#: With no progress bar (stderr not a terminal: tee, nohup, CI), a progress line at least this often, in seconds.
PROGRESS_SECONDS = 20.0
#: Written into every checkpoint-N: the training seconds so far and the steps where the run's sessions began,
#: for results.json after a resume.
TIME_NAME = "recipe_time.json"


class TrainingClock(TrainerCallback):
    """The run's training time, tokens/s and ``train_loss``, earlier sessions of a resumed run included; progress.

    Tokens/s, defined here once: the tokens trained (``state.num_input_tokens_seen``) over the seconds spent
    training, which are ``train()``'s own less the evaluations during it (checkpoint saves count), over the
    whole run: a resumed run adds the earlier sessions' seconds, which every checkpoint keeps in
    ``recipe_time.json``. The figure replaces ``train_tokens_per_second`` in every training log entry and in
    the end-of-training summary (the Trainer's counts the evaluations and this session only), so the log, the
    recipe's last line and ``results.json`` hold the same number. The summary's ``train_loss`` becomes the whole
    run's too: the mean of the Trainer's per-step loss over the earlier sessions' logged steps
    (``state.log_history``) and this session's steps. The figures of the summary are kept in ``summary``.

    With ``quiet_progress`` (no progress bar: stderr is not a terminal) it logs a progress line at the first
    step and then every :data:`PROGRESS_SECONDS`, and so while an evaluation scores its batches
    (``on_prediction_step``); ``evaluating`` names what the next evaluation scores.
    """

    def __init__(self, resume: str | None = None, quiet_progress: bool = False):
        self.resume, self.quiet_progress = resume, quiet_progress
        self.start_tokens, self.start_step, self.eval_seconds, self.training = 0, 0, 0.0, False
        self.earlier = {"train_runtime_s": 0.0, "eval_during_training_s": 0.0}  # of earlier sessions
        self.earlier_known = True  # False: a checkpoint without recipe_time.json, this session's figures only
        self.session_starts = [0]  # the steps at which the run's sessions began
        self.earlier_loss = (0.0, 0)  # the sum of the logged per-step losses of earlier sessions, and their steps
        path = None if resume is None else os.path.join(resume, TIME_NAME)
        if path is not None and os.path.isfile(path):
            with open(path, encoding="utf-8") as f:
                saved = json.load(f)
            self.earlier.update({k: float(saved[k]) for k in self.earlier if k in saved})
            self.session_starts = [int(step) for step in saved.get("session_starts", [0])]
        elif path is not None:
            self.earlier_known = False
            logger.warning(
                "%s has no %s (saved by another program, or stopped right after the Trainer's files): "
                "results.json's training time and tokens/s will count this session only.",
                os.path.basename(os.path.normpath(resume)),
                TIME_NAME,
            )
        self.began = self.last_line = time.perf_counter()
        self.ended: float | None = None
        self.summary: dict[str, Any] | None = None
        self.evaluating, self.eval_began, self.eval_batches, self.eval_line = "the validation split", None, 0, 0.0

    def on_train_begin(self, args, state, control, **kwargs):
        self.start_tokens, self.eval_seconds, self.training = state.num_input_tokens_seen, 0.0, True
        self.began, self.start_step, self.ended, self.summary = time.perf_counter(), state.global_step, None, None
        self.last_line = self.began - PROGRESS_SECONDS  # the first step logs a line
        if self.start_step not in self.session_starts:
            self.session_starts.append(self.start_step)
        self.earlier_loss = _logged_loss(state.log_history, self.session_starts, self.start_step)
        if self.resume is not None and state.is_world_process_zero:
            step, total = state.global_step, state.max_steps
            logger.info("resuming from %s (step %d of %d)", os.path.basename(self.resume), step, total)

    def on_train_end(self, args, state, control, **kwargs):
        self.training = False  # the final evaluations and saves do not count
        self.ended = self.ended or time.perf_counter()

    def on_evaluate(self, args, state, control, metrics=None, **kwargs):
        self.eval_began = None
        if self.training and metrics:
            self.eval_seconds += sum(v for k, v in metrics.items() if k.endswith("_runtime"))

    def on_predict(self, args, state, control, **kwargs):
        self.eval_began = None

    def on_log(self, args, state, control, logs=None, **kwargs):
        if not self.training or not logs or not ("loss" in logs or "train_loss" in logs):
            return  # an evaluation's entry, or one logged outside train()
        now = time.perf_counter()
        figures = {"train_tokens_per_second": self.tokens_per_second(args, state, now)}
        if "train_loss" in logs:  # the end-of-training summary: the run's figures are fixed here
            self.ended = now
            total, steps = self.earlier_loss
            session_steps = state.global_step - self.start_step
            total, steps = total + float(logs["train_loss"]) * session_steps, steps + session_steps
            figures["train_loss"] = total / steps if steps else None
            self.summary = {**self.totals(), "tokens_per_second": figures["train_tokens_per_second"]}
            self.summary["train_loss"] = figures["train_loss"]
        figures = {k: v for k, v in figures.items() if v is not None}
        # The Trainer appended a copy of this entry to log_history before calling the callbacks.
        entry = state.log_history[-1] if state.log_history else None
        if entry is not None and all(entry.get(k) == logs.get(k) for k in ("loss", "train_loss")):
            entry.update(figures)
        logs.update(figures)

    def tokens_per_second(self, args, state, now: float) -> float | None:
        """The run's tokens/s so far (see the class docstring); None without token counts."""
        if args.include_num_input_tokens_seen == "no":
            return None
        tokens = state.num_input_tokens_seen - (0 if self.earlier_known else self.start_tokens)
        seconds = self.training_seconds(now)
        return tokens / seconds if tokens > 0 and seconds > 0 else None

    def training_seconds(self, now: float) -> float:
        """The seconds spent training so far, without the evaluations during training, earlier sessions included."""
        earlier = self.earlier["train_runtime_s"] - self.earlier["eval_during_training_s"]
        return earlier + (self.ended or now) - self.began - self.eval_seconds

    def on_step_end(self, args, state, control, **kwargs):
        now = time.perf_counter()
        if control.should_evaluate:  # set by the Trainer's flow callback, which runs first
            self.expect_evaluation("the validation split")
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

    def on_epoch_end(self, args, state, control, **kwargs):
        if control.should_evaluate:
            self.expect_evaluation("the validation split")

    def expect_evaluation(self, what: str) -> None:
        """An evaluation of ``what`` (e.g. "the test split") starts now: its progress lines count from here."""
        self.evaluating, self.eval_began, self.eval_batches = what, time.perf_counter(), 0

    def on_prediction_step(self, args, state, control, eval_dataloader=None, **kwargs):
        now = time.perf_counter()
        if self.eval_began is None:  # an evaluation no one announced: timed from its first batch
            self.expect_evaluation(self.evaluating)
        self.eval_batches += 1
        quiet = not self.quiet_progress or not state.is_world_process_zero
        if quiet or (self.eval_batches > 1 and now - self.eval_line < PROGRESS_SECONDS):
            return  # a line at the first batch, then every PROGRESS_SECONDS
        self.eval_line = now
        try:
            total = len(eval_dataloader)
        except TypeError:  # no dataloader, or an iterable one of unknown length
            total = None
        elapsed = now - self.eval_began
        left = elapsed / self.eval_batches * (total - self.eval_batches) if total else float("nan")
        logger.info(
            "evaluating %s: batch %d of %s%s, %s elapsed, about %s left",
            self.evaluating,
            self.eval_batches,
            total or "?",
            f" ({100 * self.eval_batches / total:.0f}%)" if total else "",
            _duration(elapsed),
            _duration(left),
        )

    def on_save(self, args, state, control, **kwargs):
        folder = os.path.join(args.output_dir, f"checkpoint-{state.global_step}")
        if state.is_world_process_zero and os.path.isdir(folder):
            write_json(os.path.join(folder, TIME_NAME), {**self.totals(), "session_starts": self.session_starts})

    def totals(self) -> dict[str, float]:
        """Training and in-training evaluation seconds of the whole run so far (earlier sessions included)."""
        return {
            "train_runtime_s": self.earlier["train_runtime_s"] + (self.ended or time.perf_counter()) - self.began,
            "eval_during_training_s": self.earlier["eval_during_training_s"] + self.eval_seconds,
        }


def _logged_loss(history: Sequence[dict[str, Any]], session_starts: Sequence[int], until: int) -> tuple[float, int]:
    """The sum of the per-step training losses logged up to step ``until``, and the number of steps they cover.

    Each ``loss`` entry of the log history is the mean over the steps since the previous entry or since its
    session began, whichever is later (steps after a session's last entry and before its checkpoint were never
    logged, so they are not covered).
    """
    total, steps, previous = 0.0, 0, 0
    for entry in history:
        step = entry.get("step", 0)
        if "loss" not in entry or step > until:
            continue
        begin = max([previous, *(start for start in session_starts if start < step)])
        total, steps, previous = total + float(entry["loss"]) * (step - begin), steps + step - begin, step
    return total, steps


class LogLines(TrainerCallback):
    """The Trainer's log entries on stderr, where the recipe logs (transformers' PrinterCallback uses stdout).

    Numbers of 1,000 and above show as whole numbers (tokens/s, seconds), others with 4 significant digits.
    """

    def on_log(self, args, state, control, logs=None, **kwargs):
        if state.is_world_process_zero and logs:
            shown = {k: _shown(v) for k, v in logs.items() if k != "total_flos"}
            logger.info("%s", shown)


def _shown(value: Any) -> Any:
    if not isinstance(value, float):
        return value
    return f"{value:.0f}" if math.isfinite(value) and abs(value) >= 1000 else f"{value:.4g}"


def _duration(seconds: float) -> str:
    if not math.isfinite(seconds):
        return "?"
    seconds = int(round(seconds))
    return f"{seconds // 3600}h{seconds // 60 % 60:02d}m" if seconds >= 3600 else f"{seconds // 60}m{seconds % 60:02d}s"


def _split_metrics(trainer, blocks: lm_data.TokenBlocks, prefix: str, clock: TrainingClock) -> dict[str, Any]:
    """Exact full-softmax loss / perplexity of ``blocks``: the Trainer's evaluation, reused if it just ran.

    Every block predicts ``seq_len`` tokens, so the Trainer's per-block average is the per-token average.
    ``clock`` times the evaluation's progress lines.
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
        clock.expect_evaluation("the validation split" if prefix == "eval" else f"the {prefix} split")
        loss = float(trainer.evaluate(eval_dataset=blocks, metric_key_prefix=prefix)[f"{prefix}_loss"])
    ppl = math.exp(loss) if loss < 700 else math.inf
    return {"loss": loss, "perplexity": ppl, "tokens": blocks.num_predicted_tokens}


def write_json(path: str, data: dict[str, Any]) -> None:
    """Write ``data`` as JSON, atomically: a reader never sees half a file (``hf_midx._io.atomic_write``)."""

    def write(tmp: str) -> None:
        with open(tmp, "w", encoding="utf-8") as f:
            json.dump(data, f, indent=2, allow_nan=True)
            f.write("\n")

    atomic_write(path, write)


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

    Raises RecipeError for problems found before anything is written (model config, head wrapping, one process
    on several GPUs, a checkpoint to resume made with another sampler configuration); anything later propagates
    with its traceback, and no ``results.json`` is written.
    """
    from transformers import set_seed
    from transformers.trainer_callback import DefaultFlowCallback, PrinterCallback

    set_seed(training_args.seed)
    model = build_model(model_args, data, seq_len)
    positions = getattr(model.config, "n_positions", None) or getattr(model.config, "max_position_embeddings", None)
    if data.tokenizer is not None and positions and data.tokenizer.model_max_length > positions:
        data.tokenizer.model_max_length = positions  # saved with it: pipelines truncate prompts to what fits
    out_existed = os.path.isdir(training_args.output_dir)
    counter = TrainingClock(resume, quiet_progress=training_args.disable_tqdm)
    kwargs = dict(
        model=model,
        args=training_args,
        train_dataset=data.train,
        eval_dataset=data.valid,
        data_collator=lm_data.collate_blocks,
        processing_class=data.tokenizer,
        callbacks=[counter],
    )
    if midx_config is None:
        if resume is not None and has_state(resume):
            raise lm_args.RecipeError(
                f"--resume_from_checkpoint {resume!r} was trained with a MIDX head: resume it with the same --sampler "
                f"and MIDX flags, or start a new run from its weights with --model_name_or_path {resume}."
            )
        trainer = FullSoftmaxTrainer(**kwargs)
    else:
        # A model with more embedding rows than the data's vocabulary (padded, as many are): those never occur.
        counts = data.class_counts
        rows = model.get_output_embeddings().weight.shape[0]
        if counts is not None and counts.shape[0] < rows:
            counts = torch.cat([counts, counts.new_zeros(rows - counts.shape[0])])
        try:
            hf_midx.wrap(model, midx_config, class_counts=counts)
            trainer = MidxTrainer(**kwargs)  # refuses one process on several GPUs (DataParallel)
        except ValueError as err:
            raise lm_args.RecipeError(f"cannot train with --sampler {midx_config.sampler}: {err}") from None
        if resume is not None:
            try:
                trainer.check_checkpoint(resume)  # before anything is written; train() would find it too late
            except ValueError as err:
                raise lm_args.RecipeError(f"--resume_from_checkpoint: {err}") from None
        # The config in use: an exact_head above V/8 is lowered, and the card and results.json say so.
        midx_config = trainer.midx_config
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
        lm_args.FULL if midx_config is None else f"{midx_config.sampler} (num_samples={midx_config.num_samples}, "
        f"codebook_size={midx_config.codebook_size})",
    )

    # Everything is checked; from here on the output directory is written. A run stopped before its first
    # checkpoint removes it again if this run made it (see _interrupted).
    results_path = os.path.join(training_args.output_dir, lm_args.RESULTS_NAME)
    if training_args.process_index == 0 and os.path.exists(results_path):
        # Only with --overwrite_output_dir or --resume_from_checkpoint (check_output_and_resume refuses
        # otherwise): this run replaces it, and a failure must not leave the old one claiming success.
        os.remove(results_path)
    if training_args.process_index == 0 and overwrite and resume is None:
        _remove_checkpoints(training_args.output_dir)
    # The clock rewrites the log entries' tokens/s and train_loss: the reporting integrations (TensorBoard, ...),
    # which the Trainer puts before the callbacks it is given, go after it so that they report its figures.
    for callback in list(trainer.callback_handler.callbacks):
        if callback is counter:
            break
        if not isinstance(callback, DefaultFlowCallback):
            trainer.add_callback(trainer.pop_callback(callback))
    if training_args.disable_tqdm:  # the log entries on stderr with the recipe's lines, not on stdout
        trainer.remove_callback(PrinterCallback)
        trainer.add_callback(LogLines())
    try:
        trainer.train(resume_from_checkpoint=resume)
        valid = _split_metrics(trainer, data.valid, "eval", counter)
        test = _split_metrics(trainer, data.test, "test", counter) if data.test is not None else None
        trainer.save_model()
        trainer.save_state()
    except KeyboardInterrupt as err:  # Ctrl-C, or SIGTERM (see run)
        raise _interrupted(err, training_args, out_existed) from None

    trainer_summary = counter.summary or {**counter.totals(), "tokens_per_second": None, "train_loss": None}
    tokens = None
    if training_args.include_num_input_tokens_seen != "no":
        tokens = int(trainer.state.num_input_tokens_seen)  # carried in the checkpoint's trainer state
    results = {
        "recipe": recipe,
        "complete": True,
        "sampler": lm_args.FULL if midx_config is None else midx_config.sampler,
        "seed": training_args.seed,
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
        # The whole run's, earlier sessions of a resumed run included (TrainingClock): the mean per-step loss the
        # Trainer logs, and tokens/s over the training time without evaluations, as the log's last entry has them.
        "train_loss": trainer_summary["train_loss"],
        "global_step": trainer.state.global_step,
        "epoch": trainer.state.epoch,
        "train_tokens_seen": tokens,
        "train_runtime_s": trainer_summary["train_runtime_s"],
        "eval_during_training_s": trainer_summary["eval_during_training_s"],
        "resumed_from": None if resume is None else os.path.basename(os.path.normpath(resume)),
        "tokens_per_second": trainer_summary["tokens_per_second"],
        "wall_time_s": time.perf_counter() - started,
        "world_size": training_args.world_size,
        "device": str(training_args.device),
        "bf16": bool(training_args.bf16),
        "versions": hf_midx.versions(),
        **data.extra,
    }
    card = {"model_name": os.path.basename(os.path.normpath(training_args.output_dir)), **data.card}
    if training_args.hub_model_id:
        card["model_name"] = training_args.hub_model_id.split("/")[-1]
    if model_args.model_name_or_path and not os.path.isdir(model_args.model_name_or_path):
        card["finetuned_from"] = model_args.model_name_or_path
    # The card reports the exact results; it holds no path of this machine (see lm_report).
    section = lm_report.results_markdown(results, sys.argv[1:] if argv is None else argv, data.card.get("dataset"))
    trainer.model_card_extras = {"eval_results": lm_report.eval_results(results, data.card), "sections": [section]}
    if midx_config is not None:
        trainer.model_card_extras["throughput"] = {}  # one figure, in the section: tokens/s without the evaluations
    if trainer.is_world_process_zero():
        trainer.create_model_card(**card)
        write_json(results_path, results)
        logger.info(
            "%s done: valid perplexity %.3f%s, %s tokens/s, train %.1f s, wall %.1f s; results in %s",
            recipe,
            results["valid_perplexity"],
            "" if test is None else f", test perplexity {results['test_perplexity']:.3f}",
            "n/a" if results["tokens_per_second"] is None else _shown(results["tokens_per_second"]),  # as logged
            results["train_runtime_s"],
            results["wall_time_s"],
            results_path,
        )
    if training_args.push_to_hub:
        trainer.push_to_hub(**card)
    return results


# ---------------------------------------------------------------------- interruption and exit
def _remove_checkpoints(output_dir: str, newer_than: int = -1, ignore_errors: bool = False) -> None:
    import shutil

    for step, path in lm_args.checkpoints(output_dir):
        if step > newer_than:
            shutil.rmtree(path, ignore_errors=ignore_errors)


def _interrupted(err: KeyboardInterrupt, training_args, out_existed: bool) -> Interrupted:
    """The Interrupted error for a run stopped by Ctrl-C or SIGTERM; removes what a run without a checkpoint wrote.

    With no complete checkpoint there is nothing to resume, so the output folder goes if this run created it
    (an existing folder is left as it is: it may hold the user's files).
    """
    import shutil

    out = training_args.output_dir
    how = "terminated (SIGTERM)" if isinstance(err, Terminated) else "interrupted"
    last = lm_args.last_complete_checkpoint(out)
    if training_args.process_index == 0:  # a checkpoint this stop cut short while being saved
        # Best effort: the stop's own message matters more than a folder another process still writes into.
        _remove_checkpoints(out, -1 if last is None else lm_args.checkpoint_step(last), ignore_errors=True)
    if last is None:
        if training_args.process_index == 0 and not out_existed and os.path.isdir(out):
            shutil.rmtree(out, ignore_errors=True)
            return Interrupted(f"{how} before the first checkpoint; {out!r} is removed.", err)
        return Interrupted(f"{how}; no checkpoint was saved in {out!r} yet, so there is nothing to resume.", err)
    return Interrupted(
        f"{how}; the last checkpoint is {last!r}: continue with the same command plus --resume_from_checkpoint last.",
        err,
    )


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
    except (lm_args.RecipeError, lm_data.DataError) as err:
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

