from __future__ import annotations

import pytest

from geir import aclnn


@pytest.fixture(params=["numpy", "onnxruntime"])
def runtime(request):
    """Each test runs on both runtimes; aclnn starts with no device rules and ends finalized."""
    assert aclnn.aclInit(None, runtime=request.param) == aclnn.ACLNN_SUCCESS
    aclnn.aclGetRecentErrMsg()
    yield request.param
    aclnn.aclFinalize()


@pytest.fixture
def on_device():
    """Choose a device for the rest of the test (``on_device("ascend950")``), keeping the test's runtime."""
    def choose(target: str | None) -> None:
        assert aclnn.aclInit(None, target=target, runtime=aclnn._context.CONTEXT.runtime) == 0
    return choose
