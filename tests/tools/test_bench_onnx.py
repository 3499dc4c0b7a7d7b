"""The ``import`` and ``onnx-run`` suites of ``geir bench`` measure what they say: their models import and compute
what plain ONNX Runtime computes, the fused MoE graph holds the fused op, each row carries its target. Times are
the benchmark's business, never asserted here."""

from __future__ import annotations

import numpy as np
import onnxruntime as ort

import geir
from geir.tools import bench
from geir.tools.bench_onnx import (chain_model, encoder_model, import_measurements, onnx_run_measurements,
                                   unpermute_graph)


def test_the_suites_are_registered():
    assert bench.SUITES["import"] is import_measurements and bench.SUITES["onnx-run"] is onnx_run_measurements


def test_import_rows_hold_larger_models_to_the_smallest_ones_time_per_node():
    rows = import_measurements(quick=True)
    assert [r.name for r in rows] == ["1,000 nodes", "10,000 nodes"]
    assert rows[0].baseline and rows[1].targets == (("1,000 nodes", 2.0),)
    graph = rows[0].fn()
    assert isinstance(graph, geir.Graph) and len(graph.nodes) == 1000
    x = np.linspace(-1, 1, 16, dtype=np.float32).reshape(2, 8)
    model = chain_model(1000)
    want = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, {"x": x})[0]
    np.testing.assert_allclose(geir.run(graph, {"x": x}, runtime="numpy")["v999"], want, rtol=1e-6)


def test_encoder_models_compute_the_same_static_and_dynamic():
    x = np.random.default_rng(0).standard_normal((2, 8, 256)).astype(np.float32)
    static, dynamic = encoder_model(2, 8), encoder_model("batch", "seq")
    assert any(n.op_type == "Shape" for n in dynamic.graph.node) and not any(n.op_type == "Shape"
                                                                              for n in static.graph.node)
    want = ort.InferenceSession(static.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, {"x": x})[0]
    for model in (static, dynamic):
        graph = geir.from_onnx(model)
        for runtime in ("numpy", "onnxruntime"):
            np.testing.assert_allclose(geir.run(graph, {"x": x}, runtime=runtime)["y"], want, rtol=1e-4, atol=1e-5)
    assert geir.from_onnx(dynamic).outputs[0].type.shape == ("batch", "seq", 256)


def test_onnx_run_rows_compare_geir_with_plain_sessions_and_fused_with_unfused():
    rows = onnx_run_measurements(quick=True)
    targets = {r.name: r.targets for r in rows if not r.baseline}
    assert targets["geir.run onnxruntime"] == (("plain InferenceSession.run", 1.1),)
    assert targets["geir.run onnxruntime, fused MoeTokenUnpermute"] == (("geir.run onnxruntime, standard ops", 1.0),)
    unfused, fused = (r.fn() for r in rows[-2:])
    np.testing.assert_allclose(fused["y"], unfused["y"], rtol=1e-5, atol=1e-6)


def test_the_benchmarked_moe_graph_fuses():
    """Without the fused op the MoE rows would time one graph twice."""
    fused, report = geir.fuse(unpermute_graph(4, 2, 8), allow_stricter_data=True)
    assert [n.op_type for n in fused.nodes][-1] == "MoeTokenUnpermute" and report.fused
