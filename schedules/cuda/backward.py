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

from dataclasses import dataclass, replace
from typing import Any, Mapping

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


@dataclass(frozen=True)
class _Params:
    """The backward kernels' buffers: the parameters (``alibi`` and ``mask`` read only where the
    spec has them, ``dq``, ``dk``, ``dv`` written only where wanted) and ``row_dot``, the D
    scratch of the first kernel."""

    q: Any
    k: Any
    v: Any
    do: Any
    alibi: Any
    mask: Any
    out: Any
    lse: Any
    row_dot: Any
    dq: Any
    dk: Any
    dv: Any


@dataclass(frozen=True)
class _Tile:
    """A query tile meeting a key tile: batch ``b``, query head ``h``, the query rows from ``i0``
    and the keys from ``j0``; ``Sq`` queries, the last of ``Sk`` keys."""

    b: Any
    h: Any
    i0: Any
    j0: Any
    Sq: Any
    Sk: Any

    @property
    def delta(self):
        return self.Sk - self.Sq  # key index of query position 0


@dataclass(frozen=True)
class _KeyBlock:
    """A dk/dv block: batch ``b``, KV head ``g``, the key tile at ``j0``; ``Sq`` queries, ``Sk`` keys."""

    b: Any
    g: Any
    j0: Any
    Sq: Any
    Sk: Any

    def tile(self, h, i0) -> _Tile:
        return _Tile(self.b, h, i0, self.j0, self.Sq, self.Sk)


@dataclass(frozen=True)
class _QueryBlock:
    """A dq block: batch ``b``, query head ``h``, the query tile at ``i0``; ``Sq`` queries, ``Sk`` keys."""

    b: Any
    h: Any
    i0: Any
    Sq: Any
    Sk: Any

    def tile(self, j0) -> _Tile:
        return _Tile(self.b, self.h, self.i0, j0, self.Sq, self.Sk)


@dataclass(frozen=True)
class _Scratch:
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

    def query_stage(self, st, block_q: int) -> _Scratch:
        """The scratch with Qs and dOs narrowed to the tiles of pipeline stage st."""
        return replace(self, Qs=Rows.stage(self.Qs, st, block_q), dOs=Rows.stage(self.dOs, st, block_q))

    def key_stage(self, st, block_k: int) -> _Scratch:
        """The scratch with Ks and Vs narrowed to the tiles of pipeline stage st."""
        return replace(self, Ks=Rows.stage(self.Ks, st, block_k), Vs=Rows.stage(self.Vs, st, block_k))


class _Body:
    """The macros of the backward blocks, specialised to a spec, tiles, launch and grads:
    ``row_dots``, ``key_block`` (dk/dv) and ``query_block`` (dq)."""

    def __init__(self, spec: KernelSpec, tiles: CudaTiles, launch: Launch, grads: tuple[str, ...]):
        self.spec, self.tiles, self.launch = spec, tiles, launch
        self.ops = TileOps(launch, spec.dtype)
        self.BQ, self.BK, self.DP, self.NT = tiles.block_q, tiles.block_k, padded_dim(spec.head_dim), launch.threads
        self.want_dk, self.want_dv = "dk" in grads, "dv" in grads
        self.pipeline = self.ops.pipeline(tiles.stages)
        self._outputs()
        self._loads()
        self._walks()
        if spec.dtype in HALF_TYPES:  # register tiles (mma.sync) on the device and in the emulation
            self._register_products()
            self.key_block, self.query_block = self._register_key_block(), self._register_query_block()
        else:
            query_step, key_step = self._simt_steps()
            self.key_block, self.query_block = self._simt_key_block(query_step), self._simt_query_block(key_step)

    # ---- the rules every block applies ----

    def probability(self, sc: _Scratch, prm: _Params, at: _Tile, score, row, key):
        """P of the tile's query row ``row`` and key ``key`` (offsets into the tiles) from the raw
        score: 0 for a dropped key, a row past Sq (lazy: the mask is not read there) or a fully
        masked row."""
        spec = self.spec
        i, j = at.i0 + row, at.j0 + key
        capped = sem.softcap(spec.cfg, score * T.float32(spec.scale))
        return T.if_then_else(i < at.Sq, T.Select(
            visible(spec, prm.mask, at.b, at.h, i, j, at.Sk, at.delta),
            sem.probability(biased(spec, capped, prm.alibi, prm.mask, at.b, at.h, i, j, at.delta), sc.lse_r[row]),
            T.float32(0)), T.float32(0))

    def score_grad(self, sc: _Scratch, p, dp, row, score):
        """dS of the tile's query row ``row`` (tvm_fuel.semantics.score_grad, from the raw score)."""
        cfg = self.spec.cfg
        return sem.score_grad(cfg, p, dp, sc.D_r[row], sem.softcap(cfg, score * T.float32(self.spec.scale)))

    def query_tiles(self, j0, Sq, Sk):
        """(first, count): the query tiles the key tile at j0 meets, per head of the group."""
        qlo, qhi = query_tile_range(self.spec.cfg, key_first=j0, key_last=T.min(j0 + self.BK, Sk) - 1,
                                    num_queries=Sq, delta=Sk - Sq, block_q=self.BQ)
        return qlo, T.max(qhi - qlo, 0)

    def acc_row(self, i, tx):  # row and column of element i * threads + tx of a [rows, DP] accumulator
        return (i * self.NT + tx) // self.DP

    def acc_col(self, i, tx):
        return (i * self.NT + tx) % self.DP

    def group_tile(self, kb: _KeyBlock, qlo, tiles, t) -> _Tile:
        """Tile t of a dk/dv block's walk: query tile qlo + t % tiles of the group's head t // tiles."""
        return kb.tile(kb.g * self.spec.group + t // tiles, (qlo + t % tiles) * self.BQ)

    def _outputs(self):
        spec, NT, DP, local = self.spec, self.NT, self.DP, self.launch.local
        D, Hq, dtype = spec.head_dim, spec.num_q_heads, spec.dtype

        def row_of(e, Sq):  # (batch, head, position) of query row e ([B, Hq, Sq] flat)
            return e // Sq // Hq, e // Sq % Hq, e % Sq

        @T.macro
        def row_dots(prm, B, Sq, bx, tx):
            # D[b, h, i] = sum_d do * out, one thread per row
            acc = T.alloc_buffer((1,), F32, scope=local)
            e = T.Cast("int64", bx) * NT + tx
            if e < B * Hq * Sq:
                acc[0] = T.float32(0)
                for d in range(D):
                    acc[0] = acc[0] + T.Cast(F32, prm.do[*row_of(e, Sq), d]) * T.Cast(F32, prm.out[*row_of(e, Sq), d])
                prm.row_dot[*row_of(e, Sq)] = acc[0]

        @T.macro
        def store_rows(out, acc, b, head, row0, rows, limit, factor, tx):
            # registers of [rows, DP] -> out[b, head, row0 + r, :D] * factor (rows past limit and the
            # padding columns are not written)
            for i in range(_ceil(rows * DP, NT)):
                if i * NT + tx < rows * DP:
                    if tirx.all(row0 + self.acc_row(i, tx) < limit, self.acc_col(i, tx) < D):
                        out[b, head, row0 + self.acc_row(i, tx), self.acc_col(i, tx)] = T.Cast(
                            dtype, acc[i] * T.float32(factor))

        self.row_dots, self.store_rows = row_dots, store_rows

    def _loads(self):
        ops, BQ, BK, DP, NT, D = self.ops, self.BQ, self.BK, self.DP, self.NT, self.spec.head_dim

        # a block streams the tiles it walks (Q and dO for dk/dv, K and V for dq) through the
        # cp.async pipeline and loads the tiles it keeps once, synchronously
        copy_queries, copy_keys = ops.copy(BQ, D, DP), ops.copy(BK, D, DP)
        stream_queries, stream_keys = ops.copy(BQ, D, DP, asynchronous=True), ops.copy(BK, D, DP, asynchronous=True)

        @T.macro
        def load_rows(Qs, dOs, prm, at, copy, tx):
            # the Q and dO rows i0 .. i0 + BQ - 1 of head h (zero past Sq and in the padding columns)
            copy(Qs, lambda r: at.i0 + r < at.Sq, lambda r, c: prm.q[at.b, at.h, at.i0 + r, c], tx)
            copy(dOs, lambda r: at.i0 + r < at.Sq, lambda r, c: prm.do[at.b, at.h, at.i0 + r, c], tx)

        @T.macro
        def load_row_stats(sc, prm, at, with_d, tx):
            # the lse and D of rows i0 .. i0 + BQ - 1 (-inf and 0 past Sq: P and dS vanish there)
            for i in range(_ceil(BQ, NT)):
                if i * NT + tx < BQ:
                    if at.i0 + i * NT + tx < at.Sq:
                        sc.lse_r[i * NT + tx] = prm.lse[at.b, at.h, at.i0 + i * NT + tx]
                        if with_d:
                            sc.D_r[i * NT + tx] = prm.row_dot[at.b, at.h, at.i0 + i * NT + tx]
                    else:
                        sc.lse_r[i * NT + tx] = T.float32(float("-inf"))
                        if with_d:
                            sc.D_r[i * NT + tx] = T.float32(0)

        @T.macro
        def load_keys(Ks, Vs, prm, b, g, j0, Sk, copy, tx):
            # the K and V rows j0 .. j0 + BK - 1 of KV head g (zero past Sk and in the padding columns)
            copy(Ks, lambda r: j0 + r < Sk, lambda r, c: prm.k[b, g, j0 + r, c], tx)
            copy(Vs, lambda r: j0 + r < Sk, lambda r, c: prm.v[b, g, j0 + r, c], tx)

        self.load_rows, self.load_row_stats, self.load_keys = load_rows, load_row_stats, load_keys
        self.copy_queries, self.copy_keys = copy_queries, copy_keys
        self.stream_queries, self.stream_keys = stream_queries, stream_keys

    def _walks(self):
        """The walks of the blocks: ``walk_group_queries`` (dk/dv) and ``walk_keys`` (dq)."""
        spec, ops, pipeline, BQ, BK, group = self.spec, self.ops, self.pipeline, self.BQ, self.BK, self.spec.group
        load_rows, load_row_stats, load_keys = self.load_rows, self.load_row_stats, self.load_keys

        @T.macro
        def stats_then(sc, prm, at, tx, compute):
            # the tile's row statistics (the stage barrier before this step guards their reuse), then compute
            load_row_stats(sc, prm, at, self.want_dk, tx)
            ops.sync()
            compute()

        @T.macro
        def walk_group_queries(sc, prm, kb, tx, compute):
            # every query tile of every head of KV head g's group that sees the key tile at j0, streamed
            # through the pipeline (see group_tile); compute(at, st) once its Q/dO stage and row
            # statistics are in
            qlo, tiles = self.query_tiles(kb.j0, kb.Sq, kb.Sk)
            pipeline(group * tiles,
                     lambda t, st: load_rows(Rows.stage(sc.Qs, st, BQ), Rows.stage(sc.dOs, st, BQ), prm,
                                             self.group_tile(kb, qlo, tiles, t), self.stream_queries, tx),
                     lambda t, st: stats_then(sc, prm, self.group_tile(kb, qlo, tiles, t), tx,
                                              lambda: compute(self.group_tile(kb, qlo, tiles, t), st)))

        @T.macro
        def walk_keys(sc, prm, qb, tx, compute):
            # the dq block: its Q and dO rows and row statistics once, then every key tile they see
            # streamed through the pipeline; compute(at, st) once the tile is in stage st
            load_rows(sc.Qs, sc.dOs, prm, qb, self.copy_queries, tx)
            load_row_stats(sc, prm, qb, True, tx)
            lo, hi = key_tile_range(spec.cfg, first_pos=qb.i0, last_pos=T.min(qb.i0 + BQ, qb.Sq) - 1, kv_len=qb.Sk,
                                    delta=qb.Sk - qb.Sq, block_k=BK)
            pipeline(T.max(hi - lo, 0),
                     lambda t, st: load_keys(Rows.stage(sc.Ks, st, BK), Rows.stage(sc.Vs, st, BK), prm, qb.b,
                                             qb.h // group, (lo + t) * BK, qb.Sk, self.stream_keys, tx),
                     lambda t, st: compute(qb.tile((lo + t) * BK), st))

        self.walk_group_queries, self.walk_keys = walk_group_queries, walk_keys

    # ---- SIMT (float32): per-element scores, P and dS through static shared memory ----

    def _simt_steps(self):
        """The SIMT steps: ``query_step(sc, prm, at, tx)`` of the dk/dv block (dV += P^T dO, dK +=
        dS^T Q) and ``key_step(sc, prm, at, tx)`` of the dq block (dQ += dS K), on the stage's tiles."""
        ops, launch, D = self.ops, self.launch, self.spec.head_dim
        BQ, BK, DP, NT, local = self.BQ, self.BK, self.DP, self.NT, launch.local
        want_dk, want_dv = self.want_dk, self.want_dv
        acc_row, acc_col = self.acc_row, self.acc_col

        def pair_row(i, tx):  # query row and key of element i * threads + tx of a [BQ, BK] tile
            return (i * NT + tx) // BK

        def pair_key(i, tx):
            return (i * NT + tx) % BK

        @T.macro
        def scores(sc, prm, at, with_p, with_ds, tx):
            # P and dS of the tile, each thread computing its elements in registers and writing them once
            s = T.alloc_buffer((1,), F32, scope=local)
            dp = T.alloc_buffer((1,), F32, scope=local)
            p = T.alloc_buffer((1,), F32, scope=local)
            for i in range(_ceil(BQ * BK, NT)):
                if i * NT + tx < BQ * BK:
                    s[0] = T.float32(0)
                    for d in range(D):
                        s[0] = s[0] + T.Cast(F32, sc.Qs[pair_row(i, tx), d]) * T.Cast(F32, sc.Ks[pair_key(i, tx), d])
                    p[0] = self.probability(sc, prm, at, s[0], pair_row(i, tx), pair_key(i, tx))
                    if with_p:
                        sc.P[pair_row(i, tx), pair_key(i, tx)] = p[0]
                    if with_ds:
                        dp[0] = T.float32(0)
                        for d in range(D):
                            dp[0] = dp[0] + T.Cast(F32, sc.dOs[pair_row(i, tx), d]) * T.Cast(
                                F32, sc.Vs[pair_key(i, tx), d])
                        sc.dS[pair_row(i, tx), pair_key(i, tx)] = self.score_grad(sc, p[0], dp[0], pair_row(i, tx),
                                                                                  s[0])

        @T.macro
        def add_key_grad(acc, A, X, tx):
            # registers of [BK, DP] += A^T X with A [BQ, BK] (P or dS) and X [BQ, DP] (dO or Q)
            for i in launch.owned(_ceil(BK * DP, NT)):
                if i * NT + tx < BK * DP:
                    for r in range(BQ):
                        acc[i] = sem.add_weighted(acc[i], A[r, acc_row(i, tx)], T.Cast(F32, X[r, acc_col(i, tx)]))

        @T.macro
        def add_query_grad(acc, dS, Ks, tx):
            # registers of [BQ, DP] += dS K with dS [BQ, BK] and K [BK, DP]
            for i in launch.owned(_ceil(BQ * DP, NT)):
                if i * NT + tx < BQ * DP:
                    for c in range(BK):
                        acc[i] = sem.add_weighted(acc[i], dS[acc_row(i, tx), c], T.Cast(F32, Ks[c, acc_col(i, tx)]))

        @T.macro
        def query_step(sc, prm, at, tx):
            scores(sc, prm, at, want_dv, want_dk, tx)
            ops.sync()
            if want_dv:
                add_key_grad(sc.dV, sc.P, sc.dOs, tx)
            if want_dk:
                add_key_grad(sc.dK, sc.dS, sc.Qs, tx)

        @T.macro
        def key_step(sc, prm, at, tx):
            scores(sc, prm, at, False, True, tx)
            ops.sync()
            add_query_grad(sc.dQ, sc.dS, sc.Ks, tx)

        return query_step, key_step

    def _simt_key_block(self, query_step):
        launch, dtype, want_dk, want_dv = self.launch, self.spec.dtype, self.want_dk, self.want_dv
        BQ, BK, DP, NT, STAGES = self.BQ, self.BK, self.DP, self.NT, self.tiles.stages
        shared, small, local = launch.shared, launch.small_shared, launch.local
        load_keys, store_rows, walk_group_queries = self.load_keys, self.store_rows, self.walk_group_queries

        @T.macro
        def key_block_simt(prm, kb, tx):
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
            # T.meta_var: the bundle stays a Python value (an assignment would make it a TIR variable)
            sc = T.meta_var(_Scratch(Qs, dOs, Ks, Vs, lse_r, D_r, dK=dK, dV=dV, P=P, dS=dS))
            for i in range(_ceil(BK * DP, NT)):
                if want_dk:
                    dK[i] = T.float32(0)
                if want_dv:
                    dV[i] = T.float32(0)
            load_keys(Ks, Vs, prm, kb.b, kb.g, kb.j0, kb.Sk, self.copy_keys, tx)
            walk_group_queries(sc, prm, kb, tx, lambda at, st: query_step(sc.query_stage(st, BQ), prm, at, tx))
            if want_dk:
                store_rows(prm.dk, dK, kb.b, kb.g, kb.j0, BK, kb.Sk, self.spec.scale, tx)
            if want_dv:
                store_rows(prm.dv, dV, kb.b, kb.g, kb.j0, BK, kb.Sk, 1.0, tx)

        return key_block_simt

    def _simt_query_block(self, key_step):
        launch, dtype, spec = self.launch, self.spec.dtype, self.spec
        BQ, BK, DP, NT, STAGES = self.BQ, self.BK, self.DP, self.NT, self.tiles.stages
        shared, small, local = launch.shared, launch.small_shared, launch.local
        store_rows, walk_keys = self.store_rows, self.walk_keys

        @T.macro
        def query_block_simt(prm, qb, tx):
            Qs = T.alloc_buffer((BQ, DP), dtype, scope=shared)
            dOs = T.alloc_buffer((BQ, DP), dtype, scope=shared)
            Ks = T.alloc_buffer((STAGES * BK, DP), dtype, scope=shared)  # STAGES tiles in flight
            Vs = T.alloc_buffer((STAGES * BK, DP), dtype, scope=shared)
            dS = T.alloc_buffer((BQ, BK), F32, scope=small)
            lse_r = T.alloc_buffer((BQ,), F32, scope=small)
            D_r = T.alloc_buffer((BQ,), F32, scope=small)
            dQ = T.alloc_buffer((_ceil(BQ * DP, NT),), F32, scope=local)
            sc = T.meta_var(_Scratch(Qs, dOs, Ks, Vs, lse_r, D_r, dQ=dQ, dS=dS))  # a Python value (see above)
            for i in range(_ceil(BQ * DP, NT)):
                dQ[i] = T.float32(0)
            walk_keys(sc, prm, qb, tx, lambda at, st: key_step(sc.key_stage(st, BK), prm, at, tx))
            store_rows(prm.dq, dQ, qb.b, qb.h, qb.i0, BQ, qb.Sq, spec.scale, tx)

        return query_block_simt

    # ---- register tiles (float16/bfloat16) ----

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
                                    out[b, head, row0 + strip_row(wi, li, tx, strips, mt, i),
                                        tile_col(li, tx, dt, i)] = T.Cast(
                                        dtype, acc[slot(wi, li, tx), (mt * DT + dt) * 4 + i] * T.float32(factor))

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
            sc = T.meta_var(_Scratch(Qs, dOs, Ks, Vs, lse_r, D_r, dK=dK, dV=dV, s=sT, dp=dpT, a=a, bb=bb, p=p,
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
            sc = T.meta_var(_Scratch(Qs, dOs, Ks, Vs, lse_r, D_r, dQ=dQ, s=s, dp=dp, a=a, bb=bb, p=p, flags=flags))
            wt.fill(dQ, MQ * DP // 2, T.float32(0), tx)
            self.walk_keys(sc, prm, qb, tx, lambda at, st: row_tile(sc, prm, at, st * BK, tx))
            store_strips(prm.dq, dQ, qb.b, qb.h, qb.i0, MQ, qb.Sq, spec.scale, tx)

        return query_block_registers


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
    Hq, Hkv = spec.num_q_heads, spec.num_kv_heads
    BQ, BK, NT = tiles.block_q, tiles.block_k, launch.threads
    want_dq, want_dk, want_dv = "dq" in grads, "dk" in grads, "dv" in grads
    want_ds = want_dq or want_dk

    @T.prim_func
    def fuel_flash_attn_backward_cuda(q_h: T.handle, k_h: T.handle, v_h: T.handle, do_h: T.handle,
                                      alibi_h: T.handle, mask_h: T.handle, out_h: T.handle, lse_h: T.handle,
                                      dq_h: T.handle, dk_h: T.handle, dv_h: T.handle):
        T.func_attr({"tirx.noalias": True})
        q, k, v, do, alibi, mask, out, lse, dq, dk, dv = param_buffers(
            spec, dict(B=B, Sq=Sq, Sk=Sk),
            q=q_h, k=k_h, v=v_h, do=do_h, alibi=alibi_h, mask=mask_h, out=out_h, lse=lse_h, dq=dq_h, dk=dk_h, dv=dv_h)
        row_dot = T.alloc_buffer((B, Hq, Sq) if want_ds else (1, 1, 1), F32)
        # T.meta_var: the bundle stays a Python value (an assignment would make it a TIR variable)
        prm = T.meta_var(_Params(q, k, v, do, alibi, mask, out, lse, row_dot, dq, dk, dv))
        # 1. D = rowsum(do * out)
        if want_ds:
            for bx in launch.grid((B * Hq * Sq + NT - 1) // NT, "x"):
                for tx in launch.block():
                    body.row_dots(prm, B, Sq, bx, tx)
        # 2. dk, dv: one block per (key tile, batch x KV head)
        if want_dk or want_dv:
            for bx in launch.grid((Sk + BK - 1) // BK, "x"):
                for by in launch.grid(B, "y"):
                    for bz in launch.grid(Hkv, "z"):
                        for tx in launch.block():
                            # #pragma unroll for nvcc instead of TVM's expansion (see forward.py)
                            with T.attr(T.int32(0), "pragma_unroll_explicit", T.int32(0)):
                                body.key_block(prm, _KeyBlock(T.Cast("int64", by), T.Cast("int64", bz),
                                                              T.Cast("int64", bx) * BK, Sq, Sk), tx)
        # 3. dq: one block per (query tile, batch x query head)
        if want_dq:
            for bx in launch.grid((Sq + BQ - 1) // BQ, "x"):
                for by in launch.grid(B, "y"):
                    for bz in launch.grid(Hq, "z"):
                        for tx in launch.block():
                            with T.attr(T.int32(0), "pragma_unroll_explicit", T.int32(0)):
                                body.query_block(prm, _QueryBlock(T.Cast("int64", by), T.Cast("int64", bz),
                                                                  T.Cast("int64", bx) * BQ, Sq, Sk), tx)

    unused = {name for name, wanted in (("dq", want_dq), ("dk", want_dk), ("dv", want_dv)) if not wanted}
    if not spec.has_alibi:
        unused.add("alibi")
    if not spec.mask_broadcast:
        unused.add("mask")
    return finish(drop_params(fuel_flash_attn_backward_cuda, unused))
