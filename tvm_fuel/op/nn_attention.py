"""What TVM's ``R.nn.attention`` means in ``flash_attn``'s terms.

``R.nn.attention(q, k, v[, bias], scale, causal_mask, window_size)`` is what TVM's PyTorch
importers make of ``scaled_dot_product_attention`` ([B, S, H, D] layout). ``FuseAttention``
replaces it by ``flash_attn``, and its registered gradient (``tvm_fuel.autodiff``) runs
``flash_attn_backward``, wherever the two say the same thing exactly: here is the one place that
decides where that is.

Contents:
    static_dims       -- a tensor's dims (None where one is symbolic)
    flash_options     -- flash_attn's options for an R.nn.attention call, or None
    band_options      -- flash_attn's options for "query i keeps the keys i + lo <= j <= i + hi", or None
"""

from __future__ import annotations

import tvm
from tvm import relax

from .config import FLOAT_DTYPES, finite_nonzero_float32


def static_dims(expr: relax.Expr) -> list[int | None]:
    """A tensor's dims, None where one is not a constant (all of them where the shape is unknown; one
    where the rank is too)."""
    shape = expr.ty.shape
    if not isinstance(shape, relax.ShapeExpr):
        return [None] * max(expr.ty.ndim, 1)
    return [int(d) if isinstance(d, tvm.tirx.IntImm) else None for d in shape.values]


def flash_options(call: relax.Call) -> dict | None:
    """``flash_attn``'s options for an ``R.nn.attention`` / ``attention_bias`` call, or None where
    no options say exactly what it does (TVM's own sliding window, an odd bias, a top-left causal
    mask the bottom-right window cannot express, a scale float32 cannot hold)."""
    q, k, v = (static_dims(x) for x in call.args[:3])
    if call.attrs.window_size is not None or len(q) != 4 or q[3] is None or q[3] != k[3] or k[3] != v[3]:
        return None  # its sliding window is TVM's own convention; and out's head dim must be q's
    if len(call.args) > 3 and (len(static_dims(call.args[3])) != 4
                               or str(call.args[3].ty.dtype) not in FLOAT_DTYPES):
        return None
    scale = None if call.attrs.scale is None else float(call.attrs.scale.value)
    if scale is not None and not finite_nonzero_float32(scale):
        return None  # the kernels scale the logits in float32
    if str(call.args[0].ty.dtype) not in FLOAT_DTYPES:
        return None  # (float64: flash_attn's dtypes are float32, float16, bfloat16)
    options = dict(softmax_scale=scale)
    mask, sq, sk = call.attrs.causal_mask, q[1], k[1]
    if mask == "BottomRight":
        # TVM's "BottomRight" keeps j <= i + |Sq - Sk|: fuel's bottom-right causal where Sq <= Sk,
        # a window above the diagonal where there are more queries than keys
        lengths = [x.ty.shape.values[1] for x in call.args[:2]]
        if tvm.sym.Analyzer().can_prove(lengths[0] <= lengths[1]):
            options["causal"] = True
        elif sq is not None and sk is not None:
            options.update(band_options(sq, sk, None, abs(sq - sk)))
        else:
            return None
    elif mask == "TopLeft":
        causal = None if sq is None or sk is None else band_options(sq, sk, None, 0)
        if causal is None:
            return None
        options.update(causal)
    elif mask is not None:
        return None
    return options


def band_options(sq: int, sk: int, lo: int | None, hi: int | None) -> dict | None:
    """flash_attn's options for "query i keeps the keys i + lo <= j <= i + hi" (None: unbounded on
    that side; hi 0 alone is top-left causal), or None where no (left, right) window around fuel's
    bottom-right diagonal j = i + Sk - Sq says it (top-left causal with more keys than queries)."""
    delta = sk - sq
    right = -1 if hi is None else hi - delta
    left = -1 if lo is None else delta - lo
    if (hi is not None and right < 0) or (lo is not None and left < 0):
        return None
    if right == 0:
        return dict(causal=True) if left == -1 else dict(causal=True, window_size=(left, -1))
    return dict(window_size=(left, right))


__all__ = ["static_dims", "flash_options", "band_options"]
