"""``geir.torch`` without importing torch on ``import geir``: the name resolves to ``geir.tools.torch`` on first
use, through ``import geir.torch`` (a finder for that one name) or ``geir.torch`` (the package's ``__getattr__``)."""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import sys
from types import ModuleType

__all__ = ["install", "load"]

_TARGET = ".tools.torch"


def load(package: str) -> ModuleType:
    """Import the PyTorch front door and register it as ``<package>.torch`` too (the same module object)."""
    module = importlib.import_module(_TARGET, package)
    sys.modules.setdefault(package + ".torch", module)
    return module


class _Alias(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def __init__(self, package: str) -> None:
        self.name = package + ".torch"
        self.package = package

    def find_spec(self, fullname: str, path: object = None,
                  target: object = None) -> importlib.machinery.ModuleSpec | None:
        return importlib.machinery.ModuleSpec(fullname, self) if fullname == self.name else None

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType:
        return load(self.package)

    def exec_module(self, module: ModuleType) -> None:
        """Already executed by ``load``."""


def install(package: str) -> None:
    """Let ``import <package>.torch`` load the front door (once per process)."""
    if not any(isinstance(f, _Alias) and f.name == package + ".torch" for f in sys.meta_path):
        sys.meta_path.append(_Alias(package))
