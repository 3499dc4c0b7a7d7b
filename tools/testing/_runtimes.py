"""``run_all_runtimes``: every available runtime on the same feeds, asserted to agree."""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np

from ...ir._core import Graph
from ...runtimes import get_runtime, runtime_names
from ._compare import assert_close

__all__ = ["run_all_runtimes"]


def run_all_runtimes(graph: Graph, feeds: Mapping[str, np.ndarray], *, standard: str = "precision_standard",
                     compute_count: int = 0) -> dict[str, np.ndarray]:
    """Run ``graph`` on every runtime, assert that each agrees with the first (the same output names, dtypes and
    shapes; bit for bit for a graph of ops whose schemas say ``exact_across_runtimes`` and for every non-floating output, else within
    ``standard``), and return the first runtime's outputs."""
    names = runtime_names()
    results = {name: get_runtime(name).compile(graph).run(feeds) for name in names}
    exact = all(n.schema.exact_across_runtimes for n in graph.nodes)
    first = results[names[0]]
    for name in names[1:]:
        if sorted(results[name]) != sorted(first):
            raise AssertionError(f"outputs on {name} are {sorted(results[name])}, on {names[0]} {sorted(first)}")
        for output, want in first.items():
            got = results[name][output]
            subject = f"output '{output}' on {name} vs {names[0]}"
            if got.dtype != want.dtype:
                raise AssertionError(f"{subject}: dtype {got.dtype.name} differs from {want.dtype.name}")
            floating = want.dtype.kind == "f" or want.dtype.name == "bfloat16"
            assert_close(got, want, standard="bit_exact" if exact or not floating else standard,
                         compute_count=compute_count, name=subject)
    return first
