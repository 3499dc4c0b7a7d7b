"""Running exported models without geir: ONNX Runtime and onnx's ReferenceEvaluator."""

from __future__ import annotations

from collections.abc import Sequence

import ml_dtypes
import numpy as np
import onnx
from onnx import TensorProto, helper
from onnx.reference import ReferenceEvaluator


def with_float_outputs(model: onnx.ModelProto) -> onnx.ModelProto:
    """A copy whose bfloat16 outputs are Cast to float32 (exact), as NumPy cannot take ORT's bfloat16."""
    copy = onnx.ModelProto()
    copy.CopyFrom(model)
    for out in copy.graph.output:
        if out.type.tensor_type.elem_type == TensorProto.BFLOAT16:
            inner = out.name + "__bf16"
            for node in copy.graph.node:
                node.output[:] = [inner if o == out.name else o for o in node.output]
            copy.graph.node.append(helper.make_node("Cast", [inner], [out.name], to=TensorProto.FLOAT))
            out.type.tensor_type.elem_type = TensorProto.FLOAT
    return copy


def run_onnxruntime(model: onnx.ModelProto, feeds: dict[str, np.ndarray],
                    providers: Sequence[str] = ("CPUExecutionProvider",)) -> dict[str, np.ndarray]:
    """Outputs by name, bfloat16 ones back as ml_dtypes.bfloat16; bfloat16 feeds go in as OrtValues. ``providers``:
    ONNX Runtime's execution providers, in order of preference."""
    import onnxruntime as ort

    bf16_outputs = {o.name for o in model.graph.output if o.type.tensor_type.elem_type == TensorProto.BFLOAT16}
    session = ort.InferenceSession(with_float_outputs(model).SerializeToString(), providers=list(providers))
    values = {}
    for name, array in feeds.items():
        if array.dtype == ml_dtypes.bfloat16:
            values[name] = ort.OrtValue.ortvalue_from_numpy_with_onnx_type(array.view(np.uint16), TensorProto.BFLOAT16)
        else:
            values[name] = ort.OrtValue.ortvalue_from_numpy(array)
    names = [o.name for o in model.graph.output]
    results = session.run_with_ort_values(names, values)
    out = {}
    for name, value in zip(names, results):
        array = value.numpy()
        out[name] = array.astype(ml_dtypes.bfloat16) if name in bf16_outputs else array
    return out


def run_reference(model: onnx.ModelProto, feeds: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    names = [o.name for o in model.graph.output]
    return dict(zip(names, ReferenceEvaluator(model).run(names, feeds)))
