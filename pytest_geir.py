"""geir's pytest plugin: a ``geir_runtime`` parameter over every runtime, narrowed by ``--geir-runtime NAME``.

Registered through the ``pytest11`` entry point, so installing geir is enough::

    def test_my_rope_graph(geir_runtime):
        outs = geir.run(graph, feeds, runtime=geir_runtime)

pytest loads every installed plugin into every run, so this module is a top-level module of its own, not a part of
the ``geir`` package: importing anything under ``geir`` runs ``geir/__init__.py``, which imports all of geir
(ml_dtypes, ONNX, the runtimes: seconds). Here only the names of the runtimes are known (``RUNTIMES``, which a test
holds equal to geir's registry); geir is imported when a test asks for ``geir_runtime`` and no runtime was named.
A misspelled ``--geir-runtime`` is refused once, as a usage error (exit status 4), before anything is collected.
"""

from __future__ import annotations

import sys
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import pytest

__all__ = ["RUNTIMES", "pytest_addoption", "pytest_configure", "pytest_generate_tests"]

RUNTIMES = ("numpy", "onnxruntime")
"""geir's runtimes, by the names ``geir.runtimes.runtime_names()`` gives (a test checks the two agree)."""

OPTION = "--geir-runtime"


def _known() -> list[str]:
    """The runtime names a run may ask for: geir's own, and any a conftest registered (when geir is loaded already;
    otherwise none can have been, and loading geir to find out would cost every run the seconds this avoids)."""
    runtimes = sys.modules.get("geir.runtimes")
    registered = runtimes.runtime_names() if runtimes is not None else []
    return sorted({*RUNTIMES, *registered})


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.getgroup("geir").addoption(OPTION, action="append", default=None, metavar="NAME",
                                      help=f"run geir_runtime tests on this runtime only (one of {', '.join(RUNTIMES)}; "
                                           "repeat for several)")


def pytest_configure(config: pytest.Config) -> None:
    """Refuse an unknown runtime name before collection, whether or not any test uses ``geir_runtime``."""
    import pytest

    chosen = config.getoption(OPTION) or []
    unknown = [name for name in chosen if name not in _known()]
    if unknown:
        raise pytest.UsageError(f"{OPTION} {unknown[0]!r}: expected one of {', '.join(_known())}")


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    if "geir_runtime" not in metafunc.fixturenames:
        return
    chosen = metafunc.config.getoption(OPTION)
    if not chosen:
        from geir.runtimes import runtime_names      # a test that asks for every runtime: geir is loaded now

        chosen = runtime_names()
    metafunc.parametrize("geir_runtime", list(dict.fromkeys(chosen)))
