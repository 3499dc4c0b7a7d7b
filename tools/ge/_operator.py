"""GE IR operators: ``ge.op.<Op>(name)`` with chained ``set_input_*``/``set_attr_*``/``update_*_desc_*``.

Each op class is generated from its schema by ``make_class`` (no per-op code; ``ge.op``, the module ``op.py``,
holds them): one ``set_input_<name>``,
``update_input_desc_<name>`` per input, ``update_output_desc_<name>`` per output, ``set_attr_<name>``
and ``get_attr_<name>`` per attribute, all returning the op so calls chain as in GE's C++ API.
Attributes are checked when set (kind, known name); everything else when the graph is built, by
the builder's rules, with the line where the op was created.
"""

from __future__ import annotations

from typing import Any, Self

from ...ir._op_docs import output_doc
from ...ir._schema import AttrSpec, Schema
from ...ir._standard import StandardOpSchema
from ...ir._errors import GraphError, SourceLocation, user_location
from ._tensor import Tensor, TensorDesc

__all__ = ["Const", "Data", "Operator", "attribute_names", "make_class"]


class Operator:
    """``ge::Operator``: a named op, its connected inputs, attributes and tensor descs."""

    schema: Schema | None = None
    input_names: tuple[str, ...] = ()
    output_names: tuple[str, ...] = ()

    def __init__(self, name: str, op_type: str | None = None) -> None:
        if not isinstance(name, str) or not name:
            raise GraphError(f"ge.op.{type(self).__name__}: name: expected a non-empty string, got {name!r}")
        self._name = name
        self._type = op_type or type(self).__name__
        self.inputs: dict[int, tuple[Operator, int]] = {}
        self.attributes: dict[str, Any] = {}
        self.input_descs: dict[int, TensorDesc] = {}
        self.output_descs: dict[int, TensorDesc] = {}
        self.location: SourceLocation | None = user_location()

    # -- GE's generic API -------------------------------------------------------------------
    def GetName(self) -> str:
        return self._name

    def GetOpType(self) -> str:
        return self._type

    def SetInput(self, name: str, source: Operator, output: str | int | None = None) -> Self:
        """Connect input ``name`` to output ``output`` (name or index; default 0) of ``source``."""
        index = self._port(self.input_names, name, "input")
        if not isinstance(source, Operator):
            raise GraphError(f"{self._subject()}: input '{name}': expected a ge operator, got {type(source).__name__}")
        self.inputs[index] = (source, source.output_index(output, f"{self._subject()}: input '{name}'"))
        return self

    def SetAttr(self, name: str, value: Any) -> Self:
        self.attributes[name] = self._coerce_attr(name, value)
        return self

    def GetAttr(self, name: str) -> Any:
        if name in self.attributes:
            return self.attributes[name]
        spec = self._attr_spec(name)
        if spec is None:
            raise GraphError(f"{self._subject()}: attribute '{name}' has not been set (onnx's default applies)")
        if spec.required:
            raise GraphError(f"{self._subject()}: attribute '{name}' is required and has not been set")
        return spec.default

    def UpdateInputDesc(self, name: str, desc: TensorDesc) -> Self:
        self.input_descs[self._port(self.input_names, name, "input")] = _desc(desc, f"{self._subject()}: input '{name}'")
        return self

    def UpdateOutputDesc(self, name: str, desc: TensorDesc) -> Self:
        self.output_descs[self._port(self.output_names, name, "output")] = _desc(desc,
                                                                              f"{self._subject()}: output '{name}'")
        return self

    # -- helpers ----------------------------------------------------------------------------
    def output_index(self, output: str | int | None, subject: str) -> int:
        """The index of one of this op's outputs, given by name or index (None: the first)."""
        if output is None:
            return 0
        if isinstance(output, str):
            return self._port(self.output_names, output, "output", subject)
        if isinstance(output, int) and not isinstance(output, bool) and 0 <= output < len(self.output_names):
            return output
        raise GraphError(f"{subject}: output of {self._subject()}: expected a name ({', '.join(self.output_names)}) "
                         f"or an index < {len(self.output_names)}, got {output!r}")

    def _port(self, names: tuple[str, ...], name: str, kind: str, subject: str | None = None) -> int:
        try:
            return names.index(name)
        except ValueError:
            raise GraphError(f"{subject or self._subject()}: {kind} name: expected one of {', '.join(names) or 'none'}"
                             f" of {self._type}, got {name!r}") from None

    def _attr_spec(self, name: str) -> AttrSpec | None:
        assert self.schema is not None
        if name not in attribute_names(self.schema):
            known = ", ".join(attribute_names(self.schema)) or "none"
            raise GraphError(f"[SCH-3] {self._subject()}: attribute '{name}': expected one of {known}, "
                             "got an unknown attribute", rule="SCH-3", node=self._name)
        return next(a for a in self.schema.attributes if a.name == name) if self.schema.domain else None

    def _coerce_attr(self, name: str, value: Any) -> Any:
        spec = self._attr_spec(name)
        if spec is None:           # a standard op: onnx's checker validates the value when the graph is built
            return value
        try:
            return spec.kind.coerce(value)
        except TypeError:
            raise GraphError(f"[SCH-3] {self._subject()}: attribute '{name}': expected kind {spec.kind.value}, got "
                             f"{value!r} ({type(value).__name__})", rule="SCH-3", node=self._name) from None

    def _subject(self) -> str:
        return f"{self._type} '{self._name}'"

    def __repr__(self) -> str:
        return f"ge.op.{self._type}({self._name!r})"


def _desc(desc: TensorDesc, subject: str) -> TensorDesc:
    if not isinstance(desc, TensorDesc):
        raise GraphError(f"{subject}: desc: expected a ge.TensorDesc, got {type(desc).__name__}")
    return desc


class Data(Operator):
    """``op::Data``: a graph input; attribute ``index`` is its position in ``RunGraph``'s input list."""

    input_names = ("x",)
    output_names = ("y",)

    def set_attr_index(self, index: int) -> Data:
        if isinstance(index, bool) or not isinstance(index, int) or index < 0:
            raise GraphError(f"{self._subject()}: attribute 'index': expected an int >= 0, got {index!r}")
        self.attributes["index"] = index
        return self

    def get_attr_index(self) -> int | None:
        return self.attributes.get("index")

    def update_input_desc_x(self, desc: TensorDesc) -> Data:
        return self.UpdateInputDesc("x", desc)

    def update_output_desc_y(self, desc: TensorDesc) -> Data:
        return self.UpdateOutputDesc("y", desc)

    def desc(self) -> TensorDesc:
        """The tensor this input takes: its output desc, else its input desc; both must agree."""
        given = [self.output_descs.get(0), self.input_descs.get(0)]
        present = [d for d in given if d is not None]
        if not present:
            raise GraphError(f"{self._subject()}: no tensor desc: call update_output_desc_y(desc) (and "
                             "update_input_desc_x) before the graph is built", node=self._name, location=self.location)
        if len(present) == 2 and (present[0].GetShape() != present[1].GetShape()
                                  or present[0].GetDataType() != present[1].GetDataType()):
            raise GraphError(f"{self._subject()}: input desc x {present[1]} and output desc y {present[0]} disagree",
                             node=self._name, location=self.location)
        return present[0]


class Const(Operator):
    """``op::Const``: a constant tensor (attribute ``value``, a ``ge.Tensor`` with data)."""

    output_names = ("y",)

    def set_attr_value(self, tensor: Any) -> Const:
        if not isinstance(tensor, Tensor) or tensor.GetData() is None:
            raise GraphError(f"{self._subject()}: attribute 'value': expected a ge.Tensor with data, got {tensor!r}")
        self.attributes["value"] = tensor
        return self

    def get_attr_value(self) -> Any:
        return self.attributes.get("value")


def attribute_names(schema: Schema) -> list[str]:
    """Declared attributes (ours), or those onnx's schema lists (a standard op)."""
    if isinstance(schema, StandardOpSchema):
        return list(schema.onnx.attributes)
    return [a.name for a in schema.attributes]


def class_doc(schema: Schema) -> str:
    """The docstring of ``ge.op.<op>`` (``help()``, and ``op.pyi``'s): the op's doc and, for ours, each output's
    (``ir._op_docs.output_doc``: what an output holds, which may be absent)."""
    doc = f"``op::{schema.op_type}`` (generated from its schema). {schema.doc}"
    if isinstance(schema, StandardOpSchema):
        return doc
    return f"{doc} Outputs: {'; '.join(output_doc(schema))}."


def make_class(schema: Schema) -> type[Operator]:
    """The ge op class of ``schema``: GE's generated accessors as methods (typed in ``op.pyi``)."""
    namespace: dict[str, Any] = {"schema": schema, "input_names": tuple(s.name for s in schema.inputs),
                                 "output_names": tuple(s.name for s in schema.outputs),
                                 "__doc__": class_doc(schema)}
    for spec in schema.inputs:
        namespace[f"set_input_{spec.name}"] = _method(
            lambda self, source, output=None, _n=spec.name: self.SetInput(_n, source, output),
            f"set_input_{spec.name}", f"Connect input '{spec.name}' to ``source`` (output by name or index).")
        namespace[f"update_input_desc_{spec.name}"] = _method(
            lambda self, desc, _n=spec.name: self.UpdateInputDesc(_n, desc),
            f"update_input_desc_{spec.name}", f"Declare the tensor desc of input '{spec.name}' (checked at build).")
    for out in schema.outputs:
        namespace[f"update_output_desc_{out.name}"] = _method(
            lambda self, desc, _n=out.name: self.UpdateOutputDesc(_n, desc),
            f"update_output_desc_{out.name}", f"Declare the tensor desc of output '{out.name}' (checked at build).")
    for attr in attribute_names(schema):
        namespace[f"set_attr_{attr}"] = _method(lambda self, value, _n=attr: self.SetAttr(_n, value),
                                                f"set_attr_{attr}", f"Set attribute '{attr}' (checked now).")
        namespace[f"get_attr_{attr}"] = _method(lambda self, _n=attr: self.GetAttr(_n), f"get_attr_{attr}",
                                                f"Attribute '{attr}' as set, else its default.")
    return type(schema.op_type, (Operator,), namespace)


def _method(fn: Any, name: str, doc: str) -> Any:
    fn.__name__ = fn.__qualname__ = name
    fn.__doc__ = doc
    return fn
