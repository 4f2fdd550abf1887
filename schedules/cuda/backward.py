"""CUDA flash attention backward (FlashAttention-2 structure): three kernels in one PrimFunc.

1. ``D = rowsum(do * out)`` per query row (one thread per row) into a float32 scratch
   [B, Hq, Sq] (only when dq or dk is wanted).
2. dk / dv: one thread block per (key tile of ``block_k`` keys, batch x KV head). The block loads
   its K and V tile once and keeps dK and dV of the tile in registers (thread ``tx`` owns the
   elements ``i * threads + tx`` of [block_k, D]) while it walks every query head of the GQA
   group and every query tile of that head that can see the key tile. A query tile is
   ``block_q`` positions of one head. Per tile: P is recomputed from the forward's lse,
   ``dS = P * (dP - D) * softcap'``, and ``dV += P^T dO``, ``dK += dS^T Q`` (scale applied once
   when dK is written).
3. dq: a separate, deterministic kernel (no atomics), one block per (query tile, batch x query
   head), walking the key tiles its rows can see and accumulating ``dQ += dS K`` in registers.

On tensor cores (float16/bfloat16) every product is a register tile (``ldmatrix`` +
``mma.sync``, ``schedules.cuda.mma``) and nothing but the streamed tiles and row statistics
passes through shared memory. The dk/dv kernel computes the transposed scores ``S^T = K Q^T``
and ``dP^T = V dO^T`` (warp w owns 16-key strips of the block's keys): their accumulator
fragments, turned into P^T and dS^T in registers, are exactly the A operands of ``dV += P^T dO``
and ``dK += dS^T Q`` (the k dimension is the queries), so no transpose is ever staged. The dq
kernel computes ``S = Q K^T`` and ``dP = dO V^T`` for its 16-query strips and feeds dS to
``dQ += dS K`` the same way. On the SIMT path (float32) each thread computes S and dP per
element straight from the tiles (P and dS through static shared memory) and accumulates into
its registers.

The tiles a block walks stream through a ``stages``-deep ``cp.async`` pipeline
(``TileOps.pipeline``): Q and dO in the dk/dv kernel (every query tile of every head of the
group), K and V in the dq kernel.

Shared memory per block (e = bytes of the input dtype, DP = head dim padded to 16 (+8 columns
on tensor cores), ST = stages; ``tiles.backward_smem`` bounds both kernels):
    static   8 * BQ (lse and D rows); SIMT also 2 * e * BQ * BK (P, dS)
    dynamic  e * (2 * BQ * ST + 2 * BK) * DP (dk/dv; dq: 2 * BQ + 2 * BK * ST)
No buffer grows with Sq * Sk; positions past a sequence are never written.

Contents:
    flash_backward -- PrimFunc(q, k, v, do, [alibi_slopes], [attn_mask], out, lse, [dq], [dk], [dv])
"""

from __future__ import annotations

from typing import Mapping

from tvm import tirx
from tvm.script import tirx as T

from ... import semantics as sem
from ..common import (biased, drop_params, finish, KernelSpec, key_tile_range, param_buffers, query_tile_range,
                      shape_vars, visible)
from .device import F32, HALF_TYPES, TILE_PAD, Launch, Rows, TileOps, padded_dim
from .mma import WarpTiles, c_element
from .tiles import CudaTiles


def _ceil(a: int, b: int) -> int:
    return -(-a // b)


class _Body:
    """The macros of the backward blocks, specialised to a spec, tiles, launch and grads."""

    def __init__(self, spec: KernelSpec, tiles: CudaTiles, launch: Launch, grads: tuple[str, ...]):
        ops = TileOps(launch, spec.dtype)
        cfg, dtype, group, D = spec.cfg, spec.dtype, spec.group, spec.head_dim
        BQ, BK, DP, NT, STAGES = tiles.block_q, tiles.block_k, padded_dim(D), launch.threads, tiles.stages
        scale = spec.scale
        local, shared, small = launch.local, launch.shared, launch.small_shared
        registers = dtype in HALF_TYPES  # register tiles (mma.sync) on the device and in the emulation
        PAD = TILE_PAD if registers else 0
        want_dk, want_dv = "dk" in grads, "dv" in grads
        capped = cfg.softcap > 0
        pipeline = ops.pipeline(STAGES)
        self.ops = ops

        @T.macro
        def row_dots(do, out, row_dot, rows, Hq, Sq, bx, tx):
            # D[b, h, i] = sum_d do * out, one thread per row
            acc = T.alloc_buffer((1,), F32, scope=local)
            e = T.Cast("int64", bx) * NT + tx
            if e < rows:
                acc[0] = T.float32(0)
                for d in range(D):
                    acc[0] = acc[0] + T.Cast(F32, do[e // Sq // Hq, e // Sq % Hq, e % Sq, d]) * T.Cast(F32, out[e // Sq // Hq, e // Sq % Hq, e % Sq, d])
                row_dot[e // Sq // Hq, e // Sq % Hq, e % Sq] = acc[0]

        # a block streams the tiles it walks (Q and dO for dk/dv, K and V for dq) through the
        # cp.async pipeline and loads the tiles it keeps once, synchronously
        copy_queries, copy_keys = ops.copy(BQ, D, DP), ops.copy(BK, D, DP)
        stream_queries, stream_keys = ops.copy(BQ, D, DP, asynchronous=True), ops.copy(BK, D, DP, asynchronous=True)

        @T.macro
        def load_rows(Qs, dOs, q, do, b, h, i0, Sq, copy, tx):
            # the Q and dO rows i0 .. i0 + BQ - 1 of head h (zero past Sq and in the padding columns)
            copy(Qs, lambda r: i0 + r < Sq, lambda r, c: q[b, h, i0 + r, c], tx)
            copy(dOs, lambda r: i0 + r < Sq, lambda r, c: do[b, h, i0 + r, c], tx)

        @T.macro
        def load_row_stats(lse_r, D_r, lse, row_dot, b, h, i0, Sq, with_d, tx):
            # the lse and D of rows i0 .. i0 + BQ - 1 (-inf and 0 past Sq: P and dS vanish there)
            for i in range(_ceil(BQ, NT)):
                if i * NT + tx < BQ:
                    if i0 + i * NT + tx < Sq:
                        lse_r[i * NT + tx] = lse[b, h, i0 + i * NT + tx]
                        if with_d:
                            D_r[i * NT + tx] = row_dot[b, h, i0 + i * NT + tx]
                    else:
                        lse_r[i * NT + tx] = T.float32(float("-inf"))
                        if with_d:
                            D_r[i * NT + tx] = T.float32(0)

        @T.macro
        def load_keys(Ks, Vs, k, v, b, g, j0, Sk, copy, tx):
            # the K and V rows j0 .. j0 + BK - 1 of KV head g (zero past Sk and in the padding columns)
            copy(Ks, lambda r: j0 + r < Sk, lambda r, c: k[b, g, j0 + r, c], tx)
            copy(Vs, lambda r: j0 + r < Sk, lambda r, c: v[b, g, j0 + r, c], tx)

        def probability(score, lse_row, b, h, i, j, Sq, Sk, alibi, mask):
            # P of query i (row of the tile at lse_row) and key j from the raw score: 0 for a dropped
            # key, a row past Sq (lazy: the mask is not read there) or a fully masked row
            return T.if_then_else(i < Sq, T.Select(
                visible(spec, mask, b, h, i, j, Sk, Sk - Sq),
                sem.probability(biased(spec, sem.softcap(cfg, score * T.float32(scale)), alibi, mask, b, h, i, j, Sk - Sq),
                                lse_row),
                T.float32(0)), T.float32(0))

        def score_grad(p, dp, d_row, score):
            # dS = P * (dP - D) * softcap'(capped score); 0 where P is, whatever a dropped key's dP or
            # score holds (the NaN rule, tvm_fuel.semantics)
            if capped:
                return T.Select(p == T.float32(0), T.float32(0),
                                p * (dp - d_row) * sem.softcap_grad(cfg, sem.softcap(cfg, score * T.float32(scale))))
            return T.Select(p == T.float32(0), T.float32(0), p * (dp - d_row))

        @T.macro
        def store_rows(out, acc, b, head, row0, rows, limit, factor, tx):
            # registers of [rows, DP] -> out[b, head, row0 + r, :D] * factor (rows past limit and the
            # padding columns are not written)
            for i in range(_ceil(rows * DP, NT)):
                if i * NT + tx < rows * DP:
                    if tirx.all(row0 + (i * NT + tx) // DP < limit, (i * NT + tx) % DP < D):
                        out[b, head, row0 + (i * NT + tx) // DP, (i * NT + tx) % DP] = T.Cast(
                            dtype, acc[i] * T.float32(factor))

        def query_tiles(j0, Sq, Sk):
            # the query tiles the key tile at j0 meets: (first, count) per head of the group
            qlo, qhi = query_tile_range(cfg, key_first=j0, key_last=T.min(j0 + BK, Sk) - 1, num_queries=Sq,
                                        delta=Sk - Sq, block_q=BQ)
            return qlo, T.max(qhi - qlo, 0)

        # ---- SIMT (float32): per-element scores, P and dS through static shared memory ----

        @T.macro
        def scores(P, dS, Qs, dOs, Ks, Vs, lse_r, D_r, alibi, mask, b, h, i0, j0, Sq, Sk, with_p, with_ds, tx):
            # P and dS of the tile, each thread computing its elements in registers and writing them once
            s = T.alloc_buffer((1,), F32, scope=local)
            dp = T.alloc_buffer((1,), F32, scope=local)
            p = T.alloc_buffer((1,), F32, scope=local)
            for i in range(_ceil(BQ * BK, NT)):
                if i * NT + tx < BQ * BK:
                    s[0] = T.float32(0)
                    for d in range(D):
                        s[0] = s[0] + T.Cast(F32, Qs[(i * NT + tx) // BK, d]) * T.Cast(F32, Ks[(i * NT + tx) % BK, d])
                    p[0] = probability(s[0], lse_r[(i * NT + tx) // BK], b, h, i0 + (i * NT + tx) // BK,
                                       j0 + (i * NT + tx) % BK, Sq, Sk, alibi, mask)
                    if with_p:
                        P[(i * NT + tx) // BK, (i * NT + tx) % BK] = p[0]
                    if with_ds:
                        dp[0] = T.float32(0)
                        for d in range(D):
                            dp[0] = dp[0] + T.Cast(F32, dOs[(i * NT + tx) // BK, d]) * T.Cast(F32, Vs[(i * NT + tx) % BK, d])
                        dS[(i * NT + tx) // BK, (i * NT + tx) % BK] = score_grad(p[0], dp[0], D_r[(i * NT + tx) // BK], s[0])

        @T.macro
        def add_key_grad(acc, A, X, tx):
            # registers of [BK, DP] += A^T X with A [BQ, BK] (P or dS) and X [BQ, DP] (dO or Q)
            for i in launch.owned(_ceil(BK * DP, NT)):
                if i * NT + tx < BK * DP:
                    for r in range(BQ):
                        acc[i] = sem.add_weighted(acc[i], A[r, (i * NT + tx) // DP], T.Cast(F32, X[r, (i * NT + tx) % DP]))

        @T.macro
        def add_query_grad(acc, dS, Ks, tx):
            # registers of [BQ, DP] += dS K with dS [BQ, BK] and K [BK, DP]
            for i in launch.owned(_ceil(BQ * DP, NT)):
                if i * NT + tx < BQ * DP:
                    for c in range(BK):
                        acc[i] = sem.add_weighted(acc[i], dS[(i * NT + tx) // DP, c], T.Cast(F32, Ks[c, (i * NT + tx) % DP]))

        @T.macro
        def simt_query_tile(P, dS, dK, dV, Qs, dOs, Ks, Vs, lse_r, D_r, alibi, mask, b, h, i0, j0, Sq, Sk, tx):
            scores(P, dS, Qs, dOs, Ks, Vs, lse_r, D_r, alibi, mask, b, h, i0, j0, Sq, Sk, want_dv, want_dk, tx)
            ops.sync()
            if want_dv:
                add_key_grad(dV, P, dOs, tx)
            if want_dk:
                add_key_grad(dK, dS, Qs, tx)

        @T.macro
        def simt_key_tile(dS, dQ, Qs, dOs, Ks, Vs, lse_r, D_r, alibi, mask, b, h, i0, j0, Sq, Sk, tx):
            scores(dS, dS, Qs, dOs, Ks, Vs, lse_r, D_r, alibi, mask, b, h, i0, j0, Sq, Sk, False, True, tx)
            ops.sync()
            add_query_grad(dQ, dS, Ks, tx)

        @T.macro
        def stats_then(lse_r, D_r, lse, row_dot, b, h, i0, Sq, tx, compute):
            # the tile's row statistics (the stage barrier before this step guards their reuse), then compute
            load_row_stats(lse_r, D_r, lse, row_dot, b, h, i0, Sq, want_dk, tx)
            ops.sync()
            compute()

        @T.macro
        def walk_group_queries(Qs, dOs, lse_r, D_r, q, do, lse, row_dot, b, g, j0, Sq, Sk, tx, compute):
            # every query tile of every head of KV head g's group that sees the key tile at j0, streamed
            # through the pipeline: tile t is query tile qlo + t % tiles of head g * group + t // tiles;
            # compute(h, i0, st) once its Q/dO stage and row statistics are in
            qlo, tiles = query_tiles(j0, Sq, Sk)
            pipeline(group * tiles,
                     lambda t, st: load_rows(Rows.stage(Qs, st, BQ), Rows.stage(dOs, st, BQ), q, do, b,
                                             g * group + t // tiles, (qlo + t % tiles) * BQ, Sq, stream_queries, tx),
                     lambda t, st: stats_then(lse_r, D_r, lse, row_dot, b, g * group + t // tiles, (qlo + t % tiles) * BQ,
                                              Sq, tx, lambda: compute(g * group + t // tiles, (qlo + t % tiles) * BQ, st)))

        @T.macro
        def walk_keys(Qs, dOs, Ks, Vs, lse_r, D_r, q, k, v, do, lse, row_dot, b, h, i0, Sq, Sk, tx, compute):
            # the dq block: its Q and dO rows and row statistics once, then every key tile they see
            # streamed through the pipeline; compute(j0, st) once the tile at key j0 is in stage st
            load_rows(Qs, dOs, q, do, b, h, i0, Sq, copy_queries, tx)
            load_row_stats(lse_r, D_r, lse, row_dot, b, h, i0, Sq, True, tx)
            lo, hi = key_tile_range(cfg, first_pos=i0, last_pos=T.min(i0 + BQ, Sq) - 1, kv_len=Sk, delta=Sk - Sq,
                                    block_k=BK)
            pipeline(T.max(hi - lo, 0),
                     lambda t, st: load_keys(Rows.stage(Ks, st, BK), Rows.stage(Vs, st, BK), k, v, b, h // group,
                                             (lo + t) * BK, Sk, stream_keys, tx),
                     lambda t, st: compute((lo + t) * BK, st))

        @T.macro
        def key_block_simt(q, k, v, do, alibi, mask, lse, row_dot, dk, dv, b, g, j0, Sq, Sk, tx):
            Ks = T.alloc_buffer((BK, DP), dtype, scope=shared)
            Vs = T.alloc_buffer((BK, DP), dtype, scope=shared)
            Qs = T.alloc_buffer((STAGES * BQ, DP), dtype, scope=shared)  # STAGES tiles in flight
            dOs = T.alloc_buffer((STAGES * BQ, DP), dtype, scope=shared)
            # written by the element pass: static shared (told apart from the tiles by the sync planner)
            P = T.alloc_buffer((BQ, BK) if want_dv else (1, 1), F32, scope=small)
            dS = T.alloc_buffer((BQ, BK) if want_dk else (1, 1), F32, scope=small)
            lse_r = T.alloc_buffer((BQ,), F32, scope=small)
            D_r = T.alloc_buffer((BQ,) if want_dk else (1,), F32, scope=small)
            dK = T.alloc_buffer((_ceil(BK * DP, NT),) if want_dk else (1,), F32, scope=local)
            dV = T.alloc_buffer((_ceil(BK * DP, NT),) if want_dv else (1,), F32, scope=local)
            for i in range(_ceil(BK * DP, NT)):
                if want_dk:
                    dK[i] = T.float32(0)
                if want_dv:
                    dV[i] = T.float32(0)
            load_keys(Ks, Vs, k, v, b, g, j0, Sk, copy_keys, tx)
            walk_group_queries(Qs, dOs, lse_r, D_r, q, do, lse, row_dot, b, g, j0, Sq, Sk, tx,
                               lambda h, i0, st: simt_query_tile(P, dS, dK, dV, Rows.stage(Qs, st, BQ),
                                                                 Rows.stage(dOs, st, BQ), Ks, Vs, lse_r, D_r, alibi,
                                                                 mask, b, h, i0, j0, Sq, Sk, tx))
            if want_dk:
                store_rows(dk, dK, b, g, j0, BK, Sk, scale, tx)
            if want_dv:
                store_rows(dv, dV, b, g, j0, BK, Sk, 1.0, tx)

        @T.macro
        def query_block_simt(q, k, v, do, alibi, mask, lse, row_dot, dq, b, h, i0, Sq, Sk, tx):
            Qs = T.alloc_buffer((BQ, DP), dtype, scope=shared)
            dOs = T.alloc_buffer((BQ, DP), dtype, scope=shared)
            Ks = T.alloc_buffer((STAGES * BK, DP), dtype, scope=shared)  # STAGES tiles in flight
            Vs = T.alloc_buffer((STAGES * BK, DP), dtype, scope=shared)
            dS = T.alloc_buffer((BQ, BK), F32, scope=small)
            lse_r = T.alloc_buffer((BQ,), F32, scope=small)
            D_r = T.alloc_buffer((BQ,), F32, scope=small)
            dQ = T.alloc_buffer((_ceil(BQ * DP, NT),), F32, scope=local)
            for i in range(_ceil(BQ * DP, NT)):
                dQ[i] = T.float32(0)
            walk_keys(Qs, dOs, Ks, Vs, lse_r, D_r, q, k, v, do, lse, row_dot, b, h, i0, Sq, Sk, tx,
                      lambda j0, st: simt_key_tile(dS, dQ, Qs, dOs, Rows.stage(Ks, st, BK), Rows.stage(Vs, st, BK),
                                                   lse_r, D_r, alibi, mask, b, h, i0, j0, Sq, Sk, tx))
            store_rows(dq, dQ, b, h, i0, BQ, Sq, scale, tx)

        self.row_dots, self.key_block, self.query_block = row_dots, key_block_simt, query_block_simt
        if not registers:
            return

        # ---- register tiles (float16/bfloat16) ----
        wt = WarpTiles(launch, dtype, tiles.warps)
        W, DT, KD = tiles.warps, DP // 8, DP // 16
        MK, MQ = BK // 16 // W, BQ // 16 // W  # 16-row strips per warp: keys (dk/dv kernel), queries (dq)
        own = launch.owned

        def slot(wi, li, tx):
            return wt.slot(wt.warp_of(wi, tx), wt.lane_of(li, tx))

        def strip_row(wi, li, tx, strips, mt, i):  # block row of C element i of the lane's strip mt
            return (wt.warp_of(wi, tx) * strips + mt) * 16 + c_element(wt.lane_of(li, tx), i)[0]

        def tile_col(li, tx, nt, i):  # tile column of C element i of the lane's n-tile nt
            return nt * 8 + c_element(wt.lane_of(li, tx), i)[1]

        @T.macro
        def strip_products(acc, a_frag, b_frag, A, a_row0, B, b_row0, strips, columns, wi, tx):
            # acc[strips x columns / 8 tiles] = A[a strips] @ B[b_row0 .. + columns]^T (k = DP), zeroed first
            for li in wt.lanes():
                for e in own(strips * columns // 2):
                    acc[slot(wi, li, tx), e] = T.float32(0)
            for mt in own(strips):
                for kk in own(KD):
                    wt.load_a(a_frag, 0, A, a_row0 + (wt.warp_of(wi, tx) * strips + mt) * 16, kk * 16, wt.warp_of(wi, tx), tx)
                    for n2 in own(columns // 16):
                        wt.load_b(b_frag, 0, B, b_row0 + n2 * 16, kk * 16, wt.warp_of(wi, tx), tx)
                        wt.mma(acc, (mt * columns // 8 + 2 * n2) * 4, a_frag, 0, b_frag, 0, wt.warp_of(wi, tx))
                        wt.mma(acc, (mt * columns // 8 + 2 * n2 + 1) * 4, a_frag, 0, b_frag, 4, wt.warp_of(wi, tx))

        @T.macro
        def accumulate(acc, probs, p_frag, b_frag, X, x_row0, strips, inner, wi, tx):
            # acc[strips x DP] += probs[strips x inner] (C fragments, as A) @ X[x_row0 .. + inner, :DP]
            for mt in own(strips):
                for kb in own(inner // 16):
                    for li in wt.lanes():
                        for i in own(8):
                            p_frag[slot(wi, li, tx), i] = T.Cast(dtype, probs[slot(wi, li, tx), (mt * inner // 8 + 2 * kb + i // 4) * 4 + i % 4])
                    for d2 in own(DT // 2):
                        wt.load_b_trans(b_frag, 0, X, x_row0 + kb * 16, d2 * 16, wt.warp_of(wi, tx), tx)
                        wt.mma(acc, (mt * DT + 2 * d2) * 4, p_frag, 0, b_frag, 0, wt.warp_of(wi, tx))
                        wt.mma(acc, (mt * DT + 2 * d2 + 1) * 4, p_frag, 0, b_frag, 4, wt.warp_of(wi, tx))

        @T.macro
        def store_strips(out, acc, b, head, row0, strips, limit, factor, tx):
            # out[b, head, row0 + r, :D] = acc * factor from the warps' strips (rows past limit unwritten)
            for wi in wt.warp_loop():
                for li in wt.lanes():
                    for mt in own(strips):
                        for dt in own(DT):
                            for i in own(4):
                                if tirx.all(row0 + strip_row(wi, li, tx, strips, mt, i) < limit, tile_col(li, tx, dt, i) < D):
                                    out[b, head, row0 + strip_row(wi, li, tx, strips, mt, i), tile_col(li, tx, dt, i)] = T.Cast(
                                        dtype, acc[slot(wi, li, tx), (mt * DT + dt) * 4 + i] * T.float32(factor))

        # The NaN rule on tensor cores (see TileOps.zero_nonfinite): once every warp has its scores,
        # the tiles the weight mmas read (dO and Q here, K in the dq kernel) have their NaN and Inf
        # zeroed, and a flagged tile adds those terms back to the rows whose weight is not 0.
        zero_nonfinite_rows = ops.zero_nonfinite(BQ, DP)
        zero_nonfinite_keys = ops.zero_nonfinite(BK, DP)
        nonfinite_rows = wt.nonfinite_terms(MK, BQ, DP, D)
        nonfinite_keys = wt.nonfinite_terms(MQ, BK, DP, D)

        @T.macro
        def transposed_tile(sT, dpT, dK, dV, a, bb, p, Qs, dOs, q0, Ks, Vs, lse_r, D_r, alibi, mask, b, h, i0, j0, Sq,
                            Sk, q, do, flags, tx):
            # S^T and dP^T of the warp's key strips become P^T and dS^T in place (P computed once per
            # element, before S^T is overwritten: dS needs the raw score for softcap'), then
            # dV += P^T dO, dK += dS^T Q. a, bb, p: operand fragments
            if tx == 0:
                flags[0] = 0
                flags[1] = 0
            for wi in wt.warp_loop():
                strip_products(sT, a, bb, Ks, 0, Qs, q0, MK, BQ, wi, tx)
                if want_dk:
                    strip_products(dpT, a, bb, Vs, 0, dOs, q0, MK, BQ, wi, tx)
                for li in wt.lanes():
                    for mt in own(MK):
                        for nt in own(BQ // 8):
                            for i in own(4):
                                prob: T.float32 = probability(
                                    sT[slot(wi, li, tx), (mt * BQ // 8 + nt) * 4 + i], lse_r[tile_col(li, tx, nt, i)],
                                    b, h, i0 + tile_col(li, tx, nt, i), j0 + strip_row(wi, li, tx, MK, mt, i), Sq, Sk,
                                    alibi, mask)
                                if want_dk:
                                    dpT[slot(wi, li, tx), (mt * BQ // 8 + nt) * 4 + i] = score_grad(
                                        prob, dpT[slot(wi, li, tx), (mt * BQ // 8 + nt) * 4 + i],
                                        D_r[tile_col(li, tx, nt, i)], sT[slot(wi, li, tx), (mt * BQ // 8 + nt) * 4 + i])
                                sT[slot(wi, li, tx), (mt * BQ // 8 + nt) * 4 + i] = prob
            ops.sync()  # every warp has read Q and dO as they are
            if want_dv:
                zero_nonfinite_rows(dOs, q0, flags, 0, tx)
            if want_dk:
                zero_nonfinite_rows(Qs, q0, flags, 1, tx)
            # read into registers first: TVM's sync planner takes no shared load in a condition
            do_flagged: T.int32 = flags[0]
            q_flagged: T.int32 = flags[1]
            for wi in wt.warp_loop():
                if want_dv:
                    accumulate(dV, sT, p, bb, dOs, q0, MK, BQ, wi, tx)
                    if do_flagged != 0:
                        nonfinite_rows(dV, sT, lambda w, i, d: do[b, h, i0 + i, d], lambda w, i: i0 + i < Sq,
                                       wt.warp_of(wi, tx), tx)
                if want_dk:
                    accumulate(dK, dpT, p, bb, Qs, q0, MK, BQ, wi, tx)
                    if q_flagged != 0:
                        nonfinite_rows(dK, dpT, lambda w, i, d: q[b, h, i0 + i, d], lambda w, i: i0 + i < Sq,
                                       wt.warp_of(wi, tx), tx)

        @T.macro
        def key_block_registers(q, k, v, do, alibi, mask, lse, row_dot, dk, dv, b, g, j0, Sq, Sk, tx):
            Ks = T.alloc_buffer((BK, DP + PAD), dtype, scope=shared)
            Vs = T.alloc_buffer((BK, DP + PAD), dtype, scope=shared)
            Qs = T.alloc_buffer((STAGES * BQ, DP + PAD), dtype, scope=shared)  # STAGES tiles in flight
            dOs = T.alloc_buffer((STAGES * BQ, DP + PAD), dtype, scope=shared)
            lse_r = T.alloc_buffer((BQ,), F32, scope=small)
            D_r = T.alloc_buffer((BQ,) if want_dk else (1,), F32, scope=small)
            sT = T.alloc_buffer((wt.slots, MK * BQ // 2), F32, scope=local)
            dpT = T.alloc_buffer((wt.slots, MK * BQ // 2 if want_dk else 1), F32, scope=local)
            dK = T.alloc_buffer((wt.slots, MK * DP // 2 if want_dk else 1), F32, scope=local)
            dV = T.alloc_buffer((wt.slots, MK * DP // 2 if want_dv else 1), F32, scope=local)
            a = T.alloc_buffer((wt.slots, 8), dtype, scope=local)
            bb = T.alloc_buffer((wt.slots, 8), dtype, scope=local)
            p = T.alloc_buffer((wt.slots, 8), dtype, scope=local)
            flags = T.alloc_buffer((2,), "int32", scope=small)  # the tile's dO, Q held a NaN or Inf
            if want_dk:
                wt.fill(dK, MK * DP // 2, T.float32(0), tx)
            if want_dv:
                wt.fill(dV, MK * DP // 2, T.float32(0), tx)
            load_keys(Ks, Vs, k, v, b, g, j0, Sk, copy_keys, tx)
            walk_group_queries(Qs, dOs, lse_r, D_r, q, do, lse, row_dot, b, g, j0, Sq, Sk, tx,
                               lambda h, i0, st: transposed_tile(sT, dpT, dK, dV, a, bb, p, Qs, dOs, st * BQ, Ks, Vs,
                                                                 lse_r, D_r, alibi, mask, b, h, i0, j0, Sq, Sk, q, do,
                                                                 flags, tx))
            if want_dk:
                store_strips(dk, dK, b, g, j0, MK, Sk, scale, tx)
            if want_dv:
                store_strips(dv, dV, b, g, j0, MK, Sk, 1.0, tx)

        @T.macro
        def row_tile(s, dp, dQ, a, bb, p, Qs, dOs, Ks, Vs, k0, lse_r, D_r, alibi, mask, b, h, i0, j0, Sq, Sk, k, flags,
                     tx):
            # S and dP of the warp's query strips, dS in place of dP, then dQ += dS K (a, bb, p: operand fragments)
            if tx == 0:
                flags[0] = 0
            for wi in wt.warp_loop():
                strip_products(s, a, bb, Qs, 0, Ks, k0, MQ, BK, wi, tx)
                strip_products(dp, a, bb, dOs, 0, Vs, k0, MQ, BK, wi, tx)
                for li in wt.lanes():
                    for mt in own(MQ):
                        for nt in own(BK // 8):
                            for i in own(4):
                                dp[slot(wi, li, tx), (mt * BK // 8 + nt) * 4 + i] = score_grad(
                                    probability(s[slot(wi, li, tx), (mt * BK // 8 + nt) * 4 + i],
                                                lse_r[strip_row(wi, li, tx, MQ, mt, i)], b, h,
                                                i0 + strip_row(wi, li, tx, MQ, mt, i), j0 + tile_col(li, tx, nt, i), Sq,
                                                Sk, alibi, mask),
                                    dp[slot(wi, li, tx), (mt * BK // 8 + nt) * 4 + i],
                                    D_r[strip_row(wi, li, tx, MQ, mt, i)], s[slot(wi, li, tx), (mt * BK // 8 + nt) * 4 + i])
            ops.sync()  # every warp has read K as it is
            zero_nonfinite_keys(Ks, k0, flags, 0, tx)
            k_flagged: T.int32 = flags[0]  # into a register: no shared load in a condition
            for wi in wt.warp_loop():
                accumulate(dQ, dp, p, bb, Ks, k0, MQ, BK, wi, tx)
                if k_flagged != 0:
                    nonfinite_keys(dQ, dp, lambda w, j, d: k[b, h // group, j0 + j, d], lambda w, j: j0 + j < Sk,
                                   wt.warp_of(wi, tx), tx)

        @T.macro
        def query_block_registers(q, k, v, do, alibi, mask, lse, row_dot, dq, b, h, i0, Sq, Sk, tx):
            Qs = T.alloc_buffer((BQ, DP + PAD), dtype, scope=shared)
            dOs = T.alloc_buffer((BQ, DP + PAD), dtype, scope=shared)
            Ks = T.alloc_buffer((STAGES * BK, DP + PAD), dtype, scope=shared)  # STAGES tiles in flight
            Vs = T.alloc_buffer((STAGES * BK, DP + PAD), dtype, scope=shared)
            lse_r = T.alloc_buffer((BQ,), F32, scope=small)
            D_r = T.alloc_buffer((BQ,), F32, scope=small)
            s = T.alloc_buffer((wt.slots, MQ * BK // 2), F32, scope=local)
            dp = T.alloc_buffer((wt.slots, MQ * BK // 2), F32, scope=local)
            dQ = T.alloc_buffer((wt.slots, MQ * DP // 2), F32, scope=local)
            a = T.alloc_buffer((wt.slots, 8), dtype, scope=local)
            bb = T.alloc_buffer((wt.slots, 8), dtype, scope=local)
            p = T.alloc_buffer((wt.slots, 8), dtype, scope=local)
            flags = T.alloc_buffer((1,), "int32", scope=small)  # the key tile held a NaN or Inf
            wt.fill(dQ, MQ * DP // 2, T.float32(0), tx)
            walk_keys(Qs, dOs, Ks, Vs, lse_r, D_r, q, k, v, do, lse, row_dot, b, h, i0, Sq, Sk, tx,
                      lambda j0, st: row_tile(s, dp, dQ, a, bb, p, Qs, dOs, Ks, Vs, st * BK, lse_r, D_r, alibi, mask,
                                              b, h, i0, j0, Sq, Sk, k, flags, tx))
            store_strips(dq, dQ, b, h, i0, MQ, Sq, scale, tx)

        self.key_block, self.query_block = key_block_registers, query_block_registers


def flash_backward(spec: KernelSpec, tiles: CudaTiles, *, grads: tuple[str, ...], launch: Launch | None = None,
                   dims: Mapping[str, int | None] | None = None) -> tirx.PrimFunc:
    """The backward kernels producing ``grads`` (a subset of dq, dk, dv, in that order) over
    q, do [B, Hq, Sq, D] and k, v [B, Hkv, Sk, D]; ``launch`` defaults to ``tiles.threads``
    threads per block; ``dims`` fixes B, Sq, Sk (symbolic where absent)."""
    if not grads or any(g not in ("dq", "dk", "dv") for g in grads):
        raise ValueError(f"flash_backward: grads must be a non-empty subset of dq, dk, dv, got {grads!r}")
    launch = launch or Launch(tiles.threads)
    B, Sq, Sk = shape_vars(dims or {}, ("B", "Sq", "Sk"))
    body = _Body(spec, tiles, launch, grads)
    dtype, Hq, Hkv, D = spec.dtype, spec.num_q_heads, spec.num_kv_heads, spec.head_dim
    BQ, BK, NT = tiles.block_q, tiles.block_k, launch.threads
    want_dq, want_dk, want_dv = "dq" in grads, "dk" in grads, "dv" in grads
    want_ds = want_dq or want_dk
    has_mask = len(spec.mask_broadcast) > 0

    # fmt: off
    @T.prim_func
    def fuel_flash_attn_backward_cuda(q_h: T.handle, k_h: T.handle, v_h: T.handle, do_h: T.handle,
                                      alibi_h: T.handle, mask_h: T.handle, out_h: T.handle, lse_h: T.handle,
                                      dq_h: T.handle, dk_h: T.handle, dv_h: T.handle):
        T.func_attr({"tirx.noalias": True})
        q, k, v, do, alibi, mask, out, lse, dq, dk, dv = param_buffers(
            spec, dict(B=B, Sq=Sq, Sk=Sk),
            q=q_h, k=k_h, v=v_h, do=do_h, alibi=alibi_h, mask=mask_h, out=out_h, lse=lse_h, dq=dq_h, dk=dk_h, dv=dv_h)
        row_dot = T.alloc_buffer((B, Hq, Sq) if want_ds else (1, 1, 1), F32)
        # 1. D = rowsum(do * out)
        if want_ds:
            for bx in launch.grid((B * Hq * Sq + NT - 1) // NT, "x"):
                for tx in launch.block():
                    body.row_dots(do, out, row_dot, B * Hq * Sq, Hq, Sq, bx, tx)
        # 2. dk, dv: one block per (key tile, batch x KV head)
        if want_dk or want_dv:
            for bx in launch.grid((Sk + BK - 1) // BK, "x"):
                for by in launch.grid(B, "y"):
                    for bz in launch.grid(Hkv, "z"):
                        for tx in launch.block():
                            # #pragma unroll for nvcc instead of TVM's expansion (see forward.py)
                            with T.attr(T.int32(0), "pragma_unroll_explicit", T.int32(0)):
                                body.key_block(q, k, v, do, alibi, mask, lse, row_dot, dk, dv, T.Cast("int64", by),
                                               T.Cast("int64", bz), T.Cast("int64", bx) * BK, Sq, Sk, tx)
        # 3. dq: one block per (query tile, batch x query head)
        if want_dq:
            for bx in launch.grid((Sq + BQ - 1) // BQ, "x"):
                for by in launch.grid(B, "y"):
                    for bz in launch.grid(Hq, "z"):
                        for tx in launch.block():
                            with T.attr(T.int32(0), "pragma_unroll_explicit", T.int32(0)):
                                body.query_block(q, k, v, do, alibi, mask, lse, row_dot, dq, T.Cast("int64", by),
                                                 T.Cast("int64", bz), T.Cast("int64", bx) * BQ, Sq, Sk, tx)
    # fmt: on

    unused = {name for name, wanted in (("dq", want_dq), ("dk", want_dk), ("dv", want_dv)) if not wanted}
    if not spec.has_alibi:
        unused.add("alibi")
    if not has_mask:
        unused.add("mask")
    return finish(drop_params(fuel_flash_attn_backward_cuda, unused))
