"""``RepairImportedProgram``: what TVM 0.27's PyTorch importer gets wrong, made what PyTorch means.

``relax.frontend.torch.from_exported_program`` mistypes or mistranslates two things models
exported with ``torch.export`` contain (a TVM user meets them through Hugging Face models):

* ``cumsum`` of a bool tensor is imported as a bool cumsum, which TVM cannot build
  (``Check failed: t.MatchesCode(kDLFloat)``); PyTorch counts in int64 (transformers 5 computes
  its packed-sequence ids as ``(position_diff != 1).cumsum(-1)``). The pass makes the count
  int64 and re-types its users; a constant the importer already converted to bool where it met
  the count (``count * 10`` imported as ``count * True``) is beyond it: ``tvm_fuel.frontend``
  types the cumsum while importing, so nothing downstream is mistyped.
* ``x[..., [-2], :]`` becomes ``take(x, [-2], mode="fast")``, which reads out of bounds; PyTorch
  counts negative indices from the end.
"""

from __future__ import annotations

import numpy as np
import tvm
from tvm import relax
from tvm.relax.expr_functor import PyExprMutator, mutator

from .common import constant_value, op_name, rewrite_functions_with


@mutator
class _Repairs(PyExprMutator):
    def __init__(self, mod: tvm.IRModule | None = None):
        super().__init__(mod)
        self.repaired = 0

    def visit_call_(self, call: relax.Call) -> relax.Expr:
        call = super().visit_call_(call)
        name = op_name(call)
        repaired = self._cumsum(call) if name == "relax.cumsum" else self._take(call) if name == "relax.take" else call
        self.repaired += repaired is not call
        return repaired

    @staticmethod
    def _cumsum(call: relax.Call) -> relax.Expr:
        data = call.args[0]
        if str(data.ty.dtype) != "bool" or (call.attrs.dtype is not None and str(call.attrs.dtype) not in ("", "bool")):
            return call
        return relax.op.cumsum(relax.op.astype(data, "int64"), call.attrs.axis, "int64", call.attrs.exclusive)

    @staticmethod
    def _take(call: relax.Call) -> relax.Expr:
        data, indices = call.args
        values = constant_value(indices)
        if values is None:
            return call
        shape = data.ty.shape
        axis = call.attrs.axis
        if values.dtype.kind not in "iu" or not (values < 0).any() or not isinstance(shape, relax.ShapeExpr):
            return call
        axis = (int(axis) if axis is not None else 0) % len(shape.values)
        size = shape.values[axis]
        if not isinstance(size, tvm.tirx.IntImm):
            return call
        n = int(size)
        if ((values < -n) | (values >= n)).any():
            return call  # out of range in PyTorch too: left for the op's own check
        fixed = np.where(values < 0, values + n, values).astype(values.dtype)
        return relax.op.take(data, relax.const(fixed), call.attrs.axis, call.attrs.mode)


@tvm.transform.module_pass(opt_level=0, name="tvm_fuel.RepairImportedProgram")
class RepairImportedProgram:
    """Give imported programs PyTorch's meaning where TVM 0.27's importer lost it: a bool ``cumsum``
    counts in int64 (its users are re-typed), and a constant ``take`` index below 0 counts from the
    end of its axis. ``tvm_fuel.frontend.from_exported_program`` runs it after TVM's importer, and
    ``tvm_fuel.compile`` before FuseAttention."""

    def transform_module(self, mod: tvm.IRModule, ctx: tvm.transform.PassContext) -> tvm.IRModule:
        repaired, repairs = rewrite_functions_with(mod, _Repairs)
        return repaired if repairs.repaired else mod  # a module with nothing to repair stays as it is
