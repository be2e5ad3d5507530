"""Fused kernels of the training head, as plain functions over tensors (no config, no transformers).

One ``torch.autograd.Function`` per fused operation calls the Triton kernels; the eager PyTorch
version stays beside it as the reference and the CPU path. Triton is imported only when a fused
kernel runs (on CUDA tensors, or on the CPU under ``TRITON_INTERPRET=1``, as the tests do).
"""

from .candidate import (
    FusedCandidateLoss,
    candidate_loss,
    candidate_loss_reference,
    triton_available,
    triton_interpreting,
)
from .counter import counter_rand

__all__ = [
    "FusedCandidateLoss",
    "candidate_loss",
    "candidate_loss_reference",
    "counter_rand",
    "triton_available",
    "triton_interpreting",
]
