"""Measure which of ONNX's backend tests fail on each path through geir, and whether the engine alone fails them
too; write ``expectations.py``. Run from the repository root: ``python -m tests.onnx_backend.measure`` is not
possible (tests is no package), so: ``python tests/onnx_backend/measure.py``."""

from __future__ import annotations

import pprint
import sys
import unittest
import warnings
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parents[1]))

from onnx_backend.harness import BACKENDS, ENGINES, PATHS, backend_test  # noqa: E402


def _failures(backend, only=None) -> dict[str, str]:
    suite = unittest.TestSuite()
    for case in backend_test(backend, __name__, only=only).test_cases.values():
        suite.addTests(unittest.defaultTestLoader.loadTestsFromTestCase(case))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        result = unittest.TextTestRunner(stream=open("/dev/null", "w"), verbosity=0).run(suite)
    return {test.id().rsplit(".", 1)[-1]: " ".join(str(error).strip().splitlines()[-1].split())[:160]
            for test, error in result.failures + result.errors}


def main() -> None:
    engine_fails: dict[str, dict[str, str]] = {}
    geir_refuses: dict[str, list[str]] = {}
    for path in PATHS:
        failing = _failures(BACKENDS[path])
        engine = _failures(ENGINES[path], only=set(failing))
        engine_fails[path] = {name: engine[name][:72] for name in sorted(failing) if name in engine}
        geir_refuses[path] = sorted(name for name in failing if name not in engine)
        print(f"{path}: {len(failing)} failing, {len(engine_fails[path])} of them failed by the engine alone too",
              flush=True)
    lines = ['"""Which of ONNX\'s backend tests fail on each path through geir (written by measure.py): those the engine',
             'alone fails too, with the engine\'s reason, and those geir refuses although its engine runs them (issue 25',
             'closes those; the test suite runs every other test)."""', "", "ENGINE_FAILS: dict[str, dict[str, str]] = {"]
    for path in PATHS:
        lines.append(f"    {path!r}: {{")
        lines += [f"        {name!r}: {reason!r}," for name, reason in engine_fails[path].items()]
        lines.append("    },")
    lines += ["}", "", "GEIR_REFUSES: dict[str, tuple[str, ...]] = {"]
    for path in PATHS:
        lines.append(f"    {path!r}: (")
        lines += [f"        {name!r}," for name in geir_refuses[path]]
        lines.append("    ),")
    lines.append("}")
    (Path(__file__).parent / "expectations.py").write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
