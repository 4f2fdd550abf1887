"""numpy references of every fuel op: the math definition, float64 inside, no TVM.

These are the oracle of the test suite; they share no code with the TE decomposition or the
kernels. Inputs may be float32, float16 or bfloat16 (ml_dtypes) arrays; outputs are float64
(``lse`` too), so callers compare in the precision they choose.

Non-finite inputs follow the NaN rule (``tvm_fuel.semantics``): a NaN or Inf a row uses reaches
it; a weight of exactly 0 (a dropped key) never multiplies anything into a sum, and a ``-inf``
additive mask drops its key whatever the score.

Contents:
    flash_attn, flash_attn_backward, paged_attn, gather_pages, softmax_backward, visible_keys
"""

from __future__ import annotations

import math

import numpy as np


def _f64(x):
    return None if x is None else np.asarray(x).astype(np.float64)


def visible_keys(sq: int, sk: int, kv_len: int | None = None, *, causal=False, window_size=(-1, -1)) -> np.ndarray:
    """Bool [sq, sk]: key j visible to query i (bottom-right aligned, ``kv_len`` valid keys)."""
    kv_len = sk if kv_len is None else kv_len
    left, right = window_size[0], 0 if causal else window_size[1]
    i = np.arange(sq)[:, None] + (kv_len - sq)  # absolute position of query i
    j = np.arange(sk)[None, :]
    keep = np.broadcast_to(j < kv_len, (sq, sk))
    if left >= 0:
        keep = keep & (j >= i - left)
    if right >= 0:
        keep = keep & (j <= i + right)
    return keep


def _logits(q, k, alibi_slopes, attn_mask, softmax_scale, causal, window_size, softcap, kv_len=None):
    """(capped logits, final logits with -inf at dropped keys), both [B, Hq, Sq, Sk] float64."""
    B, Hq, Sq, D = q.shape
    Hkv, Sk = k.shape[1], k.shape[2]
    k = np.repeat(_f64(k), Hq // Hkv, axis=1)  # GQA: query head h reads kv head h // group
    scale = 1.0 / math.sqrt(D) if softmax_scale is None else softmax_scale
    s = scale * np.einsum("bhid,bhjd->bhij", _f64(q), k)
    capped = softcap * np.tanh(s / softcap) if softcap > 0 else s
    kv_len = Sk if kv_len is None else kv_len
    logits = capped.copy()
    if alibi_slopes is not None:
        distance = np.abs(np.arange(Sq)[:, None] + (kv_len - Sq) - np.arange(Sk)[None, :])
        logits = logits - _f64(alibi_slopes)[None, :, None, None] * distance
    keep = np.broadcast_to(visible_keys(Sq, Sk, kv_len, causal=causal, window_size=window_size), logits.shape)
    if attn_mask is not None:
        mask = np.asarray(attn_mask)
        if mask.dtype == np.bool_:
            keep = keep & np.broadcast_to(mask, logits.shape)
        else:
            additive = np.broadcast_to(_f64(mask), logits.shape)
            keep = keep & ~np.isneginf(additive)  # a -inf entry drops the key, even a NaN score
            logits = logits + additive
    return capped, np.where(keep, logits, -np.inf)


def _softmax(logits):
    """(P, lse) with P = 0 and lse = -inf on rows that keep no key; a NaN logit makes its row NaN."""
    with np.errstate(invalid="ignore"):
        row_max = logits.max(axis=-1, keepdims=True)  # NaN when the row holds one
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
        out = np.einsum("bhij,bhjd->bhid", w, np.where(finite, x, 0.0))
        for b, h, j, d in zip(*np.nonzero(~finite)):
            rows = w[b, h, :, j] != 0
            out[b, h, rows, d] += w[b, h, rows, j] * x[b, h, j, d]
    return out


def _transposed(w):
    return np.swapaxes(w, -1, -2)


def flash_attn(q, k, v, alibi_slopes=None, attn_mask=None, *, softmax_scale=None, causal=False,
               window_size=(-1, -1), softcap=0.0, return_lse=False):
    """out [B, Hq, Sq, D] (and lse [B, Hq, Sq]) in float64; see ``tvm_fuel.op.flash_attn``."""
    _, logits = _logits(q, k, alibi_slopes, attn_mask, softmax_scale, causal, window_size, softcap)
    p, lse = _softmax(logits)
    out = _weighted_sum(p, np.repeat(_f64(v), q.shape[1] // v.shape[1], axis=1))
    return (out, lse) if return_lse else out


def flash_attn_backward(q, k, v, do, alibi_slopes=None, attn_mask=None, *, softmax_scale=None, causal=False,
                        window_size=(-1, -1), softcap=0.0):
    """(dq, dk, dv) in float64 for the loss ``sum(out * do)``; masks and ALiBi are constants."""
    B, Hq, Sq, D = q.shape
    Hkv = k.shape[1]
    group = Hq // Hkv
    scale = 1.0 / math.sqrt(D) if softmax_scale is None else softmax_scale
    capped, logits = _logits(q, k, alibi_slopes, attn_mask, softmax_scale, causal, window_size, softcap)
    p, _ = _softmax(logits)
    kr, vr, do = np.repeat(_f64(k), group, axis=1), np.repeat(_f64(v), group, axis=1), _f64(do)
    with np.errstate(invalid="ignore"):
        dv = _weighted_sum(_transposed(p), do)
        dp = np.einsum("bhid,bhjd->bhij", do, vr)
        p_dp = np.where(p == 0, 0.0, p * dp)
        ds = p * (dp - p_dp.sum(axis=-1, keepdims=True))  # softmax backward
        if softcap > 0:
            ds = ds * (1.0 - (capped / softcap) ** 2)  # d/ds [c tanh(s/c)] = 1 - tanh^2
        ds = np.where(p == 0, 0.0, ds)  # a dropped key's dP or capped score may be NaN
        dq = scale * _weighted_sum(ds, kr)
        dk = scale * _weighted_sum(_transposed(ds), _f64(q))

    def per_kv_head(x):  # sum the query heads of each GQA group
        return x.reshape(B, Hkv, group, *x.shape[2:]).sum(axis=2)

    return dq, per_kv_head(dk), per_kv_head(dv)


def gather_pages(cache, block_table_row, kv_len: int) -> np.ndarray:
    """Token by token (vLLM's reference): cache [num_blocks, block_size, Hkv, D] -> [Hkv, kv_len, D]."""
    block_size = cache.shape[1]
    tokens = [cache[int(block_table_row[t // block_size]), t % block_size] for t in range(kv_len)]
    if not tokens:
        return np.zeros((cache.shape[2], 0, cache.shape[3]), cache.dtype)
    return np.stack(tokens, axis=1)


def paged_attn(q, k_cache, v_cache, block_table, context_lens, alibi_slopes=None, *, softmax_scale=None,
               causal=False, window_size=(-1, -1), softcap=0.0):
    """out [B, Hq, Sq, D] float64: each sequence's queries are the last Sq of its context."""
    B, Hq, Sq, D = q.shape
    out = np.zeros((B, Hq, Sq, D))
    for b in range(B):
        kv_len = int(context_lens[b])
        if kv_len == 0:
            continue  # no key: every row is empty
        k = gather_pages(k_cache, block_table[b], kv_len)[None]
        v = gather_pages(v_cache, block_table[b], kv_len)[None]
        out[b] = flash_attn(q[b:b + 1], k, v, alibi_slopes, softmax_scale=softmax_scale, causal=causal,
                            window_size=window_size, softcap=softcap)[0]
    return out


def softmax_backward(probs, dprobs, *, axis: int = -1):
    """``probs * (dprobs - sum(probs * dprobs, axis))`` in float64."""
    p, dp = _f64(probs), _f64(dprobs)
    return p * (dp - (p * dp).sum(axis=axis, keepdims=True))
