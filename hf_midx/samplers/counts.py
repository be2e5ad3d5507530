"""Training-token counts: their check (:func:`check_counts`, defined in :mod:`hf_midx._checks` for the exact
head, which sits above the samplers), and the smoothed unigram table that the unigram proposal, the MIDX
frequency last stage and the MIDX defensive mixture draw from. Shapes: V classes."""

from __future__ import annotations

import torch

from .._checks import check_counts, is_number  # noqa: F401 (check_counts: re-exported for the samplers)


#: How a unigram table weighs a class by its count: (count + smoothing) ** power, or log(1 + count + smoothing)
#: ** power (the paper's code: log(count + 1), i.e. smoothing 0).
UNIGRAM_WEIGHTINGS = ("count", "log-count")


def check_unigram_options(options: dict) -> None:
    """The options of a unigram table, when given: ``unigram_smoothing`` and ``unigram_power`` numbers >= 0,
    ``unigram_weighting`` one of :data:`UNIGRAM_WEIGHTINGS`."""
    for name in ("unigram_smoothing", "unigram_power"):
        if name in options and not (is_number(options[name]) and options[name] >= 0):
            raise ValueError(f"{name} must be a number >= 0, got {options[name]!r}.")
    if options.get("unigram_weighting", "count") not in UNIGRAM_WEIGHTINGS:
        raise ValueError(f"unigram_weighting must be one of {UNIGRAM_WEIGHTINGS}, got {options['unigram_weighting']!r}.")


def unigram_log_table(counts: torch.Tensor, smoothing: float, power: float, weighting: str = "count") -> torch.Tensor:
    """(V,) float32 log of the normalized weights: (count + smoothing) ** power, or with ``weighting="log-count"``
    log(1 + count + smoothing) ** power. ValueError if all weights are 0, or, for log-count, if one is (a class
    never drawn would leave the corrected label's log q at -inf)."""
    base = counts + smoothing if weighting == "count" else torch.log1p(counts + smoothing)
    weights = base**power
    if not bool((weights > 0).any()):
        raise ValueError("class_counts are all zero; pass real counts or unigram_smoothing > 0.")
    if weighting == "log-count" and not bool((weights > 0).all()):
        raise ValueError("unigram_weighting='log-count' gives a class of count 0 no weight; pass unigram_smoothing > 0.")
    return (weights / weights.sum()).log().float()
