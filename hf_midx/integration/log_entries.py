"""What :class:`~hf_midx.MidxCallback` changes in a Trainer's log entries besides its own ``midx/`` keys.

* An evaluation entry (``<prefix>_loss`` with ``<prefix>_runtime``) gets ``<prefix>_perplexity`` = exp(loss), so
  any Trainer with the callback reports it (MidxTrainer already adds it in its evaluation loop). The Trainer
  logs the very dict that ``evaluate()`` returns, so the returned metrics have it too.
* A training entry loses the metrics that need the full softmax's logits, which a wrapped model does not compute
  in training: TRL's SFTTrainer logs them as NaN (``entropy``, ``mean_token_accuracy``). They are left out, with
  one warning saying why; evaluation, exact, still reports them.
"""

from __future__ import annotations

import math
import warnings

from .model_card import perplexity

#: Training metrics that TRL computes from the full logits; NaN from a wrapped model in training.
FULL_SOFTMAX_METRICS = ("entropy", "mean_token_accuracy")


def add_perplexity(logs: dict[str, float]) -> dict[str, float]:
    """``<prefix>_perplexity`` for each evaluation ``<prefix>_loss`` of ``logs`` (not there yet); returns the added."""
    added = {}
    for key, value in logs.items():
        prefix = key[: -len("_loss")]
        if key.endswith("_loss") and prefix != "train" and f"{prefix}_runtime" in logs:
            if f"{prefix}_perplexity" not in logs and isinstance(value, (int, float)):
                added[f"{prefix}_perplexity"] = perplexity(value)
    logs.update(added)
    return added


class FullSoftmaxMetrics:
    """Leaves NaN :data:`FULL_SOFTMAX_METRICS` out of training log entries, warning once per instance."""

    def __init__(self) -> None:
        self.warned = False

    def drop(self, logs: dict[str, float]) -> list[str]:
        """Remove them from ``logs`` (a training entry: one with ``loss``, or the training summary, with
        ``train_runtime``, where TRL puts the steps' values when no step was logged); returns the removed keys."""
        if "loss" not in logs and "train_runtime" not in logs:
            return []
        dropped = [k for k in FULL_SOFTMAX_METRICS if isinstance(logs.get(k), float) and math.isnan(logs[k])]
        for key in dropped:
            del logs[key]
        if dropped and not self.warned:
            self.warned = True
            warnings.warn(
                f"MidxCallback: {' and '.join(dropped)} are left out of the training logs: they need the full "
                "softmax's logits, which the MIDX head does not compute in training (evaluation, exact, reports "
                "them; midx/train_loss_exact is the exact loss of the last micro-batch).",
                stacklevel=2,
            )
        return dropped


__all__ = ["FULL_SOFTMAX_METRICS", "FullSoftmaxMetrics", "add_perplexity"]
