"""The transformers layer: the head and its wrapping of a model, the callback and trainer, checkpoints,
distributed training, diagnostics and model cards. The only package of hf_midx that imports transformers."""
