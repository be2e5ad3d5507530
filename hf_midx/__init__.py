"""hf-midx: adaptive sampled softmax with an inverted multi-index for large-vocabulary LM training.

The algorithm (``index``, ``quantizers``, ``samplers``, ``loss``, ``codebooks``, ``diagnostics``,
``rng``) is plain PyTorch.
The Hugging Face layer (``config``, ``head``, ``callback``, ``state``, ``trainer``, ``model_card``)
is imported lazily, so ``import hf_midx`` does not import transformers' models or Trainer until one
of its names is used. ``wrap`` / ``unwrap`` are bound at import: the functions share the name of
their module ``hf_midx.wrap``, which a lazy lookup would leave in their place.
"""

import importlib as _importlib

from .codebooks import LearnableCodebooks
from .data import token_counts
from .diagnostics import kl_to_softmax, proposal_diagnostics
from .index import MidxIndex
from .loss import full_softmax_loss, sampled_softmax_loss
from .rng import CounterRNG
from .samplers import SAMPLERS, Sampler, build_sampler
from .version import __version__, versions
from .wrap import unwrap, wrap

# Public names of the transformers layer -> the module that defines them.
_LAZY = {
    "MidxCallback": "callback",
    "MidxConfig": "config",
    "MidxLMHead": "head",
    "MidxNonFiniteError": "callback",
    "MidxTrainer": "trainer",
    "refresh_index": "callback",
}


def __getattr__(name: str):
    if name in _LAZY:
        return getattr(_importlib.import_module(f".{_LAZY[name]}", __name__), name)
    raise AttributeError(f"module 'hf_midx' has no attribute {name!r}")


def __dir__() -> list[str]:
    # The lazy names are not in the module's namespace until first used: list them for dir() and completion.
    return sorted({*globals(), *_LAZY})


__all__ = [
    "CounterRNG",
    "LearnableCodebooks",
    "MidxCallback",
    "MidxConfig",
    "MidxIndex",
    "MidxLMHead",
    "MidxNonFiniteError",
    "MidxTrainer",
    "SAMPLERS",
    "Sampler",
    "__version__",
    "build_sampler",
    "full_softmax_loss",
    "kl_to_softmax",
    "proposal_diagnostics",
    "refresh_index",
    "sampled_softmax_loss",
    "token_counts",
    "unwrap",
    "versions",
    "wrap",
]
