"""``ge.op``: CANN's ``ge::op`` namespace, as a module. ``Data``, ``Const`` and one class per op of the registry,
generated from its schema (``_operator.make_class``); a standard ONNX op (``ge.op.Add``) is generated on first use
from onnx's schema. Type checkers read ``op.pyi``, generated from the same schemas by ``python -m geir.tools.stubs``
(a test fails when it is stale)."""

from ...ir._errors import GraphError as _GraphError
from ...ir._registry import all_schemas as _all_schemas, get_schema as _get_schema
from ._operator import Const, Data, Operator as _Operator, make_class as _make_class

_CLASSES: dict[str, type[_Operator]] = {"Data": Data, "Const": Const}
for _schema in _all_schemas():
    _CLASSES[_schema.op_type] = globals()[_schema.op_type] = _make_class(_schema)
del _schema


def __getattr__(name: str) -> type[_Operator]:
    """A standard ONNX op's class, made (once) on first use; AttributeError naming ours for anything else."""
    if name.startswith("_"):
        raise AttributeError(name)
    try:
        schema = _get_schema(name, "")
    except _GraphError:
        raise AttributeError(f"ge.op has no operator {name!r}: ours are {', '.join(sorted(_CLASSES))}, or any "
                             "standard ONNX op") from None
    made = _CLASSES.setdefault(name, _make_class(schema))
    globals()[name] = made
    return made


def __dir__() -> list[str]:
    return sorted(_CLASSES)
