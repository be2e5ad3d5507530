"""Adaptive kernel baselines that score all classes per query: sphere (Blanc & Rendle) and random Fourier features."""

from __future__ import annotations

import math

import torch

from .. import defaults
from .._checks import check_positive_int, is_number
from .._ops import row_chunks
from ..registry import register
from .base import Sampler


def check_positive_number(options: dict, name: str) -> None:
    """``options[name]``, when given, must be a number > 0."""
    if name in options and not (is_number(options[name]) and options[name] > 0):
        raise ValueError(f"{name} must be a number > 0, got {options[name]!r}.")


class _ExhaustiveSampler(Sampler):
    """Adaptive baselines whose unnormalized weight w(z, i) is computed for all V classes per query.

    O(T V) per call: exact probabilities, no trees (the paper measured them the same way). Subclasses implement
    ``_weights(q (c, D) float32) -> (c, V)`` float32 weights bounded below by a positive floor, so that every class
    stays drawable and log w stays finite.
    """

    def _sample(self, q, m, gen):
        return self._sample_scored(q, m, gen, None)[:2]

    def _sample_scored(self, q, m, gen, ids):
        # The (c, V) weights are the whole cost: one evaluation per chunk serves the draws and the labels, and no
        # log or exp runs over them (the float64 cumulative sum the draws invert also gives the normalizer).
        draws = torch.empty(q.shape[0], m, dtype=torch.long, device=self.device)
        log_q = torch.empty(q.shape[0], m, device=self.device)
        scored = None if ids is None else torch.empty(ids.shape, device=self.device)
        for rows in row_chunks(q.shape[0], self.num_candidates):
            w = self._weights(q[rows])
            cum = w.double().cumsum(1)
            log_total = cum[:, -1:].log()
            drawn = gen.categorical(cum, m, cumulative=True)
            draws[rows], log_q[rows] = drawn, w.gather(1, drawn).double().log() - log_total
            if scored is not None:
                scored[rows] = w.gather(1, ids[rows]).double().log() - log_total
        return draws, log_q, scored

    def _log_prob(self, q, ids):
        out = torch.empty(ids.shape, device=self.device)
        for rows in row_chunks(q.shape[0], self.num_candidates):
            w = self._weights(q[rows])
            out[rows] = w.gather(1, ids[rows]).double().log() - w.double().sum(1, keepdim=True).log()
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

    def _weights(self, q):
        o = q @ self.embeddings.t()
        return o.square_().mul_(self.alpha).add_(1.0)


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

    def _weights(self, q):
        k = self._features(q) @ self.class_features.t()
        return k.clamp_min_(math.exp(-2.0 * self.temperature))
