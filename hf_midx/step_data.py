"""StepData: what a MidxLMHead's training calls leave for the callback, kept on the device.

Per sampled call the head records, without any device-to-host synchronization: ``queries`` (hidden
states for the KL and the learned codebooks), the last batch (for one exact loss) and the first call
whose hidden states or loss were not finite. :class:`~hf_midx.MidxCallback` reads them at logging,
save and refresh steps, where the Trainer syncs anyway.

Shapes: T tokens, D hidden dims, k = ``kl_queries``.
"""

from __future__ import annotations

import torch

#: Causes of the first non-finite training call, as :meth:`StepData.first_nonfinite_call` names them.
NONFINITE_CAUSES = {1: "hidden states (the LM head's input)", 2: "loss"}


class StepData:
    """The per-call training data of one head, for the callback; no field is read back per call.

    Attributes:
        kl_queries: k, how many hidden states :meth:`record` keeps per call.
        queries: (min(k, T), D) float32, detached: hidden states of the last recorded call, evenly spaced
            over its non-ignored tokens (repeated when fewer than k; any tokens when none is
            non-ignored); or None. Chosen on the device, without reading the labels back.
        last_batch: (hidden (T, D), shifted labels (T,), ignore_index) of the last recorded call, or None.
        call_counter: 0-dim int64 tensor on the head's device, the number of recorded calls since
            :meth:`clear` (None before the first); a tensor, so that counting neither syncs nor makes
            ``torch.compile`` recompile at every call. :attr:`calls` reads it.
        scheduled: True while a :class:`~hf_midx.MidxCallback` (or another schedule) trains this head;
            the host binding warns once when a Trainer trains without one.
    """

    def __init__(self, kl_queries: int) -> None:
        self.kl_queries = int(kl_queries)
        self.scheduled = False
        self.clear()

    def clear(self) -> None:
        """Forget the kept queries, batch, counter and finiteness record (not :attr:`scheduled`)."""
        self.queries: torch.Tensor | None = None
        self.last_batch: tuple[torch.Tensor, torch.Tensor, int] | None = None
        self.call_counter: torch.Tensor | None = None
        self._first_bad: torch.Tensor | None = None  # (2,) int64: [call index or -1, cause code]

    @property
    def calls(self) -> int:
        """Recorded calls since :meth:`clear`; reads the device counter (a sync)."""
        return 0 if self.call_counter is None else int(self.call_counter)

    @torch.no_grad()
    def record(self, h: torch.Tensor, y: torch.Tensor, ignore_index: int, loss: torch.Tensor) -> None:
        """Keep one call's queries, batch and finiteness on the device: no host sync, static shapes.

        Args:
            h: (T, D) hidden states in the weight's dtype (before any logit scale); detached here.
            y: (T,) int64 shifted labels.
            ignore_index: the label value that marks ignored tokens.
            loss: the call's loss (any shape), checked for NaN/Inf.
        """
        h = h.detach()
        valid = y != ignore_index
        count = valid.sum()
        # No token counts: choose among all tokens (their hidden states are still the model's).
        valid = valid | (count == 0)
        count = torch.where(count == 0, torch.full_like(count, y.shape[0]), count)
        k = min(self.kl_queries, y.shape[0])
        # The j-th chosen token is the (1 + floor(j (count - 1) / (k - 1)))-th non-ignored one; its
        # position is where the running count of non-ignored tokens first reaches that rank.
        rank = torch.arange(k, device=h.device) * (count - 1) // max(k - 1, 1) + 1
        rows = torch.searchsorted(valid.long().cumsum(0), rank).clamp_max(y.shape[0] - 1)
        self.queries = h[rows].float()
        self.last_batch = (h, y, ignore_index)
        if self.call_counter is None:
            self.call_counter = torch.zeros((), dtype=torch.long, device=h.device)
        self.call_counter.add_(1)
        hidden_ok = torch.isfinite(h).all()
        loss_ok = torch.isfinite(loss).all()
        cause = torch.where(hidden_ok, torch.where(loss_ok, 0, 2), 1).long()
        first = torch.stack([self.call_counter - 1, cause])
        if self._first_bad is None:
            none = torch.stack([cause.new_full((), -1), cause.new_zeros(())])
            self._first_bad = torch.where(cause > 0, first, none)
        else:
            new = (self._first_bad[0] < 0) & (cause > 0)
            self._first_bad = torch.where(new, first, self._first_bad)

    def first_nonfinite_call(self) -> tuple[int, str] | None:
        """(index among the recorded calls since :meth:`clear`, cause) of the first call whose hidden
        states or loss held NaN/Inf, or None. Reads one small tensor back (a device sync): call it at
        logging steps, not per micro-batch."""
        if self._first_bad is None:
            return None
        call, cause = (int(v) for v in self._first_bad.tolist())
        return None if call < 0 else (call, NONFINITE_CAUSES[cause])


__all__ = ["NONFINITE_CAUSES", "StepData"]
