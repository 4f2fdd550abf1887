"""The register-tile (mma.sync) path of the CUDA forward for float16/bfloat16: warp tiles, their online
softmax on fragments, and the merge of the warps' partial rows.

FlashAttention-2's structure: warp (wm, wn) of the WarpLayout computes S for its 16-row strips and key
slice with mma.sync and runs the online softmax on the fragments; the warps of a row block then
merge their partial (max, sum, output) rows through shared memory.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from tvm.script import tirx as T

from tvm_fuel.op import semantics as sem
from ..common import NEG_INF, ceil_div
from .device import F32, TILE_PAD
from .mma import WarpTiles, c_element
from .tiles import WarpLayout


class RegisterTiles:
    """The forward block's register-tile macros: a mixin of the forward's builder, whose loads,
    logits and emits they call."""

    def _attend_registers(self):
        # Register tiles (FlashAttention-2): warp (wm, wn) of the WarpLayout computes S for its
        # 16-row strips and key slice with mma.sync, runs the online softmax on the fragments
        # (row max and sum over the 4 lanes of a row by shuffles, l kept per lane and summed
        # once at the end), rescales O in place and feeds P (converted to the input dtype in
        # registers: S's C fragments are P's A fragments) to P V. Key-split warps merge their
        # (max, sum, O) through shared memory at the end.
        spec, launch, tiles = self.spec, self.launch, self.tiles
        BQ, BK, DP, dtype, local = self.BQ, self.BK, self.DP, spec.dtype, launch.local
        STAGES, PAD = tiles.stages, TILE_PAD
        walk_keys = self.walk_keys
        layout = WarpLayout.of(tiles)
        wt = WarpTiles(launch, dtype, tiles.warps)
        WN, MT, NS = layout.key_warps, layout.m_tiles, layout.key_slice // 8
        DT, R, SL = DP // 8, 2 * layout.m_tiles, wt.slots
        own = launch.owned
        frow, fcol, slot, o_at = self._fragments(wt, layout)
        register_tile = self._register_tile(wt, layout)
        load_queries, load_keys, emit, emit_lse = self.load_queries, self.load_keys, self.emit, self.emit_lse
        merge_warps = self._merge_warps(wt, layout)

        @T.macro
        def emit_warp(sc, prm, blk, w, tx):
            # warp w's rows of the output and their lse, straight from its fragments (one key warp)
            for li in wt.lanes():
                for mt in own(MT):
                    for dt in own(DT):
                        for i in own(4):
                            emit(prm, blk, frow(w, li, tx, mt, i), fcol(li, tx, dt, i),
                                 sc.o[slot(w, li, tx), o_at(mt, dt, i)], sc.m[slot(w, li, tx), mt * 2 + i // 2],
                                 sc.l[slot(w, li, tx), mt * 2 + i // 2])
                    if wt.lane_of(li, tx) % 4 == 0:
                        for i in own(2):
                            emit_lse(prm, blk, frow(w, li, tx, mt, 2 * i), sc.m[slot(w, li, tx), mt * 2 + i],
                                     sc.l[slot(w, li, tx), mt * 2 + i])

        @T.macro
        def attend_registers(prm, blk, tx):
            Qs = T.alloc_buffer((BQ, DP + PAD), dtype, scope=launch.shared)
            Ks = T.alloc_buffer((STAGES * BK, DP + PAD), dtype, scope=launch.shared)  # STAGES tiles in flight
            Vs = T.alloc_buffer((STAGES * BK, DP + PAD), dtype, scope=launch.shared)
            pages = T.alloc_buffer((STAGES * BK,) if self.paged else (1,), "int64", scope=launch.small_shared)
            s = T.alloc_buffer((SL, MT * NS * 4), F32, scope=local)  # S, then P, of the warp's strips x key slice
            o = T.alloc_buffer((SL, MT * DT * 4), F32, scope=local)
            m = T.alloc_buffer((SL, R), F32, scope=local)  # row max (quad-reduced) and per-lane partial sum
            l = T.alloc_buffer((SL, R), F32, scope=local)
            mx = T.alloc_buffer((SL, R), F32, scope=local)
            alpha = T.alloc_buffer((SL, R), F32, scope=local)
            qa = T.alloc_buffer((SL, 8), dtype, scope=local)
            kb = T.alloc_buffer((SL, 8), dtype, scope=local)
            pa = T.alloc_buffer((SL, 8), dtype, scope=local)
            vb = T.alloc_buffer((SL, 8), dtype, scope=local)
            flags = T.alloc_buffer((2,), "int32", scope=launch.small_shared)  # a V tile held NaN or Inf
            # T.meta_var: the bundle stays a Python value (an assignment would make it a TIR variable)
            sc = T.meta_var(RegisterScratch(Qs, Ks, Vs, pages, flags, s, o, m, l, mx, alpha, qa, kb, pa, vb))
            if tx == 0:  # the first tile's slot (the first tile index may be odd); each tile resets the next
                flags[0] = 0
                flags[1] = 0
            load_queries(sc, prm, blk, tx)
            wt.fill(m, R, T.float32(NEG_INF), tx)
            wt.fill(l, R, T.float32(0), tx)
            wt.fill(o, MT * DT * 4, T.float32(0), tx)
            walk_keys(blk, lambda kt, st: load_keys(sc, prm, blk, kt, st, tx),
                      lambda kt, st: register_tile(sc, prm, blk, kt, st, tx))
            for wi in wt.warp_loop():
                wt.quad_sum(l, R, wt.warp_of(wi, tx), tx)
            if WN == 1:
                for wi in wt.warp_loop():
                    emit_warp(sc, prm, blk, wt.warp_of(wi, tx), tx)
            else:
                merge_warps(sc, prm, blk, tx)

        return attend_registers

    def _merge_warps(self, wt: WarpTiles, layout: WarpLayout):
        """Macro ``merge_warps(sc, prm, blk, tx)``: the key-split warps' (max, sum, O) of each row,
        combined through shared memory as split-KV's merge does, then emitted."""
        launch, ops, BQ, DP, NT, local = self.launch, self.ops, self.BQ, self.DP, self.NT, self.launch.local
        WM, WN, MT, DT = layout.row_warps, layout.key_warps, layout.m_tiles, DP // 8
        own = launch.owned
        frow, fcol, slot, o_at = self._fragments(wt, layout)
        emit, emit_lse, out_row, out_col = self.emit, self.emit_lse, self.out_row, self.out_col
        drain = ops.wait(0)  # every copy this thread issued has landed

        @T.macro
        def stash_warp(sc, merged_m, merged_l, merged_o, w, tx):
            # warp w's row max, sum and O into the merge buffers of its key slice
            for li in wt.lanes():
                for mt in own(MT):
                    if wt.lane_of(li, tx) % 4 == 0:
                        for i in own(2):
                            merged_m[w // WM, frow(w, li, tx, mt, 2 * i)] = sc.m[slot(w, li, tx), mt * 2 + i]
                            merged_l[w // WM, frow(w, li, tx, mt, 2 * i)] = sc.l[slot(w, li, tx), mt * 2 + i]
                    for dt in own(DT):
                        for i in own(4):
                            merged_o[w // WM, frow(w, li, tx, mt, i), fcol(li, tx, dt, i)] = sc.o[
                                slot(w, li, tx), o_at(mt, dt, i)]

        @T.macro
        def merge_warps(sc, prm, blk, tx):
            # the key-split warps' (max, sum, O) of each row, combined as split-KV's merge does
            merged_o = T.alloc_buffer((WN, BQ, DP), F32, scope=launch.shared)
            merged_m = T.alloc_buffer((WN, BQ), F32, scope=launch.small_shared)
            merged_l = T.alloc_buffer((WN, BQ), F32, scope=launch.small_shared)
            top = T.alloc_buffer((1,), F32, scope=local)
            weight = T.alloc_buffer((1,), F32, scope=local)
            acc = T.alloc_buffer((1,), F32, scope=local)
            drain()  # no copy may still be landing in memory merged_o shares (the tail groups are empty today)
            ops.sync()  # the last tile's readers are done (merged_o may share their memory)
            for wi in wt.warp_loop():
                stash_warp(sc, merged_m, merged_l, merged_o, wt.warp_of(wi, tx), tx)
            ops.sync()
            for i in range(ceil_div(BQ * DP, NT)):
                if i * NT + tx < BQ * DP:
                    top[0] = T.float32(NEG_INF)
                    for wn in range(WN):
                        top[0] = T.max(top[0], merged_m[wn, out_row(i, tx)])
                    weight[0] = T.float32(0)
                    acc[0] = T.float32(0)
                    for wn in range(WN):
                        weight[0] = weight[0] + merged_l[wn, out_row(i, tx)] * T.exp(
                            merged_m[wn, out_row(i, tx)] - sem.safe_row_max(top[0]))
                        acc[0] = acc[0] + merged_o[wn, out_row(i, tx), out_col(i, tx)] * T.exp(
                            merged_m[wn, out_row(i, tx)] - sem.safe_row_max(top[0]))
                    emit(prm, blk, out_row(i, tx), out_col(i, tx), acc[0], top[0], weight[0])
                    if out_col(i, tx) == 0:
                        emit_lse(prm, blk, out_row(i, tx), top[0], weight[0])

        return merge_warps

    def _fragments(self, wt: WarpTiles, layout: WarpLayout):
        """frow(w, li, tx, mt, i): block row of C element i of the lane's strip mt; fcol(li, tx, nt,
        i): column of C element i of n-tile nt; slot(w, li, tx): the lane's row of the fragments;
        o_at(mt, dt, i): C element i of O tile (mt, dt) in o."""
        WM, MT, DT = layout.row_warps, layout.m_tiles, self.DP // 8

        def frow(w, li, tx, mt, i):
            return (w % WM * MT + mt) * 16 + c_element(wt.lane_of(li, tx), i)[0]

        def fcol(li, tx, nt, i):
            return nt * 8 + c_element(wt.lane_of(li, tx), i)[1]

        def slot(w, li, tx):
            return wt.slot(w, wt.lane_of(li, tx))

        def o_at(mt, dt, i):
            return (mt * DT + dt) * 4 + i

        return frow, fcol, slot, o_at

    def _register_tile(self, wt: WarpTiles, layout: WarpLayout):
        """Macro ``register_tile(sc, prm, blk, kt, st, tx)``: one key tile (in stage st) of every warp
        of the block: S, the online softmax, P V, and the NaN rule's terms."""
        launch, ops, dtype, BK, DP = self.launch, self.ops, self.spec.dtype, self.BK, self.DP
        WM, MT, KS = layout.row_warps, layout.m_tiles, layout.key_slice
        NS, DT, KD, R = KS // 8, DP // 8, DP // 16, 2 * layout.m_tiles
        own = launch.owned
        frow, fcol, slot, o_at = self._fragments(wt, layout)

        def fkey(w, li, tx, nt, i):  # tile key of C element i of the lane's S tile nt
            return w // WM * KS + nt * 8 + c_element(wt.lane_of(li, tx), i)[1]

        def s_at(mt, nt, i):  # C element i of S tile (mt, nt) in s
            return (mt * NS + nt) * 4 + i

        def r_at(mt, i):  # the row (of the lane's R) that C element i of strip mt lies in
            return mt * 2 + i // 2

        @T.macro
        def tile_scores(sc, st, w, tx):
            for li in wt.lanes():
                for e in own(MT * NS * 4):
                    sc.s[slot(w, li, tx), e] = T.float32(0)
            for mt in own(MT):
                for kk in own(KD):
                    wt.load_a(sc.qa, 0, sc.Qs, (w % WM * MT + mt) * 16, kk * 16, w, tx)
                    for n2 in own(NS // 2):
                        wt.load_b(sc.kb, 0, sc.Ks, st * BK + w // WM * KS + n2 * 16, kk * 16, w, tx)
                        wt.mma(sc.s, (mt * NS + 2 * n2) * 4, sc.qa, 0, sc.kb, 0, w)
                        wt.mma(sc.s, (mt * NS + 2 * n2 + 1) * 4, sc.qa, 0, sc.kb, 4, w)

        @T.macro
        def tile_softmax(sc, prm, blk, kt, w, tx):
            for li in wt.lanes():
                for r in own(R):
                    sc.mx[slot(w, li, tx), r] = sc.m[slot(w, li, tx), r]
                for mt in own(MT):
                    for nt in own(NS):
                        for i in own(4):
                            sc.s[slot(w, li, tx), s_at(mt, nt, i)] = T.if_then_else(
                                blk.live(frow(w, li, tx, mt, i)),
                                self.logit(sc.s[slot(w, li, tx), s_at(mt, nt, i)], prm, blk, frow(w, li, tx, mt, i),
                                           kt * BK + fkey(w, li, tx, nt, i), self.needs_mask(blk, kt)),
                                T.float32(NEG_INF))
                            sc.mx[slot(w, li, tx), r_at(mt, i)] = T.max(sc.mx[slot(w, li, tx), r_at(mt, i)],
                                                                        sc.s[slot(w, li, tx), s_at(mt, nt, i)])
            wt.quad_max(sc.mx, R, w, tx)
            for li in wt.lanes():
                for r in own(R):
                    sc.alpha[slot(w, li, tx), r] = T.exp(
                        sc.m[slot(w, li, tx), r] - sem.safe_row_max(sc.mx[slot(w, li, tx), r]))
                    sc.l[slot(w, li, tx), r] = sc.l[slot(w, li, tx), r] * sc.alpha[slot(w, li, tx), r]
                    sc.m[slot(w, li, tx), r] = sc.mx[slot(w, li, tx), r]
                for mt in own(MT):
                    for nt in own(NS):
                        for i in own(4):
                            sc.s[slot(w, li, tx), s_at(mt, nt, i)] = T.exp(
                                sc.s[slot(w, li, tx), s_at(mt, nt, i)]
                                - sem.safe_row_max(sc.m[slot(w, li, tx), r_at(mt, i)]))
                            sc.l[slot(w, li, tx), r_at(mt, i)] = (
                                sc.l[slot(w, li, tx), r_at(mt, i)] + sc.s[slot(w, li, tx), s_at(mt, nt, i)])
                    for dt in own(DT):
                        for i in own(4):
                            sc.o[slot(w, li, tx), o_at(mt, dt, i)] = (
                                sc.o[slot(w, li, tx), o_at(mt, dt, i)] * sc.alpha[slot(w, li, tx), r_at(mt, i)])

        @T.macro
        def tile_values(sc, st, w, tx):
            for mt in own(MT):
                for kb in own(KS // 16):
                    for li in wt.lanes():
                        for i in own(8):
                            sc.pa[slot(w, li, tx), i] = T.Cast(
                                dtype, sc.s[slot(w, li, tx), (mt * NS + 2 * kb + i // 4) * 4 + i % 4])
                    for d2 in own(DT // 2):
                        wt.load_b_trans(sc.vb, 0, sc.Vs, st * BK + w // WM * KS + kb * 16, d2 * 16, w, tx)
                        wt.mma(sc.o, (mt * DT + 2 * d2) * 4, sc.pa, 0, sc.vb, 0, w)
                        wt.mma(sc.o, (mt * DT + 2 * d2 + 1) * 4, sc.pa, 0, sc.vb, 4, w)

        # The NaN rule (tvm_fuel.op.semantics) on tensor cores: the V tile's NaN and Inf are zeroed
        # for the P V mma and added back to the rows whose weight is not 0. One flag per tile
        # parity: a slot is reset by the next tile, after the pipeline's barriers that follow
        # its readers, and reused the tile after that.
        zero_nonfinite_values = ops.zero_nonfinite(BK, DP)
        nonfinite_values = wt.nonfinite_terms(MT, KS, DP, self.spec.head_dim)

        @T.macro
        def register_tile(sc, prm, blk, kt, st, tx):
            if tx == 0:
                sc.flags[(kt + 1) % 2] = 0
            zero_nonfinite_values(sc.Vs, st * BK, sc.flags, kt % 2, tx)
            for wi in wt.warp_loop():
                tile_scores(sc, st, wt.warp_of(wi, tx), tx)
                tile_softmax(sc, prm, blk, kt, wt.warp_of(wi, tx), tx)
                tile_values(sc, st, wt.warp_of(wi, tx), tx)
                # read into a register first: TVM's sync planner takes no shared load in a condition
                flagged: T.int32 = sc.flags[kt % 2]
                if flagged != 0:
                    nonfinite_values(sc.o, sc.s,
                                     lambda w, j, d: self.kv_at(prm, "v", sc.pages, blk, st, w // WM * KS + j,
                                                                kt * BK + w // WM * KS + j, d),
                                     lambda w, j: kt * BK + w // WM * KS + j < blk.kv_len, wt.warp_of(wi, tx), tx)

        return register_tile


@dataclass(frozen=True)
class RegisterScratch:
    """A register-tile block's memory. Shared: Q, ``stages`` K and V tiles, their page ids and
    the V tiles' NaN flags; fragments: s (S, then P), o, m (row max), l (per-lane row sum), mx
    (the new max), alpha, and the mma operands qa, kb, pa, vb."""

    Qs: Any
    Ks: Any
    Vs: Any
    pages: Any
    flags: Any
    s: Any
    o: Any
    m: Any
    l: Any
    mx: Any
    alpha: Any
    qa: Any
    kb: Any
    pa: Any
    vb: Any
