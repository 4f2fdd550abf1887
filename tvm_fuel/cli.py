"""Command line: ``python -m tvm_fuel <command>``. Each command calls one library function.

Commands:
    demo   -- build and run a module that uses every fuel op; print its agreement with the reference
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


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tvm_fuel", description=__doc__.split("\n")[0])
    commands = parser.add_subparsers(dest="command", required=True)
    demo = commands.add_parser("demo", help="run every fuel op through the correctness floor")
    demo.add_argument("--target", default="llvm", help="CPU target to build for (default: llvm)")
    demo.add_argument("--seed", type=int, default=0)
    demo.set_defaults(run=_demo)
    args = parser.parse_args(argv)
    return args.run(args)
