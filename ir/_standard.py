"""Standard ONNX ops (domain "", and ONNX's other domains: ``ai.onnx.ml``, ``ai.onnx.preview.training``, ...),
declared by ``onnx.defs`` rather than by us.

An imported model may mix standard ops with ours; they are first-class nodes: the adapter
below gives them the interface of an OpSchema, with arity from the onnx schema, attribute
checks by ``onnx.checker.check_node`` and types by onnx's own shape inference.
"""

from __future__ import annotations

import re
from typing import Any

import numpy as np

import onnx
from onnx import checker, defs, helper, numpy_helper, shape_inference

from ._dtypes import DType
from ._errors import GraphError, SourceLocation, first_line, format_rule_message
from ._onnx_types import tensor_type_from_onnx, type_proto
from ._pool_shapes import ceil_mode_pool_shapes as _ceil_mode_pool_shapes
from ._pool_shapes import export_attributes
from ._subgraphs import captured_names, rename_captures
from ._types import TensorType

from ._onnx_body import OPSET
from ._schema import InferContext, InputSpec, OutputSpec

__all__ = ["ONNX_DOMAINS", "OpAdapter", "StandardOpSchema", "export_attributes", "newest_opset", "standard_schema",
           "variadic_output_count"]

_ALL = tuple(DType)
_CACHE: dict[tuple[str, int | None, int, str], StandardOpSchema] = {}
ONNX_DOMAINS: dict[str, int] = {("" if d == "ai.onnx" else d): newest for d, (_, newest) in
                                defs.C.schema_version_map().items()}
"""The domains ``onnx.defs`` declares ops of, with the newest opset of each it knows ("" is the default domain)."""


def newest_opset(domain: str) -> int:
    return ONNX_DOMAINS[domain]


def _newer_version_hint(op_type: str, domain: str, version: int, message: str) -> str:
    """Where ONNX refuses a type this version of the op lacks (``unsupported type tensor(bfloat16)``, as torch's
    exporter writes a bfloat16 ConstantOfShape at opset 18): the first later opset whose version takes it, said."""
    found = re.search(r"unsupported type (tensor\(\w+\))", message)
    if found is None:
        return ""
    wanted = found.group(1)
    later = sorted((s.since_version for s in defs.get_all_schemas_with_history()
                    if s.name == op_type and s.domain == domain and s.since_version > version and
                    any(wanted in c.allowed_type_strs for c in s.type_constraints)))
    if not later:
        return ""
    return (f"; {op_type} takes {wanted} from opset {later[0]}, this node's opset is {version}: the file is not valid "
            f"ONNX at its opset (export the model at opset {later[0]} or later)")


def _opsets(domain: str, version: int) -> dict[str, int]:
    """The opset imports a one-node model of ``domain`` at ``version`` needs (a default domain too)."""
    return {"": version} if domain == "" else {domain: version, "": OPSET}


class OpAdapter:
    """What every adapter of an op declared outside geir's schemas shares (standard ops here, ``ir._foreign``'s)."""

    op_type: str
    outputs: tuple[OutputSpec, ...]

    def output_index(self, key: int | str) -> int:
        return key if isinstance(key, int) else [s.name for s in self.outputs].index(key)

    def raise_error(self, rule: str, node: str, subject: str, expected: object, got: object,
                    location: SourceLocation | None) -> None:
        raise GraphError(format_rule_message(rule, self.op_type, node, subject, expected, got), rule=rule, node=node,
                         location=location)


class StandardOpSchema(OpAdapter):
    """An ONNX standard op seen through the OpSchema interface the builder, passes and runtime use."""

    validate = None
    validated_inputs: tuple[str, ...] = ()
    exact_across_runtimes = False   # ONNX Runtime and onnx.reference may round or sum in other orders
    attributes: tuple = ()

    def __init__(self, op_type: str, outputs: int | None = None, opset: int = OPSET, domain: str = "") -> None:
        newest = ONNX_DOMAINS[domain]
        which = f"opset of {domain}" if domain else "standard opset"
        if not 1 <= opset <= newest:
            raise GraphError(f"[SCH-1] {op_type}: opset: expected a {which} onnx {onnx.__version__} knows (1 to "
                             f"{newest}), got {opset}", rule="SCH-1")
        try:
            self.onnx = defs.get_schema(op_type, opset, domain)
        except defs.SchemaError:
            raise GraphError(f"[SCH-1] {op_type}: op type: expected {'an op of ' + domain if domain else 'a standard ONNX op'}"
                             f" of opset {opset}, got unknown op '{op_type}'", rule="SCH-1") from None
        self.domain = domain
        self.version = opset
        """The standard opset whose definition of the op this adapter follows (ONNX resolves a node's op version
        from its model's opset import; geir keeps it per node, ``Node.version``)."""
        self.op_type = op_type
        self.doc = self.onnx.doc or ""
        option = defs.OpSchema.FormalParameterOption
        self.inputs = tuple(InputSpec(p.name, _ALL, optional=p.option != option.Single) for p in self.onnx.inputs)
        formal = list(self.onnx.outputs)
        self._variadic = bool(formal) and formal[-1].option == option.Variadic
        specs = [OutputSpec(p.name, optional=p.option != option.Single) for p in formal]
        if self._variadic:
            count = max(outputs or 0, len(formal) - 1 + max(1, self.onnx.min_output - len(formal) + 1))
            specs = specs[:-1] + [OutputSpec(f"{formal[-1].name}_{i}") for i in range(count - len(formal) + 1)]
        elif outputs is not None and max(1, self.onnx.min_output) <= outputs < len(specs):
            specs = specs[:outputs]   # the node leaves its optional trailing outputs out (inference BatchNormalization)
        self.outputs = tuple(specs)
        self.max_inputs = self.onnx.max_input
        self.holds_subgraphs = any(a.type in (defs.OpSchema.AttrType.GRAPH, defs.OpSchema.AttrType.GRAPHS)
                                   for a in self.onnx.attributes.values())
        """If, Loop, Scan, ...: the node's inputs are the op's, then its captures (``ir._subgraphs``)."""
        if self.holds_subgraphs:
            self.max_inputs = 2**31 - 1

    @property
    def input_names(self) -> tuple[str, ...]:
        return tuple(s.name for s in self.inputs)

    @property
    def optional_outputs(self) -> range:
        """The output counts a node of this op may have: a fixed-arity op with optional trailing outputs
        (BatchNormalization, Dropout, LayerNormalization, MaxPool) gets one adapter per count, so that ONNX's
        inference sees exactly the node's outputs (BatchNormalization refuses its training outputs otherwise)."""
        if self._variadic:
            return range(len(self.outputs), len(self.outputs) + 1)
        return range(max(1, self.onnx.min_output), len(self.onnx.outputs) + 1)

    @property
    def variadic(self) -> bool:
        """The last output repeats (Split): each node has its own count, ``standard_schema(op, outputs=n)``."""
        return self._variadic

    def input_index(self, key: int | str) -> int:
        return key if isinstance(key, int) else self.input_names.index(key)

    def bind_attributes(self, given: dict[str, Any], node: str, location: SourceLocation | None = None) -> dict:
        """Attributes are kept as given; their Python kinds are checked here and ``onnx.checker.check_node``
        validates them against the schema (SCH-3)."""
        for name, value in given.items():
            problem = _attribute_problem(value)
            if problem:
                raise GraphError(f"[SCH-3] {self.op_type} '{node}': attribute '{name}': expected an int, float, str, "
                                 f"tensor or a list of one of those, got {problem}", rule="SCH-3", node=node,
                                 location=location)
        try:
            proto = helper.make_node(self.op_type, [f"in{i}" for i in range(self.onnx.min_input)],
                                     [f"out{i}" for i in range(max(1, self.onnx.min_output))], domain=self.domain,
                                     **given)
        except (TypeError, ValueError) as exc:
            raise GraphError(f"[SCH-3] {self.op_type} '{node}': attributes: {exc}", rule="SCH-3", node=node,
                             location=location) from None
        context = checker.C.CheckerContext()
        context.ir_version = onnx.IR_VERSION
        context.opset_imports = _opsets(self.domain, self.version)
        try:
            captured = captured_names(given)
            if captured:   # a subgraph may read values of the enclosing graph: check the node in a graph declaring them
                declared = [helper.make_tensor_value_info(n, onnx.TensorProto.FLOAT, [])
                            for n in list(proto.input) + [c for c in captured if c not in proto.input]]
                checker.check_graph(helper.make_graph([proto], "scope", declared, []), context)
            else:
                checker.check_node(proto, context)
        except checker.ValidationError as exc:
            raise GraphError(f"[SCH-3] {self.op_type} '{node}': attributes: {first_line(exc)}", rule="SCH-3", node=node,
                             location=location) from None
        return dict(given)

    def check_signature(self, input_types, node: str, location: SourceLocation | None = None) -> None:
        count = len(input_types)
        if self.holds_subgraphs:   # captures follow the op's inputs; infer_types checks the count
            return
        while count and input_types[count - 1] is None:
            count -= 1
        if not self.onnx.min_input <= count <= self.onnx.max_input:
            self.raise_error("SCH-2", node, "inputs", f"{self.onnx.min_input} to {self.onnx.max_input}", count,
                             location)

    def _check_output_count(self, ctx: InferContext) -> None:
        """Split's output count must match what it splits into; onnx's inference asserts (aborts the
        process) instead of raising when it does not."""
        count = len(self.outputs)
        wanted = _split_parts(self.op_type, ctx.attributes, ctx.input_values[1] if len(ctx.input_values) > 1 else None)
        if wanted is not None and wanted != count:
            raise GraphError(f"[SCH-2] Split '{ctx.node}': outputs: expected {wanted} (num_outputs or the length of "
                             f"'split'), got {count}", rule="SCH-2", node=ctx.node, location=ctx.location)

    def infer_types(self, ctx: InferContext) -> tuple[TensorType | None, ...]:
        if self.holds_subgraphs:
            return self._infer_with_subgraphs(ctx)
        names = [f"in{i}" if t is not None else "" for i, t in enumerate(ctx.inputs)]
        proto = helper.make_node(self.op_type, names, [f"out{i}" for i in range(len(self.outputs))], domain=self.domain,
                                 **ctx.attributes)
        types = {n: type_proto(t) for n, t in zip(names, ctx.inputs) if t is not None}
        data = {n: numpy_helper.from_array(v) for n, v in zip(names, ctx.input_values) if v is not None}
        self._check_output_count(ctx)
        try:
            inferred = shape_inference.infer_node_outputs(self.onnx, proto, types, input_data=data, opset_imports=[
                helper.make_opsetid(d, v) for d, v in _opsets(self.domain, self.version).items()])
        except Exception as exc:  # onnx raises several types; all mean the same for the user
            raise GraphError(f"{self.op_type} '{ctx.node}': ONNX shape inference failed: {exc}"
                             f"{_newer_version_hint(self.op_type, self.domain, self.version, str(exc))}",
                             node=ctx.node, location=ctx.location) from None
        return self._output_types(ctx, inferred)

    def _infer_with_subgraphs(self, ctx: InferContext) -> tuple[TensorType | None, ...]:
        """Types of a node holding subgraphs: ONNX's shape inference over a one-node model whose inputs are the op's
        inputs and the node's captures (the values its subgraphs read of enclosing scopes, ``ir._subgraphs``)."""
        captured = captured_names(ctx.attributes)
        formal = len(ctx.inputs) - len(captured)
        count = formal
        while count and ctx.inputs[count - 1] is None:
            count -= 1
        if formal < 0 or not self.onnx.min_input <= count <= self.onnx.max_input:
            self.raise_error("SCH-2", ctx.node, "inputs", f"{self.onnx.min_input} to {self.onnx.max_input}, then one "
                             f"per value its subgraphs read of enclosing scopes ({len(captured)})", len(ctx.inputs),
                             ctx.location)
        names = [f"geir_in{i}" if t is not None else "" for i, t in enumerate(ctx.inputs[:formal])]
        names += [f"geir_capture{k}" for k in range(len(captured))]
        attributes = rename_captures(ctx.attributes, dict(zip(captured, names[formal:])))
        outputs = [f"geir_out{i}" for i in range(len(self.outputs))]
        proto = helper.make_node(self.op_type, names[:count], outputs, **attributes)   # no trailing absent input:
        # SequenceMap's inference takes a trailing "" for a present variadic input without a type
        declared = [helper.make_value_info(n, type_proto(t)) for n, t in zip(names, ctx.inputs) if t is not None]
        known = [numpy_helper.from_array(np.asarray(v), n) for n, v in zip(names, ctx.input_values) if v is not None]
        model = helper.make_model(helper.make_graph([proto], "node", declared, [helper.make_value_info(o, onnx.TypeProto())
                                                                                 for o in outputs], initializer=known),
                                  opset_imports=[helper.make_opsetid("", self.version)])
        try:
            model = shape_inference.infer_shapes(model, strict_mode=True, data_prop=True)
        except Exception as exc:  # onnx raises several types; all mean the same for the user
            raise GraphError(f"{self.op_type} '{ctx.node}': ONNX shape inference failed: {exc}", node=ctx.node,
                             location=ctx.location) from None
        inferred = {v.name: v.type for v in model.graph.output if v.type.WhichOneof("value") is not None}
        if self.op_type == "Loop":
            _loop_state_shapes(attributes["body"], ctx.inputs[2:formal], declared[-len(captured):] if captured else [],
                               known, [inferred.get(o) for o in outputs], self.version)
        return self._output_types(ctx, {f"out{i}": inferred.get(o) for i, o in enumerate(outputs)})

    def _output_types(self, ctx: InferContext, inferred: dict) -> tuple[TensorType | None, ...]:
        out: list[TensorType | None] = []
        for i, spec in enumerate(self.outputs):
            tp = inferred.get(f"out{i}")
            if tp is None:
                declared = ctx.declared[i] if ctx.declared is not None and i < len(ctx.declared) else None
                if declared is not None:     # ONNX cannot infer it (FlexAttention's); the file states it
                    out.append(declared)
                    continue
                raise GraphError(f"{self.op_type} '{ctx.node}': output {i} '{spec.name}': ONNX shape inference gave "
                                 f"no type, and the model declares none", node=ctx.node, location=ctx.location)
            symbol = "".join(ch if ch.isalnum() else "_" for ch in f"{ctx.node}_{spec.name}")
            out.append(tensor_type_from_onnx(tp, f"{self.op_type} '{ctx.node}' output {i} '{spec.name}'", symbol))
        return _ceil_mode_pool_shapes(self.op_type, ctx, tuple(out))


def _loop_state_shapes(body: onnx.GraphProto, states: list, captures: list, known: list, outputs: list,
                       opset: int) -> None:
    """Give a Loop's outputs the shapes ONNX's inference leaves out because a loop-carried value may change shape
    across iterations. The body is inferred with each state of its initial rank and a fresh symbol per dim: a dim
    the body passes through unchanged keeps its initial size in every iteration; a state's dim the body sets to a
    size equal to the initial one is that size too; every other dim is unknown. Scan outputs get the iterations as
    their first dim. Nothing is given when a state changes rank. ``outputs`` (TypeProtos) are completed in place."""
    if any(t is None or not t.has_rank for t in states) or len(body.input) != 2 + len(states) or \
            len(body.output) < 1 + len(states):
        return
    graph = onnx.GraphProto()
    graph.CopyFrom(body)
    types = [helper.make_tensor_type_proto(onnx.TensorProto.INT64, []),
             helper.make_tensor_type_proto(onnx.TensorProto.BOOL, [])]
    types += [helper.make_tensor_type_proto(t.dtype.onnx, [f"geir_state{k}_{i}" for i in range(len(t.shape))])
              for k, t in enumerate(states)]
    for value, tp in zip(graph.input, types):
        value.type.CopyFrom(tp)
    for value in graph.output:
        value.type.CopyFrom(onnx.TypeProto())
    graph.input.extend(captures)
    graph.initializer.extend(t for t in known if t.name in {c.name for c in captures})
    try:
        model = shape_inference.infer_shapes(helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)]),
                                             strict_mode=True, data_prop=True)
    except Exception:   # the Loop's own inference passed: leave the outputs as ONNX gave them
        return
    results = [v.type for v in model.graph.output[1:]]
    if any(not r.tensor_type.HasField("shape") for r in results):
        return
    invariant: dict[str, Any] = {}
    for k, t in enumerate(states):
        dims = results[k].tensor_type.shape.dim
        if len(dims) != len(t.shape):
            return
        for i, dim in enumerate(dims):
            if dim.dim_param == f"geir_state{k}_{i}":
                invariant[dim.dim_param] = t.shape[i]

    def size(dim, initial=None):
        if dim.HasField("dim_value"):
            return dim.dim_value if initial is None or initial == dim.dim_value else None
        return invariant.get(dim.dim_param)

    for k, result in enumerate(results):
        out = outputs[k] if k < len(outputs) else None
        if out is None or out.tensor_type.HasField("shape"):
            continue
        if k < len(states):
            dims = [size(d, states[k].shape[i]) for i, d in enumerate(result.tensor_type.shape.dim)]
        else:
            dims = [None] + [size(d) for d in result.tensor_type.shape.dim]
        out.tensor_type.shape.CopyFrom(helper.make_tensor_type_proto(out.tensor_type.elem_type, dims).tensor_type.shape)


def standard_schema(op_type: str, outputs: int | None = None, opset: int = OPSET, domain: str = ""
                    ) -> StandardOpSchema:
    """The adapter of an op of ONNX's ``domain`` as its opset ``opset`` defines it; for an op with variadic outputs,
    the one with ``outputs`` outputs; for an op with optional trailing outputs, the one with its first ``outputs``
    (all of them when None or out of range)."""
    generic = _CACHE.get((op_type, None, opset, domain))
    if generic is None:
        generic = _CACHE[(op_type, None, opset, domain)] = StandardOpSchema(op_type, opset=opset, domain=domain)
    if outputs is None or outputs == len(generic.outputs):
        return generic
    if not generic.variadic and outputs not in generic.optional_outputs:
        return generic
    key = (op_type, outputs, opset, domain)
    if key not in _CACHE:
        _CACHE[key] = StandardOpSchema(op_type, outputs, opset, domain)
    return _CACHE[key]


def _split_parts(op_type: str, attributes: dict, split: np.ndarray | None) -> int | None:
    """How many parts a Split says it makes (``num_outputs``, else the length of a known ``split``)."""
    if op_type != "Split":
        return None
    if "num_outputs" in attributes:
        return int(attributes["num_outputs"])
    return None if split is None else int(np.asarray(split).size)


def variadic_output_count(schema: StandardOpSchema, inputs: list, attributes: dict, constants: dict) -> int:
    """How many outputs a node of a variadic-output op has: Split's ``num_outputs`` or the length of its
    constant ``split`` input; GraphError when the builder cannot know (pass ``outputs=N``)."""
    split = inputs[1] if len(inputs) > 1 else None
    parts = _split_parts(schema.op_type, attributes, None if split is None else constants.get(split.name))
    if parts is not None:
        return parts
    raise GraphError(f"{schema.op_type}: its number of outputs varies per node; pass outputs=N to GraphBuilder.op "
                     f"(Split: or give num_outputs, or a constant 'split' input)")


def _attribute_problem(value: Any) -> str | None:
    """Why ``value`` cannot be an ONNX attribute value, or None when it can."""
    scalars = (int, float, str, bytes, np.integer, np.floating, onnx.TensorProto, onnx.GraphProto)
    items = list(value) if isinstance(value, (list, tuple)) else [value]
    if not isinstance(value, (list, tuple, np.ndarray)) and not isinstance(value, scalars):
        return f"{value!r} ({type(value).__name__})"
    if isinstance(value, np.ndarray):
        return None
    for item in items:
        if isinstance(item, bool) or not isinstance(item, scalars):
            return f"{value!r} (an element is {type(item).__name__})"
        if isinstance(item, (int, np.integer)) and not -2**63 <= item < 2**63:
            return f"{item} (outside int64)"
    return None
