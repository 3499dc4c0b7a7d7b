"""Import an ONNX model as a geir Graph: our ``ai.cann`` nodes map back to their schemas, standard
ONNX nodes stay standard nodes, our generated FunctionProtos are dropped and other local
functions are inlined. Every node goes through the builder, so a bad file fails like a bad
graph: a GraphError naming the node.

A file is untrusted input: it is read only if it is a regular file of at most ``MAX_MODEL_BYTES``,
must pass ``onnx.checker``, may import only opsets onnx knows (each standard node keeps the model's
opset: nothing is converted), and may expand to at most ``MAX_IMPORTED_NODES`` nodes once its functions are inlined. Whatever goes wrong
is a GraphError, with the original exception chained.
"""

from __future__ import annotations

import os

import networkx as nx
import numpy as np
import onnx
from google.protobuf.message import DecodeError
from onnx import ModelProto, checker, inliner, numpy_helper, shape_inference
from onnx.reference import ReferenceEvaluator

from ..ir._registry import all_schemas, get_schema
from .builder import GraphBuilder
from .external_data import inline_external_data
from .onnx_symbolic_shapes import symbolic_value_infos, tied_to_inputs, worth_inferring
from ..ir._core import CANN_DOMAIN, Graph, Value
from ..ir._onnx_body import OPSET
from ..ir._errors import GraphError, first_line
from ..ir._files import FileRefused, read_regular_file
from ..ir._onnx_schemas import register_onnx_schemas
from ..ir._onnx_types import attribute_from_onnx, tensor_type_from_onnx
from ..ir._types import TensorType, refine
from ..ir._subgraphs import captured_names, subgraphs_of

__all__ = ["MAX_IMPORTED_NODES", "MAX_MODEL_BYTES", "from_onnx", "load_onnx", "parse_model", "read_model_bytes",
           "read_onnx"]

MAX_MODEL_BYTES = 2**31 - 1
"""Largest file ``load_onnx`` reads (protobuf's own limit for one message)."""
MAX_IMPORTED_NODES = 100_000
"""Most nodes a model may have once its local functions are inlined (a small file can expand hugely)."""


def load_onnx(path: str | os.PathLike, *, symbolic_shapes: bool = False) -> Graph:
    """Read an ONNX file (and its external data files beside it) and import it (``from_onnx``); GraphError for
    anything wrong with the file."""
    return from_onnx(read_onnx(path), symbolic_shapes=symbolic_shapes)


def read_onnx(path: str | os.PathLike) -> ModelProto:
    """The ModelProto of an ONNX file, its external data files read in; GraphError for a file that is none."""
    model = _read_model(path)
    inline_external_data(model, path)
    return model


def from_onnx(model: ModelProto | str | os.PathLike | bytes, *, symbolic_shapes: bool = False) -> Graph:
    """A built (verified, typed) geir Graph from an ONNX model (a ModelProto, its bytes, or a path).

    ``symbolic_shapes``: also tie sizes the graph computes (a rope table sliced to ``Shape(x)[1]``) to the inputs'
    symbols with ONNX Runtime's symbolic shape inference (``tools/onnx_symbolic_shapes``), as TorchScript's dynamic
    exports need for their ropes and MoE combines to fuse. Off by default: the tool has been seen to give a wrong
    size (ONNX's RotaryEmbedding function), which the runtimes then refuse as a broken claim when the graph runs,
    where the model itself is right."""
    if isinstance(model, (str, os.PathLike)):
        return load_onnx(model, symbolic_shapes=symbolic_shapes)
    if isinstance(model, (bytes, bytearray)):
        model = parse_model(bytes(model), "the given bytes")
    if not isinstance(model, ModelProto):
        raise GraphError(f"from_onnx: expected an onnx.ModelProto, its bytes or a path, got {type(model).__name__}")
    try:
        return _import(model, symbolic_shapes)
    except GraphError:
        raise
    except Exception as exc:   # onnx and protobuf raise many types for malformed models; all mean the same
        raise GraphError(f"cannot import ONNX model '{model.graph.name}': {type(exc).__name__}: {exc}") from exc


def read_model_bytes(path: str | os.PathLike[str]) -> bytes:
    """The bytes of an ONNX file, read only if it is a regular file of at most ``MAX_MODEL_BYTES``."""
    if not isinstance(path, (str, os.PathLike)):
        raise GraphError(f"load_onnx: expected a path, got {type(path).__name__}")
    try:
        return read_regular_file(path, MAX_MODEL_BYTES)
    except FileNotFoundError as exc:
        raise GraphError(f"cannot read ONNX file {os.fspath(path)!r}: {exc.strerror}") from exc
    except FileRefused as exc:
        raise GraphError(f"cannot read ONNX file {os.fspath(path)!r}: it {exc}") from exc


def _read_model(path: str | os.PathLike) -> ModelProto:
    return parse_model(read_model_bytes(path), repr(os.fspath(path)))


def parse_model(data: bytes, what: str) -> ModelProto:
    """The ModelProto in ``data``; GraphError naming ``what`` (the file, say) when protobuf cannot decode it."""
    model = ModelProto()
    try:
        model.ParseFromString(data)
    except (DecodeError, ValueError, RuntimeError) as exc:
        raise GraphError(f"{what} is not an ONNX model (protobuf could not decode it: {exc})") from exc
    return model


def _check_model(model: ModelProto) -> None:
    """The opsets a model imports and where its tensors live."""
    imports: dict[str, int] = {}
    for opset in model.opset_import:
        domain = "" if opset.domain == "ai.onnx" else opset.domain
        if domain in imports:
            raise GraphError(f"ONNX model imports domain '{opset.domain}' twice")
        imports[domain] = opset.version
    newest = onnx.defs.onnx_opset_version()
    if "" in imports and not 1 <= imports[""] <= newest:
        raise GraphError(f"ONNX model imports standard opset {imports['']}; onnx {onnx.__version__} knows opsets "
                         f"1 to {newest}")
    if CANN_DOMAIN in imports and imports[CANN_DOMAIN] != 1:
        raise GraphError(f"ONNX model imports {CANN_DOMAIN} version {imports[CANN_DOMAIN]}; geir defines version 1")
    for tensor in model.graph.initializer:
        if tensor.data_location == onnx.TensorProto.EXTERNAL:
            raise GraphError(f"initializer '{tensor.name}' is stored outside the model; load the model with "
                             f"geir.load_onnx(path), which reads external data files beside it")


def _run_checker(model: ModelProto) -> None:
    """onnx's checker: what geir's own import tolerates (duplicate names or attributes, extra outputs,
    untyped attributes, negative initializer dims) it refuses."""
    try:
        checker.check_model(model)
    except checker.ValidationError as exc:
        raise GraphError(f"ONNX model '{model.graph.name}' is malformed: {first_line(exc)}") from exc


def _count_expanded(model: ModelProto, keep: set[tuple[str, str]]) -> int:
    """Nodes once every local function not in ``keep`` is inlined, counting the nodes of every subgraph (If, Loop
    and Scan bodies, at any depth, also inside functions) with the graph holding them; GraphError as soon as the
    count passes the budget (before anything is expanded) or on a function calling itself."""
    functions = {(f.domain, f.name): f for f in model.functions}
    sizes: dict[tuple[str, str], int] = {}

    def over() -> GraphError:
        return GraphError(f"ONNX model '{model.graph.name}' expands to more than {MAX_IMPORTED_NODES} nodes once its "
                          f"local functions are inlined, counting every subgraph (geir's import budget, "
                          f"MAX_IMPORTED_NODES)")

    def size(nodes, calling: tuple) -> int:
        total = 0
        for node in nodes:
            key = (node.domain, node.op_type)
            if key in functions and key not in keep:
                if key in calling:
                    raise GraphError(f"local function {key[0]}::{key[1]} calls itself; it cannot be inlined")
                if key not in sizes:
                    sizes[key] = size(functions[key].node, calling + (key,))
                total += sizes[key]
            else:
                total += 1
            for attribute in node.attribute:       # subgraphs: one per g, any number per graphs
                for subgraph in subgraphs_of(attribute):
                    total += size(subgraph.node, calling)
                    if total > MAX_IMPORTED_NODES:
                        raise over()
            if total > MAX_IMPORTED_NODES:
                raise over()
        return total

    return size(model.graph.node, ())


def _import(model: ModelProto, symbolic_shapes: bool = False) -> Graph:
    register_onnx_schemas()
    _check_model(model)
    ours = {(CANN_DOMAIN, s.op_type) for s in all_schemas()}
    _count_expanded(model, ours)
    try:
        _run_checker(model)    # before onnx's C++ inliner and converter see the model
    except GraphError as malformed:
        try:                   # geir's own message names the node and the rule: give it too where it has one
            _build(model)
        except GraphError as precise:
            if precise.rule or precise.node:
                raise GraphError(f"{precise.message}; {malformed}", rule=precise.rule, node=precise.node,
                                 location=precise.location) from malformed
        except Exception:
            pass
        raise
    foreign = [(f.domain, f.name) for f in model.functions if (f.domain, f.name) not in ours]
    if foreign:
        model = inliner.inline_selected_functions(model, foreign, exclude=False)
    claimed = _declared_types(model.graph.value_info, model.graph.output)
    graph = _build(model, claimed)
    if all(v.type.is_static for v in graph.values()):
        return graph
    # gaps: what ONNX's shape inference with data propagation over the whole file knows. It runs only on a model
    # geir has built (validated node by node): on some malformed nodes onnx's inference aborts the process
    try:
        inferred = shape_inference.infer_shapes(model, data_prop=True).graph
    except Exception:   # it stops where geir's node-by-node inference went on: nothing more to learn
        return graph
    more = _declared_types(inferred.value_info, inferred.output)
    # then what ONNX Runtime's symbolic inference derives through shape computations: the sequence length a table
    # is sliced to is 's', where ONNX names it anew (tools/onnx_symbolic_shapes); it wins over ONNX's fresh names
    if symbolic_shapes and worth_inferring(graph):
        more = tied_to_inputs(graph, more, _declared_types(symbolic_value_infos(model)))
    if all(refine(v.type, more.get(v.name)) == v.type for v in graph.values() if not v.type.is_static):
        return graph     # nothing to learn: building again would give the same graph
    return _build(model, more | claimed)


def _build(model: ModelProto, declared: dict[str, TensorType] | None = None) -> Graph:
    graph = model.graph
    opsets = {("" if o.domain == "ai.onnx" else o.domain): o.version for o in model.opset_import}
    b = GraphBuilder(graph.name or "imported")
    values: dict[str, Value] = {}
    # IR >= 4: an initializer named like a graph input is that input's default, which a feed overrides
    overridable = {vi.name for vi in graph.input} if model.ir_version >= 4 else set()
    defaults: dict[str, np.ndarray] = {}
    for init in graph.initializer:
        if init.name in overridable:
            defaults[init.name] = numpy_helper.to_array(init)
        else:
            values[init.name] = b.constant(init.name, numpy_helper.to_array(init))
    for vi in graph.input:
        if vi.name not in values:
            t = tensor_type_from_onnx(vi.type, f"graph input '{vi.name}'", unknown_dim=_symbol_stem(vi.name))
            values[vi.name] = b.input(vi.name, t.dtype, t.dims, default=defaults.get(vi.name), kind=t.kind)
    for node in _dependency_order(graph, set(values)):
        _import_node(b, node, values, opsets, declared or {})
    for vi in graph.output:
        if vi.name not in values:
            raise GraphError(f"graph output '{vi.name}' is produced by no node and is no input")
        b.output(values[vi.name])
    return b.build()


def _symbol_stem(name: str) -> str:
    """A symbol stem for the unnamed dims of input ``name`` (each such dim is a size of its own)."""
    stem = "".join(ch if ch.isalnum() else "_" for ch in name) or "input"
    return stem if stem[0].isalpha() else f"in_{stem}"


def _dependency_order(graph, available: set[str]) -> list:
    """Nodes in dependency order (networkx); GraphError on a cycle or an undefined input."""
    producer = {out: i for i, node in enumerate(graph.node) for out in node.output if out}
    dag = nx.DiGraph()
    dag.add_nodes_from(range(len(graph.node)))
    for i, node in enumerate(graph.node):   # a subgraph's reads of this graph's values order the node too
        reads = list(node.input) + list(captured_names({a.name: a for a in node.attribute}))
        for name in reads:
            if not name or name in available:
                continue
            if name not in producer:
                raise GraphError(f"{node.op_type} '{node.name}': input '{name}' is no graph input, initializer or "
                                 f"node output", node=node.name)
            dag.add_edge(producer[name], i)
    try:
        cycle = nx.find_cycle(dag)
    except nx.NetworkXNoCycle:
        return [graph.node[i] for i in nx.lexicographical_topological_sort(dag)]
    names = " -> ".join(f"'{graph.node[u].name or graph.node[u].op_type}'" for u, _ in cycle)
    first = graph.node[cycle[0][0]].name
    raise GraphError(f"graph '{graph.name}' has a cycle: {names} -> '{first}'", node=first)


def _declared_types(*infos) -> dict[str, TensorType]:
    """The shaped tensor types ``infos`` (ValueInfoProtos: a file's value_info and outputs, or what ONNX's shape
    inference with data propagation derives for the whole file, such as the static sizes of computed Reshape
    targets) give, by value name: what fills the gaps of geir's node-by-node inference (``ir._types.refine``). A
    value typed otherwise than as a tensor, or of an element type geir does not know, declares nothing."""
    declared: dict[str, TensorType] = {}
    for info in (i for group in infos for i in group):
        try:
            found = tensor_type_from_onnx(info.type, info.name, unknown_dim=_symbol_stem(info.name))
        except GraphError:
            continue
        if found.dims is not None and info.name not in declared:
            declared[info.name] = found
    return declared


def _import_node(b: GraphBuilder, node, values: dict[str, Value], opsets: dict[str, int],
                 declared: dict[str, TensorType]) -> None:
    """Add one node; any other node than ours follows its domain's opset in the model (``Node.version``), its
    outputs' types fill their gaps from what is declared for them (and an op of a domain neither geir nor ONNX
    declares has only those: ``ir._foreign``)."""
    domain = "" if node.domain == "ai.onnx" else node.domain
    name = node.name or None
    if domain == "" and node.op_type == "Constant":
        _import_constant(b, node, values, opsets.get("", OPSET))
        return
    if domain == CANN_DOMAIN:
        schema = get_schema(node.op_type, domain, node.name)
        kinds = {a.name: a.kind.value for a in schema.attributes}
        attrs = {a.name: attribute_from_onnx(a, kinds.get(a.name)) for a in node.attribute}
    else:
        version = opsets.get(domain)
        if version is None:
            where = f"its domain '{domain}'" if domain else "the standard domain"
            raise GraphError(f"{node.op_type} '{node.name}': the model imports no opset of {where}", node=node.name)
        schema = get_schema(node.op_type, domain, node.name, outputs=len(node.output), version=version)
        if not schema.variadic:   # absent ("") trailing optional outputs are left out, as ONNX's inference wants
            schema = get_schema(node.op_type, domain, node.name, outputs=max(
                (i + 1 for i, n in enumerate(node.output) if n), default=0), version=version)
        attrs = {a.name: attribute_from_onnx(a, None) for a in node.attribute}
    inputs = [values[n] if n else None for n in node.input]
    inputs += [values[n] for n in captured_names(attrs)]    # what its subgraphs read of enclosing scopes
    claims = [declared.get(n) if n else None for n in node.output]
    results = b.add_node(schema, inputs, attrs, name, output_names=list(node.output),
                         declared=claims if any(claims) else None)
    for value in results if isinstance(results, tuple) else (results,):
        if value is not None:
            values[value.name] = value



MAX_SPARSE_CONSTANT_ELEMENTS = 1 << 26
"""Largest dense size of a ``sparse_value`` Constant (its dims come from the file, its data does not)."""


def _import_constant(b: GraphBuilder, node, values: dict[str, Value], opset: int) -> None:
    """A standard ``Constant`` node (any of its value attributes) as a graph constant."""
    what = f"Constant '{node.name or node.output[0]}'"
    if len(node.output) != 1 or not node.output[0] or len(node.input) or len(node.attribute) != 1:
        raise GraphError(f"{what}: expected no input, one output and one value attribute, got {len(node.input)}, "
                         f"{len(node.output)} and {len(node.attribute)}", node=node.name)
    attribute = node.attribute[0]
    if attribute.name == "sparse_value":
        array = _dense_from_sparse(attribute.sparse_tensor, what)
    else:
        single = onnx.helper.make_node("Constant", [], ["value"], name=node.name)
        single.attribute.extend(node.attribute)
        graph = onnx.helper.make_graph([single], "constant", [], [onnx.helper.make_value_info("value", onnx.TypeProto())])
        probe = onnx.helper.make_model(graph, opset_imports=[onnx.helper.make_opsetid("", opset)])
        (array,) = ReferenceEvaluator(probe).run(None, {})
        array = np.asarray(array)
    if array.dtype.kind in "US":    # onnx.reference gives str_ arrays; a string tensor is an object array
        array = array.astype(object)
    values[node.output[0]] = b.constant(node.output[0], array)


def _dense_from_sparse(sparse: onnx.SparseTensorProto, what: str) -> np.ndarray:
    dims = tuple(int(d) for d in sparse.dims)
    if any(d < 0 for d in dims) or int(np.prod(dims, dtype=object)) > MAX_SPARSE_CONSTANT_ELEMENTS:
        raise GraphError(f"{what}: sparse_value dims {list(dims)}: expected at most {MAX_SPARSE_CONSTANT_ELEMENTS} "
                         f"non-negative elements")
    entries = numpy_helper.to_array(sparse.values)
    indices = numpy_helper.to_array(sparse.indices).astype(np.int64)
    dense = np.zeros(dims, entries.dtype)
    flat = indices if indices.ndim == 1 else np.ravel_multi_index(tuple(indices.T), dims)
    if flat.shape != entries.shape or (flat.size and (flat.min() < 0 or flat.max() >= dense.size)):
        raise GraphError(f"{what}: sparse_value indices do not address its {list(dims)} elements")
    dense.reshape(-1)[flat] = entries
    return dense
