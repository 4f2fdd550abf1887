"""Relax passes around the fuel ops.

Contents:
    FuseAttention     -- R.nn.attention (FX import) and unfused softmax(mask(scale Q K^T)) V graphs
                         (exported programs: causal, bool and additive masks, GQA) -> flash_attn,
                         where the semantics match exactly
    ShareForwardState -- flash_attn returns its lse too, so its gradient reuses out and lse
    UseSoftmaxBackward -- the softmax gradient Gradient writes out -> one softmax_backward
    gradient          -- ShareForwardState, relax.transform.Gradient, then UseSoftmaxBackward
    LegalizeFuel      -- the fuel ops alone lowered to kernels or the floor (``tvm_fuel.build``)
"""

from __future__ import annotations

import math
from typing import Sequence

import numpy as np
import tvm
import tvm_ffi
from tvm import relax
from tvm.relax.expr_functor import PyExprMutator, mutator

from . import op
from .build import LegalizeFuel  # noqa: F401 (the pass is built there; a pass is looked for here)
from .config import FLOAT_DTYPES
from .grad import bound_value
from .op import options_of
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
                                   or str(call.args[3].ty.dtype) not in FLOAT_DTYPES):
            return None
        scale = call.attrs.scale
        options = dict(softmax_scale=None if scale is None else float(scale.value))
        mask, sq, sk = call.attrs.causal_mask, q[1], k[1]
        if mask == "BottomRight":
            options["causal"] = True  # fuel's causal is bottom-right aligned
        elif mask == "TopLeft":
            causal = None if sq is None or sk is None else _causal_options(sq, sk, 0)
            if causal is None:
                return None
            options.update(causal)
        elif mask is not None:
            return None
        return options


def _causal_options(sq: int, sk: int, diagonal: int) -> dict | None:
    """flash_attn's options for "query i sees the keys j <= i + diagonal" (0: top-left causal), or
    None where no (left, right) window says it."""
    right = diagonal - (sk - sq)  # fuel's window is relative to the bottom-right diagonal j = i + Sk - Sq
    if right < 0:
        return None  # e.g. top-left with more keys than queries
    return dict(causal=True) if right == 0 else dict(causal=False, window_size=(-1, right))


def _op_name(expr) -> str | None:
    return expr.op.name if isinstance(expr, relax.Call) and isinstance(expr.op, tvm.ir.Op) else None


def _scalar(expr) -> float | None:
    """The value of a scalar float constant (None if ``expr`` is not one)."""
    value = _constant(expr)
    return float(value.reshape(())) if value is not None and value.size == 1 and value.dtype.kind == "f" else None


def _constant(expr) -> np.ndarray | None:
    """The value of a constant (a tensor, or an integer such as ``arange``'s bounds)."""
    if not isinstance(expr, tvm.ir.expr.Constant):
        return None
    return expr.value.numpy() if hasattr(expr.value, "numpy") else np.asarray(expr.value)


_NEG_INF = float("-inf")
_LIKE = {"relax.full_like": None, "relax.ones_like": 1, "relax.zeros_like": 0}  # value: its fill
# the elementwise ops of mask constructions (causal index arithmetic), as numpy computes them
_NUMPY = {"relax.add": np.add, "relax.subtract": np.subtract, "relax.multiply": np.multiply,
          "relax.less": np.less, "relax.less_equal": np.less_equal, "relax.greater": np.greater,
          "relax.greater_equal": np.greater_equal, "relax.equal": np.equal, "relax.not_equal": np.not_equal,
          "relax.logical_and": np.logical_and, "relax.logical_or": np.logical_or,
          "relax.logical_not": np.logical_not, "relax.bitwise_not": np.invert, "relax.where": np.where}
_VIEWS = ("relax.reshape", "relax.expand_dims", "relax.broadcast_to", "relax.astype")
_NUMPY_DTYPES = ("bool", "int8", "int32", "int64", "float16", "float32", "float64")
_MASK_DEPTH = 16  # how far a mask construction is followed (it stops at the first op of another kind anyway)
_MASK_ELEMENTS = 1 << 24  # larger masks are passed on as tensors, not evaluated


@mutator
class _FuseUnfused(PyExprMutator):
    """``reshape(matmul(P, V))`` with ``P = softmax(mask(scale * Q @ K^T))`` as frontends write it
    out (batched 3-D matmuls over merged [B * H] dims, scale constants on q, k or the scores, an
    additive or boolean mask, GQA's head repeat of k and v, the fully-masked-row guard of
    PyTorch's SDPA decomposition) -> ``flash_attn``."""

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

    def _is(self, expr, value: float) -> bool:
        """Whether ``expr`` is the scalar float constant ``value``."""
        return _scalar(self._bound(expr)) == value

    def _softmax_input(self, bound):
        """X of ``softmax(X, axis=-1)``, or of PyTorch's guard ``where(row fully masked, 0, softmax(X))``."""
        guard = None
        if _op_name(bound) == "relax.where":
            zeros = self._bound(bound.args[1])
            if not (_op_name(zeros) in ("relax.full_like", "relax.zeros_like")
                    and (len(zeros.args) < 2 or self._is(zeros.args[1], 0.0))):
                return None
            guard, bound = bound.args[0], self._bound(bound.args[2])
        if _op_name(bound) != "relax.nn.softmax" or not _last_axis(bound.args[0], bound.attrs.axis):
            return None
        if guard is not None and not self._empty_rows(guard, bound.args[0]):
            return None  # zeroes other entries: a mask after the softmax
        return bound.args[0]

    def _empty_rows(self, cond, logits) -> bool:
        """Whether ``cond`` is PyTorch's "no logit of the row is finite",
        ``not(max(astype(not(logits == -inf), int8), -1, keepdims))``: the guard zeroes only the
        rows fuel outputs as 0."""
        chain = ("relax.logical_not", "relax.astype", "relax.max", "relax.astype", "relax.logical_not")
        for name in chain:
            cond = self._bound(cond)
            if _op_name(cond) != name or (name == "relax.max" and not (
                    bool(cond.attrs.keepdims) and len(cond.attrs.axis) == 1 and _last_axis(cond, cond.attrs.axis[0]))):
                return False
            cond = cond.args[0]
        cond = self._bound(cond)
        return (_op_name(cond) == "relax.equal" and self._is(cond.args[1], _NEG_INF)
                and self._bound(cond.args[0]).same_as(self._bound(logits)))

    def _unmask(self, x):
        """(scores, mask, masked) for a softmax input ``x``: ``scores + bias`` (either order),
        ``where(keep, scores, -inf)`` or ``where(drop, -inf, scores)``, with ``mask`` the float bias
        or the bool keep mask and ``masked`` the tensor the mask is broadcast against; ``mask`` is
        None for no mask, and scores None where ``x`` masks in another way. A ``where(keep, 0, -inf)``
        bias is its keep mask."""
        masked, bound = self._peel(x)  # no scale: one outside the mask would scale the bias too
        name = _op_name(bound)
        if name == "relax.add":
            for scores, bias in (bound.args, bound.args[::-1]):
                if _op_name(self._peel(scores, [])[1]) == "relax.matmul":
                    keep = self._bound(bias)
                    if _op_name(keep) == "relax.where" and self._is(keep.args[1], 0.0) and self._is(
                            keep.args[2], _NEG_INF):
                        return scores, keep.args[0], masked
                    return scores, bias, masked
            return None, None, None
        if name == "relax.where" and self._is(bound.args[2], _NEG_INF):
            return bound.args[1], bound.args[0], masked
        if name == "relax.where" and self._is(bound.args[1], _NEG_INF):
            return bound.args[2], self._negated(bound.args[0]), masked
        return x, None, None

    def _negated(self, cond):
        """``not cond``, unwrapping a negation (``masked_fill(~keep, -inf)``)."""
        bound = self._bound(cond)
        if _op_name(bound) in ("relax.logical_not", "relax.bitwise_not") and str(bound.ty.dtype) == "bool":
            return bound.args[0]
        return self.builder_.normalize(relax.op.logical_not(cond))  # emitted only if the fusion goes ahead

    def _kv(self, expr, scale: list[float] | None = None):
        """(k or v, group): ``expr`` peeled, and GQA's head repeat undone: ``expand_dims(x, 2)``
        broadcast to [B, Hkv, group, S, D] and merged, so head h reads x's head h // group."""
        x, bound = self._peel(expr, scale)
        if _op_name(bound) == "relax.broadcast_to":
            inner = self._bound(bound.args[0])
            if _op_name(inner) == "relax.expand_dims" and [int(a) % 5 for a in inner.attrs.axis] == [2]:
                src, out = _static(inner.args[0]), _static(bound)
                if len(src) == 4 and None not in src + out and out == [src[0], src[1], out[2], src[2], src[3]]:
                    return self._peel(inner.args[0], scale)[0], out[2]
        return x, 1

    def _evaluate(self, expr, depth: int = 0) -> np.ndarray | None:
        """The value of a tensor computed from constants alone (a causal mask's index arithmetic)."""
        expr = self._bound(expr)
        value = _constant(expr)
        name = _op_name(expr)
        if value is not None or name is None or depth > _MASK_DEPTH:
            return value
        shape, dtype = _static(expr), str(expr.ty.dtype)
        if None in shape or math.prod(shape) > _MASK_ELEMENTS or dtype not in _NUMPY_DTYPES:
            return None
        if name == "relax.arange":
            bounds = [_constant(a) for a in expr.args]
            return None if any(b is None for b in bounds) else np.arange(*bounds, dtype=dtype)
        if name in ("relax.full", "relax.ones", "relax.zeros", *_LIKE):
            fill = _LIKE.get(name, 1 if name == "relax.ones" else 0)
            fill = self._evaluate(expr.args[1], depth + 1) if name in ("relax.full", "relax.full_like") else fill
            return None if fill is None else np.full(shape, fill, dtype)
        if name not in _NUMPY and name not in _VIEWS:
            return None
        args = []
        for arg in expr.args[:1] if name in _VIEWS else expr.args:  # a view's other arguments are its shape
            args.append(self._evaluate(arg, depth + 1))
            if args[-1] is None:
                return None
        if name in _NUMPY:
            return _NUMPY[name](*args)
        if name == "relax.astype":
            return args[0].astype(dtype)
        return np.broadcast_to(args[0], shape) if name == "relax.broadcast_to" else args[0].reshape(shape)

    def _detached(self, expr, depth: int = 0):
        """``expr`` with each ``*_like(x)`` made a tensor of x's static shape: a mask built from
        ``ones_like(scores)`` then no longer keeps the unfused scores alive."""
        bound = self._bound(expr)
        name = _op_name(bound)
        if name in _LIKE and None not in _static(bound):
            dtype = str(bound.ty.dtype)
            fill = bound.args[1] if _LIKE[name] is None else relax.const(_LIKE[name], dtype)
            return self.builder_.emit(relax.op.full(_static(bound), fill, dtype))
        if not (name in _NUMPY or name in _VIEWS) or depth > _MASK_DEPTH:
            return expr
        args = [self._detached(arg, depth + 1) for arg in bound.args]
        if all(new.same_as(old) for new, old in zip(args, bound.args)):
            return expr
        return self.builder_.emit(relax.Call(bound.op, args, bound.attrs, bound.ty_args))

    def _mask_options(self, mask, masked, dims: tuple[int, int, int, int]) -> tuple | None:
        """(attn_mask, options) for a float bias or bool keep ``mask`` broadcast against
        ``masked`` ([B, H, Sq, Sk] or [B * H, Sq, Sk]): a causal keep mask becomes options, any
        other mask flash_attn's attn_mask. None where the mask's shape is unknown, or a scalar
        (flash_attn takes no 0-d mask)."""
        b, h, sq, sk = dims
        shape, dtype = _static(mask), str(mask.ty.dtype)
        if not shape or None in shape or dtype not in ("bool",) + FLOAT_DTYPES:
            return None
        keep = self._evaluate(mask) if dtype == "bool" else None
        if keep is not None and all(n == 1 for n in keep.shape[:-2]):
            grid = np.broadcast_to(keep.reshape(keep.shape[-2:]), (sq, sk))
            for diagonal in (0, sk - sq):  # top-left (torch's is_causal, tril) and bottom-right
                options = _causal_options(sq, sk, diagonal)
                if options is not None and np.array_equal(grid, np.tri(sq, sk, diagonal, dtype=bool)):
                    return None, options
        mask = self._detached(mask)
        if not isinstance(mask, relax.Var):
            mask = self.builder_.emit(mask)
        if len(_static(masked)) == 3 and len(shape) == 3 and shape[0] != 1:
            mask = self.builder_.emit(relax.op.reshape(mask, [b, h, *shape[1:]]))  # [B * H, ...] -> [B, H, ...]
        return mask, {}  # otherwise the broadcast against [B * H, Sq, Sk] is the one against [B, H, Sq, Sk]

    def visit_call_(self, call: relax.Call) -> relax.Expr:  # noqa: N802
        call = super().visit_call_(call)
        if _op_name(call) != "relax.reshape" or len(call.ty.shape.values) != 4:
            return call
        fused = self._fuse(call)
        return call if fused is None else fused

    def _fuse(self, call: relax.Call) -> relax.Call | None:
        matmul = self._bound(call.args[0])
        if _op_name(matmul) != "relax.matmul":
            return None
        _, probs = self._peel(matmul.args[0])
        x = self._softmax_input(probs)
        scores, mask, masked = (None, None, None) if x is None else self._unmask(x)
        if scores is None:
            return None
        scale: list[float] = []
        _, s_bound = self._peel(scores, scale)
        if _op_name(s_bound) != "relax.matmul":
            return None
        q, _ = self._peel(s_bound.args[0], scale)
        k_t, k_t_bound = self._peel(s_bound.args[1], scale)
        if not _swaps_last_two(k_t_bound):
            return None
        (k, group), (v, v_group) = self._kv(k_t_bound.args[0], scale), self._kv(matmul.args[1])
        shapes = [_static(t) if len(t.ty.shape.values) == 4 else None for t in (q, k, v)]
        if None in shapes or None in [d for s in shapes for d in s] or shapes[0] != _static(call):
            return None
        (b, h, sq, d), (bk, hk, sk, dk), vs = shapes
        if (bk, hk, sk, dk) != tuple(vs) or group != v_group or (b, h, d) != (bk, hk * group, dk):
            return None
        # every product runs over the same (batch, head) pairs: operands are [B, H, m, n] or [B*H, m, n]
        expected = ((s_bound.args[0], (sq, d)), (s_bound.args[1], (d, sk)), (k_t, (d, sk)),
                    (k_t_bound.args[0], (sk, d)), (scores, (sq, sk)), (x, (sq, sk)), (matmul.args[0], (sq, sk)),
                    (matmul.args[1], (sk, d)), (matmul, (sq, d)))
        if masked is not None:
            expected += ((masked, (sq, sk)),)
        if not all(_merged(_static(t), (b, h), tail) for t, tail in expected):
            return None
        options = dict(softmax_scale=math.prod(scale, start=1.0))
        attn_mask = None
        if mask is not None:
            found = self._mask_options(mask, masked, (b, h, sq, sk))
            if found is None:
                return None
            attn_mask, more = found
            options.update(more)
        return op.flash_attn(q, k, v, None, attn_mask, **options)


def _swaps_last_two(call) -> bool:
    """Whether ``call`` is a ``permute_dims`` that swaps the last two axes (k -> K^T)."""
    if _op_name(call) != "relax.permute_dims" or call.attrs.axes is None:
        return False
    n = len(call.attrs.axes)
    return [int(a) % n for a in call.attrs.axes] == [*range(n - 2), n - 1, n - 2]


def _last_axis(tensor, axis) -> bool:
    rank = len(tensor.ty.shape.values)
    return int(axis) % rank == rank - 1


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
    (and ``attention_bias``) calls, and the unfused ``softmax(mask(scale * Q @ K^T)) @ V`` graphs.

    ``R.nn.attention`` is what TVM's FX importer (``relax.frontend.torch.from_fx``) makes of
    ``scaled_dot_product_attention``. Its [B, S, H, D] operands are permuted to fuel's
    [B, H, S, D] and back; ``bias`` becomes the additive ``attn_mask``; ``BottomRight`` is fuel's
    causal; ``TopLeft`` is causal when Sq == Sk and a right-bounded window when Sq > Sk. Left
    untouched: ``TopLeft`` with Sk > Sq or symbolic lengths, ``window_size`` (TVM's own sliding
    window convention), a value head dim unlike the query's, and a bias that is not a 4-D float.

    The unfused form is what ``relax.frontend.torch.from_exported_program`` makes of a hand-written
    block or of ``scaled_dot_product_attention``: batched matmuls over merged [B * H] dims (every
    operand's shape is checked), scalar constants on q, k or the scores (their product is the
    softmax scale), SDPA's guard that zeroes fully masked rows (fuel does the same), GQA's head
    repeat of k and v (``enable_gqa``, ``repeat_interleave``: fuel reads them unrepeated), and a
    mask between the scale and the softmax:

    * ``scores + bias`` (either order) with a float bias -> ``attn_mask``; a
      ``where(keep, 0, -inf)`` bias (SDPA's causal or bool ``attn_mask``) and
      ``where(keep, scores, -inf)`` / ``masked_fill(~keep, -inf)`` -> the bool ``attn_mask`` keep;
    * a keep mask computed from constants alone that is the top-left causal ``tril`` (torch's
      ``is_causal``) -> ``causal`` when Sq == Sk and a right-bounded window when Sq > Sk (with
      Sk > Sq it stays a mask tensor); the bottom-right one -> ``causal``;
    * a mask over merged [B * H, Sq, Sk] scores is reshaped to [B, H, Sq, Sk]; ``ones_like(scores)``
      and the like in a mask become constants of the shape, so the unfused scores are dropped.

    A row whose logits are all masked is 0; an unguarded graph (a hand-written ``masked_fill``)
    gives NaN there. Left untouched: a softmax over another axis, a mask after the softmax (a
    ``where`` that is not SDPA's empty-row guard), a scale after the bias, a finite fill value
    (its empty rows are uniform, not 0), a bias added on another view of the scores than
    [B, H, Sq, Sk] or [B * H, Sq, Sk], a scalar bias, dropout (``R.nn.dropout``; PyTorch's
    importer drops dropout itself), and anything with symbolic shapes.
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
                                                args["attn_mask"], return_lse=True, **options_of(call)))
        return relax.TupleGetItem(both, 0)


@tvm.transform.module_pass(opt_level=0, name="tvm_fuel.ShareForwardState")
class ShareForwardState:
    """Every ``flash_attn`` also returns its log-sum-exp (its users still see ``out``).

    Run before ``relax.transform.Gradient``: the backward then takes the forward's ``out`` and
    ``lse`` and recomputes neither. Harmless otherwise (computing lse is a few flops per row).
    """

    def transform_module(self, mod: tvm.IRModule, ctx: tvm.transform.PassContext) -> tvm.IRModule:
        return _rewrite(mod, _ReturnLse)


@mutator
class _SoftmaxBackward(PyExprMutator):
    """``(g - sum(g * y, axis, keepdims)) * y`` with ``y = softmax(x, axis)`` (either operand order,
    as ``relax.transform.Gradient`` writes softmax's gradient) -> ``softmax_backward(y, g, axis)``."""

    def visit_call_(self, call: relax.Call) -> relax.Expr:  # noqa: N802
        call = super().visit_call_(call)
        if _op_name(call) != "relax.multiply":
            return call
        for diff, probs in (call.args, call.args[::-1]):
            fused = self._match(diff, probs, call)
            if fused is not None:
                return fused
        return call

    def _match(self, diff, probs, call):
        softmax, diff = bound_value(self, probs), bound_value(self, diff)
        if _op_name(softmax) != "relax.nn.softmax" or _op_name(diff) != "relax.subtract":
            return None
        dprobs, total = diff.args[0], bound_value(self, diff.args[1])
        if _op_name(total) != "relax.sum" or not bool(total.attrs.keepdims) or total.attrs.axis is None \
                or len(total.attrs.axis) != 1:
            return None
        product = bound_value(self, total.args[0])
        if _op_name(product) != "relax.multiply" or not any(
                a.same_as(dprobs) and b.same_as(probs) for a, b in (product.args, product.args[::-1])):
            return None
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
        return relax.transform.DeadCodeElimination()(_rewrite(mod, _SoftmaxBackward))


def gradient(mod: tvm.IRModule, func_name: str = "main", require_grads: Sequence[relax.Var] | None = None,
             target_index: int = 0) -> tvm.IRModule:
    """``mod`` with ``<func_name>_adjoint`` added: ``ShareForwardState``, ``relax.transform.Gradient``,
    then ``UseSoftmaxBackward`` (softmaxes elsewhere in the model get ``softmax_backward``).

    Example
    -------
    >>> adjoint = tvm_fuel.transform.gradient(mod)                 # doctest: +SKIP
    >>> ex = tvm_fuel.compile(adjoint, "llvm", kernels="tuned")    # doctest: +SKIP
    """
    shared = ShareForwardState()(mod)
    if require_grads is not None:  # the same parameters, by position, in the rewritten function
        params = list(mod[func_name].params)
        require_grads = [shared[func_name].params[params.index(var)] for var in require_grads]
    adjoint = relax.transform.Gradient(func_name, require_grads=require_grads, target_index=target_index)(shared)
    return UseSoftmaxBackward()(adjoint)
