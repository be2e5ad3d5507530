"""hf-midx: train language models with large vocabularies faster, inside Hugging Face Transformers.

In training, the output softmax over all V words becomes a sampled softmax: the label, the most frequent words
(scored exactly) and a few negatives per token drawn from an inverted multi-index over the output embeddings
(MIDX, Chen et al., *Adaptive Sampled Softmax with Inverted Multi-Index*). Evaluation and generation stay exact,
and the saved model is a plain transformers model. In short::

    import hf_midx
    counts = hf_midx.token_counts(train_ids, V)  # (V,) training-token counts
    hf_midx.wrap(model, hf_midx.MidxConfig().for_vocabulary(V), class_counts=counts)  # in place
    trainer = hf_midx.MidxTrainer(model=model, args=args, train_dataset=train)  # or MidxCallback.install
    trainer.train()

The main names: ``wrap`` / ``unwrap`` (the head of a causal LM), ``MidxConfig`` (every option), ``MidxTrainer``
and ``MidxCallback`` (index refresh, checkpoints, diagnostics), ``token_counts``, ``RefreshScheduler`` and
``refresh_index`` (for your own training loop). The algorithm underneath is plain PyTorch: ``indexing`` (the index, quantizers,
codebooks), ``samplers`` and ``losses`` (the sampled and the full softmax loss, with Triton kernels in
``losses.kernels``). The transformers layer, ``integration`` (head, wrap, callback, trainer, model card and
theirs), is the one package that imports transformers; the callback and trainer are imported on first use, so
``import hf_midx`` does not load transformers' Trainer.
"""

import importlib as _importlib

from .version import check_versions as _check_versions

# Below a declared lower bound: one ImportError naming both versions, not an AttributeError from deep inside.
_check_versions()

from .indexing.codebooks import LearnableCodebooks
from .data import token_counts
from .integration.diagnostics import kl_to_softmax, proposal_diagnostics
from .indexing.index import MidxIndex
from .losses import full_softmax_loss, sampled_softmax_loss
from .rng import CounterRNG
from .samplers import SAMPLERS, Sampler, build_sampler
from .version import __version__, versions
from .integration.wrap import unwrap, wrap

# Public names of the transformers layer -> the module that defines them.
_LAZY = {
    "MidxCallback": "integration.callback",
    "MidxConfig": "config",
    "MidxLMHead": "integration.head",
    "MidxNonFiniteError": "integration.callback",
    "MidxTrainer": "integration.trainer",
    "RefreshScheduler": "integration.loop_refresh",
    "refresh_index": "integration.callback",
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
    "RefreshScheduler",
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
