"""What the ``geir`` commands do (``run``, ``check``, ``show``, ``example``), apart from argument parsing.

Each returns the exit status: 0 done, 1 the model broke a device restriction (``check``) or an
example failed, and raises ``CommandError`` (exit status 2) for a bad argument or input.
"""

from __future__ import annotations

import statistics
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TypeVar

import numpy as np
from onnx import ModelProto

from .facade import check, fuse
from ..ir._core import Graph
from ..ir._dot import graph_to_dot, render
from ..ir._errors import ExecutionError, GraphError
from ..ir._onnx_export import save_onnx
from .model_scopes import node_scopes
from .onnx_import import from_onnx, read_onnx
from ..runtimes import get_runtime
from ..schemas.targets import TARGETS
from ..ir._files import write_file
from .model_io import CommandError, load_feeds, parse_assignments, save_outputs, writing

__all__ = ["check_model", "load_model", "run_example", "run_model", "show_model"]


T = TypeVar("T")


def _model_file(path: str, convert: Callable[[ModelProto], T]) -> T:
    """``convert`` of an ONNX file's model, read once; a missing or bad file is a CommandError naming it."""
    if not Path(path).exists():
        raise CommandError(f"model {path!r}: no such file")
    try:
        return convert(read_onnx(path))
    except GraphError as exc:
        raise CommandError(f"model {path!r}: {exc}") from None


def load_model(path: str, symbolic_shapes: bool = False) -> Graph:
    """The geir graph of an ONNX file; a missing or bad file is a CommandError naming it."""
    return _model_file(path, lambda proto: from_onnx(proto, symbolic_shapes=symbolic_shapes))


def _summary(array: np.ndarray) -> str:
    if array.size == 0:
        return "empty"
    values = array.astype(np.float64)
    finite = np.isfinite(values)
    text = f"min {np.min(values):.6g}  max {np.max(values):.6g}  mean {np.mean(values):.6g}"
    if not finite.all():
        text += f"  ({int((~finite).sum())} not finite)"
    return text


def run_model(model: str, inputs: Sequence[str], feeds_file: str | None, random: bool, dims: Sequence[str],
              runtime: str, output: str | None, repeat: int, seed: int) -> int:
    graph = load_model(model)
    feeds = load_feeds(graph, parse_assignments(inputs, "--input"), feeds_file, random,
                       parse_assignments(dims, "--dim"), seed)
    if repeat < 0:
        raise CommandError(f"--repeat {repeat}: expected a count >= 0")
    executable = get_runtime(runtime).compile(graph)
    results = executable.run(feeds)
    print(f"model {model!r} on {runtime}:")
    width = max(len(n) for n in results)
    for name, array in results.items():
        print(f"  {name:<{width}}  {str(array.dtype):<8}  {str(list(array.shape)):<20}  {_summary(array)}")
    if repeat:
        times = []
        for _ in range(repeat):
            start = time.perf_counter()
            executable.run(feeds)
            times.append(time.perf_counter() - start)
        print(f"  {repeat} runs: min {min(times) * 1e3:.3f} ms, median {statistics.median(times) * 1e3:.3f} ms")
    if output is not None:
        widened = save_outputs(output, results)
        print(f"  outputs written to {output}" + (f" (bfloat16 stored as float32: {', '.join(widened)})"
                                                   if widened else ""))
    return 0


def check_model(model: str, target: str, strict: bool = False) -> int:
    graph = load_model(model)
    targets = list(TARGETS) if target == "all" else [target]
    if target != "all" and target not in TARGETS:
        raise CommandError(f"--target {target!r}: expected one of {', '.join(TARGETS)} or all")
    failed = False
    for name in targets:
        report = check(graph, name, strict=strict)
        print(report)
        failed |= not report.ok
    return 1 if failed else 0


def fuse_model(model: str, output: str, allow_stricter_data: bool = False, symbolic_shapes: bool = False) -> int:
    """Fuse a saved model's standard-op subgraphs into our ops, write the result, print the report."""
    fused, report = fuse(load_model(model, symbolic_shapes), allow_stricter_data=allow_stricter_data)
    with writing(output, "output"):
        save_onnx(fused, output)          # exported in full before the file is replaced: `fuse IN IN` is safe
    print(report)
    print(f"wrote {output}")
    return 0


def load_model_scopes(path: str) -> tuple[Graph, dict[str, tuple[str, ...]]]:
    """``load_model``'s graph and the module path of each node the file records (``tools.model_scopes``): what a
    picture clusters by. The file is read once."""
    return _model_file(path, lambda proto: (from_onnx(proto), node_scopes(proto)))


def _picture_to_stdout(picture: bytes, fmt: str) -> None:
    """The picture's bytes on stdout: through the CLI's stdout (a reader that leaves early ends the output, not the
    command, as for text), a plain binary stdout, or as text for SVG where stdout takes text only."""
    if not hasattr(sys.stdout, "buffer"):
        if fmt != "svg":
            raise CommandError(f"--format {fmt} is binary and this stdout takes text only: give -o FILE.{fmt}")
        sys.stdout.write(picture.decode("utf-8"))
        return
    write_bytes = getattr(sys.stdout, "write_bytes", None)
    if write_bytes is not None:
        write_bytes(picture)
        return
    sys.stdout.flush()
    sys.stdout.buffer.write(picture)
    sys.stdout.buffer.flush()


def show_model(model: str, fmt: str, output: str | None) -> int:
    """Print or write the model as text, DOT, SVG or PNG. SVG without ``-o`` goes to stdout, as ``dot -Tsvg``
    does; so does PNG when stdout is a file or a pipe (binary output is refused on a terminal)."""
    if fmt == "text":
        text = str(load_model(model)) + "\n"
    else:
        graph, scopes = load_model_scopes(model)
        if fmt == "png" and output is None and sys.stdout.isatty():
            raise CommandError("--format png is binary: give -o FILE.png, or redirect stdout "
                               "(geir show MODEL --format png > FILE.png)")
        if fmt in ("svg", "png"):
            notes: list[str] = []
            try:
                picture = render(graph, fmt, scopes, notes)
            except GraphError as exc:
                raise CommandError(str(exc)) from None
            for note in notes:       # a PNG too large for Graphviz's bitmaps comes back scaled down: say so
                hint = " (--format svg is not scaled)" if "Scaling" in note else ""
                print(f"geir show: Graphviz: {note.removeprefix('dot: ')}{hint}", file=sys.stderr)
            if output is None:
                _picture_to_stdout(picture, fmt)
                return 0
            with writing(output, "-o"):
                write_file(output, picture)
            print(f"wrote {output}")
            return 0
        text = graph_to_dot(graph, scopes)
    if output is None:
        print(text, end="")
    else:
        with writing(output, "-o"):
            write_file(output, text)
        print(f"wrote {output}")
    return 0


def run_example(name: str, runtime: str, dump: str | None) -> int:
    from .ge_examples import EXAMPLES

    names = sorted(EXAMPLES) if name == "all" else [name]
    if name != "all" and name not in EXAMPLES:
        raise CommandError(f"example {name!r}: expected one of {', '.join(sorted(EXAMPLES))} or all")
    failed = 0
    for each in names:
        print(f"== {each} ({runtime})")
        run = EXAMPLES[each](runtime=runtime, dump=None if dump is None else str(Path(dump) / each), echo=True)
        if run.dump_error is not None:     # a dump asked for and not written is the user's bad --dump, not a pass
            raise CommandError(f"--dump {dump!r}: {run.dump_error}")
        failed += run.status != 0
    return 1 if failed else 0


def describe_failure(exc: Exception) -> str:
    """One line for an error a command met in the user's model or data."""
    kind = {GraphError: "graph error", ExecutionError: "run error"}.get(type(exc), type(exc).__name__)
    return f"geir: {kind}: {exc}"
