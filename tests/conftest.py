from __future__ import annotations

import os
import sys
from pathlib import Path

from hypothesis import settings

sys.path.insert(0, str(Path(__file__).parent))

# Property tests draw the same examples on every run (a suite whose verdict changes from run to run tells
# nothing); the breadth comes from max_examples. HYPOTHESIS_PROFILE=explore draws fresh ones.
settings.register_profile("geir", derandomize=True, deadline=None)
settings.register_profile("explore", deadline=None)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "geir"))


def pytest_configure(config) -> None:
    """Without a C compiler the native library cannot exist: its one fallback warning is expected then."""
    from geir.runtimes.onnxruntime._native import find_compiler

    if find_compiler() is None:
        config.addinivalue_line("filterwarnings",
                                "ignore:geir. native ONNX Runtime kernels unavailable:geir.GeirWarning")
