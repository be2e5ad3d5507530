"""The declared version bounds of pyproject.toml, the one source: as == pins for CI's lower-bounds job, and as the
README's Requirements line (tests/test_versions.py checks the README against it).

    python .ci/bounds.py pins      # name==lower bound, one a line: the core, the trl extra and the test tools
    python .ci/bounds.py readme    # the README's Requirements line
"""

from __future__ import annotations

import re
import sys
import tomllib
from pathlib import Path

PYPROJECT = Path(__file__).resolve().parent.parent / "pyproject.toml"

#: The extras the lower-bounds job installs at their bounds (tests/integration and the README's examples use them);
#: the others (faiss, matplotlib, tensorboard) serve tests outside that job, and triton comes pinned with torch.
PINNED_EXTRAS = ("trl", "dev")
NOT_PINNED = ("faiss-cpu", "matplotlib", "triton")

_BOUND = re.compile(r"^([A-Za-z0-9_.-]+)>=([0-9][0-9.]*)(?:\s*;.*)?$")


def _bounds(requirements: list[str]) -> dict[str, str]:
    """name -> lower bound of each ``name>=x.y`` requirement (markers dropped), in order."""
    found = {}
    for requirement in requirements:
        match = _BOUND.match(requirement.replace(" ", "").replace(";", " ;", 1))
        if match is None:
            raise ValueError(f"pyproject.toml: {requirement!r} is not of the form name>=version")
        found[match.group(1)] = match.group(2)
    return found


def declared(pyproject: Path = PYPROJECT) -> dict:
    """{"python": bound, "dependencies": {name: bound}, "extras": {extra: {name: bound}}} from pyproject.toml."""
    project = tomllib.loads(pyproject.read_text())["project"]
    return {
        "python": project["requires-python"].removeprefix(">="),
        "dependencies": _bounds(project["dependencies"]),
        "extras": {name: _bounds(reqs) for name, reqs in project["optional-dependencies"].items()},
    }


def pins(pyproject: Path = PYPROJECT) -> list[str]:
    """``name==bound`` for the core dependencies and :data:`PINNED_EXTRAS`, one per package."""
    bounds = declared(pyproject)
    chosen = dict(bounds["dependencies"])
    for extra in PINNED_EXTRAS:
        chosen.update((k, v) for k, v in bounds["extras"][extra].items() if k not in NOT_PINNED)
    return [f"{name}=={version}" for name, version in chosen.items()]


def readme_line(pyproject: Path = PYPROJECT) -> str:
    """The README's Requirements line: Python, the core dependencies and the trl extra, each with its lower bound."""
    bounds = declared(pyproject)
    core = ", ".join(f"{name} >= {version}" for name, version in bounds["dependencies"].items())
    trl = ", ".join(f"{name} >= {version}" for name, version in bounds["extras"]["trl"].items())
    return (
        f"Requirements: Python >= {bounds['python']}, {core}; for `.[trl]`, {trl}. `bash .ci/run lower newest` tests "
        "each at this lower bound and at the newest release."
    )


if __name__ == "__main__":
    what = sys.argv[1] if len(sys.argv) > 1 else ""
    if what == "pins":
        print("\n".join(pins()))
    elif what == "readme":
        print(readme_line())
    else:
        sys.exit("usage: python .ci/bounds.py pins|readme")
