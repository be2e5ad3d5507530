"""Proposal distributions Q(i | z) for sampled softmax, one interface for all of the paper's samplers.

One module per family: :mod:`.base` (the interface), :mod:`.midx` (midx-rq, midx-pq), :mod:`.midx_exact`,
:mod:`.static` (uniform, unigram, log-uniform), :mod:`.kernel` (sphere, rff) and :mod:`.lsh`. Importing
this package registers all of them in :data:`SAMPLERS` (:mod:`hf_midx.registry`, with the option tables
and :func:`build_sampler`).
"""

from __future__ import annotations

from ..defaults import LAST_STAGES, MIX_STATICS
from ..registry import (
    SAMPLERS,
    all_sampler_options,
    build_sampler,
    check_option_values,
    check_sampler_options,
    register,
)
from .base import Sampler
from .counts import check_counts
from .midx import MidxPQSampler, MidxQuantizedSampler, MidxRQSampler, MidxSampler  # noqa: I001
from .midx_exact import MidxExactSampler
from .static import LogUniformSampler, UniformSampler, UnigramSampler
from .kernel import RFFSampler, SphereSampler  # (registration order: MIDX, static, kernel, LSH)
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
    "MidxQuantizedSampler",
    "MidxRQSampler",
    "MidxSampler",
    "RFFSampler",
    "Sampler",
    "SphereSampler",
    "UniformSampler",
    "UnigramSampler",
    "build_sampler",
    "check_counts",
    "check_option_values",
    "check_sampler_options",
    "register",
]
