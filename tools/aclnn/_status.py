"""aclnn's status codes and its last-error channel (``aclGetRecentErrMsg``).

The codes are CANN's (``aclnn_base.h`` / the aclnn return-code page): each two-phase call answers with one, and
keeps the reason for ``aclGetRecentErrMsg()`` on the calling thread, as CANN does.
"""

from __future__ import annotations

import threading

__all__ = ["ACLNN_ERR_INNER_TILING_ERROR", "ACLNN_ERR_PARAM_INVALID", "ACLNN_ERR_PARAM_NULLPTR",
           "ACLNN_ERR_RUNTIME_ERROR", "ACLNN_SUCCESS", "AclnnFailure", "aclGetRecentErrMsg", "record_error",
           "status_name"]

ACLNN_SUCCESS = 0
ACLNN_ERR_PARAM_NULLPTR = 161001
"""A required tensor, array or output pointer is null (``None``)."""
ACLNN_ERR_PARAM_INVALID = 161002
"""A parameter's dtype, format, layout in memory, shape or value is outside what the API takes."""
ACLNN_ERR_RUNTIME_ERROR = 361001
"""The call cannot run here: no kernel on this device, a feature the device lacks, bad data found while running."""
ACLNN_ERR_INNER_TILING_ERROR = 561002
"""The op's tiling refused the shapes or attributes (CANN's host-side checks after the API's own)."""

_NAMES = {ACLNN_SUCCESS: "ACLNN_SUCCESS", ACLNN_ERR_PARAM_NULLPTR: "ACLNN_ERR_PARAM_NULLPTR",
          ACLNN_ERR_PARAM_INVALID: "ACLNN_ERR_PARAM_INVALID", ACLNN_ERR_RUNTIME_ERROR: "ACLNN_ERR_RUNTIME_ERROR",
          ACLNN_ERR_INNER_TILING_ERROR: "ACLNN_ERR_INNER_TILING_ERROR"}


def status_name(status: int) -> str:
    """The constant's name for a status code (``161002`` -> ``"ACLNN_ERR_PARAM_INVALID"``)."""
    return _NAMES.get(status, f"status {status}")


class AclnnFailure(Exception):
    """Internal: a check failed with ``status``; the API function returns the status and records the message."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.message = message


_LOCAL = threading.local()


def record_error(api: str, failure: AclnnFailure) -> int:
    """Keep ``failure``'s message for ``aclGetRecentErrMsg`` on this thread and return its status."""
    _LOCAL.message = f"{api} failed with {failure.status} ({status_name(failure.status)}): {failure.message}"
    return failure.status


def aclGetRecentErrMsg() -> str | None:
    """The message of the most recent failed call on this thread, or None; reading it clears it (as CANN)."""
    message: str | None = getattr(_LOCAL, "message", None)
    _LOCAL.message = None
    return message
