"""The tangent pass of the higher-order CPU kernels, and forward mode (``flash_attn_jvp``) built on it.

Both higher-order ops carry a tangent direction through the attention of a query tile (JVP: q_dot,
k_dot, v_dot; double backward: the cotangents dq_bar, dk_bar, dv_bar, the direction along which the
backward is differentiated, ``tvm_fuel.reference.flash_attn_double_backward``):

    S_dot = scale (q_dot k^T + q k_dot^T),  logit_dot = softcap'(capped) S_dot,
    lse_dot = rowsum(P logit_dot),  out_dot = (P logit_dot) V + P v_dot - lse_dot out

``TangentPass`` runs that over the key tiles of one query tile, either with the online softmax
(the JVP: out, lse and out_dot in one pass, the tangent's sums rescaled with the output's) or with
the forward's lse (the double backward's first stage, ``schedules.cpu.double_backward``, which also
takes D = rowsum(do out) and D_dot = rowsum(do out_dot), the row statistics of its second stage).
Key tiles stream: nothing is [Sq, Sk]; scratch per task is O((block_q + block_k) * D), and K, V
and their tangents are packed once per KV head into float32 tiles (O(Sk * D)).

Finite inputs: the GEMMs do not skip zero weights (the NaN rule is not modelled for tangents, as in
``tvm_fuel.reference``); a dropped key still weighs exactly 0.

Contents:
    TangentPass, TangentBuffers, Direction -- the pass, its tensors, the tangents present
    flash_jvp -- PrimFunc(q, k, v, [q_dot], [k_dot], [v_dot], [alibi], [mask], out, out_dot, [lse])
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping

from tvm import tirx
from tvm.script import tirx as T

from tvm_fuel.op import semantics as sem
from ..common import (F32, KernelSpec, balanced_order, drop_params, finish, key_tiles, masked_logit, kernel_params,
                      shifted_logit, kernel_sizes)
from .common import Buffers, absent_inputs
from .micro import Micro, lane_tree
from .tiles import CpuTiles

JVP_TANGENTS = ("q_dot", "k_dot", "v_dot")
COTANGENTS = ("dq_bar", "dk_bar", "dv_bar")


def _add(a, b):
    return a + b


@dataclass(frozen=True)
class TangentBuffers(Buffers):
    """The parameter buffers the macros read; the direction (``q_dot``, ``k_dot``, ``v_dot``: the JVP's
    tangents or the double backward's cotangents) is None where absent, as are ALiBi, the mask
    and ``lse`` / ``do`` / ``out`` where the kernel has none."""

    q: tirx.Buffer
    k: tirx.Buffer
    v: tirx.Buffer
    q_dot: tirx.Buffer | None = None
    k_dot: tirx.Buffer | None = None
    v_dot: tirx.Buffer | None = None
    alibi: tirx.Buffer | None = None
    mask: tirx.Buffer | None = None
    do: tirx.Buffer | None = None
    out: tirx.Buffer | None = None
    lse: tirx.Buffer | None = None


@dataclass(frozen=True)
class Direction:
    """Which parts of the direction are present (Python flags: absent terms are not emitted)."""

    q: bool
    k: bool
    v: bool

    @staticmethod
    def of(names: tuple[str, ...], present: tuple[str, ...]) -> Direction:
        return Direction(*(name in present for name in names))

    @property
    def scores(self) -> bool:
        """Whether S_dot is not identically 0."""
        return self.q or self.k


@dataclass(frozen=True)
class _Rows:
    """A row task's float32 scratch: the query tile (q, its tangent) [block_q, DP]; per row the
    softmax state (m, l, alpha, or the forward's lse), the tangent's lse_dot accumulator
    [block_q]; the output and tangent accumulators [block_q, DP]."""

    Qs: tirx.Buffer
    Qt: tirx.Buffer
    m: tirx.Buffer
    l: tirx.Buffer
    alpha: tirx.Buffer
    lse_dot: tirx.Buffer
    O: tirx.Buffer
    Ot: tirx.Buffer


@dataclass(frozen=True)
class _KeyTile:
    """One key tile, float32: K^T and its tangent [D, block_k] (score GEMMs vectorize over keys), V
    and its tangent [block_k, DP]. Packed once per KV head for every query tile's task (packing per
    task had cost the JVP ~30 %); an absent tangent's tile is a placeholder never read."""

    Kt: tirx.Buffer
    Ktt: tirx.Buffer
    Vn: tirx.Buffer
    Vtn: tirx.Buffer


@dataclass(frozen=True)
class _Scores:
    """A row task's score tiles [block_q, block_k]: S, S_dot and the capped scores."""

    S: tirx.Buffer
    St: tirx.Buffer
    Cap: tirx.Buffer


@dataclass(frozen=True)
class _RowTile:
    """The query tile of a row task: batch ``b``, query head ``h``, first position ``i0``."""

    b: tirx.PrimExpr
    h: tirx.PrimExpr
    i0: tirx.PrimExpr


class TangentPass:
    """The macros of the tangent pass over the key tiles of one query tile (module docstring).

    ``online``: the JVP's online softmax (S in log2 units, exponentials exp2); otherwise P comes
    from the forward's lse held in ``rows.m``.
    """

    def __init__(self, spec: KernelSpec, tiles: CpuTiles, direction: Direction, B, Sq, Sk, *, online: bool):
        self.spec, self.tiles, self.direction, self.online = spec, tiles, direction, online
        self.B, self.Sq, self.Sk = B, Sq, Sk
        self.micro = Micro(tiles)
        self.n_key_tiles = (Sk + tiles.block_k - 1) // tiles.block_k
        self.load_rows, self.load_keys = self._loads()
        self.weights, self.tangent_sums = self._weights()
        self.pack, self.key_tile = self._key_tiles()
        self.stage = self._stage()

    def _sizes(self):
        """(D, BQ, BK, DP): head dim, query and key tile, padded head dim."""
        tiles = self.tiles
        return self.spec.head_dim, tiles.block_q, tiles.block_k, tiles.padded_dim(self.spec.head_dim)

    def _loads(self):
        """A query tile's rows and state into scratch; a key tile (and its tangents) into packed tiles."""
        D, BQ, BK, DP = self._sizes()
        Sq, Sk, direction, online = self.Sq, self.Sk, self.direction, self.online

        @T.macro
        def load_rows(rows, params, tile):
            for r in range(BQ):
                if tile.i0 + r < Sq:
                    for d in range(D):
                        rows.Qs[r, d] = params.q[tile.b, tile.h, tile.i0 + r, d].astype(F32)
                        if direction.q:
                            rows.Qt[r, d] = params.q_dot[tile.b, tile.h, tile.i0 + r, d].astype(F32)
                    if not online:
                        rows.m[r] = params.lse[tile.b, tile.h, tile.i0 + r]
                else:
                    for d in range(D):
                        rows.Qs[r, d] = T.float32(0)
                        if direction.q:
                            rows.Qt[r, d] = T.float32(0)
                    if not online:
                        rows.m[r] = T.float32(float("-inf"))
                for d in range(D, DP):
                    rows.Qs[r, d] = T.float32(0)
                    if direction.q:
                        rows.Qt[r, d] = T.float32(0)
                if online:
                    rows.m[r] = T.float32(float("-inf"))
                    rows.l[r] = T.float32(0)
                rows.lse_dot[r] = T.float32(0)
                for d in T.vectorized(DP):
                    rows.O[r, d] = T.float32(0)
                    rows.Ot[r, d] = T.float32(0)

        @T.macro
        def load_keys(keys, params, b, g, kt):
            for c in range(BK):
                if kt * BK + c < Sk:
                    for d in range(D):
                        keys.Kt[d, c] = params.k[b, g, kt * BK + c, d].astype(F32)
                        keys.Vn[c, d] = params.v[b, g, kt * BK + c, d].astype(F32)
                        if direction.k:
                            keys.Ktt[d, c] = params.k_dot[b, g, kt * BK + c, d].astype(F32)
                        if direction.v:
                            keys.Vtn[c, d] = params.v_dot[b, g, kt * BK + c, d].astype(F32)
                else:
                    for d in range(D):
                        keys.Kt[d, c] = T.float32(0)
                        keys.Vn[c, d] = T.float32(0)
                        if direction.k:
                            keys.Ktt[d, c] = T.float32(0)
                        if direction.v:
                            keys.Vtn[c, d] = T.float32(0)
                for d in range(D, DP):
                    keys.Vn[c, d] = T.float32(0)
                    if direction.v:
                        keys.Vtn[c, d] = T.float32(0)

        return load_rows, load_keys

    def _weights(self):
        """S and S_dot of a (query tile, key tile) pair -> the softmax weights and W = P * logit_dot."""
        spec, direction, online, Sq, Sk = self.spec, self.direction, self.online, self.Sq, self.Sk
        cfg, scale, BQ, BK, L = spec.cfg, spec.scale, self.tiles.block_q, self.tiles.block_k, self.tiles.lanes
        softcapped = cfg.softcap > 0
        dead_weight = float("-inf") if online else 0.0  # a row past Sq: a logit (online) or P

        def capped(scores, r, c):
            # the softcapped scaled score, kept in Cap only where softcap' needs it
            return scores.Cap[r, c] if softcapped else scores.S[r, c] * T.float32(scale)

        @T.macro
        def weights(rows, scores, params, tile, key_start):
            # S -> the softmax weights (online: log2-unit logits, exponentiated by the online
            # softmax after; else P from lse); S_dot -> logit_dot
            for r in range(BQ):
                if tile.i0 + r < Sq:
                    for c in T.vectorized(BK):
                        if softcapped:
                            scores.Cap[r, c] = sem.softcap(cfg, scores.S[r, c] * T.float32(scale), fast=True)
                        if direction.scores:
                            scores.St[r, c] = sem.logit_tangent(cfg, capped(scores, r, c),
                                                              scores.St[r, c] * T.float32(scale))
                        if online:
                            scores.S[r, c] = masked_logit(spec, capped(scores, r, c), params.alibi, params.mask, tile.b,
                                                        tile.h, tile.i0 + r, key_start + c, Sk,
                                                        Sk - Sq) * T.float32(sem.LOG2E)
                        else:
                            scores.S[r, c] = shifted_logit(spec, capped(scores, r, c), params.alibi, params.mask,
                                                           tile.b, tile.h, tile.i0 + r, key_start + c, Sk, Sk - Sq,
                                                           rows.m[r])
                            # stored before its exp (semantics.exp_shifted says why)
                            scores.S[r, c] = sem.exp_shifted(scores.S[r, c], rows.m[r], fast=True)
                else:  # rows past Sq weigh nothing
                    for c in T.vectorized(BK):
                        scores.S[r, c] = T.float32(dead_weight)
                        if direction.scores:
                            scores.St[r, c] = T.float32(0)

        @T.macro
        def tangent_sums(rows, scores):
            # St <- W = P * logit_dot (exactly 0 where P is); lse_dot (* alpha) += rowsum(W)
            for r in range(BQ):
                part = T.alloc_buffer((L,), F32, scope="local")
                for v in T.vectorized(L):
                    part[v] = T.float32(0)
                for c0 in range(BK // L):
                    for v in T.vectorized(L):
                        scores.St[r, c0 * L + v] = sem.weighted(scores.S[r, c0 * L + v], scores.St[r, c0 * L + v])
                        part[v] = part[v] + scores.St[r, c0 * L + v]
                if online:
                    rows.lse_dot[r] = rows.lse_dot[r] * rows.alpha[r] + lane_tree(_add, part, L)
                else:
                    rows.lse_dot[r] = rows.lse_dot[r] + lane_tree(_add, part, L)

        return weights, tangent_sums

    def _key_tiles(self):
        """Packing one key tile, and the pass of a query tile over one packed key tile."""
        D, BQ, BK, DP = self._sizes()
        KV, DV = self.tiles.key_vecs, self.tiles.dim_vecs
        group, Hkv, n_key_tiles = self.spec.group, self.spec.num_kv_heads, self.n_key_tiles
        micro, direction, online = self.micro, self.direction, self.online
        load_keys, weights, tangent_sums = self.load_keys, self.weights, self.tangent_sums

        def tile_offset(b, g, kt, size: int):
            # element offset of packed tile (b, g, kt)
            return ((b * Hkv + g) * n_key_tiles + kt) * size

        def data(packed, name: str, present: bool = True):
            # the packed buffer's data; an absent tangent's view aliases its primal's (never read)
            return getattr(packed, name if present else {"Ktt": "Kt", "Vtn": "Vn"}[name]).data

        @T.macro
        def pack(packed, params, index):
            # key tile ``index`` (of B x Hkv x key tiles) into the packed buffers
            b = T.meta_var(index // (Hkv * n_key_tiles))
            g = T.meta_var(index // n_key_tiles % Hkv)
            kt = T.meta_var(index % n_key_tiles)
            Kt = T.decl_buffer((D, BK), F32, data=data(packed, "Kt"), elem_offset=tile_offset(b, g, kt, D * BK))
            Ktt = T.decl_buffer((D, BK), F32, data=data(packed, "Ktt", direction.k),
                                elem_offset=tile_offset(b, g, kt, D * BK))
            Vn = T.decl_buffer((BK, DP), F32, data=data(packed, "Vn"), elem_offset=tile_offset(b, g, kt, BK * DP))
            Vtn = T.decl_buffer((BK, DP), F32, data=data(packed, "Vtn", direction.v),
                                elem_offset=tile_offset(b, g, kt, BK * DP))
            keys = T.meta_var(_KeyTile(Kt, Ktt, Vn, Vtn))
            load_keys(keys, params, b, g, kt)

        @T.macro
        def key_tile(rows, scores, packed, params, tile, kt):
            g = T.meta_var(sem.kv_head(tile.h, group))
            Kt = T.decl_buffer((D, BK), F32, data=data(packed, "Kt"), elem_offset=tile_offset(tile.b, g, kt, D * BK))
            Ktt = T.decl_buffer((D, BK), F32, data=data(packed, "Ktt", direction.k),
                                elem_offset=tile_offset(tile.b, g, kt, D * BK))
            Vn = T.decl_buffer((BK, DP), F32, data=data(packed, "Vn"),
                               elem_offset=tile_offset(tile.b, g, kt, BK * DP))
            Vtn = T.decl_buffer((BK, DP), F32, data=data(packed, "Vtn", direction.v),
                                elem_offset=tile_offset(tile.b, g, kt, BK * DP))
            micro.gemm(scores.S, rows.Qs, Kt, BQ, BK, D, KV)
            if direction.q:
                micro.gemm(scores.St, rows.Qt, Kt, BQ, BK, D, KV)
            if direction.k:
                micro.gemm(scores.St, rows.Qs, Ktt, BQ, BK, D, KV, accumulate=direction.q)
            weights(rows, scores, params, tile, kt * BK)
            if online:
                micro.online_softmax(scores.S, rows.m, rows.l, rows.alpha, BQ, BK)
                micro.gemm(rows.O, scores.S, Vn, BQ, DP, BK, DV, accumulate=True, row_scale=rows.alpha)
            if direction.scores:
                tangent_sums(rows, scores)
                if online:
                    micro.gemm(rows.Ot, scores.St, Vn, BQ, DP, BK, DV, accumulate=True, row_scale=rows.alpha)
                else:
                    micro.gemm(rows.Ot, scores.St, Vn, BQ, DP, BK, DV, accumulate=True)
            elif online:  # no score tangent: the accumulator still follows the running max
                micro.scale_rows(rows.Ot, rows.alpha, BQ, DP)
            if direction.v:
                micro.gemm(rows.Ot, scores.S, Vtn, BQ, DP, BK, DV, accumulate=True)

        return pack, key_tile

    def _stage(self):
        """The whole pass: K, V and their tangents packed once, then a task per query tile."""
        D, BQ, BK, DP = self._sizes()
        spec, direction, B, Sq, Sk = self.spec, self.direction, self.B, self.Sq, self.Sk
        cfg, Hkv, n_key_tiles = spec.cfg, spec.num_kv_heads, self.n_key_tiles
        load_rows, pack, key_tile = self.load_rows, self.pack, self.key_tile

        @T.macro
        def run(rows, scores, packed, params, tile):
            load_rows(rows, params, tile)
            walk = T.meta_var(key_tiles(cfg, first_pos=tile.i0, last_pos=T.min(tile.i0 + BQ, Sq) - 1, kv_len=Sk,
                                        delta=Sk - Sq, block_k=BK))
            for t in range(walk.count):
                kt: T.int64 = walk.tile(t)
                key_tile(rows, scores, packed, params, tile, kt)

        @T.macro
        def task(Qs, Qt, packed, params, tile, stores, outputs):
            # one row task: its scratch (the query tile Qs, Qt comes from the kernel), the pass over
            # the key tiles, then ``stores(rows, tile, outputs)``: the kernel's stores
            m = T.alloc_buffer((BQ,), F32)
            l = T.alloc_buffer((BQ,), F32)
            alpha = T.alloc_buffer((BQ,), F32)
            lse_dot = T.alloc_buffer((BQ,), F32)
            O = T.alloc_buffer((BQ, DP), F32)
            Ot = T.alloc_buffer((BQ, DP), F32)
            S = T.alloc_buffer((BQ, BK), F32)
            St = T.alloc_buffer((BQ, BK), F32)
            Cap = T.alloc_buffer((BQ, BK), F32)
            rows = T.meta_var(_Rows(Qs, Qt, m, l, alpha, lse_dot, O, Ot))
            scores = T.meta_var(_Scores(S, St, Cap))
            run(rows, scores, packed, params, tile)
            stores(rows, tile, outputs)

        # the packed buffers: K^T, K_dot^T, V, V_dot [B, Hkv, key tiles, tile]; (1,) for an absent
        # tangent (its views alias the primal's)
        tiles_of = (B, Hkv, n_key_tiles)
        packed_shapes = [(*tiles_of, D, BK), (*tiles_of, D, BK) if direction.k else (1,),
                         (*tiles_of, BK, DP), (*tiles_of, BK, DP) if direction.v else (1,)]
        Hq = spec.num_q_heads
        n_query_tiles = (Sq + BQ - 1) // BQ

        @T.macro
        def stage(params, stores, outputs):
            # K, V and their tangents packed once; then a task per (batch, query head, query tile)
            packed_kt = T.alloc_buffer(packed_shapes[0], F32)
            packed_ktt = T.alloc_buffer(packed_shapes[1], F32)
            packed_vn = T.alloc_buffer(packed_shapes[2], F32)
            packed_vtn = T.alloc_buffer(packed_shapes[3], F32)
            packed = T.meta_var(_KeyTile(packed_kt, packed_ktt, packed_vn, packed_vtn))
            for index in T.parallel(B * Hkv * n_key_tiles):
                pack(packed, params, index)
            for row_task in T.parallel(B * Hq * n_query_tiles):
                # bound once: inlined into every index, these divisions had made compiling 7x slower
                b: T.int64 = row_task // (Hq * n_query_tiles)
                h: T.int64 = row_task // n_query_tiles % Hq
                i0: T.int64 = balanced_order(row_task % n_query_tiles, n_query_tiles) * BQ
                Qs = T.alloc_buffer((BQ, DP), F32)
                Qt = T.alloc_buffer((BQ, DP), F32)
                tile = T.meta_var(_RowTile(b, h, i0))
                task(Qs, Qt, packed, params, tile, stores, outputs)

        return stage


def flash_jvp(spec: KernelSpec, tiles: CpuTiles, *, tangents: tuple[str, ...],
              dims: Mapping[str, int | None] | None = None) -> tirx.PrimFunc:
    """The JVP kernel along the present ``tangents`` (of q_dot, k_dot, v_dot): out, out_dot (and lse
    with ``spec.return_lse``) in one online-softmax pass per (batch, query head, query tile)."""
    sizes = kernel_sizes(dims)
    B, Sq, Sk = sizes.values()
    direction = Direction.of(JVP_TANGENTS, tangents)
    tangent_pass = TangentPass(spec, tiles, direction, B, Sq, Sk, online=True)
    dtype, D, BQ = spec.dtype, spec.head_dim, tiles.block_q
    unused = absent_inputs(spec) | {t for t in JVP_TANGENTS if t not in tangents} | (
        set() if spec.return_lse else {"lse"})

    @T.macro
    def store(rows, tile, outputs):
        # out = O / l, out_dot = Ot / l - lse_dot out (lse_dot = its sum / l), lse; 0 on empty rows
        for r in range(BQ):
            if tile.i0 + r < Sq:
                lse_dot: T.float32 = sem.normalize(rows.lse_dot[r], rows.l[r])
                for d in range(D):
                    o: T.float32 = sem.normalize(rows.O[r, d], rows.l[r])
                    outputs.out[tile.b, tile.h, tile.i0 + r, d] = o.astype(dtype)
                    outputs.out_dot[tile.b, tile.h, tile.i0 + r, d] = (
                        sem.normalize(rows.Ot[r, d], rows.l[r]) - lse_dot * o).astype(dtype)
                if spec.return_lse:
                    outputs.lse[tile.b, tile.h, tile.i0 + r] = sem.log_sum_exp(
                        sem.safe_row_max(rows.m[r]) * T.float32(sem.LN2), rows.l[r])

    # fmt: off
    @T.prim_func
    def fuel_flash_attn_jvp_cpu(q_h: T.handle, k_h: T.handle, v_h: T.handle, q_dot_h: T.handle, k_dot_h: T.handle,
                                v_dot_h: T.handle, alibi_h: T.handle, mask_h: T.handle, out_h: T.handle,
                                out_dot_h: T.handle, lse_h: T.handle):
        q, k, v, q_dot, k_dot, v_dot, alibi, mask, out, out_dot, lse = kernel_params(
            spec, sizes, q_h, k_h, v_h, q_dot_h, k_dot_h, v_dot_h, alibi_h, mask_h, out_h, out_dot_h, lse_h)
        params = T.meta_var(TangentBuffers.of(unused, q=q, k=k, v=v, q_dot=q_dot, k_dot=k_dot, v_dot=v_dot, alibi=alibi,
                                       mask=mask))
        outputs = T.meta_var(_JvpOutputs(out, out_dot, lse))
        tangent_pass.stage(params, store, outputs)
    # fmt: on

    return finish(drop_params(fuel_flash_attn_jvp_cpu, unused))


@dataclass(frozen=True)
class _JvpOutputs:
    """The JVP kernel's outputs: out, out_dot [B, Hq, Sq, D]; lse [B, Hq, Sq] (None without it)."""

    out: tirx.Buffer
    out_dot: tirx.Buffer
    lse: tirx.Buffer | None


