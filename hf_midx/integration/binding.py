"""HostBinding: the routing of each call of a wrapped model (the *host*) to its :class:`~hf_midx.MidxLMHead`.

:func:`hf_midx.wrap` swaps the modules and creates the binding; the binding owns each training step's
hand-off: its forward pre-hook looks at the call's labels, it keeps the head's input, shifts the labels
once and calls :meth:`MidxLMHead.loss` from the host's ``loss_function``, which it replaces on the
instance. :meth:`HostBinding.remove` undoes every change.

Shapes: B batch, S sequence, D hidden dims.
"""

from __future__ import annotations

import inspect
import warnings
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
import transformers
from packaging.version import Version
from torch import nn
from transformers.utils import ModelOutput

from .log_prob_calls import LogProbDecision


#: transformers 4.57 to 5.10.0 count ``num_items_in_batch`` of ``prediction_step`` over the unshifted labels, one
#: token a row more than the causal loss sums (an eval_loss x (S - 1) / S, silently, for every Trainer); 5.10.1
#: counts ``labels[..., 1:]``. On those releases the binding takes the rows' first labels off the count in
#: evaluation (:func:`shifted_eval_count`).
UNSHIFTED_EVAL_COUNT = Version(transformers.__version__) < Version("5.10.1")

_CAUSAL_LM_LOSS_TYPE = "ForCausalLM"


# transformers exports neither its loss registry nor a way to drop a loss function set on one instance: these
# two functions are hf_midx's only contact with those names, and tests/integration/test_head.py checks that both
# still hold.
def _loss_registry() -> dict:
    """transformers' ``LOSS_MAPPING``, loss type -> loss function: the ``loss_function`` property's default reads
    it, and so does the Trainer to decide that a model's loss shifts the labels
    (``LOSS_MAPPING.get(model.loss_type) is ForCausalLMLoss``)."""
    from transformers.loss.loss_utils import LOSS_MAPPING

    return LOSS_MAPPING


def _labels_position(module: nn.Module) -> int | None:
    """Where ``labels`` sits among the positional arguments of ``module.forward``, or None."""
    try:
        params = list(inspect.signature(module.forward).parameters.values())
    except (TypeError, ValueError):
        return None
    positional = [p.name for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    return positional.index("labels") if "labels" in positional else None


def _own_loss_function(host: nn.Module, *, remove: bool = False):
    """The loss function set on this instance (``host.loss_function = f``), or None where the model uses its
    ``loss_type``'s; ``remove=True`` also drops it. The public setter stores it as ``_loss_function``, which
    the ``loss_function`` property returns first; transformers has no public way to delete it."""
    own = host.__dict__.get("_loss_function")
    if remove and own is not None:
        del host.__dict__["_loss_function"]
    return own


@dataclass
class MidxFusedOutput(ModelOutput):
    """What a wrapped model returns for ``model(..., labels=..., fused_lm_head=True)`` in training mode where the
    call is answered by the head: the sampled softmax (a plain NLL), or ``log_probs="exact-forward"`` (then
    ``log_probs``, ``entropy``, ``log_sum_sq_probs``, ``mean_logits`` and ``is_top1`` are exact, as TRL's, and only
    the gradient of the first two is estimated: :meth:`~hf_midx.MidxLMHead.exact_log_probs`).

    The fields of TRL's ``FusedCausalLMOutput`` (``add_fused_lm_head``); below, those of the sampled softmax.
    Per-token fields have the shape of the shifted labels: (B, S - 1), or (B, S) with ``shift_labels``.

    Attributes:
        loss: float32 scalar, the sampled loss (sum over non-ignored tokens / ``num_items_in_batch``,
            or their mean), plus the model's auxiliary loss where it adds one; its value estimates the exact
            cross-entropy, its gradient is the sampled objective's (see ``sampled_softmax_loss``).
        log_probs: float32, each label's log-probability as estimated from the draws (the exact head plus
            the importance-sampled tail), 0 at ignored positions; an estimate, not the exact value.
        entropy: float32, NaN (not available without the full softmax).
        is_top1: float32, NaN (not available without the full softmax).
        log_sum_sq_probs, mean_logits: None.
        label_mask: bool, True where the label is not ignored.
        aux_loss: the model's auxiliary (MoE) loss, or None.
    """

    loss: torch.Tensor | None = None
    log_probs: torch.Tensor | None = None
    entropy: torch.Tensor | None = None
    log_sum_sq_probs: torch.Tensor | None = None
    mean_logits: torch.Tensor | None = None
    is_top1: torch.Tensor | None = None
    label_mask: torch.Tensor | None = None
    aux_loss: torch.Tensor | None = None


class HostBinding:
    """Everything :func:`hf_midx.wrap` changed on the host model, and the routing of each host call to the head
    (the :class:`~hf_midx.MidxLMHead`; the binding needs only its ``loss``, ``exact_only``, ``step_data`` and
    ``training``, so this module does not import it).

    It holds the removable handles of a forward pre-hook and a forward hook on the host, the host's
    own ``loss_function`` (replaced on the instance by :meth:`loss_function`) and ``loss_type``, and
    where ``labels`` sits among the forward's positional arguments; the host's ``resize_token_embeddings`` is
    :meth:`refuse_resize` while wrapped. :meth:`remove` undoes all of it.

    Per host call, the pre-hook looks at the call's ``labels``:

    * no labels, or eval mode outside ``head.exact_loss_only()``: full logits, so ``generate()``,
      pipelines and evaluation behave exactly as before;
    * training mode with labels: the binding keeps the head's input (the head returns a (B, S, 0)
      placeholder), and the host's loss computes :func:`hf_midx.sampled_softmax_loss` with ``ForCausalLMLoss`` label
      semantics. **In training, ``outputs.logits`` is that placeholder**;
    * inside ``head.exact_loss_only()`` with labels: the same, with the exact full-softmax loss;
    * training mode with labels and ``fused_lm_head=True`` (TRL's trainers, after
      ``trl.trainer.utils.add_fused_lm_head``), where the loss is the plain next-token NLL
      (:mod:`hf_midx.integration.log_prob_calls` decides; SFTTrainer): the sampled loss, returned as
      :class:`MidxFusedOutput` (``log_probs`` of the sampled softmax, ``entropy`` / ``is_top1`` NaN);
    * every other ``fused_lm_head=True`` call (DPO, KTO, GRPO, RLOO; any call without gradients; evaluation):
      nothing changes, TRL's own exact, tiled computation over all V classes runs as for the unwrapped model.

    A module that calls the host's ``forward`` directly, bypassing its hooks (peft 0.20's LoRA tuner does:
    ``self.model.forward(...)``; under Axolotl 0.19 the host's hooks then never ran), is given the same two hooks
    (``callers`` of :meth:`attach`); where calls nest (peft 0.21's tuner calls ``self.model(...)``), the outermost
    call is the one handled, the inner hooks stand aside.

    The forward hook (``always_call=True``) ends the call. A Trainer's training call (it passes
    ``num_items_in_batch``) to a head that no :class:`~hf_midx.MidxCallback` schedules warns once.

    The host's ``loss_type`` is set to ``"ForCausalLM"`` where it names no causal-LM loss (GPT-2
    declares none): the binding always shifts the labels, and the Trainer reads ``loss_type`` to count
    ``num_items_in_batch`` over ``labels[..., 1:]``.

    A training call's hand-off has this one owner: the head offers its input to :meth:`capture`, which keeps
    it when the pre-hook has asked for it; the host then calls :meth:`loss_function`, which shifts the
    labels once and calls ``head.loss``; the forward hook forgets what is left.
    """

    def __init__(self, head: nn.Module, host: nn.Module) -> None:
        self.head, self.host = head, host
        self.handles: list[Any] = []
        self.had_loss_function = _own_loss_function(host) is not None
        self.saved_loss_function = host.loss_function
        self.saved_loss_type = getattr(host, "loss_type", None)
        self.labels_position = _labels_position(host)
        self._labels_positions: dict[nn.Module, int | None] = {host: self.labels_position}  # per hooked module
        self._capturing, self._exact = False, False
        self._hidden: torch.Tensor | None = None  # (B, S, D): the head's input in the current call
        self._fused: dict[str, Any] | None = None  # set for a training call with fused_lm_head=True
        self._warned_unhooked = self._warned_unscheduled = self._warned_full_training = False
        self._warned_undecided = self._warned_never_refreshed = False
        self._caller: nn.Module | None = None  # the hooked module whose call is in progress (the outermost)
        #: True after a training call whose output's ``logits`` is the (B, S, 0) placeholder (the sampled loss is
        #: ``loss``), until the next call: ``install``'s ``compute_loss`` then explains an error from reading it.
        self.placeholder_returned = False
        #: How a training run's log-prob calls with gradients are answered, as :class:`~hf_midx.MidxCallback`
        #: decided from the trainer's arguments, set inside that run's steps only; None: undecided (exact, warned).
        self.log_prob_decision: LogProbDecision | None = None

    def attach(self, callers: list[nn.Module] | tuple = ()) -> None:
        """Register the hooks (on the host and on ``callers``, modules that call its ``forward`` directly with the
        host's arguments), replace the host's ``loss_function`` and declare its loss type."""
        host, registry = self.host, _loss_registry()
        self._loss_signature = inspect.signature(registry[_CAUSAL_LM_LOSS_TYPE])  # to bind the host's arguments
        self.handles = []
        self._labels_positions.update({caller: _labels_position(caller) for caller in callers})
        for module in [host, *callers]:
            self.handles += [
                module.register_forward_pre_hook(self.before_forward, with_kwargs=True),
                module.register_forward_hook(self.after_forward, with_kwargs=True, always_call=True),
            ]
        host.loss_function = self.loss_function
        if registry.get(self.saved_loss_type) is not registry[_CAUSAL_LM_LOSS_TYPE]:
            host.loss_type = _CAUSAL_LM_LOSS_TYPE
        # transformers' own resize refuses the head with a TypeError that names no way out: this instance's
        # method says it instead (the class is untouched; remove() deletes it).
        host.resize_token_embeddings = self.refuse_resize
        self.head.binding = self

    def remove(self) -> None:
        """Remove the hooks and give the host back its loss function and loss type."""
        for handle in self.handles:
            handle.remove()
        self.handles, self._caller = [], None
        host = self.host
        if host.loss_function == self.loss_function:  # not replaced since
            if self.had_loss_function:
                host.loss_function = self.saved_loss_function
            else:
                _own_loss_function(host, remove=True)
        if getattr(host, "loss_type", None) == _CAUSAL_LM_LOSS_TYPE:
            host.loss_type = self.saved_loss_type
        if host.__dict__.get("resize_token_embeddings") == self.refuse_resize:
            del host.__dict__["resize_token_embeddings"]
        self.reset()
        self.head.binding = None

    def refuse_resize(self, *args, **kwargs):
        """Installed as the host's ``resize_token_embeddings``: the index and the exact head are built for this
        vocabulary, so a wrapped model is not resized; raises ValueError saying the order that works."""
        raise ValueError(
            f"resize_token_embeddings on a model wrapped by hf_midx.wrap: its MIDX index is built for V = "
            f"{self.head.num_classes}. Call hf_midx.unwrap(model), then model.resize_token_embeddings(...), then "
            "hf_midx.wrap(model, config, class_counts=...) with counts of the new vocabulary size."
        )

    def end_run(self) -> None:
        """Forget what the training run that called this model decided (:attr:`log_prob_decision`, the head's
        ``step_data.scheduled``): a run interrupted in a forward leaves nothing behind for the next one, which
        gets exact log-probs and the warnings of a run without :class:`~hf_midx.MidxCallback` until its own
        callback's next step begins."""
        self.log_prob_decision = None
        self.head.step_data.scheduled = False

    def reset(self) -> None:
        """End the current call: full logits again, nothing kept."""
        self._capturing, self._exact, self._hidden, self._fused = False, False, None, None

    def capture(self, hidden: torch.Tensor) -> bool:
        """Called by the head's forward with its (B, S, D) input: True where this call keeps it (the head
        then returns a (B, S, 0) placeholder), False for full logits."""
        if self._capturing:
            self._hidden = hidden
        return self._capturing

    # ------------------------------------------------------------------ the hooks
    def before_forward(self, module: nn.Module, args: tuple, kwargs: dict):
        if self._caller is not None:  # inside a hooked caller's call: the outer call decides
            return None
        self._caller = module
        head = self.head
        labels = kwargs.get("labels")
        position = self._labels_positions.get(module)
        if labels is None and position is not None and len(args) > position:
            labels = args[position]
        fused = bool(kwargs.get("fused_lm_head"))
        only_shifted = labels is None and fused and kwargs.get("shift_labels") is not None
        if only_shifted:
            # TRL under context parallelism passes pre-shifted labels only; the model computes a loss
            # only when it gets labels, and the loss then uses shift_labels (ForCausalLMLoss semantics).
            labels = kwargs["shift_labels"]
        self.reset()
        self.placeholder_returned = False
        if labels is None and head.training and torch.is_grad_enabled() and not self._warned_full_training:
            self._warned_full_training = True
            warnings.warn(
                "MidxLMHead computed full logits in training mode with gradients: the model was called without "
                "labels, so whatever loss the caller builds from these logits trains the full softmax, not the "
                "sampled one (a Trainer with a compute_loss_func or a label smoother takes the labels away from the "
                "model). Pass labels to the model to train with MIDX: drop compute_loss_func (MidxConfig's "
                "label_smoothing and z_loss are the sampled loss's own).",
                stacklevel=2,
            )
        if labels is None or not (head.exact_only or head.training):
            return None
        route = self._log_prob_route() if fused and not head.exact_only else None
        if route == "exact":
            return None  # TRL's own fused forward: exact log-probs over all V classes, in tiles
        self._capturing, self._exact = True, head.exact_only
        if self._exact:
            return None
        if "num_items_in_batch" in kwargs and not head.step_data.scheduled and not self._warned_unscheduled:
            self._warned_unscheduled = True
            warnings.warn(
                "hf_midx: a Trainer is training a model wrapped by hf_midx.wrap without MidxCallback, so the index "
                "is never refreshed (the sampler keeps the initial weights' proposal), no midx/ diagnostics are "
                "logged and checkpoints hold no sampler state (a resumed run draws other negatives). Fix: "
                "MidxCallback.install(trainer) before trainer.train(), or train with hf_midx.MidxTrainer.",
                UserWarning,
                stacklevel=2,
            )
        head.step_data.calls_since_refresh += 1
        if not head.step_data.scheduled and "num_items_in_batch" not in kwargs:
            self._warn_never_refreshed()
        if fused:
            # TRL asks for its fused output; its fused forward would compute the exact softmax and never
            # call this head. Run the model's own forward (the sampled loss) and convert the output after.
            self._fused = {"route": route}
            kwargs = {k: v for k, v in kwargs.items() if k != "fused_lm_head"}
            if only_shifted:
                kwargs["labels"] = labels
            return args, kwargs
        return None

    def _warn_never_refreshed(self) -> None:
        """Once: a loop of the user's own has trained through more calls than the schedule lets pass without a
        rebuild (``refresh_every_steps``, or ``refresh_min_steps`` under "auto") and nothing rebuilt the index."""
        config, calls = self.head.config, self.head.step_data.calls_since_refresh
        every = config.refresh_every_steps
        limit = config.refresh_min_steps if every == "auto" else int(every)
        if self._warned_never_refreshed or not limit or calls <= limit or self.head.frozen:
            return
        self._warned_never_refreshed = True
        warnings.warn(
            f"hf_midx: {calls} training calls since the MIDX index was last built, and nothing schedules its rebuilds "
            f"(refresh_every_steps={every!r}): the sampler keeps the proposal of old weights, and the loss drifts "
            "from the full softmax's. In a loop of your own, create scheduler = hf_midx.RefreshScheduler(model) and call "
            "scheduler.step() after each optimizer.step() (or hf_midx.refresh_index(model) yourself); with a "
            "Trainer, MidxCallback.install(trainer).",
            UserWarning,
            stacklevel=3,
        )

    def _log_prob_route(self) -> str:
        """How this training call's per-token log-probabilities (``fused_lm_head=True``) are answered (one of
        :data:`~hf_midx.integration.log_prob_calls.ROUTES`): the config's ``log_probs`` where it names one, else
        what the callback read from the trainer's arguments (:attr:`log_prob_decision`). Calls without gradients
        ask for values only (reference, old-policy and metric log-probs): always "exact"."""
        mode = self.head.config.log_probs
        if not torch.is_grad_enabled():
            return "exact"
        if mode in ("exact", "sampled"):
            return mode
        if self.log_prob_decision is None:
            if not self._warned_undecided:
                self._warned_undecided = True
                warnings.warn(
                    "hf_midx: a training call asked for per-token log-probabilities with gradients (fused_lm_head=True, "
                    "as TRL's trainers do) and nothing says its loss is the plain next-token NLL (nor, for "
                    "log_probs='exact-forward', its temperature), so they are exact over all V classes (TRL's tiled "
                    "head), at the unwrapped model's cost. MidxCallback.install(trainer) reads the trainer's arguments "
                    "and keeps the sampled softmax for SFTTrainer's loss_type='nll'; MidxConfig(log_probs='sampled') "
                    "forces it (for a plain NLL only).",
                    UserWarning,
                    stacklevel=3,
                )
            return "exact"
        return self.log_prob_decision.route

    def after_forward(self, module: nn.Module, args: tuple, kwargs: dict, output: Any):
        if module is not self._caller:  # an inner call ends: the outer one is still running
            return None
        self._caller = None
        fused = self._fused
        self.placeholder_returned = self._capturing and not self._exact and fused is None and output is not None
        self.reset()
        if output is None:  # the forward raised (an always_call hook sees no output): the run may be over
            self.end_run()
            return None
        if fused is None:
            return None
        if "per_token" not in fused:
            raise RuntimeError(
                "MidxLMHead: a fused_lm_head=True training call did not reach the sampled loss (the model's loss "
                "was not computed through its loss_function); refusing to return exact log-probabilities."
            )
        mask = fused["mask"]
        fields = fused.get("fields") or {"log_probs": -fused["per_token"]}
        if fused["shifted_here"]:  # TRL's shape: (B, S - 1) when it shifts the labels itself
            fields, mask = {k: v[..., :-1] for k, v in fields.items()}, mask[..., :-1]
        if "entropy" not in fields:  # the sampled softmax has no exact entropy nor top-1
            unavailable = torch.full_like(fields["log_probs"], float("nan"))
            fields = {**fields, "entropy": unavailable, "is_top1": unavailable}
        return MidxFusedOutput(loss=output.loss, label_mask=mask, aux_loss=getattr(output, "aux_loss", None), **fields)

    def loss_function(self, *args, **kwargs) -> torch.Tensor:
        """Installed as the host's ``loss_function``; same call contract as ``ForCausalLMLoss``."""
        head, hidden, self._hidden = self.head, self._hidden, None
        call = self._loss_signature.bind(*args, **kwargs)
        if not head.training and UNSHIFTED_EVAL_COUNT and call.arguments.get("shift_labels") is None:
            if call.arguments.get("num_items_in_batch") is not None:  # counted over the unshifted labels
                call.arguments["num_items_in_batch"] = shifted_eval_count(
                    call.arguments["labels"], call.arguments["num_items_in_batch"],
                    call.arguments.get("ignore_index", -100),
                )
        if hidden is None:
            if head.training and not self._warned_unhooked:
                self._warned_unhooked = True
                warnings.warn(
                    "MidxLMHead: the loss was computed from full logits in training mode: the model's forward "
                    "pre-hook did not see labels (labels passed in an unexpected way, or forward called directly "
                    "instead of model(...)), or the LM head was replaced after wrapping (e.g. by "
                    "resize_token_embeddings: unwrap first, resize, then wrap again).",
                    stacklevel=2,
                )
            return self.saved_loss_function(*call.args, **call.kwargs)
        bound = call.arguments
        ignore_index, num_items = bound.get("ignore_index", -100), bound.get("num_items_in_batch")
        # The label of position t is the token at t + 1 (ForCausalLMLoss semantics), unless given shifted.
        labels, shifted_here = bound.get("shift_labels"), bound.get("shift_labels") is None
        if shifted_here:
            labels = F.pad(bound["labels"], (0, 1), value=ignore_index)[..., 1:]
        if labels.numel() != hidden.numel() // hidden.shape[-1]:
            raise ValueError(
                f"The head saw {hidden.numel() // hidden.shape[-1]} hidden states but the labels give "
                f"{labels.numel()} targets; with labels, call the model with logits_to_keep=0 (all positions) "
                "or pass matching shift_labels."
            )
        if self._fused is None:
            return head.loss(hidden, labels, num_items_in_batch=num_items, ignore_index=ignore_index, exact=self._exact)
        if self._fused["route"] == "exact-forward":
            fields = head.exact_log_probs(hidden, labels, ignore_index=ignore_index,
                                          temperature=self.log_prob_decision.temperature)
            per_token = -fields["log_probs"]
            self._fused["fields"] = fields
        else:
            per_token = head.loss(hidden, labels, ignore_index=ignore_index, reduction="none")
        mask = (labels != ignore_index).to(per_token.device)
        per_token = per_token.reshape(mask.shape)
        self._fused.update(per_token=per_token, mask=mask, shifted_here=shifted_here)
        count = mask.sum().clamp_min(1) if num_items is None else num_items
        return per_token.sum() / (count.to(per_token.device) if torch.is_tensor(count) else count)


def shifted_eval_count(labels: torch.Tensor, num_items: torch.Tensor | int, ignore_index: int) -> torch.Tensor:
    """The count of ``labels[..., 1:]`` that ``num_items``, a Trainer's evaluation count over the unshifted (B, S)
    int64 ``labels`` (:data:`UNSHIFTED_EVAL_COUNT`), stands for: a scalar int64 tensor on the labels' device.

    That count is this process's own, or the sum over the processes (``average_tokens_across_devices``, the
    default, which also multiplies the loss by their number); the unshifted count exceeds the shifted one by the
    rows whose first label is not ignored, so those are taken off, summed over the processes where the count is
    theirs (it differs from this process's): a collective, which every process enters as each evaluates every batch.
    """
    dist = torch.distributed
    first = (labels[..., 0] != ignore_index).sum()
    num_items = torch.as_tensor(num_items, device=labels.device)
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        everyone = first.clone()
        dist.all_reduce(everyone)
        first = torch.where(num_items == (labels != ignore_index).sum(), first, everyone)
    return num_items - first


def uses_causal_lm_loss(host: nn.Module) -> bool:
    """True where ``host`` computes its loss with transformers' ``ForCausalLMLoss`` (through its ``loss_type``)
    or with a loss function set on the instance (kept for eval mode; the binding replaces it in training)."""
    return _own_loss_function(host) is not None or host.loss_function is _loss_registry()[_CAUSAL_LM_LOSS_TYPE]


__all__ = ["HostBinding", "MidxFusedOutput", "shifted_eval_count", "uses_causal_lm_loss"]
