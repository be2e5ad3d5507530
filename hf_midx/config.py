"""MidxConfig: every option of the MIDX head and trainer in one validated dataclass.

The config is plain data: it saves to and loads from ``midx_config.json`` (with the hf-midx version
stamped in), and :meth:`MidxConfig.sampler_kwargs` turns it into the arguments of
:func:`hf_midx.build_sampler`. Sampler names and their option tables come from :mod:`hf_midx.registry`
(each sampler's own ``options`` table says which apply to it, and each sampler checks their values); the
defaults shared with the low-level builders come from :mod:`hf_midx.defaults`. This module repeats none of
them, and imports no sampler, loss or quantizer.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import textwrap
import warnings
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from . import defaults
from ._checks import check_positive_int, is_number
from ._io import atomic_write
from .defaults import ESTIMATORS, KERNEL_MODES, KMEANS_BACKENDS, LAST_STAGES, MIX_STATICS, NEGATIVE_MODES
from .registry import SAMPLERS, check_option_values, check_sampler_options
from .version import __version__

#: File name of a saved config inside a model or checkpoint directory.
CONFIG_NAME = "midx_config.json"
#: The keys of ``midx_config.json`` that are no field: the version stamp, and what the ``"auto"`` fields became
#: in training (:meth:`MidxConfig.save_pretrained`'s ``chosen``). Loading leaves both out without a warning.
_STAMPS = ("hf_midx_version", "chosen")

#: ``exact_head`` is at most V / EXACT_HEAD_FRACTION classes (see :meth:`MidxConfig.for_vocabulary`).
EXACT_HEAD_FRACTION = 8

#: ``num_samples`` when left unset, per ``negatives`` mode: M per token, or the size of the batch's one pool.
DEFAULT_NUM_SAMPLES = {"per-query": 20, "shared": 1024}

#: How the MIDX codebooks are obtained: k-means on the head weight, or learned with the paper's objective.
CODEBOOK_MODES = ("kmeans", "learned")

#: How a training call that asks for per-token log-probabilities (TRL's ``fused_lm_head=True``) is served.
LOG_PROB_MODES = ("auto", "exact", "exact-forward", "sampled")

# Sampler options that are config fields of their own; setting them twice would be ambiguous. Each is
# passed to build_sampler only for the samplers whose option table lists it (ignored by the others).
_OPTIONS_WITH_FIELDS = ("kmeans_iters", "kmeans_backend", "last_stage", "mix_weight", "mix_static")


@dataclass
class MidxConfig:
    """Configuration of MIDX sampled-softmax training (the head, its sampler and the trainer's schedule).

    Every field has a default; :meth:`__post_init__` validates all of them and raises ``ValueError``
    saying what to change. Use :meth:`save_pretrained` / :meth:`from_pretrained` for JSON files.
    """

    sampler: str = field(
        default="midx-rq",
        metadata={
            "help": "Proposal distribution for the negatives: a name in hf_midx.SAMPLERS (midx-rq, midx-pq and "
            "midx-exact are the MIDX samplers; an unknown name is refused with the list)."
        },
    )
    num_samples: int | None = field(
        default=None,
        metadata={
            "help": "Negatives per token (M) with negatives='per-query', or the size of the shared pool (P) "
            "with negatives='shared' (one pool serves the whole batch). Must be smaller than the vocabulary. "
            f"Default: {DEFAULT_NUM_SAMPLES['per-query']} per query (trained better than 100 with the exact head "
            "on WikiText-2 and at V = 100,000, docs/performance.md, and steps faster), a pool of "
            f"{DEFAULT_NUM_SAMPLES['shared']} when shared."
        },
    )
    codebook_size: int = field(
        default=defaults.CODEBOOK_SIZE,
        metadata={"help": "Codewords per codebook (K) of the MIDX samplers; K*K buckets. Ignored by other samplers."},
    )
    negatives: str = field(
        default=defaults.NEGATIVES,
        metadata={
            "help": "'per-query': each token draws its own negatives from Q(.|z_t) (the paper); 'shared': one "
            "pool per batch drawn from the batch mixture, scored with one matmul."
        },
    )
    codebooks: str = field(
        default="kmeans",
        metadata={
            "help": "'kmeans': codebooks from k-means on the head weight at every refresh; 'learned': codebooks "
            "trained with the reconstruction + KL objective (MIDX samplers only)."
        },
    )
    refresh_every_steps: int | str = field(
        default="auto",
        metadata={
            "help": "Rebuild the index every N optimizer steps. 'auto': N from the measured seconds of a rebuild and "
            "a step (rebuilds take refresh_budget of the time; logged). 0: never."
        },
    )
    refresh_budget: float = field(
        default=0.03,
        metadata={"help": "'auto' refresh: the share of training time the rebuilds may take."},
    )
    refresh_min_steps: int = field(
        default=10,
        metadata={"help": "'auto' refresh: the fewest steps between rebuilds, and before the first one."},
    )
    refresh_max_steps: int = field(
        default=1000,
        metadata={
            "help": "'auto' refresh: the most steps between rebuilds (it wins over refresh_budget)."
        },
    )
    refresh_every_epoch: bool = field(
        default=True, metadata={"help": "Rebuild the sampler from the current head weight at the start of every epoch."}
    )
    kmeans_iters: int = field(
        default=defaults.KMEANS_ITERS, metadata={"help": "Lloyd iterations per codebook at every (re)build."}
    )
    kmeans_backend: str = field(
        default=defaults.KMEANS_BACKEND,
        metadata={
            "help": f"K-means implementation: one of {KMEANS_BACKENDS} ('faiss' needs pip install 'hf-midx[faiss]')."
        },
    )
    remove_accidental_hits: bool | None = field(
        default=None,
        metadata={
            "help": "Drop a sampled negative that equals the token's own label. None (default): what keeps the "
            "estimator unbiased: dropped with estimator='exact-positive', kept with 'corrected-positive' (dropping "
            "it there biases the loss toward the labels the proposal draws often)."
        },
    )
    estimator: str = field(
        default=defaults.ESTIMATOR,
        metadata={
            "help": f"How the label's logit enters the sampled softmax; one of {ESTIMATORS}. 'corrected-positive' "
            "(default): one more candidate corrected by its own log q (Jean et al. 2015, TensorFlow); "
            "'exact-positive': as is (the paper's text; its code corrects the label as 'corrected-positive' "
            "does). Without an exact head 'exact-positive' trains markedly worse, and is warned."
        },
    )
    exact_head: int | str = field(
        default="auto",
        metadata={
            "help": "H: the H most frequent classes (by the class_counts given to wrap) are scored exactly for every "
            "token with one (T, H) matmul and excluded from the proposal, which then only estimates the tail's "
            "share of the partition function. 'auto': the fewest holding "
            f"{defaults.EXACT_HEAD_SHARE:.0%} of the tokens, at most {defaults.EXACT_HEAD_MAX} and V/8 (logged). "
            "0: off. At most V/8 (lowered, with a warning). Needs class_counts (else off, with a warning)."
        },
    )
    tail_gradient: str = field(
        default=defaults.TAIL_GRADIENT,
        metadata={
            "help": "'auto' (default): 'expected' where it applies, else 'sampled'. 'expected': every tail class "
            "moves each step by its expected gradient (hf_midx.losses.tail_gradient); 'sampled': only the drawn ones."
        },
    )
    kernels: str = field(
        default=defaults.KERNELS,
        metadata={
            "help": f"How the sampled loss is computed from the draws; one of {KERNEL_MODES}. 'auto': fused Triton "
            "kernels on CUDA with Triton and per-query negatives, eager PyTorch elsewhere. 'fused': "
            "always the kernels (a ValueError where they cannot run); 'eager': always PyTorch. Same loss and "
            "gradients from the same draws, within float rounding. On a GPU the kernels' speed is projected, not "
            "measured (3.9-8.0x faster than the exact loss's FLOP floor, docs/gpu_cost_model.md): 'eager' is the safe "
            "setting there until a GPU has timed them."
        },
    )
    log_probs: str = field(
        default="auto",
        metadata={
            "help": f"Per-token log-probs with gradients that a trainer asks for (TRL's fused_lm_head=True); one of "
            f"{LOG_PROB_MODES}. 'exact': over all V classes (TRL's tiled head, the unwrapped model's values). "
            "'exact-forward': the same values, the gradient estimated from the exact head and the draws (unbiased; "
            "about half the head's time, with MidxCallback). 'sampled': the sampled softmax's estimate, for a plain "
            "next-token NLL only. 'auto': sampled where the trainer's loss_type is 'nll' (SFTTrainer), else exact. "
            "Calls without gradients are always exact."
        },
    )
    z_loss: float = field(
        default=0.0,
        metadata={
            "help": "Weight w >= 0 of the z-loss w (log Z)^2 per token (PaLM; e.g. 1e-4), log Z the sampled loss's own "
            "estimate, with that term's gradient; logged as midx/z_loss. 0: off."
        },
    )
    label_smoothing: float = field(
        default=0.0,
        metadata={
            "help": "eps in [0, 1): the loss (1 - eps) CE + eps (log Z - mean logit), as the Trainer's "
            "label_smoothing_factor (which sets it), the mean logit exact from the weight's column sum; needs no "
            "logit soft-cap. Evaluation stays the plain cross-entropy. 0: off."
        },
    )
    mix_weight: float = field(
        default=defaults.MIX_WEIGHT,
        metadata={
            "help": "Defensive mixture of the MIDX samplers: Q = (1 - a) Q_midx + a Q_static with a = mix_weight in "
            "[0, 1) (0: the paper's MIDX alone); log q is exact (logaddexp). Ignored by other samplers. Without an "
            "exact head it is what covers the softmax; with one it changes little and stays as a guard."
        },
    )
    mix_static: str = field(
        default=defaults.MIX_STATIC,
        metadata={
            "help": f"The static component of the defensive mixture; one of {MIX_STATICS}. 'unigram' needs "
            "class_counts (without them the sampler mixes in nothing, with a warning). Ignored by non-MIDX samplers."
        },
    )
    last_stage: str = field(
        default=defaults.LAST_STAGE,
        metadata={
            "help": f"How midx-rq / midx-pq draw; one of {LAST_STAGES}. 'centered': a bucket by the query minus "
            "the mean query, a class in it by its smoothed count; 'frequency': by the query, then by count; "
            "'uniform' (the paper's): uniformly inside the bucket. The first two need class_counts."
        },
    )
    seed: int = field(default=defaults.SEED, metadata={"help": "Seed of the sampler's generator and of k-means."})
    sampler_options: dict = field(
        default_factory=dict,
        metadata={
            "help": "Extra options of the chosen sampler, by name (hf_midx.samplers.SAMPLER_OPTIONS lists them all; "
            "each sampler's own option table says which it reads, and it checks their values)."
        },
    )
    codebook_learning_rate: float = field(
        default=1e-3, metadata={"help": "Learning rate of the codewords when codebooks='learned'."}
    )
    kl_weight: float = field(
        default=1.0,
        metadata={"help": "Weight of the KL term in the learned-codebook objective (recon + kl_weight * KL)."},
    )
    kl_queries: int = field(
        default=64,
        metadata={
            "help": "Hidden states per step used for the learned-codebook KL and for the logged KL; O(kl_queries * V)."
        },
    )
    log_kl: bool = field(
        default=True,
        metadata={
            "help": "At each logging step, log how well the proposal covers the softmax on kl_queries hidden states: "
            "midx/kl = KL(Q || P), midx/kl_pq = KL(P || Q), midx/ess (effective sample size "
            "as a fraction of the draws), midx/mass_p_over_q_gt_10 and, with an exact head, midx/head_mass."
        },
    )

    # ------------------------------------------------------------------ validation
    def __post_init__(self) -> None:
        if not isinstance(self.sampler, str) or self.sampler not in SAMPLERS:
            raise ValueError(f"Unknown sampler {self.sampler!r}; choose one of: {', '.join(sorted(SAMPLERS))}.")
        if self.tail_gradient not in defaults.TAIL_GRADIENTS:
            raise ValueError(f"tail_gradient must be one of {defaults.TAIL_GRADIENTS}, got {self.tail_gradient!r}.")
        drops = self.remove_accidental_hits
        drops = self.estimator == "exact-positive" if drops is None else drops
        if self.tail_gradient == "expected" and (
            self.negatives == "shared" or drops or not SAMPLERS[self.sampler].has_closed_form()
        ):
            raise ValueError(
                "tail_gradient='expected' needs negatives='per-query', the draws' accidental hits kept "
                "(remove_accidental_hits=False, or the default estimator 'corrected-positive') and a sampler with a "
                f"closed form; got negatives={self.negatives!r}, estimator={self.estimator!r}, remove_accidental_hits="
                f"{self.remove_accidental_hits!r}, sampler={self.sampler!r}. 'auto' takes it only where it applies."
            )
        if self.negatives not in NEGATIVE_MODES:
            raise ValueError(f"negatives must be one of {NEGATIVE_MODES}, got {self.negatives!r}.")
        if self.num_samples is None:
            self.num_samples = DEFAULT_NUM_SAMPLES[self.negatives]
        self._check_int("num_samples", 1)
        self._check_int("codebook_size", 1)
        if self.codebooks not in CODEBOOK_MODES:
            raise ValueError(f"codebooks must be one of {CODEBOOK_MODES}, got {self.codebooks!r}.")
        if self.codebooks == "learned" and not self.sampler.startswith("midx"):
            midx = sorted(name for name in SAMPLERS if name.startswith("midx"))
            raise ValueError(
                f"codebooks='learned' needs a MIDX sampler ({', '.join(midx)}), but sampler={self.sampler!r} has "
                "no codebooks; use codebooks='kmeans' or pick a MIDX sampler."
            )
        self._check_refresh()
        # The option fields are valid whatever the sampler (a saved config may switch samplers later); each is
        # checked by a sampler that reads it.
        check_option_values({name: getattr(self, name) for name in _OPTIONS_WITH_FIELDS})
        self.mix_weight = float(self.mix_weight)
        if self.remove_accidental_hits is not None and not isinstance(self.remove_accidental_hits, bool):
            raise ValueError(
                f"remove_accidental_hits must be True, False or None (the estimator's choice), "
                f"got {self.remove_accidental_hits!r}."
            )
        self._check_int("seed", 0)
        if not isinstance(self.sampler_options, dict):
            raise ValueError(
                f"sampler_options must be a dict of option name -> value, got {type(self.sampler_options).__name__}."
            )
        doubled = sorted(str(k) for k in self.sampler_options if k in _OPTIONS_WITH_FIELDS)
        if doubled:
            raise ValueError(
                f"Set {', '.join(doubled)} as MidxConfig field(s), not inside sampler_options "
                f"(e.g. MidxConfig({doubled[0]}=...))."
            )
        for key, value in self.sampler_options.items():
            # Saved in midx_config.json: plain, finite values only (a NumPy float32 fails at the first save).
            plain = isinstance(value, (bool, int, float, str))
            if not plain or (isinstance(value, float) and not math.isfinite(value)):
                raise ValueError(
                    f"sampler_options[{key!r}] must be a finite number or a string, got {value!r} "
                    f"({type(value).__name__}); pass a plain Python value, e.g. float(x)."
                )
        check_sampler_options(self.sampler, self.sampler_options)
        self._check_log_probs()
        self._check_estimator()
        if self.kernels not in KERNEL_MODES:
            raise ValueError(
                f"kernels must be one of {KERNEL_MODES}, got {self.kernels!r}; 'auto' takes the fused kernels "
                "where they can run and the eager path elsewhere."
            )
        if self.kernels == "fused" and self.negatives != "per-query":
            raise ValueError(
                f"kernels='fused' computes per-query negatives only, got negatives={self.negatives!r}; use "
                "negatives='per-query', or kernels='auto' (eager for shared negatives)."
            )
        self._check_loss_terms()
        self._check_float("codebook_learning_rate", positive=True)
        self._check_float("kl_weight", positive=False)
        self._check_int("kl_queries", 1)
        self._check_bool("log_kl")

    def _check_loss_terms(self) -> None:
        """z_loss >= 0 and label_smoothing in [0, 1), finite numbers."""
        self._check_float("z_loss", positive=False)
        self._check_float("label_smoothing", positive=False)
        if self.label_smoothing >= 1:
            raise ValueError(
                f"label_smoothing must be in [0, 1) (e.g. 0.1; 0 turns it off), got {self.label_smoothing}."
            )

    def _check_estimator(self) -> None:
        """estimator one of ESTIMATORS, exact_head "auto" or an int >= 0; the paper's text's estimator alone warned."""
        if self.estimator not in ESTIMATORS:
            raise ValueError(f"estimator must be one of {ESTIMATORS}, got {self.estimator!r}.")
        if self.exact_head != "auto":
            self._check_int("exact_head", 0, auto=True)
        if self.estimator == "exact-positive" and self.exact_head == 0:
            # The paper's estimator as its text writes it; its code subtracts log q from the label too, as
            # 'corrected-positive' does. Alone it trained midx-rq to test perplexity 586 against 269 for
            # 'corrected-positive' (WikiText-2, M = 20, K = 32, one epoch, the same rebuilds; issue 73).
            warnings.warn(
                "estimator='exact-positive' with exact_head=0 is the paper's estimator as its text writes it, not "
                "as its code runs it: the label's logit is left uncorrected by its log q, which trains markedly "
                "worse without an exact head. Use the default estimator='corrected-positive' (the paper's code), "
                "or keep an exact head.",
                UserWarning,
                stacklevel=4,  # the caller of MidxConfig(...)
            )

    def _check_log_probs(self) -> None:
        if self.log_probs not in LOG_PROB_MODES:
            raise ValueError(f"log_probs must be one of {LOG_PROB_MODES}, got {self.log_probs!r}.")
        if self.log_probs == "exact-forward" and self.negatives == "shared":
            raise ValueError(
                "log_probs='exact-forward' draws num_samples negatives per token; with negatives='shared' that is "
                f"the pool size ({self.num_samples}). Use negatives='per-query' (M = 20 by default) with it."
            )

    def _check_refresh(self) -> None:
        """The refresh schedule's fields (see :mod:`hf_midx.integration.refresh_schedule`)."""
        if self.refresh_every_steps != "auto":
            self._check_int("refresh_every_steps", 0, auto=True)
        self._check_float("refresh_budget", positive=True)
        if self.refresh_budget >= 1:
            raise ValueError(f"refresh_budget is a share of training time in (0, 1), got {self.refresh_budget!r}.")
        self._check_int("refresh_min_steps", 1)
        self._check_int("refresh_max_steps", self.refresh_min_steps)
        self._check_bool("refresh_every_epoch")

    def _check_int(self, name: str, minimum: int, *, auto: bool = False) -> None:
        value = getattr(self, name)
        if auto and isinstance(value, str):
            raise ValueError(f"{name} must be 'auto' or an integer >= {minimum}, got {value!r}.")
        check_positive_int(name, value, minimum=minimum)

    def _check_bool(self, name: str) -> None:
        value = getattr(self, name)
        if not isinstance(value, bool):
            raise ValueError(f"{name} must be True or False, got {value!r}.")

    def _check_float(self, name: str, *, positive: bool) -> None:
        value = getattr(self, name)
        ok = is_number(value) and value == value and abs(value) != float("inf")
        ok = ok and (value > 0 if positive else value >= 0)
        if not ok:
            raise ValueError(f"{name} must be a finite number {'> 0' if positive else '>= 0'}, got {value!r}.")
        setattr(self, name, float(value))

    # ------------------------------------------------------------------ use
    def sampler_kwargs(self) -> dict[str, Any]:
        """Keyword arguments for ``build_sampler(config.sampler, weight, class_counts=..., **kwargs)``.

        The option fields (``kmeans_iters``, ``mix_weight``, ...) are included only for the samplers
        whose option table lists them; ``exclude`` (the exact head) is the caller's, it needs counts.
        """
        own = SAMPLERS[self.sampler].options
        fields = {name: getattr(self, name) for name in _OPTIONS_WITH_FIELDS if name in own}
        return {"codebook_size": self.codebook_size, "seed": self.seed, **fields, **self.sampler_options}

    def for_vocabulary(self, num_classes: int) -> "MidxConfig":
        """The config as a head of ``num_classes`` (V) classes uses it: ``exact_head`` at most V // 8.

        A larger ``exact_head`` would leave the proposal too few classes to sample from; it is lowered, with
        a warning. The default ``"auto"`` is left to the head, which chooses it within V/8 from the class
        counts (and logs the choice). Returns ``self`` when nothing changes, else a copy: save that one, so
        that ``midx_config.json`` and the model card show the value in use.
        """
        if isinstance(num_classes, bool) or not isinstance(num_classes, int) or num_classes < 1:
            raise ValueError(f"num_classes must be a positive integer, got {num_classes!r}.")
        limit = num_classes // EXACT_HEAD_FRACTION
        if self.exact_head == "auto" or self.exact_head <= limit:
            return self  # "auto" is chosen within V/8 at wrap, from the counts (hf_midx.losses.exact_head)
        warnings.warn(
            f"MidxConfig: exact_head={self.exact_head} is more than V/{EXACT_HEAD_FRACTION} = {limit} for a "
            f"vocabulary of {num_classes}; using exact_head={limit}.",
            UserWarning,
            stacklevel=2,
        )
        return dataclasses.replace(self, exact_head=limit)

    def replace(self, **changes) -> "MidxConfig":
        """A validated copy with some fields changed; raises ValueError naming unknown fields.

        Changing ``negatives`` alone also moves ``num_samples`` from the old mode's default to the new one's
        (20 negatives per token are a poor pool for a whole batch); a value that is not the old mode's
        default is kept.
        """
        unknown = sorted(set(changes) - {f.name for f in dataclasses.fields(self)})
        if unknown:
            raise ValueError(
                f"Unknown MidxConfig field(s) {unknown}; "
                f"known fields: {', '.join(f.name for f in dataclasses.fields(self))}."
            )
        mode = changes.get("negatives", self.negatives)
        if "num_samples" not in changes and mode != self.negatives:
            if self.num_samples == DEFAULT_NUM_SAMPLES.get(self.negatives):
                changes["num_samples"] = None
        return dataclasses.replace(self, **changes)

    # ------------------------------------------------------------------ serialization
    def to_dict(self) -> dict[str, Any]:
        """The fields as a JSON-ready dict (a deep copy)."""
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "MidxConfig":
        """Build a config from a dict; unknown keys are ignored with a warning, the version stamp silently."""
        if not isinstance(data, dict):
            raise ValueError(f"A MidxConfig is built from a dict, got {type(data).__name__}.")
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(str(k) for k in data if k not in names and k not in _STAMPS)
        if unknown:
            warnings.warn(
                f"Ignoring unknown MidxConfig key(s) {unknown} (written by another hf-midx version?).",
                UserWarning,
                stacklevel=2,
            )
        return cls(**{k: v for k, v in data.items() if k in names})

    def save_pretrained(self, save_directory: str | os.PathLike, *, chosen: Mapping[str, int] | None = None) -> str:
        """Write ``save_directory/midx_config.json`` atomically (temporary file, then rename).

        ``chosen``: what ``"auto"`` fields became in training, e.g. ``{"refresh_every_steps": 50}`` (the interval
        the refresh schedule chose last), written under the key ``"chosen"`` for the reader; :meth:`from_dict`
        leaves it out, so that a run from the saved config chooses again on its own machine. Creates the
        directory if needed. Returns the path of the written file.
        """
        save_directory = os.fspath(save_directory)
        if os.path.isfile(save_directory):
            raise ValueError(f"save_pretrained needs a directory, but {save_directory!r} is a file.")
        auto = [f.name for f in dataclasses.fields(self) if getattr(self, f.name) == "auto"]
        wrong = sorted(set(chosen or {}) - set(auto))
        if wrong or not all(is_number(v) and float(v).is_integer() for v in (chosen or {}).values()):
            raise ValueError(f"chosen maps fields set to 'auto' (here {auto}) to the integers training chose for "
                             f"them, got {dict(chosen)!r}.")
        os.makedirs(save_directory, exist_ok=True)
        data = {**self.to_dict(), "hf_midx_version": __version__}
        if chosen:
            data["chosen"] = {name: int(value) for name, value in chosen.items()}

        def write(tmp: str) -> None:
            with open(tmp, "w", encoding="utf-8") as f:
                json.dump(data, f, indent=2, sort_keys=True)
                f.write("\n")

        return atomic_write(os.path.join(save_directory, CONFIG_NAME), write)

    @classmethod
    def from_pretrained(cls, path: str | os.PathLike, **hub_kwargs) -> "MidxConfig":
        """Load a config saved by :meth:`save_pretrained`.

        Args:
            path: a directory holding ``midx_config.json``, the file itself, or a Hub repo id (then
                ``hub_kwargs`` such as ``revision`` go to ``huggingface_hub.hf_hub_download``).
        Raises:
            ValueError: the file is missing, unreadable, not JSON, or holds invalid values.
        """
        path = os.fspath(path)
        if os.path.isdir(path):
            file = os.path.join(path, CONFIG_NAME)
            if not os.path.isfile(file):
                raise ValueError(
                    f"No {CONFIG_NAME} in {path!r}; save one with MidxConfig.save_pretrained({path!r}) "
                    "or pass the directory that holds it."
                )
        elif os.path.isfile(path):
            file = path
        else:
            file = cls._download(path, hub_kwargs)
        try:
            with open(file, encoding="utf-8") as f:
                data = json.load(f)
        except (OSError, UnicodeDecodeError) as err:
            raise ValueError(f"Cannot read {file!r}: {err}.") from err
        except json.JSONDecodeError as err:
            raise ValueError(f"{file!r} is not valid JSON ({err}); write it with MidxConfig.save_pretrained.") from err
        if not isinstance(data, dict):
            raise ValueError(f"{file!r} must hold a JSON object of MidxConfig fields, got {type(data).__name__}.")
        try:
            return cls.from_dict(data)
        except (TypeError, ValueError) as err:
            raise ValueError(f"Invalid MidxConfig in {file!r}: {err}") from err

    @staticmethod
    def _download(repo_id: str, hub_kwargs: dict) -> str:
        try:
            from huggingface_hub import hf_hub_download

            return hf_hub_download(repo_id, CONFIG_NAME, **hub_kwargs)
        except Exception as err:  # not a local path and not downloadable: one clear message
            raise ValueError(
                f"{repo_id!r} is neither a local directory or file nor a Hub repo with {CONFIG_NAME} ({err})."
            ) from err


def _fields_doc(cls) -> str:
    """The "Fields" section of a config dataclass's docstring: each field's name, default and ``help``."""
    lines = ["", "", "    Fields (each with its default):", ""]
    for f in dataclasses.fields(cls):
        default = f.default_factory() if f.default is dataclasses.MISSING else f.default
        text = f"* ``{f.name}`` = ``{default!r}``: {f.metadata['help']}"
        wrapped = textwrap.fill(text, 110, initial_indent="    ", subsequent_indent="      ", break_on_hyphens=False)
        lines.append(wrapped)
    return "\n".join(lines) + "\n"


# Generated from the fields' help, so that help(MidxConfig) cannot drift from the fields.
MidxConfig.__doc__ = MidxConfig.__doc__.rstrip() + _fields_doc(MidxConfig)
