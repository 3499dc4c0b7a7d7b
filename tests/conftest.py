from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))


def pytest_configure(config) -> None:
    """Without a C compiler the native library cannot exist: its one fallback warning is expected then."""
    from geir.runtimes.onnxruntime._native import find_compiler

    if find_compiler() is None:
        config.addinivalue_line("filterwarnings",
                                "ignore:geir. native ONNX Runtime kernels unavailable:geir.GeirWarning")
