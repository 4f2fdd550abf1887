"""``PackLinearWeights``: nn.Linear's constant weights laid out once, at build, in the panels the CPU
matmul's register tile reads (``schedules.cpu.matmul.PackedMatmul``).

``FuseTransposeMatmul`` makes ``matmul(x, permute_dims(w))`` one ``NT_matmul`` reading w [N, K] as
stored, and ``Matmul`` then packs each task's [K, cols] slice of w at every call. Where w is a
constant (a model exported with its weights), this pass stores it as panels wp [N / cols, K, cols]
instead (cols: ``panel_cols``, the tile's columns on the target) and calls
``y[..., n] = sum_k x[..., k] * wp[n // cols, k, n % cols]``: the weight is packed once, when the model
is built, and every call reads it in the order the kernel walks it. A weight passed as a parameter,
another dtype than float32, or N that no vector width divides keeps its NT_matmul.
"""

from __future__ import annotations

import numpy as np
import tvm
from tvm import relax, te
from tvm.relax.expr_functor import PyExprMutator, mutator

from ..schedules.cpu.matmul import panel_cols
from .common import constant_value, int_dim, is_tensor_constant, op_name, rewrite_functions_with

PACKED_NAME = "NT_matmul_panels"  # the PrimFunc a packed call lowers to


def linear_in_panels(x: te.Tensor, wp: te.Tensor) -> te.Tensor:
    """y [..., N] = x [..., K] @ w.T with w [N, K] given as panels wp [N / cols, K, cols]
    (w[n, k] = wp[n // cols, k, n % cols]); every tensor float32."""
    *lead, K = x.shape
    tiles, _, cols = wp.shape
    k = te.reduce_axis((0, K), name="k")
    return te.compute((*lead, tiles * cols),
                      lambda *i: te.sum(x[(*i[:-1], k)] * wp[i[-1] // cols, k, i[-1] % cols], axis=k),
                      name=PACKED_NAME)


def panels(w: np.ndarray, cols: int) -> np.ndarray:
    """w [N, K] as [N / cols, K, cols]: panel j holds rows j * cols .. (j + 1) * cols - 1, K-major."""
    N, K = w.shape
    return np.ascontiguousarray(w.reshape(N // cols, cols, K).transpose(0, 2, 1))


@tvm.transform.module_pass(opt_level=0, name="tvm_fuel.PackLinearWeights")
class PackLinearWeights:
    """Each float32 ``NT_matmul(x, w)`` (``relax.transform.FuseTransposeMatmul``'s) whose w [N, K]
    is a constant becomes ``NT_matmul_panels(x, panels(w))`` on llvm targets; run after
    FuseTransposeMatmul, before LegalizeOps."""

    def __init__(self, target: tvm.target.Target):
        self.target = target

    def transform_module(self, mod: tvm.IRModule, _ctx: tvm.transform.PassContext) -> tvm.IRModule:
        if self.target.kind.name != "llvm":
            return mod
        packed, packer = rewrite_functions_with(mod, lambda module: _Packer(module, self.target))
        if not packer.packed:
            return mod
        return relax.transform.DeadCodeElimination()(packed)  # the NT_matmuls no call reads


@mutator
class _Packer(PyExprMutator):  # pylint: disable=abstract-method
    def __init__(self, mod: tvm.IRModule, target: tvm.target.Target):
        super().__init__(mod)
        self.target = target
        self.packed: dict = {}  # (the weight constant's address, cols) -> its panels: one copy per weight

    def visit_call_(self, call: relax.Call) -> relax.Expr:  # pylint: disable=arguments-renamed
        call = super().visit_call_(call)
        found = self._linear(call)
        if found is None:
            return call
        x, w, cols = found
        key = (hash(w), cols)  # an FFI object's hash is its address (its == builds an expression)
        if key not in self.packed:
            self.packed[key] = relax.const(panels(constant_value(w), cols))
        return self.builder_.call_te(linear_in_panels, x, self.packed[key], primfunc_name_hint=PACKED_NAME)

    def _linear(self, call: relax.Call):
        """(x, w, cols) of a float32 NT_matmul call over a constant w that panels can hold, else None."""
        if op_name(call) != "relax.call_tir":
            return None
        callee, args = call.args[0], call.args[1]
        if not (isinstance(callee, relax.GlobalVar) and callee.name_hint.startswith("NT_matmul")
                and isinstance(args, relax.Tuple) and len(args.fields) == 2):
            return None
        x, w = args.fields
        if not is_tensor_constant(w) or w.ty.ndim != 2 or x.ty.ndim < 2:  # (a value copied only to pack)
            return None
        if any(str(t.dtype) != "float32" for t in (x.ty, w.ty, call.ty)):
            return None
        N, K = (int_dim(d) for d in w.ty.shape.values)
        x_k = int_dim(x.ty.shape.values[-1]) if x.ty.shape is not None else None
        if N is None or K is None or x_k != K:
            return None
        cols = panel_cols(N, self.target)
        return None if cols is None else (x, w, cols)
