"""``geir.ge``: CANN's graph-mode (GE IR) call path in Python, generated from the schemas.

A test written like CANN's ``test_geir_*.cpp`` examples (``op::Data`` inputs with tensor descs, ops
built by chained ``set_input_*``/``set_attr_*`` calls, ``Graph.SetInputs/SetOutputs``, a ``Session``
that adds and runs the graph) runs here on either geir runtime. A frontend over the builder: every
schema rule and error applies. ``Graph.to_geir()`` / ``Graph.from_geir(g)`` convert both ways.
"""

from __future__ import annotations

from ._graph import Graph
from . import op
from ._operator import Operator
from ._session import (GEFinalize, GEGetErrorMsgV2, GEGetWarningMsgV2, GEInitialize, GEIR_OPTIONS, Session,
                       aclgrphDumpGraph)
from ._tensor import (DT_BF16, DT_BOOL, DT_DOUBLE, DT_FLOAT, DT_FLOAT16, DT_INT8, DT_INT16, DT_INT32, DT_INT64,
                      DT_UINT8, DT_UINT16, DT_UINT32, DT_UINT64, FAILED, FORMAT_NCHW, FORMAT_ND, FORMAT_NHWC, SUCCESS,
                      UNKNOWN_DIM, Shape, Tensor, TensorDesc)

__all__ = [
    "DT_BF16", "DT_BOOL", "DT_DOUBLE", "DT_FLOAT", "DT_FLOAT16", "DT_INT16", "DT_INT32", "DT_INT64", "DT_INT8",
    "DT_UINT16", "DT_UINT32", "DT_UINT64", "DT_UINT8", "FAILED", "FORMAT_NCHW", "FORMAT_ND", "FORMAT_NHWC",
    "GEFinalize", "GEGetErrorMsgV2", "GEGetWarningMsgV2", "GEIR_OPTIONS", "GEInitialize", "Graph", "Operator",
    "SUCCESS", "Session", "Shape", "Tensor", "TensorDesc", "UNKNOWN_DIM", "aclgrphDumpGraph", "op",
]
