"""geir's pytest plugin: a ``geir_runtime`` fixture over every runtime, narrowed by ``--geir-runtime NAME``.

Registered through the ``pytest11`` entry point, so installing geir is enough::

    def test_my_rope_graph(geir_runtime):
        outs = geir.run(graph, feeds, runtime=geir_runtime)
"""

from __future__ import annotations

import pytest

from ...runtimes import runtime_names


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.getgroup("geir").addoption("--geir-runtime", action="append", default=None, metavar="NAME",
                                      help=f"run geir_runtime tests on this runtime only (one of {', '.join(runtime_names())}; "
                                           "repeat for several)")


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    if "geir_runtime" not in metafunc.fixturenames:
        return
    chosen = metafunc.config.getoption("--geir-runtime") or runtime_names()
    unknown = [n for n in chosen if n not in runtime_names()]
    if unknown:
        raise pytest.UsageError(f"--geir-runtime {unknown[0]!r}: expected one of {', '.join(runtime_names())}")
    metafunc.parametrize("geir_runtime", chosen)
