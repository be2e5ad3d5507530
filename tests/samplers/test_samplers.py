"""Samplers: normalization, agreement of draws with the claimed probabilities, the closed forms of the
paper (Theorem 1 for midx-exact, Eq. midx_uni for midx-rq / midx-pq), KL ordering, state round trips
and argument validation.

Every statistical threshold comes from :func:`conftest.goodness_of_fit` (alpha = 1e-4 per check).
"""

from __future__ import annotations

import math

import pytest
import safetensors.torch
import torch

from hf_midx import SAMPLERS, build_sampler, kl_to_softmax
from hf_midx.indexing import quantizers
from hf_midx.samplers import Sampler

ALL = sorted(SAMPLERS)
MIDX = ("midx-rq", "midx-pq")

# Small problem for the per-sampler statistics: V = 300 classes, D = 16, K = 8 (64 buckets).
V, D, K = 300, 16, 8


def _counts(num_classes: int, seed: int = 3) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 50, (num_classes,), generator=g)


def _build(name: str, emb: torch.Tensor, *, seed: int = 0, codebook_size: int = K, **options) -> Sampler:
    return build_sampler(
        name, emb, codebook_size=codebook_size, class_counts=_counts(emb.shape[0]), seed=seed, **options
    )


@pytest.fixture(scope="module")
def problem(make_clustered):
    # center_scale 0.5: logits spread ~1.2 nats, so most classes have a visible probability.
    return make_clustered(V, D, num_queries=8, center_scale=0.5, spread=0.15, seed=1)


@pytest.fixture(scope="module")
def samplers(problem):
    emb, _ = problem
    return {name: _build(name, emb) for name in ALL}


# ------------------------------------------------------------------------------------------ normalization
@pytest.mark.parametrize("name", ALL)
def test_log_prob_is_normalized_over_all_classes(name, samplers, problem):
    _, queries = problem
    s = samplers[name]
    lp = s.full_log_prob(queries)  # (T, V)
    assert lp.shape == (queries.shape[0], V) and lp.dtype == torch.float32
    total = lp.double().exp().sum(1)
    # float32 log-probabilities: each exp carries relative error ~1e-6; 1e-4 leaves room for V of them.
    torch.testing.assert_close(total, torch.ones_like(total), atol=1e-4, rtol=0)
    # log_prob with a (T, ...) id tensor agrees with the full table.
    ids = torch.randint(V, (queries.shape[0], 3, 5), generator=torch.Generator().manual_seed(0))
    torch.testing.assert_close(s.log_prob(queries, ids), lp.gather(1, ids.view(ids.shape[0], -1)).view(ids.shape))


# ------------------------------------------------------------------------------------------ draws
@pytest.mark.parametrize("name", ALL)
def test_sample_matches_log_prob(name, samplers, problem, fits):
    """Per query, n = 100k draws of sample() fit exp(log_prob) (chi-square and TV at alpha = 1e-4)."""
    _, queries = problem
    s = samplers[name]
    q = queries[:2]
    n = 100_000
    ids, log_q = s.sample(q, n, generator=torch.Generator().manual_seed(11))
    assert ids.shape == (2, n) and ids.dtype == torch.int64 and log_q.dtype == torch.float32
    assert bool(torch.isfinite(log_q).all())
    # The returned log_q is log Q of the returned ids (same proposal, not a stale or unnormalized one).
    torch.testing.assert_close(log_q, s.log_prob(q, ids), atol=1e-4, rtol=1e-5)
    probs = s.full_log_prob(q).double().exp()
    for t in range(q.shape[0]):
        fits(torch.bincount(ids[t], minlength=V), probs[t], f"{name} sample() query {t}")


@pytest.mark.parametrize("name", ["midx-rq", "midx-pq"])
def test_few_draws_per_query_match_log_prob(name, samplers, problem, fits):
    """With M <= K/2 MIDX draws k1 and then k2 | k1 (its other code path): 100k draws of one query,
    as 25k rows of M = 4, fit exp(log_prob) like the M = 100k draws above."""
    _, queries = problem
    s = samplers[name]
    q = queries[:1].expand(25_000, -1)
    ids, log_q = s.sample(q, 4, generator=torch.Generator().manual_seed(13))
    torch.testing.assert_close(log_q, s.log_prob(q, ids), atol=1e-4, rtol=1e-5)
    probs = s.full_log_prob(queries[:1]).double().exp()[0]
    fits(torch.bincount(ids.flatten(), minlength=V), probs, f"{name} sample() M=4")


@pytest.mark.parametrize("name", ALL)
def test_sample_shared_matches_batch_mixture(name, samplers, problem, fits):
    """The shared pool fits qbar = mean_t Q(. | z_t); log_qbar equals score_shared and the mixture."""
    _, queries = problem
    s = samplers[name]
    q = queries[:4]
    p = 100_000
    ids, log_qbar = s.sample_shared(q, p, generator=torch.Generator().manual_seed(12))
    assert ids.shape == (p,) and log_qbar.shape == (p,) and bool(torch.isfinite(log_qbar).all())
    torch.testing.assert_close(log_qbar, s.score_shared(q, ids), atol=1e-5, rtol=1e-5)
    # The mixture computed independently from the per-query probabilities.
    all_ids = torch.arange(V)
    qbar = s.full_log_prob(q).double().exp().mean(0)
    torch.testing.assert_close(s.score_shared(q, all_ids).double().exp(), qbar, atol=1e-6, rtol=1e-4)
    fits(torch.bincount(ids, minlength=V), qbar, f"{name} sample_shared() pool")


@pytest.mark.parametrize("name", ALL)
def test_empty_batch_of_queries(name, samplers):
    s = samplers[name]
    ids, log_q = s.sample(torch.zeros(0, D), 5)
    assert ids.shape == (0, 5) and log_q.shape == (0, 5)
    assert s.log_prob(torch.zeros(0, D), ids).shape == (0, 5)
    with pytest.raises(ValueError, match="sample_shared needs at least one query"):
        s.sample_shared(torch.zeros(0, D), 5)


def test_own_generator_is_used_and_advances(problem):
    _, queries = problem
    s = _build("midx-rq", problem[0], seed=5)
    a, _ = s.sample(queries, 20)
    b, _ = s.sample(queries, 20)
    assert not torch.equal(a, b)
    s2 = _build("midx-rq", problem[0], seed=5)
    a2, _ = s2.sample(queries, 20)
    assert torch.equal(a, a2)


# ------------------------------------------------------------------------------------------ MIDX closed forms
@pytest.mark.parametrize("name", MIDX)
def test_midx_log_prob_is_eq_midx_uni(name, samplers, problem):
    """Eq. midx_uni: Q(i | z) = softmax_i(z . q_hat_i), q_hat_i = c1[k1(i)] (+ or concat) c2[k2(i)].

    Computed here from the index's codebooks and codes alone, in float64; the paper's MIDX alone (no mixture).
    """
    emb, queries = problem
    s = _build(name, emb, mix_weight=0.0, last_stage="uniform")
    c1, c2 = (c.double() for c in s.index.codebooks)
    codes = s.index.codes
    if name == "midx-rq":
        q_hat = c1[codes[:, 0]] + c2[codes[:, 1]]
    else:
        q_hat = torch.cat([c1[codes[:, 0]], c2[codes[:, 1]]], dim=1)
    assert q_hat.shape == (V, D)
    expected = torch.log_softmax(queries.double() @ q_hat.t(), dim=1)
    torch.testing.assert_close(s.full_log_prob(queries).double(), expected, atol=2e-5, rtol=0)
    # ...which is also the three-factor product P1(k1) P2(k2 | k1) P3(i | k1, k2) with uniform P3.
    counts = s.index.bucket_counts.double()  # (K, K)
    d1 = slice(0, D) if name == "midx-rq" else slice(0, D // 2)
    d2 = slice(0, D) if name == "midx-rq" else slice(D // 2, D)
    z = queries.double()
    e1 = (z[:, d1] @ c1.t()).exp()  # (T, K)
    e2 = (z[:, d2] @ c2.t()).exp()
    psi = (counts.unsqueeze(0) * e2.unsqueeze(1)).sum(2)  # (T, K): psi_k1 = sum_k2 omega e2
    p1 = psi * e1 / (psi * e1).sum(1, keepdim=True)
    p2 = counts.unsqueeze(0) * e2.unsqueeze(1) / psi.unsqueeze(2)  # (T, K, K)
    p3 = 1.0 / counts[codes[:, 0], codes[:, 1]]  # (V,)
    product = p1[:, codes[:, 0]] * p2[:, codes[:, 0], codes[:, 1]] * p3
    torch.testing.assert_close(product.log(), expected, atol=1e-9, rtol=0)


@pytest.mark.parametrize("name", MIDX)
def test_midx_never_draws_an_empty_bucket(name, make_clustered):
    """K = 16 on V = 40 classes leaves most of the 256 buckets empty; none may ever be drawn."""
    emb, queries = make_clustered(40, 8, clusters=4, num_queries=16, seed=2)
    s = build_sampler(name, emb, codebook_size=16)
    counts = s.index.bucket_counts.flatten()
    assert int((counts == 0).sum()) > 100  # the case is really exercised
    ids, log_q = s.sample(queries, 5000)
    assert bool(torch.isfinite(log_q).all())
    # Each drawn class sits in a non-empty bucket (its own), and the pool path behaves the same.
    b = s.index.codes[ids, 0] * 16 + s.index.codes[ids, 1]
    assert bool((counts[b] > 0).all())
    pool, log_qbar = s.sample_shared(queries, 5000)
    assert bool(torch.isfinite(log_qbar).all()) and int(pool.min()) >= 0 and int(pool.max()) < 40


def test_midx_exact_samples_the_softmax(make_clustered, fits):
    """Theorem 1: midx-exact draws follow softmax(z . q) exactly.

    The softmax is computed here in float64 from the embeddings (not from the sampler); 2 queries x
    100k draws, chi-square and TV at alpha = 1e-4 each (thresholds in conftest.goodness_of_fit).
    The logits are made steeper than elsewhere (center_scale 0.7) so that the residual factor P3 matters.
    """
    emb, queries = make_clustered(500, 16, num_queries=2, center_scale=0.7, spread=0.3, seed=4)
    s = build_sampler("midx-exact", emb, codebook_size=8)
    n = 100_000
    ids, log_q = s.sample(queries, n, generator=torch.Generator().manual_seed(21))
    softmax = torch.softmax(queries.double() @ emb.double().t(), dim=1)
    torch.testing.assert_close(log_q.double(), softmax.log().gather(1, ids), atol=1e-4, rtol=0)
    for t in range(2):
        fits(torch.bincount(ids[t], minlength=500), softmax[t], f"midx-exact vs softmax, query {t}")
    # Same with the product quantizer as the index: the decomposition holds for any codebooks.
    s_pq = build_sampler("midx-exact", emb, codebook_size=8, quantizer="pq")
    ids, _ = s_pq.sample(queries[:1], n, generator=torch.Generator().manual_seed(22))
    fits(torch.bincount(ids[0], minlength=500), softmax[0], "midx-exact (pq index) vs softmax")


# ------------------------------------------------------------------------------------------ KL ordering
def test_kl_to_softmax_orders_the_proposals(make_clustered):
    """On clustered data: KL(Q || softmax) of midx-rq <= midx-pq < uniform (and midx-exact ~ 0).

    Exact numbers (no sampling): KL is computed over all V for 64 queries.
    """
    emb, queries = make_clustered(1000, 16, num_queries=64, seed=0)
    kl = {name: float(kl_to_softmax(build_sampler(name, emb, codebook_size=16), queries, emb)) for name in ALL
          if name != "unigram"}
    kl["unigram"] = float(kl_to_softmax(_build("unigram", emb), queries, emb))
    print("[kl] KL(Q || softmax), V=1000 D=16 K=16 clustered: " + ", ".join(f"{k}={v:.4f}" for k, v in kl.items()))
    assert abs(kl["midx-exact"]) < 1e-4
    assert kl["midx-rq"] <= kl["midx-pq"] < kl["uniform"]
    # MIDX is far better than the static proposals here: every class of the query's cluster gets mass.
    assert kl["midx-pq"] < 0.1 * kl["uniform"]


def test_kl_to_softmax_handles_zero_probability_classes(make_clustered):
    """LSH without the uniform mixture gives Q = 0 to classes outside the query's buckets: 0 log 0 = 0."""
    emb, queries = make_clustered(200, 8, num_queries=8, seed=3)
    s = build_sampler("lsh", emb, lsh_uniform_mix=0.0, lsh_tables=2, lsh_bits=4)
    assert bool((s.full_log_prob(queries) == -math.inf).any())
    kl = kl_to_softmax(s, queries, emb)
    assert bool(torch.isfinite(kl)) and float(kl) >= 0


# ------------------------------------------------------------------------------------------ state
@pytest.mark.parametrize("name", ALL)
def test_state_dict_round_trip_reproduces_next_draws(name, problem):
    emb, queries = problem
    a = _build(name, emb, seed=0)
    a.sample(queries, 7)  # move the generator off its seed
    state = a.state_dict()
    assert all(isinstance(v, torch.Tensor) for v in state.values())
    state = safetensors.torch.load(safetensors.torch.save(state))  # checkpoints are safetensors
    want_ids, want_lq = a.sample(queries, 50)
    b = _build(name, emb, seed=123)  # other seed: other random structures and generator
    b.load_state_dict(state)
    got_ids, got_lq = b.sample(queries, 50)
    assert torch.equal(got_ids, want_ids)
    torch.testing.assert_close(got_lq, want_lq, atol=0, rtol=0)
    torch.testing.assert_close(b.full_log_prob(queries), a.full_log_prob(queries), atol=0, rtol=0)


@pytest.mark.parametrize("name", ALL)
def test_state_dict_from_another_vocabulary_is_refused(name, problem):
    emb, _ = problem
    state = _build(name, emb).state_dict()
    other = _build(name, emb[: V - 20])
    with pytest.raises(ValueError, match="vocabulary|classes|shape"):
        other.load_state_dict(state)


@pytest.mark.parametrize("name", ["midx-rq", "midx-pq", "midx-exact"])
def test_state_dict_from_another_codebook_size_is_refused(name, problem):
    emb, _ = problem
    state = _build(name, emb, codebook_size=8).state_dict()
    other = _build(name, emb, codebook_size=4)
    with pytest.raises(ValueError, match="codebook size"):
        other.load_state_dict(state)


# ------------------------------------------------------------------------------------------ validation
def test_unknown_sampler_lists_the_known_ones(problem):
    with pytest.raises(ValueError, match="Unknown sampler 'midx'.*known samplers: " + ", ".join(sorted(SAMPLERS))):
        build_sampler("midx", problem[0])


def test_unknown_option_is_refused(problem):
    with pytest.raises(ValueError, match=r"Unknown sampler option\(s\) \['kmeans_iter'\]"):
        build_sampler("midx-rq", problem[0], kmeans_iter=5)


def test_unigram_needs_class_counts(problem):
    with pytest.raises(ValueError, match="needs class_counts"):
        build_sampler("unigram", problem[0])
    with pytest.raises(ValueError, match=r"class_counts must have shape \(300,\)"):
        build_sampler("unigram", problem[0], class_counts=torch.ones(10))
    with pytest.raises(ValueError, match="non-negative"):
        build_sampler("unigram", problem[0], class_counts=-torch.ones(V))


@pytest.mark.parametrize("name", ["midx-rq", "midx-pq", "midx-exact"])
def test_codebook_larger_than_vocabulary_is_refused(name):
    with pytest.raises(ValueError, match="codebook_size=64 is larger than the number of classes 10"):
        build_sampler(name, torch.randn(10, 4), codebook_size=64)


@pytest.mark.parametrize("name", ALL)
@pytest.mark.parametrize("bad", [math.nan, math.inf])
def test_non_finite_embeddings_are_refused(name, bad):
    emb = torch.randn(30, 4)
    emb[7, 2] = bad
    with pytest.raises(ValueError, match="embeddings contains NaN or Inf.*first bad row: 7"):
        build_sampler(name, emb, codebook_size=4, class_counts=torch.ones(30))


@pytest.mark.parametrize("name", ALL)
def test_sample_arguments_are_checked(name, samplers, problem):
    _, queries = problem
    s = samplers[name]
    for m in (0, -1, 2.5):
        with pytest.raises(ValueError, match="num_samples must be an integer >= 1"):
            s.sample(queries, m)
        with pytest.raises(ValueError, match="num_samples must be an integer >= 1"):
            s.sample_shared(queries, m)
    with pytest.raises(ValueError, match="queries has 8 dims but 16 were expected"):
        s.sample(torch.randn(3, 8), 4)
    with pytest.raises(ValueError, match="queries contains NaN or Inf"):
        s.sample(torch.full((2, D), math.nan), 4)
    with pytest.raises(ValueError, match=r"ids contains 300, outside \[0, 300\)"):
        s.log_prob(queries[:2], torch.full((2, 3), V))
    with pytest.raises(ValueError, match=r"ids must have shape \(T, ...\) with T=2"):
        s.log_prob(queries[:2], torch.zeros(5, 3, dtype=torch.long))
    with pytest.raises(ValueError, match="refresh got 10 classes but the sampler was built for 300"):
        s.refresh(torch.randn(10, D))


# ------------------------------------------------------------------------------------------ degenerate inputs
def _degenerate_cases():
    g = torch.Generator().manual_seed(0)
    dup = torch.randn(20, 6, generator=g).repeat(3, 1)  # every row three times
    return {
        "all-rows-equal": (torch.ones(50, 6), 4),
        "all-rows-zero": (torch.zeros(50, 6), 4),
        "single-class": (torch.randn(1, 6, generator=g), 1),
        "duplicate-rows": (dup, 8),
    }


@pytest.mark.parametrize("case", sorted(_degenerate_cases()))
@pytest.mark.parametrize("name", ALL)
def test_degenerate_embeddings_still_build_and_sample(name, case):
    emb, k = _degenerate_cases()[case]
    v = emb.shape[0]
    s = build_sampler(name, emb, codebook_size=k, class_counts=torch.ones(v))
    queries = torch.randn(3, emb.shape[1], generator=torch.Generator().manual_seed(1))
    ids, log_q = s.sample(queries, 64)
    assert ids.shape == (3, 64) and int(ids.min()) >= 0 and int(ids.max()) < v
    assert bool(torch.isfinite(log_q).all())
    total = s.full_log_prob(queries).double().exp().sum(1)
    torch.testing.assert_close(total, torch.ones_like(total), atol=1e-4, rtol=0)
    pool, log_qbar = s.sample_shared(queries, 64)
    assert bool(torch.isfinite(log_qbar).all()) and int(pool.max()) < v
    s.refresh(emb)  # a rebuild on degenerate data works too


@pytest.mark.parametrize("name", ALL)
def test_refresh_follows_new_embeddings_for_every_sampler(name, problem):
    """After refresh(new): static and kernel/hashing samplers equal a fresh build on the new embeddings
    (same seed, so the same random projections); MIDX samplers re-quantize them (codes are the nearest
    codewords of the new embeddings) and stay normalized."""
    emb, queries = problem
    new = emb.flip(0).contiguous() * 1.5
    s = _build(name, emb)
    s.refresh(new)
    lp = s.full_log_prob(queries)
    total = lp.double().exp().sum(1)
    torch.testing.assert_close(total, torch.ones_like(total), atol=1e-4, rtol=0)
    if name.startswith("midx"):
        assert torch.equal(s.index.codes, quantizers.encode(s.index.quantizer, new, s.index.codebooks))
    else:
        torch.testing.assert_close(lp, _build(name, new).full_log_prob(queries))


def test_refresh_follows_new_embeddings(problem):
    """After refresh, midx-exact samples the softmax of the new embeddings (log_prob changes accordingly)."""
    emb, queries = problem
    s = build_sampler("midx-exact", emb, codebook_size=K)
    new = emb.flip(0).contiguous()
    s.refresh(new)
    expected = torch.log_softmax(queries @ new.t(), dim=1)
    torch.testing.assert_close(s.full_log_prob(queries), expected, atol=1e-5, rtol=0)
    ids, log_q = s.sample(queries, 200)
    torch.testing.assert_close(log_q, expected.gather(1, ids), atol=1e-4, rtol=0)


def test_midx_ignores_a_codeword_without_classes(make_clustered):
    """A codeword that holds no class (e.g. a learned one that drifted away) may score far above the
    others; it must neither overflow the proposal (NaN) nor be drawn."""
    emb, queries = make_clustered(200, 8, clusters=4, num_queries=8, seed=3)
    s = build_sampler("midx-rq", emb, codebook_size=4)
    c1, c2 = s.index.codebooks
    far = torch.zeros(1, 8)
    far[0, 0] = 1e4  # no residual is near it, so no class is assigned to it
    s.set_codebooks((c1, torch.cat([c2[:3], far])), emb)
    assert int(s.index.bucket_counts[:, 3].sum()) == 0
    z = queries.clone()
    z[:, 0] = 1.0  # z . far = 1e4: exp would overflow float64 without the mask
    ids, log_q = s.sample(z, 64)
    assert bool(torch.isfinite(log_q).all()) and int((s.index.codes[ids, 1] == 3).sum()) == 0
    lp = s.full_log_prob(z).double()
    torch.testing.assert_close(lp.exp().sum(1), torch.ones(z.shape[0], dtype=torch.float64), atol=1e-4, rtol=0)


@pytest.mark.parametrize(
    "name, options",
    [
        ("midx-rq", {}),
        ("midx-rq", {"mix_weight": 0.5}),
        ("midx-rq", {"last_stage": "frequency", "mix_weight": 0.3}),
        ("midx-pq", {"mix_weight": 0.5}),
        ("midx-exact", {}),
        ("unigram", {}),
        ("lsh", {}),
        ("sphere", {}),
        ("rff", {}),
    ],
)
def test_draw_scored_equals_draw_then_score(name, options, problem):
    """One proposal for the draws and the labels gives what two calls give: the same draws from the
    same generator state, and the labels' log q (-inf inside the exact head)."""
    emb = problem[0]
    head = torch.arange(0, emb.shape[0], 7)
    smp = _build(name, emb, exclude=head, **options)
    g = torch.Generator().manual_seed(5)
    q = torch.randn(13, emb.shape[1], generator=g)
    labels = torch.randint(emb.shape[0], (13, 1), generator=g)
    labels += labels % 7 == 0  # outside the head (every 7th class)...
    labels[0, 0] = head[1]  # ...but for one  # a label the proposal cannot draw
    start = smp.generator.get_state()
    ids, log_q, log_q_labels = smp.draw_scored(q, 9, labels)
    after = smp.generator.get_state()
    smp.generator.set_state(start)
    ids2, log_q2 = smp.draw(q, 9)
    assert torch.equal(ids, ids2) and torch.equal(smp.generator.get_state(), after)
    torch.testing.assert_close(log_q, log_q2)
    torch.testing.assert_close(log_q_labels, smp.score(q, labels))
    assert log_q_labels[0, 0] == -math.inf and torch.isfinite(log_q_labels[1:]).all()

    weights = (torch.arange(13) % 4 != 0).float()
    smp.generator.set_state(start)
    pool, log_qbar, log_qbar_labels = smp.draw_shared_scored(q, 17, labels[:, 0], row_weights=weights)
    smp.generator.set_state(start)
    pool2, log_qbar2 = smp.draw_shared(q, 17, row_weights=weights)
    assert torch.equal(pool, pool2)
    torch.testing.assert_close(log_qbar, log_qbar2)
    torch.testing.assert_close(log_qbar_labels, smp.score_shared(q, labels[:, 0], row_weights=weights))
    assert log_qbar_labels[0] == -math.inf


@pytest.mark.parametrize("options", [{}, {"last_stage": "frequency"}])
def test_nan_queries_still_draw_classes_in_range(options, problem):
    """NaN hidden states (a diverged step) must not crash the draw with an index error: the callback then says
    where the NaN came from. Every bucket search lands in range, an empty trailing bucket included."""
    emb = problem[0]
    smp = _build("midx-rq", emb, mix_weight=0.5, **options)
    q = torch.full((5, emb.shape[1]), float("nan"))
    ids, _ = smp.draw(q, 7)
    assert int(ids.min()) >= 0 and int(ids.max()) < emb.shape[0]
