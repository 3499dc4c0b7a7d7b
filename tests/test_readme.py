"""The README's code runs as written: its Python blocks, executed in order in one namespace (as a reader pastes
them), and the printout it shows after the fusion example is what that example prints."""

from __future__ import annotations

import contextlib
import io
from pathlib import Path

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
    assert _blocks("bash")[0].splitlines() == ['pip install -e ".[test]" && geir demo', "pytest"]


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
