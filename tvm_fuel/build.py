"""``tvm_fuel.compile``: build a Relax module that holds fuel ops.

Contents:
    compile        -- tvm.compile with the kernel path chosen explicitly (``pipeline``)
    pipeline       -- LegalizeFuel in front of TVM's default Relax pipeline for a target
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
    """``LegalizeFuel`` followed by ``base``: TVM's default Relax pipeline for ``target`` (what
    ``tvm.compile`` picks for ``relax_pipeline="default"``), a pipeline name or a Pass.

    >>> ex = tvm.compile(mod, target, relax_pipeline=tvm_fuel.pipeline(target, kernels="tuned"))  # doctest: +SKIP
    """
    target = as_target(target)
    if isinstance(base, str):
        gpu = "gpu" in [str(key) for key in target.keys]
        base = relax.get_default_pipeline(target) if gpu and base == "default" else relax.get_pipeline(base)
    return tvm.transform.Sequential([LegalizeFuel(target, kernels=kernels, database=database,
                                                  shipped_logs=shipped_logs), base], name="tvm_fuel.pipeline")


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
        from .logs import TuningRecords, shipped_logs as shipped

        roots = ([self.database] if self.database is not None else []) + ([shipped()] if self.shipped_logs else [])
        return tuned_legalize_map(target, TuningRecords(roots))


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
