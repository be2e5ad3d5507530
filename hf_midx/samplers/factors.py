"""The closed form of a proposal that the expected tail gradient (:mod:`hf_midx.losses.tail_gradient`) reads."""

from __future__ import annotations

from typing import NamedTuple

import torch

#: (index (N,) int64, offsets (bags,) int64, weights (N,) float32): the arguments of
#: ``torch.nn.functional.embedding_bag(index, rows, offsets, mode="sum", per_sample_weights=weights)``.
Bags = tuple[torch.Tensor, torch.Tensor, torch.Tensor]

#: The most classes one chunk of a bucket's row sums (one bag of ``embedding_bag``). CUDA's embedding_bag walks a
#: bag with one thread per (bag, feature), a chain of dependent loads: a bucket larger than this is cut into
#: several chunks whose partial sums are added afterwards, so no thread walks more than this many classes. 512
#: cuts only the largest buckets at LLM shapes (V / B is 125-250 there), and keeps the chunk count near B.
CHUNK = 512


class TableLayout(NamedTuple):
    """How :func:`hf_midx.losses.tail_gradient.bucket_table` sums S @ rows in parallel and
    :func:`hf_midx.losses.tail_gradient.spread` spreads a table back: S cut into bags of at most :data:`CHUNK` classes,
    each a function of (V, B) in shape (n = B + V // CHUNK chunks, empty ones padding), built at a refresh.

    chunks: S's bucket rows in chunks, the classes the proposal draws in bucket order (the others, the exact
        head's, are not visited): bag ``stride * c`` is chunk c with the classes' member weights, and with a static
        component bag ``stride * c + 1`` is the same classes with their static weights (``stride`` 2: one read of
        a chunk's rows for both, the second from cache), so ``embedding_bag`` of (V, C) rows gives
        (stride * n, C) partial sums; None for a static proposal (B = 0: its row is one GEMV).
    chunk_ids: (n,) int64, the partials' rows that are bucket chunks (``stride * arange(n)``), or None.
    chunk_offsets: (B + 1,) int64, where bucket b's chunks start among those n (row B: the padding chunks, all
        empty), or None: ``embedding_bag(chunk_ids, partials, chunk_offsets)`` adds each bucket's chunks into its
        row (no bag longer than V // CHUNK + 1 either).
    columns: S by columns, V bags over the B + 1 rows (each class its bucket's row and the static one):
        ``embedding_bag`` of a (B + 1, C) table gives S^T @ table, (V, C), the eager path's spread.
    """

    chunks: Bags | None
    chunk_ids: torch.Tensor | None
    chunk_offsets: torch.Tensor | None
    columns: Bags


class ProposalFactors(NamedTuple):
    """A proposal in the closed form the expected tail gradient needs (see :mod:`hf_midx.losses.tail_gradient`):

    Q(i | z_t) = sum_b probs[t, b] S[b, i] + S[B, i],   S[b, i] = member[i] [bucket[i] = b],   S[B, i] = static[i]

    probs: (T, B) float32 per-query terms of the proposal's buckets, or None (a static proposal: B = 0).
    bucket: (V,) int64 in [0, B), each class's bucket (0 for every class when B = 0).
    member: (V,) float32, the class's weight in its bucket's row: its share of the bucket (times the mixture's
        weight; 1 when that share is already in ``probs``), 0 for a class the bucket terms never draw (all 0 for
        B = 0).
    static: (V,) float32, the class's weight in the query-independent row B (times the mixture's weight), or None
        (no static component: row B is zero).
    layout: :class:`TableLayout`, the same S laid out for parallel sums (built with the index, not per step);
        opaque to the kernels, which read the four fields above.
    A class the proposal never draws has a zero column.
    """

    probs: torch.Tensor | None
    bucket: torch.Tensor
    member: torch.Tensor
    static: torch.Tensor | None
    layout: TableLayout


def _chunks(bucket: torch.Tensor, member: torch.Tensor, static: torch.Tensor | None, num_buckets: int):
    """(chunks, chunk_ids, chunk_offsets) of :class:`TableLayout` (see there). A few host reads: at a refresh."""
    device, v, b = bucket.device, bucket.shape[0], num_buckets
    drawn = member != 0 if static is None else (member != 0) | (static != 0)
    # The drawn classes by bucket (a stable sort: each bucket's classes in id order), then the others, cut off.
    order = torch.sort(bucket.masked_fill(~drawn, b), stable=True).indices[: int(drawn.sum())]
    counts = torch.bincount(bucket[order], minlength=b)  # (B,) drawn classes per bucket
    # Chunks per bucket: at least one (an empty bucket's is empty), so sum <= B + V // CHUNK, the fixed count.
    per = ((counts + CHUNK - 1) // CHUNK).clamp_min(1)
    n, real = b + v // CHUNK, int(per.sum())
    owner = torch.repeat_interleave(torch.arange(b, device=device), per)  # (real,) each chunk's bucket
    first_chunk = per.cumsum(0) - per  # (B,) a bucket's first chunk
    start_class = counts.cumsum(0) - counts  # (B,) a bucket's first class in `order`
    starts = start_class[owner] + (torch.arange(real, device=device) - first_chunk[owner]) * CHUNK
    ends = torch.minimum(starts + CHUNK, (start_class + counts)[owner])
    pad = torch.full((n - real,), order.shape[0], dtype=torch.long, device=device)  # empty bags at the end
    starts, ends = torch.cat([starts, pad]), torch.cat([ends, pad])
    chunk_offsets = torch.cat([first_chunk, first_chunk.new_full((1,), real)])
    if static is None:
        chunks = (order, starts, member[order])
        return chunks, torch.arange(n, device=device), chunk_offsets
    # Each chunk twice in a row, member then static weights: entry j of chunk c sits at starts[c] + j in `order`
    # and at 2 starts[c] + j (member) and 2 starts[c] + (ends[c] - starts[c]) + j (static) in the index.
    pos = torch.arange(order.shape[0], device=device)
    chunk_of = torch.searchsorted(starts[:real], pos, right=True) - 1  # each drawn class's chunk
    lo = starts[chunk_of]
    index = torch.empty(2 * order.shape[0], dtype=torch.long, device=device)
    weights = torch.empty(2 * order.shape[0], device=device)
    first, second = lo + pos, pos + ends[chunk_of]  # 2 lo + (pos - lo), and after the chunk's member entries
    index[first], index[second] = order, order
    weights[first], weights[second] = member[order], static[order]
    offsets = torch.stack([2 * starts, starts + ends], 1).view(-1)
    return (index, offsets, weights), 2 * torch.arange(n, device=device), chunk_offsets


def proposal_factors_fixed(bucket: torch.Tensor, member: torch.Tensor, static: torch.Tensor | None,
                           num_buckets: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, TableLayout]:
    """(bucket, member, static, layout): the fields of :class:`ProposalFactors` that change only with the index,
    for the (V,) int64 ``bucket`` in [0, B) of each class, its (V,) float32 weight in that row (0 for a class the
    bucket terms never draw) and (V,) float32 ``static`` or None (B = ``num_buckets``). For a refresh, not a step."""
    classes = torch.arange(bucket.shape[0], device=bucket.device)
    # Contiguous (V,) vectors (a column of a (V, 2) table is strided): the kernels read them by pointer.
    bucket, member = bucket.contiguous(), member.float().contiguous()
    static = None if static is None else static.float().contiguous()
    if static is None:
        columns = (bucket, classes, member)
    else:
        columns = (torch.stack([bucket, torch.full_like(bucket, num_buckets)], 1).view(-1), classes * 2,
                   torch.stack([member, static], 1).view(-1))
    return bucket, member, static, TableLayout(*_chunks(bucket, member, static, num_buckets), columns)


def static_factors(static: torch.Tensor) -> ProposalFactors:
    """The factors of a static proposal, (V,) float32 ``static`` (B = 0: S is its one row, summed by a GEMV)."""
    classes = torch.arange(static.shape[0], device=static.device)
    bucket = torch.zeros_like(classes)
    layout = TableLayout(None, None, None, (bucket, classes, static))
    return ProposalFactors(None, bucket, torch.zeros_like(static), static, layout)


__all__ = ["CHUNK", "Bags", "ProposalFactors", "TableLayout", "proposal_factors_fixed", "static_factors"]
