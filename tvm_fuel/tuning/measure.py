"""Building and measuring tuning candidates (run in MetaSchedule's worker processes).

``build_candidate`` is the builder's ``f_build``: it instantiates the kernel a scheduled tuning
module describes and compiles only that (the stock build function re-imports every tensor
intrinsic per batch, ~60 s here). The argument allocators give every kernel valid inputs: a
paged kernel gets a block table of distinct live block ids and full context lengths (random
integers would index out of the cache), floats are standard normal, the lse is finite.

Contents:
    build_candidate             -- f_build of ``ms.builder.LocalBuilder``
    input_specs                 -- valid fills of a kernel's parameters (also the deploy bundle's)
    alloc_arguments             -- f_alloc_argument of ``ms.runner.LocalRunner``
    alloc_arguments_rpc         -- f_alloc_argument of ``ms.runner.RPCRunner``
    PooledBuilder               -- MetaSchedule's local builder on worker processes kept between batches
    local_runner, rpc_runner, builder
    build_function, function_builder, function_runner -- the same for a model's other TIR
                                  functions (MetaSchedule's own schedules, random inputs)
    side_by_side                -- build schedules once, measure them together in rounds
"""

from __future__ import annotations

import contextlib
import os

import numpy as np
import tvm
from tvm.ir.utils import derived_object
from tvm.s_tir import meta_schedule as ms
from tvm.support.popen_pool import PopenPoolExecutor, StatusKind

from ..testing.arrays import make_arrays

EVALUATOR = dict(number=1, repeat=3, min_repeat_ms=40, enable_cpu_cache_flush=False)


def build_candidate(mod: tvm.IRModule, target: tvm.target.Target, _params=None) -> tvm.runtime.Module:
    """The kernel of a scheduled tuning module (its knob annotations), compiled for ``target``."""
    from ..schedules import rule_for
    from ..dispatch.records import knobs_of

    workload, knobs = knobs_of(mod)
    rule = rule_for(workload.op, target)
    if rule is None:
        raise ValueError(f"tvm_fuel tuning: no {target.kind.name} kernel serves {workload.op}")
    func = rule.kernel(workload, rule.knobs(workload, target, knobs), static=True)
    return tvm.tirx.build(tvm.IRModule({"main": func.with_attr("global_symbol", "main")}), target=target)


def input_specs(params) -> list[dict]:
    """How to fill a fuel kernel's parameters with valid values, from their (dtype, shape) in
    order (``testing.arrays`` fills): a paged kernel gets a block table of block ids below the
    cache's count and full context lengths, an lse is finite (about log Sk), masks mostly keep,
    floats are normal. The shapes tell the parameters apart: MetaSchedule's runners know no names."""
    params = [(str(dtype), [int(n) for n in shape]) for dtype, shape in params]
    tensors4 = [shape for _, shape in params if len(shape) == 4]  # q, k or k_cache (an 8-bit cache too), ...
    specs = []
    for dtype, shape in params:
        spec = {"shape": shape, "dtype": dtype, "fill": "normal", "scale": 0.5}
        if dtype == "int8":  # an int8 cache's codes (its scales are float32, filled as floats)
            spec.update(fill="codes")
        elif dtype.startswith(("int", "uint")) and len(shape) == 2:  # block table [B, max_blocks]
            # k_cache [num_blocks, block_size, Hkv, D] follows q
            spec.update(fill="blocks", num_blocks=tensors4[1][0], block_size=tensors4[1][1])
        elif dtype.startswith(("int", "uint")):  # context_lens [B]: every table full
            table = next(s for d, s in params if d.startswith(("int", "uint")) and len(s) == 2)
            spec.update(fill="values", values=[table[1] * tensors4[1][1]] * shape[0])
        elif dtype == "bool":
            spec.update(fill="keep", p=0.9)
        elif dtype == "float32" and len(shape) == 3:  # lse [B, Hq, Sq]
            spec.update(fill="lse", keys=tensors4[1][2])
        specs.append(spec)
    return specs


def _arrays(args_info) -> list[np.ndarray]:
    """Valid inputs for a fuel kernel's parameters, from MetaSchedule's (kind, dtype, shape)."""
    return make_arrays(input_specs((dtype, shape) for _, dtype, shape in args_info), seed=0)


def alloc_arguments(device, args_info, alloc_repeat: int):
    """LocalRunner's allocator: ``alloc_repeat`` sets of valid arguments on ``device``."""
    arrays = _arrays(args_info)
    return [[tvm.runtime.tensor(a, device=device) for a in arrays] for _ in range(alloc_repeat)]


def alloc_arguments_rpc(session, device, args_info, alloc_repeat: int):
    """RPCRunner's allocator: the same arguments, uploaded to the remote device."""
    return alloc_arguments(device, args_info, alloc_repeat)


def _build_and_export(f_build, mod: tvm.IRModule, target: tvm.target.Target) -> str:
    """In a worker: ``f_build``'s module through MetaSchedule's default export (a tar in a new
    temporary folder, which the measure callbacks or ``side_by_side`` remove)."""
    from tvm.s_tir.meta_schedule.builder.local_builder import default_export

    return default_export(f_build(mod, target, None))


@derived_object
class PooledBuilder(ms.builder.PyBuilder):
    """MetaSchedule's LocalBuilder, its worker processes kept from one batch to the next.

    LocalBuilder starts a pool for every batch, and one more to check its build function: each
    worker imports TVM anew (3-4 s), four or five times for every kernel tuned. These workers live
    until ``close`` and each is replaced after ``uses`` builds, which bounds the memory growth that
    made TVM restart its pools. A build that times out or raises is that candidate's error, as in
    LocalBuilder.
    """

    def __init__(self, f_build, workers: int | None = None, timeout_sec: float = 120, uses: int = 64):
        self.f_build, self.timeout_sec = f_build, timeout_sec
        self.pool = PopenPoolExecutor(max_workers=workers or os.cpu_count() or 1, timeout=timeout_sec,
                                      maximum_process_uses=uses)

    def build(self, build_inputs: list[ms.builder.BuilderInput]) -> list[ms.builder.BuilderResult]:
        jobs = [(self.f_build, build_input.mod, build_input.target) for build_input in build_inputs]
        results = []
        for outcome in self.pool.map_with_error_catching(lambda job: _build_and_export(*job), jobs):
            if outcome.status == StatusKind.COMPLETE:
                results.append(ms.builder.BuilderResult(outcome.value, None))
            elif outcome.status == StatusKind.TIMEOUT:
                results.append(ms.builder.BuilderResult(
                    None, f"PooledBuilder: Timeout, killed after {self.timeout_sec} seconds"))
            else:
                results.append(ms.builder.BuilderResult(None, f"PooledBuilder: An exception occurred\n{outcome.value}"))
        return results

    def close(self) -> None:
        """End the worker processes (now rather than at garbage collection)."""
        self.pool.shutdown()


def builder(workers: int | None = None) -> PooledBuilder:
    return PooledBuilder(build_candidate, workers)


def local_runner() -> ms.runner.LocalRunner:
    return ms.runner.LocalRunner(evaluator_config=ms.runner.EvaluatorConfig(**EVALUATOR), timeout_sec=120,
                                 f_alloc_argument=alloc_arguments)


def rpc_runner(tracker: str, key: str, *, workers: int | None = None, valid_inputs: bool = True) -> ms.runner.RPCRunner:
    """Measure on the servers registered at ``tracker`` (HOST:PORT) under ``key``, one worker each;
    ``valid_inputs``: a fuel kernel's valid arguments (``alloc_arguments_rpc``), else MetaSchedule's
    random ones (a model's other functions, see ``function_runner``)."""
    host, _, port = tracker.rpartition(":")
    if not host or not port.isdigit():
        raise ValueError(f"tvm_fuel.tune: rpc_tracker must be HOST:PORT, got {tracker!r}")
    if workers is None:
        from tvm import rpc

        session = rpc.connect_tracker(host, int(port))
        try:
            workers = int(session.summary()["queue_info"].get(key, {}).get("free", 0))
        finally:
            session.close()
        if workers == 0:
            raise RuntimeError(f"tvm_fuel.tune: no free RPC server is registered under key {key!r} at {tracker}")
    config = ms.runner.RPCConfig(tracker_host=host, tracker_port=int(port), tracker_key=key, session_timeout_sec=120)
    return ms.runner.RPCRunner(rpc_config=config, evaluator_config=ms.runner.EvaluatorConfig(**EVALUATOR),
                               f_alloc_argument=alloc_arguments_rpc if valid_inputs else None, max_workers=workers)


def build_function(mod: tvm.IRModule, target: tvm.target.Target, _params=None) -> tvm.runtime.Module:
    """f_build for a scheduled TIR function of a model (MetaSchedule's design spaces): the module
    as it is, without the stock builder's import of every tensor intrinsic."""
    return tvm.tirx.build(mod, target=target)


def function_builder(workers: int | None = None) -> PooledBuilder:
    return PooledBuilder(build_function, workers)


def function_runner(tracker: str | None = None, key: str | None = None) -> ms.runner.Runner:
    """A runner for a model's TIR functions: random inputs (the tasks read no index buffer, see
    ``tuning.model``), locally or on the RPC servers of ``tracker`` under ``key``."""
    if tracker is None:
        return ms.runner.LocalRunner(evaluator_config=ms.runner.EvaluatorConfig(**EVALUATOR), timeout_sec=120)
    return rpc_runner(tracker, key, valid_inputs=False)


def side_by_side(schedules: list, target, builder, runner, rounds: int) -> list[list[float] | None]:
    """Build each schedule once, then measure them all side by side ``rounds`` times (one runner
    batch per round, its order rotated, so slow drifts of the machine hit every candidate alike).
    Per schedule: the mean seconds of each round, or None where its build or a run failed."""
    device = "cpu" if target.kind.name == "llvm" else target.kind.name
    args_info = [ms.arg_info.ArgInfo.from_prim_func(sch.mod["main"]) for sch in schedules]
    built = builder.build([ms.builder.BuilderInput(sch.mod, target) for sch in schedules])
    times: list[list[float] | None] = [None if b.error_msg else [] for b in built]
    for round_index in range(rounds):
        live = [i for i, t in enumerate(times) if t is not None]
        # rotate the order every round: the first of a batch does not run like the last
        shift = round_index % max(1, len(live))
        live = live[shift:] + live[:shift]
        futures = runner.run([ms.runner.RunnerInput(built[i].artifact_path, device, args_info[i]) for i in live])
        for i, future in zip(live, futures):
            run = future.result()
            seconds = [float(s) for s in run.run_secs or []]
            if run.error_msg or not seconds:
                times[i] = None
            else:
                times[i].append(sum(seconds) / len(seconds))
    for b in built:
        if not b.error_msg:
            with contextlib.suppress(OSError):
                os.remove(b.artifact_path)
    return times
