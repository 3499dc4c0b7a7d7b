"""ONNX's own backend test suite (onnx.backend.test: node tests, simple, PyTorch-converted and -operator models,
the light real models) through geir on each path: the NumPy runtime, the ONNX Runtime runtime, and geir's export
run by plain ONNX Runtime. Every test passes except those ``expectations`` names (the engine alone fails them,
or geir refuses them today: issue 25's list); a test that starts passing or failing shows up here, and
``python tests/onnx_backend/measure.py`` measures the list again."""

from __future__ import annotations

import pytest

from onnx_backend.expectations import ENGINE_FAILS, GEIR_REFUSES
from onnx_backend.harness import BACKENDS, PATHS, backend_test

pytestmark = pytest.mark.slow

for _path in PATHS:
    _test = backend_test(BACKENDS[_path], __name__, exclude=set(ENGINE_FAILS[_path]) | set(GEIR_REFUSES[_path]))
    for _name, _case in _test.test_cases.items():
        _case.pytestmark = [pytest.mark.slow]
        globals()[f"{_name}_{_path}"] = type(f"{_name}_{_path}", (_case,), {})
