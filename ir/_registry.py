"""The operator registry: every schema, keyed by (domain, op type)."""

from __future__ import annotations

import importlib
import pkgutil
from typing import TypeVar

from ._errors import GraphError

from ._schema import OpSchema

T = TypeVar("T")

__all__ = ["all_schemas", "get_schema", "register"]

_SCHEMAS: dict[tuple[str, str], OpSchema] = {}


def register_for(table: dict[tuple[str, str], T], schema: OpSchema, entry: T, what: str) -> T:
    """``table[(domain, op type)] = entry``: every registry (schemas, kernels, lowerings) is keyed so,
    and each op has at most one ``what``."""
    key = (schema.domain, schema.op_type)
    if key in table:
        raise ValueError(f"op {schema.domain}::{schema.op_type} has two {what}")
    table[key] = entry
    return entry


def register(schema: OpSchema) -> OpSchema:
    """Add a schema; an op type may be declared only once per domain."""
    return register_for(_SCHEMAS, schema, schema, "declarations")


def get_schema(op_type: str, domain: str = "ai.cann", node: str | None = None, outputs: int | None = None) -> OpSchema:
    """Look an op up; unknown ops raise GraphError SCH-1 listing the known ones.

    Domain "" (or "ai.onnx") gives the standard ONNX op's adapter (with ``outputs`` outputs for an op
    whose output count varies per node, such as Split).
    """
    if domain in ("", "ai.onnx"):
        from ._standard import standard_schema

        return standard_schema(op_type, outputs)
    try:
        return _SCHEMAS[(domain, op_type)]
    except KeyError:
        known = ", ".join(sorted(op for d, op in _SCHEMAS if d == domain)) or "none"
        where = f" '{node}'" if node else ""
        raise GraphError(
            f"[SCH-1] {op_type}{where}: op type: expected an op of domain '{domain}' ({known}), "
            f"got unknown op '{op_type}'",
            rule="SCH-1",
            node=node,
        ) from None


def import_families(package: str, path: list[str], packages_only: bool = False) -> tuple[str, ...]:
    """Import every public module (or, with ``packages_only``, subpackage) of ``package`` in name order,
    so that it registers what it declares; return their names. A new op family is a new folder (and
    a new kernel file): nothing else lists it."""
    names = sorted(m.name for m in pkgutil.iter_modules(path)
                   if not m.name.startswith("_") and (m.ispkg or not packages_only))
    for name in names:
        importlib.import_module(f"{package}.{name}")
    return tuple(names)


def all_schemas() -> list[OpSchema]:
    return list(_SCHEMAS.values())

