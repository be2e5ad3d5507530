"""hf_midx.token_counts (tensors, lists, datasets) and the package's public names."""

from __future__ import annotations

import pytest
import torch

import hf_midx
from hf_midx import token_counts


def test_counts_of_a_tensor_any_shape():
    ids = torch.tensor([[0, 1, 1], [3, 3, 3]])
    counts = token_counts(ids, 5)
    assert counts.dtype == torch.int64 and counts.tolist() == [1, 2, 0, 3, 0]
    assert token_counts(ids.int().numpy(), 5).tolist() == [1, 2, 0, 3, 0]


def test_counts_of_lists_of_different_lengths_and_a_flat_list():
    assert token_counts([[0, 1], [], [1, 1, 4]], 5).tolist() == [1, 3, 0, 0, 1]
    assert token_counts([2, 2, 0], 3).tolist() == [1, 0, 2]


def test_counts_of_a_dataset_match_the_tensor_counts():
    datasets = pytest.importorskip("datasets")
    rows = [[int(i) for i in torch.randint(0, 50, (n,))] for n in torch.randint(1, 30, (2500,))]
    dataset = datasets.Dataset.from_dict({"input_ids": rows, "text": ["x"] * len(rows)})
    expected = torch.bincount(torch.tensor([i for r in rows for i in r]), minlength=50)
    assert torch.equal(token_counts(dataset, 50), expected)
    assert torch.equal(token_counts({"input_ids": rows}, 50), expected)
    with pytest.raises(ValueError, match="no 'ids' column"):
        token_counts(dataset, 50, column="ids")
    with pytest.raises(ValueError, match=r"data\['train'\]"):
        token_counts(datasets.DatasetDict({"train": dataset}), 50)


def test_counts_of_a_streamed_dataset_are_read_lazily():
    """An iterable dataset of unknown features (no column_names) yields records: counted as they come."""
    rows = [[int(i) for i in torch.randint(0, 50, (n,))] for n in torch.randint(1, 30, (2500,))]
    expected = torch.bincount(torch.tensor([i for r in rows for i in r]), minlength=50)
    read = []

    def records(bad_at=None):
        for i, row in enumerate(rows):
            read.append(i)
            yield {"input_ids": [-5] if i == bad_at else row, "text": "x"}

    with pytest.raises(ValueError, match="token id -5"):
        token_counts(records(bad_at=1500), 50)
    assert len(read) == 2048  # stopped with the second chunk of 1,024 rows: the stream was not read whole first
    assert torch.equal(token_counts(records(), 50), expected)
    with pytest.raises(ValueError, match=r"no 'ids' column \(columns: \['input_ids', 'text'\]\)"):
        token_counts(records(), 50, column="ids")
    datasets = pytest.importorskip("datasets")
    streamed = datasets.IterableDataset.from_generator(records)
    assert torch.equal(token_counts(streamed, 50), expected)


def test_the_ignore_index_is_not_counted():
    """SFT labels mask the prompt (and padding) with -100, the loss's ignore index: the rest are the targets."""
    assert token_counts([[1, 2, 2, -100]], 5).tolist() == [0, 1, 2, 0, 0]
    labels = torch.tensor([[-100, -100, 3, 4], [-100, 4, 4, -100]])
    assert token_counts(labels, 5).tolist() == [0, 0, 0, 1, 3]
    assert token_counts({"labels": labels.tolist()}, 5, column="labels").tolist() == [0, 0, 0, 1, 3]
    # Another ignore index (here the padding id 0), or none: -100 is then an id like any other, and refused.
    assert token_counts([[0, 0, 1]], 2, ignore_index=0).tolist() == [0, 1]
    with pytest.raises(ValueError, match="token id -100 is outside"):
        token_counts([[1, -100]], 5, ignore_index=None)
    with pytest.raises(ValueError, match="ignore_index must be an integer or None"):
        token_counts([[1]], 5, ignore_index=-100.0)


@pytest.mark.parametrize(
    "data, vocab_size, message",
    [
        (torch.tensor([0, 5]), 5, "token id 5 is outside"),
        (torch.tensor([0, -5]), 5, "token id -5 is outside"),
        (torch.tensor([0.5]), 5, "integers"),
        (torch.tensor([1.0, 2.0]), 5, r"convert them with \.long\(\)"),  # whole numbers, but not ids
        ([[1.5, 2.0]], 5, "integers"),
        (torch.tensor([], dtype=torch.long), 5, "no token ids"),
        ([[], []], 5, "no token ids"),
        ([[-100, -100]], 5, "no token ids other than the ignore index -100"),
        ("some text", 5, "tokenize it first"),
        (torch.tensor([1]), 0, "vocab_size must be a positive integer"),
        (torch.tensor([1]), True, "vocab_size must be a positive integer"),
    ],
)
def test_bad_input_is_a_value_error(data, vocab_size, message):
    with pytest.raises(ValueError, match=message):
        token_counts(data, vocab_size)


def test_all_is_sorted_and_dir_lists_the_lazy_names():
    assert hf_midx.__all__ == sorted(hf_midx.__all__)
    for name in hf_midx.__all__:
        assert getattr(hf_midx, name) is not None, name
    listed = dir(hf_midx)
    for name in ("MidxCallback", "MidxConfig", "MidxLMHead", "MidxTrainer", "token_counts"):
        assert name in listed, name
    assert "import_module" not in listed
