"""Tiny random causal LMs for the head tests (built from configs; no network, no downloads).

Each factory returns a fresh model in eval mode with a fixed seed; ``ARCHITECTURES`` names them.
"""

from __future__ import annotations

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402
from transformers import AutoConfig, AutoModelForCausalLM  # noqa: E402
from transformers.utils import logging as hf_logging  # noqa: E402

hf_logging.set_verbosity_error()

HIDDEN = 32
LAYERS = 2
VOCAB = 400

# model_type -> config kwargs (beyond the shared sizes) that keep the model tiny and exercise a feature.
_CONFIGS: dict[str, dict] = {
    "gpt2": dict(n_embd=HIDDEN, n_layer=LAYERS, n_head=2, n_positions=64, bos_token_id=0, eos_token_id=0),
    "llama": dict(
        hidden_size=HIDDEN, intermediate_size=64, num_hidden_layers=LAYERS, num_attention_heads=2,
        num_key_value_heads=1, max_position_embeddings=64, tie_word_embeddings=False,
    ),
    "qwen2": dict(
        hidden_size=HIDDEN, intermediate_size=64, num_hidden_layers=LAYERS, num_attention_heads=2,
        num_key_value_heads=1, max_position_embeddings=64,
    ),
    # A small cap so that the softcap actually bends these tiny models' logits.
    "gemma2": dict(
        hidden_size=HIDDEN, intermediate_size=64, num_hidden_layers=LAYERS, num_attention_heads=2,
        num_key_value_heads=1, head_dim=16, max_position_embeddings=64, final_logit_softcapping=0.5,
        sliding_window=8,
    ),
    "opt": dict(
        hidden_size=HIDDEN, ffn_dim=64, num_hidden_layers=LAYERS, num_attention_heads=2,
        word_embed_proj_dim=HIDDEN, max_position_embeddings=64,
    ),
    "gpt_neox": dict(
        hidden_size=HIDDEN, intermediate_size=64, num_hidden_layers=LAYERS, num_attention_heads=2,
        max_position_embeddings=64,
    ),
    # lm_head with a bias
    "phi": dict(
        hidden_size=HIDDEN, intermediate_size=64, num_hidden_layers=LAYERS, num_attention_heads=2,
        max_position_embeddings=64,
    ),
    # logits multiplied by logit_scale after the head
    "cohere": dict(
        hidden_size=HIDDEN, intermediate_size=64, num_hidden_layers=LAYERS, num_attention_heads=2,
        num_key_value_heads=1, max_position_embeddings=64, logit_scale=0.5,
    ),
    # logits divided by logits_scaling after the head
    "granite": dict(
        hidden_size=HIDDEN, intermediate_size=64, num_hidden_layers=LAYERS, num_attention_heads=2,
        num_key_value_heads=1, max_position_embeddings=64, logits_scaling=4.0,
    ),
}

ARCHITECTURES = tuple(_CONFIGS)


def tiny_config(model_type: str, vocab_size: int = VOCAB, **extra):
    kwargs = {**_CONFIGS[model_type], "vocab_size": vocab_size, **extra}
    return AutoConfig.for_model(model_type, **kwargs)


def tiny_model(model_type: str, vocab_size: int = VOCAB, seed: int = 0, **extra) -> torch.nn.Module:
    """A fresh tiny random model in eval mode; the same seed gives the same weights."""
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(tiny_config(model_type, vocab_size, **extra), attn_implementation="eager")
    return model.eval()


def clone_model(model: torch.nn.Module) -> torch.nn.Module:
    """An independent copy with the same weights (built from the config, not deep-copied)."""
    other = AutoModelForCausalLM.from_config(model.config, attn_implementation="eager")
    other.load_state_dict(model.state_dict())
    return other.eval()


def markov_batches(vocab_size: int, batch: int, seq: int, steps: int, seed: int = 0, noise: float = 0.1):
    """Batches from a fixed Markov chain (next = perm[current] with probability 1 - noise)."""
    gen = torch.Generator().manual_seed(seed)
    perm = torch.randperm(vocab_size, generator=gen)
    out = []
    for _ in range(steps):
        x = torch.empty(batch, seq, dtype=torch.long)
        x[:, 0] = torch.randint(vocab_size, (batch,), generator=gen)
        for t in range(1, seq):
            jump = torch.rand(batch, generator=gen) < noise
            x[:, t] = torch.where(jump, torch.randint(vocab_size, (batch,), generator=gen), perm[x[:, t - 1]])
        out.append(x)
    return out
