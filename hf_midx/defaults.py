"""The default and the allowed values of every option that both :class:`hf_midx.MidxConfig` and a low-level
builder take (:func:`hf_midx.build_sampler`, the samplers, :meth:`hf_midx.MidxIndex.build`,
:func:`hf_midx.sampled_softmax_loss`): one place, so that ``build_sampler("midx-rq", w)`` and
``hf_midx.wrap(model)`` build the same sampler and the loss uses the config's estimator.

Plain constants at the bottom of the package: this module imports nothing, and the modules that own an
option (the quantizers, the samplers, the loss) and the config that exposes it all read it from here.
"""

from __future__ import annotations

#: K, the codewords per codebook of the MIDX samplers (K * K buckets).
CODEBOOK_SIZE = 32
#: Lloyd iterations per codebook at every (re)build of a MIDX index.
KMEANS_ITERS = 20
#: How k-means runs: plain PyTorch, or faiss when installed.
KMEANS_BACKENDS = ("torch", "faiss")
KMEANS_BACKEND = "torch"

#: How a MIDX sampler draws a class inside a bucket: uniformly, or by its smoothed training count with the buckets
#: scored by the query ("frequency") or by the query minus the mean query ("centered": see samplers/midx.py).
LAST_STAGES = ("uniform", "frequency", "centered")
LAST_STAGE = "centered"
#: The defensive mixture Q = (1 - a) Q_midx + a Q_static of the MIDX samplers: a and the static component.
#: The unigram component needs class counts; a sampler built without them mixes in nothing (warned).
MIX_WEIGHT = 0.5
MIX_STATICS = ("unigram", "uniform")
MIX_STATIC = "unigram"

#: The smoothed training counts (count + smoothing) ** power of the unigram proposal, of the MIDX frequency
#: last stage and of the MIDX unigram component (add-one smoothing keeps every class drawable).
UNIGRAM_SMOOTHING = 1.0
UNIGRAM_POWER = 1.0

#: How the sampled softmax draws its negatives: each token its own, or one pool per batch.
NEGATIVE_MODES = ("per-query", "shared")
NEGATIVES = "per-query"
#: How the per-query sampled softmax moves the tail classes (see :mod:`hf_midx.losses.tail_gradient`): every one by its
#: expectation under the proposal plus the draws' deviation from it ("expected"), or only the drawn ones
#: ("sampled"); "auto" (the default) takes "expected" wherever it applies (per-query negatives, accidental hits
#: kept, no logit soft-cap, a proposal with a closed form: MIDX, unigram, uniform, log-uniform), else "sampled".
TAIL_GRADIENTS = ("auto", "expected", "sampled")
TAIL_GRADIENT = "auto"
#: How the label's logit enters the sampled softmax (see :mod:`hf_midx.losses.loss`).
ESTIMATORS = ("exact-positive", "corrected-positive")
ESTIMATOR = "corrected-positive"

#: How the per-query sampled softmax is computed: the fused Triton kernels of :mod:`hf_midx.losses.kernels`, the eager
#: PyTorch path (the reference, and the CPU path), or "auto": fused where they can run (CUDA tensors, Triton,
#: per-query negatives). ``MidxConfig`` defaults to "auto"; :func:`hf_midx.sampled_softmax_loss` to "eager".
KERNEL_MODES = ("auto", "fused", "eager")
KERNELS = "auto"

#: ``exact_head="auto"``: the smallest H whose classes hold this share of the training tokens, at most
#: EXACT_HEAD_MAX (the largest H measured: it holds 78% of the tokens of WikiText-2 and of the Zipf(1.1) short
#: run at V = 151,936, 68% at the synthetic V = 100,000) and at most V / 8.
EXACT_HEAD_SHARE = 0.8
EXACT_HEAD_MAX = 2048

#: Seed of a sampler's generator and of k-means.
SEED = 0
