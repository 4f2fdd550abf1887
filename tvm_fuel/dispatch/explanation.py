"""``explain(mod, target)``: where each fuel call of a module goes, and why.

One line per fuel call, in each Relax function's order: the call's workload and the kernel rule
that builds it with the knobs' source (a tuning record's log file, or "hand-picked"), or the floor
and the reason (no kernel written for the op on this target kind, a symbolic dim the kernels are
specialised on, a rule that declined). What ``LegalizeFuel(target, kernels="tuned")`` does with
the same records, without building anything.
"""

from __future__ import annotations

import sys
import warnings
from typing import Any, TextIO

import tvm
from tvm import relax

from ..op import SPECS
from ..target import as_target
from .records import TuningRecords, log_roots
from .routing import knobs_for, route

_PREFIX = "relax.fuel."


def explain(mod: tvm.IRModule, target: Any = "llvm", *, database: Any = None, shipped_logs: bool = True,
            file: TextIO | None = sys.stdout) -> list[str]:
    """Print (to ``file``; None: nothing) and return one line per fuel call of ``mod`` on ``target``:
    ``<function>: <workload>: kernel <Rule> (knobs: <source>)`` or ``...: floor (<why>)``.
    ``database`` and ``shipped_logs`` as ``tvm_fuel.compile`` takes them."""
    target = as_target(target)
    records = TuningRecords(log_roots(database, shipped_logs))
    lines = []
    for gvar, func in mod.functions.items():
        if not isinstance(func, relax.Function):
            continue
        for call in _fuel_calls(func):
            # a rule's own reason for declining (a FloorWarning) goes into the line, not to the
            # warnings registry, where it would silence the same warning of a later build
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                found = route(call.op.name[len(_PREFIX):], call, target)
            line = f"{gvar.name_hint}: {found.describe()}"
            line += "".join(f" [{w.message}]" for w in caught)
            if found.rule is not None:
                with target:
                    line += f" (knobs: {knobs_for(found, target, records)[1]['fuel.knobs']})"
            lines.append(line)
    if file is not None:
        print("\n".join(lines) if lines else "no fuel calls", file=file)
    return lines


def _fuel_calls(func: relax.Function) -> list[relax.Call]:
    names = {spec.op_name for spec in SPECS.values()}
    found: list[relax.Call] = []

    def visit(expr):
        if isinstance(expr, relax.Call) and isinstance(expr.op, tvm.ir.Op) and expr.op.name in names:
            found.append(expr)

    relax.analysis.post_order_visit(func, visit)
    return found


__all__ = ["explain"]
