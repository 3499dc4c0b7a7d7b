"""geir.grad(..., target=...) (issue 27, item 4): an op of ours the derivative adds and the device refuses (the rotary
grad on ascend910b / ascend910_93, RP-T1; the MoE grad on ascend950, MG-T1) is emitted in a form the device has: the
forward with negated sin where the tables are proven pair-duplicated (spec 6.2), else the op's standard-op body. The
derivative then breaks no rule on the target that the forward does not, computes the same bits as the derivative
without a target on both runtimes, and the report says which form each op took."""

from __future__ import annotations

import numpy as np
import pytest

import geir
from geir.passes.target_forms import KERNEL, STANDARD_OPS, SUBSTITUTE
from geir.testing import reference
from moe.helpers import moe_vjp_graph
from rotary.helpers import rotary_vjp_graph

A2, A3, A5 = "ascend910b", "ascend910_93", "ascend950"
TARGETS = (A2, A3, A5)
RUNTIMES = ("numpy", "onnxruntime")
ROPE, ROPE_GRAD = "InplacePartialRotaryMul", "InplacePartialRotaryMulGrad"


def _errors(graph: geir.Graph, target: str) -> set[tuple[str, str]]:
    return {(v.node, v.rule) for v in geir.check(graph, target).errors}


def _feeds(graph: geir.Graph, seed: int = 0) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {v.name: rng.standard_normal(v.type.shape).astype(v.dtype.numpy) for v in graph.inputs
            if v.dtype.is_floating}


def _assert_same_bits(plain: geir.Graph, lowered: geir.Graph, feeds: dict[str, np.ndarray]) -> None:
    """Bit for bit on NumPy, and on ONNX Runtime for float32. ONNX Runtime's CPU computes a float16/bfloat16 Mul or
    Add in float32 between Casts and drops a float32 -> float16 -> float32 round trip it then finds (whatever the
    optimisation level): where such an op feeds the standard-op body's Cast, its rounding to float16 is skipped. The
    body itself is bit-exact there too (``test_the_standard_op_body_alone_is_bit_exact``); so its results are held to
    two ulps of the output dtype on the tensor's scale."""
    for runtime in RUNTIMES:
        try:
            want = geir.run(plain, feeds, runtime=runtime)
        except geir.GraphError as exc:          # ONNX Runtime's CPU has no bfloat16 Mul: neither graph runs there
            assert "Could not find an implementation" in str(exc) and runtime == "onnxruntime"
            with pytest.raises(geir.GraphError, match="Could not find an implementation"):
                geir.run(lowered, feeds, runtime=runtime)
            continue
        got = geir.run(lowered, feeds, runtime=runtime)
        assert sorted(got) == sorted(want)
        for name, array in want.items():
            assert got[name].dtype == array.dtype, (runtime, name)
            if runtime == "numpy" or array.dtype == np.float32:
                assert np.ascontiguousarray(got[name]).tobytes() == np.ascontiguousarray(array).tobytes(), \
                    (runtime, name)
            else:
                a, b = array.astype(np.float64), got[name].astype(np.float64)
                assert np.abs(a - b).max() <= 2 * float(np.finfo(array.dtype).eps) * np.abs(a).max(), (runtime, name)


def _lowered(forward: geir.Graph, target: str, wrt=None) -> tuple[geir.Graph, geir.GradReport]:
    derivative, report = geir.grad(forward, wrt=wrt, target=target, report=True)
    assert report.target == target
    refused_before = _errors(forward, target)
    assert _errors(derivative, target) <= refused_before, (target, report, geir.check(derivative, target))
    assert geir.check(derivative, target).ok or not geir.check(forward, target).ok
    return derivative, report


# -- the rotary grad: the VJP tests' shapes and modes, the CANN grad shapes (spec 2.6), every target -------------------

_SHAPES = [(1, 3, 1, 8), (2, 3, 4, 8), (2, 1, 1, 8), (2, 3, 1, 8)]
_QUICK = {(1, (1, 3, 1, 8)), (3, (2, 3, 4, 8)), (0, (2, 1, 1, 8))}
"""The default run keeps three of the 16 cases (mode 1, the one with kernels; a mode-3 and a mode-0 fallback);
the rest run with -m slow (CI), so the README's test command stays within five minutes on two cores."""


@pytest.mark.parametrize("mode, cos_shape", [pytest.param(m, c, marks=() if (m, c) in _QUICK else pytest.mark.slow)
                                             for c in _SHAPES for m in range(4)])
def test_the_derivative_passes_check_wherever_the_forward_does_and_keeps_its_bits(mode, cos_shape):
    forward = rotary_vjp_graph(ROPE, mode, (2, 3, 4, 12), cos_shape, [2, 10])
    plain = geir.grad(forward)
    feeds = {**_feeds(forward), "grad_y": np.random.default_rng(1).standard_normal((2, 3, 4, 12)).astype(np.float32)}
    for target in TARGETS:
        derivative, report = _lowered(forward, target)
        grads = [f for f in report if f.op_type == ROPE_GRAD]
        assert len(grads) == 1
        if target == A5 and mode == 1:                 # the kernel exists and takes it: kept
            assert grads[0].form == KERNEL and ROPE_GRAD in [n.op_type for n in derivative.nodes]
        else:                                          # input tables: duplication unproven, standard ops
            assert grads[0].form == STANDARD_OPS and grads[0].refused, report
            assert "not proven pair-duplicated" in grads[0].detail or mode == 3 or target == A5
            assert ROPE_GRAD not in [n.op_type for n in derivative.nodes]
        if target != A3:                               # A3's forms are A2's (same rules)
            _assert_same_bits(plain, derivative, feeds)


CANN_GRAD_SHAPES = [  # spec 2.6, as forward shapes: x, cos = sin, slice, x dtype, table dtype (mode 1)
    ((1, 1, 1, 128), (1, 1, 1, 128), [0, 128], "float32", "float32"),
    ((2, 4, 8, 128), (1, 1, 1, 128), [0, 128], "float16", "float16"),
    ((1, 1, 1, 128), (1, 1, 1, 64), [32, 96], "float32", "float32"),
    ((2, 3, 4, 64), (1, 1, 1, 48), [16, 64], "float32", "float32"),
    ((2, 4, 8, 128), (2, 1, 8, 128), [0, 128], "float16", "float16"),
    ((2, 4, 8, 128), (2, 4, 1, 128), [0, 128], "float16", "float16"),
    ((1, 2, 3, 64), (1, 2, 3, 64), [0, 64], "float32", "float32"),
    ((1, 2, 4, 128), (1, 1, 1, 128), [0, 128], "bfloat16", "float32"),
    ((1, 3, 5, 64), (1, 1, 1, 30), [10, 40], "bfloat16", "bfloat16"),
    ((2, 2, 2, 128), (1, 1, 1, 64), [7, 71], "float32", "float32"),
    ((2, 2, 2, 8), (2, 1, 1, 4), [2, 6], "float16", "float32"),
]


@pytest.mark.parametrize("x_shape, cos_shape, pslice, dtype, cos_dtype", CANN_GRAD_SHAPES)
def test_cann_grad_shapes_on_every_target(x_shape, cos_shape, pslice, dtype, cos_dtype):
    forward = rotary_vjp_graph(ROPE, 1, x_shape, cos_shape, pslice, dtype=dtype, cos_dtype=cos_dtype)
    feeds = {**_feeds(forward), "grad_y": np.random.default_rng(2).standard_normal(x_shape).astype(
        forward.outputs[0].dtype.numpy)}
    for target in TARGETS:
        derivative, report = _lowered(forward, target, wrt=["x"])
        assert [f.form for f in report] == [KERNEL if target == A5 else STANDARD_OPS], report
        if target == A2:
            _assert_same_bits(geir.grad(forward, wrt=["x"]), derivative, feeds)


# -- the forward with negated sin: only for proven pair-duplicated tables ---------------------------------------------

def _repeat_interleave(b: geir.GraphBuilder, half: geir.Value, how: str) -> geir.Value:
    """``half`` (..., L/2) repeated to (..., L) with pairs (2i, 2i + 1) equal, the ways exporters write it."""
    shape = list(half.type.shape)
    target = b.constant(f"shape_{how}", np.array(shape[:-1] + [2 * shape[-1]], np.int64))
    axis = b.constant(f"axis_{how}", np.array([-1], np.int64))
    if how == "concat":
        stacked = b.op("Concat", b.op("Unsqueeze", half, axis), b.op("Unsqueeze", half, axis), axis=-1)
    elif how == "tile":       # TorchScript's repeat_interleave
        stacked = b.op("Tile", b.op("Unsqueeze", half, axis),
                       b.constant("repeats", np.array([1] * len(shape) + [2], np.int64)))
    elif how == "expand":
        stacked = b.op("Expand", b.op("Unsqueeze", half, axis), b.constant("to", np.array(shape + [2], np.int64)))
    else:                     # a Gather by [0, 0, 1, 1, ...]
        index = b.constant("index", np.repeat(np.arange(shape[-1]), 2).astype(np.int64))
        return b.op("Gather", half, index, axis=len(shape) - 1)
    return b.op("Reshape", stacked, target)


def _rope(tables: str, dtype: str = "float32", cos_dtype: str = "float32", mode: int = 1,
          shape=(2, 3, 4, 12), pslice=(2, 10)) -> geir.Graph:
    """y = rope(x)^2 with tables (B, S, 1, L) (what A2/A3's forward takes, RP-T5) made as ``tables`` says."""
    b = geir.GraphBuilder("rope")
    x = b.input("x", dtype, shape)
    length = pslice[1] - pslice[0]
    table = (shape[0], shape[1], 1, length)
    rng = np.random.default_rng(5)
    half = rng.uniform(-1, 1, table[:3] + (length // 2,))
    duplicated = np.repeat(half, 2, axis=-1) if mode == 1 else np.concatenate([half, half], -1)
    if tables == "input":
        cos, sin = (b.input(n, cos_dtype, table) for n in ("cos", "sin"))
    elif tables.startswith("constant"):
        c, s = np.cos(duplicated).astype(cos_dtype), np.sin(duplicated).astype(cos_dtype)
        if tables == "constant, one pair unequal":
            s[1, 2, 0, -1] = 0.25 if s[1, 2, 0, -2] != 0.25 else 0.5
        elif tables == "constant, zeros of two signs":
            s[0, 0, 0, 0], s[0, 0, 0, 1] = 0.0, -0.0
        cos, sin = b.constant("cos", c), b.constant("sin", s)
    else:
        f = b.input("freqs", "float32", table[:3] + (length // 2,))
        if tables == "half concat":                   # cat(f, f): half pairs, not interleave pairs
            full = b.op("Concat", f, f, axis=-1)
        elif tables == "two halves":                  # repeat_interleave's form of two different tables
            g = b.op("Neg", f)
            axis = b.constant("axis", np.array([-1], np.int64))
            full = b.op("Reshape", b.op("Concat", b.op("Unsqueeze", f, axis), b.op("Unsqueeze", g, axis), axis=-1),
                        b.constant("shape", np.array(table, np.int64)))
        else:
            full = _repeat_interleave(b, f, tables)
        cos, sin = (b.op(op, full) for op in ("Cos", "Sin"))
        if cos_dtype != "float32":                    # Cos and Sin take no bfloat16: computed in float32, then cast
            cos, sin = (b.op("Cast", t, to=geir.as_dtype(cos_dtype).onnx) for t in (cos, sin))
    y = b.InplacePartialRotaryMul(x, cos, sin, rotary_mode=mode, partial_slice=list(pslice))
    b.output(b.op("Mul", y, y), "y")
    return b.build()


@pytest.mark.parametrize("tables", ["constant", "concat", "tile", "expand", "gather"])
@pytest.mark.parametrize("dtype, cos_dtype", [("float32", "float32"), ("float16", "float16"), ("float16", "float32"),
                                              ("bfloat16", "bfloat16"), ("bfloat16", "float32")])
def test_proven_duplicated_tables_give_the_forward_with_negated_sin_bit_for_bit(tables, dtype, cos_dtype):
    forward = _rope(tables, dtype, cos_dtype)
    feeds = {**_feeds(forward, 3), "grad_y": np.random.default_rng(4).standard_normal((2, 3, 4, 12)).astype(dtype)}
    for target in (A2, A3):
        derivative, report = _lowered(forward, target, wrt=["x"])
        assert geir.check(derivative, target).ok
        (form,) = report.forms
        assert (form.form, form.refused) == (SUBSTITUTE, ("RP-T1",)), report
        assert "InplacePartialRotaryMul(dy, cos, -sin)" in form.detail and "6.2" in str(report)
        ops = [n.op_type for n in derivative.nodes]
        assert ROPE_GRAD not in ops and ops.count(ROPE) == 2 and "Neg" in ops
    _assert_same_bits(geir.grad(forward, wrt=["x"]), derivative, feeds)
    derivative, report = _lowered(forward, A5, wrt=["x"])      # the grad kernel exists: kept
    assert [f.form for f in report] == [KERNEL] and ROPE_GRAD in [n.op_type for n in derivative.nodes]


NEAR = {  # tables -> what the report says is why not
    "input": "not proven pair-duplicated",
    "constant, one pair unequal": "sin not proven",
    "constant, zeros of two signs": "sin not proven",   # equal as numbers, not as bits: the sign of a zero sum
    "half concat": "not proven",
    "two halves": "not proven",
}


@pytest.mark.parametrize("tables", sorted(NEAR))
@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
def test_near_variants_fall_back_to_standard_ops_with_the_same_bits(tables, dtype):
    forward = _rope(tables, dtype, dtype)
    feeds = {**_feeds(forward, 6), "grad_y": np.random.default_rng(7).standard_normal((2, 3, 4, 12)).astype(dtype)}
    derivative, report = _lowered(forward, A2, wrt=["x"])
    assert geir.check(derivative, A2).ok
    (form,) = report.forms
    assert form.form == STANDARD_OPS and NEAR[tables] in form.detail, report
    assert [n.op_type for n in derivative.nodes].count(ROPE) == 1
    _assert_same_bits(geir.grad(forward, wrt=["x"]), derivative, feeds)


def test_the_near_variant_would_be_wrong_as_the_forward_with_negated_sin():
    """The fallback is needed: with one pair's sin unequal, forward(dy; cos, -sin) is not the grad."""
    forward = _rope("constant, one pair unequal")
    table = {n: forward.constants[n] for n in ("cos", "sin")}
    dy = np.random.default_rng(8).standard_normal((2, 3, 4, 12)).astype(np.float32)
    grad = geir.testing.reference(_single(ROPE_GRAD, dy, table), {"dy": dy})["out"]
    negated = geir.testing.reference(_single(ROPE, dy, {"cos": table["cos"], "sin": -table["sin"]}), {"dy": dy})["out"]
    assert not np.array_equal(grad, negated)
    duplicated = _rope("constant")
    table = {n: duplicated.constants[n] for n in ("cos", "sin")}
    grad = geir.testing.reference(_single(ROPE_GRAD, dy, table), {"dy": dy})["out"]
    negated = geir.testing.reference(_single(ROPE, dy, {"cos": table["cos"], "sin": -table["sin"]}), {"dy": dy})["out"]
    assert np.array_equal(grad, negated)


def _single(op: str, dy: np.ndarray, tables: dict[str, np.ndarray]) -> geir.Graph:
    b = geir.GraphBuilder("one")
    x = b.input("dy", "float32", dy.shape)
    cos, sin = (b.constant(n, tables[n]) for n in ("cos", "sin"))
    b.output(getattr(b, op)(x, cos, sin, rotary_mode=1, partial_slice=[2, 10]), "out")
    return b.build()


def test_modes_the_forward_refuses_fall_back_even_with_duplicated_tables():
    """Mode 0 with cat(f, f) tables is the forward with negated sin (spec 6.2), but no device's forward takes mode 0
    (RP-T2): standard ops, the report naming the rule; mode 3 is never the forward with negated sin."""
    for mode, why in ((0, "breaks RP-T2"), (3, "mode 3")):
        forward = _rope("constant", mode=mode)
        derivative, report = _lowered(forward, A2, wrt=["x"])
        (form,) = report.forms
        assert form.form == STANDARD_OPS and why in form.detail, report
        feeds = {**_feeds(forward), "grad_y": np.ones((2, 3, 4, 12), np.float32)}
        _assert_same_bits(geir.grad(forward, wrt=["x"]), derivative, feeds)


@pytest.mark.parametrize("dtype, cos_dtype", [("float16", "float16"), ("bfloat16", "float32"), ("float32", "float16")])
@pytest.mark.parametrize("mode", range(4))
def test_the_standard_op_body_alone_is_bit_exact(mode, dtype, cos_dtype):
    b = geir.GraphBuilder("grad")
    dy = b.input("dy", dtype, (2, 4, 8, 128))
    cos, sin = (b.input(n, cos_dtype, (2, 4, 1, 64)) for n in ("cos", "sin"))
    b.output(b.InplacePartialRotaryMulGrad(dy, cos, sin, rotary_mode=mode, partial_slice=[32, 96]), "dx")
    single = b.build()
    from geir.passes.target_forms import for_target
    lowered, report = for_target(single, A2, lambda node: True)
    assert [f.form for f in report] == [STANDARD_OPS] and ROPE_GRAD not in [n.op_type for n in lowered.nodes]
    _assert_same_bits(single, lowered, _feeds(single, 11))


# -- the same mechanism for every op: MoE grad on ascend950 (MG-T1) ---------------------------------------------------

@pytest.mark.parametrize("grad_op", [False, True])
def test_moe_grad_ops_become_standard_ops_on_ascend950(grad_op):
    forward = moe_vjp_graph(6, 6, (3, 2), grad_op=grad_op)
    rng = np.random.default_rng(9)
    feeds = {**_feeds(forward, 10), "indices": np.array([3, 0, 5, 1, 4, 2], np.int32)}
    plain = geir.grad(forward)
    feeds.update({v.name: rng.standard_normal(v.type.shape).astype(np.float32)
                  for v in plain.inputs if v.name.startswith("grad_")})
    derivative, report = _lowered(forward, A5)
    assert report.forms and all(f.form == STANDARD_OPS for f in report if f.op_type == "MoeTokenUnpermuteGrad")
    assert all(f.refused == ("MG-T1",) for f in report if f.op_type == "MoeTokenUnpermuteGrad")
    assert all(f.refused == ("MU-T1",) for f in report if f.op_type == "MoeTokenUnpermute")
    emitted = {f.node for f in report}
    assert not any(n.name in emitted and n.domain == "ai.cann" for n in derivative.nodes)
    exact = reference(plain, {k: v.astype(np.float64) if v.dtype.kind == "f" else v for k, v in feeds.items()},
                      rounded=False)
    for runtime in RUNTIMES:
        got = geir.run(derivative, feeds, runtime=runtime)
        for name, want in exact.items():
            np.testing.assert_allclose(got[name], want, rtol=2e-6, atol=2e-6 * np.abs(want).max())
    kept, report = _lowered(forward, A2)            # kernels there: every op as the VJP emitted it
    assert all(f.form == KERNEL for f in report)


# -- interface ---------------------------------------------------------------------------------------------------------

def test_without_a_target_the_derivative_is_unchanged_and_the_report_lists_the_ops():
    forward = rotary_vjp_graph(ROPE, 1, (2, 3, 4, 12), (2, 3, 1, 8), [2, 10])
    derivative, report = geir.grad(forward, report=True)
    from helpers import assert_same_graph
    assert_same_graph(derivative, geir.grad(forward))
    assert report.target is None and [f.op_type for f in report].count(ROPE_GRAD) == 1
    assert all(f.form == KERNEL for f in report) and "emitted" in str(report)


def test_an_unknown_target_is_a_graph_error_listing_the_targets():
    forward = rotary_vjp_graph(ROPE, 1, (2, 3, 4, 12), (2, 3, 1, 8), [2, 10])
    with pytest.raises(geir.GraphError, match=r"unknown target 'ascend310': expected one of ascend910b, ascend910_93, "
                                              r"ascend950"):
        geir.grad(forward, target="ascend310")


# -- real models: fused, then differentiated for each device -----------------------------------------------------------

@pytest.mark.slow
@pytest.mark.models
@pytest.mark.parametrize("family, exporter", [("gptj", "torchscript"), ("gptj", "dynamo"), ("llama", "dynamo"),
                                              ("qwen2_moe", "dynamo")])
def test_fused_real_models_differentiate_for_every_device(family, exporter, tmp_path):
    """GPT-J's interleaved rope (mode 1, repeat_interleave tables), Llama's half rope (mode 0, RP-T2 everywhere) and
    Qwen2-MoE's combine (no MoE graph kernel on ascend950): the derivative for each target breaks no rule the fused
    forward does not, and computes what the derivative without a target does, on both runtimes."""
    torch = pytest.importorskip("torch", reason="torch is not installed (pip install -e '.[test,models]')")
    pytest.importorskip("transformers", reason="transformers is not installed (pip install -e '.[test,models]')")
    from real_models import HIDDEN, export, model

    path = tmp_path / f"{family}.onnx"
    export(model(family, torch.float32), path, exporter, False, torch.float32)
    fused, _ = geir.fuse(geir.from_onnx(path, symbolic_shapes=True), allow_stricter_data=True)
    plain = geir.grad(fused, wrt=["x"])
    rng = np.random.default_rng(0)
    feeds = {"x": rng.standard_normal((2, 5, HIDDEN)).astype(np.float32),
             plain.inputs[-1].name: rng.standard_normal((2, 5, HIDDEN)).astype(np.float32)}
    want = {runtime: geir.run(plain, feeds, runtime=runtime)["grad_x"] for runtime in RUNTIMES}
    for target in TARGETS:
        derivative, report = _lowered(fused, target, wrt=["x"])
        assert report.forms, report
        assert all(f.form == KERNEL for f in report) == (target == A5 and family == "gptj"), report
        for runtime in RUNTIMES:
            got = geir.run(derivative, feeds, runtime=runtime)["grad_x"]
            assert np.abs(got - want[runtime]).max() <= 1e-5 * np.abs(want[runtime]).max(), (target, runtime)


def test_any_family_s_emitted_op_follows_its_kernel_rows():
    """MoeTokenPermute runs on ascend950 but its grad has no kernel there (MPG-T1): the derivative's grad is its
    standard-op body there, the kernel on A2 / A3, the same values everywhere."""
    b = geir.GraphBuilder("permute")
    tokens, indices = b.input("tokens", "float32", (4, 8)), b.input("indices", "int32", (4, 2))
    permuted, _ = b.MoeTokenPermute(tokens, indices)
    b.output(b.op("Mul", permuted, permuted), "y")
    forward = b.build()
    rng = np.random.default_rng(12)
    feeds = {"tokens": rng.standard_normal((4, 8)).astype(np.float32), "grad_y": rng.standard_normal((8, 8)).astype(
        np.float32), "indices": np.array([[0, 1], [2, 3], [1, 0], [3, 2]], np.int32)}
    for target in TARGETS:
        derivative, report = _lowered(forward, target, wrt=["tokens"])
        assert geir.check(derivative, target).ok
        assert [(f.op_type, f.form) for f in report] == [("MoeTokenPermuteGrad", STANDARD_OPS if target == A5
                                                          else KERNEL)], report
        _assert_same_bits(geir.grad(forward, wrt=["tokens"]), derivative, feeds)


def test_symbolic_table_widths_fall_back_instead_of_failing():
    """Review of issue 27: a table whose last dim is a symbol cannot be compared pair by pair; the derivative takes
    the standard-op body and says why (it once raised a bare ValueError from int('L'))."""
    b = geir.GraphBuilder("r")
    x = b.input("x", "float32", (2, 4, 2, 8))
    cos, sin = b.input("cos", "float32", (1, 4, 1, "L")), b.input("sin", "float32", (1, 4, 1, "L"))
    b.output(b.InplacePartialRotaryMul(x, cos, sin, rotary_mode=1, partial_slice=[0, 8]), "y")
    _, report = geir.grad(b.build(), wrt="x", target=A2, report=True)
    (form,) = report.forms
    assert form.form == STANDARD_OPS and "symbolic" in form.detail, report


def test_a_table_built_from_shared_values_is_proven_once_per_value():
    """Add(t, t) twenty times over a duplicated table: 2**20 paths, 20 values; the proof visits each value once
    (memoised per call), fires the substitute, and computes the plain derivative's bits."""
    b = geir.GraphBuilder("r")
    x = b.input("x", "float32", (1, 3, 1, 8))
    half = b.input("freqs", "float32", (1, 3, 1, 4))
    axis = b.constant("axis", np.array([-1], np.int64))
    table = b.op("Reshape", b.op("Concat", *(b.op("Unsqueeze", half, axis) for _ in range(2)), axis=-1),
                 b.constant("shape", np.array([1, 3, 1, 8], np.int64)))
    for _ in range(20):
        table = b.op("Add", table, table)
    y = b.InplacePartialRotaryMul(x, b.op("Cos", table), b.op("Sin", table), rotary_mode=1, partial_slice=[0, 8])
    b.output(y, "y")
    forward = b.build()
    derivative, report = _lowered(forward, A2, wrt=["x"])
    assert [f.form for f in report] == [SUBSTITUTE], report
    feeds = {**_feeds(forward, 1), "grad_y": np.random.default_rng(2).standard_normal((1, 3, 1, 8)).astype(np.float32)}
    _assert_same_bits(geir.grad(forward, wrt=["x"]), derivative, feeds)
