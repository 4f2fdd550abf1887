"""``FuseAttention``: attention written out in Relax -> ``flash_attn``, where the semantics match exactly.

R.nn.attention (FX import) and the unfused softmax(mask(scale Q K^T)) V graphs of exported
programs (masks read from their programs, softcap, GQA) become one fused call; anything else is left as it
is. What R.nn.attention means in flash_attn's terms is ``tvm_fuel.op.nn_attention``.
"""

from __future__ import annotations

import functools
import math
import operator

import numpy as np
import tvm
from tvm import relax
from tvm.relax.dpl import DFPattern, is_const, is_op, is_tuple, rewrite_call, wildcard

from .. import op
from ..op.config import FLOAT_DTYPES, finite_nonzero_float32
from ..op.nn_attention import band_options, flash_options, static_dims
from .common import int_dim, op_name
from .view_chains import any_of, Chain, KV, scalar
from .mask_program import ConstantEvaluator, broadcast_dims, constraint_tensor, read_keep_mask
from .sink_column import drops_last, is_row_max, sinks_of_column


def _calls(*names: str) -> DFPattern:
    """A call of any of the ops ``names``, whatever its arguments."""
    return any_of(*(is_op(name)(varg_default_wildcard=True) for name in names))


_NN_ATTENTION = ("relax.nn.attention", "relax.nn.attention_bias")  # the second carries a bias


def _fuse_nn_attention(call: relax.Call, _matched) -> relax.Expr:
    """``R.nn.attention`` ([B, S, H, D] layout) -> permute, ``flash_attn``, permute back."""
    options = flash_options(call)
    if options is None:
        return call  # not expressible exactly: left as it is
    q, k, v = (relax.op.permute_dims(x, [0, 2, 1, 3]) for x in call.args[:3])
    bias = call.args[3] if len(call.args) > 3 else None
    return relax.op.permute_dims(op.flash_attn(q, k, v, None, bias, **options), [0, 2, 1, 3])


def _filled() -> DFPattern:
    """A constant, or a ``full`` of one (what the importer makes of ``torch.tensor(0.0)``)."""
    return is_const() | is_op("relax.full")(wildcard(), is_const())


_LIKE = ("relax.full_like", "relax.ones_like", "relax.zeros_like")


def _unlike(call: relax.Call, _matched) -> relax.Expr:
    """``full_like(x, c)`` (``ones_like``, ``zeros_like``) of a static shape -> ``full(shape, c)``: a
    mask built from ``ones_like(scores)`` then no longer keeps the unfused scores alive."""
    shape, dtype, name = static_dims(call), str(call.ty.dtype), op_name(call)
    if None in shape:
        return call
    if name == "relax.full_like":
        return relax.op.full(shape, call.args[1], dtype)
    return (relax.op.ones if name == "relax.ones_like" else relax.op.zeros)(shape, dtype)


_NEG_INF = float("-inf")
_COMPARISONS = {"relax.less": operator.lt, "relax.less_equal": operator.le, "relax.greater": operator.gt,
                "relax.greater_equal": operator.ge}
class _UnfusedAttention:
    """``reshape(matmul(P, V))`` with ``P = softmax(mask(scale * Q @ K^T))`` as frontends write it
    out -> ``flash_attn``: the pattern, and the rewrite that checks what a pattern does not say
    (shapes, axes, constants) and declines where the semantics differ."""

    def __init__(self):
        self.q, self.k = Chain(wildcard(), scaled=True), KV(scaled=True)
        self.transpose = is_op("relax.permute_dims")(self.k.pattern)
        self.k_t = Chain(self.transpose, scaled=True)
        self.qk = is_op("relax.matmul")(self.q.pattern, self.k_t.pattern)
        self.scores = Chain(self.qk, scaled=True)
        # softcap c * tanh(scores / c) (Gemma2): the chain's scale takes the 1 / c, the product the c
        self.cap = is_const()
        self.tanh = is_op("relax.tanh")(self.scores.pattern)
        self.capped = is_op("relax.multiply")(self.tanh, self.cap) | is_op("relax.multiply")(self.cap, self.tanh)
        capped = self.capped | self.scores.pattern
        # ALiBi written out (Bloom, Falcon): + slope_h * key position, on any view, scaled after it or not
        self.alibi = wildcard()
        self.alibi_add = is_op("relax.add")(capped, self.alibi) | is_op("relax.add")(self.alibi, capped)
        self.biased = Chain(self.alibi_add, scaled=True)
        s = self.biased.pattern | capped
        # scores + bias (either order; a where(keep, 0, -inf) bias is its keep mask), where(keep, scores, -inf)
        # and where(drop, -inf, scores) (masked_fill(~keep, -inf)); no scale above them (it would scale the bias)
        self.bias_keep, self.bias_fills = wildcard(), (_filled(), _filled())
        self.bias = is_op("relax.where")(self.bias_keep, *self.bias_fills) | wildcard()
        self.keep, self.keep_fill, self.drop_keep, self.drop_fill = wildcard(), is_const(), wildcard(), is_const()
        self.drop = any_of(*(is_op(name)(self.drop_keep) for name in ("relax.logical_not", "relax.bitwise_not")),
                         wildcard())
        self.add = is_op("relax.add")(s, self.bias) | is_op("relax.add")(self.bias, s)
        self.where_keep = is_op("relax.where")(self.keep, s, self.keep_fill)
        self.where_drop = is_op("relax.where")(self.drop, self.drop_fill, s)
        self.masked = Chain(any_of(self.add, self.where_keep, self.where_drop), scaled=False)
        self.logits = self.masked.pattern | s
        self.softmax = is_op("relax.nn.softmax")(self.logits)
        # PyTorch's guard where(no logit of the row is finite, 0, softmax):
        # not(astype(max(astype(not(logits == -inf), int8), -1, keepdims), bool))
        self.guard_inf, self.zero = is_const(), is_const()
        self.row_max = is_op("relax.max")(is_op("relax.astype")(is_op("relax.logical_not")(
            is_op("relax.equal")(self.logits, self.guard_inf))))
        empty_rows = is_op("relax.logical_not")(is_op("relax.astype")(self.row_max))
        zeros = any_of(*(is_op(name)(wildcard(), self.zero) for name in ("relax.full", "relax.full_like")),
                     *(is_op(name)(wildcard()) for name in ("relax.zeros", "relax.zeros_like")))
        self.guard = is_op("relax.where")(empty_rows, zeros, self.softmax)
        # gpt-oss's sinks: softmax(concat([logits, sink column], -1) - its row max) without the last column
        self.sink_column, self.shift = wildcard(), wildcard()
        self.with_sinks = is_op("relax.concat")(is_tuple([self.logits, self.sink_column]))
        self.sink_softmax = is_op("relax.nn.softmax")(is_op("relax.subtract")(self.with_sinks, self.shift)
                                                      | self.with_sinks)
        self.sliced = is_op("relax.strided_slice")(self.sink_softmax, varg_default_wildcard=True)
        self.probs, self.v = Chain(self.guard | self.softmax | self.sliced, scaled=False), KV(scaled=False)
        self.pv = is_op("relax.matmul")(self.probs.pattern, self.v.pattern)
        self.pattern = is_op("relax.reshape")(self.pv, wildcard())
        self.fused = 0
        self.bindings: dict = {}
        self.evaluated: dict = {}  # the constant tensors evaluated (ConstantEvaluator's memo, shared by functions)

    def __call__(self, func: relax.Function) -> relax.Function:
        """``func`` with its unfused attention fused (``func`` itself where there is none)."""
        prepared = rewrite_call(_calls(*_LIKE), _unlike, func)
        self.bindings = {binding.var: binding.value for block in prepared.body.blocks  # what a mask's program reads
                         if isinstance(block, relax.DataflowBlock)
                         for binding in block.bindings if isinstance(binding, relax.VarBinding)}
        before = self.fused
        fused = rewrite_call(self.pattern, self._rewrite, prepared)
        return fused if self.fused > before else func

    def _rewrite(self, call: relax.Call, m) -> relax.Expr:
        fused = self._fuse(call, m)
        self.fused += fused is not None
        return call if fused is None else fused

    def _fuse(self, call: relax.Call, m) -> relax.Call | None:
        found = self._mask(m) if self._softmax_checked(m) else None
        if found is None:
            return None
        mask, masked, huge_fill, key_bias = found
        chains = ((self.probs, self.scores, self.k_t) + ((self.masked,) if masked is not None else ())
                  + ((self.biased,) if self.alibi_add in m else ()))
        kt_heads: list = []  # a multi-query k broadcast to every head after its transpose
        peeled = {chain: chain.peel(m, kt_heads if chain is self.k_t else None) for chain in chains}
        if not all(whole for _, _, whole in peeled.values()) or not _swaps_last_two(m[self.transpose]):
            return None
        q, q_scale, _ = self.q.peel(m)
        (k, group, k_scale), (v, v_group, _) = self.k.peel(m), self.v.peel(m)
        if kt_heads:
            if group != 1:
                return None
            group = kt_heads[0]
        shapes = [static_dims(t) if len(static_dims(t)) == 4 else None for t in (q, k, v)]
        if None in shapes or None in [d for s in shapes for d in s] or shapes[0] != static_dims(call):
            return None
        (b, h, sq, d), (bk, hk, sk, dk), vs = shapes
        if (bk, hk, sk, dk) != tuple(vs) or group != v_group or (b, h, d) != (bk, hk * group, dk):
            return None
        # every product runs over the same (batch, head) pairs: operands are [B, H, m, n] or [B*H, m, n]
        qk, transpose, pv = m[self.qk], m[self.transpose], m[self.pv]
        expected = ((qk.args[0], (sq, d)), (qk.args[1], (d, sk)), (m[self.scores.pattern], (sq, sk)),
                    (m[self.logits], (sq, sk)), (pv.args[0], (sq, sk)), (pv.args[1], (sk, d)), (pv, (sq, d)))
        expected += ((masked, (sq, sk)),) if masked is not None else ()
        kt_lead = (b, hk) if kt_heads else (b, h)  # k's heads where it is transposed
        if not (all(_merged(static_dims(t), (b, h), tail) for t, tail in expected)
                and all(_merged(static_dims(t), kt_lead, tail) for t, tail in ((transpose, (d, sk)),
                                                                               (transpose.args[0], (sk, d))))):
            return None
        sinks = None
        if self.sliced in m:
            sinks = self._sinks(m, (b, h, sq, sk))
            if sinks is None:
                return None
        scale = math.prod(peeled[self.scores][1] + q_scale + peeled[self.k_t][1] + k_scale, start=1.0)
        softcap = scalar(m[self.cap]) if self.capped in m else 0.0
        if softcap is None or not (softcap == 0.0 or (math.isfinite(softcap) and softcap > 0)):
            return None  # fuel's softcap is a positive float
        if softcap:
            scale *= softcap  # c * tanh(logit / c) with logit = scale * q.k: the chain holds scale / c
        if not finite_nonzero_float32(scale):
            return None  # the kernels scale the logits in float32 (and a 0 scale makes each row uniform)
        key_terms = [] if key_bias is None else [(key_bias, 1.0)]  # (bias over the keys, its factor)
        if self.alibi_add in m:
            after = math.prod(peeled[self.biased][1], start=1.0)  # scales over scores + alibi (Falcon)
            if not finite_nonzero_float32(scale * after):
                return None
            scale *= after
            key_terms.append((m[self.alibi], after))
        options, may_empty = dict(softmax_scale=scale, softcap=softcap), False
        mask_dtype, dtype = None if mask is None else str(mask.ty.dtype), str(m[self.logits].ty.dtype)
        if mask is not None:
            found = self._mask_options(mask, masked, (b, h, sq, sk))
            if found is None:
                return None
            mask, more, may_empty = found
            options.update(more)
        slopes = None
        if key_terms:
            found = self._key_bias(key_terms, (b, h, sk), dtype, bool(options.get("causal")))
            if found is None:
                return None
            slopes, bias = found
            if bias is not None and mask is None:
                mask = bias
            elif bias is not None:  # a compact keep mask and the bias: one float mask, -inf where not kept
                mask = (relax.op.where(mask, bias, relax.const(_NEG_INF, dtype)) if mask_dtype == "bool"
                        else relax.op.add(relax.op.astype(mask, dtype), bias))
        if huge_fill and may_empty:  # with sinks, such a row's lse is the sink's: 0 unless that is -inf, as in torch
            return _uniform_where_empty(op.flash_attn(q, k, v, slopes, mask, sinks=sinks, return_lse=True,
                                                      **options), v, group, sq)
        return op.flash_attn(q, k, v, slopes, mask, sinks=sinks, **options)

    def _sinks(self, m, dims: tuple[int, int, int, int]) -> relax.Expr | None:
        """The sinks [H] of the sink column concatenated to the logits (``[..., Sq, Sk + 1]`` over
        the last axis, shifted by its own row max or not, the softmax's last column dropped); None
        where any of that is otherwise."""
        b, h, sq, sk = dims
        concat = m[self.with_sinks]
        rank = len(static_dims(concat))
        if concat.attrs.axis is None or int(concat.attrs.axis) % rank != rank - 1:
            return None
        if (not _merged(static_dims(concat), (b, h), (sq, sk + 1)) or not drops_last(m[self.sliced])
                or not _last_axis(concat, m[self.sink_softmax].attrs.axis)):
            return None
        if self.shift in m and not is_row_max(m[self.shift], concat, self._bound):
            return None
        return sinks_of_column(m[self.sink_column], (b, h, sq), self._bound)

    def _key_bias(self, terms: list, dims: tuple[int, int, int], dtype: str, causal: bool) -> tuple | None:
        """(alibi_slopes, bias) for ``terms``, biases over the keys alone ([B * H, 1, Sk] as Bloom
        builds ALiBi, or [B | 1, H | 1, 1, Sk]) each added to the logits times its factor: the
        slopes [H] where their sum, computed from constants alone, is ``slope_h * j`` over the keys
        j and the mask causal (left of the diagonal that is fuel's ``-slope * |i + Sk - Sq - j|`` up
        to a row's constant); else the sum in ``dtype`` (the logits') as one [B | 1, H | 1, 1, Sk]
        tensor (ALiBi over positions read from the padding mask, Falcon's bfloat16 ALiBi). None
        where a term is no bias over the keys."""
        b, h, sk = dims
        shaped = []
        for term, factor in terms:
            shape = static_dims(term)
            if None in shape or len(shape) not in (3, 4) or shape[-2:] != [1, sk] or str(term.ty.dtype) not in \
                    FLOAT_DTYPES:
                return None
            if len(shape) == 3:
                if shape[0] not in (1, b * h):
                    return None
                shape = [b, h, 1, sk] if shape[0] != 1 else [1, 1, 1, sk]
            elif shape[0] not in (1, b) or shape[1] not in (1, h):
                return None
            shaped.append((term, shape, factor))
        slopes = self._slopes(shaped, dims) if causal else None
        if slopes is not None:
            return relax.const(slopes), None
        bias = None
        for term, shape, factor in shaped:
            term = term if str(term.ty.dtype) == dtype else relax.op.astype(term, dtype)
            term = term if static_dims(term) == shape else relax.op.reshape(term, shape)
            if factor != 1.0:
                term = relax.op.multiply(term, relax.const(factor, dtype))
            bias = term if bias is None else relax.op.add(bias, term)
        return None, bias

    def _slopes(self, shaped: list, dims: tuple[int, int, int]) -> np.ndarray | None:
        """The slopes [H] of float32 key biases whose sum is ``slope_h * j`` in every batch row,
        computed from constants alone; None where they are anything else."""
        b, h, sk = dims
        total = np.zeros((b, h, sk), np.float32)
        for term, shape, factor in shaped:
            value = ConstantEvaluator(self.bindings, self.evaluated)(term)
            if value is None or value.dtype != np.float32:
                return None
            total = total + np.broadcast_to(value.reshape(shape), (b, h, 1, sk))[:, :, 0] * np.float32(factor)
        slopes = total[0, :, 1] if sk > 1 else np.zeros(h, np.float32)
        if not (total == slopes[:, None] * np.arange(sk, dtype=np.float32)).all():
            return None
        return slopes.astype(np.float32)

    def _softmax_checked(self, m) -> bool:
        """Whether the softmax is over the last axis, and the guard (if any) is PyTorch's "no logit
        of the row is finite", which zeroes only the rows fuel outputs as 0."""
        if self.softmax in m and not _last_axis(m[self.logits], m[self.softmax].attrs.axis):
            return False
        if self.guard not in m:
            return True
        row_max = m[self.row_max]
        axis = row_max.attrs.axis
        return (bool(row_max.attrs.keepdims) and axis is not None and len(axis) == 1 and _last_axis(row_max, axis[0])
                and scalar(m[self.guard_inf]) == _NEG_INF and (self.zero not in m or scalar(m[self.zero]) == 0.0))

    def _mask(self, m) -> tuple | None:
        """(mask, masked, huge_fill, key_bias): the float bias or the bool keep mask, the tensor it
        is applied to, whether the keep mask came from a bias whose finite fill swallows any score
        (``finfo.min``: a row without a kept key is uniform, not 0), and the bias over the keys that
        the kept logits get (``where(keep, key_bias, fill)``, as Falcon writes ALiBi into its mask;
        None for 0); (None, None, False, None) without a mask; None for a ``where`` that fills
        with anything but -inf."""
        if self.masked.leaf not in m:
            return None, None, False, None
        masked = m[self.masked.leaf]
        if self.add in m:
            fills = [scalar(m[fill]) for fill in self.bias_fills] if self.bias_keep in m else None
            if fills == [0.0, _NEG_INF]:
                return m[self.bias_keep], masked, False, None
            if fills is not None and fills[0] == 0.0 and _swallows_scores(fills[1], str(masked.ty.dtype)):
                return m[self.bias_keep], masked, True, None
            split = self._split_bias(m[self.bias], masked)
            return (m[self.bias], masked, False, None) if split is None else (split[0], masked, *split[1:])
        if scalar(m[self.keep_fill if self.where_keep in m else self.drop_fill]) != _NEG_INF:
            return None  # an empty row would be uniform, not 0
        if self.where_keep in m:
            return m[self.keep], masked, False, None
        drop = m[self.drop]
        if self.drop_keep in m and str(drop.ty.dtype) == "bool":
            return m[self.drop_keep], masked, False, None  # masked_fill(~keep, -inf)
        return relax.BlockBuilder().normalize(relax.op.logical_not(drop)), masked, False, None

    def _split_bias(self, bias, masked) -> tuple | None:
        """(keep, huge_fill, key_bias) of a float bias ``where(keep, key_bias, fill)`` or
        ``where(drop, fill, key_bias)`` with ``key_bias`` over the keys alone ([.., 1, Sk]) and a
        fill of -inf or one that swallows any score; None where it is not one."""
        call = self._bound(bias)
        if op_name(call) != "relax.where" or str(call.args[0].ty.dtype) != "bool":
            return None
        cond, then, other = call.args
        for fill, key_bias, drops in ((other, then, False), (then, other, True)):
            value = scalar(self._bound(fill))
            shape = static_dims(key_bias)
            if (value is None or len(shape) < 3 or shape[-2:] != [1, static_dims(masked)[-1]]
                    or str(key_bias.ty.dtype) not in FLOAT_DTYPES):
                continue
            huge = _swallows_scores(value, str(masked.ty.dtype))
            keep = self._negated(cond) if drops else cond
            if keep is not None and (value == _NEG_INF or huge):
                return keep, huge, key_bias
        return None

    def _negated(self, drop) -> relax.Expr | None:
        """The bool keep mask that the bool ``drop`` is the negation of: ``not(keep)``, or a
        comparison of ``where(keep, a, b)`` with a constant that is false for a and true for b
        (Falcon's ``where(keep, 0, finfo.min) < -1``); None where it is neither."""
        call = self._bound(drop)
        name = op_name(call)
        if name in ("relax.logical_not", "relax.bitwise_not"):
            return call.args[0] if str(call.args[0].ty.dtype) == "bool" else None
        compare = _COMPARISONS.get(name)
        where = self._bound(call.args[0]) if compare is not None else None
        if op_name(where) != "relax.where" or str(where.args[0].ty.dtype) != "bool":
            return None
        limit, a, b = (scalar(self._bound(x)) for x in (call.args[1], *where.args[1:]))
        if None in (limit, a, b) or compare(a, limit) or not compare(b, limit):
            return None
        return where.args[0]

    def _bound(self, expr: relax.Expr) -> relax.Expr:
        """The value ``expr`` is bound to in the function's dataflow (``expr`` itself if none)."""
        while isinstance(expr, relax.Var) and expr in self.bindings:
            expr = self.bindings[expr]
        return expr

    def _mask_options(self, mask, masked, dims: tuple[int, int, int, int]) -> tuple | None:
        """(attn_mask, options, may_empty) for a float bias or bool keep ``mask`` broadcast against
        ``masked`` ([B, H, Sq, Sk] or [B * H, Sq, Sk]): a keep mask is read from its program
        (``mask_program``) into causal / window options and the compact tensors that are left
        (none where it keeps everything), any other mask is flash_attn's attn_mask; ``may_empty``:
        a query row may keep no key. None where the mask's shape is unknown, or a scalar
        (flash_attn takes no 0-d mask)."""
        b, h, sq, sk = dims
        shape, dtype = static_dims(mask), str(mask.ty.dtype)
        if not shape or None in shape or dtype not in ("bool",) + FLOAT_DTYPES:
            return None
        options, may_empty = {}, True
        if dtype == "bool":
            read = self._read_keep(mask, sq, sk)
            if read is not None:
                mask, shape, options, may_empty = read
                if mask is None:
                    return None, options, may_empty
        if len(static_dims(masked)) == 3 and len(shape) == 3 and shape[0] != 1:
            mask = relax.op.reshape(mask, [b, h, *shape[1:]])  # [B * H, ...] -> [B, H, ...]
        # otherwise the broadcast against [B * H, Sq, Sk] is the one against [B, H, Sq, Sk]
        return mask, options, may_empty

    def _read_keep(self, mask, sq: int, sk: int) -> tuple | None:
        """(attn_mask or None, options, may_empty) of a bool keep mask read from its program: its
        band of keys per query as causal / window where fuel's window says it, and the rest
        (padding over (batch, key), constraints no window says) as one compact bool tensor."""
        keep = read_keep_mask(mask, self.bindings, ConstantEvaluator(self.bindings, self.evaluated))
        if keep is None:
            return None
        shape, options = static_dims(mask), {}
        if None in shape:
            return None
        constraints = list(keep.constraints)
        if keep.lo is not None or keep.hi is not None:
            window = band_options(sq, sk, keep.lo, keep.hi)
            if window is None:  # no fuel window: the band stays a (materialized) keep tensor
                rank = len(shape)
                band = [(_axes(rank, -1, 1), keep.hi), (_axes(rank, 1, -1), None if keep.lo is None else -keep.lo)]
                constraints += [(c, bound) for c, bound in band if bound is not None]
            else:
                options = window
        tensors = [f.tensor() for f in keep.factors] + [constraint_tensor(c, bound, tuple(shape))
                                                        for c, bound in constraints]
        dims = broadcast_dims([f.dims for f in keep.factors] + [_constraint_dims(c, shape) for c, _ in constraints])
        may_empty = bool(tensors) or not _band_covers_rows(keep.lo, keep.hi, sq, sk)
        if not tensors:
            return None, [], options, may_empty
        if dims is None or None in [int_dim(d) for d in dims]:
            return None
        return functools.reduce(relax.op.logical_and, tensors), [int_dim(d) for d in dims], options, may_empty

def _swallows_scores(fill: float | None, dtype: str) -> bool:
    """Whether a finite additive mask value ``fill`` rounds every score it is added to into itself
    (``finfo(float32).min`` does for |score| < 2**75): all logits of a row without a kept key are
    then equal, and its softmax uniform."""
    return (fill is not None and math.isfinite(fill) and fill <= -2.0 ** 100
            and dtype in ("float32", "bfloat16"))


def _band_covers_rows(lo: int | None, hi: int | None, sq: int, sk: int) -> bool:
    """Whether every query row 0 <= i < Sq keeps some key 0 <= j < Sk with i + lo <= j <= i + hi."""
    lo = -sk if lo is None else lo
    hi = sk if hi is None else hi
    return sq == 0 or (sk > 0 and lo <= hi and hi >= 0 and sq - 1 + lo <= sk - 1)


def _uniform_where_empty(call: relax.Call, v: relax.Expr, group: int, sq: int) -> relax.Expr:
    """The output of a ``flash_attn(..., return_lse=True)`` call, with its rows that keep no key
    (lse = -inf; fuel gives them 0) the uniform average of v over all keys: what a softmax over
    logits that a huge finite fill made equal gives."""
    out, lse = relax.TupleGetItem(call, 0), relax.TupleGetItem(call, 1)
    b, hkv, _, d = static_dims(v)
    mean = relax.op.mean(relax.op.astype(v, "float32"), axis=[2], keepdims=True)  # [B, Hkv, 1, D]
    if group > 1:
        mean = relax.op.reshape(relax.op.broadcast_to(relax.op.expand_dims(mean, [2]), [b, hkv, group, 1, d]),
                                [b, hkv * group, 1, d])
    # where's operands of out's shape: TVM's gradient of where does not sum a broadcast operand back
    full = [b, hkv * group, sq, d]
    empty = relax.op.broadcast_to(relax.op.expand_dims(relax.op.equal(lse, relax.const(_NEG_INF, "float32")), [3]),
                                  full)
    return relax.op.where(empty, relax.op.broadcast_to(relax.op.astype(mean, str(v.ty.dtype)), full), out)


def _constraint_dims(coeffs: tuple[int, ...], shape: list) -> tuple:
    """The dims of ``constraint_tensor``'s tensor: the mask's where the constraint reads the axis."""
    return tuple(n if c else 1 for c, n in zip(coeffs, shape))


def _axes(rank: int, ci: int, cj: int) -> tuple[int, ...]:
    """Constraint coefficients on the query (second-last) and key (last) axes."""
    return (0,) * (rank - 2) + (ci, cj)


def _swaps_last_two(call) -> bool:
    """Whether ``call`` is a ``permute_dims`` that swaps the last two axes (k -> K^T)."""
    if op_name(call) != "relax.permute_dims" or call.attrs.axes is None:
        return False
    n = len(call.attrs.axes)
    return [int(a) % n for a in call.attrs.axes] == [*range(n - 2), n - 1, n - 2]


def _last_axis(tensor, axis) -> bool:
    rank = len(static_dims(tensor))
    return int(axis) % rank == rank - 1


def _merged(shape: list, lead: tuple, tail: tuple) -> bool:
    """``shape`` is ``[*lead, *tail]`` or ``[prod(lead), *tail]``."""
    return list(shape) in ([*lead, *tail], [lead[0] * lead[1], *tail])


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
    repeat of k and v (``enable_gqa``, ``repeat_interleave``: fuel reads them unrepeated) and a
    single k and v head broadcast to every query head (multi-query, as the matmuls broadcast it),
    and a mask between the scale and the softmax:

    * ``scores + bias`` (either order) with a float bias -> ``attn_mask``; a
      ``where(keep, 0, -inf)`` bias (SDPA's causal or bool ``attn_mask``) and
      ``where(keep, scores, -inf)`` / ``masked_fill(~keep, -inf)`` -> the bool keep mask;
    * a bool keep mask is read from its program (``mask_program``): its band of keys per query
      becomes ``causal`` / ``window_size`` where fuel's bottom-right window says it (torch's
      top-left ``is_causal`` with Sk > Sq stays a tensor), the rest (a padding mask over (batch,
      key)) the compact ``attn_mask`` the program holds; an all-true mask disappears;
    * a ``where(keep, 0, finfo.min)`` bias (Hugging Face's eager attention) is the keep mask, and a
      row without a kept key (uniform under the huge finite fill) the average of v over all keys,
      from the fused call's lse;
    * a softcap ``c * tanh(scores / c)`` before the mask -> ``softcap=c`` (Gemma2);
    * a bias over the keys alone, added to the scores (ALiBi as Bloom writes it; scaled after it,
      as Falcon does, or not) or inside the mask (``where(keep, bias, fill)``, or Falcon's
      ``where(where(keep, 0, finfo.min) < -1, finfo.min, bias)``), all such terms summed: where the
      sum is computed from constants alone, is ``slope_h * j`` over the keys j and the mask is
      causal, ``alibi_slopes`` (left of the diagonal ``slope * j`` is fuel's
      ``-slope * |i + Sk - Sq - j|`` up to a row's constant); otherwise (positions read from the
      padding, bfloat16-rounded slopes) one float ``attn_mask`` of [B, H, 1, Sk] at most, the
      compact keep mask folded in as -inf;
    * gpt-oss's sinks as transformers writes them: ``concat([logits, sink column], -1)``, its row
      max subtracted or not, the softmax's last column dropped -> ``sinks`` [H], where the column
      is one logit per head broadcast over batch and queries (``sink_column``); a row without a
      kept key is then the sink's alone (0), or uniform where the sink is -inf (as in torch);
    * a mask over merged [B * H, Sq, Sk] scores is reshaped to [B, H, Sq, Sk]; ``ones_like(scores)``
      and the like in a mask become constants of the shape, so the unfused scores are dropped.

    A row whose logits are all masked is 0; an unguarded graph (a hand-written ``masked_fill``)
    gives NaN there. Left untouched: a softmax over another axis, a mask after the softmax (a
    ``where`` that is not SDPA's empty-row guard), a scale after the bias, a moderate finite fill
    value (its empty rows are neither 0 nor uniform), a bias added on another view of the scores than
    [B, H, Sq, Sk] or [B * H, Sq, Sk], a scalar bias, dropout (``R.nn.dropout``; PyTorch's
    importer drops dropout itself), a scale that is 0 or not finite in float32, and anything with
    symbolic shapes.

    Both are ``relax.dpl`` patterns rewritten by ``rewrite_call``; an O(S) integer tensor a mask
    reads that is computed from constants alone is evaluated by TVM itself.
    """

    def transform_module(self, mod: tvm.IRModule, ctx: tvm.transform.PassContext) -> tvm.IRModule:
        unfused, fused, nn_fused = _UnfusedAttention(), mod.clone(), []

        def fuse_nn_attention(call: relax.Call, matched) -> relax.Expr:
            result = _fuse_nn_attention(call, matched)
            nn_fused.append(result is not call)
            return result

        for gvar, func in mod.functions_items():
            if isinstance(func, relax.Function):
                fused.update_func(gvar, unfused(rewrite_call(_calls(*_NN_ATTENTION), fuse_nn_attention, func)))
        if not unfused.fused and not any(nn_fused):
            return mod  # nothing fused: the module as it was (rewrite_call re-normalizes what it visits)
        return relax.transform.DeadCodeElimination()(fused)


