"""The gradient of TVM's ``R.nn.attention`` / ``attention_bias`` ([B, S, H, D] layout).

What the op computes (TVM 0.27: its legalization ``_te_attention``, its type rule, and for
``window_size``, which the legalization refuses, the CUTLASS/flash codegen), per batch b and
query head h, with Sq queries, Sk keys, query head dim D and value head dim Dv (may differ)::

    P    = scale * Q_h K_g^T (+ bias)      scale: the attribute, else P = Q_h K_g^T / sqrt(D);
                                           g = h // (Hq / Hkv) where Hkv divides Hq (the CUTLASS /
                                           flash convention; the legalization reshapes k, v as if
                                           they had Hq heads, reading past their end)
    keep = query i sees key j iff  j - i <= hi  (and  j - i >= hi - (w - 1)  with a window w >= 1)
           hi = 0 (TopLeft), |Sq - Sk| (BottomRight: the legalization and the op's docstring use
           the absolute value, so with Sq > Sk its diagonal sits above the main one), none without
           a causal mask; hi >= 0, so the causal mask alone never empties a row
    O    = softmax over the kept keys of P, times V_g    (rows with no finite kept logit, e.g. all
           -inf through the bias, are NaN, as TVM's 0/0)

The bias is a 4-D tensor broadcast against [B, Hq, Sq, Sk] (unit dims allowed, except the key
dim); it is added in q's dtype (TVM's add casts a narrower or bool bias up; a wider one is cast
down here, where TVM's result takes the wider dtype its type rule does not declare). It gets **no
gradient** in either path (``no_grad``): it is treated as a mask, as ``flash_attn``'s attn_mask.

Which path:

* ``flash_attn_backward`` on the [B, H, S, D] views where ``nn_attention.flash_options`` says the
  call is ``flash_attn`` exactly (FuseAttention's rule: not float64; TVM's BottomRight diagonal
  |Sq - Sk| as fuel's causal where Sq <= Sk is provable, as a window above it for static Sq > Sk).
* Elsewhere the **primitive expansion**: the VJP (``composition_vjp``, so it differentiates again)
  of the formula above written in Relax ops that all have gradients: permute_dims, repeat (GQA),
  matmul, multiply / divide (scale), add (bias), where (-inf at dropped keys; the key-minus-query
  index j - i from cumsum of ones_like, so symbolic sizes work), softmax, matmul.

Refused (ValueError naming the op), as TVM defines no forward there: q, k, v of different dtypes;
a causal_mask other than None / TopLeft / BottomRight; a ``window_size`` without BottomRight (the
CUTLASS codegen asserts it); a window ``w >= 1`` where Sq <= Sk is not provable (there TVM's two
BottomRight diagonals differ, and the window exists only in the kernel with Sk - Sq); head counts
where Hkv does not provably divide Hq. ``w <= 0`` is no window (flash reads left = w - 1 < 0 as
unbounded).
"""

from __future__ import annotations

import math

from tvm import relax, sym, tirx
from tvm.relax.op.grad import no_grad

from .. import op
from ..op.nn_attention import flash_options
from .common import composition_vjp

R = relax.op


def _static(dim):
    """A dim as an int where it is a constant, else the PrimExpr."""
    return int(dim) if isinstance(dim, tirx.IntImm) else dim


def _dims(x: relax.Expr) -> list:
    return [_static(d) for d in x.ty.shape.values]


def _provably(cond) -> bool:
    return bool(cond) if isinstance(cond, bool) else sym.Analyzer().can_prove(cond)


def _window(call: relax.Call) -> int | None:
    """The window w >= 1 that bounds the keys on the left, or None (w <= 0 or none)."""
    w = call.attrs.window_size
    return None if w is None or int(w) <= 0 else int(w)


def _groups(call: relax.Call) -> tuple[int, int] | None:
    """How many query heads share each k head and each v head (GQA), or None where that is not
    a provable whole number."""
    hq, hk, hv = (_dims(x)[2] for x in call.args[:3])
    groups = []
    for h in (hk, hv):
        if isinstance(hq, int) and isinstance(h, int):
            if h <= 0 or hq % h:
                return None
            groups.append(hq // h)
        elif sym.Analyzer().can_prove_equal(hq, h):
            groups.append(1)
        else:
            return None
    return groups[0], groups[1]


def _refusal(call: relax.Call) -> str | None:
    """Why TVM defines no forward for this call, or None."""
    dtypes = [str(x.ty.dtype) for x in call.args[:3]]
    if len(set(dtypes)) != 1:
        return f"q, k, v have different dtypes {dtypes}"
    mask = call.attrs.causal_mask
    if mask not in (None, "TopLeft", "BottomRight"):
        return f"causal_mask {mask!r} is none of None, 'TopLeft', 'BottomRight'"
    if _groups(call) is None:
        return "the query heads are not provably a multiple of the key and value heads"
    if call.attrs.window_size is not None and mask != "BottomRight":
        return "window_size is defined only with causal_mask='BottomRight'"
    sq, sk = _dims(call.args[0])[1], _dims(call.args[1])[1]
    if _window(call) is not None and not _provably(sq <= sk):
        return ("window_size with Sq <= Sk not provable: TVM's BottomRight diagonal is |Sq - Sk| "
                "and its windowed kernel's Sk - Sq")
    return None


def _ones_along(x: relax.Expr, axis: int, dtype: str) -> relax.Expr:
    """Ones of ``x``'s size along ``axis`` (4-D, unit dims elsewhere): built from ``x`` itself, as
    Relax's Gradient fails ("key is not in Map") on a function whose call arguments (a shape, a
    PrimValue) hold symbolic sizes."""
    return R.ones_like(R.sum(x, axis=[a for a in range(4) if a != axis], keepdims=True), dtype)


def _masked(call: relax.Call, qh, kt, logits: relax.Expr, dtype: str) -> relax.Expr:
    """``logits`` [B, H, Sq, Sk] with -inf at the keys the causal mask / window drops (unchanged
    without one); the key-minus-query index j - i from exclusive cumulative sums of ones."""
    mask = call.attrs.causal_mask
    if mask is None:
        return logits
    rows, cols = _ones_along(qh, 2, "int64"), _ones_along(kt, 3, "int64")  # [1, 1, Sq, 1], [1, 1, 1, Sk]
    rel = R.subtract(R.cumsum(cols, axis=3, exclusive=True), R.cumsum(rows, axis=2, exclusive=True))
    if mask == "TopLeft":
        hi = relax.const(0, "int64")
    else:  # |Sq - Sk|: the legalization's tril offset
        hi = R.abs(R.subtract(R.sum(rows, axis=[2], keepdims=True), R.sum(cols, axis=[3], keepdims=True)))
    dropped = relax.const(-math.inf, dtype)
    logits = R.where(R.less_equal(rel, hi), logits, dropped)
    w = _window(call)
    if w is not None:
        logits = R.where(R.greater_equal(rel, R.subtract(hi, relax.const(w - 1, "int64"))), logits, dropped)
    return logits


def _forward(call: relax.Call, q, k, v, bias=None) -> relax.Expr:
    """The op as Relax primitives (bias already in q's dtype)."""
    emit = relax.BlockBuilder.current().emit  # (composition_vjp's): qh, kt are used twice
    dtype = str(q.ty.dtype)
    k_group, v_group = _groups(call)
    qh = emit(R.permute_dims(q, [0, 2, 1, 3]))  # [B, Hq, Sq, D]
    kt = R.permute_dims(k, [0, 2, 3, 1])  # [B, Hkv, D, Sk]
    vh = R.permute_dims(v, [0, 2, 1, 3])  # [B, Hkv, Sk, Dv]
    if k_group > 1:
        kt = R.repeat(kt, k_group, axis=1)  # query head h reads kv head h // group
    if v_group > 1:
        vh = R.repeat(vh, v_group, axis=1)
    kt = emit(kt)
    logits = R.matmul(qh, kt)
    if call.attrs.scale is not None:
        logits = R.multiply(logits, relax.const(float(call.attrs.scale.value), dtype))
    else:  # divided, as the legalization does
        d = _dims(call.args[0])[3]
        if isinstance(d, int):
            root = relax.const(math.sqrt(d), dtype)
        else:  # a symbolic D: a sum of D ones (see _ones_along)
            root = R.sqrt(R.sum(_ones_along(qh, 3, dtype), axis=[3], keepdims=True))
        logits = R.divide(logits, root)
    if bias is not None:
        logits = R.add(logits, bias)
    weights = R.nn.softmax(_masked(call, qh, kt, logits, dtype), axis=-1)
    return R.permute_dims(R.matmul(weights, vh), [0, 2, 1, 3])  # [B, Sq, Hq, Dv]


def _attention_gradient(orig_var, orig_call, output_grad, ctx):
    bias = orig_call.args[3] if len(orig_call.args) > 3 else None
    options = flash_options(orig_call)
    if options is not None:
        heads_first = lambda x: R.permute_dims(x, [0, 2, 1, 3])  # noqa: E731 ([B, S, H, D] <-> [B, H, S, D])
        q, k, v = (heads_first(x) for x in orig_call.args[:3])
        grads = ctx.emit(op.flash_attn_backward(q, k, v, heads_first(output_grad), None, bias,
                                                out=heads_first(orig_var), **options))
        result = [heads_first(relax.TupleGetItem(grads, i)) for i in range(3)]
    else:
        reason = _refusal(orig_call)
        if reason is not None:
            raise ValueError(f"{orig_call.op.name}: no gradient for this call: {reason}")
        args = list(orig_call.args[:3])
        if bias is not None:  # cast outside the composition: Gradient differentiates float params only
            dtype = str(args[0].ty.dtype)
            args.append(bias if str(bias.ty.dtype) == dtype else ctx.emit(R.astype(bias, dtype)))
        result = composition_vjp(ctx, lambda *a: [_forward(orig_call, *a)], args, [output_grad])[:3]
    return result + ([no_grad(bias)] if bias is not None else [])


GRADIENTS = {
    "relax.nn.attention": _attention_gradient,
    "relax.nn.attention_bias": _attention_gradient,
}
