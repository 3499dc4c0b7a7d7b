"""Loading what ``geir run`` is given (untrusted files and arguments) and saving what it returns.

Feeds come from ``.npy`` / ``.npz`` files (never pickles, bounded in size), from random values of the
declared shapes, or both; symbolic dims take their size from ``--dim NAME=VALUE``. Every problem is a
``CommandError`` whose message names the argument, the input and what was expected.
"""

from __future__ import annotations

import contextlib
import io
import math
import os
import tokenize
import zipfile
from collections.abc import Iterator, Mapping, Sequence
from typing import IO

import ml_dtypes
import numpy as np

from ..ir._core import Graph
from ..ir._files import FileRefused, read_regular_file, replacing

__all__ = ["MAX_FEED_BYTES", "CommandError", "load_feeds", "missing_directory", "parse_assignments", "save_outputs",
           "writing"]

MAX_FEED_BYTES = 4 << 30
"""The largest feed file read (4 GiB), and the most ``--random`` makes; more is refused before anything is
allocated."""


class CommandError(ValueError):
    """A bad argument or input file of a command: printed as one line, exit status 2."""


def parse_assignments(items: Sequence[str], what: str) -> dict[str, str]:
    """``NAME=VALUE`` pairs of a repeated option; each name once."""
    result: dict[str, str] = {}
    for item in items:
        name, sep, value = item.partition("=")
        if not sep or not name or not value:
            raise CommandError(f"{what} {item!r}: expected NAME=VALUE")
        if name in result:
            raise CommandError(f"{what} {name!r} is given twice")
        result[name] = value
    return result


def _read(path: str, what: str) -> bytes:
    try:
        return read_regular_file(path, MAX_FEED_BYTES)
    except FileNotFoundError:
        raise CommandError(f"{what} {path!r}: no such file") from None
    except FileRefused as exc:
        raise CommandError(f"{what} {path!r} {exc}") from None
    except OSError as exc:
        raise CommandError(f"{what} {path!r}: {exc.strerror or exc}") from None


def _read_array(stream: IO[bytes], size: int, what: str) -> np.ndarray:
    """The ``.npy`` array of ``size`` bytes at the stream's start. Its header is read first and refused when it
    claims more data than the ``size`` bytes hold: NumPy allocates what the header says before reading, so a
    60-byte file claiming 10^13 x 4 floats would otherwise end in a MemoryError."""
    fmt = np.lib.format
    try:
        version = fmt.read_magic(stream)
        if version == (1, 0):
            shape, _, dtype = fmt.read_array_header_1_0(stream)
        elif version in ((2, 0), (3, 0)):   # 3.0 differs only in allowing UTF-8 field names
            shape, _, dtype = fmt.read_array_header_2_0(stream)
        else:
            raise ValueError(f"unknown .npy format version {version}")
    except (ValueError, OSError, EOFError, SyntaxError, TypeError, tokenize.TokenError) as exc:   # NumPy's header
        # parser tokenizes the header's dict: a bracket left open is a TokenError
        raise CommandError(f"{what}: not a NumPy .npy array ({exc})") from None
    claimed, held = math.prod(shape) * dtype.itemsize, size - stream.tell()
    if any(d >= 2 ** 63 for d in shape):    # a dim NumPy cannot even index, though the product may be 0
        raise CommandError(f"{what}: its header claims shape {tuple(shape)}: a dimension past 2**63 - 1")
    if claimed > held:
        raise CommandError(f"{what}: its header claims shape {tuple(shape)} of {dtype} ({claimed} bytes), but the "
                           f"file holds {max(held, 0)} bytes of data")
    try:
        stream.seek(0)
        return fmt.read_array(stream, allow_pickle=False)
    except (ValueError, OSError, EOFError, OverflowError) as exc:
        raise CommandError(f"{what}: not a NumPy .npy array without pickles ({exc})") from None


def _load_npy(data: bytes, what: str) -> np.ndarray:
    return _read_array(io.BytesIO(data), len(data), what)


def _load_npz(data: bytes, what: str) -> dict[str, np.ndarray]:
    arrays: dict[str, np.ndarray] = {}
    try:
        with zipfile.ZipFile(io.BytesIO(data)) as archive:   # members may be compressed: bound what they unpack to
            members = archive.infolist()
            unpacked = sum(info.file_size for info in members)
            if unpacked > MAX_FEED_BYTES:
                raise CommandError(f"{what}: its arrays unpack to {unpacked} bytes, more than {MAX_FEED_BYTES}")
            for info in members:
                name = info.filename.removesuffix(".npy")
                if name in arrays:
                    raise CommandError(f"{what}: holds the array {name!r} twice")
                with archive.open(info) as member:   # its real size is checked as it unpacks (else BadZipFile)
                    arrays[name] = _read_array(member, info.file_size, f"{what}: array {name!r}")
    except CommandError:
        raise
    except (zipfile.BadZipFile, zipfile.LargeZipFile, NotImplementedError, RuntimeError, ValueError, OSError,
            EOFError) as exc:   # encrypted or unknown compression: RuntimeError, NotImplementedError
        raise CommandError(f"{what}: not a NumPy .npz archive ({exc})") from None
    return arrays


def _as_input_dtype(array: np.ndarray, want: np.dtype, name: str, source: str) -> np.ndarray:
    """Files cannot hold bfloat16: a float32 array for a bfloat16 input is taken when it converts exactly."""
    if array.dtype == want:
        return array
    if want == ml_dtypes.bfloat16 and array.dtype == np.float32:
        converted = array.astype(want)
        if np.array_equal(converted.astype(np.float32), array, equal_nan=True):
            return converted
        raise CommandError(f"{source}: input '{name}' is bfloat16 and the float32 values in the file are not all "
                           "bfloat16 values (round them first)")
    raise CommandError(f"{source}: input '{name}': expected {want} (as the model declares), got {array.dtype}")


def load_feeds(graph: Graph, inputs: Mapping[str, str], feeds_file: str | None, random: bool, dims: Mapping[str, str],
               seed: int) -> dict[str, np.ndarray]:
    """Feeds for every graph input from the files, then (with ``random``) random values for the rest."""
    declared = {v.name: v for v in graph.inputs}
    feeds: dict[str, np.ndarray] = {}
    if feeds_file is not None:
        for name, array in _load_npz(_read(feeds_file, "--feeds"), f"--feeds {feeds_file!r}").items():
            if name not in declared:
                raise CommandError(f"--feeds {feeds_file!r}: array {name!r} is not an input of the model (inputs: "
                                   f"{', '.join(declared)})")
            feeds[name] = _as_input_dtype(array, declared[name].dtype.numpy, name, f"--feeds {feeds_file!r}")
    for name, path in inputs.items():
        if name not in declared:
            raise CommandError(f"--input {name}: not an input of the model (inputs: {', '.join(declared)})")
        array = _load_npy(_read(path, f"--input {name}="), f"--input {name}={path}")
        feeds[name] = _as_input_dtype(array, declared[name].dtype.numpy, name, f"--input {name}={path}")
    symbols = {d for v in declared.values() for d in v.shape if isinstance(d, str)}
    sizes: dict[str, int] = {}
    for symbol, text in dims.items():
        if not (text.isascii() and text.isdigit()):     # str.isdigit alone takes '²', which int() refuses
            raise CommandError(f"--dim {symbol}={text}: expected a size >= 0 (decimal digits)")
        if symbol not in symbols:
            raise CommandError(f"--dim {symbol}: the model's inputs have no symbolic dim {symbol!r} (they have "
                               f"{', '.join(sorted(symbols)) or 'none'})")
        sizes[symbol] = int(text)
    missing = [n for n in declared if n not in feeds]
    if missing and not random:
        raise CommandError(f"no feed for input(s) {', '.join(missing)}: give --input NAME=FILE.npy, --feeds FILE.npz "
                           "or --random")
    shapes: dict[str, list[int]] = {}
    for name in missing:
        shape = shapes[name] = []
        for d in declared[name].shape:
            if isinstance(d, int):
                shape.append(d)
            elif d in sizes:
                shape.append(sizes[d])
            else:
                raise CommandError(f"input '{name}' has the symbolic dim {d!r}: give its size with --dim {d}=SIZE")
    total = 0
    for name, shape in shapes.items():      # bounded before anything is allocated
        total += math.prod(shape) * declared[name].dtype.numpy.itemsize
        if total > MAX_FEED_BYTES:
            given = ", ".join(f"{s}={n}" for s, n in sizes.items())
            raise CommandError(f"--random: input '{name}' of shape {shape} would take the random feeds to {total} "
                               f"bytes, more than {MAX_FEED_BYTES}" + (f" (--dim {given})" if given else ""))
    rng = np.random.default_rng(seed)
    for name, shape in shapes.items():
        value = declared[name]
        dtype = value.dtype.numpy
        if value.dtype.is_floating:
            feeds[name] = rng.standard_normal(shape).astype(dtype)
        else:     # integer inputs are indices: zeros are in range, but a permutation check will still ask for data
            feeds[name] = np.zeros(shape, dtype)
    return feeds


def save_outputs(path: str, outputs: Mapping[str, np.ndarray]) -> list[str]:
    """Write an ``.npz``; bfloat16 outputs are stored as float32 (exact). Returns the names widened so."""
    widened = [n for n, a in outputs.items() if a.dtype == ml_dtypes.bfloat16]
    with writing(path, "--output"), replacing(path) as f, zipfile.ZipFile(f, "w") as archive:   # np.savez's
        for name, array in outputs.items():                      # layout, without its keyword arguments ('file')
            with archive.open(f"{name}.npy", "w", force_zip64=True) as member:
                np.lib.format.write_array(member, array.astype(np.float32) if name in widened else array,
                                          allow_pickle=False)
    return widened


@contextlib.contextmanager
def writing(path: str, what: str) -> Iterator[None]:
    """Around the writing of an output file: an OSError is a CommandError naming ``what`` and ``path``, saying why
    in words (a missing directory by its name)."""
    try:
        yield
    except OSError as exc:
        missing = missing_directory(os.fspath(exc.filename)) if isinstance(exc, FileNotFoundError) and \
            exc.filename is not None else None
        raise CommandError(f"{what} {path!r}: {missing or f'cannot write it ({exc.strerror or exc})'}") from None


def missing_directory(path: str) -> str | None:
    """Why ``path`` cannot be written when its directory does not exist, else None."""
    parent = os.path.dirname(os.path.abspath(path))
    return None if os.path.isdir(parent) else f"cannot write it: the directory {parent!r} does not exist"
