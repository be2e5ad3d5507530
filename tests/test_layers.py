"""The layering of hf_midx/ read from its imports (``ast``, nothing imported): no circle of imports between its
files, and at most 7 floors from the leaves to the top, ``hf_midx/__init__.py``, counted as ``farm-studio look``
counts them (a subpackage, ``samplers/`` or ``kernels/``, is one room; floor 1 imports nothing of the package).

An arrow A -> B is an import that runs B when A runs: ``from .x import y`` runs ``hf_midx.x`` (and ``hf_midx.x.y``
when that is a module), ``from .pkg.mod import y`` runs ``pkg/__init__`` too (unless A is inside ``pkg``, which
is then already running). Imports inside functions count (they run on the first call), and so do those under
``if TYPE_CHECKING:`` (a type is a dependency too, and farm-studio draws them). The names that ``__init__``
loads lazily (``_LAZY``, by ``importlib``) are no arrow, as for farm-studio: their modules (the trainer) are
rooms of their own, held to the same 7 floors.
"""

from __future__ import annotations

import ast
from functools import cache
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "hf_midx"
MAX_FLOORS = 7


def _module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {_module_name(p): p for p in sorted(PACKAGE.rglob("*.py"))}


def _is_package(name: str) -> bool:
    return MODULES[name].name == "__init__.py"


def _ran(importer: str, target: str) -> set[str]:
    """``target`` and the packages above it that importing it runs, seen from ``importer``."""
    ran, parts = set(), target.split(".")
    for i in range(2, len(parts) + 1):  # "hf_midx" itself always runs first: not an edge
        name = ".".join(parts[:i])
        if name in MODULES and not (importer + ".").startswith(name + "."):
            ran.add(name)
    return ran


def _edges(name: str) -> set[str]:
    tree = ast.parse(MODULES[name].read_text())
    here = name if _is_package(name) else name.rpartition(".")[0]
    out: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
            if "hf_midx" in targets:
                out.add("hf_midx")  # the package's face: the top itself
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = here.split(".")[: len(here.split(".")) - node.level + 1]
                base = ".".join([*anchor, *([base] if base else [])])
            targets = [base] + [f"{base}.{alias.name}" for alias in node.names]
            if base == "hf_midx" and any(f"hf_midx.{a.name}" not in MODULES for a in node.names):
                out.add("hf_midx")  # a name of the package's face, not a submodule: the top itself
        else:
            continue
        for target in targets:
            if target == "hf_midx" or target.startswith("hf_midx."):
                out |= _ran(name, target)
    return out - {name}


GRAPH = {name: _edges(name) for name in MODULES}


def _circle() -> list[str] | None:
    """One circle of imports as a list of modules (first == last), or None."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done

    def visit(name: str, path: list[str]) -> list[str] | None:
        state[name] = 1
        for nxt in sorted(GRAPH[name]):
            if state.get(nxt) == 1:
                return [*path[path.index(nxt) :], nxt]
            if nxt not in state and (found := visit(nxt, [*path, nxt])):
                return found
        state[name] = 2
        return None

    for name in sorted(GRAPH):
        if name not in state and (found := visit(name, [name])):
            return found
    return None


def _room(name: str) -> str:
    """The room of a module: itself, or its subpackage directly under hf_midx (``hf_midx.samplers``)."""
    return ".".join(name.split(".")[:2])


ROOMS = {}
for _name, _targets in GRAPH.items():
    ROOMS.setdefault(_room(_name), set()).update(_room(t) for t in _targets if _room(t) != _room(_name))


@cache
def _longest_chain(room: str) -> tuple[str, ...]:
    """The longest chain of arrows from ``room`` down to a room that imports nothing of the package."""
    below = [_longest_chain(nxt) for nxt in sorted(ROOMS[room])]
    return (room, *max(below, key=len, default=()))


def test_the_graph_is_read():
    # A check of the reader itself: these arrows exist, so a reader that finds none is broken.
    assert "hf_midx.samplers.midx" in GRAPH["hf_midx.samplers"]
    assert "hf_midx.indexing.index" in GRAPH["hf_midx.samplers.midx"]
    assert {"hf_midx.samplers", "hf_midx.integration.wrap"} <= GRAPH["hf_midx"]
    assert "hf_midx.samplers" not in GRAPH["hf_midx.samplers.base"]  # its own package: already running
    assert {"hf_midx.indexing", "hf_midx.registry"} <= ROOMS["hf_midx.samplers"]


def test_no_circle_of_imports():
    circle = _circle()
    assert circle is None, "circle of imports: " + " -> ".join(circle)


def test_at_most_seven_floors_from_the_top():
    assert _circle() is None, "a circle has no longest chain: see test_no_circle_of_imports"
    for room in ["hf_midx", *sorted(ROOMS)]:  # the top first, then any room (the trainer) it loads lazily
        chain = _longest_chain(room)
        assert len(chain) <= MAX_FLOORS, (
            f"{room} stands on floor {len(chain)} (at most {MAX_FLOORS}): " + " -> ".join(chain)
        )


# Sizes past which a file holds more than one idea (the house's limits; see CHANGELOG): the head is a layer, the
# callback a scheduler, MidxTrainer the callback plus exact evaluation.
MAX_LINES = {"hf_midx.integration.head": 250, "hf_midx.integration.callback": 300}


def test_each_file_holds_one_idea():
    for name, path in MODULES.items():
        lines = len(path.read_text().splitlines())
        assert lines <= MAX_LINES.get(name, 450), f"{path.relative_to(PACKAGE.parent)} has {lines} lines"
    trainer = ast.parse(MODULES["hf_midx.integration.trainer"].read_text())
    (cls,) = [n for n in trainer.body if isinstance(n, ast.ClassDef) and n.name == "MidxTrainer"]
    assert cls.end_lineno - cls.lineno + 1 <= 120, f"MidxTrainer has {cls.end_lineno - cls.lineno + 1} lines"
