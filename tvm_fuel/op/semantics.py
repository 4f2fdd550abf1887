"""The attention semantics, written once on TIR expressions.

Every kernel of tvm_fuel -- the TE decomposition (the correctness floor) and the TensorIR kernels
of the performance path -- builds its masking, ALiBi, softcap, GQA head mapping and softmax
guards from these functions, so the ops cannot drift apart. ``tvm_fuel.reference`` restates the
same rules in numpy, independently, as the oracle.

For query row ``i`` and key ``j`` with ``delta = kv_len - Sq`` (the queries are the last ``Sq``
positions of the context, so the diagonal is aligned bottom-right):

1. ``s = scale * q_i . k_j``
2. ``softcap c > 0``: ``s = c * tanh(s / c)``
3. ``s += -slope_h * |i + delta - j|`` (ALiBi) and ``s += mask`` (additive mask, bounded to
   ``+-2^127`` so that finite biases stay finite; a ``-inf`` entry drops the key whatever ``s`` is)
4. keep ``(i, j)`` iff ``j < kv_len``, inside the window (or, left of it, ``j < sink_tokens``),
   and the boolean mask allows it
5. softmax over kept keys; a row without a kept key gives 0 and ``lse = -inf``.

Non-finite inputs (the NaN rule): a NaN or Inf in a q, k or v element that a row uses reaches
that row as IEEE arithmetic carries it; what a row does not see never reaches it. Every product
of a weight (a probability P or its gradient dS) with a value, key, query or ``do`` element skips
weights that are exactly 0 (``weighted``): the dropped keys' weights are exactly 0, whose values
may hold anything, and ``0 * NaN`` would otherwise be NaN. Whether a visible key whose weight
underflows to 0 passes its NaN on is unspecified (the paths round differently).

Contents:
    kv_head, keep, in_subtree, softcap, softcap_grad, alibi_bias, add_mask (BIAS_BOUND), masked, mask_index, NEG_INF,
    safe_row_max, normalize, with_sink, log_sum_exp, probability, exp_shifted, score_grad, weighted, add_weighted,
    fast_exp, fast_exp2 (LOG2E, LN2), fast_tanh
    logit_tangent, prob_tangent, score_grad_tangent -- forward-mode pieces of the JVP and the
        double backward (the derivatives of the lines above along a tangent direction)
"""

from __future__ import annotations

import math

from tvm import te, tirx

from .config import AttnConfig

NEG_INF = tirx.const(float("-inf"), "float32")
_ZERO = tirx.const(0.0, "float32")


def as_expr(x):
    """A TE tensor element as a TIR expression (``t[i]`` in TE is a slice until converted)."""
    return x.asobject() if isinstance(x, te.TensorSlice) else x


def as_int64(x):
    """Index arithmetic is done in int64 (Relax shapes are int64; lengths may arrive as int32)."""
    x = as_expr(x)
    return x if str(x.ty) == "int64" else x.astype("int64")


def kv_head(h, group):
    """GQA/MQA: query head ``h`` reads KV head ``h // group`` (group = Hq / Hkv)."""
    return tirx.floordiv(h, group)


def keep(cfg: AttnConfig, i, j, *, kv_len, delta):
    """Whether key ``j`` is visible to query row ``i`` under the length and window rules (the
    first ``sink_tokens`` keys past the window's left bound)."""
    i, j, kv_len, delta = as_int64(i), as_int64(j), as_int64(kv_len), as_int64(delta)
    cond = j < kv_len
    diagonal = i + delta
    if cfg.window_left >= 0:
        left = j >= diagonal - cfg.window_left
        if cfg.sink_tokens > 0:
            left = tirx.any(left, j < cfg.sink_tokens)
        cond = tirx.all(cond, left)
    if cfg.window_right >= 0:
        cond = tirx.all(cond, j <= diagonal + cfg.window_right)
    return cond


def in_subtree(node_enter, root_enter, root_exit):
    """Whether a tree's node lies in the subtree of ``root`` (root itself included), from their
    depth-first (enter, exit) numbers: tree attention's rule, where a token sees its ancestors."""
    return tirx.all(node_enter >= root_enter, node_enter < root_exit)


def softcap(cfg: AttnConfig, s, *, fast: bool = False):
    """``c * tanh(s / c)`` when ``cfg.softcap > 0``, else ``s`` (float32).

    ``fast`` uses ``fast_tanh`` (vectorizes; absolute error ~1e-7 * c) instead of libm's tanh.
    """
    if cfg.softcap <= 0:
        return s
    c = tirx.const(cfg.softcap, "float32")
    return c * (fast_tanh(s / c) if fast else te.tanh(s / c))


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


def mask_index(mask_shape, b, h, i, j):
    """Index of ``attn_mask`` (numpy-broadcast against [B, Hq, Sq, Sk]) for element (b, h, i, j)."""
    full = (b, h, i, j)[4 - len(mask_shape):]
    return tuple(0 if isinstance(n, (int, tirx.IntImm)) and int(n) == 1 else x for n, x in zip(mask_shape, full))


# Kernels that take their softmax in base 2 multiply each logit by log2(e) = 1.44: finfo(float32).min
# (Hugging Face's mask value) would become -inf there and drop a key a finite bias only weighs down
# (a row of them is the mean of its values, not 0). Bounded at 2^127, a logit times log2(e) stays
# finite with room for the score; only a row whose largest logit lies past it sees the difference.
BIAS_BOUND = 2.0 ** 127


def add_mask(logit, mask_value):
    """``logit + mask`` for an additive mask, the mask bounded to [-BIAS_BOUND, BIAS_BOUND]; ``-inf``
    where the mask is ``-inf`` (even for a NaN logit: a key the mask drops never reaches the row).
    A NaN mask stays NaN; ``+inf`` counts as BIAS_BOUND. The bound costs a min and a max per
    loaded mask element."""
    mask_value = mask_value.astype("float32")
    bounded = _clamp_keeping_nan(mask_value, -BIAS_BOUND, BIAS_BOUND)
    return tirx.Select(mask_value == NEG_INF, NEG_INF, logit + bounded)


def weighted(weight, value):
    """``weight * value``, and 0 where the weight is exactly 0 whatever the value (a dropped
    key's value, key, or a row's query or ``do``, may be NaN or Inf: it must not reach the sum)."""
    return tirx.Select(weight == _ZERO, _ZERO, weight * value)


def add_weighted(acc, weight, value):
    """``acc + weight * value``, and ``acc`` unchanged where the weight is exactly 0 (``weighted``
    as a kernel's accumulation: where the weight is not 0 it rounds exactly as the plain
    multiply-add, so a kernel that takes this path for a tile gives bit-identical rows)."""
    return tirx.Select(weight == _ZERO, acc, acc + weight * value)


def score_grad(cfg: AttnConfig, p, dp, d_row, capped, *, factor=None):
    """dS of one score: ``P * (dP - D) * softcap'(capped) [* factor]``, and exactly 0 where P is 0,
    whatever a dropped key's dP or capped score holds (0 * NaN is NaN). ``D`` is the row's
    ``rowsum(dO * O)``; ``capped`` the softcapped score (unused without softcap); ``factor``
    folds a constant such as the softmax scale into the same expression."""
    ds = p * (dp - d_row)
    if cfg.softcap > 0:
        ds = ds * softcap_grad(cfg, capped)
    if factor is not None:
        ds = ds * factor
    return tirx.Select(p == _ZERO, _ZERO, ds)


def logit_tangent(cfg: AttnConfig, capped, score_dot):
    """The directional derivative of a logit from that of its scaled score ``s``: ``softcap'(capped)
    * s_dot`` (ALiBi and masks are constants). Callers weigh it by P, so a dropped key's tangent
    never counts."""
    return score_dot * softcap_grad(cfg, capped) if cfg.softcap > 0 else score_dot


def prob_tangent(p, logit_dot, lse_dot):
    """P's directional derivative ``P * (logit_dot - lse_dot)``, exactly 0 where P is 0 (with
    ``lse_dot = sum_j P * logit_dot`` of the row)."""
    return tirx.Select(p == _ZERO, _ZERO, p * (logit_dot - lse_dot))


def score_grad_tangent(cfg: AttnConfig, p, p_dot, dp, dp_dot, d_row, d_row_dot, capped, logit_dot, *, factor=None):
    """The directional derivative of ``score_grad`` (dS) with ``do`` held, 0 where P is 0:

    ``[P_dot (dP - D) + P (dP_dot - D_dot)] softcap'(capped) + P (dP - D) softcap''`` where
    ``softcap'' = -2 capped logit_dot / c^2`` (the derivative of ``1 - (capped / c)^2``), ``D_dot``
    the row's ``rowsum(do * out_dot)`` and ``logit_dot`` the capped score's tangent."""
    ds_dot = p_dot * (dp - d_row) + p * (dp_dot - d_row_dot)
    if cfg.softcap > 0:
        c = tirx.const(cfg.softcap, "float32")
        slope_dot = tirx.const(-2.0, "float32") * capped * logit_dot / (c * c)
        ds_dot = ds_dot * softcap_grad(cfg, capped) + p * (dp - d_row) * slope_dot
    if factor is not None:
        ds_dot = ds_dot * factor
    return tirx.Select(p == _ZERO, _ZERO, ds_dot)


def masked(visible, logit):
    """The logit where the key is kept, ``-inf`` where it is dropped."""
    return tirx.Select(visible, logit, NEG_INF)


def safe_row_max(row_max):
    """A row maximum usable as an exponent shift: 0 for a fully masked row (max = -inf).

    With it ``exp(logit - shift)`` is exactly 0 for every dropped key and never NaN.
    """
    return tirx.Select(row_max == NEG_INF, _ZERO, row_max)


def normalize(acc, row_sum):
    """``acc / row_sum``, and 0 for a row that kept no key (a NaN sum stays NaN)."""
    return tirx.Select(row_sum == _ZERO, _ZERO, acc / row_sum)


def with_sink(row_sum, row_max, sink, *, log2: bool = False):
    """A row's sum with its sink's term (gpt-oss's sinks): ``row_sum + exp(sink - shift)`` for a sum
    taken relative to ``shift = safe_row_max(row_max)`` (log2 units: ``2^(sink log2 e - shift)``).
    ``normalize`` by it is the output with the sink in the softmax: the sink weighs no value, a row
    without keys is 0, a ``-inf`` sink adds nothing. (A sink past every logit by more than
    float32's exp range gives an infinite sum: the output is then 0 to float32 precision.)"""
    shift = safe_row_max(row_max)
    return row_sum + (tirx.exp2(sink * tirx.const(LOG2E, "float32") - shift) if log2 else te.exp(sink - shift))


def log_sum_exp(shift, row_sum):
    """Natural-log LSE from the shift and the shifted sum; ``-inf`` for a row that kept no key (a
    NaN sum stays NaN)."""
    return tirx.Select(row_sum == _ZERO, NEG_INF, shift + te.log(row_sum))


def probability(logit, lse, *, fast: bool = False):
    """``exp(logit - lse)``, and 0 for rows whose ``lse`` is ``-inf`` (fully masked).

    ``fast`` uses ``fast_exp``: LLVM turns a vector ``exp`` into one libm call per lane.
    """
    return exp_shifted(logit - lse, lse, fast=fast)


def exp_shifted(shifted, lse, *, fast: bool = False):
    """``exp(shifted)`` for ``shifted = logit - lse`` (``-inf`` for a dropped key), and 0 for rows
    whose ``lse`` is ``-inf``: ``probability`` from a shift computed beforehand.

    ``fast_exp`` reads its argument about a hundred times: a kernel stores a compound shift (a
    masked, biased logit) first and passes its load here, or TVM's passes spend seconds on the
    copies.
    """
    return tirx.Select(lse == NEG_INF, _ZERO, (fast_exp if fast else te.exp)(shifted))


_EXP_POLY = (1.3981999507e-3, 8.3334519073e-3, 4.1665795894e-2, 1.6666665459e-1, 5.0000001201e-1)


def fast_exp(x):
    """float32 ``exp`` that vectorizes (Cephes' expf: range reduction by ln 2, degree-6 polynomial).

    LLVM lowers a vector ``llvm.exp`` to one libm call per lane; this stays in SIMD registers.
    Relative error is within a few ulp; ``exp(x)`` is exactly 0 below -87 (so for -inf), NaN stays
    NaN.
    """
    f32 = "float32"
    clamped = _clamp_keeping_nan(x, -87.0, 88.0)
    n = tirx.floor(clamped * tirx.const(math.log2(math.e), f32) + tirx.const(0.5, f32))
    # two-step Cody-Waite reduction: ln 2 = 0.693359375 - 2.12194440e-4 (the first part exact)
    r = clamped - n * tirx.const(0.693359375, f32) + n * tirx.const(2.12194440e-4, f32)
    p = tirx.const(1.9875691500e-4, f32)
    for c in _EXP_POLY:
        p = p * r + tirx.const(c, f32)
    poly = p * r * r + r + tirx.const(1.0, f32)
    return tirx.Select(x < tirx.const(-87.0, f32), _ZERO, poly * _two_to(n, -126.0, 127.0))


def _clamp_keeping_nan(x, lo: float, hi: float):
    # the comparisons are false for NaN, which passes through (TIR's min/max would drop it)
    x = tirx.Select(x > tirx.const(hi, "float32"), tirx.const(hi, "float32"), x)
    return tirx.Select(x < tirx.const(lo, "float32"), tirx.const(lo, "float32"), x)


def _two_to(n, lo: float, hi: float):
    """``2 ** n`` for an integral float32 ``n`` in [lo, hi] built from its exponent bits. A NaN ``n``
    is clamped first (its integer conversion would be poison); the NaN reaches the result through
    the polynomial it multiplies."""
    n = tirx.max(tirx.min(n, tirx.const(hi, "float32")), tirx.const(lo, "float32"))
    return tirx.reinterpret("float32", tirx.shift_left(n.astype("int32") + 127, tirx.const(23, "int32")))


_EXP2_POLY = (1.339887440266574e-3, 9.618437357674640e-3, 5.550332471162809e-2, 2.402264791363012e-1,
              6.931472028550421e-1)
LOG2E = math.log2(math.e)
LN2 = math.log(2.0)


def fast_exp2(x):
    """float32 ``2 ** x`` that vectorizes (Cephes' exp2f: ``x = n + f``, ``|f| <= 1/2``, degree-6
    polynomial; relative error ~2e-7).

    Kernels that fold ``log2(e)`` into their query scale take their softmax in base 2: the range
    reduction is one subtraction, where ``fast_exp`` needs a multiply and two Cody-Waite steps.
    ``2 ** x`` is exactly 0 below -126 (so for -inf), NaN stays NaN.
    """
    f32 = "float32"
    clamped = _clamp_keeping_nan(x, -126.0, 127.0)
    n = tirx.floor(clamped + tirx.const(0.5, f32))
    f = clamped - n
    p = tirx.const(1.535336188319500e-4, f32)
    for c in _EXP2_POLY:
        p = p * f + tirx.const(c, f32)
    return tirx.Select(x < tirx.const(-126.0, f32), _ZERO, (p * f + tirx.const(1.0, f32)) * _two_to(n, -126.0, 127.0))


def fast_tanh(x):
    """``1 - 2 / (exp(2x) + 1)`` on ``fast_exp``: saturates to +-1 exactly, absolute error ~1e-7."""
    one = tirx.const(1.0, "float32")
    return one - tirx.const(2.0, "float32") / (fast_exp(x + x) + one)
