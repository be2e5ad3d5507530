"""The inverted multi-index (MIDX) over V class embeddings.

Two codebooks of K codewords split the classes into K x K buckets Omega(k1, k2). The index keeps:

* ``codebooks``: (K, D1) and (K, D2) float32;
* ``codes``: (V, 2) int64, each class's (k1, k2);
* ``bucket_counts``: (K, K) int64, |Omega(k1, k2)|;
* ``order`` (V,) int64 and ``offsets`` (K*K + 1,) int64: the classes sorted by bucket id
  b = k1 * K + k2 (CSR), so the members of bucket b are ``order[offsets[b]:offsets[b + 1]]``;
  ``spans`` (K*K, 2) int64 holds each bucket's [offset, size].

Building costs O(V K D iters) (k-means); sampling from the index never touches all V classes.
"""

from __future__ import annotations

import torch

from .. import defaults
from . import quantizers
from .._checks import check_matrix, check_positive_int


class MidxIndex:
    """Inverted multi-index over class embeddings, built by product or residual quantization.

    Build with :meth:`build`; rebuild (warm-started from the current codebooks) with :meth:`rebuild`;
    swap in new codebooks (e.g. learned ones) with :meth:`set_codebooks`.
    """

    def __init__(
        self,
        quantizer: str,
        codebooks: tuple[torch.Tensor, torch.Tensor],
        codes: torch.Tensor,
        *,
        kmeans_iters: int = defaults.KMEANS_ITERS,
        kmeans_backend: str = defaults.KMEANS_BACKEND,
        seed: int = defaults.SEED,
    ) -> None:
        if quantizer not in quantizers.QUANTIZERS:
            raise ValueError(f"Unknown quantizer {quantizer!r}; choose one of {quantizers.QUANTIZERS}.")
        self.quantizer = quantizer
        self.kmeans_iters = kmeans_iters
        self.kmeans_backend = kmeans_backend
        self.seed = seed
        self._set(codebooks, codes)

    # ---------------------------------------------------------------- construction
    @classmethod
    def build(
        cls,
        embeddings: torch.Tensor,
        codebook_size: int = defaults.CODEBOOK_SIZE,
        *,
        quantizer: str = "rq",
        kmeans_iters: int = defaults.KMEANS_ITERS,
        kmeans_backend: str = defaults.KMEANS_BACKEND,
        init: tuple[torch.Tensor, torch.Tensor] | None = None,
        seed: int = defaults.SEED,
        check: bool = True,
    ) -> "MidxIndex":
        """Quantize (V, D) ``embeddings`` with two K-codeword codebooks and index the classes.

        Args:
            embeddings: (V, D) float tensor, finite; the index lives on its device.
            codebook_size: K, 1 <= K <= V.
            quantizer: "rq" (residual) or "pq" (product).
            kmeans_iters: Lloyd iterations per codebook.
            kmeans_backend: "torch" or "faiss".
            init: optional previous codebooks to warm-start k-means.
            check: scan ``embeddings`` for NaN/Inf (a pass over V x D and a host sync); False when the
                caller has (a sampler's refresh validates the weight once).
        """
        check_matrix("embeddings", embeddings, finite=check)
        check_positive_int("codebook_size", codebook_size)
        check_positive_int("kmeans_iters", kmeans_iters, minimum=0)
        if init is not None:
            s1, s2 = quantizers.split_dims(quantizer, embeddings.shape[1])
            want = ((codebook_size, s1.stop - s1.start), (codebook_size, s2.stop - s2.start))
            if tuple(tuple(c.shape) for c in init) != want:
                init = None  # the size changed (new vocab or K): start k-means afresh
        result = quantizers.train_quantizer(
            quantizer,
            embeddings,
            codebook_size,
            iters=kmeans_iters,
            init=init,
            seed=seed,
            backend=kmeans_backend,
            check=False,  # checked above
        )
        return cls(
            quantizer, result.codebooks, result.codes, kmeans_iters=kmeans_iters, kmeans_backend=kmeans_backend, seed=seed
        )

    def rebuild(self, embeddings: torch.Tensor, *, check: bool = True) -> None:
        """Re-run k-means on new (V, D) embeddings, warm-started from the current codebooks (in place).

        ``check=False`` skips the NaN/Inf scan of ``embeddings`` for a caller that has done it.
        """
        check_matrix("embeddings", embeddings, finite=check)
        new = MidxIndex.build(
            embeddings,
            self.codebook_size,
            quantizer=self.quantizer,
            kmeans_iters=self.kmeans_iters,
            kmeans_backend=self.kmeans_backend,
            init=self.codebooks,
            seed=self.seed,
            check=False,
        )
        self._set(new.codebooks, new.codes)

    def set_codebooks(self, codebooks: tuple[torch.Tensor, torch.Tensor], embeddings: torch.Tensor) -> None:
        """Use the given codebooks and recompute the hard codes and bucket tables; O(V K D), in place."""
        check_matrix("embeddings", embeddings)
        # Copies: callers pass views of parameters (LearnableCodebooks) that an optimizer updates in place.
        cbs = (codebooks[0].detach().float().clone(), codebooks[1].detach().float().clone())
        for i, c in enumerate(cbs):
            check_matrix(f"codebooks[{i}]", c)
        # Checked here so that a mismatch reads as a ValueError, not as a matmul shape error in encode.
        s1, s2 = self.dim_slices(embeddings.shape[1])
        want = (s1.stop - s1.start, s2.stop - s2.start)
        if (cbs[0].shape[1], cbs[1].shape[1]) != want:
            raise ValueError(
                f"codebooks have widths ({cbs[0].shape[1]}, {cbs[1].shape[1]}) but the {self.quantizer!r} "
                f"quantizer over D={embeddings.shape[1]} dims needs {want}."
            )
        codes = quantizers.encode(self.quantizer, embeddings.detach(), cbs)
        self._set(cbs, codes)

    def _set(self, codebooks: tuple[torch.Tensor, torch.Tensor], codes: torch.Tensor) -> None:
        c1, c2 = (c.detach().float().contiguous() for c in codebooks)
        if c1.shape[0] != c2.shape[0]:
            raise ValueError(f"Both codebooks need the same number of codewords, got {c1.shape[0]} and {c2.shape[0]}.")
        if codes.dim() != 2 or codes.shape[1] != 2:
            raise ValueError(f"codes must have shape (V, 2), got {tuple(codes.shape)}.")
        k = c1.shape[0]
        self.codebooks = (c1, c2)
        self.codes = codes.to(device=c1.device, dtype=torch.long).contiguous()
        bucket = self.codes[:, 0] * k + self.codes[:, 1]
        # A stable sort keeps classes in id order inside each bucket: the layout is deterministic.
        self.order = torch.sort(bucket, stable=True).indices
        counts = torch.bincount(bucket, minlength=k * k)
        self.bucket_counts = counts.view(k, k)
        self.offsets = torch.zeros(k * k + 1, dtype=torch.long, device=c1.device)
        torch.cumsum(counts, 0, out=self.offsets[1:])
        # (K*K, 2) [offset, size] per bucket: a uniform draw inside buckets reads both with one gather. An empty
        # bucket's offset is kept below V, so that a draw from it (NaN queries only) still indexes a class.
        self.spans = torch.stack([self.offsets[:-1].clamp_max(self.codes.shape[0] - 1), counts], dim=1)

    # ---------------------------------------------------------------- properties
    @property
    def codebook_size(self) -> int:
        """K, the codewords per codebook."""
        return self.codebooks[0].shape[0]

    @property
    def num_classes(self) -> int:
        """V, the number of indexed classes."""
        return self.codes.shape[0]

    @property
    def device(self) -> torch.device:
        return self.codebooks[0].device

    def dim_slices(self, dim: int) -> tuple[slice, slice]:
        """The parts of a D-dim query that meet codebook 1 and codebook 2."""
        return quantizers.split_dims(self.quantizer, dim)

    def reconstruct(self, ids: torch.Tensor | None = None) -> torch.Tensor:
        """The quantized class embeddings ``q_i - residual_i``, (V, D) or (len(ids), D) float32."""
        codes = self.codes if ids is None else self.codes[ids]
        return quantizers.decode(self.quantizer, codes, self.codebooks)

    def draw_members(
        self,
        buckets: torch.Tensor,
        u: torch.Tensor,
        cum_weights: torch.Tensor | None = None,
        *,
        ids: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """A class of each given bucket, by inverse CDF over its slice ``order[offsets[b]:offsets[b + 1]]``.

        Args:
            buckets: (T, M) int64 non-empty bucket ids b = k1 * K + k2.
            u: (T, M) float64 uniforms in [0, 1) (53 bits at most: then u * size < size).
            cum_weights: None to draw uniformly inside the bucket; else the classes' cumulative weights
                in CSR order with a leading 0, (V + 1,) shared by all rows or (T, V + 1) one per row (float64).
            ids: (V,) int64 ids to return for the classes in CSR order (a sampler's global ids); default ``order``.
        Returns:
            (T, M) int64 class ids.
        """
        ids = self.order if ids is None else ids
        if cum_weights is None:
            span = self.spans[buckets]  # (T, M, 2): [offset, size] of each bucket, one gather
            return ids[span[..., 0] + (u * span[..., 1]).long()]
        lo, hi = self.spans[buckets, 0], self.offsets[buckets + 1]
        if cum_weights.dim() == 1:
            base, top = cum_weights[lo], cum_weights[hi]
        else:
            base, top = cum_weights.gather(1, lo), cum_weights.gather(1, hi)
        pos = torch.searchsorted(cum_weights, base + u * (top - base), right=True) - 1
        return ids[torch.maximum(torch.minimum(pos, hi - 1), lo)]

    def distortion(self, embeddings: torch.Tensor) -> float:
        """Mean squared quantization error of the indexed (V, D) embeddings."""
        return float(((embeddings.float() - self.reconstruct()) ** 2).sum(1).mean())

    # ---------------------------------------------------------------- state
    def state_dict(self) -> dict[str, torch.Tensor]:
        """Tensors that fully describe the index (for safetensors checkpoints)."""
        return {"codebook1": self.codebooks[0], "codebook2": self.codebooks[1], "codes": self.codes}

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        """Restore from :meth:`state_dict`; raises ValueError if V or K differ from this index."""
        for key in ("codebook1", "codebook2", "codes"):
            if key not in state:
                raise ValueError(f"Index state is missing {key!r}; it was not written by MidxIndex.state_dict().")
        codes = state["codes"]
        if codes.shape[0] != self.num_classes or state["codebook1"].shape != self.codebooks[0].shape:
            raise ValueError(
                f"Index state has V={codes.shape[0]}, K={state['codebook1'].shape[0]}, dims "
                f"{tuple(state['codebook1'].shape[1:])}, but this index has V={self.num_classes}, "
                f"K={self.codebook_size}, dims {tuple(self.codebooks[0].shape[1:])}: the checkpoint comes from "
                "another vocabulary or codebook size."
            )
        device = self.device
        self._set((state["codebook1"].to(device), state["codebook2"].to(device)), codes.to(device))

    def __repr__(self) -> str:
        nonempty = int((self.bucket_counts > 0).sum())
        return (
            f"MidxIndex(quantizer={self.quantizer!r}, V={self.num_classes}, K={self.codebook_size}, "
            f"nonempty_buckets={nonempty}/{self.codebook_size ** 2})"
        )
