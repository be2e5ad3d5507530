"""Learnable codebooks: the codewords as parameters, trained on the paper's objective.

    L = L_recon + kl_weight * L_KL
    L_recon = mean_i || q_hat_i - q_i ||^2
    L_KL = mean_z KL( softmax(z . q) || softmax(z . q_hat) )   over the caller's subset of queries

q_hat_i is, by default ("hard"), c1[k1(i)] (+ or concatenated with) c2[k2(i)] at the class's nearest
codewords: the very quantization the MIDX proposal uses, so L_KL is exactly KL(P || Q_midx), and the
gradients reach the codewords through the gather (codes recomputed at every call). "soft" is the
paper's soft reconstruction:
        pq: [ sum_k w1_ik c1_k , sum_k w2_ik c2_k ]  with w_l = softmax_k(-||q_i^l - c_k^l||^2)
        rq: sum_k w1_ik c1_k + sum_k w2_ik c2_k      with w2 on the residual q_i - sum_k w1_ik c1_k

The paper writes the soft weights as softmax_k(q . c_k). We use softmax_k(-||q - c_k||^2) =
softmax_k(2 q . c_k - ||c_k||^2): the paper's inner product plus a codeword-norm term, so that the
weights peak on the nearest codeword, which is the hard code the index assigns when the sampler adopts
the codebooks (``MidxIndex.set_codebooks``). With the bare inner product the weights peak on the
codeword of largest q . c_k instead, the objective describes another quantization than the one the
sampler uses, and training could raise the deployed proposal's KL (seen with pq in the tests).

Measured on the 1-epoch WikiText-2 model's head (V=33k, D=200, K=32, rq, 300 Adam steps at lr 1e-3,
held-out queries): KL(Q || P) 1.170 -> 0.790 with "hard", 1.170 -> 3.621 with "soft": when squared
distances are small next to 1 (head weights of norm ~0.7) the soft weights are nearly uniform and the
soft objective describes a quantization far from the deployed one.

Shapes: V classes, D dims, K codewords, S queries in the KL subset. The class embeddings are detached,
so gradients reach the codewords only. The KL costs O(S V D): the caller bounds it through S.
"""

from __future__ import annotations

import torch
from torch import nn

from . import quantizers
from .._checks import check_matrix

ASSIGNMENTS = ("hard", "soft")


def _soft_assign(x: torch.Tensor, codebook: torch.Tensor) -> torch.Tensor:
    """Soft codeword weights softmax_k(-||x_n - c_k||^2) for (N, d) x and (K, d) codewords; (N, K).

    Computed as softmax_k(2 x . c_k - ||c_k||^2) (the ||x||^2 term cancels); its argmax is the nearest
    codeword, as in ``quantizers.encode`` (see the module docstring).
    """
    logits = 2.0 * (x @ codebook.t()) - (codebook * codebook).sum(1)
    return torch.softmax(logits, dim=1)


class LearnableCodebooks(nn.Module):
    """Two codebooks of K codewords as ``nn.Parameter`` s.

    Args:
        codebooks: initial (K, D1), (K, D2) tensors, e.g. ``sampler.index.codebooks`` after k-means.
        quantizer: "rq" or "pq" (must match the index the codebooks feed).
        kl_weight: weight of the KL term.
        assignment: "hard" (default; q_hat is the index's own quantization) or "soft" (the paper's
            soft reconstruction; see the module docstring for why it is not the default).
    """

    def __init__(
        self,
        codebooks: tuple[torch.Tensor, torch.Tensor],
        quantizer: str = "rq",
        *,
        kl_weight: float = 1.0,
        assignment: str = "hard",
    ) -> None:
        super().__init__()
        if assignment not in ASSIGNMENTS:
            raise ValueError(f"Unknown assignment {assignment!r}; choose one of {ASSIGNMENTS}.")
        if quantizer not in quantizers.QUANTIZERS:
            raise ValueError(f"Unknown quantizer {quantizer!r}; choose one of {quantizers.QUANTIZERS}.")
        for i, c in enumerate(codebooks):
            check_matrix(f"codebooks[{i}]", c)
        if codebooks[0].shape[0] != codebooks[1].shape[0]:
            raise ValueError("Both codebooks need the same number of codewords.")
        if kl_weight < 0:
            raise ValueError(f"kl_weight must be >= 0, got {kl_weight}.")
        self.quantizer = quantizer
        self.kl_weight = float(kl_weight)
        self.assignment = assignment
        self.codebook1 = nn.Parameter(codebooks[0].detach().float().clone())
        self.codebook2 = nn.Parameter(codebooks[1].detach().float().clone())

    @property
    def codebooks(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The current codewords, detached: (K, D1), (K, D2) float32."""
        return self.codebook1.detach(), self.codebook2.detach()

    def soft_reconstruct(self, embeddings: torch.Tensor) -> torch.Tensor:
        """q_hat for (N, D) embeddings (detached inside), (N, D) float32, differentiable in the codewords."""
        q = embeddings.detach().float()
        d1, d2 = quantizers.split_dims(self.quantizer, q.shape[1])
        r1 = _soft_assign(q[:, d1], self.codebook1) @ self.codebook1
        second = q[:, d2] - r1 if self.quantizer == "rq" else q[:, d2]
        r2 = _soft_assign(second, self.codebook2) @ self.codebook2
        return torch.cat([r1, r2], dim=1) if self.quantizer == "pq" else r1 + r2

    def hard_reconstruct(self, embeddings: torch.Tensor) -> torch.Tensor:
        """The quantized (N, D) float32 embeddings at the nearest-codeword codes; differentiable in the
        codewords (the codes themselves are piecewise constant)."""
        return quantizers.decode(self.quantizer, self.hard_codes(embeddings), (self.codebook1, self.codebook2))

    def forward(
        self,
        embeddings: torch.Tensor,
        queries: torch.Tensor,
    ) -> dict[str, torch.Tensor]:
        """The codebook objective.

        Args:
            embeddings: (V, D) class embeddings (no gradient flows to them).
            queries: (S, D) query subset for the KL term (no gradient flows to them).
        Returns:
            dict with "loss" (scalar, differentiable in the codewords), "recon" and "kl" (detached).
        """
        check_matrix("embeddings", embeddings, dim=self._dim())
        check_matrix("queries", queries, dim=self._dim())
        q = embeddings.detach().float()
        z = queries.detach().float().to(q.device)
        # O(V K D) for q_hat of every class: the KL's normalization needs all of them anyway.
        q_hat = self.hard_reconstruct(q) if self.assignment == "hard" else self.soft_reconstruct(q)
        recon = ((q_hat - q) ** 2).sum(1).mean()
        log_p = torch.log_softmax(z @ q.t(), dim=1)
        log_p_hat = torch.log_softmax(z @ q_hat.t(), dim=1)
        kl = (log_p.exp() * (log_p - log_p_hat)).sum(1).mean()
        loss = recon + self.kl_weight * kl
        return {"loss": loss, "recon": recon.detach(), "kl": kl.detach()}

    def _dim(self) -> int:
        d1, d2 = self.codebook1.shape[1], self.codebook2.shape[1]
        return d1 + d2 if self.quantizer == "pq" else d1

    def hard_codes(self, embeddings: torch.Tensor) -> torch.Tensor:
        """Nearest-codeword codes (V, 2) int64 for the current codewords."""
        return quantizers.encode(self.quantizer, embeddings.detach(), self.codebooks)
