"""Files geir reads and writes: reading one that comes from outside (an ONNX model, a cached library) without
trusting it, and writing one so that a failure never leaves it empty or half written."""

from __future__ import annotations

import contextlib
import errno
import os
import secrets
import stat
from collections.abc import Callable, Iterator
from typing import BinaryIO

__all__ = ["FileRefused", "read_regular_file", "replacing", "write_file"]


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
        return f.read(min(limit, info.st_size) + 1)   # not limit + 1: that allocates a buffer of the limit


@contextlib.contextmanager
def replacing(path: str | os.PathLike) -> Iterator[BinaryIO]:
    """A binary file to write ``path``'s new content to: a temporary file beside it, renamed over ``path`` only
    when the block ends without an exception and removed otherwise, so ``path`` keeps its old bytes (or stays
    absent) whatever fails.

    A new file gets the mode ``open()`` would give it (umask applied); a replaced file keeps its mode. A link is
    written through (the file it names is replaced). A target that exists and is not a regular file (a FIFO,
    ``/dev/stdout``) cannot be renamed over: it is written directly. OSError when the directory is missing or
    not writable, or when ``path`` ends with a separator (a directory's name, as ``open()`` says: never a file).
    """
    given = os.fspath(path)
    if given.endswith(tuple(s for s in (os.sep, os.altsep) if s)):
        bare = given.rstrip(os.sep + (os.altsep or ""))
        if bare and os.path.exists(bare) and not os.path.isdir(bare):
            raise NotADirectoryError(errno.ENOTDIR, os.strerror(errno.ENOTDIR), given)
        raise IsADirectoryError(errno.EISDIR, os.strerror(errno.EISDIR), given)
    target = os.path.realpath(given)
    try:
        info: os.stat_result | None = os.stat(target)
    except FileNotFoundError:
        info = None
    if info is not None and not stat.S_ISREG(info.st_mode):
        with open(target, "wb") as direct:
            yield direct
        return
    directory, name = os.path.split(target)
    stem = os.fsdecode(os.fsencode(name)[:200])     # the temporary name stays within NAME_MAX (255 bytes)
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_CLOEXEC", 0)
    while True:                               # mkstemp would create it 0600; O_EXCL keeps the name ours alone
        temp = os.path.join(directory, f".{stem}.{secrets.token_hex(4)}.tmp")
        try:
            fd = os.open(temp, flags, 0o666 if info is None else stat.S_IMODE(info.st_mode))
            break
        except FileExistsError:
            continue
        except OSError as exc:                # name the file asked for, not the temporary one
            raise type(exc)(exc.errno, exc.strerror, os.fspath(path)) from None
    try:
        with os.fdopen(fd, "wb") as f:
            yield f
            f.flush()
            os.fsync(f.fileno())
        if info is not None:                  # os.open's mode passed through the umask: give the old mode back
            os.chmod(temp, stat.S_IMODE(info.st_mode))
        os.replace(temp, target)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(temp)
        raise


def write_file(path: str | os.PathLike, data: bytes | str) -> None:
    """Write ``data`` (text as UTF-8) to ``path`` through ``replacing``: all of it, or ``path`` is untouched."""
    payload = data.encode() if isinstance(data, str) else data
    with replacing(path) as f:
        f.write(payload)
