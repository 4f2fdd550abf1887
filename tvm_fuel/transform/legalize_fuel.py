"""``LegalizeFuel``: the fuel ops alone lowered to PrimFuncs, kernels or the floor, in front of any pipeline.
"""

from __future__ import annotations

import os
from typing import Any

import tvm
from tvm import relax
from tvm.relax.expr_functor import PyExprMutator, mutator

from ..op import SPECS
from ..target import as_target
from .common import rewrite_functions

KERNEL_PATHS = ("decomposed", "tuned")


_FUEL_OPS = {spec.op_name for spec in SPECS.values()}


def _remaining_fuel_calls(mod: tvm.IRModule) -> list[str]:
    found: list[str] = []

    def visit(expr):
        if isinstance(expr, relax.Call) and isinstance(expr.op, tvm.ir.Op) and expr.op.name in _FUEL_OPS:
            found.append(expr.op.name)

    for _, func in mod.functions.items():
        if isinstance(func, relax.Function):
            relax.analysis.post_order_visit(func, visit)
    return found


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

    def visit_call_(self, call: relax.Call) -> relax.Expr:
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
            rules = self._rules(target)
            legalized = rewrite_functions(mod, lambda mod: _FuelLowering(mod, rules))
        leftover = _remaining_fuel_calls(legalized)
        if leftover:
            raise ValueError(
                f"tvm_fuel.compile: could not legalize {sorted(set(leftover))}: an argument has an unknown shape; "
                "give it a shape with R.match_cast first")
        return legalized

    def _rules(self, target: tvm.target.Target) -> dict:
        """op name -> legalization ``(bb, call) -> Expr``."""
        if self.kernels == "decomposed":
            from ..op.legalize import LEGALIZE

            return {SPECS[name].op_name: rule for name, rule in LEGALIZE.items()}
        from ..dispatch.records import TuningRecords, log_roots
        from ..dispatch.routing import tuned_legalize_map

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
