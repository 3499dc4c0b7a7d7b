"""The NumPy runtime: the shared node-by-node interpreter with this package's kernels.

Our ops run on the kernels registered with ``@kernel``; standard ONNX ops on onnx.reference's
(``_standard``), whose results the interpreter never treats as its own buffers.
"""

from __future__ import annotations

from ...ir._core import Graph, Node

from .._compiled import compiled_once
from .._interpreter import InterpretedExecutable, NodeKernel
from .._kernels import kernel_for
from ._arrays import NUMPY
from ._standard import standard_kernel
from ...ir._standard import ONNX_DOMAINS

__all__ = ["NumpyExecutable", "NumpyRuntime"]


class NumpyRuntime:
    """Reference runtime: NumPy kernels, float32 compute, one rounding per output."""

    name = "numpy"

    def compile(self, graph: Graph) -> NumpyExecutable:
        """One schedule per revision of a graph: compiling it again is free."""
        return compiled_once(graph, None, NumpyExecutable, self.name)


class NumpyExecutable(InterpretedExecutable):
    """A graph scheduled on the NumPy kernels (see ``InterpretedExecutable`` for the run contract)."""

    runtime_name = NumpyRuntime.name
    backend = NUMPY

    def resolve(self, node: Node) -> tuple[NodeKernel, bool] | None:
        kernel = kernel_for(self.backend, node.domain, node.op_type)
        if kernel is not None:
            return kernel, True
        if node.domain in ONNX_DOMAINS:     # the standard domain and ONNX's others (ai.onnx.ml, ...)
            return standard_kernel(node), False
        return None
