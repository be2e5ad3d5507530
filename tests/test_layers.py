"""The layering of hf_midx/ read from its imports (``ast``, nothing imported): no circle of imports between its
files, and at most 7 floors from the leaves to the top, ``hf_midx/__init__.py``, counted as ``farm-studio look``
counts them (a subpackage directly under hf_midx, ``indexing/``, ``samplers/``, ``losses/`` or ``integration/``,
is one room; floor 1 imports nothing of the package).

The folders show the layers (issue 48): at most 12 modules directly under hf_midx/ (the public face and small
shared helpers); the algorithm (``indexing``, ``samplers``) and the loss (``losses``) in plain PyTorch, with no
arrow into the transformers layer (``integration``), the one package that imports transformers; no function
over 80 lines of code.

An arrow A -> B is an import that runs B when A runs: ``from .x import y`` runs ``hf_midx.x`` (and ``hf_midx.x.y``
when that is a module), ``from .pkg.mod import y`` runs ``pkg/__init__`` too (unless A is inside ``pkg``, which
is then already running). Imports inside functions count (they run on the first call), and so do those under
``if TYPE_CHECKING:`` (a type is a dependency too, and farm-studio draws them). The names that ``__init__``
loads lazily (``_LAZY``, by ``importlib``) are no arrow, as for farm-studio: their modules (the trainer) are
held to the same 7 floors.
"""

from __future__ import annotations

import ast
from functools import cache
from pathlib import Path

import pytest

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
# callback a scheduler, MidxTrainer the callback plus exact evaluation. Raised this round (each file still holds
# its one idea): the head holds its kernel guard (issue 51: an attribute, an import, a call; the guard is
# kernel_guard.py), the frozen property and the z-loss record (issue 55), times its build and sizes an "auto" exact
# head (issue 54); the callback hands the Trainer's label_smoothing_factor to the head and keeps a frozen head's
# index (55), adds eval_perplexity and drops TRL's NaN metrics (56), logs each rebuild's reason and ESS and carries the refresh schedule's state (54); the config has
# z_loss, label_smoothing (55) and the refresh budget and bounds (54), each with its help and checks.
# samplers/base.py 450 -> 465 and samplers/midx.py 450 -> 480: has_fused_draw, the hook by which the loss offers a
# sampler its Triton draw, and MIDX's fused branch of its draw with the log q it reads from the codeword scores (51).
# config.py 530 -> 545: log_probs, how a trainer's log-prob calls are answered, with its help and check (67).
# head.py 285 -> 310 (issue 68): prepare_kernels, the probe of "auto" before a compiled or captured first step (the
# guard itself stays kernel_guard.py), and the autocast dtype of its products; 310 -> 330 (67): exact_log_probs, the
# head's third answer beside the sampled and the exact loss (exact values, sampled gradient).
# callback 370 -> 390 (issue 70): midx/train_loss_exact measured before the optimizer step (on_pre_optimizer_step and
# logs_after_step, which foresees the Trainer's logging steps), still the callback's one idea: the schedule;
# 390 -> 405 (67): it hands the trainer's log-prob decision to the binding and rebuilds no index that no call draws from.
# head.py 330 -> 340 (75): exact-forward's products in TRL's dtype and its values from TRL's own fold on GPUs
# (integration/trl_log_probs.py), and a refresh zeroes the count of unrefreshed calls.
# config.py 545 -> 560 (73): the warning of the paper's text estimator without an exact head, its own check.
MAX_LINES = {"hf_midx.config": 560, "hf_midx.integration.head": 340, "hf_midx.integration.callback": 405,
             "hf_midx.samplers.base": 465, "hf_midx.samplers.midx": 480}


def test_each_file_holds_one_idea():
    for name, path in MODULES.items():
        lines = len(path.read_text().splitlines())
        assert lines <= MAX_LINES.get(name, 450), f"{path.relative_to(PACKAGE.parent)} has {lines} lines"
    trainer = ast.parse(MODULES["hf_midx.integration.trainer"].read_text())
    (cls,) = [n for n in trainer.body if isinstance(n, ast.ClassDef) and n.name == "MidxTrainer"]
    assert cls.end_lineno - cls.lineno + 1 <= 120, f"MidxTrainer has {cls.end_lineno - cls.lineno + 1} lines"


# ------------------------------------------------------------------------------------------------ the folders
MAX_TOP_MODULES = 12
TRANSFORMERS_LAYER = "hf_midx.integration"
ALGORITHM_AND_LOSS = ("hf_midx.indexing", "hf_midx.samplers", "hf_midx.losses")
MAX_CODE_LINES = 80


def _inside(name: str, package: str) -> bool:
    return name == package or name.startswith(package + ".")


def test_at_most_twelve_modules_at_the_top():
    top = sorted(p.name for p in PACKAGE.glob("*.py"))
    assert len(top) <= MAX_TOP_MODULES, f"{len(top)} modules directly under hf_midx/ (at most {MAX_TOP_MODULES}): {top}"
    for package in (TRANSFORMERS_LAYER, *ALGORITHM_AND_LOSS):
        assert _is_package(package), f"{package} is not a package"
        doc = ast.get_docstring(ast.parse(MODULES[package].read_text())) or ""
        summary = doc.split("\n\n")[0].splitlines()
        assert 1 <= len(summary) <= 2, f"{package}/__init__.py opens with what the layer is, in two lines at most"


def _imports_transformers(name: str) -> bool:
    for node in ast.walk(ast.parse(MODULES[name].read_text())):
        if isinstance(node, ast.Import):
            modules = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and not node.level:
            modules = [node.module or ""]
        else:
            continue
        if any(m == "transformers" or m.startswith("transformers.") for m in modules):
            return True
    return False


def test_transformers_is_imported_in_one_package_only():
    importers = {name for name in MODULES if _imports_transformers(name)}
    assert "hf_midx.integration.binding" in importers  # the reader finds them: the binding does import it
    outside = sorted(name for name in importers if not _inside(name, TRANSFORMERS_LAYER))
    assert outside == [], f"transformers imported outside {TRANSFORMERS_LAYER}: {outside}"


def test_only_the_top_imports_the_transformers_layer():
    # The algorithm and the loss stay usable without transformers: no arrow from them into the layer above,
    # nor from any module outside it but the package's face.
    for name, targets in GRAPH.items():
        if name == "hf_midx" or _inside(name, TRANSFORMERS_LAYER):
            continue
        up = sorted(t for t in targets if _inside(t, TRANSFORMERS_LAYER))
        assert up == [], f"{name} imports the transformers layer: {up}"
    assert any(_inside(t, TRANSFORMERS_LAYER) for t in GRAPH["hf_midx"])  # the reader sees the arrows there are
    for package in ALGORITHM_AND_LOSS:
        assert any(_inside(name, package) for name in GRAPH), f"{package} is read"


def code_lines(source_lines: list[str], node: ast.FunctionDef | ast.AsyncFunctionDef) -> int:
    """Lines of code of a function: its lines less its docstring, comments and blank lines."""
    lines = set(range(node.lineno, node.end_lineno + 1))
    first = node.body[0]
    if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant) and isinstance(first.value.value, str):
        lines -= set(range(first.lineno, first.end_lineno + 1))
    return sum(1 for i in lines if source_lines[i - 1].strip() and not source_lines[i - 1].lstrip().startswith("#"))


def test_no_function_over_80_lines_of_code():
    example = ast.parse('def f(x):\n    """Doc\n    string."""\n    # why\n\n    y = x\n    return y\n').body[0]
    assert code_lines(['def f(x):', '    """Doc', '    string."""', '    # why', '', '    y = x', '    return y'],
                      example) == 3  # the counter itself: def, y = x, return y
    long = []
    for name, path in MODULES.items():
        text = path.read_text()
        lines = text.splitlines()
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and code_lines(lines, node) > MAX_CODE_LINES:
                long.append(f"{name}.{node.name} ({code_lines(lines, node)} lines of code)")
    assert long == [], f"functions over {MAX_CODE_LINES} lines of code: {long}"


def test_the_wheel_lists_every_package():
    # setuptools ships the packages pyproject.toml lists, and nothing warns about a folder left out (hf_midx.samplers
    # once was): the list must name every package of hf_midx/, and the card template's hf_midx.model_cards.
    tomllib = pytest.importorskip("tomllib")  # Python >= 3.11
    listed = tomllib.loads((PACKAGE.parent / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"]
    on_disk = {name for name in MODULES if _is_package(name)} | {"hf_midx.model_cards"}
    assert sorted(listed) == sorted(on_disk), f"pyproject.toml's packages: {sorted(listed)}, the folders: {sorted(on_disk)}"
