"""Reading a file that comes from outside (an ONNX model, a cached library) without trusting it."""

from __future__ import annotations

import os
import stat
from collections.abc import Callable

__all__ = ["FileRefused", "read_regular_file"]


class FileRefused(ValueError):
    """Why a file was not read; the text completes a sentence whose subject is the file."""


def read_regular_file(path: str | os.PathLike, limit: int, *, follow_links: bool = True,
                      vet: Callable[[os.stat_result], None] | None = None) -> bytes:
    """The bytes of ``path``: opened without blocking (a FIFO never hangs the caller), refused unless
    it is a regular file of at most ``limit`` bytes that ``vet`` (if given) accepts.

    Raises FileNotFoundError when it is missing and FileRefused for anything else.
    """
    flags = os.O_RDONLY | os.O_NONBLOCK | (0 if follow_links else os.O_NOFOLLOW)
    try:
        fd = os.open(path, flags)
    except FileNotFoundError:
        raise
    except OSError as exc:
        raise FileRefused(f"cannot be opened safely ({exc.strerror})") from None
    info = os.fstat(fd)
    if not stat.S_ISREG(info.st_mode):   # checked before fdopen, which refuses directories itself
        os.close(fd)
        raise FileRefused("is not a regular file")
    with os.fdopen(fd, "rb") as f:
        if vet is not None:
            vet(info)
        if info.st_size > limit:
            raise FileRefused(f"is {info.st_size} bytes, more than {limit}")
        return f.read(limit + 1)
