"""The route from a fused call to its kernel, in one package.

``op/`` is the floor (each fuel op's TE decomposition); ``schedules/`` builds a kernel from a
``Workload`` and knobs. Between them, for each fuel call a build lowers with ``kernels="tuned"``:
the call's ``Workload`` (``workloads``) -> the first of the target's rules that serves it
(``schedules.rules_for``, ``KernelRule.serves``) -> its knobs, a matching tuning record's
(``records``) or the rule's hand-picked ones -> the kernel in place of the floor (``routing``);
where no rule serves the call, the floor, for a reason ``explain`` prints.

Contents:
    explanation   -- explain: one line per fuel call of a module, its kernel and knobs, or the floor and why
    routing       -- Route, route(name, call, target), tuned_legalize_map, kernel_call, emit_kernel
    workloads     -- workload_of(name, call): a call's Workload
    records       -- tuning logs: where they live, their target key, the knobs they give a workload
    log_database  -- a MetaSchedule database over one log folder
    shape_points  -- ShapePoint: symbolic dims bound to values (``tvm_fuel.specialize``'s points)

The names below load on first use: ``import tvm_fuel`` does not load the kernels.
"""

from __future__ import annotations

import importlib

_LAZY = {"explain": "explanation", "Route": "routing", "route": "routing", "kernel_call": "routing",
         "tuned_legalize_map": "routing", "emit_kernel": "routing", "knobs_for": "routing",
         "workload_of": "workloads"}


def __getattr__(name: str):
    if name in _LAZY:
        return getattr(importlib.import_module(f"{__name__}.{_LAZY[name]}"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = ["explain", "Route", "route", "kernel_call", "tuned_legalize_map", "emit_kernel", "knobs_for",
           "workload_of"]
