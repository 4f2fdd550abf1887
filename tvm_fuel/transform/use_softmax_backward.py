"""``UseSoftmaxBackward``: the softmax gradient ``relax.transform.Gradient`` writes out -> one ``softmax_backward``.
"""

from __future__ import annotations

import tvm
import tvm_ffi
from tvm import relax
from tvm.relax.expr_functor import PyExprMutator, mutator

from .. import op
from ..autodiff.common import bound_value
from ..op.config import FLOAT_DTYPES
from .common import op_name, rewrite_functions


@mutator
class _SoftmaxBackward(PyExprMutator):
    """``(g - sum(g * y, axis, keepdims)) * y`` with ``y = softmax(x, axis)`` (either operand order,
    as ``relax.transform.Gradient`` writes softmax's gradient) -> ``softmax_backward(y, g, axis)``."""

    def visit_call_(self, call: relax.Call) -> relax.Expr:
        call = super().visit_call_(call)
        if op_name(call) != "relax.multiply":
            return call
        for diff, probs in (call.args, call.args[::-1]):
            fused = self._match(diff, probs, call)
            if fused is not None:
                return fused
        return call

    def _match(self, diff, probs, call):
        softmax, diff = bound_value(self, probs), bound_value(self, diff)
        if op_name(softmax) != "relax.nn.softmax" or op_name(diff) != "relax.subtract":
            return None
        dprobs, total = diff.args[0], bound_value(self, diff.args[1])
        if op_name(total) != "relax.sum" or not bool(total.attrs.keepdims) or total.attrs.axis is None \
                or len(total.attrs.axis) != 1:
            return None
        product = bound_value(self, total.args[0])
        if op_name(product) != "relax.multiply" or not any(
                a.same_as(dprobs) and b.same_as(probs) for a, b in (product.args, product.args[::-1])):
            return None
        if str(probs.ty.dtype) not in FLOAT_DTYPES:
            return None  # softmax_backward's dtypes (float64 keeps Gradient's own ops)
        axis, rank = int(softmax.attrs.axis), len(probs.ty.shape.values)
        same_axis = int(total.attrs.axis[0]) % rank == axis % rank
        same_shape = all(tvm_ffi.structural_equal(x.ty, call.ty) for x in (dprobs, probs))  # no broadcasting
        return op.softmax_backward(probs, dprobs, axis=axis) if same_axis and same_shape else None


@tvm.transform.module_pass(opt_level=0, name="tvm_fuel.UseSoftmaxBackward")
class UseSoftmaxBackward:
    """Replace the softmax gradient ``relax.transform.Gradient`` writes out (a multiply, a
    reduction, a subtract and a multiply) by one ``softmax_backward``, then drop what it leaves.
    ``gradient`` runs it after ``Gradient``."""

    def transform_module(self, mod: tvm.IRModule, ctx: tvm.transform.PassContext) -> tvm.IRModule:
        return relax.transform.DeadCodeElimination()(rewrite_functions(mod, _SoftmaxBackward))
