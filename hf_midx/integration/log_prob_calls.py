"""Which training calls that ask for per-token log-probabilities the sampled softmax may answer.

TRL's trainers (DPO, KTO, GRPO, RLOO, SFT) ask a model for per-token log-probabilities with
``model(..., labels=..., fused_lm_head=True)``. A sampled softmax can only *estimate* them: its log Z is a
self-normalized importance-sampling estimate, biased and noisy per token. That is harmless for a loss that is
the plain next-token NLL (the sum of the log-probs: the sampled softmax's own objective), and wrong for everything
else: policy-gradient ratios, KL penalties, preference margins and DFT weights are nonlinear in the values, and
nothing downstream can tell an estimate from the exact number.

So the decision is made from what the trainer asks for, read once at train start from its arguments, not from
its class: only a trainer whose arguments declare the plain NLL (``loss_type="nll"``, SFTTrainer's default) gets
the sampled softmax on those calls; every other one (and any call without gradients: reference and old-policy
log-probs, metrics) gets TRL's exact, tiled computation over all V classes, which never builds the (tokens x V)
logits. Where nothing says what the loss is (no :class:`~hf_midx.MidxCallback` read the arguments), the calls are
exact and the binding says so once.

``MidxConfig(log_probs="exact-forward")`` keeps the values exact and estimates only their gradient
(:mod:`hf_midx.losses.log_probs`): it needs the temperature TRL's head divides the logits by, read from the same
arguments (``temperature`` of GRPO and RLOO, else 1).
"""

from __future__ import annotations

from dataclasses import dataclass

#: Values of a trainer's ``loss_type`` that name the plain next-token NLL of the labels (TRL's SFTConfig).
NLL_LOSS_TYPES = ("nll",)


#: How a call with gradients is answered: the sampled softmax's estimate, TRL's exact tiled head, or exact values with
#: the gradient estimated (:mod:`hf_midx.losses.log_probs`).
ROUTES = ("sampled", "exact", "exact-forward")


@dataclass(frozen=True)
class LogProbDecision:
    """How a training run's log-prob calls with gradients are answered.

    Attributes:
        route: one of :data:`ROUTES`.
        reason: one line for the log, naming the trainer's arguments and what follows from them.
        temperature: the temperature TRL's fused head divides the logits by: ``args.temperature``, which GRPO and RLOO
            pass to ``add_fused_lm_head``; 1.0 where the arguments have none (DPO, KTO, SFT, whose heads use 1.0).
            The "exact-forward" route applies it.
    """

    route: str
    reason: str
    temperature: float = 1.0


def decide_log_probs(mode: str, args, trainer_name: str | None = None) -> LogProbDecision:
    """The decision for a run of ``args`` (a ``TrainingArguments``, e.g. TRL's ``SFTConfig`` / ``DPOConfig``)
    under ``MidxConfig.log_probs`` = ``mode``.

    Raises:
        ValueError: ``mode="sampled"`` for a trainer whose arguments name another loss than the plain NLL (its
            ratios, KL or margins would be built on estimates), or Liger's fused linear cross-entropy, which
            replaces the model's forward and so never calls the MIDX head. Both before the first step.
    """
    who = trainer_name or type(args).__name__
    loss_type = getattr(args, "loss_type", None)
    liger = getattr(args, "use_liger_kernel", False) and (getattr(args, "liger_kernel_config", None) or {}).get(
        "fused_linear_cross_entropy", True
    )
    if liger:
        raise ValueError(
            f"{who}: use_liger_kernel=True applies Liger's fused linear cross-entropy, which replaces the model's "
            "forward and computes the full softmax from lm_head.weight, so the MIDX head would never run (and its "
            "index would be rebuilt for nothing). Drop use_liger_kernel, or keep Liger's other kernels with "
            "liger_kernel_config={'fused_linear_cross_entropy': False}."
        )
    nll = loss_type in NLL_LOSS_TYPES
    declared = f"loss_type={loss_type!r}" if loss_type is not None else "no loss_type"
    if mode == "sampled" and loss_type is not None and not nll:
        raise ValueError(
            f"MidxConfig(log_probs='sampled') with {who} ({declared}): that loss is built on per-token log-probs "
            "(ratios, KL penalties, preference margins or weights), which the sampled softmax can only estimate, "
            "biased. Use log_probs='auto' (exact log-probs for this trainer) or 'exact'."
        )
    if mode == "exact-forward":
        temperature = float(getattr(args, "temperature", None) or 1.0)
        return LogProbDecision("exact-forward", (
            f"hf_midx: MidxConfig(log_probs='exact-forward'): {who}'s per-token log-probabilities are exact over all V "
            f"classes (temperature {temperature:g}); their gradient is estimated from the exact head and the draws."
        ), temperature)
    if mode == "auto" and loss_type is None:
        return LogProbDecision("exact", (
            f"hf_midx: {who} declares no loss_type: its model calls with labels train on the sampled softmax; a call "
            "asking for per-token log-probabilities (fused_lm_head=True), if any, is exact over all V classes."
        ))
    if mode == "exact" or (mode == "auto" and not nll):
        return LogProbDecision("exact", (
            f"hf_midx: {who} ({declared}) asks for per-token log-probabilities that its loss uses as exact values; "
            "they are computed exactly over all V classes (TRL's tiled head, no (tokens x V) logits), at the "
            "unwrapped model's cost; only a plain next-token NLL (loss_type='nll') trains on the sampled softmax."
            if mode == "auto" else
            f"hf_midx: MidxConfig(log_probs='exact'): {who}'s per-token log-probabilities are exact over all V classes."
        ))
    return LogProbDecision("sampled", (
        f"hf_midx: {who} ({declared}) trains on the plain next-token NLL: its per-token log-probabilities with "
        "gradients come from the sampled softmax (their values are estimates); calls without gradients are exact."
    ))


__all__ = ["LogProbDecision", "NLL_LOSS_TYPES", "ROUTES", "decide_log_probs"]
