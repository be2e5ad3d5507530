"""StepData: what a MidxLMHead's training calls leave for the callback, kept on the device.

Per sampled call the head records, without any device-to-host synchronization and in a handful of ops
(the hidden states are not scanned per call): the last batch (for one exact loss and the queries) and
the first call whose loss was not finite. :class:`~hf_midx.MidxCallback` reads them at logging, save
and refresh steps, where the Trainer syncs anyway; what costs more (the queries, the tensor a NaN came
from) is worked out there, from the kept last batch.

Shapes: T tokens, D hidden dims, k = ``kl_queries``.
"""

from __future__ import annotations

import torch

from .._ops import step_state

#: Causes of the first non-finite training call, as :meth:`StepData.first_nonfinite_call` names them.
NONFINITE_CAUSES = {1: "hidden states (the LM head's input)", 2: "loss"}


class StepData:
    """The per-call training data of one head, for the callback; no field is read back per call.

    Attributes:
        kl_queries: k, how many hidden states :attr:`queries` keeps of the last call.
        last_batch: (hidden (T, D), shifted labels (T,), ignore_index) of the last recorded call, or None.
        z_loss: the last recorded call's z-loss term (a float32 scalar on the device), or None.
        call_counter: 0-dim int64 tensor on the head's device, the number of recorded calls since
            :meth:`clear`; a tensor, so that counting neither syncs nor makes ``torch.compile`` recompile at
            every call. :attr:`calls` reads it.
        scheduled: True while a :class:`~hf_midx.MidxCallback` (or another schedule) trains this head;
            the host binding warns once when a Trainer trains without one.
        calls_since_refresh: the sampled training calls through the model since the index was last built (a host
            count, no sync): the binding tells a loop that never refreshes, once.
    """

    def __init__(self, kl_queries: int, device: torch.device | str = "cpu") -> None:
        self.kl_queries = int(kl_queries)
        self.scheduled = False
        self.calls_since_refresh = 0
        self._counts = self._flags = None
        self.clear(device)

    def clear(self, device: torch.device | str | None = None) -> None:
        """Forget the kept batch, counters and finiteness record (not :attr:`scheduled`); ``device``: keep the
        counters there from now on (the head's device, where it moved), else where they are."""
        self.last_batch: tuple[torch.Tensor, torch.Tensor, int] | None = None
        self.z_loss: torch.Tensor | None = None
        self._queries: torch.Tensor | None = None
        device = None if device is None else torch.device(device)
        if self._counts is not None and device in (None, self._counts.device):
            # In place: a compiled (CUDA-graph) step keeps reading and advancing the same tensors.
            self._counts.zero_()
            self._flags.zero_()
            return
        # [0 * (every loss so far), 0]: [0 until the first non-finite loss and NaN from then on, 0]; and
        # [the calls before that one, all calls] (call_counter is a view of the second). Made here, outside
        # the step: a step that made them at its first call would compile a second graph for the next calls.
        self._flags = torch.zeros(2, dtype=torch.float32, device=device)
        self._counts = torch.zeros(2, dtype=torch.long, device=device)
        self.call_counter = self._counts[1]
        step_state(self._flags, self._counts)

    @property
    def calls(self) -> int:
        """Recorded calls since :meth:`clear`; reads the device counter (a sync)."""
        return int(self.call_counter)

    @torch.no_grad()
    def record(self, h: torch.Tensor, y: torch.Tensor, ignore_index: int, loss: torch.Tensor,
               z_loss: torch.Tensor | None = None) -> None:
        """Keep one call's batch and the finiteness of its loss on the device: no host sync, three small ops.

        Args:
            h: (T, D) hidden states in the weight's dtype (before any logit scale); kept detached, not copied.
            y: (T,) int64 shifted labels.
            ignore_index: the label value that marks ignored tokens.
            loss: the call's loss (any shape), checked for NaN/Inf.
            z_loss: the call's z-loss term (``MidxConfig.z_loss``), kept as :attr:`z_loss`, or None.
        """
        self.last_batch = (h.detach(), y, ignore_index)
        self.z_loss = None if z_loss is None else z_loss.detach()
        self._queries = None
        if self._counts.device != h.device:  # the head moved without clear(device): the counts follow it
            self._flags, self._counts = self._flags.to(h.device), self._counts.to(h.device)
            self.call_counter = self._counts[1]
            step_state(self._flags, self._counts)
        loss = loss.detach()
        self._flags[:1].add_(loss if loss.dim() == 0 else loss.sum(), alpha=0)  # 0 * NaN or Inf is NaN
        self._counts.add_(self._flags == 0)

    @property
    def queries(self) -> torch.Tensor | None:
        """(min(k, T), D) float32, detached: hidden states of the last recorded call, evenly spaced over its
        non-ignored tokens (repeated when fewer than k; any tokens when none is non-ignored), or None.
        Chosen on the device when first read after a call, without reading the labels back."""
        if self._queries is None and self.last_batch is not None:
            self._queries = _spaced_queries(*self.last_batch, self.kl_queries)
        return self._queries

    def first_nonfinite_call(self) -> tuple[int, str] | None:
        """(index among the recorded calls since :meth:`clear`, cause) of the first call whose loss held NaN/Inf,
        or None. The cause is "hidden states" when the kept last batch's hidden states hold NaN/Inf (a
        non-finite input stays so from step to step), else "loss". Reads small tensors back (device syncs):
        call it at logging steps, not per micro-batch."""
        call, calls = self._counts.tolist()
        if call >= calls:
            return None
        hidden_ok = bool(torch.isfinite(self.last_batch[0]).all())
        return call, NONFINITE_CAUSES[2 if hidden_ok else 1]


@torch.no_grad()
def _spaced_queries(h: torch.Tensor, y: torch.Tensor, ignore_index: int, k: int) -> torch.Tensor:
    """(min(k, T), D) float32 rows of ``h``: the j-th is the (1 + floor(j (count - 1) / (k - 1)))-th
    non-ignored token, found where the running count of non-ignored tokens first reaches that rank."""
    valid = y != ignore_index
    count = valid.sum()
    # No token counts: choose among all tokens (their hidden states are still the model's).
    valid = valid | (count == 0)
    count = torch.where(count == 0, torch.full_like(count, y.shape[0]), count)
    k = min(k, y.shape[0])
    rank = torch.arange(k, device=h.device) * (count - 1) // max(k - 1, 1) + 1
    rows = torch.searchsorted(valid.long().cumsum(0), rank).clamp_max(y.shape[0] - 1)
    return h[rows].float()


__all__ = ["NONFINITE_CAUSES", "StepData"]
