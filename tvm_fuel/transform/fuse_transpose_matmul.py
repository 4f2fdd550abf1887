"""``FuseTransposeMatmul``: TVM's pass (nn.Linear's ``matmul(x, permute_dims(w))`` as one NT_matmul
reading w [N, K] as stored), where a transposed weight with other users does not break it.

TVM 0.27's ``relax.transform.FuseTransposeMatmul`` groups the transpose and the matmul with
``FuseOpsByPattern``; where the transpose has another user (a training graph's adjoint reads w.T
again), the group returns both values and the pass fails on its tuple (``'TupleType' object has no
attribute 'dtype'``, ``fuse_transpose_matmul.py:166``). Here each such matmul first gets a
transpose of its own (the other users keep theirs), so every group has one output.
"""

from __future__ import annotations

import tvm
from tvm import relax
from tvm.relax.expr_functor import PyExprMutator, mutator

from .common import op_name, rewrite_functions_with


@mutator
class _OwnTranspose(PyExprMutator):  # pylint: disable=abstract-method
    def __init__(self, mod: tvm.IRModule, users: dict):
        super().__init__(mod)
        self.users = users  # a transpose's bound var -> how many calls read it
        self.split = 0

    def visit_call_(self, call: relax.Call) -> relax.Expr:  # pylint: disable=arguments-renamed
        call = super().visit_call_(call)
        if op_name(call) != "relax.matmul" or not isinstance(call.args[1], relax.Var):
            return call
        transposed = call.args[1]
        bound = self.lookup_binding(transposed)
        if op_name(bound) != "relax.permute_dims" or self.users.get(transposed, 0) < 2:
            return call
        self.split += 1
        own = self.builder_.emit(relax.op.permute_dims(bound.args[0], bound.attrs.axes))
        return relax.op.matmul(call.args[0], own, out_dtype=call.attrs.out_dtype)


def _users(mod: tvm.IRModule) -> dict:
    """Each Relax var of ``mod``'s functions -> how many times it is read: every var the visitor meets
    is a use (a call's argument, a tuple's field, a binding of one var to another, the return)."""
    counts: dict = {}

    def visit(expr):
        if isinstance(expr, relax.Var):
            counts[expr] = counts.get(expr, 0) + 1

    for func in mod.functions.values():
        if isinstance(func, relax.Function):
            relax.analysis.post_order_visit(func.body, visit)
    return counts


@tvm.transform.module_pass(opt_level=0, name="tvm_fuel.FuseTransposeMatmul")
class FuseTransposeMatmul:
    """``relax.transform.FuseTransposeMatmul`` after each matmul of a shared transpose got its own
    (module docstring); run before LegalizeOps."""

    def transform_module(self, mod: tvm.IRModule, _ctx: tvm.transform.PassContext) -> tvm.IRModule:
        users = _users(mod)
        owned, own = rewrite_functions_with(mod, lambda module: _OwnTranspose(module, users))
        return relax.transform.FuseTransposeMatmul()(owned if own.split else mod)
