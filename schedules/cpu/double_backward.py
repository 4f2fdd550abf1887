"""CPU kernel of the backward's vector-Jacobian product (``flash_attn_double_backward``).

Its first stage is the tangent pass (``schedules.cpu.tangent``) along the cotangents dq_bar,
dk_bar, dv_bar with the forward's lse; it also takes D = rowsum(do out) and D_dot = rowsum(do
out_dot), the row statistics of the second stage, and packs its query rows and their statistics
between the stages (O(Sq * D)).

The double backward's second stage is the backward's key-tile task (``schedules.cpu.backward``)
differentiated along the cotangents with ``do`` held: per (batch, KV head, split of the key
tiles), for every query tile that sees a key tile, P, P_dot, dS and dS_dot are recomputed
(``semantics.prob_tangent`` / ``score_grad_tangent``) and

    v_grad += P_dot^T do,  k_grad += dS_dot^T q + dS^T dq_bar,  q_grad += dS_dot k + dS dk_bar

with q_grad in per-split partials summed at the end (no races, as the backward's dq); do_grad is
out_dot. Terms of an absent tangent or cotangent are not computed.

Contents:
    flash_double_backward -- PrimFunc(q, k, v, do, [dq_bar], [dk_bar], [dv_bar], [alibi], [mask], out, lse,
                             q_grad, k_grad, v_grad, do_grad)
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping

from tvm import tirx
from tvm.script import tirx as T

from tvm_fuel.op import semantics as sem
from ..common import F32, KernelSpec, drop_params, finish, kernel_params, shifted_logit, kernel_sizes
from .common import absent_inputs
from .micro import Micro
from .tangent import COTANGENTS, Direction, TangentBuffers, TangentPass
from .tasks import KeySplitGrid, key_split_tasks, sum_split_partials, visible_query_tiles
from .tiles import CpuTiles


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
class _Kernel:
    """What every second-stage task reads: the grid, the parameters, the first stage's query
    tiles, the q_grad partials [splits, B, Hq, padded_sq, DP], and the k_grad, v_grad outputs."""

    grid: KeySplitGrid
    params: TangentBuffers
    query: _QueryTiles
    q_part: tirx.Buffer
    k_grad: tirx.Buffer | None
    v_grad: tirx.Buffer | None


class _KeyPass:
    """The macros of the double backward's second stage (module docstring)."""

    def __init__(self, spec: KernelSpec, tiles: CpuTiles, direction: Direction, Sq, Sk, padded_sq):
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
                        t.Kbn[c, d] = T.if_then_else(live, params.k_dot[b, g, j, d].astype(F32), T.float32(0))
                        t.Kbt[d, c] = t.Kbn[c, d]
                    if direction.v:
                        t.Vbt[d, c] = T.if_then_else(live, params.v_dot[b, g, j, d].astype(F32), T.float32(0))
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
                    t.S[r, c] = shifted_logit(spec, capped(t, r, c), params.alibi, params.mask, pair.b, pair.h,
                                              pair.i0 + r, pair.key_start + c, Sk, Sk - Sq, rows.lse_r[r])
                    t.S[r, c] = sem.exp_shifted(t.S[r, c], rows.lse_r[r], fast=True)  # stored first: exp_shifted
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
    sizes = kernel_sizes(dims)
    B, Sq, Sk = sizes.values()
    direction = Direction.of(COTANGENTS, cotangents)
    rows_pass = TangentPass(spec, tiles, direction, B, Sq, Sk, online=False)
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
    @T.macro
    def pair_step(kernel, t, pair):
        q_grad_tile = T.decl_buffer((BQ, DP), F32, data=kernel.q_part.data, elem_offset=pair.partial_start)
        key_pass.step(t, kernel.query, kernel.params, pair, q_grad_tile)

    @T.macro
    def key_task(kernel, b, g, split):
        # k_grad, v_grad of each of the split's key tiles, and the split's q_grad partials
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
        grid = T.meta_var(kernel.grid)
        for n in range(grid.first_tile(split), grid.end_tile(split)):
            kt: T.int64 = grid.key_tile(n)
            key_pass.load_keys(t, kernel.params, b, g, kt)
            visible_query_tiles(grid, kernel, t, b, g, split, kt, pair_step)
            key_pass.store_keys(t, kernel.params, kernel.k_grad, kernel.v_grad, b, g, kt)


    # fmt: off
    @T.prim_func
    def fuel_flash_attn_double_backward_cpu(
            q_h: T.handle, k_h: T.handle, v_h: T.handle, do_h: T.handle, dq_bar_h: T.handle, dk_bar_h: T.handle,
            dv_bar_h: T.handle, alibi_h: T.handle, mask_h: T.handle, out_h: T.handle, lse_h: T.handle,
            q_grad_h: T.handle, k_grad_h: T.handle, v_grad_h: T.handle, do_grad_h: T.handle):
        q, k, v, do, dq_bar, dk_bar, dv_bar, alibi, mask, out, lse, q_grad, k_grad, v_grad, do_grad = kernel_params(
            spec, sizes, q_h, k_h, v_h, do_h, dq_bar_h, dk_bar_h, dv_bar_h, alibi_h, mask_h, out_h, lse_h, q_grad_h,
            k_grad_h, v_grad_h, do_grad_h)
        params = T.meta_var(TangentBuffers.of(unused, q=q, k=k, v=v, q_dot=dq_bar, k_dot=dk_bar, v_dot=dv_bar,
                                              alibi=alibi, mask=mask, do=do, out=out, lse=lse))
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
        grid = T.meta_var(KeySplitGrid(cfg, B, Sq, Sk, Hq, Hkv, group, BQ, BK, DP, splits, n_key_tiles, per_split,
                                       padded_sq))
        key_split_tasks(grid, _Kernel(grid, params, query, q_part, k_grad, v_grad), key_task)
        # 3. q_grad = the sum of the splits' partials
        sum_split_partials(q_part, q_grad, B, Hq, Sq, D, splits, dtype)
    # fmt: on

    return finish(drop_params(fuel_flash_attn_double_backward_cpu, unused))
