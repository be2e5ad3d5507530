"""Label smoothing and the z-loss on a sampled softmax: the two terms built on log Z, without the full logits.

Shapes: T tokens, D hidden dims, V classes. For token t with label y, logits o (V,) and log partition function
log Z = logsumexp(o), the full softmax's smoothed and z-regularized loss (Szegedy et al. 2016; PaLM's z-loss) is

    loss_t = (1 - eps) (log Z - o_y) + eps (log Z - mean_i o_i) + w (log Z)^2
           = CE_t + eps (o_y - mean_i o_i) + w (log Z)^2

The first line is the Trainer's ``LabelSmoother`` (the mean over the V classes of -log p_i is log Z less the mean
logit). The mean logit is exact without the logits: mean_i o_i = z_t . (sum_i w_i) / V + (sum_i b_i) / V, one (D,)
column sum of the weight per call (in the weight's dtype, accumulated in float32). o_y is exact (one (T, D) gather).
log Z is the sampled loss's own estimate: its value plus o_y (the value estimates log Z - o_y), so the smoothed
loss is exact where the cross-entropy is and estimated where it is.

The gradient. d log Z is the sampled cross-entropy's gradient plus that of o_y (d CE = d log Z - d o_y: the target
of both estimators is the label's logit, up to a constant correction), so

    d loss_t = (1 + 2 w log Z) d CE_t + (eps + 2 w log Z) d o_y - eps d mean_i o_i

with log Z the per-token estimate (detached): a per-token scale of the loss's own gradient (whichever path made it,
eager or fused, with its expected tail gradient) and two exact terms. Ignored tokens count 0; no (T, V) tensor.
"""

from __future__ import annotations

import torch

from .._ops import soft_cap


def check_log_z_terms(z_loss: float, label_smoothing: float, logit_softcap) -> None:
    """A ValueError for a z-loss weight below 0, a smoothing factor outside [0, 1), or smoothing with a soft cap
    (the mean of soft-capped logits is not linear in the weight: it needs the full logits)."""
    if not isinstance(z_loss, (int, float)) or isinstance(z_loss, bool) or not z_loss >= 0:
        raise ValueError(f"z_loss must be a weight >= 0 (e.g. 1e-4; 0 turns it off), got {z_loss!r}.")
    number = isinstance(label_smoothing, (int, float)) and not isinstance(label_smoothing, bool)
    if not number or not 0 <= label_smoothing < 1:
        raise ValueError(f"label_smoothing must be in [0, 1) (e.g. 0.1; 0 turns it off), got {label_smoothing!r}.")
    if label_smoothing and logit_softcap is not None:
        raise ValueError(
            "label_smoothing needs the mean logit, which a logit soft-cap makes depend on every logit (the full "
            f"logits); this head soft-caps at {logit_softcap}. Set label_smoothing=0."
        )


def mean_logit(hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """(T,) mean over the V classes of hidden @ weight.T (+ bias), exact: hidden . sum(weight rows) / V, differentiable.

    Args:
        hidden: (T, D); weight: (V, D); bias: (V,) or None. The column sum is read once, in the weight's dtype,
            accumulated in float32 (float64 for a float64 weight).
    Returns:
        (T,) float32 (float64 for float64 inputs).
    """
    acc = torch.promote_types(weight.dtype, torch.float32)
    column_sum = weight.sum(0, dtype=acc)  # (D,)
    out = hidden.to(acc) @ column_sum
    if bias is not None:
        out = out + bias.sum(dtype=acc)
    return out / weight.shape[0]


def label_logit(hidden, weight, labels, bias=None, logit_softcap=None) -> torch.Tensor:
    """(T,) float32 (float64 for float64 inputs) o_y, each token's logit of its (T,) int64 ``labels`` (ignored
    ones already replaced by a class), soft-capped as the loss does, differentiable: one (T, D) gather."""
    acc = torch.promote_types(weight.dtype, torch.float32)
    out = (weight.index_select(0, labels).to(acc) * hidden.to(acc)).sum(1)
    if bias is not None:
        out = out + bias.index_select(0, labels).to(acc)
    return soft_cap(out, logit_softcap)


def add_log_z_terms(per_token, hidden, weight, labels, valid, *, bias=None, z_loss=0.0, label_smoothing=0.0,
                    logit_softcap=None) -> tuple[torch.Tensor, torch.Tensor]:
    """The per-token sampled cross-entropy with label smoothing and the z-loss added (see the module docstring).

    Args:
        per_token: (T,) float32 sampled cross-entropy (its value an estimate of log Z - o_y, 0 at ignored tokens),
            differentiable; hidden: (T, D) in the weight's dtype; weight: (V, D); labels: (T,) int64, ignored ones
            replaced by a class; valid: (T,) bool; bias: (V,) or None.
        z_loss: w, the weight of (log Z)^2; label_smoothing: eps.
    Returns:
        ((T,) loss, (T,) z-loss term w (log Z)^2, no gradient), both 0 at ignored tokens, float32 (float64 for a
        float64 weight: the exact terms keep their precision).
    """
    o_y = label_logit(hidden, weight, labels, bias, logit_softcap)  # float64 stays so: the terms' exactness
    log_z = (per_token.detach() + o_y.detach()).where(valid, 0.0)
    z_term = z_loss * log_z.square()
    scale = 1 + 2 * z_loss * log_z
    surrogate = per_token * scale + o_y * (scale - 1 + label_smoothing)
    value = per_token.detach() + z_term
    if label_smoothing:
        mean = mean_logit(hidden, weight, bias)
        surrogate = surrogate - label_smoothing * mean
        value = value + label_smoothing * (o_y.detach() - mean.detach())
    surrogate = surrogate.where(valid, 0.0)
    return surrogate + (value.where(valid, 0.0) - surrogate).detach(), z_term


__all__ = ["add_log_z_terms", "check_log_z_terms", "label_logit", "mean_logit"]
