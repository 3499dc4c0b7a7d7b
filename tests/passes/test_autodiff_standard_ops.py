"""geir.grad of the standard ops a transformer's training graph holds, beyond the random graphs of
test_autodiff_property.py: broadcasting decided at run time on symbolic shapes, torch's choices where a function
has no derivative (ties, kinks, bounds), Dropout's mask, opset-specific forms, and the errors for the forms that are
not differentiated."""

from __future__ import annotations

import numpy as np
import pytest

import geir
from geir.schemas import get_schema
from geir.testing import reference
from helpers import directional_error, ints


def _built(name: str, inputs: dict, body, dtype: str = "float32") -> geir.Graph:
    b = geir.GraphBuilder(name)
    values = [b.input(k, dtype, shape) for k, shape in inputs.items()]
    result = body(b, *values)
    for i, value in enumerate(result if isinstance(result, tuple) else (result,)):
        b.output(value, f"out{i}")
    return b.build()


@pytest.mark.parametrize("runtime", ["numpy", "onnxruntime"])
@pytest.mark.parametrize("rows_b", [1, 4], ids=["broadcast", "same"])
def test_broadcast_on_symbols_is_decided_from_the_fed_shapes(runtime, rows_b):
    """a: [n, 3] + b: [m, 3]: the graph cannot tell whether b was broadcast; the fed shapes do (m = 1 sums it)."""
    graph = _built("symbolic", {"a": ("n", 3), "b": ("m", 3)}, lambda b, x, y: b.op("Mul", b.op("Add", x, y), x))
    derivative = geir.grad(graph)
    rng = np.random.default_rng(0)
    a, bb, u = rng.standard_normal((4, 3)), rng.standard_normal((rows_b, 3)), rng.standard_normal((4, 3))
    got = geir.run(derivative, {"a": a.astype(np.float32), "b": bb.astype(np.float32),
                                "grad_out0": u.astype(np.float32)}, runtime=runtime)
    want_b = u * a
    want_b = want_b.sum(axis=0, keepdims=True) if rows_b == 1 else want_b
    np.testing.assert_allclose(got["grad_b"], want_b, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(got["grad_a"], u * (2 * a + bb), rtol=1e-5, atol=1e-5)
    assert got["grad_b"].shape == (rows_b, 3)


def _torch():
    return pytest.importorskip("torch", reason="torch is not installed: its autograd is the oracle here")


# (name, inputs with ties or kinks, geir body, torch function): where the derivative is not defined, geir makes
# torch's choice
TIES = {
    "max_ties": ({"a": [[1.0, 2.0, 3.0]], "b": [[1.0, 5.0, 3.0]]},
                 lambda b, x, y: b.op("Max", x, y), lambda t, x, y: t.maximum(x, y)),
    "min_ties": ({"a": [[1.0, 2.0, 3.0]], "b": [[1.0, 5.0, 3.0]]},
                 lambda b, x, y: b.op("Min", x, y), lambda t, x, y: t.minimum(x, y)),
    "reduce_max_ties": ({"a": [[1.0, 3.0, 3.0], [2.0, 2.0, 2.0]]},
                        lambda b, x: b.op("ReduceMax", x, ints(b, [1], "ax"), keepdims=0),
                        lambda t, x: t.amax(x, dim=1)),
    "reduce_min_ties": ({"a": [[1.0, 1.0, 3.0], [2.0, 2.0, 2.0]]},
                        lambda b, x: b.op("ReduceMin", x, ints(b, [1], "ax"), keepdims=1),
                        lambda t, x: t.amin(x, dim=1, keepdim=True)),
    "relu_at_zero": ({"a": [[-1.0, 0.0, 2.0]]}, lambda b, x: b.op("Relu", x), lambda t, x: t.relu(x)),
    "leaky_relu_at_zero": ({"a": [[-1.0, 0.0, 2.0]]}, lambda b, x: b.op("LeakyRelu", x, alpha=0.1),
                           lambda t, x: t.nn.functional.leaky_relu(x, 0.1)),
    "abs_at_zero": ({"a": [[-1.0, 0.0, 2.0]]}, lambda b, x: b.op("Abs", x), lambda t, x: t.abs(x)),
    "clip_at_bounds": ({"a": [[-1.0, 0.0, 0.5, 1.0, 2.0]]},
                       lambda b, x: b.op("Clip", x, b.constant("lo", np.float64(0.0)),
                                         b.constant("hi", np.float64(1.0))),
                       lambda t, x: t.clamp(x, 0.0, 1.0)),
    "reduce_prod_one_zero": ({"a": [[2.0, 0.0, 3.0], [1.0, 2.0, 4.0]]},
                             lambda b, x: b.op("ReduceProd", x, ints(b, [1], "ax"), keepdims=0),
                             lambda t, x: t.prod(x, dim=1)),
    "reduce_prod_two_zeros": ({"a": [[0.0, 0.0, 3.0]]}, lambda b, x: b.op("ReduceProd", x, ints(b, [1], "ax")),
                              lambda t, x: t.prod(x, dim=1, keepdim=True)),
    "pow_zero_base": ({"a": [[0.0, 2.0]], "b": [[2.0, 0.5]]}, lambda b, x, y: b.op("Pow", x, y),
                      lambda t, x, y: t.pow(x, y)),
    "reduce_l2_zero_norm": ({"a": [[0.0, 0.0], [3.0, 4.0]]},
                            lambda b, x: b.op("ReduceL2", x, ints(b, [1], "ax"), keepdims=0),
                            lambda t, x: t.linalg.vector_norm(x, dim=1)),
    "top_k": ({"a": [[0.5, 3.0, -1.0, 2.0]]}, lambda b, x: b.op("TopK", x, ints(b, [2], "k"))[0],
              lambda t, x: t.topk(x, 2).values),
}


@pytest.mark.parametrize("case", sorted(TIES))
def test_choices_where_the_derivative_is_undefined_are_torchs(case):
    t = _torch()
    arrays, body, torch_fn = TIES[case]
    feeds = {k: np.asarray(v, np.float64) for k, v in arrays.items()}
    graph = _built(case, {k: a.shape for k, a in feeds.items()}, body, "float64")
    derivative = geir.grad(graph)
    tensors = {k: t.tensor(a, requires_grad=True) for k, a in feeds.items()}
    out = torch_fn(t, *tensors.values())
    u = np.random.default_rng(3).standard_normal(tuple(out.shape))
    out.backward(t.from_numpy(u))
    got = reference(derivative, {**feeds, "grad_out0": u}, rounded=False)
    for k, tensor in tensors.items():
        np.testing.assert_allclose(got[f"grad_{k}"], tensor.grad.numpy(), rtol=1e-12, atol=1e-12, err_msg=k)


@pytest.mark.parametrize("runtime", ["numpy", "onnxruntime"])
def test_training_dropout_differentiates_through_its_own_mask(runtime):
    """The forward returns no mask; the derivative makes it return one and scales the kept cotangents by 1/(1-r)."""
    def body(b, x):
        return b.op("Dropout", x, b.constant("ratio", np.float32(0.25)), b.constant("training", np.bool_(True)),
                    seed=3)
    graph = _built("dropout", {"x": (6, 8)}, body)
    derivative = geir.grad(graph)
    assert [n.op_type for n in derivative.nodes].count("Dropout") == 1
    x = np.random.default_rng(0).uniform(1, 2, (6, 8)).astype(np.float32)
    u = np.ones((6, 8), np.float32)
    got = geir.run(derivative, {"x": x, "grad_out0": u}, runtime=runtime)
    kept = got["out0"] != 0
    assert 0 < kept.sum() < kept.size
    np.testing.assert_allclose(got["grad_x"], np.where(kept, 1 / 0.75, 0), rtol=1e-6)


def test_inference_dropout_and_old_softmax_forms():
    """Dropout without training is the identity; Softmax and LogSoftmax before opset 13 normalise every axis from
    ``axis`` on (default 1)."""
    graph = _built("dropout", {"x": (2, 3)}, lambda b, x: b.op("Dropout", x))
    derivative = geir.grad(graph)
    got = reference(derivative, {"x": np.ones((2, 3)), "grad_out0": np.full((2, 3), 2.0)}, rounded=False)
    np.testing.assert_array_equal(got["grad_x"], np.full((2, 3), 2.0))
    for op_type in ("Softmax", "LogSoftmax"):
        b = geir.GraphBuilder(f"old_{op_type}")
        x = b.input("x", "float32", (2, 3, 4))
        b.output(b.add_node(get_schema(op_type, "", version=11), [x], {}), "out0")
        graph = b.build()
        feeds = {"x": np.random.default_rng(1).standard_normal((2, 3, 4)).astype(np.float32)}
        assert directional_error(graph, feeds) < 1e-6, op_type


def test_newer_opset_normalizations_and_gelu():
    """RMSNormalization (opset 23), Gelu (opset 20) and LayerNormalization's statistics outputs."""
    b = geir.GraphBuilder("norms")
    x = b.input("x", "float32", (2, 3, 8))
    scale = b.input("scale", "float32", (8,))
    rms = b.add_node(get_schema("RMSNormalization", "", version=23), [x, scale], {"epsilon": 1e-3})
    gelu = b.add_node(get_schema("Gelu", "", version=20), [rms], {"approximate": "tanh"})
    y, mean, inv = b.op("LayerNormalization", gelu, scale, None, axis=-1, outputs=3)
    b.output(b.op("Add", b.op("ReduceSum", y, keepdims=0), b.op("ReduceSum", b.op("Mul", mean, inv), keepdims=0)),
             "out0")
    graph = b.build()
    rng = np.random.default_rng(2)
    feeds = {"x": rng.standard_normal((2, 3, 8)).astype(np.float32),
             "scale": rng.uniform(0.5, 1.5, (8,)).astype(np.float32)}
    assert directional_error(graph, feeds) < 1e-6


@pytest.mark.parametrize("case, message", [
    ("batch_norm_training", r"training form of opset 14\+"),
    ("scatter_mul", r"reduction 'mul' is not differentiated"),
])
def test_forms_not_differentiated_are_named(case, message):
    bodies = {
        "batch_norm_training": lambda b, x: b.add_node(get_schema("BatchNormalization", "", version=9), [x, *(
            b.constant(n, np.ones(3, np.float32)) for n in "sbmv")], {}, output_names=["y", "y_mean", "y_var", "saved_mean", "saved_var"])[0],
        "scatter_mul": lambda b, x: b.op("ScatterElements", x, b.constant("i", np.zeros((1, 3), np.int64)),
                                         b.constant("u", np.ones((1, 3), np.float32)), reduction="mul"),
    }
    shape = (3, 3) if case != "batch_norm_training" else (2, 3, 4)
    graph = _built(case, {"x": shape}, bodies[case])
    with pytest.raises(geir.GraphError, match=message):
        geir.grad(graph)


@pytest.mark.parametrize("rows", [3, 5])
def test_dynamic_shapes_as_exports_write_them(rows):
    """Slice bounds computed from Shape, Concat of pieces of symbolic size, Gather of rows NonZero picks, Tile: the
    forms of exports with dynamic batch and sequence (and of MoE's per-expert loop), differentiated with the shapes
    known only at run time."""
    b = geir.GraphBuilder("dynamic")
    x = b.input("x", "float64", ("n", 6))
    width = b.op("Gather", b.op("Shape", x), ints(b, [1], "one"))
    half = b.op("Div", width, ints(b, [2], "two"))
    left = b.op("Slice", x, ints(b, [0], "zero"), half, ints(b, [1], "axis"))
    right = b.op("Slice", x, half, ints(b, [2 ** 62], "end"), ints(b, [1], "axis2"))
    swapped = b.op("Concat", b.op("Tanh", right), left, axis=1)
    chosen = b.op("NonZero", b.op("Greater", b.op("ReduceSum", x, ints(b, [1], "axis3"), keepdims=0),
                                  b.constant("zero_f", np.float64(0.0))))
    picked = b.op("Gather", x, b.op("Squeeze", chosen, ints(b, [0], "axis4")))
    tiled = b.op("Tile", b.op("Mul", x, x), b.op("Concat", ints(b, [2], "r0"), half, axis=0))
    b.output(swapped, "swapped")
    b.output(picked, "picked")
    b.output(tiled, "tiled")
    graph = b.build()
    x_value = np.random.default_rng(rows).standard_normal((rows, 6))
    assert directional_error(graph, {"x": x_value}) < 1e-7


@pytest.mark.parametrize("equation, shapes", [
    ("ii->i", [(3, 3)]), ("ii->", [(4, 4)]), ("bii->bi", [(2, 3, 3)]), ("iij,jk->ik", [(3, 3, 2), (2, 4)]),
    ("iii->i", [(2, 2, 2)]), ("ij,jj->ij", [(2, 3), (3, 3)]),
])
def test_einsum_diagonals_get_their_cotangent_on_the_diagonal(equation, shapes):
    b = geir.GraphBuilder("diagonal")
    xs = [b.input(f"x{i}", "float64", s) for i, s in enumerate(shapes)]
    b.output(b.op("Einsum", *xs, equation=equation), "y")
    rng = np.random.default_rng(5)
    assert directional_error(b.build(), {f"x{i}": rng.standard_normal(s) for i, s in enumerate(shapes)}) < 1e-8


def test_an_einsum_diagonal_of_symbolic_size_is_named():
    b = geir.GraphBuilder("diagonal")
    x = b.input("x", "float64", ("n", "n"))
    b.output(b.op("Einsum", x, equation="ii->i"), "y")
    with pytest.raises(geir.GraphError, match="diagonal along subscript 'i' needs a static size"):
        geir.grad(b.build())


@pytest.mark.parametrize("batch_dims, data, indices", [
    (1, (2, 3, 4), [[[1], [-1]], [[0], [0]]]),             # a repeated and a negative row per batch
    (1, (2, 3, 4), [[[1, 2]], [[2, -4]]]),
    (2, (2, 2, 3, 2), [[[[2], [0], [2]], [[1], [1], [0]]], [[[0], [2], [1]], [[2], [2], [2]]]]),
])
def test_gather_nd_with_batch_dims_places_each_batch_in_its_own_rows(batch_dims, data, indices):
    b = geir.GraphBuilder("gather_nd")
    x = b.input("x", "float64", data)
    b.output(b.op("GatherND", x, b.constant("i", np.array(indices, np.int64)), batch_dims=batch_dims), "y")
    assert directional_error(b.build(), {"x": np.random.default_rng(6).standard_normal(data)}) < 1e-8


@pytest.mark.parametrize("wrt", [None, ["x", "scale", "bias"]])
@pytest.mark.parametrize("shape", [(4, 3), (2, 3, 5), (2, 3, 2, 2)])
def test_training_batch_norm_differentiates_through_the_batch_statistics(shape, wrt):
    """training_mode 1: the batch's mean and variance (and with three outputs the running statistics, which mix the
    given ones by momentum) depend on x; every input gets its cotangent."""
    b = geir.GraphBuilder("batch_norm")
    x = b.input("x", "float64", shape)
    params = [b.input(n, "float64", (3,)) for n in ("scale", "bias", "mean", "var")]
    for k, value in enumerate(b.op("BatchNormalization", x, *params, training_mode=1, momentum=0.8, epsilon=1e-3,
                                   outputs=3)):
        b.output(value, f"out{k}")
    rng = np.random.default_rng(8)
    feeds = {"x": rng.standard_normal(shape), "scale": rng.uniform(0.5, 1.5, 3), "bias": rng.standard_normal(3),
             "mean": rng.standard_normal(3), "var": rng.uniform(0.5, 1.5, 3)}
    assert directional_error(b.build(), feeds, wrt=wrt) < 1e-7
