"""``SpecializeAtTunedShapes``: static copies of a model's functions at the shape points its logs were tuned at.
"""

from __future__ import annotations

from typing import Any

import tvm
from tvm import relax

from ..target import as_target
from .common import unscheduled
from .legalize_and_fuse import fuse


@tvm.transform.module_pass(opt_level=0, name="tvm_fuel.SpecializeAtTunedShapes")
class SpecializeAtTunedShapes:
    """``tvm_fuel.specialize`` at the shape points of ``roots``' model logs where the static copy
    meets a record: a point whose function and dims the module has is tried (its copy lowered by
    ``lower`` and fused), and kept only when one of its TIR functions has a record, so a model
    the logs were not tuned for is built as it is."""

    def __init__(self, target: Any, roots: list, lower: tvm.transform.Pass):
        from ..dispatch.records import FunctionRecords

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
