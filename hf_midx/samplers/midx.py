"""The MIDX proposals over an inverted multi-index: midx-rq / midx-pq (fast), and what they share with midx-exact.

:class:`MidxSampler` is what both kinds share: the index over the candidate classes, its refresh, learned
codebooks and checkpoint state. Its two children are siblings: :class:`MidxQuantizedSampler` (midx-rq,
midx-pq: the softmax over the quantized embeddings, O(K D + K^2 + M log V) per query) and
:class:`~hf_midx.samplers.midx_exact.MidxExactSampler` (midx-exact, Theorem 1: exactly the softmax, O(V D) per
query, a yardstick, in :mod:`.midx_exact`). The sampler name names the quantizer (midx-rq: residual, midx-pq:
product); midx-exact takes it as its ``quantizer`` option. These options make the fast proposal cover the softmax
better (issues 9 and 73):

* ``last_stage="frequency"``: inside a bucket, draw a class proportionally to its smoothed training
  count w_i = (count_i + unigram_smoothing) ** unigram_power instead of uniformly; a bucket's mass uses
  the summed weights W(k1, k2) instead of |Omega(k1, k2)|, so
  Q(i | z) = exp(s1[k1(i)] + s2[k2(i)]) w_i / sum_{k,k'} W(k,k') exp(s1[k] + s2[k']);
* ``last_stage="centered"``: the frequency last stage with the buckets scored by the centered query z - mu,
  mu the mean of the queries drawn for since the last index change (0 until then):
  Q(i | z) = w_i exp((z - mu) . q~_i) / sum_j w_j exp((z - mu) . q~_j), the unigram table tilted by what
  distinguishes this query from the average one; at z = mu it is the unigram table itself. The plain
  frequency last stage counts a class's frequency twice (in w_i, and in z . q~_i, whose component along the
  queries' mean is itself largely frequency in a trained LM), and the uniform one not at all inside a bucket:
  on the paper's WikiText-2 model both under-draw the most frequent classes (issue 73);
* ``mix_weight=a`` with ``mix_static``: the defensive mixture Q = (1 - a) Q_midx + a Q_static, with
  Q_static the unigram table (smoothed counts) or uniform; each draw comes from the static component
  with probability a, and log Q is the logaddexp of both components (exact).

They need ``class_counts`` for their frequency tables; without counts they fall back, with a warning,
to the uniform last stage and no mixture (a uniform component was measured to cover the softmax worse
than MIDX alone: ESS 0.06 vs 0.12 of M, on the recipe's WikiText-2 model after 400 steps).
"""

from __future__ import annotations

import math
import warnings

import torch

from .. import defaults
from .._checks import check_positive_int, is_number
from ..defaults import KMEANS_BACKENDS, LAST_STAGES, MIX_STATICS
from ..indexing.index import MidxIndex
from ..registry import register
from ..rng import as_counter_rng
from .base import Sampler, mixture_log_prob
from .factors import ProposalFactors, proposal_factors_fixed
from .counts import check_counts, check_unigram_options, unigram_log_table


def check_choice(options: dict, name: str, choices: tuple) -> None:
    """``options[name]``, when given, must be one of ``choices``."""
    if name in options and options[name] not in choices:
        raise ValueError(f"{name} must be one of {choices}, got {options[name]!r}.")


class MidxSampler(Sampler):
    """A proposal over an inverted multi-index of the candidate classes (``index``): what midx-rq, midx-pq and
    midx-exact share. Subclasses implement the draws and ``_after_index_change``."""

    options = ("kmeans_iters", "kmeans_backend")

    def __init__(
        self,
        embeddings: torch.Tensor,
        *,
        quantizer: str,
        codebook_size: int = defaults.CODEBOOK_SIZE,
        kmeans_iters: int = defaults.KMEANS_ITERS,
        kmeans_backend: str = defaults.KMEANS_BACKEND,
        seed: int = defaults.SEED,
        exclude=None,
    ) -> None:
        MidxSampler.check_options(kmeans_iters=kmeans_iters, kmeans_backend=kmeans_backend)
        super().__init__(embeddings, seed=seed, exclude=exclude)
        self.index = MidxIndex.build(
            self._restrict(embeddings.detach()),
            codebook_size,
            quantizer=quantizer,
            kmeans_iters=kmeans_iters,
            kmeans_backend=kmeans_backend,
            seed=seed,
            check=False,  # Sampler.__init__ checked the embeddings
        )

    @classmethod
    def check_options(cls, **options) -> None:
        if "kmeans_iters" in options:
            check_positive_int("kmeans_iters", options["kmeans_iters"], minimum=0)
        check_choice(options, "kmeans_backend", KMEANS_BACKENDS)

    @property
    def quantizer(self) -> str:
        return self.index.quantizer

    def refresh(self, embeddings: torch.Tensor) -> None:
        """Warm-started k-means on the new (V, D) embeddings; O(V K D iters)."""
        emb = self._check_embeddings(embeddings)
        self.index.rebuild(emb, check=False)  # checked once, just here
        self._after_index_change(emb)

    def set_codebooks(self, codebooks: tuple[torch.Tensor, torch.Tensor], embeddings: torch.Tensor) -> None:
        """Adopt (e.g. learned) codebooks for the (V, D) embeddings; recomputes codes and bucket tables in O(V K D)."""
        emb = self._check_embeddings(embeddings)
        self.index.set_codebooks(codebooks, emb)
        self._after_index_change(emb)

    def _after_index_change(self, embeddings: torch.Tensor | None) -> None:
        """Recompute what depends on the index; ``embeddings`` (V', D) float32, or None after a checkpoint load."""
        raise NotImplementedError

    def _codeword_scores(self, q: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """s1 = z1 . c1 and s2 = z2 . c2, (T, K) float32 each."""
        d1, d2 = self.index.dim_slices(q.shape[1])
        c1, c2 = self.index.codebooks
        return q[:, d1] @ c1.t(), q[:, d2] @ c2.t()

    # -- state: the index's tensors under "index.", besides the base's
    def state_dict(self) -> dict[str, torch.Tensor]:
        state = super().state_dict()
        state.update({f"index.{k}": v.contiguous() for k, v in self.index.state_dict().items()})
        return state

    def _load_tables(self, state: dict[str, torch.Tensor]) -> None:
        self.index.load_state_dict({k[len("index.") :]: v for k, v in state.items() if k.startswith("index.")})

    def _after_load(self) -> None:
        self._after_index_change(None)


class MidxQuantizedSampler(MidxSampler):
    """The faster MIDX proposal (the paper's Eq. midx_uni): the softmax over the quantized embeddings.

    Q(i | z) = exp(z1.c1[k1(i)] + z2.c2[k2(i)]) / sum_{k,k'} |Omega(k,k')| exp(z1.c1[k] + z2.c2[k']),
    i.e. softmax over the quantized embeddings q_i - residual_i. A draw takes a bucket (k1, k2) with
    probability P1(k1) P2(k2 | k1), computed as one categorical over the K*K buckets whose logits
    are z1.c1[k1] + z2.c2[k2] + log|Omega(k1,k2)| (empty buckets get -inf and are never drawn),
    then a class from the bucket (uniformly, or by frequency with ``last_stage="frequency"`` or ``"centered"``); with
    ``mix_weight`` > 0 the defensive mixture of the module docstring. Per query:
    O(K D + K^2 + M log V); nothing of size V.
    """

    options = (
        *MidxSampler.options,
        "last_stage",
        "mix_weight",
        "mix_static",
        "unigram_smoothing",
        "unigram_power",
    )
    quantizer_name = "rq"

    def __init__(
        self,
        embeddings: torch.Tensor,
        *,
        last_stage: str = defaults.LAST_STAGE,
        mix_weight: float = defaults.MIX_WEIGHT,
        mix_static: str = defaults.MIX_STATIC,
        unigram_smoothing: float = defaults.UNIGRAM_SMOOTHING,
        unigram_power: float = defaults.UNIGRAM_POWER,
        class_counts=None,
        **index_options,
    ) -> None:
        MidxQuantizedSampler.check_options(
            last_stage=last_stage,
            mix_weight=mix_weight,
            mix_static=mix_static,
            unigram_smoothing=unigram_smoothing,
            unigram_power=unigram_power,
        )
        super().__init__(embeddings, quantizer=self.quantizer_name, **index_options)
        needs_counts = last_stage in ("frequency", "centered") or (mix_weight > 0 and mix_static == "unigram")
        counts = None
        if class_counts is not None:
            counts = self._restrict(check_counts(class_counts, self.num_classes, self.device))
        elif needs_counts:
            wanted = [f"last_stage={last_stage!r}"] if last_stage in ("frequency", "centered") else []
            wanted += ["mix_static='unigram'"] if mix_weight > 0 and mix_static == "unigram" else []
            warnings.warn(
                f"{self.name}: {' and '.join(wanted)} {'needs' if len(wanted) == 1 else 'need'} class_counts "
                "(training-token frequencies); without them the sampler draws uniformly inside buckets and mixes "
                "in no static component. Pass class_counts= (e.g. hf_midx.wrap(model, config, "
                "class_counts=hf_midx.token_counts(ids, V))) for the measured defaults, or mix_weight=0.0 for "
                "the paper's MIDX alone.",
                UserWarning,
                stacklevel=3,
            )
            last_stage = "uniform"
            if mix_static == "unigram":
                mix_weight = 0.0
        self.last_stage, self.mix_static, self.mix_weight = last_stage, mix_static, float(mix_weight)
        # The smoothed unigram table (V',) float32, built once for whichever part reads it (the frequency and
        # centered last stages, the unigram component); the last stage's per-class log weights (None: uniform).
        unigram = last_stage != "uniform" or (self.mix_weight > 0 and mix_static == "unigram")
        self._log_f = unigram_log_table(counts, unigram_smoothing, unigram_power) if unigram else None
        self._log_w = self._log_f if last_stage == "frequency" else None
        if last_stage == "centered":
            # The queries' running sum and count since the last index change (float64: a run adds millions) and
            # the mean that the current tables use (none seen yet: 0, the frequency last stage).
            self._query_sum = torch.zeros(self.dim, dtype=torch.float64, device=self.device)
            self._query_count = torch.zeros((), dtype=torch.float64, device=self.device)
            self._query_mean = torch.zeros(self.dim, device=self.device)
        self._log_static = None
        if self.mix_weight > 0:
            if mix_static == "unigram":
                self._log_static = self._log_f
            else:
                v = self.num_candidates
                self._log_static = torch.full((v,), -math.log(v), device=self.device)
            # Cumulative over the global ids, 0 weight for an excluded class (a search never returns it), and
            # its total as a Python float (read once here): u * total < total for a 53-bit u.
            self._static_cum = self._globalize(self._log_static.double().exp(), 0.0).cumsum(0)
            self._static_total = float(self._static_cum[-1])
        self._after_index_change(None)

    @classmethod
    def check_options(cls, **options) -> None:
        super().check_options(**options)
        check_choice(options, "last_stage", LAST_STAGES)
        check_choice(options, "mix_static", MIX_STATICS)
        mix_weight = options.get("mix_weight", 0.0)
        if not (is_number(mix_weight) and 0.0 <= mix_weight < 1.0):
            raise ValueError(f"mix_weight must be a number in [0, 1), got {mix_weight!r}.")
        check_unigram_options(options)
        stage = options.get("last_stage")
        if stage in ("frequency", "centered") and not options.get("unigram_smoothing", defaults.UNIGRAM_SMOOTHING) > 0:
            raise ValueError(f"last_stage={stage!r} needs unigram_smoothing > 0 so that every class stays drawable.")

    def _after_index_change(self, embeddings: torch.Tensor | None) -> None:
        """The tables a step reads, which change only with the index: the (D, 2K) codebooks as one matrix, the
        (K*K,) log bucket masses, and per class, in global ids, its bucket (V,) and (V, 2) its log share of the
        bucket (times 1 - a) and its log static probability (times a): one gather reads both; an excluded
        class scores -inf in both."""
        idx, k = self.index, self.index.codebook_size
        bucket = idx.codes[:, 0] * k + idx.codes[:, 1]  # (V',)
        if self.last_stage == "centered":
            if embeddings is not None:  # a rebuild or new codebooks, not a checkpoint load
                self._adopt_query_mean()
            self._log_w = self._centered_log_weights()
        if self._log_w is None:
            log_mass = idx.bucket_counts.double().flatten().log()
            log_member = -log_mass[bucket]  # uniform inside the bucket: 1 / |Omega|
            self._cum_w = None
        else:
            # log W(k1, k2) = logsumexp of the members' log weights (the centered ones span tens of nats).
            log_w = self._log_w.double()
            top = torch.full((k * k,), -math.inf, dtype=torch.float64, device=self.device)
            top = top.scatter_reduce(0, bucket, log_w, reduce="amax")
            total = torch.zeros_like(top).index_add_(0, bucket, (log_w - top[bucket]).exp())
            log_mass = top + total.log()
            log_member = log_w - log_mass[bucket]
            # cum_w[j] = the shares of order[:j]: a bucket's members order[lo:hi] span [cum_w[lo], cum_w[hi]),
            # one unit per bucket, so a float64 uniform resolves every bucket alike.
            self._cum_w = torch.cat([log_w.new_zeros(1), log_member.exp()[idx.order].cumsum(0)])
        self._log_mass = log_mass.float()  # -inf for an empty bucket, which is never drawn
        d1, d2 = idx.dim_slices(self.dim)
        c1, c2 = idx.codebooks
        codewords = torch.zeros(self.dim, 2 * k, device=self.device)  # s = z @ codewords = [z1 . c1, z2 . c2]
        codewords[d1, :k], codewords[d2, k:] = c1.t(), c2.t()
        self._codewords = codewords
        a = self.mix_weight
        self._class_bucket = self._globalize(bucket, 0)
        logs = [log_member.float() + math.log1p(-a)]
        if self._log_static is not None:
            logs.append(self._log_static + math.log(a))
        self._class_logs = self._globalize(torch.stack(logs, dim=1), -math.inf)
        self._order = self._to_global(idx.order)  # the classes in CSR order, as global ids
        # proposal_factors: a class's weight in its bucket's row is its share of the bucket (times 1 - a), 0 when
        # excluded; with the uniform last stage that share is the bucket's (1 - a) / |Omega|, put on the (T, K*K)
        # bucket terms, and the row weight is 1 (0 when excluded).
        class_probs = self._class_logs.exp()
        member, self._bucket_share = class_probs[:, 0], None
        if self._log_w is None:
            share = (math.log1p(-self.mix_weight) - self._log_mass).exp()
            self._bucket_share = share.masked_fill(self._log_mass == -math.inf, 0.0)  # an empty bucket: 0, not inf
            member = (member > 0).float()
        static = class_probs[:, 1] if len(logs) > 1 else None
        self._fixed_factors = proposal_factors_fixed(self._class_bucket, member, static, k * k)

    def _adopt_query_mean(self) -> None:
        """``last_stage="centered"``: the mean of the queries drawn for since the last index change becomes the
        tables' mu (the previous mu when there were none); the running sums restart. No host sync."""
        seen = self._query_count > 0
        mean = torch.where(seen, self._query_sum / self._query_count.clamp_min(1.0), self._query_mean.double())
        self._query_mean = mean.float()
        self._query_sum.zero_()
        self._query_count.zero_()

    def _centered_log_weights(self) -> torch.Tensor:
        """(V',) float32 log w_i - mu . q~_i of ``last_stage="centered"``: the smoothed count's log minus the
        mean query's score of the class's bucket, (c1[k1] + c2[k2]) . mu, from the (K,) scores of each codebook."""
        d1, d2 = self.index.dim_slices(self.dim)
        c1, c2 = self.index.codebooks
        mu = self._query_mean
        codes = self.index.codes
        return self._log_f - ((c1 @ mu[d1])[codes[:, 0]] + (c2 @ mu[d2])[codes[:, 1]])

    def _observe(self, q: torch.Tensor) -> None:
        """Adds the (T, D) float32 queries to the running mean of ``last_stage="centered"``: one (D,) sum, in
        float32 (no float64 pass over T D on GPUs that run it slowly), accumulated in float64 across steps. Every
        row counts, an ignored token's too (the draws do not know the labels): a mean over what the head sees."""
        if self.last_stage == "centered":
            self._query_sum.add_(q.sum(0))  # float32 into float64, in place: no copy
            self._query_count += q.shape[0]

    # -- state: the centered last stage's means under "centered.", besides the index (its table is recomputed)
    _CENTERED_STATE = {"query_sum": "_query_sum", "query_count": "_query_count", "query_mean": "_query_mean"}

    def state_dict(self) -> dict[str, torch.Tensor]:
        state = super().state_dict()
        if self.last_stage == "centered":
            state.update({f"centered.{k}": getattr(self, a).contiguous() for k, a in self._CENTERED_STATE.items()})
        return state

    def _load_tables(self, state: dict[str, torch.Tensor]) -> None:
        if self.last_stage == "centered":
            for key, attr in self._CENTERED_STATE.items():
                have, got = getattr(self, attr), state.get(f"centered.{key}")
                if got is None or tuple(got.shape) != tuple(have.shape):
                    raise ValueError(
                        f"{self.name} sampler state has no centered.{key} of shape {tuple(have.shape)}: it was saved "
                        "by a sampler with another last_stage or dimension."
                    )
        super()._load_tables(state)  # the index: checked before anything of this sampler changes
        if self.last_stage == "centered":
            for key, attr in self._CENTERED_STATE.items():
                # A copy: the running sums are added to in place, and the state may be another sampler's own.
                value = state[f"centered.{key}"].to(device=self.device, dtype=getattr(self, attr).dtype, copy=True)
                setattr(self, attr, value)

    # -- the proposal
    def _scores(self, q: torch.Tensor):
        """Eq. midx_uni per query over the K*K buckets, without any T x V tensor.

        Returns s (T, 2K) float32 = [z1 . c1, z2 . c2]; the bucket logits joint (T, K*K) float32 =
        s1[k1] + s2[k2] + log W(k1, k2) (W = |Omega| or the summed frequency weights; -inf for an empty
        bucket); log Z (T, 1) float32; and the buckets' cumulative weights (T, K*K) float32, relative to
        the row's largest bucket, for the inverse-CDF draw (a bucket below e^-87 of it is never drawn), with
        their (T, K*K) float32 terms.
        """
        k = self.index.codebook_size
        s = q @ self._codewords
        joint = (s[:, :k].unsqueeze(2) + s[:, k:].unsqueeze(1)).view(-1, k * k) + self._log_mass
        top = joint.amax(1, keepdim=True)
        e = (joint - top).exp()
        cum = e.cumsum(1)
        return s, joint, cum[:, -1:].log() + top, cum, e

    def codeword_scores(self, q: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """s1 = z1 . c1 (T, K), s2 = z2 . c2 (T, K) float32 and log Z (T,) float32 of the MIDX component."""
        s, _, log_z, *_ = self._scores(q)
        k = self.index.codebook_size
        return s[:, :k], s[:, k:], log_z.squeeze(1)

    def _draw(self, q: torch.Tensor, m: int, gen, ids: torch.Tensor | None, factors: bool = False,
              fused: bool = False):
        """(T, M) global draws, their log Q (T, M), and log Q of (T, N) global ``ids`` (None for None).

        One proposal evaluation and one call of the generator per step: its (4, T, M) uniforms pick the
        bucket (inverse CDF over the K*K buckets: the two-stage P1(k1) P2(k2 | k1) draw in one search), the
        class inside it, the static component's class and which of the two each draw keeps (both drawn:
        no host sync). A float64 uniform u of 53 bits gives u * total < total, so no zero-weight entry is drawn.
        ``fused``: the bucket draw and the generator in Triton kernels (:mod:`hf_midx.losses.kernels.draw`), the
        same draws up to float rounding from the same stream.
        """
        self._observe(q)
        if fused:
            # Lazily: the kernels' module imports Triton.
            from ..losses.kernels.draw import midx_bucket_draw  # noqa: PLC0415

            s = q @ self._codewords
            u = gen.rand(2 if self._log_static is None else 4, q.shape[0], m, dtype=torch.float64, fused=True)
            bucket, log_z, probs = midx_bucket_draw(s, self._log_mass, u[0], self._bucket_share, probs=factors)
            joint = None
        else:
            _, joint, log_z, cum, e = self._scores(q)
            u = gen.rand(2 if self._log_static is None else 4, q.shape[0], m, dtype=torch.float64)
            # The clamp only matters for NaN queries (searchsorted then returns K*K): an index in range lets the
            # caller say which tensor went NaN.
            # A float32 target strictly below the row's total: u * total * (1 - 2^-23) rounds at most to the float
            # before the total, so a trailing empty bucket is never drawn (the last bucket loses < 2^-23 of the
            # mass).
            target = (u[0] * (cum[:, -1:] * (1 - 2.0**-23))).float()
            bucket = torch.searchsorted(cum, target, right=True).clamp_max(cum.shape[1] - 1)
        draws = self.index.draw_members(bucket, u[1], self._cum_w, ids=self._order)
        if self._log_static is not None:
            static = torch.searchsorted(self._static_cum, u[2] * self._static_total, right=True)
            draws = torch.where(u[3] < self.mix_weight, static, draws)
        both = draws if ids is None else torch.cat([ids, draws], dim=1)
        log_q = self._log_q(joint, log_z, both) if joint is not None else self._log_q_scores(s, log_z, both)
        out = (draws, log_q, None) if ids is None else (draws, log_q[:, ids.shape[1] :], log_q[:, : ids.shape[1]])
        if not factors:
            return out
        return (*out, ProposalFactors(probs, *self._fixed_factors) if fused else self._factors(e, cum))

    def _log_q_scores(self, s: torch.Tensor, log_z: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """:meth:`_log_q` from the (T, 2K) codeword scores instead of the (T, K*K) bucket logits (the fused draw
        makes none): each id's bucket logit summed as :meth:`_scores` sums it, (s1 + s2) + log W."""
        k = self.index.codebook_size
        b = self._class_bucket[ids]
        joint = (s.gather(1, torch.div(b, k, rounding_mode="floor")) + s.gather(1, k + b % k)) + self._log_mass[b]
        return self._mixed(joint - log_z, ids)

    def _log_q(self, joint: torch.Tensor, log_z: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """log Q of (T, N) global ids from the bucket logits: the MIDX component, mixed with the static one."""
        return self._mixed(joint.gather(1, self._class_bucket[ids]) - log_z, ids)

    def _mixed(self, log_q_bucket: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """log Q of global ``ids`` from the log probability of their buckets: the class's share of its bucket,
        then the logaddexp with the static component (both already weighted by the mixture)."""
        logs = self._class_logs[ids]  # (..., 1 or 2)
        out = log_q_bucket + logs[..., 0]
        return out if logs.shape[-1] == 1 else torch.logaddexp(out, logs[..., 1])

    # The hot path in global ids (the tables hold the excluded classes as -inf), the hooks in local ones.
    def draw(self, queries, num_samples, generator=None):
        draws, log_q, _ = self._draw(self._queries(queries), num_samples, as_counter_rng(generator, self.generator), None)
        return draws, log_q

    def draw_scored(self, queries, num_samples, ids, generator=None, kernels="eager"):
        """:meth:`Sampler.draw_scored`; ``kernels="fused"`` as in :meth:`draw_with_factors`."""
        gen = as_counter_rng(generator, self.generator)
        return self._draw(self._queries(queries), num_samples, gen, ids.to(self.device), False, self._fused(kernels))

    def _sample(self, q, m, gen):
        draws, log_q, _ = self._draw(q, m, gen, None)
        return self._local(draws)[0], log_q

    def _log_prob(self, q, ids):
        _, joint, log_z, *_ = self._scores(q)
        return self._log_q(joint, log_z, self._to_global(ids))

    @classmethod
    def has_fused_draw(cls) -> bool:
        return True

    def draw_with_factors(self, queries, num_samples, ids=None, generator=None, kernels="eager"):
        """:meth:`Sampler.draw_with_factors`; ``kernels="fused"``: the bucket draw and the generator in Triton kernels
        (:mod:`hf_midx.losses.kernels.draw`, K * K <= 4,096; a larger codebook draws eagerly), the same draws up to
        float rounding, the stream advanced alike."""
        gen = as_counter_rng(generator, self.generator)
        ids = None if ids is None else ids.to(self.device)
        return self._draw(self._queries(queries), num_samples, gen, ids, True, self._fused(kernels))

    def _fused(self, kernels: str) -> bool:
        """Whether a draw asked for with ``kernels`` runs the Triton draw."""
        if kernels not in ("eager", "fused"):
            raise ValueError(f"kernels must be 'eager' or 'fused' for a draw, got {kernels!r}.")
        if kernels == "eager":
            return False
        from ..losses.kernels.draw import fits  # noqa: PLC0415 (lazily: the kernels' package)

        return fits(self.index.codebook_size)  # a larger codebook keeps the eager draw

    def proposal_factors(self, queries):
        *_, cum, e = self._scores(self._queries(queries))
        return self._factors(e, cum)

    def _factors(self, e: torch.Tensor, cum: torch.Tensor) -> ProposalFactors:
        # (T, K*K) P(bucket | z) from the draw's exponentials, in place (they are read once): an empty bucket's is 0.
        probs = e.mul_(cum[:, -1:].reciprocal())
        probs = probs if self._bucket_share is None else probs.mul_(self._bucket_share)
        return ProposalFactors(probs, *self._fixed_factors)


@register
class MidxRQSampler(MidxQuantizedSampler):
    """MIDX with residual quantization (both codebooks in D dims)."""

    name = "midx-rq"
    quantizer_name = "rq"


@register
class MidxPQSampler(MidxQuantizedSampler):
    """MIDX with product quantization (codebook 1 on the first D/2 dims, codebook 2 on the rest)."""

    name = "midx-pq"
    quantizer_name = "pq"
