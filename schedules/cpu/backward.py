"""CPU flash attention backward: dq, dk, dv in one pass over the key tiles (FlashAttention-2).

Three parallel stages in one PrimFunc:

1. ``D = rowsum(do * out)`` per query row, and the dq partial sums zeroed.
2. One task per (batch, KV head, split of the key tiles). For each key tile the task keeps
   dk and dv in an on-chip accumulator while it loops over every query head of the GQA group and
   every query tile that can see the tile; P is recomputed from the forward's lse, and
   ``dS = P * (dP - D)`` (times the softcap derivative and the scale). Five register-tiled GEMMs:
   S = q k^T, dP = do v^T, dv += P^T do, dk += dS^T q, dq += dS k.
3. dq: the splits' partial sums added (each split owns its partial buffer: no races, and the
   result does not depend on thread timing).

Scratch per task is O((block_q + block_k) * D); the dq partials are [splits, B, Hq, Sq, DP] (a
query tile adds only its live rows into them).

The NaN rule (``tvm_fuel.op.semantics``): dS is 0 wherever P is (a dropped key's dP may be NaN),
and a GEMM whose values (a key tile, or a query tile's q or do) hold a NaN or Inf skips zero
weights; the tiles are counted for non-finite elements as they are loaded, so finite inputs
run the plain GEMMs.

Contents:
    BackwardBuffers, BackwardKernel -- a task's parameters and kernel-wide buffers (its rows' layout:
                      ``row_layouts.DenseRows``)
    BackwardTask   -- the task macros (shared with the packed varlen backward, ``varlen_backward``)
    flash_backward -- PrimFunc(q, k, v, do, [alibi_slopes], [attn_mask], out, lse, [dq], [dk], [dv])
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping

from tvm import tirx
from tvm.script import tirx as T

from tvm_fuel.op import semantics as sem
from ..common import (F32, KernelSpec, drop_params, finish, is_key_mask, kernel_params,
                      key_masked_shifted_logit, key_term, shifted_logit, kernel_sizes)
from .common import Buffers, absent_inputs, named_buffer
from .micro import Micro
from .row_layouts import DenseRows
from .tasks import KeySplitGrid, key_split_tasks, sum_split_partials, visible_query_tiles
from .tiles import CpuTiles


@dataclass(frozen=True)
class BackwardBuffers(Buffers):
    """The parameter buffers the backward's macros read and write; None where the kernel has none
    (no ALiBi, no mask, a gradient it does not produce)."""

    q: tirx.Buffer
    k: tirx.Buffer
    v: tirx.Buffer
    do: tirx.Buffer
    lse: tirx.Buffer
    dq: tirx.Buffer | None = None  # the kernels that write dq in place (``backward_rows``); else partials
    dk: tirx.Buffer | None = None
    dv: tirx.Buffer | None = None
    alibi: tirx.Buffer | None = None
    mask: tirx.Buffer | None = None


@dataclass(frozen=True)
class _KeyTile:
    """A task's float32 scratch of one key tile: K [block_k, DP] (dq += dS K), K^T and V^T
    [D, block_k] (the score GEMMs vectorize over keys), and the dk, dv accumulators [block_k, DP]."""

    Kn: tirx.Buffer
    Kt: tirx.Buffer
    Vt: tirx.Buffer
    dK: tirx.Buffer
    dV: tirx.Buffer


@dataclass(frozen=True)
class _QueryRows:
    """A task's float32 scratch of one query tile: q and do [block_q, DP], and per row the forward's
    lse and D = rowsum(do * out) [block_q]."""

    Qs: tirx.Buffer
    dOs: tirx.Buffer
    lse_r: tirx.Buffer
    D_r: tirx.Buffer


@dataclass(frozen=True)
class _TaskScratch:
    """A task's scratch besides its key tile: the query tile's rows, the score tiles S (then P),
    dP (then dS) and the capped scores [block_q, block_k], the NaN/Inf counts of the key tile,
    the query tile's q and its do, and the tile's dq term dS K [block_q, DP]."""

    keys: _KeyTile
    rows: _QueryRows
    S: tirx.Buffer
    dP: tirx.Buffer
    Cap: tirx.Buffer
    keys_nonfinite: tirx.Buffer
    q_nonfinite: tirx.Buffer
    do_nonfinite: tirx.Buffer
    dQ: tirx.Buffer


@dataclass(frozen=True)
class BackwardKernel:
    """What every task reads: the grid, the parameters, the rows' layout (``DenseRows`` or the
    packed one), D = rowsum(do * out) (laid out as lse) and the flat float32 dq partials (a query
    tile's live rows, DP apart, from ``grid.pair(...).partial_start``)."""

    grid: KeySplitGrid
    params: BackwardBuffers
    seq: object
    row_dot: tirx.Buffer
    dq_part: tirx.Buffer


class _Body:
    """The macros of a backward task, specialised to one spec, tile configuration and gradient set;
    ``seq`` (``DenseRows`` or the packed layout) says where rows live and how long the sequences are."""

    def __init__(self, spec: KernelSpec, tiles: CpuTiles, grads: tuple[str, ...]):
        dtype, D, cfg, scale = spec.dtype, spec.head_dim, spec.cfg, spec.scale
        BQ, BK, DP, L = tiles.block_q, tiles.block_k, tiles.padded_dim(D), tiles.lanes
        want_dk, want_dv = "dk" in grads, "dv" in grads
        # with a softcap the capped score is stored, for the softcap derivative (dq, dk) and for dv
        # alone too: inlined into the shifted logit, the fast tanh's expression is duplicated until
        # LLVM takes 70 s to compile the dv kernel
        capped_stored = cfg.softcap > 0

        # a key mask (the same for every query row) is read once per (query tile, key tile) pair into
        # per-key terms, not per score
        KEY_MASK = is_key_mask(spec)

        def pair_shifted_logit(capped, lse_row, params, seq, pair, r, c, terms):
            # logit - lse of one score from its capped value, -inf where the key is dropped
            Sq, Sk = seq.q_len(pair.b), seq.k_len(pair.b)
            if KEY_MASK:
                return key_masked_shifted_logit(spec, capped, params.alibi, terms[c], pair.b, pair.h, pair.i0 + r,
                                                pair.key_start + c, Sk, Sk - Sq, lse_row)
            return shifted_logit(spec, capped, params.alibi, params.mask, pair.b, pair.h, pair.i0 + r,
                                 pair.key_start + c, Sk, Sk - Sq, lse_row)

        @T.macro
        def load_keys(keys, params, seq, b, g, kt):
            # key tile kt of KV head g, and its dk, dv accumulators zeroed. The transposed tiles of a
            # tile past the last key are zeroed a vector at a time first (column by column, the
            # stores of a one-key tile's 63 dead columns had cost more than its GEMMs)
            if kt * BK + BK > seq.k_len(b):
                for d, c0 in T.grid(D, BK // L):
                    for v in T.vectorized(L):
                        keys.Kt[d, c0 * L + v] = T.float32(0)
                        keys.Vt[d, c0 * L + v] = T.float32(0)
            for c in range(BK):
                if kt * BK + c < seq.k_len(b):
                    for d in range(D):
                        keys.Kn[c, d] = seq.key(params.k, b, g, kt * BK + c, d).astype(F32)
                        keys.Kt[d, c] = seq.key(params.k, b, g, kt * BK + c, d).astype(F32)
                        keys.Vt[d, c] = seq.key(params.v, b, g, kt * BK + c, d).astype(F32)
                else:
                    for d in T.vectorized(D):
                        keys.Kn[c, d] = T.float32(0)
                for d in range(D, DP):
                    keys.Kn[c, d] = T.float32(0)
                for d in T.vectorized(DP):
                    keys.dK[c, d] = T.float32(0)
                    keys.dV[c, d] = T.float32(0)

        @T.macro
        def load_rows(rows, params, row_dot, seq, pair):
            for r in range(BQ):
                if pair.i0 + r < seq.q_len(pair.b):
                    for d in range(D):
                        rows.Qs[r, d] = seq.query(params.q, pair.b, pair.h, pair.i0 + r, d).astype(F32)
                        rows.dOs[r, d] = seq.query(params.do, pair.b, pair.h, pair.i0 + r, d).astype(F32)
                    rows.lse_r[r] = seq.row(params.lse, pair.b, pair.h, pair.i0 + r)
                    rows.D_r[r] = seq.row(row_dot, pair.b, pair.h, pair.i0 + r)
                else:
                    for d in range(D):
                        rows.Qs[r, d] = T.float32(0)
                        rows.dOs[r, d] = T.float32(0)
                    rows.lse_r[r] = T.float32(float("-inf"))
                    rows.D_r[r] = T.float32(0)
                for d in range(D, DP):
                    rows.Qs[r, d] = T.float32(0)
                    rows.dOs[r, d] = T.float32(0)

        @T.macro
        def probabilities(S, Cap, lse_r, params, seq, pair):
            # S holds q.k^T; it becomes P = exp(logit - lse), 0 where the key is dropped (a vectorized
            # exp: LLVM's vector exp is 16 libm calls, which had cost the backward ~30 % of its time)
            terms = T.alloc_buffer((BK if KEY_MASK else 1,), F32)
            if KEY_MASK:
                for c in T.vectorized(BK):
                    terms[c] = key_term(spec, params.mask, pair.b, pair.h, pair.key_start + c)
            for r in range(BQ):
                if pair.i0 + r < seq.q_len(pair.b):
                    for c in T.vectorized(BK):
                        # the shifted logit stored before its exp (semantics.exp_shifted says why)
                        if capped_stored:
                            Cap[r, c] = sem.softcap(cfg, S[r, c] * T.float32(scale), fast=True)
                            S[r, c] = pair_shifted_logit(Cap[r, c], lse_r[r], params, seq, pair, r, c, terms)
                        else:
                            S[r, c] = pair_shifted_logit(S[r, c] * T.float32(scale), lse_r[r], params, seq, pair, r,
                                                         c, terms)
                        S[r, c] = sem.exp_shifted(S[r, c], lse_r[r], fast=True)
                else:  # rows past Sq: P = 0, and no garbage left in the capped scores (0 * NaN is NaN)
                    for c in T.vectorized(BK):
                        S[r, c] = T.float32(0)
                        if capped_stored:
                            Cap[r, c] = T.float32(0)

        @T.macro
        def score_grads(dP, S, Cap, D_r):
            # dP holds do.v^T; it becomes dS = P * (dP - D) * dsoftcap * scale (0 where P is 0)
            for r in range(BQ):
                for c in T.vectorized(BK):
                    dP[r, c] = sem.score_grad(cfg, S[r, c], dP[r, c], D_r[r], Cap[r, c], factor=T.float32(scale))

        @T.macro
        def store_key_grads(keys, params, seq, b, g, kt):
            for c in range(BK):
                if kt * BK + c < seq.k_len(b):
                    for d in range(D):
                        if want_dk:
                            seq.store_key(params.dk, keys.dK[c, d].astype(dtype), b, g, kt * BK + c, d)
                        if want_dv:
                            seq.store_key(params.dv, keys.dV[c, d].astype(dtype), b, g, kt * BK + c, d)

        self.load_keys, self.load_rows, self.store_key_grads = load_keys, load_rows, store_key_grads
        self.probabilities, self.score_grads = probabilities, score_grads


class BackwardTask:
    """The macros of a key-split task, shared by the dense and the packed (varlen) backward:
    ``pair_step(kernel, scratch, pair)`` (one query tile against the task's key tile) and
    ``key_task(kernel, b, g, split, scratch)`` (dk, dv of each of the split's key tiles, and the
    split's dq partials; ``task_scratch()`` allocates its scratch where called); ``kernel`` is a
    ``BackwardKernel`` whose grid and row layout are the task's."""

    def __init__(self, spec: KernelSpec, tiles: CpuTiles, grads: tuple[str, ...]):
        micro = Micro(tiles)
        body = _Body(spec, tiles, grads)
        D = spec.head_dim
        BQ, BK, DP = tiles.block_q, tiles.block_k, tiles.padded_dim(spec.head_dim)
        KV, DV = tiles.key_vecs, tiles.dim_vecs
        want_dq, want_dk, want_dv = "dq" in grads, "dk" in grads, "dv" in grads
        want_ds = want_dq or want_dk

        @T.macro
        def pair_step(kernel, scratch, pair):
            # S, P, dP and dS of one (query tile, key tile) pair; dv, dk and the dq partial accumulate
            keys = T.meta_var(scratch.keys)
            rows = T.meta_var(scratch.rows)
            body.load_rows(rows, kernel.params, kernel.row_dot, kernel.seq, pair)
            micro.gemm(scratch.S, rows.Qs, keys.Kt, BQ, BK, D, KV)
            body.probabilities(scratch.S, scratch.Cap, rows.lse_r, kernel.params, kernel.seq, pair)
            if want_dv:
                micro.count_nonfinite(scratch.do_nonfinite, rows.dOs, BQ, DP)
                micro.nan_safe_gemm(keys.dV, scratch.S, rows.dOs, BK, DP, BQ, DV,
                                    scratch.do_nonfinite[0] == T.float32(0), a_transposed=True, accumulate=True)
            if want_ds:
                micro.gemm(scratch.dP, rows.dOs, keys.Vt, BQ, BK, D, KV)
                body.score_grads(scratch.dP, scratch.S, scratch.Cap, rows.D_r)
                if want_dk:
                    micro.count_nonfinite(scratch.q_nonfinite, rows.Qs, BQ, DP)
                    micro.nan_safe_gemm(keys.dK, scratch.dP, rows.Qs, BK, DP, BQ, DV,
                                        scratch.q_nonfinite[0] == T.float32(0), a_transposed=True, accumulate=True)
                if want_dq:
                    # dS K into the task's tile, then its live rows added to the partial: the partials
                    # hold the sequences' own rows, not whole query tiles (a batch of many one-row
                    # sequences padded each to block_q rows)
                    micro.nan_safe_gemm(scratch.dQ, scratch.dP, keys.Kn, BQ, DP, BK, DV,
                                        scratch.keys_nonfinite[0] == T.float32(0))
                    for r in range(T.min(BQ, kernel.seq.q_len(pair.b) - pair.i0)):
                        for d in T.vectorized(DP):
                            kernel.dq_part[pair.partial_start + r * DP + d] = (
                                kernel.dq_part[pair.partial_start + r * DP + d] + scratch.dQ[r, d])

        def task_scratch():
            # a task's buffers, allocated where called (once per run of tasks: key_split_tasks)
            Kn = named_buffer("Kn", (BK, DP), F32)
            Kt = named_buffer("Kt", (D, BK), F32)
            Vt = named_buffer("Vt", (D, BK), F32)
            dK_acc = named_buffer("dK_acc", (BK, DP), F32)
            dV_acc = named_buffer("dV_acc", (BK, DP), F32)
            Qs = named_buffer("Qs", (BQ, DP), F32)
            dOs = named_buffer("dOs", (BQ, DP), F32)
            lse_r = named_buffer("lse_r", (BQ,), F32)
            D_r = named_buffer("D_r", (BQ,), F32)
            S = named_buffer("S", (BQ, BK), F32)
            dP = named_buffer("dP", (BQ, BK), F32)
            Cap = named_buffer("Cap", (BQ, BK), F32)
            keys_nonfinite = named_buffer("keys_nonfinite", (1,), F32, scope="local")
            q_nonfinite = named_buffer("q_nonfinite", (1,), F32, scope="local")
            do_nonfinite = named_buffer("do_nonfinite", (1,), F32, scope="local")
            dQ = named_buffer("dQ", (BQ, DP) if want_dq else (1, 1), F32)
            return _TaskScratch(_KeyTile(Kn, Kt, Vt, dK_acc, dV_acc), _QueryRows(Qs, dOs, lse_r, D_r), S, dP, Cap,
                                keys_nonfinite, q_nonfinite, do_nonfinite, dQ)

        @T.macro
        def key_task(kernel, b, g, split, scratch):
            # dk, dv of each of the split's key tiles, and the split's dq partials
            keys = T.meta_var(scratch.keys)
            grid = T.meta_var(kernel.grid)
            for i in range(grid.first_tile(split), grid.end_tile(split)):
                kt: T.int64 = grid.key_tile(i)
                body.load_keys(keys, kernel.params, kernel.seq, b, g, kt)
                micro.count_nonfinite(scratch.keys_nonfinite, keys.Kn, BK, DP)
                visible_query_tiles(grid, kernel, scratch, b, g, split, kt, pair_step)
                body.store_key_grads(keys, kernel.params, kernel.seq, b, g, kt)

        self.pair_step, self.key_task, self.task_scratch = pair_step, key_task, task_scratch


def flash_backward(spec: KernelSpec, tiles: CpuTiles, *, grads: tuple[str, ...],
                   dims: Mapping[str, int | None] | None = None, rows_task=None) -> tirx.PrimFunc:
    """The backward kernel producing ``grads`` (a subset of dq, dk, dv, in that order), with
    ``tiles.splits`` tasks per (batch, KV head); ``dims`` fixes B, Sq, Sk (symbolic where absent).

    ``rows_task`` (``backward_rows.RowsTask``): its tasks, one per (batch, KV head) over at most
    block_k keys (a longer Sk raises), run in place of the key-split tasks and write dq themselves
    (no partials)."""
    sizes = kernel_sizes(dims)
    B, Sq, Sk = sizes.values()
    splits = tiles.splits
    task = BackwardTask(spec, tiles, grads)
    partials = "dq" in grads and rows_task is None
    too_many_keys = f"fuel.flash_attn_backward: this kernel takes at most {tiles.block_k} keys (k.shape[2])"
    dtype, Hq, Hkv, D, group = spec.dtype, spec.num_q_heads, spec.num_kv_heads, spec.head_dim, spec.group
    BQ, BK, DP = tiles.block_q, tiles.block_k, tiles.padded_dim(spec.head_dim)
    cfg = spec.cfg
    unused = absent_inputs(spec) | {name for name in ("dq", "dk", "dv") if name not in grads}

    # fmt: off
    @T.prim_func
    def fuel_flash_attn_backward_cpu(q_h: T.handle, k_h: T.handle, v_h: T.handle, do_h: T.handle, alibi_h: T.handle,
                                     mask_h: T.handle, out_h: T.handle, lse_h: T.handle, dq_h: T.handle,
                                     dk_h: T.handle, dv_h: T.handle):
        q, k, v, do, alibi, mask, out, lse, dq, dk, dv = kernel_params(
            spec, sizes, q_h, k_h, v_h, do_h, alibi_h, mask_h, out_h, lse_h, dq_h, dk_h, dv_h)
        params = T.meta_var(BackwardBuffers.of(unused, q=q, k=k, v=v, do=do, lse=lse, dk=dk, dv=dv, alibi=alibi,
                                               mask=mask, dq=None if partials else dq))
        row_dot = T.alloc_buffer((B, Hq, Sq), F32)
        dq_part = T.alloc_buffer((splits * B * Hq * Sq * DP,) if partials else (1,), F32)  # [splits, B, Hq, Sq, DP]
        n_key_tiles = (Sk + BK - 1) // BK
        per_split = (n_key_tiles + splits - 1) // splits
        # 1. D = rowsum(do * out); zero the dq partials
        for bh in T.parallel(B * Hq):
            for i in range(Sq):
                acc = T.alloc_buffer((1,), F32, scope="local")
                acc[0] = T.float32(0)
                for d in range(D):
                    acc[0] = acc[0] + do[bh // Hq, bh % Hq, i, d].astype(F32) * out[bh // Hq, bh % Hq, i, d].astype(F32)
                row_dot[bh // Hq, bh % Hq, i] = acc[0]
            if partials:
                for c, i in T.grid(splits, Sq):
                    for d in T.vectorized(DP):
                        dq_part[((c * B + bh // Hq) * Hq + bh % Hq) * Sq * DP + i * DP + d] = T.float32(0)
        # 2. per (batch, KV head, split): dk, dv of each key tile; dq partials
        # the partials' rows per head are Sq (KeySplitGrid.padded_sq): a tile adds its live rows only
        grid = T.meta_var(KeySplitGrid(cfg, B, Sq, Sk, Hq, Hkv, group, BQ, BK, DP, splits, n_key_tiles, per_split,
                                       Sq))
        kernel = T.meta_var(BackwardKernel(grid, params, DenseRows(Sq, Sk), row_dot, dq_part))
        if rows_task is None:
            key_split_tasks(grid, kernel, task.key_task, task.task_scratch)
        else:
            assert Sk <= BK, too_many_keys
            key_split_tasks(grid, kernel, rows_task.task, rows_task.scratch)
        # 3. dq = sum of the splits' partials
        if partials:
            parts = T.decl_buffer((splits, B, Hq, Sq, DP), F32, data=dq_part.data)
            sum_split_partials(parts, dq, B, Hq, Sq, D, splits, dtype)
    # fmt: on

    return finish(drop_params(fuel_flash_attn_backward_cpu, unused))
