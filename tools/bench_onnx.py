"""``geir bench import`` and ``geir bench onnx-run``: what ONNX models cost through geir (issue 25, items 6 and 7).

- import: ``geir.from_onnx`` of 1,000, 10,000 and 100,000-node models (an elementwise chain with a symbolic batch,
  parsed from bytes each time); a linear import keeps the time per node of the smallest (target: at most 2x it).
- onnx-run: ``geir.run`` on the ONNX Runtime runtime against a plain ``InferenceSession.run`` of the same file, for
  an encoder layer as PyTorch exports it with static and with dynamic batch and sequence (its Reshape targets
  computed from Shape, as exporters write them): at most 1.1x; and a MoE unpermute of standard ops against the
  same graph fused into MoeTokenUnpermute (whose index rule runs on every call): the fused one at most 1.0x.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import onnx
import onnxruntime as ort
from onnx import TensorProto, helper, numpy_helper

from ..ir._core import Graph
from .bench_rows import Measurement
from .builder import GraphBuilder
from .facade import fuse, run
from .onnx_import import from_onnx

__all__ = ["chain_model", "encoder_model", "import_measurements", "onnx_run_measurements", "unpermute_graph"]

IMPORT_TARGET = 2.0
"""Import time per node of a larger model, as a multiple of the smallest's."""
RUN_TARGET = 1.1
"""geir.run on ONNX Runtime, as a multiple of a plain session.run of the same file."""


def chain_model(nodes: int) -> onnx.ModelProto:
    """``nodes`` elementwise nodes (Add, Mul, Relu, Neg in turn) over a [batch, 8] float32 input."""
    made, previous = [], "x"
    for i in range(nodes):
        op = ("Add", "Mul", "Relu", "Neg")[i % 4]
        made.append(helper.make_node(op, [previous, "c"] if op in ("Add", "Mul") else [previous], [f"v{i}"],
                                     name=f"n{i}"))
        previous = f"v{i}"
    graph = helper.make_graph(made, "chain", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", 8])],
                              [helper.make_tensor_value_info(previous, TensorProto.FLOAT, ["batch", 8])],
                              initializer=[numpy_helper.from_array(np.ones(8, np.float32), "c")])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21)])


def import_measurements(quick: bool) -> list[Measurement]:
    """geir.from_onnx of 1,000 to 100,000-node models: the time per node of a larger one against the smallest's."""
    counts = (1_000, 10_000) if quick else (1_000, 10_000, 100_000)
    case, rows = "elementwise chain, [batch, 8] float32", []
    for count in counts:
        data = chain_model(count).SerializeToString()
        rows.append(Measurement("geir.from_onnx", case, f"{count:,} nodes", lambda data=data: from_onnx(data),
                                1e9 * count, "nodes/s", baseline=not rows,
                                targets=((rows[0].name, IMPORT_TARGET),) if rows else ()))
    return rows


def encoder_model(batch: int | str, seq: int | str, hidden: int = 256, heads: int = 4) -> onnx.ModelProto:
    """One pre-norm self-attention layer as exporters write it; with symbolic ``batch``/``seq`` its Reshape targets
    are computed from the input's Shape."""
    rng = np.random.default_rng(0)
    head = hidden // heads
    weights = {"gamma": np.ones(hidden), "beta": np.zeros(hidden),
               "w_qkv": rng.standard_normal((hidden, 3 * hidden)) / hidden ** 0.5,
               "w_out": rng.standard_normal((hidden, hidden)) / hidden ** 0.5,
               "scale": np.array(head ** -0.5), "perm_k": np.array([0, 1, 3, 2])}
    inits = [numpy_helper.from_array(np.asarray(v, np.int64 if k == "perm_k" else np.float32), k)
             for k, v in weights.items() if k != "perm_k"]
    static = isinstance(batch, int) and isinstance(seq, int)

    def target(name: str, tail: list[int]) -> list[onnx.NodeProto]:
        if static:
            inits.append(numpy_helper.from_array(np.array([batch, seq] + tail, np.int64), name))
            return []
        inits.append(numpy_helper.from_array(np.array(tail, np.int64), f"{name}_tail"))
        return [helper.make_node("Shape", ["x"], [f"{name}_lead"], start=0, end=2),
                helper.make_node("Concat", [f"{name}_lead", f"{name}_tail"], [name], axis=0)]

    nodes = [helper.make_node("LayerNormalization", ["x", "gamma", "beta"], ["ln"], axis=-1),
             helper.make_node("MatMul", ["ln", "w_qkv"], ["qkv"]), *target("qkv_shape", [3, heads, head]),
             helper.make_node("Reshape", ["qkv", "qkv_shape"], ["qkv_heads"]),
             helper.make_node("Transpose", ["qkv_heads"], ["qkv_t"], perm=[2, 0, 3, 1, 4]),
             helper.make_node("Split", ["qkv_t"], ["q5", "k5", "v5"], axis=0, num_outputs=3)]
    inits.append(numpy_helper.from_array(np.array([0], np.int64), "axis0"))
    nodes += [helper.make_node("Squeeze", [f"{n}5", "axis0"], [n]) for n in "qkv"]
    nodes += [helper.make_node("Transpose", ["k"], ["k_t"], perm=[0, 1, 3, 2]),
              helper.make_node("MatMul", ["q", "k_t"], ["scores"]),
              helper.make_node("Mul", ["scores", "scale"], ["scaled"]),
              helper.make_node("Softmax", ["scaled"], ["probs"], axis=-1),
              helper.make_node("MatMul", ["probs", "v"], ["context"]),
              helper.make_node("Transpose", ["context"], ["context_t"], perm=[0, 2, 1, 3]),
              *target("out_shape", [hidden]),
              helper.make_node("Reshape", ["context_t", "out_shape"], ["merged"]),
              helper.make_node("MatMul", ["merged", "w_out"], ["projected"]),
              helper.make_node("Add", ["x", "projected"], ["y"])]
    inits = [t for t in inits if t.name != "perm_k"]
    graph = helper.make_graph(nodes, "encoder", [helper.make_tensor_value_info("x", TensorProto.FLOAT,
                                                                               [batch, seq, hidden])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [batch, seq, hidden])],
                              initializer=inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)])


def _session_run(model: onnx.ModelProto, feeds: dict[str, np.ndarray]) -> Callable[[], object]:
    options = ort.SessionOptions()
    session = ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])
    return lambda: session.run(None, feeds)


def _versus_plain(case: str, model: onnx.ModelProto, feeds: dict[str, np.ndarray]) -> list[Measurement]:
    graph = from_onnx(model)
    run(graph, feeds, runtime="onnxruntime")     # compiled once, as a user's first call does
    return [Measurement("ONNX model", case, "plain InferenceSession.run", _session_run(model, feeds), 1e9, "calls/s",
                        baseline=True),
            Measurement("ONNX model", case, "geir.run onnxruntime", lambda: run(graph, feeds, runtime="onnxruntime"),
                        1e9, "calls/s", targets=(("plain InferenceSession.run", RUN_TARGET),))]


def unpermute_graph(tokens: int, topk: int, hidden: int) -> Graph:
    """A MoE token unpermute of standard ops: Gather of the expert-sorted rows, Reshape, times probs, sum over K."""
    b = GraphBuilder("moe_unpermute")
    permuted = b.input("permuted", "float32", (tokens * topk, hidden))
    idx = b.input("idx", "int32", (tokens * topk,))
    probs = b.input("probs", "float32", (tokens, topk))
    shape = b.constant("shape", np.array([tokens, topk, hidden], np.int64))
    rows = b.op("Reshape", b.op("Gather", permuted, idx, axis=0), shape)
    weighted = b.op("Mul", rows, b.op("Unsqueeze", probs, b.constant("last", np.array([-1], np.int64))))
    b.output(b.op("ReduceSum", weighted, b.constant("over_k", np.array([1], np.int64)), keepdims=0), "y")
    return b.build()


def onnx_run_measurements(quick: bool) -> list[Measurement]:
    """geir.run on ONNX Runtime against a plain InferenceSession.run of the same file (an encoder layer), and a MoE
    unpermute of standard ops against it fused."""
    batch, seq = (2, 32) if quick else (4, 128)
    x = np.random.default_rng(1).standard_normal((batch, seq, 256)).astype(np.float32)
    rows = _versus_plain(f"encoder layer, static [{batch}, {seq}, 256]", encoder_model(batch, seq), {"x": x})
    rows += _versus_plain(f"encoder layer, dynamic [batch, seq, 256] fed [{batch}, {seq}, 256]",
                          encoder_model("batch", "seq"), {"x": x})
    tokens, topk, hidden = (256, 2, 128) if quick else (2048, 2, 1024)
    unfused = unpermute_graph(tokens, topk, hidden)
    fused, _ = fuse(unfused, allow_stricter_data=True)   # probs may hold zeros: CANN skips those rows
    rng = np.random.default_rng(2)
    feeds = {"permuted": rng.standard_normal((tokens * topk, hidden)).astype(np.float32),
             "idx": rng.permutation(tokens * topk).astype(np.int32),
             "probs": rng.random((tokens, topk)).astype(np.float32)}
    case = f"MoE unpermute, {tokens} tokens x top-{topk} x {hidden} float32"
    for graph in (unfused, fused):
        run(graph, feeds, runtime="onnxruntime")
    return rows + [
        Measurement("ONNX model", case, "geir.run onnxruntime, standard ops", lambda: run(unfused, feeds,
                                                                                          runtime="onnxruntime"),
                    1e9, "calls/s", baseline=True),
        Measurement("ONNX model", case, "geir.run onnxruntime, fused MoeTokenUnpermute",
                    lambda: run(fused, feeds, runtime="onnxruntime"), 1e9, "calls/s",
                    targets=(("geir.run onnxruntime, standard ops", 1.0),))]
