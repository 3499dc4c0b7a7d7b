"""The NumPy runtime: an interpreter over plain-array kernels, one module per op family."""

from __future__ import annotations

from ._interpreter import NumpyExecutable, NumpyRuntime
from ._kernels import KERNELS

__all__ = ["KERNELS", "NumpyExecutable", "NumpyRuntime"]
