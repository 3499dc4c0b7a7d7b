"""Types users can check (issue 24 item 5): ``mypy --strict`` passes on the generated stubs, on a user script that
builds, runs, checks, fuses, differentiates, goes through ONNX and uses ``geir.ge`` (``typing_user_script.py``), and
on the README's Python blocks; it sees the results ``b.op`` and the facade promise; and after an editable install
of a checkout whose folder is not named geir, mypy finds geir through the path the install writes.

Each test runs mypy (about ten seconds cold), hence the slow marker; CI runs them (``pytest -m slow``) and
``.ci/run typing`` runs mypy on the user script against the README's installed venv.
"""

from __future__ import annotations

import os
import subprocess
import sys
import sysconfig
import zipfile
from pathlib import Path

import pytest

from test_readme import _blocks

pytest.importorskip("mypy", reason="mypy is in the test extra: pip install -e '.[test]'")

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]
HERE = Path(__file__).resolve().parent
STUBBED = ("ir/_editor.pyi", "tools/builder.py", "tools/ge/op.pyi")
MYPY_INI = """\
[mypy]
strict = True

[mypy-readme_blocks]
# the README's blocks run in one namespace, in order (tests/test_readme.py), and reuse names (dy is a Value in
# the builder example and a ge Data op in the GE one): a name may take a new type, nothing else is relaxed
allow_redefinition = True
"""
REVEAL = """\
import numpy as np
import geir
from geir import ge

b = geir.GraphBuilder("g")
x = b.input("x", "float32", (2, 4))
kind: str = "Add"
reveal_type(b.op("Add", x, x))
reveal_type(b.op("Split", x, num_outputs=2))
reveal_type(b.op("TopK", x, b.constant("k", np.array([1])), axis=1))
reveal_type(b.op("SparseFlashAttentionGrad", x))
reveal_type(b.op(kind, x, x))
reveal_type(b.MoeTokenUnpermuteGrad(x))
reveal_type(geir.check(b.build(), "ascend910b"))
reveal_type(geir.fuse)
reveal_type(ge.op.InplacePartialRotaryMulGrad("r").set_input_dy(ge.op.Data("d")).set_attr_rotary_mode(1))
reveal_type(ge.op.InplacePartialRotaryMulGrad("r").get_attr_partial_slice())
reveal_type(ge.op.Add("a").set_input_A(ge.op.Data("d")))
reveal_type(geir.GraphBuilder.copy)
"""
REVEALED = [
    "geir.ir._core.Value",
    "tuple[geir.ir._core.Value, ...]",
    "tuple[geir.ir._core.Value, geir.ir._core.Value]",
    "tuple[geir.ir._core.Value, geir.ir._core.Value, geir.ir._core.Value | None, geir.ir._core.Value | None, "
    "geir.ir._core.Value | None]",
    "geir.ir._core.Value | tuple[geir.ir._core.Value | None, ...]",
    "tuple[geir.ir._core.Value, geir.ir._core.Value]",
    "geir.passes.check_target.CheckReport",
    "def (graph: geir.ir._core.Graph | onnx.onnx_ml_pb2.ModelProto | str | os.PathLike[Any], *, "
    "allow_stricter_data: bool =) -> tuple[geir.ir._core.Graph, geir.passes.fusion.FusionReport]",
    "geir.tools.ge.op.InplacePartialRotaryMulGrad",
    "tuple[int, ...]",
    "geir.tools.ge.op.Add",
    "def (graph: geir.ir._core.Graph, name: str | None =) -> geir.tools.builder.GraphBuilder",
]


@pytest.fixture(scope="module")
def mypy_cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One cache for the module's mypy runs (numpy's and onnx's stubs are read once)."""
    return tmp_path_factory.mktemp("mypy-cache")


def _mypy(args: list[str], cwd: Path, cache: Path, python: str | None = None,
          pythonpath: Path | None = None) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "MYPYPATH")}
    if pythonpath is not None:
        env["PYTHONPATH"] = str(pythonpath)
    command = [sys.executable, "-m", "mypy", "--cache-dir", str(cache), "--no-error-summary", "--hide-error-context"]
    if python is not None:
        command += ["--python-executable", python]
    return subprocess.run(command + args, cwd=cwd, env=env, capture_output=True, text=True, timeout=600)


def test_mypy_strict_passes_on_the_stubs_the_user_script_and_the_readme(tmp_path, mypy_cache):
    """geir is found through a folder whose ``geir`` links to this checkout (as an editable install makes): the
    package is an installed one, so mypy reports only the files named, which are the stubs and builder (the
    whole of what geir generates), the user script and the README's blocks (one module, in order)."""
    (tmp_path / "site").mkdir()
    (tmp_path / "site" / "geir").symlink_to(ROOT, target_is_directory=True)
    (tmp_path / "mypy.ini").write_text(MYPY_INI)
    (tmp_path / "typing_user_script.py").write_text((HERE / "typing_user_script.py").read_text())
    (tmp_path / "readme_blocks.py").write_text("\n".join(_blocks("python")))
    files = [str(tmp_path / "site" / "geir" / f) for f in STUBBED] + ["typing_user_script.py", "readme_blocks.py"]
    result = _mypy(["--config-file", "mypy.ini", *files], tmp_path, mypy_cache, pythonpath=tmp_path / "site")
    assert (result.returncode, result.stdout) == (0, ""), result.stdout + result.stderr

    (tmp_path / "reveal.py").write_text(REVEAL)
    result = _mypy(["--strict", "reveal.py"], tmp_path, mypy_cache, pythonpath=tmp_path / "site")
    assert result.returncode == 0, result.stdout + result.stderr
    revealed = [line.split('Revealed type is "', 1)[1][:-1] for line in result.stdout.splitlines()
                if "Revealed type is" in line]
    assert revealed == REVEALED


def test_the_user_script_runs():
    """What the script's types claim holds when it runs (a graph built, run, checked, fused, differentiated,
    exported, imported, and the README's GE example)."""
    result = subprocess.run([sys.executable, str(HERE / "typing_user_script.py")], capture_output=True, text=True,
                            timeout=600, env={**os.environ, "GEIR_NATIVE": "0"})
    assert result.returncode == 0, result.stdout + result.stderr
    assert result.stdout.endswith("typed user script: ok\n")


def _editable_wheel(checkout: Path, out: Path) -> Path:
    """The wheel ``pip install -e`` builds for ``checkout`` (setuptools' PEP 660 hook, offline, no isolation)."""
    script = "import sys; from setuptools import build_meta; print(build_meta.build_editable(sys.argv[1]))"
    built = subprocess.run([sys.executable, "-c", script, str(out)], cwd=checkout, capture_output=True, text=True,
                           timeout=600)
    assert built.returncode == 0, built.stdout + built.stderr
    return out / built.stdout.split()[-1]


def test_an_editable_install_is_a_path_that_mypy_follows_whatever_the_folder_is_called(tmp_path, mypy_cache):
    """A copy of the checkout in a folder not named geir, its editable wheel installed in a fresh venv (its
    dependencies from this one's site-packages): Python imports geir through the link the install made, mypy
    (which runs no import hook) finds geir and its types, and without the link setuptools' hook still imports it."""
    checkout = tmp_path / "not-geir"
    files = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"], cwd=ROOT,
                           capture_output=True, check=True).stdout.decode().split("\0")
    for name in filter(None, files):
        if (ROOT / name).is_file() and not name.startswith("tests/"):
            (checkout / name).parent.mkdir(parents=True, exist_ok=True)
            (checkout / name).write_bytes((ROOT / name).read_bytes())
    wheel = _editable_wheel(checkout, tmp_path / "dist")
    link = checkout / "build" / "__editable__.geir-path" / "geir"
    assert link.is_symlink() and link.resolve() == checkout.resolve()

    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(tmp_path / "venv")], check=True, timeout=300)
    python = tmp_path / "venv" / "bin" / "python"
    site = Path(subprocess.run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                               capture_output=True, text=True, check=True).stdout.strip())
    zipfile.ZipFile(wheel).extractall(site)
    assert (site / "__editable__.geir-path.pth").read_text().split() == [str(link.parent)]
    (site / "zz_dependencies.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")   # numpy, onnx, ...

    where = "import geir, sys; print(geir.__file__); assert 'geir' in sys.modules"
    imported = subprocess.run([str(python), "-c", where], cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert imported.returncode == 0, imported.stderr
    assert imported.stdout.split() == [str(link / "__init__.py")]

    (tmp_path / "user.py").write_text(
        "import geir\nb = geir.GraphBuilder('g')\nx = b.input('x', 'float32', (2,))\n"
        "b.output(b.op('Neg', b.op('Add', x, x)), 'y')\nreport: geir.CheckReport = geir.check(b.build(), 'ascend910b')\n")
    result = _mypy(["--strict", "user.py"], tmp_path, mypy_cache, python=str(python))
    assert (result.returncode, result.stdout) == (0, ""), result.stdout + result.stderr

    link.unlink()                       # build/ removed: the hook setuptools installed beside the path imports geir
    imported = subprocess.run([str(python), "-c", where], cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert imported.returncode == 0, imported.stderr
    assert Path(imported.stdout.split()[0]).resolve() == (checkout / "__init__.py").resolve()
