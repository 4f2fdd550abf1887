"""CUDA forward attention kernels: dense flash attention (with lse) and paged attention.

One thread block per (row tile, batch x KV head, split). A row tile packs ``block_q`` task rows
(query position x head of the GQA group, as on CPU), so each K/V tile is loaded into shared
memory once per group. Per key tile: ``S = Q K^T`` (tensor cores for float16/bfloat16), the
online-softmax update one thread per row (masks, softcap, ALiBi from ``schedules.common``; only
boundary tiles are masked unless a per-element transform is on), ``P V`` into shared memory and
the rescaled accumulation into each thread's registers. A block walks only the key tiles its
rows can see (causal/window bounds and the sequence length). K/V tiles stream through a
``stages``-deep ``cp.async`` pipeline: while a tile is computed, the next ones are in flight.

The paged kernel reads its key tiles through the block table (ids clamped into the cache: a
device kernel cannot assert) and stops at ``context_lens[b]`` (clamped to the table's capacity),
so only live blocks are visited. With ``splits > 1`` the blocks of one row tile share its key
tiles; each writes a normalized partial output and its lse, and a merge kernel combines them
(split-KV, for long contexts with few (batch, head) tasks). No buffer grows with Sq * Sk.

Contents:
    dense_forward -- PrimFunc(q, k, v, [alibi_slopes], [attn_mask], out, [lse])
    paged_forward -- PrimFunc(q, k_cache, v_cache, block_table, context_lens, [alibi_slopes], out)
"""

from __future__ import annotations

from typing import Mapping

from tvm import tirx
from tvm.script import tirx as T

from ... import semantics as sem
from ..common import (drop_params, finish, KernelSpec, key_tile_range, masked_logit, param_buffers, row_head,
                      row_position, shape_vars, tile_is_interior)
from .device import F32, HALF_TYPES, TILE_PAD, Launch, Rows, TileOps, padded_dim
from .mma import WarpTiles, c_element
from .tiles import CudaTiles, WarpLayout


def _ceil(a: int, b: int) -> int:
    return -(-a // b)


class _Body:
    """The macros of one forward block, specialised to a spec, tiles and launch."""

    def __init__(self, spec: KernelSpec, tiles: CudaTiles, launch: Launch, *, paged: bool):
        ops = TileOps(launch, spec.dtype)
        cfg, dtype, group, D = spec.cfg, spec.dtype, spec.group, spec.head_dim
        BQ, BK, DP, NT, BS = tiles.block_q, tiles.block_k, padded_dim(D), launch.threads, spec.block_size
        SPLITS, STAGES = tiles.splits, tiles.stages
        scale = spec.scale
        local = launch.local
        # float16/bfloat16: register tiles (mma.sync), on the device and, lane by lane, in the emulation
        registers = spec.dtype in HALF_TYPES
        qk = None if registers else ops.gemm(BQ, BK, DP, b_trans=True)
        PAD = TILE_PAD if registers else 0
        self.ops = ops

        copy_queries, copy_keys = ops.copy(BQ, D, DP), ops.copy(BK, D, DP, asynchronous=True)
        pipeline = ops.pipeline(STAGES)
        drain = ops.wait(0)  # every copy this thread issued has landed

        def stage(tiles_buffer, index):  # a [BK, DP + PAD] stage of a K or V buffer
            return Rows.stage(tiles_buffer, index, BK)

        @T.macro
        def load_queries(Qs, q, b, g, r0, rows, tx):
            copy_queries(Qs, lambda r: r0 + r < rows,
                         lambda r, c: q[b, row_head(g, r0 + r, group), row_position(r0 + r, group), c], tx)

        @T.macro
        def load_keys(Ks, Vs, pages, k, v, table, b, g, kt, st, kv_len, num_blocks, tx):
            # key tile kt of K and V into stage st (zero past kv_len and in the padding columns),
            # issued as cp.async copies on the device: the caller commits and waits
            if paged:
                for i in range(_ceil(BK, NT)):
                    if i * NT + tx < BK:
                        # the tile's block ids, read once (dead tokens reuse block 0; never read past the table)
                        if kt * BK + i * NT + tx < kv_len:
                            pages[st * BK + i * NT + tx] = T.max(T.min(T.Cast("int64", table[b, (kt * BK + i * NT + tx) // BS]), num_blocks - 1), T.int64(0))
                        else:
                            pages[st * BK + i * NT + tx] = T.int64(0)
                ops.sync()
                copy_keys(stage(Ks, st), lambda r: kt * BK + r < kv_len, lambda r, c: k[pages[st * BK + r], (kt * BK + r) % BS, g, c], tx)
                copy_keys(stage(Vs, st), lambda r: kt * BK + r < kv_len, lambda r, c: v[pages[st * BK + r], (kt * BK + r) % BS, g, c], tx)
            else:
                copy_keys(stage(Ks, st), lambda r: kt * BK + r < kv_len, lambda r, c: k[b, g, kt * BK + r, c], tx)
                copy_keys(stage(Vs, st), lambda r: kt * BK + r < kv_len, lambda r, c: v[b, g, kt * BK + r, c], tx)

        def logit_of(score, alibi, mask, b, h, pos, key, kv_len, delta, check):
            s = sem.softcap(cfg, score * T.float32(scale))
            if spec.elementwise_logits:
                return masked_logit(spec, s, alibi, mask, b, h, pos, key, kv_len, delta)
            return T.Select(check, masked_logit(spec, s, alibi, mask, b, h, pos, key, kv_len, delta), s)

        def row_logit(S, alibi, mask, b, g, r0, r, c, key0, kv_len, delta, check):
            return logit_of(S[r, c], alibi, mask, b, row_head(g, r0 + r, group), row_position(r0 + r, group), key0 + c,
                            kv_len, delta, check)

        # RT threads share a row of the softmax update (a power of two within a warp, combined by
        # shuffles), so every thread is busy and a warp reads S without bank conflicts
        RT = NT // BQ if NT % BQ == 0 and 1 < NT // BQ <= 32 and BK % (NT // BQ) == 0 else 1
        SLOTS = _ceil(BQ * RT, NT)  # (row, part) slots per thread
        SHUFFLES = RT.bit_length() - 1  # xor-shuffle steps over the RT lanes of a row

        def slot_row(i, tx):
            return (i * NT + tx) // RT

        def slot_part(i, tx):
            return (i * NT + tx) % RT

        def warp_max(x, lanes):
            return T.max(x, T.tvm_warp_shuffle_xor(T.uint32(0xFFFFFFFF), x, lanes, 32, 32))

        def warp_sum(x, lanes):
            return x + T.tvm_warp_shuffle_xor(T.uint32(0xFFFFFFFF), x, lanes, 32, 32)

        @T.macro
        def softmax_rows(S, P, m, l, alpha, alibi, mask, b, g, r0, rows, key0, kv_len, delta, check, tx):
            # The online-softmax update: the RT threads of a row find its new max and sum from the
            # logits they hold in registers (m and l stay in registers too), write their elements
            # of P = exp(logit - new max) and publish alpha (the rescale of O). Shuffles run on
            # every lane (padded rows contribute -inf, so their P is 0). S and P are distinct
            # static buffers: TVM's sync planner needs no barrier inside this conditional loop.
            part = T.alloc_buffer((BK // RT,), F32, scope=local)
            top = T.alloc_buffer((1,), F32, scope=local)
            total = T.alloc_buffer((1,), F32, scope=local)
            for i in range(SLOTS):
                if i * NT + tx < BQ * RT:
                    top[0] = m[i]
                    for c in range(BK // RT):
                        part[c] = T.if_then_else(r0 + slot_row(i, tx) < rows, row_logit(S, alibi, mask, b, g, r0, slot_row(i, tx), c * RT + slot_part(i, tx), key0, kv_len, delta, check), T.float32(float("-inf")))
                        top[0] = T.max(top[0], part[c])
                    if RT > 1:
                        for n in T.unroll(SHUFFLES):
                            top[0] = warp_max(top[0], T.shift_left(1, n))
                    total[0] = T.float32(0)
                    for c in range(BK // RT):
                        part[c] = T.exp(part[c] - sem.safe_row_max(top[0]))
                        P[slot_row(i, tx), c * RT + slot_part(i, tx)] = T.Cast(dtype, part[c])
                        total[0] = total[0] + part[c]
                    if RT > 1:
                        for n in T.unroll(SHUFFLES):
                            total[0] = warp_sum(total[0], T.shift_left(1, n))
                    if slot_part(i, tx) == 0:
                        alpha[slot_row(i, tx)] = T.exp(m[i] - sem.safe_row_max(top[0]))
                    l[i] = l[i] * T.exp(m[i] - sem.safe_row_max(top[0])) + total[0]
                    m[i] = top[0]

        def key_walk(r0, rows, split, kv_len, Sq):
            """(first, count): the key tiles this block's split walks (those its rows can see)."""
            lo, hi = key_tile_range(cfg, first_pos=row_position(r0, group),
                                    last_pos=row_position(T.min(r0 + BQ, rows) - 1, group), kv_len=kv_len,
                                    delta=kv_len - Sq, block_k=BK)
            per = (hi - lo + SPLITS - 1) // SPLITS
            return lo + split * per, T.max(lo + split * per, T.min(hi, lo + split * per + per)) - lo - split * per

        def needs_mask(kt, r0, rows, kv_len, Sq):
            """Whether key tile kt masks any element of the block's rows (interior tiles skip it)."""
            if spec.elementwise_logits:
                return T.bool(True)
            return tirx.Not(tile_is_interior(
                cfg, key_start=kt * BK, first_pos=row_position(r0, group),
                last_pos=row_position(T.min(r0 + BQ, rows) - 1, group), kv_len=kv_len, delta=kv_len - Sq, block_k=BK))

        @T.macro
        def emit(out, part_o, b, g, r0, rows, split, row, col, acc, row_sum):
            # element (row, col) of the block's output: normalized (a split's partial O is float32)
            if tirx.all(r0 + row < rows, col < D):
                if SPLITS == 1:
                    out[b, row_head(g, r0 + row, group), row_position(r0 + row, group), col] = T.Cast(dtype, sem.normalize(acc, row_sum))
                else:
                    part_o[b, row_head(g, r0 + row, group), row_position(r0 + row, group), split, col] = sem.normalize(acc, row_sum)

        @T.macro
        def emit_lse(lse, part_lse, b, g, r0, rows, split, row, row_max, row_sum):
            if r0 + row < rows:
                if SPLITS > 1:
                    part_lse[b, row_head(g, r0 + row, group), row_position(r0 + row, group), split] = sem.log_sum_exp(sem.safe_row_max(row_max), row_sum)
                elif spec.return_lse:
                    lse[b, row_head(g, r0 + row, group), row_position(r0 + row, group)] = sem.log_sum_exp(sem.safe_row_max(row_max), row_sum)

        @T.macro
        def simt_tile(S, P, m, l, alpha, O, Qs, Ks, Vs, alibi, mask, b, g, r0, rows, kt, st, kv_len, Sq, tx):
            qk(S, Qs, stage(Ks, st), tx)
            ops.sync()
            softmax_rows(S, P, m, l, alpha, alibi, mask, b, g, r0, rows, kt * BK, kv_len, kv_len - Sq,
                         needs_mask(kt, r0, rows, kv_len, Sq), tx)
            ops.sync()
            # each thread multiplies straight into the elements of O it owns
            for i in launch.owned(_ceil(BQ * DP, NT)):
                if i * NT + tx < BQ * DP:
                    O[i] = O[i] * alpha[(i * NT + tx) // DP]
                    for c in range(BK):
                        O[i] = sem.add_weighted(O[i], T.Cast(F32, P[(i * NT + tx) // DP, c]), T.Cast(F32, stage(Vs, st)[c, (i * NT + tx) % DP]))

        @T.macro
        def attend_simt(q, k, v, table, alibi, mask, out, lse, part_o, part_lse, b, g, r0, split, rows, Sq, kv_len,
                        num_blocks, tx):
            Qs = T.alloc_buffer((BQ, DP), dtype, scope=launch.shared)
            Ks = T.alloc_buffer((STAGES * BK, DP), dtype, scope=launch.shared)  # STAGES tiles in flight
            Vs = T.alloc_buffer((STAGES * BK, DP), dtype, scope=launch.shared)
            # S and P in static shared memory: TVM's sync planner tells them apart from the dynamic
            # tiles, so the passes reading one and writing the other need no extra barriers
            S = T.alloc_buffer((BQ, BK + 4), F32, scope=launch.small_shared)  # +4: fewer bank conflicts
            P = T.alloc_buffer((BQ, BK), dtype, scope=launch.small_shared)
            m = T.alloc_buffer((SLOTS,), F32, scope=local)  # max and sum of the rows this thread works on
            l = T.alloc_buffer((SLOTS,), F32, scope=local)
            row_max = T.alloc_buffer((BQ,), F32, scope=launch.small_shared)  # published after the last tile
            row_sum = T.alloc_buffer((BQ,), F32, scope=launch.small_shared)
            alpha = T.alloc_buffer((BQ,), F32, scope=launch.small_shared)
            pages = T.alloc_buffer((STAGES * BK,) if paged else (1,), "int64", scope=launch.small_shared)
            O = T.alloc_buffer((_ceil(BQ * DP, NT),), F32, scope=local)
            load_queries(Qs, q, b, g, r0, rows, tx)
            for i in range(SLOTS):
                m[i] = T.float32(float("-inf"))
                l[i] = T.float32(0)
            for i in range(_ceil(BQ * DP, NT)):
                O[i] = T.float32(0)
            first, count = key_walk(r0, rows, split, kv_len, Sq)
            pipeline(count,
                     lambda t, st: load_keys(Ks, Vs, pages, k, v, table, b, g, first + t, st, kv_len, num_blocks, tx),
                     lambda t, st: simt_tile(S, P, m, l, alpha, O, Qs, Ks, Vs, alibi, mask, b, g, r0, rows, first + t,
                                             st, kv_len, Sq, tx))
            for i in range(SLOTS):
                if tirx.all(i * NT + tx < BQ * RT, slot_part(i, tx) == 0):
                    row_max[slot_row(i, tx)] = m[i]
                    row_sum[slot_row(i, tx)] = l[i]
            ops.sync()
            for i in range(_ceil(BQ * DP, NT)):
                if i * NT + tx < BQ * DP:
                    emit(out, part_o, b, g, r0, rows, split, (i * NT + tx) // DP, (i * NT + tx) % DP, O[i],
                         row_sum[(i * NT + tx) // DP])
            for i in range(_ceil(BQ, NT)):
                if i * NT + tx < BQ:
                    emit_lse(lse, part_lse, b, g, r0, rows, split, i * NT + tx, row_max[i * NT + tx], row_sum[i * NT + tx])

        if registers:
            # Register tiles (FlashAttention-2): warp (wm, wn) of the WarpLayout computes S for its
            # 16-row strips and key slice with mma.sync, runs the online softmax on the fragments
            # (row max and sum over the 4 lanes of a row by shuffles, l kept per lane and summed
            # once at the end), rescales O in place and feeds P (converted to the input dtype in
            # registers: S's C fragments are P's A fragments) to P V. Key-split warps merge their
            # (max, sum, O) through shared memory at the end.
            layout = WarpLayout.of(tiles)
            wt = WarpTiles(launch, dtype, tiles.warps)
            WM, WN, MT, KS = layout.row_warps, layout.key_warps, layout.m_tiles, layout.key_slice
            NS, DT, KD, R, SL = KS // 8, DP // 8, DP // 16, 2 * layout.m_tiles, wt.slots
            own = launch.owned

            def frow(w, lane, mt, i):  # block row of C element i of the lane's strip mt
                return (w % WM * MT + mt) * 16 + c_element(lane, i)[0]

            def fkey(w, lane, nt, i):  # tile key of C element i of the lane's S tile nt
                return w // WM * KS + nt * 8 + c_element(lane, i)[1]

            @T.macro
            def tile_scores(s, qa, kb, Qs, Ks, st, w, tx):
                for li in wt.lanes():
                    for e in own(MT * NS * 4):
                        s[wt.slot(w, wt.lane_of(li, tx)), e] = T.float32(0)
                for mt in own(MT):
                    for kk in own(KD):
                        wt.load_a(qa, 0, Qs, (w % WM * MT + mt) * 16, kk * 16, w, tx)
                        for n2 in own(NS // 2):
                            wt.load_b(kb, 0, Ks, st * BK + w // WM * KS + n2 * 16, kk * 16, w, tx)
                            wt.mma(s, (mt * NS + 2 * n2) * 4, qa, 0, kb, 0, w)
                            wt.mma(s, (mt * NS + 2 * n2 + 1) * 4, qa, 0, kb, 4, w)

            @T.macro
            def tile_softmax(s, o, m, l, mx, alpha, alibi, mask, b, g, r0, rows, key0, kv_len, delta, check, w, tx):
                for li in wt.lanes():
                    for r in own(R):
                        mx[wt.slot(w, wt.lane_of(li, tx)), r] = m[wt.slot(w, wt.lane_of(li, tx)), r]
                    for mt in own(MT):
                        for nt in own(NS):
                            for i in own(4):
                                s[wt.slot(w, wt.lane_of(li, tx)), (mt * NS + nt) * 4 + i] = T.if_then_else(
                                    r0 + frow(w, wt.lane_of(li, tx), mt, i) < rows,
                                    logit_of(s[wt.slot(w, wt.lane_of(li, tx)), (mt * NS + nt) * 4 + i], alibi, mask, b,
                                             row_head(g, r0 + frow(w, wt.lane_of(li, tx), mt, i), group),
                                             row_position(r0 + frow(w, wt.lane_of(li, tx), mt, i), group),
                                             key0 + fkey(w, wt.lane_of(li, tx), nt, i), kv_len, delta, check),
                                    T.float32(float("-inf")))
                                mx[wt.slot(w, wt.lane_of(li, tx)), mt * 2 + i // 2] = T.max(
                                    mx[wt.slot(w, wt.lane_of(li, tx)), mt * 2 + i // 2],
                                    s[wt.slot(w, wt.lane_of(li, tx)), (mt * NS + nt) * 4 + i])
                wt.quad_max(mx, R, w, tx)
                for li in wt.lanes():
                    for r in own(R):
                        alpha[wt.slot(w, wt.lane_of(li, tx)), r] = T.exp(
                            m[wt.slot(w, wt.lane_of(li, tx)), r] - sem.safe_row_max(mx[wt.slot(w, wt.lane_of(li, tx)), r]))
                        l[wt.slot(w, wt.lane_of(li, tx)), r] = l[wt.slot(w, wt.lane_of(li, tx)), r] * alpha[wt.slot(w, wt.lane_of(li, tx)), r]
                        m[wt.slot(w, wt.lane_of(li, tx)), r] = mx[wt.slot(w, wt.lane_of(li, tx)), r]
                    for mt in own(MT):
                        for nt in own(NS):
                            for i in own(4):
                                s[wt.slot(w, wt.lane_of(li, tx)), (mt * NS + nt) * 4 + i] = T.exp(
                                    s[wt.slot(w, wt.lane_of(li, tx)), (mt * NS + nt) * 4 + i]
                                    - sem.safe_row_max(m[wt.slot(w, wt.lane_of(li, tx)), mt * 2 + i // 2]))
                                l[wt.slot(w, wt.lane_of(li, tx)), mt * 2 + i // 2] = l[wt.slot(w, wt.lane_of(li, tx)), mt * 2 + i // 2] + s[wt.slot(w, wt.lane_of(li, tx)), (mt * NS + nt) * 4 + i]
                        for dt in own(DT):
                            for i in own(4):
                                o[wt.slot(w, wt.lane_of(li, tx)), (mt * DT + dt) * 4 + i] = o[wt.slot(w, wt.lane_of(li, tx)), (mt * DT + dt) * 4 + i] * alpha[wt.slot(w, wt.lane_of(li, tx)), mt * 2 + i // 2]

            @T.macro
            def tile_values(s, o, pa, vb, Vs, st, w, tx):
                for mt in own(MT):
                    for kb in own(KS // 16):
                        for li in wt.lanes():
                            for i in own(8):
                                pa[wt.slot(w, wt.lane_of(li, tx)), i] = T.Cast(dtype, s[wt.slot(w, wt.lane_of(li, tx)), (mt * NS + 2 * kb + i // 4) * 4 + i % 4])
                        for d2 in own(DT // 2):
                            wt.load_b_trans(vb, 0, Vs, st * BK + w // WM * KS + kb * 16, d2 * 16, w, tx)
                            wt.mma(o, (mt * DT + 2 * d2) * 4, pa, 0, vb, 0, w)
                            wt.mma(o, (mt * DT + 2 * d2 + 1) * 4, pa, 0, vb, 4, w)

            # The NaN rule (tvm_fuel.semantics) on tensor cores: the V tile's NaN and Inf are zeroed
            # for the P V mma and added back to the rows whose weight is not 0. One flag per tile
            # parity: a slot is reset by the next tile, after the pipeline's barriers that follow
            # its readers, and reused the tile after that.
            zero_nonfinite_values = ops.zero_nonfinite(BK, DP)
            nonfinite_values = wt.nonfinite_terms(MT, KS, DP, D)

            def value_at(v, pages, b, g, st, r, key, d):
                return v[pages[st * BK + r], key % BS, g, d] if paged else v[b, g, key, d]

            @T.macro
            def register_tile(s, o, m, l, mx, alpha, qa, kb, pa, vb, Qs, Ks, Vs, v, pages, flags, alibi, mask, b, g,
                              r0, rows, kt, st, kv_len, Sq, tx):
                if tx == 0:
                    flags[(kt + 1) % 2] = 0
                zero_nonfinite_values(Vs, st * BK, flags, kt % 2, tx)
                for wi in wt.warp_loop():
                    tile_scores(s, qa, kb, Qs, Ks, st, wt.warp_of(wi, tx), tx)
                    tile_softmax(s, o, m, l, mx, alpha, alibi, mask, b, g, r0, rows,
                                 kt * BK, kv_len, kv_len - Sq, needs_mask(kt, r0, rows, kv_len, Sq), wt.warp_of(wi, tx), tx)
                    tile_values(s, o, pa, vb, Vs, st, wt.warp_of(wi, tx), tx)
                    # read into a register first: TVM's sync planner takes no shared load in a condition
                    flagged: T.int32 = flags[kt % 2]
                    if flagged != 0:
                        nonfinite_values(o, s, lambda w, j, d: value_at(v, pages, b, g, st, w // WM * KS + j, kt * BK + w // WM * KS + j, d),
                                         lambda w, j: kt * BK + w // WM * KS + j < kv_len, wt.warp_of(wi, tx), tx)

            @T.macro
            def merge_warps(o, m, l, out, lse, part_o, part_lse, b, g, r0, rows, split, tx):
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
                    for li in wt.lanes():
                        for mt in own(MT):
                            if wt.lane_of(li, tx) % 4 == 0:
                                for i in own(2):
                                    merged_m[wt.warp_of(wi, tx) // WM, frow(wt.warp_of(wi, tx), wt.lane_of(li, tx), mt, 2 * i)] = m[wt.slot(wt.warp_of(wi, tx), wt.lane_of(li, tx)), mt * 2 + i]
                                    merged_l[wt.warp_of(wi, tx) // WM, frow(wt.warp_of(wi, tx), wt.lane_of(li, tx), mt, 2 * i)] = l[wt.slot(wt.warp_of(wi, tx), wt.lane_of(li, tx)), mt * 2 + i]
                            for dt in own(DT):
                                for i in own(4):
                                    merged_o[wt.warp_of(wi, tx) // WM, frow(wt.warp_of(wi, tx), wt.lane_of(li, tx), mt, i), dt * 8 + c_element(wt.lane_of(li, tx), i)[1]] = o[wt.slot(wt.warp_of(wi, tx), wt.lane_of(li, tx)), (mt * DT + dt) * 4 + i]
                ops.sync()
                for i in range(_ceil(BQ * DP, NT)):
                    if i * NT + tx < BQ * DP:
                        top[0] = T.float32(float("-inf"))
                        for wn in range(WN):
                            top[0] = T.max(top[0], merged_m[wn, (i * NT + tx) // DP])
                        weight[0] = T.float32(0)
                        acc[0] = T.float32(0)
                        for wn in range(WN):
                            weight[0] = weight[0] + merged_l[wn, (i * NT + tx) // DP] * T.exp(merged_m[wn, (i * NT + tx) // DP] - sem.safe_row_max(top[0]))
                            acc[0] = acc[0] + merged_o[wn, (i * NT + tx) // DP, (i * NT + tx) % DP] * T.exp(merged_m[wn, (i * NT + tx) // DP] - sem.safe_row_max(top[0]))
                        emit(out, part_o, b, g, r0, rows, split, (i * NT + tx) // DP, (i * NT + tx) % DP, acc[0], weight[0])
                        if (i * NT + tx) % DP == 0:
                            emit_lse(lse, part_lse, b, g, r0, rows, split, (i * NT + tx) // DP, top[0], weight[0])

            @T.macro
            def attend_registers(q, k, v, table, alibi, mask, out, lse, part_o, part_lse, b, g, r0, split, rows, Sq,
                                 kv_len, num_blocks, tx):
                Qs = T.alloc_buffer((BQ, DP + PAD), dtype, scope=launch.shared)
                Ks = T.alloc_buffer((STAGES * BK, DP + PAD), dtype, scope=launch.shared)  # STAGES tiles in flight
                Vs = T.alloc_buffer((STAGES * BK, DP + PAD), dtype, scope=launch.shared)
                pages = T.alloc_buffer((STAGES * BK,) if paged else (1,), "int64", scope=launch.small_shared)
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
                if tx == 0:  # the first tile's slot (the first tile index may be odd); each tile resets the next
                    flags[0] = 0
                    flags[1] = 0
                load_queries(Qs, q, b, g, r0, rows, tx)
                wt.fill(m, R, T.float32(float("-inf")), tx)
                wt.fill(l, R, T.float32(0), tx)
                wt.fill(o, MT * DT * 4, T.float32(0), tx)
                first, count = key_walk(r0, rows, split, kv_len, Sq)
                pipeline(count,
                         lambda t, st: load_keys(Ks, Vs, pages, k, v, table, b, g, first + t, st, kv_len, num_blocks, tx),
                         lambda t, st: register_tile(s, o, m, l, mx, alpha, qa, kb, pa, vb, Qs, Ks, Vs, v, pages, flags,
                                                     alibi, mask, b, g, r0, rows, first + t, st, kv_len, Sq, tx))
                for wi in wt.warp_loop():
                    wt.quad_sum(l, R, wt.warp_of(wi, tx), tx)
                if WN == 1:
                    for wi in wt.warp_loop():
                        for li in wt.lanes():
                            for mt in own(MT):
                                for dt in own(DT):
                                    for i in own(4):
                                        emit(out, part_o, b, g, r0, rows, split, frow(wt.warp_of(wi, tx), wt.lane_of(li, tx), mt, i),
                                             dt * 8 + c_element(wt.lane_of(li, tx), i)[1],
                                             o[wt.slot(wt.warp_of(wi, tx), wt.lane_of(li, tx)), (mt * DT + dt) * 4 + i],
                                             l[wt.slot(wt.warp_of(wi, tx), wt.lane_of(li, tx)), mt * 2 + i // 2])
                                if wt.lane_of(li, tx) % 4 == 0:
                                    for i in own(2):
                                        emit_lse(lse, part_lse, b, g, r0, rows, split,
                                                 frow(wt.warp_of(wi, tx), wt.lane_of(li, tx), mt, 2 * i),
                                                 m[wt.slot(wt.warp_of(wi, tx), wt.lane_of(li, tx)), mt * 2 + i],
                                                 l[wt.slot(wt.warp_of(wi, tx), wt.lane_of(li, tx)), mt * 2 + i])
                else:
                    merge_warps(o, m, l, out, lse, part_o, part_lse, b, g, r0, rows, split, tx)

        attend = attend_registers if registers else attend_simt

        @T.macro
        def merge(out, lse, part_o, part_lse, B, Hq, Sq, tx, bx):
            # out = sum_s w_s O_s / sum_s w_s with w_s = exp(lse_s - max lse); lse = max + log sum w_s
            top = T.alloc_buffer((1,), F32, scope=local)
            weight = T.alloc_buffer((1,), F32, scope=local)
            acc = T.alloc_buffer((1,), F32, scope=local)
            e = T.Cast("int64", bx) * NT + tx
            if e < B * Hq * Sq * D:
                top[0] = T.float32(float("-inf"))
                for s in range(SPLITS):
                    top[0] = T.max(top[0], part_lse[e // D // Sq // Hq, e // D // Sq % Hq, e // D % Sq, s])
                weight[0] = T.float32(0)
                acc[0] = T.float32(0)
                for s in range(SPLITS):
                    weight[0] = weight[0] + T.exp(part_lse[e // D // Sq // Hq, e // D // Sq % Hq, e // D % Sq, s] - sem.safe_row_max(top[0]))
                    acc[0] = acc[0] + T.exp(part_lse[e // D // Sq // Hq, e // D // Sq % Hq, e // D % Sq, s] - sem.safe_row_max(top[0])) * part_o[e // D // Sq // Hq, e // D // Sq % Hq, e // D % Sq, s, e % D]
                out[e // D // Sq // Hq, e // D // Sq % Hq, e // D % Sq, e % D] = T.Cast(dtype, sem.normalize(acc[0], weight[0]))
                if spec.return_lse:
                    if e % D == 0:
                        lse[e // D // Sq // Hq, e // D // Sq % Hq, e // D % Sq] = sem.log_sum_exp(sem.safe_row_max(top[0]), weight[0])

        @T.macro
        def launch_grid(q, k, v, table, alibi, mask, out, lse, part_o, part_lse, B, Hq, Sq, kv_len, num_blocks):
            # grid as FlashAttention-2's: x row tiles, y batch, z KV heads x splits (each within
            # CUDA's limits); then the split-KV merge
            for bx in launch.grid((Sq * group + BQ - 1) // BQ, "x"):
                for by in launch.grid(B, "y"):
                    for bz in launch.grid(spec.num_kv_heads * SPLITS, "z"):
                        for tx in launch.block():
                            # unrolled loops stay loops with #pragma unroll: nvcc unrolls them (registers
                            # indexed by constants), and the CUDA C is ~10x shorter than TVM's expansion
                            with T.attr(T.int32(0), "pragma_unroll_explicit", T.int32(0)):
                                attend(q, k, v, table, alibi, mask, out, lse, part_o, part_lse, T.Cast("int64", by),
                                       T.Cast("int64", bz // SPLITS), T.Cast("int64", bx) * BQ, bz % SPLITS,
                                       Sq * group, Sq, kv_len(by), num_blocks, tx)
            if SPLITS > 1:
                for bx in launch.grid((B * Hq * Sq * D + NT - 1) // NT, "x"):
                    for tx in launch.block():
                        merge(out, lse, part_o, part_lse, B, Hq, Sq, tx, bx)

        self.launch_grid = launch_grid


def dense_forward(spec: KernelSpec, tiles: CudaTiles, *, launch: Launch | None = None,
                  dims: Mapping[str, int | None] | None = None) -> tirx.PrimFunc:
    """Flash attention forward over q [B, Hq, Sq, D], k, v [B, Hkv, Sk, D] (B, Sq, Sk symbolic
    unless ``dims`` fixes them); ``launch`` defaults to ``tiles.threads`` threads per block."""
    launch = launch or Launch(tiles.threads)
    B, Sq, Sk = shape_vars(dims or {}, ("B", "Sq", "Sk"))
    body = _Body(spec, tiles, launch, paged=False)
    dtype, Hq, Hkv, D, group = spec.dtype, spec.num_q_heads, spec.num_kv_heads, spec.head_dim, spec.group
    SPLITS = tiles.splits
    has_mask = len(spec.mask_broadcast) > 0

    # fmt: off
    @T.prim_func
    def fuel_flash_attn_cuda(q_h: T.handle, k_h: T.handle, v_h: T.handle, alibi_h: T.handle, mask_h: T.handle,
                             out_h: T.handle, lse_h: T.handle):
        T.func_attr({"tirx.noalias": True})
        q, k, v, alibi, mask, out, lse = param_buffers(
            spec, dict(B=B, Sq=Sq, Sk=Sk),
            q=q_h, k=k_h, v=v_h, alibi=alibi_h, mask=mask_h, out=out_h, lse=lse_h)
        part_o = T.alloc_buffer((B, Hq, Sq, SPLITS, D) if SPLITS > 1 else (1, 1, 1, 1, 1), F32)
        part_lse = T.alloc_buffer((B, Hq, Sq, SPLITS) if SPLITS > 1 else (1, 1, 1, 1), F32)
        body.launch_grid(q, k, v, k, alibi, mask, out, lse, part_o, part_lse, B, Hq, Sq, lambda b: Sk, Sk)
    # fmt: on

    unused = ({"alibi"} if not spec.has_alibi else set()) | ({"mask"} if not has_mask else set())
    unused |= {"lse"} if not spec.return_lse else set()
    return finish(drop_params(fuel_flash_attn_cuda, unused))


def paged_forward(spec: KernelSpec, tiles: CudaTiles, *, launch: Launch | None = None,
                  dims: Mapping[str, int | None] | None = None) -> tirx.PrimFunc:
    """Paged attention over q [B, Hq, Sq, D] and caches [num_blocks, block_size, Hkv, D] through
    block_table [B, max_blocks] and context_lens [B] (the queries are the last Sq positions)."""
    launch = launch or Launch(tiles.threads)
    B, Sq, num_blocks, max_blocks = shape_vars(dims or {}, ("B", "Sq", "num_blocks", "max_blocks"))
    body = _Body(spec, tiles, launch, paged=True)
    dtype, Hq, Hkv, D, group = spec.dtype, spec.num_q_heads, spec.num_kv_heads, spec.head_dim, spec.group
    SPLITS, BS = tiles.splits, spec.block_size

    # fmt: off
    @T.prim_func
    def fuel_paged_attn_cuda(q_h: T.handle, k_cache_h: T.handle, v_cache_h: T.handle, table_h: T.handle,
                             lens_h: T.handle, alibi_h: T.handle, out_h: T.handle):
        T.func_attr({"tirx.noalias": True})
        q, k_cache, v_cache, table, lens, alibi, out = param_buffers(
            spec, dict(B=B, Sq=Sq, num_blocks=num_blocks, max_blocks=max_blocks),
            q=q_h, k_cache=k_cache_h, v_cache=v_cache_h, table=table_h, lens=lens_h, alibi=alibi_h, out=out_h)
        part_o = T.alloc_buffer((B, Hq, Sq, SPLITS, D) if SPLITS > 1 else (1, 1, 1, 1, 1), F32)
        part_lse = T.alloc_buffer((B, Hq, Sq, SPLITS) if SPLITS > 1 else (1, 1, 1, 1), F32)
        # a device kernel cannot assert: a length past the table's capacity is clamped
        body.launch_grid(q, k_cache, v_cache, table, alibi, alibi, out, out, part_o, part_lse, B, Hq, Sq,
                         lambda b: T.max(T.min(T.Cast("int64", lens[b]), max_blocks * BS), T.int64(0)), num_blocks)
    # fmt: on

    return finish(drop_params(fuel_paged_attn_cuda, set() if spec.has_alibi else {"alibi"}))
