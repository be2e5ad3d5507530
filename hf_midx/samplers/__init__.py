"""Proposal distributions Q(i | z) for sampled softmax, one interface for all of the paper's samplers.

One module per family: :mod:`.base` (the interface, the registry, :func:`build_sampler`), :mod:`.midx`
(midx-rq, midx-pq, midx-exact), :mod:`.static` (uniform, unigram, log-uniform), :mod:`.kernel` (sphere,
rff) and :mod:`.lsh`. Importing this package registers all of them in :data:`SAMPLERS`.
"""

from __future__ import annotations

from .base import SAMPLERS, Sampler, all_sampler_options, build_sampler, check_counts, check_sampler_options, register
from .midx import LAST_STAGES, MIX_STATICS, MidxExactSampler, MidxPQSampler, MidxRQSampler, MidxSampler
from .static import LogUniformSampler, UniformSampler, UnigramSampler
from .kernel import RFFSampler, SphereSampler  # noqa: I001 (registration order: MIDX, static, kernel, LSH)
from .lsh import LSHSampler

#: Every option some sampler reads (the union of the per-sampler ``options`` tables).
SAMPLER_OPTIONS: tuple[str, ...] = all_sampler_options()


__all__ = [
    "LAST_STAGES",
    "MIX_STATICS",
    "SAMPLERS",
    "SAMPLER_OPTIONS",
    "LSHSampler",
    "LogUniformSampler",
    "MidxExactSampler",
    "MidxPQSampler",
    "MidxRQSampler",
    "MidxSampler",
    "RFFSampler",
    "Sampler",
    "SphereSampler",
    "UniformSampler",
    "UnigramSampler",
    "build_sampler",
    "check_counts",
    "check_sampler_options",
    "register",
]
