"""K-means and the two quantizers of the inverted multi-index (product and residual).

Shapes: N vectors, D dims, K codewords. A quantizer here has two codebooks (B = 2):

* product (``pq``): codebook 1 quantizes dims ``[0, D1)``, codebook 2 dims ``[D1, D)``, D1 = D // 2;
  the reconstruction is the concatenation ``[c1[k1], c2[k2]]``.
* residual (``rq``): codebook 1 quantizes the vectors, codebook 2 their residuals ``x - c1[k1]``;
  both live in D dims and the reconstruction is the sum ``c1[k1] + c2[k2]``.

Everything is plain PyTorch on the vectors' own device; ``backend="faiss"`` hands the k-means
iterations to faiss when it is installed (``pip install hf-midx[faiss]``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .. import defaults
from .._checks import check_matrix, check_positive_int
from ..defaults import KMEANS_BACKENDS

QUANTIZERS = ("pq", "rq")

# Rows of the (chunk, K) distance matrix per step: keeps k-means at O(chunk * K) extra memory.
_ASSIGN_CHUNK = 65536
#: Lloyd iterations see at most this many rows per centroid (a random subset, faiss's default of 256);
#: every row is encoded once at the end. K = 64 then trains on 16,384 rows whatever V is.
MAX_POINTS_PER_CENTROID = 256


def assign(
    x: torch.Tensor, centroids: torch.Tensor, x_sq: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Nearest centroid of each row.

    Args:
        x: (N, D) float tensor.
        centroids: (K, D) float tensor, same device.
        x_sq: optional (N,) ``||x||^2``, so that k-means computes it once, not every iteration.
    Returns:
        codes: (N,) int64, the argmin of ``||x - c_k||^2``.
        sq_dist: (N,) float32, that squared distance.
    """
    x = x.float()
    c = centroids.float()
    c_sq = (c * c).sum(1)
    codes = torch.empty(x.shape[0], dtype=torch.long, device=x.device)
    dist = torch.empty(x.shape[0], dtype=torch.float32, device=x.device)
    for start in range(0, x.shape[0], _ASSIGN_CHUNK):
        xs = x[start : start + _ASSIGN_CHUNK]
        # ||x - c||^2 = ||x||^2 - 2 x.c + ||c||^2; the ||x||^2 term does not change the argmin.
        d = torch.addmm(c_sq.unsqueeze(0), xs, c.t(), alpha=-2.0)
        best, idx = d.min(dim=1)
        # Row norms per chunk, while the chunk is in cache (no (N, D) temporary).
        xs_sq = torch.linalg.vector_norm(xs, dim=1).square_() if x_sq is None else x_sq[start : start + xs.shape[0]]
        codes[start : start + xs.shape[0]] = idx
        dist[start : start + xs.shape[0]] = (best + xs_sq).clamp_min_(0.0)
    return codes, dist


def _farthest_rows(dist: torch.Tensor, count: int) -> torch.Tensor:
    return torch.topk(dist, k=min(count, dist.numel())).indices


def kmeans_torch(
    x: torch.Tensor,
    num_clusters: int,
    *,
    iters: int = 20,
    init: torch.Tensor | None = None,
    generator: torch.Generator | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Lloyd's k-means in PyTorch.

    Args:
        x: (N, D) float tensor (any device).
        num_clusters: K <= N.
        iters: Lloyd iterations (each O(N K D)).
        init: optional (K, D) warm start (e.g. the previous codebook); else K distinct random rows.
        generator: RNG for the random initialization (CPU generator).
    Returns:
        centroids: (K, D) float32; codes: (N,) int64.

    Empty clusters are re-seeded with the rows farthest from their centroid, so a cluster stays
    empty only when fewer than K distinct rows exist.
    """
    x = x.float()
    n = x.shape[0]
    if init is not None:
        centroids = init.detach().to(device=x.device, dtype=torch.float32).clone()
    else:
        perm = torch.randperm(n, generator=generator)[:num_clusters].to(x.device)
        centroids = x[perm].clone()
    x_sq = torch.linalg.vector_norm(x, dim=1).square_()
    codes, dist = assign(x, centroids, x_sq)
    for _ in range(iters):
        # Cluster sums as one (K, N) x (N, D) GEMM: index_add_ over many repeated codes is serial on CPU.
        sums = torch.nn.functional.one_hot(codes, num_clusters).to(x.dtype).t() @ x
        counts = torch.bincount(codes, minlength=num_clusters)
        nonempty = counts > 0
        centroids = torch.where(nonempty.unsqueeze(1), sums / counts.clamp_min(1).unsqueeze(1).float(), centroids)
        empty = (~nonempty).nonzero().flatten()
        if empty.numel():
            far = _farthest_rows(dist, empty.numel())
            centroids[empty[: far.numel()]] = x[far]
        new_codes, dist = assign(x, centroids, x_sq)
        if torch.equal(new_codes, codes) and not empty.numel():
            break
        codes = new_codes
    return centroids, codes


def _import_faiss():
    try:
        import faiss  # noqa: PLC0415 - optional, imported only when asked for
    except ImportError as err:  # pragma: no cover - depends on the environment
        raise ImportError(
            "kmeans_backend='faiss' needs faiss: pip install 'hf-midx[faiss]' (CPU) or 'hf-midx[faiss-gpu]'."
        ) from err
    return faiss


def kmeans_faiss(
    x: torch.Tensor,
    num_clusters: int,
    *,
    iters: int = 20,
    init: torch.Tensor | None = None,
    seed: int = 0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The same contract as :func:`kmeans_torch`, with faiss doing the Lloyd iterations on CPU."""
    faiss = _import_faiss()
    xn = x.detach().float().cpu().contiguous().numpy()
    km = faiss.Kmeans(xn.shape[1], num_clusters, niter=iters, seed=seed, verbose=False)
    # faiss warns when N < 39 K but still clusters; we keep its defaults otherwise.
    km.cp.min_points_per_centroid = 1
    init_np = None if init is None else init.detach().float().cpu().contiguous().numpy()
    km.train(xn, init_centroids=init_np)
    centroids = torch.from_numpy(km.centroids.copy()).to(x.device)
    codes, _ = assign(x.float(), centroids)
    return centroids, codes


def kmeans(
    x: torch.Tensor,
    num_clusters: int,
    *,
    iters: int = defaults.KMEANS_ITERS,
    init: torch.Tensor | None = None,
    seed: int = defaults.SEED,
    backend: str = defaults.KMEANS_BACKEND,
) -> tuple[torch.Tensor, torch.Tensor]:
    """K-means with the chosen backend ("torch" or "faiss"); see :func:`kmeans_torch`."""
    if backend not in KMEANS_BACKENDS:
        raise ValueError(f"Unknown kmeans backend {backend!r}; choose one of {KMEANS_BACKENDS}.")
    if backend == "faiss":
        return kmeans_faiss(x, num_clusters, iters=iters, init=init, seed=seed)
    generator = torch.Generator().manual_seed(seed)
    return kmeans_torch(x, num_clusters, iters=iters, init=init, generator=generator)


@dataclass
class TwoLevelCodes:
    """The result of quantizing N vectors with two codebooks.

    Attributes:
        codebooks: pair of (K, D1) and (K, D2) float32 tensors.
        codes: (N, 2) int64, each vector's (k1, k2).
    """

    codebooks: tuple[torch.Tensor, torch.Tensor]
    codes: torch.Tensor


def split_dims(quantizer: str, dim: int) -> tuple[slice, slice]:
    """The slices of a D-dim vector that codebook 1 and codebook 2 act on."""
    if quantizer == "pq":
        half = dim // 2
        return slice(0, half), slice(half, dim)
    return slice(0, dim), slice(0, dim)


def encode(quantizer: str, x: torch.Tensor, codebooks: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    """Hard codes (N, 2) int64 of (N, D) vectors ``x`` for the given codebooks."""
    s1, s2 = split_dims(quantizer, x.shape[1])
    x = x.float()
    k1, _ = assign(x[:, s1], codebooks[0])
    if quantizer == "pq":
        return torch.stack([k1, assign(x[:, s2], codebooks[1])[0]], dim=1)
    # Residuals r = x - c1[k1] are never formed: ||r - c2||^2 = ||r||^2 - 2 (x.c2 - c1[k1].c2) + ||c2||^2,
    # and c1 . c2 is a (K, K) table.
    c1, c2 = codebooks[0].float(), codebooks[1].float()
    cross, c2_sq = c1 @ c2.t(), (c2 * c2).sum(1)
    k2 = torch.empty_like(k1)
    for start in range(0, x.shape[0], _ASSIGN_CHUNK):
        rows = slice(start, start + _ASSIGN_CHUNK)
        dot = x[rows] @ c2.t() - cross[k1[rows]]
        k2[rows] = (c2_sq.unsqueeze(0) - 2.0 * dot).argmin(dim=1)
    return torch.stack([k1, k2], dim=1)


def decode(quantizer: str, codes: torch.Tensor, codebooks: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    """Reconstruction (N, D) float32 of codes (N, 2): concatenation (pq) or sum (rq)."""
    c1 = codebooks[0][codes[:, 0]]
    c2 = codebooks[1][codes[:, 1]]
    return torch.cat([c1, c2], dim=1) if quantizer == "pq" else c1 + c2


def train_quantizer(
    quantizer: str,
    x: torch.Tensor,
    num_codewords: int,
    *,
    iters: int = defaults.KMEANS_ITERS,
    init: tuple[torch.Tensor, torch.Tensor] | None = None,
    seed: int = defaults.SEED,
    backend: str = defaults.KMEANS_BACKEND,
    check: bool = True,
    max_points_per_centroid: int | None = MAX_POINTS_PER_CENTROID,
) -> TwoLevelCodes:
    """Learn two codebooks of K codewords for (N, D) vectors ``x`` by k-means.

    Costs O(min(N, K P) K D iters + N K D) with P = ``max_points_per_centroid``.

    Args:
        quantizer: "pq" or "rq".
        init: optional previous codebooks to warm-start both k-means runs.
        max_points_per_centroid: P; with more than K P rows, k-means runs on a random subset of K P
            rows (as faiss does by default, P = 256) and all N rows are then encoded; None uses all.
        check: scan ``x`` for NaN/Inf (one pass and a host sync); False when the caller has.
    """
    if quantizer not in QUANTIZERS:
        raise ValueError(f"Unknown quantizer {quantizer!r}; choose one of {QUANTIZERS}.")
    check_matrix("embeddings", x, finite=check)
    check_positive_int("codebook_size", num_codewords)
    if num_codewords > x.shape[0]:
        raise ValueError(
            f"codebook_size={num_codewords} is larger than the number of classes {x.shape[0]}; "
            f"use codebook_size <= {x.shape[0]}."
        )
    if quantizer == "pq" and x.shape[1] < 2:
        raise ValueError("Product quantization splits the dims in two and needs D >= 2; use quantizer 'rq'.")
    s1, s2 = split_dims(quantizer, x.shape[1])
    x = x.detach().float()
    # Lloyd's iterations see at most K * MAX_POINTS_PER_CENTROID rows (faiss's rule); every row is
    # encoded once at the end. The subset is fixed by the seed, so a resumed run rebuilds identically.
    train = x
    if max_points_per_centroid is not None and x.shape[0] > num_codewords * max_points_per_centroid:
        keep = torch.randperm(x.shape[0], generator=torch.Generator().manual_seed(seed))
        train = x[keep[: num_codewords * max_points_per_centroid].to(x.device)]
    c1, k1 = kmeans(
        train[:, s1], num_codewords, iters=iters, init=None if init is None else init[0], seed=seed, backend=backend
    )
    second = train[:, s2] - c1[k1] if quantizer == "rq" else train[:, s2]
    c2, k2 = kmeans(
        second, num_codewords, iters=iters, init=None if init is None else init[1], seed=seed + 1, backend=backend
    )
    codes = torch.stack([k1, k2], dim=1) if train is x else encode(quantizer, x, (c1, c2))
    return TwoLevelCodes(codebooks=(c1, c2), codes=codes)


def distortion(quantizer: str, x: torch.Tensor, result: TwoLevelCodes) -> float:
    """Mean squared reconstruction error ``mean_i ||x_i - x_hat_i||^2``."""
    return float(((x.float() - decode(quantizer, result.codes, result.codebooks)) ** 2).sum(1).mean())
