"""The NumPy runtime: an interpreter over plain-array kernels, one module per op family."""

from __future__ import annotations

from ...ir._registry import import_families
from ._interpreter import NumpyExecutable, NumpyRuntime
from ._kernels import KERNELS

KERNEL_MODULES = import_families(__name__, __path__)
"""The kernel modules found here, one per op family (each registers its kernels with @kernel)."""

__all__ = ["KERNELS", "KERNEL_MODULES", "NumpyExecutable", "NumpyRuntime"]
