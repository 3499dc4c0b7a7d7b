"""The README's code runs as written: its Python blocks, executed in order in one namespace (as a reader pastes
them), and the printout it shows after the fusion example is what that example prints; its pytest-xdist recipe on
the README's own geir_runtime test (the ssh workers as local processes in a folder of their own)."""

from __future__ import annotations

import contextlib
import io
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

README = Path(__file__).resolve().parents[1] / "README.md"


def _blocks(kind: str) -> list[str]:
    """The fenced blocks whose info string is ``kind`` ("" for a bare fence), in order."""
    blocks, current, info = [], [], None
    for line in README.read_text(encoding="utf-8").splitlines(keepends=True):
        if line.startswith("```"):
            if info is None:
                info, current = line[3:].strip(), []
            else:
                if info == kind:
                    blocks.append("".join(current))
                info = None
        elif info is not None:
            current.append(line)
    return blocks


def test_the_readme_starts_with_the_install_and_test_commands():
    assert _blocks("bash")[0].splitlines() == ['pip install -e ".[test]" && geir demo', "pytest -n auto"]


def test_ci_runs_the_readme_commands_exactly():
    """.ci/run's readme step is a user following the README: its commands are the README's first block, in order."""
    ci = (README.parent / ".ci" / "run").read_text(encoding="utf-8")
    step = ci[ci.index("\nreadme() {"):]
    step = step[: step.index("\n}\n")]
    lines = [line.strip() for line in step.splitlines()]
    first = _blocks("bash")[0].splitlines()
    start = lines.index(first[0])
    assert lines[start: start + len(first)] == first, step


def test_every_python_block_runs_and_prints_what_the_readme_shows(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)                    # the blocks write rope_grad.onnx and a graph dump
    namespace: dict = {}
    printed = []
    for index, block in enumerate(_blocks("python")):
        out = io.StringIO()
        with contextlib.redirect_stdout(out):
            exec(compile(block, f"README python block {index}", "exec"), namespace)
        printed.append(out.getvalue())
    shown = _blocks("")                            # the one bare block: the fusion example's printout
    assert len(shown) == 1
    assert shown[0] in printed, f"the README shows:\n{shown[0]}\nthe blocks printed:\n{''.join(printed)}"
    assert (tmp_path / "rope_grad.onnx").is_file() and (tmp_path / "dump_rope_grad.onnx").is_file()


def _command_rows() -> dict[str, str]:
    """The README's table of commands: command name -> its row."""
    rows = [line for line in README.read_text(encoding="utf-8").splitlines() if line.startswith("| `geir ")]
    return {row.split("`")[1].split()[1]: re.split(r"(?<!\\)\|", row)[1] for row in rows}   # \| is a literal bar


def _parser_options() -> dict[str, list[tuple[str, ...]]]:
    """Each command's options, as the spellings of each (``("-o", "--output")``)."""
    from geir.tools.cli import build_parser

    parser = build_parser()
    commands = next(a for a in parser._actions if a.dest == "command").choices   # argparse's subparsers
    return {name: [tuple(a.option_strings) for a in sub._actions if a.option_strings and a.dest != "help"]
            for name, sub in commands.items()}


FLAG = re.compile(r"(?<![\w-])(--?[a-z][a-z-]*)")


def test_the_readme_lists_every_command_with_every_option_the_cli_has():
    rows, options = _command_rows(), _parser_options()
    assert set(rows) == set(options)
    for name, row in rows.items():
        shown = set(FLAG.findall(row))
        assert [o for o in options[name] if not shown & set(o)] == [], f"geir {name}: options the README omits"
        assert shown <= {s for o in options[name] for s in o}, f"geir {name}: options the CLI does not have"


def test_every_command_and_option_in_the_readme_is_exercised_by_the_cli_tests():
    tests = "".join(path.read_text() for path in (README.parent / "tests").rglob("test_*.py"))
    for name, row in _command_rows().items():
        assert f'"{name}"' in tests, f"no CLI test runs geir {name}"
        for option in FLAG.findall(row):
            assert f'"{option}' in tests, f"no CLI test passes geir {name} {option}"


SSH_WORKERS = re.compile(r"\d+\*ssh=[^/\s]+//python=(\S+?)//chdir=(\S+)")


def _xdist_recipe() -> list[str]:
    """The README's pytest-xdist commands (the bash block with ``--tx``), continuation lines joined."""
    block = next(b for b in _blocks("bash") if "--tx" in b)
    return [line for line in block.replace("\\\n", " ").splitlines() if line.strip()]


def _on_this_machine(command: str, python: str, away: Path) -> str:
    """``command`` with each ``N*ssh=HOST//python=...//chdir=DIR`` worker made one local process that runs from
    ``away`` with this Python: the same copy of the tests (--rsyncdir) and the same chdir, without ssh."""
    assert SSH_WORKERS.search(command), command
    return SSH_WORKERS.sub(f"1*popen//python={python}//chdir={away}", command)


@pytest.mark.slow   # starts five pytest-xdist workers, each importing geir: about 40 s on two cores
def test_the_xdist_recipe_runs_the_readme_matrix_on_workers(tmp_path):
    """The local command as written, and the ssh one with its ssh workers as local processes in a folder of their
    own, on the README's geir_runtime test as the matrix; a scratch native cache, filled by the stand-in compiler."""
    pytest.importorskip("xdist", reason="pytest-xdist is not installed (the test extra has it)")
    from native_helpers import copying_compiler, links

    local, remote = _xdist_recipe()
    assert local.startswith("pytest -n auto ") and "--rsyncdir" in remote
    project, away = tmp_path / "project", tmp_path / "box1"
    (project / "tests").mkdir(parents=True)
    matrix = next(b for b in _blocks("python") if "def test_rope_grad(geir_runtime" in b)
    (project / "tests" / "test_matrix.py").write_text(matrix)
    compiler, log = copying_compiler(tmp_path / "bin")
    scripts = str(Path(sys.executable).parent)      # this environment's pytest first, as an activated venv has it
    env = {k: v for k, v in os.environ.items() if k != "PWD"}         # bash sets $PWD to the project
    env.update(PATH=scripts + os.pathsep + env.get("PATH", ""), CC=compiler, GEIR_CACHE_DIR=str(tmp_path / "cache"))
    for command in (local, _on_this_machine(remote, sys.executable, away)):
        result = subprocess.run(["bash", "-c", command], cwd=project, env=env, capture_output=True, text=True,
                                timeout=300)
        assert result.returncode == 0, f"{command}\n{result.stdout[-3000:]}{result.stderr[-3000:]}"
        assert re.search(r"\b2 passed\b", result.stdout), result.stdout[-3000:]    # numpy and onnxruntime
    assert (away / "tests" / "test_matrix.py").read_text() == matrix             # --rsyncdir copied the tests there
    assert links(log) == 1                                                        # one build for every worker
