"""Standard ONNX ops on the NumPy runtime: the ``onnx`` package's own reference kernels, except Slice,
GatherElements, Erf and Mean.

onnx.reference's Slice applies Python's slice rules to the raw starts and ends, which differ from ONNX's
clamping with negative steps (it selects nothing where ONNX Runtime selects index 0); Slice runs on
``schemas.onnx_slice``, the one statement of ONNX's rules that the VJP and the reference use too.
onnx.reference's GatherElements (``np.choose`` with ``mode="wrap"``) wraps an out-of-range index silently and
fails on an index smaller than the data in other axes (every BERT export's position ids); it runs on
``_gather_elements_kernel``. onnx.reference's Erf rounds to float32 whatever its input; ``Erf`` and ``Gelu`` keep the
input's precision (the float64 reference differentiates it). Its Mean fails on broadcasting operands whose first
is not the largest.

A node runs at its own opset (``Node.version``). onnx.reference implements a few ops only as their newest
definition, which means something else at older opsets (``REFERENCE_ONLY_SINCE``): such a node is lifted to that
definition by ``onnx.version_converter`` first, or refused where the converter cannot keep its meaning.
"""

from __future__ import annotations

from collections.abc import Callable

import math

import numpy as np
from onnx import helper, version_converter
from onnx.reference import ReferenceEvaluator
from onnx.reference.op_run import OpRun
from onnx.reference.ops._op import OpRunUnaryNum
from onnx.reference.ops.op_loop import Loop as _ReferenceLoop

from ...ir._core import Node
from ...ir._errors import ExecutionError, GraphError
from ...ir._onnx_types import value_info
from ...ir._subgraphs import captured_names, rename_captures
from ...schemas import OPSET
from ...schemas.onnx_slice import SliceError, slice_index
from .._checks import describe

__all__ = ["standard_kernel"]

_SLICE_OPERANDS = ("starts", "ends", "axes", "steps")


def _slice_kernel(node: Node) -> Callable[..., tuple[np.ndarray]]:
    """Slice (opset >= 10: starts, ends, axes and steps are inputs) with ONNX's clamping; the result is a view."""

    def run(data: np.ndarray, *operands: np.ndarray | None, **_: object) -> tuple[np.ndarray]:
        lists: list[list[int] | None] = []
        for name, operand in zip(_SLICE_OPERANDS, operands):
            if operand is not None and np.ndim(operand) != 1:
                raise ExecutionError(f"{describe(node)}: input '{name}': expected a 1-D tensor, got shape "
                                     f"{list(np.shape(operand))}", node=node.name)
            lists.append(None if operand is None else [int(v) for v in operand])
        lists += [None] * (len(_SLICE_OPERANDS) - len(lists))
        try:
            index = slice_index(data.shape, lists[0] or [], lists[1] or [], lists[2], lists[3])
        except SliceError as exc:
            raise ExecutionError(f"{describe(node)}: {exc} (data shape {list(data.shape)})", node=node.name) from None
        return (data[index],)

    return run


def _gather_elements_kernel(node: Node) -> Callable[..., tuple[np.ndarray]]:
    """GatherElements as ONNX defines it: ``out[i][j] = data[index[i][j]][j]`` (axis 0), an index of the data's rank
    no larger than the data in the other axes, negative indices counted from the end, any other index out of range
    an ExecutionError."""
    axis_attribute = int(node.attributes.get("axis", 0))

    def run(data: np.ndarray, index: np.ndarray, **_: object) -> tuple[np.ndarray]:
        rank = data.ndim
        if index.ndim != rank or not -rank <= axis_attribute < max(rank, 1):
            raise ExecutionError(f"{describe(node)}: expected indices of the data's rank {rank} and an axis in "
                                 f"[{-rank}, {rank}), got rank {index.ndim} and axis {axis_attribute}", node=node.name)
        axis = axis_attribute % rank
        if any(k != axis and i > d for k, (i, d) in enumerate(zip(index.shape, data.shape))):
            raise ExecutionError(f"{describe(node)}: input 'indices' shape {list(index.shape)}: expected at most the "
                                 f"data's {list(data.shape)} in every axis but {axis}", node=node.name)
        size = data.shape[axis]
        if index.size and (index.min() < -size or index.max() >= size):
            bad = index[(index < -size) | (index >= size)].flat[0]
            raise ExecutionError(f"{describe(node)}: input 'indices': expected values in [{-size}, {size - 1}] (axis "
                                 f"{axis} of the data), got {int(bad)}", node=node.name)
        window = tuple(slice(None) if k == axis else slice(0, n) for k, n in enumerate(index.shape))
        return (np.take_along_axis(data[window], np.where(index < 0, index + size, index).astype(np.intp), axis),)

    return run


class Loop(_ReferenceLoop):
    """onnx.reference's Loop, its scan outputs stacked along a new first axis as ONNX says (and ONNX Runtime does):
    onnx.reference ``np.vstack``s them, which concatenates the iterations' values along their own first axis."""

    op_domain = ""

    def _run(self, *args, **kwargs):
        body, seen = self._run_body, []     # OpRun sets _run_body on the instance: wrap it to see each iteration

        def iteration(*a, **k):
            outputs = body(*a, **k)
            seen.append([np.shape(o) for o in outputs[len(outputs) - self.K:]] if self.K else [])
            return outputs

        self._run_body = iteration
        try:
            results = list(super()._run(*args, **kwargs))
        finally:
            self._run_body = body
        for k, shape in enumerate(seen[-1] if seen else []):
            at = len(self.body.output_names) - 1 - self.K + k
            results[at] = np.reshape(results[at], (len(seen),) + tuple(shape))
        return tuple(results)


class Erf(OpRunUnaryNum):
    """Erf in the input's precision: onnx.reference computes it in float32 whatever the input (a float64 reference
    4 % off in central differences of it, and of Gelu, whose function body it runs)."""

    op_domain = ""
    _erf = np.vectorize(math.erf, otypes=[np.float64])

    def _run(self, x):
        return (np.asarray(self._erf(x)).astype(x.dtype),)


class Gelu(OpRun):
    """Gelu (opset 20) in the input's precision: onnx.reference runs its function body, whose Erf is float32."""

    op_domain = ""

    def _run(self, x, approximate="none"):
        wide = np.asarray(x, np.float64)
        if approximate == "tanh":
            inner = math.sqrt(2.0 / math.pi) * (wide + 0.044715 * wide ** 3)
            result = 0.5 * wide * (1.0 + np.tanh(inner))
        else:
            result = 0.5 * wide * (1.0 + Erf._erf(wide / math.sqrt(2.0)))
        return (result.astype(x.dtype),)


class Mean(OpRun):
    """Mean of broadcasting operands: onnx.reference adds them into a copy of the first, which fails where the first
    is the smaller one."""

    op_domain = ""

    def _run(self, *args):
        return ((np.add.reduce(np.broadcast_arrays(*args)) / len(args)).astype(args[0].dtype),)


_OWN_KERNELS = {"Loop": [Loop], "Erf": [Erf], "Gelu": [Gelu], "Mean": [Mean]}
"""onnx.reference's kernels replaced by ours, by op type."""


REFERENCE_ONLY_SINCE: dict[str, tuple[int, bool]] = {
    "Softmax": (13, True), "LogSoftmax": (13, True), "Hardmax": (13, True),   # 13: one axis, no 2-D coercion
    "Resize": (11, True),      # 11 added the roi input before scales
    "Upsample": (9, True),     # 9 made scales an input
    "Scan": (9, False),        # 9 dropped the batch axis; the converter drops it too instead of unrolling it
}
"""Ops whose older definitions onnx.reference runs with its newest semantics: (the opset that definition starts at,
whether ``onnx.version_converter`` lifts an older node to it exactly)."""


def _lift(model, node: Node, opset: int):
    """``model`` (one node of standard opset ``opset``) as onnx.reference can run it exactly."""
    since, exact = REFERENCE_ONLY_SINCE.get(node.op_type, (0, True))
    if opset >= since:
        return model
    if not exact:
        raise GraphError(f"{describe(node)}: {node.op_type} of opset {opset} is not run by onnx.reference (it runs "
                         f"{node.op_type}-{since}'s meaning), and onnx's version converter does not keep its "
                         f"meaning; run this graph on the onnxruntime runtime", node=node.name)
    try:
        return version_converter.convert_version(model, since)
    except Exception as exc:   # the converter raises several types; all mean the same for the user
        raise GraphError(f"{describe(node)}: {node.op_type} of opset {opset} is not run by onnx.reference (it runs "
                         f"{node.op_type}-{since}'s meaning), and onnx's version converter cannot lift it: "
                         f"{type(exc).__name__}: {exc}", node=node.name) from None


def standard_kernel(node: Node) -> Callable[..., tuple[np.ndarray | None, ...]]:
    """A kernel running one standard node through ``onnx.reference.ReferenceEvaluator`` (Slice: ONNX's rules)."""
    if node.domain == "" and node.op_type == "Slice" and not node.attributes:   # Slice-1: bounds in attributes
        return _slice_kernel(node)
    if node.domain == "" and node.op_type == "GatherElements":
        return _gather_elements_kernel(node)
    captured = captured_names(node.attributes)      # what its subgraphs read of enclosing scopes: inputs after the op's
    formal = len(node.inputs) - len(captured)
    inputs = [f"in{i}" if v is not None else "" for i, v in enumerate(node.inputs)]
    outputs = [f"out{i}" if v is not None else "" for i, v in enumerate(node.outputs)]
    attributes = rename_captures(node.attributes, dict(zip(captured, inputs[formal:])))
    proto = helper.make_node(node.op_type, inputs[:formal], outputs, domain=node.domain, **attributes)
    graph = helper.make_graph([proto], node.name,
                              [value_info(n, v.type) for n, v in zip(inputs, node.inputs) if v is not None],
                              [value_info(n, v.type) for n, v in zip(outputs, node.outputs) if v is not None])
    opset = OPSET if node.version is None else node.version
    imports = [helper.make_opsetid(node.domain, opset)] + ([helper.make_opsetid("", OPSET)] if node.domain else [])
    model = _lift(helper.make_model(graph, opset_imports=imports), node, opset)
    evaluator = ReferenceEvaluator(model, new_ops=_OWN_KERNELS.get(node.op_type) if node.domain == "" else None)
    wanted = [n for n in outputs if n]

    # Dropout before opset 10 gives its mask in the data's type; onnx.reference gives it as bool at every opset
    as_declared = {1} if node.op_type == "Dropout" and opset < 10 and len(outputs) > 1 and outputs[1] else set()

    def run(*args: np.ndarray | None, **_: object) -> tuple[np.ndarray | None, ...]:
        results = dict(zip(wanted, evaluator.run(wanted, {n: a for n, a in zip(inputs, args) if n})))
        # the interpreter never owns what this returns (it may be an input or a cached array)
        arrays = [None if not n else results[n] if isinstance(results[n], list) or results[n] is None
                  else np.asarray(results[n]) for n in outputs]     # a sequence is a list, an empty optional None
        for k in as_declared:
            arrays[k] = arrays[k].astype(node.outputs[k].type.dtype.numpy)   # type: ignore[union-attr]
        return tuple(arrays)

    return run
