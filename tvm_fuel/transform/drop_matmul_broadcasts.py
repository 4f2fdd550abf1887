"""``DropMatmulBroadcasts``: a matmul's operands read where they are, not broadcast to its batch first.

TVM 0.27's PyTorch importer takes ``aten.linear`` over a 3-D input it cannot view as 2-D (the
attention output projection, after a transpose) as ``matmul(broadcast_to(x, [B, S, K]),
broadcast_to(permute_dims(w), [B, K, N]))``. ``FoldConstant`` then stores the weight B times
([4, 576, 576] for a 576-wide projection at batch 4), and the batched matmul misses nn.Linear's
path (``FuseTransposeMatmul``, the weight laid out once in panels). ``matmul`` broadcasts its batch
dims itself, so each ``broadcast_to`` that only adds or widens batch dims is dropped, where the
product keeps its shape.
"""

from __future__ import annotations

import tvm
import tvm_ffi
from tvm import relax
from tvm.relax.expr_functor import PyExprMutator, mutator

from .common import op_name, rewrite_functions_with


@mutator
class _Drop(PyExprMutator):  # pylint: disable=abstract-method
    def __init__(self, mod: tvm.IRModule | None = None):
        super().__init__(mod)
        self.dropped = 0

    def visit_call_(self, call: relax.Call) -> relax.Expr:  # pylint: disable=arguments-renamed
        call = super().visit_call_(call)
        if op_name(call) != "relax.matmul":
            return call
        operands = [self._source(arg) for arg in call.args]
        if all(source is arg for source, arg in zip(operands, call.args)):
            return call
        dropped = self.builder_.normalize(relax.op.matmul(*operands, out_dtype=call.attrs.out_dtype))
        if not tvm_ffi.structural_equal(dropped.ty, call.ty):
            return call  # (both operands lose the batch: the product would too)
        self.dropped += 1
        return dropped

    def _source(self, arg: relax.Expr) -> relax.Expr:
        """What ``arg`` broadcasts, where the broadcast only adds or widens dims before the last two."""
        bound = self.lookup_binding(arg) if isinstance(arg, relax.Var) else None
        if op_name(bound) != "relax.broadcast_to":
            return arg
        source = bound.args[0]
        source_shape, target_shape = source.ty.shape, arg.ty.shape
        if not isinstance(source_shape, relax.ShapeExpr) or not isinstance(target_shape, relax.ShapeExpr):
            return arg
        if len(source_shape.values) < 2 or not all(
                tvm_ffi.structural_equal(a, b) for a, b in zip(source_shape.values[-2:], target_shape.values[-2:])):
            return arg
        return source


@tvm.transform.module_pass(opt_level=0, name="tvm_fuel.DropMatmulBroadcasts")
class DropMatmulBroadcasts:
    """Each ``matmul`` of a ``broadcast_to`` over batch dims reads the broadcast's source (module
    docstring); run before ``FoldConstant`` and ``FuseTransposeMatmul``."""

    def transform_module(self, mod: tvm.IRModule, _ctx: tvm.transform.PassContext) -> tvm.IRModule:
        rewritten, drop = rewrite_functions_with(mod, _Drop)
        if not drop.dropped:
            return mod
        return relax.transform.DeadCodeElimination()(rewritten)  # the broadcasts no call reads
