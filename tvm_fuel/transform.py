"""Relax passes around the fuel ops.

Contents:
    FuseAttention     -- R.nn.attention (what the FX importer makes of scaled_dot_product_attention)
                         -> flash_attn, where the semantics match exactly
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


def _static(expr: relax.Expr) -> list[int | None]:
    return [int(d) if isinstance(d, tvm.tirx.IntImm) else None for d in expr.ty.shape.values]


_NN_ATTENTION = ("relax.nn.attention", "relax.nn.attention_bias")  # the second carries a bias


@mutator
class _FuseNnAttention(PyExprMutator):
    """``R.nn.attention`` ([B, S, H, D] layout) -> permute, ``flash_attn``, permute back."""

    def visit_call_(self, call: relax.Call) -> relax.Expr:  # noqa: N802
        call = super().visit_call_(call)
        if not (isinstance(call.op, tvm.ir.Op) and call.op.name in _NN_ATTENTION):
            return call
        options = self._options(call)
        if options is None:
            return call  # not expressible exactly: left as it is
        q, k, v = (self.builder_.emit(relax.op.permute_dims(x, [0, 2, 1, 3])) for x in call.args[:3])
        bias = call.args[3] if len(call.args) > 3 else None
        out = self.builder_.emit(op.flash_attn(q, k, v, None, bias, **options))
        return relax.op.permute_dims(out, [0, 2, 1, 3])

    @staticmethod
    def _options(call: relax.Call) -> dict | None:
        q, k, v = (_static(x) for x in call.args[:3])
        if call.attrs.window_size is not None or q[3] is None or q[3] != k[3] or k[3] != v[3]:
            return None  # its sliding window is TVM's own convention; and out's head dim must be q's
        if len(call.args) > 3 and (len(call.args[3].ty.shape.values) != 4
                                   or str(call.args[3].ty.dtype) not in ("float32", "float16", "bfloat16")):
            return None
        scale = call.attrs.scale
        options = dict(softmax_scale=None if scale is None else float(scale.value))
        mask, sq, sk = call.attrs.causal_mask, q[1], k[1]
        if mask == "BottomRight":
            options["causal"] = True  # fuel's causal is bottom-right aligned
        elif mask == "TopLeft":
            if sq is None or sk is None or sk > sq:
                return None  # keys j <= i with more keys than queries: no (left, right) window says that
            # j <= i  <=>  j <= i + (Sk - Sq) + right with right = Sq - Sk
            options["causal"] = sq == sk
            if sq != sk:
                options["window_size"] = (-1, sq - sk)
        elif mask is not None:
            return None
        return options


@tvm.transform.module_pass(opt_level=0, name="tvm_fuel.FuseAttention")
class FuseAttention:
    """Replace ``R.nn.attention`` (and ``attention_bias``) calls by ``flash_attn`` where the
    semantics match exactly.

    ``R.nn.attention`` is what TVM's FX importer (``relax.frontend.torch.from_fx``) makes of
    ``scaled_dot_product_attention``. Its [B, S, H, D] operands are permuted to fuel's
    [B, H, S, D] and back; ``bias`` becomes the additive ``attn_mask``; ``BottomRight`` is fuel's
    causal; ``TopLeft`` is causal when Sq == Sk and a right-bounded window when Sq > Sk. Left
    untouched: ``TopLeft`` with Sk > Sq or symbolic lengths, ``window_size`` (TVM's own sliding
    window convention), a value head dim unlike the query's, and a bias that is not a 4-D float.
    """

    def transform_module(self, mod: tvm.IRModule, ctx: tvm.transform.PassContext) -> tvm.IRModule:
        return _rewrite(mod, _FuseNnAttention)


def _rewrite(mod: tvm.IRModule, mutator_class) -> tvm.IRModule:
    rewriter = mutator_class(mod)
    for gvar, func in mod.functions.items():
        if isinstance(func, relax.Function):
            rewriter.builder_.update_func(gvar, rewriter.visit_expr(func))
    return rewriter.builder_.get()


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
        return _rewrite(mod, _ReturnLse)


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
