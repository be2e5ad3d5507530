"""README.md: every command in it runs, its Python usage runs, and the facts it quotes match the code.

The fenced ``bash`` blocks are parsed; the test command (after ``<!-- test-command -->``) is only
checked for its exact text, since CI runs it. Every other command must be a recipe command; it is run
offline (on the shipped WikiText-2 sample), with its ``--max_steps`` divided by 100 (at least 1), runs
under ``runs/`` moved to a temporary folder, local data files replaced by text made here, evaluation
cut to a few blocks and ``--vocab_size`` capped at 5,000. Launchers (``torchrun``, ``accelerate launch``)
run as written: on a machine without GPUs the recipe itself makes their processes one DDP job on the CPU
(``--use_cpu`` is added only where there are GPUs, but fewer than the command's processes), and the test
checks the world size. The install steps before ``&&`` (a virtualenv, PyTorch's CPU build, then
``pip install -e .``) are checked for their text, not re-run: the package is installed where the tests run.
Every ``python`` block runs as written, each in its own process and folder, offline.
"""

from __future__ import annotations

import ast
import inspect
import json
import re
import shlex
import subprocess
import sys
from collections import defaultdict
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch
from _env import offline_env

REPO = Path(__file__).resolve().parents[1]
README = REPO / "README.md"

TEST_COMMAND = 'pip install -e ".[dev]" && python -m pytest -q -n auto --dist worksteal tests'
# PyTorch's CPU index as an extra index with a pinned release: its `+cpu` build outranks PyPI's (CUDA) one
# of the same version, and where only PyPI (or a mirror) is reachable pip still finds the release there.
# An unpinned `torch` would take the newest release of any index, a CUDA build where PyPI offers one.
CPU_TORCH = ["pip", "install", "torch==2.13.0", "--extra-index-url", "https://download.pytorch.org/whl/cpu"]
INSTALL = ["pip", "install", "-e", "."]
VENV = [["python", "-m", "venv", ".venv"], [".", ".venv/bin/activate"]]
LAUNCHERS = {
    "python": [sys.executable],
    "torchrun": [sys.executable, "-m", "torch.distributed.run"],
    "accelerate launch": [sys.executable, "-m", "accelerate.commands.launch"],
}
#: The flag that gives a launcher's rendezvous its own port: launches that run at the same time must not
#: share the default 29500.
PORT_FLAG = {"torchrun": "--master_port", "accelerate launch": "--main_process_port"}


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


SCRIPTS = {"recipes/wikitext2.py", "recipes/large_vocab.py"}
QUICK = {
    "recipes/wikitext2.py": ["--max_eval_samples", "8"],
    "recipes/large_vocab.py": ["--train_tokens", "2000", "--eval_tokens", "400", "--test_tokens", "400"],
}


def fenced_blocks(text: str, language: str) -> list[str]:
    return [m.group(2) for m in re.finditer(r"^```(\w*)\n(.*?)^```", text, re.M | re.S) if m.group(1) == language]


def bash_commands(text: str) -> list[str]:
    commands = []
    for block in fenced_blocks(text, "bash"):
        joined = block.replace("\\\n", " ")
        commands += [line.strip() for line in joined.splitlines() if line.strip() and not line.strip().startswith("#")]
    return commands


def readme() -> str:
    return README.read_text(encoding="utf-8")


def test_the_test_command_follows_its_marker_on_one_line():
    after = readme().split("<!-- test-command -->", 1)
    assert len(after) == 2, "the <!-- test-command --> marker is gone"
    match = re.match(r"\s*```bash\n(.*?)```", after[1], re.S)
    assert match, "the marker must be followed by a ```bash block"
    assert match.group(1).strip().splitlines() == [TEST_COMMAND]


def is_install(command: str) -> bool:
    """A command of install steps only (the virtualenv, PyTorch's CPU build, the package)."""
    return all(shlex.split(part) in (INSTALL, CPU_TORCH, *VENV) for part in command.split("&&"))


def test_first_command_installs_cpu_torch_before_the_package_and_the_first_run_comes_apart():
    """In a new virtualenv, a fresh CPU machine gets PyTorch's CPU build first; `pip install -e .` then keeps it.
    The first training run is a command of its own, so that a failure in it does not read as a failed install."""
    first, second = bash_commands(readme())[:2]
    steps = [shlex.split(part) for part in first.split("&&")]
    assert steps == [*VENV, CPU_TORCH, INSTALL]
    assert shlex.split(second)[:2] == ["python", "recipes/wikitext2.py"] and "&&" not in second
    assert re.search(r"about \d+ minutes? on an? (?:idle )?2-core CPU", readme().split("## Usage", 1)[0])  # how long
    assert "With an NVIDIA GPU" in readme().split("## Usage", 1)[0]  # and what a GPU user does instead
    # CI pins the same CPU build from the same index where it resolves (PyPI stays an index, for machines that only
    # reach PyPI or a mirror).
    ci = (REPO / ".ci" / "run").read_text(encoding="utf-8")
    assert f"python -m pip install -q {CPU_TORCH[2]} " in ci and f"CPU_INDEX=({' '.join(CPU_TORCH[3:])})" in ci


def test_readme_is_short_leads_with_the_decision_and_its_links_resolve():
    lines = readme().splitlines()
    # 220 -> 240: issue 55's config rows and frozen-head line, issue 56's traced sources, Install block and midx/* rows,
    # issue 53's Requirements line; 245 -> 252: issue 70's sampler_options line, the Quick start's source, resize /
    # merge / resume refusals; 252 -> 290: issue 67's table of TRL trainers and what each gets; 290 -> 310: issue 77's
    # Axolotl section (a YAML example, what the plugin does and refuses, the versions it was tested with); 310 -> 330:
    # issue 73's bullet on the paper's own setting, issue 75's loop refresh and loss-bias range.
    assert len(lines) <= 330, len(lines)
    decision = next(i for i, line in enumerate(lines) if line.startswith("## When to use it"))
    assert decision < 40 and "Cut Cross-Entropy" in "\n".join(lines[decision : decision + 20])
    assert not re.search(r"\b(sessions?|rounds?)\b", readme()), "process words belong to no user's README"
    for document in (README, REPO / "docs" / "performance.md"):
        text = document.read_text(encoding="utf-8")
        for target in re.findall(r"\]\(([^)#]+)(?:#[^)]*)?\)", text):
            if not target.startswith("http"):
                assert (document.parent / target).exists(), f"{document.name} links to a missing {target}"
    assert "docs/performance.md" in readme()


# ---------------------------------------------------------------------- the recipe commands
def write_text_files(directory: Path) -> dict[str, Path]:
    import random

    rng = random.Random(1)
    words = [f"w{i}" for i in range(150)]
    directory.mkdir(parents=True, exist_ok=True)
    files = {}
    for name, lines in (("train", 300), ("valid", 60), ("test", 60)):
        text = "\n".join(" " + " ".join(rng.choices(words, k=rng.randint(0, 15))) + " " for _ in range(lines)) + "\n"
        files[name] = directory / f"{name}.txt"
        files[name].write_text(text, encoding="utf-8")
    return files


def plan(command: str, tmp: Path, files: dict[str, Path]) -> tuple[list[str], str, str]:
    """(argv, output_dir, script) for one README command; fails for a command this test does not cover."""
    parts = [shlex.split(part) for part in command.split("&&")]
    runs = [p for p in parts if p not in (INSTALL, CPU_TORCH, *VENV)]
    assert len(runs) == 1, f"README command not covered by tests/test_readme.py: {command!r}"
    tokens = runs[0]
    name = "accelerate launch" if tokens[:2] == ["accelerate", "launch"] else tokens[0]
    if name not in LAUNCHERS:
        raise AssertionError(f"README command not covered by tests/test_readme.py: {command!r}")
    launcher, rest = LAUNCHERS[name], tokens[len(name.split()) :]
    if name in PORT_FLAG:
        launcher = [*launcher, PORT_FLAG[name], str(free_port())]
    scripts = [t for t in rest if t in SCRIPTS]
    assert len(scripts) == 1, f"README command runs no recipe: {command!r}"
    at = rest.index(scripts[0])
    launch_args, args = rest[:at], rest[at + 1 :]
    out = None
    new_args = []
    i = 0
    while i < len(args):
        flag = args[i]
        value = args[i + 1] if i + 1 < len(args) else None
        if flag == "--output_dir":
            out = str(tmp / value)
            new_args += [flag, out]
        elif flag == "--max_steps":
            new_args += [flag, str(max(1, int(value) // 100))]
        elif flag in ("--train_file", "--validation_file", "--test_file"):
            new_args += [flag, str(files[Path(value).stem])]
        elif flag == "--vocab_size":
            new_args += [flag, str(min(int(value), 5000))]
        else:
            new_args.append(flag)
            i += 1
            continue
        i += 2
    assert out is not None, f"README command without --output_dir: {command!r}"
    if 0 < torch.cuda.device_count() < world_size(launch_args):
        new_args.append("--use_cpu")  # a machine with too few GPUs for the command: its processes on the CPU
    argv = [*launcher, *launch_args, str(REPO / scripts[0]), *new_args, *QUICK[scripts[0]]]
    return argv, out, scripts[0]


def world_size(argv: list[str]) -> int:
    """The processes a launcher command starts (1 for python)."""
    for flag in ("--num_processes", "--nproc_per_node"):
        if flag in argv:
            return int(argv[argv.index(flag) + 1])
    return 1


def run_group(
    steps: list[tuple[list[str], str, str]], env: dict[str, str]
) -> list[tuple[list[str], subprocess.CompletedProcess]]:
    done = []
    for argv, _, _ in steps:
        done.append((argv, subprocess.run(argv, cwd=REPO, env=env, capture_output=True, text=True, timeout=600)))
        if done[-1][1].returncode != 0:
            break
    return done


def test_every_readme_command_runs(tmp_path):
    commands = [c for c in bash_commands(readme()) if c != TEST_COMMAND and not is_install(c)]
    assert commands, "README.md has no recipe command"
    files = write_text_files(tmp_path / "text")
    # Commands sharing an output directory run in README order (e.g. train, then resume); others concurrently.
    groups: dict[str, list] = defaultdict(list)
    for command in commands:
        step = plan(command, tmp_path, files)
        groups[step[1]].append(step)
    env = offline_env()
    with ThreadPoolExecutor(max_workers=3) as pool:
        finished = list(pool.map(lambda steps: run_group(steps, env), groups.values()))
    for out, steps, done in zip(groups, groups.values(), finished, strict=True):
        for argv, result in done:
            assert result.returncode == 0, (
                f"{shlex.join(argv)}\nexit {result.returncode}\nstdout:\n{result.stdout[-3000:]}\nstderr:\n{result.stderr[-3000:]}"
            )
        assert len(done) == len(steps)
        results = json.loads((Path(out) / "results.json").read_text())
        assert results["complete"] is True and results["test_perplexity"] > 1
        max_steps = int(steps[-1][0][steps[-1][0].index("--max_steps") + 1])
        assert results["global_step"] == max_steps  # the resume command continued to its new max_steps
        # One job over all the launched processes (DDP on the CPU here), not several separate trainings.
        assert results["world_size"] == world_size(steps[-1][0])
        assert sum(done[-1][1].stderr.count(f"{Path(script).stem} done:") for script in SCRIPTS) == 1


# ---------------------------------------------------------------------- the Python usage
def test_every_python_block_runs(tmp_path):
    """Each ```python block runs as a user would paste it: a fresh process, an empty folder, no network."""
    blocks = fenced_blocks(readme(), "python")
    assert any("SFTTrainer" in b for b in blocks) and any("MidxTrainer" in b for b in blocks)
    env = offline_env(OMP_NUM_THREADS="1")

    def run(item):
        i, block = item
        folder = tmp_path / f"block{i}"
        folder.mkdir()
        (folder / "example.py").write_text(block, encoding="utf-8")
        return subprocess.run(
            [sys.executable, "example.py"], cwd=folder, env=env, capture_output=True, text=True, timeout=600
        )

    with ThreadPoolExecutor(max_workers=2) as pool:
        results = list(pool.map(run, enumerate(blocks)))
    for block, result in zip(blocks, results, strict=True):
        assert result.returncode == 0, f"{block}\nexit {result.returncode}\nstderr:\n{result.stderr[-3000:]}"
    # TRL's SFTTrainer with MidxCallback.install: the callback is in place, so no missing-callback warning.
    sft = results[next(i for i, b in enumerate(blocks) if "SFTTrainer" in b)]
    assert "without MidxCallback" not in sft.stderr


# ---------------------------------------------------------------------- facts quoted from the code
def table_rows(heading: str) -> list[list[str]]:
    section = readme().split(heading, 1)[1].split("\n## ", 1)[0]
    rows = [line for line in section.splitlines() if line.startswith("| ")]
    return [[cell.strip() for cell in re.split(r"(?<!\\)\|", row)[1:-1]] for row in rows[1:]]  # skip the header


def test_sampler_table_lists_the_registry_and_its_option_defaults():
    from hf_midx import SAMPLERS
    from hf_midx.samplers import SAMPLER_OPTIONS

    rows = table_rows("## Samplers")
    names = [row[0].strip("`") for row in rows]
    assert sorted(names) == sorted(SAMPLERS)
    listed = {}
    for name, row in zip(names, rows, strict=True):
        params = {}
        for cls in SAMPLERS[name].__mro__:
            if "__init__" in cls.__dict__:
                for p in inspect.signature(cls.__init__).parameters.values():
                    params.setdefault(p.name, p.default)
        for option, default in re.findall(r"`(\w+)` \(([^)]*)\)", row[2]):
            assert option in SAMPLER_OPTIONS, option
            assert option in params, f"{name} has no option {option}"
            assert ast.literal_eval(default) == params[option], (name, option)
            listed[option] = default
    # Options that are MidxConfig fields (kmeans_iters, last_stage, ...) are in the config table.
    from hf_midx.config import _OPTIONS_WITH_FIELDS

    assert set(listed) == set(SAMPLER_OPTIONS) - set(_OPTIONS_WITH_FIELDS)


def test_sampler_options_are_said_to_be_no_config_fields_and_the_example_runs():
    """The table's options go in sampler_options (MidxConfig(unigram_power=...) is a TypeError): the section says so,
    and its example builds a config."""
    from hf_midx import MidxConfig

    section = readme().split("## Samplers", 1)[1].split("\n## ", 1)[0]
    examples = [" ".join(e.split()) for e in re.findall(r"`(MidxConfig\(.*?\))`", section, re.S)]
    assert len(examples) == 2 and "sampler_options" in examples[0], examples
    assert eval(examples[0], {"MidxConfig": MidxConfig}).sampler_options  # noqa: S307 (the README's own text)
    with pytest.raises(TypeError):
        eval(examples[1], {"MidxConfig": MidxConfig})  # noqa: S307


def test_the_quick_start_figures_are_those_of_its_committed_run():
    """The Quick start's minutes and perplexities are those of the committed run it links (its results.json, and its
    notes for the wall clock), a run of the current defaults."""
    from hf_midx import MidxConfig

    section = readme().split("## Quick start", 1)[1].split("\n## ", 1)[0]
    notes_path = REPO / next(t for _, t in LINK.findall(section) if not t.startswith("http"))
    assert notes_path.is_relative_to(REPO / "recipes/benchmarks/results"), notes_path
    notes = notes_path.read_text(encoding="utf-8")
    results = json.loads((notes_path.parent / "results.json").read_text(encoding="utf-8"))
    command = re.search(r"^```bash\n(python recipes/wikitext2.py [^\n]*)\n```", section, re.M).group(1)
    assert command in notes and results["recipe"] == "wikitext2" and results["complete"]
    assert results["global_step"] == int(command.split("--max_steps ")[1].split()[0]) and results["seed"] == 42
    minutes = int(re.search(r"about (\d+) minutes? on an? (?:idle )?2-core CPU", section).group(1))
    wall = int(re.search(r"wall clock, `/usr/bin/time` \| (\d+) s", notes).group(1))
    assert round(wall / 60) == minutes and f"about {minutes} minute" in notes
    valid, test = re.search(r"validation / test perplexity ([\d.]+) / ([\d.]+) \(seed 42\)", section).groups()
    assert (valid, test) == (f"{results['valid_perplexity']:.1f}", f"{results['test_perplexity']:.1f}")
    # The run is of today's defaults (the recipe's seed and the exact head "auto" chose aside).
    defaults = MidxConfig().to_dict()
    differ = {k: v for k, v in results["midx_config"].items() if k not in ("seed", "exact_head") and defaults[k] != v}
    assert not differ, f"the committed Quick start run used other defaults: {differ}; run it again"


def test_config_table_matches_midx_config_and_the_recipe():
    from hf_midx import MidxConfig
    from recipes import wikitext2

    defaults = MidxConfig()
    rows = table_rows("## Main `MidxConfig` fields")
    assert rows
    for field, default, recipe, _ in rows:
        name = field.strip("`")
        assert ast.literal_eval(default.strip("`")) == getattr(defaults, name), name
        expected = wikitext2.MIDX_DEFAULTS.get(name, getattr(defaults, name))
        if name != "seed":  # the recipes take the MIDX seed from --seed
            assert recipe.strip("`") == str(expected), name


# ---------------------------------------------------------------------- the claims and their files
#: A number as a claim writes it (1,429, 201.7, 15-31x, -1.6%), not inside a name (H200, sm_80, gpt2).
NUMBER = re.compile(r"(?<![\w.])(\d+(?:,\d{3})*(?:\.\d+)?)(?=x?(?!\w))")
LINK = re.compile(r"\[([^\]]*)\]\(([^)]+)\)")


def claims() -> list[str]:
    """The bullets of "When to use it": the README's results, each one line."""
    section = readme().split("## When to use it", 1)[1].split("\n## ", 1)[0]
    return [" ".join(b.split()) for b in re.split(r"\n(?=- )", section.split("\n\n", 1)[1].split("\n\n")[0])]


def numbers(text: str) -> list[str]:
    return NUMBER.findall(text)


def written_as(claim: str, value: str, candidates: list[str]) -> bool:
    """``value`` as the claim writes it is one of ``candidates`` rounded to as many decimals."""
    decimals = len(value.partition(".")[2])
    target = float(value.replace(",", ""))
    return any(abs(float(c.replace(",", "")) - target) <= 0.5 * 10**-decimals + 1e-9 for c in candidates)


def test_every_number_of_the_results_is_in_the_files_its_claim_links():
    """Each claim links the committed files it comes from (results under recipes/benchmarks/results/, or docs/); every
    number in it (outside its links and a `commit abc1234` label) is one of those files' numbers, to the claim's
    rounding. A figure of an older default stays only with its commit named and its file linked."""
    checked = 0
    for claim in claims():
        sources = [REPO / target.split("#")[0] for _, target in LINK.findall(claim) if not target.startswith("http")]
        sources += [path.with_suffix(".json") for path in sources if path.with_suffix(".json").exists()]
        text = re.sub(r"\bcommits? [0-9a-f]{7,40}\b", "", LINK.sub(lambda m: m.group(1), claim))
        found = numbers(text)
        if not found:
            continue
        assert sources, f"a claim with figures links no results file: {claim}"
        for path in sources:
            assert path.is_file() and (path.is_relative_to(REPO / "recipes/benchmarks/results") or
                                       path.is_relative_to(REPO / "docs")), f"{path} is no committed results file"  # fmt: skip
        pool = [n for path in sources for n in re.findall(r"-?\d+(?:,\d{3})*(?:\.\d+)?(?:[eE][-+]?\d+)?", path.read_text())]
        pool = [n.lstrip("-") for n in pool if not re.search(r"[eE]", n)] + [
            repr(abs(float(n))) for n in pool if re.search(r"[eE]", n)]  # fmt: skip
        for value in found:
            assert written_as(claim, value, pool), f"{value} in the README is in none of {[str(p) for p in sources]}"
            checked += 1
    assert checked >= 20
    assert not re.search(r"\d+x (CCE|Liger)'s", readme()), "say a speed-up as 'Nx faster than', not 'Nx CCE's time'"


def test_every_midx_key_the_callback_logs_is_explained():
    """The keys MidxCallback adds to a log entry: the proposal diagnostics (kl_qp logged as midx/kl) and the ones
    it names itself; each has a row in "What the numbers mean"."""
    from hf_midx.integration import callback
    from hf_midx.integration.diagnostics import DIAGNOSTIC_KEYS

    logged = {"midx/kl" if k == "kl_qp" else f"midx/{k}" for k in DIAGNOSTIC_KEYS}
    logged |= set(re.findall(r'"(midx/\w+)"', Path(callback.__file__).read_text(encoding="utf-8")))
    table = readme().split("### What the numbers mean", 1)[1].split("\n### ", 1)[0]
    explained = set(re.findall(r"`(midx/\w+)`", table))
    assert {"midx/train_loss_exact", "midx/refresh_seconds", "midx/codebook_loss", "midx/ess_sampled"} <= logged
    assert logged <= explained, f"logged but not explained in the README: {sorted(logged - explained)}"
