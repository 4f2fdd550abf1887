"""CPU forward attention: a task's macros (load, online-softmax tiles, store), shared by the dense, paged
(``paged.py``), packed and TVM-cache kernels, and the dense flash attention kernel (with lse).

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

Contents:
    KernelSpec     -- the static facts of one kernel instance
    ForwardBuffers         -- the parameter buffers a task's macros read and write
    RowTile        -- the rows one task owns and the keys they may see
    Scratch        -- a task's float32 scratch (queries, scores, accumulator, row statistics)
    ForwardMacros  -- a task's macros: load, online-softmax tiles, store (the TVM-cache kernels use them too)
    head_view      -- one head's view of a [heads, ...] task buffer
    dense_forward   -- PrimFunc(q, k, v, [alibi_slopes], [attn_mask], out, [lse])
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Mapping

from tvm import tirx
from tvm.script import tirx as T

from tvm_fuel.op import semantics as sem
from ..common import (F32, add_key_term, balanced_order, biased, drop_params, finish, is_key_mask, KernelSpec,
                      key_mask_heads, key_term, KeyTiles, key_tile_range, key_tiles, masked_logit, kernel_params,
                      row_head, row_position, kernel_sizes, tile_is_interior, tile_width, visible, without_mask)
from .common import absent_inputs, Buffers
from .micro import lane_tree, Micro
from .tiles import CpuTiles


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

    def live_rows(self, block_q: int, micro_rows: int):
        """The tile's rows up to its last real one, in whole register tiles: what its GEMMs run over
        (a one-row sequence's task is not block_q rows)."""
        live = (self.head_rows - self.r0 + micro_rows - 1) // micro_rows * micro_rows
        return tirx.min(tirx.const(block_q, "int64"), live)

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
    """A task's scratch: float32 queries Qs [block_q, D], scores S [block_q, block_k], the
    accumulator O [block_q, DP] and the row statistics m, l, alpha [block_q] (and the integer
    decode's int16 / int32 buffers below). A paged task holds one of each per KV head it streams:
    [heads, ...] buffers."""

    Qs: tirx.Buffer
    S: tirx.Buffer
    O: tirx.Buffer
    m: tirx.Buffer
    l: tirx.Buffer
    alpha: tirx.Buffer
    # int8 decode in integers (PagedTile.int_dot): Qs rounded to int16 per row and each row's unit;
    # a key tile's weights (S) rounded so, and the int32 sums of their products with V's codes
    q16: tirx.Buffer | None = None
    q_unit: tirx.Buffer | None = None
    w16: tirx.Buffer | None = None
    w_unit: tirx.Buffer | None = None
    acc_i: tirx.Buffer | None = None

    def view(self, index) -> Scratch:
        """The scratch of head ``index`` of [heads, ...] buffers, as views (declared in field order)."""
        return Scratch(*(head_view(buffer, index) for buffer in (self.Qs, self.S, self.O, self.m, self.l, self.alpha)))


class ForwardMacros:
    """The macros of a forward task, specialised to one spec and tile configuration.

    Their arguments: scratch buffers (or a ``Scratch``), then the ``ForwardBuffers`` and the ``RowTile``.
    """

    def __init__(self, spec: KernelSpec, tiles: CpuTiles):
        micro = Micro(tiles)
        cfg, dtype, D = spec.cfg, spec.dtype, spec.head_dim
        BQ, BK, L, MR = tiles.block_q, tiles.block_k, tiles.lanes, tiles.micro_rows
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
        def init_state(O, m, l, rows=BQ):
            # the running max, sum and accumulator of the first `rows` rows (those the GEMMs run over)
            for r in range(rows):
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

        # A key mask (or bias: the same for every query row) is read once per key tile into terms
        # [MH, BK] (log2 units) and added to whole columns, not loaded per score; an interior tile
        # whose terms are all 0 (an all-true mask) is left as it is.
        KEY_MASK = is_key_mask(spec)
        plain = without_mask(spec)  # the logit's other parts, per score where plain.elementwise_logits
        MH = key_mask_heads(spec)  # rows of terms: one per query head of the group, or one for all

        def key_masked_logit(score, term, params, tile, r, key, boundary: bool):
            # the logit of row r and key `key` (log2 units) from its score and its key's term; the
            # window/length rule only on a boundary tile (an interior one keeps every key)
            x = score
            if plain.elementwise_logits:
                capped = sem.softcap(cfg, score * T.float32(sem.LN2), fast=True)
                x = biased(plain, capped, params.alibi, None, tile.b, tile.row_head(r), tile.row_position(r), key,
                           tile.delta) * T.float32(sem.LOG2E)
            x = add_key_term(x, term)
            if boundary:
                x = sem.masked(visible(plain, None, tile.b, tile.row_head(r), tile.row_position(r), key,
                                       tile.kv_len, tile.delta), x)
            return x

        @T.macro
        def add_key_terms(S, terms, params, tile, key_start, boundary):
            for r in range(BQ):
                if tile.r0 + r < tile.head_rows:
                    for c in T.vectorized(BK):
                        S[r, c] = key_masked_logit(S[r, c], terms[(tile.r0 + r) % MH, c], params, tile, r,
                                                   key_start + c, boundary)

        @T.macro
        def key_masked_logits(S, params, tile, key_start):
            terms = T.alloc_buffer((MH, BK), F32)
            marked = T.alloc_buffer((L,), F32)  # per lane: 1 where a term of its columns is not 0
            flag = T.alloc_buffer((1,), F32)
            for v in T.vectorized(L):
                marked[v] = T.float32(0)
            for hi, c0 in T.grid(MH, BK // L):
                for v in T.vectorized(L):
                    terms[hi, c0 * L + v] = key_term(spec, params.mask, tile.b, tile.g * spec.group + hi,
                                                     key_start + c0 * L + v, unit=sem.LOG2E)
                    marked[v] = T.max(marked[v], T.Select(terms[hi, c0 * L + v] == T.float32(0), T.float32(0),
                                                          T.float32(1)))
            flag[0] = lane_tree(T.max, marked, L)
            if not tile.is_interior(cfg, key_start, BK):
                add_key_terms(S, terms, params, tile, key_start, True)
            elif plain.elementwise_logits:
                add_key_terms(S, terms, params, tile, key_start, False)
            elif flag[0] != T.float32(0):
                add_key_terms(S, terms, params, tile, key_start, False)

        @T.macro
        def normalize_tile(S, m, l, alpha, params, tile, key_start, width, rows=BQ):
            # scores -> masked logits -> 2^(logit - running max), log2 units; alpha: O's rescale to the new max
            # (of the tile's first `rows` rows)
            if KEY_MASK:
                key_masked_logits(S, params, tile, key_start)
            elif spec.elementwise_logits:
                logits(S, params, tile, key_start)
            else:
                if not tile.is_interior(cfg, key_start, BK):
                    logits(S, params, tile, key_start)
            micro.online_softmax(S, m, l, alpha, rows, width)

        @T.macro
        def attend_tile(scratch, Kt, Vt, params, tile, key_start, values_finite):
            # a packed key tile: both products are register-tiled GEMMs over its first `width` keys
            # (past them no row sees a key: the rest of a causal diagonal tile is skipped) and the
            # task's live rows, in whole register tiles (a one-row sequence's task is not 64 rows)
            width: T.int64 = tile.width(cfg, key_start, BK, tiles.key_vecs * L)
            rows: T.let[T.int64] = tile.live_rows(BQ, MR)
            micro.gemm(scratch.S, scratch.Qs, Kt, rows, width, D, tiles.key_vecs)
            normalize_tile(scratch.S, scratch.m, scratch.l, scratch.alpha, params, tile, key_start, width, rows)
            micro.nan_safe_gemm(scratch.O, scratch.S, Vt, rows, DP, width, tiles.dim_vecs, values_finite,
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


def dense_forward(spec: KernelSpec, tiles: CpuTiles, *, dims: Mapping[str, int | None] | None = None,
                  tasks=None) -> tirx.PrimFunc:
    """Flash attention forward over q [B, Hq, Sq, D], k, v [B, Hkv, Sk, D]; ``dims`` fixes B, Sq, Sk
    (symbolic where absent). ``tasks(params, B, Sq, Sk, k, v)``: the kernel's body (a macro over its
    ``ForwardBuffers`` and sizes), by default the packed key tiles' below (``decode`` passes the
    streaming one): one signature for the op's CPU kernels."""
    sizes = kernel_sizes(dims)
    B, Sq, Sk = sizes.values()
    body = ForwardMacros(spec, tiles)
    Hkv, D, group = spec.num_kv_heads, spec.head_dim, spec.group
    BQ, BK, DP, L = tiles.block_q, tiles.block_k, tiles.padded_dim(D), tiles.lanes
    cfg = spec.cfg
    unused = absent_inputs(spec) | (set() if spec.return_lse else {"lse"})

    # fmt: off
    @T.macro
    def packed_tasks(params, B, Sq, Sk, k, v):
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

    run = tasks or packed_tasks

    @T.prim_func
    def fuel_flash_attn_cpu(q_h: T.handle, k_h: T.handle, v_h: T.handle, alibi_h: T.handle, mask_h: T.handle,
                            out_h: T.handle, lse_h: T.handle):
        q, k, v, alibi, mask, out, lse = kernel_params(spec, sizes, q_h, k_h, v_h, alibi_h, mask_h, out_h, lse_h)
        params = T.meta_var(ForwardBuffers.of(unused, q=q, out=out, alibi=alibi, mask=mask, lse=lse))
        run(params, B, Sq, Sk, k, v)
    # fmt: on

    return finish(drop_params(fuel_flash_attn_cpu, unused))


def head_view(buffer, index):
    """View of ``buffer[index]`` (a [heads, ...] task buffer) as its own buffer."""
    shape = list(buffer.shape[1:])
    size = 1
    for n in shape:
        size *= int(n)
    return T.decl_buffer(shape, F32, data=buffer.data, elem_offset=index * size)
