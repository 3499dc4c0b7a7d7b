"""geir.fuse on attention over gathered keys: it becomes SparseFlashAttention (scaled by Mul or Div, masked or not),
computes what the original did, and its near misses say why."""

from __future__ import annotations

import numpy as np
import pytest

import geir
from geir.testing import reference


def _attention_graph(indices=None, scale_op="Mul", dtype="float16", softmax_axis=-1, masked=False):
    b = geir.GraphBuilder("gathered_attention")
    q = b.input("q", dtype, (5, 4, 8))
    k = b.input("k", dtype, (9, 8))
    v = b.input("v", dtype, (9, 6))
    idx = b.constant("idx", np.asarray(indices, np.int64)) if indices is not None else b.input("idx", "int64", (5, 3))
    rows = b.op("Max", idx, b.constant("zero", np.array(0, np.int64))) if masked else idx
    scores = b.op("MatMul", q, b.op("Transpose", b.op("Gather", k, rows, axis=0), perm=[0, 2, 1]))
    factor = b.constant("factor", np.array(0.25 if scale_op == "Mul" else 4.0, dtype))
    scores = b.op(scale_op, scores, factor)
    if masked:                     # masked_fill(-inf) where the row is padded with -1
        valid = b.op("Unsqueeze", b.op("GreaterOrEqual", idx, b.constant("zero_", np.array(0, np.int64))),
                     b.constant("axis1", np.array([1], np.int64)))
        scores = b.op("Where", valid, scores, b.constant("minus_inf", np.array(-np.inf, dtype)))
    probs = b.op("Softmax", scores, axis=softmax_axis)
    b.output(b.op("MatMul", probs, b.op("Gather", v, rows, axis=0)), "out")
    return b.build()


@pytest.mark.parametrize("scale_op, masked", [("Mul", False), ("Div", False), ("Mul", True)])
def test_attention_over_gathered_keys_becomes_sparse_flash_attention(scale_op, masked):
    rows = np.array([[0, 3, 8], [2, 1, 0], [5, 6, 7], [4, 0, 2], [8, 7, 6]])
    if masked:                                     # -1 padding at the end of rows, as the op reads it
        rows[[0, 2], 2], rows[3, 1:] = -1, -1
    original = _attention_graph(rows, scale_op, masked=masked)
    fused, report = geir.fuse(original, allow_stricter_data=True)
    attention = [n for n in fused.nodes if n.op_type == "SparseFlashAttention"]
    assert len(attention) == 1 and report.fused[0].pattern.startswith("sparse attention")
    attrs = attention[0].attributes
    assert (attrs["layout_query"], attrs["sparse_mode"], attrs["sparse_block_size"], attrs["scale_value"]) == \
        ("TND", 0, 1, 0.25)
    want = reference(original, {"q": np.random.default_rng(1).standard_normal((5, 4, 8)).astype(np.float16),
                                "k": np.random.default_rng(2).standard_normal((9, 8)).astype(np.float16),
                                "v": np.random.default_rng(3).standard_normal((9, 6)).astype(np.float16)}, rounded=False)
    got = reference(fused, {"q": np.random.default_rng(1).standard_normal((5, 4, 8)).astype(np.float16),
                            "k": np.random.default_rng(2).standard_normal((9, 8)).astype(np.float16),
                            "v": np.random.default_rng(3).standard_normal((9, 6)).astype(np.float16)}, rounded=False)
    np.testing.assert_allclose(got["out"], want["out"], rtol=1e-12, atol=1e-12)
    for runtime in ("numpy", "onnxruntime"):
        feeds = {"q": np.ones((5, 4, 8), np.float16) * 0.1, "k": np.linspace(-1, 1, 72).reshape(9, 8).astype(np.float16),
                 "v": np.linspace(-2, 2, 54).reshape(9, 6).astype(np.float16)}
        a, c = geir.run(original, feeds, runtime=runtime)["out"], geir.run(fused, feeds, runtime=runtime)["out"]
        np.testing.assert_allclose(c.astype(np.float32), a.astype(np.float32), rtol=5e-3, atol=5e-3)


def test_attention_near_misses():
    _, report = geir.fuse(_attention_graph([[0, 0, 1]] * 5), allow_stricter_data=True)
    assert "distinct ids in [0, T2)" in report.near_misses[0].reason
    _, report = geir.fuse(_attention_graph([[0, 1, 2]] * 5, softmax_axis=1), allow_stricter_data=True)
    assert report.near_misses[0].reason == "the softmax is not over the last axis (the keys)"
    original = _attention_graph([[0, -1, 2]] + [[0, 1, 2]] * 4, masked=True)   # padding not at the end: moved there
    fused, report = geir.fuse(original, allow_stricter_data=True)
    assert not report.near_misses and [n.op_type for n in fused.nodes][-1] == "SparseFlashAttention"
    feeds = {"q": np.ones((5, 4, 8), np.float16), "k": np.linspace(-1, 1, 72).reshape(9, 8).astype(np.float16),
             "v": np.linspace(-2, 2, 54).reshape(9, 6).astype(np.float16)}
    np.testing.assert_allclose(reference(fused, feeds, rounded=False)["out"],
                               reference(original, feeds, rounded=False)["out"], rtol=1e-12, atol=1e-12)
    _, report = geir.fuse(_attention_graph([[-1, -1, -1]] + [[0, 1, 2]] * 4, masked=True), allow_stricter_data=True)   # NaN in the subgraph
    assert "only padding" in report.near_misses[0].reason
    fused, report = geir.fuse(_attention_graph(), allow_stricter_data=True)                       # a fed index tensor: checked at run time
    assert [n.op_type for n in fused.nodes][-1] == "SparseFlashAttention"
    with pytest.raises(geir.ExecutionError, match=r"SA-D3"):
        geir.run(fused, {"q": np.zeros((5, 4, 8), np.float16), "k": np.zeros((9, 8), np.float16),
                         "v": np.zeros((9, 6), np.float16), "idx": np.zeros((5, 3), np.int64)})
