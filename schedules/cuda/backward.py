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

On tensor cores (float16/bfloat16) the five GEMMs are WMMA tile GEMMs through shared memory:
S = Q K^T and dP = dO V^T (float32, dynamic shared), P and dS written in the input dtype to
static shared memory, and P^T dO, dS^T Q, dS K (float32, dynamic shared) added into the
registers. On the SIMT path (float32, and the llvm emulation) S and dP are computed per element
straight from the tiles and P^T dO, dS^T Q, dS K are accumulated straight into the registers, so
no float32 product tile is staged at all.

The tiles a block walks stream through a ``stages``-deep ``cp.async`` pipeline: Q and dO in the
dk/dv kernel (every query tile of every head of the group), K and V in the dq kernel.

Shared memory per block (e = bytes of the input dtype, DP = head dim padded to 16, ST = stages;
``tiles.backward_smem`` bounds both kernels):
    tensor cores  static  2 * e * BQ * BK + 8 * BQ               (P, dS, lse and D rows)
                  dynamic e * (2 * BQ * ST + 2 * BK) * DP (dk/dv; dq: 2 * BQ + 2 * BK * ST)
                          + 8 * BQ * BK + 4 * max(BQ, BK) * DP   (S, dP; one float32 product tile)
    SIMT          static  2 * e * BQ * BK + 8 * BQ,  dynamic the same tiles without S, dP, product
(the dq kernel needs no P and only a [BQ, DP] product tile: at most the above). No buffer grows
with Sq * Sk; positions past a sequence are never written.

Contents:
    flash_backward -- PrimFunc(q, k, v, do, [alibi_slopes], [attn_mask], out, lse, [dq], [dk], [dv])
"""

from __future__ import annotations

from typing import Mapping

from tvm import tirx
from tvm.script import tirx as T

from ... import semantics as sem
from ..common import (biased, drop_params, finish, KernelSpec, key_tile_range, param_buffers, query_tile_range,
                      shape_vars, visible)
from .device import F32, Launch, Rows, TileOps, padded_dim
from .tiles import CudaTiles


def _ceil(a: int, b: int) -> int:
    return -(-a // b)


class _Body:
    """The macros of the backward blocks, specialised to a spec, tiles, launch and grads."""

    def __init__(self, spec: KernelSpec, tiles: CudaTiles, launch: Launch, grads: tuple[str, ...]):
        ops = TileOps(launch, spec.dtype)
        cfg, dtype, group, D = spec.cfg, spec.dtype, spec.group, spec.head_dim
        BQ, BK, DP, NT, STAGES = tiles.block_q, tiles.block_k, padded_dim(D), launch.threads, tiles.stages
        scale = spec.scale
        local, shared, small = launch.local, launch.shared, launch.small_shared
        tc = ops.tensor_cores
        PAD = ops.pad
        want_dk, want_dv = "dk" in grads, "dv" in grads
        capped = cfg.softcap > 0
        if tc:
            qk = ops.gemm(BQ, BK, DP, b_trans=True)  # S = Q K^T and dP = dO V^T
            key_grad = ops.gemm(BK, DP, BQ, a_trans=True)  # P^T dO and dS^T Q
            query_grad = ops.gemm(BQ, DP, BK)  # dS K
        self.ops = ops

        @T.macro
        def row_dots(do, out, row_dot, rows, Hq, Sq, bx, tx):
            # D[b, h, i] = sum_d do * out, one thread per row
            acc = T.alloc_buffer((1,), F32, scope=local)
            e = T.Cast("int64", bx) * NT + tx
            if e < rows:
                acc[0] = T.float32(0)
                for d in range(D):
                    acc[0] = acc[0] + T.Cast(F32, do[e // Sq // Hq, e // Sq % Hq, e % Sq, d]) * T.Cast(F32, out[e // Sq // Hq, e // Sq % Hq, e % Sq, d])
                row_dot[e // Sq // Hq, e // Sq % Hq, e % Sq] = acc[0]

        # a block streams the tiles it walks (Q and dO for dk/dv, K and V for dq) through a
        # STAGES-deep cp.async pipeline and loads the tiles it keeps once, synchronously
        copy_queries, copy_keys = ops.copy(BQ, D, DP), ops.copy(BK, D, DP)
        stream_queries, stream_keys = ops.copy(BQ, D, DP, asynchronous=True), ops.copy(BK, D, DP, asynchronous=True)
        wait_for_tile = ops.wait(STAGES - 1)


        @T.macro
        def load_rows(Qs, dOs, q, do, b, h, i0, Sq, copy, tx):
            # the Q and dO rows i0 .. i0 + BQ - 1 of head h (zero past Sq and in the padding columns)
            copy(Qs, lambda r: i0 + r < Sq, lambda r, c: q[b, h, i0 + r, c], tx)
            copy(dOs, lambda r: i0 + r < Sq, lambda r, c: do[b, h, i0 + r, c], tx)

        @T.macro
        def load_row_stats(lse_r, D_r, lse, row_dot, b, h, i0, Sq, with_d, tx):
            # the lse and D of rows i0 .. i0 + BQ - 1 (-inf and 0 past Sq: P and dS vanish there)
            for i in range(_ceil(BQ, NT)):
                if i * NT + tx < BQ:
                    if i0 + i * NT + tx < Sq:
                        lse_r[i * NT + tx] = lse[b, h, i0 + i * NT + tx]
                        if with_d:
                            D_r[i * NT + tx] = row_dot[b, h, i0 + i * NT + tx]
                    else:
                        lse_r[i * NT + tx] = T.float32(float("-inf"))
                        if with_d:
                            D_r[i * NT + tx] = T.float32(0)

        @T.macro
        def load_keys(Ks, Vs, k, v, b, g, j0, Sk, copy, tx):
            # the K and V rows j0 .. j0 + BK - 1 of KV head g (zero past Sk and in the padding columns)
            copy(Ks, lambda r: j0 + r < Sk, lambda r, c: k[b, g, j0 + r, c], tx)
            copy(Vs, lambda r: j0 + r < Sk, lambda r, c: v[b, g, j0 + r, c], tx)

        @T.macro
        def tile_dot(out, product, A, B, r, c):
            # out[0] = A[r] . B[c]: the tensor cores' product tile, or the SIMT dot product
            if tc:
                out[0] = product[r, c]
            else:
                out[0] = T.float32(0)
                for d in range(D):
                    out[0] = out[0] + T.Cast(F32, A[r, d]) * T.Cast(F32, B[c, d])

        @T.macro
        def scores(P, dS, S, dP, Qs, dOs, Ks, Vs, lse_r, D_r, alibi, mask, b, h, i0, j0, Sq, Sk, with_p, with_ds, tx):
            # P = exp(logit - lse) (0 where the key is dropped) and dS = P * (dP - D) * softcap',
            # both in the input dtype; each thread computes its elements in registers and writes
            # them once (never read back in the same pass: no in-place shared update).
            s = T.alloc_buffer((1,), F32, scope=local)
            dp = T.alloc_buffer((1,), F32, scope=local)
            cap = T.alloc_buffer((1,), F32, scope=local)
            p = T.alloc_buffer((1,), F32, scope=local)
            for i in range(_ceil(BQ * BK, NT)):
                if i * NT + tx < BQ * BK:
                    if i0 + (i * NT + tx) // BK < Sq:
                        tile_dot(s, S, Qs, Ks, (i * NT + tx) // BK, (i * NT + tx) % BK)
                        cap[0] = sem.softcap(cfg, s[0] * T.float32(scale))
                        p[0] = T.Select(
                            visible(spec, mask, b, h, i0 + (i * NT + tx) // BK, j0 + (i * NT + tx) % BK, Sk, Sk - Sq),
                            sem.probability(biased(spec, cap[0], alibi, mask, b, h, i0 + (i * NT + tx) // BK,
                                                   j0 + (i * NT + tx) % BK, Sk - Sq), lse_r[(i * NT + tx) // BK]),
                            T.float32(0))
                        if with_p:
                            P[(i * NT + tx) // BK, (i * NT + tx) % BK] = T.Cast(dtype, p[0])
                        if with_ds:
                            tile_dot(dp, dP, dOs, Vs, (i * NT + tx) // BK, (i * NT + tx) % BK)
                            if capped:
                                dS[(i * NT + tx) // BK, (i * NT + tx) % BK] = T.Cast(dtype, p[0] * (dp[0] - D_r[(i * NT + tx) // BK]) * sem.softcap_grad(cfg, cap[0]))
                            else:
                                dS[(i * NT + tx) // BK, (i * NT + tx) % BK] = T.Cast(dtype, p[0] * (dp[0] - D_r[(i * NT + tx) // BK]))
                    else:
                        if with_p:
                            P[(i * NT + tx) // BK, (i * NT + tx) % BK] = T.Cast(dtype, 0)
                        if with_ds:
                            dS[(i * NT + tx) // BK, (i * NT + tx) % BK] = T.Cast(dtype, 0)

        @T.macro
        def add_product(acc, G, rows, tx):
            # registers += the float32 product tile G [rows, DP] (tensor-core path)
            for i in range(_ceil(rows * DP, NT)):
                if i * NT + tx < rows * DP:
                    acc[i] = acc[i] + G[(i * NT + tx) // DP, (i * NT + tx) % DP]

        @T.macro
        def add_key_grad(acc, A, X, tx):
            # SIMT: registers of [BK, DP] += A^T X with A [BQ, BK] (P or dS) and X [BQ, DP] (dO or Q)
            for i in launch.owned(_ceil(BK * DP, NT)):
                if i * NT + tx < BK * DP:
                    for r in range(BQ):
                        acc[i] = acc[i] + T.Cast(F32, A[r, (i * NT + tx) // DP]) * T.Cast(F32, X[r, (i * NT + tx) % DP])

        @T.macro
        def add_query_grad(acc, dS, Ks, tx):
            # SIMT: registers of [BQ, DP] += dS K with dS [BQ, BK] and K [BK, DP]
            for i in launch.owned(_ceil(BQ * DP, NT)):
                if i * NT + tx < BQ * DP:
                    for c in range(BK):
                        acc[i] = acc[i] + T.Cast(F32, dS[(i * NT + tx) // DP, c]) * T.Cast(F32, Ks[c, (i * NT + tx) % DP])

        @T.macro
        def store_rows(out, acc, b, head, row0, rows, limit, factor, tx):
            # registers of [rows, DP] -> out[b, head, row0 + r, :D] * factor (rows past limit and the
            # padding columns are not written)
            for i in range(_ceil(rows * DP, NT)):
                if i * NT + tx < rows * DP:
                    if tirx.all(row0 + (i * NT + tx) // DP < limit, (i * NT + tx) % DP < D):
                        out[b, head, row0 + (i * NT + tx) // DP, (i * NT + tx) % DP] = T.Cast(
                            dtype, acc[i] * T.float32(factor))

        @T.macro
        def key_block(q, k, v, do, alibi, mask, lse, row_dot, dk, dv, b, g, j0, Sq, Sk, tx):
            Ks = T.alloc_buffer((BK, DP + PAD), dtype, scope=shared)
            Vs = T.alloc_buffer((BK, DP + PAD), dtype, scope=shared)
            Qs = T.alloc_buffer((STAGES * BQ, DP + PAD), dtype, scope=shared)  # STAGES tiles in flight
            dOs = T.alloc_buffer((STAGES * BQ, DP + PAD), dtype, scope=shared)
            # WMMA outputs (dynamic: the stores go through address_of)
            S = T.alloc_buffer((BQ, BK) if tc else (1, 1), F32, scope=shared)
            dP = T.alloc_buffer((BQ, BK) if tc and want_dk else (1, 1), F32, scope=shared)
            G = T.alloc_buffer((BK, DP) if tc else (1, 1), F32, scope=shared)
            # written by the element pass that reads S and dP: static shared (told apart by the
            # sync planner)
            P = T.alloc_buffer((BQ, BK + PAD) if want_dv else (1, 1), dtype, scope=small)
            dS = T.alloc_buffer((BQ, BK + PAD) if want_dk else (1, 1), dtype, scope=small)
            lse_r = T.alloc_buffer((BQ,), F32, scope=small)
            D_r = T.alloc_buffer((BQ,) if want_dk else (1,), F32, scope=small)
            dK = T.alloc_buffer((_ceil(BK * DP, NT),) if want_dk else (1,), F32, scope=local)
            dV = T.alloc_buffer((_ceil(BK * DP, NT),) if want_dv else (1,), F32, scope=local)
            for i in range(_ceil(BK * DP, NT)):
                if want_dk:
                    dK[i] = T.float32(0)
                if want_dv:
                    dV[i] = T.float32(0)
            load_keys(Ks, Vs, k, v, b, g, j0, Sk, copy_keys, tx)
            qlo, qhi = query_tile_range(cfg, key_first=j0, key_last=T.min(j0 + BK, Sk) - 1, num_queries=Sq,
                                        delta=Sk - Sq, block_q=BQ)
            # the query tiles this key tile meets, over every head of the group: tile t is query tile
            # qlo + t % tiles of head g * group + t // tiles; streamed STAGES - 1 ahead, one group each
            tiles = T.max(qhi - qlo, 0)
            for t in range(STAGES - 1):
                if t < group * tiles:
                    load_rows(Rows.stage(Qs, t, BQ), Rows.stage(dOs, t, BQ), q, do, b, g * group + t // tiles,
                              (qlo + t % tiles) * BQ, Sq, stream_queries, tx)
                ops.commit()
            for t in range(group * tiles):
                ops.sync()  # the previous tile's readers are done with its stage, P, dS, G and the row stats
                if t + STAGES - 1 < group * tiles:
                    load_rows(Rows.stage(Qs, (t + STAGES - 1) % STAGES, BQ), Rows.stage(dOs, (t + STAGES - 1) % STAGES, BQ), q,
                              do, b, g * group + (t + STAGES - 1) // tiles, (qlo + (t + STAGES - 1) % tiles) * BQ, Sq,
                              stream_queries, tx)
                ops.commit()
                load_row_stats(lse_r, D_r, lse, row_dot, b, g * group + t // tiles, (qlo + t % tiles) * BQ, Sq,
                               want_dk, tx)
                wait_for_tile()
                ops.sync()
                if tc:
                    qk(S, Rows.stage(Qs, t % STAGES, BQ), Ks, tx)
                    if want_dk:
                        qk(dP, Rows.stage(dOs, t % STAGES, BQ), Vs, tx)
                    ops.sync()
                scores(P, dS, S, dP, Rows.stage(Qs, t % STAGES, BQ), Rows.stage(dOs, t % STAGES, BQ), Ks, Vs, lse_r, D_r, alibi,
                       mask, b, g * group + t // tiles, (qlo + t % tiles) * BQ, j0, Sq, Sk, want_dv, want_dk, tx)
                ops.sync()
                if want_dv:
                    if tc:
                        key_grad(G, P, Rows.stage(dOs, t % STAGES, BQ), tx)
                        ops.sync()
                        add_product(dV, G, BK, tx)
                        if want_dk:
                            ops.sync()  # G is reused for dS^T Q
                    else:
                        add_key_grad(dV, P, Rows.stage(dOs, t % STAGES, BQ), tx)
                if want_dk:
                    if tc:
                        key_grad(G, dS, Rows.stage(Qs, t % STAGES, BQ), tx)
                        ops.sync()
                        add_product(dK, G, BK, tx)
                    else:
                        add_key_grad(dK, dS, Rows.stage(Qs, t % STAGES, BQ), tx)
            if want_dk:
                store_rows(dk, dK, b, g, j0, BK, Sk, scale, tx)
            if want_dv:
                store_rows(dv, dV, b, g, j0, BK, Sk, 1.0, tx)

        @T.macro
        def query_block(q, k, v, do, alibi, mask, lse, row_dot, dq, b, h, i0, Sq, Sk, tx):
            Qs = T.alloc_buffer((BQ, DP + PAD), dtype, scope=shared)
            dOs = T.alloc_buffer((BQ, DP + PAD), dtype, scope=shared)
            Ks = T.alloc_buffer((STAGES * BK, DP + PAD), dtype, scope=shared)  # STAGES tiles in flight
            Vs = T.alloc_buffer((STAGES * BK, DP + PAD), dtype, scope=shared)
            S = T.alloc_buffer((BQ, BK) if tc else (1, 1), F32, scope=shared)
            dP = T.alloc_buffer((BQ, BK) if tc else (1, 1), F32, scope=shared)
            G = T.alloc_buffer((BQ, DP) if tc else (1, 1), F32, scope=shared)
            dS = T.alloc_buffer((BQ, BK + PAD), dtype, scope=small)
            lse_r = T.alloc_buffer((BQ,), F32, scope=small)
            D_r = T.alloc_buffer((BQ,), F32, scope=small)
            dQ = T.alloc_buffer((_ceil(BQ * DP, NT),), F32, scope=local)
            for i in range(_ceil(BQ * DP, NT)):
                dQ[i] = T.float32(0)
            load_rows(Qs, dOs, q, do, b, h, i0, Sq, copy_queries, tx)
            load_row_stats(lse_r, D_r, lse, row_dot, b, h, i0, Sq, True, tx)
            lo, hi = key_tile_range(cfg, first_pos=i0, last_pos=T.min(i0 + BQ, Sq) - 1, kv_len=Sk, delta=Sk - Sq,
                                    block_k=BK)
            # key tile lo + t, streamed STAGES - 1 ahead
            for t in range(STAGES - 1):
                if lo + t < hi:
                    load_keys(Rows.stage(Ks, t, BK), Rows.stage(Vs, t, BK), k, v, b, h // group, (lo + t) * BK, Sk, stream_keys,
                              tx)
                ops.commit()
            for t in range(T.max(hi - lo, 0)):
                ops.sync()  # the previous tile's readers are done with its stage, dS and G
                if lo + t + STAGES - 1 < hi:
                    load_keys(Rows.stage(Ks, (t + STAGES - 1) % STAGES, BK), Rows.stage(Vs, (t + STAGES - 1) % STAGES, BK), k, v,
                              b, h // group, (lo + t + STAGES - 1) * BK, Sk, stream_keys, tx)
                ops.commit()
                wait_for_tile()
                ops.sync()
                if tc:
                    qk(S, Qs, Rows.stage(Ks, t % STAGES, BK), tx)
                    qk(dP, dOs, Rows.stage(Vs, t % STAGES, BK), tx)
                    ops.sync()
                scores(dS, dS, S, dP, Qs, dOs, Rows.stage(Ks, t % STAGES, BK), Rows.stage(Vs, t % STAGES, BK), lse_r, D_r, alibi,
                       mask, b, h, i0, (lo + t) * BK, Sq, Sk, False, True, tx)
                ops.sync()
                if tc:
                    query_grad(G, dS, Rows.stage(Ks, t % STAGES, BK), tx)
                    ops.sync()
                    add_product(dQ, G, BQ, tx)
                else:
                    add_query_grad(dQ, dS, Rows.stage(Ks, t % STAGES, BK), tx)
            store_rows(dq, dQ, b, h, i0, BQ, Sq, scale, tx)

        self.row_dots, self.key_block, self.query_block = row_dots, key_block, query_block


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
    dtype, Hq, Hkv, D = spec.dtype, spec.num_q_heads, spec.num_kv_heads, spec.head_dim
    BQ, BK, NT = tiles.block_q, tiles.block_k, launch.threads
    want_dq, want_dk, want_dv = "dq" in grads, "dk" in grads, "dv" in grads
    want_ds = want_dq or want_dk
    has_mask = len(spec.mask_broadcast) > 0

    # fmt: off
    @T.prim_func
    def fuel_flash_attn_backward_cuda(q_h: T.handle, k_h: T.handle, v_h: T.handle, do_h: T.handle,
                                      alibi_h: T.handle, mask_h: T.handle, out_h: T.handle, lse_h: T.handle,
                                      dq_h: T.handle, dk_h: T.handle, dv_h: T.handle):
        T.func_attr({"tirx.noalias": True})
        q, k, v, do, alibi, mask, out, lse, dq, dk, dv = param_buffers(
            spec, dict(B=B, Sq=Sq, Sk=Sk),
            q=q_h, k=k_h, v=v_h, do=do_h, alibi=alibi_h, mask=mask_h, out=out_h, lse=lse_h, dq=dq_h, dk=dk_h, dv=dv_h)
        row_dot = T.alloc_buffer((B, Hq, Sq) if want_ds else (1, 1, 1), F32)
        # 1. D = rowsum(do * out)
        if want_ds:
            for bx in launch.grid((B * Hq * Sq + NT - 1) // NT, "x"):
                for tx in launch.block():
                    body.row_dots(do, out, row_dot, B * Hq * Sq, Hq, Sq, bx, tx)
        # 2. dk, dv: one block per (key tile, batch x KV head)
        if want_dk or want_dv:
            for bx in launch.grid((Sk + BK - 1) // BK, "x"):
                for by in launch.grid(B, "y"):
                    for bz in launch.grid(Hkv, "z"):
                        for tx in launch.block():
                            body.key_block(q, k, v, do, alibi, mask, lse, row_dot, dk, dv, T.Cast("int64", by),
                                           T.Cast("int64", bz), T.Cast("int64", bx) * BK, Sq, Sk, tx)
        # 3. dq: one block per (query tile, batch x query head)
        if want_dq:
            for bx in launch.grid((Sq + BQ - 1) // BQ, "x"):
                for by in launch.grid(B, "y"):
                    for bz in launch.grid(Hq, "z"):
                        for tx in launch.block():
                            body.query_block(q, k, v, do, alibi, mask, lse, row_dot, dq, T.Cast("int64", by),
                                             T.Cast("int64", bz), T.Cast("int64", bx) * BQ, Sq, Sk, tx)
    # fmt: on

    unused = {name for name, wanted in (("dq", want_dq), ("dk", want_dk), ("dv", want_dv)) if not wanted}
    if not spec.has_alibi:
        unused.add("alibi")
    if not has_mask:
        unused.add("mask")
    return finish(drop_params(fuel_flash_attn_backward_cuda, unused))
