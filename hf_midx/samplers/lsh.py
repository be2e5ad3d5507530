"""Locality-sensitive hashing baseline (SimHash tables with a uniform safety mix)."""

from __future__ import annotations

import torch

from .. import defaults
from .._checks import check_positive_int, is_number
from .._ops import row_chunks
from .base import Sampler
from ..registry import register


@register
class LSHSampler(Sampler):
    """SimHash proposal: L tables of b random hyperplanes each (default 16 x 4).

    A draw is uniform over V with probability ``lsh_uniform_mix``; otherwise it picks uniformly one of
    the tables in which the query's bucket is non-empty and then a class uniformly from that bucket.
    Hence, exactly, Q(i | z) = mix / V + (1 - mix) / L_z * sum_{l : h_l(i) = h_l(z)} 1 / |B_l(h_l(z))|,
    with L_z the number of tables whose query bucket is non-empty (Q = 1/V when L_z = 0).
    """

    name = "lsh"
    options = ("lsh_tables", "lsh_bits", "lsh_uniform_mix")
    _state_names = ("hyperplanes", "class_hashes")

    def __init__(
        self,
        embeddings: torch.Tensor,
        *,
        lsh_tables: int = 16,
        lsh_bits: int = 4,
        lsh_uniform_mix: float = 0.05,
        seed: int = defaults.SEED,
        exclude=None,
        **_common,
    ) -> None:
        self.check_options(lsh_tables=lsh_tables, lsh_bits=lsh_bits, lsh_uniform_mix=lsh_uniform_mix)
        super().__init__(embeddings, seed=seed, exclude=exclude)
        self.num_tables, self.num_bits, self.mix = lsh_tables, lsh_bits, float(lsh_uniform_mix)
        gen = torch.Generator().manual_seed(seed + 104729)
        self.hyperplanes = torch.randn(lsh_tables * lsh_bits, self.dim, generator=gen).to(self.device)
        self._weights_pow2 = 2 ** torch.arange(lsh_bits, device=self.device)
        self.class_hashes = self._hash(self._restrict(embeddings.detach().float()))
        self._after_load()

    @classmethod
    def check_options(cls, **options) -> None:
        if "lsh_tables" in options:
            check_positive_int("lsh_tables", options["lsh_tables"])
        if "lsh_bits" in options and check_positive_int("lsh_bits", options["lsh_bits"]) > 24:
            bits = options["lsh_bits"]
            raise ValueError(f"lsh_bits={bits} gives 2**{bits} buckets per table; use at most 24.")
        mix = options.get("lsh_uniform_mix", 0.0)
        if not (is_number(mix) and 0.0 <= mix <= 1.0):
            raise ValueError(f"lsh_uniform_mix must be a number in [0, 1], got {mix!r}.")

    def _hash(self, x: torch.Tensor) -> torch.Tensor:
        """(N, D) -> (N, L) int64 bucket ids in [0, 2^b)."""
        bits = (x @ self.hyperplanes.t() > 0).long().view(x.shape[0], self.num_tables, self.num_bits)
        return (bits * self._weights_pow2).sum(-1)

    def _after_load(self) -> None:
        nb = 2**self.num_bits
        table_offset = torch.arange(self.num_tables, device=self.device) * nb
        key = (self.class_hashes + table_offset).t()  # (L, V): global bucket id per table
        self._order = torch.sort(key, dim=1, stable=True).indices  # (L, V) class ids per table, by bucket
        counts = torch.bincount(key.flatten(), minlength=self.num_tables * nb).view(self.num_tables, nb)
        self._counts = counts
        self._offsets = torch.cumsum(counts, 1) - counts  # (L, nb) start of each bucket in _order[l]

    def refresh(self, embeddings: torch.Tensor) -> None:
        self.class_hashes = self._hash(self._check_embeddings(embeddings))
        self._after_load()

    def _query_tables(self, q):
        h = self._hash(q)  # (T, L)
        sizes = self._counts.gather(1, h.t()).t()  # (T, L)
        return h, sizes

    def _sample(self, q, m, gen):
        t = q.shape[0]
        h, sizes = self._query_tables(q)
        nonempty = sizes > 0
        has_any = nonempty.any(dim=1, keepdim=True)
        table_w = torch.where(has_any, nonempty.float(), torch.ones_like(nonempty, dtype=torch.float32))
        tables = gen.categorical(table_w, m)  # (T, M)
        size = sizes.gather(1, tables)
        start = self._offsets[tables, h.gather(1, tables)]
        u = gen.rand(t, m, dtype=torch.float64)
        pos = start + torch.minimum((u * size).long(), (size - 1).clamp_min(0))
        # A query none of whose buckets holds a class (no table usable) draws uniformly below; its
        # empty bucket may start at V, so clamp the throw-away position to keep the gather in range.
        from_bucket = self._order[tables, pos.clamp_max(self.num_candidates - 1)]
        uniform = gen.randint(self.num_candidates, (t, m))
        use_uniform = (gen.rand(t, m) < self.mix) | ~has_any
        ids = torch.where(use_uniform, uniform, from_bucket)
        return ids, self._log_q(h, sizes, ids)

    def _log_q(self, h, sizes, ids):
        # collide[t, j, l] = class ids[t, j] shares query t's bucket in table l.
        collide = self.class_hashes[ids] == h.unsqueeze(1)
        inv = torch.where(sizes > 0, 1.0 / sizes.clamp_min(1).float(), torch.zeros_like(sizes, dtype=torch.float32))
        tables_nonempty = (sizes > 0).sum(1, keepdim=True).float()  # (T, 1)
        bucket_part = (collide.float() * inv.unsqueeze(1)).sum(-1) / tables_nonempty.clamp_min(1.0)
        q = torch.where(
            tables_nonempty > 0,
            self.mix / self.num_candidates + (1.0 - self.mix) * bucket_part,
            torch.full_like(bucket_part, 1.0 / self.num_candidates),
        )
        return q.log()

    def _log_prob(self, q, ids):
        h, sizes = self._query_tables(q)
        out = torch.empty(ids.shape, device=self.device)
        for cols in row_chunks(ids.shape[1], q.shape[0] * self.num_tables):
            out[:, cols] = self._log_q(h, sizes, ids[:, cols])
        return out
