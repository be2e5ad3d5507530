"""The exact head: the ``MidxConfig.exact_head`` most frequent classes, scored exactly for every token.

:class:`~hf_midx.MidxLMHead` passes their ids to its sampler, which leaves them out of the draws
(``exclude=``), and to :func:`~hf_midx.sampled_softmax_loss` (``exact_ids=``). Shapes: V classes, H ids.
"""

from __future__ import annotations

import warnings

import torch

from .._checks import check_counts


def exact_head_ids(h: int, class_counts: torch.Tensor | None, num_classes: int) -> torch.Tensor | None:
    """(H,) int64 ids of the exact head: the ``h`` most frequent classes of the (V,) ``class_counts``, sorted;
    None when ``h`` is 0 or without counts (warned). ``h`` is ``config.exact_head`` fitted to V (at most V // 8,
    :meth:`MidxConfig.for_vocabulary`)."""
    if h == 0:
        return None
    if class_counts is None:
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


__all__ = ["exact_head_ids"]
