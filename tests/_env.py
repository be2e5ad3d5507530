"""The environment of the subprocesses the tests start: offline, and able to import the checkout."""

from __future__ import annotations

import os
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parent.parent


def offline_env(**extra: str) -> dict[str, str]:
    """os.environ plus offline Hub/datasets flags and the repository on PYTHONPATH; ``extra`` overrides."""
    env = dict(os.environ)
    env.update(
        HF_HUB_OFFLINE="1",
        HF_DATASETS_OFFLINE="1",
        TRANSFORMERS_OFFLINE="1",
        TOKENIZERS_PARALLELISM="false",
        PYTHONPATH=os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH", "")])),
    )
    if not torch.cuda.is_available():
        # DeepSpeed (a dev dependency), imported by accelerate inside the recipes, otherwise probes for an
        # accelerator and prints its "Setting accelerator to CPU" warning on stdout, which the recipes keep empty.
        env.setdefault("DS_ACCELERATOR", "cpu")
    env.update(extra)
    return env


#: The oldest Triton whose CPU interpreter runs the fused kernels (3.3, torch 2.7's, fails inside them:
#: "only 0-dimensional arrays can be converted to Python scalars").
INTERPRETER_TRITON = (3, 7)


def skip_without_interpreter() -> None:
    """Skip the calling test where Triton is missing or older than :data:`INTERPRETER_TRITON`, saying which."""
    import pytest

    triton = pytest.importorskip("triton", reason="the fused kernels need Triton (Linux x86_64 wheels)")
    release = tuple(int(p) for p in triton.__version__.split("+")[0].split(".")[:2])
    if release < INTERPRETER_TRITON:
        needed = ".".join(map(str, INTERPRETER_TRITON))
        pytest.skip(f"Triton's interpreter runs the fused kernels from triton {needed}; installed {triton.__version__}")
