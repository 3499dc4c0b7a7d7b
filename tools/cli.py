"""The ``geir`` command line: ``demo``, ``bench``, ``run``, ``check``, ``show``, ``fuse``, ``example``.

Bare ``geir`` prints the command list, the same text as ``geir -h`` and with its exit status 0: it is how a newcomer
asks what the tool does (as bare ``pip``, ``docker`` and ``kubectl`` answer), not a bad argument.

Exit status: 0 done; 1 a demo case or example failed, or ``check`` found a violated restriction;
2 a bad argument, file or input, a file that cannot be written, too little memory (one line on stderr,
no traceback). A reader that closes stdout early (``geir run ... | head -2``) loses the rest of the printout,
not the command's work: files are still written and the exit status is the command's own.
"""

from __future__ import annotations

import argparse
import inspect
import os
import re
import shutil
import sys
import textwrap
from collections.abc import Callable, Sequence
from typing import NoReturn, TextIO

from ..ir._errors import ExecutionError, GraphError
from ..runtimes import runtime_names
from ..schemas.targets import TARGETS
from .bench import SUITES
from .model_io import CommandError, missing_directory


class _Parser(argparse.ArgumentParser):
    """argparse, with a usage error printed as one line (exit 2) like every other bad argument."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: {_one_line(message)} (see {self.prog} --help)\n")


def _count(minimum: int) -> Callable[[str], int]:
    """An argparse type: a decimal integer >= ``minimum``."""
    def parse(text: str) -> int:
        if re.fullmatch(r"[+-]?[0-9]+", text) is None or int(text) < minimum:   # int() would take '²' and '1_0'
            raise argparse.ArgumentTypeError(f"expected an integer >= {minimum}, got {text!r}")
        return int(text)
    parse.__name__ = "count"
    return parse


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("geir")
    except PackageNotFoundError:
        return "unknown (not installed)"


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="geir", description="Graph IR compiler and executor for CANN "
                                     "ops-transformer training operators.")
    parser.add_argument("--version", action="version", version=f"geir {_version()}")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    demo = commands.add_parser("demo", help="run the contract's worked examples on both runtimes and compare")
    demo.add_argument("--runtime", choices=runtime_names(), default=None,
                      help="run on one runtime only (default: both, side by side)")
    bench = commands.add_parser("bench", help="benchmark every op against copy bandwidth, a matmul, NumPy, PyTorch",
                                formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog=_listing("suites (default: every one)", SUITES))
    bench.add_argument("suite", nargs="*", help="suites to run (listed below; default: all)")
    bench.add_argument("--quick", action="store_true", help="small shapes, for a smoke test")
    bench.add_argument("--repeat", type=_count(1), default=5, help="timed repetitions; the best is reported")
    bench.add_argument("--plot", metavar="FILE.png", help="also draw the ratios as a bar chart (needs matplotlib)")
    run = commands.add_parser("run", help="run a saved ONNX model on given or random feeds")
    run.add_argument("model", help="the .onnx file")
    run.add_argument("--input", action="append", default=[], metavar="NAME=FILE.npy", help="one input from a .npy")
    run.add_argument("--feeds", metavar="FILE.npz", help="inputs from an .npz (array names = input names)")
    run.add_argument("--random", action="store_true", help="random values for inputs not given (ints: zeros)")
    run.add_argument("--dim", action="append", default=[], metavar="NAME=SIZE", help="size of a symbolic dim")
    run.add_argument("--seed", type=_count(0), default=0, help="seed of --random (default 0)")
    run.add_argument("--runtime", choices=runtime_names(), default="numpy")
    run.add_argument("--output", metavar="FILE.npz", help="write the outputs to an .npz")
    run.add_argument("--repeat", type=_count(0), default=0, metavar="N", help="time N more runs (min and median)")
    chk = commands.add_parser("check", help="check a saved model against a device's restrictions (exit 1 if violated)")
    chk.add_argument("model", help="the .onnx file")
    chk.add_argument("--target", required=True, help=f"a device ({', '.join(TARGETS)}) or all")
    chk.add_argument("--strict", action="store_true", help="also fail on 'unsupported' (what the docs forbid but "
                     "the device code accepts)")
    show = commands.add_parser("show", help="print a saved model as text, or draw it (dot, svg, png)")
    show.add_argument("model", help="the .onnx file")
    show.add_argument("--format", choices=("text", "dot", "svg", "png"), default="text",
                      help="text (default); dot: Graphviz DOT text; svg, png: drawn by Graphviz's dot, which must be "
                           "installed (Debian/Ubuntu: apt-get install graphviz; macOS: brew install graphviz)")
    show.add_argument("-o", "--output", metavar="FILE", help="write to FILE instead of stdout (png: needs -o, "
                      "or stdout redirected to a file)")
    fuse = commands.add_parser("fuse", help="rewrite standard-op subgraphs of a saved model into our ops")
    fuse.add_argument("model", help="the .onnx file to read")
    fuse.add_argument("output", help="the .onnx file to write")
    fuse.add_argument("--allow-stricter-data", action="store_true",
                      help="also fuse where our op checks fed indices more strictly than the subgraph (distinct key "
                           "ids per row, a permutation for MoE); such data is then refused when the model runs")
    fuse.add_argument("--symbolic-shapes", action="store_true",
                      help="on import, tie sizes the model computes from its inputs' shapes to their symbols (ONNX "
                           "Runtime's symbolic shape inference), as TorchScript's dynamic exports need for their ropes "
                           "and MoE combines to fuse")
    from .ge_examples import EXAMPLES

    example = commands.add_parser("example", help="run the geir.ge ports of CANN's graph-mode examples",
                                  formatter_class=argparse.RawDescriptionHelpFormatter,
                                  epilog=_listing("examples (default: all of them)", EXAMPLES))
    example.add_argument("name", nargs="?", default="all", help="an example (listed below) or all (default)")
    example.add_argument("--runtime", choices=runtime_names(), default="numpy")
    example.add_argument("--dump", metavar="DIR", help="also write each graph there (aclgrphDumpGraph)")
    return parser


def _summary(item: object) -> str:
    """The first sentence of ``item``'s docstring, as one line of help (reST quotes dropped)."""
    text = " ".join((inspect.getdoc(item) or "").split("\n\n")[0].split()).replace("``", "")
    text = re.sub(r" \(issue \d+[^)]*\)", "", text)          # the project's history, not the user's business
    return re.split(r"(?<=[.!?])\s", text, maxsplit=1)[0]


def _listing(title: str, entries: dict[str, object]) -> str:
    """A help epilog naming every entry of a registry with its summary: made from the registry, so a suite or
    example added there is listed without editing any help text."""
    width = max(60, min(shutil.get_terminal_size().columns - 2, 100))
    name_width = max(map(len, entries)) + 2
    lines = [f"{title}:"]
    for name, item in entries.items():
        if name_width > width // 4:          # long names: each on its line, the summary indented below it
            lines += [f"  {name}", textwrap.fill(_summary(item) or "-", width, initial_indent=" " * 6,
                                                 subsequent_indent=" " * 6, break_long_words=False)]
        else:
            lines.append(textwrap.fill(_summary(item) or "-", width, initial_indent=f"  {name:<{name_width}}",
                                       subsequent_indent=" " * (name_width + 2), break_long_words=False))
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    stdout = sys.stdout
    closed = None if stdout is not None else open(os.devnull, "w")   # started with stdout closed (`>&-`)
    sys.stdout = _ReaderMayLeave(stdout if closed is None else closed)   # type: ignore[assignment]
    try:                                    # --help and --version print (and exit) inside parse_args
        parser = build_parser()
        arguments = sys.argv[1:] if argv is None else list(argv)
        if not arguments:                   # bare `geir`: the command list, as `geir -h` prints it
            parser.print_help()
            return 0
        return _run(parser, parser.parse_args(arguments))
    finally:
        sys.stdout.flush()                  # through the wrapper: a reader gone now is not an error at exit
        sys.stdout = stdout
        if closed is not None:
            closed.close()


def _run(parser: argparse.ArgumentParser, args: argparse.Namespace) -> int:
    try:
        return _dispatch(parser, args)
    except (CommandError, GraphError, ExecutionError) as exc:
        from .commands import describe_failure

        return _refuse(describe_failure(exc) if not isinstance(exc, CommandError) else f"geir {args.command}: {exc}")
    except MemoryError as exc:
        return _refuse(f"geir {args.command}: out of memory{f' ({exc})' if str(exc) else ''}: the model or its "
                       "inputs need more than this machine has")
    except OSError as exc:                  # a file the command writes or reads that the commands did not name
        where = f"{os.fspath(exc.filename)!r}: " if exc.filename is not None else ""
        return _refuse(f"geir {args.command}: {where}{exc.strerror or exc}")
    except KeyboardInterrupt:
        return _refuse(f"geir {args.command}: interrupted", 130)


def _one_line(text: str) -> str:
    return "; ".join(line.strip() for line in str(text).splitlines() if line.strip())


def _refuse(message: str, status: int = 2) -> int:
    print(_one_line(message), file=sys.stderr)
    return status


class _ReaderMayLeave:
    """``sys.stdout`` while a command runs. When its reader goes away (``geir run ... | head -2``) the rest of
    the printout is dropped, the descriptor is pointed at /dev/null (so the buffered bytes cannot fail again
    at exit) and the command goes on: its files are written and its exit status is its own."""

    def __init__(self, stream: TextIO) -> None:
        self._stream = stream
        self.gone = False

    def write(self, text: str) -> int:
        if not self.gone:
            try:
                self._stream.write(text)
            except BrokenPipeError:
                self._leave()
        return len(text)

    def flush(self) -> None:
        if not self.gone:
            try:
                self._stream.flush()
            except BrokenPipeError:
                self._leave()

    def write_bytes(self, data: bytes) -> None:
        """Binary output (a picture) through the stream's buffer, on the same terms as text."""
        if not self.gone:
            try:
                self._stream.flush()
                self._stream.buffer.write(data)
                self._stream.buffer.flush()
            except BrokenPipeError:
                self._leave()

    def _leave(self) -> None:
        self.gone = True
        try:
            devnull = os.open(os.devnull, os.O_WRONLY)
            try:
                os.dup2(devnull, self._stream.fileno())
            finally:
                os.close(devnull)
        except (OSError, ValueError, AttributeError):    # not a real descriptor (a test's capture): nothing to do
            pass

    def __getattr__(self, name: str) -> object:
        return getattr(self._stream, name)


def _dispatch(parser: argparse.ArgumentParser, args: argparse.Namespace) -> int:
    from . import commands

    if args.command == "demo":
        from .demo import run_demo

        return 1 if run_demo(args.runtime) else 0
    if args.command == "run":
        return commands.run_model(args.model, args.input, args.feeds, args.random, args.dim, args.runtime,
                                  args.output, args.repeat, args.seed)
    if args.command == "check":
        return commands.check_model(args.model, args.target, args.strict)
    if args.command == "show":
        return commands.show_model(args.model, args.format, args.output)
    if args.command == "example":
        return commands.run_example(args.name, args.runtime, args.dump)
    if args.command == "fuse":
        return commands.fuse_model(args.model, args.output, args.allow_stricter_data, args.symbolic_shapes)
    from .bench import run_benchmarks

    unknown = [s for s in args.suite if s not in SUITES]
    if unknown:
        parser.error(f"unknown benchmark(s) {unknown}; choose from {sorted(SUITES)}")
    if args.plot is not None and (missing := missing_directory(args.plot)):   # before minutes of measuring
        raise CommandError(f"--plot {args.plot!r}: {missing}")
    table = run_benchmarks(args.suite or None, quick=args.quick, repeat=args.repeat, plot=args.plot)
    print(table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
