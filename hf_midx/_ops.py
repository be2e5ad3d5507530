"""Small tensor helpers shared by the algorithm (loss, samplers) and the layer above it (diagnostics, wrap).

At the bottom of the package (it imports only torch), so that a module using them does not climb to the
module that first had them: :func:`row_chunks` was the samplers', :func:`soft_cap` the loss's.
"""

from __future__ import annotations

import torch

# Upper bound on the elements of one (chunk, V) or (chunk, K*K) work tensor (64 MiB in float32):
# few chunks, since on a GPU each costs a dozen kernel launches.
_WORK_ELEMENTS = 1 << 24


def row_chunks(total: int, per_row: int):
    """Slices of ``range(total)`` rows, each of at most about ``_WORK_ELEMENTS / per_row`` rows: bounds the
    (rows, per_row) temporaries of a chunked computation."""
    step = max(1, _WORK_ELEMENTS // max(per_row, 1))
    for start in range(0, total, step):
        yield slice(start, min(start + step, total))


def step_state(*tensors: torch.Tensor) -> None:
    """Mark tensors that a training step advances in place (its RNG counter, call counts) as static addresses
    for ``torch.compile``: a CUDA graph of the step (``mode="reduce-overhead"``) then reads and updates them
    where they live, as it does a parameter, instead of skipping the capture for a mutated input. Call it where
    the state is created (outside the step), and keep its address: reset in place, never replace it."""
    if torch.compiler.is_compiling():  # made inside a compiled region (a torch.Generator converted per call)
        return
    import torch._dynamo as dynamo  # noqa: PLC0415 (about a second, once; transformers' Trainer imports it anyway)

    for t in tensors:
        dynamo.mark_static_address(t)


def soft_cap(logits: torch.Tensor, cap: float | None) -> torch.Tensor:
    """``cap * tanh(logits / cap)`` (Gemma-2's ``final_logit_softcapping``), any shape and dtype; ``logits`` when
    ``cap`` is None."""
    return logits if cap is None else cap * torch.tanh(logits / cap)


__all__ = ["row_chunks", "soft_cap", "step_state"]
