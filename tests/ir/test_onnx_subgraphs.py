"""Subgraphs (If branches, Loop and Scan bodies) that read values of the enclosing graph by name, as ONNX allows:
import, both runtimes, export, and the reads counted as uses of those values (ir/_subgraphs.py)."""

from __future__ import annotations

import functools

import numpy as np
import onnx
import pytest
from onnx import TensorProto as TP, helper
from onnx.reference import ReferenceEvaluator

import geir
from geir.ir._subgraphs import captured_names
from geir.passes import EliminateDeadCode
from geir.runtimes.numpy._standard import Loop as StackingLoop

RUNTIMES = ("numpy", "onnxruntime")


def _loop_model() -> onnx.ModelProto:
    """A Loop whose body reads the outer `w` (computed) and `s` (an initializer) every iteration."""
    body = helper.make_graph(
        [helper.make_node("Add", ["acc_in", "w"], ["t"]), helper.make_node("Mul", ["t", "s"], ["acc_out"]),
         helper.make_node("Identity", ["cond_in"], ["cond_out"]), helper.make_node("Add", ["acc_out", "w"], ["scan"])],
        "body",
        [helper.make_tensor_value_info("i", TP.INT64, []), helper.make_tensor_value_info("cond_in", TP.BOOL, []),
         helper.make_tensor_value_info("acc_in", TP.FLOAT, [2, 3])],
        [helper.make_tensor_value_info("cond_out", TP.BOOL, []),
         helper.make_tensor_value_info("acc_out", TP.FLOAT, [2, 3]), helper.make_tensor_value_info("scan", TP.FLOAT, [2, 3])])
    graph = helper.make_graph(
        [helper.make_node("Relu", ["x"], ["w"]),
         helper.make_node("Loop", ["trips", "cond", "acc0"], ["acc", "scans"], body=body)],
        "loop_outer",
        [helper.make_tensor_value_info("x", TP.FLOAT, [2, 3]), helper.make_tensor_value_info("acc0", TP.FLOAT, [2, 3])],
        [helper.make_tensor_value_info("acc", TP.FLOAT, [2, 3]),
         helper.make_tensor_value_info("scans", TP.FLOAT, [None, 2, 3])],
        initializer=[helper.make_tensor("trips", TP.INT64, [], [3]), helper.make_tensor("cond", TP.BOOL, [], [True]),
                     helper.make_tensor("s", TP.FLOAT, [], [0.5])])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)])


def _if_model() -> onnx.ModelProto:
    """An If whose branches read the outer `x` (an input), `y` (computed) and `two` and `yes` (initializers), one through a Loop
    nested in a branch."""
    inner = helper.make_graph(
        [helper.make_node("Identity", ["c_in"], ["c_out"]), helper.make_node("Add", ["v_in", "y"], ["v_out"])], "inner",
        [helper.make_tensor_value_info("j", TP.INT64, []), helper.make_tensor_value_info("c_in", TP.BOOL, []),
         helper.make_tensor_value_info("v_in", TP.FLOAT, [2, 3])],
        [helper.make_tensor_value_info("c_out", TP.BOOL, []), helper.make_tensor_value_info("v_out", TP.FLOAT, [2, 3])])
    then = helper.make_graph([helper.make_node("Loop", ["two", "yes", "x"], ["r"], body=inner)], "then", [],
                             [helper.make_tensor_value_info("r", TP.FLOAT, [2, 3])])
    other = helper.make_graph([helper.make_node("Sub", ["x", "y"], ["r2"])], "else", [],
                              [helper.make_tensor_value_info("r2", TP.FLOAT, [2, 3])])
    graph = helper.make_graph(
        [helper.make_node("Neg", ["a"], ["y"]), helper.make_node("If", ["c"], ["z"], then_branch=then, else_branch=other)],
        "if_outer",
        [helper.make_tensor_value_info("c", TP.BOOL, []), helper.make_tensor_value_info("x", TP.FLOAT, [2, 3]),
         helper.make_tensor_value_info("a", TP.FLOAT, [2, 3])],
        [helper.make_tensor_value_info("z", TP.FLOAT, [2, 3])], initializer=[helper.make_tensor("two", TP.INT64, [], [2]),
                                                                      helper.make_tensor("yes", TP.BOOL, [], [True])])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)])


def _scan_model() -> onnx.ModelProto:
    """A Scan (opset 9+) whose body scales each row by the outer `k` before summing."""
    body = helper.make_graph(
        [helper.make_node("Mul", ["row", "k"], ["scaled"]), helper.make_node("Add", ["sum_in", "scaled"], ["sum_out"]),
         helper.make_node("Identity", ["sum_out"], ["partial"])],
        "body",
        [helper.make_tensor_value_info("sum_in", TP.FLOAT, [3]), helper.make_tensor_value_info("row", TP.FLOAT, [3])],
        [helper.make_tensor_value_info("sum_out", TP.FLOAT, [3]), helper.make_tensor_value_info("partial", TP.FLOAT, [3])])
    graph = helper.make_graph(
        [helper.make_node("Exp", ["e"], ["k"]),
         helper.make_node("Scan", ["init", "rows"], ["total", "partials"], body=body, num_scan_inputs=1)],
        "scan_outer",
        [helper.make_tensor_value_info("init", TP.FLOAT, [3]), helper.make_tensor_value_info("rows", TP.FLOAT, [4, 3]),
         helper.make_tensor_value_info("e", TP.FLOAT, [3])],
        [helper.make_tensor_value_info("total", TP.FLOAT, [3]), helper.make_tensor_value_info("partials", TP.FLOAT, [4, 3])])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)])


def _feeds(model: onnx.ModelProto, seed: int = 0) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    feeds = {}
    for vi in model.graph.input:
        shape = [d.dim_value for d in vi.type.tensor_type.shape.dim]
        if vi.type.tensor_type.elem_type == TP.BOOL:
            feeds[vi.name] = np.array(rng.random() < 0.5)
        else:
            feeds[vi.name] = rng.standard_normal(shape).astype(np.float32)
    return feeds


def _expected(model: onnx.ModelProto, feeds) -> list[np.ndarray]:
    # onnx.reference's Loop np.vstack's scan outputs ([6, 3] for 3 iterations of [2, 3]); ONNX stacks them
    return ReferenceEvaluator(model, new_ops=[StackingLoop]).run(None, feeds)


def _check(model: onnx.ModelProto, feeds, expected=None) -> geir.Graph:
    expected = _expected(model, feeds) if expected is None else expected
    graph = geir.from_onnx(model)
    exported = geir.to_onnx(graph)
    for name, candidate in (("imported", graph), ("round trip", geir.from_onnx(exported))):
        for runtime in RUNTIMES:
            got = geir.run(candidate, feeds, runtime=runtime)
            assert list(got) == [o.name for o in model.graph.output], (name, runtime)
            for (key, value), want in zip(got.items(), expected):
                np.testing.assert_allclose(value, want, rtol=1e-5, atol=1e-6, err_msg=f"{name} {runtime} {key}")
    return graph


@pytest.mark.parametrize("make", [_loop_model, _if_model, _scan_model], ids=["loop", "if", "scan"])
def test_subgraphs_reading_outer_values_import_and_run_on_both_runtimes(make):
    model = make()
    for seed in (0, 1, 2):
        _check(model, _feeds(model, seed))


def test_if_branches_both_taken():
    model = _if_model()
    feeds = _feeds(model)
    for c in (True, False):
        _check(model, {**feeds, "c": np.array(c)})


def test_outer_reads_are_uses_of_the_values_read():
    graph = geir.from_onnx(_loop_model())
    loop = next(n for n in graph.nodes if n.op_type == "Loop")
    assert captured_names(loop.attributes) == ("s", "w")
    relu = next(n for n in graph.nodes if n.op_type == "Relu")
    assert [u.op_type for u, _ in relu.outputs[0].uses] == ["Loop"]        # its only reader is the body
    EliminateDeadCode()(graph)
    assert any(n.op_type == "Relu" for n in graph.nodes)                   # so dead-code elimination keeps it
    exported = geir.to_onnx(graph)
    onnx_loop = next(n for n in exported.graph.node if n.op_type == "Loop")
    assert list(onnx_loop.input) == ["trips", "cond", "acc0"]             # captures are no ONNX inputs


def test_a_renamed_outer_value_is_read_under_its_new_name():
    model = _loop_model()
    feeds = _feeds(model)
    expected = _expected(model, feeds)
    graph = geir.from_onnx(model)
    relu = next(n for n in graph.nodes if n.op_type == "Relu")
    relu.outputs[0].name = "renamed_w"
    exported = geir.to_onnx(graph)
    body = next(n for n in exported.graph.node if n.op_type == "Loop").attribute[0].g
    assert "renamed_w" in {i for n in body.node for i in n.input} and "w" not in {i for n in body.node for i in n.input}
    for runtime in RUNTIMES:
        got = geir.run(geir.from_onnx(exported), feeds, runtime=runtime)
        for value, want in zip(got.values(), expected):
            np.testing.assert_allclose(value, want, rtol=1e-5, atol=1e-6)


@functools.cache
def _backend_cases() -> dict[str, object]:
    """ONNX's own backend node tests for these ops (the generators, as the installed onnx ships no data files)."""
    import onnx.backend.test.case.node as cases
    from onnx.backend.test.case.node.if_ import If
    from onnx.backend.test.case.node.loop import Loop
    from onnx.backend.test.case.node.rangeop import Range
    from onnx.backend.test.case.node.scan import Scan

    before = len(cases._NodeTestCases)
    for op in (If, Loop, Range, Scan):
        for name in dir(op):
            if name.startswith("export"):
                try:
                    getattr(op, name)()
                except ValueError:      # already generated in this process (the name is taken)
                    pass
    return {case.name: case for case in cases._NodeTestCases[before:]} or \
        {case.name: case for case in cases._NodeTestCases}


@pytest.mark.parametrize("name", ["test_range_float_type_positive_delta_expanded",
                                  "test_range_int32_type_negative_delta_expanded", "test_loop11", "test_if",
                                  "test_scan9_sum"])
def test_onnx_backend_node_tests(name):
    """The backend tests of subgraph ops whose values geir has (the range ones' Loop bodies read `delta` of the
    enclosing graph); compared with the test's own expected outputs, as onnx.reference's Loop vstack's."""
    case = _backend_cases()[name]
    (inputs, outputs), = case.data_sets
    model = case.model
    feeds = dict(zip([i.name for i in model.graph.input], inputs))
    _check(model, feeds, expected=outputs)
