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
    dense_forward   -- PrimFunc(q, k, v, [alibi_slopes], [attn_mask], out, [lse])
    paged_forward   -- PrimFunc(q, k_cache, v_cache, block_table, context_lens, [alibi_slopes], out)
"""

from __future__ import annotations

from typing import Mapping

import tvm
from tvm import tirx
from tvm.script import tirx as T

from ... import semantics as sem
from ..common import (F32, balanced_order, drop_params, finish, KernelSpec, key_tile_range, masked_logit,
                      param_buffers, row_head, row_position, shape_vars, tile_is_interior, tile_width)
from .common import prefetch
from .micro import Micro, store_row_sums
from .tiles import STREAMING_ROWS, CpuTiles


class _Body:
    """The macros of a forward task, specialised to one spec and tile configuration."""

    def __init__(self, spec: KernelSpec, tiles: CpuTiles):
        micro = Micro(tiles)
        cfg, dtype, group, D = spec.cfg, spec.dtype, spec.group, spec.head_dim
        BQ, BK, L = tiles.block_q, tiles.block_k, tiles.lanes
        DP = tiles.padded_dim(D)
        # scores are taken in log2 units (q pre-scaled by scale * log2 e): the online softmax's
        # exponentials are then exp2, whose range reduction is one subtraction
        scale = spec.scale * sem.LOG2E
        mask_dtype = spec.mask_dtype

        @T.macro
        def load_queries(Qs, q, b, g, r0, rows):
            for r in range(BQ):
                if r0 + r < rows:
                    for d in range(D):
                        Qs[r, d] = q[b, row_head(g, r0 + r, group), row_position(r0 + r, group), d].astype(F32) * T.float32(scale)
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
        def logits(S, alibi, mask, b, g, r0, rows, key_start, kv_len, delta):
            # softcap, ALiBi, masks and the window/length rule, element by element (in natural units:
            # S is in log2 units around it)
            for r in range(BQ):
                if r0 + r < rows:
                    for c in T.vectorized(BK):
                        S[r, c] = masked_logit(spec, sem.softcap(cfg, S[r, c] * T.float32(sem.LN2), fast=True), alibi, mask, b, row_head(g, r0 + r, group), row_position(r0 + r, group), key_start + c, kv_len, delta) * T.float32(sem.LOG2E)

        @T.macro
        def normalize_tile(S, m, l, alpha, alibi, mask, b, g, r0, rows, key_start, kv_len, delta, first_pos,
                           last_pos, width):
            # scores -> masked logits -> 2^(logit - running max), log2 units; alpha: O's rescale to the new max
            if spec.elementwise_logits:
                logits(S, alibi, mask, b, g, r0, rows, key_start, kv_len, delta)
            else:
                if not tile_is_interior(cfg, key_start=key_start, first_pos=first_pos, last_pos=last_pos,
                                        kv_len=kv_len, delta=delta, block_k=BK):
                    logits(S, alibi, mask, b, g, r0, rows, key_start, kv_len, delta)
            micro.online_softmax(S, m, l, alpha, BQ, width)

        @T.macro
        def attend_tile(Qs, Kt, Vt, S, O, m, l, alpha, alibi, mask, b, g, r0, rows, key_start, kv_len, delta,
                        first_pos, last_pos, values_finite):
            # a packed key tile: both products are register-tiled GEMMs over its first `width` keys
            # (past them no row sees a key: the rest of a causal diagonal tile is skipped)
            width: T.int64 = tile_width(cfg, key_start=key_start, first_pos=first_pos, last_pos=last_pos,
                                        kv_len=kv_len, delta=delta, block_k=BK, step=tiles.key_vecs * L)
            micro.gemm(S, Qs, Kt, BQ, width, D, tiles.key_vecs, False, False, None)
            normalize_tile(S, m, l, alpha, alibi, mask, b, g, r0, rows, key_start, kv_len, delta, first_pos,
                           last_pos, width)
            if values_finite:
                micro.gemm(O, S, Vt, BQ, DP, width, tiles.dim_vecs, False, True, alpha)
            else:
                micro.gemm(O, S, Vt, BQ, DP, width, tiles.dim_vecs, False, True, alpha, True)

        @T.macro
        def store(out, lse, O, m, l, b, g, r0, rows):
            for r in range(BQ):
                if r0 + r < rows:
                    for d in range(D):
                        out[b, row_head(g, r0 + r, group), row_position(r0 + r, group), d] = sem.normalize(O[r, d], l[r]).astype(dtype)
                    if spec.return_lse:
                        lse[b, row_head(g, r0 + r, group), row_position(r0 + r, group)] = sem.log_sum_exp(sem.safe_row_max(m[r]) * T.float32(sem.LN2), l[r])

        self.load_queries, self.init_state, self.store = load_queries, init_state, store
        self.normalize_tile, self.attend_tile, self.scale_rows = normalize_tile, attend_tile, micro.scale_rows
        self.count_nonfinite = micro.count_nonfinite


def dense_forward(spec: KernelSpec, tiles: CpuTiles, *, dims: Mapping[str, int | None] | None = None) -> tirx.PrimFunc:
    """Flash attention forward over q [B, Hq, Sq, D], k, v [B, Hkv, Sk, D]; ``dims`` fixes B, Sq, Sk
    (symbolic where absent)."""
    B, Sq, Sk = shape_vars(dims or {}, ("B", "Sq", "Sk"))
    body = _Body(spec, tiles)
    dtype, Hq, Hkv, D, group = spec.dtype, spec.num_q_heads, spec.num_kv_heads, spec.head_dim, spec.group
    BQ, BK, DP, L = tiles.block_q, tiles.block_k, tiles.padded_dim(D), tiles.lanes
    cfg = spec.cfg
    has_mask = len(spec.mask_broadcast) > 0

    # fmt: off
    @T.prim_func
    def fuel_flash_attn_cpu(q_h: T.handle, k_h: T.handle, v_h: T.handle, alibi_h: T.handle, mask_h: T.handle,
                            out_h: T.handle, lse_h: T.handle):
        T.func_attr({"tirx.noalias": True})
        q, k, v, alibi, mask, out, lse = param_buffers(
            spec, dict(B=B, Sq=Sq, Sk=Sk),
            q=q_h, k=k_h, v=v_h, alibi=alibi_h, mask=mask_h, out=out_h, lse=lse_h)
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
                                 T.decl_buffer((BK, DP), F32, data=v_tiles.data, elem_offset=pack * (BK * DP)), BK, DP)
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
            body.load_queries(Qs, q, b, g, r0, rows)
            body.init_state(O, m, l)
            lo, hi = key_tile_range(cfg, first_pos=first_pos, last_pos=last_pos, kv_len=Sk, delta=Sk - Sq, block_k=BK)
            for kt in range(lo, hi):
                Kt = T.decl_buffer((D, BK), F32, data=k_tiles.data, elem_offset=((b * Hkv + g) * n_key_tiles + kt) * (D * BK))
                Vt = T.decl_buffer((BK, DP), F32, data=v_tiles.data, elem_offset=((b * Hkv + g) * n_key_tiles + kt) * (BK * DP))
                body.attend_tile(Qs, Kt, Vt, S, O, m, l, alpha, alibi, mask, b, g, r0, rows, kt * BK, Sk,
                                 Sk - Sq, first_pos, last_pos, v_nonfinite[b, g, kt] == T.float32(0))
            body.store(out, lse, O, m, l, b, g, r0, rows)
    # fmt: on

    unused = set()
    if not spec.has_alibi:
        unused.add("alibi")
    if not has_mask:
        unused.add("mask")
    if not spec.return_lse:
        unused.add("lse")
    return finish(drop_params(fuel_flash_attn_cpu, unused))


def paged_forward(spec: KernelSpec, tiles: CpuTiles, *, dims: Mapping[str, int | None] | None = None) -> tirx.PrimFunc:
    """Paged attention of q [B, Hq, Sq, D] over caches [num_blocks, block_size, Hkv, D].

    Decode-shaped work (at most STREAMING_ROWS rows per KV head) streams keys and values in place:
    a task owns ``tiles.kv_heads`` adjacent KV heads of one sequence, so for each token it reads
    one contiguous run of the page ([kv_heads, D]) for K and for V, and keeps per head its own
    rows, score tile and accumulator (views into the task's buffers). More rows (multi-query)
    pack each key tile through the block table and run the register-tiled GEMMs.
    """
    B, Sq, num_blocks, max_blocks = shape_vars(dims or {}, ("B", "Sq", "num_blocks", "max_blocks"))
    body = _Body(spec, tiles)
    dtype, Hq, Hkv, D, group = spec.dtype, spec.num_q_heads, spec.num_kv_heads, spec.head_dim, spec.group
    BQ, BK, DP, BS = tiles.block_q, tiles.block_k, tiles.padded_dim(D), spec.block_size
    cfg = spec.cfg
    streaming = BQ <= STREAMING_ROWS
    HT = tiles.kv_heads if streaming else 1  # KV heads per task
    LD = next(lanes for lanes in (tiles.lanes, 8, 4, 2, 1) if D % lanes == 0)  # lanes of the head-dim loops
    VT = tiles.value_tokens
    PREFETCH = tiles.prefetch
    PER_LINE = 64 // (tvm.DataType(dtype).bits // 8)  # elements per 64-byte cache line
    LINES = -(-D // PER_LINE)  # cache lines of one head's row of a token
    ROWS_POW2 = 1 << (BQ - 1).bit_length()  # rows of the score shuffle tree

    def page_of(table, b, j, num_blocks):
        # a live token's block id was validated before the kernel (CPU check); clamp all the same
        return T.max(T.min(T.Cast("int64", table[b, j // BS]), num_blocks - 1), T.int64(0))

    @T.macro
    def prefetch_row(cache, pages_ahead, token, kv_len, g, c):
        # one head's row of the token PREFETCH ahead: its K in the score pass, its V in the value
        # pass. The hardware prefetchers restart at every 4 KiB page and at every jump through the
        # block table (measured: bfloat16 1.7x faster with it, float32 0-16 % by the memory load).
        ahead: T.int64 = T.min(token + PREFETCH, kv_len - 1)
        for line in T.unroll(LINES):
            prefetch(T.address_of(cache[pages_ahead[c], ahead % BS, g, T.min(line * PER_LINE, D - 1)]))

    @T.macro
    def add_values(O_all, S_all, pages, v_cache, kt, g0, gi, first, count: T.int32, skip_zero_weights):
        # O[gi] += sum over tokens first .. first + count - 1 of P[gi, :, token] * V[token, head g0 + gi]
        # (skip_zero_weights: a dropped token's P is 0 and its V may be NaN, see the module docstring)
        for d0 in range(D // LD):
            acc_o = T.alloc_buffer((BQ, LD), F32, scope="local")
            for r in T.unroll(BQ):
                for v in T.vectorized(LD):
                    acc_o[r, v] = O_all[gi, r, d0 * LD + v]
            for u in T.unroll(count):
                for r in T.unroll(BQ):
                    for v in T.vectorized(LD):
                        if skip_zero_weights:
                            acc_o[r, v] = sem.add_weighted(acc_o[r, v], S_all[gi, r, first + u], v_cache[pages[first + u], (kt * BK + first + u) % BS, g0 + gi, d0 * LD + v].astype(F32))
                        else:
                            acc_o[r, v] = acc_o[r, v] + S_all[gi, r, first + u] * v_cache[pages[first + u], (kt * BK + first + u) % BS, g0 + gi, d0 * LD + v].astype(F32)
            for r in T.unroll(BQ):
                for v in T.vectorized(LD):
                    O_all[gi, r, d0 * LD + v] = acc_o[r, v]

    @T.macro
    def add_value_rows(O_all, S_all, pages, pages_ahead, v_cache, kt, kv_len, g0, live, skip_zero_weights):
        for c0 in range(live // VT):
            for gi in range(HT):
                if PREFETCH > 0:
                    for u in T.unroll(VT):
                        prefetch_row(v_cache, pages_ahead, kt * BK + c0 * VT + u, kv_len, g0 + gi, c0 * VT + u)
                add_values(O_all, S_all, pages, v_cache, kt, g0, gi, c0 * VT, VT, skip_zero_weights)
        for c in range(live // VT * VT, live):
            for gi in range(HT):
                add_values(O_all, S_all, pages, v_cache, kt, g0, gi, c, 1, skip_zero_weights)

    @T.macro
    def stream_tile(Qs_all, S_all, O_all, m_all, l_all, alpha_all, k_cache, v_cache, table, alibi, b, g0, r0, rows,
                    kt, kv_len, Sq, num_blocks, first_pos, last_pos):
        # the page of every token of the tile, looked up once (dead tokens reuse the last live one)
        pages = T.alloc_buffer((BK,), "int64", scope="local")
        sums = T.alloc_buffer((ROWS_POW2,), F32, scope="local")
        for c in range(BK):
            pages[c] = page_of(table, b, T.min(kt * BK + c, kv_len - 1), num_blocks)
        # and of the token PREFETCH ahead of each (the last live one past the end)
        pages_ahead = T.alloc_buffer((BK if PREFETCH > 0 else 1,), "int64", scope="local")
        if PREFETCH > 0:
            for c in range(BK):
                pages_ahead[c] = page_of(table, b, T.min(kt * BK + c + PREFETCH, kv_len - 1), num_blocks)
        for c in range(BK):
            if kt * BK + c < kv_len:
                for gi in range(HT):
                    acc = T.alloc_buffer((BQ, LD), F32, scope="local")
                    for r in T.unroll(BQ):
                        for v in T.vectorized(LD):
                            acc[r, v] = T.float32(0)
                    if PREFETCH > 0:
                        prefetch_row(k_cache, pages_ahead, kt * BK + c, kv_len, g0 + gi, c)
                    for d0 in range(D // LD):
                        for r in T.unroll(BQ):
                            for v in T.vectorized(LD):
                                acc[r, v] = acc[r, v] + Qs_all[gi, r, d0 * LD + v] * k_cache[pages[c], (kt * BK + c) % BS, g0 + gi, d0 * LD + v].astype(F32)
                    store_row_sums(sums, acc, BQ, LD)
                    for r in T.unroll(BQ):
                        S_all[gi, r, c] = sums[r]
            else:
                for gi, r in T.grid(HT, BQ):
                    S_all[gi, r, c] = T.float32(0)
        for gi in range(HT):
            body.normalize_tile(_head(S_all, gi), _head(m_all, gi), _head(l_all, gi), _head(alpha_all, gi), alibi,
                                alibi, b, g0 + gi, r0, rows, kt * BK, kv_len, kv_len - Sq, first_pos, last_pos, BK)
            body.scale_rows(_head(O_all, gi), _head(alpha_all, gi), BQ, DP)
        live = T.min(kv_len - kt * BK, BK)
        # value rows accumulated VT tokens per pass: the accumulator is loaded and stored once per
        # VT tokens; each token's value row is still read as one contiguous run over the heads
        if tile_is_interior(cfg, key_start=kt * BK, first_pos=first_pos, last_pos=last_pos, kv_len=kv_len,
                            delta=kv_len - Sq, block_k=BK):
            add_value_rows(O_all, S_all, pages, pages_ahead, v_cache, kt, kv_len, g0, live, False)
        else:
            add_value_rows(O_all, S_all, pages, pages_ahead, v_cache, kt, kv_len, g0, live, True)

    @T.macro
    def packed_tile(Qs_all, S_all, O_all, m_all, l_all, alpha_all, Kt, Vt, k_cache, v_cache, table, alibi, b, g,
                    r0, rows, kt, kv_len, Sq, num_blocks, first_pos, last_pos):
        for c in range(BK):
            if kt * BK + c < kv_len:
                block: T.int64 = page_of(table, b, kt * BK + c, num_blocks)
                for d in range(D):
                    Kt[d, c] = k_cache[block, (kt * BK + c) % BS, g, d].astype(F32)
                    Vt[c, d] = v_cache[block, (kt * BK + c) % BS, g, d].astype(F32)
            else:
                for d in range(D):
                    Kt[d, c] = T.float32(0)
                    Vt[c, d] = T.float32(0)
            for d in range(D, DP):
                Vt[c, d] = T.float32(0)
        nonfinite = T.alloc_buffer((1,), F32, scope="local")
        body.count_nonfinite(nonfinite, Vt, BK, DP)
        body.attend_tile(_head(Qs_all, 0), Kt, Vt, _head(S_all, 0), _head(O_all, 0), _head(m_all, 0),
                         _head(l_all, 0), _head(alpha_all, 0), alibi, alibi, b, g, r0, rows, kt * BK, kv_len,
                         kv_len - Sq, first_pos, last_pos, nonfinite[0] == T.float32(0))

    # fmt: off
    @T.prim_func
    def fuel_paged_attn_cpu(q_h: T.handle, k_cache_h: T.handle, v_cache_h: T.handle, table_h: T.handle,
                            lens_h: T.handle, alibi_h: T.handle, out_h: T.handle):
        T.func_attr({"tirx.noalias": True})
        q, k_cache, v_cache, table, lens, alibi, out = param_buffers(
            spec, dict(B=B, Sq=Sq, num_blocks=num_blocks, max_blocks=max_blocks),
            q=q_h, k_cache=k_cache_h, v_cache=v_cache_h, table=table_h, lens=lens_h, alibi=alibi_h, out=out_h)
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
            for gi in range(HT):
                body.load_queries(_head(Qs_all, gi), q, b, g0 + gi, r0, rows)
                body.init_state(_head(O_all, gi), _head(m_all, gi), _head(l_all, gi))
            lo, hi = key_tile_range(cfg, first_pos=first_pos, last_pos=last_pos, kv_len=kv_len, delta=kv_len - Sq,
                                    block_k=BK)
            for kt in range(lo, hi):
                if streaming:
                    stream_tile(Qs_all, S_all, O_all, m_all, l_all, alpha_all, k_cache, v_cache, table, alibi, b, g0,
                                r0, rows, kt, kv_len, Sq, num_blocks, first_pos, last_pos)
                else:
                    packed_tile(Qs_all, S_all, O_all, m_all, l_all, alpha_all, Kt, Vt, k_cache, v_cache, table, alibi,
                                b, g0, r0, rows, kt, kv_len, Sq, num_blocks, first_pos, last_pos)
            for gi in range(HT):
                body.store(out, out, _head(O_all, gi), _head(m_all, gi), _head(l_all, gi), b, g0 + gi, r0, rows)
    # fmt: on

    return finish(drop_params(fuel_paged_attn_cpu, set() if spec.has_alibi else {"alibi"}))


def _head(buffer, index):
    """View of ``buffer[index]`` (a [heads, ...] task buffer) as its own buffer."""
    shape = list(buffer.shape[1:])
    size = 1
    for n in shape:
        size *= int(n)
    return T.decl_buffer(shape, F32, data=buffer.data, elem_offset=index * size)
