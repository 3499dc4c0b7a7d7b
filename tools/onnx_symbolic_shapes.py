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
import re
from typing import Any

import numpy as np
from onnx import ModelProto

from ..ir._core import Graph
from ..ir._types import TensorType

__all__ = ["SYMBOLIC_INTEGER_ELEMENTS", "SYMBOLIC_NODES", "symbolic_value_infos", "tied_to_inputs", "worth_inferring"]

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


_SYMBOLIC_TRUSTED = frozenset({"Reshape", "Gather", "GatherND", "Unsqueeze", "Squeeze", "Expand", "Range", "Concat",
                               "Slice", "Transpose", "Flatten", "Cast", "ConstantOfShape", "Tile", "MatMul", "TopK",
                               "ScatterElements", "Softmax", "Add", "Sub", "Mul", "Div", "Neg", "Where", "And", "Or",
                               "Not", "Equal", "Less", "LessOrEqual", "Greater", "GreaterOrEqual"})
"""Ops whose outputs take symbolic inference's dims: the shape plumbing exporters write and its elementwise users. Not
Split: the tool has given its pieces wrong sizes (ONNX's own RotaryEmbedding function, rotary_embedding tests)."""


def tied_to_inputs(graph: Graph, known: dict[str, TensorType], symbolic: dict[str, TensorType]
                    ) -> dict[str, TensorType]:
    """``known`` with the dims symbolic inference gives where geir's own inference has a size of its own (a fresh
    symbol): a size, or an expression of the inputs' symbols (``s``, ``2*b*s``), for the outputs of the ops in
    ``_SYMBOLIC_TRUSTED``; never over a size or an input's symbol geir already has, nor a name the tool made up
    where it could not tie a dim."""
    inputs = _input_symbols(graph)
    ours = {v.name: v for v in graph.values()}

    def tied(dim: object) -> bool:
        return isinstance(dim, int) or set(re.findall(r"[A-Za-z_]\w*", str(dim))) <= inputs

    for name, found in symbolic.items():       # a size the tool contradicts: it got the graph wrong somewhere
        value = ours.get(name)
        for other in (value.type if value is not None else None, known.get(name)):
            if other is not None and other.dims is not None and len(other.dims) == len(found.dims) and any(
                    isinstance(m, int) and isinstance(d, int) and m != d for m, d in zip(other.dims, found.dims)):
                return known
    merged = dict(known)
    for name, found in symbolic.items():
        value, before = ours.get(name), known.get(name)
        mine = value.type if value is not None else None
        if mine is None or value.producer is None or value.producer.op_type not in _SYMBOLIC_TRUSTED or \
                mine.dims is None or len(mine.dims) != len(found.dims) or mine.dtype is not found.dtype:
            continue
        base = before.dims if before is not None and before.dims is not None and \
            len(before.dims) == len(found.dims) else mine.dims
        dims = tuple(d if tied(d) and isinstance(m, str) and m not in inputs else b
                     for d, m, b in zip(found.dims, mine.dims, base))
        if dims != tuple(base):
            merged[name] = TensorType(found.dtype, dims)
    return merged


def _has_fresh_symbols(graph: Graph) -> bool:
    """Whether a value has a dim of unknown size that is none of the inputs' symbols (or an unknown rank): a size
    computed in the graph, which symbolic inference may tie to the inputs' symbols."""
    inputs = _input_symbols(graph)
    return any(v.type.dims is None or any(isinstance(d, str) and d not in inputs for d in v.type.dims)
               for v in graph.values() if v.type.is_tensor)


SYMBOLIC_INTEGER_ELEMENTS = 1 << 20
"""Largest integer tensor a node may compute for symbolic inference to run: the tool evaluates integer values it can
(shape computations), and would materialise a huge ConstantOfShape of a hostile file."""


def _small_integer_values(graph: Graph) -> bool:
    """Whether no node computes an integer tensor of more than ``SYMBOLIC_INTEGER_ELEMENTS`` elements."""
    return all(v.type.dims is None or not v.type.is_static or v.type.dtype.numpy.kind not in "iub"
               or int(np.prod(v.type.dims)) <= SYMBOLIC_INTEGER_ELEMENTS for v in graph.values()
               if v.type.is_tensor and v.producer is not None)


def worth_inferring(graph: Graph) -> bool:
    """Whether symbolic inference may tie a size of ``graph`` (it has fresh symbols) and may safely run on it."""
    return _has_fresh_symbols(graph) and _small_integer_values(graph)


def _input_symbols(graph: Graph) -> set[str]:
    return {d for v in graph.inputs if v.type.dims is not None for d in v.type.dims if isinstance(d, str)}
