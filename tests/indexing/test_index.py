"""The inverted multi-index and its quantizers: CSR layout, codes, warm-started rebuilds, learned
codebooks, quantization quality (rq vs pq, torch vs faiss k-means), state and validation."""

from __future__ import annotations

import math

import pytest
import torch

from hf_midx import MidxIndex
from hf_midx.indexing import quantizers


@pytest.fixture(scope="module")
def data(make_clustered):
    return make_clustered(600, 16, num_queries=8, seed=5)


def _brute_force_codes(index: MidxIndex, emb: torch.Tensor) -> torch.Tensor:
    """Nearest codewords by explicit pairwise distances (no quantizers.assign)."""
    d = emb.shape[1]
    s1, s2 = index.dim_slices(d)
    c1, c2 = (c.double() for c in index.codebooks)
    x = emb.double()
    k1 = torch.cdist(x[:, s1], c1).argmin(1)
    second = x[:, s2] - c1[k1] if index.quantizer == "rq" else x[:, s2]
    k2 = torch.cdist(second, c2).argmin(1)
    return torch.stack([k1, k2], 1)


def _assert_csr_consistent(index: MidxIndex) -> None:
    k, v = index.codebook_size, index.num_classes
    bucket = index.codes[:, 0] * k + index.codes[:, 1]
    assert index.codes.shape == (v, 2) and int(index.codes.min()) >= 0 and int(index.codes.max()) < k
    torch.testing.assert_close(index.bucket_counts.flatten(), torch.bincount(bucket, minlength=k * k))
    assert int(index.bucket_counts.sum()) == v
    assert index.offsets.shape == (k * k + 1,) and int(index.offsets[0]) == 0 and int(index.offsets[-1]) == v
    torch.testing.assert_close(index.offsets[1:] - index.offsets[:-1], index.bucket_counts.flatten())
    assert torch.equal(torch.sort(index.order).values, torch.arange(v))  # a permutation of the classes
    for b in range(k * k):
        members = index.order[index.offsets[b] : index.offsets[b + 1]]
        assert bool((bucket[members] == b).all())
        assert bool((members[1:] > members[:-1]).all())  # stable: id order inside a bucket
    # draw_members reads the same slices: every draw lands in its bucket, uniformly or by weight.
    nonempty = (index.bucket_counts.flatten() > 0).nonzero()  # (B, 1)
    u = torch.linspace(0, 1, 65, dtype=torch.float64)[:-1].expand(nonempty.shape[0], -1)
    buckets = nonempty.expand(-1, 64)
    assert bool((bucket[index.draw_members(buckets, u)] == buckets).all())
    cum = torch.cat([torch.zeros(1, dtype=torch.float64), torch.rand(v, dtype=torch.float64).cumsum(0)])
    assert bool((bucket[index.draw_members(buckets, u, cum)] == buckets).all())
    per_row = cum.expand(buckets.shape[0], -1).contiguous()
    assert bool((bucket[index.draw_members(buckets, u, per_row)] == buckets).all())


@pytest.mark.parametrize("quantizer", ["rq", "pq"])
def test_build_gives_consistent_csr_and_nearest_codes(quantizer, data):
    emb, _ = data
    index = MidxIndex.build(emb, 8, quantizer=quantizer)
    _assert_csr_consistent(index)
    assert torch.equal(index.codes, _brute_force_codes(index, emb))
    widths = (16, 16) if quantizer == "rq" else (8, 8)
    assert tuple(c.shape for c in index.codebooks) == ((8, widths[0]), (8, widths[1]))
    torch.testing.assert_close(index.reconstruct(), quantizers.decode(quantizer, index.codes, index.codebooks))
    torch.testing.assert_close(index.reconstruct(torch.tensor([3, 1])), index.reconstruct()[[3, 1]])
    want = float(((emb - index.reconstruct()) ** 2).sum(1).mean())
    assert index.distortion(emb) == pytest.approx(want, rel=1e-6)
    assert "nonempty_buckets=" in repr(index)


def test_odd_dimension_product_split(make_clustered):
    emb, _ = make_clustered(100, 7, num_queries=1, seed=0)
    index = MidxIndex.build(emb, 4, quantizer="pq")
    assert tuple(c.shape for c in index.codebooks) == ((4, 3), (4, 4))
    _assert_csr_consistent(index)


def test_rq_distorts_less_than_pq_on_clustered_data(data):
    """Residual quantization reconstructs in full D twice; on clustered data it beats PQ's halves."""
    emb, _ = data
    d_rq = MidxIndex.build(emb, 8, quantizer="rq").distortion(emb)
    d_pq = MidxIndex.build(emb, 8, quantizer="pq").distortion(emb)
    norm = float((emb**2).sum(1).mean())
    print(f"[index] distortion V=600 D=16 K=8: rq={d_rq:.4f} pq={d_pq:.4f} (mean ||q||^2={norm:.2f})")
    assert d_rq <= d_pq


def test_rebuild_is_warm_started_from_the_current_codebooks(data):
    emb, _ = data
    index = MidxIndex.build(emb, 8, quantizer="rq", seed=0)
    before = tuple(c.clone() for c in index.codebooks)
    moved = emb + 0.01 * torch.randn(emb.shape, generator=torch.Generator().manual_seed(1))
    # With zero Lloyd iterations a warm start returns the previous codebooks unchanged.
    index.kmeans_iters = 0
    index.rebuild(moved)
    torch.testing.assert_close(index.codebooks[0], before[0], atol=0, rtol=0)
    torch.testing.assert_close(index.codebooks[1], before[1], atol=0, rtol=0)
    assert torch.equal(index.codes, _brute_force_codes(index, moved))
    # With iterations, Lloyd steps from the warm start cannot increase codebook 1's distortion,
    # and the whole rebuild stays consistent.
    d1_before = float(quantizers.assign(moved, index.codebooks[0])[1].mean())
    index.kmeans_iters = 20
    index.rebuild(moved)
    d1_after = float(quantizers.assign(moved, index.codebooks[0])[1].mean())
    assert d1_after <= d1_before + 1e-6
    _assert_csr_consistent(index)
    assert torch.equal(index.codes, _brute_force_codes(index, moved))


def test_build_with_init_of_another_size_starts_afresh(data):
    emb, _ = data
    old = MidxIndex.build(emb, 8).codebooks
    index = MidxIndex.build(emb[:100], 4, init=old)  # other K: the init is ignored, no error
    assert index.codebook_size == 4 and index.num_classes == 100
    _assert_csr_consistent(index)


@pytest.mark.parametrize("quantizer", ["rq", "pq"])
def test_set_codebooks_recomputes_codes(quantizer, data):
    emb, _ = data
    index = MidxIndex.build(emb, 8, quantizer=quantizer)
    c1, c2 = index.codebooks
    perm1, perm2 = torch.randperm(8, generator=torch.Generator().manual_seed(0)), torch.arange(7, -1, -1)
    old_codes = index.codes.clone()
    index.set_codebooks((c1[perm1], c2[perm2]), emb)
    # Permuting the codewords permutes the codes: inverse permutation applied to the old codes.
    inv1, inv2 = torch.argsort(perm1), torch.argsort(perm2)
    assert torch.equal(index.codes[:, 0], inv1[old_codes[:, 0]])
    assert torch.equal(index.codes[:, 1], inv2[old_codes[:, 1]])
    _assert_csr_consistent(index)
    # Arbitrary new codebooks (here: perturbed) give the nearest-codeword codes for them.
    g = torch.Generator().manual_seed(2)
    new = (c1 + 0.3 * torch.randn(c1.shape, generator=g), c2 + 0.3 * torch.randn(c2.shape, generator=g))
    index.set_codebooks(new, emb)
    torch.testing.assert_close(index.codebooks[0], new[0])
    assert torch.equal(index.codes, _brute_force_codes(index, emb))
    _assert_csr_consistent(index)


def test_set_codebooks_of_the_wrong_width_is_refused(data):
    emb, _ = data
    index = MidxIndex.build(emb, 8, quantizer="pq")
    with pytest.raises(ValueError, match="codebooks"):
        index.set_codebooks((torch.randn(8, 16), torch.randn(8, 16)), emb)
    with pytest.raises(ValueError, match="same number of codewords"):
        index.set_codebooks((torch.randn(8, 8), torch.randn(4, 8)), emb)


def test_kmeans_torch_and_faiss_agree_in_quality(data):
    """Randomized clusterers are compared by quality, not equality: distortions within 10%.

    On unstructured Gaussian data all Lloyd optima have nearly the same distortion, so one run per
    backend is compared. On clustered data a single run depends on which clusters its random start
    merges (+-30% between seeds for either backend), so there the mean over 5 seeds is compared.
    """
    pytest.importorskip("faiss")
    gauss = torch.randn(2000, 16, generator=torch.Generator().manual_seed(0))
    results = {}
    for backend in ("torch", "faiss"):
        centroids, codes = quantizers.kmeans(gauss, 64, iters=20, seed=0, backend=backend)
        assert centroids.shape == (64, 16) and codes.shape == (2000,)
        assert torch.equal(codes, quantizers.assign(gauss, centroids)[0])  # codes are the nearest centroids
        results[f"gauss/{backend}"] = float(((gauss - centroids[codes]) ** 2).sum(1).mean())
        for quantizer in ("rq", "pq"):
            index = MidxIndex.build(gauss, 16, quantizer=quantizer, kmeans_backend=backend)
            results[f"gauss-{quantizer}-index/{backend}"] = index.distortion(gauss)
            _assert_csr_consistent(index)
        emb, _ = data
        runs = [quantizers.kmeans(emb, 16, iters=20, seed=s, backend=backend) for s in range(5)]
        results[f"clustered-mean5/{backend}"] = sum(float(((emb - c[k]) ** 2).sum(1).mean()) for c, k in runs) / 5
    print("[index] k-means distortion, torch vs faiss: " + ", ".join(f"{k}={v:.4f}" for k, v in results.items()))
    for case in ("gauss", "gauss-rq-index", "gauss-pq-index", "clustered-mean5"):
        a, b = results[f"{case}/torch"], results[f"{case}/faiss"]
        assert abs(a - b) <= 0.1 * min(a, b), (case, a, b)


def test_kmeans_reseeds_empty_clusters():
    """Three far-apart groups and K = 3 from a bad start: no centroid stays empty."""
    x = torch.cat([torch.zeros(10, 2), torch.full((10, 2), 10.0), torch.tensor([[0.0, 50.0]]).repeat(10, 1)])
    init = torch.tensor([[0.0, 0.0], [0.1, 0.0], [0.2, 0.0]])
    centroids, codes = quantizers.kmeans_torch(x, 3, iters=10, init=init)
    assert torch.bincount(codes, minlength=3).min() > 0
    assert float(quantizers.assign(x, centroids)[1].max()) < 1e-6


# ------------------------------------------------------------------------------------------ state
def test_state_dict_round_trip(data):
    emb, _ = data
    a = MidxIndex.build(emb, 8, seed=0)
    b = MidxIndex.build(emb, 8, seed=1)
    b.load_state_dict(a.state_dict())
    for x, y in zip(a.codebooks, b.codebooks, strict=True):
        torch.testing.assert_close(x, y, atol=0, rtol=0)
    assert torch.equal(a.codes, b.codes) and torch.equal(a.order, b.order) and torch.equal(a.offsets, b.offsets)


def test_state_dict_of_another_vocabulary_or_codebook_size_is_refused(data):
    emb, _ = data
    state = MidxIndex.build(emb, 8).state_dict()
    with pytest.raises(ValueError, match="another vocabulary or codebook size"):
        MidxIndex.build(emb[:500], 8).load_state_dict(state)
    with pytest.raises(ValueError, match="another vocabulary or codebook size"):
        MidxIndex.build(emb, 4).load_state_dict(state)
    with pytest.raises(ValueError, match="missing 'codes'"):
        MidxIndex.build(emb, 8).load_state_dict({k: v for k, v in state.items() if k != "codes"})


# ------------------------------------------------------------------------------------------ validation
def test_invalid_builds_are_refused():
    emb = torch.randn(10, 4)
    with pytest.raises(ValueError, match="codebook_size=11 is larger than the number of classes 10"):
        MidxIndex.build(emb, 11)
    with pytest.raises(ValueError, match="codebook_size must be an integer >= 1"):
        MidxIndex.build(emb, 0)
    with pytest.raises(ValueError, match="Unknown quantizer 'opq'"):
        MidxIndex.build(emb, 2, quantizer="opq")
    with pytest.raises(ValueError, match="needs D >= 2"):
        MidxIndex.build(torch.randn(10, 1), 2, quantizer="pq")
    with pytest.raises(ValueError, match="Unknown kmeans backend 'sklearn'"):
        MidxIndex.build(emb, 2, kmeans_backend="sklearn")
    bad = emb.clone()
    bad[3, 1] = math.inf
    with pytest.raises(ValueError, match="embeddings contains NaN or Inf"):
        MidxIndex.build(bad, 2)
    with pytest.raises(ValueError, match="must be 2-D"):
        MidxIndex.build(torch.randn(10), 2)


@pytest.mark.parametrize("quantizer", ["rq", "pq"])
@pytest.mark.parametrize(
    "emb, k",
    [(torch.ones(40, 6), 4), (torch.randn(1, 6), 1), (torch.randn(5, 6).repeat(8, 1), 8)],
    ids=["all-rows-equal", "single-class", "duplicate-rows"],
)
def test_degenerate_embeddings_build_a_valid_index(quantizer, emb, k):
    index = MidxIndex.build(emb, k, quantizer=quantizer)
    _assert_csr_consistent(index)
    assert bool(torch.isfinite(index.reconstruct()).all())
    assert index.distortion(emb) < 1e-8 or emb.shape[0] > k  # exact when every distinct row fits a codeword


@pytest.mark.parametrize("quantizer", ["rq", "pq"])
def test_subsampled_kmeans_keeps_quality_and_encodes_every_row(quantizer, make_clustered):
    """With more than K * P rows, Lloyd's iterations run on K * P of them (faiss's rule) and every row
    is then encoded: codes are the nearest codewords, and the distortion stays within 5% of k-means
    on all rows (a quality bound, not equality: both are local optima)."""
    emb, _ = make_clustered(6000, 24, num_queries=1, seed=4)
    k, p = 16, 32  # trains on 512 of the 6,000 rows
    sub = quantizers.train_quantizer(quantizer, emb, k, seed=0, max_points_per_centroid=p)
    full = quantizers.train_quantizer(quantizer, emb, k, seed=0, max_points_per_centroid=None)
    assert torch.equal(sub.codes, quantizers.encode(quantizer, emb, sub.codebooks))
    d_sub, d_full = quantizers.distortion(quantizer, emb, sub), quantizers.distortion(quantizer, emb, full)
    assert d_sub <= 1.05 * d_full, (d_sub, d_full)
    again = quantizers.train_quantizer(quantizer, emb, k, seed=0, max_points_per_centroid=p)
    assert torch.equal(again.codes, sub.codes)  # the subset is fixed by the seed: rebuilds repeat


def test_rq_encode_without_residuals_matches_the_residual_assignment(make_clustered):
    emb, _ = make_clustered(700, 12, num_queries=1, seed=5)
    res = quantizers.train_quantizer("rq", emb, 8, seed=0)
    c1, c2 = res.codebooks
    k1, _ = quantizers.assign(emb, c1)
    k2, _ = quantizers.assign(emb - c1[k1], c2)
    codes = quantizers.encode("rq", emb, res.codebooks)
    assert torch.equal(codes[:, 0], k1)
    # Equal up to float ties: the chosen codeword is as near as the residual's nearest.
    r = emb - c1[k1]
    d_enc = ((r - c2[codes[:, 1]]) ** 2).sum(1)
    d_ref = ((r - c2[k2]) ** 2).sum(1)
    torch.testing.assert_close(d_enc, d_ref, rtol=1e-5, atol=1e-5)
