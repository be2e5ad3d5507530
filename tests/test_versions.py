"""The declared version bounds: pyproject.toml is the source; the README's Requirements line, the runtime check's
minimums and CI's lower-bound pins are generated from it or held equal to it, and below a bound ``import hf_midx``
fails with one error naming both versions."""

from __future__ import annotations

import importlib.util
import subprocess
import sys

import pytest

from _env import REPO, offline_env
from hf_midx.version import MINIMUM_VERSIONS, check_versions

tomllib = pytest.importorskip("tomllib")  # Python >= 3.11; .ci/bounds.py needs it too


def _bounds_module():
    spec = importlib.util.spec_from_file_location("ci_bounds", REPO / ".ci" / "bounds.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_readme_requirements_line_is_generated_from_pyproject():
    line = _bounds_module().readme_line()
    readme = (REPO / "README.md").read_text(encoding="utf-8").splitlines()
    assert line in readme, f"README.md's Requirements line is stale; regenerate it: python .ci/bounds.py readme\n{line}"
    assert "torch >= " + MINIMUM_VERSIONS["torch"] in line


def test_the_runtime_minimums_are_pyprojects_bounds():
    declared = _bounds_module().declared()["dependencies"]
    assert {name: declared[name] for name in MINIMUM_VERSIONS} == MINIMUM_VERSIONS


def test_the_lower_bound_pins_name_every_core_dependency_once():
    bounds = _bounds_module()
    pins = bounds.pins()
    names = [pin.split("==")[0] for pin in pins]
    assert len(names) == len(set(names))
    assert {f"{k}=={v}" for k, v in bounds.declared()["dependencies"].items()} <= set(pins)
    assert "trl==" + bounds.declared()["extras"]["trl"]["trl"] in pins


@pytest.mark.parametrize(
    "installed, ok",
    [
        ({"torch": "2.7.0a0+79aa17489c.nv25.04", "transformers": "4.57.1"}, True),  # NVIDIA's builds of 2.7
        ({"torch": "2.13.0+cpu", "transformers": "5.24.0"}, True),
        ({"torch": "2.6.0", "transformers": "5.24.0"}, False),
        ({"torch": "2.13.0", "transformers": "4.57.0"}, False),
    ],
)
def test_check_versions_compares_release_numbers(installed, ok):
    if ok:
        check_versions(installed)
    else:
        with pytest.raises(ImportError, match=r"hf_midx needs \S+ >= \S+ \(installed: \S+\): pip install -U"):
            check_versions(installed)


def test_import_below_a_bound_is_one_error_naming_both_versions(tmp_path):
    # A fake transformers 4.46.3 distribution ahead of the real one on sys.path: the metadata is all the check reads.
    info = tmp_path / "transformers-4.46.3.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: transformers\nVersion: 4.46.3\n")
    env = offline_env(PYTHONPATH=f"{tmp_path}:{REPO}")
    done = subprocess.run([sys.executable, "-c", "import hf_midx"], env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode != 0
    last = done.stderr.strip().splitlines()[-1]
    assert last == (
        "ImportError: hf_midx needs transformers >= 4.57.1 (installed: 4.46.3): pip install -U 'transformers>=4.57.1'"
    ), done.stderr
