"""The one registry of what geir knows per op, keyed by (domain, op type) everywhere.

Each kind of thing an op may have is a typed ``Slot`` of it, declared by the module that owns the kind: the
schema (here), its VJP rule (``schemas/vjp.py``), its ONNX lowering (``ir/_lowering.py``), the targets where
CANN has a kernel (``schemas/targets.py``), each backend's kernel (``runtimes/_kernels.py``). An op has at most
one entry per slot: registering a second is a ValueError naming the op, the slot and both values. Kinds an op
has several of (device rows, worked examples, fusion patterns anchored on a standard op) are ``Rows``.
``entry(domain, op_type)`` shows everything registered for one op.
"""

from __future__ import annotations

import importlib
import pkgutil
from collections.abc import Iterator, MutableMapping
from typing import Generic, TypeVar

from ._errors import GraphError
from ._onnx_body import OPSET

from ._schema import OpSchema, Schema

T = TypeVar("T")

__all__ = ["Rows", "SCHEMAS", "Slot", "all_schemas", "entry", "get_schema", "register"]

Key = tuple[str, str]
"""(domain, op type): "" is the standard ONNX domain, "ai.cann" ours."""

_KINDS: dict[str, Slot[object] | Rows[object]] = {}


def _describe(value: object) -> str:
    module, name = getattr(value, "__module__", None), getattr(value, "__qualname__", None)
    return f"{module}.{name}" if module and name else repr(value)


def _claim_kind(kind: Slot[T] | Rows[T]) -> None:
    if kind.what in _KINDS:
        raise ValueError(f"the registry already has a kind named {kind.what!r}")
    _KINDS[kind.what] = kind  # type: ignore[assignment]


class Slot(MutableMapping[Key, T], Generic[T]):
    """At most one ``T`` per op. ``register`` refuses a second; reading is a mapping (a test may patch an
    entry with ``monkeypatch.setitem``, which bypasses the check on purpose)."""

    def __init__(self, what: str) -> None:
        self.what = what
        self._table: dict[Key, T] = {}
        _claim_kind(self)

    def register(self, domain: str, op_type: str, value: T) -> T:
        key = (domain, op_type)
        if key in self._table:
            raise ValueError(f"op {domain}::{op_type} has two {self.what}: {_describe(self._table[key])} and "
                             f"{_describe(value)}")
        self._table[key] = value
        return value

    def __getitem__(self, key: Key) -> T:
        return self._table[key]

    def __setitem__(self, key: Key, value: T) -> None:
        self._table[key] = value

    def __delitem__(self, key: Key) -> None:
        del self._table[key]

    def __iter__(self) -> Iterator[Key]:
        return iter(self._table)

    def __len__(self) -> int:
        return len(self._table)


class Rows(Generic[T]):
    """Any number of ``T`` per op, kept in registration order (overall and per op)."""

    def __init__(self, what: str) -> None:
        self.what = what
        self._rows: list[tuple[Key, T]] = []
        _claim_kind(self)

    def add(self, domain: str, op_type: str, *values: T) -> None:
        self._rows.extend(((domain, op_type), v) for v in values)

    def of(self, domain: str, op_type: str) -> list[T]:
        return [v for key, v in self._rows if key == (domain, op_type)]

    def all(self) -> list[T]:
        return [v for _, v in self._rows]


def entry(domain: str, op_type: str) -> dict[str, object]:
    """Everything registered for one op, by kind (a slot's value, or the list of an op's rows); kinds the op
    has nothing of are left out."""
    found: dict[str, object] = {}
    for what, kind in _KINDS.items():
        if isinstance(kind, Slot):
            if (domain, op_type) in kind:
                found[what] = kind[(domain, op_type)]
        elif kind.of(domain, op_type):
            found[what] = kind.of(domain, op_type)
    return found


SCHEMAS: Slot[OpSchema] = Slot("declarations")
"""Our ops' schemas (a standard op's adapter is made on demand by ``get_schema``)."""


def register(schema: OpSchema) -> OpSchema:
    """Add a schema; an op type may be declared only once per domain."""
    return SCHEMAS.register(schema.domain, schema.op_type, schema)


def get_schema(op_type: str, domain: str = "ai.cann", node: str | None = None, outputs: int | None = None,
               version: int | None = None) -> Schema:
    """Look an op up; unknown ops of our domains raise GraphError SCH-1 listing the known ones.

    Domain "" (or "ai.onnx") gives the standard ONNX op's adapter as standard opset ``version`` defines it (geir's
    default opset when None), with ``outputs`` outputs for an op whose output count varies per node (Split); ONNX's
    other domains (``ai.onnx.ml``, ...) likewise at their newest opset when None. An op of any other domain (ONNX
    Runtime's ``com.microsoft``, say) gets the adapter of ops geir knows only by the types a file declares
    (``ir._foreign``).
    """
    if domain == "ai.onnx":
        domain = ""
    found = SCHEMAS.get((domain, op_type))
    if found is not None:
        return found
    from ._standard import ONNX_DOMAINS, standard_schema

    if domain in ONNX_DOMAINS:
        if version is None:
            version = OPSET if domain == "" else ONNX_DOMAINS[domain]
        return standard_schema(op_type, outputs, version, domain)
    if domain not in {d for d, _ in SCHEMAS} | {"ai.cann"}:   # ours even before a family registers (CANN_DOMAIN)
        from ._foreign import foreign_schema

        return foreign_schema(op_type, domain, outputs, version)
    known = ", ".join(sorted(op for d, op in SCHEMAS if d == domain)) or "none"
    where = f" '{node}'" if node else ""
    raise GraphError(f"[SCH-1] {op_type}{where}: op type: expected an op of domain '{domain}' ({known}), got unknown "
                     f"op '{op_type}'", rule="SCH-1", node=node)


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
    return list(SCHEMAS.values())

