"""The exact head: the ``MidxConfig.exact_head`` most frequent classes, scored exactly for every token.

:class:`~hf_midx.MidxLMHead` passes their ids to its sampler, which leaves them out of the draws
(``exclude=``), and to :func:`~hf_midx.sampled_softmax_loss` (``exact_ids=``). Shapes: V classes, H ids.
"""

from __future__ import annotations

import logging
import warnings

import torch

from .._checks import check_counts
from ..defaults import EXACT_HEAD_MAX, EXACT_HEAD_SHARE

logger = logging.getLogger(__name__)


def choose_exact_head(class_counts: torch.Tensor, num_classes: int, *, share: float, most: int) -> tuple[int, float]:
    """``exact_head="auto"``: the smallest H whose most frequent classes hold ``share`` of the (V,) ``class_counts``,
    at most ``most`` and V // 8. Returns (H, the share of the counts those H classes hold)."""
    counts = check_counts(class_counts, num_classes, "cpu").double()
    total = float(counts.sum())
    limit = min(most, num_classes // 8)
    if total <= 0 or limit == 0:
        return 0, 0.0
    held = torch.sort(counts, descending=True).values[:limit].cumsum(0) / total
    h = min(int(torch.searchsorted(held, torch.tensor([share], dtype=held.dtype))[0]) + 1, limit)
    return h, float(held[h - 1])


def auto_exact_head(class_counts: torch.Tensor, num_classes: int) -> int:
    """``MidxConfig(exact_head="auto")`` made a number: :func:`choose_exact_head` with the defaults' share and bound,
    said once in the log (the head calls it once, at wrap)."""
    h, held = choose_exact_head(class_counts, num_classes, share=EXACT_HEAD_SHARE, most=EXACT_HEAD_MAX)
    limit = min(EXACT_HEAD_MAX, num_classes // 8)
    bound = f", at the bound min({EXACT_HEAD_MAX}, V/8) = {limit}" if h == limit else ""
    logger.info("hf_midx: exact_head='auto': H = %d most frequent classes, holding %.1f%% of the training tokens "
                "(target %.0f%%%s; V = %d).", h, 100 * held, 100 * EXACT_HEAD_SHARE, bound, num_classes)
    return h


def exact_head_ids(h: int, class_counts: torch.Tensor | None, num_classes: int) -> torch.Tensor | None:
    """(H,) int64 ids of the exact head: the ``h`` most frequent classes of the (V,) ``class_counts``, sorted;
    None when ``h`` is 0 or without counts (warned). ``h`` is ``config.exact_head`` fitted to V (at most V // 8,
    :meth:`MidxConfig.for_vocabulary`)."""
    if h == 0:
        return None
    if class_counts is None:
        h = repr(h) if isinstance(h, str) else h
        warnings.warn(
            f"MidxLMHead: exact_head={h} needs class_counts (training-token frequencies) to pick the most "
            "frequent classes; without them the exact head is off. Pass class_counts= to wrap.",
            UserWarning,
            stacklevel=4,
        )
        return None
    counts = check_counts(class_counts, num_classes, "cpu")  # every sampler's head, not only those that read them
    # stable ranking: ties broken by class id, so every rank picks the same head.
    return torch.sort(torch.sort(-counts, stable=True).indices[:h]).values


__all__ = ["auto_exact_head", "choose_exact_head", "exact_head_ids"]
