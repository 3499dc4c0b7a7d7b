"""geir.grad: every standard op's rule against central finite differences of the float64 reference (a random
cotangent u and direction v: <u, (f(x + eps v) - f(x - eps v)) / 2 eps> == sum over inputs of <grad_x, v_x>), a
training step through all families, both runtimes, the errors. Each family's rules are tested in its folder
(tests/<family>/test_*_vjp.py)."""

from __future__ import annotations

import numpy as np
import pytest

import geir
from geir.testing import reference
from helpers import directional_error, ints, uniform_feeds
from moe.helpers import moe_vjp_graph
from rotary.helpers import rotary_vjp_graph
from sparse_attention.helpers import SFA, AttentionCase, only_attention_out, sfa_graph


def _graph(name: str, inputs: dict[str, tuple], body, dtype="float32"):
    b = geir.GraphBuilder(name)
    values = {k: b.input(k, dtype, shape) for k, shape in inputs.items()}
    result = body(b, *values.values())
    for i, value in enumerate(result if isinstance(result, tuple) else (result,)):
        b.output(value, f"out{i}")
    return b.build()


STANDARD = {
    "add_broadcast": ({"a": (2, 3, 4), "b": (3, 1)}, lambda b, a, c: b.op("Add", a, c)),
    "sub_broadcast": ({"a": (4,), "b": (2, 3, 4)}, lambda b, a, c: b.op("Sub", a, c)),
    "mul_broadcast": ({"a": (2, 1, 4), "b": (1, 3, 4)}, lambda b, a, c: b.op("Mul", a, c)),
    "div_broadcast": ({"a": (2, 3, 4), "b": (1, 4)}, lambda b, a, c: b.op("Div", a, c)),
    "neg": ({"a": (2, 3)}, lambda b, a: b.op("Neg", a)),
    "matmul_batched": ({"a": (2, 3, 4), "b": (4, 5)}, lambda b, a, c: b.op("MatMul", a, c)),
    "matmul_broadcast_batch": ({"a": (1, 3, 4), "b": (2, 4, 5)}, lambda b, a, c: b.op("MatMul", a, c)),
    "transpose": ({"a": (2, 3, 4)}, lambda b, a: b.op("Transpose", a, perm=[2, 0, 1])),
    "reshape": ({"a": (2, 3, 4)}, lambda b, a: b.op("Reshape", a, ints(b, [4, 6], "shape"))),
    "squeeze_unsqueeze": ({"a": (2, 1, 4)}, lambda b, a: b.op("Unsqueeze", b.op("Squeeze", a, ints(b, [1], "s")),
                                                              ints(b, [0], "u"))),
    "flatten": ({"a": (2, 3, 4)}, lambda b, a: b.op("Flatten", a, axis=2)),
    "concat": ({"a": (2, 3), "b": (2, 5)}, lambda b, a, c: b.op("Concat", a, c, a, axis=1)),
    "slice_contiguous": ({"a": (4, 6)}, lambda b, a: b.op("Slice", a, ints(b, [1, 2], "s"), ints(b, [3, 5], "e"))),
    "slice_strided": ({"a": (3, 8)}, lambda b, a: b.op("Slice", a, ints(b, [1], "s"), ints(b, [8], "e"),
                                                       ints(b, [1], "ax"), ints(b, [2], "st"))),
    "slice_reversed": ({"a": (3, 8)}, lambda b, a: b.op("Slice", a, ints(b, [-2], "s"), ints(b, [-9], "e"),
                                                        ints(b, [-1], "ax"), ints(b, [-3], "st"))),
    "gather_repeats_and_negative": ({"a": (5, 3)}, lambda b, a: b.op("Gather", a, b.constant(
        "i", np.array([[0, 4], [4, -1], [2, 0]], np.int64)))),
    "gather_axis1": ({"a": (2, 6, 3)}, lambda b, a: b.op("Gather", a, b.constant("i", np.array([5, 1, 1], np.int32)),
                                                         axis=1)),
    "cast_roundtrip": ({"a": (2, 3)}, lambda b, a: b.op("Cast", b.op("Cast", a, to=10), to=1)),
    "identity": ({"a": (2, 3)}, lambda b, a: b.op("Identity", a)),
    "reduce_sum_keepdims": ({"a": (2, 3, 4)}, lambda b, a: b.op("ReduceSum", a, ints(b, [0, 2], "ax"), keepdims=1)),
    "reduce_sum_dropped": ({"a": (2, 3, 4)}, lambda b, a: b.op("ReduceSum", a, ints(b, [-1], "ax"), keepdims=0)),
    "reduce_sum_all": ({"a": (2, 3)}, lambda b, a: b.op("ReduceSum", a, keepdims=0)),
    "softmax": ({"a": (2, 3, 5)}, lambda b, a: b.op("Softmax", a, axis=1)),
    # 0-d operands (found by the random graphs: Transpose's VJP emitted a Transpose with perm [], which ONNX cannot write)
    "transpose_0d": ({"a": ()}, lambda b, a: b.op("Transpose", a)),
    "reduce_sum_0d_dropped": ({"a": ()}, lambda b, a: b.op("ReduceSum", a, keepdims=0)),
    "shared_value": ({"a": (2, 3)}, lambda b, a: b.op("Mul", b.op("Add", a, a), a)),
}


@pytest.mark.parametrize("name", list(STANDARD))
def test_standard_op_vjps_match_finite_differences(name):
    inputs, body = STANDARD[name]
    graph = _graph(name, inputs, body)
    assert directional_error(graph, uniform_feeds(graph)) < 1e-7


def test_the_derivative_exports_and_runs_on_both_runtimes():
    graph = rotary_vjp_graph("InplacePartialRotaryMul", 1, (2, 3, 4, 8), (1, 3, 1, 8), [0, 8])
    derivative = geir.grad(graph)
    model = geir.to_onnx(derivative)
    import onnx
    onnx.checker.check_model(model, full_check=True)
    feeds = {k: v.astype(np.float32) for k, v in uniform_feeds(derivative).items()}
    want = reference(derivative, feeds)
    for runtime in geir.runtimes.runtime_names() if hasattr(geir, "runtimes") else ("numpy", "onnxruntime"):
        got = geir.run(derivative, feeds, runtime=runtime)
        for name in want:
            np.testing.assert_allclose(got[name], want[name], rtol=1e-5, atol=1e-5)
    assert [v.name for v in derivative.inputs] == ["x", "cos", "sin", "grad_y"]
    assert [v.name for v in derivative.outputs] == ["y", "grad_x", "grad_cos", "grad_sin"]


def test_errors_name_the_op_and_the_reason():
    graph = _graph("acosh", {"a": (2, 3)}, lambda b, a: b.op("Acosh", a))
    with pytest.raises(geir.GraphError, match=r"no VJP rule for Acosh 'Acosh_0'"):
        geir.grad(graph)
    graph = _graph("add", {"a": (2, 3)}, lambda b, a: b.op("Add", a, a))
    with pytest.raises(geir.GraphError, match=r"has no input 'nope'"):
        geir.grad(graph, wrt=["nope"])
    with pytest.raises(geir.GraphError, match=r"has no output 'nope'"):
        geir.grad(graph, outputs=["nope"])
    case = AttentionCase(B=1, S1=2, S2=4, N1=2, D=4, D2=4, K=2, lengths=True, mode=0)
    bsnd, _ = sfa_graph(case.arrays(), SFA, **dict(case.forward_attrs(), return_softmax_lse=False))
    with pytest.raises(geir.GraphError, match=r"BSND with actual_seq_lengths"):
        geir.grad(only_attention_out(bsnd))
    full, _ = sfa_graph(AttentionCase(B=1, S1=2, S2=4, N1=2, D=4, D2=4, K=2).arrays(), SFA,
                        **AttentionCase(B=1, S1=2, S2=4, N1=2, D=4, D2=4, K=2).forward_attrs())
    with pytest.raises(geir.GraphError, match=r"softmax statistics get a cotangent"):
        geir.grad(full)
    assert "grad_query" in [v.name for v in geir.grad(full, outputs=["attention_out"]).outputs]


def test_a_wrt_input_without_a_path_gets_zeros():
    graph = _graph("unused", {"a": (2, 3), "b": (2, 3)}, lambda b, a, c: b.op("Neg", a))
    derivative = geir.grad(graph)
    result = reference(derivative, {"a": np.ones((2, 3), np.float32), "b": np.ones((2, 3), np.float32),
                                    "grad_out0": np.ones((2, 3), np.float32)})
    assert np.array_equal(result["grad_b"], np.zeros((2, 3))) and np.array_equal(result["grad_a"], -np.ones((2, 3)))


def _rope_attention_moe() -> geir.Graph:
    """rope -> sparse attention -> Reshape, Mul -> MoE unpermute: a forward of a model's training step."""
    b = geir.GraphBuilder("rope_attention_moe")
    x = b.input("x", "float16", (1, 4, 2, 8))
    cos = b.input("cos", "float16", (1, 4, 1, 8))
    sin = b.input("sin", "float16", (1, 4, 1, 8))
    key = b.input("key", "float16", (1, 6, 1, 8))
    probs = b.input("probs", "float16", (4, 2))
    blocks = b.constant("sparse_indices", np.array([[0, 1, -1], [2, 0, 1], [3, 1, -1], [4, 5, 0]],
                                                   np.int32).reshape(1, 4, 1, 3))
    order = b.constant("sorted_indices", np.array([3, 0, 6, 1, 7, 2, 5, 4], np.int32))
    q = b.InplacePartialRotaryMul(x, cos, sin, rotary_mode=1, partial_slice=[0, 8])
    out, _, _ = b.SparseFlashAttention(q, key, key, blocks, scale_value=0.35, sparse_mode=0)
    rows = b.op("Reshape", out, b.constant("rows", np.array([8, 8], np.int64)))
    scaled = b.op("Mul", rows, b.constant("half", np.array(0.5, np.float16)))
    b.output(b.MoeTokenUnpermute(scaled, order, probs), "y")
    return b.build()


def test_a_training_step_differentiates_checks_exports_and_runs_everywhere():
    graph = _rope_attention_moe()
    rng = np.random.default_rng(11)
    feeds = {v.name: rng.uniform(-1, 1, v.type.shape).astype(np.float16) for v in graph.inputs}
    assert directional_error(graph, feeds) < 1e-6
    derivative = geir.grad(graph)
    ops = {n.op_type for n in derivative.nodes}
    assert {"InplacePartialRotaryMulGrad", "SparseFlashAttentionGrad", "MoeTokenUnpermuteGrad"} <= ops
    # spec 2.3 RP-T1: InplacePartialRotaryMulGrad has no ascend910b kernel, so the derivative of a rope passes
    # everything the forward passes there except that rule (the "passes wherever the forward passes"
    # cannot hold for rotary on A2/A3)
    forward_rules = {v.rule for v in geir.check(graph, "ascend910b").errors}
    derivative_rules = {v.rule for v in geir.check(derivative, "ascend910b").errors}
    assert derivative_rules == forward_rules | {"RP-T1"}
    import onnx
    onnx.checker.check_model(geir.to_onnx(derivative), full_check=True)
    cotangent = {"grad_y": rng.uniform(-1, 1, (4, 8)).astype(np.float16)}
    want = reference(derivative, {**feeds, **cotangent}, rounded=False)
    for runtime in ("numpy", "onnxruntime"):
        got = geir.run(derivative, {**feeds, **cotangent}, runtime=runtime)
        for name, expected in want.items():
            distance = np.linalg.norm(got[name].astype(np.float64) - expected) / max(np.linalg.norm(expected), 1e-30)
            assert distance < 2e-2, (runtime, name, distance)


def test_rotary_and_moe_gradients_agree_with_torch_autograd():
    """The same math written the usual PyTorch way (Llama's rotate_half; a gather and a weighted sum), float64."""
    torch = pytest.importorskip("torch")
    rng = np.random.default_rng(12)
    graph = rotary_vjp_graph("InplacePartialRotaryMul", 0, (2, 3, 4, 8), (1, 3, 1, 8), [0, 8])
    feeds = {k: rng.standard_normal(v.shape) for k, v in uniform_feeds(graph).items()}
    u = rng.standard_normal((2, 3, 4, 8))
    got = reference(geir.grad(graph), {**feeds, "grad_y": u}, rounded=False)
    x, c, s = (torch.tensor(feeds[k], requires_grad=True) for k in ("x", "cos", "sin"))
    y = x * c + torch.cat([-x[..., 4:], x[..., :4]], -1) * s
    (y * y * torch.tensor(u)).sum().backward()
    for name, tensor in (("x", x), ("cos", c), ("sin", s)):
        np.testing.assert_allclose(got[f"grad_{name}"], tensor.grad.numpy(), rtol=1e-10, atol=1e-12)
    graph = moe_vjp_graph(6, 6, (3, 2))
    feeds = {k: (rng.standard_normal(v.shape) if v.dtype.kind == "f" else v) for k, v in uniform_feeds(graph).items()}
    feeds["indices"] = np.array([3, 0, 5, 1, 4, 2], np.int32)
    u = rng.standard_normal((3, 4))
    got = reference(geir.grad(graph), {**feeds, "grad_y": u}, rounded=False)
    tokens, probs = (torch.tensor(feeds[k], requires_grad=True) for k in ("tokens", "probs"))
    rows = tokens[torch.tensor(feeds["indices"], dtype=torch.long)].reshape(3, 2, 4)
    y = (rows * probs[..., None]).sum(1)
    (y * y * torch.tensor(u)).sum().backward()
    np.testing.assert_allclose(got["grad_tokens"], tokens.grad.numpy(), rtol=1e-10, atol=1e-12)
    np.testing.assert_allclose(got["grad_probs"], probs.grad.numpy(), rtol=1e-10, atol=1e-12)


def test_a_rule_that_fails_is_a_graph_error_naming_the_node(monkeypatch):
    from geir.schemas import vjp

    def broken(ctx, node, grads):
        raise IndexError("surprise")
    monkeypatch.setitem(vjp.VJP_RULES, ("", "Tanh"), broken)
    graph = _graph("tanh", {"a": (2, 3)}, lambda b, a: b.op("Tanh", a))
    with pytest.raises(geir.GraphError, match=r"the VJP rule of Tanh 'Tanh_0' failed: IndexError: surprise"):
        geir.grad(graph)


def test_pass_through_outputs_get_their_own_cotangent_input():
    """Issue 23 item 22: an output that is a graph input x had its cotangent named grad_x, the name of x's gradient:
    geir.grad failed with "output name 'grad_x' is already used". The cotangent is now grad_x_cotangent."""
    b = geir.GraphBuilder("pass_through")
    x = b.input("x", "float32", (2, 3))
    other = b.input("grad_y", "float32", (2, 3))          # a forward input that holds the name grad_y too
    b.output(x)
    b.output(b.op("Neg", b.op("Mul", x, other)), "y")
    graph = b.build()
    derivative = geir.grad(graph)
    assert [v.name for v in derivative.inputs] == ["x", "grad_y", "grad_x_cotangent", "grad_y_cotangent"]
    assert [v.name for v in derivative.outputs] == ["x", "y", "grad_x", "grad_grad_y"]
    rng = np.random.default_rng(7)
    feeds = {k: rng.standard_normal((2, 3)).astype(np.float32) for k in ("x", "grad_y", "grad_x_cotangent",
                                                                          "grad_y_cotangent")}
    for runtime in ("numpy", "onnxruntime"):
        got = geir.run(derivative, feeds, runtime=runtime)
        np.testing.assert_allclose(got["grad_x"], feeds["grad_x_cotangent"] - feeds["grad_y"] * feeds["grad_y_cotangent"],
                                   rtol=1e-6, atol=1e-6)
        np.testing.assert_allclose(got["grad_grad_y"], -feeds["x"] * feeds["grad_y_cotangent"], rtol=1e-6, atol=1e-6)
        np.testing.assert_array_equal(got["x"], feeds["x"])
    assert directional_error(graph, uniform_feeds(graph)) < 1e-7


def test_an_output_that_is_only_an_input_passes_its_cotangent_through():
    b = geir.GraphBuilder("identity_graph")
    b.output(b.input("x", "float32", (3,)))
    derivative = geir.grad(b.build())
    u = np.array([1.5, -2.0, 0.25], np.float32)
    for runtime in ("numpy", "onnxruntime"):
        got = geir.run(derivative, {"x": np.zeros(3, np.float32), "grad_x_cotangent": u}, runtime=runtime)
        np.testing.assert_array_equal(got["grad_x"], u)


@pytest.mark.parametrize("constant", ["grad_y", "grad_x"])
@pytest.mark.parametrize("runtime", ["numpy", "onnxruntime"])
def test_a_constant_named_like_a_cotangent_or_gradient_is_renamed_not_refused(constant, runtime):
    """The derivative's interface (cotangent input grad_y, gradient output grad_x) keeps its names; a constant of
    the graph with one of them is renamed inside the derivative (it failed: 'name is already used')."""
    b = geir.GraphBuilder("named")
    x = b.input("x", "float32", (2,))
    b.output(b.op("Mul", x, b.constant(constant, np.array([3.0, -2.0], np.float32))), "y")
    derivative = geir.grad(b.build())
    assert [v.name for v in derivative.inputs] == ["x", "grad_y"]
    assert [v.name for v in derivative.outputs] == ["y", "grad_x"]
    got = geir.run(derivative, {"x": np.ones(2, np.float32), "grad_y": np.array([1.0, 0.5], np.float32)},
                   runtime=runtime)
    np.testing.assert_array_equal(got["grad_x"], [3.0, -1.0])


@pytest.mark.parametrize("runtime", ["numpy", "onnxruntime"])
@pytest.mark.parametrize("op", ["Gather", "Slice"])
def test_non_finite_cotangents_land_only_where_they_are_placed(op, runtime):
    """Gather's and a strided Slice's cotangents are placed by one-hot products; an inf there must not turn the
    zeros of the one-hot matrix into NaN elsewhere (grad_x was [inf, nan, nan, nan] for Gather(x, [0]))."""
    b = geir.GraphBuilder("placed")
    x = b.input("x", "float32", (6, 2))
    if op == "Gather":
        index = np.array([0, 3, 3, 5, 5], np.int64)
        b.output(b.op("Gather", x, b.constant("index", index), axis=0), "y")
    else:
        index = np.arange(0, 6, 2)
        ints = lambda name, v: b.constant(name, np.array([v], np.int64))       # noqa: E731
        b.output(b.op("Slice", x, ints("start", 0), ints("end", 6), ints("axis", 0), ints("step", 2)), "y")
    cotangent = np.ones((len(index), 2), np.float32)
    cotangent[0, 0], cotangent[1, 1], cotangent[-1, 0] = np.inf, np.nan, -np.inf
    if op == "Gather":                                # index 3 twice: inf + -inf lands there, NaN
        cotangent[1, 0], cotangent[2, 0] = np.inf, -np.inf
    want = np.zeros((6, 2), np.float64)
    with np.errstate(invalid="ignore"):
        np.add.at(want, index, cotangent.astype(np.float64))
    got = geir.run(geir.grad(b.build()), {"x": np.zeros((6, 2), np.float32), "grad_y": cotangent},
                   runtime=runtime)["grad_x"]
    np.testing.assert_array_equal(got, want.astype(np.float32))      # NaN and infinities at the same places


ZERO_SIZE = {
    "gather with no index": ((3, 2), lambda b, x: b.op("Gather", x, b.constant("i", np.zeros((0,), np.int64)))),
    "gather from zero columns": ((3, 0), lambda b, x: b.op("Gather", x, b.constant("i", np.array([2, 0], np.int64)))),
    "unsqueeze of zero rows": ((0, 3), lambda b, x: b.op("Unsqueeze", x, b.constant("a", np.array([0], np.int64)))),
    "squeeze with a zero dim": ((1, 0), lambda b, x: b.op("Squeeze", x, b.constant("a", np.array([0], np.int64)))),
    "reshape to zero rows": ((2, 0), lambda b, x: b.op("Reshape", x, b.constant("s", np.array([0, 5], np.int64)),
                                                      allowzero=1)),
}


@pytest.mark.parametrize("runtime", ["numpy", "onnxruntime"])
@pytest.mark.parametrize("case", list(ZERO_SIZE))
def test_zero_size_tensors_differentiate(case, runtime):
    """A VJP's Reshape to a shape with a 0 means size 0 (allowzero), not ONNX's 'copy this dim'."""
    shape, make = ZERO_SIZE[case]
    b = geir.GraphBuilder("zero")
    x = b.input("x", "float32", shape)
    b.output(make(b, x), "y")
    graph = b.build()
    derivative = geir.grad(graph)
    y_shape = tuple(graph.outputs[0].type.shape)
    got = geir.run(derivative, {"x": np.zeros(shape, np.float32), "grad_y": np.ones(y_shape, np.float32)},
                   runtime=runtime)["grad_x"]
    assert got.shape == shape and not got.any()
