"""numpy references of every fuel op: the math definition, float64 inside, no TVM.

These are the oracle of the test suite; they share no code with the TE decomposition or the
kernels. Inputs may be float32, float16 or bfloat16 (ml_dtypes) arrays; outputs are float64
(``lse`` too), so callers compare in the precision they choose.

Non-finite inputs follow the NaN rule (``tvm_fuel.op.semantics``): a NaN or Inf a row uses reaches
it; a weight of exactly 0 (a dropped key) never multiplies anything into a sum, and a ``-inf``
additive mask drops its key whatever the score.

Contents:
    flash_attn, flash_attn_backward, paged_attn, gather_pages, softmax_backward, visible_keys,
    layer_norm_backward, rms_norm_backward
    dequantize, quantize_fp8, quantize_int8 -- 8-bit KV caches (fp8 with a per-cache or per-head
        scale, int8 with a scale per token and head)
    flash_attn_jvp, flash_attn_double_backward -- forward mode and the backward's VJP (issue 16)
    flash_attn_varlen, flash_attn_varlen_backward -- packed variable-length batches (cu_seqlens)

Sink tokens (``sink_tokens = n``, StreamingLLM's): keys ``j < n`` stay visible past the window's
left bound (``visible_keys``).

Sinks (``sinks [Hq]``, gpt-oss's learned logits): one more column in each row's softmax holding
``sinks[h]`` as it is (not scaled, capped or masked), that weighs no value. A row keeping no key
then gives 0 and ``lse = sinks[h]``; its gradient is ``-sum_i exp(sinks[h] - lse_i) * rowsum(do_i * out_i)``.
"""

from __future__ import annotations

import math

import numpy as np


def _f64(x):
    return None if x is None else np.asarray(x).astype(np.float64)


# The contractions go through matmul (BLAS): np.einsum without ``optimize`` loops in C on its own, 17x
# slower at Sq = Sk = 1024 (0.71 s against 0.04 s a product), which made the reference most of a
# long-sequence test's time.
def _dots(a, b):
    """``a [..., i, d]`` and ``b [..., j, d]`` -> ``[..., i, j]``: each row of a dotted with each row of b."""
    return a @ np.swapaxes(b, -1, -2)


def _transposed(w):
    return np.swapaxes(w, -1, -2)


def visible_keys(sq: int, sk: int, kv_len: int | None = None, *, causal=False, window_size=(-1, -1),
                 sink_tokens: int = 0) -> np.ndarray:
    """Bool [sq, sk]: key j visible to query i (bottom-right aligned, ``kv_len`` valid keys; keys
    ``j < sink_tokens`` past the window's left bound)."""
    kv_len = sk if kv_len is None else kv_len
    left, right = window_size[0], 0 if causal else window_size[1]
    i = np.arange(sq)[:, None] + (kv_len - sq)  # absolute position of query i
    j = np.arange(sk)[None, :]
    keep = np.broadcast_to(j < kv_len, (sq, sk))
    if left >= 0:
        keep = keep & ((j >= i - left) | (j < sink_tokens))
    if right >= 0:
        keep = keep & (j <= i + right)
    return keep


def _logits(q, k, alibi_slopes, attn_mask, softmax_scale, causal, window_size, softcap, kv_len=None, sink_tokens=0):
    """(capped logits, final logits with -inf at dropped keys), both [B, Hq, Sq, Sk] float64."""
    B, Hq, Sq, D = q.shape
    Hkv, Sk = k.shape[1], k.shape[2]
    k = np.repeat(_f64(k), Hq // Hkv, axis=1)  # GQA: query head h reads kv head h // group
    scale = 1.0 / math.sqrt(D) if softmax_scale is None else softmax_scale
    s = scale * _dots(_f64(q), k)
    capped = softcap * np.tanh(s / softcap) if softcap > 0 else s
    kv_len = Sk if kv_len is None else kv_len
    logits = capped.copy()
    if alibi_slopes is not None:
        distance = np.abs(np.arange(Sq)[:, None] + (kv_len - Sq) - np.arange(Sk)[None, :])
        logits = logits - _f64(alibi_slopes)[None, :, None, None] * distance
    keep = np.broadcast_to(visible_keys(Sq, Sk, kv_len, causal=causal, window_size=window_size,
                                        sink_tokens=sink_tokens), logits.shape)
    if attn_mask is not None:
        mask = np.asarray(attn_mask)
        if mask.dtype == np.bool_:
            keep = keep & np.broadcast_to(mask, logits.shape)
        else:
            additive = np.broadcast_to(_f64(mask), logits.shape)
            keep = keep & ~np.isneginf(additive)  # a -inf entry drops the key, even a NaN score
            # bounded to +-2^127 (semantics.add_mask): finfo(float32).min weighs a key down, not out
            logits = logits + np.clip(additive, -2.0 ** 127, 2.0 ** 127)
    return capped, np.where(keep, logits, -np.inf)


def _softmax(logits, sinks=None):
    """(P, lse) with P = 0 and lse = -inf on rows that keep no key; a NaN logit makes its row NaN.
    With ``sinks`` ([Hq]) each row's softmax has one more column, sinks[h], dropped from P."""
    if sinks is not None:
        sink = np.broadcast_to(_f64(sinks)[None, :, None, None], logits.shape[:-1] + (1,))
        p, lse = _softmax(np.concatenate([logits, sink], axis=-1))
        return p[..., :-1], lse
    with np.errstate(invalid="ignore"):
        # NaN when the row holds one; -inf for a row of no keys at all (Sk = 0), like a masked row
        row_max = logits.max(axis=-1, keepdims=True, initial=-np.inf)
        shift = np.where(np.isneginf(row_max), 0.0, row_max)
        # a dropped key weighs exactly 0, even in a row whose shift is NaN (exp(-inf - NaN) is NaN)
        e = np.where(np.isneginf(logits), 0.0, np.exp(logits - shift))
        total = e.sum(axis=-1, keepdims=True)
    with np.errstate(divide="ignore", invalid="ignore"):
        p = np.where(np.isneginf(logits) | (total == 0), 0.0, e / total)
        lse = np.where(total == 0, -np.inf, shift + np.log(total))[..., 0]
    return p, lse


def _weighted_sum(w, x):
    """``out[b, h, i, d] = sum_j w[b, h, i, j] * x[b, h, j, d]`` where a weight of exactly 0 skips
    its term (so a NaN or Inf in ``x`` reaches only the rows that weigh it)."""
    finite = np.isfinite(x)
    with np.errstate(invalid="ignore"):
        out = w @ np.where(finite, x, 0.0)
        for b, h, j, d in zip(*np.nonzero(~finite)):
            rows = w[b, h, :, j] != 0
            out[b, h, rows, d] += w[b, h, rows, j] * x[b, h, j, d]
    return out


def flash_attn(q, k, v, alibi_slopes=None, attn_mask=None, *, softmax_scale=None, causal=False,
               window_size=(-1, -1), softcap=0.0, sinks=None, return_lse=False, sink_tokens=0):
    """out [B, Hq, Sq, D] (and lse [B, Hq, Sq]) in float64; see ``tvm_fuel.op.flash_attn``;
    ``sinks`` [Hq]: see the module's docstring."""
    _, logits = _logits(q, k, alibi_slopes, attn_mask, softmax_scale, causal, window_size, softcap,
                        sink_tokens=sink_tokens)
    p, lse = _softmax(logits, sinks)
    out = _weighted_sum(p, np.repeat(_f64(v), q.shape[1] // v.shape[1], axis=1))
    return (out, lse) if return_lse else out


def flash_attn_backward(q, k, v, do, alibi_slopes=None, attn_mask=None, *, softmax_scale=None, causal=False,
                        window_size=(-1, -1), softcap=0.0, sinks=None, sink_tokens=0):
    """(dq, dk, dv) in float64 for the loss ``sum(out * do)``; masks and ALiBi are constants. With
    ``sinks``, (dq, dk, dv, dsinks), dsinks [Hq]."""
    B, Hq, Sq, D = q.shape
    Hkv = k.shape[1]
    group = Hq // Hkv
    scale = 1.0 / math.sqrt(D) if softmax_scale is None else softmax_scale
    capped, logits = _logits(q, k, alibi_slopes, attn_mask, softmax_scale, causal, window_size, softcap,
                        sink_tokens=sink_tokens)
    p, lse = _softmax(logits, sinks)
    kr, vr, do = np.repeat(_f64(k), group, axis=1), np.repeat(_f64(v), group, axis=1), _f64(do)
    with np.errstate(invalid="ignore"):
        dv = _weighted_sum(_transposed(p), do)
        dp = _dots(do, vr)
        p_dp = np.where(p == 0, 0.0, p * dp)
        ds = p * (dp - p_dp.sum(axis=-1, keepdims=True))  # softmax backward
        if softcap > 0:
            ds = ds * (1.0 - (capped / softcap) ** 2)  # d/ds [c tanh(s/c)] = 1 - tanh^2
        ds = np.where(p == 0, 0.0, ds)  # a dropped key's dP or capped score may be NaN
        dq = scale * _weighted_sum(ds, kr)
        dk = scale * _weighted_sum(_transposed(ds), _f64(q))

    def per_kv_head(x):  # sum the query heads of each GQA group
        return x.reshape(B, Hkv, group, *x.shape[2:]).sum(axis=2)

    if sinks is None:
        return dq, per_kv_head(dk), per_kv_head(dv)
    # the sink column's dP is 0 (it weighs no value): its dS is -P_sink * rowsum(P * dP)
    p_sink = np.exp(_f64(sinks)[None, :, None] - lse)
    dsinks = -(p_sink * p_dp.sum(axis=-1)).sum(axis=(0, 2))
    return dq, per_kv_head(dk), per_kv_head(dv), dsinks


def _zeros_or(x, like):
    return np.zeros(np.shape(like)) if x is None else _f64(x)


def _tangents(q, k, v, q_dot, k_dot, v_dot, alibi_slopes, attn_mask, softmax_scale, causal, window_size,
              softcap, sink_tokens=0) -> dict:
    """The forward's values and their directional derivatives along (q_dot, k_dot, v_dot), per
    query head (K, V and their tangents repeated over the GQA group), float64, finite inputs.

    A dropped key has no logit tangent; a fully masked row keeps P = 0, out = 0 and its tangents 0.
    """
    Hq, D = q.shape[1], q.shape[3]
    group = Hq // k.shape[1]
    scale = 1.0 / math.sqrt(D) if softmax_scale is None else softmax_scale
    capped, logits = _logits(q, k, alibi_slopes, attn_mask, softmax_scale, causal, window_size, softcap,
                        sink_tokens=sink_tokens)
    p, lse = _softmax(logits)
    kr, vr = np.repeat(_f64(k), group, axis=1), np.repeat(_f64(v), group, axis=1)
    kr_dot, vr_dot = np.repeat(_zeros_or(k_dot, k), group, axis=1), np.repeat(_zeros_or(v_dot, v), group, axis=1)
    s_dot = scale * (_dots(_zeros_or(q_dot, q), kr) + _dots(_f64(q), kr_dot))
    slope = 1.0 - (capped / softcap) ** 2 if softcap > 0 else np.ones_like(capped)  # d capped / d s
    capped_dot = slope * s_dot
    logit_dot = np.where(p == 0, 0.0, capped_dot)  # ALiBi and masks are constants
    lse_dot = (p * logit_dot).sum(axis=-1, keepdims=True)
    p_dot = p * (logit_dot - lse_dot)
    out = p @ vr
    out_dot = p_dot @ vr + p @ vr_dot
    return dict(scale=scale, group=group, capped=capped, capped_dot=capped_dot, slope=slope, p=p, p_dot=p_dot,
                lse=lse, lse_dot=lse_dot[..., 0], out=out, out_dot=out_dot, kr=kr, vr=vr, kr_dot=kr_dot,
                vr_dot=vr_dot)


def flash_attn_jvp(q, k, v, q_dot, k_dot, v_dot, alibi_slopes=None, attn_mask=None, *, softmax_scale=None,
                   causal=False, window_size=(-1, -1), softcap=0.0, return_lse=False, sink_tokens=0):
    """Forward mode: (out, out_dot[, lse]) float64, ``out_dot`` the derivative of ``flash_attn``'s
    out along (q_dot [B, Hq, Sq, D], k_dot, v_dot [B, Hkv, Sk, D]; None counts as 0). Finite
    inputs (the NaN rule is not modelled for tangents)."""
    t = _tangents(q, k, v, q_dot, k_dot, v_dot, alibi_slopes, attn_mask, softmax_scale, causal, window_size,
                  softcap, sink_tokens)
    return (t["out"], t["out_dot"], t["lse"]) if return_lse else (t["out"], t["out_dot"])


def flash_attn_double_backward(q, k, v, do, dq_bar=None, dk_bar=None, dv_bar=None, alibi_slopes=None,
                               attn_mask=None, *, softmax_scale=None, causal=False, window_size=(-1, -1),
                               softcap=0.0, sink_tokens=0):
    """(q_grad, k_grad, v_grad, do_grad) float64: the vector-Jacobian product of
    ``(dq, dk, dv) = flash_attn_backward(q, k, v, do)`` with cotangents (dq_bar [B, Hq, Sq, D],
    dk_bar, dv_bar [B, Hkv, Sk, D]; None counts as 0). Finite inputs.

    The backward is the gradient of L = sum(out * do), so its VJP in (q, k, v) is the Hessian of
    L times the cotangents (symmetric): the backward's derivative along (dq_bar, dk_bar, dv_bar)
    with do held; in do it is the forward's derivative along the same direction (out_dot).
    """
    B, Hkv = q.shape[0], k.shape[1]
    t = _tangents(q, k, v, dq_bar, dk_bar, dv_bar, alibi_slopes, attn_mask, softmax_scale, causal, window_size,
                  softcap, sink_tokens)
    p, p_dot, scale, slope = t["p"], t["p_dot"], t["scale"], t["slope"]
    q64, q_bar, do = _f64(q), _zeros_or(dq_bar, q), _f64(do)
    dp = _dots(do, t["vr"])
    dp_dot = _dots(do, t["vr_dot"])
    row = (p * dp).sum(axis=-1, keepdims=True)  # D = rowsum(dO * O)
    row_dot = (p_dot * dp + p * dp_dot).sum(axis=-1, keepdims=True)
    d_logits = p * (dp - row)
    d_logits_dot = p_dot * (dp - row) + p * (dp_dot - row_dot)
    # softcap: ds = dlogits * (1 - (capped / c)^2), whose derivative brings -2 capped capped_dot / c^2
    slope_dot = -2.0 * t["capped"] * t["capped_dot"] / softcap ** 2 if softcap > 0 else 0.0
    ds = d_logits * slope
    ds_dot = np.where(p == 0, 0.0, d_logits_dot * slope + d_logits * slope_dot)
    q_grad = scale * (ds_dot @ t["kr"] + ds @ t["kr_dot"])
    k_grad = scale * (_transposed(ds_dot) @ q64 + _transposed(ds) @ q_bar)
    v_grad = _transposed(p_dot) @ do

    def per_kv_head(x):  # sum the query heads of each GQA group
        return x.reshape(B, Hkv, t["group"], *x.shape[2:]).sum(axis=2)

    return q_grad, per_kv_head(k_grad), per_kv_head(v_grad), t["out_dot"]


def gather_pages(cache, block_table_row, kv_len: int) -> np.ndarray:
    """Token by token (vLLM's reference): cache [num_blocks, block_size, Hkv, D] -> [Hkv, kv_len, D]."""
    block_size = cache.shape[1]
    tokens = [cache[int(block_table_row[t // block_size]), t % block_size] for t in range(kv_len)]
    if not tokens:
        return np.zeros((cache.shape[2], 0, cache.shape[3]), cache.dtype)
    return np.stack(tokens, axis=1)


def dequantize(cache, scale=None) -> np.ndarray:
    """A cache's float64 values: an 8-bit cache [num_blocks, block_size, Hkv, D] times its scale
    (fp8: a scalar or [Hkv]; int8: [num_blocks, block_size, Hkv]); any other cache as it is."""
    values = _f64(cache)  # ml_dtypes' float8 -> float64 is exact
    if scale is None:
        return values
    scale = _f64(scale)
    return values * (scale[..., None] if scale.ndim == 3 else scale.reshape(scale.shape + (1,)))


_FP8_MAX = {"float8_e4m3fn": 448.0, "float8_e5m2": 57344.0}


def quantize_fp8(x, dtype: str, scale=1.0) -> np.ndarray:
    """x [..., Hkv, D] as a ``dtype`` (float8_e4m3fn / float8_e5m2) cache of ``scale`` (a scalar or
    [Hkv]): ``x / scale`` rounded to nearest even, saturated to the format's largest finite value;
    NaN stays NaN."""
    import ml_dtypes

    scaled = _f64(x) / np.asarray(scale, np.float64).reshape(np.shape(scale) + (1,))
    # float32 first: the kernels divide in float32, then round once to the 8-bit format
    limit = _FP8_MAX[dtype]
    return np.clip(scaled.astype(np.float32), -limit, limit).astype(getattr(ml_dtypes, dtype))


def quantize_int8(x) -> tuple[np.ndarray, np.ndarray]:
    """x [..., Hkv, D] as an int8 cache and its float32 scales [..., Hkv]: each (token, head) row
    scaled by max |x| / 127, rounded to nearest even (a zero row: scale 0, codes 0; a row holding
    NaN or Inf: scale NaN or Inf, codes 0, so it reads back NaN)."""
    x = np.asarray(x).astype(np.float32)
    scale = (np.abs(x).max(axis=-1) * np.float32(1.0 / 127)).astype(np.float32)
    with np.errstate(divide="ignore", invalid="ignore"):
        codes = np.where(scale[..., None] > 0, x / scale[..., None], 0)
    codes = np.where(np.isnan(codes), 0, codes)  # a NaN or Inf row: codes 0, its scale NaN or Inf
    return np.clip(np.rint(codes), -127, 127).astype(np.int8), scale


def paged_attn(q, k_cache, v_cache, block_table, context_lens, alibi_slopes=None, *, softmax_scale=None,
               causal=False, window_size=(-1, -1), softcap=0.0, sinks=None, sink_tokens=0, k_scale=None,
               v_scale=None):
    """out [B, Hq, Sq, D] float64: each sequence's queries are the last Sq of its context. A
    quantized cache reads as ``dequantize(cache, scale)``."""
    k_cache, v_cache = dequantize(k_cache, k_scale), dequantize(v_cache, v_scale)
    B, Hq, Sq, D = q.shape
    out = np.zeros((B, Hq, Sq, D))
    for b in range(B):
        kv_len = int(context_lens[b])
        if kv_len == 0:
            continue  # no key: every row is empty
        k = gather_pages(k_cache, block_table[b], kv_len)[None]
        v = gather_pages(v_cache, block_table[b], kv_len)[None]
        out[b] = flash_attn(q[b:b + 1], k, v, alibi_slopes, softmax_scale=softmax_scale, causal=causal,
                            window_size=window_size, softcap=softcap, sinks=sinks, sink_tokens=sink_tokens)[0]
    return out


def _sequences(cu_seqlens_q, cu_seqlens_k):
    """(slice of q rows, slice of k rows) of each sequence of a packed batch."""
    cq, ck = (np.asarray(c).astype(np.int64) for c in (cu_seqlens_q, cu_seqlens_k))
    assert cq.shape == ck.shape and cq.ndim == 1, "cu_seqlens_q and cu_seqlens_k must both be [B + 1]"
    return [(slice(cq[b], cq[b + 1]), slice(ck[b], ck[b + 1])) for b in range(len(cq) - 1)]


def _as_batch(x):
    """[S, H, D] rows of one sequence -> [1, H, S, D]."""
    return np.swapaxes(np.asarray(x), 0, 1)[None]


def flash_attn_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, alibi_slopes=None, *, softmax_scale=None, causal=False,
                      window_size=(-1, -1), softcap=0.0, sinks=None, sink_tokens=0, return_lse=False):
    """FlashAttention's packed layout: q [total_q, Hq, D], k, v [total_k, Hkv, D], sequence b at
    rows ``cu_seqlens[b]:cu_seqlens[b + 1]``; every option (causal bottom-right) per sequence.
    out [total_q, Hq, D] and lse [Hq, total_q], float64."""
    out = np.zeros(np.shape(q))
    lse = np.full((np.shape(q)[1], np.shape(q)[0]), -np.inf)
    for rows_q, rows_k in _sequences(cu_seqlens_q, cu_seqlens_k):
        o, l_ = flash_attn(_as_batch(q[rows_q]), _as_batch(k[rows_k]), _as_batch(v[rows_k]), alibi_slopes,
                           softmax_scale=softmax_scale, causal=causal, window_size=window_size, softcap=softcap,
                           sinks=sinks, sink_tokens=sink_tokens, return_lse=True)
        out[rows_q], lse[:, rows_q] = np.swapaxes(o[0], 0, 1), l_[0]
    return (out, lse) if return_lse else out


def flash_attn_varlen_backward(q, k, v, do, cu_seqlens_q, cu_seqlens_k, alibi_slopes=None, *, softmax_scale=None,
                               causal=False, window_size=(-1, -1), softcap=0.0, sinks=None, sink_tokens=0):
    """(dq, dk, dv) of ``flash_attn_varlen`` in its packed layout (and dsinks [Hq] with sinks)."""
    dq, dk, dv = np.zeros(np.shape(q)), np.zeros(np.shape(k)), np.zeros(np.shape(v))
    dsinks = None if sinks is None else np.zeros(np.shape(sinks))
    for rows_q, rows_k in _sequences(cu_seqlens_q, cu_seqlens_k):
        grads = flash_attn_backward(_as_batch(q[rows_q]), _as_batch(k[rows_k]), _as_batch(v[rows_k]),
                                    _as_batch(do[rows_q]), alibi_slopes, softmax_scale=softmax_scale, causal=causal,
                                    window_size=window_size, softcap=softcap, sinks=sinks, sink_tokens=sink_tokens)
        for packed, grad, rows in zip((dq, dk, dv), grads, (rows_q, rows_k, rows_k)):
            packed[rows] = np.swapaxes(grad[0], 0, 1)
        if sinks is not None:
            dsinks += grads[3]
    return (dq, dk, dv) if sinks is None else (dq, dk, dv, dsinks)


def softmax_backward(probs, dprobs, *, axis: int = -1):
    """``probs * (dprobs - sum(probs * dprobs, axis))`` in float64."""
    p, dp = _f64(probs), _f64(dprobs)
    return p * (dp - (p * dp).sum(axis=axis, keepdims=True))


def layer_norm_backward(dy, x, gamma, mean, rstd):
    """(dx, dgamma, dbeta) of layer norm over the rows of [N, C] arrays, in float64."""
    dy, x, gamma = _f64(dy), _f64(x), _f64(gamma)
    x_hat = (x - _f64(mean)[:, None]) * _f64(rstd)[:, None]
    g = dy * gamma
    dx = _f64(rstd)[:, None] * (g - g.mean(1, keepdims=True) - x_hat * (g * x_hat).mean(1, keepdims=True))
    return dx, (dy * x_hat).sum(0), dy.sum(0)


def rms_norm_backward(dy, x, weight, rstd):
    """(dx, dweight) of RMS norm over the rows of [N, C] arrays, in float64."""
    dy, x = _f64(dy), _f64(x)
    x_hat = x * _f64(rstd)[:, None]
    g = dy * _f64(weight)
    dx = _f64(rstd)[:, None] * (g - x_hat * (g * x_hat).mean(1, keepdims=True))
    return dx, (dy * x_hat).sum(0)
