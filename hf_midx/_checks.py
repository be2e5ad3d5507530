"""Input validation shared by the public entry points.

Every check raises ``ValueError`` with a message that names the argument and says what to do;
none uses ``assert`` (which ``python -O`` strips).
"""

from __future__ import annotations

import torch


def check_matrix(name: str, x: torch.Tensor, *, dim: int | None = None, finite: bool = True) -> None:
    """Check that ``x`` is a 2-D floating tensor (rows, ``dim``) with finite values."""
    if not isinstance(x, torch.Tensor):
        raise ValueError(f"{name} must be a torch.Tensor, got {type(x).__name__}.")
    if x.dim() != 2:
        raise ValueError(f"{name} must be 2-D (rows, dims), got shape {tuple(x.shape)}.")
    if not x.is_floating_point():
        raise ValueError(f"{name} must be a floating-point tensor, got dtype {x.dtype}.")
    if dim is not None and x.shape[1] != dim:
        raise ValueError(f"{name} has {x.shape[1]} dims but {dim} were expected (shape {tuple(x.shape)}).")
    # A NaN or Inf makes the sum non-finite: one cheap pass; only then (or on an overflowing sum of
    # huge finite values) the elementwise test, which allocates a (rows, dims) mask.
    if finite and x.numel() and not bool(torch.isfinite(x.sum())) and not bool(torch.isfinite(x).all()):
        bad = int((~torch.isfinite(x)).any(dim=1).nonzero()[0, 0])
        raise ValueError(
            f"{name} contains NaN or Inf (first bad row: {bad}); check the model's weights and learning rate."
        )


def check_positive_int(name: str, value, *, minimum: int = 1) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"{name} must be an integer >= {minimum}, got {value!r}.")
    return value


def check_ids(name: str, ids: torch.Tensor, num_classes: int, *, ignore_index: int | None = None) -> None:
    """Check that integer ``ids`` lie in [0, num_classes), ``ignore_index`` excepted."""
    if not isinstance(ids, torch.Tensor) or ids.is_floating_point() or ids.is_complex() or ids.dtype == torch.bool:
        raise ValueError(f"{name} must be an integer tensor, got {getattr(ids, 'dtype', type(ids).__name__)}.")
    if ids.numel() == 0:
        return
    keep = ids if ignore_index is None else ids[ids != ignore_index]
    if keep.numel() == 0:
        return
    lo, hi = int(keep.min()), int(keep.max())
    if lo < 0 or hi >= num_classes:
        bad = lo if lo < 0 else hi
        extra = "" if ignore_index is None else f" (or {ignore_index} to ignore a position)"
        raise ValueError(f"{name} contains {bad}, outside [0, {num_classes}){extra}; check the tokenizer and vocab size.")


def is_number(value) -> bool:
    """True for an int or float that is not a bool."""
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def check_counts(class_counts, num_classes: int, device) -> torch.Tensor:
    """(V,) float64 training-token counts, validated (finite, non-negative, right length).

    Counts need not be whole numbers: only their ratios are used (the unigram proposal, the exact head's
    most frequent classes), so smoothed or reweighted frequencies are accepted as they are.
    """
    if class_counts is None:
        raise ValueError(
            "This sampler needs class_counts: a (V,) tensor of training-token frequencies "
            "(e.g. torch.bincount(train_ids, minlength=V))."
        )
    counts = torch.as_tensor(class_counts, dtype=torch.float64, device=device)
    if counts.shape != (num_classes,):
        raise ValueError(f"class_counts must have shape ({num_classes},), got {tuple(counts.shape)}.")
    if not bool(torch.isfinite(counts).all()) or bool((counts < 0).any()):
        raise ValueError("class_counts must be finite and non-negative.")
    return counts
