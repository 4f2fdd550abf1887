"""The driver the Relax rewrites of this package share (transform, expand).

Contents:
    rewrite_functions -- a module with every Relax function visited by a PyExprMutator
"""

from __future__ import annotations

from typing import Callable

import tvm
from tvm import relax
from tvm.relax.expr_functor import PyExprMutator


def rewrite_functions(mod: tvm.IRModule, make_mutator: Callable[[tvm.IRModule], PyExprMutator]) -> tvm.IRModule:
    """``mod`` with each Relax function replaced by what ``make_mutator(mod)`` makes of it (one
    mutator, so the functions it adds share its block builder)."""
    rewriter = make_mutator(mod)
    for gvar, func in mod.functions.items():
        if isinstance(func, relax.Function):
            rewriter.builder_.update_func(gvar, rewriter.visit_expr(func))
    return rewriter.builder_.get()
