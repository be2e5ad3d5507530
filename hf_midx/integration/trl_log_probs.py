"""exact-forward's values from TRL's own fused head where TRL folds its tiles in Triton (CUDA, XPU).

``MidxConfig(log_probs="exact-forward")`` answers TRL's ``fused_lm_head=True`` calls: the values must be TRL's, in
its rounding, so that a policy's ratio to its old policy (whose log-probs TRL's head computes) is exactly 1 where
the two are one model. On a CPU :func:`hf_midx.losses.log_probs.log_prob_statistics` is TRL's torch fold op for op
(bit for bit, tested). On a GPU TRL folds each tile in a Triton kernel, in another summation order, and a fold in
torch ops would make about 20 float32 passes over every (tokens x classes) tile (the cost model projects 53 ms for
a policy call at V = 262,144, D = 640, T = 8,192 against a 2.8 ms floor): there the values come from TRL's
``trl.kernels.ChunkedLogProbFunction`` itself, called as TRL's head calls it (the non-ignored positions only), without
gradient; only log Z for the sampled backward is derived here (z_y - log p_y).
"""

from __future__ import annotations

import torch

#: TRL's fused head's vocabulary tile (``_CHUNKED_LOGPROB_CHUNK_SIZE``), as :data:`~hf_midx.losses.log_probs.CLASS_TILE`.
TRL_CLASS_TILE = 32768
FIELDS = ("entropy", "log_sum_sq_probs", "mean_logits", "is_top1")


def trl_function():
    """TRL's ``ChunkedLogProbFunction`` (TRL >= 1.16, whose signature this module calls), or None."""
    try:
        import trl
        from packaging.version import Version
        from trl.kernels import ChunkedLogProbFunction
    except ImportError:
        return None
    return ChunkedLogProbFunction if Version(trl.__version__) >= Version("1.16") else None


@torch.no_grad()
def trl_statistics(hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, labels: torch.Tensor,
                   valid: torch.Tensor, transform, dtype: torch.dtype, force: bool = False) -> dict | None:
    """The fields of :func:`~hf_midx.losses.log_probs.log_prob_statistics` plus ``log_probs``, from TRL's function,
    or None where it would not be TRL's Triton fold (a CPU, no TRL >= 1.16) unless ``force`` (tests).

    Args:
        hidden: (T, D); weight: (V, D); bias: (V,) or None; labels: (T,) int64 in [0, V); valid: (T,) bool;
        transform: the :class:`~hf_midx.losses.log_probs.LogitTransform`; dtype: of the products (z_y's here).
    Returns:
        (T,) each, 0 (False) where not ``valid``: float32 ``log_probs`` (TRL's values), ``entropy``,
        ``log_sum_sq_probs``, ``mean_logits``, bool ``is_top1``, and ``label_logit`` / ``log_z`` (z_y in the
        products' dtype, log Z = z_y - log p_y: for the backward only).
    """
    function = trl_function()
    if function is None or not (force or hidden.device.type in ("cuda", "xpu")):
        return None
    # As TRL's head calls it on these devices: the non-ignored positions only (a data-dependent shape and a sync,
    # as TRL's own exact head has), so that its tiles' GEMMs are the same shape and round the same way.
    rows = valid.nonzero()[:, 0]
    values = function.apply(hidden[rows], weight, bias, labels[rows], transform.temperature, TRL_CLASS_TILE,
                            transform.softcap, transform.scale, ("log_probs", *FIELDS))
    out = {name: torch.zeros(hidden.shape[0], dtype=v.dtype, device=v.device).index_copy_(0, rows, v)
           for name, v in zip(("log_probs", *FIELDS), values)}
    with torch.autocast(hidden.device.type, enabled=False):
        raw = (hidden.to(dtype) * weight[labels].to(dtype)).sum(-1)
        if bias is not None:
            raw = raw + bias[labels].to(dtype)
        out["label_logit"] = transform(raw.float())
    out["log_z"] = out["label_logit"] - out["log_probs"]
    return out


__all__ = ["TRL_CLASS_TILE", "trl_function", "trl_statistics"]
