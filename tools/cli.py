"""The ``geir`` command line."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from ..runtimes import runtime_names


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="geir", description="Graph IR compiler and executor for CANN "
                                     "ops-transformer training operators.")
    commands = parser.add_subparsers(dest="command", required=True)
    demo = commands.add_parser("demo", help="run the spec's graph-mode examples and compare with expected values")
    demo.add_argument("--runtime", choices=runtime_names(), default=None,
                      help="run on one runtime only (default: both, side by side)")
    bench = commands.add_parser("bench", help="benchmark every op on both runtimes against copy bandwidth, a matmul, "
                                 "plain NumPy and PyTorch eager")
    bench.add_argument("suite", nargs="*", help="suites to run (default: all): rotary, moe, sfa")
    bench.add_argument("--quick", action="store_true", help="small shapes, for a smoke test")
    bench.add_argument("--repeat", type=int, default=5, help="timed repetitions; the best is reported")
    args = parser.parse_args(argv)

    if args.command == "demo":
        from .demo import run_demo

        return 1 if run_demo(args.runtime) else 0
    from .bench import SUITES, run_benchmarks

    unknown = [s for s in args.suite if s not in SUITES]
    if unknown:
        parser.error(f"unknown benchmark(s) {unknown}; choose from {sorted(SUITES)}")
    print(run_benchmarks(args.suite or list(SUITES), quick=args.quick, repeat=args.repeat))
    return 0


if __name__ == "__main__":
    sys.exit(main())
