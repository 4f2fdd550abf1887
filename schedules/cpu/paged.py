"""CPU paged attention: q [B, Hq, Sq, D] over caches [num_blocks, block_size, Hkv, D] (vLLM's
layout; bfloat16/float16/float32 or an 8-bit cache with its scales).

The kernel reads its key tiles through the block table (no gather) and stops at
``context_lens[b]``, so its cost follows the live tokens, not the table's capacity. Decode streams
each token's K and V rows in place; more rows pack each key tile and run the register-tiled GEMMs.

Contents:
    PagedTile      -- the macros of one key tile of a paged task, streamed in place or packed
    paged_forward  -- PrimFunc(q, k_cache, v_cache, block_table, context_lens, [alibi_slopes], [sinks],
                      [k_scale, v_scale], out)
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping

import tvm
from tvm import tirx
from tvm.script import tirx as T

from tvm_fuel.op import quant
from ..common import F32, balanced_order, drop_params, finish, KernelSpec, kernel_params, row_position, kernel_sizes
from ..layouts import BlockTable
from .common import absent_inputs, named_buffer, prefetch
from .forward import ForwardBuffers, ForwardMacros, head_view, RowTile, Scratch
from .micro import (add_term, int16_dot, INT16_DOT_LANES, INT16_DOT_SUMS, ROUND_LANES, round_rows_to_int16,
                    store_row_sums)
from .tasks import task_runs
from .tiles import STREAMING_ROWS, CpuTiles


WIDE_ROWS = 4  # a streaming task of at most this many rows takes the head dim two vectors at a time


class PagedTile:
    """The macros that run one key tile of a paged task, its tokens placed by ``cache`` (a
    ``BlockTable`` or a layout like it): ``stream_tile`` reads the tile's K and V rows in place
    (decode), ``pack_tile`` packs them, ``packed_tile`` packs them and runs the register-tiled
    GEMMs. Their scratch is allocated in the default scope and their per-tile scalars are ``T.let``
    bindings: TVM 0.27 lowers a CPU kernel's ``local`` buffers and mutable scalars to heap
    workspaces, which LLVM cannot keep in registers (tests/schedules/test_cpu_stack_scratch.py)."""

    def __init__(self, spec: KernelSpec, tiles: CpuTiles, body: ForwardMacros):
        cfg, D = spec.cfg, spec.head_dim
        BQ, BK, DP = tiles.block_q, tiles.block_k, tiles.padded_dim(D)
        HT = tiles.kv_heads  # KV heads per streaming task
        # lanes of the head-dim loops: two AVX2 vectors where a few rows leave the registers for
        # them (each row's accumulators two vectors wide; side by side on a Zen 4, decode took 0.93x
        # the time over a bfloat16 cache and 0.79-0.96x over fp8 ones; at 8 rows 1.04-1.16x, its 16
        # accumulators spilling). AVX2 targets only (int16_dot, which no record changes, says so):
        # AVX-512 is unmeasured, whichever lanes its record picks
        wide = (16,) if BQ <= WIDE_ROWS and tiles.lanes == 8 and tiles.int16_dot else ()
        LD = next(lanes for lanes in wide + (tiles.lanes, 8, 4, 2, 1) if D % lanes == 0)
        VT = tiles.value_tokens
        PREFETCH = tiles.prefetch
        PER_LINE = 64 // (tvm.DataType(spec.kv_dtype).bits // 8)  # elements per 64-byte cache line
        LINES = -(-D // PER_LINE)  # cache lines of one head's row of a token
        ROWS_POW2 = 1 << (BQ - 1).bit_length()  # rows of the score shuffle tree
        # an 8-bit cache streams its elements decoded but unscaled: a token's K scale multiplies its
        # scores and its V scale its weights (per token, not per element)
        SL = next(lanes for lanes in (tiles.lanes, 8, 4, 2, 1) if BK % lanes == 0)  # lanes of the key loops
        QUANT = bool(spec.cache_dtype)
        SCALED = QUANT and (bool(spec.kv_scale) or quant.decode_factor(spec.cache_dtype) != 1)
        # an int8 cache's q.k in integers where the target has vpmaddwd: q rounded per row to int16
        # (2^-15 of its largest element, far under the cache's 2^-8), two multiplies an instruction
        # and no conversion of K (side by side, multi-head decode: int8 3.6 -> 3.2 ms)
        INT_DOT = (bool(tiles.int16_dot) and spec.cache_dtype == "int8" and D % INT16_DOT_LANES == 0 and D <= 256
                   and BK % ROUND_LANES == 0 and BK <= 512)
        DL, DS = INT16_DOT_LANES, INT16_DOT_SUMS
        self.int_dot = INT_DOT  # the task rounds its queries once (round_queries) into Scratch.q16
        STEP = VT + VT % 2 if INT_DOT else VT  # tokens per value pass (whole pairs in integers)
        # V's pass in integers too: a tile's weights rounded per row to int16 (Scratch.w16), two
        # tokens' codes interleaved so one vpmaddwd takes both, summed in int32 over the tile
        # (Scratch.acc_i: |sum| <= BK * 32767 * 128, under 2^31 for BK <= 512) and added to O once
        INTERLEAVE = [tirx.const(i, "int32") for half in range(2) for j in range(DS)
                      for i in (half * DS + j, DL + half * DS + j)]  # x0 y0 x1 y1 ... of two tokens' codes

        def element(cache, kind, page, slot, g, d):
            return (cache.raw(kind, page, slot, g, d) if QUANT else getattr(cache, kind)(page, slot, g, d)).astype(F32)

        def scaled(x, cache, kind, page, slot, g):
            return x * cache.scale(kind, page, slot, g) if SCALED else x

        @T.macro
        def prefetch_row(cache, kind, pages_ahead, token, kv_len, g, c):
            # one head's row of the token PREFETCH ahead: its K in the score pass, its V in the value
            # pass. The hardware prefetchers restart at every 4 KiB page and at every jump through the
            # block table (measured: bfloat16 1.7x faster with it, float32 0-16 % by the memory load).
            ahead: T.let[T.int64] = T.min(token + PREFETCH, kv_len - 1)
            for line in T.unroll(LINES):
                prefetch(T.address_of(cache.stored(kind, pages_ahead[c], cache.slot(ahead), g,
                                                   T.min(line * PER_LINE, D - 1))))

        @T.macro
        def add_values(heads, cache, tile, tokens, gi, first, count: T.int32, skip_zero_weights):
            # O[gi] += sum over tokens first .. first + count - 1 of P[gi, :, token] * V[token, head g + gi]
            # (skip_zero_weights: a dropped token's P is 0 and its V may be NaN, see the module docstring)
            for d0 in range(D // LD):
                acc_o = T.alloc_buffer((BQ, LD), F32)
                for r in T.unroll(BQ):
                    for v in T.vectorized(LD):
                        acc_o[r, v] = heads.O[gi, r, d0 * LD + v]
                for u in T.unroll(count):
                    for r in T.unroll(BQ):
                        for v in T.vectorized(LD):
                            acc_o[r, v] = add_term(
                                acc_o[r, v], heads.S[gi, r, first + u],
                                element(cache, "v", tokens.pages[first + u], cache.slot(tokens.kt * BK + first + u),
                                        tile.g + gi, d0 * LD + v),
                                skip_zero_weights)
                for r in T.unroll(BQ):
                    for v in T.vectorized(LD):
                        heads.O[gi, r, d0 * LD + v] = acc_o[r, v]

        @T.macro
        def add_int_values(heads, cache, tile, tokens, gi, first, pairs: T.int32):
            # acc_i[gi] += sum over the token pairs from `first` of w16 . V codes (a pair's second
            # token may be past the live ones: its weight is 0, its page the last live token's)
            codes = T.alloc_buffer((2, DL), "int16")
            for d0 in range(D // DL):
                acc = T.alloc_buffer((2 * BQ, DS), "int32")
                for r in T.unroll(BQ):
                    for half in T.unroll(2):
                        for v in T.vectorized(DS):
                            acc[2 * r + half, v] = heads.acc_i[gi, r, d0 * DL + half * DS + v]
                for u in T.unroll(pairs):
                    pair = T.meta_var([cache.stored("v", tokens.pages[first + 2 * u + t],
                                                    cache.slot(tokens.kt * BK + first + 2 * u + t), tile.g + gi,
                                                    tirx.Ramp(d0 * DL, 1, DL)) for t in range(2)])
                    T.buffer_store(codes, tirx.Cast(f"int16x{DL}", tirx.Shuffle(pair, INTERLEAVE[:DL])),
                                   [0, tirx.Ramp(0, 1, DL)])
                    T.buffer_store(codes, tirx.Cast(f"int16x{DL}", tirx.Shuffle(pair, INTERLEAVE[DL:])),
                                   [1, tirx.Ramp(0, 1, DL)])
                    for r in T.unroll(BQ):
                        weights = T.meta_var(tirx.reinterpret(f"int16x{DL}", tirx.Broadcast(tirx.reinterpret(
                            "int32", tirx.BufferLoad(heads.w16, [gi, r, tirx.Ramp(first + 2 * u, 1, 2)])), DS)))
                        for half in T.unroll(2):
                            int16_dot(acc, 2 * r + half, tirx.BufferLoad(codes, [half, tirx.Ramp(0, 1, DL)]), weights)
                for r in T.unroll(BQ):
                    for half in T.unroll(2):
                        for v in T.vectorized(DS):
                            heads.acc_i[gi, r, d0 * DL + half * DS + v] = acc[2 * r + half, v]

        @T.macro
        def add_value_rows(heads, cache, tile, tokens, live, skip_zero_weights):
            # value rows accumulated STEP tokens per pass (the integer path's pairs: an even step): the
            # accumulator is loaded and stored once per STEP tokens; each token's value row is still
            # read as one contiguous run over the heads
            for c0 in range(live // STEP):
                for gi in range(HT):
                    if PREFETCH > 0:
                        for u in T.unroll(STEP):
                            prefetch_row(cache, "v", tokens.pages_ahead, tokens.kt * BK + c0 * STEP + u,
                                         tile.kv_len, tile.g + gi, c0 * STEP + u)
                    if INT_DOT:
                        add_int_values(heads, cache, tile, tokens, gi, c0 * STEP, STEP // 2)
                    else:
                        add_values(heads, cache, tile, tokens, gi, c0 * STEP, STEP, skip_zero_weights)
            for c in range(live // STEP * STEP, live, 2 if INT_DOT else 1):
                for gi in range(HT):
                    if INT_DOT:
                        add_int_values(heads, cache, tile, tokens, gi, c, 1)
                    else:
                        add_values(heads, cache, tile, tokens, gi, c, 1, skip_zero_weights)

        @T.macro
        def add_int_sums(heads):
            # O += the tile's int32 sums times their row's weight unit (and the sums back to 0)
            for gi, r in T.grid(HT, BQ):
                for d0 in range(D // DS):
                    for v in T.vectorized(DS):
                        heads.O[gi, r, d0 * DS + v] = heads.O[gi, r, d0 * DS + v] + T.Cast(
                            F32, heads.acc_i[gi, r, d0 * DS + v]) * heads.w_unit[gi, r]
                        heads.acc_i[gi, r, d0 * DS + v] = 0

        @T.macro
        def round_queries(heads):
            round_rows_to_int16(heads.Qs, heads.q16, heads.q_unit, HT, BQ, D)

        @T.macro
        def integer_scores(heads, cache, tile, page, slot, gi, c):
            # S[gi, :, c] from int32 lane sums of q16 . k (q's unit and the K scale applied to the
            # tile's scores at once: scale_scores)
            # (the lane sums folded in int32, an integer add's latency a third of a float one's: at
            # most D * 32767 * 128, 2^30 at head dim 256)
            acc_i = T.alloc_buffer((BQ, DS), "int32")
            sums_i = T.alloc_buffer((ROWS_POW2,), "int32")
            for r in T.unroll(BQ):
                for v in T.vectorized(DS):
                    acc_i[r, v] = 0
            for d0 in range(D // DL):
                for r in T.unroll(BQ):
                    int16_dot(acc_i, r, tirx.BufferLoad(heads.q16, [gi, r, tirx.Ramp(d0 * DL, 1, DL)]), tirx.Cast(
                        f"int16x{DL}", cache.stored("k", page, slot, tile.g + gi, tirx.Ramp(d0 * DL, 1, DL))))
            store_row_sums(sums_i, acc_i, BQ, DS)
            for r in T.unroll(BQ):
                heads.S[gi, r, c] = T.Cast(F32, sums_i[r])

        @T.macro
        def scale_scores(heads, k_scales):
            # S[gi, r, c] *= q's unit of row r times token c's K scale (0 past the live tokens), a
            # vector of tokens at a time
            for gi, r, c0 in T.grid(HT, BQ, BK // SL):
                for v in T.vectorized(SL):
                    heads.S[gi, r, c0 * SL + v] = heads.S[gi, r, c0 * SL + v] * (
                        heads.q_unit[gi, r] * k_scales[gi, c0 * SL + v])

        @T.macro
        def stream_tile(heads, params, cache, tile, kt):
            # the page of every token of the tile, looked up once (dead tokens reuse the last live one)
            # (in the layout's page dtype: int32 in TVM's cache, whose kernels MLC-LLM narrows to int32 indices)
            pages = T.alloc_buffer((BK,), cache.page_dtype)
            sums = T.alloc_buffer((ROWS_POW2 if not INT_DOT else 1,), F32)
            for c in range(BK):
                pages[c] = T.Cast(cache.page_dtype, cache.page(T.min(kt * BK + c, tile.kv_len - 1)))
            # and of the token PREFETCH ahead of each (the last live one past the end)
            pages_ahead = T.alloc_buffer((BK if PREFETCH > 0 else 1,), cache.page_dtype)
            if PREFETCH > 0:
                for c in range(BK):
                    pages_ahead[c] = T.Cast(cache.page_dtype,
                                            cache.page(T.min(kt * BK + c + PREFETCH, tile.kv_len - 1)))
            tokens = T.meta_var(_Tokens(kt, pages, pages_ahead))
            # the tile's V scales (and K scales, where q.k is taken in integers), a token's for all heads at once
            v_scales = T.alloc_buffer((HT, BK) if SCALED else (1, 1), F32)
            k_scales = T.alloc_buffer((HT, BK) if INT_DOT else (1, 1), F32)
            for c in range(BK):
                if kt * BK + c < tile.kv_len:
                    for gi in range(HT):
                        if SCALED:
                            v_scales[gi, c] = cache.scale("v", pages[c], cache.slot(kt * BK + c), tile.g + gi)
                        if INT_DOT:
                            k_scales[gi, c] = cache.scale("k", pages[c], cache.slot(kt * BK + c), tile.g + gi)
                        if PREFETCH > 0:
                            prefetch_row(cache, "k", pages_ahead, kt * BK + c, tile.kv_len, tile.g + gi, c)
                        if INT_DOT:
                            integer_scores(heads, cache, tile, pages[c], cache.slot(kt * BK + c), gi, c)
                        else:
                            acc = T.alloc_buffer((BQ, LD), F32)
                            for r in T.unroll(BQ):
                                for v in T.vectorized(LD):
                                    acc[r, v] = T.float32(0)
                            for d0 in range(D // LD):
                                for r in T.unroll(BQ):
                                    for v in T.vectorized(LD):
                                        acc[r, v] = acc[r, v] + heads.Qs[gi, r, d0 * LD + v] * element(
                                            cache, "k", pages[c], cache.slot(kt * BK + c), tile.g + gi, d0 * LD + v)
                            store_row_sums(sums, acc, BQ, LD)
                            for r in T.unroll(BQ):
                                heads.S[gi, r, c] = scaled(sums[r], cache, "k", pages[c], cache.slot(kt * BK + c),
                                                           tile.g + gi)
                else:
                    for gi, r in T.grid(HT, BQ):
                        heads.S[gi, r, c] = T.float32(0)
                    for gi in range(HT):
                        if SCALED:
                            v_scales[gi, c] = T.float32(0)
                        if INT_DOT:
                            k_scales[gi, c] = T.float32(0)
            if INT_DOT:
                scale_scores(heads, k_scales)
            for gi in range(HT):
                body.normalize_tile(head_view(heads.S, gi), head_view(heads.m, gi), head_view(heads.l, gi),
                                    head_view(heads.alpha, gi), params, tile.head(gi), kt * BK, BK)
                body.scale_rows(head_view(heads.O, gi), head_view(heads.alpha, gi), BQ, DP)
                if SCALED:  # the weights times their token's V scale, a vector of tokens at a time (a zero
                    # weight stays 0: NaN scales of dropped tokens never reach a row)
                    for r, c0 in T.grid(BQ, BK // SL):
                        for v in T.vectorized(SL):
                            heads.S[gi, r, c0 * SL + v] = T.Select(
                                heads.S[gi, r, c0 * SL + v] == T.float32(0), T.float32(0),
                                heads.S[gi, r, c0 * SL + v] * v_scales[gi, c0 * SL + v])
            live: T.let[T.int64] = T.min(tile.kv_len - kt * BK, BK)
            # interior tiles drop no token: their value rows need no zero-weight check (an int8
            # code is never NaN: a dropped token's NaN scale stays out of its weight of 0)
            if INT_DOT:  # the tile's weights rounded, V's codes summed against them, the sums added to O
                round_rows_to_int16(heads.S, heads.w16, heads.w_unit, HT, BQ, BK)
                add_value_rows(heads, cache, tile, tokens, live, False)
                add_int_sums(heads)
            elif tile.is_interior(cfg, kt * BK, BK):
                add_value_rows(heads, cache, tile, tokens, live, False)
            else:
                add_value_rows(heads, cache, tile, tokens, live, True)

        @T.macro
        def pack_tile(Kt, Vt, nonfinite, cache, g, kv_len, kt, keys=BK):
            # key tile kt of KV head g as Kt [D, BK] and Vt [BK, DP] (zeros past kv_len), its first
            # `keys` only (the GEMMs read no further); nonfinite[0]: how many of their Vt elements are NaN or Inf
            # a tile past the last key: Kt's rows zeroed a vector of keys at a time first (column by
            # column, LLVM scatters each key's zeros down the head dim: a one-token sequence's task
            # spent most of its time there)
            if kt * BK + keys > kv_len:
                for d, c0 in T.grid(D, keys // SL):
                    for v in T.vectorized(SL):
                        Kt[d, c0 * SL + v] = T.float32(0)
            for c in range(keys):
                if kt * BK + c < kv_len:
                    block: T.let[T.int64] = cache.page(kt * BK + c)
                    for d in range(D):
                        Kt[d, c] = cache.k(block, cache.slot(kt * BK + c), g, d).astype(F32)
                        Vt[c, d] = cache.v(block, cache.slot(kt * BK + c), g, d).astype(F32)
                else:
                    for d in T.vectorized(D):
                        Vt[c, d] = T.float32(0)
                for d in range(D, DP):
                    Vt[c, d] = T.float32(0)
            body.count_nonfinite(nonfinite, Vt, keys, DP)

        @T.macro
        def packed_tile(heads, Kt, Vt, params, cache, tile, kt):
            nonfinite = T.alloc_buffer((1,), F32)
            pack_tile(Kt, Vt, nonfinite, cache, tile.g, tile.kv_len, kt)
            body.attend_tile(heads.view(0), Kt, Vt, params, tile, kt * BK, nonfinite[0] == T.float32(0))

        STREAMING = BQ <= STREAMING_ROWS
        ROUNDED = STREAMING and INT_DOT  # int8 decode's q.k in integers: q rounded once per task
        TASK_HEADS = HT if STREAMING else 1

        def task_scratch():
            # a task's buffers, allocated where called (once per run of tasks: decode_tasks)
            Qs_all = named_buffer("Qs_all", (TASK_HEADS, BQ, D), F32)
            S_all = named_buffer("S_all", (TASK_HEADS, BQ, BK), F32)
            O_all = named_buffer("O_all", (TASK_HEADS, BQ, DP), F32)
            m_all = named_buffer("m_all", (TASK_HEADS, BQ), F32)
            l_all = named_buffer("l_all", (TASK_HEADS, BQ), F32)
            alpha_all = named_buffer("alpha_all", (TASK_HEADS, BQ), F32)
            Kt = named_buffer("Kt", (D, BK) if not STREAMING else (1,), F32)
            Vt = named_buffer("Vt", (BK, DP) if not STREAMING else (1,), F32)
            q16_all = named_buffer("q16_all", (TASK_HEADS, BQ, D) if ROUNDED else (1, 1, 1), "int16")
            q_unit_all = named_buffer("q_unit_all", (TASK_HEADS, BQ) if ROUNDED else (1, 1), F32)
            w16_all = named_buffer("w16_all", (TASK_HEADS, BQ, BK) if ROUNDED else (1, 1, 1), "int16")
            w_unit_all = named_buffer("w_unit_all", (TASK_HEADS, BQ) if ROUNDED else (1, 1), F32)
            acc_i_all = named_buffer("acc_i_all", (TASK_HEADS, BQ, D) if ROUNDED else (1, 1, 1), "int32")
            return Scratch(Qs_all, S_all, O_all, m_all, l_all, alpha_all, q16_all, q_unit_all, w16_all, w_unit_all,
                           acc_i_all), Kt, Vt

        @T.macro
        def attend_task(params, cache, tile, scratch):
            # one task: the rows of ``tile`` for its TASK_HEADS KV heads over the keys they see (read
            # through ``cache``), streamed in place (at most STREAMING_ROWS rows) or packed per tile
            heads, Kt, Vt = T.meta_var(scratch)
            Qs_all, O_all, m_all, l_all, acc_i_all = T.meta_var((heads.Qs, heads.O, heads.m, heads.l, heads.acc_i))
            for gi in range(TASK_HEADS):
                body.load_queries(head_view(Qs_all, gi), params, tile.head(gi))
                body.init_state(head_view(O_all, gi), head_view(m_all, gi), head_view(l_all, gi))
            if ROUNDED:
                round_queries(heads)
                for gi, r, d in T.grid(TASK_HEADS, BQ, D):
                    acc_i_all[gi, r, d] = 0
            walk = T.meta_var(tile.key_walk(cfg, BK))
            for t in range(walk.count):
                kt: T.let[T.int64] = walk.tile(t)
                if STREAMING:
                    stream_tile(heads, params, cache, tile, kt)
                else:
                    packed_tile(heads, Kt, Vt, params, cache, tile, kt)
            for gi in range(TASK_HEADS):
                body.store(head_view(O_all, gi), head_view(m_all, gi), head_view(l_all, gi), params, tile.head(gi))

        self.stream_tile, self.pack_tile, self.packed_tile = stream_tile, pack_tile, packed_tile
        self.attend_task, self.task_scratch = attend_task, task_scratch
        self.task_heads, self.block_q = TASK_HEADS, BQ
        self.round_queries = round_queries


@dataclass(frozen=True)
class _Tokens:
    """Key tile ``kt`` of a streaming paged task: the page of each of its tokens (``pages``) and of
    the token PREFETCH ahead of each (``pages_ahead``)."""

    kt: tirx.PrimExpr
    pages: tirx.Buffer
    pages_ahead: tirx.Buffer


@T.macro
def _decode_task(context, task, scratch):
    # task ``task`` of decode_tasks: its batch, first KV head and row tile
    paged, params, Sq, spec, kv_len_of, keys_of, rows, n_row_tiles = T.meta_var(context)
    BQ, HT, group, Hkv = T.meta_var((paged.block_q, paged.task_heads, spec.group, spec.num_kv_heads))
    b: T.int64 = task // ((Hkv // HT) * n_row_tiles)
    g0: T.int64 = task // n_row_tiles % (Hkv // HT) * HT
    r0: T.int64 = balanced_order(task % n_row_tiles, n_row_tiles) * BQ
    kv_len: T.int64 = kv_len_of(b)
    first_pos: T.int64 = row_position(r0, group)
    last_pos: T.int64 = row_position(T.min(r0 + BQ, rows) - 1, group)
    tile = T.meta_var(RowTile(group, b, g0, r0, rows, kv_len=kv_len, delta=kv_len - Sq,
                              first_pos=first_pos, last_pos=last_pos))
    paged.attend_task(params, keys_of(b), tile, scratch)


@T.macro
def decode_tasks(paged, params, B, Sq, spec, kv_len_of, keys_of):
    # the tasks of a paged (or dense decode-shaped) forward: (batch, paged.task_heads KV heads, row
    # tile), each over its sequence's kv_len_of(b) keys, read through keys_of(b) (a layout), in
    # task_runs (per task, a batch of 2048 one-token rows had paid 13 workspace calls a task)
    BQ, HT, group, Hkv = T.meta_var((paged.block_q, paged.task_heads, spec.group, spec.num_kv_heads))
    rows = Sq * group
    n_row_tiles = (rows + BQ - 1) // BQ
    task_runs(B * (Hkv // HT) * n_row_tiles, paged.task_scratch, _decode_task,
              (paged, params, Sq, spec, kv_len_of, keys_of, rows, n_row_tiles))


def paged_forward(spec: KernelSpec, tiles: CpuTiles, *,
                  dims: Mapping[str, int | None] | None = None) -> tirx.PrimFunc:
    """Paged attention of q [B, Hq, Sq, D] over caches [num_blocks, block_size, Hkv, D].

    Decode-shaped work (at most STREAMING_ROWS rows per KV head) streams keys and values in place:
    a task owns ``tiles.kv_heads`` adjacent KV heads of one sequence, so for each token it reads
    one contiguous run of the page ([kv_heads, D]) for K and for V, and keeps per head its own
    rows, score tile and accumulator (views into the task's buffers). More rows (multi-query)
    pack each key tile through the block table and run the register-tiled GEMMs.
    """
    sizes = kernel_sizes(dims, paged=True)
    B, Sq, num_blocks, max_blocks = sizes.values()
    body = ForwardMacros(spec, tiles)
    paged = PagedTile(spec, tiles, body)
    unused = absent_inputs(spec)
    scaled = bool(spec.kv_scale)

    # fmt: off
    @T.prim_func
    def fuel_paged_attn_cpu(q_h: T.handle, k_cache_h: T.handle, v_cache_h: T.handle, table_h: T.handle,
                            lens_h: T.handle, alibi_h: T.handle, sinks_h: T.handle, k_scale_h: T.handle,
                            v_scale_h: T.handle, out_h: T.handle):
        q, k_cache, v_cache, table, lens, alibi, sinks, k_scale, v_scale, out = kernel_params(
            spec, sizes, q_h, k_cache_h, v_cache_h, table_h, lens_h, alibi_h, sinks_h, k_scale_h, v_scale_h, out_h)
        params = T.meta_var(ForwardBuffers.of(unused, q=q, out=out, alibi=alibi, k_cache=k_cache, v_cache=v_cache,
                                      table=table, sinks=sinks))
        decode_tasks(paged, params, B, Sq, spec, lambda b: T.Cast("int64", lens[b]),
                     lambda b: BlockTable(table, k_cache, v_cache, b, num_blocks, spec.block_size,
                                          *((k_scale, v_scale) if scaled else ())))
    # fmt: on

    return finish(drop_params(fuel_paged_attn_cpu, unused))
