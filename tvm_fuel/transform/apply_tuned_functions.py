"""``ApplyTunedFunctions``: the unscheduled TIR functions of a module take their MetaSchedule records.
"""

from __future__ import annotations

from typing import Any

import tvm

from ..target import as_target
from .common import unscheduled


@tvm.transform.module_pass(opt_level=0, name="tvm_fuel.ApplyTunedFunctions")
class ApplyTunedFunctions:
    """Each unscheduled TIR function with a MetaSchedule record in ``roots`` (their ``model``
    folders, see ``tvm_fuel.dispatch.records``) takes the record's schedule, as ``MetaScheduleApplyDatabase``
    does, and says so: attribute ``fuel.record`` = the log it came from."""

    def __init__(self, target: Any, roots: list):
        from ..dispatch.records import FunctionRecords

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
