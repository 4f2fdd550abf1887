"""``PackLinearWeights``: nn.Linear's constant weights laid out once, at build, in the panels the CPU
matmul's register tile reads (``schedules.cpu.matmul.PackedMatmul``).

``FuseTransposeMatmul`` makes ``matmul(x, permute_dims(w))`` one ``NT_matmul`` reading w [N, K] as
stored, and ``Matmul`` then packs each task's [K, cols] slice of w at every call. Where w is a
constant (a model exported with its weights), this pass stores it as panels wp [N / cols, K, cols]
instead (cols: ``panel_cols``, the tile's columns on the target) and calls
``y[..., n] = sum_k x[..., k] * wp[n // cols, k, n % cols]``: the weight is packed once, when the model
is built, and every call reads it in the order the kernel walks it.

``PackLinearParams`` does the same for a weight passed as a parameter, laid out once at load: a
parameter after its function's ``num_input`` (relax.frontend.nn's ``export_tvm`` marks the weights
so, as MLC-LLM's models are) gets a ``pack_panels`` call in front of its matmuls, which TVM's
``LiftTransformParams`` moves into the module's ``transform_params``: the caller runs it once over
the weights and passes its results in their place (``tvm_fuel.compile(..., pack_params=True)``).

Another dtype than float32 or N that no vector width divides keeps its NT_matmul.
"""

from __future__ import annotations

import numpy as np
import tvm
from tvm import relax, te
from tvm.relax.expr_functor import PyExprMutator, mutator

from ..schedules.cpu.matmul import panel_cols
from .common import constant_value, int_dim, is_tensor_constant, op_name, rewrite_functions_with
from .fuse_transpose_matmul import FuseTransposeMatmul

PACKED_NAME = "NT_matmul_panels"  # the PrimFunc a packed call lowers to
PACK_NAME = "pack_panels"  # the PrimFunc that lays a weight parameter out in panels (lifted to transform_params)


def linear_in_panels(x: te.Tensor, wp: te.Tensor) -> te.Tensor:
    """y [..., N] = x [..., K] @ w.T with w [N, K] given as panels wp [N / cols, K, cols]
    (w[n, k] = wp[n // cols, k, n % cols]); every tensor float32."""
    *lead, K = x.shape
    tiles, _, cols = wp.shape
    k = te.reduce_axis((0, K), name="k")
    return te.compute((*lead, tiles * cols),
                      lambda *i: te.sum(x[(*i[:-1], k)] * wp[i[-1] // cols, k, i[-1] % cols], axis=k),
                      name=PACKED_NAME)


def panels_of(w: te.Tensor, cols: int) -> te.Tensor:
    """w [N, K] as panels [N / cols, K, cols] (``panels`` in TE: a weight parameter's layout)."""
    n, k = w.shape
    return te.compute((n // cols, k, cols), lambda tile, kk, col: w[tile * cols + col, kk], name=PACK_NAME)


def panels(w: np.ndarray, cols: int) -> np.ndarray:
    """w [N, K] as [N / cols, K, cols]: panel j holds rows j * cols .. (j + 1) * cols - 1, K-major."""
    N, K = w.shape
    return np.ascontiguousarray(w.reshape(N // cols, cols, K).transpose(0, 2, 1))


@tvm.transform.module_pass(opt_level=0, name="tvm_fuel.PackLinearWeights")
class PackLinearWeights:
    """Each float32 ``NT_matmul(x, w)`` (``relax.transform.FuseTransposeMatmul``'s) whose w [N, K]
    is a constant becomes ``NT_matmul_panels(x, panels(w))`` on llvm targets; with ``params``, also
    each whose w is a weight parameter (after the function's ``num_input``), as
    ``NT_matmul_panels(x, pack_panels(w))`` for ``LiftTransformParams`` to lift. Run after
    FuseTransposeMatmul, before LegalizeOps."""

    def __init__(self, target: tvm.target.Target, *, params: bool = False):
        self.target, self.params = target, params

    def transform_module(self, mod: tvm.IRModule, _ctx: tvm.transform.PassContext) -> tvm.IRModule:
        if self.target.kind.name != "llvm":
            return mod
        packed, packer = rewrite_functions_with(mod, lambda module: _Packer(module, self.target, self.params))
        if not packer.rewritten:
            return mod
        return relax.transform.DeadCodeElimination()(packed)  # the NT_matmuls no call reads


def PackLinearParams(target: tvm.target.Target) -> tvm.transform.Pass:  # noqa: N802
    """nn.Linear's weight parameters in panels, packed by the module's ``transform_params`` (one for
    every function with a ``"num_input"``: ``LiftTransformParams(shared_transform=True)``); on
    llvm, in front of the build (before ``SpecializeAtTunedShapes`` copies a function: its copies
    and their dispatcher then take the same packed weights). The NT_matmuls of TVM's
    ``FuseTransposeMatmul`` are read as ``PackLinearWeights`` reads them. A packing that not every
    such function does (a weight one of them reads otherwise) is not lifted: it stays in its
    function, run at each call."""

    @tvm.transform.module_pass(opt_level=0, name="tvm_fuel.PackLinearParams")
    def _pack(mod: tvm.IRModule, _ctx: tvm.transform.PassContext) -> tvm.IRModule:
        if target.kind.name != "llvm":
            return mod
        if not any(isinstance(func, relax.Function) and func.attrs is not None and "num_input" in func.attrs
                   for func in mod.functions.values()):
            return mod  # no weights declared (and LiftTransformParams' shared mode refuses such a module)
        packed = PackLinearWeights(target, params=True)(FuseTransposeMatmul()(mod))
        return relax.transform.LiftTransformParams(shared_transform=True)(packed)

    return _pack


@mutator
class _Packer(PyExprMutator):  # pylint: disable=abstract-method
    def __init__(self, mod: tvm.IRModule, target: tvm.target.Target, params: bool):
        super().__init__(mod)
        self.target, self.params = target, params
        self.packed: dict = {}  # (the constant's address, cols) -> its panels: one copy per weight
        self.weights: set = set()  # the addresses of the weight parameters of the function being visited
        self.packed_params: dict = {}  # (the parameter's address, cols) -> its panels, in the block being visited
        self.rewritten = 0  # NT_matmul calls now reading panels

    def visit_function_(self, func: relax.Function) -> relax.Expr:  # pylint: disable=arguments-renamed
        inputs = func.attrs.get("num_input") if func.attrs is not None else None
        self.weights = ({hash(p) for p in func.params[int(inputs):]} if self.params and inputs is not None
                        else set())
        return super().visit_function_(func)

    def visit_dataflow_block_(self, block: relax.DataflowBlock):  # pylint: disable=arguments-renamed
        self.packed_params = {}  # a block's panels are not visible in the next one
        return super().visit_dataflow_block_(block)

    def visit_binding_block_(self, block: relax.BindingBlock):  # pylint: disable=arguments-renamed
        self.packed_params = {}
        return super().visit_binding_block_(block)

    def visit_call_(self, call: relax.Call) -> relax.Expr:  # pylint: disable=arguments-renamed
        call = super().visit_call_(call)
        found = self._linear(call)
        if found is None:
            return call
        x, w, cols = found
        key = (hash(w), cols)  # an FFI object's hash is its address (its == builds an expression)
        if is_tensor_constant(w):
            if key not in self.packed:
                self.packed[key] = relax.const(panels(constant_value(w), cols))
            wp = self.packed[key]
        else:
            if key not in self.packed_params:
                self.packed_params[key] = self.builder_.emit(
                    self.builder_.call_te(panels_of, w, cols, primfunc_name_hint=PACK_NAME))
            wp = self.packed_params[key]
        self.rewritten += 1
        return self.builder_.call_te(linear_in_panels, x, wp, primfunc_name_hint=PACKED_NAME)

    def _linear(self, call: relax.Call):
        """(x, w, cols) of a float32 NT_matmul call over a constant w (or a weight parameter, where
        asked) that panels can hold, else None."""
        if op_name(call) != "relax.call_tir":
            return None
        callee, args = call.args[0], call.args[1]
        if not (isinstance(callee, relax.GlobalVar) and callee.name_hint.startswith("NT_matmul")
                and isinstance(args, relax.Tuple) and len(args.fields) == 2):
            return None
        x, w = args.fields
        if not (is_tensor_constant(w) or hash(w) in self.weights) or w.ty.ndim != 2 or x.ty.ndim < 2:
            return None
        if any(str(t.dtype) != "float32" for t in (x.ty, w.ty, call.ty)):
            return None
        N, K = (int_dim(d) for d in w.ty.shape.values)
        x_k = int_dim(x.ty.shape.values[-1]) if x.ty.shape is not None else None
        if N is None or K is None or x_k != K:
            return None
        cols = panel_cols(N, self.target)
        return None if cols is None else (x, w, cols)
