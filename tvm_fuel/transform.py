"""Relax passes around the fuel ops.

Contents:
    FuseAttention     -- R.nn.attention (FX import) and unfused softmax(Q K^T) V graphs (exported
                         programs) -> flash_attn, where the semantics match exactly
    ShareForwardState -- flash_attn returns its lse too, so its gradient reuses out and lse
    gradient          -- ShareForwardState, then relax.transform.Gradient
"""

from __future__ import annotations

from typing import Sequence

import tvm
from tvm import relax
from tvm.relax.expr_functor import PyExprMutator, mutator

from . import op
from .grad import _options, bound_value
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


def _op_name(expr) -> str | None:
    return expr.op.name if isinstance(expr, relax.Call) and isinstance(expr.op, tvm.ir.Op) else None


def _scalar(expr) -> float | None:
    """The value of a scalar float constant (None if ``expr`` is not one)."""
    if not isinstance(expr, tvm.ir.expr.Constant):
        return None
    value = expr.value.numpy()
    return float(value.reshape(())) if value.size == 1 and value.dtype.kind == "f" else None


@mutator
class _FuseUnfused(PyExprMutator):
    """``reshape(matmul(P, V))`` with ``P = softmax(scale * Q @ K^T)`` as frontends write it out
    (batched 3-D matmuls over merged [B * H] dims, scale constants on q, k or the scores, the
    fully-masked-row guard of PyTorch's SDPA decomposition) -> ``flash_attn``."""

    def _bound(self, expr):
        return bound_value(self, expr)

    def _peel(self, expr, scale: list[float] | None = None):
        """Strip reshapes and broadcasts that keep the element count, and, where ``scale`` collects
        them, multiplies by a scalar constant."""
        while True:
            bound = self._bound(expr)
            name = _op_name(bound)
            if name in ("relax.reshape", "relax.broadcast_to") and _numel(bound.args[0]) == _numel(bound):
                expr = bound.args[0]
            elif name == "relax.multiply" and scale is not None and _scalar(self._bound(bound.args[1])) is not None:
                scale.append(_scalar(self._bound(bound.args[1])))
                expr = bound.args[0]
            elif name == "relax.divide" and scale is not None and _scalar(self._bound(bound.args[1])):
                scale.append(1.0 / _scalar(self._bound(bound.args[1])))
                expr = bound.args[0]
            else:
                return expr, bound

    def _softmax_input(self, bound):
        """X of ``softmax(X, axis=-1)``, or of PyTorch's guard ``where(row fully masked, 0, softmax(X))``."""
        if _op_name(bound) == "relax.where":
            zeros = self._bound(bound.args[1])
            if not (_op_name(zeros) in ("relax.full_like", "relax.zeros_like")
                    and (len(zeros.args) < 2 or _scalar(self._bound(zeros.args[1])) == 0.0)):
                return None
            bound = self._bound(bound.args[2])  # the guard only zeroes fully masked rows, as fuel does
        if _op_name(bound) != "relax.nn.softmax" or int(bound.attrs.axis) not in (-1, 3):
            return None
        return bound.args[0]

    def visit_call_(self, call: relax.Call) -> relax.Expr:  # noqa: N802
        call = super().visit_call_(call)
        if _op_name(call) != "relax.reshape" or len(call.ty.shape.values) != 4:
            return call
        matmul = self._bound(call.args[0])
        if _op_name(matmul) != "relax.matmul":
            return call
        scale: list[float] = []
        v, _ = self._peel(matmul.args[1])
        _, probs = self._peel(matmul.args[0])
        scores = self._softmax_input(probs)
        if scores is None:
            return call
        s_var, s_bound = self._peel(scores, scale)
        if _op_name(s_bound) != "relax.matmul":
            return call
        q, _ = self._peel(s_bound.args[0], scale)
        k_t, k_t_bound = self._peel(s_bound.args[1], scale)
        if _op_name(k_t_bound) != "relax.permute_dims" or [int(a) for a in k_t_bound.attrs.axes] != [0, 1, 3, 2]:
            return call
        k, _ = self._peel(k_t_bound.args[0], scale)
        shapes = [_static(x) if len(x.ty.shape.values) == 4 else None for x in (q, k, v)]
        out_shape = _static(call)
        if None in shapes or None in [d for s in shapes for d in s] or shapes[0] != out_shape:
            return call
        (b, h, sq, d), (bk, hk, sk, dk), vs = shapes
        if (bk, hk, sk, dk) != tuple(vs) or (b, h, d) != (bk, hk, dk):
            return call
        # every product runs over the same (batch, head) pairs: operands are [B, H, m, n] or [B*H, m, n]
        expected = ((s_bound.args[0], (sq, d)), (s_bound.args[1], (d, sk)), (scores, (sq, sk)),
                    (matmul.args[0], (sq, sk)), (matmul.args[1], (sk, d)), (matmul, (sq, d)))
        if not all(_merged(_static(x), (b, h), tail) for x, tail in expected):
            return call
        factor = 1.0
        for c in scale:
            factor *= c
        return op.flash_attn(q, k, v, softmax_scale=factor)


def _merged(shape: list, lead: tuple, tail: tuple) -> bool:
    """``shape`` is ``[*lead, *tail]`` or ``[prod(lead), *tail]``."""
    return list(shape) in ([*lead, *tail], [lead[0] * lead[1], *tail])


def _numel(expr) -> int | None:
    size = 1
    for dim in expr.ty.shape.values:
        if not isinstance(dim, tvm.tirx.IntImm):
            return None
        size *= int(dim)
    return size


@tvm.transform.module_pass(opt_level=0, name="tvm_fuel.FuseAttention")
class FuseAttention:
    """Replace attention by ``flash_attn`` where the semantics match exactly: ``R.nn.attention``
    (and ``attention_bias``) calls, and the unfused ``softmax(scale * Q @ K^T) @ V`` graphs.

    ``R.nn.attention`` is what TVM's FX importer (``relax.frontend.torch.from_fx``) makes of
    ``scaled_dot_product_attention``. Its [B, S, H, D] operands are permuted to fuel's
    [B, H, S, D] and back; ``bias`` becomes the additive ``attn_mask``; ``BottomRight`` is fuel's
    causal; ``TopLeft`` is causal when Sq == Sk and a right-bounded window when Sq > Sk. Left
    untouched: ``TopLeft`` with Sk > Sq or symbolic lengths, ``window_size`` (TVM's own sliding
    window convention), a value head dim unlike the query's, and a bias that is not a 4-D float.

    The unfused form is what ``relax.frontend.torch.from_exported_program`` makes of a hand-written
    block or of an unmasked ``scaled_dot_product_attention``: batched matmuls over merged
    [B * H] dims (every operand's shape is checked), scalar constants on q, k or the scores
    (their product is the softmax scale), and SDPA's guard that zeroes fully masked rows (fuel
    does the same). Masked graphs (a causal SDPA's mask construction, additive masks) and GQA
    broadcasts are left untouched.
    """

    def transform_module(self, mod: tvm.IRModule, ctx: tvm.transform.PassContext) -> tvm.IRModule:
        fused = _rewrite(_rewrite(mod, _FuseNnAttention), _FuseUnfused)
        return relax.transform.DeadCodeElimination()(fused)


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
