"""hf_midx.integration.diagnostics: the coverage of the softmax by a proposal (KL both ways, ESS, missed mass)."""

from __future__ import annotations

import math

import pytest
import torch

import hf_midx.samplers
from hf_midx import build_sampler
from hf_midx.integration.diagnostics import DIAGNOSTIC_KEYS, kl_to_softmax, proposal_diagnostics

V, D, K = 300, 16, 8


@pytest.fixture(scope="module")
def problem(make_clustered):
    # center_scale 1: a peaked softmax, so a static proposal covers it badly.
    return make_clustered(V, D, num_queries=6, center_scale=1.0, spread=0.15, seed=2)


def _reference(log_q: torch.Tensor, log_p: torch.Tensor) -> dict[str, float]:
    """The diagnostics from (S, V) float64 tables, written out plainly."""
    p, q = log_p.exp(), log_q.exp()
    return {
        "kl_qp": float((q * (log_q - log_p)).sum(1).mean()),
        "kl_pq": float((p * (log_p - log_q)).sum(1).mean()),
        "ess": float((1.0 / (p * p / q).sum(1)).mean()),
        "mass_p_over_q_gt_10": float((p * (p / q > 10)).sum(1).mean()),
    }


@pytest.mark.parametrize("name", ["uniform", "midx-rq", "lsh"])
def test_diagnostics_equal_their_definitions(name, problem):
    emb, queries = problem
    s = build_sampler(name, emb, codebook_size=K)
    out = proposal_diagnostics(s, queries, emb, num_samples=20)
    assert set(out) == set(DIAGNOSTIC_KEYS) and all(v.dim() == 0 and v.dtype == torch.float32 for v in out.values())
    ref = _reference(s.full_log_prob(queries).double(), torch.log_softmax(queries.double() @ emb.double().t(), 1))
    for key, value in ref.items():
        assert math.isclose(float(out[key]), value, rel_tol=1e-3, abs_tol=1e-5), (key, float(out[key]), value)
    assert float(out["head_mass"]) == 0.0
    assert 0.0 < float(out["ess_sampled"]) <= 1.0
    torch.testing.assert_close(out["kl_qp"], kl_to_softmax(s, queries, emb), atol=1e-5, rtol=1e-4)
    assert not hasattr(hf_midx.samplers, "kl_to_softmax")  # the diagnostics live in hf_midx.integration.diagnostics only


def test_the_softmax_itself_is_a_perfect_proposal(problem):
    emb, queries = problem
    s = build_sampler("midx-exact", emb, codebook_size=K)
    out = proposal_diagnostics(s, queries, emb, num_samples=50)
    assert abs(float(out["kl_qp"])) < 1e-4 and abs(float(out["kl_pq"])) < 1e-4
    # p/q = 1 for every draw: the sampled ESS is exactly M, the analytic one exactly 1.
    assert abs(float(out["ess"]) - 1.0) < 1e-4 and abs(float(out["ess_sampled"]) - 1.0) < 1e-4
    assert float(out["mass_p_over_q_gt_10"]) == 0.0


def test_a_static_proposal_misses_a_peaked_softmax(problem):
    emb, queries = problem
    uniform = proposal_diagnostics(build_sampler("uniform", emb), queries, emb, num_samples=20)
    exact = proposal_diagnostics(build_sampler("midx-exact", emb, codebook_size=K), queries, emb, num_samples=20)
    assert float(uniform["ess"]) < 0.5 * float(exact["ess"])
    assert float(uniform["kl_pq"]) > 0.5 and float(uniform["mass_p_over_q_gt_10"]) > 0.1


def test_exact_head_conditions_p_on_the_tail(problem):
    emb, queries = problem
    head = torch.arange(0, V, 7)
    s = build_sampler("uniform", emb, exclude=head)
    out = proposal_diagnostics(s, queries, emb, num_samples=20)  # the sampler's exclusion is the default
    log_p = torch.log_softmax(queries.double() @ emb.double().t(), 1)
    head_mass = log_p[:, head].exp().sum(1)
    assert math.isclose(float(out["head_mass"]), float(head_mass.mean()), rel_tol=1e-4)
    tail = torch.ones(V, dtype=torch.bool)
    tail[head] = False
    log_tail = log_p[:, tail] - torch.logsumexp(log_p[:, tail], 1, keepdim=True)
    ref = _reference(s.full_log_prob(queries).double()[:, tail], log_tail)
    for key, value in ref.items():
        assert math.isclose(float(out[key]), value, rel_tol=1e-3, abs_tol=1e-5), key
    explicit = proposal_diagnostics(s, queries, emb, num_samples=20, exact_ids=head)
    assert all(torch.equal(explicit[k], out[k]) for k in out)


def test_diagnostics_leave_the_sampler_generator_alone(problem):
    emb, queries = problem
    s = build_sampler("midx-rq", emb, codebook_size=K)
    before = s.generator.get_state()
    proposal_diagnostics(s, queries, emb, num_samples=20)
    assert torch.equal(before, s.generator.get_state())


def test_diagnostics_check_their_arguments(problem):
    emb, queries = problem
    s = build_sampler("uniform", emb)
    with pytest.raises(ValueError, match="at least one query"):
        proposal_diagnostics(s, queries[:0], emb, num_samples=4)
    with pytest.raises(ValueError, match="num_samples must be an integer >= 1"):
        proposal_diagnostics(s, queries, emb, num_samples=0)
    with pytest.raises(ValueError, match="weight has 10 rows"):
        proposal_diagnostics(s, queries, emb[:10], num_samples=4)
    with pytest.raises(ValueError, match=r"exact_ids contains 300"):
        proposal_diagnostics(s, queries, emb, num_samples=4, exact_ids=torch.tensor([300]))
    with pytest.raises(ValueError, match="logit_softcap must be a positive number or None, got 0"):
        proposal_diagnostics(s, queries, emb, num_samples=4, logit_softcap=0)
