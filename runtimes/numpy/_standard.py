"""Standard ONNX ops on the NumPy runtime: the ``onnx`` package's own reference kernels."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
from onnx import helper
from onnx.reference import ReferenceEvaluator

from ...ir._core import Node
from ...ir._onnx_types import value_info
from ...schemas import OPSET

__all__ = ["standard_kernel"]


def standard_kernel(node: Node) -> Callable[..., tuple[np.ndarray | None, ...]]:
    """A kernel running one standard node through ``onnx.reference.ReferenceEvaluator``."""
    inputs = [f"in{i}" if v is not None else "" for i, v in enumerate(node.inputs)]
    outputs = [f"out{i}" if v is not None else "" for i, v in enumerate(node.outputs)]
    proto = helper.make_node(node.op_type, inputs, outputs, **node.attributes)
    graph = helper.make_graph([proto], node.name,
                              [value_info(n, v.type) for n, v in zip(inputs, node.inputs) if v is not None],
                              [value_info(n, v.type) for n, v in zip(outputs, node.outputs) if v is not None])
    evaluator = ReferenceEvaluator(helper.make_model(graph, opset_imports=[helper.make_opsetid("", OPSET)]))
    wanted = [n for n in outputs if n]

    def run(*args: np.ndarray | None, **_: object) -> tuple[np.ndarray | None, ...]:
        results = dict(zip(wanted, evaluator.run(wanted, {n: a for n, a in zip(inputs, args) if n})))
        # the interpreter never owns what this returns (it may be an input or a cached array)
        return tuple(None if not n else np.asarray(results[n]) for n in outputs)

    return run
