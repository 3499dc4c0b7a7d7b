"""A user's script, as a type checker sees it: ``mypy --strict`` on this file must report nothing.

Not a test module (pytest collects ``test_*.py`` only): ``tests/tools/test_typing.py`` runs mypy on it and runs it,
and ``.ci/run typing`` runs mypy on it against the installed package. It builds a graph with our ops and standard
ops through ``b.op``, runs it, checks it for a target, fuses, differentiates, exports and imports ONNX, and uses
``geir.ge`` the way the README does. Every ``reveal``-style annotation below is a claim the checker verifies.
"""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path

import numpy as np
import numpy.typing as npt
import onnx

import geir
from geir import ge


def rope_graph() -> geir.Graph:
    """Our ops by their generated methods, and standard ops chained through ``b.op``."""
    b = geir.GraphBuilder("typed_rope")
    x = b.input("x", "float32", ("B", 8, 2, 32))
    cos = b.input("cos", "float32", (1, 8, 1, 16))
    sin = b.input("sin", "float32", (1, 8, 1, 16))
    y: geir.Value = b.InplacePartialRotaryMul(x, cos, sin, rotary_mode=0, partial_slice=[8, 24])
    scaled = b.op("Mul", b.op("Add", y, y), b.constant("half", np.array(0.5, np.float32)))
    first, second = b.op("Split", scaled, axis=3, num_outputs=2)       # a variadic op: a tuple of Values
    both: tuple[geir.Value, ...] = b.op("Split", scaled, axis=3, outputs=2)
    b.output(b.op("Concat", second, first, axis=3), "y")
    b.output(b.op("Transpose", both[0], perm=[0, 2, 1, 3]), "t")
    return b.build()


def moe_graph() -> geir.Graph:
    """An op with two outputs is a typed tuple; an optional input may be left out."""
    b = geir.GraphBuilder("typed_moe")
    rows = b.input("rows", "float32", (6, 4))
    grad = b.input("grad", "float32", (3, 4))
    idx = b.input("idx", "int32", (6,))
    probs = b.input("probs", "float32", (3, 2))
    d_rows, d_probs = b.MoeTokenUnpermuteGrad(rows, grad, idx, probs)
    b.output(d_rows, "d_rows")
    b.output(b.op("Identity", d_probs), "d_probs")
    return b.build()


def run_and_check(graph: geir.Graph) -> dict[str, npt.NDArray[np.float32]]:
    rng = np.random.default_rng(0)
    feeds = {"x": rng.standard_normal((2, 8, 2, 32)).astype(np.float32),
             "cos": rng.uniform(-1, 1, (1, 8, 1, 16)).astype(np.float32),
             "sin": rng.uniform(-1, 1, (1, 8, 1, 16)).astype(np.float32)}
    outputs: dict[str, np.ndarray] = geir.run(graph, feeds)
    report: geir.CheckReport = geir.check(graph, target="ascend910b")
    errors: list[geir.Violation] = report.errors
    ok: bool = report.ok
    print(f"{report.graph} on {report.target}: ok={ok}, {len(errors)} error(s)")
    return {name: np.asarray(array, np.float32) for name, array in outputs.items()}


def fuse_and_grad() -> geir.Graph:
    """The README's Llama rope: standard ops only, fused into ours, then differentiated."""
    b = geir.GraphBuilder("llama_rope")
    x = b.input("x", "float32", (1, 16, 2, 8))
    cos, sin = b.input("cos", "float32", (1, 16, 1, 8)), b.input("sin", "float32", (1, 16, 1, 8))
    bounds = {v: b.constant(f"b{v}", np.array([v], np.int64)) for v in (0, 4, 8, -1)}
    first = b.op("Slice", x, bounds[0], bounds[4], bounds[-1])
    second = b.op("Slice", x, bounds[4], bounds[8], bounds[-1])
    rotated = b.op("Concat", b.op("Neg", second), first, axis=-1)
    b.output(b.op("Add", b.op("Mul", x, cos), b.op("Mul", rotated, sin)), "y")
    fused, report = geir.fuse(b.build())
    fusion: geir.FusionReport = report
    print(fusion)
    step: geir.Graph = geir.grad(fused, wrt=["x"])
    on_a2, forms = geir.grad(fused, wrt=["x"], target="ascend910b", report=True)   # forms the device has
    grad_report: geir.GradReport = forms
    print(grad_report, geir.check(on_a2, "ascend910b").ok)
    kinds: list[str] = [n.op_type for n in step.nodes]
    print(kinds)
    return step


def onnx_round_trip(graph: geir.Graph, folder: Path) -> geir.Graph:
    model: onnx.ModelProto = geir.to_onnx(graph)
    again: geir.Graph = geir.from_onnx(model)
    geir.save_onnx(again, folder / "typed.onnx")
    return geir.load_onnx(folder / "typed.onnx")


def ge_rope_grad() -> np.ndarray | None:
    """The README's ``geir.ge`` example: generated accessors chain and keep the op's class."""
    rng = np.random.default_rng(0)
    dy_array = rng.standard_normal((2, 128, 8, 64)).astype(np.float16)
    c, s = (rng.uniform(-1, 1, (1, 128, 1, 64)).astype(np.float16) for _ in range(2))
    ge.GEInitialize({"ge.exec.deviceId": "0", "ge.graphRunMode": "1"})
    graph = ge.Graph("tc_ge_irrun_test")
    desc = ge.TensorDesc(ge.Shape([2, 128, 8, 64]), ge.FORMAT_ND, ge.DT_FLOAT16)
    table = ge.TensorDesc(ge.Shape([1, 128, 1, 64]), ge.FORMAT_ND, ge.DT_FLOAT16)
    dy, cos, sin = (ge.op.Data(n).set_attr_index(i).update_output_desc_y(d)
                    for i, (n, d) in enumerate((("dy", desc), ("cos", table), ("sin", table))))
    op: ge.op.InplacePartialRotaryMulGrad = (
        ge.op.InplacePartialRotaryMulGrad("rope_grad").set_input_dy(dy).set_input_cos(cos).set_input_sin(sin)
        .set_attr_rotary_mode(1).set_attr_partial_slice([0, 64]))
    mode: int = op.get_attr_rotary_mode()
    assert mode == 1
    graph.SetInputs([dy, cos, sin]).SetOutputs([op])
    session = ge.Session({"geir.runtime": "numpy", "geir.target": "ascend950"})
    status: int = session.AddGraph(0, graph)
    assert status == ge.SUCCESS, ge.GEGetErrorMsgV2()
    outputs: list[ge.Tensor] = []
    status = session.RunGraph(0, [ge.Tensor(desc, dy_array), ge.Tensor(table, c), ge.Tensor(table, s)], outputs)
    assert status == ge.SUCCESS, ge.GEGetErrorMsgV2()
    built: geir.Graph = graph.to_geir()
    assert built.name == "tc_ge_irrun_test"
    ge.GEFinalize()
    return outputs[0].GetData()


def aclnn_rope_grad() -> np.ndarray:
    """CANN's single-op call path: two phases, a workspace and a stream."""
    from geir import aclnn

    assert aclnn.aclInit(None, target="ascend950") == aclnn.ACLNN_SUCCESS
    stream: aclnn.aclrtStream = aclnn.aclrtCreateStream()
    dy = np.ones((1, 1, 1, 8), np.float32)
    table = aclnn.aclCreateTensor(np.full((1, 1, 1, 8), 0.5, np.float32))
    status, size, executor = aclnn.aclnnInplacePartialRotaryMulGradGetWorkspaceSize(
        aclnn.aclCreateTensor(dy), table, table, 1, aclnn.aclCreateIntArray([0, 8]))
    assert status == aclnn.ACLNN_SUCCESS, aclnn.aclGetRecentErrMsg()
    workspace: aclnn.DeviceBuffer | None = aclnn.aclrtMalloc(size)
    status = aclnn.aclnnInplacePartialRotaryMulGrad(workspace, size, executor, stream)
    assert status == aclnn.ACLNN_SUCCESS and aclnn.aclrtSynchronizeStream(stream) == 0
    aclnn.aclFinalize()
    return dy


def main() -> None:
    rope = rope_graph()
    print(sorted(run_and_check(rope)))
    print([v.name for v in moe_graph().outputs])
    step = fuse_and_grad()
    with tempfile.TemporaryDirectory() as folder:
        print(len(onnx_round_trip(step, Path(folder)).nodes))
    result = ge_rope_grad()
    assert result is not None and result.shape == (2, 128, 8, 64)
    assert aclnn_rope_grad().shape == (1, 1, 1, 8)
    sys.stdout.write("typed user script: ok\n")


if __name__ == "__main__":
    main()
