"""Model surgery: put a :class:`~hf_midx.MidxLMHead` in place of a causal LM's output layer, and back.

The layer itself (forward, loss, sampler) lives in :mod:`hf_midx.head`; this module only finds the
output layer and its owning model (the *host*), swaps the modules, installs and removes the hooks, and
checks on 8 tokens that the swap reproduces the model's logits and loss. Nothing here is patched on a
class: every change is made on the instance and undone by :func:`unwrap`.

``MidxLMHead.wrap`` / ``MidxLMHead.unwrap`` / ``MidxLMHead.find`` are the same functions.
"""

from __future__ import annotations

import inspect
import warnings

import torch
import torch.nn.functional as F
from torch import nn

from .config import MidxConfig
from .head import MidxLMHead, find_head

# nn.Module dicts that flag a hook id (with_kwargs / always_call); cleaned with the hook on unwrap.
_HOOK_FLAG_STORES = ("_forward_pre_hooks_with_kwargs", "_forward_hooks_with_kwargs", "_forward_hooks_always_called")


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
    if find_head(model) is not None:
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
    head.__dict__["_host"] = host
    try:
        params = list(inspect.signature(host.forward).parameters.values())
        positional = [p.name for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
        head._labels_position = positional.index("labels") if "labels" in positional else None
    except (TypeError, ValueError):
        head._labels_position = None
    try:
        _replace_module(model, linear, head)
    except ValueError:
        head._sync_linear()  # the Linear gets its parameters back
        raise
    head._had_loss_function = "_loss_function" in host.__dict__
    if head._had_loss_function:
        warnings.warn(
            f"{type(host).__name__} has a custom loss_function; MidxLMHead keeps it for calls in eval mode "
            "but computes the sampled-softmax cross-entropy in training mode with labels.",
            stacklevel=3,
        )
    head._saved_loss_function = loss_fn
    host.register_forward_pre_hook(head._before_forward, with_kwargs=True)
    host.register_forward_hook(head._after_forward, with_kwargs=True, always_call=True)
    host.loss_function = head._loss_function
    if verify:
        try:
            _verify(head, host)
        except ValueError:
            unwrap(model)
            raise
    return model


def unwrap(model: nn.Module) -> nn.Module:
    """Put the original ``nn.Linear`` back (same Parameter objects) and remove every hook (in place).

    Returns the same model, which then behaves as if it had never been wrapped.
    """
    head = find_head(model)
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
    head.clear_step_data()
    return model


@torch.no_grad()
def _verify(head: MidxLMHead, host: nn.Module) -> None:
    """Check on 8 tokens that the head's logit transform and loss path reproduce the host's."""
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
                stacklevel=4,
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
        if rel > tol and not head._had_loss_function:  # a custom loss may differ on purpose
            raise ValueError(
                f"{type(host).__name__}: the head's exact loss {float(loss_exact):.6f} differs from the model's "
                f"{float(loss):.6f}; the model's loss is not the causal-LM cross-entropy MidxLMHead reproduces."
            )
    finally:
        hook.remove()
        head._reset_call_state()
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


__all__ = ["unwrap", "wrap"]
