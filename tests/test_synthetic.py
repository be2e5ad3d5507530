"""recipes/synthetic.py: the Zipf-Markov chain's stationary law, exact entropy rate and sampler."""

from __future__ import annotations

import math

import numpy as np
import pytest

from recipes.synthetic import ZipfMarkovChain, entropy, zipf_probabilities


def brute_force_entropy_rate(chain: ZipfMarkovChain) -> tuple[float, np.ndarray, np.ndarray]:
    """H = -sum_{w,w'} mu(w) P(w'|w) log P(w'|w) from the dense matrix and its own stationary vector."""
    p = chain.dense_transition_matrix()
    values, vectors = np.linalg.eig(p.T)
    stationary = np.real(vectors[:, np.argmin(np.abs(values - 1))])
    stationary = stationary / stationary.sum()
    logs = np.log(np.where(p > 0, p, 1.0))
    return float(-(stationary[:, None] * p * logs).sum()), stationary, p


@pytest.mark.parametrize(
    "vocab_size, exponent, clusters, successors, seed",
    [(40, 1.0, 6, 2, 0), (97, 1.3, 10, 3, 1), (200, 0.8, None, 8, 2), (64, 1.0, 64, 1, 3), (50, 2.0, 2, 1, 4)],
)
def test_entropy_rate_matches_the_definition_and_mu_is_stationary(vocab_size, exponent, clusters, successors, seed):
    chain = ZipfMarkovChain(vocab_size, exponent, clusters, successors, seed)
    h, stationary, p = brute_force_entropy_rate(chain)
    assert np.allclose(p.sum(axis=1), 1.0, atol=1e-12)
    assert np.allclose(chain.mu @ p, chain.mu, atol=1e-14)  # Zipf is stationary
    assert np.allclose(stationary, zipf_probabilities(vocab_size, exponent), atol=1e-10)  # and the only one
    assert chain.entropy_rate() == pytest.approx(h, rel=1e-10, abs=1e-12)
    assert chain.entropy_rate() < chain.unigram_entropy() + 1e-12
    ids = np.arange(vocab_size)
    assert np.allclose(chain.transition_prob(ids[:, None], ids[None, :]), p, atol=1e-15)


def test_zipf_frequencies_and_balanced_clusters():
    chain = ZipfMarkovChain(10_000, 1.1, 100, 4, seed=0)
    mu = chain.mu
    assert mu[0] / mu[9] == pytest.approx(10**1.1)
    assert mu.sum() == pytest.approx(1.0)
    masses, sizes = chain.cluster_mass, np.bincount(chain.cluster_of, minlength=100)
    shared = sizes >= 2  # the other clusters hold one frequent word each
    assert masses[shared].max() / masses[shared].min() < 1.01  # nearly equal masses
    assert masses[~shared].min() >= masses[shared].max()  # a lone word is at least as heavy as a shared cluster
    assert entropy(mu) == pytest.approx(chain.unigram_entropy())


def test_samples_follow_the_chain_and_oracle_nll_estimates_the_entropy_rate():
    chain = ZipfMarkovChain(2000, 1.0, seed=5)
    blocks = chain.sample_blocks(4000, 26, seed=1)
    assert blocks.shape == (4000, 26) and blocks.dtype == np.int64
    assert blocks.min() >= 0 and blocks.max() < 2000
    assert np.array_equal(blocks, chain.sample_blocks(4000, 26, seed=1))  # deterministic
    nll = -chain.log_prob(blocks)
    assert np.isfinite(nll).all()  # every sampled transition is possible under the chain
    stderr = nll.std() / math.sqrt(nll.size)
    assert abs(nll.mean() - chain.entropy_rate()) < 5 * stderr + 0.01
    counts = np.bincount(blocks.ravel(), minlength=2000) / blocks.size
    assert np.abs(counts[:20] - chain.mu[:20]).max() < 0.01  # stationary frequencies at every position


def test_invalid_settings_raise_value_error():
    for kwargs in ({"vocab_size": 1}, {"vocab_size": 10, "num_clusters": 11}, {"vocab_size": 10, "zipf_exponent": 0},
                   {"vocab_size": 10, "successors": 0}):  # fmt: skip
        with pytest.raises(ValueError):
            ZipfMarkovChain(**kwargs)
    with pytest.raises(ValueError, match="too large"):
        ZipfMarkovChain(6000).dense_transition_matrix()
