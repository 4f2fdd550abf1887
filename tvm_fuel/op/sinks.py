"""Attention sinks in Relax ops: a sink-free (out, lse) rescaled to the sinks', and the sinks' gradient.

A sink adds one logit ``sinks[h]`` to each row's softmax that weighs no value (README, "Sinks";
``tvm_fuel.reference``). Against the row's sink-free state (``out0``, ``lse0``) that is exactly::

    lse = logaddexp(lse0, sinks[h])        out = out0 * exp(lse0 - lse)

so any kernel that returns its lse serves sinks with one elementwise pass over ``out`` (the merge
of two softmax states, as FlashInfer's ``merge_state`` does with a state that holds no value).
The backward kernels need no change: given the sinks' out and lse, ``P = exp(s - lse)`` and
``D = rowsum(do * out)`` are already the sinks'; only the sinks' own gradient is new::

    dsinks[h] = -sum_{b, i} exp(sinks[h] - lse[b, h, i]) * rowsum(do * out)[b, h, i]

Contents:
    rescale_by_sinks -- (out, lse) of attention with sinks from the sink-free (out0, lse0), dense or packed
    sinks_grad       -- dsinks [Hq] float32 from the forward's out, lse and the output gradient do
"""

from __future__ import annotations

from tvm import relax

R = relax.op
F32 = "float32"


def _f32(x: relax.Expr) -> relax.Expr:
    return x if str(x.ty.dtype) == F32 else R.astype(x, F32)


def _per_row(sinks: relax.Expr, packed: bool = False) -> relax.Expr:
    """sinks [Hq] as [1, Hq, 1], broadcast against [B, Hq, Sq]; ``packed``: as [Hq, 1], against the
    packed layout's lse [Hq, total_q]."""
    return R.expand_dims(sinks, [1] if packed else [0, 2])


def rescale_by_sinks(bb: relax.BlockBuilder, out0: relax.Expr, lse0: relax.Expr,
                     sinks: relax.Expr, *, rows: relax.Expr | None = None) -> tuple[relax.Expr, relax.Expr]:
    """``(out, lse)`` of attention with ``sinks`` from the same attention's sink-free result.

    out0: [B, Hq, Sq, D] (float32, float16 or bfloat16); lse0: [B, Hq, Sq] float32, ``-inf`` for
    rows without a visible key; sinks: [Hq] float32. Returns out like out0 and lse [B, Hq, Sq]
    float32. A row without a visible key stays 0 with ``lse = sinks[h]``; ``sinks[h] = -inf`` is
    no sink (``-inf`` with a row without keys too, never NaN).
    ``rows`` (``flash_attn_varlen``'s layout, out0 [total_q, Hq, D] and lse0 [Hq, total_q]): how many
    leading rows belong to a sequence (a scalar, ``cu_seqlens_q[B]``); rows past them belong to none
    and keep ``lse = -inf``, as the floor's.
    """
    packed = rows is not None
    neg_inf = relax.const(float("-inf"), F32)
    sink = bb.emit(_per_row(sinks, packed))
    top = bb.emit(R.maximum(lse0, sink))
    none = bb.emit(R.equal(top, neg_inf))  # neither a key nor a sink: keep -inf (no -inf - -inf)
    if packed:  # a row of no sequence has no sink either
        index = R.arange(0, lse0.ty.shape[1], 1, "int64")
        none = bb.emit(R.logical_or(none, R.expand_dims(R.greater_equal(index, R.astype(rows, "int64")), [0])))
    shift = bb.emit(R.where(none, relax.const(0.0, F32), top))
    lse = bb.emit(R.where(none, neg_inf, R.add(shift, R.log(R.add(R.exp(R.subtract(lse0, shift)),
                                                                   R.exp(R.subtract(sink, shift)))))))
    # exp(lse0 - lse) in (0, 1]; 0 where the row has no key (lse0 = -inf)
    factor = bb.emit(R.where(R.equal(lse0, neg_inf), relax.const(0.0, F32),
                             R.exp(R.subtract(lse0, R.where(none, relax.const(0.0, F32), lse)))))
    per_row = R.expand_dims(R.permute_dims(factor, [1, 0]), [2]) if packed else R.expand_dims(factor, [3])
    out = R.multiply(_f32(out0), per_row)
    out = bb.emit(out if str(out0.ty.dtype) == F32 else R.astype(out, str(out0.ty.dtype)))
    return out, lse


def sinks_grad(out: relax.Expr, lse: relax.Expr, do: relax.Expr, sinks: relax.Expr, *,
               packed: bool = False) -> relax.Expr:
    """The gradient of ``flash_attn``'s sinks for the output gradient ``do``.

    out, do: [B, Hq, Sq, D] (as q); lse: [B, Hq, Sq] float32 (the forward's, sinks included);
    sinks: [Hq] float32. Returns dsinks [Hq] float32:
    ``-sum_{b, i} exp(sinks[h] - lse[b, h, i]) * rowsum(do * out)[b, h, i]``.
    ``packed``: ``flash_attn_varlen``'s layout, out, do [total_q, Hq, D] and lse [Hq, total_q].
    """
    row = R.sum(R.multiply(_f32(do), _f32(out)), axis=[2 if packed else 3])  # D = rowsum(dO * O)
    if packed:
        row = R.permute_dims(row, [1, 0])  # [Hq, total_q], as lse
    sink = _per_row(sinks, packed)
    # the sink column's probability; 0 where lse is -inf (a -inf sink and no key: no -inf - -inf)
    weight = R.where(R.equal(lse, relax.const(float("-inf"), F32)), relax.const(0.0, F32),
                     R.exp(R.subtract(sink, lse)))
    return R.negative(R.sum(R.multiply(weight, row), axis=[1] if packed else [0, 2]))
