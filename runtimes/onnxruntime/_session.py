"""The ONNX Runtime runtime: a graph runs as its exported model in one InferenceSession."""

from __future__ import annotations

import weakref
from collections.abc import Mapping

import ml_dtypes
import numpy as np
import onnxruntime as ort
from onnx import TensorProto

from geir._core import Graph
from geir._errors import ExecutionError, GraphError
from geir._onnx_export import to_onnx
from geir.schemas import DataContext

from .._feeds import validate_feeds
from ..numpy._parallel import num_threads
from ._native import native_library

__all__ = ["OnnxRuntimeExecutable", "OnnxRuntimeRuntime"]

_CACHE: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


class OnnxRuntimeRuntime:
    """Runs graphs through ``geir.to_onnx`` in ONNX Runtime's CPU provider (our ops as function bodies)."""

    name = "onnxruntime"

    def compile(self, graph: Graph) -> OnnxRuntimeExecutable:
        """One session per graph object, cached: compiling the same graph again is free."""
        if not {"verified", "typed"} <= graph.properties:
            raise GraphError(f"graph '{graph.name}' is not built; call GraphBuilder.build() first")
        native = native_library() is not None
        cached = _CACHE.get(graph)
        if cached is None or cached.native != native:
            cached = _CACHE[graph] = OnnxRuntimeExecutable(graph)
        return cached


def session_options() -> ort.SessionOptions:
    """Intra-op threads as the NumPy runtime uses, sequential execution, our native kernels when proven."""
    options = ort.SessionOptions()
    options.intra_op_num_threads = num_threads()
    options.inter_op_num_threads = 1
    options.execution_mode = ort.ExecutionMode.ORT_SEQUENTIAL
    library = native_library()
    if library is not None:
        options.register_custom_ops_library(library)
    return options


class OnnxRuntimeExecutable:
    def __init__(self, graph: Graph) -> None:
        self.graph = graph
        self.native = native_library() is not None
        self.model = to_onnx(graph)
        self.session = ort.InferenceSession(self.model.SerializeToString(), session_options(),
                                            providers=["CPUExecutionProvider"])

    def run(self, feeds: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        arrays, bindings = validate_feeds(self.graph, feeds)
        validate_graph_inputs(self.graph, arrays, bindings)
        binding = self.session.io_binding()
        keep_alive = []                       # OrtValues and buffers must outlive the run
        for name, array in arrays.items():
            value = _ort_value(np.ascontiguousarray(array))
            keep_alive.append(value)
            binding.bind_ortvalue_input(name, value)
        outputs: dict[str, np.ndarray] = {}
        bound: list[str] = []                 # binding order, which is the order of binding.get_outputs()
        for value in self.graph.outputs:
            if value.producer is None:        # a graph input or constant passed through: ORT never writes it
                continue
            bound.append(value.name)
            shape = _concrete(value.type.shape, bindings)
            if shape is None:
                binding.bind_output(value.name)
                continue
            buffer = np.empty(shape, value.type.dtype.numpy)
            ort_value = _ort_value(buffer)
            keep_alive.append(ort_value)
            binding.bind_ortvalue_output(value.name, ort_value)
            outputs[value.name] = buffer
        try:
            self.session.run_with_iobinding(binding)
        except Exception as exc:
            raise ExecutionError(f"graph '{self.graph.name}' on onnxruntime: {exc}") from exc
        for name, value in zip(bound, binding.get_outputs()):
            if name not in outputs:
                outputs[name] = value.numpy()
        for value in self.graph.outputs:
            if value.producer is None:
                source = arrays.get(value.name)
                outputs[value.name] = (source if source is not None else self.graph.constants[value.name]).copy()
        return {v.name: outputs[v.name] for v in self.graph.outputs}


def _ort_value(array: np.ndarray) -> ort.OrtValue:
    if array.dtype == ml_dtypes.bfloat16:
        if not hasattr(ort.OrtValue, "ortvalue_from_numpy_with_onnx_type"):
            raise ExecutionError(f"ONNX Runtime {ort.__version__} cannot exchange bfloat16 arrays with Python (it has no "
                                 f"OrtValue.ortvalue_from_numpy_with_onnx_type); use a newer ONNX Runtime or the numpy "
                                 f"runtime for bfloat16 graphs")
        return ort.OrtValue.ortvalue_from_numpy_with_onnx_type(array.view(np.uint16), TensorProto.BFLOAT16)
    return ort.OrtValue.ortvalue_from_numpy(array)


def _concrete(shape: tuple, bindings: dict[str, int]) -> tuple[int, ...] | None:
    dims = [d if isinstance(d, int) else bindings.get(d) for d in shape]
    return None if any(d is None for d in dims) else tuple(dims)


def validate_graph_inputs(graph: Graph, arrays: dict[str, np.ndarray], bindings: dict[str, int]) -> None:
    """Run each node's data validation where the values it reads are graph inputs or constants.

    Inside the model nothing can be checked (the function bodies stay memory-safe), so this is
    where bad indices or lengths fed to the graph are caught, naming the node and input.
    """
    known = dict(graph.constants) | arrays
    for node in graph.topological_order():
        schema = node.schema
        if schema.validate is None:
            continue
        args = []
        readable = True
        for spec, value in zip(schema.inputs, node.inputs):
            if value is None:
                args.append(None)
            elif value.name in known:
                args.append(known[value.name])
            elif spec.name in schema.validated_inputs:
                readable = False
                break
            else:                                     # only its shape is read: a zero-cost stand-in
                shape = _concrete(value.type.shape, bindings)
                if shape is None:
                    readable = False
                    break
                args.append(np.broadcast_to(np.zeros((), value.type.dtype.numpy), shape))
        if readable:
            schema.validate(DataContext(schema, node.name, args, node.attributes, location=node.location))
