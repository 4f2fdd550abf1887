"""The register-tile (mma.sync) path of the CUDA backward for float16/bfloat16: warp strips of the
products (S, dP and their transposes) in mma.sync fragments, the key-block task (dK, dV) and the
query-block task (dQ).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

from tvm import tirx
from tvm.script import tirx as T

from .device import F32, TILE_PAD, Rows
from .mma import WarpTiles, c_element


@dataclass(frozen=True)
class Scratch:
    """A backward block's memory. Shared: the Q, dO, K and V tiles (``stages`` of the pair the
    block streams) and the lse and D of its query rows. SIMT blocks: the tile's P and dS (static
    shared). Register-tile blocks: the scores ``s`` and ``dp`` (S^T and dP^T in the dk/dv kernel),
    the operand fragments ``a``, ``bb``, ``p`` and the NaN flags. The accumulators dK and dV or
    dQ in registers. What a block does not have is None."""

    Qs: Any
    dOs: Any
    Ks: Any
    Vs: Any
    lse_r: Any
    D_r: Any
    dK: Any = None
    dV: Any = None
    dQ: Any = None
    P: Any = None
    dS: Any = None
    s: Any = None
    dp: Any = None
    a: Any = None
    bb: Any = None
    p: Any = None
    flags: Any = None

    def query_stage(self, st, block_q: int) -> Scratch:
        """The scratch with Qs and dOs narrowed to the tiles of pipeline stage st."""
        return replace(self, Qs=Rows.stage(self.Qs, st, block_q), dOs=Rows.stage(self.dOs, st, block_q))

    def key_stage(self, st, block_k: int) -> Scratch:
        """The scratch with Ks and Vs narrowed to the tiles of pipeline stage st."""
        return replace(self, Ks=Rows.stage(self.Ks, st, block_k), Vs=Rows.stage(self.Vs, st, block_k))


class RegisterTiles:
    """The backward block's register-tile macros: a mixin of the backward's builder, whose loads,
    walks and outputs they call."""

    def _register_products(self):
        """The warps' fragment helpers and products shared by both register-tile kernels."""
        launch, dtype, D, tiles = self.launch, self.spec.dtype, self.spec.head_dim, self.tiles
        DP = self.DP
        wt = self.wt = WarpTiles(launch, dtype, tiles.warps)
        DT, KD = DP // 8, DP // 16
        own = launch.owned

        def slot(wi, li, tx):
            return wt.slot(wt.warp_of(wi, tx), wt.lane_of(li, tx))

        def strip_row(wi, li, tx, strips, mt, i):  # block row of C element i of the lane's strip mt
            return (wt.warp_of(wi, tx) * strips + mt) * 16 + c_element(wt.lane_of(li, tx), i)[0]

        def tile_col(li, tx, nt, i):  # tile column of C element i of the lane's n-tile nt
            return nt * 8 + c_element(wt.lane_of(li, tx), i)[1]

        @T.macro
        def strip_products(acc, sc, A, a_row0, B, b_row0, strips, columns, wi, tx):
            # acc[strips x columns / 8 tiles] = A[a strips] @ B[b_row0 .. + columns]^T (k = DP), zeroed
            # first (operands through sc.a and sc.bb)
            for li in wt.lanes():
                for e in own(strips * columns // 2):
                    acc[slot(wi, li, tx), e] = T.float32(0)
            for mt in own(strips):
                for kk in own(KD):
                    wt.load_a(sc.a, 0, A, a_row0 + (wt.warp_of(wi, tx) * strips + mt) * 16, kk * 16,
                              wt.warp_of(wi, tx), tx)
                    for n2 in own(columns // 16):
                        wt.load_b(sc.bb, 0, B, b_row0 + n2 * 16, kk * 16, wt.warp_of(wi, tx), tx)
                        wt.mma(acc, (mt * columns // 8 + 2 * n2) * 4, sc.a, 0, sc.bb, 0, wt.warp_of(wi, tx))
                        wt.mma(acc, (mt * columns // 8 + 2 * n2 + 1) * 4, sc.a, 0, sc.bb, 4, wt.warp_of(wi, tx))

        @T.macro
        def accumulate(acc, probs, sc, X, x_row0, strips, inner, wi, tx):
            # acc[strips x DP] += probs[strips x inner] (C fragments, as A) @ X[x_row0 .. + inner, :DP]
            # (operands through sc.p and sc.bb)
            for mt in own(strips):
                for kb in own(inner // 16):
                    for li in wt.lanes():
                        for i in own(8):
                            sc.p[slot(wi, li, tx), i] = T.Cast(
                                dtype, probs[slot(wi, li, tx), (mt * inner // 8 + 2 * kb + i // 4) * 4 + i % 4])
                    for d2 in own(DT // 2):
                        wt.load_b_trans(sc.bb, 0, X, x_row0 + kb * 16, d2 * 16, wt.warp_of(wi, tx), tx)
                        wt.mma(acc, (mt * DT + 2 * d2) * 4, sc.p, 0, sc.bb, 0, wt.warp_of(wi, tx))
                        wt.mma(acc, (mt * DT + 2 * d2 + 1) * 4, sc.p, 0, sc.bb, 4, wt.warp_of(wi, tx))

        @T.macro
        def store_strips(out, acc, b, head, row0, strips, limit, factor, tx):
            # out[b, head, row0 + r, :D] = acc * factor from the warps' strips (rows past limit unwritten)
            for wi in wt.warp_loop():
                for li in wt.lanes():
                    for mt in own(strips):
                        for dt in own(DT):
                            for i in own(4):
                                if tirx.all(row0 + strip_row(wi, li, tx, strips, mt, i) < limit,
                                            tile_col(li, tx, dt, i) < D):
                                    # vstore: out may be a packed tensor's view (varlen.PackedRows)
                                    out.vstore([b, head, row0 + strip_row(wi, li, tx, strips, mt, i),
                                                tile_col(li, tx, dt, i)],
                                               T.Cast(dtype, acc[slot(wi, li, tx), (mt * DT + dt) * 4 + i]
                                                      * T.float32(factor)))

        self.slot, self.strip_row, self.tile_col = slot, strip_row, tile_col
        self.strip_products, self.accumulate, self.store_strips = strip_products, accumulate, store_strips

    def _register_key_block(self):
        # The dk/dv kernel on tensor cores: warp w owns 16-key strips; S^T = K Q^T and dP^T = V dO^T
        # of its strips become P^T and dS^T in registers, the A operands of dV += P^T dO, dK += dS^T Q.
        spec, launch, ops, wt = self.spec, self.launch, self.ops, self.wt
        BQ, BK, DP, STAGES, dtype = self.BQ, self.BK, self.DP, self.tiles.stages, spec.dtype
        want_dk, want_dv = self.want_dk, self.want_dv
        shared, small, local, own = launch.shared, launch.small_shared, launch.local, launch.owned
        MK = BK // 16 // wt.warps  # 16-key strips per warp
        slot, strip_row, tile_col = self.slot, self.strip_row, self.tile_col
        strip_products, accumulate, store_strips = self.strip_products, self.accumulate, self.store_strips
        # The NaN rule on tensor cores (see TileOps.zero_nonfinite): once every warp has its scores,
        # the tiles the weight mmas read (dO and Q here, K in the dq kernel) have their NaN and Inf
        # zeroed, and a flagged tile adds those terms back to the rows whose weight is not 0.
        zero_nonfinite_rows = ops.zero_nonfinite(BQ, DP)
        nonfinite_rows = wt.nonfinite_terms(MK, BQ, DP, spec.head_dim)

        def s_at(mt, nt, i):  # C element i of tile (mt, nt) of the [MK strips x BQ] transposed scores
            return (mt * BQ // 8 + nt) * 4 + i

        @T.macro
        def transposed_scores(sc, prm, at, q0, wi, tx):
            # S^T and dP^T of warp wi's key strips become P^T and dS^T in place (P computed once per
            # element, before S^T is overwritten: dS needs the raw score for softcap')
            strip_products(sc.s, sc, sc.Ks, 0, sc.Qs, q0, MK, BQ, wi, tx)
            if want_dk:
                strip_products(sc.dp, sc, sc.Vs, 0, sc.dOs, q0, MK, BQ, wi, tx)
            for li in wt.lanes():
                for mt in own(MK):
                    for nt in own(BQ // 8):
                        for i in own(4):
                            prob: T.float32 = self.probability(
                                sc, prm, at, sc.s[slot(wi, li, tx), s_at(mt, nt, i)], tile_col(li, tx, nt, i),
                                strip_row(wi, li, tx, MK, mt, i))
                            if want_dk:
                                sc.dp[slot(wi, li, tx), s_at(mt, nt, i)] = self.score_grad(
                                    sc, prob, sc.dp[slot(wi, li, tx), s_at(mt, nt, i)], tile_col(li, tx, nt, i),
                                    sc.s[slot(wi, li, tx), s_at(mt, nt, i)])
                            sc.s[slot(wi, li, tx), s_at(mt, nt, i)] = prob

        @T.macro
        def transposed_tile(sc, prm, at, q0, tx):
            # the scores of every warp, then dV += P^T dO, dK += dS^T Q (the tiles' NaN and Inf
            # added back where a tile held any)
            if tx == 0:
                sc.flags[0] = 0
                sc.flags[1] = 0
            for wi in wt.warp_loop():
                transposed_scores(sc, prm, at, q0, wi, tx)
            ops.sync()  # every warp has read Q and dO as they are
            if want_dv:
                zero_nonfinite_rows(sc.dOs, q0, sc.flags, 0, tx)
            if want_dk:
                zero_nonfinite_rows(sc.Qs, q0, sc.flags, 1, tx)
            # read into registers first: TVM's sync planner takes no shared load in a condition
            do_flagged: T.int32 = sc.flags[0]
            q_flagged: T.int32 = sc.flags[1]
            for wi in wt.warp_loop():
                if want_dv:
                    accumulate(sc.dV, sc.s, sc, sc.dOs, q0, MK, BQ, wi, tx)
                    if do_flagged != 0:
                        nonfinite_rows(sc.dV, sc.s, lambda w, i, d: prm.do[at.b, at.h, at.i0 + i, d],
                                       lambda w, i: at.i0 + i < at.Sq, wt.warp_of(wi, tx), tx)
                if want_dk:
                    accumulate(sc.dK, sc.dp, sc, sc.Qs, q0, MK, BQ, wi, tx)
                    if q_flagged != 0:
                        nonfinite_rows(sc.dK, sc.dp, lambda w, i, d: prm.q[at.b, at.h, at.i0 + i, d],
                                       lambda w, i: at.i0 + i < at.Sq, wt.warp_of(wi, tx), tx)

        @T.macro
        def key_block_registers(prm, kb, tx):
            Ks = T.alloc_buffer((BK, DP + TILE_PAD), dtype, scope=shared)
            Vs = T.alloc_buffer((BK, DP + TILE_PAD), dtype, scope=shared)
            Qs = T.alloc_buffer((STAGES * BQ, DP + TILE_PAD), dtype, scope=shared)  # STAGES tiles in flight
            dOs = T.alloc_buffer((STAGES * BQ, DP + TILE_PAD), dtype, scope=shared)
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
            # T.meta_var: the bundle stays a Python value (an assignment would make it a TIR variable)
            sc = T.meta_var(Scratch(Qs, dOs, Ks, Vs, lse_r, D_r, dK=dK, dV=dV, s=sT, dp=dpT, a=a, bb=bb, p=p,
                                     flags=flags))
            if want_dk:
                wt.fill(dK, MK * DP // 2, T.float32(0), tx)
            if want_dv:
                wt.fill(dV, MK * DP // 2, T.float32(0), tx)
            self.load_keys(Ks, Vs, prm, kb.b, kb.g, kb.j0, kb.Sk, self.copy_keys, tx)
            self.walk_group_queries(sc, prm, kb, tx, lambda at, st: transposed_tile(sc, prm, at, st * BQ, tx))
            if want_dk:
                store_strips(prm.dk, dK, kb.b, kb.g, kb.j0, MK, kb.Sk, spec.scale, tx)
            if want_dv:
                store_strips(prm.dv, dV, kb.b, kb.g, kb.j0, MK, kb.Sk, 1.0, tx)

        return key_block_registers

    def _register_query_block(self):
        # The dq kernel on tensor cores: S = Q K^T and dP = dO V^T of the warp's 16-query strips,
        # dS in place of dP (its C fragments are the A operand of dQ += dS K).
        spec, launch, ops, wt = self.spec, self.launch, self.ops, self.wt
        BQ, BK, DP, STAGES, dtype, group = self.BQ, self.BK, self.DP, self.tiles.stages, spec.dtype, spec.group
        shared, small, local, own = launch.shared, launch.small_shared, launch.local, launch.owned
        MQ = BQ // 16 // wt.warps  # 16-query strips per warp
        slot, strip_row, tile_col = self.slot, self.strip_row, self.tile_col
        strip_products, accumulate, store_strips = self.strip_products, self.accumulate, self.store_strips
        zero_nonfinite_keys = ops.zero_nonfinite(BK, DP)  # the NaN rule, as in the dk/dv kernel
        nonfinite_keys = wt.nonfinite_terms(MQ, BK, DP, spec.head_dim)

        def s_at(mt, nt, i):  # C element i of tile (mt, nt) of the [MQ strips x BK] scores
            return (mt * BK // 8 + nt) * 4 + i

        @T.macro
        def row_tile(sc, prm, at, k0, tx):
            # S and dP of the warp's query strips, dS in place of dP, then dQ += dS K (the K tile's
            # NaN and Inf added back where it held any)
            if tx == 0:
                sc.flags[0] = 0
            for wi in wt.warp_loop():
                strip_products(sc.s, sc, sc.Qs, 0, sc.Ks, k0, MQ, BK, wi, tx)
                strip_products(sc.dp, sc, sc.dOs, 0, sc.Vs, k0, MQ, BK, wi, tx)
                for li in wt.lanes():
                    for mt in own(MQ):
                        for nt in own(BK // 8):
                            for i in own(4):
                                sc.dp[slot(wi, li, tx), s_at(mt, nt, i)] = self.score_grad(
                                    sc, self.probability(sc, prm, at, sc.s[slot(wi, li, tx), s_at(mt, nt, i)],
                                                         strip_row(wi, li, tx, MQ, mt, i), tile_col(li, tx, nt, i)),
                                    sc.dp[slot(wi, li, tx), s_at(mt, nt, i)], strip_row(wi, li, tx, MQ, mt, i),
                                    sc.s[slot(wi, li, tx), s_at(mt, nt, i)])
            ops.sync()  # every warp has read K as it is
            zero_nonfinite_keys(sc.Ks, k0, sc.flags, 0, tx)
            k_flagged: T.int32 = sc.flags[0]  # into a register: no shared load in a condition
            for wi in wt.warp_loop():
                accumulate(sc.dQ, sc.dp, sc, sc.Ks, k0, MQ, BK, wi, tx)
                if k_flagged != 0:
                    nonfinite_keys(sc.dQ, sc.dp, lambda w, j, d: prm.k[at.b, at.h // group, at.j0 + j, d],
                                   lambda w, j: at.j0 + j < at.Sk, wt.warp_of(wi, tx), tx)

        @T.macro
        def query_block_registers(prm, qb, tx):
            Qs = T.alloc_buffer((BQ, DP + TILE_PAD), dtype, scope=shared)
            dOs = T.alloc_buffer((BQ, DP + TILE_PAD), dtype, scope=shared)
            Ks = T.alloc_buffer((STAGES * BK, DP + TILE_PAD), dtype, scope=shared)  # STAGES tiles in flight
            Vs = T.alloc_buffer((STAGES * BK, DP + TILE_PAD), dtype, scope=shared)
            lse_r = T.alloc_buffer((BQ,), F32, scope=small)
            D_r = T.alloc_buffer((BQ,), F32, scope=small)
            s = T.alloc_buffer((wt.slots, MQ * BK // 2), F32, scope=local)
            dp = T.alloc_buffer((wt.slots, MQ * BK // 2), F32, scope=local)
            dQ = T.alloc_buffer((wt.slots, MQ * DP // 2), F32, scope=local)
            a = T.alloc_buffer((wt.slots, 8), dtype, scope=local)
            bb = T.alloc_buffer((wt.slots, 8), dtype, scope=local)
            p = T.alloc_buffer((wt.slots, 8), dtype, scope=local)
            flags = T.alloc_buffer((1,), "int32", scope=small)  # the key tile held a NaN or Inf
            sc = T.meta_var(Scratch(Qs, dOs, Ks, Vs, lse_r, D_r, dQ=dQ, s=s, dp=dp, a=a, bb=bb, p=p, flags=flags))
            wt.fill(dQ, MQ * DP // 2, T.float32(0), tx)
            self.walk_keys(sc, prm, qb, tx, lambda at, st: row_tile(sc, prm, at, st * BK, tx))
            store_strips(prm.dq, dQ, qb.b, qb.h, qb.i0, MQ, qb.Sq, spec.scale, tx)

        return query_block_registers
