"""The two phases every aclnn API shares: ``prepare`` (phase one: check the arguments, build and check the op's
graph for the device, report the workspace and an executor) and ``execute`` (phase two: run the executor on a
stream and write the outputs through the caller's tensors).

Phase one answers as CANN's API does: a null required tensor is ``ACLNN_ERR_PARAM_NULLPTR``; a data type,
format, layout in memory or output shape it does not take is ``ACLNN_ERR_PARAM_INVALID``; a rule of the op (the
contract's ``..-S#``, or a ``..-T#`` of the chosen device) is the status ``StatusRules`` gives it, the op's
documented one. Each failure keeps its message (naming the parameter and the rule) for ``aclGetRecentErrMsg``.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ...ir._core import Graph
from ...ir._dtypes import DType
from ...ir._errors import ExecutionError, GraphError
from ...ir._registry import get_schema
from ...ir._schema import OpSchema
from ...runtimes import Executable, get_runtime
from ..builder import GraphBuilder
from ..facade import check
from ._context import CONTEXT, DeviceBuffer, aclrtStream
from ._status import (ACLNN_ERR_INNER_TILING_ERROR, ACLNN_ERR_PARAM_INVALID, ACLNN_ERR_PARAM_NULLPTR,
                      ACLNN_ERR_RUNTIME_ERROR, ACLNN_SUCCESS, AclnnFailure, record_error)
from ._tensor import ACL_FORMAT_ND, aclIntArray, aclTensor, data_type_name, format_name

__all__ = ["StatusRules", "TensorArg", "aclDestroyAclOpExecutor", "aclOpExecutor", "aclSetAclOpExecutorRepeatable",
           "execute", "int_array", "prepare"]

_SCHEMA_RULES = {"SCH-2": ACLNN_ERR_PARAM_NULLPTR, "SCH-3": ACLNN_ERR_PARAM_INVALID,
                 "SCH-5": ACLNN_ERR_PARAM_INVALID, "SCH-6": ACLNN_ERR_PARAM_INVALID}


@dataclass(frozen=True)
class StatusRules:
    """Which status an API returns for a broken rule: ``codes`` by rule ID, else ``semantic`` for the contract's
    rules and ``device`` for a device's; ``skipped`` are device rules of the graph path this API does not have."""

    semantic: int = ACLNN_ERR_PARAM_INVALID
    device: int = ACLNN_ERR_INNER_TILING_ERROR
    codes: Mapping[str, int] = field(default_factory=dict)
    skipped: frozenset[str] = frozenset()

    def status(self, rule: str | None, on_device: bool) -> int:
        if rule is None:
            return ACLNN_ERR_PARAM_INVALID
        if rule in self.codes:
            return self.codes[rule]
        if rule in _SCHEMA_RULES:
            return _SCHEMA_RULES[rule]
        return self.device if on_device else self.semantic


@dataclass(frozen=True)
class TensorArg:
    """One tensor parameter: its aclnn name (messages), the schema's name, and what the API accepts there."""

    name: str
    key: str
    tensor: aclTensor | None
    required: bool = True
    strided: bool = False
    """A non-contiguous view is accepted (the docs' "支持非连续")."""
    written: bool = True
    """An output the call writes; False: checked for null and data type only (MoE grad's probsGradOut without
    probs, which CANN's op_api requires but its kernel never writes)."""
    dtypes: tuple[DType, ...] = ()
    """The data types taken here, where the op's schema does not say (an output never written); () for any."""


class aclOpExecutor:  # noqa: N801  (CANN's name)
    """What phase one made: the compiled op, the tensors it reads and writes, and its workspace size. It runs once
    unless ``aclSetAclOpExecutorRepeatable`` was called before its first run."""

    def __init__(self, api: str, executable: Executable | None, feeds: dict[str, aclTensor],
                 writes: dict[str, aclTensor], workspace_size: int) -> None:
        self.api = api
        self.executable = executable
        self.feeds = feeds
        self.writes = writes
        self.workspace_size = workspace_size
        self.repeatable = False
        self.runs = 0
        self.destroyed = False

    def __repr__(self) -> str:
        return f"aclOpExecutor({self.api}, workspace {self.workspace_size} bytes, runs {self.runs})"


def aclSetAclOpExecutorRepeatable(executor: aclOpExecutor | None) -> int:
    """Let ``executor`` run any number of times (until ``aclDestroyAclOpExecutor``)."""
    if executor is None:
        return record_error("aclSetAclOpExecutorRepeatable", AclnnFailure(
            ACLNN_ERR_PARAM_NULLPTR, "executor: expected the executor phase one returned, got a null pointer (None)"))
    if not isinstance(executor, aclOpExecutor) or executor.destroyed or executor.runs:
        return record_error("aclSetAclOpExecutorRepeatable", AclnnFailure(
            ACLNN_ERR_PARAM_INVALID, "executor: expected a live executor that has not run yet, got " + repr(executor)))
    executor.repeatable = True
    return ACLNN_SUCCESS


def aclDestroyAclOpExecutor(executor: aclOpExecutor | None) -> int:
    """Release a repeatable executor (a single-use one is released by its run, as in CANN)."""
    if executor is None:
        return ACLNN_ERR_PARAM_NULLPTR
    if isinstance(executor, aclOpExecutor):
        executor.destroyed = True
    return ACLNN_SUCCESS


def int_array(name: str, array: aclIntArray | None) -> tuple[int, ...] | None:
    """The values of an optional ``aclIntArray`` parameter (None for a null one)."""
    if array is None:
        return None
    if not isinstance(array, aclIntArray) or array.destroyed:
        raise AclnnFailure(ACLNN_ERR_PARAM_INVALID, f"{name}: expected a live aclIntArray, got {array!r}")
    return array.values


def _check_present(arg: TensorArg) -> None:
    if arg.tensor is None and arg.required:
        raise AclnnFailure(ACLNN_ERR_PARAM_NULLPTR, f"{arg.name}: expected a tensor, got a null pointer (None)")


def _check_tensor(arg: TensorArg) -> None:
    t = arg.tensor
    if t is None:
        return
    if not isinstance(t, aclTensor) or t.destroyed:
        raise AclnnFailure(ACLNN_ERR_PARAM_INVALID, f"{arg.name}: expected a live aclTensor, got {t!r}")
    if t.dtype is None or (arg.dtypes and t.dtype not in arg.dtypes):
        expected = f"; expected one of {', '.join(d.name.lower() for d in arg.dtypes)}" if arg.dtypes else ""
        raise AclnnFailure(ACLNN_ERR_PARAM_INVALID, f"{arg.name}: data type {data_type_name(t.data_type)} is "
                           f"not supported{expected}")
    if t.format != ACL_FORMAT_ND:
        raise AclnnFailure(ACLNN_ERR_PARAM_INVALID, f"{arg.name}: format: expected ACL_FORMAT_ND, got "
                           f"{format_name(t.format)}")
    if not arg.strided and not t.is_contiguous():
        raise AclnnFailure(ACLNN_ERR_PARAM_INVALID, f"{arg.name}: expected a contiguous tensor (this API does "
                           f"not take non-contiguous ones here), got shape {list(t.shape)} with strides "
                           f"{list(t.strides)}")


def _build(api: str, op_type: str, inputs: Sequence[TensorArg], attributes: Mapping[str, Any],
           outputs: Sequence[TensorArg]) -> Graph:
    schema = get_schema(op_type)
    assert isinstance(schema, OpSchema)
    b = GraphBuilder(api)
    given = {arg.key: arg.tensor for arg in inputs}
    values = []
    for spec in schema.inputs:
        t = given.get(spec.name)
        values.append(None if t is None else b.input(spec.name, t.dtype, t.shape))   # type: ignore[arg-type]
    result = b.add_node(schema, values, dict(attributes), name=api)
    results = result if isinstance(result, tuple) else (result,)
    for output, value in zip(schema.outputs, results):
        if value is not None:
            b.output(value, "out_" + output.name)
    return b.build()


def _check_outputs(graph: Graph, outputs: Sequence[TensorArg]) -> dict[str, aclTensor]:
    produced = {v.name: v for v in graph.outputs}
    writes = {}
    for arg in outputs:
        value = produced.get("out_" + arg.key)
        if arg.tensor is None or value is None or not arg.written:
            continue
        t = arg.tensor
        if t.dtype != value.type.dtype:
            raise AclnnFailure(ACLNN_ERR_PARAM_INVALID, f"{arg.name}: data type: expected "
                               f"{value.type.dtype.name.lower()} (the op's result), got {data_type_name(t.data_type)}")
        if t.shape != tuple(value.type.shape):
            raise AclnnFailure(ACLNN_ERR_PARAM_INVALID, f"{arg.name}: shape: expected {list(value.type.shape)} "
                               f"(the op's result), got {list(t.shape)}")
        if not t.view.flags.writeable:
            raise AclnnFailure(ACLNN_ERR_PARAM_INVALID, f"{arg.name}: the tensor's memory is read-only")
        writes[value.name] = t
    return writes


def prepare(api: str, op_type: str, inputs: Sequence[TensorArg], attributes: Mapping[str, Any],
            outputs: Sequence[TensorArg], rules: StatusRules, *,
            workspace: Callable[[Graph], int] = lambda graph: 0,
            no_op: Callable[[], bool] = lambda: False) -> tuple[int, int, aclOpExecutor | None]:
    """Phase one: ``(status, workspace_size, executor)``; on failure ``(status, 0, None)``."""
    try:
        for arg in (*inputs, *outputs):        # every null first, then the rest (op_api's CheckNotNull, then dtypes)
            _check_present(arg)
        for arg in (*inputs, *outputs):
            _check_tensor(arg)
        if no_op():
            return ACLNN_SUCCESS, 0, aclOpExecutor(api, None, {}, {}, 0)
        try:
            graph = _build(api, op_type, inputs, attributes, outputs)
        except GraphError as exc:
            raise AclnnFailure(rules.status(exc.rule, False), exc.message) from None
        writes = _check_outputs(graph, outputs)
        if CONTEXT.target is not None:
            for violation in check(graph, CONTEXT.target).errors:
                if violation.rule not in rules.skipped:
                    raise AclnnFailure(rules.status(violation.rule, True), violation.message)
        executable = get_runtime(CONTEXT.runtime).compile(graph)
        feeds = {arg.key: arg.tensor for arg in inputs if arg.tensor is not None}
        return ACLNN_SUCCESS, workspace(graph), aclOpExecutor(api, executable, feeds, writes, workspace(graph))
    except AclnnFailure as failure:
        return record_error(api + "GetWorkspaceSize", failure), 0, None


def _check_launch(workspace: DeviceBuffer | None, workspace_size: int, executor: aclOpExecutor | None,
                  stream: aclrtStream | None) -> aclOpExecutor:
    if executor is None:
        raise AclnnFailure(ACLNN_ERR_PARAM_NULLPTR, "executor: expected the executor phase one returned, got None")
    if not isinstance(executor, aclOpExecutor) or executor.destroyed:
        raise AclnnFailure(ACLNN_ERR_PARAM_INVALID, f"executor: expected a live executor, got {executor!r}")
    if executor.runs and not executor.repeatable:
        raise AclnnFailure(ACLNN_ERR_PARAM_INVALID, "executor: it has run once already; an executor is single-use "
                           "unless aclSetAclOpExecutorRepeatable was called before its first run")
    if stream is not None and (not isinstance(stream, aclrtStream) or stream.destroyed):
        raise AclnnFailure(ACLNN_ERR_PARAM_INVALID, f"stream: expected a live aclrtStream or None, got {stream!r}")
    if isinstance(workspace_size, bool) or not isinstance(workspace_size, (int, np.integer)):
        raise AclnnFailure(ACLNN_ERR_PARAM_INVALID, f"workspaceSize: expected an int, got {workspace_size!r}")
    if workspace_size < executor.workspace_size:
        raise AclnnFailure(ACLNN_ERR_PARAM_INVALID, f"workspaceSize: expected at least {executor.workspace_size} "
                           f"bytes (what phase one asked for), got {workspace_size}")
    if executor.workspace_size and workspace is None:
        raise AclnnFailure(ACLNN_ERR_PARAM_NULLPTR, f"workspace: expected {executor.workspace_size} bytes from "
                           f"aclrtMalloc, got a null pointer (None)")
    if workspace is not None:
        if not isinstance(workspace, DeviceBuffer) or workspace.freed:
            raise AclnnFailure(ACLNN_ERR_PARAM_INVALID, f"workspace: expected a live aclrtMalloc buffer, got "
                               f"{workspace!r}")
        if workspace.size < workspace_size:
            raise AclnnFailure(ACLNN_ERR_PARAM_INVALID, f"workspace: the buffer holds {workspace.size} bytes, "
                               f"fewer than workspaceSize {workspace_size}")
    return executor


def execute(api: str, workspace: DeviceBuffer | None, workspace_size: int, executor: aclOpExecutor | None,
            stream: aclrtStream | None) -> int:
    """Phase two: run the executor; the outputs (and an in-place input) are written only when the run succeeds."""
    try:
        ex = _check_launch(workspace, workspace_size, executor, stream)
        for name, t in (*ex.feeds.items(), *ex.writes.items()):
            if t.destroyed:
                raise AclnnFailure(ACLNN_ERR_PARAM_INVALID, f"tensor '{name}' was destroyed after phase one")
        ex.runs += 1
        if stream is not None:
            stream.launched += 1
        if ex.executable is None:
            return ACLNN_SUCCESS
        try:
            results = ex.executable.run({key: t.read() for key, t in ex.feeds.items()})
        except ExecutionError as exc:
            raise AclnnFailure(ACLNN_ERR_RUNTIME_ERROR, str(exc)) from None
        for name, t in ex.writes.items():
            np.copyto(t.view, np.asarray(results[name]))
        return ACLNN_SUCCESS
    except AclnnFailure as failure:
        return record_error(api, failure)
