"""``tvm_fuel.compile``: build a Relax module that holds fuel ops.

Contents:
    compile        -- tvm.compile with the kernel path chosen explicitly (``pipeline``)
    pipeline       -- SpecializeAtTunedShapes and LegalizeFuel in front of default_pipeline
    default_pipeline -- TVM's Relax pipeline with tuned records and default schedules for the rest
    ApplyTunedFunctions, SpecializeAtTunedShapes -- the passes reading a model's tuning logs
    fuse, unscheduled -- the TIR functions a build schedules (tuning's tasks)
    RoundBfloat16Results -- each op's bfloat16 results rounded where it stores them (fusion keeps it)
    log_roots      -- the log roots a build reads
    LegalizeFuel   -- the pass lowering the fuel ops alone (kernels or decomposition)
    legalize       -- LegalizeFuel applied to a module
    host_target    -- llvm with this machine's CPU features
    as_target      -- str / dict / Target -> Target
    KERNEL_PATHS   -- the accepted ``kernels`` values
"""

from __future__ import annotations

import os
from typing import Any

import tvm
from tvm import relax
from tvm.relax.expr_functor import PyExprMutator, mutator

from .op import SPECS

KERNEL_PATHS = ("decomposed", "tuned")
_FUEL_OPS = {spec.op_name for spec in SPECS.values()}


def as_target(target: Any) -> tvm.target.Target:
    """Accept ``"llvm"``, ``{"kind": "cuda", "arch": "sm_90"}`` or a Target."""
    if isinstance(target, tvm.target.Target):
        return target
    if isinstance(target, str):
        return tvm.target.Target({"kind": target} if target.isidentifier() else target)
    if isinstance(target, dict):
        return tvm.target.Target(target)
    raise TypeError(f"tvm_fuel.compile: target must be a str, dict or tvm.target.Target, got {type(target).__name__}")


def _remaining_fuel_calls(mod: tvm.IRModule) -> list[str]:
    found: list[str] = []

    def visit(expr):
        if isinstance(expr, relax.Call) and isinstance(expr.op, tvm.ir.Op) and expr.op.name in _FUEL_OPS:
            found.append(expr.op.name)

    for _, func in mod.functions.items():
        if isinstance(func, relax.Function):
            relax.analysis.post_order_visit(func, visit)
    return found


def compile(mod: tvm.IRModule, target: Any = "llvm", *, kernels: str = "decomposed", database: Any = None,  # noqa: A001
            shipped_logs: bool = True, relax_pipeline: Any = "default", **compile_options):
    """``tvm.compile`` with ``LegalizeFuel`` in front of the Relax pipeline (``pipeline``).

    Parameters
    ----------
    mod : tvm.IRModule
        A Relax module; its fuel ops may appear anywhere.
    target : str, dict or tvm.target.Target
        ``"llvm"``, ``{"kind": "cuda", "arch": "sm_90"}``, ...
    kernels : str
        ``"decomposed"``: every fuel op runs its TE decomposition (the correctness floor).
        ``"tuned"``: the performance-path kernels where a rule serves the op on this target
        (CPU: flash_attn, its backward ops, paged_attn), the decomposition elsewhere. Fuel
        kernels are marked scheduled and opaque, so the pipeline neither re-schedules nor fuses
        into them. Their knobs come from the best tuning record for the same workload and
        target key (``database`` first, then the logs shipped in ``tvm_fuel/tuning_logs``),
        else they are the hand-picked ones; ``tvm_fuel.tuning_report`` lists which.
    database : path or ``ms.database.Database``, optional
        Tuning logs of ``tvm_fuel.tune`` (its ``work_dir``) or a MetaSchedule database.
    shipped_logs : bool
        Also use the logs shipped with the package (default True).
    relax_pipeline : str or Pass
        The pipeline the fuel ops are lowered in front of (default: TVM's for the target).
    compile_options :
        Passed on to ``tvm.compile``.

    Examples
    --------
    >>> import tvm_fuel
    >>> ex = tvm_fuel.compile(mod, "llvm")                      # doctest: +SKIP
    >>> vm = tvm.relax.VirtualMachine(ex, tvm.cpu())            # doctest: +SKIP
    """
    target = as_target(target)
    return tvm.compile(mod, target=target, relax_pipeline=pipeline(
        target, kernels=kernels, database=database, shipped_logs=shipped_logs, base=relax_pipeline),
        **compile_options)


def pipeline(target: Any, *, kernels: str = "decomposed", database: Any = None, shipped_logs: bool = True,
             base: Any = "default") -> tvm.transform.Pass:
    """``SpecializeAtTunedShapes`` and ``LegalizeFuel`` followed by ``base``: ``"default"`` is
    ``default_pipeline`` (TVM's Relax pipeline for the target with the tuned records of the
    model's other functions and default schedules), else a pipeline name or a Pass.

    >>> ex = tvm.compile(mod, target, relax_pipeline=tvm_fuel.pipeline(target, kernels="tuned"))  # doctest: +SKIP
    """
    target = as_target(target)
    lower = LegalizeFuel(target, kernels=kernels, database=database, shipped_logs=shipped_logs)
    roots = log_roots(database, shipped_logs)
    if isinstance(base, str):
        base = default_pipeline(target, roots) if base == "default" else relax.get_pipeline(base)
    return tvm.transform.Sequential([SpecializeAtTunedShapes(target, roots, lower), lower, base],
                                    name="tvm_fuel.pipeline")


def log_roots(database: Any, shipped_logs: bool) -> list:
    """The log roots a build reads, in order: ``database`` (if any), then the shipped logs."""
    from .logs import shipped_logs as shipped

    return ([database] if database is not None else []) + ([shipped()] if shipped_logs else [])


def default_pipeline(target: Any, roots: list | None = None) -> tvm.transform.Pass:
    """TVM's Relax pipeline for the target's backend (``relax.backend.cpu_generic``, ``cuda``),
    where every TIR function left unscheduled after fusion (a model's projections, norms, RoPE)
    first takes a tuning record of ``roots`` (``ApplyTunedFunctions``), else a default schedule:
    on llvm ``schedules.cpu.generic``'s rules (parallel over the cores, vectorized; register-tiled
    GEMMs), where TVM's own llvm pipeline leaves single-threaded scalar loops; on CUDA dlight's.
    Other targets get TVM's default pipeline as it is."""
    from tvm.relax.backend.cpu_generic import pipeline as cpu_backend
    from tvm.relax.backend.cuda import pipeline as cuda_backend
    from tvm.s_tir import dlight as dl

    from .schedules.cpu.generic import RULES

    target = as_target(target)
    records = ApplyTunedFunctions(target, roots or [])
    if target.kind.name == "llvm":
        backend = cpu_backend
        legalize_passes = _cpu_legalize_passes(target) + [records, dl.ApplyDefaultSchedule(*RULES)]
    elif target.kind.name == "cuda":
        backend = cuda_backend
        legalize_passes = cuda_backend.legalize_passes(target)  # ends in dlight's default schedules
        legalize_passes.insert(len(legalize_passes) - 1, records)
    else:
        return relax.get_default_pipeline(target)
    passes = (backend.library_dispatch_passes(target) + legalize_passes + backend.dataflow_lower_passes(target)
              + backend.finalize_passes(target))

    @tvm.transform.module_pass(opt_level=0, name="tvm_fuel.default_pipeline")
    def _pipeline(mod: tvm.IRModule, _ctx: tvm.transform.PassContext) -> tvm.IRModule:
        with target:
            return tvm.transform.Sequential(passes)(mod)

    return _pipeline


def fuse(mod: tvm.IRModule, target: Any) -> tvm.IRModule:
    """``mod`` (fuel ops already lowered) legalized and fused as ``default_pipeline`` does before
    it schedules: the TIR functions a build tunes or schedules (``tvm_fuel.tuning.model``'s tasks)."""
    from tvm.relax.backend.cpu_generic import pipeline as cpu_backend

    target = as_target(target)
    with target:
        return tvm.transform.Sequential(cpu_backend.library_dispatch_passes(target)
                                        + _cpu_legalize_passes(target))(mod)


def _cpu_legalize_passes(target: tvm.target.Target) -> list:
    """TVM's CPU legalization and fusion, each op's bfloat16 results rounded where the op stores them
    (``RoundBfloat16Results``, before FuseOps)."""
    from tvm.relax.backend.cpu_generic import pipeline as cpu_backend

    passes = cpu_backend.legalize_passes(target)
    # after the op patterns are read (the rounding would hide a reduction's pattern from FuseOps)
    at = next(i for i, p in enumerate(passes) if p.info.name == "AnnotateTIROpPattern") + 1
    return passes[:at] + [RoundBfloat16Results()] + passes[at:]


def _rounded_to_bfloat16(value):
    """``value`` (bfloat16) rounded as BF16StorageLegalize rounds a stored bfloat16 (nearest even: the
    float32 bits plus 0x7fff plus the lowest kept bit, the low half cleared), in float32 arithmetic that
    BF16ComputeLegalize keeps; rounding a rounded value changes no bit."""
    bits = tvm.tirx.reinterpret("uint32", tvm.tirx.Cast("float32", value))
    lowest_kept = tvm.tirx.bitwise_and(tvm.tirx.shift_right(bits, tvm.tirx.const(16, "uint32")),
                                       tvm.tirx.const(1, "uint32"))
    rounded = tvm.tirx.bitwise_and(bits + tvm.tirx.const(0x7FFF, "uint32") + lowest_kept,
                                   tvm.tirx.const(0xFFFF0000, "uint32"))
    return tvm.tirx.Cast("bfloat16", tvm.tirx.reinterpret("float32", rounded))


def _bfloat16_bits_rounded(value: float) -> float:
    """``_rounded_to_bfloat16`` of a constant."""
    import numpy as np

    bits = int(np.array(value, np.float32).view(np.uint32))
    bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000
    return float(np.array(bits & 0xFFFFFFFF, np.uint32).view(np.float32))


@tvm.transform.module_pass(opt_level=0, name="tvm_fuel.RoundBfloat16Results")
class RoundBfloat16Results:
    """Each op's computed bfloat16 results rounded explicitly where it stores them.

    TVM computes bfloat16 in float32 and rounds where a value is stored to memory of the dtype: a
    function's parameters. FuseOps turns the results ops pass each other into buffers inside one
    function, which BF16ComputeLegalize makes float32, so without this an op's result reached the
    next op unrounded ((x.bfloat16() * y.bfloat16()).float() gave 689.0625 for 26.25^2, not 688) and a
    bfloat16 sum accumulated in float32. Rounded in the store itself, the rounding stays wherever
    fusion and the schedules move the value: results equal TVM's unfused build. Runs on the op
    functions LegalizeOps made (the fuel kernels, already scheduled, keep their own numerics)."""

    def transform_module(self, mod: tvm.IRModule, _ctx: tvm.transform.PassContext) -> tvm.IRModule:
        rounded = {gvar: _round_results(func) for gvar, func in unscheduled(mod).items()}
        for gvar, func in rounded.items():
            if func is not None:
                mod[gvar] = func
        return mod


def _round_results(func: tvm.tirx.PrimFunc):
    """``func`` with its computed stores into bfloat16 parameters rounded, or None where it has none."""
    import tvm_ffi

    outputs = [param for param in func.params
               if isinstance(param.ty, tvm.tirx.BufferType) and str(param.dtype) == "bfloat16"]
    changed = []

    def store(node):
        if not any(node.buffer.same_as(buf) for buf in outputs) or isinstance(node.value, tvm.ir.expr.TensorLoad):
            return node  # (a copy is rounded already)
        changed.append(node)
        if isinstance(node.value, tvm.tirx.FloatImm):  # a constant: rounded here
            value = tvm.tirx.FloatImm("bfloat16", _bfloat16_bits_rounded(node.value.value))
        else:
            value = _rounded_to_bfloat16(node.value)
        return tvm.tirx.BufferStore(node.buffer, value, node.indices)

    body = tvm_ffi.structural_map(func.body, (tvm.tirx.BufferStore, store)) if outputs else func.body
    return func.with_body(body) if changed else None


def unscheduled(mod: tvm.IRModule) -> dict:
    """GlobalVar -> PrimFunc of the TIR functions of ``mod`` that no schedule has touched."""
    return {gvar: func for gvar, func in mod.functions.items() if isinstance(func, tvm.tirx.PrimFunc)
            and not (func.attrs is not None and func.attrs.get("tirx.is_scheduled", False))}


@tvm.transform.module_pass(opt_level=0, name="tvm_fuel.ApplyTunedFunctions")
class ApplyTunedFunctions:
    """Each unscheduled TIR function with a MetaSchedule record in ``roots`` (their ``model``
    folders, see ``tvm_fuel.logs``) takes the record's schedule, as ``MetaScheduleApplyDatabase``
    does, and says so: attribute ``fuel.record`` = the log it came from."""

    def __init__(self, target: Any, roots: list):
        from .logs import FunctionRecords

        self.target, self.records = as_target(target), FunctionRecords(roots)

    def transform_module(self, mod: tvm.IRModule, _ctx: tvm.transform.PassContext) -> tvm.IRModule:
        if not self.records.databases(self.target):
            return mod
        updated = {}
        for gvar, func in unscheduled(mod).items():
            found = self.records.query(func, self.target)
            if found is not None:
                scheduled, source = found
                updated[gvar] = scheduled.with_attr("tirx.is_scheduled", True).with_attr("fuel.record", source)
        for gvar, func in updated.items():
            mod[gvar] = func
        return mod


@tvm.transform.module_pass(opt_level=0, name="tvm_fuel.SpecializeAtTunedShapes")
class SpecializeAtTunedShapes:
    """``tvm_fuel.specialize`` at the shape points of ``roots``' model logs where the static copy
    meets a record: a point whose function and dims the module has is tried (its copy lowered by
    ``lower`` and fused), and kept only when one of its TIR functions has a record, so a model
    the logs were not tuned for is built as it is."""

    def __init__(self, target: Any, roots: list, lower: tvm.transform.Pass):
        from .logs import FunctionRecords

        self.target, self.records, self.lower = as_target(target), FunctionRecords(roots), lower

    def transform_module(self, mod: tvm.IRModule, _ctx: tvm.transform.PassContext) -> tvm.IRModule:
        from .specialize import specialize, symbolic_dims

        funcs = {gvar.name_hint: func for gvar, func in mod.functions.items()}
        points = [p for p in self.records.points(self.target) if isinstance(funcs.get(p.function), relax.Function)
                  and set(p.dims) <= set(symbolic_dims(funcs[p.function]))]
        kept = [p for p in points if self._meets_a_record(mod, p)]
        return specialize(mod, kept) if kept else mod

    def _meets_a_record(self, mod: tvm.IRModule, point) -> bool:
        from .specialize import specialize

        copy = point.function + point.suffix()
        alone = specialize(mod, [point])
        # the copy alone, public (the passes drop functions nothing public reaches)
        alone = tvm.IRModule({gvar: func.with_attr("global_symbol", copy) if gvar.name_hint == copy else func
                              for gvar, func in alone.functions.items()
                              if not isinstance(func, relax.Function) or gvar.name_hint == copy})
        fused = fuse(self.lower(alone), self.target)
        return any(self.records.query(func, self.target) is not None for func in unscheduled(fused).values())


def legalize(mod: tvm.IRModule, target: Any = "llvm", *, kernels: str = "decomposed", database: Any = None,
             shipped_logs: bool = True) -> tvm.IRModule:
    """``mod`` with its fuel ops lowered to PrimFuncs (kernels or decomposition) for ``target``;
    every other op is left to the pipeline (``LegalizeFuel`` applied once)."""
    return LegalizeFuel(target, kernels=kernels, database=database, shipped_logs=shipped_logs)(mod)


@mutator
class _FuelLowering(PyExprMutator):
    """Each fuel call with known argument shapes -> its legalization (the other calls are kept)."""

    def __init__(self, mod: tvm.IRModule, rules: dict):
        super().__init__(mod)
        self.rules = rules

    def visit_call_(self, call: relax.Call) -> relax.Expr:  # noqa: N802 (the visitor's name)
        call = super().visit_call_(call)
        if not (isinstance(call.op, tvm.ir.Op) and call.op.name in self.rules):
            return call
        if any(isinstance(arg.ty, relax.TensorType) and arg.ty.shape is None for arg in call.args):
            return call  # as LegalizeOps does; reported below
        return self.rules[call.op.name](self.builder_, call)


@tvm.transform.module_pass(opt_level=0, name="tvm_fuel.LegalizeFuel")
class LegalizeFuel:
    """Lower the fuel ops of a module, and only them, to PrimFuncs for ``target``: the kernels
    (``kernels="tuned"``, knobs from ``database`` and the shipped logs) or the decomposition
    (``"decomposed"``). Every other op is left to the rest of the pipeline (TVM's library
    dispatch, legalization and scheduling), so the pass goes in front of any Relax pipeline::

        seq = tvm.transform.Sequential([tvm_fuel.transform.LegalizeFuel(target, kernels="tuned"),
                                        tvm.relax.get_default_pipeline(target)])

    A fuel call with an argument of unknown shape cannot be lowered: ValueError.
    """

    def __init__(self, target: Any = None, *, kernels: str = "decomposed", database: Any = None,
                 shipped_logs: bool = True):
        if kernels not in KERNEL_PATHS:
            raise ValueError(f"tvm_fuel.LegalizeFuel: kernels must be one of {KERNEL_PATHS}, got {kernels!r}")
        if database is not None:
            _check_database(database)
        self.target = None if target is None else as_target(target)
        self.kernels, self.database, self.shipped_logs = kernels, database, shipped_logs

    def transform_module(self, mod: tvm.IRModule, ctx: tvm.transform.PassContext) -> tvm.IRModule:
        target = self.target or tvm.target.Target.current(allow_none=True)
        if target is None:
            raise ValueError("tvm_fuel.LegalizeFuel: no target: pass one or run it under `with target:`")
        with target:
            rewriter = _FuelLowering(mod, self._rules(target))
            for gvar, func in mod.functions.items():
                if isinstance(func, relax.Function):
                    rewriter.builder_.update_func(gvar, rewriter.visit_expr(func))
            legalized = rewriter.builder_.get()
        leftover = _remaining_fuel_calls(legalized)
        if leftover:
            raise ValueError(
                f"tvm_fuel.compile: could not legalize {sorted(set(leftover))}: an argument has an unknown shape; "
                "give it a shape with R.match_cast first")
        return legalized

    def _rules(self, target: tvm.target.Target) -> dict:
        """op name -> legalization ``(bb, call) -> Expr``."""
        if self.kernels == "decomposed":
            from .legalize import LEGALIZE

            return {SPECS[name].op_name: rule for name, rule in LEGALIZE.items()}
        from .schedules import tuned_legalize_map
        from .logs import TuningRecords

        return tuned_legalize_map(target, TuningRecords(log_roots(self.database, self.shipped_logs)))


def _check_database(database: Any) -> None:
    """A log root, a MetaSchedule work dir or an ``ms.database.Database``: a file (or anything
    else) would match no record, silently, so it is refused by name."""
    from tvm.s_tir import meta_schedule as ms

    if isinstance(database, ms.database.Database):
        return
    if not isinstance(database, (str, os.PathLike)):
        raise TypeError(f"tvm_fuel.compile: database must be a path or an ms.database.Database, "
                        f"got {type(database).__name__}")
    if os.path.isfile(database):
        raise ValueError(f"tvm_fuel.compile: database {os.fspath(database)} is a file; give the log root directory "
                         f"(tune's work_dir) or the folder holding database_tuning_record.json")


def host_target(num_cores: int | None = None) -> tvm.target.Target:
    """llvm for this machine's CPU (its vector units), using ``num_cores`` threads (default: the
    threads of TVM's pool, ``tvm_fuel.threads.thread_count``: the physical cores unless set)."""
    from .threads import thread_count

    return tvm.target.Target({"kind": "llvm", "mcpu": tvm.target.codegen.llvm_get_system_cpu(),
                              "num-cores": num_cores or thread_count()})
