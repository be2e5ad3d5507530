"""The environment of the subprocesses the tests start: offline, and able to import the checkout."""

from __future__ import annotations

import os
from pathlib import Path

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
    env.update(extra)
    return env
