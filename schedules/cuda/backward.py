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

from dataclasses import dataclass
from typing import Any, Mapping

from tvm import tirx
from tvm.script import tirx as T

from tvm_fuel.op import semantics as sem
from ..common import (KernelSpec, ceil_div, drop_params, finish, key_tiles, kernel_params, probability,
                      query_tile_range, kernel_sizes)
from .backward_registers import RegisterTiles, Scratch
from .device import F32, HALF_TYPES, Launch, Rows, TileOps, padded_dim
from .tiles import CudaTiles


@dataclass(frozen=True)
class BackwardBuffers:
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
class KeyBlock:
    """A dk/dv block: batch ``b``, KV head ``g``, the key tile at ``j0``; ``Sq`` queries, ``Sk`` keys."""

    b: Any
    g: Any
    j0: Any
    Sq: Any
    Sk: Any

    def tile(self, h, i0) -> _Tile:
        return _Tile(self.b, h, i0, self.j0, self.Sq, self.Sk)


@dataclass(frozen=True)
class QueryBlock:
    """A dq block: batch ``b``, query head ``h``, the query tile at ``i0``; ``Sq`` queries, ``Sk`` keys."""

    b: Any
    h: Any
    i0: Any
    Sq: Any
    Sk: Any

    def tile(self, j0) -> _Tile:
        return _Tile(self.b, self.h, self.i0, j0, self.Sq, self.Sk)


class BackwardMacros(RegisterTiles):
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

    def probability(self, sc: Scratch, prm: BackwardBuffers, at: _Tile, score, row, key):
        """P of the tile's query row ``row`` and key ``key`` (offsets into the tiles) from the raw
        score: 0 for a dropped key, a row past Sq (lazy: the mask is not read there) or a fully
        masked row."""
        spec = self.spec
        i, j = at.i0 + row, at.j0 + key
        capped = sem.softcap(spec.cfg, score * T.float32(spec.scale))
        return T.if_then_else(i < at.Sq, probability(spec, capped, prm.alibi, prm.mask, at.b, at.h, i, j, at.Sk,
                                                     at.delta, sc.lse_r[row]), T.float32(0))

    def score_grad(self, sc: Scratch, p, dp, row, score):
        """dS of the tile's query row ``row`` (tvm_fuel.op.semantics.score_grad, from the raw score)."""
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

    def group_tile(self, kb: KeyBlock, qlo, tiles, t) -> _Tile:
        """Tile t of a dk/dv block's walk: query tile qlo + t % tiles of the group's head t // tiles."""
        return kb.tile(kb.g * self.spec.group + t // tiles, (qlo + t % tiles) * self.BQ)

    def _outputs(self):
        spec, NT, DP, local = self.spec, self.NT, self.DP, self.launch.local
        D, dtype = spec.head_dim, spec.dtype

        @T.macro
        def row_dots(prm, rows, index_of, bx, tx):
            # D[row] = sum_d do * out, one thread per row e < rows (index_of(e): its index into do,
            # out without the head dim, and into row_dot)
            acc = T.alloc_buffer((1,), F32, scope=local)
            e = T.Cast("int64", bx) * NT + tx
            if e < rows:
                acc[0] = T.float32(0)
                for d in range(D):
                    acc[0] = acc[0] + T.Cast(F32, prm.do[*index_of(e), d]) * T.Cast(F32, prm.out[*index_of(e), d])
                prm.row_dot[*index_of(e)] = acc[0]

        @T.macro
        def store_rows(out, acc, b, head, row0, rows, limit, factor, tx):
            # registers of [rows, DP] -> out[b, head, row0 + r, :D] * factor (rows past limit and the
            # padding columns are not written)
            for i in range(ceil_div(rows * DP, NT)):
                if i * NT + tx < rows * DP:
                    if tirx.all(row0 + self.acc_row(i, tx) < limit, self.acc_col(i, tx) < D):
                        # vstore: out may be a packed tensor's view (varlen.PackedRows)
                        out.vstore([b, head, row0 + self.acc_row(i, tx), self.acc_col(i, tx)],
                                   T.Cast(dtype, acc[i] * T.float32(factor)))

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
            for i in range(ceil_div(BQ, NT)):
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
            walk = T.meta_var(key_tiles(spec.cfg, first_pos=qb.i0, last_pos=T.min(qb.i0 + BQ, qb.Sq) - 1,
                                        kv_len=qb.Sk, delta=qb.Sk - qb.Sq, block_k=BK))
            lo: T.int64 = walk.lo
            sinks: T.int64 = walk.sinks
            tile = T.meta_var(walk.bound(sinks, lo))
            pipeline(T.max(walk.count, 0),
                     lambda t, st: load_keys(Rows.stage(sc.Ks, st, BK), Rows.stage(sc.Vs, st, BK), prm, qb.b,
                                             qb.h // group, tile(t) * BK, qb.Sk, self.stream_keys, tx),
                     lambda t, st: compute(qb.tile(tile(t) * BK), st))

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
            for i in range(ceil_div(BQ * BK, NT)):
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
            for i in launch.owned(ceil_div(BK * DP, NT)):
                if i * NT + tx < BK * DP:
                    for r in range(BQ):
                        acc[i] = sem.add_weighted(acc[i], A[r, acc_row(i, tx)], T.Cast(F32, X[r, acc_col(i, tx)]))

        @T.macro
        def add_query_grad(acc, dS, Ks, tx):
            # registers of [BQ, DP] += dS K with dS [BQ, BK] and K [BK, DP]
            for i in launch.owned(ceil_div(BQ * DP, NT)):
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
            dK = T.alloc_buffer((ceil_div(BK * DP, NT),) if want_dk else (1,), F32, scope=local)
            dV = T.alloc_buffer((ceil_div(BK * DP, NT),) if want_dv else (1,), F32, scope=local)
            # T.meta_var: the bundle stays a Python value (an assignment would make it a TIR variable)
            sc = T.meta_var(Scratch(Qs, dOs, Ks, Vs, lse_r, D_r, dK=dK, dV=dV, P=P, dS=dS))
            for i in range(ceil_div(BK * DP, NT)):
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
            dQ = T.alloc_buffer((ceil_div(BQ * DP, NT),), F32, scope=local)
            sc = T.meta_var(Scratch(Qs, dOs, Ks, Vs, lse_r, D_r, dQ=dQ, dS=dS))  # a Python value (see above)
            for i in range(ceil_div(BQ * DP, NT)):
                dQ[i] = T.float32(0)
            walk_keys(sc, prm, qb, tx, lambda at, st: key_step(sc.key_stage(st, BK), prm, at, tx))
            store_rows(prm.dq, dQ, qb.b, qb.h, qb.i0, BQ, qb.Sq, spec.scale, tx)

        return query_block_simt

    # ---- register tiles (float16/bfloat16) ----


def flash_backward(spec: KernelSpec, tiles: CudaTiles, *, grads: tuple[str, ...], launch: Launch | None = None,
                   dims: Mapping[str, int | None] | None = None) -> tirx.PrimFunc:
    """The backward kernels producing ``grads`` (a subset of dq, dk, dv, in that order) over
    q, do [B, Hq, Sq, D] and k, v [B, Hkv, Sk, D]; ``launch`` defaults to ``tiles.threads``
    threads per block; ``dims`` fixes B, Sq, Sk (symbolic where absent)."""
    if not grads or any(g not in ("dq", "dk", "dv") for g in grads):
        raise ValueError(f"flash_backward: grads must be a non-empty subset of dq, dk, dv, got {grads!r}")
    launch = launch or Launch(tiles.threads)
    sizes = kernel_sizes(dims)
    B, Sq, Sk = sizes.values()
    body = BackwardMacros(spec, tiles, launch, grads)
    Hq, Hkv = spec.num_q_heads, spec.num_kv_heads
    BQ, BK, NT = tiles.block_q, tiles.block_k, launch.threads
    want_dq, want_dk, want_dv = "dq" in grads, "dk" in grads, "dv" in grads
    want_ds = want_dq or want_dk

    @T.macro
    def tile_blocks(prm, length, tile, heads, block_of, block_body):
        # one thread block per (tile of `length`, batch, head): `block_body` over `block_of` its
        # coordinates; the dk/dv and the dq kernels launch alike
        for bx in launch.grid((length + tile - 1) // tile, "x"):
            for by in launch.grid(B, "y"):
                for bz in launch.grid(heads, "z"):
                    for tx in launch.block():
                        # #pragma unroll for nvcc instead of TVM's expansion (see forward.py)
                        with T.attr(T.int32(0), "pragma_unroll_explicit", T.int32(0)):
                            block_body(prm, block_of(T.Cast("int64", by), T.Cast("int64", bz),
                                                     T.Cast("int64", bx) * tile, Sq, Sk), tx)

    @T.prim_func
    def fuel_flash_attn_backward_cuda(q_h: T.handle, k_h: T.handle, v_h: T.handle, do_h: T.handle,
                                      alibi_h: T.handle, mask_h: T.handle, out_h: T.handle, lse_h: T.handle,
                                      dq_h: T.handle, dk_h: T.handle, dv_h: T.handle):
        q, k, v, do, alibi, mask, out, lse, dq, dk, dv = kernel_params(
            spec, sizes, q_h, k_h, v_h, do_h, alibi_h, mask_h, out_h, lse_h, dq_h, dk_h, dv_h)
        row_dot = T.alloc_buffer((B, Hq, Sq) if want_ds else (1, 1, 1), F32)
        # T.meta_var: the bundle stays a Python value (an assignment would make it a TIR variable)
        prm = T.meta_var(BackwardBuffers(q, k, v, do, alibi, mask, out, lse, row_dot, dq, dk, dv))
        # 1. D = rowsum(do * out)
        if want_ds:
            for bx in launch.grid((B * Hq * Sq + NT - 1) // NT, "x"):
                for tx in launch.block():
                    body.row_dots(prm, B * Hq * Sq, lambda e: (e // Sq // Hq, e // Sq % Hq, e % Sq), bx, tx)
        # 2. dk, dv: one block per (key tile, batch x KV head)
        if want_dk or want_dv:
            tile_blocks(prm, Sk, BK, Hkv, KeyBlock, body.key_block)
        # 3. dq: one block per (query tile, batch x query head)
        if want_dq:
            tile_blocks(prm, Sq, BQ, Hq, QueryBlock, body.query_block)

    unused = {name for name, wanted in (("dq", want_dq), ("dk", want_dk), ("dv", want_dv)) if not wanted}
    if not spec.has_alibi:
        unused.add("alibi")
    if not spec.mask_broadcast:
        unused.add("mask")
    return finish(drop_params(fuel_flash_attn_backward_cuda, unused))
