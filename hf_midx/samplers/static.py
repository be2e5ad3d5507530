"""Static proposals, the same for every query: uniform, unigram (training-token frequencies), log-uniform."""

from __future__ import annotations

import math

import torch

from .. import defaults
from ..registry import register
from .base import Sampler
from .factors import static_factors
from .counts import check_counts, check_unigram_options, unigram_log_table


@register
class UniformSampler(Sampler):
    """Q(i) = 1 / V (1 / V' over the candidates when some classes are excluded)."""

    name = "uniform"
    query_dependent = False

    def __init__(self, embeddings: torch.Tensor, *, seed: int = defaults.SEED, exclude=None, **_common) -> None:
        super().__init__(embeddings, seed=seed, exclude=exclude)
        static = self._globalize(torch.full((self.num_candidates,), 1.0 / self.num_candidates, device=self.device), 0.0)
        self._fixed_factors = static_factors(static)

    def refresh(self, embeddings: torch.Tensor) -> None:
        self._check_embeddings(embeddings)

    def _sample(self, q, m, gen):
        ids = gen.randint(self.num_candidates, (q.shape[0], m))
        return ids, torch.full(ids.shape, -math.log(self.num_candidates), device=self.device)

    def _log_prob(self, q, ids):
        return torch.full(ids.shape, -math.log(self.num_candidates), device=self.device)

    def proposal_factors(self, queries):
        return self._fixed_factors


class _TableSampler(Sampler):
    """A static proposal given by a (V',) table of log-probabilities ``log_table``."""

    query_dependent = False
    _state_names = ("log_table",)

    def _set_table(self, log_table: torch.Tensor) -> None:
        self.log_table = log_table
        self._after_load()

    def _after_load(self) -> None:
        # float64 cumulative sum: inverse-CDF draws (no sync, unlike some multinomial paths) over V'.
        self._cum = self.log_table.double().exp().cumsum(0)
        probs = self._globalize(self.log_table.exp(), 0.0)  # (V,) float32, 0 at excluded classes
        self._fixed_factors = static_factors(probs)

    def proposal_factors(self, queries):
        return self._fixed_factors

    def _sample(self, q, m, gen):
        ids = gen.categorical(self._cum, m, cumulative=True, rows=q.shape[0])
        return ids, self.log_table[ids]

    def _log_prob(self, q, ids):
        return self.log_table[ids]

    def refresh(self, embeddings: torch.Tensor) -> None:
        self._check_embeddings(embeddings)


@register
class UnigramSampler(_TableSampler):
    """Q(i) proportional to (count_i + smoothing) ** power, from training-token frequencies.

    ``smoothing`` (default 1, add-one) keeps every class drawable, so the estimator of the partition
    function stays unbiased; ``power`` = 1 is the count-proportional unigram, 0.75 the word2vec distortion.
    ``unigram_weighting="log-count"`` weighs by log(1 + count + smoothing) ** power instead: with smoothing 0,
    the paper's code's log(count + 1), a flatter table than the counts.
    """

    name = "unigram"
    options = ("unigram_smoothing", "unigram_power", "unigram_weighting")

    def __init__(
        self,
        embeddings: torch.Tensor,
        *,
        class_counts=None,
        unigram_smoothing: float = defaults.UNIGRAM_SMOOTHING,
        unigram_power: float = defaults.UNIGRAM_POWER,
        unigram_weighting: str = "count",
        seed: int = defaults.SEED,
        exclude=None,
        **_common,
    ) -> None:
        self.check_options(
            unigram_smoothing=unigram_smoothing, unigram_power=unigram_power, unigram_weighting=unigram_weighting
        )
        super().__init__(embeddings, seed=seed, exclude=exclude)
        counts = self._restrict(check_counts(class_counts, self.num_classes, self.device))
        self._set_table(unigram_log_table(counts, unigram_smoothing, unigram_power, unigram_weighting))

    @classmethod
    def check_options(cls, **options) -> None:
        check_unigram_options(options)


@register
class LogUniformSampler(_TableSampler):
    """Zipfian proposal over frequency ranks (TensorFlow's log_uniform_candidate_sampler).

    P(rank r) = (log(r + 2) - log(r + 1)) / log(V' + 1). Class ids are taken as ranks unless
    ``class_counts`` is given, in which case classes are ranked by descending count.
    """

    name = "log-uniform"

    def __init__(
        self, embeddings: torch.Tensor, *, class_counts=None, seed: int = defaults.SEED, exclude=None, **_common
    ) -> None:
        super().__init__(embeddings, seed=seed, exclude=exclude)
        v = self.num_candidates
        r = torch.arange(v, dtype=torch.float64, device=self.device)
        log_p_rank = (torch.log1p(1.0 / (r + 1.0))).log() - math.log(math.log(v + 1.0))
        if class_counts is None:
            rank_of_class = torch.arange(v, device=self.device)
        else:
            counts = self._restrict(check_counts(class_counts, self.num_classes, self.device))
            by_rank = torch.sort(-counts, stable=True).indices
            rank_of_class = torch.empty_like(by_rank)
            rank_of_class[by_rank] = torch.arange(v, device=self.device)
        self._set_table(log_p_rank[rank_of_class].float())
