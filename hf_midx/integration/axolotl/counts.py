"""The training-token counts of a tokenized dataset as a trainer holds it: the ``class_counts`` of ``hf_midx.wrap``.

Axolotl tokenizes the data before it builds the trainer, and TRL's trainers tokenize theirs in their constructor, so
``trainer.train_dataset`` already holds ids: counting them is one pass over integer columns, never over raw text.
Which columns are the training targets depends on the trainer:

* ``labels`` (Axolotl's SFT, any causal-LM dataset): the targets, with the masked prompt and padding (-100) left out;
* ``chosen_ids`` and ``rejected_ids`` (TRL's DPO, after its tokenization): both completions, the prompt left out;
* ``input_ids`` alone (pretraining-style data without labels): every id.

Plain ``datasets``-agnostic code over :func:`hf_midx.token_counts`; nothing here imports Axolotl or transformers.
"""

from __future__ import annotations

from typing import Any

import torch

from ...data import token_counts

#: Column groups holding the training targets, most specific first; the first group the dataset has all of is counted.
TARGET_COLUMNS = (("labels",), ("chosen_ids", "rejected_ids"), ("input_ids",))


def dataset_token_counts(dataset: Any, vocab_size: int) -> torch.Tensor:
    """(V,) int64 counts of the training targets of a tokenized ``dataset`` (see :data:`TARGET_COLUMNS`).

    Args:
        dataset: a ``datasets.Dataset`` (or anything with ``column_names`` that :func:`hf_midx.token_counts` reads),
            e.g. ``trainer.train_dataset``.
        vocab_size: V, the rows of the model's output layer.
    Raises:
        ValueError: no dataset, none of the column groups, or what :func:`hf_midx.token_counts` refuses (ids out of
            range, no ids).
    """
    if dataset is None:
        raise ValueError("hf_midx needs the training dataset to count its tokens, and the trainer has none.")
    columns = getattr(dataset, "column_names", None)
    if not isinstance(columns, (list, tuple)):
        raise ValueError(
            f"hf_midx counts the training tokens from a tokenized datasets.Dataset, got {type(dataset).__name__} "
            "(a streamed dataset cannot be counted before training without a second pass over it)."
        )
    for group in TARGET_COLUMNS:
        if set(group) <= set(columns):
            return sum(token_counts(dataset, vocab_size, column=column) for column in group)
    wanted = " or ".join("+".join(group) for group in TARGET_COLUMNS)
    raise ValueError(f"the training dataset has none of the token columns {wanted} (columns: {list(columns)}).")


__all__ = ["TARGET_COLUMNS", "dataset_token_counts"]
