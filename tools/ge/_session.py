"""GE's session API: ``GEInitialize``/``GEFinalize``, ``Session`` (AddGraph, RunGraph, RemoveGraph), the
error and warning channels, and ``aclgrphDumpGraph``.

As in GE, these calls answer with a status (``SUCCESS``/``FAILED``) and keep the message for
``GEGetErrorMsgV2()``; the session option ``geir.raise_errors = "1"`` raises the geir error instead.
Session options choose geir's behaviour: ``geir.runtime`` (``numpy`` or ``onnxruntime``) and
``geir.target`` (a device of ``geir.check``: AddGraph refuses a graph that device would refuse,
naming the rule). GE's documented option keys are read by ``_options.read_ge_options`` (issue 27, item 3):
``ge.exec.deterministic`` and ``ge.exec.precision_mode(_v2)`` are honoured or refused, the rest accepted and
reported on ``GEGetWarningMsgV2``; any other key (not ``geir.*``, not GE's) is refused, as is a ``geir.*`` key geir
does not know and any key or value that is not a string (GE takes a string map). GEInitialize and AddGraph answer
FAILED (``geir.raise_errors = "1"`` raises); the Session constructor, which has no status, raises.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from ...runtimes import get_runtime, runtime_names
from ...schemas.targets import TARGETS
from ..facade import check
from ...ir._core import Graph as GeirGraph
from ...ir._errors import ExecutionError, GeirWarning, GraphError
from ...ir._files import replacing
from ...ir._types import TensorType
from ...ir._onnx_export import to_onnx
from ._graph import Graph, desc_of
from ._options import read_ge_options
from ._tensor import FAILED, SUCCESS, UNKNOWN_DIM, Tensor, ge_data_type

__all__ = ["GEFinalize", "GEGetErrorMsgV2", "GEGetWarningMsgV2", "GEInitialize", "Session", "aclgrphDumpGraph"]

GEIR_OPTIONS = {"geir.runtime": "numpy | onnxruntime (default numpy)",
                "geir.target": "a device of geir.check (" + ", ".join(TARGETS) + "); none by default",
                "geir.raise_errors": "1 raises the geir error instead of returning FAILED (default 0)"}


class _State:
    def __init__(self) -> None:
        self.initialized = False
        self.generation = 0           # GEFinalize counts up: a session of an older generation is closed
        self.options: dict[str, str] = {}
        self.errors: list[str] = []
        self.warnings: list[str] = []


_STATE = _State()


def _string_map(options: Mapping[str, str] | None, what: str) -> dict[str, str]:
    if options is None:
        return {}
    if not isinstance(options, Mapping):
        raise GraphError(f"{what}: options: expected a dict of strings, got {type(options).__name__}")
    for key, value in options.items():
        if not isinstance(key, str) or not isinstance(value, str):
            raise GraphError(f"{what}: option {key!r}: expected a string key and a string value (GE takes a map of "
                             f"strings), got {type(key).__name__} -> {type(value).__name__}")
    return dict(options)


def _fail(message: str) -> int:
    _STATE.errors.append(message)
    return FAILED


def GEInitialize(options: Mapping[str, str] | None = None) -> int:
    """Start geir's GE facade; validates and keeps the global options."""
    try:
        kept = _string_map(options, "GEInitialize")
        reports = read_ge_options(kept, "GEInitialize")
    except GraphError as exc:
        if isinstance(options, Mapping) and options.get("geir.raise_errors") == "1":
            raise
        return _fail(str(exc))
    _STATE.warnings += reports
    _STATE.initialized, _STATE.options = True, kept
    return SUCCESS


def GEFinalize() -> int:
    """End the facade: as in GE, every session made before is closed (its calls fail, even after a new
    GEInitialize); the error and warning channels stay readable."""
    if _STATE.initialized:
        _STATE.generation += 1
    _STATE.initialized = False
    _STATE.options = {}
    return SUCCESS


def GEGetErrorMsgV2() -> str:
    """The errors since the last call (then cleared), one per line; "" when none."""
    text, _STATE.errors = "\n".join(_STATE.errors), []
    return text


def GEGetWarningMsgV2() -> str:
    """The warnings (geir contract warnings, such as RP-W1) since the last call, then cleared."""
    text, _STATE.warnings = "\n".join(_STATE.warnings), []
    return text


class Session:
    """``ge::Session``: graphs added by id, run on tensors listed in Data ``index`` order."""

    def __init__(self, options: Mapping[str, str] | None = None) -> None:
        self.options = _string_map(options, "ge.Session")
        unknown = sorted(k for k in self.options if k.startswith("geir.") and k not in GEIR_OPTIONS)
        if unknown:
            known = "; ".join(f"{k}: {v}" for k, v in GEIR_OPTIONS.items())
            raise GraphError(f"ge.Session: option {unknown[0]!r}: expected one of geir's ({known})")
        try:
            _STATE.warnings += read_ge_options(self.options, "ge.Session")
        except GraphError as exc:
            _STATE.errors.append(str(exc))       # kept for GEGetErrorMsgV2 too: a constructor has no status
            raise
        runtime = self.options.get("geir.runtime", "numpy")
        if runtime not in runtime_names():
            raise GraphError(f"ge.Session: option 'geir.runtime': expected one of {', '.join(runtime_names())}, "
                             f"got {runtime!r}")
        target = self.options.get("geir.target")
        if target is not None and target not in TARGETS:
            raise GraphError(f"ge.Session: option 'geir.target': expected one of {', '.join(TARGETS)}, got {target!r}")
        raise_errors = self.options.get("geir.raise_errors", "0")
        if raise_errors not in ("0", "1"):
            raise GraphError(f"ge.Session: option 'geir.raise_errors': expected '0' or '1', got {raise_errors!r}")
        self.runtime, self.target, self.raise_errors = runtime, target, raise_errors == "1"
        self._graphs: dict[int, tuple[GeirGraph, Any]] = {}
        self._generation = _STATE.generation

    def _ensure_open(self, call: str, error: type[GraphError] | type[ExecutionError]) -> None:
        """Refuse every call after GEFinalize (AddGraph's message, as before), and on a session that a
        GEFinalize closed even after a new GEInitialize (GE drops its sessions then)."""
        closed = self._generation != _STATE.generation
        if closed:
            self._graphs.clear()                      # its graphs and executables are gone with it
        if not _STATE.initialized:
            raise error(f"Session.{call}: GEInitialize has not been called (or GEFinalize was)")
        if closed:
            raise error(f"Session.{call}: this session was closed by GEFinalize; create a new Session")

    def AddGraph(self, graph_id: int, graph: Graph, options: Mapping[str, str] | None = None) -> int:
        """Build ``graph`` (and check it against the session's target); FAILED with the message otherwise."""
        def add() -> None:
            _STATE.warnings.extend(read_ge_options(_string_map(options, "Session.AddGraph"), "Session.AddGraph"))
            self._ensure_open("AddGraph", GraphError)
            if not isinstance(graph, Graph):
                raise GraphError(f"Session.AddGraph: expected a ge.Graph, got {type(graph).__name__}")
            if graph_id in self._graphs:
                raise GraphError(f"Session.AddGraph: graph id {graph_id} is already added (RemoveGraph it first)")
            built = graph.to_geir()
            if self.target is not None:
                report = check(built, self.target)
                if not report.ok:
                    raise GraphError(f"Session.AddGraph: {report}".rstrip(), rule=sorted(report.rules())[0])
            self._graphs[graph_id] = (built, get_runtime(self.runtime).compile(built))

        return self._answer(add)

    def RunGraph(self, graph_id: int, inputs: list[Tensor], outputs: list[Tensor]) -> int:
        """Run graph ``graph_id`` on ``inputs`` (Data index order); ``outputs`` is filled in output order, and
        emptied when the run fails (no tensor of an earlier run is left there to be taken for this one's)."""
        def run() -> None:
            if not isinstance(outputs, list):
                raise ExecutionError(f"Session.RunGraph: outputs: expected a list to fill, got {type(outputs).__name__}")
            try:
                self._ensure_open("RunGraph", ExecutionError)
                if graph_id not in self._graphs:
                    raise ExecutionError(f"Session.RunGraph: graph id {graph_id} has not been added")
                graph, executable = self._graphs[graph_id]
                results = executable.run(_feeds(graph, inputs))
                filled = [Tensor(desc_of(TensorType(v.dtype, results[v.name].shape)), results[v.name])
                          for v in graph.outputs]
            except BaseException:
                outputs.clear()
                raise
            outputs[:] = filled

        return self._answer(run)

    def RemoveGraph(self, graph_id: int) -> int:
        def remove() -> None:
            self._ensure_open("RemoveGraph", GraphError)
            if self._graphs.pop(graph_id, None) is None:
                raise GraphError(f"Session.RemoveGraph: graph id {graph_id} has not been added")

        return self._answer(remove)

    def _answer(self, action: Callable[[], Any]) -> int:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always", GeirWarning)
            try:
                action()
            except (GraphError, ExecutionError) as exc:
                if self.raise_errors:
                    raise
                return _fail(str(exc))
            finally:
                _STATE.warnings += [str(w.message) for w in caught if issubclass(w.category, GeirWarning)]
        return SUCCESS


def _feeds(graph: GeirGraph, inputs: list[Tensor]) -> dict[str, Any]:
    """Tensors to feeds by Data order, each checked against its Data op's desc."""
    if not isinstance(inputs, (list, tuple)):
        raise ExecutionError(f"Session.RunGraph: inputs: expected a list of ge.Tensor, got {type(inputs).__name__}")
    if len(inputs) != len(graph.inputs):
        names = ", ".join(f"{i}: '{v.name}'" for i, v in enumerate(graph.inputs))
        raise ExecutionError(f"Session.RunGraph: inputs: expected {len(graph.inputs)} tensors (Data {names}), "
                             f"got {len(inputs)}")
    feeds = {}
    for i, (value, tensor) in enumerate(zip(graph.inputs, inputs)):
        subject = f"Session.RunGraph: input {i} (Data '{value.name}')"
        if not isinstance(tensor, Tensor) or tensor.GetData() is None:
            raise ExecutionError(f"{subject}: expected a ge.Tensor with data, got {tensor!r}")
        desc = tensor.GetTensorDesc()
        want_dims = [d if isinstance(d, int) else UNKNOWN_DIM for d in value.type.shape]
        if desc.GetDataType() != ge_data_type(value.dtype):
            raise ExecutionError(f"{subject}: data type: expected {value.dtype.value} (the Data desc), got "
                                 f"{desc.data_type_name()}", node=value.name)
        data = tensor.GetData()
        if len(data.shape) != len(want_dims) or any(w not in (UNKNOWN_DIM, a) for w, a in zip(want_dims, data.shape)):
            raise ExecutionError(f"{subject}: shape: expected {want_dims} (the Data desc), got {list(data.shape)}",
                                 node=value.name)
        feeds[value.name] = data
    return feeds


def aclgrphDumpGraph(graph: Graph, file: str, length: int | None = None) -> int:
    """Write the graph for inspection: ``<file>.onnx`` (our ops with their function bodies) and ``<file>.txt``
    (geir's text, a type on every value). ``length`` is GE's string length argument, checked if given."""
    def dump() -> None:
        if length is not None and length != len(file):
            raise GraphError(f"aclgrphDumpGraph: length: expected {len(file)} (the length of {file!r}), got {length}")
        built = graph.to_geir() if isinstance(graph, Graph) else graph
        path = Path(file)
        if path.parent and not path.parent.exists():
            path.parent.mkdir(parents=True)
        model, text = to_onnx(built).SerializeToString(), (str(built) + "\n").encode()
        with replacing(str(path) + ".onnx") as onnx_file, replacing(str(path) + ".txt") as text_file:
            onnx_file.write(model)             # both written in full before either replaces the old dump
            text_file.write(text)

    try:
        dump()
    except (GraphError, OSError) as exc:
        return _fail(f"aclgrphDumpGraph: {exc}")
    return SUCCESS
