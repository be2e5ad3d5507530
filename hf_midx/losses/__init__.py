"""The sampled and the full softmax loss: candidate logits, the tail gradient, the exact head and the
fused Triton kernels. Plain PyTorch; nothing here imports transformers or hf_midx.integration."""

from .full import full_softmax_loss
from .loss import sampled_softmax_loss

__all__ = ["full_softmax_loss", "sampled_softmax_loss"]
