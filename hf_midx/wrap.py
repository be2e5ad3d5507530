"""Model surgery: put a :class:`~hf_midx.MidxLMHead` in place of a causal LM's output layer, and back.

As peft keeps ``get_peft_model`` apart from its layers: the layer (forward, loss, sampler) is
:mod:`hf_midx.head`; this module finds the output layer and its owning model (the *host*), swaps the
modules, binds the host to the head (:class:`HostBinding`: two removable hooks and the host's
``loss_function``), and checks on 8 tokens that the swap reproduces the model's logits and loss.
Nothing here is patched on a class: every change is made on the instance and undone by :func:`unwrap`.
"""

from __future__ import annotations

import inspect
import warnings
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from transformers.utils import ModelOutput

from .config import MidxConfig
from .head import MidxLMHead, find_head


def _causal_lm_loss_reference(
    logits, labels, vocab_size=None, num_items_in_batch=None, ignore_index=-100, shift_labels=None, **kwargs
):
    """Signature of transformers' ``ForCausalLMLoss``; used only to bind the host's call arguments."""


_LOSS_SIGNATURE = inspect.signature(_causal_lm_loss_reference)
_CAUSAL_LM_LOSS_TYPE = "ForCausalLM"


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


class HostBinding:
    """Everything :func:`wrap` changed on the host model, and the routing of each host call to the head.

    It holds the removable handles of a forward pre-hook and a forward hook on the host, the host's
    own ``loss_function`` (replaced on the instance by :meth:`loss_function`) and ``loss_type``, and
    where ``labels`` sits among the forward's positional arguments. :meth:`remove` undoes all of it.

    Per host call, the pre-hook looks at the call's ``labels``:

    * no labels, or eval mode outside ``head.exact_loss_only()``: full logits, so ``generate()``,
      pipelines and evaluation behave exactly as before;
    * training mode with labels: the head captures its input and returns a (B, S, 0) placeholder, and
      the host's loss computes :func:`hf_midx.sampled_softmax_loss` with ``ForCausalLMLoss`` label
      semantics. **In training, ``outputs.logits`` is that placeholder**;
    * inside ``head.exact_loss_only()`` with labels: the same, with the exact full-softmax loss;
    * training mode with labels and ``fused_lm_head=True`` (TRL's trainers, after
      ``trl.trainer.utils.add_fused_lm_head``): the sampled loss, returned as :class:`MidxFusedOutput`
      (``log_probs`` of the sampled softmax, ``entropy`` / ``is_top1`` NaN). Outside training mode
      TRL's own exact, tiled computation runs unchanged.

    The forward hook (``always_call=True``) ends the call. A Trainer's training call (it passes
    ``num_items_in_batch``) to a head that no :class:`~hf_midx.MidxCallback` schedules warns once.

    The host's ``loss_type`` is set to ``"ForCausalLM"`` where it names no causal-LM loss (GPT-2
    declares none): the head always shifts the labels, and the Trainer reads ``loss_type`` to count
    ``num_items_in_batch`` over ``labels[..., 1:]``.
    """

    def __init__(self, head: MidxLMHead, host: nn.Module) -> None:
        self.head, self.host = head, host
        self.handles: list[Any] = []
        self.had_loss_function = "_loss_function" in host.__dict__
        self.saved_loss_function = host.loss_function
        self.saved_loss_type = getattr(host, "loss_type", None)
        try:
            params = list(inspect.signature(host.forward).parameters.values())
            positional = [p.name for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
            self.labels_position = positional.index("labels") if "labels" in positional else None
        except (TypeError, ValueError):
            self.labels_position = None
        self._exact = False
        self._fused: dict[str, Any] | None = None  # set for a training call with fused_lm_head=True
        self._warned_unhooked = self._warned_unscheduled = self._warned_full_training = False

    def attach(self) -> None:
        """Register the hooks, replace the host's ``loss_function`` and declare its loss type."""
        from transformers.loss.loss_utils import LOSS_MAPPING, ForCausalLMLoss

        host = self.host
        self.handles = [
            host.register_forward_pre_hook(self.before_forward, with_kwargs=True),
            host.register_forward_hook(self.after_forward, with_kwargs=True, always_call=True),
        ]
        host.loss_function = self.loss_function
        if LOSS_MAPPING.get(self.saved_loss_type) is not ForCausalLMLoss:
            host.loss_type = _CAUSAL_LM_LOSS_TYPE
        self.head.binding = self

    def remove(self) -> None:
        """Remove the hooks and give the host back its loss function and loss type."""
        for handle in self.handles:
            handle.remove()
        self.handles = []
        host = self.host
        if host.__dict__.get("_loss_function") == self.loss_function:
            if self.had_loss_function:
                host.loss_function = self.saved_loss_function
            else:
                del host.__dict__["_loss_function"]
        if getattr(host, "loss_type", None) == _CAUSAL_LM_LOSS_TYPE:
            host.loss_type = self.saved_loss_type
        self.reset()
        self.head.binding = None

    def reset(self) -> None:
        """End the current call: full logits again, nothing kept."""
        self.head.capturing = False
        self.head.take_hidden()
        self._exact, self._fused = False, None

    # ------------------------------------------------------------------ the hooks
    def before_forward(self, module: nn.Module, args: tuple, kwargs: dict):
        head = self.head
        labels = kwargs.get("labels")
        if labels is None and self.labels_position is not None and len(args) > self.labels_position:
            labels = args[self.labels_position]
        fused = bool(kwargs.get("fused_lm_head"))
        only_shifted = labels is None and fused and kwargs.get("shift_labels") is not None
        if only_shifted:
            # TRL under context parallelism passes pre-shifted labels only; the model computes a loss
            # only when it gets labels, and the loss then uses shift_labels (ForCausalLMLoss semantics).
            labels = kwargs["shift_labels"]
        self.reset()
        if labels is None and head.training and torch.is_grad_enabled() and not self._warned_full_training:
            self._warned_full_training = True
            warnings.warn(
                "MidxLMHead computed full logits in training mode with gradients: the model was called without "
                "labels, so whatever loss the caller builds from these logits trains the full softmax, not the "
                "sampled one (e.g. label smoothing or a compute_loss_func). Pass labels to the model to train "
                "with MIDX.",
                stacklevel=2,
            )
        if labels is None or not (head.exact_only or head.training):
            return None
        head.capturing, self._exact = True, head.exact_only
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
        if fused:
            # TRL asks for its fused output; its fused forward would compute the exact softmax and never
            # call this head. Run the model's own forward (the sampled loss) and convert the output after.
            self._fused = {}
            kwargs = {k: v for k, v in kwargs.items() if k != "fused_lm_head"}
            if only_shifted:
                kwargs["labels"] = labels
            return args, kwargs
        return None

    def after_forward(self, module: nn.Module, args: tuple, kwargs: dict, output: Any):
        fused = self._fused
        self.reset()
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

    def loss_function(self, *args, **kwargs) -> torch.Tensor:
        """Installed as the host's ``loss_function``; same call contract as ``ForCausalLMLoss``."""
        head = self.head
        hidden = head.take_hidden() if head.capturing else None
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
            return self.saved_loss_function(*args, **kwargs)
        bound = _LOSS_SIGNATURE.bind(*args, **kwargs).arguments
        labels, shift_labels = bound.get("labels"), bound.get("shift_labels")
        ignore_index = bound.get("ignore_index", -100)
        num_items = bound.get("num_items_in_batch")
        if self._fused is not None:
            per_token = head.loss_from_hidden(
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
        return head.loss_from_hidden(
            hidden,
            labels,
            shift_labels=shift_labels,
            num_items_in_batch=num_items,
            ignore_index=ignore_index,
            exact=self._exact,
        )


def _is_number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def wrap(
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
        class_counts: (V,) training-token counts, for the "unigram" (required) and "log-uniform"
            samplers and the exact head.
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
    if find_head(model) is not None:
        raise ValueError("This model is already wrapped by MidxLMHead; call hf_midx.unwrap(model) first to wrap it again.")
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
    vocab, _ = linear.weight.shape
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

    head = MidxLMHead(
        linear,
        config,
        class_counts=class_counts,
        logit_softcap=float(softcap) if softcap is not None else None,
        logit_scale=scale,
    )
    # A new Module starts in training mode; the head must follow the model's mode (from_pretrained
    # returns models in eval mode, whose loss must stay exact until someone calls train()).
    head.train(linear.training)
    try:
        _replace_module(model, linear, head)
    except ValueError:
        head.sync_linear()  # the Linear gets its parameters back
        raise
    binding = HostBinding(head, host)
    if binding.had_loss_function:
        warnings.warn(
            f"{type(host).__name__} has a custom loss_function; MidxLMHead keeps it for calls in eval mode "
            "but computes the sampled-softmax cross-entropy in training mode with labels.",
            stacklevel=2,
        )
    binding.attach()
    if verify:
        try:
            _verify(binding)
        except BaseException:  # a refusal, or anything else (out of memory, Ctrl-C): the model as it was
            unwrap(model)
            raise
    return model


def unwrap(model: nn.Module) -> nn.Module:
    """Put the original ``nn.Linear`` back (same Parameter objects) and remove every hook (in place).

    Returns the same model, which then behaves as if it had never been wrapped.
    """
    head = find_head(model)
    if head is None:
        raise ValueError("This model has no MidxLMHead to unwrap; hf_midx.wrap(model) was not called on it.")
    head.sync_linear()
    _replace_module(model, head, head.linear)
    if head.binding is not None:
        head.binding.remove()
    head.step_data.clear()
    return model


@torch.no_grad()
def _verify(binding: HostBinding) -> None:
    """Check on 8 tokens that the head's logit transform and loss path reproduce the host's."""
    head, host = binding.head, binding.host
    modes = [(m, m.training) for m in host.modules()]
    vocab = head.num_classes
    try:
        device = host.get_input_embeddings().weight.device
    except (AttributeError, NotImplementedError):
        device = head.weight.device
    ids = (torch.arange(1, 9, device=device) * 37 % vocab).unsqueeze(0)
    captured: list[torch.Tensor] = []
    hook = head.register_forward_hook(lambda mod, args, out: captured.append(args[0]))
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
        bias = None if head.bias is None else head.bias.float() * head.logit_scale
        z = F.linear(captured[0].float() * head.logit_scale, head.weight.float(), bias)
        if head.logit_softcap is not None:
            z = head.logit_softcap * torch.tanh(z / head.logit_softcap)
        tol = 1e-4 if head.weight.dtype == torch.float32 else 3e-2
        err = float((z - logits).abs().max()) / max(float(logits.abs().max()), 1e-6)
        if err > tol:
            raise ValueError(
                f"{type(host).__name__} transforms the LM head's output in a way MidxLMHead does not model "
                f"(relative logit difference {err:.2e}); it cannot be wrapped."
            )
        with head.exact_loss_only():
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
        if rel > tol and not binding.had_loss_function:  # a custom loss may differ on purpose
            raise ValueError(
                f"{type(host).__name__}: the head's exact loss {float(loss_exact):.6f} differs from the model's "
                f"{float(loss):.6f}; the model's loss is not the causal-LM cross-entropy MidxLMHead reproduces."
            )
    finally:
        hook.remove()
        binding.reset()
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
    paths = [name for name, module in root.named_modules(remove_duplicate=False) if module is old and name]
    if not paths:
        raise ValueError(f"The output layer {type(old).__name__} is not a submodule of {type(root).__name__}.")
    for path in paths:
        root.set_submodule(path, new)


__all__ = ["HostBinding", "MidxFusedOutput", "unwrap", "wrap"]
