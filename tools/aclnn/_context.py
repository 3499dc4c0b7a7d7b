"""The runtime calls around aclnn: ``aclInit`` (where geir's device and runtime are chosen), devices, streams and
device memory (host memory here).

A stream runs its work at once, in the calling thread (``aclrtSynchronizeStream`` then has nothing to wait for);
``aclrtMalloc`` gives a zeroed byte buffer a workspace argument takes.
"""

from __future__ import annotations

import numpy as np

from ...ir._errors import GraphError
from ...runtimes import runtime_names
from ...schemas.targets import validate_target

__all__ = ["Context", "CONTEXT", "aclFinalize", "aclInit", "aclrtCreateStream", "aclrtDestroyStream", "aclrtFree",
           "aclrtGetSocName", "aclrtMalloc", "aclrtResetDevice", "aclrtSetDevice", "aclrtStream",
           "aclrtSynchronizeStream", "DeviceBuffer"]


class Context:
    """What ``aclInit`` chose: the device whose rules the calls follow (None: the contract's semantics only) and the
    geir runtime that computes."""

    def __init__(self) -> None:
        self.target: str | None = None
        self.runtime = "numpy"


CONTEXT = Context()


def aclInit(config_path: str | None = None, *, target: str | None = None, runtime: str = "numpy") -> int:
    """Start aclnn. ``target`` is the device whose rules every call follows, as ``geir.check`` names them
    (``"ascend910b"``, ``"ascend910_93"``, ``"ascend950"``; None: no device rules); ``runtime`` computes the ops
    (``"numpy"`` or ``"onnxruntime"``). ``config_path`` (a JSON file in CANN) is accepted and not read."""
    if target is not None:
        validate_target(target)
    if runtime not in runtime_names():
        raise GraphError(f"aclInit: runtime: expected one of {', '.join(runtime_names())}, got {runtime!r}")
    CONTEXT.target, CONTEXT.runtime = target, runtime
    return 0


def aclFinalize() -> int:
    """End aclnn: the device and runtime go back to the defaults (no device rules, NumPy)."""
    CONTEXT.target, CONTEXT.runtime = None, "numpy"
    return 0


def aclrtGetSocName() -> str | None:
    """The device ``aclInit`` chose, or None."""
    return CONTEXT.target


def aclrtSetDevice(device_id: int) -> int:
    """Accepted for ported code; geir computes on the host."""
    return 0


def aclrtResetDevice(device_id: int) -> int:
    return 0


class aclrtStream:  # noqa: N801  (CANN's name)
    """A stream: work given to it runs at once, in order, in the calling thread."""

    __slots__ = ("destroyed", "launched")

    def __init__(self) -> None:
        self.destroyed = False
        self.launched = 0

    def __repr__(self) -> str:
        return f"aclrtStream(launched={self.launched}{', destroyed' if self.destroyed else ''})"


def aclrtCreateStream() -> aclrtStream:
    return aclrtStream()


def aclrtSynchronizeStream(stream: aclrtStream | None) -> int:
    """Wait for the stream's work: it is already done (a destroyed stream is an error, 161002)."""
    return 161002 if stream is not None and stream.destroyed else 0


def aclrtDestroyStream(stream: aclrtStream | None) -> int:
    if stream is not None:
        stream.destroyed = True
    return 0


class DeviceBuffer:
    """``aclrtMalloc``'s memory: ``size`` zeroed bytes (``data``, a uint8 array)."""

    __slots__ = ("data", "freed")

    def __init__(self, size: int) -> None:
        self.data = np.zeros(size, np.uint8)
        self.freed = False

    @property
    def size(self) -> int:
        return int(self.data.size)

    def __repr__(self) -> str:
        return f"DeviceBuffer({self.size} bytes{', freed' if self.freed else ''})"


def aclrtMalloc(size: int) -> DeviceBuffer | None:
    """``size`` bytes for a workspace; None for 0 (pass None as the workspace then, as CANN's examples do)."""
    if isinstance(size, bool) or not isinstance(size, (int, np.integer)) or size < 0:
        raise GraphError(f"aclrtMalloc: size: expected an int >= 0, got {size!r}")
    return DeviceBuffer(int(size)) if size else None


def aclrtFree(buffer: DeviceBuffer | None) -> int:
    if buffer is not None:
        buffer.freed = True
    return 0
