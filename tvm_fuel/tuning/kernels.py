"""``tvm_fuel.tune``: MetaSchedule's evolutionary search over the fuel kernels' knobs.

One task per static workload (a fuel call of the module with static shapes), grouped into one
database per kernel family under ``<work_dir>/<target key>/<kernel>/``, the layout
``tvm_fuel.compile`` reads. Before searching, each task measures its hand-picked knobs (once: a
resumed run finds that record), so the progress lines show the speed-up. The search resumes from
what the database already holds (``logs.LogDatabase``: JSONDatabase's files read line by line, so
the torn last line of a killed run is skipped with a warning, and written one whole line at a
time). Afterwards the best knob sets are re-measured side by side with the hand-picked ones, a
few rounds (single measurements on a shared machine drift by 10-30 %); those verified records
are what ``tvm_fuel.compile`` chooses from, so a kernel only leaves its hand-picked knobs for
ones that beat them in the same rounds.

Logs go to ``work_dir``, by default ``default_work_dir()``: a per-user cache directory, never the
logs shipped with the package (``--work-dir tuning_logs`` in a checkout still writes those, on purpose).

Contents:
    tune               -- tune a module's fuel kernels (or given workloads); returns TaskResult rows
    TaskResult         -- what one task found
    workloads_of       -- the static kernel workloads of a module's fuel calls
    default_work_dir   -- $TVM_FUEL_TUNING_DIR, else the user's cache dir: where logs go unless told
    check_writable_dir -- ValueError unless a path is, or can be made, a writable directory
"""

from __future__ import annotations

import contextlib
import os
import statistics
import sys
import time
import types
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Iterable

import tvm
from tvm import relax
from tvm.ir.utils import derived_object
from tvm.s_tir import meta_schedule as ms

from ..target import as_target
from ..op.config import as_int
from ..op import SPECS
from ..dispatch.routing import route
from ..schedules import rule_for
from ..schedules.workload import Workload
from . import measure
from .buckets import TUNABLE_OPS
from ..dispatch.records import kernel_family, knobs_of, replay, target_key
from ..dispatch.log_database import LogDatabase
from .space import KnobFeatures, fixed_point, space_generator, workload_module

_OP_NAMES = {spec.op_name: name for name, spec in SPECS.items()}
WORK_DIR_ENV = "TVM_FUEL_TUNING_DIR"


def default_work_dir() -> Path:
    """Where ``tune`` writes logs unless told: ``$TVM_FUEL_TUNING_DIR`` if set, else
    ``$XDG_CACHE_HOME/tvm_fuel/tuning_logs`` or ``~/.cache/tvm_fuel/tuning_logs``.

    Never the shipped logs (a relative ``tuning_logs`` run from a checkout was exactly those):
    tuning on one machine must not change what every tuned build elsewhere reads."""
    explicit = os.environ.get(WORK_DIR_ENV)
    if explicit:
        return Path(explicit).expanduser()
    cache = os.environ.get("XDG_CACHE_HOME", "")
    if not os.path.isabs(cache):  # the XDG spec: unset, empty or relative means ~/.cache
        cache = "~/.cache"
    return Path(cache).expanduser() / "tvm_fuel" / "tuning_logs"


def check_writable_dir(path: str | os.PathLike, name: str = "work_dir", *, who: str = "tvm_fuel.tune") -> Path:
    """``path`` as a Path if it is a writable directory or can be created as one (nothing is
    created here); else ValueError naming ``who`` and ``name``, so a run fails before it tunes."""
    path = Path(path).expanduser()
    # os.path's tests: False rather than PermissionError where a parent cannot be searched
    if os.path.exists(path) and not os.path.isdir(path):
        raise ValueError(f"{who}: {name} must be a directory, but {path} is a file")
    existing = path
    while not os.path.exists(existing) and existing != existing.parent:  # where mkdir will write
        existing = existing.parent
    if not os.path.isdir(existing):
        raise ValueError(f"{who}: {name} {path} cannot be created: {existing} is a file")
    if not os.access(existing, os.W_OK | os.X_OK):  # also catches a read-only file system, even for root
        state = "is not writable" if existing == path else f"cannot be created: {existing} is not writable"
        raise ValueError(f"{who}: {name} {path} {state} (give a writable {name}, or set ${WORK_DIR_ENV})")
    return path


@dataclass
class TaskResult:
    """One tuned workload: times in seconds (mean of the measured repeats)."""

    workload: Workload
    log_dir: Path
    trials: int = 0
    hand_picked_s: float | None = None
    best_s: float | None = None
    best_knobs: dict = field(default_factory=dict)

    @property
    def speedup(self) -> float | None:
        """Hand-picked time over the best tuned time (>= 1)."""
        if self.hand_picked_s is None or self.best_s is None:
            return None
        return self.hand_picked_s / self.best_s

    def rate(self, seconds: float) -> str:
        """GFLOP/s (dense) or GB/s of K/V read (paged) at ``seconds``."""
        return _rate(self.workload, seconds)


def workloads_of(mod: tvm.IRModule, target: tvm.target.Target, ops: Iterable[str] | None = None) -> list[Workload]:
    """The distinct static workloads of the fuel calls of ``mod`` served by a tunable kernel on
    ``target`` (the norm backward kernels' knobs are hand-picked: memory-bound, one pass); a call
    with sinks: the sink-free kernel's that serves it (``dispatch.routing.route``)."""
    wanted = set(ops) if ops is not None else None
    found: list[Workload] = []

    def visit(expr):
        if not (isinstance(expr, relax.Call) and isinstance(expr.op, tvm.ir.Op) and expr.op.name in _OP_NAMES):
            return
        name = _OP_NAMES[expr.op.name]
        if wanted is not None and kernel_family(name) not in wanted:
            return
        found_route = route(name, expr, target)
        workload = found_route.workload
        if found_route.rule is not None and found_route.rule.tunable and workload.is_static and workload not in found:
            found.append(workload)

    for _, func in mod.functions.items():
        if isinstance(func, relax.Function):
            relax.analysis.post_order_visit(func, visit)
    return found


def _rate(workload: Workload, seconds: float) -> str:
    from ..testing.cases import attention_flops, kv_bytes

    spec, dims = workload.spec, workload.dim
    if workload.op == "paged_attn":  # measured with every table full (see measure._arrays)
        itemsize = 2 if spec.dtype in ("float16", "bfloat16") else 4
        read = kv_bytes(dims["B"], dims["max_blocks"] * spec.block_size, spec.num_kv_heads, spec.head_dim, itemsize)
        return f"{read / seconds / 1e9:.1f} GB/s"
    flops = attention_flops(dims["B"], spec.num_q_heads, dims["Sq"], dims["Sk"], spec.head_dim,
                            causal=spec.cfg.causal, backward=bool(workload.grads))
    return f"{flops / seconds / 1e9:.1f} GFLOP/s"


@contextlib.contextmanager
def _without_tensor_intrinsics():
    """TuneContext imports tvm.s_tir.tensor_intrin (about a minute on 2 cores) so that tensorize
    rules can find intrinsics; the fuel spaces use none, so a placeholder stands in meanwhile.
    It is removed afterwards: a later real import still loads the intrinsics."""
    name = "tvm.s_tir.tensor_intrin"
    if name in sys.modules:
        yield
        return
    sys.modules[name] = types.ModuleType(name)
    try:
        yield
    finally:
        if isinstance(sys.modules.get(name), types.ModuleType) and not hasattr(sys.modules[name], "__file__"):
            del sys.modules[name]


@derived_object
class _Progress(ms.measure_callback.PyMeasureCallback):
    """Prints trials done, the best time and its GFLOP/s or GB/s after every measured batch."""

    def __init__(self, results: list[TaskResult], trials: int, log: Callable[[str], None]):
        self.results, self.trials, self.log = results, trials, log
        self.start = time.perf_counter()

    def apply(self, task_scheduler, task_id, measure_candidates, builder_results, runner_results) -> None:
        result = self.results[task_id]
        for candidate, run in zip(measure_candidates, runner_results):
            result.trials += 1
            seconds = [float(s) for s in (run.run_secs or [])]
            if run.error_msg or not seconds:
                continue
            mean = sum(seconds) / len(seconds)
            if result.best_s is None or mean < result.best_s:
                result.best_s, result.best_knobs = mean, knobs_of(candidate.sch.mod)[1]
        _report(result, self.trials, time.perf_counter() - self.start, self.log)


def _report(result: TaskResult, trials: int, elapsed: float, log: Callable[[str], None]) -> None:
    best = "no valid trial yet" if result.best_s is None else (
        f"best {result.best_s * 1e3:.2f} ms ({result.rate(result.best_s)})")
    ratio = f", {result.speedup:.2f}x hand-picked" if result.speedup else ""
    log(f"[{elapsed:6.0f}s] {result.workload.describe()}: trials {result.trials}/{trials}, {best}{ratio}")


def commit_record(database, mod: tvm.IRModule, sch, seconds: list[float] | None, target) -> None:
    """Store the knob point ``sch`` of tuning task ``mod`` with its measured ``seconds`` (None: failed)."""
    args_info = ms.arg_info.ArgInfo.from_prim_func(sch.mod["main"])
    database.commit_tuning_record(ms.database.TuningRecord(
        sch.trace, database.commit_workload(mod), run_secs=seconds or [1e10], target=target, args_info=args_info))


def _verify(result: TaskResult, mod: tvm.IRModule, defaults: dict, database, target, builder, runner, *,
            top: int, rounds: int) -> None:
    """Re-measure the ``top`` best knob sets of the database side by side with the hand-picked
    knobs and commit them as verified records (the ones ``tvm_fuel.compile`` then chooses from)."""
    def is_default(knobs):
        return all(defaults.get(k) == v for k, v in knobs.items())

    best: dict = {}
    for knobs, _ in sorted(_recorded(database, mod), key=lambda item: item[1]):
        if len(best) < top and not is_default(knobs):
            best.setdefault(tuple(sorted(knobs.items())), knobs)
    points = [defaults, *best.values()]
    session = int(time.time())  # records of one verification are comparable with each other only
    schedules = [fixed_point(mod, knobs, verification=session) for knobs in points]
    times = measure.side_by_side(schedules, target, builder, runner, rounds)
    for sch, seconds in zip(schedules, times):
        commit_record(database, mod, sch, seconds, target)
    measured = [(knobs_of(sch.mod)[1], statistics.median(t)) for sch, t in zip(schedules, times) if t]
    if times[0]:
        result.hand_picked_s = statistics.median(times[0])
    if measured:
        result.best_knobs, result.best_s = min(measured, key=lambda item: item[1])


def _recorded(database, mod: tvm.IRModule) -> list[tuple[dict, float]]:
    """(knobs, median seconds) of the records the database holds for ``mod``'s workload."""
    if not database.has_workload(mod):
        return []
    records = (replay(raw) for raw in database.get_top_k(database.commit_workload(mod), 10**6))
    return [(record.knobs, record.seconds) for record in records if record is not None]


def tune(mod: tvm.IRModule | Iterable[Workload], target, *, ops: Iterable[str] | None = None, trials: int = 64,
         work_dir: str | os.PathLike | None = None, trials_per_iter: int = 8, rpc_tracker: str | None = None,
         rpc_key: str | None = None, verify_top: int = 3, verify_rounds: int = 5, seed: int = 1,
         log: Callable[[str], None] | None = None) -> list[TaskResult]:
    """Tune the fuel kernels of ``mod`` for ``target`` with MetaSchedule; return one TaskResult per workload.

    Parameters
    ----------
    mod : tvm.IRModule or iterable of Workload
        Its fuel calls with static shapes are the tasks (a symbolic call has nothing to measure).
    target : str, dict or Target
        Where the kernels run, e.g. ``tvm_fuel.host_target()``.
    ops : iterable of str, optional
        Kernel families to tune (``paged_attn``, ``flash_attn_backward``, ``flash_attn``); all by default.
    trials : int
        New measurements per task (the hand-picked point is measured once more, on a fresh log);
        0 only verifies what the database holds.
    work_dir : path, optional
        Log root: records go to ``<work_dir>/<target key>/<kernel>/``; an existing database there
        is resumed. MetaSchedule's own logs go to ``<work_dir>/logs/``. Default:
        ``default_work_dir()`` (``$TVM_FUEL_TUNING_DIR`` or ``~/.cache/tvm_fuel/tuning_logs``);
        pass it to ``tvm_fuel.compile(..., database=...)`` to build with the records.
    verify_top, verify_rounds : int
        After the search, the ``verify_top`` best knob sets and the hand-picked ones are measured
        side by side ``verify_rounds`` times and committed as verified records, which are the ones
        ``tvm_fuel.compile`` chooses from (0: no verification).
    rpc_tracker, rpc_key : str, optional
        ``HOST:PORT`` of a TVM RPC tracker and the key its servers registered: candidates are
        measured there (one at a time per server) while builds run locally.

    Examples
    --------
    >>> from tvm_fuel.tuning.buckets import bucket_module
    >>> mod = bucket_module("paged_attn", dict(B=8, Hq=32, Hkv=8, D=128, block_size=16, ctx=4096))
    >>> results = tvm_fuel.tune(mod, tvm_fuel.host_target(), trials=16)     # doctest: +SKIP
    >>> ex = tvm_fuel.compile(mod, tvm_fuel.host_target(), kernels="tuned",
    ...                       database=default_work_dir())                   # doctest: +SKIP
    """
    target = as_target(target)
    log = log or (lambda line: print(line, flush=True))
    if isinstance(ops, str):  # list("paged_attn") would be its letters
        raise TypeError(f"tvm_fuel.tune: ops must be a list of op names, got the str {ops!r} (use [{ops!r}])")
    if ops is not None:
        ops = list(ops)
        unknown = [o for o in ops if o not in TUNABLE_OPS]
        if unknown:
            raise ValueError(f"tvm_fuel.tune: ops must be among {TUNABLE_OPS}, got {unknown}")
    trials, trials_per_iter, verify_top, verify_rounds, seed = (
        as_int("tvm_fuel.tune", name, value) for name, value in (
            ("trials", trials), ("trials_per_iter", trials_per_iter), ("verify_top", verify_top),
            ("verify_rounds", verify_rounds), ("seed", seed)))
    for name, value, least in (("trials", trials, 0), ("trials_per_iter", trials_per_iter, 1),
                               ("verify_top", verify_top, 0), ("verify_rounds", verify_rounds, 1),
                               ("seed", seed, 0)):
        if value < least:  # MetaSchedule would fail deep inside on these ("Check failed: st < ed")
            raise ValueError(f"tvm_fuel.tune: {name} must be >= {least}, got {value}")
    if (rpc_tracker is None) != (rpc_key is None):
        raise ValueError("tvm_fuel.tune: rpc_tracker and rpc_key go together")
    if target.kind.name == "cuda" and rpc_tracker is None:
        from ..target import has_gpu

        if not has_gpu():
            raise ValueError("tvm_fuel.tune: measuring cuda kernels needs a CUDA device on this machine, or "
                             "rpc_tracker/rpc_key of RPC servers that have one")
    workloads = workloads_of(mod, target, ops) if isinstance(mod, tvm.IRModule) else list(mod)
    if not workloads:
        raise ValueError(f"tvm_fuel.tune: no static fuel call served by a {target.kind.name} kernel to tune")
    root = check_writable_dir(default_work_dir() if work_dir is None else work_dir)
    builder = measure.builder()
    runner = measure.rpc_runner(rpc_tracker, rpc_key) if rpc_tracker else measure.local_runner()
    results: list[TaskResult] = []
    try:
        for family in dict.fromkeys(kernel_family(w.op) for w in workloads):
            group = [w for w in workloads if kernel_family(w.op) == family]
            folder = root / target_key(target) / family
            try:
                folder.mkdir(parents=True, exist_ok=True)
            except OSError as err:  # checked above, but the disk may change meanwhile
                raise ValueError(f"tvm_fuel.tune: cannot create {folder} under work_dir: {err.strerror}") from None
            database = LogDatabase(folder)  # resumes from the whole lines of an interrupted run's log
            results += _tune_family(group, target, folder, root / "logs", database, builder, runner, trials,
                                    trials_per_iter, seed, log, verify_top, verify_rounds)
    finally:
        # their worker processes, now rather than at garbage collection
        builder.close()
        runner.pool.shutdown()
    return results


def _tune_family(workloads, target, folder, log_dir, database, builder, runner, trials, trials_per_iter, seed,
                 log, verify_top, verify_rounds) -> list[TaskResult]:
    results, contexts = [], []
    start = time.perf_counter()
    with _without_tensor_intrinsics():
        for index, workload in enumerate(workloads):
            mod = workload_module(workload, target)
            result = TaskResult(workload, folder)
            rule = rule_for(workload.op, target)
            defaults = rule.default_knobs(workload, target)
            previous = _recorded(database, mod)  # a resumed run: the hand-picked point is in there
            hand = [s for knobs, s in previous if all(defaults.get(k) == v for k, v in knobs.items())]
            if hand:
                result.hand_picked_s = min(hand)
            else:
                sch = fixed_point(mod, defaults)
                (seconds,) = measure.side_by_side([sch], target, builder, runner, rounds=1)
                commit_record(database, mod, sch, seconds, target)
                if seconds:
                    result.hand_picked_s = seconds[0]
                    previous.append((knobs_of(sch.mod)[1], seconds[0]))
            if previous:
                result.best_knobs, result.best_s = min(previous, key=lambda item: item[1])
            _report(result, trials, time.perf_counter() - start, log)
            results.append(result)
            contexts.append(ms.TuneContext(
                mod=mod, target=target, space_generator=space_generator(seed + index),
                search_strategy=ms.search_strategy.EvolutionarySearch(
                    population_size=64, init_measured_ratio=0.25, init_min_unmeasured=32, genetic_num_iters=3,
                    genetic_mutate_prob=0.85, eps_greedy=0.1),
                task_name=workload.describe(), rand_state=seed + index, num_threads=os.cpu_count() or 1))
        if trials > 0:
            cost_model = ms.cost_model.XGBModel(extractor=KnobFeatures(), num_warmup_samples=min(16, trials),
                                                adaptive_training=False)
            callbacks = [ms.measure_callback.AddToDatabase(), ms.measure_callback.RemoveBuildArtifact(),
                         ms.measure_callback.UpdateCostModel(), _Progress(results, trials, log)]
            ms.tune_tasks(tasks=contexts, task_weights=[1.0] * len(contexts), work_dir=str(log_dir),
                          max_trials_global=trials * len(contexts), max_trials_per_task=trials,
                          num_trials_per_iter=min(trials_per_iter, trials), builder=builder, runner=runner,
                          database=database, cost_model=cost_model, measure_callbacks=callbacks,
                          task_scheduler="round-robin")
    for result, context in zip(results, contexts):
        if verify_top > 0:
            rule = rule_for(result.workload.op, target)
            _verify(result, context.mod, rule.default_knobs(result.workload, target), database, target, builder,
                    runner, top=verify_top, rounds=verify_rounds)
            if result.hand_picked_s is None or result.best_s is None:
                log(f"[{time.perf_counter() - start:6.0f}s] {result.workload.describe()}: no candidate was measured")
                continue
            log(f"[{time.perf_counter() - start:6.0f}s] verified side by side ({verify_rounds} rounds): "
                f"{result.workload.describe()}: hand-picked {result.hand_picked_s * 1e3:.2f} ms, "
                f"best {result.best_s * 1e3:.2f} ms ({result.rate(result.best_s)}), {result.speedup:.2f}x, "
                f"knobs {result.best_knobs}")
    return results
