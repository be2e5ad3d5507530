"""Model surgery: put a :class:`~hf_midx.MidxLMHead` in place of a causal LM's output layer, and back.

As peft keeps ``get_peft_model`` apart from its layers: the layer (forward, loss, sampler) is
:mod:`hf_midx.integration.head`; this module finds the output layer and its owning model (the *host*), swaps the
modules, binds the host to the head (:class:`~hf_midx.integration.binding.HostBinding`: two removable hooks and the
host's ``loss_function``; the binding owns each training step's hand-off), and checks on 8 tokens that
the swap reproduces the model's logits and loss. Nothing is patched on a class: every change is made on
the instance and undone by :func:`unwrap`.
"""

from __future__ import annotations

import warnings

import torch
import torch.nn.functional as F
from torch import nn

from .._checks import is_number
from .binding import HostBinding, MidxFusedOutput, uses_causal_lm_loss
from ..config import MidxConfig
from .head import MidxLMHead, find_head
from .._ops import soft_cap
from .zero import full_shape, gathered

def wrap(
    model: nn.Module,
    config: MidxConfig | None = None,
    *,
    class_counts: torch.Tensor | None = None,
    verify: bool = True,
    **overrides,
) -> nn.Module:
    """Replace the model's output layer by a ``MidxLMHead`` (in place); returns the same model.

    While wrapped, ``resize_token_embeddings`` raises ValueError (the index is built for this V): unwrap, resize,
    wrap again. A PEFT model's ``merge_and_unload()`` returns the base model with the MIDX head still in place
    (it trains sampled; ``save_pretrained`` writes a plain model either way): ``hf_midx.unwrap(merged)`` gives
    the ``nn.Linear`` back.

    Args:
        model: a causal LM (``AutoModelForCausalLM``), possibly inside a PEFT wrapper, whose
            ``get_output_embeddings()`` is an ``nn.Linear`` (tied or not, with or without bias).
        config: the :class:`~hf_midx.MidxConfig`; defaults to ``MidxConfig()``.
        class_counts: (V,) training-token counts (e.g. ``hf_midx.token_counts``), for the "unigram"
            (required) and "log-uniform" samplers and the exact head; any finite non-negative
            weights are accepted, since only their ratios are used.
        verify: run two 8-token forwards in eval mode to check that the head reproduces the model's
            logits and loss (catches architectures that post-process logits in ways the head does
            not model); skipped with a warning if the model cannot run on plain ``input_ids``. A model
            partitioned by DeepSpeed ZeRO-3 is gathered whole for these forwards: pass ``verify=False``
            where it does not fit on one device.
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
    linear = _output_layer(model)
    vocab, _ = full_shape(linear.weight)  # a DeepSpeed ZeRO-3 weight is a (0,) slice here
    if config.num_samples >= vocab:
        raise ValueError(
            f"num_samples={config.num_samples} is not smaller than the vocabulary size {vocab}: sampling buys "
            f"nothing; lower num_samples (e.g. to {max(1, vocab // 10)}) or train with the full softmax."
        )
    if class_counts is not None and not bool(torch.as_tensor(class_counts).any()):
        warnings.warn(
            "hf_midx.wrap: class_counts are all zero, so the exact head, the unigram mixture and the frequency "
            "order they set mean nothing (every class ties). Pass the counts of the training tokens, "
            f"hf_midx.token_counts(ids, {vocab}) (labels of -100 are left out: are all of yours ignored?), or "
            "class_counts=None.",
            UserWarning,
            stacklevel=2,
        )
    host = _find_host(model, linear)
    loss_fn = host.loss_function
    if not uses_causal_lm_loss(host):
        raise ValueError(
            f"{type(host).__name__} computes its loss with {getattr(loss_fn, '__name__', loss_fn)!r}, not the "
            "causal-LM loss (ForCausalLMLoss); MidxLMHead supports causal language models only."
        )
    softcap, scale = _logit_transform(host)
    with gathered([linear.weight, linear.bias]):  # the sampler is built from the full (V, D) weight
        head = MidxLMHead(linear, config, class_counts=class_counts, logit_softcap=softcap, logit_scale=scale)
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
    binding.attach(callers=_callers(model, host))
    if verify:
        try:
            _verify(binding)
        except BaseException:  # a refusal, or anything else (out of memory, Ctrl-C): the model as it was
            unwrap(model)
            raise
    head.prepare_kernels()  # "auto" decided here on a CUDA head: a compiled or captured first step probes nothing
    return model


def _output_layer(model: nn.Module) -> nn.Linear:
    """The model's ``get_output_embeddings()``, which must be an ``nn.Linear``, else ValueError."""
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
    return linear


def _logit_transform(host: nn.Module) -> tuple[float | None, float]:
    """(cap, scale) of the host's logits: Gemma-2's ``final_logit_softcapping`` (or None), and Cohere's
    ``logit_scale`` times 1 / Granite's ``logits_scaling`` (or 1.0)."""
    text_config = host.config.get_text_config() if hasattr(host.config, "get_text_config") else host.config
    softcap = getattr(text_config, "final_logit_softcapping", None)
    scale = 1.0
    if is_number(getattr(host, "logit_scale", None)):
        scale *= float(host.logit_scale)  # Cohere
    if is_number(getattr(text_config, "logits_scaling", None)):
        scale /= float(text_config.logits_scaling)  # Granite
    return (float(softcap) if softcap is not None else None), scale


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
    """Check on 8 tokens that the head's logit transform and loss path reproduce the host's.

    A model built under DeepSpeed ZeRO-3 (``TrainingArguments`` with a stage-3 config created first) has every
    parameter partitioned and no engine yet to gather them around each forward: the check gathers the whole
    model once, for these two 8-token forwards (``wrap(..., verify=False)`` where it cannot fit on one device).
    """
    with gathered(binding.host.parameters()):
        _verify_gathered(binding)


def _verify_gathered(binding: HostBinding) -> None:
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
        z = soft_cap(F.linear(captured[0].float() * head.logit_scale, head.weight.float(), bias), head.logit_softcap)
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


def _callers(model: nn.Module, host: nn.Module) -> list[nn.Module]:
    """The modules of ``model`` (outside the host) that hold the host as their ``model``: PEFT's tuner (``LoraModel``),
    which peft 0.20 runs as ``self.model.forward(...)``, past the host's hooks, and the ``PeftModel`` around it."""
    return [m for m in model.modules() if m is not host and getattr(m, "model", None) is host]


def _replace_module(root: nn.Module, old: nn.Module, new: nn.Module) -> None:
    """Set every attribute of ``root``'s submodules that holds ``old`` to ``new``."""
    paths = [name for name, module in root.named_modules(remove_duplicate=False) if module is old and name]
    if not paths:
        raise ValueError(f"The output layer {type(old).__name__} is not a submodule of {type(root).__name__}.")
    for path in paths:
        root.set_submodule(path, new)


__all__ = ["HostBinding", "MidxFusedOutput", "unwrap", "wrap"]
