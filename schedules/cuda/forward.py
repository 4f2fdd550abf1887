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
tiles; each writes a normalized partial output and its row max and sum, and a merge kernel
combines them (split-KV, for long contexts with few (batch, head) tasks). No buffer grows with
Sq * Sk.

Contents:
    dense_forward -- PrimFunc(q, k, v, [alibi_slopes], [attn_mask], out, [lse])
    paged_forward -- PrimFunc(q, k_cache, v_cache, block_table, context_lens, [alibi_slopes], out)
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping

from tvm import tirx
from tvm.script import tirx as T

from ... import semantics as sem
from ..common import (drop_params, finish, KernelSpec, key_tile_range, masked_logit, param_buffers, row_head,
                      row_position, shape_vars, tile_is_interior)
from .device import F32, HALF_TYPES, TILE_PAD, Launch, Rows, TileOps, padded_dim
from .mma import WarpTiles, c_element
from .tiles import CudaTiles, WarpLayout

_NEG_INF = float("-inf")


def _ceil(a: int, b: int) -> int:
    return -(-a // b)


def _lse(row_max, row_sum):
    """A row's lse from its running max and sum."""
    return sem.log_sum_exp(sem.safe_row_max(row_max), row_sum)


@dataclass(frozen=True)
class _Params:
    """A forward kernel's buffers. ``table`` and ``num_blocks`` (the cache's block count: block ids
    are clamped into it) only on the paged path, ``mask`` and ``lse`` only where the kernel has
    them (None otherwise); ``part_o`` and ``part_stats`` hold the splits' partial results (O, and
    the row max and sum; one element each without split-KV)."""

    q: Any
    k: Any
    v: Any
    out: Any
    part_o: Any
    part_stats: Any
    alibi: Any = None
    mask: Any = None
    lse: Any = None
    table: Any = None
    num_blocks: Any = None


@dataclass(frozen=True)
class _Block:
    """What one thread block works on: batch ``b``, KV head ``g``, the task rows from ``r0`` (of
    ``rows`` = Sq * group), key split ``split``; ``Sq`` queries, the last of ``kv_len`` keys."""

    b: Any
    g: Any
    r0: Any
    rows: Any
    split: Any
    Sq: Any
    kv_len: Any
    group: int

    def live(self, r):
        """Whether row r of the block is a task row (the last row tile runs past them)."""
        return self.r0 + r < self.rows

    def head(self, r):
        return row_head(self.g, self.r0 + r, self.group)

    def position(self, r):
        return row_position(self.r0 + r, self.group)

    def task(self, r):
        """(batch, query head, query position) of row r: its index into q, out and lse."""
        return self.b, self.head(r), self.position(r)

    def positions(self, block_q: int):
        """The query positions of the block's first and last task rows."""
        return row_position(self.r0, self.group), row_position(T.min(self.r0 + block_q, self.rows) - 1, self.group)

    @property
    def delta(self):
        return self.kv_len - self.Sq  # key index of query position 0


@dataclass(frozen=True)
class _SimtScratch:
    """A SIMT (float32) block's memory. Shared: Q, ``stages`` K and V tiles, their page ids;
    static shared: S, P, the rows' alpha and their final max and sum; registers: m and l (max
    and sum of the rows a thread updates) and O (the output elements a thread owns)."""

    Qs: Any
    Ks: Any
    Vs: Any
    pages: Any
    S: Any
    P: Any
    alpha: Any
    row_max: Any
    row_sum: Any
    m: Any
    l: Any
    O: Any


@dataclass(frozen=True)
class _RegisterScratch:
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


class _Body:
    """The macros of one forward block, specialised to a spec, tiles and launch: ``launch_grid``
    is the kernel body (the blocks, then the split-KV merge)."""

    def __init__(self, spec: KernelSpec, tiles: CudaTiles, launch: Launch, *, paged: bool):
        self.spec, self.tiles, self.launch, self.paged = spec, tiles, launch, paged
        self.ops = TileOps(launch, spec.dtype)
        self.BQ, self.BK, self.DP, self.NT = tiles.block_q, tiles.block_k, padded_dim(spec.head_dim), launch.threads
        self._loads()
        self._emits()
        # float16/bfloat16: register tiles (mma.sync), on the device and, lane by lane, in the emulation
        attend = self._attend_registers() if spec.dtype in HALF_TYPES else self._attend_simt()
        self.launch_grid = self._grid(attend)

    # ---- what every block does: key tiles to walk, loads, logits, results ----

    def key_walk(self, blk: _Block):
        """(first, count): the key tiles this block's split walks (those its rows can see)."""
        SPLITS = self.tiles.splits
        first_pos, last_pos = blk.positions(self.BQ)
        lo, hi = key_tile_range(self.spec.cfg, first_pos=first_pos, last_pos=last_pos, kv_len=blk.kv_len,
                                delta=blk.delta, block_k=self.BK)
        per = (hi - lo + SPLITS - 1) // SPLITS
        first = lo + blk.split * per
        return first, T.max(first, T.min(hi, first + per)) - lo - blk.split * per

    def needs_mask(self, blk: _Block, kt):
        """Whether key tile kt masks any element of the block's rows (interior tiles skip it)."""
        if self.spec.elementwise_logits:
            return T.bool(True)
        first_pos, last_pos = blk.positions(self.BQ)
        return tirx.Not(tile_is_interior(self.spec.cfg, key_start=kt * self.BK, first_pos=first_pos,
                                         last_pos=last_pos, kv_len=blk.kv_len, delta=blk.delta, block_k=self.BK))

    def logit(self, score, prm: _Params, blk: _Block, r, key, check):
        """The logit of row r and key ``key`` from the raw score: softcapped, then biased and masked
        where ``check`` holds (everywhere with a per-element transform)."""
        spec = self.spec
        capped = sem.softcap(spec.cfg, score * T.float32(spec.scale))
        logit = masked_logit(spec, capped, prm.alibi, prm.mask, blk.b, blk.head(r), blk.position(r), key, blk.kv_len,
                             blk.delta)
        return logit if spec.elementwise_logits else T.Select(check, logit, capped)

    def kv_at(self, x, pages, blk: _Block, st, r, key, c):
        """Column c of key ``key`` of x (K or V), row r of the tile in stage st: paged, through the
        block ids the stage holds."""
        if self.paged:
            return x[pages[st * self.BK + r], key % self.spec.block_size, blk.g, c]
        return x[blk.b, blk.g, key, c]

    def out_row(self, i, tx):  # row and column of element i * threads + tx of a [block_q, DP] tile
        return (i * self.NT + tx) // self.DP

    def out_col(self, i, tx):
        return (i * self.NT + tx) % self.DP

    def _loads(self):
        spec, ops, paged, BK, NT = self.spec, self.ops, self.paged, self.BK, self.NT
        D, DP, BS = spec.head_dim, self.DP, spec.block_size
        copy_queries, copy_keys = ops.copy(self.BQ, D, DP), ops.copy(BK, D, DP, asynchronous=True)

        @T.macro
        def load_queries(sc, prm, blk, tx):
            copy_queries(sc.Qs, blk.live, lambda r, c: prm.q[*blk.task(r), c], tx)

        def block_id(prm, blk, key):  # the cache block holding key ``key`` of batch b
            return T.max(T.min(T.Cast("int64", prm.table[blk.b, key // BS]), prm.num_blocks - 1), T.int64(0))

        @T.macro
        def load_pages(pages, prm, blk, kt, st, tx):
            # the block ids of key tile kt, read once (dead tokens reuse block 0; never read past the
            # table; ids clamped into the cache: a device kernel cannot assert)
            for i in range(_ceil(BK, NT)):
                if i * NT + tx < BK:
                    if kt * BK + i * NT + tx < blk.kv_len:
                        pages[st * BK + i * NT + tx] = block_id(prm, blk, kt * BK + i * NT + tx)
                    else:
                        pages[st * BK + i * NT + tx] = T.int64(0)

        @T.macro
        def load_keys(sc, prm, blk, kt, st, tx):
            # key tile kt of K and V into stage st (zero past kv_len and in the padding columns),
            # issued as cp.async copies on the device: the caller commits and waits
            if paged:
                load_pages(sc.pages, prm, blk, kt, st, tx)
                ops.sync()
            copy_keys(Rows.stage(sc.Ks, st, BK), lambda r: kt * BK + r < blk.kv_len,
                      lambda r, c: self.kv_at(prm.k, sc.pages, blk, st, r, kt * BK + r, c), tx)
            copy_keys(Rows.stage(sc.Vs, st, BK), lambda r: kt * BK + r < blk.kv_len,
                      lambda r, c: self.kv_at(prm.v, sc.pages, blk, st, r, kt * BK + r, c), tx)

        self.load_queries, self.load_keys = load_queries, load_keys

    def _emits(self):
        spec, D, SPLITS = self.spec, self.spec.head_dim, self.tiles.splits

        @T.macro
        def emit(prm, blk, row, col, acc, row_sum):
            # element (row, col) of the block's output: normalized (a split's partial O is float32)
            if tirx.all(blk.live(row), col < D):
                if SPLITS == 1:
                    prm.out[*blk.task(row), col] = T.Cast(spec.dtype, sem.normalize(acc, row_sum))
                else:
                    prm.part_o[*blk.task(row), blk.split, col] = sem.normalize(acc, row_sum)

        @T.macro
        def emit_lse(prm, blk, row, row_max, row_sum):
            if blk.live(row):
                if SPLITS > 1:  # the max and the sum, not their lse: a float32 lse of a huge
                    # finite logit cannot hold log(sum), and the merge would weigh splits alike
                    prm.part_stats[*blk.task(row), blk.split, 0] = row_max
                    prm.part_stats[*blk.task(row), blk.split, 1] = row_sum
                elif spec.return_lse:
                    prm.lse[*blk.task(row)] = _lse(row_max, row_sum)

        self.emit, self.emit_lse = emit, emit_lse

    # ---- SIMT blocks (float32) ----

    def _attend_simt(self):
        spec, launch, ops, STAGES = self.spec, self.launch, self.ops, self.tiles.stages
        BQ, BK, DP, NT, dtype, local = self.BQ, self.BK, self.DP, self.NT, spec.dtype, launch.local
        qk = ops.gemm(BQ, BK, DP, b_trans=True)
        pipeline = ops.pipeline(STAGES)
        load_queries, load_keys, emit, emit_lse = self.load_queries, self.load_keys, self.emit, self.emit_lse
        out_row, out_col = self.out_row, self.out_col

        # RT threads share a row of the softmax update (a power of two within a warp, combined by
        # shuffles), so every thread is busy and a warp reads S without bank conflicts
        RT = NT // BQ if NT % BQ == 0 and 1 < NT // BQ <= 32 and BK % (NT // BQ) == 0 else 1
        SLOTS = _ceil(BQ * RT, NT)  # (row, part) slots per thread
        SHUFFLES = RT.bit_length() - 1  # xor-shuffle steps over the RT lanes of a row

        def slot_row(i, tx):
            return (i * NT + tx) // RT

        def slot_part(i, tx):
            return (i * NT + tx) % RT

        def slot_col(i, tx, c):  # column of the slot's c-th element
            return c * RT + slot_part(i, tx)

        def warp_max(x, lanes):
            return T.max(x, T.tvm_warp_shuffle_xor(T.uint32(0xFFFFFFFF), x, lanes, 32, 32))

        def warp_sum(x, lanes):
            return x + T.tvm_warp_shuffle_xor(T.uint32(0xFFFFFFFF), x, lanes, 32, 32)

        @T.macro
        def softmax_rows(sc, prm, blk, kt, tx):
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
                    top[0] = sc.m[i]
                    for c in range(BK // RT):
                        part[c] = T.if_then_else(
                            blk.live(slot_row(i, tx)),
                            self.logit(sc.S[slot_row(i, tx), slot_col(i, tx, c)], prm, blk, slot_row(i, tx),
                                       kt * BK + slot_col(i, tx, c), self.needs_mask(blk, kt)),
                            T.float32(_NEG_INF))
                        top[0] = T.max(top[0], part[c])
                    if RT > 1:
                        for n in T.unroll(SHUFFLES):
                            top[0] = warp_max(top[0], T.shift_left(1, n))
                    total[0] = T.float32(0)
                    for c in range(BK // RT):
                        part[c] = T.exp(part[c] - sem.safe_row_max(top[0]))
                        sc.P[slot_row(i, tx), slot_col(i, tx, c)] = T.Cast(dtype, part[c])
                        total[0] = total[0] + part[c]
                    if RT > 1:
                        for n in T.unroll(SHUFFLES):
                            total[0] = warp_sum(total[0], T.shift_left(1, n))
                    if slot_part(i, tx) == 0:
                        sc.alpha[slot_row(i, tx)] = T.exp(sc.m[i] - sem.safe_row_max(top[0]))
                    sc.l[i] = sc.l[i] * T.exp(sc.m[i] - sem.safe_row_max(top[0])) + total[0]
                    sc.m[i] = top[0]

        @T.macro
        def simt_tile(sc, prm, blk, kt, st, tx):
            qk(sc.S, sc.Qs, Rows.stage(sc.Ks, st, BK), tx)
            ops.sync()
            softmax_rows(sc, prm, blk, kt, tx)
            ops.sync()
            # each thread multiplies straight into the elements of O it owns
            for i in launch.owned(_ceil(BQ * DP, NT)):
                if i * NT + tx < BQ * DP:
                    sc.O[i] = sc.O[i] * sc.alpha[out_row(i, tx)]
                    for c in range(BK):
                        sc.O[i] = sem.add_weighted(sc.O[i], T.Cast(F32, sc.P[out_row(i, tx), c]),
                                                   T.Cast(F32, Rows.stage(sc.Vs, st, BK)[c, out_col(i, tx)]))

        @T.macro
        def attend_simt(prm, blk, tx):
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
            pages = T.alloc_buffer((STAGES * BK,) if self.paged else (1,), "int64", scope=launch.small_shared)
            O = T.alloc_buffer((_ceil(BQ * DP, NT),), F32, scope=local)
            # T.meta_var: the bundle stays a Python value (an assignment would make it a TIR variable)
            sc = T.meta_var(_SimtScratch(Qs, Ks, Vs, pages, S, P, alpha, row_max, row_sum, m, l, O))
            load_queries(sc, prm, blk, tx)
            for i in range(SLOTS):
                m[i] = T.float32(_NEG_INF)
                l[i] = T.float32(0)
            for i in range(_ceil(BQ * DP, NT)):
                O[i] = T.float32(0)
            first, count = self.key_walk(blk)
            pipeline(count, lambda t, st: load_keys(sc, prm, blk, first + t, st, tx),
                     lambda t, st: simt_tile(sc, prm, blk, first + t, st, tx))
            for i in range(SLOTS):
                if tirx.all(i * NT + tx < BQ * RT, slot_part(i, tx) == 0):
                    row_max[slot_row(i, tx)] = m[i]
                    row_sum[slot_row(i, tx)] = l[i]
            ops.sync()
            for i in range(_ceil(BQ * DP, NT)):
                if i * NT + tx < BQ * DP:
                    emit(prm, blk, out_row(i, tx), out_col(i, tx), O[i], row_sum[out_row(i, tx)])
            for i in range(_ceil(BQ, NT)):
                if i * NT + tx < BQ:
                    emit_lse(prm, blk, i * NT + tx, row_max[i * NT + tx], row_sum[i * NT + tx])

        return attend_simt

    # ---- register tiles (float16/bfloat16) ----

    def _attend_registers(self):
        # Register tiles (FlashAttention-2): warp (wm, wn) of the WarpLayout computes S for its
        # 16-row strips and key slice with mma.sync, runs the online softmax on the fragments
        # (row max and sum over the 4 lanes of a row by shuffles, l kept per lane and summed
        # once at the end), rescales O in place and feeds P (converted to the input dtype in
        # registers: S's C fragments are P's A fragments) to P V. Key-split warps merge their
        # (max, sum, O) through shared memory at the end.
        spec, launch, ops, tiles = self.spec, self.launch, self.ops, self.tiles
        BQ, BK, DP, dtype, local = self.BQ, self.BK, self.DP, spec.dtype, launch.local
        STAGES, PAD = tiles.stages, TILE_PAD
        pipeline = ops.pipeline(STAGES)
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
                                 sc.o[slot(w, li, tx), o_at(mt, dt, i)], sc.l[slot(w, li, tx), mt * 2 + i // 2])
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
            sc = T.meta_var(_RegisterScratch(Qs, Ks, Vs, pages, flags, s, o, m, l, mx, alpha, qa, kb, pa, vb))
            if tx == 0:  # the first tile's slot (the first tile index may be odd); each tile resets the next
                flags[0] = 0
                flags[1] = 0
            load_queries(sc, prm, blk, tx)
            wt.fill(m, R, T.float32(_NEG_INF), tx)
            wt.fill(l, R, T.float32(0), tx)
            wt.fill(o, MT * DT * 4, T.float32(0), tx)
            first, count = self.key_walk(blk)
            pipeline(count, lambda t, st: load_keys(sc, prm, blk, first + t, st, tx),
                     lambda t, st: register_tile(sc, prm, blk, first + t, st, tx))
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
            for i in range(_ceil(BQ * DP, NT)):
                if i * NT + tx < BQ * DP:
                    top[0] = T.float32(_NEG_INF)
                    for wn in range(WN):
                        top[0] = T.max(top[0], merged_m[wn, out_row(i, tx)])
                    weight[0] = T.float32(0)
                    acc[0] = T.float32(0)
                    for wn in range(WN):
                        weight[0] = weight[0] + merged_l[wn, out_row(i, tx)] * T.exp(
                            merged_m[wn, out_row(i, tx)] - sem.safe_row_max(top[0]))
                        acc[0] = acc[0] + merged_o[wn, out_row(i, tx), out_col(i, tx)] * T.exp(
                            merged_m[wn, out_row(i, tx)] - sem.safe_row_max(top[0]))
                    emit(prm, blk, out_row(i, tx), out_col(i, tx), acc[0], weight[0])
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
                                T.float32(_NEG_INF))
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

        # The NaN rule (tvm_fuel.semantics) on tensor cores: the V tile's NaN and Inf are zeroed
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
                                     lambda w, j, d: self.kv_at(prm.v, sc.pages, blk, st, w // WM * KS + j,
                                                                kt * BK + w // WM * KS + j, d),
                                     lambda w, j: kt * BK + w // WM * KS + j < blk.kv_len, wt.warp_of(wi, tx), tx)

        return register_tile

    # ---- the grid ----

    def _grid(self, attend):
        spec, launch, BQ, NT = self.spec, self.launch, self.BQ, self.NT
        D, Hq, group, SPLITS, local = spec.head_dim, spec.num_q_heads, spec.group, self.tiles.splits, launch.local

        def task_of(e, Sq):  # (batch, query head, query position) of element e of out ([B, Hq, Sq, D] flat)
            return e // D // Sq // Hq, e // D // Sq % Hq, e // D % Sq

        @T.macro
        def merge(prm, B, Sq, tx, bx):
            # out = sum_s w_s O_s / sum_s w_s with w_s = l_s exp(m_s - max m); lse = max m + log sum w_s
            top = T.alloc_buffer((1,), F32, scope=local)
            weight = T.alloc_buffer((1,), F32, scope=local)
            acc = T.alloc_buffer((1,), F32, scope=local)
            e = T.Cast("int64", bx) * NT + tx
            if e < B * Hq * Sq * D:
                top[0] = T.float32(_NEG_INF)
                for s in range(SPLITS):
                    top[0] = T.max(top[0], prm.part_stats[*task_of(e, Sq), s, 0])
                weight[0] = T.float32(0)
                acc[0] = T.float32(0)
                for s in range(SPLITS):
                    w = T.meta_var(prm.part_stats[*task_of(e, Sq), s, 1] * T.exp(
                        prm.part_stats[*task_of(e, Sq), s, 0] - sem.safe_row_max(top[0])))
                    weight[0] = weight[0] + w
                    acc[0] = acc[0] + w * prm.part_o[*task_of(e, Sq), s, e % D]
                prm.out[*task_of(e, Sq), e % D] = T.Cast(spec.dtype, sem.normalize(acc[0], weight[0]))
                if spec.return_lse:
                    if e % D == 0:
                        prm.lse[*task_of(e, Sq)] = _lse(top[0], weight[0])

        @T.macro
        def launch_grid(prm, B, Sq, kv_len):
            # grid as FlashAttention-2's: x row tiles, y batch, z KV heads x splits (each within
            # CUDA's limits); then the split-KV merge
            for bx in launch.grid((Sq * group + BQ - 1) // BQ, "x"):
                for by in launch.grid(B, "y"):
                    for bz in launch.grid(spec.num_kv_heads * SPLITS, "z"):
                        for tx in launch.block():
                            # unrolled loops stay loops with #pragma unroll: nvcc unrolls them (registers
                            # indexed by constants), and the CUDA C is ~10x shorter than TVM's expansion
                            with T.attr(T.int32(0), "pragma_unroll_explicit", T.int32(0)):
                                attend(prm, _Block(b=T.Cast("int64", by), g=T.Cast("int64", bz // SPLITS),
                                                 r0=T.Cast("int64", bx) * BQ, rows=Sq * group, split=bz % SPLITS,
                                                 Sq=Sq, kv_len=kv_len(by), group=group), tx)
            if SPLITS > 1:
                for bx in launch.grid((B * Hq * Sq * D + NT - 1) // NT, "x"):
                    for tx in launch.block():
                        merge(prm, B, Sq, tx, bx)

        return launch_grid


def _partials(B, Sq, spec: KernelSpec, splits: int):
    """Shapes of the split-KV partial O and (row max, row sum) (one element each without splits)."""
    if splits > 1:
        return (B, spec.num_q_heads, Sq, splits, spec.head_dim), (B, spec.num_q_heads, Sq, splits, 2)
    return (1, 1, 1, 1, 1), (1, 1, 1, 1, 2)


def dense_forward(spec: KernelSpec, tiles: CudaTiles, *, launch: Launch | None = None,
                  dims: Mapping[str, int | None] | None = None) -> tirx.PrimFunc:
    """Flash attention forward over q [B, Hq, Sq, D], k, v [B, Hkv, Sk, D] (B, Sq, Sk symbolic
    unless ``dims`` fixes them); ``launch`` defaults to ``tiles.threads`` threads per block."""
    launch = launch or Launch(tiles.threads)
    B, Sq, Sk = shape_vars(dims or {}, ("B", "Sq", "Sk"))
    body = _Body(spec, tiles, launch, paged=False)
    part_o_shape, part_stats_shape = _partials(B, Sq, spec, tiles.splits)

    @T.prim_func
    def fuel_flash_attn_cuda(q_h: T.handle, k_h: T.handle, v_h: T.handle, alibi_h: T.handle, mask_h: T.handle,
                             out_h: T.handle, lse_h: T.handle):
        T.func_attr({"tirx.noalias": True})
        q, k, v, alibi, mask, out, lse = param_buffers(
            spec, dict(B=B, Sq=Sq, Sk=Sk),
            q=q_h, k=k_h, v=v_h, alibi=alibi_h, mask=mask_h, out=out_h, lse=lse_h)
        part_o = T.alloc_buffer(part_o_shape, F32)
        part_stats = T.alloc_buffer(part_stats_shape, F32)
        body.launch_grid(_Params(q, k, v, out, part_o, part_stats, alibi=alibi, mask=mask, lse=lse), B, Sq,
                         lambda b: Sk)

    unused = ({"alibi"} if not spec.has_alibi else set()) | ({"mask"} if not spec.mask_broadcast else set())
    unused |= {"lse"} if not spec.return_lse else set()
    return finish(drop_params(fuel_flash_attn_cuda, unused))


def paged_forward(spec: KernelSpec, tiles: CudaTiles, *, launch: Launch | None = None,
                  dims: Mapping[str, int | None] | None = None) -> tirx.PrimFunc:
    """Paged attention over q [B, Hq, Sq, D] and caches [num_blocks, block_size, Hkv, D] through
    block_table [B, max_blocks] and context_lens [B] (the queries are the last Sq positions)."""
    launch = launch or Launch(tiles.threads)
    B, Sq, num_blocks, max_blocks = shape_vars(dims or {}, ("B", "Sq", "num_blocks", "max_blocks"))
    body = _Body(spec, tiles, launch, paged=True)
    part_o_shape, part_stats_shape = _partials(B, Sq, spec, tiles.splits)

    def context_len(lens, b):  # a device kernel cannot assert: a length past the table's capacity is clamped
        return T.max(T.min(T.Cast("int64", lens[b]), max_blocks * spec.block_size), T.int64(0))

    @T.prim_func
    def fuel_paged_attn_cuda(q_h: T.handle, k_cache_h: T.handle, v_cache_h: T.handle, table_h: T.handle,
                             lens_h: T.handle, alibi_h: T.handle, out_h: T.handle):
        T.func_attr({"tirx.noalias": True})
        q, k_cache, v_cache, table, lens, alibi, out = param_buffers(
            spec, dict(B=B, Sq=Sq, num_blocks=num_blocks, max_blocks=max_blocks),
            q=q_h, k_cache=k_cache_h, v_cache=v_cache_h, table=table_h, lens=lens_h, alibi=alibi_h, out=out_h)
        part_o = T.alloc_buffer(part_o_shape, F32)
        part_stats = T.alloc_buffer(part_stats_shape, F32)
        body.launch_grid(_Params(q, k_cache, v_cache, out, part_o, part_stats, alibi=alibi, table=table,
                                 num_blocks=num_blocks), B, Sq, lambda b: context_len(lens, b))

    return finish(drop_params(fuel_paged_attn_cuda, set() if spec.has_alibi else {"alibi"}))
