"""The native custom-op library: built from the C files in ``native/`` (the ABI declarations in
``abi.h``/``abi.c``, half-precision helpers in ``half.h``, one file per op family, the attention plan and
the register-tiled matrix multiply it runs on, registration)
into one shared object with the machine's C compiler on first use, cached, loaded into sessions,
and proven by a self-test before it is trusted.

Op families: a C file that says ``GEIR_FAMILY(<its stem>, <table>)`` (``native/family.h``) declares its ops;
the build lists every such file in a translation unit it generates (``families_source``), which
``register.c`` walks, so a new family is one new C file.

Trust rules for the cache (a library there runs its code inside this process):
- the cache directory must be a directory owned by the current user and writable by no one else
  (as ssh treats its key files); geir creates it with mode 0700;
- a library is loaded only if it is a regular file owned by the current user, writable by no one
  else, and its SHA-256 equals the one recorded beside it when geir built it (``<name>.sha256``);
  anything else is rebuilt, never loaded;
- builds go to a private temporary file that is renamed into place (atomic), the compiler runs
  with a time limit, and the self-test runs every kernel family (rotary, MoE forward and grad, sparse
  attention forward and grad) against the NumPy runtime before the library is used.

``GEIR_NATIVE=0`` (or ``false``, ``no``, ``off``) disables it; when it cannot be built, loaded or
proven, sessions run the ONNX function bodies instead and geir says so once (a GeirWarning).
Initialisation is serialised: concurrent first callers all get the same answer. Across processes (pytest-xdist
workers, several programs starting at once) a build holds an exclusive lock on a file beside the library, and a
process that finds no valid library takes the lock and looks again before building: one process builds, the others
wait and load its file.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import fcntl
import hashlib
import os
import re
import shlex
import shutil
import stat
import subprocess
import sys
import tempfile
import threading
import time
import warnings
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import onnxruntime as ort

from ...ir._core import Graph
from ...ir._dtypes import as_dtype
from ...ir._editor import GraphEditor
from ...ir._registry import all_schemas
from ...ir._errors import GeirWarning
from ...ir._files import FileRefused, read_regular_file
from ...ir._onnx_export import runtime_model
from ...passes import build
from ...schemas import all_examples
from ..numpy import NumpyRuntime

__all__ = ["COMPILE_TIMEOUT_S", "families", "families_source", "find_compiler", "native_library", "native_op_types",
           "native_status"]

NATIVE = Path(__file__).with_name("native")
SOURCES = tuple(sorted(NATIVE.glob("*.c")))
"""Compiled together into the one library; the headers beside them take part in the cache key."""
FAMILY = re.compile(r"^GEIR_FAMILY\(\s*(\w+)\s*,", re.MULTILINE)
"""How a C file declares its op family (native/family.h): at the start of a line, the file's stem first."""
CFLAGS = ["-O3", "-march=native", "-ffp-contract=off", "-fPIC", "-shared", "-std=c11", "-Wall", "-Werror=vla"]
"""``-ffp-contract=off``: no FMA contraction, so results stay bit-identical to the NumPy runtime. ``-Werror=vla``:
no variable-length array, whose size the data would set, on a stack of fixed size (scratch is on the heap)."""
COMPILE_TIMEOUT_S = 300.0
"""A compiler that runs longer than this is stopped and the function bodies are used."""
LOCK_TIMEOUT_S = COMPILE_TIMEOUT_S + 60.0
"""How long a process waits for another one's build (its compile is stopped at COMPILE_TIMEOUT_S; a process
stopped by a signal or a debugger could hold the lock for ever)."""
MAX_LIBRARY_BYTES = 64 << 20
"""A cached file larger than this is not ours."""
DISABLED = ("0", "false", "no", "off")

_state: dict[str, object] = {}
_lock = threading.Lock()


class _Untrusted(RuntimeError):
    """A cache path that must not be used (wrong owner, writable by others, not a regular file)."""


def _cache_dir() -> Path:
    base = os.environ.get("GEIR_CACHE_DIR") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "geir")
    return Path(base)


def _check_owner(info: os.stat_result, path: Path, what: str) -> None:
    if info.st_uid != os.geteuid():
        raise _Untrusted(f"{what} {path} is owned by uid {info.st_uid}, not by this user (uid {os.geteuid()})")
    if info.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        raise _Untrusted(f"{what} {path} is writable by others (mode {stat.filemode(info.st_mode)})")


def _trusted_dir() -> Path:
    """The cache directory, created private if missing; _Untrusted unless this user alone may write it."""
    directory = _cache_dir()
    directory.mkdir(mode=0o700, parents=True, exist_ok=True)
    info = os.stat(directory)
    if not stat.S_ISDIR(info.st_mode):
        raise _Untrusted(f"cache path {directory} is not a directory")
    _check_owner(info, directory, "cache directory")
    return directory


def _read_trusted(path: Path, limit: int) -> bytes | None:
    """The bytes of ``path`` if it is a regular file this user owns and alone may write; None if missing.

    Links are not followed and a FIFO never blocks (``read_regular_file``).
    """
    try:
        return read_regular_file(path, limit, follow_links=False,
                                 vet=lambda info: _check_owner(info, path, "cached file"))
    except FileNotFoundError:
        return None
    except FileRefused as exc:
        raise _Untrusted(f"{path} {exc}") from None


def _write_atomically(directory: Path, name: str, data: bytes) -> None:
    fd, temp = tempfile.mkstemp(dir=directory, prefix=f".{name}.")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.replace(temp, directory / name)
    except BaseException:
        Path(temp).unlink(missing_ok=True)
        raise


def find_compiler() -> list[str] | None:
    """The C compiler command: ``CC`` if set, else ``cc`` or ``gcc`` from PATH; None if there is none."""
    configured = os.environ.get("CC", "").strip()
    if configured:
        return shlex.split(configured)
    found = shutil.which("cc") or shutil.which("gcc")
    return [found] if found else None


def _compiler() -> list[str]:
    compiler = find_compiler()
    if compiler is None:
        raise RuntimeError("no C compiler (cc or gcc) on PATH")
    return compiler


def _cpu_identity() -> str:
    """The CPU's model and feature flags: ``-march=native`` builds for this CPU, so a cache shared with a machine
    of another kind must not hand it our library."""
    try:
        with open("/proc/cpuinfo", "rb") as f:
            text = f.read(1 << 16).decode("ascii", "replace")
    except OSError:
        import platform
        return platform.processor() or platform.machine()
    lines = [line for line in text.splitlines() if line.startswith(("model name", "flags", "Features"))]
    return "\n".join(sorted(set(lines)))


def families(sources: tuple[Path, ...] = SOURCES) -> tuple[str, ...]:
    """The op families among ``sources``: the stems of the files that declare one with ``GEIR_FAMILY``.

    A file declares at most one, named after itself (the symbol ``geir_family_<stem>`` is what the generated
    list refers to); RuntimeError otherwise, before anything is compiled."""
    found = []
    for path in sources:
        names = FAMILY.findall(path.read_text())
        if len(names) > 1 or (names and names[0] != path.stem):
            raise RuntimeError(f"{path.name} declares GEIR_FAMILY({', '.join(names)}): a C file declares at most "
                               f"one op family, named after the file (GEIR_FAMILY({path.stem}, ...))")
        found += names
    return tuple(found)


def families_source(names: tuple[str, ...]) -> str:
    """The translation unit listing the op families ``names`` for register.c (generated at build time)."""
    externs = "".join(f"extern const GeirFamily geir_family_{name};\n" for name in names)
    listed = ", ".join(f"&geir_family_{name}" for name in names) or "NULL"
    return (f"/* Generated by geir's runtimes/onnxruntime/_native.py: the op families of native/. */\n"
            f'#include "family.h"\n{externs}'
            f"const GeirFamily* const geir_families[] = {{{listed}}};\n"
            f"const int geir_family_count = {len(names)};\n")


BUILDING = "geir: building the native ONNX Runtime kernels with {compiler} (once per machine, usually {seconds})..."
"""The one line on stderr before a real compile (a cached library is used silently)."""
USUAL_SECONDS = "10-30 s"


def _say_building(compiler: list[str]) -> None:
    if sys.stderr is None:   # started with stderr closed
        return
    try:
        print(BUILDING.format(compiler=Path(compiler[0]).name, seconds=USUAL_SECONDS), file=sys.stderr, flush=True)
    except (OSError, ValueError):   # a closed or broken stderr must not cost the user the kernels
        pass


def _build() -> Path:
    """The cached library for this source and compiler, verified or freshly built."""
    compiler = _compiler()
    listing = families_source(families())
    source = b"".join(p.name.encode() + p.read_bytes() for p in sorted([*SOURCES, *NATIVE.glob("*.h")]))
    key = hashlib.sha256(source + listing.encode() + " ".join([*compiler, *CFLAGS, sys.platform, _cpu_identity()])
                         .encode()).hexdigest()[:16]
    directory = _trusted_dir()
    target = directory / f"libgeir_ort-{key}.so"
    if _is_ours(target):
        return target
    with _build_lock(directory / f".{target.name}.lock"):
        if _is_ours(target):   # another process built it while this one waited
            return target
        _compile_into(compiler, listing, directory, target)
    return target


def _is_ours(target: Path) -> bool:
    """Whether ``target`` is a trusted file whose SHA-256 is the one recorded beside it when geir built it."""
    library = _read_trusted(target, MAX_LIBRARY_BYTES)
    recorded = _read_trusted(target.with_name(target.name + ".sha256"), 64)
    return library is not None and recorded is not None and hashlib.sha256(library).hexdigest().encode() == recorded


@contextlib.contextmanager
def _build_lock(path: Path) -> Iterator[None]:
    """Hold an exclusive ``flock`` on ``path`` (created private in the trusted cache directory, never followed
    through a link): one process builds at a time; the lock goes with the process if it dies. Where the file
    system has no locks (some network mounts) the build goes ahead unlocked: the rename keeps it safe, only not
    single."""
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    try:
        deadline = time.monotonic() + LOCK_TIMEOUT_S
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except OSError as exc:
                if exc.errno in (errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS):
                    break
                if exc.errno not in (errno.EWOULDBLOCK, errno.EACCES):
                    raise
                if time.monotonic() > deadline:
                    raise RuntimeError(f"another process has held the build lock {path} for over "
                                       f"{LOCK_TIMEOUT_S:g} s") from None
                time.sleep(0.05)
        yield
    finally:
        os.close(fd)


def _compile_into(compiler: list[str], listing: str, directory: Path, target: Path) -> None:
    """Build the library into a private temporary file, record its SHA-256, and rename it to ``target``."""
    _say_building(compiler)
    fd, temp = tempfile.mkstemp(dir=directory, prefix=".build-", suffix=".so")
    os.close(fd)
    try:
        with tempfile.TemporaryDirectory(dir=directory, prefix=".objects-") as objects:
            generated = Path(objects) / "families.c"
            generated.write_text(listing)
            _compile(compiler, Path(objects), temp, [*SOURCES, generated])
        built = Path(temp).read_bytes()
        _write_atomically(directory, target.name + ".sha256", hashlib.sha256(built).hexdigest().encode())
        os.chmod(temp, 0o700)
        os.replace(temp, target)   # atomic: a concurrent reader finds a whole file or none
    finally:
        Path(temp).unlink(missing_ok=True)


def _compile(compiler: list[str], objects: Path, library: str, sources: list[Path]) -> None:
    """Compile every source to an object file at once (one compiler process each, so a machine's cores share
    the work), then link them into ``library``; all within COMPILE_TIMEOUT_S, every process stopped past it.
    Headers are found beside the sources in ``native/`` (the generated one lives in ``objects``)."""
    deadline = time.monotonic() + COMPILE_TIMEOUT_S
    flags = [f for f in CFLAGS if f != "-shared"] + ["-I", str(NATIVE)]
    outputs = [objects / f"{i}-{source.stem}.o" for i, source in enumerate(sources)]
    steps = [[[*compiler, *flags, "-c", "-o", str(o), str(s)] for s, o in zip(sources, outputs)],
             [[*compiler, *CFLAGS, "-o", library, *map(str, outputs)]]]
    for commands in steps:
        processes = [subprocess.Popen(c, stdout=subprocess.PIPE, stderr=subprocess.PIPE, stdin=subprocess.DEVNULL,
                                      text=True) for c in commands]
        try:
            for process in processes:
                try:
                    _, errors = process.communicate(timeout=max(0.0, deadline - time.monotonic()))
                except subprocess.TimeoutExpired:
                    raise RuntimeError(f"{compiler[0]} did not finish within {COMPILE_TIMEOUT_S:g} s") from None
                if process.returncode != 0:
                    raise RuntimeError(f"{compiler[0]} failed: {errors.strip()[:500]}")
        finally:
            for process in processes:
                if process.returncode is None:   # not yet waited for: stop it, reap it, close its pipes
                    process.kill()
                    process.communicate()


def _counter(path: Path) -> ctypes._CFuncPtr:
    counter = ctypes.CDLL(str(path)).geir_native_calls
    counter.restype = ctypes.c_long
    return counter


def native_ops(path: Path) -> frozenset[str]:
    """The op types the library at ``path`` registers a kernel for (its families' descriptor tables)."""
    library = ctypes.CDLL(str(path))
    name = ctypes.c_char_p()
    types_in, types_out = (ctypes.c_int * 32)(), (ctypes.c_int * 32)()
    counts = [ctypes.c_int() for _ in range(3)]
    found = set()
    for i in range(max(0, library.geir_op_count())):
        if library.geir_op_entry(i, ctypes.byref(name), types_in, ctypes.byref(counts[0]), types_out,
                                 ctypes.byref(counts[1]), ctypes.byref(counts[2])) and name.value:
            found.add(name.value.decode())
    return frozenset(found)


TOLERANCE = {"float32": 1e-5, "float16": 2e-3, "bfloat16": 1.6e-2}
"""How far a kernel whose schema is not exact across runtimes may be from the NumPy runtime (matrix products and
weighted sums may add in another order): a few units in the last place of each dtype."""


def _self_test_graph(native: frozenset[str] | None = None) -> tuple[Graph, dict[str, np.ndarray], int,
                                                                    frozenset[str]]:
    """One graph with a node of each of our ops, on the first worked example its family declares for it
    (``schemas/<family>/examples.py``), in float16 where the example has it (so the conversions run too); its feeds, the native calls it makes, and the outputs whose schemas promise the same
    bits on every runtime. A new family is covered by declaring its examples; an op the library has no kernel for
    (``native``: the ops it registers) runs its function body and is not counted."""
    b = GraphEditor("geir_native_self_test")
    feeds: dict[str, np.ndarray] = {}
    exact: set[str] = set()
    calls = 0
    for schema in all_schemas():
        examples = [e for e in all_examples(schema) if e.warning is None]
        if not examples:
            continue
        example = examples[0]
        dtype = "float16" if "float16" in example.dtypes else example.dtypes[0]   # bfloat16 feeds need OrtValues
        inputs = []
        for spec in schema.inputs:
            if spec.name not in example.inputs:
                inputs.append(None)
                continue
            name = f"{schema.op_type}.{spec.name}"
            feeds[name] = np.asarray(example.inputs[spec.name]).astype(
                as_dtype(example.input_dtype(spec.name, dtype)).numpy)
            inputs.append(b.input(name, feeds[name].dtype, feeds[name].shape))
        results = b.add_node(schema, inputs, dict(example.attributes), name=schema.op_type)
        for spec, value in zip(schema.outputs, results if isinstance(results, tuple) else (results,)):
            if value is not None:
                b.output(value, f"{schema.op_type}.{spec.name}.out")
                if schema.exact_across_runtimes:
                    exact.add(value.name)
        calls += native is None or schema.op_type in native
    return build(b), feeds, calls, frozenset(exact)


def _self_test(path: Path) -> None:
    """Run every op's worked example through a session with the library: its call counter must move once per
    node, and each result must equal the NumPy runtime's (bit for bit where the schema promises the same bits on
    every runtime, else within ``TOLERANCE``)."""
    graph, feeds, calls, exact = _self_test_graph(native_ops(path))
    options = ort.SessionOptions()
    options.register_custom_ops_library(str(path))
    counter = _counter(path)
    before = counter()
    session = ort.InferenceSession(runtime_model(graph).SerializeToString(), options,
                                   providers=["CPUExecutionProvider"])
    names = [v.name for v in graph.outputs]
    got = dict(zip(names, session.run(names, feeds)))
    if counter() - before != calls:
        raise RuntimeError(f"the self-test ran {counter() - before} of {calls} native kernels (ONNX Runtime older "
                           f"than 1.17 offers no API version 17)")
    want = NumpyRuntime().compile(graph).run(feeds)
    for name in names:
        if name in exact or want[name].dtype.kind not in "fV" and want[name].dtype.name != "bfloat16":
            same = np.array_equal(got[name].view(np.uint8), want[name].view(np.uint8))
        else:
            tolerance = TOLERANCE[want[name].dtype.name]
            same = np.allclose(got[name].astype(np.float32), want[name].astype(np.float32), rtol=tolerance,
                               atol=tolerance)
        if not same:
            raise RuntimeError(f"the native kernel's self-test result '{name}' differs from the NumPy runtime")


def _initialise() -> tuple[str | None, str | None]:
    """(library path, None) or (None, why not); warns once when the library cannot be used."""
    setting = os.environ.get("GEIR_NATIVE", "1")
    if setting.strip().lower() in DISABLED:
        return None, f"disabled by GEIR_NATIVE={setting}"
    try:
        path = _build()
        _self_test(path)
        _state["ops"] = native_ops(path)
        return str(path), None
    except Exception as exc:  # any failure means: run the function bodies, and say why once
        reason = f"{type(exc).__name__}: {exc}"
        warnings.warn(f"geir: native ONNX Runtime kernels unavailable ({reason}); running the ONNX function bodies "
                      f"instead", GeirWarning, stacklevel=4)
        return None, reason


def native_library() -> str | None:
    """Path of the loaded native library, or None (disabled, unbuildable, untrusted or failed its self-test)."""
    if "path" not in _state:
        with _lock:   # the first caller builds; the others wait for its answer
            if "path" not in _state:
                path, reason = _initialise()
                _state["reason"] = reason
                _state["path"] = path   # published last: a caller that sees it sees the reason too
    return _state["path"]  # type: ignore[return-value]


def native_op_types() -> frozenset[str]:
    """The op types the loaded library runs (every dtype combination their schemas allow, which the library's
    table is tested to list), and so whose data rules it enforces itself; empty when no library is loaded."""
    return frozenset(_state.get("ops", ())) if native_library() is not None else frozenset()  # type: ignore[arg-type]


def native_status() -> str:
    """One line saying which kernels ONNX Runtime sessions use, and why."""
    path = native_library()
    return f"native kernels: {path}" if path else f"function bodies only ({_state['reason']})"
