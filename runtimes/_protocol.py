"""The Runtime protocol and the registry of runtimes by name."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Protocol

from ..ir._core import Graph

from ._arrays import Array

__all__ = ["Executable", "Runtime", "get_runtime", "register_runtime", "runtime_names"]


class Executable(Protocol):
    """A graph compiled for one runtime."""

    def run(self, feeds: Mapping[str, object], outputs: Mapping[str, object] | None = None) -> dict[str, Array]:
        """Run on the given inputs; return the graph outputs by name (arrays of the runtime's array backend, NumPy
        arrays for "numpy" and "onnxruntime"). Feeds are never modified (except a feed the caller passes as the
        output buffer of an in-place op). ``outputs`` are caller-provided buffers (see ``runtimes._outputs``),
        written and returned as those outputs."""
        ...


class Runtime(Protocol):
    name: str

    def compile(self, graph: Graph) -> Executable: ...


_FACTORIES: dict[str, Callable[[], Runtime]] = {}


def register_runtime(name: str, factory: Callable[[], Runtime]) -> None:
    _FACTORIES[name] = factory


def runtime_names() -> list[str]:
    return sorted(_FACTORIES)


def get_runtime(name: str) -> Runtime:
    try:
        return _FACTORIES[name]()
    except KeyError:
        raise ValueError(f"unknown runtime {name!r}: expected one of {', '.join(runtime_names())}") from None
