"""One contract on both runtimes: feeds and constants never modified, pass-through outputs, the same
fed-shape and data checks with the same messages."""

from __future__ import annotations

import numpy as np
import pytest

import geir
from geir import ExecutionError
from helpers import ROPE_GRAD

RUNTIMES = ["numpy", "onnxruntime"]


def _dropout_then_rotary(source: str) -> tuple[geir.Graph, dict[str, np.ndarray]]:
    """Dropout (onnx.reference returns its input object) feeding an in-place rotary grad."""
    b = geir.GraphBuilder("alias")
    x = b.input("x", "float32", (1, 2, 1, 4)) if source == "feed" else b.constant("x", np.arange(8, dtype=np.float32)
                                                                                    .reshape(1, 2, 1, 4))
    cos = b.input("cos", "float32", (1, 2, 1, 4))
    y = b.op("Dropout", x)[0]
    b.output(b.InplacePartialRotaryMulGrad(y, cos, cos, rotary_mode=1, partial_slice=[0, 4]), "dx")
    feeds = {"cos": np.full((1, 2, 1, 4), 0.5, np.float32)}
    if source == "feed":
        feeds["x"] = np.arange(8, dtype=np.float32).reshape(1, 2, 1, 4).copy()   # owns its data
    return b.build(), feeds


@pytest.mark.parametrize("runtime", RUNTIMES)
@pytest.mark.parametrize("source", ["feed", "constant"])
def test_in_place_op_after_an_aliasing_standard_kernel_leaves_feeds_and_constants_alone(runtime, source):
    g, feeds = _dropout_then_rotary(source)
    before = {k: v.copy() for k, v in feeds.items()}
    constants = {k: v.copy() for k, v in g.constants.items()}
    first = geir.run(g, feeds, runtime=runtime)["dx"]
    second = geir.run(g, feeds, runtime=runtime)["dx"]
    assert all(np.array_equal(before[k], feeds[k]) for k in feeds)
    assert all(np.array_equal(constants[k], g.constants[k]) for k in constants)
    np.testing.assert_array_equal(first, second)
    x = np.arange(8, dtype=np.float32).reshape(1, 2, 1, 4)
    want = 0.5 * x + 0.5 * x[..., [1, 0, 3, 2]] * np.array([1, -1, 1, -1], np.float32)
    np.testing.assert_allclose(first, want, rtol=1e-6)


@pytest.mark.parametrize("runtime", RUNTIMES)
def test_a_view_of_an_owned_value_is_not_overwritten_by_a_later_in_place_op(runtime):
    b = geir.GraphBuilder("views")
    x = b.input("x", "float32", (1, 1, 1, 4))
    c = b.input("c", "float32", (1, 1, 1, 4))
    first = b.InplacePartialRotaryMulGrad(x, c, c, rotary_mode=1, partial_slice=[0, 4])
    view = b.op("Reshape", first, b.constant("shape", np.array([4], np.int64)))
    second = b.InplacePartialRotaryMulGrad(first, c, c, rotary_mode=1, partial_slice=[0, 4])
    b.output(view, "view")
    b.output(second, "twice")
    g = b.build()
    feeds = {"x": np.array([1, 2, 3, 4], np.float32).reshape(1, 1, 1, 4), "c": np.ones((1, 1, 1, 4), np.float32)}
    once = geir.run(g, feeds, runtime=runtime)
    # dx = c*dy + s*swap: with c = s = 1, [1,2,3,4] -> [1+2, 2-1, 3+4, 4-3]
    np.testing.assert_array_equal(once["view"], [3, 1, 7, 1])
    np.testing.assert_array_equal(once["twice"].reshape(-1), [4, -2, 8, -6])


@pytest.mark.parametrize("runtime", RUNTIMES)
def test_a_graph_input_that_is_also_an_output_is_returned_as_fed(runtime):
    b = geir.GraphBuilder("passthrough")
    x = b.input("x", "float16", ("B", 2, 1, 4))
    c = b.input("c", "float16", (1, 2, 1, 4))
    b.output(b.InplacePartialRotaryMulGrad(x, c, c, rotary_mode=1, partial_slice=[0, 4]), "dx")
    b.output(x)
    b.output(c)
    g = b.build()
    rng = np.random.default_rng(0)
    for batch in (3, 1, 2):   # a symbolic shape: nothing of an earlier run may come back
        feeds = {"x": rng.standard_normal((batch, 2, 1, 4)).astype(np.float16),
                 "c": rng.standard_normal((1, 2, 1, 4)).astype(np.float16)}
        out = geir.run(g, feeds, runtime=runtime)
        np.testing.assert_array_equal(out["x"], feeds["x"])
        np.testing.assert_array_equal(out["c"], feeds["c"])
        assert not np.shares_memory(out["x"], feeds["x"])
