"""A synthetic large-vocabulary corpus whose best achievable perplexity is known exactly.

:class:`ZipfMarkovChain` is a first-order Markov chain over V words (ids 0..V-1, id = frequency rank):

* **Zipfian frequencies.** The chain's stationary distribution is exactly mu(w) = (w + 1)^-s / H_{V,s}.
* **Clustered next-word structure.** The words are split into C clusters of nearly equal stationary
  mass (words in rank order, each to the currently lightest cluster). The next word depends only on the
  current word's cluster c: first the next cluster c' ~ T(c, .), then a word of c' in proportion to its
  frequency, p(w' | c') = mu(w') / m(c') with m(c') the cluster's mass. T is sparse: every cluster is
  linked to ``successors`` random clusters (links made symmetric), and the weights are
  Metropolis-Hastings moves between linked clusters, T(c, c') = min(1 / deg(c), m(c') / (m(c) deg(c'))),
  the rest staying at c. T is reversible with stationary distribution m, hence mu is stationary for the
  words: sum_w mu(w) P(w' | w) = sum_c m(c) T(c, c') mu(w') / m(c') = mu(w').

**Entropy rate (exact, O(V + edges)).** With the chain started from mu,

    H = sum_c m(c) H(T(c, .)) + sum_c m(c) H(p(. | c))        [nats per token]

(the first term is the uncertainty of the next cluster, the second of the word within it, using
sum_c m(c) T(c, c') = m(c')). exp(H) is the perplexity of the generating chain itself: no model can
do better in expectation. :meth:`ZipfMarkovChain.dense_transition_matrix` (small V) lets tests check
the formula against the definition H = -sum_{w,w'} mu(w) P(w' | w) log P(w' | w).

:meth:`ZipfMarkovChain.sample_blocks` draws independent stationary runs (each block starts from mu),
so every predicted token of a block follows its Markov predecessor and the expected per-token
negative log-likelihood of the true chain is exactly H. :meth:`ZipfMarkovChain.log_prob` scores
tokens under the true chain (the oracle).

Only numpy; nothing here imports torch, transformers or hf_midx, so benchmarks can import it alone.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np


def zipf_probabilities(vocab_size: int, exponent: float) -> np.ndarray:
    """(V,) float64 mu(w) = (w + 1)^-exponent, normalized."""
    weights = np.arange(1, vocab_size + 1, dtype=np.float64) ** -float(exponent)
    return weights / weights.sum()


def entropy(p: np.ndarray) -> float:
    """Shannon entropy in nats of a probability vector (zeros ignored)."""
    p = np.asarray(p, dtype=np.float64)
    nz = p[p > 0]
    return float(-(nz * np.log(nz)).sum())


def _balanced_clusters(mu: np.ndarray, num_clusters: int, rng: np.random.Generator) -> np.ndarray:
    """(V,) cluster of each word: words in decreasing mass, each to the currently lightest cluster.

    Clusters are numbered in a random order so that cluster ids carry no frequency information.
    """
    import heapq

    v = mu.shape[0]
    cluster = np.empty(v, dtype=np.int64)
    heap = [(0.0, c) for c in range(num_clusters)]  # (mass, cluster)
    for w in range(v):  # mu is decreasing in w
        mass, c = heapq.heappop(heap)
        cluster[w] = c
        heapq.heappush(heap, (mass + mu[w], c))
    return rng.permutation(num_clusters)[cluster]


@dataclass(frozen=True)
class ChainSettings:
    """What defines a chain; the same settings always give the same chain."""

    vocab_size: int = 100_000
    zipf_exponent: float = 1.0
    num_clusters: int | None = None  # None: round(sqrt(V)), at least 2
    successors: int = 8
    seed: int = 0

    def resolved_clusters(self) -> int:
        if self.num_clusters is not None:
            return self.num_clusters
        return max(2, round(math.sqrt(self.vocab_size)))


class ZipfMarkovChain:
    """The chain described in the module docstring.

    Args:
        vocab_size: V >= 2 words.
        zipf_exponent: s > 0 of the stationary frequencies mu(w) proportional to (w + 1)^-s.
        num_clusters: C, 2 <= C <= V (default round(sqrt(V)): exp(H) is then about 80 to 160 for V from
            5,000 to 1,000,000 with the other defaults, the range of word-level LMs on real text).
        successors: random links drawn per cluster (>= 1) before symmetrizing.
        seed: seeds the clustering and the links.
    """

    def __init__(
        self,
        vocab_size: int = 100_000,
        zipf_exponent: float = 1.0,
        num_clusters: int | None = None,
        successors: int = 8,
        seed: int = 0,
    ) -> None:
        if not isinstance(vocab_size, int) or vocab_size < 2:
            raise ValueError(f"vocab_size must be an integer >= 2, got {vocab_size!r}.")
        settings = ChainSettings(vocab_size, zipf_exponent, num_clusters, successors, seed)
        v, c = settings.vocab_size, settings.resolved_clusters()
        if not isinstance(c, int) or not 2 <= c <= v:
            raise ValueError(f"num_clusters must be an integer in [2, vocab_size={v}], got {num_clusters!r}.")
        if not (isinstance(zipf_exponent, (int, float)) and 0 < zipf_exponent < math.inf):
            raise ValueError(f"zipf_exponent must be a positive number, got {zipf_exponent!r}.")
        if not isinstance(successors, int) or successors < 1:
            raise ValueError(f"successors must be an integer >= 1, got {successors!r}.")
        self.settings = settings
        self.vocab_size, self.num_clusters = v, c
        rng = np.random.default_rng(seed)

        # Words: stationary frequencies, clusters, within-cluster probabilities.
        self.mu = zipf_probabilities(v, zipf_exponent)  # (V,)
        self.cluster_of = _balanced_clusters(self.mu, c, rng)  # (V,)
        self.cluster_mass = np.bincount(self.cluster_of, weights=self.mu, minlength=c)  # (C,) m(c)
        self.word_given_cluster = self.mu / self.cluster_mass[self.cluster_of]  # (V,) p(w | c(w))
        self.words_by_cluster = np.argsort(self.cluster_of, kind="stable")  # (V,) words grouped by cluster
        sorted_clusters = self.cluster_of[self.words_by_cluster]
        self._word_keys = sorted_clusters + _cumulative_within(
            sorted_clusters, self.word_given_cluster[self.words_by_cluster]
        )

        # Clusters: symmetric random links, Metropolis-Hastings weights, self-loops for the rest.
        src = np.repeat(np.arange(c), successors)
        dst = (src + rng.integers(1, c, size=src.shape[0])) % c  # never a self-link
        pairs = np.unique(np.concatenate([src * c + dst, dst * c + src]))
        a, b = pairs // c, pairs % c
        degree = np.bincount(a, minlength=c).astype(np.float64)
        m = self.cluster_mass
        move = np.minimum(1.0 / degree[a], m[b] / (m[a] * degree[b]))
        stay = np.clip(1.0 - np.bincount(a, weights=move, minlength=c), 0.0, 1.0)
        rows = np.concatenate([a, np.arange(c)])
        cols = np.concatenate([b, np.arange(c)])
        probs = np.concatenate([move, stay])
        order = np.lexsort((cols, rows))
        self.edge_from, self.edge_to, self.edge_prob = rows[order], cols[order], probs[order]  # CSR-ordered T
        self._edge_ids = self.edge_from * c + self.edge_to  # sorted: lookup of T(c, c') by id
        self._edge_keys = self.edge_from + _cumulative_within(self.edge_from, self.edge_prob)

    #: The ``synthetic`` entries of a run's ``results.json`` that fix its chain.
    FACT_KEYS = ("vocab_size", "zipf_exponent", "num_clusters", "successors", "corpus_seed")

    @classmethod
    def from_facts(cls, facts: dict) -> "ZipfMarkovChain":
        """The chain of a finished run, from the ``synthetic`` entry of its ``results.json`` (as ``large_vocab.py``
        writes it; the keys are ``FACT_KEYS``)."""
        return cls(*(facts[k] for k in cls.FACT_KEYS))

    # ------------------------------------------------------------------ exact quantities
    def entropy_rate(self) -> float:
        """H in nats per token (exact; see the module docstring)."""
        m = self.cluster_mass
        p = self.edge_prob
        nz = p > 0
        next_cluster = -float((m[self.edge_from[nz]] * p[nz] * np.log(p[nz])).sum())
        q = self.word_given_cluster
        within = -float((self.mu * np.log(q)).sum())  # sum_c m(c) H(p(.|c)) = -sum_w mu(w) log p(w|c(w))
        return next_cluster + within

    def entropy_rate_perplexity(self) -> float:
        """exp(H): the best perplexity any model can reach on this chain's text, in expectation."""
        return math.exp(self.entropy_rate())

    def unigram_entropy(self) -> float:
        """H(mu) in nats: the best a model that ignores the context can do."""
        return entropy(self.mu)

    def transition_prob(self, prev: np.ndarray, nxt: np.ndarray) -> np.ndarray:
        """P(nxt | prev) for arrays of word ids (any equal shapes); float64."""
        prev, nxt = np.asarray(prev, dtype=np.int64), np.asarray(nxt, dtype=np.int64)
        c_prev, c_next = self.cluster_of[prev], self.cluster_of[nxt]
        ids = c_prev * self.num_clusters + c_next
        pos = np.searchsorted(self._edge_ids, ids)
        pos_clipped = np.minimum(pos, self._edge_ids.shape[0] - 1)
        linked = self._edge_ids[pos_clipped] == ids
        t = np.where(linked, self.edge_prob[pos_clipped], 0.0)
        return t * self.word_given_cluster[nxt]

    def log_prob(self, blocks: np.ndarray) -> np.ndarray:
        """(n, L - 1) log P(block[:, t + 1] | block[:, t]) of (n, L) word-id blocks under the true chain."""
        blocks = np.asarray(blocks, dtype=np.int64)
        with np.errstate(divide="ignore"):
            return np.log(self.transition_prob(blocks[:, :-1], blocks[:, 1:]))

    def dense_transition_matrix(self) -> np.ndarray:
        """(V, V) P(w' | w); O(V^2) memory, for tests on small V."""
        if self.vocab_size > 5000:
            raise ValueError(f"dense_transition_matrix is O(V^2); V={self.vocab_size} is too large (max 5000).")
        t = np.zeros((self.num_clusters, self.num_clusters))
        t[self.edge_from, self.edge_to] = self.edge_prob
        return t[self.cluster_of][:, self.cluster_of] * self.word_given_cluster[None, :]

    # ------------------------------------------------------------------ sampling
    def sample_blocks(self, num_blocks: int, length: int, seed: int | list[int] = 0) -> np.ndarray:
        """(num_blocks, length) int64 word ids: independent runs of the chain, each started from mu.

        ``seed`` (an int or a list of ints) seeds ``numpy.random.default_rng``; same seed, same blocks.
        """
        if num_blocks < 0 or length < 1:
            raise ValueError(f"need num_blocks >= 0 and length >= 1, got {num_blocks} and {length}.")
        rng = np.random.default_rng(seed)
        out = np.empty((num_blocks, length), dtype=np.int64)
        if num_blocks == 0:
            return out
        cluster = self._draw(self._cluster_keys_stationary(), np.zeros(num_blocks, dtype=np.int64), rng)
        out[:, 0] = self._draw_word(cluster, rng)
        for t in range(1, length):
            cluster = self.edge_to[self._draw(self._edge_keys, self.cluster_of[out[:, t - 1]], rng)]
            out[:, t] = self._draw_word(cluster, rng)
        return out

    def _cluster_keys_stationary(self) -> np.ndarray:
        return _cumulative_within(np.zeros(self.num_clusters, dtype=np.int64), self.cluster_mass)

    def _draw_word(self, cluster: np.ndarray, rng: np.random.Generator) -> np.ndarray:
        return self.words_by_cluster[self._draw(self._word_keys, cluster, rng)]

    @staticmethod
    def _draw(keys: np.ndarray, group: np.ndarray, rng: np.random.Generator) -> np.ndarray:
        """Index of a draw within each row's segment of ``keys`` (= row + inclusive cumulative probability)."""
        u = rng.random(group.shape[0])
        return np.searchsorted(keys, group + u, side="right")


def _cumulative_within(groups: np.ndarray, probs: np.ndarray) -> np.ndarray:
    """Inclusive cumulative sum of ``probs`` restarted at every new value of the sorted ``groups``.

    The last entry of each group is set to exactly 1, so ``group + u`` for u in [0, 1) always lands
    inside the group with ``searchsorted(..., side="right")``.
    """
    csum = np.cumsum(probs)
    starts = np.flatnonzero(np.r_[True, groups[1:] != groups[:-1]])
    offsets = np.r_[0.0, csum][starts]
    counts = np.diff(np.r_[starts, groups.shape[0]])
    within = csum - np.repeat(offsets, counts)
    ends = np.r_[starts[1:], groups.shape[0]] - 1
    within = within / np.repeat(within[ends], counts)  # renormalize each group to end at 1
    within[ends] = 1.0
    return within
