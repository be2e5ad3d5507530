"""Proposal distributions Q(i | z) for sampled softmax, one interface for all of the paper's samplers.

Shapes: T queries (hidden states), D dims, V classes, M draws per query, P draws in a shared pool,
K codewords per codebook.

Every sampler offers

* ``sample(queries (T, D), M) -> ids (T, M) int64, log_q (T, M) float32``: M i.i.d. draws per query and
  the normalized log-probability of each draw under that query's proposal;
* ``log_prob(queries (T, D), ids (T, ...)) -> (T, ...) float32``: log Q(id | query), normalized over V;
* ``sample_shared(queries (T, D), P) -> ids (P,), log_qbar (P,)``: one pool drawn from the batch mixture
  qbar(i) = (1/T) sum_t Q(i | z_t), with log qbar of each draw;
* ``refresh(embeddings (V, D))``: rebuild what the proposal keeps from the current class embeddings;
* ``state_dict()`` / ``load_state_dict()``: tensors only, for safetensors checkpoints.

All probabilities are computed in float32 log space whatever the model's dtype, and a sampled id never
gets a -inf or NaN log-probability.
"""

from __future__ import annotations

import math
from typing import ClassVar

import torch

from ._checks import check_ids, check_matrix, check_positive_int
from .index import MidxIndex

# Upper bound on the elements of one (chunk, V) or (chunk, K*K) work tensor.
_WORK_ELEMENTS = 1 << 22


def _chunks(total: int, per_row: int):
    step = max(1, _WORK_ELEMENTS // max(per_row, 1))
    for start in range(0, total, step):
        yield slice(start, min(start + step, total))


def _as_generator(generator: torch.Generator | None, default: torch.Generator) -> torch.Generator:
    return default if generator is None else generator


def _inverse_cdf(weights: torch.Tensor, num: int, gen: torch.Generator) -> torch.Tensor:
    """``num`` i.i.d. draws per row from unnormalized non-negative ``weights`` (..., K) (float32/64).

    Returns (..., num) int64. Inverse-CDF sampling by ``searchsorted``; a zero-weight category is never
    returned, because the target stays strictly below the total.
    """
    cum = weights.cumsum(-1)
    total = cum[..., -1:]
    u = torch.rand(*weights.shape[:-1], num, dtype=cum.dtype, device=cum.device, generator=gen)
    target = torch.minimum(u * total, torch.nextafter(total, torch.zeros_like(total)))
    return torch.searchsorted(cum, target, right=True)


class Sampler:
    """Base class: validation, the shared-pool mixture, RNG and state handling.

    Subclasses implement ``_sample``, ``_log_prob`` and ``refresh``; they may override ``_sample_shared``
    and ``_log_prob_shared`` with faster versions.
    """

    name: ClassVar[str] = ""
    #: True when Q depends on the query; False for static proposals (uniform, unigram, log-uniform).
    query_dependent: ClassVar[bool] = True

    def __init__(self, embeddings: torch.Tensor, *, seed: int = 0) -> None:
        check_matrix("embeddings", embeddings)
        if embeddings.shape[0] < 1:
            raise ValueError("embeddings must have at least one class (row).")
        self.num_classes = embeddings.shape[0]
        self.dim = embeddings.shape[1]
        self.device = embeddings.device
        self.seed = seed
        self.generator = torch.Generator(device=self.device).manual_seed(seed)

    # ------------------------------------------------------------------ public API
    def sample(
        self, queries: torch.Tensor, num_samples: int, generator: torch.Generator | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Draw ``num_samples`` classes i.i.d. from Q(. | z_t) for each query.

        Args:
            queries: (T, D) float tensor (any float dtype; used in float32, no gradient).
            num_samples: M >= 1.
            generator: optional torch.Generator on the sampler's device; defaults to the sampler's own.
        Returns:
            ids: (T, M) int64 in [0, V); log_q: (T, M) float32, log Q(ids | z_t), finite.
        """
        q = self._queries(queries)
        check_positive_int("num_samples", num_samples)
        return self._sample(q, num_samples, _as_generator(generator, self.generator))

    def log_prob(self, queries: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """log Q(ids | z), normalized over all V classes.

        Args:
            queries: (T, D) float tensor.
            ids: (T, ...) int64 class ids in [0, V).
        Returns:
            (T, ...) float32.
        """
        q = self._queries(queries)
        check_ids("ids", ids, self.num_classes)
        if ids.dim() == 0 or ids.shape[0] != q.shape[0]:
            raise ValueError(f"ids must have shape (T, ...) with T={q.shape[0]} queries, got {tuple(ids.shape)}.")
        # Explicit width (not -1): reshape(0, -1) is ambiguous for an empty batch of queries.
        flat = ids.reshape(ids.shape[0], math.prod(ids.shape[1:])).to(self.device)
        return self._log_prob(q, flat).reshape(ids.shape)

    def sample_shared(
        self, queries: torch.Tensor, num_samples: int, generator: torch.Generator | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Draw one pool of P classes from the batch mixture qbar(i) = (1/T) sum_t Q(i | z_t).

        Each draw picks a query uniformly and then a class from that query's proposal.

        Returns:
            ids: (P,) int64; log_qbar: (P,) float32, log qbar(ids).
        """
        q = self._queries(queries)
        check_positive_int("num_samples", num_samples)
        if q.shape[0] == 0:
            raise ValueError("sample_shared needs at least one query.")
        return self._sample_shared(q, num_samples, _as_generator(generator, self.generator))

    def log_prob_shared(self, queries: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """log qbar(ids) for (P,) ids under the mixture of the (T, D) queries' proposals; (P,) float32."""
        q = self._queries(queries)
        check_ids("ids", ids, self.num_classes)
        if ids.dim() != 1:
            raise ValueError(f"ids must be 1-D (P,), got shape {tuple(ids.shape)}.")
        return self._log_prob_shared(q, ids.to(self.device))

    def full_log_prob(self, queries: torch.Tensor) -> torch.Tensor:
        """log Q(. | z) over all classes, (T, V) float32. O(T V): for tests and diagnostics only."""
        q = self._queries(queries)
        ids = torch.arange(self.num_classes, device=self.device).expand(q.shape[0], -1)
        return self._log_prob(q, ids)

    def refresh(self, embeddings: torch.Tensor) -> None:
        """Rebuild the proposal's tables from the current (V, D) class embeddings (in place)."""
        raise NotImplementedError

    # ------------------------------------------------------------------ state
    #: attribute names of the tensors that, with the RNG state, define the sampler.
    _state_names: ClassVar[tuple[str, ...]] = ()

    def state_dict(self) -> dict[str, torch.Tensor]:
        """Tensors that define the proposal and the RNG position (for safetensors checkpoints)."""
        state = {name: getattr(self, name).contiguous() for name in self._state_names}
        state["generator_state"] = self.generator.get_state()
        # V is stored explicitly: proposals without per-class tensors (uniform) could not refuse a
        # checkpoint of another vocabulary otherwise.
        state["num_classes"] = torch.tensor(self.num_classes, dtype=torch.int64, device=self.device)
        return state

    def _check_num_classes(self, state: dict[str, torch.Tensor]) -> None:
        if "num_classes" in state and int(state["num_classes"]) != self.num_classes:
            raise ValueError(
                f"{self.name} sampler state is for V={int(state['num_classes'])} classes, this sampler has "
                f"V={self.num_classes}: the checkpoint comes from another vocabulary."
            )

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        """Restore from :meth:`state_dict`; raises ValueError on missing keys or other shapes."""
        self._check_num_classes(state)
        for name in self._state_names:
            if name not in state:
                raise ValueError(f"{self.name} sampler state is missing {name!r}; it was saved by another sampler.")
            have = getattr(self, name)
            if tuple(state[name].shape) != tuple(have.shape):
                raise ValueError(
                    f"{self.name} sampler state {name!r} has shape {tuple(state[name].shape)}, this sampler has "
                    f"{tuple(have.shape)}: the checkpoint comes from another vocabulary, dimension or codebook size."
                )
        for name in self._state_names:
            setattr(self, name, state[name].to(device=self.device, dtype=getattr(self, name).dtype))
        if "generator_state" in state:
            self.generator.set_state(state["generator_state"].cpu().to(torch.uint8))
        self._after_load()

    def _after_load(self) -> None:
        """Recompute derived tables after :meth:`load_state_dict`."""

    # ------------------------------------------------------------------ defaults for subclasses
    def _queries(self, queries: torch.Tensor) -> torch.Tensor:
        check_matrix("queries", queries, dim=self.dim)
        return queries.detach().to(device=self.device, dtype=torch.float32)

    def _check_embeddings(self, embeddings: torch.Tensor) -> torch.Tensor:
        check_matrix("embeddings", embeddings, dim=self.dim)
        if embeddings.shape[0] != self.num_classes:
            raise ValueError(
                f"refresh got {embeddings.shape[0]} classes but the sampler was built for {self.num_classes}; "
                "build a new sampler for a new vocabulary."
            )
        return embeddings.detach().to(device=self.device, dtype=torch.float32)

    def _sample(self, q: torch.Tensor, m: int, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
        raise NotImplementedError

    def _log_prob(self, q: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def _sample_shared(self, q: torch.Tensor, p: int, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
        if not self.query_dependent:
            ids, log_q = self._sample(q[:1], p, gen)
            return ids[0], log_q[0]
        rows = torch.randint(q.shape[0], (p,), device=self.device, generator=gen)
        ids, _ = self._sample(q[rows], 1, gen)
        ids = ids[:, 0]
        return ids, self._log_prob_shared(q, ids)

    def _log_prob_shared(self, q: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        if not self.query_dependent:
            return self._log_prob(q[:1], ids.unsqueeze(0))[0]
        out = torch.full((ids.shape[0],), -math.inf, device=self.device)
        # log qbar = logsumexp_t log Q(i|z_t) - log T, accumulated over query chunks.
        for rows in _chunks(q.shape[0], ids.shape[0]):
            lp = self._log_prob(q[rows], ids.expand(rows.stop - rows.start, -1))
            out = torch.logaddexp(out, torch.logsumexp(lp, dim=0))
        return out - math.log(q.shape[0])

    def __repr__(self) -> str:
        return f"{type(self).__name__}(name={self.name!r}, V={self.num_classes}, D={self.dim})"


# ====================================================================== static proposals
class UniformSampler(Sampler):
    """Q(i) = 1 / V."""

    name = "uniform"
    query_dependent = False

    def __init__(self, embeddings: torch.Tensor, *, seed: int = 0, **_ignored) -> None:
        super().__init__(embeddings, seed=seed)

    def refresh(self, embeddings: torch.Tensor) -> None:
        self._check_embeddings(embeddings)

    def _sample(self, q, m, gen):
        ids = torch.randint(self.num_classes, (q.shape[0], m), device=self.device, generator=gen)
        return ids, torch.full(ids.shape, -math.log(self.num_classes), device=self.device)

    def _log_prob(self, q, ids):
        return torch.full(ids.shape, -math.log(self.num_classes), device=self.device)


class _TableSampler(Sampler):
    """A static proposal given by a (V,) table of log-probabilities ``log_table``."""

    query_dependent = False
    _state_names = ("log_table",)

    def _sample(self, q, m, gen):
        if q.shape[0] == 0:  # torch.multinomial refuses to draw 0 samples
            ids = torch.empty(0, m, dtype=torch.long, device=self.device)
            return ids, self.log_table[ids]
        flat = torch.multinomial(self.log_table.exp(), q.shape[0] * m, replacement=True, generator=gen)
        ids = flat.view(q.shape[0], m)
        return ids, self.log_table[ids]

    def _log_prob(self, q, ids):
        return self.log_table[ids]


def _check_counts(class_counts, num_classes: int, device) -> torch.Tensor:
    if class_counts is None:
        raise ValueError(
            "This sampler needs class_counts: a (V,) tensor of training-token frequencies "
            "(e.g. torch.bincount(train_ids, minlength=V))."
        )
    counts = torch.as_tensor(class_counts, dtype=torch.float64, device=device)
    if counts.shape != (num_classes,):
        raise ValueError(f"class_counts must have shape ({num_classes},), got {tuple(counts.shape)}.")
    if not bool(torch.isfinite(counts).all()) or bool((counts < 0).any()):
        raise ValueError("class_counts must be finite and non-negative.")
    return counts


class UnigramSampler(_TableSampler):
    """Q(i) proportional to (count_i + smoothing) ** power, from training-token frequencies.

    ``smoothing`` (default 1, add-one) keeps every class drawable, so the estimator of the partition
    function stays unbiased; ``power`` = 1 is the paper's unigram, 0.75 the word2vec distortion.
    """

    name = "unigram"

    def __init__(
        self,
        embeddings: torch.Tensor,
        *,
        class_counts=None,
        unigram_smoothing: float = 1.0,
        unigram_power: float = 1.0,
        seed: int = 0,
        **_ignored,
    ) -> None:
        super().__init__(embeddings, seed=seed)
        counts = _check_counts(class_counts, self.num_classes, self.device)
        if unigram_smoothing < 0 or unigram_power < 0:
            raise ValueError("unigram_smoothing and unigram_power must be >= 0.")
        weights = (counts + unigram_smoothing) ** unigram_power
        if not bool((weights > 0).any()):
            raise ValueError("class_counts are all zero; pass real counts or unigram_smoothing > 0.")
        self.log_table = (weights / weights.sum()).log().float()

    def refresh(self, embeddings: torch.Tensor) -> None:
        self._check_embeddings(embeddings)


class LogUniformSampler(_TableSampler):
    """Zipfian proposal over frequency ranks (TensorFlow's log_uniform_candidate_sampler).

    P(rank r) = (log(r + 2) - log(r + 1)) / log(V + 1). Class ids are taken as ranks unless
    ``class_counts`` is given, in which case classes are ranked by descending count.
    """

    name = "log-uniform"

    def __init__(self, embeddings: torch.Tensor, *, class_counts=None, seed: int = 0, **_ignored) -> None:
        super().__init__(embeddings, seed=seed)
        v = self.num_classes
        r = torch.arange(v, dtype=torch.float64, device=self.device)
        log_p_rank = (torch.log1p(1.0 / (r + 1.0))).log() - math.log(math.log(v + 1.0)) if v > 0 else r
        if class_counts is None:
            rank_of_class = torch.arange(v, device=self.device)
        else:
            counts = _check_counts(class_counts, v, self.device)
            by_rank = torch.sort(-counts, stable=True).indices
            rank_of_class = torch.empty_like(by_rank)
            rank_of_class[by_rank] = torch.arange(v, device=self.device)
        self.log_table = log_p_rank[rank_of_class].float()

    def refresh(self, embeddings: torch.Tensor) -> None:
        self._check_embeddings(embeddings)


# ====================================================================== MIDX
class MidxSampler(Sampler):
    """The faster MIDX proposal (the paper's Eq. midx_uni) over an inverted multi-index.

    Q(i | z) = exp(z1.c1[k1(i)] + z2.c2[k2(i)]) / sum_{k,k'} |Omega(k,k')| exp(z1.c1[k] + z2.c2[k']),
    i.e. softmax over the quantized embeddings q_i - residual_i. A draw takes a bucket (k1, k2) with
    probability P1(k1) P2(k2 | k1), computed as one categorical over the K*K buckets whose logits
    are z1.c1[k1] + z2.c2[k2] + log|Omega(k1,k2)| (empty buckets get -inf and are never drawn),
    then a class uniformly from the bucket. Per query: O(K D + K^2 + M); nothing of size V.
    """

    name = "midx"

    def __init__(
        self,
        embeddings: torch.Tensor,
        *,
        codebook_size: int = 64,
        quantizer: str = "rq",
        kmeans_iters: int = 20,
        kmeans_backend: str = "torch",
        seed: int = 0,
        **_ignored,
    ) -> None:
        super().__init__(embeddings, seed=seed)
        self.index = MidxIndex.build(
            embeddings.detach(),
            codebook_size,
            quantizer=quantizer,
            kmeans_iters=kmeans_iters,
            kmeans_backend=kmeans_backend,
            seed=seed,
        )

    @property
    def quantizer(self) -> str:
        return self.index.quantizer

    def refresh(self, embeddings: torch.Tensor) -> None:
        """Warm-started k-means on the new embeddings; O(V K D iters)."""
        self.index.rebuild(self._check_embeddings(embeddings))

    def set_codebooks(self, codebooks: tuple[torch.Tensor, torch.Tensor], embeddings: torch.Tensor) -> None:
        """Adopt (e.g. learned) codebooks; recomputes codes and bucket tables in O(V K D)."""
        self.index.set_codebooks(codebooks, self._check_embeddings(embeddings))

    # -- the proposal
    def codeword_scores(self, q: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """s1 = z1 . c1 (T, K), s2 = z2 . c2 (T, K) float32 and log Z (T,) float32."""
        s1, s2, log_z, *_ = self._proposal(q)
        return s1, s2, log_z

    def _proposal(self, q: torch.Tensor):
        """The per-query quantities of Eq. midx_uni, without any T x K x K tensor.

        With psi(k1) = sum_k2 |Omega(k1,k2)| exp(s2[k2]) (one (T,K) x (K,K) matmul),
        Z = sum_k1 exp(s1[k1]) psi(k1) and P1(k1) = exp(s1[k1]) psi(k1) / Z.
        Returns s1, s2 (T, K) float32; log Z (T,) float32; and, float64 (T, K), e2 = exp(s2 - m2),
        P1 and psi / exp(m2), so that P(k1, k2) = P1(k1) |Omega(k1,k2)| e2[k2] / psi[k1]. m2 is the
        row's largest s2 over codewords that hold classes: psi >= 1 for some k1 in every row, and
        float64 loses only buckets more than ~700 nats below the best.
        """
        d1, d2 = self.index.dim_slices(q.shape[1])
        c1, c2 = self.index.codebooks
        s1 = q[:, d1] @ c1.t()
        s2 = q[:, d2] @ c2.t()
        counts = self.index.bucket_counts.double()
        used = counts.sum(0) > 0
        s2_used = s2.masked_fill(~used, -math.inf)  # a codeword without classes must not overflow e2
        m2 = s2_used.amax(1, keepdim=True)
        e2 = (s2_used - m2).double().exp()
        psi = e2 @ counts.t()
        logits1 = s1.double() + psi.log() + m2.double()  # -inf for codewords k1 with no class
        log_z = torch.logsumexp(logits1, dim=1, keepdim=True)
        return s1, s2, log_z.squeeze(1).float(), e2, (logits1 - log_z).exp(), psi

    def _draw_buckets(self, e2: torch.Tensor, p1: torch.Tensor, psi: torch.Tensor, m: int, gen) -> torch.Tensor:
        """(T, M) bucket ids b = k1*K + k2 drawn with probability P1(k1) P2(k2 | k1).

        Inverse-CDF draws, whichever is cheaper for M: k1 from P1 and then k2 from
        P2(. | k1) proportional to |Omega(k1,k2)| e2[k2], O(M K) per query (the paper's two stages);
        or, for M > K/2, one search per draw over the K*K buckets laid out in (k1, k2) order, which is
        the same two-stage draw at O(K^2) per query whatever M is. Empty buckets have weight 0 and are
        never drawn.
        """
        k = e2.shape[1]
        counts = self.index.bucket_counts
        out = torch.empty(e2.shape[0], m, dtype=torch.long, device=e2.device)
        if 2 * m <= k:
            k1 = _inverse_cdf(p1, m, gen)
            for rows in _chunks(e2.shape[0], m * k):
                w2 = counts[k1[rows]].to(e2.dtype) * e2[rows].unsqueeze(1)  # (c, M, K)
                out[rows] = k1[rows] * k + _inverse_cdf(w2, 1, gen).squeeze(-1)
            return out
        r = torch.where(psi > 0, p1 / psi, torch.zeros_like(psi)).float()
        for rows in _chunks(e2.shape[0], k * k):
            # (c, K, K) bucket probabilities, float32 (a bucket below e^-87 of the total is never drawn).
            joint = r[rows].unsqueeze(2) * counts.float().unsqueeze(0) * e2[rows].float().unsqueeze(1)
            out[rows] = _inverse_cdf(joint.view(-1, k * k), m, gen)
        return out

    def _uniform_in_bucket(self, buckets: torch.Tensor, gen) -> torch.Tensor:
        start = self.index.offsets[buckets]
        size = self.index.offsets[buckets + 1] - start
        u = torch.rand(buckets.shape, dtype=torch.float64, device=buckets.device, generator=gen)
        pos = start + torch.minimum((u * size).long(), size - 1)
        return self.index.order[pos]

    def _gather_log_q(self, s1, s2, log_z, ids) -> torch.Tensor:
        codes = self.index.codes[ids]  # (..., 2)
        return s1.gather(1, codes[..., 0]) + s2.gather(1, codes[..., 1]) - log_z.unsqueeze(1)

    def _sample(self, q, m, gen):
        s1, s2, log_z, e2, p1, psi = self._proposal(q)
        ids = self._uniform_in_bucket(self._draw_buckets(e2, p1, psi, m, gen), gen)
        return ids, self._gather_log_q(s1, s2, log_z, ids)

    def _log_prob(self, q, ids):
        s1, s2, log_z = self.codeword_scores(q)
        return self._gather_log_q(s1, s2, log_z, ids)

    def _sample_shared(self, q, p, gen):
        s1, s2, log_z, e2, p1, psi = self._proposal(q)
        rows = torch.randint(q.shape[0], (p,), device=self.device, generator=gen)
        ids = self._uniform_in_bucket(self._draw_buckets(e2[rows], p1[rows], psi[rows], 1, gen)[:, 0], gen)
        return ids, self._mixture_log_q(s1, s2, log_z, ids)

    def _log_prob_shared(self, q, ids):
        return self._mixture_log_q(*self.codeword_scores(q), ids)

    def _mixture_log_q(self, s1, s2, log_z, ids):
        # qbar(i) = (1/T) sum_t exp(s1[t,k1(i)] + s2[t,k2(i)] - logZ_t): T x P gathers from the T x K scores.
        codes = self.index.codes[ids]
        out = torch.full((ids.shape[0],), -math.inf, device=self.device)
        for rows in _chunks(s1.shape[0], ids.shape[0]):
            lp = s1[rows][:, codes[:, 0]] + s2[rows][:, codes[:, 1]] - log_z[rows].unsqueeze(1)
            out = torch.logaddexp(out, torch.logsumexp(lp, dim=0))
        return out - math.log(s1.shape[0])

    # -- state
    def state_dict(self) -> dict[str, torch.Tensor]:
        state = {f"index.{k}": v.contiguous() for k, v in self.index.state_dict().items()}
        state["generator_state"] = self.generator.get_state()
        state["num_classes"] = torch.tensor(self.num_classes, dtype=torch.int64, device=self.device)
        return state

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        self._check_num_classes(state)
        self.index.load_state_dict({k[len("index.") :]: v for k, v in state.items() if k.startswith("index.")})
        if "generator_state" in state:
            self.generator.set_state(state["generator_state"].cpu().to(torch.uint8))


class MidxRQSampler(MidxSampler):
    """MIDX with residual quantization (both codebooks in D dims)."""

    name = "midx-rq"

    def __init__(self, embeddings: torch.Tensor, **options) -> None:
        options["quantizer"] = "rq"
        super().__init__(embeddings, **options)


class MidxPQSampler(MidxSampler):
    """MIDX with product quantization (codebook 1 on the first D/2 dims, codebook 2 on the rest)."""

    name = "midx-pq"

    def __init__(self, embeddings: torch.Tensor, **options) -> None:
        options["quantizer"] = "pq"
        super().__init__(embeddings, **options)


class MidxExactSampler(MidxSampler):
    """Theorem 1: P1(k1) P2(k2|k1) P3(i|k1,k2) with the residual softmax P3; exactly softmax(z . q).

    Costs O(V D) per query (it keeps the embeddings): it verifies the decomposition and serves as a
    yardstick, not as a fast sampler. ``quantizer`` ("rq" default or "pq") picks the index.
    """

    name = "midx-exact"
    _state_names = ("embeddings",)

    def __init__(self, embeddings: torch.Tensor, **options) -> None:
        super().__init__(embeddings, **options)
        self.embeddings = embeddings.detach().float().clone()

    def refresh(self, embeddings: torch.Tensor) -> None:
        emb = self._check_embeddings(embeddings)
        self.index.rebuild(emb)
        self.embeddings = emb.clone()

    def set_codebooks(self, codebooks, embeddings) -> None:
        super().set_codebooks(codebooks, embeddings)
        self.embeddings = self._check_embeddings(embeddings).clone()

    def _log_prob(self, q, ids):
        out = torch.empty(ids.shape, device=self.device)
        for rows in _chunks(q.shape[0], self.num_classes):
            logits = q[rows] @ self.embeddings.t()
            out[rows] = logits.gather(1, ids[rows]) - torch.logsumexp(logits, dim=1, keepdim=True)
        return out

    def _sample(self, q, m, gen):
        idx = self.index
        k2 = idx.codebook_size**2
        bucket_of_class = idx.codes[:, 0] * idx.codebook_size + idx.codes[:, 1]
        ids = torch.empty(q.shape[0], m, dtype=torch.long, device=self.device)
        log_q = torch.empty(q.shape[0], m, device=self.device)
        for rows in _chunks(q.shape[0], 2 * self.num_classes):
            zq = q[rows]
            s1, s2, _ = self.codeword_scores(zq)
            logits = zq @ self.embeddings.t()  # (c, V)
            codes = idx.codes.unsqueeze(0).expand(zq.shape[0], -1, -1)
            residual = logits - s1.gather(1, codes[..., 0]) - s2.gather(1, codes[..., 1])  # z . q~_i
            # log omega(k1,k2) = logsumexp of residual logits over the bucket (scatter in log space).
            b_idx = bucket_of_class.expand(zq.shape[0], -1)
            b_max = torch.full((zq.shape[0], k2), -math.inf, device=self.device).scatter_reduce(
                1, b_idx, residual, reduce="amax"
            )
            w = (residual - b_max.gather(1, b_idx)).double().exp()  # each bucket's max weight is 1
            b_sum = torch.zeros(zq.shape[0], k2, dtype=torch.float64, device=self.device).scatter_add_(1, b_idx, w)
            log_omega = (b_max + b_sum.log().float()).view(-1, k2)  # -inf for empty buckets
            joint = (s1.unsqueeze(2) + s2.unsqueeze(1)).view(-1, k2) + log_omega
            log_p12 = torch.log_softmax(joint, dim=1)
            buckets = torch.multinomial(log_p12.exp(), m, replacement=True, generator=gen)
            # P3: inverse CDF inside the bucket's CSR slice of the per-query cumulative weights.
            cum = torch.cumsum(w.gather(1, idx.order.expand(zq.shape[0], -1)), dim=1)
            cum = torch.cat([torch.zeros(zq.shape[0], 1, dtype=cum.dtype, device=cum.device), cum], dim=1)
            lo, hi = idx.offsets[buckets], idx.offsets[buckets + 1]
            base, top = cum.gather(1, lo), cum.gather(1, hi)
            u = torch.rand(buckets.shape, dtype=torch.float64, device=self.device, generator=gen)
            pos = torch.searchsorted(cum, base + u * (top - base), right=True) - 1
            pos = torch.maximum(torch.minimum(pos, hi - 1), lo)
            drawn = idx.order[pos]
            ids[rows] = drawn
            log_p3 = residual.gather(1, drawn) - log_omega.gather(1, buckets)
            log_q[rows] = log_p12.gather(1, buckets) + log_p3
        return ids, log_q

    def _sample_shared(self, q, p, gen):
        return Sampler._sample_shared(self, q, p, gen)

    def _log_prob_shared(self, q, ids):
        return Sampler._log_prob_shared(self, q, ids)

    def state_dict(self) -> dict[str, torch.Tensor]:
        state = super().state_dict()
        state["embeddings"] = self.embeddings.contiguous()
        return state

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        self._check_num_classes(state)
        if "embeddings" not in state or tuple(state["embeddings"].shape) != tuple(self.embeddings.shape):
            raise ValueError("midx-exact sampler state lacks embeddings of this sampler's (V, D) shape.")
        super().load_state_dict(state)
        self.embeddings = state["embeddings"].to(self.device, torch.float32)


# ====================================================================== kernel and hashing baselines
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
        for rows in _chunks(q.shape[0], self.num_classes):
            lw = self._log_weights(q[rows])
            lp = lw - torch.logsumexp(lw, dim=1, keepdim=True)
            drawn = torch.multinomial(lp.exp(), m, replacement=True, generator=gen)
            ids[rows], log_q[rows] = drawn, lp.gather(1, drawn)
        return ids, log_q

    def _log_prob(self, q, ids):
        out = torch.empty(ids.shape, device=self.device)
        for rows in _chunks(q.shape[0], self.num_classes):
            lw = self._log_weights(q[rows])
            out[rows] = lw.gather(1, ids[rows]) - torch.logsumexp(lw, dim=1, keepdim=True)
        return out


class SphereSampler(_ExhaustiveSampler):
    """Quadratic-kernel proposal: Q(i | z) proportional to alpha * (z . q_i)^2 + 1 (Blanc & Rendle, 2018)."""

    name = "sphere"
    _state_names = ("embeddings",)

    def __init__(self, embeddings: torch.Tensor, *, sphere_alpha: float = 100.0, seed: int = 0, **_ignored) -> None:
        super().__init__(embeddings, seed=seed)
        if not sphere_alpha > 0:
            raise ValueError(f"sphere_alpha must be > 0, got {sphere_alpha}.")
        self.alpha = float(sphere_alpha)
        self.embeddings = embeddings.detach().float().clone()

    def refresh(self, embeddings: torch.Tensor) -> None:
        self.embeddings = self._check_embeddings(embeddings).clone()

    def _log_weights(self, q):
        o = q @ self.embeddings.t()
        return torch.log1p(self.alpha * o * o)


class RFFSampler(_ExhaustiveSampler):
    """Random Fourier features (Rawat et al., 2019): Q(i | z) proportional to phi(z) . phi(q_i).

    Queries and classes are L2-normalized; phi(x) = [cos(W x), sin(W x)] / sqrt(R) with W ~ N(0, tau I)
    approximates the Gaussian kernel exp(-tau ||z - q||^2 / 2) = exp(-tau) exp(tau z . q). The estimate
    can be negative, so weights are floored at exp(-2 tau), the true kernel's minimum on the sphere,
    which keeps every class drawable and the probability exact.
    """

    name = "rff"
    _state_names = ("projection", "class_features")

    def __init__(
        self,
        embeddings: torch.Tensor,
        *,
        rff_features: int = 32,
        rff_temperature: float = 4.0,
        seed: int = 0,
        **_ignored,
    ) -> None:
        super().__init__(embeddings, seed=seed)
        check_positive_int("rff_features", rff_features)
        if not rff_temperature > 0:
            raise ValueError(f"rff_temperature must be > 0, got {rff_temperature}.")
        self.temperature = float(rff_temperature)
        gen = torch.Generator().manual_seed(seed + 7919)
        self.projection = (torch.randn(rff_features, self.dim, generator=gen) * math.sqrt(self.temperature)).to(
            self.device
        )
        self.class_features = self._features(embeddings.detach().float())

    def _features(self, x: torch.Tensor) -> torch.Tensor:
        proj = torch.nn.functional.normalize(x, dim=1) @ self.projection.t()
        return torch.cat([proj.cos(), proj.sin()], dim=1) / math.sqrt(self.projection.shape[0])

    def refresh(self, embeddings: torch.Tensor) -> None:
        self.class_features = self._features(self._check_embeddings(embeddings))

    def _log_weights(self, q):
        k = self._features(q) @ self.class_features.t()
        return k.clamp_min(math.exp(-2.0 * self.temperature)).log()


class LSHSampler(Sampler):
    """SimHash proposal: L tables of b random hyperplanes each (default 16 x 4).

    A draw is uniform over V with probability ``lsh_uniform_mix``; otherwise it picks uniformly one of
    the tables in which the query's bucket is non-empty and then a class uniformly from that bucket.
    Hence, exactly, Q(i | z) = mix / V + (1 - mix) / L_z * sum_{l : h_l(i) = h_l(z)} 1 / |B_l(h_l(z))|,
    with L_z the number of tables whose query bucket is non-empty (Q = 1/V when L_z = 0).
    """

    name = "lsh"
    _state_names = ("hyperplanes", "class_hashes")

    def __init__(
        self,
        embeddings: torch.Tensor,
        *,
        lsh_tables: int = 16,
        lsh_bits: int = 4,
        lsh_uniform_mix: float = 0.05,
        seed: int = 0,
        **_ignored,
    ) -> None:
        super().__init__(embeddings, seed=seed)
        check_positive_int("lsh_tables", lsh_tables)
        check_positive_int("lsh_bits", lsh_bits)
        if lsh_bits > 24:
            raise ValueError(f"lsh_bits={lsh_bits} gives 2**{lsh_bits} buckets per table; use at most 24.")
        if not 0.0 <= lsh_uniform_mix <= 1.0:
            raise ValueError(f"lsh_uniform_mix must be in [0, 1], got {lsh_uniform_mix}.")
        self.num_tables, self.num_bits, self.mix = lsh_tables, lsh_bits, float(lsh_uniform_mix)
        gen = torch.Generator().manual_seed(seed + 104729)
        self.hyperplanes = torch.randn(lsh_tables * lsh_bits, self.dim, generator=gen).to(self.device)
        self._weights_pow2 = 2 ** torch.arange(lsh_bits, device=self.device)
        self.class_hashes = self._hash(embeddings.detach().float())
        self._after_load()

    def _hash(self, x: torch.Tensor) -> torch.Tensor:
        """(N, D) -> (N, L) int64 bucket ids in [0, 2^b)."""
        bits = (x @ self.hyperplanes.t() > 0).long().view(x.shape[0], self.num_tables, self.num_bits)
        return (bits * self._weights_pow2).sum(-1)

    def _after_load(self) -> None:
        nb = 2**self.num_bits
        table_offset = torch.arange(self.num_tables, device=self.device) * nb
        key = (self.class_hashes + table_offset).t()  # (L, V): global bucket id per table
        self._order = torch.sort(key, dim=1, stable=True).indices  # (L, V) class ids per table, by bucket
        counts = torch.bincount(key.flatten(), minlength=self.num_tables * nb).view(self.num_tables, nb)
        self._counts = counts
        self._offsets = torch.cumsum(counts, 1) - counts  # (L, nb) start of each bucket in _order[l]

    def refresh(self, embeddings: torch.Tensor) -> None:
        self.class_hashes = self._hash(self._check_embeddings(embeddings))
        self._after_load()

    def _query_tables(self, q):
        h = self._hash(q)  # (T, L)
        sizes = self._counts.gather(1, h.t()).t()  # (T, L)
        return h, sizes

    def _sample(self, q, m, gen):
        t = q.shape[0]
        h, sizes = self._query_tables(q)
        nonempty = sizes > 0
        has_any = nonempty.any(dim=1, keepdim=True)
        table_w = torch.where(has_any, nonempty.float(), torch.ones_like(nonempty, dtype=torch.float32))
        tables = torch.multinomial(table_w, m, replacement=True, generator=gen)  # (T, M)
        size = sizes.gather(1, tables)
        start = self._offsets[tables, h.gather(1, tables)]
        u = torch.rand(t, m, dtype=torch.float64, device=self.device, generator=gen)
        pos = start + torch.minimum((u * size).long(), (size - 1).clamp_min(0))
        # A query none of whose buckets holds a class (no table usable) draws uniformly below; its
        # empty bucket may start at V, so clamp the throw-away position to keep the gather in range.
        from_bucket = self._order[tables, pos.clamp_max(self.num_classes - 1)]
        uniform = torch.randint(self.num_classes, (t, m), device=self.device, generator=gen)
        use_uniform = (torch.rand(t, m, device=self.device, generator=gen) < self.mix) | ~has_any
        ids = torch.where(use_uniform, uniform, from_bucket)
        return ids, self._log_q(h, sizes, ids)

    def _log_q(self, h, sizes, ids):
        # collide[t, j, l] = class ids[t, j] shares query t's bucket in table l.
        collide = self.class_hashes[ids] == h.unsqueeze(1)
        inv = torch.where(sizes > 0, 1.0 / sizes.clamp_min(1).float(), torch.zeros_like(sizes, dtype=torch.float32))
        tables_nonempty = (sizes > 0).sum(1, keepdim=True).float()  # (T, 1)
        bucket_part = (collide.float() * inv.unsqueeze(1)).sum(-1) / tables_nonempty.clamp_min(1.0)
        q = torch.where(
            tables_nonempty > 0,
            self.mix / self.num_classes + (1.0 - self.mix) * bucket_part,
            torch.full_like(bucket_part, 1.0 / self.num_classes),
        )
        return q.log()

    def _log_prob(self, q, ids):
        h, sizes = self._query_tables(q)
        out = torch.empty(ids.shape, device=self.device)
        for cols in _chunks(ids.shape[1], q.shape[0] * self.num_tables):
            out[:, cols] = self._log_q(h, sizes, ids[:, cols])
        return out


# ====================================================================== registry
SAMPLERS: dict[str, type[Sampler]] = {
    cls.name: cls
    for cls in (
        MidxRQSampler,
        MidxPQSampler,
        MidxExactSampler,
        UniformSampler,
        UnigramSampler,
        LogUniformSampler,
        SphereSampler,
        RFFSampler,
        LSHSampler,
    )
}

#: Every option any sampler reads; build_sampler rejects names outside this set (typos).
SAMPLER_OPTIONS = (
    "quantizer",
    "kmeans_iters",
    "kmeans_backend",
    "unigram_smoothing",
    "unigram_power",
    "sphere_alpha",
    "rff_features",
    "rff_temperature",
    "lsh_tables",
    "lsh_bits",
    "lsh_uniform_mix",
)


def build_sampler(
    name: str,
    embeddings: torch.Tensor,
    *,
    codebook_size: int = 64,
    class_counts: torch.Tensor | None = None,
    seed: int = 0,
    **options,
) -> Sampler:
    """Build the proposal ``name`` over (V, D) class ``embeddings``.

    Args:
        name: one of :data:`SAMPLERS` ("midx-rq", "midx-pq", "midx-exact", "uniform", "unigram",
            "log-uniform", "sphere", "rff", "lsh").
        embeddings: (V, D) float tensor (e.g. the LM head weight); the sampler lives on its device.
        codebook_size: K for the MIDX samplers (ignored by the others).
        class_counts: (V,) training-token counts (unigram: required; log-uniform: optional ranking).
        seed: seeds the sampler's own generator and its random structures.
        **options: sampler options (see :data:`SAMPLER_OPTIONS`); those a sampler does not use are ignored.
    """
    if name not in SAMPLERS:
        raise ValueError(f"Unknown sampler {name!r}; known samplers: {', '.join(sorted(SAMPLERS))}.")
    unknown = sorted(set(options) - set(SAMPLER_OPTIONS))
    if unknown:
        raise ValueError(f"Unknown sampler option(s) {unknown}; known options: {', '.join(SAMPLER_OPTIONS)}.")
    if name == "midx-exact" and "quantizer" not in options:
        options["quantizer"] = "rq"
    return SAMPLERS[name](embeddings, codebook_size=codebook_size, class_counts=class_counts, seed=seed, **options)


def kl_to_softmax(
    sampler: Sampler, queries: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """Mean over queries of KL(Q(. | z) || softmax(z W^T + b)); O(S V) for S queries, so pass a few.

    Args:
        queries: (S, D); weight: (V, D); bias: optional (V,).
    Returns:
        scalar float32 tensor (nats).
    """
    q = sampler._queries(queries)
    check_matrix("weight", weight, dim=sampler.dim)
    total = torch.zeros((), device=q.device)
    w = weight.detach().float().to(q.device)
    for rows in _chunks(q.shape[0], sampler.num_classes):
        logits = q[rows] @ w.t()
        if bias is not None:
            logits = logits + bias.detach().float().to(q.device)
        log_p = torch.log_softmax(logits, dim=1)
        log_q = sampler.full_log_prob(q[rows])
        # Classes with Q = 0 (e.g. LSH without its uniform mix) add 0 log 0 = 0, not 0 * -inf = NaN.
        terms = torch.where(log_q > -math.inf, log_q.exp() * (log_q - log_p), torch.zeros_like(log_q))
        total = total + terms.sum()
    return total / max(q.shape[0], 1)
