"""The package version, in one place (pyproject.toml reads it from here), the versions a run depends on, and the
oldest releases of them hf_midx runs with."""

from __future__ import annotations

import re

__version__ = "0.1.0"

#: The distributions a training run depends on, in the order :func:`versions` lists them.
_RUN_DEPENDENCIES = ("torch", "transformers", "accelerate", "huggingface_hub")


def versions() -> dict[str, str]:
    """hf_midx's version and those of torch, transformers, accelerate, huggingface_hub and Python.

    For a model card's "Framework versions" and a run's results file. Read from the installed
    packages' metadata, so nothing is imported; a package that is not installed is left out.
    """
    import platform
    from importlib.metadata import PackageNotFoundError, version

    found = {"hf_midx": __version__}
    for name in _RUN_DEPENDENCIES:
        try:
            found[name] = version(name)
        except PackageNotFoundError:  # accelerate is needed by the Trainer only, not by a card
            continue
    found["python"] = platform.python_version()
    return found


#: The oldest release of each run dependency that hf_midx works with: pyproject.toml's lower bounds (the source;
#: tests/test_versions.py holds the two equal), checked by :func:`check_versions` at ``import hf_midx``.
#: torch 2.7: ``torch.library.custom_op`` infers the fused kernels' schemas (strings, ``list[int]``) and
#: ``nn.Module.set_submodule`` exists; transformers 4.57.1: the last 4.x line (4.57.0 was yanked).
MINIMUM_VERSIONS = {
    "torch": "2.7",
    "transformers": "4.57.1",
    "accelerate": "1.4",
    "huggingface_hub": "0.34",
    "safetensors": "0.4.3",
}


def check_versions(installed: dict[str, str] | None = None) -> None:
    """Raise ImportError naming the installed and the needed versions where a run dependency is older than
    :data:`MINIMUM_VERSIONS`; ``installed`` (name -> version) replaces the installed packages' metadata.

    Only the release numbers are compared, so a vendor's pre-release build of a supported version (NVIDIA's
    containers ship torch ``2.7.0a0+...``) passes. A package that is not installed is left to its importer.
    """
    from importlib.metadata import PackageNotFoundError, version

    too_old = []
    for name, needed in MINIMUM_VERSIONS.items():
        try:
            found = installed[name] if installed is not None else version(name)
        except (KeyError, PackageNotFoundError):
            continue
        if _release(found) < _release(needed):
            too_old.append((name, found, needed))
    if too_old:
        needs = ", ".join(f"{name} >= {needed} (installed: {found})" for name, found, needed in too_old)
        pins = " ".join(f"'{name}>={needed}'" for name, _, needed in too_old)
        raise ImportError(f"hf_midx needs {needs}: pip install -U {pins}")


def _release(text: str) -> tuple[int, ...]:
    """The release numbers a version string starts with: (2, 7, 0) for "2.7.0a0+79aa174.nv25.04"."""
    return tuple(int(part) for part in re.match(r"\d+(?:\.\d+)*", text).group().split("."))
