"""``ShareForwardState``: every ``flash_attn`` (and ``flash_attn_varlen``) also returns its
log-sum-exp, so its gradient reuses out and lse.
"""

from __future__ import annotations

import tvm
from tvm import relax
from tvm.relax.expr_functor import PyExprMutator, mutator

from ..op import SPECS
from .common import rewrite_functions


@mutator
class _ReturnLse(PyExprMutator):
    def visit_call_(self, call: relax.Call) -> relax.Expr:
        call = super().visit_call_(call)
        names = {SPECS[name].op_name: name for name in ("flash_attn", "flash_attn_varlen")}
        if not (isinstance(call.op, tvm.ir.Op) and call.op.name in names and not bool(call.attrs["return_lse"])):
            return call
        both = self.builder_.emit(SPECS[names[call.op.name]].replace(call, return_lse=True))
        return relax.TupleGetItem(both, 0)


@tvm.transform.module_pass(opt_level=0, name="tvm_fuel.ShareForwardState")
class ShareForwardState:
    """Every ``flash_attn`` and ``flash_attn_varlen`` also returns its log-sum-exp (its users still see ``out``).

    Run before ``relax.transform.Gradient``: the backward then takes the forward's ``out`` and
    ``lse`` and recomputes neither. Harmless otherwise (computing lse is a few flops per row).
    """

    def transform_module(self, mod: tvm.IRModule, ctx: tvm.transform.PassContext) -> tvm.IRModule:
        return rewrite_functions(mod, _ReturnLse)
