"""The exact full-softmax cross-entropy, the reference the sampled loss estimates, and the checks and the
reduction both losses share.

Shapes: T tokens, D hidden dims, V classes. No (T, V) tensor: torch's chunked ``linear_cross_entropy`` where
it exists, else chunks whose logits are recomputed in backward.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
import torch.utils.checkpoint

from .._checks import check_ids, check_matrix
from .._ops import soft_cap

REDUCTIONS = ("mean", "sum", "none")


def check_loss_inputs(hidden, weight, labels, bias, ignore_index, reduction, check_labels):
    """Shapes and types (no device sync); the label values too when ``check_labels`` (one sync)."""
    check_matrix("hidden", hidden, finite=False)
    check_matrix("weight", weight, dim=hidden.shape[1], finite=False)
    if labels.dim() != 1 or labels.shape[0] != hidden.shape[0]:
        raise ValueError(
            f"labels must have shape (T,) = ({hidden.shape[0]},) to match hidden {tuple(hidden.shape)}, "
            f"got {tuple(labels.shape)}; flatten (batch, seq) first."
        )
    if check_labels:
        check_ids("labels", labels, weight.shape[0], ignore_index=ignore_index)
    elif not isinstance(labels, torch.Tensor) or labels.is_floating_point() or labels.dtype == torch.bool:
        raise ValueError(f"labels must be an integer tensor, got {getattr(labels, 'dtype', type(labels).__name__)}.")
    if bias is not None and tuple(bias.shape) != (weight.shape[0],):
        raise ValueError(f"bias must have shape ({weight.shape[0]},), got {tuple(bias.shape)}.")
    if reduction not in REDUCTIONS:
        raise ValueError(f"reduction must be one of {REDUCTIONS}, got {reduction!r}.")


def assert_labels_in_range(labels: torch.Tensor, num_classes: int) -> None:
    """A device-side assertion on (T,) labels (ignored ones already replaced by a class): fails the step (at the
    next sync) instead of reading labels back now."""
    ok = (labels.clamp(0, num_classes - 1) == labels).all()
    torch._assert_async(ok, f"labels outside [0, {num_classes}) reached the MIDX loss")


def reduce_tokens(per_token: torch.Tensor, valid: torch.Tensor, reduction: str) -> torch.Tensor:
    """per_token: (T,) float32, already 0 at ignored tokens; valid: (T,) bool."""
    if reduction == "none":
        return per_token
    total = per_token.sum()
    if reduction == "sum":
        return total
    # An all-ignored batch gives 0 (with a zero gradient) rather than 0/0; the count stays on the device.
    return total / valid.sum(dtype=torch.float32).clamp_min(1)


def full_softmax_loss(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    *,
    bias: torch.Tensor | None = None,
    ignore_index: int = -100,
    reduction: str = "mean",
    logit_softcap: float | None = None,
    chunk_size: int | None = None,
    check_labels: bool = True,
) -> torch.Tensor:
    """Exact cross-entropy of ``hidden @ weight.T (+ bias)`` without materializing the (T, V) logits.

    Uses torch's chunked ``linear_cross_entropy`` where it exists (torch >= 2.13), for float32 inputs without a
    softcap; otherwise chunks whose logits (in the inputs' dtype, as ``nn.Linear`` gives them) are cross-entropied in
    float32 and recomputed in backward.

    Args:
        hidden: (T, D); weight: (V, D); labels: (T,) int64 or ``ignore_index``; bias: optional (V,).
        chunk_size: tokens per chunk (default: about 2^24 logits a chunk, 64 to 1024 tokens).
        check_labels: range-check the labels with a ValueError (one device sync); with False a
            device-side assertion checks them instead (as it does under ``torch.compile``: no graph break).
    Returns:
        float32 scalar ("mean"/"sum") or (T,) ("none").
    """
    if check_labels and torch.compiler.is_compiling():
        check_labels = False  # a host read would break the graph: the asynchronous check runs instead
    check_loss_inputs(hidden, weight, labels, bias, ignore_index, reduction, check_labels)
    if not check_labels:
        assert_labels_in_range(labels.masked_fill(labels == ignore_index, 0), weight.shape[0])
    labels = labels.long()  # cross_entropy (and the chunked path) need int64 targets; int32 ids are common
    float32 = hidden.dtype == torch.float32 and weight.dtype == torch.float32
    if float32 and logit_softcap is None and hasattr(F, "linear_cross_entropy") and hasattr(torch.nn, "LinearCrossEntropyOptions"):
        # torch reduces inside its chunked kernel ("sum": no per-token backward pass, measured 2.0 s vs 3.4 s at
        # T=2048, V=131k). Low precision takes the chunks below, whose logits are rounded to the inputs' dtype and
        # then cross-entropied in float32, as an unwrapped model's loss is: torch's bfloat16 kernel computes the
        # softmax in bfloat16 (0.03 nats per token off, T = 300, V = 5,000), and its running sum drifts.
        fused_sum = reduction != "none"
        per_token = F.linear_cross_entropy(
            hidden,
            weight,
            labels,
            linear_bias=bias,
            reduction="sum" if fused_sum else "none",
            ignore_index=ignore_index,
            # An explicit chunk: on CPU the "auto" chunking of torch 2.13 ran 10-30x slower than
            # plain chunks (10.1 s vs 0.37 s for T=5100, V=33k, no grad).
            # Under torch.compile torch forces allow_retain_graph=True with a warning, a graph break: asked for here.
            options=torch.nn.LinearCrossEntropyOptions(
                batch_chunk_size=_token_chunk(weight.shape[0], chunk_size), chunking_method=None,
                allow_retain_graph=torch.compiler.is_compiling(),
            ),
        ).float()
    else:
        per_token = _chunked_ce(hidden, weight, bias, labels, ignore_index, logit_softcap, chunk_size)
    return reduce_tokens(per_token, labels != ignore_index, reduction)  # the fused 0-dim sum passes through .sum()


def _token_chunk(num_classes: int, chunk_size: int | None) -> int:
    """Tokens per chunk: 512 (fastest measured at V=33k-131k) unless the chunk's logits pass 2^27
    floats (512 MiB), then fewer, down to 128 at V=1M."""
    return chunk_size or max(128, min(512, (1 << 27) // max(num_classes, 1)))


def _chunked_ce(hidden, weight, bias, labels, ignore_index, logit_softcap, chunk_size):
    """(T,) float32 per-token cross-entropy, chunk by chunk, each chunk's logits recomputed in backward."""
    chunk = _token_chunk(weight.shape[0], chunk_size)
    pieces = []
    for s in range(0, hidden.shape[0], chunk):
        pieces.append(
            torch.utils.checkpoint.checkpoint(
                _chunk_ce,
                hidden[s : s + chunk],
                weight,
                bias,
                labels[s : s + chunk],
                ignore_index,
                logit_softcap,
                use_reentrant=False,
            )
        )
    return torch.cat(pieces) if pieces else hidden.new_zeros(0, dtype=torch.float32)


def _chunk_ce(hidden, weight, bias, labels, ignore_index, cap):
    logits = F.linear(hidden, weight, bias).float()
    return F.cross_entropy(soft_cap(logits, cap), labels, ignore_index=ignore_index, reduction="none")


__all__ = ["REDUCTIONS", "assert_labels_in_range", "check_loss_inputs", "full_softmax_loss", "reduce_tokens"]
