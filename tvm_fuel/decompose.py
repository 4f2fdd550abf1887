"""TE compute for every fuel op: the materialized, always-correct decomposition.

These functions take and return ``te.Tensor`` only (no Relax), like ``tvm.topi``. Scores are
materialized as [B, Hq, Sq, Sk] float32; all arithmetic is float32 and results are cast back to
the input dtype. The masking and softmax rules come from ``tvm_fuel.semantics``.

Contents:
    flash_attn             -- out (and lse) of dense attention
    flash_attn_backward    -- dq, dk, dv (any subset) of dense attention
    paged_attn             -- attention over a paged KV cache read through a block table
    sanitize_block_table   -- live block ids clamped in range, dead entries zeroed (no OOB reads)
    softmax_backward       -- probs * (dprobs - sum(probs * dprobs))
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Sequence

from tvm import te, tirx

from . import semantics as sem
from .config import AttnConfig

F32 = "float32"


@dataclass(frozen=True)
class _Layout:
    """Where keys end and where the diagonal sits, per batch row.

    Dense attention: ``kv_len = Sk`` and ``delta = Sk - Sq``. Paged attention: both come from
    ``context_lens[b]``.
    """

    group: tirx.PrimExpr
    kv_len: Callable[[tirx.PrimExpr], tirx.PrimExpr]
    delta: Callable[[tirx.PrimExpr], tirx.PrimExpr]


def _dense_layout(q: te.Tensor, k: te.Tensor) -> _Layout:
    sq, sk = q.shape[2], k.shape[2]
    return _Layout(group=q.shape[1] // k.shape[1], kv_len=lambda b: sk, delta=lambda b: sk - sq)


def _scale(cfg: AttnConfig, head_dim) -> tirx.PrimExpr:
    if cfg.softmax_scale is not None:
        return tirx.const(cfg.softmax_scale, F32)
    if isinstance(head_dim, tirx.IntImm):
        return tirx.const(cfg.scale_for(int(head_dim)), F32)
    return tirx.const(1.0, F32) / te.sqrt(head_dim.astype(F32))


def _logits(q, k, cfg: AttnConfig, layout: _Layout, alibi_slopes, attn_mask):
    """(capped, logits): ``softcap(scale * q.k)`` and the final logits with bias and -inf masking."""
    B, Hq, Sq, D = q.shape
    Sk = k.shape[2]
    scale = _scale(cfg, D)
    d = te.reduce_axis((0, D), name="d")
    qk = te.compute(
        (B, Hq, Sq, Sk),
        lambda b, h, i, j: te.sum(
            q[b, h, i, d].astype(F32) * k[b, sem.kv_head(h, layout.group), j, d].astype(F32), axis=d),
        name="qk")
    capped = te.compute((B, Hq, Sq, Sk), lambda b, h, i, j: sem.softcap(cfg, qk[b, h, i, j] * scale),
                        name="capped")

    def logit(b, h, i, j):
        s = capped[b, h, i, j]
        visible = sem.keep(cfg, i, j, kv_len=layout.kv_len(b), delta=layout.delta(b))
        if alibi_slopes is not None:
            s = s + sem.alibi_bias(alibi_slopes[h], i, j, delta=layout.delta(b))
        if attn_mask is not None:
            m = attn_mask[sem.mask_index(attn_mask.shape, b, h, i, j)]
            if str(attn_mask.dtype) == "bool":
                visible = tirx.all(visible, m)
            else:
                s = sem.add_mask(s, m)
        return sem.masked(visible, s)

    return capped, te.compute((B, Hq, Sq, Sk), logit, name="logits")


def _nonempty(reduced: te.Tensor, extent, empty_value, name: str) -> te.Tensor:
    """``reduced`` where its reduction ran over ``extent > 0`` items, else ``empty_value``: TIR
    initializes a reduction inside its loop, so an empty one leaves its buffer unwritten."""
    return te.compute(reduced.shape, lambda *idx: tirx.Select(
        sem.as_int64(extent) > 0, reduced(*idx), tirx.const(empty_value, F32)), name=name)


def _softmax_stats(logits):
    """(shift, row_sum, lse) of each row of ``logits``; fully masked rows get lse = -inf."""
    B, Hq, Sq, Sk = logits.shape
    j = te.reduce_axis((0, Sk), name="j")
    row_max = _nonempty(te.compute((B, Hq, Sq), lambda b, h, i: te.max(logits[b, h, i, j], axis=j),
                                   name="row_max_acc"), Sk, float("-inf"), "row_max")
    shift = te.compute((B, Hq, Sq), lambda b, h, i: sem.safe_row_max(row_max[b, h, i]), name="shift")
    p = te.compute((B, Hq, Sq, Sk), lambda b, h, i, jj: te.exp(logits[b, h, i, jj] - shift[b, h, i]),
                   name="p_unnorm")
    j2 = te.reduce_axis((0, Sk), name="j2")
    row_sum = _nonempty(te.compute((B, Hq, Sq), lambda b, h, i: te.sum(p[b, h, i, j2], axis=j2), name="row_sum_acc"),
                        Sk, 0.0, "row_sum")
    lse = te.compute((B, Hq, Sq), lambda b, h, i: sem.log_sum_exp(shift[b, h, i], row_sum[b, h, i]),
                     name="lse")
    return p, row_sum, lse


def _attend(q, k, v, cfg, layout, alibi_slopes, attn_mask, return_lse):
    B, Hq, Sq, D = q.shape
    _, logits = _logits(q, k, cfg, layout, alibi_slopes, attn_mask)
    p, row_sum, lse = _softmax_stats(logits)
    j = te.reduce_axis((0, k.shape[2]), name="j_pv")
    acc = _nonempty(te.compute(
        (B, Hq, Sq, D),
        lambda b, h, i, e: te.sum(sem.weighted(p[b, h, i, j], v[b, sem.kv_head(h, layout.group), j, e].astype(F32)),
                                  axis=j),
        name="pv_acc"), k.shape[2], 0.0, "pv")
    out = te.compute((B, Hq, Sq, D),
                     lambda b, h, i, e: sem.normalize(acc[b, h, i, e], row_sum[b, h, i]).astype(str(q.dtype)),
                     name="out")
    return [out, lse] if return_lse else out


def flash_attn(q, k, v, alibi_slopes=None, attn_mask=None, *, cfg: AttnConfig, return_lse: bool = False):
    """Dense attention. q [B, Hq, Sq, D]; k, v [B, Hkv, Sk, D] -> out [B, Hq, Sq, D] (+ lse [B, Hq, Sq])."""
    return _attend(q, k, v, cfg, _dense_layout(q, k), alibi_slopes, attn_mask, return_lse)


def flash_attn_backward(q, k, v, do, alibi_slopes=None, attn_mask=None, out=None, lse=None, *,
                        cfg: AttnConfig, grads: Sequence[str] = ("dq", "dk", "dv")):
    """Gradients of ``flash_attn`` w.r.t. the requested subset of (q, k, v), in that order.

    ``out`` and ``lse`` (from the forward) are used when given; otherwise the softmax state is
    recomputed. Masks and ALiBi are constants: they get no gradient.
    """
    B, Hq, Sq, D = q.shape
    Hkv, Sk = k.shape[1], k.shape[2]
    layout = _dense_layout(q, k)
    group = layout.group
    scale = _scale(cfg, D)
    capped, logits = _logits(q, k, cfg, layout, alibi_slopes, attn_mask)
    if lse is None:
        _, _, lse = _softmax_stats(logits)
    # a dropped key weighs exactly 0 even where the row's lse is NaN (exp(-inf - NaN) is NaN): its
    # dk and dv must not see the row
    p = te.compute((B, Hq, Sq, Sk), lambda b, h, i, j: tirx.Select(
        logits[b, h, i, j] == sem.NEG_INF, tirx.const(0.0, F32), sem.probability(logits[b, h, i, j], lse[b, h, i])),
        name="p")
    d = te.reduce_axis((0, D), name="d_dp")
    dp = te.compute(
        (B, Hq, Sq, Sk),
        lambda b, h, i, j: te.sum(do[b, h, i, d].astype(F32) * v[b, sem.kv_head(h, group), j, d].astype(F32), axis=d),
        name="dp")
    if out is not None:  # FlashAttention-2's D = rowsum(dO * O)
        e = te.reduce_axis((0, D), name="d_row")
        row_dot = te.compute((B, Hq, Sq), lambda b, h, i: te.sum(
            do[b, h, i, e].astype(F32) * out[b, h, i, e].astype(F32), axis=e), name="do_dot_o")
    else:
        jr = te.reduce_axis((0, Sk), name="j_row")
        row_dot = _nonempty(te.compute((B, Hq, Sq), lambda b, h, i: te.sum(sem.weighted(p[b, h, i, jr], dp[b, h, i, jr]), axis=jr),
                                       name="do_dot_o_acc"), Sk, 0.0, "do_dot_o")
    ds = te.compute(
        (B, Hq, Sq, Sk),
        lambda b, h, i, j: sem.weighted(p[b, h, i, j], (dp[b, h, i, j] - row_dot[b, h, i])
                                        * sem.softcap_grad(cfg, capped[b, h, i, j]) * scale),
        name="ds")

    results = []
    for grad in grads:
        if grad == "dq":
            j = te.reduce_axis((0, Sk), name="j_dq")
            acc = _nonempty(te.compute((B, Hq, Sq, D), lambda b, h, i, e: te.sum(
                sem.weighted(ds[b, h, i, j], k[b, sem.kv_head(h, group), j, e].astype(F32)), axis=j), name="dq_sum"),
                Sk, 0.0, "dq_acc")
            results.append(_cast(acc, q.dtype, "dq"))
        elif grad in ("dk", "dv"):
            # kv head g gathers the query heads g*group .. g*group+group-1 and all query rows
            r = te.reduce_axis((0, group), name="r")
            i = te.reduce_axis((0, Sq), name="i")
            weight, rhs = (ds, q) if grad == "dk" else (p, do)
            acc = _nonempty(te.compute((B, Hkv, Sk, D), lambda b, g, j, e: te.sum(
                sem.weighted(weight[b, g * group + r, i, j], rhs[b, g * group + r, i, e].astype(F32)), axis=[r, i]),
                name=f"{grad}_sum"), Sq, 0.0, f"{grad}_acc")
            results.append(_cast(acc, (k if grad == "dk" else v).dtype, grad))
        else:
            raise ValueError(f"flash_attn_backward: unknown gradient {grad!r}")
    return results if len(results) > 1 else results[0]


def _cast(t, dtype, name):
    return te.compute(t.shape, lambda *idx: t(*idx).astype(str(dtype)), name=name)


def sanitize_block_table(block_table, context_lens, num_blocks, block_size):
    """int64 block ids safe to dereference: dead entries -> 0, live ones clamped to [0, num_blocks).

    Entries past a sequence's live blocks may hold anything (-1, garbage). Live ids are validated
    before this runs on CPU (see ``legalize``); the clamp keeps every target in bounds regardless.
    """
    B, max_blocks = block_table.shape

    def safe(b, n):
        live = n * block_size < sem.as_int64(context_lens[b])
        block = sem.as_int64(block_table[b, n])
        clamped = tirx.max(tirx.min(block, sem.as_int64(num_blocks) - 1), tirx.const(0, "int64"))
        return tirx.Select(live, clamped, tirx.const(0, "int64"))

    return te.compute((B, max_blocks), safe, name="safe_block_table")


def gather_pages(cache, safe_table, context_lens):
    """The cache [num_blocks, block_size, Hkv, D] gathered to dense [B, Hkv, max_blocks * block_size, D].

    Slots past a sequence's length are 0 and never read (an empty cache has no block to read).
    """
    _, block_size, Hkv, D = cache.shape
    B, max_blocks = safe_table.shape
    return te.compute(
        (B, Hkv, max_blocks * block_size, D),
        lambda b, g, j, e: tirx.if_then_else(
            j < sem.as_int64(context_lens[b]), cache[safe_table[b, j // block_size], j % block_size, g, e],
            tirx.const(0, str(cache.dtype))),
        name="gathered")


def paged_attn(q, k_cache, v_cache, block_table, context_lens, alibi_slopes=None, *, cfg: AttnConfig):
    """Attention of q [B, Hq, Sq, D] over the paged cache; the Sq queries are each sequence's last."""
    num_blocks, block_size = k_cache.shape[0], k_cache.shape[1]
    safe_table = sanitize_block_table(block_table, context_lens, num_blocks, block_size)
    k = gather_pages(k_cache, safe_table, context_lens)
    v = gather_pages(v_cache, safe_table, context_lens)
    sq = q.shape[2]
    layout = _Layout(
        group=q.shape[1] // k_cache.shape[2],
        kv_len=lambda b: sem.as_int64(context_lens[b]),
        delta=lambda b: sem.as_int64(context_lens[b]) - sq)
    return _attend(q, k, v, cfg, layout, alibi_slopes, None, False)


def softmax_backward(probs, dprobs, *, axis: int = -1):
    """``probs * (dprobs - sum(probs * dprobs, axis))``, accumulated in float32."""
    ndim = len(probs.shape)
    axis = axis % ndim
    r = te.reduce_axis((0, probs.shape[axis]), name="r")

    def at(t, idx, pos):
        full = list(idx[:axis]) + [pos] + list(idx[axis:])
        return t[tuple(full)].astype(F32)

    reduced_shape = [n for a, n in enumerate(probs.shape) if a != axis]
    dot = te.compute(reduced_shape, lambda *idx: te.sum(at(probs, idx, r) * at(dprobs, idx, r), axis=r),
                     name="p_dot_dp")

    def grad(*idx):
        rest = idx[:axis] + idx[axis + 1:]
        p = probs[idx].astype(F32)
        return (p * (dprobs[idx].astype(F32) - dot[rest])).astype(str(probs.dtype))

    return te.compute(probs.shape, grad, name="dlogits")
