"""``reference(graph, feeds)``: the float64 golden of any geir graph.

Every floating feed is widened to float64 and every node runs on float64 arrays without an
intermediate rounding: our ops on their NumPy kernels (which compute in float64 when given float64,
the hook the tests use), standard ops on onnx.reference (a Cast to a floating type keeps float64).
Each output is rounded once, to its declared dtype. The feed checks and the data rules of the
runtimes apply, so bad data is the same ExecutionError here.
"""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np

from ...ir._core import Graph
from ...ir._errors import ExecutionError, GraphError
from ...passes import live_nodes
from ...runtimes._checks import describe, validate_node_data
from ...runtimes._feeds import validate_feeds
from ...runtimes.numpy._kernels import kernel_for
from ...runtimes.numpy._standard import standard_kernel

__all__ = ["reference"]

_FLOAT_CASTS = ("Cast", "CastLike")


def _widen(array: np.ndarray | None) -> np.ndarray | None:
    if array is None or array.dtype.kind != "f" and array.dtype.name != "bfloat16":
        return array
    return array.astype(np.float64)


def reference(graph: Graph, feeds: Mapping[str, np.ndarray], rounded: bool = True) -> dict[str, np.ndarray]:
    """The graph's outputs computed in float64, each rounded once to its declared dtype.

    With ``rounded=False`` the outputs stay float64 and a floating input may also be fed a float64 array,
    used exactly as given (finite differences need perturbations finer than the input dtype); its shape and
    every other check still apply.
    """
    if not {"verified", "typed"} <= graph.properties:
        raise GraphError(f"graph '{graph.name}' is not built; call GraphBuilder.build() first")
    exact: dict[str, np.ndarray] = {}
    if not rounded and isinstance(feeds, Mapping):
        declared = {v.name: v.dtype for v in graph.inputs}
        exact = {k: np.asarray(v) for k, v in feeds.items() if isinstance(v, (np.ndarray, np.float64))
                 and v.dtype == np.float64 and k in declared and declared[k].is_floating}   # 0-d arithmetic: a scalar
        feeds = {k: (v.astype(declared[k].numpy) if k in exact else v) for k, v in feeds.items()}
    env, _ = validate_feeds(graph, feeds)
    env = {name: exact[name] if name in exact else _widen(array) for name, array in env.items()}
    env.update({name: _widen(array) for name, array in graph.constants.items()})
    live = live_nodes(graph)
    for node in graph.topological_order():
        if node not in live:
            continue
        args = [env[v.name] if v is not None else None for v in node.inputs]
        validate_node_data(node, args)
        try:
            results = _evaluate(node, args)
        except ExecutionError:
            raise
        except Exception as exc:
            raise ExecutionError(f"While computing the float64 reference of {describe(node)}: {type(exc).__name__}: "
                                 f"{exc}", node=node.name) from exc
        for value, array in zip(node.outputs, results if isinstance(results, tuple) else (results,)):
            if value is not None:
                narrower = value.dtype.is_floating and getattr(array, "dtype", None) != np.float64
                env[value.name] = _widen(array) if narrower else array      # a Constant node's float32, say
    if not rounded:
        return {v.name: np.array(env[v.name]) for v in graph.outputs}
    return {v.name: np.asarray(env[v.name]).astype(v.dtype.numpy) for v in graph.outputs}


def _evaluate(node, args):
    kernel = kernel_for(node.schema)
    if kernel is not None:
        return kernel(*args, **node.attributes)
    if node.op_type in _FLOAT_CASTS and node.outputs[0].dtype.is_floating:   # a cast to a floating type: float64
        return args[0].astype(np.float64)
    return standard_kernel(node)(*args)
