"""Training-token counts: their check, and the smoothed unigram table that the unigram proposal, the MIDX
frequency last stage and the MIDX defensive mixture draw from. Shapes: V classes."""

from __future__ import annotations

import torch

from .._checks import is_number


def check_counts(class_counts, num_classes: int, device) -> torch.Tensor:
    """(V,) float64 training-token counts, validated (finite, non-negative, right length)."""
    if class_counts is None:
        raise ValueError(
            "This sampler needs class_counts: a (V,) tensor of training-token frequencies "
            "(e.g. torch.bincount(train_ids, minlength=V))."
        )
    counts = torch.as_tensor(class_counts, dtype=torch.float64, device=device)
    if counts.shape != (num_classes,):
        raise ValueError(f"class_counts must have shape ({num_classes},), got {tuple(counts.shape)}.")
    if not bool(torch.isfinite(counts).all()) or bool((counts < 0).any()):
        raise ValueError("class_counts must be finite and non-negative.")
    return counts


def check_unigram_options(options: dict) -> None:
    """The options of a unigram table, ``unigram_smoothing`` and ``unigram_power``, when given: numbers >= 0."""
    for name in ("unigram_smoothing", "unigram_power"):
        if name in options and not (is_number(options[name]) and options[name] >= 0):
            raise ValueError(f"{name} must be a number >= 0, got {options[name]!r}.")


def unigram_log_table(counts: torch.Tensor, smoothing: float, power: float) -> torch.Tensor:
    """(V,) float32 log of (count + smoothing) ** power, normalized; ValueError if all weights are 0."""
    weights = (counts + smoothing) ** power
    if not bool((weights > 0).any()):
        raise ValueError("class_counts are all zero; pass real counts or unigram_smoothing > 0.")
    return (weights / weights.sum()).log().float()
