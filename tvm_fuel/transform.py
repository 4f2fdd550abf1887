"""Relax passes around the fuel ops.

Contents:
    ShareForwardState -- flash_attn returns its lse too, so its gradient reuses out and lse
    gradient          -- ShareForwardState, then relax.transform.Gradient
"""

from __future__ import annotations

from typing import Sequence

import tvm
from tvm import relax
from tvm.relax.expr_functor import PyExprMutator, mutator

from . import op
from .grad import _options
from .op import SPECS


@mutator
class _ReturnLse(PyExprMutator):
    def visit_call_(self, call: relax.Call) -> relax.Expr:  # noqa: N802 (the visitor's name)
        call = super().visit_call_(call)
        if not (isinstance(call.op, tvm.ir.Op) and call.op.name == SPECS["flash_attn"].op_name
                and not bool(call.attrs["return_lse"])):
            return call
        args = SPECS["flash_attn"].split_args(call)
        both = self.builder_.emit(op.flash_attn(args["q"], args["k"], args["v"], args["alibi_slopes"],
                                                args["attn_mask"], return_lse=True, **_options(call)))
        return relax.TupleGetItem(both, 0)


@tvm.transform.module_pass(opt_level=0, name="tvm_fuel.ShareForwardState")
class ShareForwardState:
    """Every ``flash_attn`` also returns its log-sum-exp (its users still see ``out``).

    Run before ``relax.transform.Gradient``: the backward then takes the forward's ``out`` and
    ``lse`` and recomputes neither. Harmless otherwise (computing lse is a few flops per row).
    """

    def transform_module(self, mod: tvm.IRModule, ctx: tvm.transform.PassContext) -> tvm.IRModule:
        rewriter = _ReturnLse(mod)
        for gvar, func in mod.functions.items():
            if isinstance(func, relax.Function):
                rewriter.builder_.update_func(gvar, rewriter.visit_expr(func))
        return rewriter.builder_.get()


def gradient(mod: tvm.IRModule, func_name: str = "main", require_grads: Sequence[relax.Var] | None = None,
             target_index: int = 0) -> tvm.IRModule:
    """``mod`` with ``<func_name>_adjoint`` added: ``ShareForwardState`` then ``relax.transform.Gradient``.

    Example
    -------
    >>> adjoint = tvm_fuel.transform.gradient(mod)                 # doctest: +SKIP
    >>> ex = tvm_fuel.compile(adjoint, "llvm", kernels="tuned")    # doctest: +SKIP
    """
    shared = ShareForwardState()(mod)
    if require_grads is not None:  # the same parameters, by position, in the rewritten function
        params = list(mod[func_name].params)
        require_grads = [shared[func_name].params[params.index(var)] for var in require_grads]
    return relax.transform.Gradient(func_name, require_grads=require_grads, target_index=target_index)(shared)
