"""CPU forward attention kernels: dense flash attention (with lse) and paged attention.

One task per (batch, KV head, tile of block_q rows), run in parallel across cores. Rows pack the
query positions and the heads of a GQA group (row = position * group + head-in-group), so a key
tile is loaded once per group and serves all its query heads. Each task walks only the key tiles
its rows can see (causal/window bounds and the sequence length), with a FlashAttention-2 online
softmax; masks are applied per element only on tiles that straddle a boundary. Scratch per task is
O(block_q * D + block_k * D); no buffer grows with Sq * Sk.

A dropped key's value may hold NaN or Inf (uninitialized padding) and must not reach any row
(0 * NaN is NaN): a packed value tile is counted for non-finite elements once, and only a tile
that holds some runs the P.V GEMM that skips zero weights; the streaming decode path skips them
on the tiles that straddle a boundary (the only ones where a read token can be dropped).

The paged kernel reads its key tiles through the block table (no gather) and stops at
``context_lens[b]``, so its cost follows the live tokens, not the table's capacity.

Contents:
    KernelSpec     -- the static facts of one kernel instance
    ForwardBuffers         -- the parameter buffers a task's macros read and write
    RowTile        -- the rows one task owns and the keys they may see
    Scratch        -- a task's float32 scratch (queries, scores, accumulator, row statistics)
    ForwardMacros  -- a task's macros: load, online-softmax tiles, store (the TVM-cache kernels use them too)
    BlockTable     -- where a paged task's tokens live in vLLM's layout (page, slot, K and V reads)
    PagedTile      -- the macros of one key tile of a paged task, streamed in place or packed
    dense_forward   -- PrimFunc(q, k, v, [alibi_slopes], [attn_mask], out, [lse])
    paged_forward   -- PrimFunc(q, k_cache, v_cache, block_table, context_lens, [alibi_slopes], [sinks],
                       [k_scale, v_scale], out)
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Mapping

import tvm
from tvm import tirx
from tvm.script import tirx as T

from ...op import quant, semantics as sem
from ..common import (F32, balanced_order, drop_params, finish, KernelSpec, KeyTiles, key_tile_range, key_tiles,
                      masked_logit, kernel_params, row_head, row_position, kernel_sizes, tile_is_interior, tile_width)
from ..layouts import BlockTable
from .common import absent_inputs, Buffers, prefetch
from .micro import (add_term, int16_dot, INT16_DOT_LANES, INT16_DOT_SUMS, Micro, round_rows_to_int16,
                    store_row_sums)
from .tiles import STREAMING_ROWS, CpuTiles


@dataclass(frozen=True)
class ForwardBuffers(Buffers):
    """The parameter buffers a forward task's macros read and write; None where the kernel has
    none (no ALiBi, no mask, no lse; only the paged kernel has the caches, the block table and sinks)."""

    q: tirx.Buffer
    out: tirx.Buffer
    alibi: tirx.Buffer | None = None
    mask: tirx.Buffer | None = None
    lse: tirx.Buffer | None = None
    k_cache: tirx.Buffer | None = None
    v_cache: tirx.Buffer | None = None
    table: tirx.Buffer | None = None
    sinks: tirx.Buffer | None = None


@dataclass(frozen=True)
class RowTile:
    """The block_q rows one task owns and the keys they may see (expressions of the kernel body).

    group       query heads per KV head: row = position * group + head in group
    b, g        batch and KV head (paged streaming: the first of the task's KV heads)
    r0          the tile's first row
    head_rows   rows of the KV head (Sq * group); the tile's rows past it are padding
    kv_len      keys of the sequence; delta = kv_len - Sq aligns query i with key i + delta
    first_pos, last_pos  query positions of the tile's first and last row
    """

    group: int
    b: tirx.PrimExpr
    g: tirx.PrimExpr
    r0: tirx.PrimExpr
    head_rows: tirx.PrimExpr
    kv_len: tirx.PrimExpr
    delta: tirx.PrimExpr
    first_pos: tirx.PrimExpr
    last_pos: tirx.PrimExpr

    def head(self, gi) -> RowTile:
        """The same rows of KV head g + gi (a streaming task's gi-th head)."""
        return replace(self, g=self.g + gi)

    def row_head(self, r):
        """Query head of the tile's row r."""
        return row_head(self.g, self.r0 + r, self.group)

    def row_position(self, r):
        """Query position of the tile's row r."""
        return row_position(self.r0 + r, self.group)

    def key_tiles(self, cfg, block_k: int):
        """[lo, hi) of the key tiles the rows can see, for a config without sink tokens (TVM's
        cache kernels); ``key_walk`` walks the sink tokens' tiles too."""
        if cfg.sink_tokens:
            raise ValueError("RowTile.key_tiles: the window's range alone would skip the sink tokens' tiles; "
                             "walk them with key_walk")
        return key_tile_range(cfg, **self._bounds(), block_k=block_k)

    def key_walk(self, cfg, block_k: int) -> KeyTiles:
        """The key tiles the rows can see, the sink tokens' included (``KeyTiles``)."""
        return key_tiles(cfg, **self._bounds(), block_k=block_k)

    def is_interior(self, cfg, key_start, block_k: int):
        """Whether every row sees every key of the tile at ``key_start`` (no masking needed)."""
        return tile_is_interior(cfg, key_start=key_start, **self._bounds(), block_k=block_k)

    def width(self, cfg, key_start, block_k: int, step: int):
        """Keys of the tile at ``key_start`` up to the last one a row sees, rounded up to ``step``."""
        return tile_width(cfg, key_start=key_start, **self._bounds(), block_k=block_k, step=step)

    def _bounds(self) -> dict:
        return dict(first_pos=self.first_pos, last_pos=self.last_pos, kv_len=self.kv_len, delta=self.delta)


@dataclass(frozen=True)
class Scratch:
    """A task's float32 scratch: queries Qs [block_q, D], scores S [block_q, block_k], the
    accumulator O [block_q, DP] and the row statistics m, l, alpha [block_q]. A paged task
    holds one of each per KV head it streams: [heads, ...] buffers."""

    Qs: tirx.Buffer
    S: tirx.Buffer
    O: tirx.Buffer
    m: tirx.Buffer
    l: tirx.Buffer
    alpha: tirx.Buffer
    q16: tirx.Buffer | None = None  # Qs rounded to int16 per row, and each row's unit (PagedTile.int_dot)
    q_unit: tirx.Buffer | None = None

    def view(self, index) -> Scratch:
        """The scratch of head ``index`` of [heads, ...] buffers, as views (declared in field order)."""
        return Scratch(_head(self.Qs, index), _head(self.S, index), _head(self.O, index), _head(self.m, index),
                        _head(self.l, index), _head(self.alpha, index))


class ForwardMacros:
    """The macros of a forward task, specialised to one spec and tile configuration.

    Their arguments: scratch buffers (or a ``Scratch``), then the ``ForwardBuffers`` and the ``RowTile``.
    """

    def __init__(self, spec: KernelSpec, tiles: CpuTiles):
        micro = Micro(tiles)
        cfg, dtype, D = spec.cfg, spec.dtype, spec.head_dim
        BQ, BK, L = tiles.block_q, tiles.block_k, tiles.lanes
        DP = tiles.padded_dim(D)
        # scores are taken in log2 units (q pre-scaled by scale * log2 e): the online softmax's
        # exponentials are then exp2, whose range reduction is one subtraction
        scale = spec.scale * sem.LOG2E

        def logit(score, params, tile, r, key):
            # softcap, ALiBi, masks and the window/length rule of one score, in natural units (S
            # is in log2 units around it)
            capped = sem.softcap(cfg, score * T.float32(sem.LN2), fast=True)
            return masked_logit(spec, capped, params.alibi, params.mask, tile.b, tile.row_head(r),
                                tile.row_position(r), key, tile.kv_len, tile.delta) * T.float32(sem.LOG2E)

        @T.macro
        def load_queries(Qs, params, tile):
            for r in range(BQ):
                if tile.r0 + r < tile.head_rows:
                    for d in range(D):
                        Qs[r, d] = (params.q[tile.b, tile.row_head(r), tile.row_position(r), d].astype(F32)
                                    * T.float32(scale))
                else:
                    for d in range(D):
                        Qs[r, d] = T.float32(0)

        @T.macro
        def init_state(O, m, l):
            for r in range(BQ):
                m[r] = T.float32(float("-inf"))
                l[r] = T.float32(0)
                for d in range(DP):
                    O[r, d] = T.float32(0)

        @T.macro
        def logits(S, params, tile, key_start):
            for r in range(BQ):
                if tile.r0 + r < tile.head_rows:
                    for c in T.vectorized(BK):
                        S[r, c] = logit(S[r, c], params, tile, r, key_start + c)

        @T.macro
        def normalize_tile(S, m, l, alpha, params, tile, key_start, width):
            # scores -> masked logits -> 2^(logit - running max), log2 units; alpha: O's rescale to the new max
            if spec.elementwise_logits:
                logits(S, params, tile, key_start)
            else:
                if not tile.is_interior(cfg, key_start, BK):
                    logits(S, params, tile, key_start)
            micro.online_softmax(S, m, l, alpha, BQ, width)

        @T.macro
        def attend_tile(scratch, Kt, Vt, params, tile, key_start, values_finite):
            # a packed key tile: both products are register-tiled GEMMs over its first `width` keys
            # (past them no row sees a key: the rest of a causal diagonal tile is skipped)
            width: T.int64 = tile.width(cfg, key_start, BK, tiles.key_vecs * L)
            micro.gemm(scratch.S, scratch.Qs, Kt, BQ, width, D, tiles.key_vecs)
            normalize_tile(scratch.S, scratch.m, scratch.l, scratch.alpha, params, tile, key_start, width)
            micro.nan_safe_gemm(scratch.O, scratch.S, Vt, BQ, DP, width, tiles.dim_vecs, values_finite,
                                accumulate=True, row_scale=scratch.alpha)

        def row_sum(m, l, params, tile, r):
            # with sinks, the row's sink logit joins the sum (O and l are relative to max m, log2 units)
            if spec.has_sinks:
                return sem.with_sink(l[r], m[r], params.sinks[tile.row_head(r)], log2=True)
            return l[r]

        @T.macro
        def store(O, m, l, params, tile):
            for r in range(BQ):
                if tile.r0 + r < tile.head_rows:
                    total: T.float32 = row_sum(m, l, params, tile, r)
                    for d in range(D):
                        params.out[tile.b, tile.row_head(r), tile.row_position(r), d] = sem.normalize(
                            O[r, d], total).astype(dtype)
                    if spec.return_lse:
                        params.lse[tile.b, tile.row_head(r), tile.row_position(r)] = sem.log_sum_exp(
                            sem.safe_row_max(m[r]) * T.float32(sem.LN2), l[r])

        self.load_queries, self.init_state, self.store = load_queries, init_state, store
        self.normalize_tile, self.attend_tile, self.scale_rows = normalize_tile, attend_tile, micro.scale_rows
        self.count_nonfinite = micro.count_nonfinite


def dense_forward(spec: KernelSpec, tiles: CpuTiles, *,
                  dims: Mapping[str, int | None] | None = None) -> tirx.PrimFunc:
    """Flash attention forward over q [B, Hq, Sq, D], k, v [B, Hkv, Sk, D]; ``dims`` fixes B, Sq, Sk
    (symbolic where absent)."""
    sizes = kernel_sizes(dims)
    B, Sq, Sk = sizes.values()
    body = ForwardMacros(spec, tiles)
    Hkv, D, group = spec.num_kv_heads, spec.head_dim, spec.group
    BQ, BK, DP, L = tiles.block_q, tiles.block_k, tiles.padded_dim(D), tiles.lanes
    cfg = spec.cfg
    unused = absent_inputs(spec) | (set() if spec.return_lse else {"lse"})

    # fmt: off
    @T.prim_func
    def fuel_flash_attn_cpu(q_h: T.handle, k_h: T.handle, v_h: T.handle, alibi_h: T.handle, mask_h: T.handle,
                            out_h: T.handle, lse_h: T.handle):
        q, k, v, alibi, mask, out, lse = kernel_params(spec, sizes, q_h, k_h, v_h, alibi_h, mask_h, out_h, lse_h)
        params = T.meta_var(ForwardBuffers.of(unused, q=q, out=out, alibi=alibi, mask=mask, lse=lse))
        rows = Sq * group
        n_row_tiles = (rows + BQ - 1) // BQ
        # K and V are packed once into float32 key tiles shared by every task of the KV head:
        # K transposed [D, block_k] (the q.k^T GEMM vectorizes over keys), V [block_k, DP]
        k_tiles = T.alloc_buffer((B, Hkv, (Sk + BK - 1) // BK, D, BK), F32)
        v_tiles = T.alloc_buffer((B, Hkv, (Sk + BK - 1) // BK, BK, DP), F32)
        n_key_tiles = (Sk + BK - 1) // BK
        v_nonfinite = T.alloc_buffer((B, Hkv, (Sk + BK - 1) // BK), F32)  # per value tile
        for pack in T.parallel(B * Hkv * n_key_tiles):
            pb: T.int64 = pack // (Hkv * n_key_tiles)
            pg: T.int64 = pack // n_key_tiles % Hkv
            pt: T.int64 = pack % n_key_tiles
            # K^T in panels of L keys: a panel's L source rows and its D destination lines stay in
            # L1 while every line is filled (a whole-tile transpose at hdim 128 missed on each store)
            for c0 in range(BK // L):
                if pt * BK + c0 * L + L <= Sk:
                    for d in range(D):
                        for c1 in T.vectorized(L):
                            k_tiles[pb, pg, pt, d, c0 * L + c1] = k[pb, pg, pt * BK + c0 * L + c1, d].astype(F32)
                else:
                    for d, c1 in T.grid(D, L):
                        k_tiles[pb, pg, pt, d, c0 * L + c1] = T.if_then_else(
                            pt * BK + c0 * L + c1 < Sk,
                            k[pb, pg, T.min(pt * BK + c0 * L + c1, Sk - 1), d].astype(F32), T.float32(0))
            for c in range(BK):
                if pt * BK + c < Sk:
                    for d in T.vectorized(D):
                        v_tiles[pb, pg, pt, c, d] = v[pb, pg, pt * BK + c, d].astype(F32)
                else:
                    for d in range(D):
                        v_tiles[pb, pg, pt, c, d] = T.float32(0)
                for d in range(D, DP):
                    v_tiles[pb, pg, pt, c, d] = T.float32(0)
            body.count_nonfinite(T.decl_buffer((1,), F32, data=v_nonfinite.data, elem_offset=pack),
                                 T.decl_buffer((BK, DP), F32, data=v_tiles.data, elem_offset=pack * (BK * DP)),
                                 BK, DP)
        for task in T.parallel(B * Hkv * n_row_tiles):
            b: T.int64 = task // (Hkv * n_row_tiles)
            g: T.int64 = task // n_row_tiles % Hkv
            r0: T.int64 = balanced_order(task % n_row_tiles, n_row_tiles) * BQ
            first_pos: T.int64 = row_position(r0, group)
            last_pos: T.int64 = row_position(T.min(r0 + BQ, rows) - 1, group)
            Qs = T.alloc_buffer((BQ, D), F32)
            S = T.alloc_buffer((BQ, BK), F32)
            O = T.alloc_buffer((BQ, DP), F32)
            m = T.alloc_buffer((BQ,), F32)
            l = T.alloc_buffer((BQ,), F32)
            alpha = T.alloc_buffer((BQ,), F32)
            scratch = T.meta_var(Scratch(Qs, S, O, m, l, alpha))
            tile = T.meta_var(RowTile(group, b, g, r0, rows, kv_len=Sk, delta=Sk - Sq, first_pos=first_pos,
                                      last_pos=last_pos))
            body.load_queries(Qs, params, tile)
            body.init_state(O, m, l)
            walk = T.meta_var(tile.key_walk(cfg, BK))
            for t in range(walk.count):
                kt: T.int64 = walk.tile(t)
                tile_offset = T.meta_var((b * Hkv + g) * n_key_tiles + kt)  # of the KV head's packed tile kt
                Kt = T.decl_buffer((D, BK), F32, data=k_tiles.data, elem_offset=tile_offset * (D * BK))
                Vt = T.decl_buffer((BK, DP), F32, data=v_tiles.data, elem_offset=tile_offset * (BK * DP))
                body.attend_tile(scratch, Kt, Vt, params, tile, kt * BK, v_nonfinite[b, g, kt] == T.float32(0))
            body.store(O, m, l, params, tile)
    # fmt: on

    return finish(drop_params(fuel_flash_attn_cpu, unused))


class PagedTile:
    """The macros that run one key tile of a paged task, its tokens placed by ``cache`` (a
    ``BlockTable`` or a layout like it): ``stream_tile`` reads the tile's K and V rows in place
    (decode), ``pack_tile`` packs them, ``packed_tile`` packs them and runs the register-tiled
    GEMMs."""

    def __init__(self, spec: KernelSpec, tiles: CpuTiles, body: ForwardMacros):
        cfg, D = spec.cfg, spec.head_dim
        BQ, BK, DP = tiles.block_q, tiles.block_k, tiles.padded_dim(D)
        HT = tiles.kv_heads  # KV heads per streaming task
        LD = next(lanes for lanes in (tiles.lanes, 8, 4, 2, 1) if D % lanes == 0)  # lanes of the head-dim loops
        VT = tiles.value_tokens
        PREFETCH = tiles.prefetch
        PER_LINE = 64 // (tvm.DataType(spec.kv_dtype).bits // 8)  # elements per 64-byte cache line
        LINES = -(-D // PER_LINE)  # cache lines of one head's row of a token
        ROWS_POW2 = 1 << (BQ - 1).bit_length()  # rows of the score shuffle tree
        # an 8-bit cache streams its elements decoded but unscaled: a token's K scale multiplies its
        # scores and its V scale its weights (per token, not per element)
        QUANT = bool(spec.cache_dtype)
        SCALED = QUANT and (bool(spec.kv_scale) or quant.decode_factor(spec.cache_dtype) != 1)
        # an int8 cache's q.k in integers where the target has vpmaddwd: q rounded per row to int16
        # (2^-15 of its largest element, far under the cache's 2^-8), two multiplies an instruction
        # and no conversion of K (side by side, multi-head decode: int8 3.6 -> 3.2 ms)
        INT_DOT = bool(tiles.int16_dot) and spec.cache_dtype == "int8" and D % INT16_DOT_LANES == 0
        DL, DS = INT16_DOT_LANES, INT16_DOT_SUMS
        self.int_dot = INT_DOT  # the task rounds its queries once (round_queries) into Scratch.q16

        def element(cache, kind, page, slot, g, d):
            return (cache.raw(kind, page, slot, g, d) if QUANT else getattr(cache, kind)(page, slot, g, d)).astype(F32)

        def scaled(x, cache, kind, page, slot, g):
            return x * cache.scale(kind, page, slot, g) if SCALED else x

        @T.macro
        def prefetch_row(cache, kind, pages_ahead, token, kv_len, g, c):
            # one head's row of the token PREFETCH ahead: its K in the score pass, its V in the value
            # pass. The hardware prefetchers restart at every 4 KiB page and at every jump through the
            # block table (measured: bfloat16 1.7x faster with it, float32 0-16 % by the memory load).
            ahead: T.int64 = T.min(token + PREFETCH, kv_len - 1)
            for line in T.unroll(LINES):
                prefetch(T.address_of(cache.stored(kind, pages_ahead[c], cache.slot(ahead), g,
                                                   T.min(line * PER_LINE, D - 1))))

        @T.macro
        def add_values(heads, cache, tile, tokens, gi, first, count: T.int32, skip_zero_weights):
            # O[gi] += sum over tokens first .. first + count - 1 of P[gi, :, token] * V[token, head g + gi]
            # (skip_zero_weights: a dropped token's P is 0 and its V may be NaN, see the module docstring)
            for d0 in range(D // LD):
                acc_o = T.alloc_buffer((BQ, LD), F32, scope="local")
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
        def add_value_rows(heads, cache, tile, tokens, live, skip_zero_weights):
            # value rows accumulated VT tokens per pass: the accumulator is loaded and stored once per
            # VT tokens; each token's value row is still read as one contiguous run over the heads
            for c0 in range(live // VT):
                for gi in range(HT):
                    if PREFETCH > 0:
                        for u in T.unroll(VT):
                            prefetch_row(cache, "v", tokens.pages_ahead, tokens.kt * BK + c0 * VT + u,
                                         tile.kv_len, tile.g + gi, c0 * VT + u)
                    add_values(heads, cache, tile, tokens, gi, c0 * VT, VT, skip_zero_weights)
            for c in range(live // VT * VT, live):
                for gi in range(HT):
                    add_values(heads, cache, tile, tokens, gi, c, 1, skip_zero_weights)

        @T.macro
        def round_queries(heads):
            round_rows_to_int16(heads.Qs, heads.q16, heads.q_unit, HT, BQ, D)

        @T.macro
        def integer_scores(heads, sums, cache, tile, page, slot, gi, c):
            # S[gi, :, c] from int32 lane sums of q16 . k (the K scale and q's unit applied per row)
            acc_i = T.alloc_buffer((BQ, DS), "int32", scope="local")
            acc_f = T.alloc_buffer((BQ, DS), F32, scope="local")
            for r in T.unroll(BQ):
                for v in T.vectorized(DS):
                    acc_i[r, v] = 0
            for d0 in range(D // DL):
                for r in T.unroll(BQ):
                    int16_dot(acc_i, r, tirx.BufferLoad(heads.q16, [gi, r, tirx.Ramp(d0 * DL, 1, DL)]), tirx.Cast(
                        f"int16x{DL}", cache.stored("k", page, slot, tile.g + gi, tirx.Ramp(d0 * DL, 1, DL))))
            for r in T.unroll(BQ):
                for v in T.vectorized(DS):
                    acc_f[r, v] = T.Cast(F32, acc_i[r, v])
            store_row_sums(sums, acc_f, BQ, DS)
            for r in T.unroll(BQ):
                heads.S[gi, r, c] = scaled(sums[r] * heads.q_unit[gi, r], cache, "k", page, slot, tile.g + gi)

        @T.macro
        def stream_tile(heads, params, cache, tile, kt):
            # the page of every token of the tile, looked up once (dead tokens reuse the last live one)
            pages = T.alloc_buffer((BK,), "int64", scope="local")
            sums = T.alloc_buffer((ROWS_POW2,), F32, scope="local")
            for c in range(BK):
                pages[c] = cache.page(T.min(kt * BK + c, tile.kv_len - 1))
            # and of the token PREFETCH ahead of each (the last live one past the end)
            pages_ahead = T.alloc_buffer((BK if PREFETCH > 0 else 1,), "int64", scope="local")
            if PREFETCH > 0:
                for c in range(BK):
                    pages_ahead[c] = cache.page(T.min(kt * BK + c + PREFETCH, tile.kv_len - 1))
            tokens = T.meta_var(_Tokens(kt, pages, pages_ahead))
            for c in range(BK):
                if kt * BK + c < tile.kv_len:
                    for gi in range(HT):
                        if PREFETCH > 0:
                            prefetch_row(cache, "k", pages_ahead, kt * BK + c, tile.kv_len, tile.g + gi, c)
                        if INT_DOT:
                            integer_scores(heads, sums, cache, tile, pages[c], cache.slot(kt * BK + c), gi, c)
                        else:
                            acc = T.alloc_buffer((BQ, LD), F32, scope="local")
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
                body.normalize_tile(_head(heads.S, gi), _head(heads.m, gi), _head(heads.l, gi),
                                    _head(heads.alpha, gi), params, tile.head(gi), kt * BK, BK)
                body.scale_rows(_head(heads.O, gi), _head(heads.alpha, gi), BQ, DP)
                if SCALED:  # the weights times their token's V scale (a zero weight stays 0: NaN scales of
                    # dropped tokens never reach a row)
                    for c in range(BK):
                        if kt * BK + c < tile.kv_len:
                            for r in T.unroll(BQ):
                                heads.S[gi, r, c] = T.Select(
                                    heads.S[gi, r, c] == T.float32(0), T.float32(0),
                                    scaled(heads.S[gi, r, c], cache, "v", pages[c], cache.slot(kt * BK + c),
                                           tile.g + gi))
            live = T.min(tile.kv_len - kt * BK, BK)
            # interior tiles drop no token: their value rows need no zero-weight check
            if tile.is_interior(cfg, kt * BK, BK):
                add_value_rows(heads, cache, tile, tokens, live, False)
            else:
                add_value_rows(heads, cache, tile, tokens, live, True)

        @T.macro
        def pack_tile(Kt, Vt, nonfinite, cache, g, kv_len, kt):
            # key tile kt of KV head g as Kt [D, BK] and Vt [BK, DP] (zeros past kv_len);
            # nonfinite[0]: how many of Vt's elements are NaN or Inf
            for c in range(BK):
                if kt * BK + c < kv_len:
                    block: T.int64 = cache.page(kt * BK + c)
                    for d in range(D):
                        Kt[d, c] = cache.k(block, cache.slot(kt * BK + c), g, d).astype(F32)
                        Vt[c, d] = cache.v(block, cache.slot(kt * BK + c), g, d).astype(F32)
                else:
                    for d in range(D):
                        Kt[d, c] = T.float32(0)
                        Vt[c, d] = T.float32(0)
                for d in range(D, DP):
                    Vt[c, d] = T.float32(0)
            body.count_nonfinite(nonfinite, Vt, BK, DP)

        @T.macro
        def packed_tile(heads, Kt, Vt, params, cache, tile, kt):
            nonfinite = T.alloc_buffer((1,), F32, scope="local")
            pack_tile(Kt, Vt, nonfinite, cache, tile.g, tile.kv_len, kt)
            body.attend_tile(heads.view(0), Kt, Vt, params, tile, kt * BK, nonfinite[0] == T.float32(0))

        self.stream_tile, self.pack_tile, self.packed_tile = stream_tile, pack_tile, packed_tile
        self.round_queries = round_queries


@dataclass(frozen=True)
class _Tokens:
    """Key tile ``kt`` of a streaming paged task: the page of each of its tokens (``pages``) and of
    the token PREFETCH ahead of each (``pages_ahead``)."""

    kt: tirx.PrimExpr
    pages: tirx.Buffer
    pages_ahead: tirx.Buffer


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
    Hkv, D, group = spec.num_kv_heads, spec.head_dim, spec.group
    BQ, BK, DP = tiles.block_q, tiles.block_k, tiles.padded_dim(D)
    cfg = spec.cfg
    streaming = BQ <= STREAMING_ROWS
    rounded = streaming and paged.int_dot  # int8 decode's q.k in integers: q rounded once per task
    HT = tiles.kv_heads if streaming else 1  # KV heads per task
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
        rows = Sq * group
        n_row_tiles = (rows + BQ - 1) // BQ
        for task in T.parallel(B * (Hkv // HT) * n_row_tiles):
            b: T.int64 = task // ((Hkv // HT) * n_row_tiles)
            g0: T.int64 = task // n_row_tiles % (Hkv // HT) * HT
            r0: T.int64 = balanced_order(task % n_row_tiles, n_row_tiles) * BQ
            kv_len: T.int64 = T.Cast("int64", lens[b])
            first_pos: T.int64 = row_position(r0, group)
            last_pos: T.int64 = row_position(T.min(r0 + BQ, rows) - 1, group)
            Qs_all = T.alloc_buffer((HT, BQ, D), F32)
            S_all = T.alloc_buffer((HT, BQ, BK), F32)
            O_all = T.alloc_buffer((HT, BQ, DP), F32)
            m_all = T.alloc_buffer((HT, BQ), F32)
            l_all = T.alloc_buffer((HT, BQ), F32)
            alpha_all = T.alloc_buffer((HT, BQ), F32)
            Kt = T.alloc_buffer((D, BK) if not streaming else (1,), F32)
            Vt = T.alloc_buffer((BK, DP) if not streaming else (1,), F32)
            q16_all = T.alloc_buffer((HT, BQ, D) if rounded else (1, 1, 1), "int16")
            q_unit_all = T.alloc_buffer((HT, BQ) if rounded else (1, 1), F32)
            heads = T.meta_var(Scratch(Qs_all, S_all, O_all, m_all, l_all, alpha_all, q16_all, q_unit_all))
            tile = T.meta_var(RowTile(group, b, g0, r0, rows, kv_len=kv_len, delta=kv_len - Sq,
                                      first_pos=first_pos, last_pos=last_pos))
            cache = T.meta_var(BlockTable(table, k_cache, v_cache, b, num_blocks, spec.block_size,
                                          *((k_scale, v_scale) if scaled else ())))
            for gi in range(HT):
                body.load_queries(_head(Qs_all, gi), params, tile.head(gi))
                body.init_state(_head(O_all, gi), _head(m_all, gi), _head(l_all, gi))
            if rounded:
                paged.round_queries(heads)
            walk = T.meta_var(tile.key_walk(cfg, BK))
            for t in range(walk.count):
                kt: T.int64 = walk.tile(t)
                if streaming:
                    paged.stream_tile(heads, params, cache, tile, kt)
                else:
                    paged.packed_tile(heads, Kt, Vt, params, cache, tile, kt)
            for gi in range(HT):
                body.store(_head(O_all, gi), _head(m_all, gi), _head(l_all, gi), params, tile.head(gi))
    # fmt: on

    return finish(drop_params(fuel_paged_attn_cpu, unused))


def _head(buffer, index):
    """View of ``buffer[index]`` (a [heads, ...] task buffer) as its own buffer."""
    shape = list(buffer.shape[1:])
    size = 1
    for n in shape:
        size *= int(n)
    return T.decl_buffer(shape, F32, data=buffer.data, elem_offset=index * size)
