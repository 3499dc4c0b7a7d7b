"""geir's pytest plugin, ``pytest_geir`` (issue 30, item 4): loading it costs a pytest run nothing (geir is imported
only when a test asks for ``geir_runtime``), and a misspelled ``--geir-runtime`` is one usage error listing the
runtimes, whether or not a test uses the parameter. Each test runs an inner pytest (pytester) with the plugin from
this checkout and without the installed entry point, so it tests this file whatever an older install registered."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import pytest

from geir.runtimes import _protocol, runtime_names

from tools.test_testing import PLUGIN_TEST   # tests/ is on the path (pythonpath)

pytest_plugins = ["pytester"]

ROOT = Path(__file__).parents[2]

USES_RUNTIME = PLUGIN_TEST     # a user's test of the fixture: one rope grad on every runtime


def _plugin() -> ModuleType:
    """This checkout's pytest_geir.py (the module the pytest11 entry point names), loaded by its path under a name of
    its own: ``-p no:geir`` blocks the installed entry point, and with it any plugin named ``pytest_geir``."""
    spec = importlib.util.spec_from_file_location("pytest_geir_under_test", ROOT / "pytest_geir.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _run(pytester: pytest.Pytester, *args: str) -> pytest.RunResult:
    return pytester.runpytest("-p", "no:geir", "-p", "no:cacheprovider", *args, plugins=[_plugin()])


def test_the_plugin_knows_the_runtimes_of_geirs_registry():
    assert list(_plugin().RUNTIMES) == runtime_names() == ["numpy", "onnxruntime"]


def test_every_runtime_by_default_and_the_one_named(pytester):
    pytester.makepyfile(test_user=USES_RUNTIME)
    every = _run(pytester, "-v")
    every.assert_outcomes(passed=2)
    assert every.ret == 0
    every.stdout.fnmatch_lines(["*test_rope_grad_on_every_runtime?numpy? PASSED*",
                                "*test_rope_grad_on_every_runtime?onnxruntime? PASSED*"])
    one = _run(pytester, "-v", "--geir-runtime", "onnxruntime", "--geir-runtime", "onnxruntime")
    one.assert_outcomes(passed=1)
    one.stdout.fnmatch_lines(["*test_rope_grad_on_every_runtime?onnxruntime? PASSED*"])


@pytest.mark.parametrize("uses", [True, False], ids=["a test uses geir_runtime", "no test uses it"])
def test_an_unknown_runtime_is_one_usage_error_listing_the_runtimes(pytester, uses):
    files = {f"test_{i}": USES_RUNTIME if uses else "def test_plain():\n    assert True\n" for i in range(3)}
    pytester.makepyfile(**files)
    result = _run(pytester, "--geir-runtime", "numpy", "--geir-runtime", "tensorrt")
    assert result.ret == pytest.ExitCode.USAGE_ERROR == 4
    output = "\n".join(result.outlines + result.errlines)
    assert output.count("--geir-runtime 'tensorrt': expected one of numpy, onnxruntime") == 1, output
    assert "ERROR: --geir-runtime 'tensorrt'" in output
    assert "Traceback" not in output and "collected" not in output and "passed" not in output


def test_a_runtime_a_conftest_registered_may_be_named(pytester, monkeypatch):
    """A run whose conftest imported geir and registered a runtime may name it (geir is loaded by then anyway)."""
    monkeypatch.setitem(_protocol._FACTORIES, "tvm", _protocol._FACTORIES["numpy"])
    pytester.makepyfile(test_user="def test_it(geir_runtime):\n    assert geir_runtime == 'tvm'\n")
    _run(pytester, "--geir-runtime", "tvm").assert_outcomes(passed=1)


def test_loading_the_plugin_imports_no_part_of_geir():
    """What pytest does with the entry point, in a fresh interpreter: ml_dtypes, ONNX, ONNX Runtime and geir itself
    stay out of sys.modules (they cost seconds, and every pytest run in the environment loads the plugin)."""
    code = ("import sys; sys.path.insert(0, sys.argv[1]); import pytest, pytest_geir\n"
            "print(sorted(m for m in sys.modules if m.split('.')[0] in ('geir', 'ml_dtypes', 'onnx', 'onnxruntime', "
            "'torch')))\n"
            "print(pytest_geir.__file__)")
    done = subprocess.run([sys.executable, "-c", code, str(ROOT)], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    loaded, path = done.stdout.splitlines()
    assert loaded == "[]" and Path(path).resolve() == (ROOT / "pytest_geir.py").resolve()
