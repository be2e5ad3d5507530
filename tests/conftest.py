"""Shared fixtures and statistical helpers for the hf-midx test suite.

Everything runs on CPU, seeded, and offline. The statistical helpers derive every threshold from the
sample size and a false-alarm level ``alpha``; no threshold is tuned to the data a test happens to draw.
"""

from __future__ import annotations

import math
import os

# Tests never reach the network: the Hugging Face hub is told so before anything imports it.
os.environ["HF_HUB_OFFLINE"] = "1"

import pytest  # noqa: E402
import torch  # noqa: E402

# The suite's tensors are small: one intra-op thread avoids oversubscribing small (shared) CI runners,
# which made the tests several times slower than with one thread.
torch.set_num_threads(1)

# The tests stand in one folder per layer (indexing/, samplers/, losses/, integration/), and a few import helpers
# from a test module of another folder (test_fused_head from test_kernels): every folder is on sys.path, as the one
# flat folder was, so each test module is imported once, under its own name.
import sys  # noqa: E402

_TESTS = os.path.dirname(os.path.abspath(__file__))
sys.path[1:1] = [os.path.join(_TESTS, d) for d in sorted(os.listdir(_TESTS))
                 if d.isidentifier() and not d.startswith("_") and os.path.isdir(os.path.join(_TESTS, d))]

#: False-alarm level of every single statistical check in the suite.
ALPHA = 1e-4


@pytest.fixture(autouse=True)
def _same_environment():
    """Each test starts from the environment the session started with. transformers 4.x's TrainingArguments
    writes its precision into os.environ (ACCELERATE_MIXED_PRECISION, read by every later Accelerator and child
    process): a bf16 SFTConfig (TRL's default) made the tests after it train and evaluate under bf16 autocast and
    DeepSpeed's children refuse their config."""
    saved = dict(os.environ)
    yield
    if os.environ != saved:
        os.environ.clear()
        os.environ.update(saved)


# ---------------------------------------------------------------------------------------- data
def clustered(
    num_classes: int = 1000,
    dim: int = 16,
    *,
    clusters: int = 20,
    num_queries: int = 64,
    center_scale: float = 1.0,
    spread: float = 0.15,
    seed: int = 0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Mixture-of-Gaussians class embeddings (V, D) and queries (T, D) near the same cluster centers.

    Centers ~ N(0, center_scale^2 I); each class and each query is a center plus N(0, spread^2 I).
    With the defaults the logits z . q have a spread of a few nats, so the softmax is neither flat
    nor a point mass.
    """
    g = torch.Generator().manual_seed(seed)
    centers = torch.randn(clusters, dim, generator=g) * center_scale
    emb = centers[torch.randint(clusters, (num_classes,), generator=g)]
    emb = emb + spread * torch.randn(num_classes, dim, generator=g)
    queries = centers[torch.randint(clusters, (num_queries,), generator=g)]
    queries = queries + spread * torch.randn(num_queries, dim, generator=g)
    return emb, queries


@pytest.fixture(scope="session")
def make_clustered():
    """The :func:`clustered` factory, for tests that need their own sizes."""
    return clustered


# ---------------------------------------------------------------------------------------- statistics
def chi2_quantile(df: int, alpha: float = ALPHA) -> float:
    """Upper ``alpha`` quantile of the chi-square distribution with ``df`` degrees of freedom.

    Wilson-Hilferty: (X / df)^(1/3) is close to normal with mean 1 - 2/(9 df) and variance 2/(9 df),
    so x_alpha = df (1 - 2/(9 df) + z_alpha sqrt(2/(9 df)))^3 with z_alpha the standard normal upper
    quantile (torch.special.ndtri). At alpha = 1e-4 it errs on the safe side for few cells (+3.5% at
    df = 3, +7% at df = 1) and is within 0.2% of the exact quantile for df >= 50.
    """
    z = float(torch.special.ndtri(torch.tensor(1.0 - alpha, dtype=torch.float64)))
    c = 2.0 / (9.0 * df)
    return df * (1.0 - c + z * math.sqrt(c)) ** 3


def goodness_of_fit(counts: torch.Tensor, probs: torch.Tensor, alpha: float = ALPHA) -> dict[str, float]:
    """Compare observed category ``counts`` (n draws) with the claimed probabilities ``probs``.

    Returns the Pearson chi-square statistic with its alpha-level critical value, and the total
    variation distance with its alpha-level bound:

    * chi-square: categories whose expected count n p is below 5 are pooled into one cell (the usual
      validity condition of the chi-square approximation); df = cells - 1; critical value from
      :func:`chi2_quantile`.
    * total variation TV = 1/2 sum |c_i / n - p_i|. By Jensen, E|c_i/n - p_i| <= sqrt(p_i (1 - p_i) / n),
      so E[TV] <= 1/2 sum_i sqrt(p_i (1 - p_i) / n). TV changes by at most 1/n when one draw changes,
      so McDiarmid's inequality gives P(TV >= E[TV] + t) <= exp(-2 n t^2); t = sqrt(ln(1/alpha) / (2n)).
      Hence ``tv_max = 1/2 sum sqrt(p (1 - p) / n) + sqrt(ln(1/alpha) / (2 n))``, with no fudge factor.
    * ``zero_prob_hits``: draws of categories with p = 0 (must be 0).
    """
    counts = counts.double().flatten()
    p = probs.double().flatten()
    p = p / p.sum()
    n = float(counts.sum())
    zero_hits = float(counts[p == 0].sum())
    expected = n * p
    small = expected < 5.0
    obs_cells = [counts[~small]]
    exp_cells = [expected[~small]]
    if small.any():
        obs_cells.append(counts[small].sum().reshape(1))
        exp_cells.append(expected[small].sum().reshape(1))
    obs, exp = torch.cat(obs_cells), torch.cat(exp_cells)
    keep = exp > 0
    obs, exp = obs[keep], exp[keep]
    chi2 = float(((obs - exp) ** 2 / exp).sum())
    df = max(int(obs.numel()) - 1, 1)
    tv = 0.5 * float((counts / n - p).abs().sum())
    tv_max = 0.5 * float((p * (1 - p) / n).sqrt().sum()) + math.sqrt(math.log(1.0 / alpha) / (2.0 * n))
    return {
        "n": n,
        "chi2": chi2,
        "df": df,
        "chi2_max": chi2_quantile(df, alpha),
        "tv": tv,
        "tv_max": tv_max,
        "zero_prob_hits": zero_hits,
    }


def assert_fits(counts: torch.Tensor, probs: torch.Tensor, label: str) -> dict[str, float]:
    """:func:`goodness_of_fit` plus the assertions and one printed line (``pytest -s`` shows it)."""
    r = goodness_of_fit(counts, probs)
    print(
        f"[gof] {label}: n={int(r['n'])} TV={r['tv']:.4f} (bound {r['tv_max']:.4f}) "
        f"chi2={r['chi2']:.1f} (df={r['df']}, critical {r['chi2_max']:.1f} at alpha={ALPHA:g})"
    )
    assert r["zero_prob_hits"] == 0, f"{label}: drew a class whose claimed probability is 0"
    assert r["tv"] <= r["tv_max"], f"{label}: TV {r['tv']:.4f} > {r['tv_max']:.4f}"
    assert r["chi2"] <= r["chi2_max"], f"{label}: chi2 {r['chi2']:.1f} > {r['chi2_max']:.1f} (df={r['df']})"
    return r


@pytest.fixture(scope="session")
def fits():
    """:func:`assert_fits` as a fixture."""
    return assert_fits
