"""geir: a graph IR compiler and executor for CANN ops-transformer training operators.

Build graphs with ``GraphBuilder``, run them with ``run`` on the NumPy runtime, and check
them against a device with ``check``. See the project README for a tour.
"""

from __future__ import annotations

import sys
from typing import TYPE_CHECKING

from .ir._dtypes import DType, as_dtype
from .ir._errors import ExecutionError, GeirWarning, GraphError, SourceLocation
from .ir._types import Dim, SymbolTable, TensorType
from .ir._core import Graph, Node, Value
from .ir._onnx_export import save_onnx, to_onnx
from .schemas.moe import indices as moe_indices
from .tools.builder import GraphBuilder
from .passes import CheckReport, Violation          # what check() returns, for annotations
from .passes.fusion import FusionReport             # what fuse() returns beside the graph
from .passes.target_forms import GradReport         # what grad(..., report=True) returns beside it
from .tools.facade import check, fuse, grad, run
from .tools.onnx_import import from_onnx, load_onnx
from .tools import aclnn, ge

from .ir._onnx_schemas import register_onnx_schemas

register_onnx_schemas()   # ONNX tools (checker, shape inference) know our ops once geir is imported

from .tools import backend, lazy_torch, testing

sys.modules.setdefault(__name__ + ".ge", ge)   # ``import geir.ge`` as well as ``from geir import ge``
sys.modules.setdefault(__name__ + ".ge.op", ge.op)   # ``import geir.ge.op`` too: the same module, not a copy
sys.modules.setdefault(__name__ + ".aclnn", aclnn)   # ``import geir.aclnn``: CANN's single-op API
sys.modules.setdefault(__name__ + ".testing", testing)
sys.modules.setdefault(__name__ + ".backend", backend)   # ONNX's backend interface: ``import geir.backend``
lazy_torch.install(__name__)   # ``import geir.torch``: the PyTorch front door, loaded (with torch) only then


if not TYPE_CHECKING:   # hidden from type checkers: a module __getattr__ would make every unknown name legal
    def __getattr__(name: str) -> object:
        """``geir.torch`` on first access imports the PyTorch front door (``tools/torch``); ``import geir`` does
        not."""
        if name == "torch":
            return lazy_torch.load(__name__)
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


float32 = DType.FLOAT32
float16 = DType.FLOAT16
bfloat16 = DType.BFLOAT16
int32 = DType.INT32
int64 = DType.INT64
bool_ = DType.BOOL

__all__ = [
    "CheckReport",
    "DType",
    "Dim",
    "ExecutionError",
    "FusionReport",
    "GeirWarning",
    "GradReport",
    "Graph",
    "GraphBuilder",
    "GraphError",
    "Node",
    "SourceLocation",
    "SymbolTable",
    "TensorType",
    "Value",
    "Violation",
    "aclnn",
    "as_dtype",
    "backend",
    "bfloat16",
    "bool_",
    "check",
    "float16",
    "float32",
    "from_onnx",
    "fuse",
    "ge",
    "grad",
    "int32",
    "int64",
    "load_onnx",
    "moe_indices",
    "run",
    "save_onnx",
    "testing",
    "to_onnx",
]
