"""The repository root is the geir package: imported once, as geir, never again as a test package."""

from __future__ import annotations

import sys
from pathlib import Path

import geir


def test_the_root_package_is_imported_once_and_only_as_geir():
    root_init = (Path(__file__).parents[1] / "__init__.py").resolve()
    holders = [name for name, module in list(sys.modules.items())
               if getattr(module, "__file__", None) and Path(module.__file__).resolve() == root_init]
    assert holders == ["geir"]
    assert Path(geir.__file__).resolve() == root_init
