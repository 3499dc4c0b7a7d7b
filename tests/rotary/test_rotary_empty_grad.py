"""An empty dy/cos/sin makes InplacePartialRotaryMulGrad the identity (issue 27, item 3).

Source: ops-transformer posembedding/inplace_partial_rotary_mul_grad/op_host/
inplace_partial_rotary_mul_grad_tiling_base_arch35.cpp @2b888cdb (2026-08): "No-op: empty slice (start == end) or
any of dy/cos/sin is an empty tensor (some dim is 0) ... the kernel goes through TILING_KEY_EMPTY and returns,
dx == dy"; rank 4, cos == sin shapes, the mode, the slice bounds and "The D axis of input cos should not be greater
than the D axis of input dy" are still checked before it. The aclnn doc agrees since ops-transformer 5778144
(2026-08-21, docs/aclnnInplacePartialRotaryMulGrad.md, "空输入支持": an empty dyRef, cos or sin is a no-op that
returns directly; the older revision @307cfaf2 said "该算子不支持输入空Tensor"), so ascend950 reports nothing. Both
runtimes, the native C kernel and the ONNX function body return dy.
"""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest

import geir
from geir import GraphError
from native_helpers import requires_compiler
from oracles.onnx_runners import run_onnxruntime
from rotary.helpers import ROPE, ROPE_GRAD, rotary_graph

# (dy, cos = sin, slice): an empty dy, an empty cos batch (not broadcastable onto dy), an empty cos seq with a
# last axis that is not the slice length, and an empty head axis with D beyond the 1024 of RP-T3
EMPTY_CASES = [((0, 2, 2, 8), (1, 2, 1, 4), [2, 6]), ((2, 2, 2, 8), (0, 2, 1, 4), [2, 6]),
               ((2, 2, 2, 8), (1, 0, 1, 3), [2, 6]), ((2, 2, 0, 2000), (1, 1, 1, 4), [0, 4])]


def _feeds(g: geir.Graph, dtype, cos_dtype) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(3)
    shapes = {v.name: v.shape for v in g.inputs}
    return {"x": rng.standard_normal(shapes["x"]).astype(dtype),
            "cos": rng.standard_normal(shapes["cos"]).astype(cos_dtype),
            "sin": rng.standard_normal(shapes["sin"]).astype(cos_dtype)}


@pytest.mark.parametrize("x, cos, pslice", EMPTY_CASES)
@pytest.mark.parametrize("dtype, cos_dtype", [("float32", "float32"), ("bfloat16", "float16"), ("float16", "bfloat16")])
def test_an_empty_grad_input_is_the_identity_on_both_runtimes(x, cos, pslice, dtype, cos_dtype):
    g = rotary_graph(ROPE_GRAD, x, cos, dtype, cos_dtype, rotary_mode=1, partial_slice=pslice)
    np_types = {"float32": np.float32, "float16": np.float16, "bfloat16": ml_dtypes.bfloat16}
    feeds = _feeds(g, np_types[dtype], np_types[cos_dtype])
    for runtime in ("numpy", "onnxruntime"):
        y = geir.run(g, feeds, runtime=runtime)["y"]
        assert y.shape == x and y.dtype == feeds["x"].dtype
        assert np.array_equal(y.view(np.uint8), feeds["x"].view(np.uint8)), runtime   # bit for bit dy
    y = run_onnxruntime(geir.to_onnx(g), feeds)["y"]                                       # plain ORT: the body
    assert np.array_equal(y.view(np.uint8), feeds["x"].view(np.uint8))


@requires_compiler
def test_the_native_kernel_runs_the_empty_grad():
    from native_helpers import native_calls
    g = rotary_graph(ROPE_GRAD, (2, 2, 2, 8), (0, 2, 1, 4), rotary_mode=1, partial_slice=[2, 6])
    feeds = _feeds(g, np.float32, np.float32)
    before = native_calls()
    y = geir.run(g, feeds, runtime="onnxruntime")["y"]
    assert native_calls() > before and np.array_equal(y, feeds["x"])


def test_the_rules_the_tiling_still_checks_bind_an_empty_grad():
    with pytest.raises(GraphError, match=r"\[RP-S1\]"):
        rotary_graph(ROPE_GRAD, (0, 2, 8), (1, 1, 1, 4), partial_slice=[0, 4])
    with pytest.raises(GraphError, match=r"\[RP-S2\]"):
        b = geir.GraphBuilder("g")
        dy, c, s = b.input("dy", "float32", (0, 2, 2, 8)), b.input("c", "float32", (1, 2, 1, 4)), b.input(
            "s", "float32", (1, 2, 1, 2))
        b.InplacePartialRotaryMulGrad(dy, c, s, rotary_mode=1, partial_slice=[2, 6])
    with pytest.raises(GraphError, match=r"\[RP-S5\]"):      # the arch35 tiling checks the bounds before the no-op
        rotary_graph(ROPE_GRAD, (0, 2, 2, 4), (1, 2, 1, 4), partial_slice=[5, 5])
    with pytest.raises(GraphError, match=r"\[RP-S7b\] .*input 1 'cos' dim 3: expected <= D = 8"):
        rotary_graph(ROPE_GRAD, (0, 2, 2, 8), (1, 2, 1, 12), partial_slice=[2, 6])


def test_ascend950_accepts_it_silently_and_still_needs_mode_1():
    g = rotary_graph(ROPE_GRAD, (2, 2, 0, 2000), (1, 1, 1, 4), rotary_mode=1, partial_slice=[0, 4])
    report = geir.check(g, "ascend950")                   # filterwarnings=error: a warning would fail here
    assert report.ok and report.rules() == set() and not report.warnings   # no RP-T3: D = 2000 unchecked for identity
    g0 = rotary_graph(ROPE_GRAD, (2, 2, 0, 8), (1, 1, 1, 4), partial_slice=[0, 4])     # IR default mode 0
    assert geir.check(g0, "ascend950").rules() == {"RP-T2"}
    for target in ("ascend910b", "ascend910_93"):                        # no grad kernel there at all
        assert geir.check(g, target).rules() == {"RP-T1"}


def test_the_forward_still_refuses_empty_tensors_with_a_slice():
    with pytest.raises(GraphError, match=r"\[RP-S6\] InplacePartialRotaryMul 'node': input 0 'x' dim 0"):
        rotary_graph(ROPE, (0, 2, 2, 8), (1, 2, 1, 4), partial_slice=[2, 6])
