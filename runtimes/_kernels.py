"""The kernel registry of every runtime that runs nodes on kernels: (backend, domain, op type) -> kernel.

A runtime's kernel modules register into it under their backend's name (``ArrayBackend.name``: "numpy", later
"torch"), each op at most once per backend; an interpreter asks it for the kernel of a node. The calling convention
is ``runtimes._interpreter.NodeKernel``'s: the node's inputs positionally (None for absent ones), its attributes
by keyword, ``out=`` for an aliased output and, when the kernel takes it, ``outputs=`` (the caller's buffers).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from ..ir._registry import Slot
from ._arrays import ArrayBackend

__all__ = ["Kernel", "kernel_for", "kernel_table", "register_kernel"]

Kernel = Callable[..., object]

_TABLES: dict[str, Slot[Kernel]] = {}
"""Backend name -> its slot of the one registry (``ir._registry``)."""


def _name(backend: ArrayBackend[Any] | str) -> str:
    return backend if isinstance(backend, str) else backend.name


def kernel_table(backend: ArrayBackend[Any] | str) -> Slot[Kernel]:
    """The live table of ``backend``'s kernels, (domain, op type) -> kernel (made empty on first use). Reading it
    is ``kernel_for``; tests may patch an entry in it."""
    name = _name(backend)
    if name not in _TABLES:
        _TABLES[name] = Slot(f"{name} kernels")
    return _TABLES[name]


def register_kernel(backend: ArrayBackend[Any] | str, domain: str, op_type: str, fn: Kernel) -> Kernel:
    """Register ``fn`` as ``backend``'s kernel of ``domain::op_type``; returns ``fn``.

    Raises ValueError naming the key when that backend already has a kernel for the op (two modules claiming
    one op is a defect, never a silent override)."""
    return kernel_table(backend).register(domain, op_type, fn)


def kernel_for(backend: ArrayBackend[Any] | str, domain: str, op_type: str) -> Kernel | None:
    """``backend``'s kernel of ``domain::op_type``, or None when it has none."""
    table = _TABLES.get(_name(backend))
    return None if table is None else table.get((domain, op_type))
