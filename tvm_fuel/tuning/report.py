"""Which kernels of a module run tuned knobs, and from which log; which keep the hand-picked ones.

Contents:
    tuning_report -- one row per performance-path kernel of the legalized module
    format_report -- the rows as a table
"""

from __future__ import annotations

import tvm

from ..build import as_target, legalize


def tuning_report(mod: tvm.IRModule, target, *, database=None, shipped_logs: bool = True) -> list[dict]:
    """Legalize ``mod`` as ``tvm_fuel.compile(..., kernels="tuned")`` would and list its kernels.

    Returns rows ``{"function", "workload", "knobs", "match", "tuned_at"}`` where ``knobs`` is the
    record file the kernel's knobs came from, or ``"hand-picked"`` (no record for this workload
    and target); ``match`` is "exact" (a record of the call's dims; a symbolic dim matches any) or
    "bucket" (a neighbour's in the same shape bucket), None when hand-picked; ``tuned_at`` the
    dims of the record that served it.
    """
    legalized = legalize(mod, as_target(target), kernels="tuned", database=database, shipped_logs=shipped_logs)
    rows = []
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
        hit = "fallback" if row["knobs"] == "hand-picked" else "bucket" if row["match"] == "bucket" else "record"
        lines.append(f"{row['function']:<34} {hit:<10} {row['workload']}")
        if hit == "bucket":  # a neighbour's record in the same power-of-two shape bucket
            lines.append(f"{'':<45}tuned at {row['tuned_at']} (same shape bucket)")
        if hit != "fallback":
            lines.append(f"{'':<45}{row['knobs']}")
    return "\n".join(lines)
