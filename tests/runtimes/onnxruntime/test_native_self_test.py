"""The native library's self-test is driven by the families' worked examples: every op of ours runs once."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from geir.ir._registry import all_schemas
from geir.runtimes.onnxruntime import _native, native_library
from native_helpers import requires_compiler


def test_the_self_test_graph_has_a_node_of_every_op_from_its_examples():
    graph, feeds, calls, exact = _native._self_test_graph()
    assert sorted(n.op_type for n in graph.nodes) == sorted(s.op_type for s in all_schemas())
    assert calls == len(graph.nodes)
    assert set(feeds) == {v.name for v in graph.inputs}
    assert exact == {v.name for v in graph.outputs if v.producer.schema.exact_across_runtimes}


@requires_compiler
def test_the_self_test_refuses_a_kernel_that_drifts(monkeypatch):
    """A kernel result one step off the NumPy runtime's is a failed self-test, not a loaded library."""
    path = native_library()
    assert path is not None
    _native._self_test(Path(path))
    real = _native.NumpyRuntime.compile

    def drifting(self, graph):
        executable = real(self, graph)
        run = executable.run

        def off(feeds, outputs=None):
            results = run(feeds, outputs)
            name = "InplacePartialRotaryMulGrad.dy.out"
            results[name] = np.nextafter(results[name], np.float32(np.inf))
            return results
        executable.run = off
        return executable
    monkeypatch.setattr(_native.NumpyRuntime, "compile", drifting)
    with pytest.raises(RuntimeError, match="'InplacePartialRotaryMulGrad.dy.out' differs from the NumPy runtime"):
        _native._self_test(Path(path))


@requires_compiler
def test_an_op_without_a_native_kernel_runs_its_body_and_is_not_counted(monkeypatch):
    """A family with examples but no C file must not fail the self-test (and with it every family's kernels)."""
    path = Path(native_library())
    assert _native.native_ops(path) == {s.op_type for s in all_schemas()}
    without_rotary = frozenset(_native.native_ops(path) - {"InplacePartialRotaryMul", "InplacePartialRotaryMulGrad"})
    graph, _, calls, _ = _native._self_test_graph(without_rotary)
    assert calls == len(graph.nodes) - 2
    monkeypatch.setattr(_native, "native_ops", lambda p: without_rotary)
    with pytest.raises(RuntimeError, match=f"the self-test ran {len(graph.nodes)} of {calls} native kernels"):
        _native._self_test(path)           # the library does run rotary natively: the count tells
