"""The sampled and the full softmax loss: candidate logits, the tail gradient, the exact head and the
fused Triton kernels. Plain PyTorch; nothing here imports transformers or hf_midx.integration."""
