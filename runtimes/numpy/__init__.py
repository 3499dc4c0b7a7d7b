"""The NumPy runtime: an interpreter over plain-array kernels, one module per op family."""

from __future__ import annotations

from . import moe, rotary, sparse_attention  # noqa: F401  (each module registers its kernels)
from ._interpreter import NumpyExecutable, NumpyRuntime
from ._kernels import KERNELS

__all__ = ["KERNELS", "NumpyExecutable", "NumpyRuntime"]
