"""GraphEditor: adds inputs, constants, nodes and outputs to a graph the way CANN's graph mode does, one
method per registered op, each node checked at once (signature, semantic rules, inference), so a bad graph
fails at the line that built it.

It is the ground floor's half of ``geir.GraphBuilder``: the passes that emit nodes (autodiff, fusion) and the
importers use it directly; ``GraphBuilder`` (``tools/builder.py``) adds ``build()``, which runs the
verification passes. The op methods are generated from the schemas: ``b.InplacePartialRotaryMulGrad(dy, cos,
sin, rotary_mode=1, partial_slice=[16, 48])``.
"""

from __future__ import annotations

import inspect
import warnings
from collections.abc import Iterable, Sequence
from typing import Any, Self

import numpy as np

from ._op_docs import output_doc
from ._registry import all_schemas, get_schema
from ._schema import InferContext, OpSchema
from ._standard import variadic_output_count
from ._core import CANN_DOMAIN, Graph, Node, Value, unused_name
from ._dtypes import DTypeLike
from ._errors import GeirWarning, GraphError, SourceLocation, user_location
from ._types import TensorType, refine_all

__all__ = ["GraphEditor", "OpResult"]

OpResult = Value | tuple[Value | None, ...]


class GraphEditor:
    """Accumulates inputs, nodes and outputs of one graph; ``finish()`` hands the unverified graph over."""

    def __init__(self, name: str) -> None:
        if not isinstance(name, str) or not name:
            raise GraphError(f"{type(self).__name__}: the graph name must be a non-empty str (ONNX requires one), got {name!r}")
        self._graph = Graph(name)
        self._names: set[str] = set()       # value names (inputs, node outputs)
        self._node_names: set[str] = set()  # node names: a namespace of their own, as in ONNX
        self._values: set[int] = set()
        self._counts: dict[str, int] = {}
        self._built = False

    @classmethod
    def extend(cls, graph: Graph) -> Self:
        """A builder that adds to an existing graph: its inputs, constants, nodes and outputs stay, their
        names stay taken, and verifying the result checks the whole graph again."""
        builder = cls(graph.name)
        builder._graph = graph
        builder._names = {v.name for v in graph.values()}
        builder._values = {id(v) for v in graph.values()}
        builder._node_names = {n.name for n in graph.nodes}
        graph.invalidate()
        return builder

    @classmethod
    def copy(cls, graph: Graph, name: str | None = None) -> Self:
        """A builder holding a copy of ``graph``'s inputs, constants (their arrays copied), nodes (same names,
        attributes and value names) and outputs; verifying the result checks the copy. The original is not touched."""
        builder = cls(name or graph.name)
        builder.copy_from(graph)
        return builder

    def copy_from(self, graph: Graph, rewrite: Any = None, outputs: bool = True,
                  reserved: frozenset[str] = frozenset()) -> dict[int, Value | None]:
        """Add a copy of ``graph`` (symbol groups, inputs, constants, nodes in topological order, and with
        ``outputs`` its outputs) to this builder; return the map ``id(original value) -> copy``.

        ``rewrite(node, inputs)``, when given, may re-emit a node itself (returning its outputs here) or
        return None to have it copied as it is. A constant or inner value named in ``reserved`` (names the caller
        will give its own inputs or outputs) is copied under a new name."""
        for group in graph.symbols.groups():
            self.declare_equal(*sorted(group))
        kept = {v.name for v in graph.inputs} | {v.name for v in graph.outputs}   # the interface keeps its names
        avoid = set(reserved) | kept | {v.name for v in graph.constant_values} | {
            v.name for n in graph.nodes for v in n.outputs if v is not None}

        def named(name: str) -> str:
            if name not in reserved or name in kept:
                return name
            fresh = unused_name(name, avoid | self._names)      # name itself is reserved: a suffix is added
            avoid.add(fresh)
            return fresh
        mapping: dict[int, Value | None] = {}
        for v in graph.inputs:
            mapping[id(v)] = self.input(v.name, v.type.dtype, v.type.dims, default=graph.defaults.get(v.name),
                                        kind=v.type.kind)
        for v in graph.constant_values:
            mapping[id(v)] = self.constant(named(v.name), graph.constants[v.name])
        for node in graph.topological_order():
            inputs = [None if v is None else mapping[id(v)] for v in node.inputs]
            made = rewrite(node, inputs) if rewrite is not None else None
            if made is None:
                made = self.add_node(node.schema, inputs, node.attributes, name=node.name,
                                     output_names=[named(v.name) if v is not None else "" for v in node.outputs],
                                     location=node.location, declared=node.declared)
            for old, new in zip(node.outputs, made if isinstance(made, tuple) else (made,)):
                if old is not None:
                    mapping[id(old)] = new
        if outputs:
            for v in graph.outputs:
                self.output(mapping[id(v)])
        return mapping

    # -- graph interface -----------------------------------------------------------------
    def input(self, name: str, dtype: DTypeLike, shape: Iterable[int | str] | None,
              default: np.ndarray | None = None, kind: str = "tensor") -> Value:
        """Declare a graph input; dims are ints or symbol names bound when the graph runs (None: any rank, for
        standard ops only). ``default``: the array a run uses when the input is not fed (ONNX: an input with a
        same-name initializer). ``kind``: "sequence", "optional" or "optional_sequence" for an input standard ops
        take as a list of arrays or an optional value (``TensorType.kind``)."""
        self._check_open()
        try:
            value = Value(name, TensorType(dtype, shape, kind))
        except (TypeError, ValueError) as exc:
            raise GraphError(f"graph '{self._graph.name}': input '{name}': {exc}") from None
        self._claim(name, "input")
        self._graph.inputs.append(value)
        self._values.add(id(value))
        if default is not None:
            self._graph.set_default(name, default)
        return value

    def declare_equal(self, *symbols: str) -> None:
        """Declare symbolic dims equal (otherwise two different symbols are different sizes)."""
        for a, b in zip(symbols, symbols[1:]):
            self._graph.symbols.declare_equal(a, b)

    def output(self, value: Value, name: str | None = None) -> Value:
        """Mark ``value`` as a graph output, renamed to ``name`` when given."""
        self._check_open()
        self._check_value(value, "output")
        if any(v is value for v in self._graph.outputs):
            raise GraphError(f"graph '{self._graph.name}': value '{value.name}' is already a graph output")
        if name is not None and name != value.name:
            if value.producer is None:
                raise GraphError(f"graph '{self._graph.name}': output '{name}': a graph input keeps its name "
                                 f"'{value.name}' as an output")
            self._claim(name, "output")
            self._names.discard(value.name)
            value.name = name
        self._graph.outputs.append(value)
        return value

    def finish(self) -> Graph:
        """Close the editor and return its graph, not yet verified (``geir.passes.build_pipeline`` does that);
        a graph needs at least one output."""
        self._check_open()
        if not self._graph.outputs:
            raise GraphError(f"graph '{self._graph.name}': no outputs; mark at least one with output()")
        self._built = True
        return self._graph

    # -- ops -----------------------------------------------------------------------------
    def op(self, op_type: str, *inputs: Value | None, domain: str | None = None, name: str | None = None,
           outputs: int | None = None, **attributes: Any) -> OpResult:
        """Add a node of any op: ours (domain "ai.cann") or a standard ONNX op (domain "").

        Without ``domain``, our op of that name if there is one, else the standard op. Inputs
        are positional (None for an absent optional input), attributes by keyword. ``outputs``
        gives the output count of a standard op whose count varies (Split can also tell it
        from ``num_outputs`` or a constant ``split``), or leaves a standard op's optional trailing outputs out
        (``b.op("BatchNormalization", x, s, bias, m, v, outputs=1)``: inference mode has one output).
        Example: ``b.op("Add", x, y)``, ``b.op("Transpose", x, perm=[0, 2, 1, 3])``,
        ``a, c = b.op("Split", x, axis=1, num_outputs=2)``.

        Returns the output Value of an op with one output; a tuple in the op's output order (None for an
        absent optional output of ours) for an op with several, and always for an op whose count varies per
        node (Split), even of one. The stub types it by op name (``b.op("Add", ...)`` is a ``Value``).
        """
        if domain is None:
            ours = sorted(s.op_type for s in all_schemas())
            if op_type not in ours:
                try:
                    schema = get_schema(op_type, "", name)
                except GraphError:
                    raise GraphError(f"[SCH-1] {op_type}: op type: expected one of ours ({', '.join(ours)}) or a "
                                     f"standard ONNX op, got unknown op '{op_type}'", rule="SCH-1") from None
                domain = ""
            else:
                domain = CANN_DOMAIN
        schema = get_schema(op_type, domain, name)
        if schema.variadic:
            count = outputs if outputs is not None else variadic_output_count(schema, list(inputs), attributes,
                                                                              self._graph.constants)
            if not isinstance(count, int) or isinstance(count, bool) or count < 1:
                raise GraphError(f"{op_type}: outputs: expected a positive int, got {count!r}")
            if op_type == "Split" and "num_outputs" not in attributes and (len(inputs) < 2 or inputs[1] is None):
                attributes = {**attributes, "num_outputs": count}   # opset 18 wants one of the two
            schema = get_schema(op_type, domain, name, outputs=count)
        elif outputs is not None and domain == "" and len(schema.optional_outputs) > 1:
            counts = schema.optional_outputs          # a standard op with optional trailing outputs
            if outputs not in counts:
                raise GraphError(f"{op_type}: outputs=: expected {counts.start} to {counts.stop - 1} (its optional "
                                 f"outputs are trailing), got {outputs!r}")
            schema = get_schema(op_type, domain, name, outputs=outputs)
        elif outputs is not None:
            raise GraphError(f"{op_type}: outputs=: the op has a fixed number of outputs ({len(schema.outputs)})")
        result = self._add(schema, list(inputs), {}, attributes, name)
        return (result,) if schema.variadic and isinstance(result, Value) else result

    def constant(self, name: str, array: np.ndarray) -> Value:
        """A named constant (an ONNX initializer): never fed, never modified."""
        self._check_open()
        array = np.array(array)  # a private copy
        self._claim(name, "constant")
        try:
            value = Value(name, TensorType(array.dtype, array.shape))
        except (TypeError, ValueError) as exc:
            raise GraphError(f"graph '{self._graph.name}': constant '{name}': {exc}") from None
        self._graph.constants[name] = array
        self._graph.constant_values.append(value)
        self._values.add(id(value))
        return value

    def __getattr__(self, op_type: str) -> Any:
        for schema in all_schemas():
            if schema.op_type == op_type:
                method = _op_method(schema)
                return method.__get__(self, type(self))
        raise AttributeError(f"'{type(self).__name__}' has no attribute or registered op {op_type!r}")

    def __dir__(self) -> list[str]:
        return sorted(set(super().__dir__()) | {s.op_type for s in all_schemas()})

    def add_node(self, schema: OpSchema, inputs: list[Value | None], attributes: dict[str, Any] | None = None,
                 name: str | None = None, output_names: list[str] | None = None,
                 location: SourceLocation | None = None,
                 declared: Sequence[TensorType | None] | None = None) -> OpResult:
        """Add a node of ``schema`` (from ``geir.schemas.get_schema``): the call every frontend uses.

        ``inputs`` are positional (None for an absent optional input); ``output_names`` keeps given
        value names (an importer's), "" marking an absent optional output; ``location`` is where the
        user created the node (default: the calling line outside geir); ``declared``: output types a file
        claims, which fill the gaps of inference (``Node.declared``).
        """
        return self._add(schema, list(inputs), {}, dict(attributes or {}), name, output_names, location, declared)

    def _add(self, schema: OpSchema, positional: list[Any], named_inputs: dict[str, Any],
             attributes: dict[str, Any], name: str | None, output_names: list[str] | None = None,
             location: SourceLocation | None = None,
             declared: Sequence[TensorType | None] | None = None) -> OpResult:
        self._check_open()
        location = location or user_location()
        if name is None:
            n = self._counts.get(schema.op_type, 0)
            while f"{schema.op_type}_{n}" in self._node_names:
                n += 1
            self._counts[schema.op_type] = n + 1
            name = f"{schema.op_type}_{n}"
        if len(positional) > schema.max_inputs:
            schema.raise_error("SCH-2", name, "inputs", f"at most {schema.max_inputs}", len(positional), location)
        inputs: list[Value | None] = positional + [None] * max(0, len(schema.inputs) - len(positional))
        for key, value in named_inputs.items():
            i = schema.input_index(key)
            if i < len(positional):
                raise GraphError(f"{schema.op_type} '{name}': input {i} '{key}' given both by position and "
                                 f"by name", node=name, location=location)
            inputs[i] = value
        for i, value in enumerate(inputs):
            if value is not None:
                formal = schema.inputs[min(i, len(schema.inputs) - 1)].name
                self._check_value(value, f"{schema.op_type} '{name}': input {i} '{formal}'")
        bound = schema.bind_attributes(attributes, name, location)
        types = [v.type if v is not None else None for v in inputs]
        schema.check_signature(types, name, location)
        values = [self._graph.constants.get(v.name) if v is not None and v.producer is None else None for v in inputs]
        ctx = InferContext(schema, name, types, bound, symbols=self._graph.symbols, location=location,
                           input_values=values, declared=declared)
        out_types = refine_all(schema.infer_types(ctx), declared)
        for message in ctx.warnings:
            if location is None:
                warnings.warn(message, GeirWarning, stacklevel=3)
            else:
                warnings.warn_explicit(message, GeirWarning, location.filename, location.lineno)
        self._claim(name, "node", self._node_names)
        if output_names is not None:  # an imported node: keep its value names; "" or a missing one is absent
            names = list(output_names) + [""] * (len(out_types) - len(output_names))
            for n in names:
                if n:
                    self._claim(n, "value")
            out_specs = [None if t is None or not n else (n, t) for n, t in zip(names, out_types)]
        else:
            out_specs = [None if t is None else (self._fresh(f"{name}.{s.name}"), t)
                         for s, t in zip(schema.outputs, out_types)]
        node = Node(schema.op_type, inputs, bound, out_specs, name=name, domain=schema.domain, location=location,
                    version=schema.version)
        node.declared = None if declared is None else tuple(declared)
        node.inferred = (node.inference_key(types), tuple(out_types))   # the build's InferShapes reuses it
        self._graph.nodes.append(node)                   # still being built: no guarantees to clear
        node.graph = self._graph
        for value in node.outputs:
            if value is not None:
                self._values.add(id(value))
        return node.outputs[0] if len(node.outputs) == 1 else node.outputs

    # -- helpers -------------------------------------------------------------------------
    def _check_open(self) -> None:
        if self._built:
            raise GraphError(f"graph '{self._graph.name}' is already built; start a new {type(self).__name__}")

    def _check_value(self, value: Any, what: str) -> None:
        if not isinstance(value, Value):
            raise GraphError(f"{what}: expected a geir Value of graph '{self._graph.name}', got "
                             f"{type(value).__name__}", location=user_location())
        if id(value) not in self._values:
            raise GraphError(f"{what}: value '{value.name}' belongs to another graph", location=user_location())

    def _claim(self, name: str, what: str, space: set[str] | None = None) -> None:
        space = self._names if space is None else space
        if not isinstance(name, str) or not name:
            raise GraphError(f"graph '{self._graph.name}': {what} name must be a non-empty str, got {name!r}")
        if name in space:
            raise GraphError(f"graph '{self._graph.name}': {what} name '{name}' is already used")
        space.add(name)

    def _fresh(self, base: str) -> str:
        name = unused_name(base, self._names)
        self._names.add(name)
        return name


_METHODS: dict[int, Any] = {}


def _op_method(schema: OpSchema) -> Any:
    """Generate (once per schema) the builder method for an op, with a real signature and doc."""
    cached = _METHODS.get(id(schema))
    if cached is not None:
        return cached
    input_names = [s.name for s in schema.inputs]
    attr_names = {s.name for s in schema.attributes}

    def method(self: GraphEditor, *args: Any, name: str | None = None, **kwargs: Any) -> OpResult:
        named = {k: kwargs.pop(k) for k in list(kwargs) if k in input_names}
        for key in kwargs:
            if key not in attr_names:
                schema.raise_error("SCH-3", name or schema.op_type, f"keyword '{key}'",
                              "an input (" + ", ".join(input_names) + ") or attribute ("
                              + ", ".join(attr_names) + ")", "an unknown name", user_location())
        return self._add(schema, list(args), named, kwargs, name)

    params = [inspect.Parameter("self", inspect.Parameter.POSITIONAL_OR_KEYWORD)]
    first_optional = next((i for i, s in enumerate(schema.inputs) if s.optional), len(schema.inputs))
    params += [inspect.Parameter(s.name, inspect.Parameter.POSITIONAL_OR_KEYWORD,  # Python wants defaults after
                                 default=None if i >= first_optional else inspect.Parameter.empty)  # the first one
               for i, s in enumerate(schema.inputs)]
    params += [inspect.Parameter(s.name, inspect.Parameter.KEYWORD_ONLY,
                                 default=inspect.Parameter.empty if s.required else s.default)
               for s in schema.attributes]
    params.append(inspect.Parameter("name", inspect.Parameter.KEYWORD_ONLY, default=None))
    method.__signature__ = inspect.Signature(params)  # type: ignore[attr-defined]
    method.__name__ = method.__qualname__ = schema.op_type
    lines = [schema.doc, "", "Inputs:"]
    lines += [f"    {s.name} ({'optional' if s.optional else 'required'}; "
              f"{', '.join(map(str, s.dtypes))}): {s.doc}" for s in schema.inputs]
    lines += ["Attributes:"] + [f"    {s.name} ({s.kind.value}, default {s.default!r}): {s.doc}"
                                for s in schema.attributes]
    optional = ", ".join(s.name for s in schema.outputs if s.optional)
    lines += ["Returns:"] + ([] if len(schema.outputs) == 1 else [
        "    a tuple in GE IR order of a Value per output, " + (f"None for an absent optional one ({optional}):"
                                                             if optional else "never None:")])
    lines += ["    " + line for line in output_doc(schema, "None when absent")]
    method.__doc__ = "\n".join(lines)
    _METHODS[id(schema)] = method
    return method
