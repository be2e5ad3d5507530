"""MidxLMHead: the LM-head layer that trains with the MIDX sampled softmax and predicts with the full one.

The layer only (forward, loss, sampler). Putting it into a model, keeping its input during a training call
and computing the loss from it is :mod:`hf_midx.integration.wrap`, as peft keeps ``get_peft_model`` apart from its
layers. The head holds the *same* ``weight`` / ``bias`` Parameters as the ``nn.Linear`` it replaces, so
``state_dict`` keys, weight ties and ``save_pretrained`` stay those of the plain model.

Shapes: B batch, S sequence, N = B*S tokens, D hidden dims, V classes, H exact-head classes.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import time

import torch
import torch.nn.functional as F
from torch import nn

from ..config import MidxConfig
from .diagnostics import proposal_diagnostics
from .kernel_guard import KernelGuard
from ..losses.exact_head import auto_exact_head, exact_head_ids
from ..losses import full_softmax_loss, sampled_softmax_loss
from ..losses.full import assert_labels_in_range
from ..losses.log_probs import LogitTransform, SampledGradientLogProbs, log_prob_statistics, logits_dtype
from ..losses.precision import product_dtype
from ..registry import build_sampler  # any hf_midx import runs hf_midx/__init__, which registers the samplers
from .step_data import StepData
from .trl_log_probs import trl_statistics
from .zero import check_whole, full_shape

logger = logging.getLogger(__name__)


class MidxLMHead(nn.Module):
    """An LM head that trains with the MIDX sampled softmax and predicts with the full softmax; build it with
    :func:`hf_midx.wrap`, not directly.

    Attributes:
        config: the :class:`~hf_midx.MidxConfig` in use.
        sampler: the proposal (:class:`hf_midx.Sampler`), built from the head weight at wrap time.
        linear: the original ``nn.Linear`` (not a submodule); while wrapped its ``weight``/``bias`` are
            None (the head holds them), and :func:`hf_midx.unwrap` gives them back.
        num_classes: V, the output classes, and ``in_features`` D: kept (a ZeRO-3 weight is a (0,) slice).
        logit_softcap: ``cap`` in ``cap * tanh(logits / cap)`` (Gemma-2's ``final_logit_softcapping``) or None.
        logit_scale: the host's logit factor (Cohere's ``logit_scale``, 1 / Granite's ``logits_scaling``) or 1.0.
        exact_ids: (H,) int64 ids of the exact head (:mod:`hf_midx.losses.exact_head`), scored exactly for each token, or None.
        step_data: the :class:`~hf_midx.integration.step_data.StepData` of the sampled :meth:`loss` calls, for the callback.
        kernel_guard: the :class:`~hf_midx.integration.kernel_guard.KernelGuard` of ``kernels="auto"``'s first call.
        binding: the :class:`~hf_midx.integration.binding.HostBinding` that put this head in a model, or None.
            :meth:`forward` offers it its input; where the binding keeps it, forward returns (B, S, 0).
    """

    def __init__(self, linear: nn.Linear, config: MidxConfig, *, class_counts: torch.Tensor | None = None,
                 logit_softcap: float | None = None, logit_scale: float = 1.0) -> None:
        super().__init__()
        # The same Parameter objects as the Linear: identical state_dict keys, ties and optimizer state.
        self.weight = linear.weight
        self.register_parameter("bias", linear.bias)
        self.__dict__["linear"] = linear  # kept out of _modules so its keys do not appear twice
        self.num_classes, self._in_features = (int(n) for n in full_shape(self.weight))  # wrap gathers a ZeRO-3 one
        # The values in use (exact_head at most V / 8): what midx_config.json and the card then show.
        config = config.for_vocabulary(self.num_classes)
        if config.exact_head == "auto" and class_counts is not None:  # without counts: warned and off below
            config = dataclasses.replace(config, exact_head=auto_exact_head(class_counts, self.num_classes))
        self.config = config
        self.logit_softcap, self.logit_scale, self.binding = logit_softcap, float(logit_scale), None
        self.step_data = StepData(config.kl_queries, self.weight.device)
        self._class_counts, self._exact_depth = class_counts, 0
        self.kernel_guard = KernelGuard()  # "auto"'s first call on each device
        self.exact_ids: torch.Tensor | None = exact_head_ids(config.exact_head, class_counts, self.num_classes)
        started = time.perf_counter()
        self.sampler = self._build_sampler(self.weight)  # a hf_midx.Sampler (no import: the head stays below them)
        self.build_seconds = time.perf_counter() - started  # what a rebuild costs, for the refresh schedule
        # What is in use, for midx_config.json and the model card: without class counts there is no exact head,
        # and a MIDX sampler mixes in no unigram and draws uniformly inside buckets (both warned).
        effective = {"exact_head": 0} if self.exact_ids is None and config.exact_head else {}
        for name in set(type(self.sampler).options) & {"mix_weight", "last_stage"}:
            if getattr(self.sampler, name, None) not in (None, getattr(config, name)):
                effective[name] = getattr(self.sampler, name)
        if effective:
            self.config = dataclasses.replace(config, **effective)
        self._release_linear()  # last: a failed construction leaves the model's Linear as it was

    # ------------------------------------------------------------------ nn.Linear look-alike
    in_features = property(lambda self: self._in_features, doc="D, the input features.")
    out_features = property(lambda self: self.num_classes, doc="V, the output features.")

    def extra_repr(self) -> str:
        cfg = self.config
        return (f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}, "
                f"sampler={cfg.sampler!r}, num_samples={cfg.num_samples}, negatives={cfg.negatives!r}")

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        """Full logits (B, S, V) from ``hidden`` (B, S, D); (B, S, 0) where the binding keeps ``hidden``."""
        if self.binding is not None and self.binding.capture(hidden):
            return hidden.new_zeros((*hidden.shape[:-1], 0))
        if type(self.linear) is nn.Linear:
            # The head's own parameters: under FSDP2 they are the unsharded ones during forward.
            return F.linear(hidden, self.weight, self.bias)
        self.sync_linear()
        try:
            return self.linear(hidden)
        finally:
            self._release_linear()

    def sync_linear(self) -> None:
        """Give the kept ``linear`` the head's parameters (to unwrap, or after ``tie_weights`` re-registered them)."""
        if self.linear.weight is not self.weight:
            self.linear.weight = self.weight
        if self.linear.bias is not self.bias:
            self.linear.bias = self.bias

    def _release_linear(self) -> None:
        # The head holds the parameters; the kept Linear gets them back on unwrap. A second reference
        # would keep the full weight alive where FSDP2 replaces the head's parameters by shards.
        self.linear.register_parameter("weight", None)
        if getattr(self.linear, "bias", None) is not None:
            self.linear.register_parameter("bias", None)

    # ------------------------------------------------------------------ sampler
    def _build_sampler(self, weight: torch.Tensor):
        exclude = None if self.exact_ids is None else self.exact_ids.to(weight.device)
        options = dict(class_counts=self._class_counts, exclude=exclude, **self.config.sampler_kwargs())
        return build_sampler(self.config.sampler, weight.detach(), **options)

    @torch.no_grad()
    def refresh(self, weight: torch.Tensor | None = None) -> None:
        """Rebuild the sampler's tables from ``weight`` (the full (V, D) weight, e.g. gathered from FSDP /
        ZeRO-3 shards) or the head's own, in place, this process only. :func:`hf_midx.refresh_index` is the
        one for a sharded head or several processes: it gathers, rebuilds on rank 0 and broadcasts."""
        w = self.weight if weight is None else weight
        got = tuple(w.shape) if isinstance(w, torch.Tensor) else type(w).__name__
        if got != (self.num_classes, self.in_features):
            raise ValueError(f"refresh needs the full ({self.num_classes}, {self.in_features}) head weight, got {got}; "
                             "gather a sharded weight first (hf_midx.refresh_index(model) does).")
        if hasattr(w, "full_tensor"):
            raise ValueError("refresh got a sharded DTensor weight; hf_midx.refresh_index(model) gathers it.")
        self.step_data.calls_since_refresh = 0
        if w.device == self.sampler.device:
            return self.sampler.refresh(w.detach())
        self.sampler = self._build_sampler(w)  # the head moved

    def _sampler_on(self, device: torch.device):
        if self.sampler.device != device:
            logger.info("MidxLMHead: the head moved to %s; rebuilding the sampler there.", device)
            self.sampler = self._build_sampler(self.weight)
        return self.sampler

    # ------------------------------------------------------------------ the loss
    def prepare_kernels(self, dtype: torch.dtype | None = None) -> None:
        """Decide ``kernels="auto"`` for the head's device now, probing the fused kernels there
        (:class:`~hf_midx.integration.kernel_guard.KernelGuard`), for the weight's dtype and ``dtype`` (the autocast
        dtype a mixed-precision step runs the head's products in): before a step that ``torch.compile`` traces or a
        CUDA graph captures. :func:`hf_midx.wrap` and the callback's train begin call it. The probe reads the head's
        shape, not its weight: a sharded head (ZeRO-3, FSDP) is probed here as a whole one."""
        weight = self.weight
        for d in dict.fromkeys(x for x in (weight.dtype, dtype) if x is not None):
            self.kernel_guard.prepare(self.config, self.probe_shape(), weight.device, weight.dtype, d)

    def probe_shape(self) -> tuple:
        """What the kernels' probe takes of the head: (V, D, H exact classes, has a bias, logit soft-cap or None)."""
        num_exact = 0 if self.exact_ids is None else self.exact_ids.numel()
        return self.num_classes, self.in_features, num_exact, self.bias is not None, self.logit_softcap

    @contextlib.contextmanager
    def exact_loss_only(self):
        """Within this context, model calls with labels return the exact full-softmax loss and (B, S, 0)
        logits: for evaluation loops that need the loss but no logits (no (N, V) tensor is built). Calls
        without labels still return full logits. Re-entrant."""
        self._exact_depth += 1
        try:
            yield self
        finally:
            self._exact_depth -= 1

    exact_only = property(lambda self: self._exact_depth > 0, doc="True inside :meth:`exact_loss_only`.")

    @property
    def frozen(self) -> bool:
        """True when neither the weight nor the bias requires grad (LoRA and other adapters leave ``lm_head`` so):
        the loss then does no weight-gradient work, and the callback keeps the index built at wrap time."""
        return not self.weight.requires_grad and (self.bias is None or not self.bias.requires_grad)

    def loss(self, hidden: torch.Tensor, labels: torch.Tensor, *, num_items_in_batch: torch.Tensor | int | None = None,
             ignore_index: int = -100, exact: bool = False, reduction: str | None = None,
             weight: torch.Tensor | None = None, bias: torch.Tensor | None = None) -> torch.Tensor:
        """The cross-entropy of each hidden state against its label, which is already shifted.

        The sampled path reads nothing back to the host (labels are range-checked on the device) and
        records the call in :attr:`step_data`; the exact path checks the labels with a ``ValueError``.

        Args:
            hidden: (N, D) (or (..., D)) hidden states, the head's input (any float dtype).
            labels: (N,) integers (or hidden's leading shape), the class each hidden state predicts, or
                ``ignore_index``: already shifted (:func:`hf_midx.wrap`'s binding shifts a model's labels).
            num_items_in_batch: divide the sum over tokens by this count (the Trainer's gradient-accumulation
                normalization) instead of taking the mean.
            exact: the full softmax (exact, chunked, no (N, V) tensor) instead of the sampled one.
            reduction: "none" for the (N,) float32 per-token losses (0 at ignored tokens); else a float32 scalar.
            weight, bias: the full (V, D) weight and (V,) bias instead of the head's, e.g. gathered from shards.
        """
        h = hidden.reshape(-1, hidden.shape[-1])
        y = labels.reshape(-1).to(device=h.device, dtype=torch.long)
        weight, bias = (self.weight, self.bias) if weight is None else (weight, bias)
        check_whole(weight)  # a ZeRO-3 slice outside the engine's forward: one clear error
        if reduction is None:
            reduction = "mean" if num_items_in_batch is None else "sum"
        # Under autocast both losses multiply in its dtype as an nn.Linear head would (float32 accumulation and
        # gradients: hf_midx.losses.precision): the sampled one on the weight uncast (its path casts where it needs a
        # copy; the kernels round tiles on chip), the exact one on the cast weight, so that it is the unwrapped
        # model's (an eval_loss with or without compute_metrics). Either runs with autocast off (it would recast some
        # of the loss's ops and not the kernels), the kernels' probe under the caller's (it probes the AMP step).
        dtype = product_dtype(weight)
        kernels = None if exact else self.kernel_guard.kernels(self.config, self.probe_shape(), weight, dtype)
        autocast = torch.is_autocast_enabled(h.device.type)
        with torch.autocast(h.device.type, enabled=False) if autocast else contextlib.nullcontext():
            weight = weight.to(dtype) if exact else weight
            bias = None if bias is None else bias.to(dtype)  # as nn.Linear's: (V,), in the products' dtype
            raw = h = h.to(dtype)
            if self.logit_scale != 1.0:
                h = h * self.logit_scale
                bias = None if bias is None else bias * self.logit_scale
            options = dict(bias=bias, ignore_index=ignore_index, reduction=reduction, logit_softcap=self.logit_softcap)
            if exact:
                loss = full_softmax_loss(h, weight, y, **options)
            else:
                cfg, sampler = self.config, self._sampler_on(weight.device)
                loss = sampled_softmax_loss(
                    h, weight, y, sampler, cfg.num_samples, negatives=cfg.negatives,
                    remove_accidental_hits=cfg.remove_accidental_hits, check_labels=False, estimator=cfg.estimator,
                    exact_ids=sampler.excluded, kernels=kernels, tail_gradient=cfg.tail_gradient,
                    z_loss=cfg.z_loss, label_smoothing=cfg.label_smoothing, return_z_loss=bool(cfg.z_loss),
                    product_dtype=dtype, **options,  # excluded: on the sampler's device
                )
                loss, z_term = loss if cfg.z_loss else (loss, None)
                if z_term is not None and reduction != "mean":  # logged as a mean over this call's tokens
                    z_term = z_term.sum() / (y != ignore_index).sum().clamp_min(1)
                self.step_data.record(raw, y, ignore_index, loss, z_loss=z_term)
        count = num_items_in_batch
        if count is None or reduction == "none":
            return loss
        return loss / (count.to(loss.device) if torch.is_tensor(count) else count)

    def exact_log_probs(self, hidden: torch.Tensor, labels: torch.Tensor, *, ignore_index: int = -100,
                        temperature: float = 1.0) -> dict[str, torch.Tensor]:
        """Exact per-token log-probabilities and softmax statistics with a sampled gradient
        (:mod:`hf_midx.losses.log_probs`): TRL's fused-head fields for ``MidxConfig(log_probs="exact-forward")``, in
        its rounding (products in the autocast dtype under autocast, then float32).

        Args:
            hidden: (..., D) hidden states (the head's input); labels: (...) already shifted, or ``ignore_index``.
            temperature: what the logits are divided by (after the host's scale and soft-cap), as TRL's head does.
        Returns:
            ``log_probs`` and ``entropy`` (differentiable; the gradient estimated from the exact head and the draws),
            ``log_sum_sq_probs`` and ``mean_logits`` (float32, no gradient) and ``is_top1`` (bool), each of the
            labels' shape and 0 (False) where ignored.
        """
        if not temperature > 0:
            raise ValueError(f"temperature must be a positive number (the logits are divided by it), got {temperature!r}.")
        if labels.numel() * hidden.shape[-1] != hidden.numel():
            raise ValueError(f"exact_log_probs needs one label per hidden state: hidden {tuple(hidden.shape)}, labels "
                             f"{tuple(labels.shape)}.")
        weight, bias = self.weight, self.bias
        check_whole(weight)
        h = hidden.reshape(-1, hidden.shape[-1])
        y = labels.reshape(-1).to(device=h.device, dtype=torch.long)
        valid = y != ignore_index
        y = y.masked_fill(~valid, 0)
        assert_labels_in_range(y, self.num_classes)  # on the device: no sync
        transform = LogitTransform(float(temperature), self.logit_scale, self.logit_softcap)
        dtype = logits_dtype(h)  # TRL's rule: its old-policy and reference log-probs round the same way
        stats = trl_statistics(h, weight, bias, y, valid, transform, dtype)  # GPUs: TRL's Triton fold itself
        stats = log_prob_statistics(h, weight, bias, y, transform, dtype) if stats is None else stats
        sampler = self._sampler_on(weight.device)
        ids, log_q = sampler.draw(h.detach().float() * self.logit_scale, self.config.num_samples)
        log_probs, entropy = SampledGradientLogProbs.apply(h, weight, bias, y, valid, stats, sampler.excluded, ids,
                                                          log_q, transform, dtype)
        self.step_data.record(h.detach().to(weight.dtype), labels.reshape(-1), ignore_index, log_probs)
        fields = {"log_probs": log_probs, "entropy": entropy, "is_top1": stats["is_top1"] & valid,
                  **{k: stats[k] * valid for k in ("log_sum_sq_probs", "mean_logits")}}
        return {k: v.reshape(labels.shape) for k, v in fields.items()}

    # ------------------------------------------------------------------ for hf_midx.integration.callback
    # The schedule (callback, distributed, learned codebooks) reaches the step data and the sampler through these.
    last_queries = property(lambda self: self.step_data.queries, doc="``step_data.queries``: (min(k, N), D) or None.")
    sampled_calls = property(lambda self: self.step_data.calls, doc="``step_data.calls``, read back (a sync).")

    @torch.no_grad()
    def last_batch_exact_loss(self, weight=None, bias=None) -> torch.Tensor | None:
        """The exact (full-softmax) mean loss of the last sampled call's tokens: a float32 scalar, chunked
        (no (N, V) tensor), or None before the first sampled call. ``weight``, ``bias``: the full ones
        when the head's are sharded (see :meth:`loss`)."""
        if self.step_data.last_batch is None:
            return None
        h, y, ignore_index = self.step_data.last_batch
        if weight is None:
            weight, bias = self.weight, self.bias
        bias = None if bias is None else bias.detach()
        return self.loss(h, y, ignore_index=ignore_index, exact=True, weight=weight.detach(), bias=bias)

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


def find_head(model: nn.Module) -> MidxLMHead | None:
    """The ``MidxLMHead`` inside ``model`` (through PEFT / compile / FSDP wrappers too), or None."""
    if isinstance(model, nn.Module):
        for module in model.modules():
            if isinstance(module, MidxLMHead):
                return module
    return None


__all__ = ["MidxLMHead", "exact_head_ids", "find_head"]
