"""MidxLMHead: the LM-head layer that trains with the MIDX sampled softmax and predicts with the full one.

This module is the layer (its forward, its loss, its sampler); putting it into a model and taking it
out again (wrap / unwrap / verify) is :mod:`hf_midx.wrap`. All state is per instance; no class is patched.

* The head registers the *same* ``weight`` (and ``bias``) ``Parameter`` s as the ``nn.Linear`` it
  replaces, so ``model.state_dict()`` keeps exactly the original keys, tied weights stay tied and
  ``save_pretrained`` writes a plain transformers checkpoint. The original ``nn.Linear`` is kept in
  ``head.linear`` (not a submodule).
* A forward pre-hook on the model that owns the head (the *host*) looks at each call's ``labels``:

  - no labels, or eval mode outside ``exact_loss_only``: full logits, so ``generate()``, pipelines and
    evaluation behave exactly as before;
  - training mode with labels ("sampled" mode): the head stashes its input hidden states and returns
    a zero-width placeholder of shape (B, S, 0), so no (tokens x vocab) tensor is ever built; the
    host's ``loss_function`` (replaced on the instance) computes :func:`hf_midx.sampled_softmax_loss`
    with ``ForCausalLMLoss`` label semantics. **In training, ``outputs.logits`` is that placeholder.**
  - inside ``with head.exact_loss_only():`` with labels ("exact" mode): the same stash and
    placeholder, and the exact :func:`hf_midx.full_softmax_loss` (no full logits materialized).
  - training mode with labels and ``fused_lm_head=True`` (TRL's trainers, after
    ``trl.trainer.utils.add_fused_lm_head``): the sampled loss as above, returned as TRL's fused output
    (:class:`MidxFusedOutput`): ``log_probs`` are the per-token log-probabilities *of the sampled
    softmax* (minus the per-token sampled loss), ``label_mask`` the non-ignored positions, and
    ``entropy`` / ``is_top1`` NaN (unavailable: both need the full softmax). Outside training mode
    TRL's own exact, tiled computation runs unchanged.

  A forward hook (``always_call=True``) switches the head back to full logits after every call.
* Per training call the head keeps, without any device-to-host synchronization, the data the
  callback needs at its next logging step: ``last_queries`` (``kl_queries`` hidden states, for the KL
  and the learned codebooks), the last batch's hidden states and labels (for one exact loss), and the
  first call whose hidden states or loss were not finite.

Shapes: B batch, S sequence, T = B*S tokens, D hidden dims, V classes, k = ``config.kl_queries``.
"""

from __future__ import annotations

import contextlib
import inspect
import logging
import warnings
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from transformers.utils import ModelOutput

from .config import MidxConfig
from .loss import full_softmax_loss, sampled_softmax_loss
from .samplers import Sampler, build_sampler

logger = logging.getLogger(__name__)

_FULL, _SAMPLED, _EXACT = "full", "sampled", "exact"
#: Causes of the first non-finite training call, as :meth:`MidxLMHead.first_nonfinite_call` names them.
NONFINITE_CAUSES = {1: "hidden states (the LM head's input)", 2: "loss"}


def _causal_lm_loss_reference(
    logits, labels, vocab_size=None, num_items_in_batch=None, ignore_index=-100, shift_labels=None, **kwargs
):
    """Signature of transformers' ``ForCausalLMLoss``; used only to bind the host's call arguments."""


_LOSS_SIGNATURE = inspect.signature(_causal_lm_loss_reference)


@dataclass
class MidxFusedOutput(ModelOutput):
    """What a wrapped model returns for ``model(..., labels=..., fused_lm_head=True)`` in training mode.

    The fields of TRL's ``FusedCausalLMOutput`` (``add_fused_lm_head``), from the sampled softmax.
    Per-token fields have the shape of the shifted labels: (B, S - 1), or (B, S) with ``shift_labels``.

    Attributes:
        loss: float32 scalar, the sampled loss (sum over non-ignored tokens / ``num_items_in_batch``,
            or their mean), plus the model's auxiliary loss where it adds one.
        log_probs: float32, log-probability of each label under the sampled softmax (the label and
            the proposal-corrected negatives), 0 at ignored positions; an estimate, not the exact value.
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


class MidxLMHead(nn.Module):
    """An LM head that trains with the MIDX sampled softmax and predicts with the full softmax.

    Build it with :meth:`MidxLMHead.wrap`, not directly.

    Attributes:
        config: the :class:`~hf_midx.MidxConfig` in use.
        sampler: the proposal (:class:`hf_midx.Sampler`), built from the head weight at wrap time.
        linear: the original ``nn.Linear`` (not a submodule); while wrapped its ``weight``/``bias`` are
            None (the head holds them), and :meth:`unwrap` gives them back.
        num_classes: V, the number of output classes (rows of the weight).
        logit_softcap: ``cap`` in ``cap * tanh(logits / cap)`` (Gemma-2's ``final_logit_softcapping``) or None.
        logit_scale: factor the host applies to the logits (Cohere's ``logit_scale``, 1 / Granite's
            ``logits_scaling``); 1.0 for most models.
        last_queries: (min(k, T), D) float32, detached: hidden states of the last sampled call, evenly
            spaced over its non-ignored tokens (repeated when fewer than k; any tokens when none is
            non-ignored); or None. Chosen on the device, without reading the labels back.
        call_counter: 0-dim int64 tensor on the head's device, the number of sampled-loss calls since
            :meth:`clear_step_data` (None before the first); a tensor, so that counting neither syncs
            nor makes ``torch.compile`` recompile at every call. :attr:`sampled_calls` reads it.
    """

    def __init__(
        self,
        linear: nn.Linear,
        config: MidxConfig,
        *,
        class_counts: torch.Tensor | None = None,
        logit_softcap: float | None = None,
        logit_scale: float = 1.0,
    ) -> None:
        super().__init__()
        # The same Parameter objects as the Linear: identical state_dict keys, ties and optimizer state.
        self.weight = linear.weight
        if linear.bias is not None:
            self.bias = linear.bias
        else:
            self.register_parameter("bias", None)
        self.__dict__["linear"] = linear  # kept out of _modules so its keys do not appear twice
        self.__dict__["_host"] = None
        self.config = config
        self.num_classes = int(self.weight.shape[0])
        self.logit_softcap = logit_softcap
        self.logit_scale = float(logit_scale)
        self._class_counts = class_counts
        self._mode = _FULL
        self._exact_depth = 0
        self._hidden: torch.Tensor | None = None
        self._fused: dict[str, Any] | None = None  # set for a training call with fused_lm_head=True
        self._labels_position: int | None = None
        self._saved_loss_function: Any = None
        self._had_loss_function = False
        self._warned_unhooked = False
        self._warned_full_training = False
        self.clear_step_data()
        #: (H,) int64 ids of the exact head (config.exact_head most frequent classes), or None.
        self.exact_ids: torch.Tensor | None = self._exact_head_ids(config, class_counts, self.num_classes)
        self.sampler: Sampler = self._build_sampler(self.weight)
        self._release_linear()  # last: a failed construction leaves the model's Linear as it was

    # ------------------------------------------------------------------ nn.Linear look-alike
    @property
    def in_features(self) -> int:
        return int(self.weight.shape[1])

    @property
    def out_features(self) -> int:
        return int(self.weight.shape[0])

    def extra_repr(self) -> str:
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}, "
            f"sampler={self.config.sampler!r}, num_samples={self.config.num_samples}, "
            f"negatives={self.config.negatives!r}"
        )

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        """Full logits (B, S, V) in "full" mode; in "sampled"/"exact" mode stash ``hidden`` and return (B, S, 0)."""
        if self._mode == _FULL:
            if self.training and torch.is_grad_enabled() and not self._warned_full_training:
                self._warned_full_training = True
                warnings.warn(
                    "MidxLMHead computed full logits in training mode with gradients: the model was called without "
                    "labels, so whatever loss the caller builds from these logits trains the full softmax, not the "
                    "sampled one (e.g. label smoothing or a compute_loss_func). Pass labels to the model to train "
                    "with MIDX.",
                    stacklevel=2,
                )
            if type(self.linear) is nn.Linear:
                # The head's own parameters: under FSDP2 they are the unsharded ones during forward.
                return F.linear(hidden, self.weight, self.bias)
            self._sync_linear()
            try:
                return self.linear(hidden)
            finally:
                self._release_linear()
        self._hidden = hidden
        return hidden.new_zeros((*hidden.shape[:-1], 0))

    def _release_linear(self) -> None:
        # The head holds the parameters; the kept Linear gets them back on unwrap. A second reference
        # would keep the full weight alive where FSDP2 replaces the head's parameters by shards.
        self.linear._parameters["weight"] = None
        if "bias" in self.linear._parameters:
            self.linear._parameters["bias"] = None

    def _sync_linear(self) -> None:
        # If something re-registered the head's parameters (e.g. tie_weights), the Linear follows.
        linear = self.linear
        if linear.weight is not self.weight:
            linear.weight = self.weight
        if linear.bias is not self.bias:
            linear.bias = self.bias

    # ------------------------------------------------------------------ sampler
    @staticmethod
    def _exact_head_ids(config: MidxConfig, class_counts, num_classes: int) -> torch.Tensor | None:
        """The min(config.exact_head, V // 8) most frequent classes, sorted; None when off or without counts (warned)."""
        h = config.exact_head
        if h == 0:
            return None
        if class_counts is None:
            warnings.warn(
                f"MidxLMHead: exact_head={h} needs class_counts (training-token frequencies) to pick the most "
                "frequent classes; without them the exact head is off. Pass class_counts= to wrap.",
                UserWarning,
                stacklevel=4,
            )
            return None
        # At most V/8: a small vocabulary keeps most of its classes in the sampled part (and a default
        # made for V in the tens of thousands still works on a tiny test model).
        h = min(h, num_classes // 8)
        if h == 0:
            return None
        counts = torch.as_tensor(class_counts).double().flatten()
        if counts.shape[0] != num_classes:
            raise ValueError(f"class_counts must have shape ({num_classes},), got {tuple(counts.shape)}.")
        # stable ranking: ties broken by class id, so every rank picks the same head.
        return torch.sort(torch.sort(-counts, stable=True).indices[:h]).values

    def _build_sampler(self, weight: torch.Tensor) -> Sampler:
        exclude = None if self.exact_ids is None else self.exact_ids.to(weight.device)
        return build_sampler(
            self.config.sampler,
            weight.detach(),
            class_counts=self._class_counts,
            exclude=exclude,
            **self.config.sampler_kwargs(),
        )

    @torch.no_grad()
    def refresh(self, weight: torch.Tensor | None = None) -> None:
        """Rebuild the sampler's tables from the current head weight (in place, this process only).

        Use :func:`hf_midx.refresh_index` for a model whose head is sharded or trained by several
        processes: it gathers the weight, rebuilds on rank 0 and broadcasts.

        Args:
            weight: optional full (V, D) weight to use instead of ``self.weight``, e.g. the gathered
                weight when the head is sharded (FSDP / DeepSpeed ZeRO-3).
        """
        w = self.weight if weight is None else weight
        if not isinstance(w, torch.Tensor) or w.dim() != 2 or tuple(w.shape) != (self.num_classes, self.in_features):
            raise ValueError(
                f"refresh needs the full ({self.num_classes}, {self.in_features}) head weight, got "
                f"{tuple(w.shape) if isinstance(w, torch.Tensor) else type(w).__name__}; gather a sharded weight first "
                "(hf_midx.refresh_index(model) does)."
            )
        if hasattr(w, "full_tensor"):
            raise ValueError("refresh got a sharded DTensor weight; hf_midx.refresh_index(model) gathers it.")
        w = w.detach()
        if w.device != self.sampler.device:
            self.sampler = self._build_sampler(w)
        else:
            self.sampler.refresh(w)

    def _sampler_on(self, device: torch.device) -> Sampler:
        if self.sampler.device != device:
            logger.info("MidxLMHead: the head moved to %s; rebuilding the sampler there.", device)
            self.sampler = self._build_sampler(self.weight)
        return self.sampler

    # ------------------------------------------------------------------ modes
    @contextlib.contextmanager
    def exact_loss_only(self):
        """Within this context, calls with labels return the exact full-softmax loss and (B, S, 0) logits.

        For evaluation loops that need the loss but no logits: the (T, V) logits are never
        materialized. Calls without labels still return full logits. Re-entrant.
        """
        self._exact_depth += 1
        try:
            yield self
        finally:
            self._exact_depth -= 1

    @property
    def mode(self) -> str:
        """What the current (or next) call does: "full", "sampled" or "exact"."""
        return self._mode

    def _before_forward(self, module: nn.Module, args: tuple, kwargs: dict):
        labels = kwargs.get("labels")
        if labels is None and self._labels_position is not None and len(args) > self._labels_position:
            labels = args[self._labels_position]
        fused = bool(kwargs.get("fused_lm_head"))
        only_shifted = labels is None and fused and kwargs.get("shift_labels") is not None
        if only_shifted:
            # TRL under context parallelism passes pre-shifted labels only; the model computes a loss
            # only when it gets labels, and the loss then uses shift_labels (ForCausalLMLoss semantics).
            labels = kwargs["shift_labels"]
        if labels is None:
            self._mode = _FULL
        elif self._exact_depth > 0:
            self._mode = _EXACT
        elif self.training:
            self._mode = _SAMPLED
        else:
            self._mode = _FULL
        self._hidden = None
        self._fused = None
        if self._mode == _SAMPLED and fused:
            # TRL asks for its fused output; its fused forward would compute the exact softmax and never
            # call this head. Run the model's own forward (the sampled loss) and convert the output after.
            self._fused = {}
            kwargs = {k: v for k, v in kwargs.items() if k != "fused_lm_head"}
            if only_shifted:
                kwargs["labels"] = labels
            return args, kwargs
        return None

    def _after_forward(self, module: nn.Module, args: tuple, kwargs: dict, output: Any):
        fused = self._fused
        self._reset_call_state()
        if fused is None or output is None:
            return None
        if "per_token" not in fused:
            raise RuntimeError(
                "MidxLMHead: a fused_lm_head=True training call did not reach the sampled loss (the model's loss "
                "was not computed through its loss_function); refusing to return exact log-probabilities."
            )
        per_token, mask = fused["per_token"], fused["mask"]
        log_probs = -per_token
        if fused["shifted_here"]:  # TRL's shape: (B, S - 1) when it shifts the labels itself
            log_probs, mask = log_probs[..., :-1], mask[..., :-1]
        unavailable = torch.full_like(log_probs, float("nan"))
        return MidxFusedOutput(
            loss=output.loss,
            log_probs=log_probs,
            entropy=unavailable,
            is_top1=unavailable,
            label_mask=mask,
            aux_loss=getattr(output, "aux_loss", None),
        )

    def _reset_call_state(self) -> None:
        self._mode = _FULL
        self._hidden = None
        self._fused = None

    # ------------------------------------------------------------------ the loss
    def _loss_function(self, *args, **kwargs) -> torch.Tensor:
        """Installed as the host's ``loss_function``; same call contract as ``ForCausalLMLoss``."""
        hidden, mode = self._hidden, self._mode
        if mode == _FULL or hidden is None:
            if self.training and not self._warned_unhooked:
                self._warned_unhooked = True
                warnings.warn(
                    "MidxLMHead: the loss was computed from full logits in training mode: the model's forward "
                    "pre-hook did not see labels (labels passed in an unexpected way, or forward called directly "
                    "instead of model(...)), or the LM head was replaced after wrapping (e.g. by "
                    "resize_token_embeddings: unwrap first, resize, then wrap again).",
                    stacklevel=2,
                )
            return self._saved_loss_function(*args, **kwargs)
        self._hidden = None
        bound = _LOSS_SIGNATURE.bind(*args, **kwargs).arguments
        labels = bound.get("labels")
        shift_labels = bound.get("shift_labels")
        ignore_index = bound.get("ignore_index", -100)
        num_items = bound.get("num_items_in_batch")
        if self._fused is not None:
            per_token = self.loss_from_hidden(
                hidden, labels, shift_labels=shift_labels, ignore_index=ignore_index, reduction="none"
            )
            target = shift_labels if shift_labels is not None else F.pad(labels, (0, 1), value=ignore_index)[..., 1:]
            mask = (target != ignore_index).to(per_token.device)
            per_token = per_token.reshape(mask.shape)
            self._fused.update(per_token=per_token, mask=mask, shifted_here=shift_labels is None)
            count = mask.sum().clamp_min(1) if num_items is None else num_items
            if torch.is_tensor(count):
                count = count.to(per_token.device)
            return per_token.sum() / count
        return self.loss_from_hidden(
            hidden,
            labels,
            shift_labels=shift_labels,
            num_items_in_batch=num_items,
            ignore_index=ignore_index,
            exact=mode == _EXACT,
        )

    def loss_from_hidden(
        self,
        hidden: torch.Tensor,
        labels: torch.Tensor | None,
        *,
        shift_labels: torch.Tensor | None = None,
        num_items_in_batch: torch.Tensor | int | None = None,
        ignore_index: int = -100,
        exact: bool = False,
        reduction: str | None = None,
        weight: torch.Tensor | None = None,
        bias: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """The causal-LM loss from the head's input hidden states, with ``ForCausalLMLoss`` semantics.

        The sampled path reads nothing back to the host (labels are range-checked on the device) and
        keeps this call's step data (``last_queries``, the batch for :meth:`last_batch_exact_loss`, the
        finiteness record); the exact path checks the labels with a ``ValueError``.

        Args:
            hidden: (B, S, D) (or (N, D)) hidden states the model passed to the head.
            labels: (B, S) unshifted labels; shifted left by one and padded with ``ignore_index``
                unless ``shift_labels`` is given.
            shift_labels: already-shifted labels with one entry per hidden state.
            num_items_in_batch: if given, the loss is the sum over tokens divided by this count
                (the Trainer's gradient-accumulation normalization); otherwise the mean.
            exact: full softmax (exact, chunked) instead of the sampled softmax.
            reduction: "none" for the (N,) float32 per-token losses (0 at ignored tokens); by default
                "sum" with ``num_items_in_batch``, else "mean".
            weight, bias: the full (V, D) weight and (V,) bias to use instead of the head's own, e.g.
                gathered from shards outside the model's forward.
        Returns:
            float32 scalar, or (N,) with ``reduction="none"``.
        """
        if shift_labels is None:
            if labels is None:
                raise ValueError("The loss needs labels or shift_labels.")
            shift_labels = F.pad(labels, (0, 1), value=ignore_index)[..., 1:]
        h = hidden.reshape(-1, hidden.shape[-1])
        y = shift_labels.reshape(-1).to(device=h.device, dtype=torch.long)
        if y.shape[0] != h.shape[0]:
            raise ValueError(
                f"The head saw {h.shape[0]} hidden states but the labels give {y.shape[0]} targets; with labels, "
                "call the model with logits_to_keep=0 (all positions) or pass matching shift_labels."
            )
        if weight is None:
            weight, bias = self.weight, self.bias
        if reduction is None:
            reduction = "mean" if num_items_in_batch is None else "sum"
        with contextlib.ExitStack() as stack:
            if torch.is_autocast_enabled(h.device.type):
                # The loss runs in the head weight's precision; autocast would recast inside the kernels.
                stack.enter_context(torch.autocast(h.device.type, enabled=False))
            if h.dtype != weight.dtype:
                h = h.to(weight.dtype)
            raw = h
            if self.logit_scale != 1.0:
                h = h * self.logit_scale
                bias = None if bias is None else bias * self.logit_scale
            if exact:
                loss = full_softmax_loss(
                    h,
                    weight,
                    y,
                    bias=bias,
                    ignore_index=ignore_index,
                    reduction=reduction,
                    logit_softcap=self.logit_softcap,
                )
            else:
                cfg = self.config
                sampler = self._sampler_on(weight.device)
                loss = sampled_softmax_loss(
                    h,
                    weight,
                    y,
                    sampler,
                    cfg.num_samples,
                    bias=bias,
                    negatives=cfg.negatives,
                    ignore_index=ignore_index,
                    remove_accidental_hits=cfg.remove_accidental_hits,
                    reduction=reduction,
                    logit_softcap=self.logit_softcap,
                    check_labels=False,
                    estimator=cfg.estimator,
                    exact_ids=sampler.excluded,  # the exact head, kept on the sampler's device
                )
                self._keep_step_data(raw, y, ignore_index, loss)
        if num_items_in_batch is not None and reduction != "none":
            if torch.is_tensor(num_items_in_batch):
                num_items_in_batch = num_items_in_batch.to(loss.device)
            loss = loss / num_items_in_batch
        return loss

    # ------------------------------------------------------------------ per-step side data
    def clear_step_data(self) -> None:
        """Forget the kept queries, batch and finiteness record (the callback does this at train start)."""
        self.last_queries: torch.Tensor | None = None
        self._last_batch: tuple[torch.Tensor, torch.Tensor, int] | None = None
        self._first_bad: torch.Tensor | None = None  # (2,) int64: [call index or -1, cause code]
        self.call_counter: torch.Tensor | None = None

    @property
    def sampled_calls(self) -> int:
        """Sampled-loss calls since :meth:`clear_step_data`; reads the device counter (a sync)."""
        return 0 if self.call_counter is None else int(self.call_counter)

    @torch.no_grad()
    def _keep_step_data(self, h: torch.Tensor, y: torch.Tensor, ignore_index: int, loss: torch.Tensor) -> None:
        """Keep this call's queries, batch and finiteness on the device: no host sync, static shapes.

        h: (T, D) detached-to-be hidden states in the weight's dtype (before the logit scale); y: (T,).
        """
        h = h.detach()
        valid = y != ignore_index
        count = valid.sum()
        # No token counts: choose among all tokens (their hidden states are still the model's).
        valid = valid | (count == 0)
        count = torch.where(count == 0, torch.full_like(count, y.shape[0]), count)
        k = min(self.config.kl_queries, y.shape[0])
        # The j-th chosen token is the (1 + floor(j (count - 1) / (k - 1)))-th non-ignored one; its
        # position is where the running count of non-ignored tokens first reaches that rank.
        rank = torch.arange(k, device=h.device) * (count - 1) // max(k - 1, 1) + 1
        rows = torch.searchsorted(valid.long().cumsum(0), rank).clamp_max(y.shape[0] - 1)
        self.last_queries = h[rows].float()
        self._last_batch = (h, y, ignore_index)
        if self.call_counter is None:
            self.call_counter = torch.zeros((), dtype=torch.long, device=h.device)
        self.call_counter.add_(1)
        hidden_ok = torch.isfinite(h).all()
        loss_ok = torch.isfinite(loss).all()
        cause = torch.where(hidden_ok, torch.where(loss_ok, 0, 2), 1).long()
        first = torch.stack([self.call_counter - 1, cause])
        if self._first_bad is None:
            none = torch.stack([cause.new_full((), -1), cause.new_zeros(())])
            self._first_bad = torch.where(cause > 0, first, none)
        else:
            new = (self._first_bad[0] < 0) & (cause > 0)
            self._first_bad = torch.where(new, first, self._first_bad)

    def first_nonfinite_call(self) -> tuple[int, str] | None:
        """(index among the sampled calls since :meth:`clear_step_data`, cause) of the first call whose
        hidden states or loss held NaN/Inf, or None. Reads one small tensor back (a device sync): call it
        at logging steps, not per micro-batch."""
        if self._first_bad is None:
            return None
        call, cause = (int(v) for v in self._first_bad.tolist())
        return None if call < 0 else (call, NONFINITE_CAUSES[cause])

    @torch.no_grad()
    def last_batch_exact_loss(
        self, weight: torch.Tensor | None = None, bias: torch.Tensor | None = None
    ) -> torch.Tensor | None:
        """The exact (full-softmax) mean loss of the last sampled call's tokens, chunked, no (T, V) tensor.

        Args:
            weight, bias: the full weight and bias when the head's are sharded (see loss_from_hidden).
        Returns:
            float32 scalar, or None before the first sampled call.
        """
        if self._last_batch is None:
            return None
        h, y, ignore_index = self._last_batch
        if weight is None:
            weight, bias = self.weight, self.bias
        return self.loss_from_hidden(
            h, None, shift_labels=y, ignore_index=ignore_index, exact=True, weight=weight.detach(),
            bias=None if bias is None else bias.detach(),
        )

    # ------------------------------------------------------------------ wrap / unwrap / find (hf_midx.wrap)
    @classmethod
    def wrap(
        cls,
        model: nn.Module,
        config: MidxConfig | None = None,
        *,
        class_counts: torch.Tensor | None = None,
        verify: bool = True,
        **overrides,
    ) -> nn.Module:
        """Replace the model's output layer by a ``MidxLMHead`` (in place); see :func:`hf_midx.wrap.wrap`."""
        from .wrap import wrap

        return wrap(model, config, class_counts=class_counts, verify=verify, **overrides)

    @classmethod
    def unwrap(cls, model: nn.Module) -> nn.Module:
        """Put the original ``nn.Linear`` back and remove every hook (in place); see :func:`hf_midx.wrap.unwrap`."""
        from .wrap import unwrap

        return unwrap(model)

    @staticmethod
    def find(model: nn.Module) -> "MidxLMHead | None":
        """The ``MidxLMHead`` inside ``model`` (through PEFT / compile / FSDP wrappers too), or None."""
        return find_head(model)


def find_head(model: nn.Module) -> MidxLMHead | None:
    """The ``MidxLMHead`` inside ``model`` (through PEFT / compile / FSDP wrappers too), or None."""
    if not isinstance(model, nn.Module):
        return None
    for module in model.modules():
        if isinstance(module, MidxLMHead):
            return module
    return None


__all__ = ["MidxFusedOutput", "MidxLMHead", "find_head"]
