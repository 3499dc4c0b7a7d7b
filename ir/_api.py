"""Top-level functions of the facade: run a graph, check it for a target."""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np

from ._core import Graph

__all__ = ["check", "run"]


def run(graph: Graph, feeds: Mapping[str, np.ndarray], runtime: str = "numpy") -> dict[str, np.ndarray]:
    """Compile ``graph`` for ``runtime`` and run it once; return the outputs by name.

    Raises:
        ExecutionError: a feed is missing, unexpected or of the wrong dtype/shape, or a
            node's input data is invalid; the message names the input or node.
    """
    from geir.runtimes import get_runtime

    return get_runtime(runtime).compile(graph).run(feeds)


def check(graph: Graph, target: str):
    """Check a built graph against one device's restrictions; return a ``CheckReport``.

    Raises GraphError for an unknown target (the message lists the known ones).
    """
    from geir.passes import CheckTarget

    check_pass = CheckTarget(target)
    check_pass(graph)
    return check_pass.report
