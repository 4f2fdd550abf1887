"""TE compute for every fuel op: the materialized, always-correct decomposition.

These functions take and return ``te.Tensor`` only (no Relax), like ``tvm.topi``. Scores are
materialized as [B, Hq, Sq, Sk] float32; all arithmetic is float32 and results are cast back to
the input dtype. The masking and softmax rules come from ``tvm_fuel.op.semantics``.

Contents:
    flash_attn             -- out (and lse) of dense attention
    flash_attn_backward    -- dq, dk, dv (any subset) of dense attention
    flash_attn_jvp         -- out and its directional derivative (forward mode), lse
    flash_attn_double_backward -- the VJP of the backward: gradients of q, k, v and do
    paged_attn             -- attention over a paged KV cache read through a block table
    paged_live_len         -- the longest context: how far paged_attn gathers (not the capacity)
    sanitize_block_table   -- live block ids clamped in range, dead entries zeroed (no OOB reads)
    softmax_backward       -- probs * (dprobs - sum(probs * dprobs))
    norm_backward_row_mean, norm_backward_dx, norm_backward_column_sum
                           -- layer / RMS norm backward over [N, C] rows, one reduction each
    logit_scale, nonempty, softmax_stats, probabilities, do_dot_out
                           -- the steps the packed (varlen) floor shares (``tvm_fuel.op.ragged``)
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Sequence

from tvm import te, tirx

from . import quant, semantics as sem
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


def logit_scale(cfg: AttnConfig, head_dim) -> tirx.PrimExpr:
    if cfg.softmax_scale is not None:
        return tirx.const(cfg.softmax_scale, F32)
    if isinstance(head_dim, tirx.IntImm):
        return tirx.const(cfg.scale_for(int(head_dim)), F32)
    return tirx.const(1.0, F32) / te.sqrt(head_dim.astype(F32))


def _logits(q, k, cfg: AttnConfig, layout: _Layout, alibi_slopes, attn_mask):
    """(capped, logits): ``softcap(scale * q.k)`` and the final logits with bias and -inf masking."""
    B, Hq, Sq, D = q.shape
    Sk = k.shape[2]
    scale = logit_scale(cfg, D)
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


def nonempty(reduced: te.Tensor, extent, empty_value, name: str) -> te.Tensor:
    """``reduced`` where its reduction ran over ``extent > 0`` items, else ``empty_value``: TIR
    initializes a reduction inside its loop, so an empty one leaves its buffer unwritten."""
    return te.compute(reduced.shape, lambda *idx: tirx.Select(
        sem.as_int64(extent) > 0, reduced(*idx), tirx.const(empty_value, F32)), name=name)


def softmax_stats(logits, sinks=None):
    """(unnormalized P, row_sum, lse) of each row of ``logits``; fully masked rows get lse = -inf.

    With ``sinks`` [Hq] each row has one more column, ``sinks[h]``, in its max and its sum (not in P)."""
    B, Hq, Sq, Sk = logits.shape
    j = te.reduce_axis((0, Sk), name="j")
    row_max = nonempty(te.compute((B, Hq, Sq), lambda b, h, i: te.max(logits[b, h, i, j], axis=j),
                                   name="row_max_acc"), Sk, float("-inf"), "row_max")
    if sinks is not None:
        row_max = te.compute((B, Hq, Sq), lambda b, h, i: tirx.max(row_max[b, h, i], sinks[h]), name="row_max_sink")
    shift = te.compute((B, Hq, Sq), lambda b, h, i: sem.safe_row_max(row_max[b, h, i]), name="shift")
    p = te.compute((B, Hq, Sq, Sk), lambda b, h, i, jj: te.exp(logits[b, h, i, jj] - shift[b, h, i]),
                   name="p_unnorm")
    j2 = te.reduce_axis((0, Sk), name="j2")
    row_sum = nonempty(te.compute((B, Hq, Sq), lambda b, h, i: te.sum(p[b, h, i, j2], axis=j2), name="row_sum_acc"),
                        Sk, 0.0, "row_sum")
    if sinks is not None:
        row_sum = te.compute((B, Hq, Sq), lambda b, h, i: row_sum[b, h, i] + te.exp(sinks[h] - shift[b, h, i]),
                             name="row_sum_sink")
    lse = te.compute((B, Hq, Sq), lambda b, h, i: sem.log_sum_exp(shift[b, h, i], row_sum[b, h, i]),
                     name="lse")
    return p, row_sum, lse


def _attend(q, k, v, cfg, layout, alibi_slopes, attn_mask, sinks, return_lse):
    B, Hq, Sq, D = q.shape
    _, logits = _logits(q, k, cfg, layout, alibi_slopes, attn_mask)
    p, row_sum, lse = softmax_stats(logits, sinks)
    j = te.reduce_axis((0, k.shape[2]), name="j_pv")
    acc = nonempty(te.compute(
        (B, Hq, Sq, D),
        lambda b, h, i, e: te.sum(sem.weighted(p[b, h, i, j], v[b, sem.kv_head(h, layout.group), j, e].astype(F32)),
                                  axis=j),
        name="pv_acc"), k.shape[2], 0.0, "pv")
    out = te.compute((B, Hq, Sq, D),
                     lambda b, h, i, e: sem.normalize(acc[b, h, i, e], row_sum[b, h, i]).astype(str(q.dtype)),
                     name="out")
    return [out, lse] if return_lse else out


def flash_attn(q, k, v, alibi_slopes=None, attn_mask=None, sinks=None, *, cfg: AttnConfig,
               return_lse: bool = False):
    """Dense attention. q [B, Hq, Sq, D]; k, v [B, Hkv, Sk, D] -> out [B, Hq, Sq, D] (+ lse [B, Hq, Sq])."""
    return _attend(q, k, v, cfg, _dense_layout(q, k), alibi_slopes, attn_mask, sinks, return_lse)


def _dense_probabilities(q, k, cfg: AttnConfig, alibi_slopes, attn_mask, lse=None, *, normalized=False,
                         sinks=None):
    """(group, scale, capped scores, lse, P) of dense attention: P from the given lse (the
    forward's) or from one recomputed, as the backward kernels take it; ``normalized``: P from the
    recomputed row statistics, as an online softmax (the JVP kernel's) has it.

    The two differ where a float32 lse cannot hold log(n) (a row whose every key carries a huge
    finite bias): there ``exp(logit - lse)`` is P times a per-row factor (1 / P's row sum)."""
    layout = _dense_layout(q, k)
    capped, logits = _logits(q, k, cfg, layout, alibi_slopes, attn_mask)
    if normalized:
        assert lse is None, "normalized probabilities come from the recomputed statistics"
        p_unnorm, row_sum, lse = softmax_stats(logits)
        p = te.compute(logits.shape, lambda b, h, i, j: tirx.Select(
            logits[b, h, i, j] == sem.NEG_INF, tirx.const(0.0, F32),
            sem.normalize(p_unnorm[b, h, i, j], row_sum[b, h, i])), name="p")
        return layout.group, logit_scale(cfg, q.shape[3]), capped, lse, p
    if lse is None:
        _, _, lse = softmax_stats(logits, sinks)
    return layout.group, logit_scale(cfg, q.shape[3]), capped, lse, probabilities(logits, lse)


def flash_attn_backward(q, k, v, do, alibi_slopes=None, attn_mask=None, out=None, lse=None, sinks=None, *,
                        cfg: AttnConfig, grads: Sequence[str] = ("dq", "dk", "dv")):
    """Gradients of ``flash_attn`` w.r.t. the requested subset of (q, k, v), in that order.

    ``out`` and ``lse`` (from the forward) are used when given; otherwise the softmax state is
    recomputed (with ``sinks``' column). Masks and ALiBi are constants: they get no gradient.
    """
    B, Hq, Sq, D = q.shape
    Hkv, Sk = k.shape[1], k.shape[2]
    group, scale, capped, lse, p = _dense_probabilities(q, k, cfg, alibi_slopes, attn_mask, lse, sinks=sinks)
    dp = _row_times_values(do, v, group, "dp")
    sink_p = None if sinks is None else te.compute(
        lse.shape, lambda b, h, i: sem.probability(sinks[h], lse[b, h, i]), name="sink_p")
    row_dot = do_dot_out(do, out, p, dp, sink_p)
    ds = te.compute(
        (B, Hq, Sq, Sk),
        lambda b, h, i, j: sem.weighted(p[b, h, i, j], (dp[b, h, i, j] - row_dot[b, h, i])
                                        * sem.softcap_grad(cfg, capped[b, h, i, j]) * scale),
        name="ds")

    results = []
    for grad in grads:
        if grad == "dq":
            j = te.reduce_axis((0, Sk), name="j_dq")
            acc = nonempty(te.compute((B, Hq, Sq, D), lambda b, h, i, e: te.sum(
                sem.weighted(ds[b, h, i, j], k[b, sem.kv_head(h, group), j, e].astype(F32)), axis=j), name="dq_sum"),
                Sk, 0.0, "dq_acc")
            results.append(_cast(acc, q.dtype, "dq"))
        elif grad in ("dk", "dv"):
            # kv head g gathers the query heads g*group .. g*group+group-1 and all query rows
            r = te.reduce_axis((0, group), name="r")
            i = te.reduce_axis((0, Sq), name="i")
            weight, rhs = (ds, q) if grad == "dk" else (p, do)
            acc = nonempty(te.compute((B, Hkv, Sk, D), lambda b, g, j, e: te.sum(
                sem.weighted(weight[b, g * group + r, i, j], rhs[b, g * group + r, i, e].astype(F32)), axis=[r, i]),
                name=f"{grad}_sum"), Sq, 0.0, f"{grad}_acc")
            results.append(_cast(acc, (k if grad == "dk" else v).dtype, grad))
        else:
            raise ValueError(f"flash_attn_backward: unknown gradient {grad!r}")
    return results if len(results) > 1 else results[0]


def probabilities(logits, lse):
    """P [B, Hq, Sq, Sk] float32 from the logits and the rows' lse."""
    # a dropped key weighs exactly 0 even where the row's lse is NaN (exp(-inf - NaN) is NaN): its
    # dk and dv must not see the row
    return te.compute(logits.shape, lambda b, h, i, j: tirx.Select(
        logits[b, h, i, j] == sem.NEG_INF, tirx.const(0.0, F32), sem.probability(logits[b, h, i, j], lse[b, h, i])),
        name="p")


def _row_times_values(rows, kv, group, name):
    """``rows[b, h, i, :] . kv[b, kv_head(h), j, :]`` [B, Hq, Sq, Sk] float32 (dP = dO V^T and its kin)."""
    B, Hq, Sq, D = rows.shape
    d = te.reduce_axis((0, D), name=f"d_{name}")
    return te.compute(
        (B, Hq, Sq, kv.shape[2]),
        lambda b, h, i, j: te.sum(rows[b, h, i, d].astype(F32) * kv[b, sem.kv_head(h, group), j, d].astype(F32),
                                  axis=d),
        name=name)


def do_dot_out(do, out, p, dp, sink_p=None):
    """D = rowsum(dO * O) [B, Hq, Sq]: from ``out`` when given (FlashAttention-2), else
    rowsum(P * dP) / rowsum(P), the forward's O without forming it. The kernels take O from the
    forward: where P from the lse does not sum to 1 (``_dense_probabilities``) so must this.
    ``sink_p`` [B, Hq, Sq]: the sink column's share of each row, which the row's mass counts."""
    B, Hq, Sq, D = do.shape
    if out is not None:
        e = te.reduce_axis((0, D), name="d_row")
        return te.compute((B, Hq, Sq), lambda b, h, i: te.sum(
            do[b, h, i, e].astype(F32) * out[b, h, i, e].astype(F32), axis=e), name="do_dot_o")
    Sk = p.shape[3]
    jr = te.reduce_axis((0, Sk), name="j_row")
    acc = nonempty(te.compute((B, Hq, Sq), lambda b, h, i: te.sum(sem.weighted(p[b, h, i, jr], dp[b, h, i, jr]),
                                                                    axis=jr),
                               name="do_dot_o_acc"), Sk, 0.0, "do_dot_o_sum")
    mass = _row_mass(p)
    if sink_p is not None:
        mass = te.compute((B, Hq, Sq), lambda b, h, i: mass[b, h, i] + sink_p[b, h, i], name="p_mass_sink")
    return te.compute((B, Hq, Sq), lambda b, h, i: sem.normalize(acc[b, h, i], mass[b, h, i]), name="do_dot_o")


def _row_mass(p):
    """rowsum(P) [B, Hq, Sq] (0 for a row without a visible key)."""
    B, Hq, Sq, Sk = p.shape
    j = te.reduce_axis((0, Sk), name="j_mass")
    return nonempty(te.compute((B, Hq, Sq), lambda b, h, i: te.sum(p[b, h, i, j], axis=j), name="p_mass_acc"),
                     Sk, 0.0, "p_mass")


def _zeros(shape, dtype, name):
    return te.compute(shape, lambda *idx: tirx.const(0.0, str(dtype)), name=name)


def _sum_terms(shape, extent, terms, name):
    """``sum_r`` of the present ``terms`` over ``extent`` (float32, 0 where the reduction is
    empty); ``terms(idx, r)`` lists expressions (None where a term is absent: no zeros built)."""

    r = te.reduce_axis((0, extent), name=f"r_{name}")

    def body(*idx):
        present = [t for t in terms(idx, r) if t is not None]
        return te.sum(present[0] if len(present) == 1 else sum(present[1:], present[0]), axis=r)

    return nonempty(te.compute(shape, body, name=f"{name}_acc"), extent, 0.0, name)


@dataclass
class _Tangent:
    """The forward's state along one direction (q_dot, k_dot, v_dot), float32; None where a
    quantity is identically 0 (its direction absent)."""

    capped: te.Tensor
    lse: te.Tensor
    p: te.Tensor
    out: te.Tensor  # [B, Hq, Sq, D] float32, the forward's output
    logit_dot: te.Tensor | None
    p_dot: te.Tensor | None
    out_dot: te.Tensor  # [B, Hq, Sq, D], zeros when the whole direction is absent


def _tangent(q, k, v, q_dot, k_dot, v_dot, cfg, alibi_slopes, attn_mask, lse=None, out=None, *,
             online=False) -> _Tangent:
    """Scores, P and their derivatives along (q_dot, k_dot, v_dot):

    ``S_dot = scale (q_dot K^T + Q k_dot^T)``, ``logit_dot = softcap'(capped) S_dot``,
    ``lse_dot = rowsum(P logit_dot)``, ``P_dot = P (logit_dot - lse_dot)``,
    ``out_dot = (P logit_dot) V + P v_dot - lse_dot O`` (= ``P_dot V + P v_dot``), as the kernels
    (``schedules.cpu.tangent``) take them: ``online`` (the JVP) P normalized, else P from the
    lse; O the given ``out`` or P V / rowsum(P) (the two forms differ only where P from the lse does
    not sum to 1, ``_dense_probabilities``)."""
    B, Hq, Sq, D = q.shape
    Sk = k.shape[2]
    group, scale, capped, lse, p = _dense_probabilities(q, k, cfg, alibi_slopes, attn_mask, lse, normalized=online)

    def v_at(x, idx, j):
        return x[idx[0], sem.kv_head(idx[1], group), j, idx[3]].astype(F32)

    if out is None:
        pv = _sum_terms((B, Hq, Sq, D), Sk,
                        lambda idx, j: [sem.weighted(p[idx[0], idx[1], idx[2], j], v_at(v, idx, j))], "pv")
        mass = _row_mass(p)
        # the backward kernels read the forward op's output, rounded to q's dtype (the JVP's own is not)
        dtype = F32 if online else str(q.dtype)
        out = te.compute((B, Hq, Sq, D), lambda b, h, i, e: sem.normalize(pv[b, h, i, e], mass[b, h, i]).astype(
            dtype).astype(F32), name="out_f32")
    else:
        out = te.compute((B, Hq, Sq, D), lambda *idx: out(*idx).astype(F32), name="out_f32")
    lse_dot = None
    logit_dot = p_dot = None
    if q_dot is not None or k_dot is not None:
        d = te.reduce_axis((0, D), name="d_sdot")

        def score_dot(b, h, i, j):
            g = sem.kv_head(h, group)
            terms = []
            if q_dot is not None:
                terms.append(q_dot[b, h, i, d].astype(F32) * k[b, g, j, d].astype(F32))
            if k_dot is not None:
                terms.append(q[b, h, i, d].astype(F32) * k_dot[b, g, j, d].astype(F32))
            return te.sum(terms[0] if len(terms) == 1 else terms[0] + terms[1], axis=d)

        s_dot = te.compute((B, Hq, Sq, Sk), score_dot, name="s_dot")
        logit_dot = te.compute((B, Hq, Sq, Sk), lambda b, h, i, j: sem.logit_tangent(
            cfg, capped[b, h, i, j], s_dot[b, h, i, j] * scale), name="logit_dot")
        jl = te.reduce_axis((0, Sk), name="j_lse_dot")
        lse_dot = nonempty(te.compute((B, Hq, Sq), lambda b, h, i: te.sum(
            sem.weighted(p[b, h, i, jl], logit_dot[b, h, i, jl]), axis=jl), name="lse_dot_acc"), Sk, 0.0, "lse_dot")
        p_dot = te.compute((B, Hq, Sq, Sk), lambda b, h, i, j: sem.prob_tangent(
            p[b, h, i, j], logit_dot[b, h, i, j], lse_dot[b, h, i]), name="p_dot")
    if p_dot is None and v_dot is None:
        out_dot = _zeros((B, Hq, Sq, D), F32, "out_dot")
    else:
        sums = _sum_terms((B, Hq, Sq, D), Sk, lambda idx, j: [
            None if logit_dot is None else sem.weighted(
                p[idx[0], idx[1], idx[2], j], logit_dot[idx[0], idx[1], idx[2], j] * v_at(v, idx, j)),
            None if v_dot is None else sem.weighted(p[idx[0], idx[1], idx[2], j], v_at(v_dot, idx, j)),
        ], "out_dot_sums")
        out_dot = sums if lse_dot is None else te.compute(
            (B, Hq, Sq, D), lambda b, h, i, e: sums[b, h, i, e] - lse_dot[b, h, i] * out[b, h, i, e], name="out_dot")
    return _Tangent(capped, lse, p, out, logit_dot, p_dot, out_dot)


def flash_attn_jvp(q, k, v, q_dot=None, k_dot=None, v_dot=None, alibi_slopes=None, attn_mask=None, *,
                   cfg: AttnConfig, return_lse: bool = False):
    """Forward mode of dense attention: [out, out_dot] (+ lse), out and out_dot [B, Hq, Sq, D] in
    q's dtype, lse [B, Hq, Sq] float32 (-inf on rows without a visible key). Absent tangents are 0."""
    t = _tangent(q, k, v, q_dot, k_dot, v_dot, cfg, alibi_slopes, attn_mask, online=True)
    results = [_cast(t.out, q.dtype, "out"), _cast(t.out_dot, q.dtype, "out_dot")]
    return results + [t.lse] if return_lse else results


def flash_attn_double_backward(q, k, v, do, dq_bar=None, dk_bar=None, dv_bar=None, alibi_slopes=None,
                               attn_mask=None, out=None, lse=None, *, cfg: AttnConfig):
    """The VJP of ``flash_attn_backward`` with (dq_bar, dk_bar, dv_bar): [q_grad, k_grad, v_grad,
    do_grad] typed like (q, k, v, do). Absent cotangents are 0; ``out``/``lse`` as for the backward.

    With ``do`` held, along the bars: ``dS_dot`` (``semantics.score_grad_tangent``),
    ``q_grad = dS_dot K + dS k_bar``, ``k_grad = dS_dot^T Q + dS^T q_bar``, ``v_grad = P_dot^T dO``
    (both summed over the GQA group) and ``do_grad = out_dot``.
    """
    B, Hq, Sq, D = q.shape
    Hkv, Sk = k.shape[1], k.shape[2]
    group = _dense_layout(q, k).group
    scale = logit_scale(cfg, D)
    t = _tangent(q, k, v, dq_bar, dk_bar, dv_bar, cfg, alibi_slopes, attn_mask, lse, out)
    p, capped = t.p, t.capped
    dp = _row_times_values(do, v, group, "dp")
    row_dot = do_dot_out(do, out, p, dp)
    ds = te.compute((B, Hq, Sq, Sk), lambda b, h, i, j: sem.score_grad(
        cfg, p[b, h, i, j], dp[b, h, i, j], row_dot[b, h, i], capped[b, h, i, j], factor=scale), name="ds")
    zero = tirx.const(0.0, F32)
    ds_dot = None
    if t.p_dot is not None or dv_bar is not None:
        dp_dot = None if dv_bar is None else _row_times_values(do, dv_bar, group, "dp_dot")
        e = te.reduce_axis((0, D), name="d_row_dot")  # D_dot = rowsum(dO * out_dot)
        row_dot_dot = te.compute((B, Hq, Sq), lambda b, h, i: te.sum(
            do[b, h, i, e].astype(F32) * t.out_dot[b, h, i, e], axis=e), name="do_dot_o_dot")

        def at(x, idx):
            return zero if x is None else x[idx]

        ds_dot = te.compute((B, Hq, Sq, Sk), lambda b, h, i, j: sem.score_grad_tangent(
            cfg, p[b, h, i, j], at(t.p_dot, (b, h, i, j)), dp[b, h, i, j], at(dp_dot, (b, h, i, j)), row_dot[b, h, i],
            row_dot_dot[b, h, i], capped[b, h, i, j], at(t.logit_dot, (b, h, i, j)), factor=scale), name="ds_dot")

    def kv(x, idx, j):  # a k-shaped tensor read by query head idx[1]
        return x[idx[0], sem.kv_head(idx[1], group), j, idx[3]].astype(F32)

    def q_terms(idx, j):
        b, h, i, _ = idx
        return [None if ds_dot is None else sem.weighted(ds_dot[b, h, i, j], kv(k, idx, j)),
                None if dk_bar is None else sem.weighted(ds[b, h, i, j], kv(dk_bar, idx, j))]

    def grouped(weight, rhs):
        """``sum_{r, i} weight[b, g group + r, i, j] rhs[b, g group + r, i, e]`` (k/v-shaped)."""
        if weight is None or rhs is None:
            return None

        def term(b, g, j, e, r, i):
            return sem.weighted(weight[b, g * group + r, i, j], rhs[b, g * group + r, i, e].astype(F32))

        return term

    def kv_grad(terms, like, name):
        terms = [t_ for t_ in terms if t_ is not None]
        if not terms:
            return _zeros(like.shape, like.dtype, name)
        r = te.reduce_axis((0, group), name=f"r_{name}")
        i = te.reduce_axis((0, Sq), name=f"i_{name}")
        acc = nonempty(te.compute((B, Hkv, Sk, D), lambda b, g, j, e: te.sum(
            sum((f(b, g, j, e, r, i) for f in terms[1:]), terms[0](b, g, j, e, r, i)), axis=[r, i]),
            name=f"{name}_sum"), Sq, 0.0, f"{name}_acc")
        return _cast(acc, like.dtype, name)

    if ds_dot is None and dk_bar is None:
        q_grad = _zeros(q.shape, q.dtype, "q_grad")
    else:
        q_grad = _cast(_sum_terms((B, Hq, Sq, D), Sk, q_terms, "q_grad_f32"), q.dtype, "q_grad")
    k_grad = kv_grad([grouped(ds_dot, q), grouped(ds, dq_bar)], k, "k_grad")
    v_grad = kv_grad([grouped(t.p_dot, do)], v, "v_grad")
    do_grad = _cast(t.out_dot, do.dtype, "do_grad")
    return [q_grad, k_grad, v_grad, do_grad]


def _cast(t, dtype, name):
    return te.compute(t.shape, lambda *idx: t(*idx).astype(str(dtype)), name=name)


def paged_live_len(block_table, context_lens, block_size):
    """[1] int64: the longest context, clamped to [0, the table's capacity] (0 without
    sequences). The floor gathers this many keys per sequence, not the capacity: a table may be
    sized for millions of blocks of which a few are live."""
    B, max_blocks = block_table.shape
    capacity = sem.as_int64(max_blocks) * sem.as_int64(block_size)
    # one guarded step without sequences: schedules leave an empty reduction's output unwritten
    b = te.reduce_axis((0, tirx.max(B, 1)), name="b")
    zero = tirx.const(0, "int64")

    def length(b):
        return tirx.if_then_else(b < B, tirx.max(tirx.min(sem.as_int64(context_lens[b]), capacity), zero), zero)

    return te.compute((1,), lambda _: te.max(length(b), axis=b), name="live_len")


def sanitize_block_table(block_table, context_lens, num_blocks, block_size, live_blocks):
    """[B, live_blocks] int64 block ids safe to dereference: dead entries -> 0, live ones clamped
    to [0, num_blocks). ``live_blocks`` (<= the table's width) covers the longest context.

    Entries past a sequence's live blocks may hold anything (-1, garbage). Live ids are validated
    before this runs on CPU (see ``legalize``); the clamp keeps every target in bounds regardless.
    """
    B = block_table.shape[0]

    def safe(b, n):
        live = n * block_size < sem.as_int64(context_lens[b])
        block = sem.as_int64(block_table[b, n])
        clamped = tirx.max(tirx.min(block, sem.as_int64(num_blocks) - 1), tirx.const(0, "int64"))
        return tirx.Select(live, clamped, tirx.const(0, "int64"))

    return te.compute((B, live_blocks), safe, name="safe_block_table")


def gather_pages(cache, safe_table, context_lens, live_len, scale=None):
    """The cache [num_blocks, block_size, Hkv, D] gathered to dense [B, Hkv, live_len, D].

    Slots past a sequence's length are 0 and never read (an empty cache has no block to read).
    An 8-bit cache is dequantized to float32 with its ``scale`` ([], [Hkv] or [num_blocks,
    block_size, Hkv]; absent: 1), ``tvm_fuel.op.quant``'s rule.
    """
    _, block_size, Hkv, D = cache.shape
    B = safe_table.shape[0]
    quantized = str(cache.dtype) in quant.QUANT_DTYPES
    dtype = F32 if quantized else str(cache.dtype)

    def element(block, slot, g, e):
        value = sem.as_expr(cache[block, slot, g, e])
        if not quantized:
            return value
        value = quant.decode(value)
        if scale is None:
            return value
        return value * sem.as_expr(quant.scale_at(scale, block, slot, g))

    return te.compute(
        (B, Hkv, live_len, D),
        lambda b, g, j, e: tirx.if_then_else(
            j < sem.as_int64(context_lens[b]), element(safe_table[b, j // block_size], j % block_size, g, e),
            tirx.const(0, dtype)),
        name="gathered")


def paged_attn(q, k_cache, v_cache, block_table, context_lens, alibi_slopes=None, sinks=None, k_scale=None,
               v_scale=None, *, cfg: AttnConfig, live_len):
    """Attention of q [B, Hq, Sq, D] over the paged cache; the Sq queries are each sequence's last.

    ``live_len`` is ``paged_live_len``'s value (a variable of the caller): keys, scores and the
    sanitized table span the longest context, never the table's capacity."""
    num_blocks, block_size = k_cache.shape[0], k_cache.shape[1]
    safe_table = sanitize_block_table(block_table, context_lens, num_blocks, block_size,
                                      (live_len + block_size - 1) // block_size)
    k = gather_pages(k_cache, safe_table, context_lens, live_len, k_scale)
    v = gather_pages(v_cache, safe_table, context_lens, live_len, v_scale)
    sq = q.shape[2]
    layout = _Layout(
        group=q.shape[1] // k_cache.shape[2],
        kv_len=lambda b: sem.as_int64(context_lens[b]),
        delta=lambda b: sem.as_int64(context_lens[b]) - sq)
    return _attend(q, k, v, cfg, layout, alibi_slopes, None, sinks, False)


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


def _x_hat(x, mean, rstd, n, c, acc):
    """x_hat[n, c] of a norm: (x - mean) * rstd, or x * rstd without a mean (RMS)."""
    centered = x[n, c].astype(acc) if mean is None else x[n, c].astype(acc) - mean[n]
    return centered * rstd[n]


def norm_backward_row_mean(dy, x, gamma, mean, rstd, *, times_x_hat: bool):
    """[N] in the statistics' dtype: mean_C(g) or, ``times_x_hat``, mean_C(g * x_hat), g = dy * gamma."""
    rows, features = x.shape
    acc = str(rstd.dtype)
    c = te.reduce_axis((0, features), name="c")

    def term(n, c):
        g = dy[n, c].astype(acc) * gamma[c].astype(acc)
        return g * _x_hat(x, mean, rstd, n, c, acc) if times_x_hat else g

    total = te.compute((rows,), lambda n: te.sum(term(n, c), axis=c), name="row_sum")
    return te.compute((rows,), lambda n: total[n] / features.astype(acc), name="row_mean")


def norm_backward_dx(dy, x, gamma, mean, rstd, g_mean, gx_mean):
    """dx [N, C] = rstd (g - g_mean - x_hat gx_mean) (``g_mean`` None: RMS norm's, no centering)."""
    acc = str(rstd.dtype)

    def dx(n, c):
        g = dy[n, c].astype(acc) * gamma[c].astype(acc)
        centered = g if g_mean is None else g - g_mean[n]
        return (rstd[n] * (centered - _x_hat(x, mean, rstd, n, c, acc) * gx_mean[n])).astype(str(x.dtype))

    return te.compute(x.shape, dx, name="dx")


def norm_backward_column_sum(dy, x, mean, rstd, *, times_x_hat: bool):
    """[C], dtype of dy: sum_N(dy * x_hat) (dgamma) or, without ``times_x_hat``, sum_N(dy) (dbeta)."""
    rows, features = x.shape
    acc = str(rstd.dtype)
    # no rows: the sum is 0, but TVM's schedules leave an empty reduction's output unwritten; one
    # guarded step (no read) writes the 0
    n = te.reduce_axis((0, tirx.max(rows, 1)), name="n")

    def term(n, c):
        value = dy[n, c].astype(acc) * _x_hat(x, mean, rstd, n, c, acc) if times_x_hat else dy[n, c].astype(acc)
        return tirx.if_then_else(n < rows, value, tirx.const(0, acc))

    total = te.compute((features,), lambda c: te.sum(term(n, c), axis=n), name="column_sum")
    return te.compute((features,), lambda c: total[c].astype(str(dy.dtype)), name="weight_grad")
