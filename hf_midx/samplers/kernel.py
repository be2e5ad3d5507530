"""Adaptive kernel baselines that score all classes per query: sphere (Blanc & Rendle) and random Fourier features."""

from __future__ import annotations

import math

import torch

from .. import defaults
from .._checks import check_positive_int, is_number
from .._ops import row_chunks
from .base import Sampler


def check_positive_number(options: dict, name: str) -> None:
    """``options[name]``, when given, must be a number > 0."""
    if name in options and not (is_number(options[name]) and options[name] > 0):
        raise ValueError(f"{name} must be a number > 0, got {options[name]!r}.")
from ..registry import register


class _ExhaustiveSampler(Sampler):
    """Adaptive baselines whose unnormalized weight w(z, i) is computed for all V classes per query.

    O(T V) per call: exact probabilities, no trees (the paper measured them the same way).
    Subclasses implement ``_weights(q (c, D)) -> (c, V)`` non-negative float32 and may override
    ``_log_z``.
    """

    def _log_weights(self, q: torch.Tensor) -> torch.Tensor:
        return self._weights(q).log()

    def _sample(self, q, m, gen):
        ids = torch.empty(q.shape[0], m, dtype=torch.long, device=self.device)
        log_q = torch.empty(q.shape[0], m, device=self.device)
        for rows in row_chunks(q.shape[0], self.num_candidates):
            lw = self._log_weights(q[rows])
            lp = lw - torch.logsumexp(lw, dim=1, keepdim=True)
            drawn = gen.categorical(lp.double().exp(), m)
            ids[rows], log_q[rows] = drawn, lp.gather(1, drawn)
        return ids, log_q

    def _log_prob(self, q, ids):
        out = torch.empty(ids.shape, device=self.device)
        for rows in row_chunks(q.shape[0], self.num_candidates):
            lw = self._log_weights(q[rows])
            out[rows] = lw.gather(1, ids[rows]) - torch.logsumexp(lw, dim=1, keepdim=True)
        return out


@register
class SphereSampler(_ExhaustiveSampler):
    """Quadratic-kernel proposal: Q(i | z) proportional to alpha * (z . q_i)^2 + 1 (Blanc & Rendle, 2018)."""

    name = "sphere"
    options = ("sphere_alpha",)
    _state_names = ("embeddings",)

    def __init__(
        self,
        embeddings: torch.Tensor,
        *,
        sphere_alpha: float = 100.0,
        seed: int = defaults.SEED,
        exclude=None,
        **_common,
    ) -> None:
        self.check_options(sphere_alpha=sphere_alpha)
        super().__init__(embeddings, seed=seed, exclude=exclude)
        self.alpha = float(sphere_alpha)
        self.embeddings = self._restrict(embeddings.detach().float()).clone()

    @classmethod
    def check_options(cls, **options) -> None:
        check_positive_number(options, "sphere_alpha")

    def refresh(self, embeddings: torch.Tensor) -> None:
        self.embeddings = self._check_embeddings(embeddings).clone()

    def _log_weights(self, q):
        o = q @ self.embeddings.t()
        return torch.log1p(self.alpha * o * o)


@register
class RFFSampler(_ExhaustiveSampler):
    """Random Fourier features (Rawat et al., 2019): Q(i | z) proportional to phi(z) . phi(q_i).

    Queries and classes are L2-normalized; phi(x) = [cos(W x), sin(W x)] / sqrt(R) with W ~ N(0, tau I)
    approximates the Gaussian kernel exp(-tau ||z - q||^2 / 2) = exp(-tau) exp(tau z . q). The estimate
    can be negative, so weights are floored at exp(-2 tau), the true kernel's minimum on the sphere,
    which keeps every class drawable and the probability exact.
    """

    name = "rff"
    options = ("rff_features", "rff_temperature")
    _state_names = ("projection", "class_features")

    def __init__(
        self,
        embeddings: torch.Tensor,
        *,
        rff_features: int = 32,
        rff_temperature: float = 4.0,
        seed: int = defaults.SEED,
        exclude=None,
        **_common,
    ) -> None:
        self.check_options(rff_features=rff_features, rff_temperature=rff_temperature)
        super().__init__(embeddings, seed=seed, exclude=exclude)
        self.temperature = float(rff_temperature)
        gen = torch.Generator().manual_seed(seed + 7919)
        self.projection = (torch.randn(rff_features, self.dim, generator=gen) * math.sqrt(self.temperature)).to(
            self.device
        )
        self.class_features = self._features(self._restrict(embeddings.detach().float()))

    @classmethod
    def check_options(cls, **options) -> None:
        if "rff_features" in options:
            check_positive_int("rff_features", options["rff_features"])
        check_positive_number(options, "rff_temperature")

    def _features(self, x: torch.Tensor) -> torch.Tensor:
        proj = torch.nn.functional.normalize(x, dim=1) @ self.projection.t()
        return torch.cat([proj.cos(), proj.sin()], dim=1) / math.sqrt(self.projection.shape[0])

    def refresh(self, embeddings: torch.Tensor) -> None:
        self.class_features = self._features(self._check_embeddings(embeddings))

    def _log_weights(self, q):
        k = self._features(q) @ self.class_features.t()
        return k.clamp_min(math.exp(-2.0 * self.temperature)).log()
