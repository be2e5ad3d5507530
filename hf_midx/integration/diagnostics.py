"""How well a proposal Q covers the softmax P it stands in for, measured on a few held queries.

Shapes: S queries, D dims, V classes, M draws per query, H exactly-scored classes (the exact head).

The sampled softmax estimates the partition function sum_i exp(o_i) by importance sampling from Q,
with weights w_i = p_i / q_i. What makes the estimate (and so the gradient) poor is mass of P that Q
misses: a class with p/q large is rarely drawn, and when it is, its weight dominates. Hence:

* ``kl_pq`` = KL(P || Q) and ``mass_p_over_q_gt_10`` (P's mass on classes with p/q > 10) measure the
  missed mass directly;
* ``ess`` = 1 / E_Q[(p/q)^2] = 1 / (1 + chi^2(P || Q)), the effective sample size of the importance
  weights as a fraction of the draws, computed analytically over all classes (the large-M limit of
  (sum w)^2 / (M sum w^2); deterministic, so it can be logged every step); ``ess_sampled`` is the same
  ratio measured on M actual draws (noisy, and for small M biased upwards, since a draw that would
  carry a large weight is rarely seen);
* ``kl_qp`` = KL(Q || P), the quantity the paper's learned codebooks minimize. It is the wrong
  yardstick for training quality: a proposal that concentrates on the softmax's mode has a small
  KL(Q || P) and still misses the tail (measured in issue 9: midx-rq 0.4 nats vs unigram 0.97, and
  unigram trained better).

With an exact head (``exact_ids``, or the classes the sampler excludes), P is the softmax restricted
to the other classes and renormalized (the share the estimator has to estimate), and ``head_mass`` is
the softmax's mass on the exact head.

Everything here is O(S V); pass a few queries (the trainer passes ``kl_queries`` hidden states).
"""

from __future__ import annotations

import math

import torch

from .._checks import check_ids, check_matrix, check_positive_int, is_number
from .._ops import row_chunks, soft_cap
from ..rng import CounterRNG

#: Keys of :func:`proposal_diagnostics`, in logging order.
DIAGNOSTIC_KEYS = ("kl_qp", "kl_pq", "ess", "ess_sampled", "mass_p_over_q_gt_10", "head_mass")

# Seed of the draws behind ess_sampled: a generator of their own, so logging never moves the sampler's.
_DIAGNOSTIC_SEED = 20_231


def _log_softmax(
    q: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None, softcap: float | None = None
) -> torch.Tensor:
    logits = q @ w.t()
    if bias is not None:
        logits = logits + bias
    return torch.log_softmax(soft_cap(logits, softcap), dim=1)


def kl_to_softmax(
    sampler, queries: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """Mean over queries of KL(Q(. | z) || softmax(z W^T + b)); O(S V) for S queries, so pass a few.

    Args:
        sampler: a :class:`hf_midx.Sampler`; queries: (S, D); weight: (V, D); bias: optional (V,).
    Returns:
        scalar float32 tensor (nats).
    """
    q = sampler.checked_queries(queries)
    check_matrix("weight", weight, dim=sampler.dim)
    total = torch.zeros((), device=q.device)
    w = weight.detach().float().to(q.device)
    b = None if bias is None else bias.detach().float().to(q.device)
    for rows in row_chunks(q.shape[0], sampler.num_classes):
        log_p = _log_softmax(q[rows], w, b)
        log_q = sampler.full_log_prob(q[rows])
        # Classes with Q = 0 (e.g. LSH without its uniform mix) add 0 log 0 = 0, not 0 * -inf = NaN.
        terms = torch.where(log_q > -math.inf, log_q.exp() * (log_q - log_p), torch.zeros_like(log_q))
        total = total + terms.sum()
    return total / max(q.shape[0], 1)


@torch.no_grad()
def proposal_diagnostics(
    sampler,
    queries: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    *,
    num_samples: int,
    exact_ids: torch.Tensor | None = None,
    logit_softcap: float | None = None,
) -> dict[str, torch.Tensor]:
    """Coverage of the softmax by the proposal, averaged over S held queries (see the module docstring).

    Args:
        sampler: the proposal, a :class:`hf_midx.Sampler` (not imported for the hint: this module stays below
            the samplers package, which the head that calls it must not import).
        queries: (S, D) hidden states (any float dtype), S >= 1 and small (O(S V) work).
        weight: (V, D) head weight; bias: optional (V,).
        num_samples: M, the draws per token in training (for ``ess_sampled``).
        exact_ids: optional (H,) class ids the loss scores exactly; defaults to the sampler's
            excluded classes. P is then the softmax over the other classes.
        logit_softcap: the model's final logit soft-cap (Gemma-2), if any: P is the softmax of
            ``cap * tanh(logits / cap)``. A logit scale is the caller's: pass the queries and bias scaled.
    Returns:
        dict of 0-dim float32 tensors on the sampler's device, keys :data:`DIAGNOSTIC_KEYS`:
        ``kl_qp``, ``kl_pq`` (nats), ``ess``, ``ess_sampled`` (fractions of M in (0, 1]),
        ``mass_p_over_q_gt_10`` and ``head_mass`` (probabilities). Draws use a generator of their own.
    """
    q = sampler.checked_queries(queries)
    if q.shape[0] == 0:
        raise ValueError("proposal_diagnostics needs at least one query.")
    check_matrix("weight", weight, dim=sampler.dim)
    if weight.shape[0] != sampler.num_classes:
        raise ValueError(f"weight has {weight.shape[0]} rows but the sampler covers V={sampler.num_classes} classes.")
    check_positive_int("num_samples", num_samples)
    if logit_softcap is not None and not (is_number(logit_softcap) and logit_softcap > 0):
        raise ValueError(f"logit_softcap must be a positive number or None, got {logit_softcap!r}.")
    if exact_ids is None:
        exact_ids = sampler.excluded
    elif not isinstance(exact_ids, torch.Tensor) or exact_ids.dim() != 1:
        raise ValueError("exact_ids must be a 1-D tensor of class ids.")
    else:
        check_ids("exact_ids", exact_ids, sampler.num_classes)
    device = q.device
    w = weight.detach().float().to(device)
    b = None if bias is None else bias.detach().float().to(device)
    head = None
    if exact_ids is not None and exact_ids.numel():
        head = torch.zeros(sampler.num_classes, dtype=torch.bool, device=device)
        head[exact_ids.to(device)] = True
    gen = CounterRNG(_DIAGNOSTIC_SEED, device=sampler.device)
    sums = dict.fromkeys(DIAGNOSTIC_KEYS, torch.zeros((), dtype=torch.float64, device=device))
    for rows in row_chunks(q.shape[0], 2 * sampler.num_classes):
        zq = q[rows]
        log_p = _log_softmax(zq, w, b, logit_softcap)
        head_mass = torch.zeros(zq.shape[0], device=device)
        if head is not None:
            log_tail = torch.logsumexp(log_p.masked_fill(head, -math.inf), dim=1, keepdim=True)
            head_mass = -torch.expm1(log_tail.squeeze(1))
            log_p = (log_p - log_tail).masked_fill(head, -math.inf)
        log_q = sampler.full_log_prob(zq)
        p, qq = log_p.exp(), log_q.exp()
        # 0 log 0 = 0 on both sides; p > 0 where q = 0 makes KL(P||Q) infinite, as it should.
        kl_qp = torch.where(qq > 0, qq * (log_q - log_p), torch.zeros_like(qq)).sum(1)
        kl_pq = torch.where(p > 0, p * (log_p - log_q), torch.zeros_like(p)).sum(1)
        log_ratio = log_p - log_q
        chi = torch.where(p > 0, torch.exp(log_p + log_ratio), torch.zeros_like(p)).sum(1)  # E_Q[(p/q)^2]
        missed = torch.where(log_ratio > math.log(10.0), p, torch.zeros_like(p)).sum(1)
        ids, log_q_drawn = sampler.draw(zq, num_samples, generator=gen)
        wt = torch.exp(log_p.gather(1, ids) - log_q_drawn).double()
        ess_sampled = wt.sum(1) ** 2 / (num_samples * (wt * wt).sum(1)).clamp_min(1e-300)
        for key, value in (
            ("kl_qp", kl_qp),
            ("kl_pq", kl_pq),
            ("ess", 1.0 / chi),
            ("ess_sampled", ess_sampled),
            ("mass_p_over_q_gt_10", missed),
            ("head_mass", head_mass),
        ):
            sums[key] = sums[key] + value.double().sum()
    return {key: (value / q.shape[0]).float() for key, value in sums.items()}
