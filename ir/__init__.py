"""geir.ir: the core (dtypes, tensor types with symbolic dims, values, nodes, graphs, errors) and the
frontends over it (GraphBuilder, ONNX import and export, the run/check facade). The core modules
import nothing from schemas, passes or runtimes; the frontends do, and say so."""

from __future__ import annotations
