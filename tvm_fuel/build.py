"""``tvm_fuel.compile``: build a Relax module that holds fuel ops.

Contents:
    compile        -- tvm.compile with the kernel path chosen explicitly
    legalize       -- the fuel ops of a module lowered to PrimFuncs (kernels or decomposition)
    host_target    -- llvm with this machine's CPU features
    as_target      -- str / dict / Target -> Target
    KERNEL_PATHS   -- the accepted ``kernels`` values
"""

from __future__ import annotations

import os
from typing import Any

import tvm
from tvm import relax

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
            shipped_logs: bool = True, **compile_options):
    """Build ``mod`` for ``target`` and return what ``tvm.compile`` returns.

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
    compile_options :
        Passed on to ``tvm.compile``.

    Examples
    --------
    >>> import tvm_fuel
    >>> ex = tvm_fuel.compile(mod, "llvm")                      # doctest: +SKIP
    >>> vm = tvm.relax.VirtualMachine(ex, tvm.cpu())            # doctest: +SKIP
    """
    target = as_target(target)
    legalized = legalize(mod, target, kernels=kernels, database=database, shipped_logs=shipped_logs)
    return tvm.compile(legalized, target=target, **compile_options)


def legalize(mod: tvm.IRModule, target: Any = "llvm", *, kernels: str = "decomposed", database: Any = None,
             shipped_logs: bool = True) -> tvm.IRModule:
    """Lower every fuel op of ``mod`` to PrimFuncs (kernels or decomposition) for ``target``."""
    if kernels not in KERNEL_PATHS:
        raise ValueError(f"tvm_fuel.compile: kernels must be one of {KERNEL_PATHS}, got {kernels!r}")
    if database is not None:
        _check_database(database)
    target = as_target(target)
    legalize_map = None
    if kernels == "tuned":
        from .schedules import tuned_legalize_map
        from .tuning.records import TuningRecords, shipped_logs as shipped

        roots = ([database] if database is not None else []) + ([shipped()] if shipped_logs else [])
        legalize_map = tuned_legalize_map(target, TuningRecords(roots))
    with target:
        legalized = relax.transform.LegalizeOps(customize_legalize_map=legalize_map)(mod)
    leftover = _remaining_fuel_calls(legalized)
    if leftover:
        raise ValueError(
            f"tvm_fuel.compile: could not legalize {sorted(set(leftover))}: an argument has an unknown shape; "
            "give it a shape with R.match_cast first")
    return legalized


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
