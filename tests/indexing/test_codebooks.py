"""Learnable codebooks: gradients reach the codewords only, and training them lowers the KL of the MIDX
proposal once the sampler adopts them."""

from __future__ import annotations

import pytest
import torch

from hf_midx import LearnableCodebooks, build_sampler, kl_to_softmax
from hf_midx.indexing import quantizers
from hf_midx.indexing.codebooks import _soft_assign


@pytest.fixture(scope="module")
def data(make_clustered):
    # 64 training queries and 64 held-out ones from the same clusters.
    emb, queries = make_clustered(1000, 16, num_queries=128, seed=0)
    return emb, queries[:64], queries[64:]


@pytest.mark.parametrize("assignment", ["hard", "soft"])
@pytest.mark.parametrize("quantizer", ["rq", "pq"])
def test_gradients_reach_the_codewords_only(quantizer, assignment, data):
    emb, queries, _ = data
    sampler = build_sampler(f"midx-{quantizer}", emb, codebook_size=8)
    module = LearnableCodebooks(sampler.index.codebooks, quantizer, assignment=assignment)
    emb_leaf = emb.clone().requires_grad_(True)
    q_leaf = queries.clone().requires_grad_(True)
    out = module(emb_leaf, q_leaf)
    assert set(out) == {"loss", "recon", "kl"}
    assert not out["recon"].requires_grad and not out["kl"].requires_grad
    torch.testing.assert_close(out["loss"].detach(), out["recon"] + module.kl_weight * out["kl"])
    out["loss"].backward()
    assert emb_leaf.grad is None and q_leaf.grad is None
    for p in (module.codebook1, module.codebook2):
        assert p.grad is not None and bool(torch.isfinite(p.grad).all()) and float(p.grad.abs().sum()) > 0
    assert [n for n, _ in module.named_parameters()] == ["codebook1", "codebook2"]
    # The sampler's own codebooks are copies: training does not touch the index behind its back.
    assert module.codebook1.data_ptr() != sampler.index.codebooks[0].data_ptr()


@pytest.mark.parametrize("quantizer", ["rq", "pq"])
def test_hard_codes_are_the_index_codes(quantizer, data):
    emb, _, _ = data
    sampler = build_sampler(f"midx-{quantizer}", emb, codebook_size=8)
    module = LearnableCodebooks(sampler.index.codebooks, quantizer)
    assert torch.equal(module.hard_codes(emb), sampler.index.codes)


@pytest.mark.parametrize("quantizer", ["rq", "pq"])
def test_soft_weights_peak_on_the_index_code(quantizer, data):
    """The soft weights' argmax is the nearest codeword, i.e. the code the index assigns; and the soft
    reconstruction tends to the hard one as the weight logits sharpen (data and codewords scaled by s
    multiply them by s^2)."""
    emb, _, _ = data
    sampler = build_sampler(f"midx-{quantizer}", emb, codebook_size=8)
    c1, c2 = sampler.index.codebooks
    codes = sampler.index.codes
    s1, s2 = sampler.index.dim_slices(emb.shape[1])
    assert torch.equal(_soft_assign(emb[:, s1], c1).argmax(1), codes[:, 0])
    second = emb[:, s2] - c1[codes[:, 0]] if quantizer == "rq" else emb[:, s2]
    assert torch.equal(_soft_assign(second, c2).argmax(1), codes[:, 1])
    scale = 30.0
    module = LearnableCodebooks((c1 * scale, c2 * scale), quantizer)
    soft = module.soft_reconstruct(emb * scale) / scale
    hard = quantizers.decode(quantizer, codes, (c1, c2))
    # Up to near-ties (classes almost equidistant from two codewords), soft == hard.
    close = ((soft - hard).abs().max(1).values < 1e-3).float().mean()
    assert float(close) > 0.99


@pytest.mark.parametrize("quantizer", ["rq", "pq"])
def test_training_lowers_the_kl_of_the_midx_proposal(quantizer, data):
    """Adam on the codebook objective (200 steps), then ``sampler.set_codebooks``: KL(Q || softmax) drops,
    for the 64 training queries and for 64 held-out ones (exact KL over all V classes).

    kl_weight = 10: the reconstruction term is a squared distance summed over D (2.5-5 here after
    k-means) while the KL is 0.3-0.5 nats, so with weight 1 the reconstruction dominates tenfold and
    the KL term, which is what this test is about, hardly steers; 10 puts the two on one scale.
    """
    emb, queries, held_out = data
    sampler = build_sampler(f"midx-{quantizer}", emb, codebook_size=8)
    kl_before = float(kl_to_softmax(sampler, queries, emb))
    held_before = float(kl_to_softmax(sampler, held_out, emb))
    module = LearnableCodebooks(sampler.index.codebooks, quantizer, kl_weight=10.0)
    optimizer = torch.optim.Adam(module.parameters(), lr=1e-2)
    first = None
    for _ in range(200):
        out = module(emb, queries)
        first = first or {k: float(v.detach()) for k, v in out.items()}
        optimizer.zero_grad()
        out["loss"].backward()
        optimizer.step()
    sampler.set_codebooks(module.codebooks, emb)
    assert torch.equal(sampler.index.codes, module.hard_codes(emb))
    kl_after = float(kl_to_softmax(sampler, queries, emb))
    held_after = float(kl_to_softmax(sampler, held_out, emb))
    print(
        f"[codebooks] midx-{quantizer} V=1000 D=16 K=8: KL(Q || softmax) train {kl_before:.4f} -> {kl_after:.4f}, "
        f"held-out {held_before:.4f} -> {held_after:.4f}; objective recon {first['recon']:.3f} -> "
        f"{float(out['recon']):.3f}, soft KL {first['kl']:.4f} -> {float(out['kl']):.4f}"
    )
    assert float(out["loss"].detach()) < first["loss"]
    assert kl_after < kl_before
    assert held_after < held_before


def test_invalid_codebooks_are_refused():
    with pytest.raises(ValueError, match="Unknown quantizer 'opq'"):
        LearnableCodebooks((torch.randn(4, 8), torch.randn(4, 8)), "opq")
    with pytest.raises(ValueError, match="same number of codewords"):
        LearnableCodebooks((torch.randn(4, 8), torch.randn(5, 8)), "rq")
    with pytest.raises(ValueError, match="Unknown assignment"):
        LearnableCodebooks((torch.randn(4, 8), torch.randn(4, 8)), "rq", assignment="nearest")
    with pytest.raises(ValueError, match="kl_weight must be >= 0"):
        LearnableCodebooks((torch.randn(4, 8), torch.randn(4, 8)), "rq", kl_weight=-1.0)
    with pytest.raises(ValueError, match=r"codebooks\[1\] contains NaN or Inf"):
        LearnableCodebooks((torch.randn(4, 8), torch.full((4, 8), float("nan"))), "rq")
    module = LearnableCodebooks((torch.randn(4, 4), torch.randn(4, 4)), "pq")
    with pytest.raises(ValueError, match="embeddings has 6 dims but 8 were expected"):
        module(torch.randn(10, 6), torch.randn(3, 8))
    with pytest.raises(ValueError, match="queries has 6 dims but 8 were expected"):
        module(torch.randn(10, 8), torch.randn(3, 6))
