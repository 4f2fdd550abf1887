"""Which kernels of a module run tuned knobs, and from which log; which keep the hand-picked ones;
which of its other TIR functions run a tuned schedule, and which the default one.

Contents:
    tuning_report -- one row per performance-path kernel of the legalized module
    format_report -- the rows as a table
"""

from __future__ import annotations

import tvm

from ..transform.apply_tuned_functions import ApplyTunedFunctions
from ..transform.legalize_fuel import LegalizeFuel
from ..transform.pack_linear_weights import PackLinearParams
from ..transform.specialize_at_tuned_shapes import SpecializeAtTunedShapes
from ..target import as_target
from ..transform.legalize_and_fuse import fuse
from ..dispatch.records import log_roots
from ..transform.common import unscheduled

TIR_FUNCTION = "tir function"  # the workload column of a model's other functions


def tuning_report(mod: tvm.IRModule, target, *, database=None, shipped_logs: bool = True,
                  functions: bool = False, pack_params: bool = False) -> list[dict]:
    """Lower ``mod`` as ``tvm_fuel.compile(..., kernels="tuned")`` would and list its kernels.

    Returns rows ``{"function", "workload", "knobs", "match", "tuned_at"}`` where ``knobs`` is the
    record file the kernel's knobs came from, or ``"hand-picked"`` (no record for this workload
    and target); ``match`` is "exact" (a record of the call's dims; a symbolic dim matches any) or
    "bucket" (a neighbour's in the same shape bucket), None when hand-picked; ``tuned_at`` the
    dims of the record that served it.

    ``functions``: also a row per other TIR function (workload ``"tir function"``) after the
    model is specialized at its logs' shape points and fused as a build does: ``knobs`` is the
    log its MetaSchedule record came from, or ``"default schedule"``. ``pack_params``: as
    ``tvm_fuel.compile``'s (the matmuls over the packed weights are other functions).
    """
    target = as_target(target)
    roots = log_roots(database, shipped_logs)
    lower = LegalizeFuel(target, kernels="tuned", database=database, shipped_logs=shipped_logs)
    if pack_params:
        mod = PackLinearParams(target)(mod)
    legalized = lower(SpecializeAtTunedShapes(target, roots, lower)(mod))
    rows = []
    if functions:
        fused = ApplyTunedFunctions(target, roots)(fuse(legalized, target))
        for gvar, func in fused.functions.items():
            if not isinstance(func, tvm.tirx.PrimFunc) or (func.attrs is not None and "fuel.knobs" in func.attrs):
                continue
            record = None if func.attrs is None else func.attrs.get("fuel.record")
            if record is None and gvar not in unscheduled(fused):
                continue  # scheduled by its author (a KV append)
            rows.append({"function": gvar.name_hint, "workload": TIR_FUNCTION,
                         "knobs": "default schedule" if record is None else str(record),
                         "match": None if record is None else "exact", "tuned_at": None})
    for gvar, func in legalized.functions.items():
        if isinstance(func, tvm.tirx.PrimFunc) and func.attrs is not None and "fuel.knobs" in func.attrs:
            match, tuned_at = (func.attrs.get(name) for name in ("fuel.match", "fuel.tuned_at"))
            rows.append({"function": gvar.name_hint, "workload": str(func.attrs["fuel.workload"]),
                         "knobs": str(func.attrs["fuel.knobs"]), "match": None if match is None else str(match),
                         "tuned_at": None if tuned_at is None else str(tuned_at)})
    return sorted(rows, key=lambda row: row["function"])


def format_report(rows: list[dict]) -> str:
    if not rows:
        return "no performance-path kernel in this module for this target"
    lines = [f"{'kernel':<34} {'knobs from':<10} workload"]
    for row in rows:
        hit = ("fallback" if row["knobs"] in ("hand-picked", "default schedule") else
               "bucket" if row["match"] == "bucket" else "record")
        lines.append(f"{row['function']:<34} {hit:<10} {row['workload']}")
        if hit == "bucket":  # a neighbour's record in the same power-of-two shape bucket
            lines.append(f"{'':<45}tuned at {row['tuned_at']} (same shape bucket)")
        if hit != "fallback":
            lines.append(f"{'':<45}{row['knobs']}")
    return "\n".join(lines)
