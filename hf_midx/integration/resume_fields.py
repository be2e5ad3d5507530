"""Which :class:`~hf_midx.MidxConfig` changes a resumed run accepts: the one table that classifies every field.

A resume promises the uninterrupted run. A field whose change makes the resumed steps compute another loss,
gradient or draws (``num_samples``, ``tail_gradient``, ``seed``, ``exact_head``...) is *refused*: the checkpoint's
``midx_config.json`` and the model's config are compared before anything is loaded, and the error names each
field with both values. A field that changes how the run goes on, not what a step is (the refresh schedule, the
k-means effort, the kernels, the learned codebooks' optimizer: what a new learning-rate schedule is to the
Trainer), is *noted*: accepted, with one log line saying that the run is no longer the uninterrupted one. A field
that changes only what is logged is *free*.

A field in no set (one added to MidxConfig after this table) is refused: a new field is classified here, and
``tests/integration/test_resume_fields.py`` fails until it is.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Mapping

#: Fields whose change makes the resumed steps compute something else than the uninterrupted run's.
REFUSED = frozenset({
    "sampler", "num_samples", "codebook_size", "negatives", "codebooks", "remove_accidental_hits", "estimator",
    "exact_head", "tail_gradient", "z_loss", "label_smoothing", "mix_weight", "mix_static", "last_stage", "seed",
    "sampler_options",
})  # fmt: skip
#: Fields a resumed run may change: the schedule of rebuilds, their k-means, the kernels (the same loss within
#: float rounding), the learned codebooks' optimizer and KL queries, and how a trainer's log-prob calls are answered
#: (``log_probs``: exact values or an estimate, a choice of cost a run may revise, as of its learning rate).
NOTED = frozenset({
    "refresh_every_steps", "refresh_budget", "refresh_min_steps", "refresh_max_steps", "refresh_every_epoch",
    "kmeans_iters", "kmeans_backend", "kernels", "codebook_learning_rate", "kl_weight", "kl_queries", "log_probs",
})  # fmt: skip
#: Fields that change only what is logged.
FREE = frozenset({"log_kl"})


def resume_class(name: str) -> str:
    """``"refused"``, ``"noted"`` or ``"free"``: what a resume does when field ``name`` changed (unknown: refused)."""
    if name in NOTED:
        return "noted"
    if name in FREE:
        return "free"
    return "refused"


def _plain(value):
    """``value`` as ``midx_config.json`` holds it (tuples become lists), to compare like with like."""
    return json.loads(json.dumps(value))


def config_changes(saved: Mapping, config) -> tuple[list[str], list[str]]:
    """The fields of ``config`` (a :class:`~hf_midx.MidxConfig`, as the model's head uses it) that differ from
    ``saved`` (a checkpoint's ``midx_config.json``, a dict): (refused, noted), each entry
    ``"name: checkpoint <value>, now <value>"``.

    A field the checkpoint lacks (written by an older hf-midx) is compared with the field's default; a key of the
    checkpoint that is no field (a newer hf-midx, or the ``"chosen"`` stamp) is left out.
    """
    refused, noted = [], []
    for f in dataclasses.fields(config):
        default = f.default_factory() if f.default is dataclasses.MISSING else f.default
        before, now = _plain(saved.get(f.name, default)), _plain(getattr(config, f.name))
        if before == now:
            continue
        kind = resume_class(f.name)
        if kind != "free":
            (refused if kind == "refused" else noted).append(f"{f.name}: checkpoint {before!r}, now {now!r}")
    return refused, noted


__all__ = ["FREE", "NOTED", "REFUSED", "config_changes", "resume_class"]
