"""CPU kernels of the higher-order ops: forward mode (``flash_attn_jvp``) and the backward's
vector-Jacobian product (``flash_attn_double_backward``). Both stream key tiles: nothing is
[Sq, Sk]; scratch per task is O((block_q + block_k) * D), and K, V and their tangents are packed
once per KV head into float32 tiles (O(Sk * D)); the double backward also packs its query rows and
their statistics between its stages (O(Sq * D)).

Both carry a tangent direction through the attention of a query tile (JVP: q_dot, k_dot, v_dot;
double backward: the cotangents dq_bar, dk_bar, dv_bar, the direction along which the backward
is differentiated, ``tvm_fuel.reference.flash_attn_double_backward``):

    S_dot = scale (q_dot k^T + q k_dot^T),  logit_dot = softcap'(capped) S_dot,
    lse_dot = rowsum(P logit_dot),  out_dot = (P logit_dot) V + P v_dot - lse_dot out

``_TangentPass`` runs that over the key tiles of one query tile, either with the online softmax
(the JVP: out, lse and out_dot in one pass, the tangent's sums rescaled with the output's) or with
the forward's lse (the double backward's first stage, which also takes D = rowsum(do out) and
D_dot = rowsum(do out_dot), the row statistics of its second stage).

The double backward's second stage is the backward's key-tile task (``schedules.cpu.backward``)
differentiated along the cotangents with ``do`` held: per (batch, KV head, split of the key
tiles), for every query tile that sees a key tile, P, P_dot, dS and dS_dot are recomputed
(``semantics.prob_tangent`` / ``score_grad_tangent``) and

    v_grad += P_dot^T do,  k_grad += dS_dot^T q + dS^T dq_bar,  q_grad += dS_dot k + dS dk_bar

with q_grad in per-split partials summed at the end (no races, as the backward's dq); do_grad is
out_dot. Terms of an absent tangent or cotangent are not computed.

Finite inputs: the GEMMs do not skip zero weights (the NaN rule is not modelled for tangents, as in
``tvm_fuel.reference``); a dropped key still weighs exactly 0.

Contents:
    flash_jvp             -- PrimFunc(q, k, v, [q_dot], [k_dot], [v_dot], [alibi], [mask], out, out_dot, [lse])
    flash_double_backward -- PrimFunc(q, k, v, do, [dq_bar], [dk_bar], [dv_bar], [alibi], [mask], out, lse,
                             q_grad, k_grad, v_grad, do_grad)
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping

from tvm import tirx
from tvm.script import tirx as T

from ... import semantics as sem
from ..common import (F32, balanced_order, biased, drop_params, finish, key_tile_range, KernelSpec, masked_logit,
                      param_buffers, query_tile_range, shape_vars, visible)
from .common import absent_inputs, Buffers
from .micro import lane_tree, Micro
from .tiles import CpuTiles

JVP_TANGENTS = ("q_dot", "k_dot", "v_dot")
COTANGENTS = ("dq_bar", "dk_bar", "dv_bar")


def _add(a, b):
    return a + b


@dataclass(frozen=True)
class _Params(Buffers):
    """The parameter buffers the macros read; the direction (``q_t``, ``k_t``, ``v_t``: the JVP's
    tangents or the double backward's cotangents) is None where absent, as are ALiBi, the mask
    and ``lse`` / ``do`` / ``out`` where the kernel has none."""

    q: tirx.Buffer
    k: tirx.Buffer
    v: tirx.Buffer
    q_t: tirx.Buffer | None = None
    k_t: tirx.Buffer | None = None
    v_t: tirx.Buffer | None = None
    alibi: tirx.Buffer | None = None
    mask: tirx.Buffer | None = None
    do: tirx.Buffer | None = None
    out: tirx.Buffer | None = None
    lse: tirx.Buffer | None = None


@dataclass(frozen=True)
class _Direction:
    """Which parts of the direction are present (Python flags: absent terms are not emitted)."""

    q: bool
    k: bool
    v: bool

    @staticmethod
    def of(names: tuple[str, ...], present: tuple[str, ...]) -> _Direction:
        return _Direction(*(name in present for name in names))

    @property
    def scores(self) -> bool:
        """Whether S_dot is not identically 0."""
        return self.q or self.k


@dataclass(frozen=True)
class _Rows:
    """A row task's float32 scratch: the query tile (q, its tangent) [block_q, DP]; per row the
    softmax state (m, l, alpha, or the forward's lse), the tangent's lse_dot accumulator
    [block_q]; the output and tangent accumulators [block_q, DP]."""

    Qs: tirx.Buffer
    Qt: tirx.Buffer
    m: tirx.Buffer
    l: tirx.Buffer
    alpha: tirx.Buffer
    lse_dot: tirx.Buffer
    O: tirx.Buffer
    Ot: tirx.Buffer


@dataclass(frozen=True)
class _KeyTile:
    """One key tile, float32: K^T and its tangent [D, block_k] (score GEMMs vectorize over keys), V
    and its tangent [block_k, DP]. Packed once per KV head for every query tile's task (packing per
    task had cost the JVP ~30 %); an absent tangent's tile is a placeholder never read."""

    Kt: tirx.Buffer
    Ktt: tirx.Buffer
    Vn: tirx.Buffer
    Vtn: tirx.Buffer


@dataclass(frozen=True)
class _Scores:
    """A row task's score tiles [block_q, block_k]: S, S_dot and the capped scores."""

    S: tirx.Buffer
    St: tirx.Buffer
    Cap: tirx.Buffer


@dataclass(frozen=True)
class _RowTile:
    """The query tile of a row task: batch ``b``, query head ``h``, first position ``i0``."""

    b: tirx.PrimExpr
    h: tirx.PrimExpr
    i0: tirx.PrimExpr


class _TangentPass:
    """The macros of the tangent pass over the key tiles of one query tile (module docstring).

    ``online``: the JVP's online softmax (S in log2 units, exponentials exp2); otherwise P comes
    from the forward's lse held in ``rows.m``.
    """

    def __init__(self, spec: KernelSpec, tiles: CpuTiles, direction: _Direction, B, Sq, Sk, *, online: bool):
        micro = Micro(tiles)
        cfg, D = spec.cfg, spec.head_dim
        BQ, BK, L = tiles.block_q, tiles.block_k, tiles.lanes
        DP = tiles.padded_dim(D)
        KV, DV = tiles.key_vecs, tiles.dim_vecs
        scale = spec.scale
        group, Hkv = spec.group, spec.num_kv_heads
        n_key_tiles = (Sk + BK - 1) // BK
        softcapped = cfg.softcap > 0
        dead_weight = float("-inf") if online else 0.0  # a row past Sq: a logit (online) or P

        def capped(scores, r, c):
            # the softcapped scaled score, kept in Cap only where softcap' needs it
            return scores.Cap[r, c] if softcapped else scores.S[r, c] * T.float32(scale)

        @T.macro
        def load_rows(rows, params, tile):
            for r in range(BQ):
                if tile.i0 + r < Sq:
                    for d in range(D):
                        rows.Qs[r, d] = params.q[tile.b, tile.h, tile.i0 + r, d].astype(F32)
                        if direction.q:
                            rows.Qt[r, d] = params.q_t[tile.b, tile.h, tile.i0 + r, d].astype(F32)
                    if not online:
                        rows.m[r] = params.lse[tile.b, tile.h, tile.i0 + r]
                else:
                    for d in range(D):
                        rows.Qs[r, d] = T.float32(0)
                        if direction.q:
                            rows.Qt[r, d] = T.float32(0)
                    if not online:
                        rows.m[r] = T.float32(float("-inf"))
                for d in range(D, DP):
                    rows.Qs[r, d] = T.float32(0)
                    if direction.q:
                        rows.Qt[r, d] = T.float32(0)
                if online:
                    rows.m[r] = T.float32(float("-inf"))
                    rows.l[r] = T.float32(0)
                rows.lse_dot[r] = T.float32(0)
                for d in T.vectorized(DP):
                    rows.O[r, d] = T.float32(0)
                    rows.Ot[r, d] = T.float32(0)

        @T.macro
        def load_keys(keys, params, b, g, kt):
            for c in range(BK):
                if kt * BK + c < Sk:
                    for d in range(D):
                        keys.Kt[d, c] = params.k[b, g, kt * BK + c, d].astype(F32)
                        keys.Vn[c, d] = params.v[b, g, kt * BK + c, d].astype(F32)
                        if direction.k:
                            keys.Ktt[d, c] = params.k_t[b, g, kt * BK + c, d].astype(F32)
                        if direction.v:
                            keys.Vtn[c, d] = params.v_t[b, g, kt * BK + c, d].astype(F32)
                else:
                    for d in range(D):
                        keys.Kt[d, c] = T.float32(0)
                        keys.Vn[c, d] = T.float32(0)
                        if direction.k:
                            keys.Ktt[d, c] = T.float32(0)
                        if direction.v:
                            keys.Vtn[c, d] = T.float32(0)
                for d in range(D, DP):
                    keys.Vn[c, d] = T.float32(0)
                    if direction.v:
                        keys.Vtn[c, d] = T.float32(0)

        @T.macro
        def weights(rows, scores, params, tile, key_start):
            # S -> the softmax weights (online: log2-unit logits, exponentiated by the online
            # softmax after; else P from lse); S_dot -> logit_dot
            for r in range(BQ):
                if tile.i0 + r < Sq:
                    for c in T.vectorized(BK):
                        if softcapped:
                            scores.Cap[r, c] = sem.softcap(cfg, scores.S[r, c] * T.float32(scale), fast=True)
                        if direction.scores:
                            scores.St[r, c] = sem.logit_tangent(cfg, capped(scores, r, c),
                                                              scores.St[r, c] * T.float32(scale))
                        if online:
                            scores.S[r, c] = masked_logit(spec, capped(scores, r, c), params.alibi, params.mask, tile.b,
                                                        tile.h, tile.i0 + r, key_start + c, Sk,
                                                        Sk - Sq) * T.float32(sem.LOG2E)
                        else:
                            scores.S[r, c] = T.Select(
                                visible(spec, params.mask, tile.b, tile.h, tile.i0 + r, key_start + c, Sk, Sk - Sq),
                                sem.probability(biased(spec, capped(scores, r, c), params.alibi, params.mask, tile.b,
                                                       tile.h, tile.i0 + r, key_start + c, Sk - Sq), rows.m[r],
                                                fast=True),
                                T.float32(0))
                else:  # rows past Sq weigh nothing
                    for c in T.vectorized(BK):
                        scores.S[r, c] = T.float32(dead_weight)
                        if direction.scores:
                            scores.St[r, c] = T.float32(0)

        @T.macro
        def tangent_sums(rows, scores):
            # St <- W = P * logit_dot (exactly 0 where P is); lse_dot (* alpha) += rowsum(W)
            for r in range(BQ):
                part = T.alloc_buffer((L,), F32, scope="local")
                for v in T.vectorized(L):
                    part[v] = T.float32(0)
                for c0 in range(BK // L):
                    for v in T.vectorized(L):
                        scores.St[r, c0 * L + v] = sem.weighted(scores.S[r, c0 * L + v], scores.St[r, c0 * L + v])
                        part[v] = part[v] + scores.St[r, c0 * L + v]
                if online:
                    rows.lse_dot[r] = rows.lse_dot[r] * rows.alpha[r] + lane_tree(_add, part, L)
                else:
                    rows.lse_dot[r] = rows.lse_dot[r] + lane_tree(_add, part, L)

        def tile_offset(b, g, kt, size: int):
            # element offset of packed tile (b, g, kt)
            return ((b * Hkv + g) * n_key_tiles + kt) * size

        def data(packed, name: str, present: bool = True):
            # the packed buffer's data; an absent tangent's view aliases its primal's (never read)
            return getattr(packed, name if present else {"Ktt": "Kt", "Vtn": "Vn"}[name]).data

        @T.macro
        def pack(packed, params, index):
            # key tile ``index`` (of B x Hkv x key tiles) into the packed buffers
            b = T.meta_var(index // (Hkv * n_key_tiles))
            g = T.meta_var(index // n_key_tiles % Hkv)
            kt = T.meta_var(index % n_key_tiles)
            Kt = T.decl_buffer((D, BK), F32, data=data(packed, "Kt"), elem_offset=tile_offset(b, g, kt, D * BK))
            Ktt = T.decl_buffer((D, BK), F32, data=data(packed, "Ktt", direction.k),
                                elem_offset=tile_offset(b, g, kt, D * BK))
            Vn = T.decl_buffer((BK, DP), F32, data=data(packed, "Vn"), elem_offset=tile_offset(b, g, kt, BK * DP))
            Vtn = T.decl_buffer((BK, DP), F32, data=data(packed, "Vtn", direction.v),
                                elem_offset=tile_offset(b, g, kt, BK * DP))
            keys = T.meta_var(_KeyTile(Kt, Ktt, Vn, Vtn))
            load_keys(keys, params, b, g, kt)

        @T.macro
        def key_tile(rows, scores, packed, params, tile, kt):
            g = T.meta_var(sem.kv_head(tile.h, group))
            Kt = T.decl_buffer((D, BK), F32, data=data(packed, "Kt"), elem_offset=tile_offset(tile.b, g, kt, D * BK))
            Ktt = T.decl_buffer((D, BK), F32, data=data(packed, "Ktt", direction.k),
                                elem_offset=tile_offset(tile.b, g, kt, D * BK))
            Vn = T.decl_buffer((BK, DP), F32, data=data(packed, "Vn"),
                               elem_offset=tile_offset(tile.b, g, kt, BK * DP))
            Vtn = T.decl_buffer((BK, DP), F32, data=data(packed, "Vtn", direction.v),
                                elem_offset=tile_offset(tile.b, g, kt, BK * DP))
            micro.gemm(scores.S, rows.Qs, Kt, BQ, BK, D, KV)
            if direction.q:
                micro.gemm(scores.St, rows.Qt, Kt, BQ, BK, D, KV)
            if direction.k:
                micro.gemm(scores.St, rows.Qs, Ktt, BQ, BK, D, KV, accumulate=direction.q)
            weights(rows, scores, params, tile, kt * BK)
            if online:
                micro.online_softmax(scores.S, rows.m, rows.l, rows.alpha, BQ, BK)
                micro.gemm(rows.O, scores.S, Vn, BQ, DP, BK, DV, accumulate=True, row_scale=rows.alpha)
            if direction.scores:
                tangent_sums(rows, scores)
                if online:
                    micro.gemm(rows.Ot, scores.St, Vn, BQ, DP, BK, DV, accumulate=True, row_scale=rows.alpha)
                else:
                    micro.gemm(rows.Ot, scores.St, Vn, BQ, DP, BK, DV, accumulate=True)
            elif online:  # no score tangent: the accumulator still follows the running max
                micro.scale_rows(rows.Ot, rows.alpha, BQ, DP)
            if direction.v:
                micro.gemm(rows.Ot, scores.S, Vtn, BQ, DP, BK, DV, accumulate=True)

        @T.macro
        def run(rows, scores, packed, params, tile):
            load_rows(rows, params, tile)
            lo, hi = key_tile_range(cfg, first_pos=tile.i0, last_pos=T.min(tile.i0 + BQ, Sq) - 1, kv_len=Sk,
                                    delta=Sk - Sq, block_k=BK)
            for kt in range(lo, hi):
                key_tile(rows, scores, packed, params, tile, kt)

        @T.macro
        def task(Qs, Qt, packed, params, tile, stores, outputs):
            # one row task: its scratch (the query tile Qs, Qt comes from the kernel), the pass over
            # the key tiles, then ``stores(rows, tile, outputs)``: the kernel's stores
            m = T.alloc_buffer((BQ,), F32)
            l = T.alloc_buffer((BQ,), F32)
            alpha = T.alloc_buffer((BQ,), F32)
            lse_dot = T.alloc_buffer((BQ,), F32)
            O = T.alloc_buffer((BQ, DP), F32)
            Ot = T.alloc_buffer((BQ, DP), F32)
            S = T.alloc_buffer((BQ, BK), F32)
            St = T.alloc_buffer((BQ, BK), F32)
            Cap = T.alloc_buffer((BQ, BK), F32)
            rows = T.meta_var(_Rows(Qs, Qt, m, l, alpha, lse_dot, O, Ot))
            scores = T.meta_var(_Scores(S, St, Cap))
            run(rows, scores, packed, params, tile)
            stores(rows, tile, outputs)

        # the packed buffers: K^T, K_dot^T, V, V_dot [B, Hkv, key tiles, tile]; (1,) for an absent
        # tangent (its views alias the primal's)
        tiles_of = (B, Hkv, n_key_tiles)
        packed_shapes = [(*tiles_of, D, BK), (*tiles_of, D, BK) if direction.k else (1,),
                         (*tiles_of, BK, DP), (*tiles_of, BK, DP) if direction.v else (1,)]
        Hq = spec.num_q_heads
        n_query_tiles = (Sq + BQ - 1) // BQ

        @T.macro
        def stage(params, stores, outputs):
            # K, V and their tangents packed once; then a task per (batch, query head, query tile)
            packed_kt = T.alloc_buffer(packed_shapes[0], F32)
            packed_ktt = T.alloc_buffer(packed_shapes[1], F32)
            packed_vn = T.alloc_buffer(packed_shapes[2], F32)
            packed_vtn = T.alloc_buffer(packed_shapes[3], F32)
            packed = T.meta_var(_KeyTile(packed_kt, packed_ktt, packed_vn, packed_vtn))
            for index in T.parallel(B * Hkv * n_key_tiles):
                pack(packed, params, index)
            for row_task in T.parallel(B * Hq * n_query_tiles):
                # bound once: inlined into every index, these divisions had made compiling 7x slower
                b: T.int64 = row_task // (Hq * n_query_tiles)
                h: T.int64 = row_task // n_query_tiles % Hq
                i0: T.int64 = balanced_order(row_task % n_query_tiles, n_query_tiles) * BQ
                Qs = T.alloc_buffer((BQ, DP), F32)
                Qt = T.alloc_buffer((BQ, DP), F32)
                tile = T.meta_var(_RowTile(b, h, i0))
                task(Qs, Qt, packed, params, tile, stores, outputs)

        self.stage = stage


def flash_jvp(spec: KernelSpec, tiles: CpuTiles, *, tangents: tuple[str, ...],
              dims: Mapping[str, int | None] | None = None) -> tirx.PrimFunc:
    """The JVP kernel along the present ``tangents`` (of q_dot, k_dot, v_dot): out, out_dot (and lse
    with ``spec.return_lse``) in one online-softmax pass per (batch, query head, query tile)."""
    B, Sq, Sk = shape_vars(dims or {}, ("B", "Sq", "Sk"))
    direction = _Direction.of(JVP_TANGENTS, tangents)
    tangent_pass = _TangentPass(spec, tiles, direction, B, Sq, Sk, online=True)
    dtype, D, BQ = spec.dtype, spec.head_dim, tiles.block_q
    unused = absent_inputs(spec) | {t for t in JVP_TANGENTS if t not in tangents} | (
        set() if spec.return_lse else {"lse"})

    @T.macro
    def store(rows, tile, outputs):
        # out = O / l, out_dot = Ot / l - lse_dot out (lse_dot = its sum / l), lse; 0 on empty rows
        for r in range(BQ):
            if tile.i0 + r < Sq:
                lse_dot: T.float32 = sem.normalize(rows.lse_dot[r], rows.l[r])
                for d in range(D):
                    o: T.float32 = sem.normalize(rows.O[r, d], rows.l[r])
                    outputs.out[tile.b, tile.h, tile.i0 + r, d] = o.astype(dtype)
                    outputs.out_dot[tile.b, tile.h, tile.i0 + r, d] = (
                        sem.normalize(rows.Ot[r, d], rows.l[r]) - lse_dot * o).astype(dtype)
                if spec.return_lse:
                    outputs.lse[tile.b, tile.h, tile.i0 + r] = sem.log_sum_exp(
                        sem.safe_row_max(rows.m[r]) * T.float32(sem.LN2), rows.l[r])

    # fmt: off
    @T.prim_func
    def fuel_flash_attn_jvp_cpu(q_h: T.handle, k_h: T.handle, v_h: T.handle, q_dot_h: T.handle, k_dot_h: T.handle,
                                v_dot_h: T.handle, alibi_h: T.handle, mask_h: T.handle, out_h: T.handle,
                                out_dot_h: T.handle, lse_h: T.handle):
        T.func_attr({"tirx.noalias": True})
        q, k, v, q_dot, k_dot, v_dot, alibi, mask, out, out_dot, lse = param_buffers(
            spec, dict(B=B, Sq=Sq, Sk=Sk), q=q_h, k=k_h, v=v_h, q_dot=q_dot_h, k_dot=k_dot_h, v_dot=v_dot_h,
            alibi=alibi_h, mask=mask_h, out=out_h, out_dot=out_dot_h, lse=lse_h)
        params = T.meta_var(_Params.of(unused, q=q, k=k, v=v, q_t=q_dot, k_t=k_dot, v_t=v_dot, alibi=alibi,
                                       mask=mask))
        outputs = T.meta_var(_JvpOutputs(out, out_dot, lse))
        tangent_pass.stage(params, store, outputs)
    # fmt: on

    return finish(drop_params(fuel_flash_attn_jvp_cpu, unused))


@dataclass(frozen=True)
class _JvpOutputs:
    """The JVP kernel's outputs: out, out_dot [B, Hq, Sq, D]; lse [B, Hq, Sq] (None without it)."""

    out: tirx.Buffer
    out_dot: tirx.Buffer
    lse: tirx.Buffer | None


@dataclass(frozen=True)
class _FirstStage:
    """What the double backward's first stage reads and writes besides the tangent pass: do and
    the forward's out, do_grad, the packed query tiles and the q_grad partials it zeroes."""

    do: tirx.Buffer
    out: tirx.Buffer
    do_grad: tirx.Buffer
    query: _QueryTiles
    q_part: tirx.Buffer


@dataclass(frozen=True)
class _QueryTiles:
    """What the double backward's first stage leaves for its second, per query row (rows padded to
    whole query tiles, float32): q, dq_bar and do [B, Hq, padded Sq, DP] (dq_bar aliases q when
    absent: never read), and lse, lse_dot, D = rowsum(do out), D_dot = rowsum(do out_dot)
    [B, Hq, padded Sq]. The second stage's steps read views of them, packed once."""

    q: tirx.Buffer
    q_bar: tirx.Buffer
    do: tirx.Buffer
    lse: tirx.Buffer
    lse_dot: tirx.Buffer
    d_row: tirx.Buffer
    d_row_dot: tirx.Buffer

    @staticmethod
    def of(has_q_bar: bool, q, q_bar, *rest) -> _QueryTiles:
        return _QueryTiles(q, q_bar if has_q_bar else q, *rest)


@dataclass(frozen=True)
class _QueryTile:
    """Views of one query tile of ``_QueryTiles``: q, dq_bar, do [block_q, DP]; lse, lse_dot, D,
    D_dot [block_q]."""

    Qs: tirx.Buffer
    Qbs: tirx.Buffer
    dOs: tirx.Buffer
    lse_r: tirx.Buffer
    lsed_r: tirx.Buffer
    D_r: tirx.Buffer
    Dd_r: tirx.Buffer


@dataclass(frozen=True)
class _KeyTask:
    """A second-stage task's float32 scratch: the key tile (K [block_k, DP] and K^T [D, block_k],
    V^T [D, block_k], and the cotangents' alike), its k_grad, v_grad accumulators [block_k, DP];
    the score tiles S, S_dot, dP, dP_dot and the capped scores [block_q, block_k]."""

    Kn: tirx.Buffer
    Kt: tirx.Buffer
    Vt: tirx.Buffer
    Kbn: tirx.Buffer
    Kbt: tirx.Buffer
    Vbt: tirx.Buffer
    kG: tirx.Buffer
    vG: tirx.Buffer
    S: tirx.Buffer
    St: tirx.Buffer
    dP: tirx.Buffer
    dPt: tirx.Buffer
    Cap: tirx.Buffer


@dataclass(frozen=True)
class _Pair:
    """The (query tile, key tile) pair of a second-stage step."""

    b: tirx.PrimExpr
    h: tirx.PrimExpr
    i0: tirx.PrimExpr
    key_start: tirx.PrimExpr


class _KeyPass:
    """The macros of the double backward's second stage (module docstring)."""

    def __init__(self, spec: KernelSpec, tiles: CpuTiles, direction: _Direction, Sq, Sk, padded_sq):
        micro = Micro(tiles)
        cfg, D, dtype, Hq = spec.cfg, spec.head_dim, spec.dtype, spec.num_q_heads
        BQ, BK = tiles.block_q, tiles.block_k
        DP = tiles.padded_dim(D)
        KV, DV = tiles.key_vecs, tiles.dim_vecs
        scale = spec.scale
        softcapped = cfg.softcap > 0

        @T.macro
        def load_keys(t, params, b, g, kt):
            for c in range(BK):
                for d in range(D):
                    # keys past Sk are 0 (clamped reads keep them in bounds)
                    live = T.meta_var(kt * BK + c < Sk)
                    j = T.meta_var(T.min(kt * BK + c, Sk - 1))
                    t.Kn[c, d] = T.if_then_else(live, params.k[b, g, j, d].astype(F32), T.float32(0))
                    t.Kt[d, c] = t.Kn[c, d]
                    t.Vt[d, c] = T.if_then_else(live, params.v[b, g, j, d].astype(F32), T.float32(0))
                    if direction.k:
                        t.Kbn[c, d] = T.if_then_else(live, params.k_t[b, g, j, d].astype(F32), T.float32(0))
                        t.Kbt[d, c] = t.Kbn[c, d]
                    if direction.v:
                        t.Vbt[d, c] = T.if_then_else(live, params.v_t[b, g, j, d].astype(F32), T.float32(0))
                for d in range(D, DP):
                    t.Kn[c, d] = T.float32(0)
                    if direction.k:
                        t.Kbn[c, d] = T.float32(0)
                for d in T.vectorized(DP):
                    t.kG[c, d] = T.float32(0)
                    t.vG[c, d] = T.float32(0)

        def capped(t, r, c):
            return t.Cap[r, c] if softcapped else t.S[r, c] * T.float32(scale)

        def logit_dot(t, r, c):  # S_dot holds it (0 when no cotangent moves the scores)
            return t.St[r, c] if direction.scores else T.float32(0)

        def dp_dot(t, r, c):  # do dv_bar^T
            return t.dPt[r, c] if direction.v else T.float32(0)

        @T.macro
        def score_terms(t, rows, params, pair):
            # S -> P, S_dot -> logit_dot, dP_dot -> dS_dot, dP -> dS, then S_dot -> P_dot (each line
            # reads what the lines before left; P, dS, dS_dot are 0 where the key is dropped)
            for r in range(BQ):
                if pair.i0 + r >= Sq:  # rows past Sq weigh nothing (and must not read the mask)
                    for c in T.vectorized(BK):
                        t.S[r, c] = T.float32(0)
                        t.St[r, c] = T.float32(0)
                        t.dP[r, c] = T.float32(0)
                        t.dPt[r, c] = T.float32(0)
                        t.Cap[r, c] = T.float32(0)
                    continue
                for c in T.vectorized(BK):
                    if softcapped:
                        t.Cap[r, c] = sem.softcap(cfg, t.S[r, c] * T.float32(scale), fast=True)
                    if direction.scores:
                        t.St[r, c] = sem.logit_tangent(cfg, capped(t, r, c), t.St[r, c] * T.float32(scale))
                    t.S[r, c] = T.Select(
                        visible(spec, params.mask, pair.b, pair.h, pair.i0 + r, pair.key_start + c, Sk, Sk - Sq),
                        sem.probability(biased(spec, capped(t, r, c), params.alibi, params.mask, pair.b, pair.h,
                                               pair.i0 + r, pair.key_start + c, Sk - Sq), rows.lse_r[r], fast=True),
                        T.float32(0))
                    t.dPt[r, c] = sem.score_grad_tangent(
                        cfg, t.S[r, c], sem.prob_tangent(t.S[r, c], logit_dot(t, r, c), rows.lsed_r[r]), t.dP[r, c],
                        dp_dot(t, r, c), rows.D_r[r], rows.Dd_r[r], capped(t, r, c), logit_dot(t, r, c),
                        factor=T.float32(scale))
                    t.dP[r, c] = sem.score_grad(cfg, t.S[r, c], t.dP[r, c], rows.D_r[r], capped(t, r, c),
                                                factor=T.float32(scale))
                    t.St[r, c] = sem.prob_tangent(t.S[r, c], logit_dot(t, r, c), rows.lsed_r[r])

        @T.macro
        def step(t, query, params, pair, q_grad):
            row0 = T.meta_var((pair.b * Hq + pair.h) * padded_sq + pair.i0)  # the tile's first padded row
            Qs = T.decl_buffer((BQ, DP), F32, data=query.q.data, elem_offset=row0 * DP)
            Qbs = T.decl_buffer((BQ, DP), F32, data=query.q_bar.data, elem_offset=row0 * DP)
            dOs = T.decl_buffer((BQ, DP), F32, data=query.do.data, elem_offset=row0 * DP)
            lse_r = T.decl_buffer((BQ,), F32, data=query.lse.data, elem_offset=row0)
            lsed_r = T.decl_buffer((BQ,), F32, data=query.lse_dot.data, elem_offset=row0)
            D_r = T.decl_buffer((BQ,), F32, data=query.d_row.data, elem_offset=row0)
            Dd_r = T.decl_buffer((BQ,), F32, data=query.d_row_dot.data, elem_offset=row0)
            rows = T.meta_var(_QueryTile(Qs, Qbs, dOs, lse_r, lsed_r, D_r, Dd_r))
            micro.gemm(t.S, rows.Qs, t.Kt, BQ, BK, D, KV)
            if direction.q:
                micro.gemm(t.St, rows.Qbs, t.Kt, BQ, BK, D, KV)
            if direction.k:
                micro.gemm(t.St, rows.Qs, t.Kbt, BQ, BK, D, KV, accumulate=direction.q)
            micro.gemm(t.dP, rows.dOs, t.Vt, BQ, BK, D, KV)
            if direction.v:
                micro.gemm(t.dPt, rows.dOs, t.Vbt, BQ, BK, D, KV)
            score_terms(t, rows, params, pair)
            micro.gemm(t.vG, t.St, rows.dOs, BK, DP, BQ, DV, a_transposed=True, accumulate=True)
            micro.gemm(t.kG, t.dPt, rows.Qs, BK, DP, BQ, DV, a_transposed=True, accumulate=True)
            if direction.q:
                micro.gemm(t.kG, t.dP, rows.Qbs, BK, DP, BQ, DV, a_transposed=True, accumulate=True)
            micro.gemm(q_grad, t.dPt, t.Kn, BQ, DP, BK, DV, accumulate=True)
            if direction.k:
                micro.gemm(q_grad, t.dP, t.Kbn, BQ, DP, BK, DV, accumulate=True)

        @T.macro
        def store_keys(t, params, k_grad, v_grad, b, g, kt):
            for c in range(BK):
                if kt * BK + c < Sk:
                    for d in range(D):
                        k_grad[b, g, kt * BK + c, d] = t.kG[c, d].astype(dtype)
                        v_grad[b, g, kt * BK + c, d] = t.vG[c, d].astype(dtype)

        self.load_keys, self.step, self.store_keys = load_keys, step, store_keys


def flash_double_backward(spec: KernelSpec, tiles: CpuTiles, *, cotangents: tuple[str, ...],
                          dims: Mapping[str, int | None] | None = None) -> tirx.PrimFunc:
    """The double backward kernel for the present ``cotangents`` (of dq_bar, dk_bar, dv_bar), with
    ``tiles.splits`` second-stage tasks per (batch, KV head); ``dims`` fixes B, Sq, Sk."""
    B, Sq, Sk = shape_vars(dims or {}, ("B", "Sq", "Sk"))
    direction = _Direction.of(COTANGENTS, cotangents)
    rows_pass = _TangentPass(spec, tiles, direction, B, Sq, Sk, online=False)
    padded_sq = (Sq + tiles.block_q - 1) // tiles.block_q * tiles.block_q  # rows in whole query tiles
    key_pass = _KeyPass(spec, tiles, direction, Sq, Sk, padded_sq)
    dtype, Hq, Hkv, D, group, cfg = spec.dtype, spec.num_q_heads, spec.num_kv_heads, spec.head_dim, spec.group, spec.cfg
    BQ, BK, DP, splits = tiles.block_q, tiles.block_k, tiles.padded_dim(spec.head_dim), tiles.splits
    unused = absent_inputs(spec) | {name for name in COTANGENTS if name not in cotangents}

    @T.macro
    def first_stage(rows, tile, stage):
        # per row: do_grad = out_dot = Ot - lse_dot out, D = rowsum(do out), D_dot = rowsum(do out_dot),
        # the row's do and statistics packed for stage 2 (rows past Sq: weights 0, nothing to add);
        # the q_grad partials zeroed; the tile's q and dq_bar kept for stage 2
        query = T.meta_var(stage.query)
        b = T.meta_var(tile.b)
        h = T.meta_var(tile.h)
        i0 = T.meta_var(tile.i0)
        for r in range(BQ):
            if i0 + r < Sq:
                acc = T.alloc_buffer((2,), F32, scope="local")
                acc[0] = T.float32(0)
                acc[1] = T.float32(0)
                for d in range(D):
                    o: T.float32 = stage.out[b, h, i0 + r, d].astype(F32)
                    o_dot: T.float32 = rows.Ot[r, d] - rows.lse_dot[r] * o
                    stage.do_grad[b, h, i0 + r, d] = o_dot.astype(dtype)
                    query.do[b, h, i0 + r, d] = stage.do[b, h, i0 + r, d].astype(F32)
                    acc[0] = acc[0] + query.do[b, h, i0 + r, d] * o
                    acc[1] = acc[1] + query.do[b, h, i0 + r, d] * o_dot
                query.lse_dot[b, h, i0 + r] = rows.lse_dot[r]
                query.d_row[b, h, i0 + r] = acc[0]
                query.d_row_dot[b, h, i0 + r] = acc[1]
            else:
                for d in range(D):
                    query.do[b, h, i0 + r, d] = T.float32(0)
                query.lse_dot[b, h, i0 + r] = T.float32(0)
                query.d_row[b, h, i0 + r] = T.float32(0)
                query.d_row_dot[b, h, i0 + r] = T.float32(0)
            query.lse[b, h, i0 + r] = rows.m[r]  # the forward's lse, -inf past Sq (load_rows)
            for d in range(D, DP):
                query.do[b, h, i0 + r, d] = T.float32(0)
            for d in T.vectorized(DP):  # q and dq_bar as loaded (0 past Sq and D)
                query.q[b, h, i0 + r, d] = rows.Qs[r, d]
                if direction.q:
                    query.q_bar[b, h, i0 + r, d] = rows.Qt[r, d]
            for c in range(splits):
                for d in T.vectorized(DP):
                    stage.q_part[c, b, h, i0 + r, d] = T.float32(0)

    # fmt: off
    @T.prim_func
    def fuel_flash_attn_double_backward_cpu(
            q_h: T.handle, k_h: T.handle, v_h: T.handle, do_h: T.handle, dq_bar_h: T.handle, dk_bar_h: T.handle,
            dv_bar_h: T.handle, alibi_h: T.handle, mask_h: T.handle, out_h: T.handle, lse_h: T.handle,
            q_grad_h: T.handle, k_grad_h: T.handle, v_grad_h: T.handle, do_grad_h: T.handle):
        T.func_attr({"tirx.noalias": True})
        q, k, v, do, dq_bar, dk_bar, dv_bar, alibi, mask, out, lse, q_grad, k_grad, v_grad, do_grad = param_buffers(
            spec, dict(B=B, Sq=Sq, Sk=Sk), q=q_h, k=k_h, v=v_h, do=do_h, dq_bar=dq_bar_h, dk_bar=dk_bar_h,
            dv_bar=dv_bar_h, alibi=alibi_h, mask=mask_h, out=out_h, lse=lse_h, q_grad=q_grad_h, k_grad=k_grad_h,
            v_grad=v_grad_h, do_grad=do_grad_h)
        params = T.meta_var(_Params.of(unused, q=q, k=k, v=v, q_t=dq_bar, k_t=dk_bar, v_t=dv_bar, alibi=alibi,
                                       mask=mask, do=do, out=out, lse=lse))
        q_tiles = T.alloc_buffer((B, Hq, padded_sq, DP), F32)
        q_bar_tiles = T.alloc_buffer((B, Hq, padded_sq, DP) if direction.q else (1,), F32)
        do_tiles = T.alloc_buffer((B, Hq, padded_sq, DP), F32)
        lse_rows = T.alloc_buffer((B, Hq, padded_sq), F32)
        lse_dot = T.alloc_buffer((B, Hq, padded_sq), F32)
        d_row = T.alloc_buffer((B, Hq, padded_sq), F32)
        d_row_dot = T.alloc_buffer((B, Hq, padded_sq), F32)
        query = T.meta_var(_QueryTiles.of(direction.q, q_tiles, q_bar_tiles, do_tiles, lse_rows, lse_dot, d_row,
                                          d_row_dot))
        q_part = T.alloc_buffer((splits, B, Hq, padded_sq, DP), F32)
        stage = T.meta_var(_FirstStage(do, out, do_grad, query, q_part))
        # 1. per query tile: lse_dot, out_dot (= do_grad), D and D_dot; the tile's q, dq_bar, do and
        # row statistics packed for stage 2; q_grad partials zeroed
        rows_pass.stage(params, first_stage, stage)
        # 2. per (batch, KV head, split): k_grad, v_grad of each key tile; q_grad partials
        n_key_tiles = (Sk + BK - 1) // BK
        per_split = (n_key_tiles + splits - 1) // splits
        for task in T.parallel(B * Hkv * splits):
            b: T.int64 = task // (Hkv * splits)
            g: T.int64 = task // splits % Hkv
            split: T.int64 = task % splits
            Kn = T.alloc_buffer((BK, DP), F32)
            Kt2 = T.alloc_buffer((D, BK), F32)
            Vt2 = T.alloc_buffer((D, BK), F32)
            Kbn = T.alloc_buffer((BK, DP), F32)
            Kbt = T.alloc_buffer((D, BK), F32)
            Vbt = T.alloc_buffer((D, BK), F32)
            kG = T.alloc_buffer((BK, DP), F32)
            vG = T.alloc_buffer((BK, DP), F32)
            S2 = T.alloc_buffer((BQ, BK), F32)
            St2 = T.alloc_buffer((BQ, BK), F32)
            dP = T.alloc_buffer((BQ, BK), F32)
            dPt = T.alloc_buffer((BQ, BK), F32)
            Cap2 = T.alloc_buffer((BQ, BK), F32)
            t = T.meta_var(_KeyTask(Kn, Kt2, Vt2, Kbn, Kbt, Vbt, kG, vG, S2, St2, dP, dPt, Cap2))
            for n in range(split * per_split, T.min(split * per_split + per_split, n_key_tiles)):
                kt: T.int64 = balanced_order(n, n_key_tiles)  # causal work falls with kt: pair them
                key_pass.load_keys(t, params, b, g, kt)
                for hr in range(group):
                    qlo, qhi = query_tile_range(cfg, key_first=kt * BK, key_last=T.min(kt * BK + BK, Sk) - 1,
                                                num_queries=Sq, delta=Sk - Sq, block_q=BQ)
                    for qt in range(qlo, qhi):
                        q_grad_tile = T.decl_buffer((BQ, DP), F32, data=q_part.data, elem_offset=(
                            ((split * B + b) * Hq + g * group + hr) * padded_sq + qt * BQ) * DP)
                        pair = T.meta_var(_Pair(b, g * group + hr, qt * BQ, kt * BK))
                        key_pass.step(t, query, params, pair, q_grad_tile)
                key_pass.store_keys(t, params, k_grad, v_grad, b, g, kt)
        # 3. q_grad = the sum of the splits' partials
        for bh in T.parallel(B * Hq):
            for i, d in T.grid(Sq, D):
                total = T.alloc_buffer((1,), F32, scope="local")
                total[0] = T.float32(0)
                for c in range(splits):
                    total[0] = total[0] + q_part[c, bh // Hq, bh % Hq, i, d]
                q_grad[bh // Hq, bh % Hq, i, d] = total[0].astype(dtype)
    # fmt: on

    return finish(drop_params(fuel_flash_attn_double_backward_cpu, unused))
