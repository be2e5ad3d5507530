"""MidxLMHead: the LM-head layer that trains with the MIDX sampled softmax and predicts with the full one.

The layer only (forward, loss, sampler); putting it into a model and taking it out again is
:mod:`hf_midx.wrap`, as peft keeps ``get_peft_model`` apart from its layers. The head holds the *same*
``weight`` / ``bias`` Parameters as the ``nn.Linear`` it replaces, so ``state_dict`` keys, weight ties
and ``save_pretrained`` stay those of the plain model. It returns full logits, unless ``capturing`` is
set for a call (training with labels, or :meth:`~MidxLMHead.exact_loss_only`): then it keeps its input
for :meth:`~MidxLMHead.loss_from_hidden` and returns a (B, S, 0) placeholder, so no (tokens x vocab)
tensor is built. Each sampled call is recorded in ``step_data`` for the callback.

Shapes: B batch, S sequence, T = B*S tokens, D hidden dims, V classes, H exact-head classes.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import sys
import warnings

import torch
import torch.nn.functional as F
from torch import nn

from .config import MidxConfig
from .diagnostics import proposal_diagnostics
from .loss import full_softmax_loss, sampled_softmax_loss
from .samplers import Sampler, build_sampler
from .samplers.base import check_counts
from .step_data import StepData

logger = logging.getLogger(__name__)


class MidxLMHead(nn.Module):
    """An LM head that trains with the MIDX sampled softmax and predicts with the full softmax.

    Build it with :func:`hf_midx.wrap`, not directly.

    Attributes:
        config: the :class:`~hf_midx.MidxConfig` in use.
        sampler: the proposal (:class:`hf_midx.Sampler`), built from the head weight at wrap time.
        linear: the original ``nn.Linear`` (not a submodule); while wrapped its ``weight``/``bias`` are
            None (the head holds them), and :func:`hf_midx.unwrap` gives them back.
        num_classes: V, the number of output classes (rows of the weight).
        logit_softcap: ``cap`` in ``cap * tanh(logits / cap)`` (Gemma-2's ``final_logit_softcapping``) or None.
        logit_scale: factor the host applies to the logits (Cohere's ``logit_scale``, 1 / Granite's
            ``logits_scaling``); 1.0 for most models.
        exact_ids: (H,) int64 ids of the exact head (the ``config.exact_head`` most frequent classes,
            at most V // 8), scored exactly for every token; or None.
        capturing: set by the host binding for one call: keep the input, return (B, S, 0).
        step_data: the :class:`~hf_midx.step_data.StepData` the callback reads.
        binding: the :class:`hf_midx.wrap.HostBinding` that put this head in a model, or None (kept
            here for :func:`hf_midx.unwrap`; the head never reads it).
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
        self.num_classes = int(self.weight.shape[0])
        # The values in use (exact_head at most V / 8): what midx_config.json and the card then show.
        config = config.for_vocabulary(self.num_classes)
        self.config = config
        self.logit_softcap = logit_softcap
        self.logit_scale = float(logit_scale)
        self.capturing = False
        self.binding = None
        self.step_data = StepData(config.kl_queries)
        self._class_counts = class_counts
        self._exact_depth = 0
        self._hidden: torch.Tensor | None = None
        self.exact_ids: torch.Tensor | None = exact_head_ids(config, class_counts, self.num_classes)
        self.sampler: Sampler = self._build_sampler(self.weight)
        # What is in use, for midx_config.json and the model card: without class counts there is no exact head,
        # and a MIDX sampler mixes in no unigram and draws uniformly inside buckets (both warned).
        effective = {"exact_head": 0} if self.exact_ids is None and config.exact_head else {}
        for name in ("mix_weight", "last_stage"):
            used = getattr(self.sampler, name, None)
            if name in type(self.sampler).options and used is not None and used != getattr(config, name):
                effective[name] = used
        if effective:
            self.config = dataclasses.replace(config, **effective)
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
        """Full logits (B, S, V); while :attr:`capturing`, keep ``hidden`` (B, S, D) and return (B, S, 0)."""
        if self.capturing:
            self._hidden = hidden
            return hidden.new_zeros((*hidden.shape[:-1], 0))
        if type(self.linear) is nn.Linear:
            # The head's own parameters: under FSDP2 they are the unsharded ones during forward.
            return F.linear(hidden, self.weight, self.bias)
        self.sync_linear()
        try:
            return self.linear(hidden)
        finally:
            self._release_linear()

    def take_hidden(self) -> torch.Tensor | None:
        """The input kept by the last capturing call (then forgotten), or None."""
        hidden, self._hidden = self._hidden, None
        return hidden

    def sync_linear(self) -> None:
        """Point the kept ``linear`` at the head's parameters (before unwrapping, or if something
        re-registered them, e.g. ``tie_weights``)."""
        linear = self.linear
        if linear.weight is not self.weight:
            linear.weight = self.weight
        if linear.bias is not self.bias:
            linear.bias = self.bias

    def _release_linear(self) -> None:
        # The head holds the parameters; the kept Linear gets them back on unwrap. A second reference
        # would keep the full weight alive where FSDP2 replaces the head's parameters by shards.
        self.linear.register_parameter("weight", None)
        if getattr(self.linear, "bias", None) is not None:
            self.linear.register_parameter("bias", None)

    # ------------------------------------------------------------------ sampler
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

    # ------------------------------------------------------------------ the loss
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
    def exact_only(self) -> bool:
        """True inside :meth:`exact_loss_only`."""
        return self._exact_depth > 0

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
        records this call in :attr:`step_data` (queries, the batch for :meth:`last_batch_exact_loss`,
        finiteness); the exact path checks the labels with a ``ValueError``.

        Args:
            hidden: (B, S, D) (or (N, D)) hidden states the model passed to the head.
            labels: (B, S) unshifted labels (shifted here), unless ``shift_labels`` (N,) is given.
            num_items_in_batch: if given, the sum over tokens divided by this count (the Trainer's
                gradient-accumulation normalization); otherwise the mean.
            exact: full softmax (exact, chunked) instead of the sampled softmax.
            reduction: "none" for the (N,) float32 per-token losses (0 at ignored tokens).
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
                    h, weight, y, bias=bias, ignore_index=ignore_index, reduction=reduction,
                    logit_softcap=self.logit_softcap,
                )
            else:
                cfg = self.config
                sampler = self._sampler_on(weight.device)
                loss = sampled_softmax_loss(
                    h, weight, y, sampler, cfg.num_samples, bias=bias, negatives=cfg.negatives,
                    ignore_index=ignore_index, remove_accidental_hits=cfg.remove_accidental_hits,
                    reduction=reduction, logit_softcap=self.logit_softcap, check_labels=False,
                    estimator=cfg.estimator, exact_ids=sampler.excluded,  # the exact head, on the sampler's device
                )
                self.step_data.record(raw, y, ignore_index, loss)
        if num_items_in_batch is not None and reduction != "none":
            if torch.is_tensor(num_items_in_batch):
                num_items_in_batch = num_items_in_batch.to(loss.device)
            loss = loss / num_items_in_batch
        return loss

    # ------------------------------------------------------------------ the callback's data
    @property
    def last_queries(self) -> torch.Tensor | None:
        """``step_data.queries``: (min(k, T), D) hidden states of the last sampled call, or None."""
        return self.step_data.queries

    @property
    def sampled_calls(self) -> int:
        """``step_data.calls``: sampled-loss calls since the step data was cleared (a sync)."""
        return self.step_data.calls

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
        if self.step_data.last_batch is None:
            return None
        h, y, ignore_index = self.step_data.last_batch
        if weight is None:
            weight, bias = self.weight, self.bias
        return self.loss_from_hidden(
            h, None, shift_labels=y, ignore_index=ignore_index, exact=True, weight=weight.detach(),
            bias=None if bias is None else bias.detach(),
        )

    # ------------------------------------------------------------------ deprecated aliases
    # One-line aliases of hf_midx.wrap / unwrap, kept for a release. They look the functions up on the
    # package at call time, so that this module imports nothing from wrap.py (which imports it).
    @classmethod
    def wrap(cls, model: nn.Module, config: MidxConfig | None = None, **kwargs) -> nn.Module:
        """Deprecated alias of :func:`hf_midx.wrap` (same arguments); kept for one release."""
        return sys.modules[__package__].wrap(model, config, **kwargs)

    @classmethod
    def unwrap(cls, model: nn.Module) -> nn.Module:
        """Deprecated alias of :func:`hf_midx.unwrap`; kept for one release."""
        return sys.modules[__package__].unwrap(model)

    @staticmethod
    def find(model: nn.Module) -> "MidxLMHead | None":
        """Deprecated alias of :func:`find_head`; kept for one release."""
        return find_head(model)

    # ------------------------------------------------------------------ the sampler, for hf_midx.callback
    # The schedule (callback, distributed, learned codebooks) reaches the sampler only through these.
    def sampler_state(self) -> dict[str, torch.Tensor]:
        """The sampler's tensors (``Sampler.state_dict``: its tables, sizes and ``generator_state``)."""
        return self.sampler.state_dict()

    def load_sampler_state(self, state: dict[str, torch.Tensor]) -> None:
        """Load :meth:`sampler_state` tensors (``generator_state`` optional); ValueError on another layout."""
        self.sampler.load_state_dict(state)

    @torch.no_grad()
    def set_codebooks(self, codebooks: tuple[torch.Tensor, torch.Tensor], weight: torch.Tensor) -> None:
        """Rebuild a MIDX index with the given (K, D1), (K, D2) codebooks from the full (V, D) ``weight``."""
        self.sampler.set_codebooks(codebooks, weight.detach())

    def proposal_diagnostics(self, queries: torch.Tensor, weight: torch.Tensor, bias=None) -> dict[str, torch.Tensor]:
        """:func:`hf_midx.proposal_diagnostics` of the sampler on (N, D) hidden states, scaled as in the loss."""
        scale = self.logit_scale
        return proposal_diagnostics(
            self.sampler, queries.to(weight.device) * scale, weight, None if bias is None else bias * scale,
            num_samples=self.config.num_samples, logit_softcap=self.logit_softcap,
        )


def exact_head_ids(config: MidxConfig, class_counts, num_classes: int) -> torch.Tensor | None:
    """(H,) ids of the exact head: the config.exact_head most frequent classes, sorted; None when off or
    without counts (warned). ``config`` is already fitted to V (:meth:`MidxConfig.for_vocabulary`)."""
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
    counts = check_counts(class_counts, num_classes, "cpu")  # every sampler's head, not only those that read them
    # stable ranking: ties broken by class id, so every rank picks the same head.
    return torch.sort(torch.sort(-counts, stable=True).indices[:h]).values



def find_head(model: nn.Module) -> MidxLMHead | None:
    """The ``MidxLMHead`` inside ``model`` (through PEFT / compile / FSDP wrappers too), or None."""
    if not isinstance(model, nn.Module):
        return None
    for module in model.modules():
        if isinstance(module, MidxLMHead):
            return module
    return None


__all__ = ["MidxLMHead", "exact_head_ids", "find_head"]
