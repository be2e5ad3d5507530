"""The proposal interface Q(i | z) shared by every sampler, the registry and :func:`build_sampler`.

Shapes: T queries (hidden states), D dims, V classes, M draws per query, P draws in a shared pool,
H classes excluded from the proposal (scored exactly by the loss), V' = V - H candidate classes.

Every sampler offers

* ``sample(queries (T, D), M) -> ids (T, M) int64, log_q (T, M) float32``: M i.i.d. draws per query and
  the normalized log-probability of each draw under that query's proposal;
* ``log_prob(queries (T, D), ids (T, ...)) -> (T, ...) float32``: log Q(id | query), normalized over V;
* ``sample_shared(queries (T, D), P, row_weights=None) -> ids (P,), log_qbar (P,)``: one pool drawn from
  the batch mixture qbar(i) = sum_t w_t Q(i | z_t) / sum_t w_t (w_t = 1 without ``row_weights``);
* ``draw`` / ``draw_shared``: the same draws without any argument check and without a host sync, for
  the training hot path; ``draw_scored`` / ``draw_shared_scored`` also return log Q of the labels
  from the same evaluation of the proposal (:func:`hf_midx.sampled_softmax_loss` calls one per step);
* ``refresh(embeddings (V, D))``: rebuild what the proposal keeps from the current class embeddings;
* ``state_dict()`` / ``load_state_dict()``: tensors only, for safetensors checkpoints.

A sampler built with ``exclude=ids`` (the exact head, see :func:`build_sampler`) covers only the other
V' classes: it never draws an excluded id, ``log_prob`` of an excluded id is -inf, and its ids are
always global ids in [0, V). Subclasses work in the local id space [0, V') of ``candidates``.

All probabilities are computed in float32 log space whatever the model's dtype, and a sampled id never
gets a -inf or NaN log-probability.
"""

from __future__ import annotations

import math
from typing import ClassVar

import torch

from .._checks import check_ids, check_matrix, check_positive_int
from ..rng import CounterRNG, as_counter_rng

# Upper bound on the elements of one (chunk, V) or (chunk, K*K) work tensor (64 MiB in float32):
# few chunks, since on a GPU each costs a dozen kernel launches.
_WORK_ELEMENTS = 1 << 24


def row_chunks(total: int, per_row: int):
    """Slices of ``range(total)`` rows, each of at most about ``_WORK_ELEMENTS / per_row`` rows: bounds the
    (rows, per_row) temporaries of a chunked computation."""
    step = max(1, _WORK_ELEMENTS // max(per_row, 1))
    for start in range(0, total, step):
        yield slice(start, min(start + step, total))


def inverse_cdf(weights: torch.Tensor, num: int, gen: torch.Generator) -> torch.Tensor:
    """``num`` i.i.d. draws per row from unnormalized non-negative ``weights`` (..., K) (float32/64).

    Returns (..., num) int64. Inverse-CDF sampling by ``searchsorted``; a zero-weight category is never
    returned, because the target stays strictly below the total.
    """
    return draw_from_cumsum(weights.cumsum(-1), num, gen)


def draw_from_cumsum(cum: torch.Tensor, num: int, gen: torch.Generator, lead: tuple = ()) -> torch.Tensor:
    """Inverse-CDF draws from a cumulative sum ``cum`` (..., K); ``lead`` replaces its leading shape
    when ``cum`` is one (K,) table shared by all rows. Returns (*lead or cum.shape[:-1], num) int64."""
    total = cum[..., -1:]
    shape = lead if lead else cum.shape[:-1]
    u = gen.rand(*shape, num, dtype=cum.dtype)
    target = torch.minimum(u * total, torch.nextafter(total, torch.zeros_like(total)))
    # The clamp only matters for a NaN weight (from NaN queries): searchsorted then returns K, and an
    # index out of range would crash before the caller can say which tensor went NaN.
    last = cum.shape[-1] - 1
    if lead:
        return torch.searchsorted(cum, target.reshape(-1), right=True).clamp_max(last).view(*shape, num)
    return torch.searchsorted(cum, target, right=True).clamp_max(last)


def check_counts(class_counts, num_classes: int, device) -> torch.Tensor:
    """(V,) float64 training-token counts, validated (finite, non-negative, right length)."""
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


def unigram_log_table(counts: torch.Tensor, smoothing: float, power: float) -> torch.Tensor:
    """(V,) float32 log of (count + smoothing) ** power, normalized; ValueError if all weights are 0."""
    if smoothing < 0 or power < 0:
        raise ValueError("unigram_smoothing and unigram_power must be >= 0.")
    weights = (counts + smoothing) ** power
    if not bool((weights > 0).any()):
        raise ValueError("class_counts are all zero; pass real counts or unigram_smoothing > 0.")
    return (weights / weights.sum()).log().float()


class Sampler:
    """Base class: validation, exclusion of exactly-scored classes, the shared-pool mixture, RNG and state.

    Subclasses implement ``_sample``, ``_log_prob`` and ``refresh`` in local ids [0, V'); they may
    override ``_log_prob_shared``, ``draw_scored`` and ``draw_shared_scored`` with faster versions.
    """

    name: ClassVar[str] = ""
    #: True when Q depends on the query; False for static proposals (uniform, unigram, log-uniform).
    query_dependent: ClassVar[bool] = True
    #: The sampler options (keyword arguments of build_sampler beyond the common ones) this sampler
    #: reads; the option table of :func:`check_sampler_options` is the union of these, one per sampler.
    options: ClassVar[tuple[str, ...]] = ()

    def __init__(self, embeddings: torch.Tensor, *, seed: int = 0, exclude: torch.Tensor | None = None) -> None:
        check_matrix("embeddings", embeddings)
        if embeddings.shape[0] < 1:
            raise ValueError("embeddings must have at least one class (row).")
        self.num_classes = embeddings.shape[0]
        self.dim = embeddings.shape[1]
        self.device = embeddings.device
        self.seed = seed
        # A counter-based stream on the device: draws trace under torch.compile and capture in CUDA graphs.
        self.generator = CounterRNG(seed, device=self.device)
        self._set_candidates(exclude)

    # ------------------------------------------------------------------ exclusion
    def _set_candidates(self, exclude: torch.Tensor | None) -> None:
        """``candidates`` (V',) int64 global ids the proposal covers (None: all), ``_local_of`` (V,) int64
        local id of each class or -1, and ``num_candidates`` V'."""
        v = self.num_classes
        if exclude is None or exclude.numel() == 0:
            self.candidates = None
            self._local_of = None
            self._excluded = None
            self.num_candidates = v
            return
        if not isinstance(exclude, torch.Tensor) or exclude.dim() != 1:
            raise ValueError(f"exclude must be a 1-D tensor of class ids, got {getattr(exclude, 'shape', exclude)!r}.")
        check_ids("exclude", exclude, v)
        excluded = torch.zeros(v, dtype=torch.bool, device=self.device)
        excluded[exclude.to(self.device).long()] = True
        if int(excluded.sum()) != exclude.numel():
            raise ValueError("exclude holds a class id more than once; pass each excluded class once.")
        if int(excluded.sum()) >= v:
            raise ValueError(f"exclude removes all {v} classes; the proposal needs at least one class to draw.")
        self.candidates = (~excluded).nonzero().squeeze(1)
        self._excluded = excluded.nonzero().squeeze(1)
        self.num_candidates = int(self.candidates.shape[0])
        self._local_of = torch.full((v,), -1, dtype=torch.long, device=self.device)
        self._local_of[self.candidates] = torch.arange(self.num_candidates, device=self.device)

    @property
    def excluded(self) -> torch.Tensor | None:
        """(H,) int64 sorted ids the proposal never draws (the exact head) on the sampler's device, or None."""
        return self._excluded

    def _restrict(self, x: torch.Tensor) -> torch.Tensor:
        """Rows of a (V, ...) per-class tensor for the candidate classes, (V', ...)."""
        return x if self.candidates is None else x[self.candidates.to(x.device)]

    def _to_global(self, ids: torch.Tensor) -> torch.Tensor:
        return ids if self.candidates is None else self.candidates[ids]

    # ------------------------------------------------------------------ public API (validated)
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
        q = self.checked_queries(queries)
        check_positive_int("num_samples", num_samples)
        return self.draw(q, num_samples, generator=generator)

    def log_prob(self, queries: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """log Q(ids | z), normalized over all V classes (-inf for excluded classes).

        Args:
            queries: (T, D) float tensor.
            ids: (T, ...) int64 class ids in [0, V).
        Returns:
            (T, ...) float32.
        """
        q = self.checked_queries(queries)
        check_ids("ids", ids, self.num_classes)
        if ids.dim() == 0 or ids.shape[0] != q.shape[0]:
            raise ValueError(f"ids must have shape (T, ...) with T={q.shape[0]} queries, got {tuple(ids.shape)}.")
        # Explicit width (not -1): reshape(0, -1) is ambiguous for an empty batch of queries.
        flat = ids.reshape(ids.shape[0], math.prod(ids.shape[1:])).to(self.device)
        return self._global_log_prob(q, flat).reshape(ids.shape)

    def sample_shared(
        self,
        queries: torch.Tensor,
        num_samples: int,
        generator: torch.Generator | None = None,
        row_weights: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Draw one pool of P classes from the batch mixture qbar(i) = sum_t w_t Q(i | z_t) / sum_t w_t.

        Each draw picks a query with probability proportional to its weight (uniformly without
        ``row_weights``) and then a class from that query's proposal.

        Args:
            row_weights: optional (T,) non-negative float weights of the queries, with a positive sum.
        Returns:
            ids: (P,) int64; log_qbar: (P,) float32, log qbar(ids).
        """
        q = self.checked_queries(queries)
        check_positive_int("num_samples", num_samples)
        if q.shape[0] == 0:
            raise ValueError("sample_shared needs at least one query.")
        self._check_row_weights(row_weights, q.shape[0])
        return self.draw_shared(q, num_samples, row_weights, generator=generator)

    def log_prob_shared(
        self, queries: torch.Tensor, ids: torch.Tensor, row_weights: torch.Tensor | None = None
    ) -> torch.Tensor:
        """log qbar(ids) for (P,) ids under the (weighted) mixture of the (T, D) queries' proposals; (P,) float32."""
        q = self.checked_queries(queries)
        check_ids("ids", ids, self.num_classes)
        if ids.dim() != 1:
            raise ValueError(f"ids must be 1-D (P,), got shape {tuple(ids.shape)}.")
        if q.shape[0] == 0:
            raise ValueError("log_prob_shared needs at least one query.")
        self._check_row_weights(row_weights, q.shape[0])
        return self.score_shared(q, ids, row_weights)

    def full_log_prob(self, queries: torch.Tensor) -> torch.Tensor:
        """log Q(. | z) over all classes, (T, V) float32. O(T V): for tests and diagnostics only."""
        q = self.checked_queries(queries)
        ids = torch.arange(self.num_classes, device=self.device).expand(q.shape[0], -1)
        return self._global_log_prob(q, ids)

    def refresh(self, embeddings: torch.Tensor) -> None:
        """Rebuild the proposal's tables from the current (V, D) class embeddings (in place)."""
        raise NotImplementedError

    # ------------------------------------------------------------------ hot path (unchecked)
    def draw(
        self, queries: torch.Tensor, num_samples: int, generator: torch.Generator | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """:meth:`sample` without argument checks and without a host sync (the loss's hot path).

        Args:
            queries: (T, D) float32 (detached here) on the sampler's device; num_samples: M >= 1.
        Returns:
            ids (T, M) int64 global ids, log_q (T, M) float32.
        """
        q = queries.detach().to(device=self.device, dtype=torch.float32)
        ids, log_q = self._sample(q, num_samples, as_counter_rng(generator, self.generator))
        return self._to_global(ids), log_q

    def draw_shared(
        self,
        queries: torch.Tensor,
        num_samples: int,
        row_weights: torch.Tensor | None = None,
        generator: torch.Generator | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """:meth:`sample_shared` without argument checks and without a host sync.

        Args:
            queries: (T, D) float32, T >= 1; num_samples: P >= 1.
            row_weights: optional (T,) non-negative weights (e.g. the valid-token mask as float, so that
                ignored tokens neither draw nor enter qbar), with a positive sum.
        Returns:
            ids (P,) int64 global ids; log_qbar (P,) float32 with
            log qbar(i) = logsumexp_t(log w_t + log Q(i | z_t)) - log sum_t w_t.
        """
        q = queries.detach().to(device=self.device, dtype=torch.float32)
        gen = as_counter_rng(generator, self.generator)
        log_w = self._log_row_weights(row_weights, q)
        if not self.query_dependent:
            ids, log_q = self._sample(q[:1], num_samples, gen)
            return self._to_global(ids[0]), log_q[0]
        ids = self._draw_pool(q, num_samples, row_weights, gen)
        return self._to_global(ids), self._log_prob_shared(q, ids, log_w)

    def _draw_pool(self, q: torch.Tensor, num: int, row_weights: torch.Tensor | None, gen) -> torch.Tensor:
        """(P,) local ids: each draw picks a query by its weight, then a class from that query's proposal."""
        if row_weights is None:
            rows = gen.randint(q.shape[0], (num,))
        else:
            w = row_weights.detach().to(device=self.device, dtype=torch.float64)
            # clamp: an all-zero weight vector (no valid token) must still index a row.
            rows = inverse_cdf(w, num, gen).clamp_max(q.shape[0] - 1)
        return self._sample(q[rows], 1, gen)[0][:, 0]

    def draw_scored(
        self, queries: torch.Tensor, num_samples: int, ids: torch.Tensor, generator: torch.Generator | None = None
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """:meth:`draw` plus :meth:`score` of given ids (the labels, for the corrected-positive
        estimator); unchecked, no host sync. Query-dependent samplers override it to evaluate their
        proposal once for both.

        Args:
            queries: (T, D) float32; num_samples: M >= 1; ids: (T, N) int64 global ids in [0, V).
        Returns:
            draws (T, M) int64 global ids, their log_q (T, M) float32, and log Q(ids | z_t) (T, N)
            float32 (-inf for excluded classes).
        """
        draws, log_q = self.draw(queries, num_samples, generator=generator)
        return draws, log_q, self.score(queries, ids)

    def draw_shared_scored(
        self,
        queries: torch.Tensor,
        num_samples: int,
        ids: torch.Tensor,
        row_weights: torch.Tensor | None = None,
        generator: torch.Generator | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """:meth:`draw_shared` plus :meth:`score_shared` of given (N,) ids; unchecked, no host sync.

        Returns:
            pool (P,) int64 global ids, log_qbar (P,) float32, log qbar(ids) (N,) float32 (-inf for
            excluded classes).
        """
        pool, log_q = self.draw_shared(queries, num_samples, row_weights, generator=generator)
        return pool, log_q, self.score_shared(queries, ids, row_weights)

    def score(self, queries: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """:meth:`log_prob` without argument checks and without a host sync.

        Args:
            queries: (T, D) float32; ids: (T, N) int64 global ids in [0, V).
        Returns:
            (T, N) float32 log Q(ids | z_t); -inf for excluded classes.
        """
        q = queries.detach().to(device=self.device, dtype=torch.float32)
        return self._global_log_prob(q, ids.to(self.device))

    def score_shared(
        self, queries: torch.Tensor, ids: torch.Tensor, row_weights: torch.Tensor | None = None
    ) -> torch.Tensor:
        """:meth:`log_prob_shared` without argument checks and without a host sync.

        Args:
            queries: (T, D) float32, T >= 1; ids: (P,) int64 global ids; row_weights: as in :meth:`draw_shared`.
        Returns:
            (P,) float32 log qbar(ids); -inf for excluded classes.
        """
        q = queries.detach().to(device=self.device, dtype=torch.float32)
        local, keep = self._local(ids.to(self.device))
        out = self._log_prob_shared(q, local, self._log_row_weights(row_weights, q))
        return out if keep is None else out.masked_fill(~keep, -math.inf)

    # ------------------------------------------------------------------ state
    #: attribute names of the tensors that, with the RNG state, define the sampler.
    _state_names: ClassVar[tuple[str, ...]] = ()

    def state_dict(self) -> dict[str, torch.Tensor]:
        """Tensors that define the proposal and the RNG position (for safetensors checkpoints)."""
        state = {name: getattr(self, name).contiguous() for name in self._state_names}
        state["generator_state"] = self.generator.get_state()
        self._put_sizes(state)
        return state

    def _put_sizes(self, state: dict[str, torch.Tensor]) -> None:
        # V is stored explicitly: proposals without per-class tensors (uniform) could not refuse a
        # checkpoint of another vocabulary otherwise; V' likewise for another exact head.
        state["num_classes"] = torch.tensor(self.num_classes, dtype=torch.int64, device=self.device)
        state["num_candidates"] = torch.tensor(self.num_candidates, dtype=torch.int64, device=self.device)

    def _check_num_classes(self, state: dict[str, torch.Tensor]) -> None:
        if "num_classes" in state and int(state["num_classes"]) != self.num_classes:
            raise ValueError(
                f"{self.name} sampler state is for V={int(state['num_classes'])} classes, this sampler has "
                f"V={self.num_classes}: the checkpoint comes from another vocabulary."
            )
        if "num_candidates" in state and int(state["num_candidates"]) != self.num_candidates:
            raise ValueError(
                f"{self.name} sampler state covers {int(state['num_candidates'])} classes, this sampler covers "
                f"{self.num_candidates}: the checkpoint comes from another exact head (exact_head) size."
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
            self.generator.set_state(state["generator_state"].cpu())
        self._after_load()

    def _after_load(self) -> None:
        """Recompute derived tables after :meth:`load_state_dict`."""

    # ------------------------------------------------------------------ helpers
    def checked_queries(self, queries: torch.Tensor) -> torch.Tensor:
        """Validate (T, D) queries (any float dtype, finite); returns them detached, float32, on the sampler's
        device: what the checked entry points, and diagnostics built on a sampler, score."""
        check_matrix("queries", queries, dim=self.dim)
        return queries.detach().to(device=self.device, dtype=torch.float32)

    @staticmethod
    def _check_row_weights(row_weights: torch.Tensor | None, num_queries: int) -> None:
        if row_weights is None:
            return
        if not isinstance(row_weights, torch.Tensor) or tuple(row_weights.shape) != (num_queries,):
            raise ValueError(
                f"row_weights must be a ({num_queries},) tensor, one weight per query, got "
                f"{tuple(getattr(row_weights, 'shape', ())) or type(row_weights).__name__}."
            )
        w = row_weights.double()
        if not bool(torch.isfinite(w).all()) or bool((w < 0).any()) or not bool(w.sum() > 0):
            raise ValueError("row_weights must be finite, non-negative and not all zero.")

    def _log_row_weights(self, row_weights: torch.Tensor | None, q: torch.Tensor) -> torch.Tensor | None:
        """(T,) float32 log w_t - log sum_t w_t, or None for equal weights."""
        if row_weights is None:
            return None
        w = row_weights.detach().to(device=self.device, dtype=torch.float32)
        # All zero (every label of the batch ignored): equal weights keep qbar finite, so that the zero loss
        # of such a batch has a zero gradient, not a NaN one (inf - inf in its logsumexp). No host sync.
        w = torch.where(w.sum() > 0, w, torch.ones_like(w))
        return w.log() - w.sum().log()

    def _check_embeddings(self, embeddings: torch.Tensor) -> torch.Tensor:
        """Validated (V, D) embeddings as float32 on the device, restricted to the (V', D) candidates."""
        check_matrix("embeddings", embeddings, dim=self.dim)
        if embeddings.shape[0] != self.num_classes:
            raise ValueError(
                f"refresh got {embeddings.shape[0]} classes but the sampler was built for {self.num_classes}; "
                "build a new sampler for a new vocabulary."
            )
        return self._restrict(embeddings.detach().to(device=self.device, dtype=torch.float32))

    def _local(self, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Global ids -> (local ids, with excluded ones replaced by 0; keep mask or None)."""
        if self._local_of is None:
            return ids, None
        local = self._local_of[ids]
        return local.clamp_min(0), local >= 0

    def _global_log_prob(self, q: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        local, keep = self._local(ids)
        out = self._log_prob(q, local)
        return out if keep is None else out.masked_fill(~keep, -math.inf)

    # ------------------------------------------------------------------ defaults for subclasses
    def _sample(self, q: torch.Tensor, m: int, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
        """(T, M) local ids and their log Q, float32."""
        raise NotImplementedError

    def _log_prob(self, q: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """log Q of (T, N) local ids, (T, N) float32."""
        raise NotImplementedError

    def _log_prob_shared(self, q: torch.Tensor, ids: torch.Tensor, log_w: torch.Tensor | None) -> torch.Tensor:
        """log qbar of (P,) local ids; ``log_w`` (T,) normalized log weights or None (equal weights)."""
        if not self.query_dependent:
            return self._log_prob(q[:1], ids.unsqueeze(0))[0]
        out = torch.full((ids.shape[0],), -math.inf, device=self.device)
        # log qbar = logsumexp_t (log w_t + log Q(i|z_t)), accumulated over query chunks.
        for rows in row_chunks(q.shape[0], ids.shape[0]):
            lp = self._log_prob(q[rows], ids.expand(rows.stop - rows.start, -1))
            if log_w is not None:
                lp = lp + log_w[rows].unsqueeze(1)
            out = torch.logaddexp(out, torch.logsumexp(lp, dim=0))
        return out if log_w is not None else out - math.log(q.shape[0])

    def __repr__(self) -> str:
        extra = "" if self.candidates is None else f", excluded={self.num_classes - self.num_candidates}"
        return f"{type(self).__name__}(name={self.name!r}, V={self.num_classes}, D={self.dim}{extra})"


# ====================================================================== registry
#: Sampler name -> class, in registration order (MIDX first); filled by the modules of this package.
SAMPLERS: dict[str, type[Sampler]] = {}


def register(cls: type[Sampler]) -> type[Sampler]:
    """Class decorator: add a sampler class to :data:`SAMPLERS` under its ``name``."""
    if not cls.name or cls.name in SAMPLERS:
        raise ValueError(f"A sampler needs a new, non-empty name; got {cls.name!r}.")
    SAMPLERS[cls.name] = cls
    return cls


def all_sampler_options() -> tuple[str, ...]:
    """Every option some registered sampler reads, in first-seen order."""
    seen: dict[str, None] = {}
    for cls in SAMPLERS.values():
        seen.update(dict.fromkeys(cls.options))
    return tuple(seen)


def check_sampler_options(name: str, options) -> None:
    """Refuse options that no sampler reads (typos) and options of another sampler than ``name``.

    The per-sampler option table is each class's ``options``; raises ValueError naming the sampler(s)
    an option belongs to.
    """
    if name not in SAMPLERS:
        raise ValueError(f"Unknown sampler {name!r}; known samplers: {', '.join(sorted(SAMPLERS))}.")
    known = all_sampler_options()
    unknown = sorted(str(k) for k in options if k not in known)
    if unknown:
        raise ValueError(f"Unknown sampler option(s) {unknown}; known options: {', '.join(known)}.")
    own = SAMPLERS[name].options
    foreign = sorted(k for k in options if k not in own)
    if foreign:
        owners = {k: sorted(n for n, c in SAMPLERS.items() if k in c.options) for k in foreign}
        said = "; ".join(f"{k!r} belongs to {', '.join(v)}" for k, v in owners.items())
        raise ValueError(
            f"Sampler option(s) {foreign} do not apply to sampler {name!r} ({said}); "
            f"{name!r} takes: {', '.join(own) or 'no options'}."
        )


def build_sampler(
    name: str,
    embeddings: torch.Tensor,
    *,
    codebook_size: int = 64,
    class_counts: torch.Tensor | None = None,
    exclude: torch.Tensor | None = None,
    seed: int = 0,
    **options,
) -> Sampler:
    """Build the proposal ``name`` over (V, D) class ``embeddings``.

    Args:
        name: one of :data:`SAMPLERS` ("midx-rq", "midx-pq", "midx-exact", "uniform", "unigram",
            "log-uniform", "sphere", "rff", "lsh").
        embeddings: (V, D) float tensor (e.g. the LM head weight); the sampler lives on its device.
        codebook_size: K for the MIDX samplers (ignored by the others).
        class_counts: (V,) training-token counts (unigram: required; log-uniform: optional ranking;
            MIDX: for the unigram component of the defensive mixture and the frequency last stage).
        exclude: optional (H,) int64 class ids the proposal must never draw (the exact head, which
            the loss scores exactly): the sampler indexes only the other V - H classes, returns
            global ids, and gives excluded ids log-probability -inf.
        seed: seeds the sampler's own generator and its random structures.
        **options: options of this sampler (each class's ``options``); an unknown option or one of
            another sampler raises ValueError.
    """
    check_sampler_options(name, options)
    return SAMPLERS[name](
        embeddings, codebook_size=codebook_size, class_counts=class_counts, exclude=exclude, seed=seed, **options
    )
