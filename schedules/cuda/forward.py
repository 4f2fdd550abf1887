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
    ForwardMacros, RowBlock, ForwardBuffers -- one block's macros, what it works on, its buffers
    dense_forward -- PrimFunc(q, k, v, [alibi_slopes], [attn_mask], out, [lse])
    paged_forward -- PrimFunc(q, k_cache, v_cache, block_table, context_lens, [alibi_slopes], [sinks],
                     [k_scale, v_scale], out)
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping

from tvm import tirx
from tvm.script import tirx as T

from tvm_fuel.op import semantics as sem
from ..common import (NEG_INF, KernelSpec, ceil_div, drop_params, finish, key_tiles, masked_logit, kernel_params,
                      row_head, row_position, kernel_sizes, tile_is_interior)
from ..layouts import BlockTable, EMPTY_LSE
from .device import F32, HALF_TYPES, Launch, Rows, TileOps, padded_dim
from .forward_registers import RegisterTiles
from .tiles import CudaTiles


def _lse(row_max, row_sum):
    """A row's lse from its running max and sum."""
    return sem.log_sum_exp(sem.safe_row_max(row_max), row_sum)


def with_sink(prm, head, row_max, row_sum):
    """A finished row's sum with its head's sink (paged kernels with sinks), else the sum."""
    return row_sum if prm.sinks is None else sem.with_sink(row_sum, row_max, prm.sinks[head])


@dataclass(frozen=True)
class ForwardBuffers:
    """A forward kernel's buffers. ``keys(b)`` only on the paged path: where sequence b's tokens
    live (a ``layouts`` object: ``BlockTable``, TVM's ``TvmPages``); ``mask``, ``lse`` and
    ``sinks`` (paged) only where the kernel has them (None otherwise); ``part_o`` and ``part_stats`` hold the splits'
    partial results (O, and the row max and sum; one element each without split-KV). TVM's cache
    kernels: ``sm_scale`` (a run-time scale in place of the spec's) and ``lse_log2`` (lse in log2
    units, ``EMPTY_LSE`` for a row without keys)."""

    q: Any
    k: Any
    v: Any
    out: Any
    part_o: Any
    part_stats: Any
    alibi: Any = None
    mask: Any = None
    lse: Any = None
    keys: Any = None
    sinks: Any = None
    sm_scale: Any = None
    lse_log2: bool = False


@dataclass(frozen=True)
class RowBlock:
    """What one thread block works on: batch ``b``, KV head ``g``, the task rows from ``r0`` (of
    ``rows`` = Sq * group), key split ``split``; ``Sq`` queries, the last of ``kv_len`` keys (or,
    ``after_keys``, the ones after them). Grids other than this module's build their blocks from it
    and call ``ForwardMacros.attend`` (``varlen``)."""

    b: Any
    g: Any
    r0: Any
    rows: Any
    split: Any
    Sq: Any
    kv_len: Any
    group: int
    q_start: Any = None  # ragged queries (TVM's cache): the sequence's first row of q [total_q, Hq, D]
    after_keys: bool = False  # the queries follow all the keys (TVM's sliding-window prefill)

    def live(self, r):
        """Whether row r of the block is a task row (the last row tile runs past them)."""
        return self.r0 + r < self.rows

    def head(self, r):
        return row_head(self.g, self.r0 + r, self.group)

    def position(self, r):
        return row_position(self.r0 + r, self.group)

    def task(self, r):
        """Row r's index into q, out and lse (without the head dim): (batch, query head, query
        position), or for ragged queries (row of q, query head)."""
        if self.q_start is not None:
            return self.q_start + self.position(r), self.head(r)
        return self.b, self.head(r), self.position(r)

    def positions(self, block_q: int):
        """The query positions of the block's first and last task rows."""
        return row_position(self.r0, self.group), row_position(T.min(self.r0 + block_q, self.rows) - 1, self.group)

    @property
    def delta(self):
        return self.kv_len if self.after_keys else self.kv_len - self.Sq  # key index of query position 0


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


class ForwardMacros(RegisterTiles):
    """The macros of one forward block, specialised to a spec, tiles and launch: ``launch_grid``
    is the kernel body (the blocks, then the split-KV merge)."""

    def __init__(self, spec: KernelSpec, tiles: CudaTiles, launch: Launch, *, paged: bool,
                 queries_after_keys: bool = False):
        # queries_after_keys: the queries follow all of the keys (TVM's sliding-window prefill over
        # cached keys), not the last Sq of them
        self.spec, self.tiles, self.launch, self.paged = spec, tiles, launch, paged
        self.queries_after_keys = queries_after_keys
        # an fp8 cache's scales are one per KV head (or cache): its tiles hold the decoded elements,
        # exact in q's dtype, and the block's K scale joins the softmax scale, its V scale the
        # output (float32: a scaled element could overflow float16). int8's per-token scales are
        # applied in the loads.
        self.folded = bool(spec.cache_dtype) and spec.kv_scale != "token"
        self.ops = TileOps(launch, spec.dtype)
        self.BQ, self.BK, self.DP, self.NT = tiles.block_q, tiles.block_k, padded_dim(spec.head_dim), launch.threads
        self._loads()
        self._emits()
        self.walk_keys = self._walk_keys()
        # float16/bfloat16: register tiles (mma.sync), on the device and, lane by lane, in the emulation
        attend = self._attend_registers() if spec.dtype in HALF_TYPES else self._attend_simt()
        self.attend = attend  # macro attend(prm, blk, tx): one block's rows (a RowBlock), for other grids
        self.launch_grid = self._grid(attend)

    # ---- what every block does: key tiles to walk, loads, logits, results ----

    def key_walk(self, blk: RowBlock):
        """(walk, first, count): the key tiles this block's split walks (those its rows can see, the
        sink tokens' included: ``KeyTiles``), its step t's tile ``walk.tile(first + t)`` (the
        callers bind the walk's bounds: ``KeyTiles.bound``)."""
        SPLITS = self.tiles.splits
        first_pos, last_pos = blk.positions(self.BQ)
        walk = key_tiles(self.spec.cfg, first_pos=first_pos, last_pos=last_pos, kv_len=blk.kv_len,
                         delta=blk.delta, block_k=self.BK)
        total = walk.count
        per = (total + SPLITS - 1) // SPLITS
        first = blk.split * per
        count = T.max(first, T.min(total, first + per)) - first
        if blk.q_start is not None:  # ragged queries: a block past its sequence's rows walks no keys
            count = T.Select(blk.r0 < blk.rows, count, T.int64(0))
        return walk, first, count

    def _walk_keys(self):
        """Macro ``walk_keys(blk, issue, compute)``: the block's key tiles (``key_walk``) through the
        copy pipeline, ``issue(kt, st)`` then ``compute(kt, st)`` for key tile kt in stage st. The
        walk's bounds are bound to variables once (``KeyTiles.bound``)."""
        pipeline = self.ops.pipeline(self.tiles.stages)

        @T.macro
        def walk_keys(blk, issue, compute):
            walk, first, steps = T.meta_var(self.key_walk(blk))
            count: T.int64 = steps
            start: T.int64 = first
            lo: T.int64 = walk.lo
            sinks: T.int64 = walk.sinks
            tile = T.meta_var(walk.bound(sinks, lo, start))
            pipeline(count, lambda t, st: issue(tile(t), st), lambda t, st: compute(tile(t), st))

        return walk_keys

    def needs_mask(self, blk: RowBlock, kt):
        """Whether key tile kt masks any element of the block's rows (interior tiles skip it)."""
        if self.spec.elementwise_logits:
            return T.bool(True)
        first_pos, last_pos = blk.positions(self.BQ)
        return tirx.Not(tile_is_interior(self.spec.cfg, key_start=kt * self.BK, first_pos=first_pos,
                                         last_pos=last_pos, kv_len=blk.kv_len, delta=blk.delta, block_k=self.BK))

    def logit(self, score, prm: ForwardBuffers, blk: RowBlock, r, key, check):
        """The logit of row r and key ``key`` from the raw score: softcapped, then biased and masked
        where ``check`` holds (everywhere with a per-element transform)."""
        spec = self.spec
        scale = T.float32(spec.scale) if prm.sm_scale is None else prm.sm_scale
        capped = sem.softcap(spec.cfg, score * self.folded_scale(prm, blk, "k", scale))
        logit = masked_logit(spec, capped, prm.alibi, prm.mask, blk.b, blk.head(r), blk.position(r), key, blk.kv_len,
                             blk.delta)
        return logit if spec.elementwise_logits else T.Select(check, logit, capped)

    def folded_scale(self, prm: ForwardBuffers, blk: RowBlock, kind: str, x):
        """``x`` times the block's K or V (``kind``) scale of an fp8 cache (see ``__init__``)."""
        if not self.folded:
            return x
        scale = prm.keys(blk.b).scale(kind, 0, 0, blk.g)  # per KV head or cache: no page or slot
        return x if scale is None else x * scale

    def kv_at(self, prm: ForwardBuffers, kind: str, pages, blk: RowBlock, st, r, key, c):
        """Column c of key ``key`` of K or V (``kind``), row r of the tile in stage st: paged,
        through the page ids the stage holds and the layout's slots."""
        if self.paged:
            cache = prm.keys(blk.b)
            page, slot = pages[st * self.BK + r], cache.slot(key)
            if self.folded:  # decoded, unscaled: exact in q's dtype
                return T.Cast(self.spec.dtype, cache.raw(kind, page, slot, blk.g, c))
            value = getattr(cache, kind)(page, slot, blk.g, c)
            # an int8 cache is dequantized (float32) on its way to shared memory, in q's dtype
            return T.Cast(self.spec.dtype, value) if self.spec.cache_dtype else value
        return getattr(prm, kind)[blk.b, blk.g, key, c]

    def out_row(self, i, tx):  # row and column of element i * threads + tx of a [block_q, DP] tile
        return (i * self.NT + tx) // self.DP

    def out_col(self, i, tx):
        return (i * self.NT + tx) % self.DP

    def _loads(self):
        spec, ops, paged, BK, NT = self.spec, self.ops, self.paged, self.BK, self.NT
        D, DP = spec.head_dim, self.DP
        # cp.async moves bytes as they are: an 8-bit cache's tiles are loaded, dequantized and stored
        copy_queries = ops.copy(self.BQ, D, DP)
        copy_keys = ops.copy(BK, D, DP, asynchronous=not spec.cache_dtype, vector=not spec.cache_dtype)

        @T.macro
        def load_queries(sc, prm, blk, tx):
            copy_queries(sc.Qs, blk.live, lambda r, c: prm.q[*blk.task(r), c], tx)

        @T.macro
        def load_pages(pages, prm, blk, kt, st, tx):
            # the block ids of key tile kt, read once (dead tokens reuse block 0; never read past the
            # table; ids clamped into the cache: a device kernel cannot assert)
            for i in range(ceil_div(BK, NT)):
                if i * NT + tx < BK:
                    if kt * BK + i * NT + tx < blk.kv_len:
                        pages[st * BK + i * NT + tx] = prm.keys(blk.b).page(kt * BK + i * NT + tx)
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
                      lambda r, c: self.kv_at(prm, "k", sc.pages, blk, st, r, kt * BK + r, c), tx)
            copy_keys(Rows.stage(sc.Vs, st, BK), lambda r: kt * BK + r < blk.kv_len,
                      lambda r, c: self.kv_at(prm, "v", sc.pages, blk, st, r, kt * BK + r, c), tx)

        self.load_queries, self.load_keys = load_queries, load_keys

    def _emits(self):
        spec, D, SPLITS = self.spec, self.spec.head_dim, self.tiles.splits

        @T.macro
        def emit(prm, blk, row, col, acc, row_max, row_sum):
            # element (row, col) of the block's output: normalized (a split's partial O is float32;
            # the merge adds the sink there)
            if tirx.all(blk.live(row), col < D):
                if SPLITS == 1:
                    prm.out[*blk.task(row), col] = T.Cast(spec.dtype, sem.normalize(
                        self.folded_scale(prm, blk, "v", acc), with_sink(prm, blk.head(row), row_max, row_sum)))
                else:
                    prm.part_o[*blk.task(row), blk.split, col] = sem.normalize(
                        self.folded_scale(prm, blk, "v", acc), row_sum)

        @T.macro
        def emit_lse(prm, blk, row, row_max, row_sum):
            if blk.live(row):
                if SPLITS > 1:  # the max and the sum, not their lse: a float32 lse of a huge
                    # finite logit cannot hold log(sum), and the merge would weigh splits alike
                    prm.part_stats[*blk.task(row), blk.split, 0] = row_max
                    prm.part_stats[*blk.task(row), blk.split, 1] = row_sum
                elif spec.return_lse:
                    if prm.lse_log2:
                        prm.lse[*blk.task(row)] = T.Select(row_sum == T.float32(0), T.float32(EMPTY_LSE),
                                                           _lse(row_max, row_sum) * T.float32(sem.LOG2E))
                    else:
                        prm.lse[*blk.task(row)] = _lse(row_max, row_sum)

        self.emit, self.emit_lse = emit, emit_lse

    # ---- SIMT blocks (float32) ----

    def _attend_simt(self):
        spec, launch, ops, STAGES = self.spec, self.launch, self.ops, self.tiles.stages
        BQ, BK, DP, NT, dtype, local = self.BQ, self.BK, self.DP, self.NT, spec.dtype, launch.local
        qk = ops.gemm(BQ, BK, DP, b_trans=True)
        load_queries, load_keys, emit, emit_lse = self.load_queries, self.load_keys, self.emit, self.emit_lse
        walk_keys = self.walk_keys
        out_row, out_col = self.out_row, self.out_col

        # RT threads share a row of the softmax update (a power of two within a warp, combined by
        # shuffles), so every thread is busy and a warp reads S without bank conflicts
        RT = NT // BQ if NT % BQ == 0 and 1 < NT // BQ <= 32 and BK % (NT // BQ) == 0 else 1
        SLOTS = ceil_div(BQ * RT, NT)  # (row, part) slots per thread
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
                            T.float32(NEG_INF))
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
            for i in launch.owned(ceil_div(BQ * DP, NT)):
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
            O = T.alloc_buffer((ceil_div(BQ * DP, NT),), F32, scope=local)
            # T.meta_var: the bundle stays a Python value (an assignment would make it a TIR variable)
            sc = T.meta_var(_SimtScratch(Qs, Ks, Vs, pages, S, P, alpha, row_max, row_sum, m, l, O))
            load_queries(sc, prm, blk, tx)
            for i in range(SLOTS):
                m[i] = T.float32(NEG_INF)
                l[i] = T.float32(0)
            for i in range(ceil_div(BQ * DP, NT)):
                O[i] = T.float32(0)
            walk_keys(blk, lambda kt, st: load_keys(sc, prm, blk, kt, st, tx),
                      lambda kt, st: simt_tile(sc, prm, blk, kt, st, tx))
            for i in range(SLOTS):
                if tirx.all(i * NT + tx < BQ * RT, slot_part(i, tx) == 0):
                    row_max[slot_row(i, tx)] = m[i]
                    row_sum[slot_row(i, tx)] = l[i]
            ops.sync()
            for i in range(ceil_div(BQ * DP, NT)):
                if i * NT + tx < BQ * DP:
                    emit(prm, blk, out_row(i, tx), out_col(i, tx), O[i], row_max[out_row(i, tx)],
                         row_sum[out_row(i, tx)])
            for i in range(ceil_div(BQ, NT)):
                if i * NT + tx < BQ:
                    emit_lse(prm, blk, i * NT + tx, row_max[i * NT + tx], row_sum[i * NT + tx])

        return attend_simt

    # ---- register tiles (float16/bfloat16) ----

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
                top[0] = T.float32(NEG_INF)
                for s in range(SPLITS):
                    top[0] = T.max(top[0], prm.part_stats[*task_of(e, Sq), s, 0])
                weight[0] = T.float32(0)
                acc[0] = T.float32(0)
                for s in range(SPLITS):
                    w = T.meta_var(prm.part_stats[*task_of(e, Sq), s, 1] * T.exp(
                        prm.part_stats[*task_of(e, Sq), s, 0] - sem.safe_row_max(top[0])))
                    weight[0] = weight[0] + w
                    acc[0] = acc[0] + w * prm.part_o[*task_of(e, Sq), s, e % D]
                prm.out[*task_of(e, Sq), e % D] = T.Cast(spec.dtype, sem.normalize(
                    acc[0], with_sink(prm, task_of(e, Sq)[1], top[0], weight[0])))
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
                                attend(prm, RowBlock(b=T.Cast("int64", by), g=T.Cast("int64", bz // SPLITS),
                                                   r0=T.Cast("int64", bx) * BQ, rows=Sq * group, split=bz % SPLITS,
                                                   Sq=Sq, kv_len=kv_len(by), group=group), tx)
            if SPLITS > 1:
                for bx in launch.grid((B * Hq * Sq * D + NT - 1) // NT, "x"):
                    for tx in launch.block():
                        merge(prm, B, Sq, tx, bx)

        @T.macro
        def launch_ragged(prm, B, row_bound, q_start, q_len, kv_len):
            # ragged queries (TVM's cache): sequence b's are rows q_start(b) .. + q_len(b) of q
            # [total_q, Hq, D]; row_bound: at least any q_len (the grid's x extent: a block past its
            # sequence's rows walks no keys and writes nothing; a condition around the block would
            # hold its barriers). No split-KV (its merge indexes [B, Hq, Sq] outputs).
            for bx in launch.grid((row_bound * group + BQ - 1) // BQ, "x"):
                for by in launch.grid(B, "y"):
                    for bz in launch.grid(spec.num_kv_heads, "z"):
                        for tx in launch.block():
                            with T.attr(T.int32(0), "pragma_unroll_explicit", T.int32(0)):
                                attend(prm, RowBlock(b=T.Cast("int64", by), g=T.Cast("int64", bz),
                                                   r0=T.Cast("int64", bx) * BQ, rows=q_len(by) * group,
                                                   split=T.int64(0), Sq=q_len(by), kv_len=kv_len(by), group=group,
                                                   q_start=q_start(by), after_keys=self.queries_after_keys), tx)

        self.launch_ragged = launch_ragged
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
    sizes = kernel_sizes(dims)
    B, Sq, Sk = sizes.values()
    body = ForwardMacros(spec, tiles, launch, paged=False)
    part_o_shape, part_stats_shape = _partials(B, Sq, spec, tiles.splits)

    @T.prim_func
    def fuel_flash_attn_cuda(q_h: T.handle, k_h: T.handle, v_h: T.handle, alibi_h: T.handle, mask_h: T.handle,
                             out_h: T.handle, lse_h: T.handle):
        q, k, v, alibi, mask, out, lse = kernel_params(spec, sizes, q_h, k_h, v_h, alibi_h, mask_h, out_h, lse_h)
        part_o = T.alloc_buffer(part_o_shape, F32)
        part_stats = T.alloc_buffer(part_stats_shape, F32)
        body.launch_grid(ForwardBuffers(q, k, v, out, part_o, part_stats, alibi=alibi, mask=mask, lse=lse), B, Sq,
                         lambda b: Sk)

    unused = ({"alibi"} if not spec.has_alibi else set()) | ({"mask"} if not spec.mask_broadcast else set())
    unused |= {"lse"} if not spec.return_lse else set()
    return finish(drop_params(fuel_flash_attn_cuda, unused))


def paged_forward(spec: KernelSpec, tiles: CudaTiles, *, launch: Launch | None = None,
                  dims: Mapping[str, int | None] | None = None) -> tirx.PrimFunc:
    """Paged attention over q [B, Hq, Sq, D] and caches [num_blocks, block_size, Hkv, D] through
    block_table [B, max_blocks] and context_lens [B] (the queries are the last Sq positions)."""
    launch = launch or Launch(tiles.threads)
    sizes = kernel_sizes(dims, paged=True)
    B, Sq, num_blocks, max_blocks = sizes.values()
    body = ForwardMacros(spec, tiles, launch, paged=True)
    part_o_shape, part_stats_shape = _partials(B, Sq, spec, tiles.splits)
    scaled = bool(spec.kv_scale)

    def context_len(lens, b):  # a device kernel cannot assert: a length past the table's capacity is clamped
        return T.max(T.min(T.Cast("int64", lens[b]), max_blocks * spec.block_size), T.int64(0))

    @T.prim_func
    def fuel_paged_attn_cuda(q_h: T.handle, k_cache_h: T.handle, v_cache_h: T.handle, table_h: T.handle,
                             lens_h: T.handle, alibi_h: T.handle, sinks_h: T.handle, k_scale_h: T.handle,
                             v_scale_h: T.handle, out_h: T.handle):
        q, k_cache, v_cache, table, lens, alibi, sinks, k_scale, v_scale, out = kernel_params(
            spec, sizes, q_h, k_cache_h, v_cache_h, table_h, lens_h, alibi_h, sinks_h, k_scale_h, v_scale_h, out_h)
        part_o = T.alloc_buffer(part_o_shape, F32)
        part_stats = T.alloc_buffer(part_stats_shape, F32)
        body.launch_grid(ForwardBuffers(q, k_cache, v_cache, out, part_o, part_stats, alibi=alibi,
                                        sinks=sinks if spec.has_sinks else None,
                                        keys=lambda b: BlockTable(table, k_cache, v_cache, b, num_blocks,
                                                                  spec.block_size,
                                                                  *((k_scale, v_scale) if scaled else ()))),
                         B, Sq, lambda b: context_len(lens, b))

    unused = {name for name, used in (("alibi", spec.has_alibi), ("sinks", spec.has_sinks), ("k_scale", spec.kv_scale),
                                      ("v_scale", spec.kv_scale)) if not used}
    return finish(drop_params(fuel_paged_attn_cuda, unused))
