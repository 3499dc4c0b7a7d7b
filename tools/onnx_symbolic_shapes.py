"""Symbolic shapes of an ONNX model by exact data propagation: ONNX Runtime's symbolic shape inference.

Exporters compute shapes inside the graph (``Shape`` -> ``Gather`` -> ``Range`` -> a table sliced to the sequence
length). ONNX's own inference names every such dim anew (``unk__7``), so nothing ties a rotary table's length to
the input's sequence and a fusion rule must take them for different sizes. ONNX Runtime's tool propagates these
computations symbolically (with sympy) and names the dim ``s``, or ``2*b*s``. It runs here with ``auto_merge`` off,
so it never assumes two symbols equal (a broadcast of two different symbols stays unknown), and what it derives is
a claim the runtimes check again on the fed shapes (``ir._types.refine``).

Its public entry point writes ``sym_shape_infer_temp.onnx`` into the working directory when inference is
incomplete and raises; geir drives the same steps itself, keeps what was derived, writes nothing, and silences the
tool's log. Without sympy or the tool (an older onnxruntime), or on any failure, it derives nothing.
"""

from __future__ import annotations

import logging
from typing import Any

from onnx import ModelProto

__all__ = ["SYMBOLIC_NODES", "symbolic_value_infos"]

SYMBOLIC_NODES = 20_000
"""Models with more nodes are not inferred (the tool is Python per node; the import stays linear in the size)."""


def symbolic_value_infos(model: ModelProto) -> list[Any]:
    """The ValueInfoProtos (value_info and outputs) ONNX Runtime's symbolic inference derives for ``model``, or []."""
    if len(model.graph.node) > SYMBOLIC_NODES:
        return []
    log = logging.getLogger("onnxruntime.tools.symbolic_shape_infer")
    try:
        from onnxruntime.tools.symbolic_shape_infer import SymbolicShapeInference
    except Exception:                     # no sympy, or an onnxruntime without the tool
        return []
    previous, log.disabled = log.disabled, True
    try:
        inference = SymbolicShapeInference(2**31 - 1, False, False, 0)
        inference._preprocess(model)
        while inference.run_:
            inference._infer_impl()
        inference._update_output_from_vi()
        graph = inference.out_mp_.graph
        return [*graph.value_info, *graph.output]
    except Exception:                     # a model the tool does not handle: nothing derived
        return []
    finally:
        log.disabled = previous
