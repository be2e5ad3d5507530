"""The inverted multi-index: quantizers (k-means, PQ, RQ), the index over the output embeddings and
its learnable codebooks. Plain PyTorch; nothing here imports transformers or the layers above."""
