"""Training-token counts: the ``class_counts`` that ``hf_midx.wrap`` takes.

The exact head (the most frequent classes scored exactly), the unigram half of the default mixture and
the unigram / log-uniform samplers all rank classes by how often they occur as training tokens. This
module turns what a user has at hand (a tensor of ids, lists of ids, a ``datasets.Dataset`` with an
``input_ids`` column) into the (V,) int64 tensor they need. Labels work too: their ignore index (-100, the
masked prompt of SFT and the padding) is left out, so counting the labels counts exactly the training targets.
Plain PyTorch; ``datasets`` is never imported (a dataset is recognised by its ``column_names``).
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable, Mapping
from typing import Any

import torch

__all__ = ["token_counts"]

#: Rows of a dataset or of a list counted per ``bincount`` call: bounds the memory of one flattened batch.
_CHUNK_ROWS = 1024


def token_counts(
    data: Any, vocab_size: int, *, column: str = "input_ids", ignore_index: int | None = -100
) -> torch.Tensor:
    """(V,) int64 count of each token id in ``data``: the ``class_counts`` of ``hf_midx.wrap``.

    Args:
        data: the training token ids, as one of
            - a tensor (or numpy array) of any shape;
            - a sequence of sequences of ids (a list of tokenized texts; lengths may differ);
            - a ``datasets.Dataset`` (or a dict of lists) with a ``column`` of ids, e.g. the output of
              ``dataset.map(tokenize)``; a ``DatasetDict`` must be given one split (``ds["train"]``).
        vocab_size: V, the number of classes of the head (``model.config.vocab_size``).
        column: the column holding the ids in a dataset or dict (``"labels"`` counts the training targets).
        ignore_index: an id that is not a token and is not counted: -100 (the default) is the ignore index of
            the loss, which labels hold for padding and, in SFT, for the masked prompt. ``None`` counts every id.

    Returns:
        An int64 tensor of shape (V,), on the CPU: how many times each id occurs, ``ignore_index`` left out.

    Raises:
        ValueError: ``vocab_size`` is not a positive integer, ``data`` holds no ids (other than
            ``ignore_index``), an id is negative or ``>= vocab_size``, or the dataset has no such column.
            Ids must be integers: a floating-point tensor or list is refused even when its values are whole
            (convert it with ``.long()``), as a float there is more likely a weight or a probability than an id.

    Example: ``token_counts([[1, 2, 2, -100]], 5)`` is ``tensor([0, 1, 2, 0, 0])``.
    """
    if isinstance(vocab_size, bool) or not isinstance(vocab_size, int) or vocab_size < 1:
        raise ValueError(f"vocab_size must be a positive integer, got {vocab_size!r}.")
    if ignore_index is not None and (isinstance(ignore_index, bool) or not isinstance(ignore_index, int)):
        raise ValueError(f"ignore_index must be an integer or None, got {ignore_index!r}.")
    counts = torch.zeros(vocab_size, dtype=torch.int64)
    seen = 0
    for ids in _id_chunks(data, column):
        if ids.numel() == 0:
            continue
        if ids.is_floating_point() or ids.is_complex() or ids.dtype == torch.bool:
            raise ValueError(
                f"token ids must be integers, got dtype {ids.dtype}; if these are whole-number ids, convert them "
                "with .long()."
            )
        ids = ids.reshape(-1).to(torch.int64)
        if ignore_index is not None:
            ids = ids[ids != ignore_index]
            if ids.numel() == 0:
                continue
        low, high = int(ids.min()), int(ids.max())
        if low < 0 or high >= vocab_size:
            bad = low if low < 0 else high
            raise ValueError(f"token id {bad} is outside [0, {vocab_size}) (vocab_size={vocab_size}).")
        counts += torch.bincount(ids.cpu(), minlength=vocab_size)
        seen += ids.numel()
    if seen == 0:
        what = "" if ignore_index is None else f" other than the ignore index {ignore_index}"
        raise ValueError(f"token_counts got no token ids{what}; pass the training set's ids.")
    return counts


def _id_chunks(data: Any, column: str) -> Iterable[torch.Tensor]:
    """``data`` as a stream of id tensors, a bounded number of rows at a time."""
    if isinstance(data, torch.Tensor):
        yield data
        return
    if type(data).__module__.startswith("numpy"):
        yield torch.as_tensor(data)
        return
    if isinstance(data, (str, bytes)):
        raise ValueError(f"token_counts needs token ids, not text ({type(data).__name__}); tokenize it first.")
    names = getattr(data, "column_names", None)
    if isinstance(names, Mapping):  # a DatasetDict: one column list per split
        raise ValueError(f"token_counts needs one split of a DatasetDict, e.g. data['train'] (splits: {sorted(names)}).")
    if names is not None or isinstance(data, Mapping):
        columns = list(names) if names is not None else list(data)
        if column not in columns:
            raise ValueError(f"the dataset has no {column!r} column (columns: {columns}); tokenize it first.")
        if names is not None and hasattr(data, "iter"):  # a datasets.Dataset: read in batches, no full copy
            for batch in data.with_format("numpy").iter(batch_size=_CHUNK_ROWS):
                yield from _rows(batch[column], column)
            return
        data = data[column]
    yield from _rows(data, column)


def _rows(rows: Any, column: str) -> Iterable[torch.Tensor]:
    """Tensors of id rows (a list of lists, a numpy object array, a 2-D array, or any iterable of rows, such as a
    streamed dataset's ``{column: ids}`` records), read lazily ``_CHUNK_ROWS`` rows at a time."""
    if isinstance(rows, torch.Tensor) or (type(rows).__module__.startswith("numpy") and rows.dtype != object):
        yield torch.as_tensor(rows)
        return
    try:
        it = iter(rows)
    except TypeError:
        raise ValueError(f"token_counts cannot read token ids from a {type(rows).__name__}.") from None
    first = next(it, None)
    if first is None:
        return
    if isinstance(first, int) and not isinstance(first, bool):
        yield _tensor([first, *it])  # one flat list of ids
        return
    chunk: list[torch.Tensor] = []
    for row in itertools.chain([first], it):
        if isinstance(row, Mapping):  # a record of a streamed (iterable) dataset
            if column not in row:
                raise ValueError(f"the dataset has no {column!r} column (columns: {sorted(row)}); tokenize it first.")
            row = row[column]
        ids = _tensor(row).reshape(-1)
        if ids.numel():  # an empty row converts to a float tensor, which would turn the concatenation into floats
            chunk.append(ids)
        if len(chunk) == _CHUNK_ROWS:
            yield torch.cat(chunk)
            chunk = []
    if chunk:
        yield torch.cat(chunk)


def _tensor(row: Any) -> torch.Tensor:
    try:
        return torch.as_tensor(row)
    except (TypeError, ValueError, RuntimeError) as err:
        raise ValueError(f"token ids must be integers or lists of integers ({err}).") from None
