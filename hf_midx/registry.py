"""The registry of samplers by name, their option tables, and :func:`build_sampler`.

Each module of :mod:`hf_midx.samplers` adds its classes with ``@register`` (importing ``hf_midx``
registers them all); :class:`hf_midx.MidxConfig` reads the names and option tables from here to check
a config before any sampler is built. A plain table at the bottom of the package: it imports no sampler
(a class is a subclass of :class:`hf_midx.Sampler` with ``name``, ``options`` and ``check_options``).
"""

from __future__ import annotations

import torch

from . import defaults

#: Sampler name -> class, in registration order (MIDX first); filled by the modules of hf_midx.samplers.
SAMPLERS: dict[str, type] = {}


def register(cls: type) -> type:
    """Class decorator: add a sampler class to :data:`SAMPLERS` under its ``name``."""
    if not cls.name or cls.name in SAMPLERS:
        raise ValueError(f"A sampler needs a new, non-empty name; got {cls.name!r}.")
    SAMPLERS[cls.name] = cls
    return cls


def all_sampler_options() -> tuple[str, ...]:
    """Every option some registered sampler reads, in first-seen order."""
    seen: dict[str, None] = {}
    for cls in SAMPLERS.values():
        seen.update(dict.fromkeys(cls.options))
    return tuple(seen)


def check_sampler_options(name: str, options: dict) -> None:
    """Refuse options that no sampler reads (typos), options of another sampler than ``name``, and values
    that sampler refuses (its :meth:`Sampler.check_options`).

    The per-sampler option table is each class's ``options``; raises ValueError naming the sampler(s)
    an option belongs to.
    """
    if name not in SAMPLERS:
        raise ValueError(f"Unknown sampler {name!r}; known samplers: {', '.join(sorted(SAMPLERS))}.")
    known = all_sampler_options()
    unknown = sorted(str(k) for k in options if k not in known)
    if unknown:
        raise ValueError(f"Unknown sampler option(s) {unknown}; known options: {', '.join(known)}.")
    own = SAMPLERS[name].options
    foreign = sorted(k for k in options if k not in own)
    if foreign:
        owners = {k: sorted(n for n, c in SAMPLERS.items() if k in c.options) for k in foreign}
        said = "; ".join(f"{k!r} belongs to {', '.join(v)}" for k, v in owners.items())
        raise ValueError(
            f"Sampler option(s) {foreign} do not apply to sampler {name!r} ({said}); "
            f"{name!r} takes: {', '.join(own) or 'no options'}."
        )
    SAMPLERS[name].check_options(**options)


def check_option_values(options: dict) -> None:
    """Validate option values whatever sampler is chosen: each by the first registered sampler that reads it.

    For settings kept beside a sampler's name (the option fields of :class:`hf_midx.MidxConfig`), which
    must be valid even while the chosen sampler ignores them. Raises ValueError for an unknown option.
    """
    for key, value in options.items():
        owner = next((cls for cls in SAMPLERS.values() if key in cls.options), None)
        if owner is None:
            raise ValueError(f"Unknown sampler option {key!r}; known options: {', '.join(all_sampler_options())}.")
        owner.check_options(**{key: value})


def build_sampler(
    name: str,
    embeddings: torch.Tensor,
    *,
    codebook_size: int = defaults.CODEBOOK_SIZE,
    class_counts: torch.Tensor | None = None,
    exclude: torch.Tensor | None = None,
    seed: int = defaults.SEED,
    **options,
):
    """Build the proposal ``name`` over (V, D) class ``embeddings``: a :class:`hf_midx.Sampler`.

    Every option left out takes the default of :class:`hf_midx.MidxConfig` (:mod:`hf_midx.defaults`):
    ``build_sampler(config.sampler, w, class_counts=c, **MidxConfig().sampler_kwargs())`` and
    ``build_sampler("midx-rq", w, class_counts=c)`` are the same sampler. The exact head is not the
    sampler's: ``exclude`` is empty unless given.

    Args:
        name: one of :data:`SAMPLERS` ("midx-rq", "midx-pq", "midx-exact", "uniform", "unigram",
            "log-uniform", "sphere", "rff", "lsh").
        embeddings: (V, D) float tensor (e.g. the LM head weight); the sampler lives on its device.
        codebook_size: K for the MIDX samplers (ignored by the others), at most V.
        class_counts: (V,) training-token counts (unigram: required; log-uniform: optional ranking;
            MIDX: for the unigram component of the defensive mixture and the frequency last stage;
            without them a MIDX sampler mixes in nothing, with a warning).
        exclude: optional (H,) int64 class ids the proposal must never draw (the exact head, which
            the loss scores exactly): the sampler indexes only the other V - H classes, returns
            global ids, and gives excluded ids log-probability -inf.
        seed: seeds the sampler's own generator and its random structures.
        **options: options of this sampler (each class's ``options``); an unknown option, one of
            another sampler, or a value the sampler refuses raises ValueError.
    """
    check_sampler_options(name, options)
    return SAMPLERS[name](
        embeddings, codebook_size=codebook_size, class_counts=class_counts, exclude=exclude, seed=seed, **options
    )
