"""MidxLMHead: wrap a causal LM's output layer so training uses the MIDX sampled softmax.

How it works (all per instance; no class is patched):

* :meth:`MidxLMHead.wrap` replaces the model's ``get_output_embeddings()`` ``nn.Linear`` by a
  ``MidxLMHead`` that registers the *same* ``weight`` (and ``bias``) ``Parameter`` s as its own, so
  ``model.state_dict()`` keeps exactly the original keys (``lm_head.weight``), tied weights stay tied and
  ``save_pretrained`` writes a plain transformers checkpoint. The original ``nn.Linear`` is kept in
  ``head.linear`` (not a submodule) and put back by :meth:`MidxLMHead.unwrap`.
* A forward pre-hook on the model that owns the head (the *host*, e.g. ``LlamaForCausalLM``; inside
  a PEFT wrapper too) looks at each call's ``labels``:

  - no labels, or eval mode outside ``exact_loss_only``: the head *is* the original ``nn.Linear``: full logits, so ``generate()``,
    pipelines and evaluation behave exactly as before;
  - training mode with labels ("sampled" mode): the head stashes its input hidden states and returns a
    zero-width placeholder of shape (B, S, 0), so no (tokens x vocab) tensor is ever built; the host's
    ``loss_function`` (replaced on the instance) computes :func:`hf_midx.sampled_softmax_loss` from the
    stash with ``ForCausalLMLoss`` label semantics. **In training, ``outputs.logits`` is that
    placeholder.**
  - inside ``with head.exact_loss_only():`` with labels ("exact" mode): the same stash and placeholder,
    the loss is the exact :func:`hf_midx.full_softmax_loss` (no full logits materialized).

  A forward hook (``always_call=True``) switches the head back to full logits after every call, also
  when the forward raises.
* At wrap time two 8-token eval forwards check that the head reproduces the model's logits (with its
  softcap / logit scale) and its loss; architectures that post-process logits otherwise, or compute
  the loss without ``self.loss_function``, are refused instead of trained wrongly.

Shapes: B batch, S sequence, T = B*S tokens, D hidden dims, V classes.
"""

from __future__ import annotations

import contextlib
import inspect
import logging
import warnings
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from .config import MidxConfig
from .loss import full_softmax_loss, sampled_softmax_loss
from .samplers import Sampler, build_sampler

logger = logging.getLogger(__name__)

_FULL, _SAMPLED, _EXACT = "full", "sampled", "exact"
# nn.Module dicts that flag a hook id (with_kwargs / always_call); cleaned with the hook on unwrap.
_HOOK_FLAG_STORES = ("_forward_pre_hooks_with_kwargs", "_forward_hooks_with_kwargs", "_forward_hooks_always_called")


def _causal_lm_loss_reference(
    logits, labels, vocab_size=None, num_items_in_batch=None, ignore_index=-100, shift_labels=None, **kwargs
):
    """Signature of transformers' ``ForCausalLMLoss``; used only to bind the host's call arguments."""


_LOSS_SIGNATURE = inspect.signature(_causal_lm_loss_reference)


def _is_number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


class MidxLMHead(nn.Module):
    """An LM head that trains with the MIDX sampled softmax and predicts with the full softmax.

    Build it with :meth:`MidxLMHead.wrap`, not directly.

    Attributes:
        config: the :class:`~hf_midx.MidxConfig` in use.
        sampler: the proposal (:class:`hf_midx.Sampler`), built from the head weight at wrap time.
        linear: the original ``nn.Linear`` (not a submodule: its parameters *are* ``weight``/``bias``).
        num_classes: V, the number of output classes (rows of the weight).
        logit_softcap: ``cap`` in ``cap * tanh(logits / cap)`` (Gemma-2's ``final_logit_softcapping``) or None.
        logit_scale: factor the host applies to the logits (Cohere's ``logit_scale``, 1 / Granite's
            ``logits_scaling``); 1.0 for most models.
        last_queries: up to ``config.kl_queries`` hidden states (float32, detached) of the last sampled
            loss's non-ignored tokens, for the trainer's KL logging and learned codebooks; or None.
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
        self.num_classes = int(linear.weight.shape[0])
        self.logit_softcap = logit_softcap
        self.logit_scale = float(logit_scale)
        self.last_queries: torch.Tensor | None = None
        self._class_counts = class_counts
        self._mode = _FULL
        self._exact_depth = 0
        self._hidden: torch.Tensor | None = None
        self._labels_position: int | None = None
        self._saved_loss_function: Any = None
        self._had_loss_function = False
        self._warned_unhooked = False
        self.sampler: Sampler = self._build_sampler(self.weight)

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
            self._sync_linear()
            return self.linear(hidden)
        self._hidden = hidden
        return hidden.new_zeros((*hidden.shape[:-1], 0))

    def _sync_linear(self) -> None:
        # If something re-registered the head's parameters (e.g. tie_weights), the Linear follows.
        linear = self.linear
        if linear.weight is not self.weight:
            linear.weight = self.weight
        if linear.bias is not self.bias:
            linear.bias = self.bias

    # ------------------------------------------------------------------ sampler
    def _build_sampler(self, weight: torch.Tensor) -> Sampler:
        return build_sampler(
            self.config.sampler, weight.detach(), class_counts=self._class_counts, **self.config.sampler_kwargs()
        )

    @torch.no_grad()
    def refresh(self, weight: torch.Tensor | None = None) -> None:
        """Rebuild the sampler's tables from the current head weight (in place).

        Args:
            weight: optional full (V, D) weight to use instead of ``self.weight``, e.g. the gathered
                weight when the head is sharded (FSDP / DeepSpeed ZeRO-3).
        """
        w = self.weight if weight is None else weight
        if not isinstance(w, torch.Tensor) or w.dim() != 2 or tuple(w.shape) != (self.num_classes, self.in_features):
            raise ValueError(
                f"refresh needs the full ({self.num_classes}, {self.in_features}) head weight, got "
                f"{tuple(w.shape) if isinstance(w, torch.Tensor) else type(w).__name__}; gather a sharded weight first."
            )
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

    def _before_forward(self, module: nn.Module, args: tuple, kwargs: dict) -> None:
        labels = kwargs.get("labels")
        if labels is None and self._labels_position is not None and len(args) > self._labels_position:
            labels = args[self._labels_position]
        if labels is None:
            self._mode = _FULL
        elif self._exact_depth > 0:
            self._mode = _EXACT
        elif self.training:
            self._mode = _SAMPLED
        else:
            self._mode = _FULL
        self._hidden = None

    def _after_forward(self, module: nn.Module, args: tuple, kwargs: dict, output: Any) -> None:
        self._mode = _FULL
        self._hidden = None

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
    ) -> torch.Tensor:
        """The causal-LM loss from the head's input hidden states, with ``ForCausalLMLoss`` semantics.

        Args:
            hidden: (B, S, D) (or (N, D)) hidden states the model passed to the head.
            labels: (B, S) unshifted labels; shifted left by one and padded with ``ignore_index``
                unless ``shift_labels`` is given.
            shift_labels: already-shifted labels with one entry per hidden state.
            num_items_in_batch: if given, the loss is the sum over tokens divided by this count
                (the Trainer's gradient-accumulation normalization); otherwise the mean.
            exact: full softmax (exact, chunked) instead of the sampled softmax.
        Returns:
            float32 scalar.
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
        weight, bias = self.weight, self.bias
        reduction = "mean" if num_items_in_batch is None else "sum"
        with contextlib.ExitStack() as stack:
            if torch.is_autocast_enabled(h.device.type):
                # The loss runs in the head weight's precision; autocast would recast inside the kernels.
                stack.enter_context(torch.autocast(h.device.type, enabled=False))
                h = h.to(weight.dtype)
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
                loss = sampled_softmax_loss(
                    h,
                    weight,
                    y,
                    self._sampler_on(weight.device),
                    cfg.num_samples,
                    bias=bias,
                    negatives=cfg.negatives,
                    ignore_index=ignore_index,
                    remove_accidental_hits=cfg.remove_accidental_hits,
                    reduction=reduction,
                    logit_softcap=self.logit_softcap,
                )
                self._keep_queries(h, y, ignore_index)
        if num_items_in_batch is not None:
            if torch.is_tensor(num_items_in_batch):
                num_items_in_batch = num_items_in_batch.to(loss.device)
            loss = loss / num_items_in_batch
        return loss

    @torch.no_grad()
    def _keep_queries(self, h: torch.Tensor, y: torch.Tensor, ignore_index: int) -> None:
        q = h.detach()[y != ignore_index]
        k = self.config.kl_queries
        if q.shape[0] > k:  # k evenly spaced tokens of the batch
            q = q[torch.linspace(0, q.shape[0] - 1, k, device=q.device).long()]
        self.last_queries = q.float().clone()

    # ------------------------------------------------------------------ wrap / unwrap / find
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
        """Replace the model's output layer by a ``MidxLMHead`` (in place); returns the same model.

        Args:
            model: a causal LM (``AutoModelForCausalLM``), possibly inside a PEFT wrapper, whose
                ``get_output_embeddings()`` is an ``nn.Linear`` (tied or not, with or without bias).
            config: the :class:`~hf_midx.MidxConfig`; defaults to ``MidxConfig()``.
            class_counts: (V,) training-token counts, for the "unigram" (required) and "log-uniform" samplers.
            verify: run two 8-token forwards in eval mode to check that the head reproduces the model's
                logits and loss (catches architectures that post-process logits in ways the head does
                not model); skipped with a warning if the model cannot run on plain ``input_ids``.
            **overrides: MidxConfig fields to change, e.g. ``num_samples=256``.
        Raises:
            ValueError: no usable output layer, already wrapped, ``num_samples`` >= vocabulary size,
                invalid config values, or a failed verification.
        """
        if config is None:
            config = MidxConfig()
        if not isinstance(config, MidxConfig):
            raise ValueError(f"config must be a MidxConfig, got {type(config).__name__}.")
        if overrides:
            config = config.replace(**overrides)
        if not isinstance(model, nn.Module):
            raise ValueError(f"wrap needs a torch.nn.Module (a transformers model), got {type(model).__name__}.")
        if cls.find(model) is not None:
            raise ValueError(
                "This model is already wrapped by MidxLMHead; call MidxLMHead.unwrap(model) first to wrap it again."
            )
        get_output = getattr(model, "get_output_embeddings", None)
        if not callable(get_output):
            raise ValueError(
                f"{type(model).__name__} has no get_output_embeddings(); wrap a model with a language-model head, "
                "e.g. AutoModelForCausalLM.from_pretrained(...), not a bare backbone (AutoModel)."
            )
        linear = get_output()
        if linear is None:
            raise ValueError(
                f"{type(model).__name__}.get_output_embeddings() returned None: the model has no LM head; load it with "
                "AutoModelForCausalLM instead of AutoModel."
            )
        if not isinstance(linear, nn.Linear):
            raise ValueError(
                f"{type(model).__name__}.get_output_embeddings() is a {type(linear).__name__}, not an nn.Linear; "
                "MidxLMHead wraps a plain linear LM head (apply PEFT adapters to the backbone only, not to lm_head)."
            )
        vocab, dim = linear.weight.shape
        if config.num_samples >= vocab:
            raise ValueError(
                f"num_samples={config.num_samples} is not smaller than the vocabulary size {vocab}: sampling buys "
                f"nothing; lower num_samples (e.g. to {max(1, vocab // 10)}) or train with the full softmax."
            )
        host = _find_host(model, linear)
        loss_fn = host.loss_function
        if not host.__dict__.get("_loss_function") and getattr(loss_fn, "__name__", "") != "ForCausalLMLoss":
            raise ValueError(
                f"{type(host).__name__} computes its loss with {getattr(loss_fn, '__name__', loss_fn)!r}, not the "
                "causal-LM loss (ForCausalLMLoss); MidxLMHead supports causal language models only."
            )
        text_config = host.config.get_text_config() if hasattr(host.config, "get_text_config") else host.config
        softcap = getattr(text_config, "final_logit_softcapping", None)
        scale = 1.0
        if _is_number(getattr(host, "logit_scale", None)):
            scale *= float(host.logit_scale)  # Cohere
        if _is_number(getattr(text_config, "logits_scaling", None)):
            scale /= float(text_config.logits_scaling)  # Granite

        head = cls(
            linear,
            config,
            class_counts=class_counts,
            logit_softcap=float(softcap) if softcap is not None else None,
            logit_scale=scale,
        )
        # A new Module starts in training mode; the head must follow the model's mode (from_pretrained
        # returns models in eval mode, whose loss must stay exact until someone calls train()).
        head.train(linear.training)
        head.__dict__["_host"] = host
        try:
            params = list(inspect.signature(host.forward).parameters.values())
            positional = [p.name for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
            head._labels_position = positional.index("labels") if "labels" in positional else None
        except (TypeError, ValueError):
            head._labels_position = None
        _replace_module(model, linear, head)
        head._had_loss_function = "_loss_function" in host.__dict__
        if head._had_loss_function:
            warnings.warn(
                f"{type(host).__name__} has a custom loss_function; MidxLMHead keeps it for calls in eval mode "
                "but computes the sampled-softmax cross-entropy in training mode with labels.",
                stacklevel=2,
            )
        head._saved_loss_function = loss_fn
        host.register_forward_pre_hook(head._before_forward, with_kwargs=True)
        host.register_forward_hook(head._after_forward, with_kwargs=True, always_call=True)
        host.loss_function = head._loss_function
        if verify:
            try:
                head._verify(host)
            except ValueError:
                cls.unwrap(model)
                raise
        return model

    @classmethod
    def unwrap(cls, model: nn.Module) -> nn.Module:
        """Put the original ``nn.Linear`` back (same Parameter objects) and remove every hook (in place).

        Returns the same model, which then behaves as if it had never been wrapped.
        """
        head = cls.find(model)
        if head is None:
            raise ValueError("This model has no MidxLMHead to unwrap; MidxLMHead.wrap(model) was not called on it.")
        host = head._host
        head._sync_linear()
        _replace_module(model, head, head.linear)
        if host is not None:
            for store in ("_forward_pre_hooks", "_forward_hooks"):
                hooks = getattr(host, store)
                for key in [k for k, fn in hooks.items() if getattr(fn, "__self__", None) is head]:
                    del hooks[key]
                    for extra in _HOOK_FLAG_STORES:
                        getattr(host, extra, {}).pop(key, None)
            if host.__dict__.get("_loss_function") == head._loss_function:
                if head._had_loss_function:
                    host._loss_function = head._saved_loss_function
                else:
                    del host.__dict__["_loss_function"]
        head.__dict__["_host"] = None
        head._hidden = None
        head.last_queries = None
        return model

    @staticmethod
    def find(model: nn.Module) -> "MidxLMHead | None":
        """The ``MidxLMHead`` inside ``model`` (through PEFT / compile wrappers too), or None."""
        if not isinstance(model, nn.Module):
            return None
        for module in model.modules():
            if isinstance(module, MidxLMHead):
                return module
        return None

    # ------------------------------------------------------------------ verification
    @torch.no_grad()
    def _verify(self, host: nn.Module) -> None:
        """Check on 8 tokens that the head's logit transform and loss path reproduce the host's."""
        modes = [(m, m.training) for m in host.modules()]
        vocab = self.num_classes
        try:
            device = host.get_input_embeddings().weight.device
        except (AttributeError, NotImplementedError):
            device = self.weight.device
        ids = (torch.arange(1, 9, device=device) * 37 % vocab).unsqueeze(0)
        captured: list[torch.Tensor] = []
        hook = self.register_forward_hook(lambda mod, args, out: captured.append(args[0]))
        try:
            host.eval()
            try:
                out = host(input_ids=ids, labels=ids, use_cache=False)
            except Exception as err:  # the architecture needs more than input_ids; nothing to compare
                warnings.warn(
                    f"MidxLMHead could not verify {type(host).__name__} on plain input_ids "
                    f"({type(err).__name__}: {err}); check the eval loss against the unwrapped model yourself.",
                    stacklevel=3,
                )
                return
            if not captured or out.logits is None or out.logits.shape[-1] != vocab:
                raise ValueError(
                    f"{type(host).__name__}'s forward did not return the head's logits; MidxLMHead cannot wrap it."
                )
            logits = out.logits.float()
            bias = None if self.bias is None else self.bias.float() * self.logit_scale
            z = F.linear(captured[0].float() * self.logit_scale, self.weight.float(), bias)
            if self.logit_softcap is not None:
                z = self.logit_softcap * torch.tanh(z / self.logit_softcap)
            tol = 1e-4 if self.weight.dtype == torch.float32 else 3e-2
            err = float((z - logits).abs().max()) / max(float(logits.abs().max()), 1e-6)
            if err > tol:
                raise ValueError(
                    f"{type(host).__name__} transforms the LM head's output in a way MidxLMHead does not model "
                    f"(relative logit difference {err:.2e}); it cannot be wrapped."
                )
            with self.exact_loss_only():
                try:
                    out_exact = host(input_ids=ids, labels=ids, use_cache=False)
                except Exception as err:
                    raise ValueError(
                        f"{type(host).__name__} does not compute its loss through self.loss_function "
                        f"({type(err).__name__}: {err}); MidxLMHead cannot take over its loss."
                    ) from err
            loss, loss_exact = out.loss, out_exact.loss
            if loss is None or loss_exact is None or out_exact.logits.shape[-1] != 0:
                raise ValueError(
                    f"{type(host).__name__} does not compute its loss through self.loss_function; "
                    "MidxLMHead cannot take over its loss."
                )
            rel = abs(float(loss_exact) - float(loss)) / max(abs(float(loss)), 1e-6)
            if rel > tol and not self._had_loss_function:  # a custom loss may differ on purpose
                raise ValueError(
                    f"{type(host).__name__}: the head's exact loss {float(loss_exact):.6f} differs from the model's "
                    f"{float(loss):.6f}; the model's loss is not the causal-LM cross-entropy MidxLMHead reproduces."
                )
        finally:
            hook.remove()
            self._mode, self._hidden = _FULL, None
            for module, training in modes:
                module.training = training


def _find_host(model: nn.Module, linear: nn.Linear) -> nn.Module:
    """The innermost-first ``PreTrainedModel`` whose ``get_output_embeddings()`` is ``linear``."""
    from transformers import PreTrainedModel

    for module in model.modules():
        if isinstance(module, PreTrainedModel):
            try:
                if module.get_output_embeddings() is linear:
                    return module
            except (AttributeError, NotImplementedError):
                continue
    raise ValueError(
        f"Could not find the transformers PreTrainedModel that owns the LM head inside {type(model).__name__}; "
        "wrap a transformers causal LM (or a PEFT model around one)."
    )


def _replace_module(root: nn.Module, old: nn.Module, new: nn.Module) -> None:
    """Set every attribute of ``root``'s submodules that holds ``old`` to ``new``."""
    found = False
    for parent in list(root.modules()):
        for name, child in list(parent._modules.items()):
            if child is old:
                setattr(parent, name, new)
                found = True
    if not found:
        raise ValueError(f"The output layer {type(old).__name__} is not a submodule of {type(root).__name__}.")
