"""The declarative operator schema (in the spirit of CANN's REG_OP) and its inference context."""

from __future__ import annotations

import enum
import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np

from ._dtypes import DType
from ._errors import ExecutionError, GraphError, SourceLocation, format_rule_message
from ._types import Dim, SymbolTable, TensorType

__all__ = [
    "REQUIRED",
    "AttrKind",
    "AttrSpec",
    "DataContext",
    "InferContext",
    "InputSpec",
    "OpSchema",
    "OutputSpec",
    "Schema",
]


class _Required:
    def __repr__(self) -> str:
        return "REQUIRED"


REQUIRED: Any = _Required()
"""Default of an attribute that has none: the caller must give it (SCH-4)."""


class AttrKind(enum.Enum):
    """GE attribute kinds. ``Float`` keeps the Python float; semantics use ``np.float32(value)``."""

    INT = "Int"
    FLOAT = "Float"
    BOOL = "Bool"
    STRING = "String"
    LIST_INT = "ListInt"

    def coerce(self, value: Any) -> Any:
        """Return the canonical value (tuple for ListInt), or raise TypeError."""
        if self is AttrKind.BOOL:
            if isinstance(value, (bool, np.bool_)):
                return bool(value)
        elif self is AttrKind.INT:
            if _is_int(value):
                return int(value)
        elif self is AttrKind.FLOAT:
            if _is_int(value) or isinstance(value, (float, np.floating)):
                with np.errstate(over="ignore"):
                    single = np.float32(value)
                return float(single) if np.isfinite(single) else float(value)   # GE Floats are 32-bit
        elif self is AttrKind.STRING:
            if isinstance(value, str):
                return value
        elif self is AttrKind.LIST_INT:
            if isinstance(value, (list, tuple)) and all(_is_int(v) for v in value):
                return tuple(int(v) for v in value)
        raise TypeError(self.value)


def _is_int(value: Any) -> bool:
    """An int that fits the int64 attributes of GE IR and ONNX."""
    return isinstance(value, (int, np.integer)) and not isinstance(value, bool) and -2**63 <= value < 2**63


@dataclass(frozen=True)
class InputSpec:
    name: str
    dtypes: tuple[DType, ...]
    optional: bool = False
    doc: str = ""


@dataclass(frozen=True)
class OutputSpec:
    name: str
    optional: bool = False
    alias: int | None = None
    """Index of the input this output aliases (in-place op), or None."""
    doc: str = ""


@dataclass(frozen=True)
class AttrSpec:
    name: str
    kind: AttrKind
    default: Any = REQUIRED
    doc: str = ""

    @property
    def required(self) -> bool:
        return self.default is REQUIRED


class _NodeContext:
    """Naming shared by the contexts: how a rule's subject and message read."""

    schema: OpSchema
    node: str
    attributes: dict[str, Any]
    location: SourceLocation | None
    target: str | None = None

    def attr(self, name: str) -> Any:
        return self.attributes[name]

    def input_subject(self, key: int | str, dim: int | None = None) -> str:
        i = self.schema.input_index(key)
        text = f"input {i} '{self.schema.inputs[i].name}'"
        return text if dim is None else f"{text} dim {dim}"

    def output_subject(self, index: int) -> str:
        return f"output {index} '{self.schema.outputs[index].name}'"

    @staticmethod
    def attr_subject(name: str) -> str:
        return f"attribute '{name}'"

    def message(self, rule: str, subject: str, expected: object, got: object, hint: str | None = None) -> str:
        return format_rule_message(rule, self.schema.op_type, self.node, subject, expected, got, hint=hint,
                                   target=self.target)


class InferContext(_NodeContext):
    """What a schema's ``check``/``infer`` sees of one node, and how it reports violations.

    Dimension comparisons go through ``equal``, which is three-valued over symbols; a rule
    whose outcome is None cannot be decided yet and is recorded in ``deferred`` (the
    interpreter re-checks it on concrete shapes).
    """

    def __init__(
        self,
        schema: OpSchema,
        node: str,
        input_types: Sequence[TensorType | None],
        attributes: Mapping[str, Any],
        *,
        symbols: SymbolTable | None = None,
        location: SourceLocation | None = None,
        target: str | None = None,
        input_values: Sequence[np.ndarray | None] | None = None,
        declared: Sequence[TensorType | None] | None = None,
        sources: Sequence[object | None] | None = None,
    ) -> None:
        self.schema = schema
        self.declared = declared
        """Output types the node's file declares (``Node.declared``): all an op of a foreign domain has."""
        self.sources = tuple(sources) if sources is not None else None   # the graph's input values (``same_input``)
        self.node = node
        self.inputs = tuple(input_types)
        self.input_values = tuple(input_values) if input_values is not None else (None,) * len(self.inputs)
        """Values of constant inputs (standard ops' shape inference needs e.g. Reshape's shape)."""
        self.attributes = dict(attributes)
        self.symbols = symbols if symbols is not None else SymbolTable()
        self.location = location
        self.target = target
        self.outputs: list[TensorType | None] = [None] * len(schema.outputs)
        self.deferred: list[str] = []
        self.warnings: list[str] = []

    def input(self, key: int | str) -> TensorType | None:
        return self.inputs[self.schema.input_index(key)]

    def equal(self, a: Dim, b: Dim) -> bool | None:
        return self.symbols.equal(a, b)

    def same_input(self, a: int | str, b: int | str) -> bool | None:
        """Whether inputs ``a`` and ``b`` are the same graph value (None: no graph to tell)."""
        if self.sources is None:
            return None
        return self.sources[self.schema.input_index(a)] is self.sources[self.schema.input_index(b)]

    # -- reporting -----------------------------------------------------------------------
    def error(self, rule: str, subject: str, expected: object, got: object, hint: str | None = None) -> GraphError:
        symbols = sorted({d for t in self.inputs if t is not None for d in t.shape if isinstance(d, str)})
        if isinstance(got, str) and got in symbols and len(symbols) > 1:
            named = [s for s in symbols if s != got and re.search(rf"(?<![\w']){re.escape(s)}(?![\w'])", str(expected))]
            other = named[0] if named else next(s for s in symbols if s != got)   # the symbol the rule expected
            note = (f"different symbols are different sizes unless declared equal, e.g. "
                    f"GraphBuilder.declare_equal({other!r}, {got!r})")
            hint = f"{hint}; {note}" if hint else note
        return GraphError(self.message(rule, subject, expected, got, hint), rule=rule, node=self.node,
                          location=self.location)

    def fail(self, rule: str, subject: str, expected: object, got: object, hint: str | None = None) -> None:
        raise self.error(rule, subject, expected, got, hint)

    def warn(self, rule: str, subject: str, expected: object, got: object, hint: str | None = None) -> None:
        """Record a contract warning (``..-W#``); the builder emits it as a GeirWarning."""
        self.warnings.append(self.message(rule, subject, expected, got, hint))

    def require(
        self, ok: bool | None, rule: str, subject: str, expected: object, got: object, hint: str | None = None
    ) -> bool:
        """Fail when ``ok`` is False, defer the rule when it is None; return whether it was decided."""
        if ok is None:
            self.deferred.append(rule)
            return False
        if not ok:
            self.fail(rule, subject, expected, got, hint)
        return True

    # -- writing -------------------------------------------------------------------------
    def set_output(self, key: int | str, type: TensorType) -> None:
        self.outputs[self.schema.output_index(key)] = type


class DataContext(_NodeContext):
    """What a schema's run-time data validation (``..-D#`` rules) sees of one node: its input arrays."""

    def __init__(self, schema: OpSchema, node: str, arrays: Sequence[np.ndarray | None],
                 attributes: Mapping[str, Any], *, location: SourceLocation | None = None) -> None:
        self.schema = schema
        self.node = node
        self.arrays = tuple(arrays)
        self.attributes = dict(attributes)
        self.location = location

    def array(self, key: int | str) -> np.ndarray | None:
        return self.arrays[self.schema.input_index(key)]

    def fail(self, rule: str, subject: str, expected: object, got: object, hint: str | None = None) -> None:
        """Raise ExecutionError: bad data is found while running, not while building."""
        raise ExecutionError(self.message(rule, subject, expected, got, hint), node=self.node, rule=rule)


Rule = Callable[[InferContext], None]


class Schema(Protocol):
    """What every layer asks of an op's declaration, ours (``OpSchema``) or a standard ONNX op's adapter
    (``StandardOpSchema``): the one interface the registry hands out."""

    @property
    def op_type(self) -> str: ...
    @property
    def domain(self) -> str: ...
    @property
    def version(self) -> int: ...
    @property
    def doc(self) -> str: ...
    @property
    def inputs(self) -> tuple[InputSpec, ...]: ...
    @property
    def outputs(self) -> tuple[OutputSpec, ...]: ...
    @property
    def attributes(self) -> tuple[AttrSpec, ...]: ...
    @property
    def validate(self) -> Callable[[DataContext], None] | None: ...
    @property
    def validated_inputs(self) -> tuple[str, ...]: ...
    @property
    def input_names(self) -> tuple[str, ...]: ...
    @property
    def variadic(self) -> bool: ...
    @property
    def max_inputs(self) -> int: ...
    @property
    def exact_across_runtimes(self) -> bool: ...

    def input_index(self, key: int | str) -> int: ...
    def output_index(self, key: int | str) -> int: ...
    def raise_error(self, rule: str, node: str, subject: str, expected: object, got: object,
                    location: SourceLocation | None) -> None: ...
    def bind_attributes(self, given: dict[str, Any], node: str,
                        location: SourceLocation | None = None) -> dict[str, Any]: ...
    def check_signature(self, input_types: Sequence[TensorType | None], node: str,
                        location: SourceLocation | None = None) -> None: ...
    def infer_types(self, ctx: InferContext) -> tuple[TensorType | None, ...]: ...


@dataclass(frozen=True)
class OpSchema:
    """One operator's declaration: the single source for builder methods, checks and runtimes.

    ``type_combinations`` lists the legal dtype tuples over the inputs (None where an input
    does not take part); absent optional inputs are ignored when matching (SCH-6).
    ``check`` holds the semantic rules and runs before ``infer``, which sets the output types.
    """

    op_type: str
    inputs: tuple[InputSpec, ...]
    outputs: tuple[OutputSpec, ...]
    attributes: tuple[AttrSpec, ...]
    type_combinations: tuple[tuple[DType | None, ...], ...]
    infer: Rule
    check: Rule
    validate: Callable[[DataContext], None] | None = None
    """Run-time data validation on the input arrays (indices, lengths); None when the op has none."""
    validated_inputs: tuple[str, ...] = ()
    """Inputs whose values ``validate`` reads (of the others it reads only shapes)."""
    domain: str = "ai.cann"
    version: int = 1
    doc: str = ""
    exact_across_runtimes: bool = False
    """Every runtime gives the same bits (the contract fixes every rounding: no reduction whose order a runtime
    may choose). ``geir.testing.run_all_runtimes`` holds a graph of such ops to bit equality."""
    _input_index: dict[str, int] = field(init=False, repr=False, compare=False)
    _output_index: dict[str, int] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "_input_index", {s.name: i for i, s in enumerate(self.inputs)})
        object.__setattr__(self, "_output_index", {s.name: i for i, s in enumerate(self.outputs)})
        for combo in self.type_combinations:
            if len(combo) != len(self.inputs):
                raise ValueError(f"{self.op_type}: dtype combination {combo} does not cover every input")

    @property
    def input_names(self) -> tuple[str, ...]:
        return tuple(s.name for s in self.inputs)

    @property
    def max_inputs(self) -> int:
        return len(self.inputs)

    @property
    def variadic(self) -> bool:
        """Our ops have a fixed output count (a standard op such as Split may not)."""
        return False

    def input_index(self, key: int | str) -> int:
        return key if isinstance(key, int) else self._input_index[key]

    def output_index(self, key: int | str) -> int:
        return key if isinstance(key, int) else self._output_index[key]

    def attribute(self, name: str) -> AttrSpec:
        for spec in self.attributes:
            if spec.name == name:
                return spec
        raise KeyError(name)

    # -- generic rules SCH-2..SCH-6 ------------------------------------------------------
    def bind_attributes(
        self, given: Mapping[str, Any], node: str, location: SourceLocation | None = None
    ) -> dict[str, Any]:
        """Validate attributes (SCH-3, SCH-4) and fill in defaults, in schema order."""
        known = {s.name for s in self.attributes}
        for name in given:
            if name not in known:
                expected = "one of " + ", ".join(known) if known else "no attributes"
                self.raise_error("SCH-3", node, f"attribute '{name}'", expected, "an unknown attribute", location)
        bound: dict[str, Any] = {}
        for spec in self.attributes:
            if spec.name not in given or given[spec.name] is None:
                if spec.required:
                    self.raise_error("SCH-4", node, f"attribute '{spec.name}'", f"a {spec.kind.value} value",
                                "nothing (the attribute is required)", location)
                bound[spec.name] = spec.default
                continue
            value = given[spec.name]
            try:
                bound[spec.name] = spec.kind.coerce(value)
            except TypeError:
                self.raise_error("SCH-3", node, f"attribute '{spec.name}'", f"kind {spec.kind.value}",
                            f"{value!r} ({type(value).__name__})", location)
        return bound

    def check_signature(
        self, input_types: Sequence[TensorType | None], node: str, location: SourceLocation | None = None
    ) -> None:
        """Arity and required inputs (SCH-2), per-operand dtypes (SCH-5), dtype combination (SCH-6)."""
        if len(input_types) > len(self.inputs):
            self.raise_error("SCH-2", node, "inputs", f"at most {len(self.inputs)}", len(input_types), location)
        types = tuple(input_types) + (None,) * (len(self.inputs) - len(input_types))
        for i, (spec, t) in enumerate(zip(self.inputs, types)):
            subject = f"input {i} '{spec.name}'"
            if t is None:
                if not spec.optional:
                    self.raise_error("SCH-2", node, subject, "a value (required input)", "None", location)
                continue
            if t.dtype not in spec.dtypes:
                self.raise_error("SCH-5", node, subject, "dtype in {" + ", ".join(map(str, spec.dtypes)) + "}",
                            t.dtype, location)
        present = [i for i, t in enumerate(types) if t is not None]
        actual = tuple(types[i].dtype for i in present)  # type: ignore[union-attr]
        legal = {tuple(combo[i] for i in present) for combo in self.type_combinations}
        if actual not in legal:
            names = ", ".join(self.inputs[i].name for i in present)
            options = sorted(legal, key=str)
            shown = "; ".join("(" + ", ".join(str(d) for d in c) + ")" for c in options)
            self.raise_error("SCH-6", node, f"dtypes of ({names})", f"one of {shown}",
                        "(" + ", ".join(map(str, actual)) + ")", location)

    def raise_error(self, rule: str, node: str, subject: str, expected: object, got: object,
               location: SourceLocation | None) -> None:
        raise GraphError(format_rule_message(rule, self.op_type, node, subject, expected, got),
                         rule=rule, node=node, location=location)

    # -- inference -----------------------------------------------------------------------
    def infer_types(self, ctx: InferContext) -> tuple[TensorType | None, ...]:
        """Run the semantic rules, then inference; return one type per output (None if absent). Our ops need every
        input's rank: an input of unknown rank (a standard op's data-dependent output) is a GraphError."""
        for spec, t in zip(self.inputs, ctx.inputs):
            if t is not None and not t.has_rank:
                raise GraphError(f"{self.op_type} '{ctx.node}': input '{spec.name}': expected a known rank (geir's "
                                 f"ops need every rank), got {t}, whose rank ONNX infers only from data; give the "
                                 f"value a shape (a constant Reshape target or constant axes)", node=ctx.node,
                                 location=ctx.location)
        self.check(ctx)
        self.infer(ctx)
        for i, (spec, t) in enumerate(zip(self.outputs, ctx.outputs)):
            if t is None and not spec.optional:
                raise AssertionError(f"{self.op_type}.infer left required output {i} '{spec.name}' untyped")
        return tuple(ctx.outputs)
