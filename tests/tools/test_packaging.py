"""A wheel (a non-editable install) ships every package of the source tree (issue 23 item 14: the hand-written
package list missed geir.tools.ge, the op families and geir.tools.testing, so ``import geir`` failed, and with it
every pytest run through the ``pytest11`` entry point)."""

from __future__ import annotations

import importlib.util
import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).parents[2]
SHIPPED = (".py", ".pyi", ".c", ".h")
NOT_SOURCE = {"build", "dist", "tests", "examples", "__pycache__"}   # examples/: scripts run from the checkout


def _skipped(name: str) -> bool:
    return name.startswith(".") or name in NOT_SOURCE or name.endswith(".egg-info")


TOP_LEVEL = {"pytest_geir.py"}
"""Files at the root that ship outside geir/, as top-level modules (the pytest plugin: loading it imports no geir)."""


def _source_files() -> set[str]:
    """Every file of the package (relative to the root): what a wheel must hold, under geir/."""
    found = {"py.typed"}
    for folder, dirs, files in os.walk(ROOT):
        dirs[:] = [d for d in dirs if not _skipped(d)]
        rel = Path(folder).relative_to(ROOT)
        found |= {(rel / f).as_posix() for f in files if f.endswith(SHIPPED)}
    return found - {"setup.py"} - TOP_LEVEL


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    """A wheel built from a copy of the working tree (so the checkout gets no build/ folder), offline."""
    tmp = tmp_path_factory.mktemp("wheel")
    shutil.copytree(ROOT, tmp / "src", ignore=lambda folder, names: [n for n in names if _skipped(n)
                                                                     and n != "tests"])
    built = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w",
                            str(tmp / "dist"), str(tmp / "src")], capture_output=True, text=True, timeout=600)
    assert built.returncode == 0, built.stdout + built.stderr
    (path,) = (tmp / "dist").glob("geir-*.whl")
    return path


@pytest.mark.slow
def test_the_wheel_holds_every_package_and_data_file_and_nothing_else(wheel):
    names = set(zipfile.ZipFile(wheel).namelist())
    package = {n.removeprefix("geir/") for n in names if n.startswith("geir/")}
    want = _source_files()
    assert want - package == set(), "missing from the wheel"
    folders = {str(Path(f).parent) for f in want}
    assert {"tools/ge", "schemas/rotary", "schemas/moe", "schemas/sparse_attention", "tools/testing",
            "runtimes/onnxruntime/native"} <= folders           # the ones the hand-written list missed, and C
    assert package - want == set(), "in the wheel but not a source file"    # no tests, no setup.py
    assert not any(n.startswith("tests/") for n in names)
    assert {n for n in names if "/" not in n} == TOP_LEVEL            # beside geir/ and the .dist-info only
    (entry_points,) = [n for n in names if n.endswith(".dist-info/entry_points.txt")]
    text = zipfile.ZipFile(wheel).read(entry_points).decode()
    assert "geir = geir.tools.cli:main" in text and "geir = pytest_geir" in text


@pytest.mark.slow
def test_every_module_of_the_wheel_imports_outside_the_checkout(wheel, tmp_path):
    """Unpacked and first on the path (before the editable install's finder), every module imports from it; without
    torch (the optional extra) geir.tools.torch and its modules are the only ones left out, and say so."""
    zipfile.ZipFile(wheel).extractall(tmp_path / "site")
    script = ("import importlib, importlib.util, pkgutil, geir\n"
              "without_torch = importlib.util.find_spec('torch') is None\n"
              "for m in pkgutil.walk_packages(geir.__path__, 'geir.'):\n"
              "    if m.name.endswith('__main__'):   # runs the command line\n"
              "        continue\n"
              "    if without_torch and m.name.startswith('geir.tools.torch'):\n"
              "        try:\n"
              "            importlib.import_module(m.name)\n"
              "        except ImportError as exc:\n"
              "            assert 'geir.torch needs PyTorch' in str(exc), exc\n"
              "            continue\n"
              "    module = importlib.import_module(m.name)\n"
              "    assert module.__file__.startswith(%r), (m.name, module.__file__)\n"
              "    print(m.name)\n") % str(tmp_path / "site")
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300,
                            cwd=tmp_path, env={**os.environ, "PYTHONPATH": str(tmp_path / "site")})
    assert result.returncode == 0, result.stderr
    modules = {("geir/" + f).removesuffix(".py").removesuffix("/__init__").replace("/", ".")
               for f in _source_files() if f.endswith(".py")}
    expected = modules - {"geir", "geir.__main__"}
    if importlib.util.find_spec("torch") is None:      # this interpreter runs the script too
        expected = {m for m in expected if not m.startswith("geir.tools.torch")}
    assert set(result.stdout.split()) == expected
