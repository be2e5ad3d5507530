"""The proposals that cover the softmax (issue 9): the frequency last stage of MIDX, the defensive
mixture, the exact head (``exclude``), the weighted shared pool, the unchecked hot-path methods and the
per-sampler option table.

Every statistical threshold comes from :func:`conftest.goodness_of_fit` (alpha = 1e-4 per check).
"""

from __future__ import annotations

import inspect
import math

import pytest
import torch

from hf_midx import SAMPLERS, build_sampler
from hf_midx.samplers import check_sampler_options

V, D, K = 300, 16, 8

# MIDX variants: (name, options) -> each tested for normalization, exact log q and the fit of its draws.
VARIANTS = {
    "rq-frequency": ("midx-rq", dict(last_stage="frequency")),
    "pq-frequency": ("midx-pq", dict(last_stage="frequency", unigram_power=0.75)),
    "rq-mix-unigram": ("midx-rq", dict(mix_weight=0.5, mix_static="unigram")),
    "rq-mix-uniform": ("midx-rq", dict(mix_weight=0.3, mix_static="uniform")),
    "rq-frequency-mix": ("midx-rq", dict(last_stage="frequency", mix_weight=0.25)),
    "pq-mix-unigram": ("midx-pq", dict(mix_weight=0.5)),
    "rq-centered": ("midx-rq", dict(last_stage="centered")),
    "pq-centered-mix": ("midx-pq", dict(last_stage="centered", mix_weight=0.25, unigram_power=0.75)),
}


def _counts(num_classes: int = V, seed: int = 3) -> torch.Tensor:
    # Zipf-like counts with zeros: the frequency tables must handle both.
    g = torch.Generator().manual_seed(seed)
    ranks = torch.randperm(num_classes, generator=g).double() + 1.0
    counts = (5000.0 / ranks).floor()
    counts[torch.randint(num_classes, (20,), generator=g)] = 0
    return counts


@pytest.fixture(scope="module")
def problem(make_clustered):
    return make_clustered(V, D, num_queries=8, center_scale=0.5, spread=0.15, seed=1)


@pytest.fixture(scope="module")
def variants(problem):
    emb, queries = problem
    out = {
        key: build_sampler(name, emb, codebook_size=K, class_counts=_counts(), seed=0, **opts)
        for key, (name, opts) in VARIANTS.items()
    }
    for key, s in out.items():
        if s.last_stage == "centered":  # queries seen, then a refresh: a mean that is not 0
            s.sample(queries + 0.5, 1, generator=torch.Generator().manual_seed(0))
            s.refresh(emb)
    return out


def _exclude_ids() -> torch.Tensor:
    return torch.sort(torch.argsort(_counts(), descending=True, stable=True)[:40]).values


# ------------------------------------------------------------------------------------------ variants
@pytest.mark.parametrize("key", sorted(VARIANTS))
def test_variant_is_normalized_and_its_draws_fit_log_prob(key, variants, problem, fits):
    _, queries = problem
    s = variants[key]
    q = queries[:2]
    lp = s.full_log_prob(q)
    torch.testing.assert_close(lp.double().exp().sum(1), torch.ones(2, dtype=torch.float64), atol=1e-4, rtol=0)
    n = 100_000
    ids, log_q = s.sample(q, n, generator=torch.Generator().manual_seed(11))
    assert bool(torch.isfinite(log_q).all())
    torch.testing.assert_close(log_q, s.log_prob(q, ids), atol=1e-4, rtol=1e-5)
    for t in range(2):
        fits(torch.bincount(ids[t], minlength=V), lp[t].double().exp(), f"{key} sample() query {t}")
    # M <= K/2: the two-stage bucket draw.
    few, few_q = s.sample(q[:1].expand(25_000, -1), 4, generator=torch.Generator().manual_seed(13))
    torch.testing.assert_close(few_q, s.log_prob(q[:1].expand(25_000, -1), few), atol=1e-4, rtol=1e-5)
    fits(torch.bincount(few.flatten(), minlength=V), lp[0].double().exp(), f"{key} sample() M=4")


@pytest.mark.parametrize("key", sorted(VARIANTS))
def test_variant_shared_pool_fits_the_weighted_mixture(key, variants, problem, fits):
    """Row weights (0 for 'ignored' rows) pick the queries; log_qbar is the weighted mixture."""
    _, queries = problem
    s = variants[key]
    q = queries[:4]
    w = torch.tensor([1.0, 0.0, 2.0, 1.0])
    p = 100_000
    ids, log_qbar = s.sample_shared(q, p, generator=torch.Generator().manual_seed(12), row_weights=w)
    qbar = (s.full_log_prob(q).double().exp() * (w / w.sum()).double().unsqueeze(1)).sum(0)
    torch.testing.assert_close(log_qbar, s.score_shared(q, ids, row_weights=w), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(s.score_shared(q, torch.arange(V), row_weights=w).double().exp(), qbar, atol=1e-6, rtol=1e-4)
    fits(torch.bincount(ids, minlength=V), qbar, f"{key} weighted sample_shared() pool")


def test_frequency_last_stage_is_its_closed_form(problem):
    """Q(i | z) = exp(s1[k1(i)] + s2[k2(i)]) w_i / sum_b W_b exp(s1 + s2), w_i = count_i + 1."""
    emb, queries = problem
    counts = _counts()
    s = build_sampler("midx-rq", emb, codebook_size=K, class_counts=counts, last_stage="frequency", mix_weight=0.0)
    s1, s2, _ = s.codeword_scores(queries)
    codes = s.index.codes
    logit = s1[:, codes[:, 0]] + s2[:, codes[:, 1]] + (counts + 1.0).log().float()
    torch.testing.assert_close(s.full_log_prob(queries), torch.log_softmax(logit.double(), 1).float(), atol=1e-4, rtol=0)


def test_mixture_is_the_convex_combination(problem):
    emb, queries = problem
    counts = _counts()
    plain = build_sampler("midx-rq", emb, codebook_size=K, class_counts=counts, mix_weight=0.0)
    mixed = build_sampler("midx-rq", emb, codebook_size=K, class_counts=counts, mix_weight=0.3)
    unigram = build_sampler("unigram", emb, class_counts=counts)
    expected = 0.7 * plain.full_log_prob(queries).double().exp() + 0.3 * unigram.full_log_prob(queries).double().exp()
    torch.testing.assert_close(mixed.full_log_prob(queries).double().exp(), expected, atol=1e-6, rtol=1e-4)


def test_variants_follow_a_refresh_and_a_state_round_trip(problem):
    emb, queries = problem
    s = build_sampler("midx-rq", emb, codebook_size=K, class_counts=_counts(), last_stage="frequency", mix_weight=0.2)
    s.refresh(emb.flip(0).contiguous())
    total = s.full_log_prob(queries).double().exp().sum(1)
    torch.testing.assert_close(total, torch.ones_like(total), atol=1e-4, rtol=0)
    other = build_sampler("midx-rq", emb, codebook_size=K, class_counts=_counts(), last_stage="frequency", mix_weight=0.2)
    other.load_state_dict(s.state_dict())
    torch.testing.assert_close(other.full_log_prob(queries), s.full_log_prob(queries))
    a, _ = s.sample(queries, 16)
    b, _ = other.sample(queries, 16)
    assert torch.equal(a, b)


def test_without_counts_the_variants_degrade_with_a_warning(problem):
    emb, queries = problem
    with pytest.warns(UserWarning, match="need class_counts"):
        s = build_sampler("midx-rq", emb, codebook_size=K, last_stage="frequency", mix_weight=0.5)
    assert s.last_stage == "uniform" and s.mix_weight == 0.0
    plain = build_sampler("midx-rq", emb, codebook_size=K, mix_weight=0.0)
    torch.testing.assert_close(s.full_log_prob(queries), plain.full_log_prob(queries))
    # An explicitly uniform static component needs no counts and stays.
    u = build_sampler("midx-rq", emb, codebook_size=K, mix_weight=0.5, mix_static="uniform")
    assert bool((u.full_log_prob(queries) >= math.log(0.5 / V) - 1e-5).all())


@pytest.mark.parametrize(
    "options, message",
    [
        (dict(last_stage="softmax"), "last_stage must be one of"),
        (dict(mix_weight=1.0), r"mix_weight must be a number in \[0, 1\)"),
        (dict(mix_static="zipf"), "mix_static must be one of"),
        (dict(last_stage="frequency", unigram_smoothing=0.0), "needs unigram_smoothing > 0"),
    ],
)
def test_variant_options_are_checked(options, message, problem):
    with pytest.raises(ValueError, match=message):
        build_sampler("midx-rq", problem[0], codebook_size=K, class_counts=_counts(), **options)


# ------------------------------------------------------------------------------------------ option table
@pytest.mark.parametrize(
    "name, option, owner",
    [
        ("midx-rq", "rff_temperature", "rff"),
        ("midx-rq", "quantizer", "midx-exact"),
        ("midx-pq", "lsh_bits", "lsh"),
        ("unigram", "mix_weight", "midx-pq, midx-rq"),
        ("sphere", "kmeans_iters", "midx-exact, midx-pq, midx-rq"),
        ("uniform", "unigram_power", "midx-pq, midx-rq, unigram"),
    ],
)
def test_an_option_of_another_sampler_is_refused_naming_its_owner(name, option, owner, problem):
    message = rf"do not apply to sampler '{name}' \('{option}' belongs to {owner}\)"
    with pytest.raises(ValueError, match=message):
        build_sampler(name, problem[0], codebook_size=K, class_counts=_counts(), **{option: 1})
    with pytest.raises(ValueError, match=message):
        check_sampler_options(name, {option: 1})


def test_every_sampler_builds_with_each_of_its_own_options_listed(problem):
    """Each listed option is a keyword of the sampler with a default, and that default passes its own check."""
    for name, cls in SAMPLERS.items():
        own = {}
        for option in cls.options:
            klass = next(c for c in cls.__mro__ if option in inspect.signature(c.__init__).parameters)
            own[option] = inspect.signature(klass.__init__).parameters[option].default
        assert inspect.Parameter.empty not in own.values(), (name, own)
        check_sampler_options(name, own)
        build_sampler(name, problem[0], codebook_size=K, class_counts=_counts(), **own)


@pytest.mark.parametrize(
    "name, options, message",
    [
        ("midx-rq", dict(kmeans_iters=-1), "kmeans_iters must be an integer >= 0"),
        ("midx-exact", dict(kmeans_backend="sklearn"), "kmeans_backend must be one of"),
        ("midx-exact", dict(quantizer="opq"), "quantizer must be one of"),
        ("midx-pq", dict(last_stage="softmax"), "last_stage must be one of"),
        ("midx-rq", dict(mix_weight=1.0), r"mix_weight must be a number in \[0, 1\)"),
        ("midx-rq", dict(mix_static="zipf"), "mix_static must be one of"),
        ("midx-rq", dict(last_stage="frequency", unigram_smoothing=0.0), "needs unigram_smoothing > 0"),
        ("unigram", dict(unigram_power=-1.0), "unigram_power must be a number >= 0"),
        ("sphere", dict(sphere_alpha=0), "sphere_alpha must be a number > 0"),
        ("rff", dict(rff_features=0), "rff_features must be an integer >= 1"),
        ("rff", dict(rff_temperature="hot"), "rff_temperature must be a number > 0"),
        ("lsh", dict(lsh_bits=25), "use at most 24"),
        ("lsh", dict(lsh_uniform_mix=1.5), r"lsh_uniform_mix must be a number in \[0, 1\]"),
    ],
)
def test_each_sampler_checks_its_own_option_values_before_building(name, options, message, problem):
    """The same check refuses a value at build time and, with no embeddings at all, in check_sampler_options
    (what MidxConfig calls)."""
    with pytest.raises(ValueError, match=message):
        check_sampler_options(name, options)
    with pytest.raises(ValueError, match=message):
        build_sampler(name, problem[0], codebook_size=K, class_counts=_counts(), **options)


# ------------------------------------------------------------------------------------------ exact head
@pytest.mark.parametrize("name", sorted(SAMPLERS))
def test_excluded_classes_are_never_drawn_and_have_log_prob_minus_inf(name, problem, fits):
    emb, queries = problem
    exclude = _exclude_ids()
    s = build_sampler(name, emb, codebook_size=K, class_counts=_counts(), exclude=exclude)
    assert torch.equal(s.excluded, exclude) and s.num_candidates == V - exclude.numel()
    q = queries[:2]
    lp = s.full_log_prob(q)
    assert bool((lp[:, exclude] == -math.inf).all())
    torch.testing.assert_close(lp.double().exp().sum(1), torch.ones(2, dtype=torch.float64), atol=1e-4, rtol=0)
    n = 50_000
    ids, log_q = s.sample(q, n, generator=torch.Generator().manual_seed(5))
    assert not bool(torch.isin(ids, exclude).any()) and bool(torch.isfinite(log_q).all())
    torch.testing.assert_close(log_q, s.log_prob(q, ids), atol=1e-4, rtol=1e-5)
    fits(torch.bincount(ids[0], minlength=V), lp[0].double().exp(), f"{name} exclude sample()")
    pool, log_qbar = s.sample_shared(q, 4096)
    assert not bool(torch.isin(pool, exclude).any())
    torch.testing.assert_close(log_qbar, s.score_shared(q, pool), atol=1e-5, rtol=1e-5)
    s.refresh(emb * 1.1)  # a rebuild keeps the exclusion
    assert not bool(torch.isin(s.sample(q, 256)[0], exclude).any())


def test_midx_over_the_tail_indexes_only_the_tail(problem):
    emb, queries = problem
    exclude = _exclude_ids()
    s = build_sampler("midx-rq", emb, codebook_size=K, exclude=exclude)
    assert s.index.num_classes == V - exclude.numel()
    tail = build_sampler("midx-rq", emb[s.candidates], codebook_size=K)
    # The same index over the same rows: the same proposal, in global ids.
    torch.testing.assert_close(s.full_log_prob(queries)[:, s.candidates], tail.full_log_prob(queries))


def test_exclude_is_checked(problem):
    emb, _ = problem
    with pytest.raises(ValueError, match="more than once"):
        build_sampler("uniform", emb, exclude=torch.tensor([1, 1]))
    with pytest.raises(ValueError, match=r"exclude contains 300, outside \[0, 300\)"):
        build_sampler("uniform", emb, exclude=torch.tensor([300]))
    with pytest.raises(ValueError, match="removes all 300 classes"):
        build_sampler("uniform", emb, exclude=torch.arange(V))


def test_state_of_another_exact_head_is_refused(problem):
    emb, _ = problem
    a = build_sampler("uniform", emb, exclude=_exclude_ids())
    with pytest.raises(ValueError, match="another exact head"):
        build_sampler("uniform", emb).load_state_dict(a.state_dict())


# ------------------------------------------------------------------------------------------ hot path
def test_draw_and_score_equal_the_checked_methods(problem):
    """draw/score (unchecked) give what sample/log_prob give from the same generator state."""
    emb, queries = problem
    s = build_sampler("midx-rq", emb, codebook_size=K, class_counts=_counts(), mix_weight=0.5, exclude=_exclude_ids())
    state = s.generator.get_state()
    a, la = s.sample(queries, 12)
    s.generator.set_state(state)
    b, lb = s.draw(queries, 12)
    assert torch.equal(a, b) and torch.equal(la, lb)
    torch.testing.assert_close(s.score(queries, b), s.log_prob(queries, b))
    w = torch.ones(queries.shape[0])
    w[::2] = 0.0
    s.generator.set_state(state)
    pool, lq = s.draw_shared(queries, 64, row_weights=w)
    torch.testing.assert_close(lq, s.score_shared(queries, pool, row_weights=w))
    torch.testing.assert_close(s.score_shared(queries, pool, row_weights=w), lq)
    # Zero-weight rows do not enter qbar: the same as the mixture of the other rows alone.
    torch.testing.assert_close(lq, s.score_shared(queries[1::2], pool), atol=1e-5, rtol=1e-5)


def test_row_weights_are_checked(problem):
    emb, queries = problem
    s = build_sampler("midx-rq", emb, codebook_size=K)
    with pytest.raises(ValueError, match=r"row_weights must be a \(8,\) tensor"):
        s.sample_shared(queries, 4, row_weights=torch.ones(3))
    with pytest.raises(ValueError, match="not all zero"):
        s.sample_shared(queries, 4, row_weights=torch.zeros(8))


# ------------------------------------------------------------------------------------------ centered last stage
def _centered_sampler(emb, name="midx-rq", **opts):
    return build_sampler(name, emb, codebook_size=K, seed=0, last_stage="centered", mix_weight=0.0,
                         class_counts=_counts(), **opts)  # fmt: skip


@pytest.mark.parametrize("name", ["midx-rq", "midx-pq"])
def test_centered_last_stage_is_the_unigram_table_tilted_by_the_centered_query(name, problem):
    emb, queries = problem
    s = _centered_sampler(emb, name)
    frequency = build_sampler(name, emb, codebook_size=K, seed=0, mix_weight=0.0, last_stage="frequency",
                              class_counts=_counts())  # fmt: skip
    # No query seen yet: a zero mean, the frequency last stage.
    torch.testing.assert_close(s.full_log_prob(queries), frequency.full_log_prob(queries), atol=1e-5, rtol=0)
    seen = queries * 2.0 + torch.linspace(-1, 1, D)
    for rows in seen.split(3):  # the mean over several calls
        s.sample(rows, 2, generator=torch.Generator().manual_seed(1))
    s.refresh(emb)
    mu = seen.mean(0)
    log_w = torch.log(_counts() + 1.0).float()
    want = torch.log_softmax((queries - mu) @ s.index.reconstruct().t() + log_w, dim=1)
    torch.testing.assert_close(s.full_log_prob(queries), want, atol=1e-4, rtol=0)
    # At z = mu it is the unigram table itself.
    torch.testing.assert_close(s.full_log_prob(mu[None])[0], torch.log_softmax(log_w, 0), atol=1e-4, rtol=0)
    # A refresh with no query since keeps the mean (the same table for the same codebooks).
    before = s.full_log_prob(queries)
    s.set_codebooks(tuple(c.clone() for c in s.index.codebooks), emb)
    torch.testing.assert_close(s.full_log_prob(queries), before, atol=1e-6, rtol=0)


def test_centered_last_stage_state_round_trips_and_refuses_another_last_stage(problem):
    emb, queries = problem
    s = _centered_sampler(emb)
    s.sample(queries + 1.0, 3, generator=torch.Generator().manual_seed(2))
    s.refresh(emb)
    s.sample(queries - 0.5, 3, generator=torch.Generator().manual_seed(3))  # a pending running sum
    state = s.state_dict()
    other = _centered_sampler(emb)
    other.load_state_dict(state)
    torch.testing.assert_close(other.full_log_prob(queries), s.full_log_prob(queries), atol=0, rtol=0)
    for smp in (other, s):  # the pending sums travelled too: the same codebooks give the same table
        smp.set_codebooks(tuple(c.clone() for c in s.index.codebooks), emb)
    torch.testing.assert_close(other.full_log_prob(queries), s.full_log_prob(queries), atol=0, rtol=0)
    frequency = build_sampler("midx-rq", emb, codebook_size=K, seed=0, mix_weight=0.0, last_stage="frequency",
                              class_counts=_counts())  # fmt: skip
    with pytest.raises(ValueError, match="centered.query_sum"):
        other.load_state_dict(frequency.state_dict())
    torch.testing.assert_close(other.full_log_prob(queries), s.full_log_prob(queries), atol=0, rtol=0)


def test_unigram_log_count_weighting_is_the_papers_table():
    emb = torch.randn(5, 4)
    counts = torch.tensor([1.0, 2.0, 9.0, 0.0, 40.0])
    s = build_sampler("unigram", emb, class_counts=counts, unigram_weighting="log-count", unigram_smoothing=1.0)
    want = torch.log1p(counts + 1.0) / torch.log1p(counts + 1.0).sum()
    torch.testing.assert_close(s.full_log_prob(torch.zeros(1, 4))[0].exp(), want.float(), atol=1e-6, rtol=0)
    with pytest.raises(ValueError, match="count 0 no weight"):
        build_sampler("unigram", emb, class_counts=counts, unigram_weighting="log-count", unigram_smoothing=0.0)
    with pytest.raises(ValueError, match="unigram_weighting must be one of"):
        build_sampler("unigram", emb, class_counts=counts, unigram_weighting="log")
