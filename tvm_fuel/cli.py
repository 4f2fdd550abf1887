"""Command line: ``python -m tvm_fuel <command>``. Each command calls one library function.

Commands:
    demo   -- build and run a module that uses every fuel op; print its agreement with the reference
    bench  -- floor vs tuned kernels vs PyTorch, with this machine's peaks; writes JSON and a PNG chart
"""

from __future__ import annotations

import argparse
import sys


def _demo(args: argparse.Namespace) -> int:
    from .demo import run_demo

    results = run_demo(target=args.target, seed=args.seed)
    bad = [r.name for r in results if not r.ok]
    if bad:
        print(f"MISMATCH in {', '.join(bad)}", file=sys.stderr)
        return 1
    print(f"all {len(results)} outputs agree with tvm_fuel.reference")
    return 0


def _bench(args: argparse.Namespace) -> int:
    from .bench import run_bench

    run_bench(out_dir=args.out, floor_all=args.floor_all, long_context=not args.no_long_context,
              sweep=not args.no_sweep)
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tvm_fuel", description=__doc__.split("\n")[0])
    commands = parser.add_subparsers(dest="command", required=True)
    demo = commands.add_parser("demo", help="run every fuel op through the correctness floor")
    demo.add_argument("--target", default="llvm", help="CPU target to build for (default: llvm)")
    demo.add_argument("--seed", type=int, default=0)
    demo.set_defaults(run=_demo)
    bench = commands.add_parser("bench", help="benchmark the floor, the tuned kernels and PyTorch")
    bench.add_argument("--out", default="bench_results", help="folder for bench.json and bench.png")
    bench.add_argument("--floor-all", action="store_true", help="also time the floor on the large cases (slow)")
    bench.add_argument("--no-long-context", action="store_true", help="skip the S=16384 memory probe")
    bench.add_argument("--no-sweep", action="store_true", help="skip the sequence-length sweep of the chart")
    bench.set_defaults(run=_bench)
    args = parser.parse_args(argv)
    return args.run(args)
