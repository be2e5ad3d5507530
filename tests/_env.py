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
