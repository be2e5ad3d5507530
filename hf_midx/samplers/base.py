"""The proposal interface Q(i | z) shared by every sampler, and the helpers the samplers share.

Shapes: T queries (hidden states), D dims, V classes, M draws per query, P draws in a shared pool,
H classes excluded from the proposal (scored exactly by the loss), V' = V - H candidate classes.

One API in two forms. The hot path, unchecked and without a host sync: ``draw`` (M draws per query and
their log Q), ``draw_shared`` (one pool from the batch mixture qbar), ``score`` / ``score_shared`` (log Q,
log qbar of given ids) and ``draw_scored`` / ``draw_shared_scored`` (a draw plus the score of the labels
from one evaluation of the proposal; :func:`hf_midx.sampled_softmax_loss` calls one per step). The public
entry points ``sample``, ``sample_shared``, ``log_prob`` and ``full_log_prob`` are these with their
arguments checked first (:meth:`Sampler.checked_queries`). Besides: ``refresh(embeddings)``,
``state_dict`` / ``load_state_dict`` (tensors only, for safetensors) and the classmethod ``check_options``.

A sampler built with ``exclude=ids`` (the exact head) covers only the other V' classes: it never draws an
excluded id, scores it -inf, and speaks global ids in [0, V); subclasses implement hooks in the local
ids [0, V') of ``candidates``. Probabilities are float32 log space whatever the model's dtype, and a
sampled id never gets a -inf or NaN log-probability.
"""

from __future__ import annotations

import math
from typing import Callable, ClassVar

import torch

from .. import defaults
from .._checks import check_ids, check_matrix, check_positive_int
from .._ops import row_chunks
from ..rng import CounterRNG, as_counter_rng
from .factors import ProposalFactors


def mixture_log_prob(
    log_prob_rows: Callable[[slice], torch.Tensor], num_queries: int, num_ids: int, log_w: torch.Tensor | None
) -> torch.Tensor:
    """log qbar of N ids under the batch mixture qbar(i) = sum_t w_t Q(i | z_t), (N,) float32.

    ``log_prob_rows(rows)`` gives log Q(ids | z_t) for a slice of the T queries, (rows, N) float32;
    ``log_w`` (T,) float32 normalized log weights, or None for equal weights. Accumulated over query
    chunks, so no (T, N) tensor is built.
    """
    out = None
    for rows in row_chunks(num_queries, num_ids):
        lp = log_prob_rows(rows)
        if log_w is not None:
            lp = lp + log_w[rows].unsqueeze(1)
        part = torch.logsumexp(lp, dim=0)
        out = part if out is None else torch.logaddexp(out, part)
    return out if log_w is not None else out - math.log(num_queries)


class Sampler:
    """Base class: the API (checked and unchecked), the exclusion of exactly-scored classes, the pool, RNG, state.

    Subclasses implement ``_sample``, ``_log_prob`` and ``refresh`` in local ids [0, V'); they may
    override ``_sample_scored`` and ``_log_prob_shared`` with faster versions, and ``check_options``
    to validate their options.
    """

    name: ClassVar[str] = ""
    #: True when Q depends on the query; False for static proposals (uniform, unigram, log-uniform).
    query_dependent: ClassVar[bool] = True
    #: The sampler options (keyword arguments of build_sampler beyond the common ones) this sampler
    #: reads; the option table of :func:`check_sampler_options` is the union of these, one per sampler.
    options: ClassVar[tuple[str, ...]] = ()
    #: attribute names of the tensors that, with the RNG state, define the sampler.
    _state_names: ClassVar[tuple[str, ...]] = ()

    def __init__(
        self, embeddings: torch.Tensor, *, seed: int = defaults.SEED, exclude: torch.Tensor | None = None
    ) -> None:
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

    @classmethod
    def check_options(cls, **options) -> None:
        """Validate the values of the given ``options`` (some of :attr:`options`); ValueError saying what to do.

        The constructor calls it, and :class:`hf_midx.MidxConfig` through :func:`check_sampler_options`
        before any sampler is built. Subclasses check each option they read when it is given.
        """

    # ------------------------------------------------------------------ public API (checked)
    def sample(
        self, queries: torch.Tensor, num_samples: int, generator: torch.Generator | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """:meth:`draw` with its arguments checked: M = ``num_samples`` i.i.d. draws from Q(. | z_t) per query,
        (T, M) int64 ids and their (T, M) float32 log Q. ``queries`` may have any float dtype."""
        return self.draw(self.checked_queries(queries, num_samples=num_samples), num_samples, generator)

    def sample_shared(
        self,
        queries: torch.Tensor,
        num_samples: int,
        generator: torch.Generator | None = None,
        row_weights: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """:meth:`draw_shared` with its arguments checked: one pool of P = ``num_samples`` (P,) int64 ids from the
        batch mixture qbar, and their (P,) float32 log qbar; ``row_weights`` (T,) non-negative, positive sum."""
        q = self.checked_queries(queries, num_samples=num_samples, row_weights=row_weights, pool=True)
        return self.draw_shared(q, num_samples, row_weights, generator)

    def log_prob(self, queries: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """:meth:`score` with its arguments checked, for ``ids`` of any shape (T, ...) in [0, V): (T, ...) float32."""
        q = self.checked_queries(queries, ids=ids)
        # Explicit width (not -1): reshape(0, -1) is ambiguous for an empty batch of queries.
        return self.score(q, ids.reshape(ids.shape[0], math.prod(ids.shape[1:]))).reshape(ids.shape)

    def full_log_prob(self, queries: torch.Tensor) -> torch.Tensor:
        """log Q(. | z) over all classes, (T, V) float32. O(T V): for tests and diagnostics only."""
        q = self.checked_queries(queries)
        return self.score(q, torch.arange(self.num_classes, device=self.device).expand(q.shape[0], -1))

    def draw_with_factors(self, queries, num_samples, ids=None, generator=None):
        """:meth:`draw_scored` (or :meth:`draw` for ``ids=None``, with None for the ids' log q) plus
        :meth:`proposal_factors` of the same queries, from one evaluation of the proposal where it can. A sampler
        whose :meth:`has_fused_draw` is True also takes ``kernels="fused"`` here and in :meth:`draw_scored` (its
        Triton draw)."""
        if ids is None:
            draws, log_q, scored = (*self.draw(queries, num_samples, generator=generator), None)
        else:
            draws, log_q, scored = self.draw_scored(queries, num_samples, ids, generator=generator)
        return draws, log_q, scored, self.proposal_factors(self._queries(queries))

    @classmethod
    def has_fused_draw(cls) -> bool:
        """Whether :meth:`draw_with_factors` and :meth:`draw_scored` take ``kernels="fused"`` (a Triton draw; False
        here: a sampler, a custom one included, is called without it)."""
        return False

    @classmethod
    def has_closed_form(cls) -> bool:
        """Whether :meth:`proposal_factors` gives the proposal (what ``tail_gradient="expected"`` needs)."""
        return cls.proposal_factors is not Sampler.proposal_factors

    def proposal_factors(self, queries: torch.Tensor) -> ProposalFactors | None:
        """Q over all classes for each of the (T, D) float32 ``queries`` (unchecked: the loss passes its own),
        as :class:`ProposalFactors`; None when the proposal has no such form (then the loss keeps its sampled
        tail gradient)."""
        return None

    def _globalize(self, local: torch.Tensor, fill: float) -> torch.Tensor:
        """A (V, ...) table of per-class values from the (V', ...) candidates' ones, ``fill`` for the excluded ones."""
        if self.candidates is None:
            return local
        out = torch.full((self.num_classes, *local.shape[1:]), fill, dtype=local.dtype, device=self.device)
        out[self.candidates] = local
        return out

    def refresh(self, embeddings: torch.Tensor) -> None:
        """Rebuild the proposal's tables from the current (V, D) class embeddings (in place)."""
        raise NotImplementedError

    def checked_queries(
        self,
        queries: torch.Tensor,
        *,
        num_samples: int | None = None,
        ids: torch.Tensor | None = None,
        row_weights: torch.Tensor | None = None,
        pool: bool = False,
    ) -> torch.Tensor:
        """Validate the arguments of a checked entry point: (T, D) queries (any float dtype, finite), and
        those given of ``num_samples`` (>= 1), ``ids`` ((T, ...) in [0, V)) and ``row_weights`` ((T,),
        non-negative, positive sum); ``pool``: a shared pool, which needs T >= 1. Returns the queries
        detached, float32, on the sampler's device: what the unchecked methods (and diagnostics) take."""
        check_matrix("queries", queries, dim=self.dim)
        t = queries.shape[0]
        if num_samples is not None:
            check_positive_int("num_samples", num_samples)
        if ids is not None:
            check_ids("ids", ids, self.num_classes)
            if ids.dim() == 0 or ids.shape[0] != t:
                raise ValueError(f"ids must have shape (T, ...) with T={t} queries, got {tuple(ids.shape)}.")
        if pool and t == 0:
            raise ValueError("sample_shared needs at least one query: the pool is drawn from their proposals.")
        if row_weights is not None:
            if not isinstance(row_weights, torch.Tensor) or tuple(row_weights.shape) != (t,):
                raise ValueError(
                    f"row_weights must be a ({t},) tensor, one weight per query, got "
                    f"{tuple(getattr(row_weights, 'shape', ())) or type(row_weights).__name__}."
                )
            w = row_weights.double()
            if not bool(torch.isfinite(w).all()) or bool((w < 0).any()) or not bool(w.sum() > 0):
                raise ValueError("row_weights must be finite, non-negative and not all zero.")
        return self._queries(queries)

    # ------------------------------------------------------------------ hot path (unchecked, no host sync)
    def draw(
        self, queries: torch.Tensor, num_samples: int, generator: torch.Generator | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """M i.i.d. draws from Q(. | z_t) for each query (the loss's hot path).

        Args:
            queries: (T, D) float (used detached, in float32) on the sampler's device; num_samples: M >= 1;
            generator: optional torch.Generator or CounterRNG; defaults to the sampler's own.
        Returns:
            ids (T, M) int64 global ids in [0, V), log_q (T, M) float32 log Q(ids | z_t), finite.
        """
        ids, log_q = self._sample(self._queries(queries), num_samples, as_counter_rng(generator, self.generator))
        return self._to_global(ids), log_q

    def draw_scored(
        self, queries: torch.Tensor, num_samples: int, ids: torch.Tensor, generator: torch.Generator | None = None
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """:meth:`draw` plus :meth:`score` of given ids (the labels, for the corrected-positive estimator),
        from one evaluation of the proposal.

        Args:
            queries: (T, D) float; num_samples: M >= 1; ids: (T, N) int64 global ids in [0, V).
        Returns:
            draws (T, M) int64 global ids, their log_q (T, M) float32, and log Q(ids | z_t) (T, N)
            float32 (-inf for excluded classes).
        """
        local, keep = self._local(ids.to(self.device))
        gen = as_counter_rng(generator, self.generator)
        draws, log_q, log_q_ids = self._sample_scored(self._queries(queries), num_samples, gen, local)
        return self._to_global(draws), log_q, self._mask(log_q_ids, keep)

    def draw_shared(
        self,
        queries: torch.Tensor,
        num_samples: int,
        row_weights: torch.Tensor | None = None,
        generator: torch.Generator | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """One pool of P classes from the batch mixture qbar(i) = sum_t w_t Q(i | z_t) / sum_t w_t (the hot path
        of ``negatives="shared"``): each draw picks a query by its weight, then a class from its proposal.

        Args:
            queries: (T, D) float, T >= 1; num_samples: P >= 1.
            row_weights: optional (T,) float weights, e.g. ``labels != ignore_index``: ignored tokens
                neither pick draws nor enter qbar. All zero counts as all equal (no host check).
        Returns:
            ids (P,) int64 global ids; log_qbar (P,) float32 with
            log qbar(i) = logsumexp_t(log w_t + log Q(i | z_t)) - log sum_t w_t.
        """
        no_ids = torch.empty(0, dtype=torch.long, device=self.device)
        pool, log_qbar, _ = self.draw_shared_scored(queries, num_samples, no_ids, row_weights, generator)
        return pool, log_qbar

    def draw_shared_scored(
        self,
        queries: torch.Tensor,
        num_samples: int,
        ids: torch.Tensor,
        row_weights: torch.Tensor | None = None,
        generator: torch.Generator | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """:meth:`draw_shared` plus :meth:`score_shared` of given (N,) ids, in one pass over the queries.

        Returns:
            pool (P,) int64 global ids, log_qbar (P,) float32, log qbar(ids) (N,) float32 (-inf for
            excluded classes).
        """
        q = self._queries(queries)
        pool = self._draw_pool(q, num_samples, row_weights, as_counter_rng(generator, self.generator))
        local, keep = self._local(ids.to(self.device))
        both = self._log_prob_shared(q, torch.cat([pool, local]), self._log_row_weights(row_weights, q))
        return self._to_global(pool), both[:num_samples], self._mask(both[num_samples:], keep)

    def score(self, queries: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """log Q(ids | z_t), normalized over all V classes.

        Args:
            queries: (T, D) float; ids: (T, N) int64 global ids in [0, V).
        Returns:
            (T, N) float32 log Q(ids | z_t); -inf for excluded classes.
        """
        local, keep = self._local(ids.to(self.device))
        return self._mask(self._log_prob(self._queries(queries), local), keep)

    def score_shared(
        self, queries: torch.Tensor, ids: torch.Tensor, row_weights: torch.Tensor | None = None
    ) -> torch.Tensor:
        """log qbar(ids) of (N,) global ids under the batch mixture of :meth:`draw_shared`, unchecked.

        Args:
            queries: (T, D) float, T >= 1; ids: (N,) int64 global ids; row_weights: as in :meth:`draw_shared`.
        Returns:
            (N,) float32 log qbar(ids); -inf for excluded classes.
        """
        q = self._queries(queries)
        local, keep = self._local(ids.to(self.device))
        return self._mask(self._log_prob_shared(q, local, self._log_row_weights(row_weights, q)), keep)

    def _queries(self, queries: torch.Tensor) -> torch.Tensor:
        return queries.detach().to(device=self.device, dtype=torch.float32)

    def _draw_pool(self, q: torch.Tensor, num: int, row_weights: torch.Tensor | None, gen) -> torch.Tensor:
        """(P,) local ids: each draw picks a query by its weight, then a class from that query's proposal."""
        if not self.query_dependent:
            return self._sample(q[:1], num, gen)[0][0]
        if row_weights is None:
            rows = gen.randint(q.shape[0], (num,))
        else:
            w = row_weights.detach().to(device=self.device, dtype=torch.float64)
            # clamp: an all-zero weight vector (no valid token) must still index a row.
            rows = gen.categorical(w, num).clamp_max(q.shape[0] - 1)
        return self._sample(q[rows], 1, gen)[0][:, 0]

    def _log_row_weights(self, row_weights: torch.Tensor | None, q: torch.Tensor) -> torch.Tensor | None:
        """(T,) float32 log w_t - log sum_t w_t, or None for equal weights."""
        if row_weights is None:
            return None
        w = row_weights.detach().to(device=self.device, dtype=torch.float32)
        # All zero (every label of the batch ignored): equal weights keep qbar finite, so that the zero loss
        # of such a batch has a zero gradient, not a NaN one (inf - inf in its logsumexp). No host sync.
        w = torch.where(w.sum() > 0, w, torch.ones_like(w))
        return w.log() - w.sum().log()

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

    def _local(self, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Global ids -> (local ids, with excluded ones replaced by 0; keep mask or None)."""
        if self._local_of is None:
            return ids, None
        local = self._local_of[ids]
        return local.clamp_min(0), local >= 0

    @staticmethod
    def _mask(log_q: torch.Tensor, keep: torch.Tensor | None) -> torch.Tensor:
        """-inf where ``keep`` is False (an excluded class), as is without a mask."""
        return log_q if keep is None else log_q.masked_fill(~keep, -math.inf)

    def _check_embeddings(self, embeddings: torch.Tensor) -> torch.Tensor:
        """Validated (V, D) embeddings as float32 on the device, restricted to the (V', D) candidates."""
        check_matrix("embeddings", embeddings, dim=self.dim)
        if embeddings.shape[0] != self.num_classes:
            raise ValueError(
                f"refresh got {embeddings.shape[0]} classes but the sampler was built for {self.num_classes}; "
                "build a new sampler for a new vocabulary."
            )
        return self._restrict(embeddings.detach().to(device=self.device, dtype=torch.float32))

    # ------------------------------------------------------------------ state
    def state_dict(self) -> dict[str, torch.Tensor]:
        """Tensors that define the proposal and the RNG position (for safetensors checkpoints)."""
        state = {name: getattr(self, name).contiguous() for name in self._state_names}
        state["generator_state"] = self.generator.get_state()
        # V is stored explicitly: proposals without per-class tensors (uniform) could not refuse a
        # checkpoint of another vocabulary otherwise; V' likewise for another exact head.
        state["num_classes"] = torch.tensor(self.num_classes, dtype=torch.int64, device=self.device)
        state["num_candidates"] = torch.tensor(self.num_candidates, dtype=torch.int64, device=self.device)
        return state

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
        self._load_tables(state)
        for name in self._state_names:
            setattr(self, name, state[name].to(device=self.device, dtype=getattr(self, name).dtype))
        if "generator_state" in state:
            self.generator.set_state(state["generator_state"].cpu())
        self._after_load()

    def _load_tables(self, state: dict[str, torch.Tensor]) -> None:
        """Restore what :meth:`state_dict` saves beyond ``_state_names`` (checked first, before anything changes)."""

    def _after_load(self) -> None:
        """Recompute derived tables after :meth:`load_state_dict`."""

    # ------------------------------------------------------------------ hooks for subclasses (local ids)
    def _sample(self, q: torch.Tensor, m: int, gen: CounterRNG) -> tuple[torch.Tensor, torch.Tensor]:
        """(T, M) local ids and their log Q, float32."""
        raise NotImplementedError

    def _log_prob(self, q: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """log Q of (T, N) local ids, (T, N) float32."""
        raise NotImplementedError

    def _sample_scored(
        self, q: torch.Tensor, m: int, gen: CounterRNG, ids: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """:meth:`_sample` plus log Q of (T, N) local ``ids``; query-dependent samplers evaluate their proposal once."""
        draws, log_q = self._sample(q, m, gen)
        return draws, log_q, self._log_prob(q, ids)

    def _log_prob_shared(self, q: torch.Tensor, ids: torch.Tensor, log_w: torch.Tensor | None) -> torch.Tensor:
        """log qbar of (N,) local ids; ``log_w`` (T,) normalized log weights or None (equal weights)."""
        if not self.query_dependent:
            return self._log_prob(q[:1], ids.unsqueeze(0))[0]
        def rows_of(rows: slice) -> torch.Tensor:
            return self._log_prob(q[rows], ids.expand(rows.stop - rows.start, -1))

        return mixture_log_prob(rows_of, q.shape[0], ids.shape[0], log_w)

    def __repr__(self) -> str:
        extra = "" if self.candidates is None else f", excluded={self.num_classes - self.num_candidates}"
        return f"{type(self).__name__}(name={self.name!r}, V={self.num_classes}, D={self.dim}{extra})"
