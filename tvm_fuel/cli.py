"""Command line: ``python -m tvm_fuel <command>``. Each command calls one library function.

Commands:
    demo   -- every fuel op vs the reference; a Llama-style decoder's greedy generation over a paged
              KV cache (tokens/s, floor vs tuned); a training run's loss curve; PyTorch agreement
    bench  -- floor vs tuned kernels vs PyTorch, with this machine's peaks; writes JSON and a PNG chart
              (``--target cuda``: the CUDA kernels vs the dlight-scheduled floor vs PyTorch CUDA SDPA)
    gpucheck -- on a CUDA device: build the deploy bundle for it and run it (every stage)
    bundle -- build a suite's modules, cubins and a runtime-only TVM for a GPU node without TVM
    tune   -- MetaSchedule tuning of a kernel at static shape buckets; logs under --work-dir
              (``--import results.json``: a bundle run's CUDA measurements as records)
    logs   -- which kernels hit a tuning record (shipped logs and --database) and which fall back
"""

from __future__ import annotations

import argparse
import re
import sys


def _demo(args: argparse.Namespace) -> int:
    from .demo import run_demo

    checks = run_demo(target=_target(args.target), seed=args.seed, parts=args.parts)
    bad = [c.name for c in checks if not c.ok]
    if bad:
        print(f"MISMATCH in {', '.join(bad)}", file=sys.stderr)
        return 1
    print(f"all {len(checks)} checks hold")
    return 0


def _bench(args: argparse.Namespace) -> int:
    if args.target == "cuda":
        from .gpu import run_gpucheck

        return run_gpucheck(out_dir=args.out, suite="bench")
    from .bench import run_bench

    run_bench(out_dir=args.out, floor_all=args.floor_all, long_context=not args.no_long_context,
              sweep=not args.no_sweep)
    return 0


def _gpucheck(args: argparse.Namespace) -> int:
    from .gpu import run_gpucheck

    return run_gpucheck(out_dir=args.out, suite=args.suite)


def _bundle(args: argparse.Namespace) -> int:
    from .deploy.bundle import build_bundle

    build_bundle(args.out, target=args.target, arch=args.arch, suite=args.suite, python=args.python,
                 small=args.small, tune_points=args.tune_points)
    print(f"run it on the node: python3 {args.out}/run.py --out results.json")
    return 0


def _target(text: str):
    import json

    from .build import as_target, host_target

    if text == "host":
        return host_target()
    return as_target(json.loads(text) if text.lstrip().startswith("{") else text)


def _workloads(ops: list[str], shapes: list[str] | None, target) -> list:
    from .tuning.buckets import benchmark_buckets, bucket_module, parse_bucket
    from .tuning.tune import workloads_of

    found = []
    for name in ops:
        buckets = [parse_bucket(text) for text in shapes] if shapes else benchmark_buckets(name)
        for bucket in buckets:
            found += [w for w in workloads_of(bucket_module(name, bucket), target, [name]) if w not in found]
    return found


def _tune(args: argparse.Namespace) -> int:
    import time

    from .tuning import tune

    if args.import_results:
        from .deploy.imports import import_results

        given = [flag for flag, value in (("--op", args.op), ("--shapes", args.shapes),
                                          ("--rpc-tracker", args.rpc_tracker)) if value]
        if given:
            raise ValueError(f"--import takes the workloads and target from the results file, not {given}")

        rows = import_results(args.import_results, args.work_dir)
        print(f"imported {sum(r['points'] for r in rows)} measured knob points of {len(rows)} workload(s) "
              f"into {args.work_dir}")
        return 0
    if args.op is None:
        raise ValueError("give --op (tune here) or --import RESULTS (a GPU node's measurements)")

    target = _target(args.target)
    start = time.perf_counter()
    results = tune(_workloads([args.op], args.shapes, target), target, trials=args.trials, work_dir=args.work_dir,
                   trials_per_iter=args.trials_per_iter, rpc_tracker=args.rpc_tracker, rpc_key=args.rpc_key,
                   verify_top=args.verify_top)
    print(f"\ntuned {len(results)} workload(s) in {time.perf_counter() - start:.0f} s; logs in {args.work_dir}")
    for r in results:
        hand = f"{r.hand_picked_s * 1e3:.2f} ms" if r.hand_picked_s else "failed"
        best = f"{r.best_s * 1e3:.2f} ms ({r.rate(r.best_s)})" if r.best_s else "none"
        ratio = f"{r.speedup:.2f}x" if r.speedup else "-"
        print(f"  {r.workload.describe()}\n    hand-picked {hand}, best {best}, {ratio}; knobs {r.best_knobs}")
    return 0


def _logs(args: argparse.Namespace) -> int:
    import warnings

    from .tuning.buckets import TUNABLE_OPS, benchmark_buckets, bucket_module, parse_bucket
    from .tuning.records import TuningRecords, shipped_logs, target_key
    from .tuning.report import format_report, tuning_report

    target = _target(args.target)
    roots = ([args.database] if args.database else []) + ([] if args.no_shipped else [shipped_logs()])
    print(f"target key: {target_key(target)}")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for root in roots:
            records = TuningRecords([root]).all(target)
            print(f"{root}: {len(records)} usable record(s) for {target_key(target)}")
        if args.module:  # a Relax module in TVMScript, e.g. written by mod.script()
            import tvm

            with open(args.module) as source:
                modules = [tvm.script.from_source(source.read())]
        else:
            modules = [bucket_module(name, bucket) for name in args.op or TUNABLE_OPS
                       for bucket in ([parse_bucket(t) for t in args.shapes] if args.shapes else benchmark_buckets(name))]
        rows = [row for mod in modules for row in tuning_report(mod, target, database=args.database,
                                                                 shipped_logs=not args.no_shipped)]
    for warning in {str(w.message) for w in caught}:
        print(f"warning: {warning}")
    print(format_report(rows))
    return 0


def main(argv: list[str] | None = None) -> int:
    from .tuning.buckets import TUNABLE_OPS

    parser = argparse.ArgumentParser(prog="python -m tvm_fuel", description=__doc__.split("\n")[0])
    commands = parser.add_subparsers(dest="command", required=True)
    demo = commands.add_parser("demo", help="every op vs the reference, a decoder's serving loop, a training run")
    demo.add_argument("--target", default="host", help="CPU target: host (this CPU's features, default), "
                                                         "llvm, or a target JSON")
    demo.add_argument("--parts", nargs="+", choices=["ops", "decoder", "training"],
                      default=["ops", "decoder", "training"])
    demo.add_argument("--seed", type=int, default=0)
    demo.set_defaults(run=_demo)
    bench = commands.add_parser("bench", help="benchmark the floor, the tuned kernels and PyTorch")
    bench.add_argument("--out", default="bench_results", help="folder for bench.json and bench.png")
    bench.add_argument("--floor-all", action="store_true", help="also time the floor on the large cases (slow)")
    bench.add_argument("--no-long-context", action="store_true", help="skip the S=16384 memory probe")
    bench.add_argument("--no-sweep", action="store_true", help="skip the sequence-length sweep of the chart")
    bench.add_argument("--target", choices=["cpu", "cuda"], default="cpu",
                       help="cpu (this machine's llvm) or cuda (device 0; see also gpucheck)")
    bench.set_defaults(run=_bench)
    gpucheck = commands.add_parser("gpucheck", help="on a CUDA device: build the bundle for it and run it here")
    gpucheck.add_argument("--out", default="bench_results", help="folder for the bundle and results.json")
    gpucheck.add_argument("--suite", default="all", choices=["smoke", "check", "bench", "tune", "all"])
    gpucheck.set_defaults(run=_gpucheck)
    bundle = commands.add_parser("bundle", help="build a suite's modules for a node without TVM (run.py runs them)")
    bundle.add_argument("--target", default="cuda", choices=["cuda", "llvm"])
    bundle.add_argument("--arch", help="cuda: sm_80, sm_86, sm_89 or sm_90 (default sm_90)")
    bundle.add_argument("--suite", default="all", choices=["smoke", "check", "bench", "tune", "all"])
    bundle.add_argument("--python", help="the node's Python, e.g. 3.12 (default: this one)")
    bundle.add_argument("--out", required=True, help="the bundle folder (replaced if it holds a bundle)")
    bundle.add_argument("--small", action="store_true", help="a reduced check matrix (quick)")
    bundle.add_argument("--tune-points", type=int, help="at most this many knob points per tune bucket (default 64)")
    bundle.set_defaults(run=_bundle)
    tune = commands.add_parser("tune", help="tune a kernel's knobs with MetaSchedule at static shapes")
    tune.add_argument("--op", choices=TUNABLE_OPS)
    tune.add_argument("--import", dest="import_results", metavar="RESULTS",
                      help="instead of tuning here: records from a bundle run's results.json (its tune stage)")
    tune.add_argument("--target", default="host",
                      help='"host" (this CPU, default), a kind, or a JSON target such as \'{"kind": "llvm", "mcpu": "znver3"}\'')
    tune.add_argument("--shapes", nargs="+", metavar="K=V,...",
                      help="shape buckets, e.g. B=1,H=8,S=1024,D=64,causal=1 or "
                           "B=8,Hq=32,Hkv=8,D=128,block_size=16,ctx=4096 (default: the benchmark's)")
    tune.add_argument("--trials", type=int, default=64,
                      help="measured candidates per bucket (default 64; 0: only verify the database's best)")
    tune.add_argument("--verify-top", type=int, default=3,
                      help="best knob sets re-measured side by side with the hand-picked ones (default 3)")
    tune.add_argument("--trials-per-iter", type=int, default=8, help="candidates per search round (default 8)")
    tune.add_argument("--work-dir", default="tuning_logs", help="log root; an existing database is resumed")
    tune.add_argument("--rpc-tracker", metavar="HOST:PORT", help="measure on the RPC servers of this tracker")
    tune.add_argument("--rpc-key", help="the key those servers registered under")
    tune.set_defaults(run=_tune)
    logs = commands.add_parser("logs", help="which kernels use a tuning record, and which the hand-picked knobs")
    logs.add_argument("--target", default="host")
    logs.add_argument("--database", help="a tuning log root (tune's --work-dir) searched before the shipped logs")
    logs.add_argument("--no-shipped", action="store_true", help="ignore the logs shipped with the package")
    logs.add_argument("--op", nargs="+", choices=TUNABLE_OPS)
    logs.add_argument("--shapes", nargs="+", metavar="K=V,...", help="shape buckets (default: the benchmark's)")
    logs.add_argument("--module", metavar="FILE", help="report on this Relax module (TVMScript, as mod.script() prints)")
    logs.set_defaults(run=_logs)
    args = parser.parse_args(argv)
    try:
        return args.run(args)
    except (ValueError, RuntimeError) as err:  # bad options or a missing device: one line, not a traceback
        text = re.sub(r"^tvm_fuel[ .][\w .-]*?: ", "", " ".join(str(err).split()))  # the command says it
        print(f"python -m tvm_fuel {args.command}: {text}", file=sys.stderr)
        return 2
