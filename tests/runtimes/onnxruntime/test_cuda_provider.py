"""Exported models on ONNX Runtime's CUDA provider.

geir's export writes each of our ops with a function body of standard ops that casts float16/bfloat16 to float32
inside, so the bodies need no half-precision arithmetic kernel. What a GPU machine needs, then, is that the CUDA
provider has a kernel for every (op, element type) the bodies use at the opset they are written at; any it lacks
runs on the CPU provider behind copies. ``CUDA_KERNELS`` states, for each op the bodies use, the element types
ONNX Runtime's CUDA provider registers for the opset-18 version of that op, as its generated table of kernels
lists them (microsoft/onnxruntime, docs/OperatorKernels.md, "Operators implemented by CUDAExecutionProvider").
The static test checks every body of every worked example and of the attention variants against it, here, with
no GPU. The run test executes exported rope, MoE and attention models with providers CUDA then CPU and compares
them with the NumPy runtime; it skips, saying why, without onnxruntime-gpu or without a usable CUDA device.
"""

from __future__ import annotations

import warnings
from collections.abc import Iterator

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, inliner, shape_inference

import geir
from geir.ir._dtypes import as_dtype
from geir.ir._editor import GraphEditor
from geir.ir._registry import all_schemas
from geir.passes import build
from geir.schemas import all_examples
from moe.helpers import moe_grad_graph, moe_graph
from moe_permute.helpers import permute_graph
from oracles.onnx_runners import run_onnxruntime
from rotary.helpers import ROPE, ROPE_GRAD, rotary_graph
from sparse_attention.helpers import SFA, SFA_GRAD, AttentionCase, paged_arrays, sfa_graph, sfa_grad_feeds

BODY_OPSET = 18
"""The opset the bodies are written at (every model below holds only our ops); CUDA_KERNELS is read for it."""

_ALL = frozenset({"bfloat16", "bool", "double", "float", "float16", "int16", "int32", "int64", "int8", "uint16",
                  "uint32", "uint64", "uint8"})
_NUMERIC = _ALL - {"bool"}
_ORDERED = frozenset({"double", "float", "float16", "int32", "int64", "uint32", "uint64"})
_MIN_MAX = _ORDERED | {"bfloat16"}
_FLOATS = frozenset({"bfloat16", "double", "float", "float16"})
_BOOL = frozenset({"bool"})

CUDA_KERNELS: dict[str, tuple[tuple[str, ...], frozenset[str]]] = {
    # op: (the inputs "iN" / outputs "oN" its type constraint binds, the types the opset-18 kernel takes)
    "Add": (("i0",), _NUMERIC), "Sub": (("i0",), _NUMERIC), "Mul": (("i0",), _NUMERIC), "Div": (("i0",), _NUMERIC),
    "And": (("i0",), _BOOL), "Or": (("i0",), _BOOL), "Not": (("i0",), _BOOL),
    "Cast": (("i0", "o0"), _ALL), "Compress": (("i0",), _ALL), "Concat": (("i0",), _ALL),
    "ConstantOfShape": (("o0",), _ALL), "CumSum": (("i0",), _ORDERED), "Equal": (("i0",), _ORDERED | _BOOL),
    "Exp": (("i0",), _FLOATS), "Expand": (("i0",), _ALL), "Gather": (("i0",), _ALL),
    "Greater": (("i0",), _ORDERED), "GreaterOrEqual": (("i0",), _ORDERED), "Less": (("i0",), _ORDERED),
    "LessOrEqual": (("i0",), _ORDERED), "Identity": (("i0",), _ALL), "IsInf": (("i0",), frozenset({"double", "float"})),
    "IsNaN": (("i0",), _FLOATS), "MatMul": (("i0",), _FLOATS), "Max": (("i0",), _MIN_MAX), "Min": (("i0",), _MIN_MAX),
    "Mod": (("i0",), _MIN_MAX), "Neg": (("i0",), _FLOATS | {"int16", "int32", "int64", "int8"}),
    "Range": (("i0",), frozenset({"double", "float", "int16", "int32", "int64"})),
    "ReduceMax": (("i0",), frozenset({"double", "float", "float16", "int32", "int64"})),
    "ReduceMin": (("i0",), frozenset({"double", "float", "float16", "int32", "int64", "int8", "uint8"})),
    "ReduceProd": (("i0",), frozenset({"double", "float", "float16", "int32"})),
    "ReduceSum": (("i0",), _FLOATS | {"int32", "int64"}),
    "Reshape": (("i0",), _ALL), "ScatterElements": (("i0",), _ALL), "ScatterND": (("i0",), _ALL),
    "Shape": (("i0",), _ALL), "Slice": (("i0",), _ALL), "Squeeze": (("i0",), _ALL), "Unsqueeze": (("i0",), _ALL),
    "TopK": (("i0",), frozenset({"double", "float", "float16", "int32", "int64"})), "Transpose": (("i0",), _ALL),
    "Where": (("i1",), frozenset({"bfloat16", "double", "float", "float16", "int32", "int64", "uint8"})),
}
EXPANDED = {"CastLike": "Cast"}
"""Ops ONNX defines by a function body, which ONNX Runtime expands where no kernel claims them: CastLike is a Cast."""
NOT_KERNELS = {"Constant"}
"""Folded into initializers by ONNX Runtime, so no provider runs them."""


def _type_name(elem_type: int) -> str:
    """As OperatorKernels.md names it: float, double, float16, bfloat16, int64, bool, ..."""
    return TensorProto.DataType.Name(elem_type).lower()


def gaps(model: onnx.ModelProto) -> list[str]:
    """Each node of the model with its functions inlined that the CUDA provider has no kernel for, as text."""
    flat = shape_inference.infer_shapes(inliner.inline_local_functions(model), strict_mode=True)
    types = {v.name: v.type.tensor_type.elem_type for v in (*flat.graph.input, *flat.graph.value_info,
                                                             *flat.graph.output)}
    types.update({t.name: t.data_type for t in flat.graph.initializer})
    found = []
    for node in flat.graph.node:
        if node.domain not in ("", "ai.onnx"):
            found.append(f"{node.op_type} ({node.domain}): not a standard op")
            continue
        if node.op_type in NOT_KERNELS:
            continue
        op = EXPANDED.get(node.op_type, node.op_type)
        if op not in CUDA_KERNELS:
            found.append(f"{node.op_type}: not in CUDA_KERNELS (read docs/OperatorKernels.md for it)")
            continue
        positions, allowed = CUDA_KERNELS[op]
        for position in positions:
            name = (node.input if position[0] == "i" else node.output)[int(position[1:])]
            got = _type_name(types[name])
            if got not in allowed:
                found.append(f"{node.op_type} '{node.name}': {position} is {got}; the CUDA provider has "
                             f"{', '.join(sorted(allowed))}")
    return found


def _example_models() -> Iterator[tuple[str, onnx.ModelProto]]:
    """Every worked example of every op of ours, in each of its dtypes, as an exported one-node model."""
    for schema in all_schemas():
        for example in (e for e in all_examples(schema) if e.warning is None):
            for dtype in example.dtypes:
                b = GraphEditor(example.name)
                inputs = []
                for spec in schema.inputs:
                    array = example.inputs.get(spec.name)
                    inputs.append(None if array is None else b.input(
                        spec.name, as_dtype(example.input_dtype(spec.name, dtype)), np.shape(array)))
                results = b.add_node(schema, inputs, dict(example.attributes), name="node")
                for spec, value in zip(schema.outputs, results if isinstance(results, tuple) else (results,)):
                    if value is not None:
                        b.output(value, f"{spec.name}_out")
                yield f"{example.name}-{dtype}", geir.to_onnx(build(b))


ATTENTION = [AttentionCase(layout=layout, mode=mode, Dr=dr, sinks=sinks, kv_merge=merge, lengths=layout == "BSND",
                           N1=4, N2=n2, dtype=dtype)
             for layout, mode, dr, sinks, merge, n2, dtype in [
                 ("BSND", 3, 8, False, False, 1, "float16"), ("BSND", 0, 0, True, False, 2, "bfloat16"),
                 ("TND", 3, 8, True, True, 1, "bfloat16"), ("TND", 0, 0, False, False, 2, "float16")]]


def _attention_models() -> Iterator[tuple[str, onnx.ModelProto]]:
    """The attention bodies' structural variants: layouts, sparse modes, rope, sinks, KV merge, grouped heads, the
    grad of each, and a paged KV cache."""
    for case in ATTENTION:
        label = f"{case.layout}-mode{case.mode}-dr{case.Dr}-sinks{case.sinks}-merge{case.kv_merge}-{case.dtype}"
        arrays = case.arrays()
        forward, feeds = sfa_graph(arrays, SFA, value_is_key=case.kv_merge, **case.forward_attrs())
        yield f"sfa-{label}", geir.to_onnx(forward)
        out = geir.run(forward, feeds)
        grad_feeds = sfa_grad_feeds(arrays, out, arrays["query"], case.layout)
        if not case.sinks:       # the grad op takes no sinks (their cotangent comes from the statistics)
            grad, _ = sfa_graph(grad_feeds, SFA_GRAD, value_is_key=case.kv_merge, **case.grad_attrs())
            yield f"sfa-grad-{label}", geir.to_onnx(grad)
        paged = paged_arrays(arrays, case.layout, 16, np.random.default_rng(0))
        graph, _ = sfa_graph(paged, SFA, value_is_key=case.kv_merge, **dict(case.forward_attrs(), layout_kv="PA_BSND", return_softmax_lse=False))
        yield f"sfa-paged-{label}", geir.to_onnx(graph)


def test_every_body_uses_only_kernels_the_cuda_provider_has():
    checked, found = 0, []
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", geir.GeirWarning)     # examples of rules that warn (RP-W1, MG-W2)
        for name, model in [*_example_models(), *_attention_models()]:
            opsets = {o.domain: o.version for o in model.opset_import}
            assert opsets[""] == BODY_OPSET, f"{name}: opset {opsets['']}; CUDA_KERNELS is read for {BODY_OPSET}"
            found += [f"{name}: {gap}" for gap in gaps(model)]
            checked += 1
    assert checked >= 80 and found == [], "\n".join(found)


def test_the_check_finds_a_kernel_the_cuda_provider_lacks():
    """The permute body once took K as an int64 ReduceProd, which the CUDA provider does not have."""
    shape = helper.make_node("Shape", ["x"], ["s"], start=1)
    node = helper.make_node("ReduceProd", ["s"], ["k"], keepdims=1, name="k")
    graph = helper.make_graph([shape, node], "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [3, 2])],
                              [helper.make_tensor_value_info("k", TensorProto.INT64, [1])])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", BODY_OPSET)])
    assert gaps(model) == ["ReduceProd 'k': i0 is int64; the CUDA provider has double, float, float16, int32"]


CUDA = ["CUDAExecutionProvider", "CPUExecutionProvider"]


def _require_cuda() -> None:
    import onnxruntime as ort

    if "CUDAExecutionProvider" not in ort.get_available_providers():
        pytest.skip(f"onnxruntime {ort.__version__} here has no CUDAExecutionProvider (it comes with the "
                    f"onnxruntime-gpu package, on a machine with an NVIDIA GPU)")
    probe = helper.make_model(helper.make_graph(
        [helper.make_node("Identity", ["x"], ["y"])], "probe", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1])]), opset_imports=[helper.make_opsetid("", 18)])
    session = ort.InferenceSession(probe.SerializeToString(), providers=CUDA)
    if "CUDAExecutionProvider" not in session.get_providers():
        pytest.skip("onnxruntime-gpu is installed but no CUDA device is usable (its session fell back to the CPU)")


def _rope(op: str, dtype: str):
    g = rotary_graph(op, (2, 64, 8, 128), (1, 64, 1, 64), dtype, rotary_mode=1, partial_slice=[32, 96])
    rng = np.random.default_rng(1)
    dt = as_dtype(dtype).numpy
    return g, {"x": rng.standard_normal((2, 64, 8, 128)).astype(dt),
               "cos": rng.uniform(-1, 1, (1, 64, 1, 64)).astype(dt), "sin": rng.uniform(-1, 1, (1, 64, 1, 64)).astype(dt)}


def _moe(grad: bool, dtype: str):
    rng = np.random.default_rng(2)
    dt = as_dtype(dtype).numpy
    tokens, probs = rng.standard_normal((64, 256)).astype(dt), rng.uniform(0, 1, (32, 2)).astype(dt)
    indices = rng.permutation(64).astype(np.int32)
    if grad:
        g = moe_grad_graph((64, 256), (32, 256), 64, (32, 2), dtype)
        return g, {"tokens": tokens, "dy": rng.standard_normal((32, 256)).astype(dt), "indices": indices,
                   "probs": probs}
    return moe_graph(64, 256, 64, (32, 2), dtype), {"tokens": tokens, "indices": indices, "probs": probs}


def _permute(dtype: str):
    rng = np.random.default_rng(3)
    return permute_graph((32, 256), (32, 4), as_dtype(dtype)), {
        "tokens": rng.standard_normal((32, 256)).astype(as_dtype(dtype).numpy),
        "indices": rng.integers(0, 8, (32, 4)).astype(np.int32)}


def _attention(grad: bool, dtype: str):
    case = AttentionCase(layout="BSND", B=2, S1=16, S2=256, N1=8, D=64, D2=64, Dr=16, K=16, bs=4, mode=3,
                         dtype=dtype)
    arrays = case.arrays()
    forward, feeds = sfa_graph(arrays, SFA, **case.forward_attrs())
    if not grad:
        return forward, feeds
    d_out = np.random.default_rng(4).standard_normal(arrays["query"].shape).astype(arrays["query"].dtype)
    return sfa_graph(sfa_grad_feeds(arrays, geir.run(forward, feeds), d_out, "BSND"), SFA_GRAD, **case.grad_attrs())


MODELS = {"rope-bfloat16": lambda: _rope(ROPE, "bfloat16"), "rope-grad-float16": lambda: _rope(ROPE_GRAD, "float16"),
          "moe-unpermute-bfloat16": lambda: _moe(False, "bfloat16"), "moe-grad-float16": lambda: _moe(True, "float16"),
          "moe-permute-bfloat16": lambda: _permute("bfloat16"), "attention-float16": lambda: _attention(False, "float16"),
          "attention-grad-bfloat16": lambda: _attention(True, "bfloat16")}


@pytest.mark.parametrize("name", MODELS)
def test_exported_model_runs_on_the_cuda_provider(name, tmp_path):
    _require_cuda()
    graph, feeds = MODELS[name]()
    path = tmp_path / f"{name}.onnx"
    geir.save_onnx(graph, path)
    model = onnx.load(path)
    got = run_onnxruntime(model, feeds, providers=CUDA)
    want = geir.run(graph, feeds)
    assert sorted(got) == sorted(want)
    for output, expected in want.items():
        actual = np.asarray(got[output])
        assert actual.dtype == expected.dtype and actual.shape == expected.shape, output
        floating = expected.dtype.kind == "f" or expected.dtype.name == "bfloat16"
        geir.testing.assert_close(actual, expected, standard="precision_standard" if floating else "bit_exact",
                                  name=f"{name} {output} on CUDA vs the NumPy runtime")
