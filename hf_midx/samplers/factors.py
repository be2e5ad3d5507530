"""The closed form of a proposal that the expected tail gradient (:mod:`hf_midx.tail_gradient`) reads."""

from __future__ import annotations

from typing import NamedTuple

import torch

#: (index (N,) int64, offsets (bags,) int64, weights (N,) float32): the arguments of
#: ``torch.nn.functional.embedding_bag(index, rows, offsets, mode="sum", per_sample_weights=weights)``.
Bags = tuple[torch.Tensor, torch.Tensor, torch.Tensor]


class ProposalFactors(NamedTuple):
    """A proposal in the closed form the expected tail gradient needs (see :mod:`hf_midx.tail_gradient`):

    Q(i | z_t) = sum_b probs[t, b] S[b, i] + S[B, i]

    probs: (T, B) float32 per-query terms of the proposal's buckets, or None (a static proposal: B = 0). S is a
    fixed (B + 1, V) matrix: row b < B a bucket's classes, each weighted by its share of the bucket (times the
    mixture's weight; 1 when that share is already in ``probs``), row B the query-independent part (times its
    weight; empty without one). A class the proposal never draws has a zero column. S is kept twice, as
    embedding bags, since it changes only with the index (the sampler builds both at a refresh):

    rows: S by rows, B + 1 bags over the classes: ``embedding_bag`` of (V, C) rows gives S @ rows, (B + 1, C);
    columns: S by columns, V bags over the B + 1 rows: ``embedding_bag`` of a (B + 1, C) table gives S^T @ table,
    (V, C).
    """

    probs: torch.Tensor | None
    rows: Bags
    columns: Bags


def proposal_bags(bucket: torch.Tensor, member: torch.Tensor, static: torch.Tensor | None,
                  num_buckets: int) -> tuple[Bags, Bags]:
    """(rows, columns) of :class:`ProposalFactors` for the (V,) int64 ``bucket`` in [0, B) of each class, its
    (V,) float32 weight in that row (0 for a class the bucket terms never draw) and (V,) float32 ``static`` or
    None (B = ``num_buckets``). Sorts the classes once: for a refresh, not for a step."""
    v = bucket.shape[0]
    order = torch.sort(bucket, stable=True).indices  # the classes by bucket: a row's bag is a slice of them
    # Row b's bag starts where bucket b does; row B's (the static one, or empty) after the last bucket, at V.
    offsets = torch.searchsorted(bucket[order], torch.arange(num_buckets + 1, device=bucket.device))
    classes = torch.arange(v, device=bucket.device)
    if static is None:
        return (order, offsets, member[order]), (bucket, classes, member)
    rows = (torch.cat([order, classes]), offsets, torch.cat([member[order], static]))
    columns = (torch.stack([bucket, torch.full_like(bucket, num_buckets)], 1).view(-1), classes * 2,
               torch.stack([member, static], 1).view(-1))
    return rows, columns


def static_factors(static: torch.Tensor) -> ProposalFactors:
    """The factors of a static proposal, (V,) float32 ``static`` (B = 0: S is its one row)."""
    classes = torch.arange(static.shape[0], device=static.device)
    return ProposalFactors(None, (classes, classes.new_zeros(1), static), (torch.zeros_like(classes), classes, static))


__all__ = ["Bags", "ProposalFactors", "proposal_bags", "static_factors"]
