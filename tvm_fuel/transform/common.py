"""What the passes of ``tvm_fuel.transform`` share.

Contents:
    rewrite_functions -- a module with every Relax function visited by a PyExprMutator
    rewrite_functions_with -- the same, and the mutator (what it counted)
    op_name           -- the name of the op a call calls (None: not an op call)
    is_tensor_constant -- a Relax tensor constant (its value not copied)
    constant_value    -- the value of a Relax tensor constant (None: no constant)
    int_dim           -- a dim as an int (None: symbolic)
    unscheduled       -- the TIR functions of a module that no schedule has touched
"""

from __future__ import annotations

from typing import Callable

import numpy as np
import tvm
from tvm import relax
from tvm.relax.expr_functor import PyExprMutator


def rewrite_functions(mod: tvm.IRModule, make_mutator: Callable[[tvm.IRModule], PyExprMutator]) -> tvm.IRModule:
    """``mod`` with each Relax function replaced by what ``make_mutator(mod)`` makes of it (one
    mutator, so the functions it adds share its block builder)."""
    return rewrite_functions_with(mod, make_mutator)[0]


def rewrite_functions_with(mod: tvm.IRModule, make_mutator: Callable[[tvm.IRModule], PyExprMutator]):
    """``rewrite_functions``, and the mutator that rewrote them (what it counted: did it change
    anything?)."""
    rewriter = make_mutator(mod)
    for gvar, func in mod.functions.items():
        if isinstance(func, relax.Function):
            rewriter.builder_.update_func(gvar, rewriter.visit_expr(func))
    return rewriter.builder_.get(), rewriter


def op_name(expr) -> str | None:
    """The name of the op ``expr`` calls, or None where it is no call of an op."""
    return expr.op.name if isinstance(expr, relax.Call) and isinstance(expr.op, tvm.ir.Op) else None


def is_tensor_constant(expr) -> bool:
    """``expr`` is a Relax tensor constant (not one of TVM 0.27's IntImm arguments, which subclass
    Constant); no copy of its value is made."""
    return isinstance(expr, tvm.ir.expr.Constant) and not isinstance(expr, tvm.tirx.IntImm)


def constant_value(expr) -> np.ndarray | None:
    """The value of a Relax tensor constant, None where ``expr`` is none (``is_tensor_constant``)."""
    if not is_tensor_constant(expr):
        return None
    return expr.value.numpy() if hasattr(expr.value, "numpy") else np.asarray(expr.value)


def int_dim(dim) -> int | None:
    """A dim (or an integer argument) as an int, None where it is symbolic."""
    return int(dim) if isinstance(dim, (int, tvm.tirx.IntImm)) else None


def unscheduled(mod: tvm.IRModule) -> dict:
    """GlobalVar -> PrimFunc of the TIR functions of ``mod`` that no schedule has touched."""
    return {gvar: func for gvar, func in mod.functions.items() if isinstance(func, tvm.tirx.PrimFunc)
            and not (func.attrs is not None and func.attrs.get("tirx.is_scheduled", False))}
