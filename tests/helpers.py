"""What tests of every family share: dtype names, random feeds, graph comparison. Each family's own builders
and cases are in tests/<family>/helpers.py; they are still found here under their old names (``_MOVED``) for tests
that import them from here (tests/tools)."""

from __future__ import annotations

import importlib

import ml_dtypes
import numpy as np

import geir

NP = {"float16": np.float16, "bfloat16": ml_dtypes.bfloat16, "float64": np.float64, "float32": np.float32}


def random_feeds(graph: geir.Graph, seed: int = 0, bindings: dict[str, int] | None = None) -> dict[str, np.ndarray]:
    """Standard-normal feeds for every graph input; symbolic dims take their size from ``bindings``."""
    rng = np.random.default_rng(seed)
    sizes = bindings or {}
    return {v.name: rng.standard_normal([sizes[d] if isinstance(d, str) else d for d in v.shape]).astype(v.dtype.numpy)
            for v in graph.inputs}


def assert_same_graph(got: geir.Graph, want: geir.Graph) -> None:
    """Same name, inputs, constants, nodes (op, domain, name, attributes, input and output names and types), outputs."""
    def sig(v):
        return None if v is None else (v.name, str(v.type))
    assert got.name == want.name
    assert [sig(v) for v in got.inputs] == [sig(v) for v in want.inputs]
    assert sorted(got.constants) == sorted(want.constants)
    for name, array in want.constants.items():
        assert got.constants[name].dtype == array.dtype and np.array_equal(got.constants[name], array), name
    assert len(got.nodes) == len(want.nodes)
    for a, b in zip(got.topological_order(), want.topological_order()):
        assert (a.op_type, a.domain, a.name) == (b.op_type, b.domain, b.name)
        assert a.attributes == b.attributes, (a.name, a.attributes, b.attributes)
        assert [sig(v) for v in a.inputs] == [sig(v) for v in b.inputs], a.name
        assert [sig(v) for v in a.outputs] == [sig(v) for v in b.outputs], a.name
    assert [sig(v) for v in got.outputs] == [sig(v) for v in want.outputs]


_MOVED = {**dict.fromkeys(("ROPE", "ROPE_GRAD", "empty_grad_slices_expected", "rotary_graph"), "rotary.helpers"),
          **dict.fromkeys(("MOE", "MOE_GRAD", "moe_graph", "moe_grad_graph"), "moe.helpers"),
          **dict.fromkeys(("SFA", "SFA_GRAD", "sfa_graph", "sfa_grad_feeds"), "sparse_attention.helpers")}


def __getattr__(name: str):
    """The family names, from their family's helpers (imported when asked for: a family's helpers may import this
    module)."""
    if name in _MOVED:
        return getattr(importlib.import_module(_MOVED[name]), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
