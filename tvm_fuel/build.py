"""``tvm_fuel.compile``: build a Relax module that holds fuel ops.

The passes it runs live in ``tvm_fuel.transform`` (one per file), the targets in ``tvm_fuel.target``.

Contents:
    compile          -- tvm.compile with the kernel path chosen explicitly (``pipeline``)
    pipeline         -- RepairImportedProgram, SpecializeAtTunedShapes and LegalizeFuel in front of
                        default_pipeline
    default_pipeline -- TVM's Relax pipeline with tuned records and default schedules for the rest
"""

from __future__ import annotations

from typing import Any

import tvm
from tvm import relax

from .target import as_target
from .transform.apply_tuned_functions import ApplyTunedFunctions
from .transform.legalize_and_fuse import cpu_legalize_passes
from .transform.legalize_fuel import LegalizeFuel
from .transform.pack_linear_weights import PackLinearParams
from .transform.repair_imported_program import RepairImportedProgram
from .transform.specialize_at_tuned_shapes import SpecializeAtTunedShapes


def compile(mod: tvm.IRModule, target: Any = "llvm", *, kernels: str = "decomposed", database: Any = None,  # noqa: A001
            shipped_logs: bool = True, relax_pipeline: Any = "default", pack_params: bool = False, **compile_options):
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
    pack_params : bool
        On llvm: nn.Linear weights passed as parameters (those after a function's ``"num_input"``,
        as ``relax.frontend.nn``'s ``export_tvm`` marks them) are laid out in the CPU matmul's
        panels by the build's ``transform_params`` (``transform.PackLinearParams``): run it once
        over the weights, ``params = vm["transform_params"](weights)``, and pass ``*params`` in
        their place to every function. Default False: the weights are passed as given and the
        matmuls pack them at each call.
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
        target, kernels=kernels, database=database, shipped_logs=shipped_logs, base=relax_pipeline,
        pack_params=pack_params), **compile_options)


def pipeline(target: Any, *, kernels: str = "decomposed", database: Any = None, shipped_logs: bool = True,
             base: Any = "default", pack_params: bool = False) -> tvm.transform.Pass:
    """``RepairImportedProgram`` (what TVM's PyTorch importer mistranslates), ``PackLinearParams`` where
    ``pack_params``, ``SpecializeAtTunedShapes`` and ``LegalizeFuel``, followed by ``base``: ``"default"`` is
    ``default_pipeline`` (TVM's Relax pipeline for the target with the tuned records of the
    model's other functions and default schedules), else a pipeline name or a Pass.

    >>> ex = tvm.compile(mod, target, relax_pipeline=tvm_fuel.pipeline(target, kernels="tuned"))  # doctest: +SKIP
    """
    target = as_target(target)
    lower = LegalizeFuel(target, kernels=kernels, database=database, shipped_logs=shipped_logs)
    from .dispatch.records import log_roots  # (it reads the kernel rules: loaded on first build)

    roots = log_roots(database, shipped_logs)
    if pack_params and target.kind.name != "llvm":  # (no transform_params would come of it)
        raise ValueError(f"tvm_fuel.compile: pack_params lays weights out for the CPU matmuls (an llvm target), "
                         f"got a {target.kind.name} target")
    if isinstance(base, str):
        base = default_pipeline(target, roots) if base == "default" else relax.get_pipeline(base)
    front = [RepairImportedProgram()] + ([PackLinearParams(target)] if pack_params else [])
    return tvm.transform.Sequential(front + [SpecializeAtTunedShapes(target, roots, lower), lower, base,
                                             MarkVacuousNoAlias()], name="tvm_fuel.pipeline")


def MarkVacuousNoAlias() -> tvm.transform.Pass:  # noqa: N802
    """``tirx.noalias`` on every PrimFunc with at most one buffer parameter (nothing it could alias;
    e.g. VMShapeLower's ``shape_func``). TVM 0.27's LLVM codegen declares all PrimFuncs of a module
    (sorted by symbol) before emitting any, and ``DeclareFunctionInternal`` leaves ``is_restricted_``
    (read while emitting) at the ``tirx.noalias`` of the one declared last: one PrimFunc without it
    that sorts last strips ``noalias`` (and ``noinline``) from every kernel's ``_compute_`` function,
    and the CPU attention kernels then run 3-5x slower."""
    pointer_types = (tvm.tirx.BufferType, tvm.ir.PointerType)

    @tvm.transform.module_pass(opt_level=0, name="tvm_fuel.MarkVacuousNoAlias")
    def _mark(mod: tvm.IRModule, _ctx: tvm.transform.PassContext) -> tvm.IRModule:
        updates = {gv: func.with_attr("tirx.noalias", True) for gv, func in mod.functions_items()
                   if isinstance(func, tvm.tirx.PrimFunc) and not (func.attrs and func.attrs.get("tirx.noalias"))
                   and sum(isinstance(p.ty, pointer_types) for p in func.params) <= 1}
        if not updates:
            return mod
        mod = mod.clone()
        for gv, func in updates.items():
            mod.update_func(gv, func)
        return mod

    return _mark


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
        legalize_passes = cpu_legalize_passes(target) + [records, dl.ApplyDefaultSchedule(*RULES)]
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


