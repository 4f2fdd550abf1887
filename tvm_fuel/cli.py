"""Command line: ``python -m tvm_fuel <command>``. Each command calls one library function.

Commands:
    demo   -- every fuel op vs the reference; a Llama-style decoder's greedy generation over a paged
              KV cache (tokens/s, floor vs tuned); a training run's loss curve; PyTorch agreement
    bench  -- floor vs tuned kernels vs PyTorch, with this machine's peaks; writes JSON and a PNG chart
              (``--target cuda``: the CUDA kernels vs the dlight-scheduled floor vs PyTorch CUDA SDPA)
    gpucheck -- on a CUDA device: build the deploy bundle for it and run it (every stage)
    bundle -- build a suite's modules, cubins and a runtime-only TVM for a GPU node without TVM
    tune   -- MetaSchedule tuning of a kernel at static shape buckets; logs under --work-dir
              (``--model M``: every task of a model, fuel kernels and its other TIR functions;
              ``--import results.json``: a bundle run's CUDA measurements as records)
    logs   -- which kernels hit a tuning record (shipped logs and --database) and which fall back

Every output folder is checked before any work (``tvm_fuel.outputs``), and no command writes over
or removes a file there that it did not write.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import sys
from pathlib import Path
from typing import Callable

_MAX_DIM = 2**31 - 1  # a larger dim is no workload to tune: it would only fail deep in the build


def _shape_bucket(text: str) -> dict:
    """argparse type of --shapes: a bucket whose every value is checked here, so a mistake is an
    ``error: argument --shapes: ...`` naming the key, not a traceback from deep in the build."""
    from .op.config import FLOAT_DTYPES, MAX_WINDOW, finite_nonzero_float32
    from .tuning.buckets import parse_bucket

    def bad(message: str):
        return argparse.ArgumentTypeError(f"{message} (in {text!r})")

    items = [item.partition("=") for item in filter(None, (part.strip() for part in text.split(",")))]
    keys = [key for key, sep, _ in items if sep]
    repeated = sorted({key for key in keys if keys.count(key) > 1})
    if repeated:  # parse_bucket would keep the last silently
        raise bad(f"{repeated[0]} is given twice")
    # the keys parse_bucket converts with a bare int()/float() (its error would not name them)
    for key, _, value in items:
        if key == "window":
            sides = value.split(":")
            if len(sides) != 2 or not all(re.fullmatch(r"-?[0-9]+", side) and -1 <= int(side) <= MAX_WINDOW
                                          for side in sides):
                raise bad(f"window must be L:R, two ints in [-1, 2**31 - 1] (-1: unbounded), got {value!r}")
        elif key == "softcap":
            try:
                number = float(value)
            except ValueError:
                number = math.nan
            if not (number == 0 or (number > 0 and math.isfinite(number) and finite_nonzero_float32(number))):
                raise bad(f"softcap must be a float >= 0 (0: off), finite and non-zero as a float32, got {value!r}")
        elif key == "dtype" and value not in FLOAT_DTYPES:
            raise bad(f"dtype must be one of {', '.join(FLOAT_DTYPES)}, got {value!r}")
    try:
        bucket = parse_bucket(text)
    except ValueError as err:  # a missing '=', an unknown key, a dim that is not an int: it names the item
        raise argparse.ArgumentTypeError(re.sub(r"^tvm_fuel tune: ", "", str(err))) from None
    for key, value in bucket.items():
        if key == "causal" and value not in (0, 1):
            raise bad(f"causal must be 0 or 1, got {value}")
        if isinstance(value, int) and key != "causal" and not 1 <= value <= _MAX_DIM:
            raise bad(f"{key} must be an int in [1, 2**31 - 1], got {value}")
    return bucket


def _int_at_least(least: int):
    """argparse type: an int >= ``least`` (MetaSchedule fails deep inside on, e.g., 0 trials per round)."""
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected an int >= {least}, got {text!r}") from None
        if value < least:
            raise argparse.ArgumentTypeError(f"expected an int >= {least}, got {value}")
        return value

    parse.__name__ = f"int >= {least}"
    return parse


def _work_dir(text: str) -> str:
    """argparse type of tune's --work-dir: a folder this user can write (created later, by tune),
    outside the package's own folders but for the shipped logs' root (``--work-dir tuning_logs`` in a
    checkout writes those, on purpose)."""
    from .outputs import check_output_dir
    from .tuning.kernels import WORK_DIR_ENV
    from .dispatch.records import shipped_logs

    try:
        check_output_dir(text, "--work-dir", who="tvm_fuel tune", allow=(shipped_logs(),),
                         hint=f"give a writable --work-dir, or set ${WORK_DIR_ENV}")
    except ValueError as err:
        raise argparse.ArgumentTypeError(re.sub(r"^tvm_fuel tune: --work-dir ", "", str(err))) from None
    return text


def _log_root(text: str) -> str:
    """argparse type of logs' --database: an existing log root folder (a file or a mistyped path
    matched nothing, silently); only read, so a read-only folder or the shipped logs are fine."""
    if os.path.isfile(text):
        raise argparse.ArgumentTypeError(
            f"{text} is a file; give the log root directory (tune's --work-dir) or the folder holding "
            f"database_tuning_record.json")
    if not os.path.isdir(text):
        raise argparse.ArgumentTypeError(f"no such folder: {text}")
    return text


def _existing_file(text: str) -> str:
    """argparse type of --module: a file that exists."""
    if not os.path.isfile(text):
        raise argparse.ArgumentTypeError(f"no such file: {text}")
    return text


def _demo(args: argparse.Namespace) -> int:
    from .demo import run_demo

    checks = run_demo(target=_target(args.target), seed=args.seed, parts=args.parts)
    bad = [c.name for c in checks if not c.ok]
    if bad:
        print(f"MISMATCH in {', '.join(bad)}", file=sys.stderr)
        return 1
    print(f"all {len(checks)} checks hold")
    return 0


# the row groups a CPU bench run writes after the kernel rows: (option that skips it, bench module, its rows)
_ROW_GROUPS = (("no_decoder", "decoder", "decoder_rows"), ("no_norm", "norm", "norm_rows"),
               ("no_sinks", "sinks", "sink_rows"), ("no_quantized", "quantized", "quantized_rows"),
               ("no_varlen", "varlen", "varlen_rows"))
_KERNEL_FILES = ("bench.json", "bench.png")  # what run_bench writes


def _bench_groups(args: argparse.Namespace) -> list[tuple[str, str, Callable]]:
    """(file, bench module, its report from the module) of each row group a CPU bench run of these
    options writes besides the kernel rows, in order: the files are claimed before any runs."""
    if args.tvm_cache:
        return [("tvm_cache.json", "tvm_cache", lambda module: module.tvm_cache_rows())]
    if args.gemm:
        return [("gemm.json", "gemm", lambda module: module.gemm_rows())]
    if args.models:
        return [("models.json", "models",
                 lambda module: module.model_rows(module.MODEL_ROWS if "all" in args.models else args.models))]
    groups = [(f"{name}.json", name, lambda module, rows=rows: getattr(module, rows)())
              for option, name, rows in _ROW_GROUPS if not args.higher_order_only and not getattr(args, option)]
    if not args.no_higher_order:
        groups.append(("higher_order.json", "higher_order",
                       lambda module: module.higher_order_rows(memory=not args.no_long_context)))
    return groups


def _bench(args: argparse.Namespace) -> int:
    if args.target == "cuda":
        from .deploy.gpucheck import run_gpucheck

        return run_gpucheck(out_dir=args.out, suite="bench")  # it checks --out before anything runs
    import importlib

    from .outputs import OutputFiles

    groups = _bench_groups(args)
    kernel_rows = not (args.tvm_cache or args.models or args.gemm or args.higher_order_only)
    outputs = OutputFiles(args.out, [*(_KERNEL_FILES if kernel_rows else ()), *(file for file, _, _ in groups)],
                          command="bench")
    outputs.claim()  # a bad --out or a file of the user's there: refused now, not after minutes of benchmark
    if kernel_rows:
        from .bench.attention import run_bench

        run_bench(out_dir=args.out, floor_all=args.floor_all, long_context=not args.no_long_context,
                  sweep=not args.no_sweep)
        outputs.record(_KERNEL_FILES)
    for file, name, rows in groups:
        module = importlib.import_module(f"{__package__}.bench.{name}")
        report = rows(module)
        module.print_rows(report)
        print(f"wrote {outputs.write_text(file, json.dumps(report, indent=2))}")
    return 0


def _model_row(text: str) -> tuple[int, int, str] | str:
    """``SEQxBATCH:DTYPE`` (``512x1:float32``) as a model row, or ``all``."""
    if text == "all":
        return text
    try:
        shape, dtype = text.split(":")
        seq, batch = (int(n) for n in shape.split("x"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"a row is SEQxBATCH:DTYPE (512x1:float32) or all, got {text!r}") from None
    if dtype not in ("float32", "bfloat16") or seq < 1 or batch < 1:
        raise argparse.ArgumentTypeError(f"{text!r}: the dtype is float32 or bfloat16, the lengths at least 1")
    return seq, batch, dtype


def _gpucheck(args: argparse.Namespace) -> int:
    from .deploy.gpucheck import run_gpucheck

    return run_gpucheck(out_dir=args.out, suite=args.suite)


def _bundle(args: argparse.Namespace) -> int:
    from .deploy.bundle import build_bundle

    build_bundle(args.out, target=args.target, arch=args.arch, suite=args.suite, python=args.python,
                 small=args.small, tune_points=args.tune_points)
    print(f"run it on the node: python3 {args.out}/run.py --out results.json")
    return 0


def _target(text: str):
    import json

    from .target import as_target, host_target

    if text == "host":
        return host_target()
    return as_target(json.loads(text) if text.lstrip().startswith("{") else text)


def _workloads(ops: list[str], shapes: list[dict] | None, target) -> list:
    from .tuning.buckets import benchmark_buckets, bucket_module
    from .tuning.kernels import workloads_of

    found = []
    for name in ops:
        buckets = shapes or benchmark_buckets(name)  # --shapes arrive parsed (_shape_bucket)
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
    if args.model:
        return _tune_model(args)
    if args.at:
        raise ValueError("--at goes with --model")
    if args.op is None:
        raise ValueError("give --op or --model (tune here), or --import RESULTS (a GPU node's measurements)")

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
    # the logs are outside the shipped ones by default: say how a build reads them
    print(f"builds apply them with tvm_fuel.compile(..., kernels=\"tuned\", database={args.work_dir!r}); "
          f"python -m tvm_fuel logs --database {args.work_dir} lists which kernels hit them")
    return 0


def _load_model(text: str):
    """--model: a TVMScript file (an IRModule), or a Python module (dotted name or .py file) whose
    ``tuning_module()`` returns an IRModule or (IRModule, shape points). ValueError naming --model
    for anything else: the file or module fails to load, tuning_module() is missing, raises or
    returns something else."""
    import importlib
    import importlib.util

    import tvm

    from .transform.specialize import ShapePoint

    if os.path.isfile(text) and not text.endswith(".py"):
        return _read_module(text, "--model"), []
    if text.endswith(".py") and not os.path.isfile(text):
        raise ValueError(f"--model {text}: no such file")
    try:
        if text.endswith(".py"):
            spec = importlib.util.spec_from_file_location(Path(text).stem, text)
            module = importlib.util.module_from_spec(spec)
            spec.loader.exec_module(module)
        else:
            module = importlib.import_module(text)
    except ImportError as err:
        raise ValueError(f"--model {text}: neither a file nor an importable module ({err})") from None
    except Exception as err:  # noqa: BLE001 -- the user's code: a SyntaxError, or whatever it raised
        raise ValueError(f"--model {text}: loading it failed: {_first_line(err)}") from None
    make = getattr(module, "tuning_module", None)
    if not callable(make):
        raise ValueError(f"--model {text}: the module has no tuning_module() (it returns the IRModule to tune, "
                         f"or the IRModule and its shape points)")
    try:
        made = make()
    except Exception as err:  # noqa: BLE001 -- the user's code
        raise ValueError(f"--model {text}: tuning_module() raised {_first_line(err)}") from None
    mod, points = made if isinstance(made, tuple) and len(made) == 2 else (made, [])
    if not isinstance(mod, tvm.IRModule):
        raise ValueError(f"--model {text}: tuning_module() must return an IRModule or (IRModule, shape points), "
                         f"got {_kind(made)}")
    try:
        points = list(points)
    except TypeError:
        raise ValueError(f"--model {text}: tuning_module()'s shape points must be a list of "
                         f"tvm_fuel.ShapePoint, got {_kind(points)}") from None
    for index, point in enumerate(points):
        if not isinstance(point, ShapePoint):
            raise ValueError(f"--model {text}: tuning_module()'s shape point {index} must be a "
                             f"tvm_fuel.ShapePoint, got {_kind(point)}")
    return mod, points


def _first_line(err: BaseException) -> str:
    """An exception as one line: its type and the first line of its message (and a SyntaxError's place)."""
    first = next((line.strip() for line in str(err).splitlines() if line.strip()), "")
    if isinstance(err, SyntaxError) and err.lineno:
        first = f"{err.msg} ({err.filename}, line {err.lineno})"
    return f"{type(err).__name__}: {first[:200]}" if first else type(err).__name__


def _kind(value) -> str:
    text = repr(value)
    return f"{type(value).__name__} {text[:60] + '...' if len(text) > 60 else text}"


def _shape_point(text: str):
    """argparse type of --at: FUNC:NAME=VALUE[,NAME=VALUE...]."""
    from .transform.specialize import ShapePoint

    function, _, dims = text.partition(":")
    try:
        items = [(name.strip(), int(value)) for name, value in (item.split("=") for item in dims.split(","))]
        names = [name for name, _ in items]
        if not function.strip() or not all(names):
            raise ValueError("a name is empty")
        point = ShapePoint(function.strip(), dict(items))
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not FUNC:NAME=VALUE[,NAME=VALUE...] with positive "
                                         f"integer values, e.g. prefill:batch=1,seq_len=1000") from None
    repeated = sorted({name for name in names if names.count(name) > 1})
    if repeated:  # a dict would keep the last value silently
        raise argparse.ArgumentTypeError(f"{text!r} gives the dim {repeated[0]} twice")
    return point


def _tune_model(args: argparse.Namespace) -> int:
    import time

    from .tuning.model import tune_model

    if args.op or args.shapes:
        raise ValueError("--model tunes the model's own workloads: give no --op or --shapes")
    mod, points = _load_model(args.model)
    points += [p for p in args.at or [] if p not in points]
    target = _target(args.target)
    start = time.perf_counter()
    result = tune_model(mod, target, points=points, trials=args.trials, work_dir=args.work_dir,
                        trials_per_iter=args.trials_per_iter, verify_top=max(1, args.verify_top),
                        rpc_tracker=args.rpc_tracker, rpc_key=args.rpc_key)
    print(f"\ntuned {len(result.kernels)} fuel kernel workload(s) and {len(result.functions)} TIR function(s) in "
          f"{time.perf_counter() - start:.0f} s ({args.trials} trials each); logs in {args.work_dir}")
    for point in result.points:
        print(f"  shape point {point.function}: {dict(point.dims)}")
    for r in result.kernels:
        ratio = f"{r.speedup:.2f}x hand-picked" if r.speedup else "-"
        print(f"  kernel   {r.workload.describe()}: {ratio}")
    for f in result.functions:
        best = f"{f.best_s * 1e3:.3f} ms" if f.best_s else "none"
        ratio = f"{f.speedup:.2f}x the default schedule" if f.speedup else "-"
        print(f"  function {f.name}: best {best}, {ratio}")
    print(f"builds apply them with tvm_fuel.compile(..., kernels=\"tuned\", database={args.work_dir!r}); "
          f"python -m tvm_fuel logs --database {args.work_dir} --module FILE lists which functions hit them")
    return 0


def _logs(args: argparse.Namespace) -> int:
    import warnings

    from .tuning.buckets import TUNABLE_OPS, benchmark_buckets, bucket_module
    from .dispatch.records import TuningRecords, shipped_logs, target_key
    from .tuning.report import format_report, tuning_report

    target = _target(args.target)
    module = _read_module(args.module) if args.module else None  # a bad file fails before any output
    roots = ([args.database] if args.database else []) + ([] if args.no_shipped else [shipped_logs()])
    print(f"target key: {target_key(target)}")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for root in roots:
            records = TuningRecords([root]).all(target)
            print(f"{root}: {len(records)} usable record(s) for {target_key(target)}")
        if module is not None:  # a Relax module in TVMScript, e.g. written by mod.script()
            modules = [module]
        else:
            modules = [bucket_module(name, bucket) for name in args.op or TUNABLE_OPS
                       for bucket in (args.shapes or benchmark_buckets(name))]
        rows = [row for mod in modules for row in tuning_report(mod, target, database=args.database,
                                                                 shipped_logs=not args.no_shipped,
                                                                 functions=module is not None)]
    for warning in {str(w.message) for w in caught}:
        print(f"warning: {warning}")
    print(format_report(rows))
    return 0


def _read_module(path: str, flag: str = "--module"):
    """The IRModule of a TVMScript file; ValueError naming ``flag`` (the option that gave the file)
    if it is not one."""
    import tvm

    what = f"{flag} {path} is not a Relax module in TVMScript (as mod.script() prints)"
    try:
        with open(path, encoding="utf-8") as source:
            text = source.read()
    except UnicodeDecodeError:
        raise ValueError(f"{what}: not UTF-8 text") from None
    try:
        mod = tvm.script.from_source(text)
    except Exception as err:  # noqa: BLE001 -- the parser's errors are of many kinds; each means "not TVMScript"
        first = next((line.strip() for line in str(err).splitlines() if line.strip()), type(err).__name__)
        first = re.sub(r"^error: ", "", first)  # TVM's diagnostics start so; ours says it once
        raise ValueError(f"{what}: {first[:200]}") from None
    if not isinstance(mod, tvm.IRModule):  # e.g. a lone PrimFunc
        raise ValueError(f"{what}: it holds a {type(mod).__name__}")
    return mod


def build_parser() -> argparse.ArgumentParser:
    """The command line's parser (defaults such as tune's --work-dir are read from the environment now)."""
    from .tuning.buckets import TUNABLE_OPS
    from .tuning.kernels import WORK_DIR_ENV, default_work_dir

    parser = argparse.ArgumentParser(prog="python -m tvm_fuel", description=__doc__.split("\n")[0])
    commands = parser.add_subparsers(dest="command", required=True)
    demo = commands.add_parser("demo", help="every op vs the reference, a decoder's serving loop, a training run, "
                                            "second-order training")
    demo.add_argument("--target", default="host", help="CPU target: host (this CPU's features, default), "
                                                         "llvm, or a target JSON")
    which = demo.add_mutually_exclusive_group()
    which.add_argument("--parts", nargs="+", choices=["ops", "decoder", "training", "second-order"],
                       default=["ops", "decoder", "training", "second-order"])
    which.add_argument("--quick", action="store_const", const=["ops"], dest="parts",
                       help="the ops part only (every op vs the reference, under a minute): same as --parts ops")
    demo.add_argument("--seed", type=int, default=0)
    demo.set_defaults(run=_demo)
    bench = commands.add_parser("bench", help="benchmark the floor, the tuned kernels and PyTorch")
    bench.add_argument("--out", default="bench_results",
                       help="folder for bench.json, bench.png and each row group's JSON (default bench_results); "
                            "a file of those names that this command did not write there (its record: "
                            ".tvm_fuel-outputs.json) makes it refuse before running, anything else there is left "
                            "alone; with --target cuda as gpucheck's --out")
    bench.add_argument("--floor-all", action="store_true", help="also time the floor on the large cases (slow)")
    bench.add_argument("--no-long-context", action="store_true", help="skip the S=16384 memory probe")
    bench.add_argument("--no-sweep", action="store_true", help="skip the sequence-length sweep of the chart")
    higher = bench.add_mutually_exclusive_group()
    higher.add_argument("--no-higher-order", action="store_true",
                        help="skip the forward-mode and double-backward rows (their expanded path takes minutes)")
    higher.add_argument("--higher-order-only", action="store_true",
                        help="only the forward-mode and double-backward rows (higher_order.json)")
    bench.add_argument("--no-decoder", action="store_true",
                       help="skip the demo decoder's end-to-end rows against PyTorch (decoder.json)")
    bench.add_argument("--no-norm", action="store_true",
                       help="skip the norm backward rows: fused kernel, floor, composition, PyTorch (norm.json)")
    bench.add_argument("--no-quantized", action="store_true",
                       help="skip the quantized-cache rows: paged decode over bfloat16, fp8 and int8 caches "
                            "(quantized.json)")
    bench.add_argument("--no-varlen", action="store_true",
                       help="skip the varlen row: a packed batch of prompts against padding and PyTorch's SDPA per "
                            "prompt (varlen.json)")
    bench.add_argument("--no-sinks", action="store_true",
                       help="skip the attention sinks rows: with and without sinks, PyTorch's eager gpt-oss "
                            "attention (sinks.json)")
    instead = bench.add_mutually_exclusive_group()  # each replaces the kernel rows
    instead.add_argument("--models", nargs="+", metavar="ROW", type=_model_row,
                         help="instead of the kernel rows: the Hugging Face rows, an exported SmolLM-135M-shaped "
                              "Llama against PyTorch eager and torch.compile; 'all' (S 512, 2048 x B 1, 4 x float32, "
                              "bfloat16) or rows SEQxBATCH:DTYPE (512x1:float32); then the decode rows, 512-token "
                              "prompts at B 1 and 4 and 128 greedy steps over a KV cache against transformers' "
                              "DynamicCache")
    instead.add_argument("--tvm-cache", action="store_true",
                         help="instead of the kernel rows: one layer's prefill and decode inside TVM's own paged KV "
                              "cache (MLC-LLM's runtime), TVM's CPU kernels against fuel's in its slots")
    instead.add_argument("--gemm", action="store_true",
                         help="instead of the kernel rows: the SmolLM-135M-shaped model's matmuls (prefill M 512, "
                              "decode M 1, 4, 8; the weight a parameter and a constant) against "
                              "torch.nn.functional.linear and this machine's FMA and read probes (gemm.json)")
    bench.add_argument("--target", choices=["cpu", "cuda"], default="cpu",
                       help="cpu (this machine's llvm) or cuda (device 0; see also gpucheck)")
    bench.set_defaults(run=_bench)
    gpucheck = commands.add_parser("gpucheck", help="on a CUDA device: build the bundle for it and run it here")
    gpucheck.add_argument("--out", default="bench_results",
                          help="folder for the bundle (bundle-ARCH) and results.json (default bench_results); a "
                               "rerun replaces both, but a results.json that is not the results of the bundle "
                               "there (another bundle's, your own) makes it refuse before building")
    gpucheck.add_argument("--suite", default="all", choices=["smoke", "check", "bench", "tune", "all"])
    gpucheck.set_defaults(run=_gpucheck)
    bundle = commands.add_parser("bundle", help="build a suite's modules for a node without TVM (run.py runs them)")
    bundle.add_argument("--target", default="cuda", choices=["cuda", "llvm"])
    bundle.add_argument("--arch", help="cuda: sm_80, sm_86, sm_89 or sm_90 (default sm_90)")
    bundle.add_argument("--suite", default="all", choices=["smoke", "check", "bench", "tune", "all"])
    bundle.add_argument("--python", help="the node's Python, e.g. 3.12 (default: this one)")
    bundle.add_argument("--out", required=True,
                        help="the bundle folder: new or empty, or one holding an earlier bundle, which is replaced "
                             "(a folder holding anything else is refused before building, and left as it is)")
    bundle.add_argument("--small", action="store_true", help="a reduced check matrix (quick)")
    bundle.add_argument("--tune-points", type=_int_at_least(1),
                        help="at most this many knob points per tune bucket (default 64)")
    bundle.set_defaults(run=_bundle)
    tune = commands.add_parser("tune", help="tune a kernel's knobs, or a whole model, with MetaSchedule")
    tune.add_argument("--op", choices=TUNABLE_OPS)
    tune.add_argument("--model", metavar="MODULE_OR_FILE",
                      help="tune every task of a model: a Python module (e.g. tvm_fuel.models.llama) or .py file "
                           "with tuning_module(), or a TVMScript file; its fuel kernels through their knobs, every "
                           "other TIR function through MetaSchedule's design spaces, into one --work-dir")
    tune.add_argument("--at", nargs="+", metavar="FUNC:NAME=VALUE,...", type=_shape_point,
                      help="with --model: shape points to specialize its symbolic dims at, e.g. "
                           "prefill:batch=1,seq_len=1000 decode:batch=4 (added to the module's own)")
    tune.add_argument("--import", dest="import_results", metavar="RESULTS",
                      help="instead of tuning here: records from a bundle run's results.json (its tune stage)")
    tune.add_argument("--target", default="host",
                      help='"host" (this CPU, default), a kind, or a JSON target such as '
                           '\'{"kind": "llvm", "mcpu": "znver3"}\'')
    tune.add_argument("--shapes", nargs="+", metavar="K=V,...", type=_shape_bucket,
                      help="shape buckets, e.g. B=1,H=8,S=1024,D=64,causal=1 or "
                           "B=8,Hq=32,Hkv=8,D=128,block_size=16,ctx=4096 (default: the benchmark's)")
    tune.add_argument("--trials", type=_int_at_least(0), default=64,
                      help="measured candidates per bucket or model task (default 64; 0: only verify the "
                           "database's best)")
    tune.add_argument("--verify-top", type=_int_at_least(0), default=3,
                      help="best knob sets re-measured side by side with the hand-picked ones (default 3; 0: none)")
    tune.add_argument("--trials-per-iter", type=_int_at_least(1), default=8,
                      help="candidates per search round (default 8)")
    # a per-user default: a relative tuning_logs run from a checkout appended to the shipped logs
    tune.add_argument("--work-dir", type=_work_dir, default=str(default_work_dir()),
                      help=f"log root; an existing database is resumed (default: %(default)s, from "
                           f"${WORK_DIR_ENV} if set, else the user cache dir; never the shipped logs unless given)")
    tune.add_argument("--rpc-tracker", metavar="HOST:PORT", help="measure on the RPC servers of this tracker")
    tune.add_argument("--rpc-key", help="the key those servers registered under")
    tune.set_defaults(run=_tune)
    logs = commands.add_parser("logs", help="which kernels use a tuning record, and which the hand-picked knobs")
    logs.add_argument("--target", default="host")
    logs.add_argument("--database", type=_log_root,
                      help=f"a tuning log root searched before the shipped logs, e.g. tune's --work-dir (whose "
                           f"default is {default_work_dir()}); none unless given, as in tvm_fuel.compile")
    logs.add_argument("--no-shipped", action="store_true", help="ignore the logs shipped with the package")
    logs.add_argument("--op", nargs="+", choices=TUNABLE_OPS)
    logs.add_argument("--shapes", nargs="+", metavar="K=V,...", type=_shape_bucket,
                      help="shape buckets (default: the benchmark's)")
    logs.add_argument("--module", metavar="FILE", type=_existing_file,
                      help="report on this Relax module (TVMScript, as mod.script() prints): its kernels and its "
                           "other TIR functions (a MetaSchedule record or the default schedule)")
    logs.set_defaults(run=_logs)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Run a command; bad options exit 2 with argparse's ``error:`` line, as do errors the command
    raises for bad input (ValueError, TypeError), a missing device (RuntimeError) or a path (OSError)."""
    args = build_parser().parse_args(argv)
    try:
        return args.run(args)
    except (ValueError, TypeError, RuntimeError, OSError) as err:  # one line, not a traceback
        text = re.sub(r"^tvm_fuel[ .][\w .-]*?: ", "", " ".join(str(err).split()))  # the command says it
        print(f"python -m tvm_fuel {args.command}: error: {text}", file=sys.stderr)
        return 2
