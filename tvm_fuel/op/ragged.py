"""TE compute of the packed variable-length ops (``flash_attn_varlen`` and its backward): their floor.

Layout (FlashAttention's varlen): q, do, out [TQ, Hq, D]; k, v [TK, Hkv, D]; cu_seqlens_q,
cu_seqlens_k [B + 1]; lse [Hq, TQ]. Query row i belongs to sequence ``#{b : cu_q[b + 1] <= i}``
(B for a row past the last sequence: it sees no key). Key j of a row is key row ``cu_k[b] + j``.

The scores are materialized per query row over the longest sequence's keys, as a batch of one
[1, Hq, TQ, max_k], so the dense floor's softmax steps (``tvm_fuel.op.decompose``) serve them
unchanged; dk and dv gather per key row over the longest sequence's queries. The floor's work is
TQ * max_k (TK * max_q for dk, dv), not B * max^2. Every index read from cu_seqlens is clamped in
range, so malformed offsets (the legalization checks them on CPU targets) cannot read out of
bounds on any target.

Contents:
    varlen_live_lens           -- [2] int64: the longest query and key sequences (how far the floor gathers)
    flash_attn_varlen          -- out [TQ, Hq, D] (+ lse [Hq, TQ])
    flash_attn_varlen_backward -- dq, dk, dv
"""

from __future__ import annotations

from dataclasses import dataclass

from tvm import te, tirx

from . import semantics as sem
from .config import AttnConfig
from .decompose import do_dot_out, logit_scale, nonempty, probabilities, softmax_stats

F32 = "float32"
I64 = "int64"


def _clamped(x, lo, hi):
    return tirx.max(tirx.min(x, hi), lo)


def _offset(cu: te.Tensor, b):
    """``cu[b]`` (int64), b clamped into the tensor."""
    b = b.var if isinstance(b, tirx.IterVar) else b
    return sem.as_int64(cu[_clamped(sem.as_int64(b), tirx.const(0, I64), cu.shape[0] - 1)])


def varlen_live_lens(q: te.Tensor, k: te.Tensor, cu_seqlens_q: te.Tensor, cu_seqlens_k: te.Tensor) -> te.Tensor:
    """[2] int64: the longest query and key sequences (lengths clamped to [0, TQ] and [0, TK]; 0
    without sequences): how far the floor gathers."""
    b = te.reduce_axis((0, cu_seqlens_q.shape[0] - 1), name="b_live")

    def longest(side):
        cu, total = (cu_seqlens_q, q.shape[0]) if side == 0 else (cu_seqlens_k, k.shape[0])
        return _clamped(_offset(cu, b.var + 1) - _offset(cu, b), tirx.const(0, I64), sem.as_int64(total))

    acc = te.compute((2,), lambda side: te.max(tirx.Select(side == 0, longest(0), longest(1)), axis=b),
                     name="longest_acc")
    return te.compute((2,), lambda side: tirx.Select(cu_seqlens_q.shape[0] > 1, acc[side], tirx.const(0, I64)),
                      name="longest")


def _sequence_of(cu: te.Tensor, total, name: str) -> te.Tensor:
    """[total] int64: the sequence of each row (B past the last one)."""
    b = te.reduce_axis((0, cu.shape[0] - 1), name=f"b_{name}")
    count = te.compute((total,), lambda i: te.sum(tirx.Select(_offset(cu, b.var + 1) <= i, tirx.const(1, I64),
                                                               tirx.const(0, I64)), axis=b), name=f"{name}_acc")
    return te.compute((total,), lambda i: tirx.Select(cu.shape[0] > 1, count[i], tirx.const(0, I64)), name=name)


@dataclass(frozen=True)
class _Sequences:
    """Where each packed row's sequence starts and how long it is, on both sides."""

    cu_q: te.Tensor
    cu_k: te.Tensor
    seq: te.Tensor  # [rows] int64, the sequence of each row of this side

    def at(self, row):
        """(valid, b, q0, Sq_b, k0, Sk_b) of the sequence of ``row``; b clamped."""
        b = self.seq[row]
        valid = b < self.cu_q.shape[0] - 1
        q0, k0 = _offset(self.cu_q, b), _offset(self.cu_k, b)
        return valid, q0, _offset(self.cu_q, b + 1) - q0, k0, _offset(self.cu_k, b + 1) - k0


def _row_index(base, offset, total):
    offset = offset.var if isinstance(offset, tirx.IterVar) else offset
    return _clamped(base + sem.as_int64(offset), tirx.const(0, I64), sem.as_int64(total) - 1)


def _logits(q, k, cu_q, cu_k, alibi_slopes, cfg: AttnConfig, max_k):
    """(rows, capped, logits), scores [1, Hq, TQ, max_k]: ``softcap(scale * q.k)`` and the final
    logits (ALiBi, -inf at dropped keys and in rows of no sequence)."""
    TQ, Hq, D = q.shape
    TK = k.shape[0]
    group = Hq // k.shape[1]
    rows = _Sequences(cu_q, cu_k, _sequence_of(cu_q, TQ, "row_sequence"))
    d = te.reduce_axis((0, D), name="d")

    def key(i, j):
        return _row_index(rows.at(i)[3], j, TK)

    qk = te.compute((1, Hq, TQ, max_k), lambda _, h, i, j: te.sum(
        q[i, h, d].astype(F32) * k[key(i, j), sem.kv_head(h, group), d].astype(F32), axis=d), name="qk")
    step = logit_scale(cfg, D)
    capped = te.compute(qk.shape, lambda _, h, i, j: sem.softcap(cfg, qk[0, h, i, j] * step), name="capped")

    def logit(_, h, i, j):
        valid, q0, sq, _k0, sk = rows.at(i)
        position, delta = sem.as_int64(i) - q0, sk - sq
        valid = tirx.all(valid, position >= 0)  # malformed offsets (GPU builds: unchecked) drop the row
        s = capped[0, h, i, j]
        if alibi_slopes is not None:
            s = s + sem.alibi_bias(alibi_slopes[h], position, j, delta=delta)
        return sem.masked(tirx.all(valid, sem.keep(cfg, position, j, kv_len=sk, delta=delta)), s)

    return rows, capped, te.compute(qk.shape, logit, name="logits")


def _heads_first(x: te.Tensor, name: str) -> te.Tensor:
    """[TQ, Hq, D] as the dense [1, Hq, TQ, D]."""
    return te.compute((1, x.shape[1], x.shape[0], x.shape[2]), lambda _, h, i, e: x[i, h, e], name=name)


def _gather_keys(weights, rows, k, values, name):
    """``out[i, h, e] = sum_j weights[0, h, i, j] * values[key(i, j), kv_head(h), e]`` [TQ, Hq, D] float32."""
    _, Hq, TQ, max_k = weights.shape
    group = Hq // values.shape[1]
    j = te.reduce_axis((0, max_k), name=f"j_{name}")
    acc = te.compute((TQ, Hq, values.shape[2]), lambda i, h, e: te.sum(sem.weighted(
        weights[0, h, i, j], values[_row_index(rows.at(i)[3], j, k.shape[0]), sem.kv_head(h, group), e].astype(F32)),
        axis=j), name=f"{name}_sum")
    return nonempty(acc, max_k, 0.0, f"{name}_acc")


def flash_attn_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, alibi_slopes=None, sinks=None, *, cfg: AttnConfig,
                      max_k, return_lse: bool = False):
    """out [TQ, Hq, D] (q's dtype) and, with ``return_lse``, lse [Hq, TQ] float32; ``max_k``: the
    longest key sequence (``varlen_live_lens``)."""
    rows, _, logits = _logits(q, k, cu_seqlens_q, cu_seqlens_k, alibi_slopes, cfg, max_k)
    p, row_sum, lse = softmax_stats(logits, sinks)
    acc = _gather_keys(p, rows, k, v, "pv")
    out = te.compute(q.shape, lambda i, h, e: sem.normalize(acc[i, h, e], row_sum[0, h, i]).astype(str(q.dtype)),
                     name="out")
    if not return_lse:
        return out

    def packed_lse(h, i):
        # a row of no sequence is -inf even with sinks (the sink column weighs rows of a sequence)
        valid, q0 = rows.at(i)[:2]
        return tirx.Select(tirx.all(valid, sem.as_int64(i) >= q0), lse[0, h, i], sem.NEG_INF)

    return [out, te.compute((q.shape[1], q.shape[0]), packed_lse, name="lse_packed")]


def flash_attn_varlen_backward(q, k, v, do, cu_seqlens_q, cu_seqlens_k, alibi_slopes=None, out=None, lse=None,
                               sinks=None, *, cfg: AttnConfig, max_q, max_k):
    """[dq, dk, dv] of ``flash_attn_varlen`` (q's, k's, v's shapes and dtype); ``out`` and ``lse``
    (the forward's) used when given, as the dense floor uses them."""
    TQ, Hq, D = q.shape
    TK, Hkv = k.shape[0], k.shape[1]
    group = Hq // Hkv
    rows, capped, logits = _logits(q, k, cu_seqlens_q, cu_seqlens_k, alibi_slopes, cfg, max_k)
    if lse is None:
        lse4 = softmax_stats(logits, sinks)[2]
    else:
        lse4 = te.compute((1, Hq, TQ), lambda _, h, i: lse[h, i], name="lse4")
    p = probabilities(logits, lse4)
    d = te.reduce_axis((0, D), name="d_dp")
    dp = te.compute(logits.shape, lambda _, h, i, j: te.sum(
        do[i, h, d].astype(F32) * v[_row_index(rows.at(i)[3], j, TK), sem.kv_head(h, group), d].astype(F32),
        axis=d), name="dp")
    sink_p = None if sinks is None else te.compute(
        lse4.shape, lambda _, h, i: sem.probability(sinks[h], lse4[0, h, i]), name="sink_p")
    row_dot = do_dot_out(_heads_first(do, "do4"), None if out is None else _heads_first(out, "out4"), p, dp, sink_p)
    step = logit_scale(cfg, D)
    ds = te.compute(logits.shape, lambda _, h, i, j: sem.weighted(
        p[0, h, i, j], (dp[0, h, i, j] - row_dot[0, h, i]) * sem.softcap_grad(cfg, capped[0, h, i, j]) * step),
        name="ds")
    dq = _gather_keys(ds, rows, k, k, "dq")
    keys = _Sequences(cu_seqlens_q, cu_seqlens_k, _sequence_of(cu_seqlens_k, TK, "key_sequence"))

    def key_grad(weights, rhs, name):
        # key row t gathers the query heads of its group over its sequence's query rows
        r = te.reduce_axis((0, group), name=f"r_{name}")
        i = te.reduce_axis((0, max_q), name=f"i_{name}")

        def body(t, g, e):
            valid, q0, sq, k0, sk = keys.at(t)
            row = _row_index(q0, i, TQ)
            offset = sem.as_int64(t) - k0  # the key's column in its sequence's rows of scores
            column = _clamped(offset, tirx.const(0, I64), sem.as_int64(max_k) - 1)
            term = sem.weighted(weights[0, g * group + r, row, column], rhs[row, g * group + r, e].astype(F32))
            # the guard holds only for columns inside [0, Sk_b) <= [0, max_k): no read of an empty tensor
            inside = tirx.all(valid, sem.as_int64(i.var) < sq, offset >= 0, offset < sk)
            return te.sum(tirx.if_then_else(inside, term, tirx.const(0.0, F32)), axis=[r, i])

        return nonempty(te.compute((TK, Hkv, D), body, name=f"{name}_sum"), max_q, 0.0, f"{name}_acc")

    grads = [dq, key_grad(ds, q, "dk"), key_grad(p, do, "dv")]
    return [_cast(g, like.dtype, name) for g, like, name in zip(grads, (q, k, v), ("dq", "dk", "dv"))]


def _cast(t: te.Tensor, dtype, name: str) -> te.Tensor:
    return te.compute(t.shape, lambda *idx: t(*idx).astype(str(dtype)), name=name)


__all__ = ["varlen_live_lens", "flash_attn_varlen", "flash_attn_varlen_backward"]
