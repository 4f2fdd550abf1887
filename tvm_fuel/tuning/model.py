"""Whole-model tuning: the fuel kernels through their knob spaces, every other TIR function of the
model through MetaSchedule's own design spaces, into one log root.

``tune_model(mod, target, points=...)`` specializes ``mod`` at its shape points (a model of
symbolic dims has no static TIR to measure; ``tvm_fuel.specialize``), tunes the static fuel calls
with ``tvm_fuel.tune`` (``<work_dir>/<target key>/<kernel>/``), lowers the model as a build does
(``build.fuse``) and tunes each distinct unscheduled static TIR function: MetaSchedule's search
(its records in ``<work_dir>/logs/model/``), then the best ``verify_top`` schedules re-measured
side by side with the function's default schedule (``schedules.cpu.generic`` / dlight, else the
plain loops), a few rounds. Only those verified records go to ``<work_dir>/<target key>/model/``,
where a build reads them (``build.ApplyTunedFunctions``), with the points
(``build.SpecializeAtTunedShapes``): the default schedule's own record is among them, so a
function keeps it unless a tuned one beat it in the same rounds.

Functions that read an integer buffer (gathers, the KV append's slots, RoPE at cached positions)
are not tuned: MetaSchedule's random inputs would index out of bounds, and their time is small.
Nor are reshapes, which the build turns into views.

Contents:
    tune_model      -- tune a model; returns ModelTuning
    ModelTuning     -- the fuel kernels' TaskResults and the functions' FunctionResults
    FunctionResult  -- what one function's task found
    function_tasks  -- the tasks of a (static) model: name -> the function's tuning module
"""

from __future__ import annotations

import os
import statistics
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Sequence

import tvm
import tvm_ffi
from tvm import relax, s_tir
from tvm.ir.utils import derived_object
from tvm.s_tir import meta_schedule as ms

from ..transform.legalize_fuel import LegalizeFuel
from ..target import as_target
from ..transform.legalize_and_fuse import fuse
from ..transform.common import unscheduled
from ..dispatch.records import MODEL_FOLDER, target_key, write_points
from ..dispatch.log_database import LogDatabase
from ..transform.specialize import ShapePoint, specialize
from . import measure
from .kernels import TaskResult, check_writable_dir, commit_record, default_work_dir, tune, workloads_of


@dataclass
class FunctionResult:
    """One tuned TIR function: times in seconds (medians of the verification rounds)."""

    name: str
    trials: int = 0
    default_s: float | None = None
    best_s: float | None = None
    searched_best_s: float | None = None

    @property
    def speedup(self) -> float | None:
        if self.default_s is None or self.best_s is None:
            return None
        return self.default_s / self.best_s


@dataclass
class ModelTuning:
    kernels: list[TaskResult] = field(default_factory=list)
    functions: list[FunctionResult] = field(default_factory=list)
    points: list[ShapePoint] = field(default_factory=list)


def _reads_integers(func: tvm.tirx.PrimFunc) -> bool:
    return any(str(param.ty.dtype).startswith(("int", "uint", "bool")) for param in func.params
               if isinstance(param.ty, tvm.tirx.BufferType))


def _is_static(func: tvm.tirx.PrimFunc) -> bool:
    return all(isinstance(dim, tvm.tirx.IntImm) for param in func.params if isinstance(param.ty, tvm.tirx.BufferType)
               for dim in param.ty.shape) and not any(not isinstance(p.ty, tvm.tirx.BufferType) for p in func.params)


def function_tasks(mod: tvm.IRModule, target, *, database=None) -> dict[str, tvm.IRModule]:
    """The TIR functions a build of ``mod`` would leave to default schedules (fuel ops lowered to
    their kernels, the rest legalized and fused), static and reading no integer buffer, one per
    structure: name -> ``IRModule({"main": func})`` (the key of its records)."""
    target = as_target(target)
    fused = fuse(LegalizeFuel(target, kernels="tuned", database=database)(mod), target)
    tasks: dict[str, tvm.IRModule] = {}
    for gvar, func in unscheduled(fused).items():
        if not _is_static(func) or _reads_integers(func) or relax.analysis.has_reshape_pattern(func):
            continue  # (a reshape becomes a view after fusion: no kernel runs)
        task = tvm.IRModule({"main": func.with_attr("global_symbol", "main")})
        if not any(tvm_ffi.structural_equal(task, seen) for seen in tasks.values()):
            tasks[gvar.name_hint] = task
    return tasks


def _default_schedule(task: tvm.IRModule, target) -> s_tir.Schedule:
    """What a build gives the function without a record: the first default rule that applies
    (``build.default_pipeline``'s), else the function as it is."""
    from tvm.s_tir import dlight as dl

    from ..schedules.cpu.generic import RULES

    rules = RULES if target.kind.name == "llvm" else (dl.gpu.Matmul(), dl.gpu.GEMV(), dl.gpu.Reduction(),
                                                      dl.gpu.GeneralReduction(), dl.gpu.Fallback())
    with target:
        for rule in rules:
            sch = rule.apply(task["main"], target, False)
            if sch is not None:
                return sch[0] if isinstance(sch, list) else sch
    return s_tir.Schedule(task)


@derived_object
class _Progress(ms.measure_callback.PyMeasureCallback):
    def __init__(self, results: list[FunctionResult], trials: int, log: Callable[[str], None]):
        self.results, self.trials, self.log, self.start = results, trials, log, time.perf_counter()

    def apply(self, task_scheduler, task_id, measure_candidates, builder_results, runner_results) -> None:
        result = self.results[task_id]
        for run in runner_results:
            result.trials += 1
            seconds = [float(s) for s in (run.run_secs or [])]
            if not run.error_msg and seconds:
                mean = sum(seconds) / len(seconds)
                result.searched_best_s = mean if result.searched_best_s is None else min(result.searched_best_s, mean)
        best = "no valid trial yet" if result.searched_best_s is None else f"best {result.searched_best_s * 1e3:.3f} ms"
        self.log(f"[{time.perf_counter() - self.start:6.0f}s] function {result.name}: trials "
                 f"{result.trials}/{self.trials}, {best}")


def tune_model(mod: tvm.IRModule, target, *, points: Sequence[ShapePoint] = (), trials: int = 32,
               kernel_trials: int | None = None, work_dir: str | os.PathLike | None = None,
               trials_per_iter: int = 8, verify_top: int = 3, verify_rounds: int = 3,
               rpc_tracker: str | None = None, rpc_key: str | None = None, seed: int = 1,
               log: Callable[[str], None] | None = None) -> ModelTuning:
    """Tune every task of ``mod`` for ``target`` (see the module docstring); returns what each found.

    Parameters
    ----------
    mod : tvm.IRModule
        A Relax module (fuel ops anywhere). Its symbolic dims must be bound by ``points``, else
        those functions have no static task.
    points : sequence of ShapePoint
        Where to specialize ``mod`` (e.g. ``ShapePoint("prefill", {"batch": 1, "seq_len": 1000})``);
        saved with the records, a build specializes a matching model there.
    trials, kernel_trials : int
        MetaSchedule trials per TIR function, and per fuel kernel workload (default: ``trials``).
    work_dir : path
        Log root, as ``tvm_fuel.tune``'s (default ``default_work_dir()``); pass it to
        ``tvm_fuel.compile(..., kernels="tuned", database=work_dir)``.
    verify_top, verify_rounds : int
        The best schedules re-measured side by side with the default schedule (>= 1 each).
    rpc_tracker, rpc_key : str, optional
        Measure on RPC servers, as ``tvm_fuel.tune``.
    """
    target = as_target(target)
    log = log or (lambda line: print(line, flush=True))
    for name, value, least in (("trials", trials, 0), ("trials_per_iter", trials_per_iter, 1),
                               ("verify_top", verify_top, 1), ("verify_rounds", verify_rounds, 1)):
        if not isinstance(value, int) or isinstance(value, bool) or value < least:
            raise ValueError(f"tvm_fuel.tune_model: {name} must be an int >= {least}, got {value!r}")
    if (rpc_tracker is None) != (rpc_key is None):
        raise ValueError("tvm_fuel.tune_model: rpc_tracker and rpc_key go together")
    if target.kind.name != "llvm" and rpc_tracker is None:
        raise ValueError(f"tvm_fuel.tune_model: measuring {target.kind.name} functions needs RPC servers with "
                         f"that device (rpc_tracker, rpc_key); this machine tunes llvm")
    points = list(points)
    root = check_writable_dir(default_work_dir() if work_dir is None else work_dir, who="tvm_fuel.tune_model")
    static = specialize(mod, points) if points else mod
    result = ModelTuning(points=points)
    if workloads_of(static, target):
        result.kernels = tune(static, target, trials=trials if kernel_trials is None else kernel_trials,
                              work_dir=root, trials_per_iter=trials_per_iter, rpc_tracker=rpc_tracker,
                              rpc_key=rpc_key, verify_top=verify_top, verify_rounds=verify_rounds, seed=seed,
                              log=log)
    tasks = function_tasks(static, target, database=root)
    if not tasks and not result.kernels:
        raise ValueError("tvm_fuel.tune_model: no static task in this module for this target (bind its "
                         "symbolic dims with points)")
    folder = root / target_key(target) / MODEL_FOLDER
    folder.mkdir(parents=True, exist_ok=True)
    if points:
        write_points(folder, points)
    if tasks:
        result.functions = _tune_functions(tasks, target, root, folder, trials=trials, trials_per_iter=trials_per_iter,
                                           verify_top=verify_top, verify_rounds=verify_rounds,
                                           rpc=(rpc_tracker, rpc_key), seed=seed, log=log)
    return result


def _tune_functions(tasks: dict[str, tvm.IRModule], target, root: Path, folder: Path, *, trials, trials_per_iter,
                    verify_top, verify_rounds, rpc, seed, log) -> list[FunctionResult]:
    search_dir = root / "logs" / MODEL_FOLDER
    search_dir.mkdir(parents=True, exist_ok=True)
    # line by line: an interrupted run's torn last line costs that line, not the resume
    search_db, verified_db = LogDatabase(search_dir), LogDatabase(folder)
    builder, runner = measure.function_builder(), measure.function_runner(*rpc)
    results = [FunctionResult(name) for name in tasks]
    try:
        if trials > 0:
            contexts = [ms.TuneContext(mod=task, target=target, space_generator="post-order-apply",
                                       search_strategy="evolutionary", task_name=name, rand_state=seed + index,
                                       num_threads=os.cpu_count() or 1)
                        for index, (name, task) in enumerate(tasks.items())]
            callbacks = [ms.measure_callback.AddToDatabase(), ms.measure_callback.RemoveBuildArtifact(),
                         ms.measure_callback.UpdateCostModel(), _Progress(results, trials, log)]
            ms.tune_tasks(tasks=contexts, task_weights=[1.0] * len(contexts), work_dir=str(root / "logs"),
                          max_trials_global=trials * len(contexts), max_trials_per_task=trials,
                          num_trials_per_iter=min(trials_per_iter, trials), builder=builder, runner=runner,
                          database=search_db, cost_model=ms.cost_model.XGBModel(num_warmup_samples=min(16, trials)),
                          measure_callbacks=callbacks, task_scheduler="round-robin")
        for result, task in zip(results, tasks.values()):
            _verify(result, task, search_db, verified_db, target, builder, runner, top=verify_top,
                    rounds=verify_rounds, log=log)
    finally:
        builder.close()
        pool = getattr(runner, "pool", None)
        if pool is not None:
            pool.shutdown()
    return results


def _verify(result: FunctionResult, task: tvm.IRModule, search_db, verified_db, target, builder, runner, *, top: int,
            rounds: int, log) -> None:
    """The default schedule and the search's ``top`` best, measured side by side ``rounds`` times
    and committed to the verified database with those times."""
    candidates = [_default_schedule(task, target)]
    if search_db.has_workload(task):
        for record in search_db.get_top_k(search_db.commit_workload(task), top):
            sch = s_tir.Schedule(task)
            try:
                record.trace.apply_to_schedule(sch, remove_postproc=False)
            except Exception:  # noqa: BLE001 -- a trace that does not replay is no candidate
                continue
            candidates.append(sch)
    times = measure.side_by_side(candidates, target, builder, runner, rounds)
    for sch, seconds in zip(candidates, times):
        if seconds:
            commit_record(verified_db, task, sch, seconds, target)
    if times[0]:
        result.default_s = statistics.median(times[0])
    measured = [statistics.median(t) for t in times if t]
    if measured:
        result.best_s = min(measured)
    ratio = f", {result.speedup:.2f}x the default schedule" if result.speedup else ""
    best = f"{result.best_s * 1e3:.3f} ms" if result.best_s else "none"
    default = f"{result.default_s * 1e3:.3f} ms" if result.default_s else "failed"
    log(f"verified side by side ({rounds} rounds): function {result.name}: default {default}, best {best}{ratio}")


__all__ = ["tune_model", "ModelTuning", "FunctionResult", "function_tasks"]
