"""Loading what ``geir run`` is given (untrusted files and arguments) and saving what it returns.

Feeds come from ``.npy`` / ``.npz`` files (never pickles, bounded in size), from random values of the
declared shapes, or both; symbolic dims take their size from ``--dim NAME=VALUE``. Every problem is a
``CommandError`` whose message names the argument, the input and what was expected.
"""

from __future__ import annotations

import io
import zipfile
from collections.abc import Mapping, Sequence

import ml_dtypes
import numpy as np

from ..ir._core import Graph
from ..ir._files import FileRefused, read_regular_file

__all__ = ["MAX_FEED_BYTES", "CommandError", "load_feeds", "parse_assignments", "save_outputs"]

MAX_FEED_BYTES = 4 << 30
"""The largest feed file read (4 GiB); a bigger one is refused before it is read."""


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


def _load_npy(data: bytes, what: str) -> np.ndarray:
    try:
        return np.load(io.BytesIO(data), allow_pickle=False)
    except (ValueError, OSError, EOFError) as exc:
        raise CommandError(f"{what}: not a NumPy .npy array without pickles ({exc})") from None


def _load_npz(data: bytes, what: str) -> dict[str, np.ndarray]:
    try:
        with zipfile.ZipFile(io.BytesIO(data)) as archive:   # members may be compressed: bound what they unpack to
            unpacked = sum(info.file_size for info in archive.infolist())
    except zipfile.BadZipFile as exc:
        raise CommandError(f"{what}: not a NumPy .npz archive ({exc})") from None
    if unpacked > MAX_FEED_BYTES:
        raise CommandError(f"{what}: its arrays unpack to {unpacked} bytes, more than {MAX_FEED_BYTES}")
    try:
        with np.load(io.BytesIO(data), allow_pickle=False) as archive:
            return {name: archive[name] for name in archive.files}
    except (ValueError, OSError, EOFError, zipfile.BadZipFile) as exc:
        raise CommandError(f"{what}: not a NumPy .npz archive without pickles ({exc})") from None


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
    sizes: dict[str, int] = {}
    for symbol, text in dims.items():
        if not text.isdigit():
            raise CommandError(f"--dim {symbol}={text}: expected a size >= 0")
        sizes[symbol] = int(text)
    missing = [n for n in declared if n not in feeds]
    if missing and not random:
        raise CommandError(f"no feed for input(s) {', '.join(missing)}: give --input NAME=FILE.npy, --feeds FILE.npz "
                           "or --random")
    rng = np.random.default_rng(seed)
    for name in missing:
        value = declared[name]
        shape = []
        for d in value.shape:
            if isinstance(d, int):
                shape.append(d)
            elif d in sizes:
                shape.append(sizes[d])
            else:
                raise CommandError(f"input '{name}' has the symbolic dim {d!r}: give its size with --dim {d}=SIZE")
        dtype = value.dtype.numpy
        if value.dtype.is_floating:
            feeds[name] = rng.standard_normal(shape).astype(dtype)
        else:     # integer inputs are indices: zeros are in range, but a permutation check will still ask for data
            feeds[name] = np.zeros(shape, dtype)
    return feeds


def save_outputs(path: str, outputs: Mapping[str, np.ndarray]) -> list[str]:
    """Write an ``.npz``; bfloat16 outputs are stored as float32 (exact). Returns the names widened so."""
    widened = [n for n, a in outputs.items() if a.dtype == ml_dtypes.bfloat16]
    arrays = {n: (a.astype(np.float32) if n in widened else a) for n, a in outputs.items()}
    try:
        np.savez(path, **arrays)
    except OSError as exc:
        raise CommandError(f"--output {path!r}: {exc.strerror or exc}") from None
    return widened
