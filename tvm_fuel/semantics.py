"""The attention semantics, written once on TIR expressions.

Every kernel of tvm_fuel -- the TE decomposition (the correctness floor) and the TensorIR kernels
of the performance path -- builds its masking, ALiBi, softcap, GQA head mapping and softmax
guards from these functions, so the ops cannot drift apart. ``tvm_fuel.reference`` restates the
same rules in numpy, independently, as the oracle.

For query row ``i`` and key ``j`` with ``delta = kv_len - Sq`` (the queries are the last ``Sq``
positions of the context, so the diagonal is aligned bottom-right):

1. ``s = scale * q_i . k_j``
2. ``softcap c > 0``: ``s = c * tanh(s / c)``
3. ``s += -slope_h * |i + delta - j|`` (ALiBi) and ``s += mask`` (additive mask)
4. keep ``(i, j)`` iff ``j < kv_len``, inside the window, and the boolean mask allows it
5. softmax over kept keys; a row without a kept key gives 0 and ``lse = -inf``.

Contents:
    kv_head, keep, softcap, softcap_grad, alibi_bias, masked, NEG_INF,
    safe_row_max, normalize, log_sum_exp, probability
"""

from __future__ import annotations

from tvm import te, tirx

from .config import AttnConfig

NEG_INF = tirx.const(float("-inf"), "float32")
_ZERO = tirx.const(0.0, "float32")


def as_int64(x):
    """Index arithmetic is done in int64 (Relax shapes are int64; lengths may arrive as int32)."""
    if isinstance(x, te.TensorSlice):  # t[i] in TE is a slice until converted
        x = x.asobject()
    return x if str(x.ty) == "int64" else x.astype("int64")


def kv_head(h, group):
    """GQA/MQA: query head ``h`` reads KV head ``h // group`` (group = Hq / Hkv)."""
    return tirx.floordiv(h, group)


def keep(cfg: AttnConfig, i, j, *, kv_len, delta):
    """Whether key ``j`` is visible to query row ``i`` under the length and window rules."""
    i, j, kv_len, delta = as_int64(i), as_int64(j), as_int64(kv_len), as_int64(delta)
    cond = j < kv_len
    diagonal = i + delta
    if cfg.window_left >= 0:
        cond = tirx.all(cond, j >= diagonal - cfg.window_left)
    if cfg.window_right >= 0:
        cond = tirx.all(cond, j <= diagonal + cfg.window_right)
    return cond


def softcap(cfg: AttnConfig, s):
    """``c * tanh(s / c)`` when ``cfg.softcap > 0``, else ``s`` (float32)."""
    if cfg.softcap <= 0:
        return s
    c = tirx.const(cfg.softcap, "float32")
    return c * te.tanh(s / c)


def softcap_grad(cfg: AttnConfig, capped):
    """d(capped)/d(s) expressed through the capped value: ``1 - (capped / c)^2``."""
    if cfg.softcap <= 0:
        return tirx.const(1.0, "float32")
    ratio = capped / tirx.const(cfg.softcap, "float32")
    return tirx.const(1.0, "float32") - ratio * ratio


def alibi_bias(slope, i, j, *, delta):
    """``-slope * |i + delta - j|``, the symmetric (FlashAttention) ALiBi bias."""
    distance = as_int64(i) + as_int64(delta) - as_int64(j)
    return -slope.astype("float32") * tirx.abs(distance).astype("float32")


def masked(visible, logit):
    """The logit where the key is kept, ``-inf`` where it is dropped."""
    return tirx.Select(visible, logit, NEG_INF)


def safe_row_max(row_max):
    """A row maximum usable as an exponent shift: 0 for a fully masked row (max = -inf).

    With it ``exp(logit - shift)`` is exactly 0 for every dropped key and never NaN.
    """
    return tirx.Select(row_max == NEG_INF, _ZERO, row_max)


def normalize(acc, row_sum):
    """``acc / row_sum``, and 0 for a row that kept no key."""
    return tirx.Select(row_sum > _ZERO, acc / row_sum, _ZERO)


def log_sum_exp(shift, row_sum):
    """Natural-log LSE from the shift and the shifted sum; ``-inf`` for a row that kept no key."""
    return tirx.Select(row_sum > _ZERO, shift + te.log(row_sum), NEG_INF)


def probability(logit, lse):
    """``exp(logit - lse)``, and 0 for rows whose ``lse`` is ``-inf`` (fully masked)."""
    return tirx.Select(lse == NEG_INF, _ZERO, te.exp(logit - lse))
