"""Training-token counts: their check (:func:`check_counts`, defined in :mod:`hf_midx._checks` for the exact
head, which sits above the samplers), and the smoothed unigram table that the unigram proposal, the MIDX
frequency last stage and the MIDX defensive mixture draw from. Shapes: V classes."""

from __future__ import annotations

import torch

from .._checks import check_counts, is_number  # noqa: F401 (check_counts: re-exported for the samplers)


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
