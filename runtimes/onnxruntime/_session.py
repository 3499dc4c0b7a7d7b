"""The ONNX Runtime runtime: a graph runs as its exported model in one InferenceSession."""

from __future__ import annotations

import math
from collections.abc import Mapping

import ml_dtypes
import numpy as np
import onnx
import onnxruntime as ort
from onnx import TensorProto

from ...ir._core import CANN_DOMAIN, Graph, Node, Value
from ...ir._dtypes import DType
from ...ir._errors import ExecutionError, GraphError, first_line
from ...ir._onnx_export import runtime_model
from ...ir._onnx_types import value_info
from ...ir._types import TensorType

from .._checks import concrete_types, describe, validate_node_data
from .._compiled import compiled_once, ensure_current
from .._feeds import validate_feeds
from .._outputs import concrete_shape, fill_output_buffers, validate_output_buffers
from .._threads import num_threads
from ._native import native_library, native_op_types

__all__ = ["OnnxRuntimeExecutable", "OnnxRuntimeRuntime"]

NATIVE_REFUSAL = "(geir native kernel)"
"""What every error of our native kernels carries (``ort_errorf`` in native/abi.c)."""

_AS_BITS: dict[np.dtype, tuple[int, str]] = {
    np.dtype(ml_dtypes.bfloat16): (TensorProto.BFLOAT16, "tensor(bfloat16)"),
    np.dtype(ml_dtypes.float8_e4m3fn): (TensorProto.FLOAT8E4M3FN, "tensor(float8e4m3fn)"),
    np.dtype(ml_dtypes.float8_e4m3fnuz): (TensorProto.FLOAT8E4M3FNUZ, "tensor(float8e4m3fnuz)"),
    np.dtype(ml_dtypes.float8_e5m2): (TensorProto.FLOAT8E5M2, "tensor(float8e5m2)"),
    np.dtype(ml_dtypes.float8_e5m2fnuz): (TensorProto.FLOAT8E5M2FNUZ, "tensor(float8e5m2fnuz)"),
}
"""Element types ONNX Runtime's Python binding has no NumPy dtype for but stores as NumPy does (one element per
whole bytes): exchanged as OrtValues of their bits (ONNX code, ONNX Runtime's type name)."""
_BY_ORT_NAME = {name: dtype for dtype, (_, name) in _AS_BITS.items()}
_PACKED = frozenset({DType.INT4, DType.UINT4, DType.INT2, DType.UINT2, DType.FLOAT4E2M1, DType.FLOAT6E2M3,
                     DType.FLOAT6E3M2})
"""Sub-byte types: ONNX Runtime packs several per byte, NumPy (ml_dtypes) one per byte."""

class OnnxRuntimeRuntime:
    """Runs graphs through ``geir.to_onnx`` in ONNX Runtime's CPU provider (our ops as function bodies)."""

    name = "onnxruntime"

    def compile(self, graph: Graph) -> OnnxRuntimeExecutable:
        """One session per revision of a graph (and per native library state): compiling it again is free."""
        return compiled_once(graph, native_library() is not None, OnnxRuntimeExecutable, self.name)


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
    """A graph's exported model in one session, with the checks the NumPy runtime makes before each node.

    Semantic rules are re-checked on the fed shapes (``concrete_types``) and every data rule runs on
    the values its node reads: feeds and constants directly, values computed inside the model by a
    probe session that returns just those values (ONNX Runtime prunes the rest), before the real run.
    A node whose native kernel enforces its data rules itself (``native_op_types``) is not probed for: the
    run goes ahead, and only when a native kernel refuses its data does the probe run, so that the error
    names the node and rule exactly as the NumPy runtime's does.
    """

    def __init__(self, graph: Graph) -> None:
        self.graph = graph
        self.revision = graph.revision
        self.model = runtime_model(graph)
        self.session = _session(self.model, graph)
        self.order = graph.topological_order()
        given = {v.name for v in graph.inputs} | set(graph.constants)
        self.checked = [n for n in self.order if n.schema.validate is not None]
        self.probed: dict[str, Value] = {}
        """Values computed inside the model that a data rule reads (or whose symbolic shape it needs)."""
        for node in self.checked:
            for spec, value in zip(node.schema.inputs, node.inputs):
                if value is not None and value.name not in given and (
                        spec.name in node.schema.validated_inputs or not value.type.is_static):
                    self.probed[value.name] = value
        native = native_op_types()
        self.enforced = frozenset(n.name for n in self.checked if n.domain == CANN_DOMAIN and n.op_type in native)
        """Checked nodes run by a native kernel that refuses bad data itself (the library's table lists every dtype
        combination their schemas allow, a tested fact): their values need no probe before a run."""
        self._probe_session: ort.InferenceSession | None = None
        self.quiet = ort.RunOptions()
        """A failed run raises an ExecutionError carrying ONNX Runtime's message: its logger need not print it too
        (a kernel's refusal of data is an expected outcome, explained by the error)."""
        self.quiet.log_severity_level = 4
        self.static_types: dict[str, TensorType] | None = None
        """Every value's type when none holds a symbol: then the fed shapes change nothing to re-derive."""
        if all(v.type.is_static for v in graph.values()):
            self.static_types = {v.name: v.type for v in graph.values()}
        exchanged = [v.type.dtype for v in list(graph.inputs) + list(graph.outputs)]
        packed = sorted({d.value for d in exchanged if d in _PACKED})
        if packed:
            raise GraphError(f"runtime 'onnxruntime' cannot run graph '{graph.name}': its inputs or outputs are "
                             f"{', '.join(packed)}, which ONNX Runtime packs several to a byte and its Python binding "
                             f"cannot exchange; run it on the numpy runtime")
        self.unbindable = DType.STRING in exchanged or not all(v.type.is_tensor for v in list(graph.inputs) +
                                                               list(graph.outputs))
        """String tensors, sequences and optional values have no address to bind: such a graph always runs through
        ``session.run``."""
        self.plain_run = self.unbindable or self.static_types is not None and all(
            v.producer is not None and v.type.dtype.numpy not in _AS_BITS for v in graph.outputs) and all(
            v.type.dtype.numpy not in _AS_BITS for v in graph.inputs)
        """Static shapes, no bfloat16 or float8 and no pass-through output: without caller buffers ``session.run``
        does it all (IOBinding costs tens of microseconds in Python per call, more than a small run itself)."""
        self.output_names = [v.name for v in graph.outputs]

    def run(self, feeds: Mapping[str, np.ndarray],
            outputs: Mapping[str, np.ndarray] | None = None) -> dict[str, np.ndarray]:
        ensure_current(self.graph, self.revision, OnnxRuntimeRuntime.name)
        arrays, bindings = validate_feeds(self.graph, feeds)
        buffers = validate_output_buffers(self.graph, outputs, arrays, bindings, feeds)
        types = self.static_types if self.static_types is not None else concrete_types(
            self.graph, self.order, {name: a.shape for name, a in arrays.items() if isinstance(a, np.ndarray)})
        known: dict[str, np.ndarray] = dict(self.graph.constants) | arrays
        pending = [n for n in self.checked if not _validate_node(n, known, types, final=False)]
        # no probe where the native kernels check the data themselves (not into caller buffers, which a refused run
        # could leave half written)
        deferred = bool(pending) and not buffers and all(n.name in self.enforced for n in pending)
        if pending and not deferred:
            self._validate_probed(pending, arrays, known, types)
        if self.unbindable and buffers:
            raise ExecutionError(f"graph '{self.graph.name}' on onnxruntime: output buffers cannot be given for a graph "
                                 f"that exchanges string tensors, sequences or optional values (ONNX Runtime returns "
                                 f"new ones)")
        if self.plain_run and not buffers:
            try:
                plain = dict(zip(self.output_names,
                                 self.session.run(self.output_names, _plain_feeds(arrays), self.quiet)))
            except Exception as exc:
                if deferred:
                    self._explain_refusal(exc, pending, arrays, known, types)
                raise ExecutionError(f"graph '{self.graph.name}' on onnxruntime: {exc}") from exc
            _check_outputs(self.graph, plain, types)
            return plain
        binding = self.session.io_binding()
        keep_alive = _bind_inputs(binding, arrays)   # OrtValues and buffers must outlive the run
        results: dict[str, np.ndarray] = {}
        bound: list[str] = []                 # binding order, which is the order of binding.get_outputs()
        for value in self.graph.outputs:
            if value.producer is None:        # a graph input or constant passed through: ORT never writes it
                continue
            bound.append(value.name)
            buffer = buffers.get(value.name)       # the caller's buffer, written by ONNX Runtime directly
            if buffer is None or concrete_shape(self.graph, value, bindings) is None:
                binding.bind_output(value.name)    # ONNX Runtime allocates it, from its arena (no fresh pages to
                continue                           # fault in on every run); a data-dependent one is copied after
            keep_alive += _bind_array(binding, value.name, buffer, output=True)
            results[value.name] = buffer
        try:
            if bound:     # ONNX Runtime refuses a run that requests no output (every output passed through)
                self.session.run_with_iobinding(binding, self.quiet)
        except Exception as exc:
            if deferred:
                self._explain_refusal(exc, pending, arrays, known, types)
            raise ExecutionError(f"graph '{self.graph.name}' on onnxruntime: {exc}") from exc
        if any(name not in results for name in bound):     # outputs ONNX Runtime allocated
            for name, value in zip(bound, binding.get_outputs()):
                if name not in results:
                    results[name] = _as_array(value)
        for value in self.graph.outputs:
            if value.producer is None:
                source = arrays.get(value.name)
                results[value.name] = (source if source is not None else self.graph.constants[value.name]).copy()
        ordered = {v.name: results[v.name] for v in self.graph.outputs}
        _check_outputs(self.graph, ordered, types)
        fill_output_buffers(self.graph, ordered, buffers)
        return ordered

    def _validate_probed(self, pending: list[Node], arrays: Mapping[str, np.ndarray], known: dict[str, np.ndarray],
                         types: Mapping[str, TensorType]) -> None:
        """Run the data rules of ``pending`` on the values the probe session computes (ExecutionError on bad data)."""
        known |= self._probe(arrays)
        for node in pending:
            _validate_node(node, known, types, final=True)

    def _explain_refusal(self, exc: Exception, pending: list[Node], arrays: Mapping[str, np.ndarray],
                         known: dict[str, np.ndarray], types: Mapping[str, TensorType]) -> None:
        """A run whose data rules were left to the native kernels failed: when a kernel refused its data, the
        rules run on the probed values now and raise the error the NumPy runtime gives (node, rule, entry)."""
        if NATIVE_REFUSAL in str(exc):
            self._validate_probed(pending, arrays, known, types)

    def _probe(self, arrays: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        """The probed inner values for these feeds (index tensors as arrays; others as shape stand-ins)."""
        values = list(self.probed.values())
        if self._probe_session is None:
            self._probe_session = _session(_probe_model(self.model, values), self.graph, spinning=False)
        binding = self._probe_session.io_binding()
        keep_alive = _bind_inputs(binding, arrays)   # noqa: F841  (must outlive the run)
        for value in values:
            binding.bind_output(value.name)
        try:
            self._probe_session.run_with_iobinding(binding)
        except Exception as exc:
            raise ExecutionError(f"graph '{self.graph.name}' on onnxruntime: {exc}") from exc
        probed = {}
        for value, result in zip(values, binding.get_outputs()):
            if value.type.dtype.numpy in (np.int32, np.int64):
                probed[value.name] = result.numpy()
            else:   # only its shape is read
                probed[value.name] = _stand_in(value.type.dtype.numpy, tuple(result.shape()))
        return probed


def _bind_inputs(binding: ort.IOBinding, arrays: Mapping[str, np.ndarray]) -> list[object]:
    """Bind every feed; return what must outlive the run (the arrays, or OrtValues for bfloat16)."""
    alive: list[object] = []
    for name, array in arrays.items():   # not np.ascontiguousarray: it makes a 0-d array 1-d, a (1,) feed
        alive += _bind_array(binding, name, np.require(array, requirements="C"), output=False)
    return alive


def _plain_feeds(arrays: Mapping[str, np.ndarray]) -> dict[str, object]:
    """Feeds for ``session.run``: arrays, and OrtValues of the types ``_AS_BITS`` names."""
    return {name: _ort_value(a) if isinstance(a, np.ndarray) and a.dtype in _AS_BITS else a
            for name, a in arrays.items()}


def _bind_array(binding: ort.IOBinding, name: str, array: np.ndarray, output: bool) -> list[object]:
    """Bind a C-contiguous array by its address (no OrtValue to build: the cheap path for small runs); bfloat16 and
    float8, which ONNX Runtime's Python binding cannot name by a NumPy dtype, through an OrtValue."""
    if array.dtype in _AS_BITS:
        value = _ort_value(array)
        (binding.bind_ortvalue_output if output else binding.bind_ortvalue_input)(name, value)
        return [value, array]
    bind = binding.bind_output if output else binding.bind_input
    bind(name, "cpu", 0, array.dtype, list(array.shape), array.ctypes.data)
    return [array]


class _OrtMemory:
    """An OrtValue's memory as NumPy sees it, for the types ``_AS_BITS`` names (which ONNX Runtime's binding has no
    NumPy type for): the array made from it keeps this object, and so the OrtValue and its memory, alive."""

    __slots__ = ("value", "__array_interface__")

    def __init__(self, value: ort.OrtValue, shape: tuple[int, ...], itemsize: int) -> None:
        self.value = value
        self.__array_interface__ = {"version": 3, "shape": shape, "typestr": f"<u{itemsize}",
                                    "data": (value.data_ptr(), False)}


def _as_array(value: ort.OrtValue) -> np.ndarray:
    """An output ONNX Runtime allocated, as a NumPy array over its memory (no copy, as ``OrtValue.numpy``)."""
    dtype = _BY_ORT_NAME.get(value.data_type())
    if dtype is None:
        return value.numpy()
    shape = tuple(value.shape())
    if math.prod(shape) == 0:
        return np.empty(shape, dtype)
    return np.asarray(_OrtMemory(value, shape, dtype.itemsize)).view(dtype)


def _check_outputs(graph: Graph, results: Mapping[str, np.ndarray], types: Mapping[str, TensorType]) -> None:
    """What ONNX Runtime returned has each output's declared shape (ExecutionError otherwise), as the NumPy runtime
    checks every kernel's result: ONNX Runtime only warns when a result disagrees with the model's declared shape."""
    for value in graph.outputs:
        array = results[value.name]
        want = types.get(value.name, value.type)
        if want.is_tensor and want.dims is not None and (len(array.shape) != len(want.dims) or any(
                isinstance(d, int) and d != a for a, d in zip(array.shape, want.dims))):
            node = value.producer
            where = describe(node) if node is not None else f"graph '{graph.name}'"
            raise ExecutionError(f"{where} on onnxruntime: returned {list(array.shape)} for output '{value.name}', "
                                 f"expected {want}", node=None if node is None else node.name)


def _stand_in(dtype: np.dtype, shape: tuple[int, ...]) -> np.ndarray:
    """A zero-cost array of ``shape`` for a data rule that reads only the shape of an input."""
    return np.broadcast_to(np.zeros((), dtype), shape)


def _session(model: onnx.ModelProto, graph: Graph, spinning: bool = True) -> ort.InferenceSession:
    """An InferenceSession; GraphError when ONNX Runtime cannot run the graph (a kernel it lacks, say).

    ``spinning=False`` for the probe session: its pool's threads, left spinning after each probe (ONNX Runtime's
    default), would take the cores from the real run that follows (1.6x slower on two cores)."""
    options = session_options()
    if not spinning:
        options.add_session_config_entry("session.intra_op.allow_spinning", "0")
    try:
        return ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])
    except Exception as exc:
        raise GraphError(f"runtime 'onnxruntime' cannot run graph '{graph.name}': {first_line(exc)}") from exc


def _probe_model(model: onnx.ModelProto, values: list[Value]) -> onnx.ModelProto:
    """A copy of ``model`` computing only ``values`` (inner values of the graph), its outputs."""
    probe = onnx.ModelProto()
    probe.CopyFrom(model)
    needed = {v.name for v in values}
    kept = []
    for node in reversed(probe.graph.node):        # the model's nodes are in topological order
        if needed.intersection(node.output):
            kept.append(node)
            needed.update(name for name in node.input if name)
    del probe.graph.node[:]
    probe.graph.node.extend(reversed(kept))
    names = {v.name for v in values}
    inner = [vi for vi in probe.graph.value_info if vi.name not in names]
    del probe.graph.value_info[:]
    probe.graph.value_info.extend(inner)
    del probe.graph.output[:]
    probe.graph.output.extend(value_info(v.name, v.type) for v in values)
    return probe


def _ort_value(array: np.ndarray) -> ort.OrtValue:
    if array.dtype in _AS_BITS:
        if not hasattr(ort.OrtValue, "ortvalue_from_numpy_with_onnx_type"):
            raise ExecutionError(f"ONNX Runtime {ort.__version__} cannot exchange {array.dtype} arrays with Python (it "
                                 f"has no OrtValue.ortvalue_from_numpy_with_onnx_type); use a newer ONNX Runtime or the "
                                 f"numpy runtime for {array.dtype} graphs")
        bits = array.view(np.uint16 if array.dtype.itemsize == 2 else np.uint8)
        return ort.OrtValue.ortvalue_from_numpy_with_onnx_type(bits, _AS_BITS[array.dtype][0])
    return ort.OrtValue.ortvalue_from_numpy(array)


def _validate_node(node: Node, known: Mapping[str, np.ndarray], types: Mapping[str, TensorType], final: bool) -> bool:
    """Validate ``node``'s data if every value it reads is at hand; return whether it ran.

    Inputs of which only the shape is read get a zero-cost stand-in of their concrete shape.
    """
    args: list[np.ndarray | None] = []
    for spec, value in zip(node.schema.inputs, node.inputs):
        if value is None:
            args.append(None)
        elif value.name in known:
            args.append(known[value.name])
        elif spec.name not in node.schema.validated_inputs and value.name in types:
            t = types[value.name]
            args.append(_stand_in(t.dtype.numpy, t.shape))
        elif final:
            raise AssertionError(f"{describe(node)}: input '{value.name}' was not probed")
        else:
            return False
    validate_node_data(node, args)
    return True
