"""The closed form of a proposal that the expected tail gradient (:mod:`hf_midx.tail_gradient`) reads."""

from __future__ import annotations

from typing import NamedTuple

import torch


class ProposalFactors(NamedTuple):
    """A proposal in the closed form the expected tail gradient needs (see :mod:`hf_midx.tail_gradient`):

    Q(i | z_t) = probs[t, bucket[i]] * member[i] + static[i]

    probs: (T, B) float32 per-query bucket terms, or None (a static proposal); bucket: (V,) int64 in [0, B);
    member: (V,) float32 a class's share of its bucket (times the mixture's weight), or None when that share
    is already in ``probs`` (1); static: (V,) float32 or None, the query-independent part (times its weight).
    A class the proposal never draws has 0 in member (or in its bucket's probs) and static.
    """

    probs: torch.Tensor | None
    bucket: torch.Tensor | None
    member: torch.Tensor | None
    static: torch.Tensor | None


__all__ = ["ProposalFactors"]
