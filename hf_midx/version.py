"""The package version, in one place (pyproject.toml reads it from here), and the versions a run depends on."""

from __future__ import annotations

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
