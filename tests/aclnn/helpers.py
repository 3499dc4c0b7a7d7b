"""Two-phase calls as CANN's examples write them, for the aclnn tests."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from geir import aclnn


def two_phase(get_workspace_size: Callable[..., tuple[int, int, Any]], run: Callable[..., int], *args: Any,
              **kwargs: Any) -> int:
    """Phase one, the workspace, phase two and a stream sync; the first failing status (with its message
    checked to exist), else 0."""
    status, size, executor = get_workspace_size(*args, **kwargs)
    if status != aclnn.ACLNN_SUCCESS:
        assert executor is None and size == 0
        return status
    stream = aclnn.aclrtCreateStream()
    workspace = aclnn.aclrtMalloc(size)
    status = run(workspace, size, executor, stream)
    if status == aclnn.ACLNN_SUCCESS:
        assert aclnn.aclrtSynchronizeStream(stream) == aclnn.ACLNN_SUCCESS
    aclnn.aclrtFree(workspace)
    aclnn.aclrtDestroyStream(stream)
    return status


def failure(status: int, *facts: str) -> None:
    """The last call failed with ``status`` and its message names every fact."""
    message = aclnn.aclGetRecentErrMsg()
    assert message is not None, "no error message was recorded"
    assert f"failed with {status}" in message, message
    for fact in facts:
        assert fact in message, (fact, message)
