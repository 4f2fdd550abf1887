"""CPU kernel of FlashAttention's packed variable-length backward (``flash_attn_varlen_func``'s
gradient): dq [total_q, Hq, D], dk, dv [total_k, Hkv, D] of the packed forward (``varlen``), every
option per sequence exactly as there (bottom-right causal, window, softcap, sink tokens, ALiBi,
GQA: dk and dv sum over the group's query heads).

It is the dense backward (``backward``: FlashAttention-2, D = rowsum(do * out), P recomputed from
the forward's lse, the NaN rule) run per sequence: its task macros (``BackwardTask``) read the
packed rows through ``PackedSequence`` in place of ``DenseRows``. A task is one (sequence, KV head,
split of the sequence's key tiles); the tasks, ``sum_b Hkv * min(splits, key tiles of b)`` of
them, are dealt to parallel workers (``ragged.dealt_tasks``, bit-reversed so that even a few
tasks reach every thread), and each walks only the query tiles of its sequence that can see its
key tiles, so the cost follows sum_b Sq_b * Sk_b, not B * max^2.

dq: each task adds into its own float32 partial, [splits, Hq, total_q, DP] (a query tile adds its
live rows only, so the partials are O(splits * total_q * D) however short the sequences; the rule
keeps splits <= 4); a last pass sums a row's partials in split order (deterministic, no races).
Rows past cu_seqlens_q[B] get dq = 0 and keys
past cu_seqlens_k[B] dk = dv = 0; a sequence without keys gives its rows dq = 0.

cu_seqlens are validated in the kernel before anything is read through them (``varlen.check_packed_offsets``).

Contents:
    SequenceGrid     -- a task's key-split grid over one sequence, its dq partials in the packed layout
    varlen_backward  -- PrimFunc fuel_flash_attn_varlen_backward_cpu(q, k, v, do, cu_seqlens_q,
                        cu_seqlens_k, [alibi_slopes], out, lse, dq, dk, dv)
"""

from __future__ import annotations

from dataclasses import dataclass

from tvm import tirx
from tvm.script import tirx as T

from ..common import F32, KernelSpec, check_packed, drop_params, finish, kernel_params
from .backward import BackwardBuffers, BackwardKernel, BackwardTask
from .ragged import dealt_tasks, find_sequence
from .row_layouts import PackedSequence
from .tasks import KeySplitGrid, TilePair, split_sum
from .tiles import CpuTiles
from .varlen import check_packed_offsets

OP = "fuel.flash_attn_varlen_backward"


@dataclass(frozen=True)
class SequenceGrid(KeySplitGrid):
    """A task's grid over one sequence (Sq, Sk, its key tiles and their splits are the sequence's);
    the dq partial of query tile qt of head h, split c starts at row ``first_row + qt * block_q``
    (first_row: the sequence's first row) of the [splits, Hq, padded_rows, DP] partials."""

    first_row: tirx.PrimExpr = 0
    padded_rows: tirx.PrimExpr = 0

    def pair(self, b, g, split, hr, qt, kt) -> TilePair:
        h = g * self.group + hr
        return TilePair(b, h, qt * self.block_q, kt * self.block_k,
                        ((split * self.num_q_heads + h) * self.padded_rows + self.first_row + qt * self.block_q)
                        * self.padded_dim)


def varlen_backward(spec: KernelSpec, tiles: CpuTiles, *, workers: int = 64, rows_task=None) -> tirx.PrimFunc:
    """``fuel_flash_attn_varlen_backward_cpu(q [total_q, Hq, D], k, v [total_k, Hkv, D], do
    [total_q, Hq, D], cu_seqlens_q [B + 1] int32, cu_seqlens_k [B + 1] int32, alibi_slopes [Hq]
    float32 (``spec.has_alibi``), out [total_q, Hq, D], lse [Hq, total_q] float32 (natural log,
    -inf for a row without a visible key), dq [total_q, Hq, D], dk, dv [total_k, Hkv, D])``:
    total_q, total_k and B symbolic; gradients in q's dtype. ``tiles.splits``: the most tasks per
    (sequence, KV head) (no more than the sequence's key tiles); ``workers`` (a power of two): the
    parallel workers the tasks are dealt to.

    ``rows_task`` (``backward_rows.RowsTask``, the rule's choice where max_seqlen bounds every
    sequence to a few rows and keys): one task per (sequence, KV head), each over at most block_k keys
    (a longer sequence raises), writing dq itself (no partials)."""
    check_packed(spec, "varlen_backward")
    partials = rows_task is None
    too_long = f"{OP}: this kernel takes sequences of at most {tiles.block_k} keys (cu_seqlens_k)"
    Hq, Hkv, D, group, dtype, cfg = (spec.num_q_heads, spec.num_kv_heads, spec.head_dim, spec.group, spec.dtype,
                                     spec.cfg)
    BQ, BK, DP = tiles.block_q, tiles.block_k, tiles.padded_dim(D)
    splits = tiles.splits
    task = BackwardTask(spec, tiles, ("dq", "dk", "dv"))
    total_q, total_k, B1 = (tirx.Var(name, "int64") for name in ("total_q", "total_k", "B1"))  # B1: B + 1
    sizes = dict(total_q=total_q, total_k=total_k, B1=B1)
    # the partials' rows per (split, query head): the packed rows themselves (a query tile adds its
    # live rows only)
    padded_rows = total_q
    unused = set() if spec.has_alibi else {"alibi_slopes"}

    def tiles_per_split(n_key_tiles):
        # a key-split task's run of key tiles (a sequence with keys has tasks); a rows task (one also
        # for a sequence without keys) walks no key tiles
        if not partials:
            return T.int64(0)
        return (n_key_tiles + T.min(n_key_tiles, splits) - 1) // T.min(n_key_tiles, splits)

    @T.macro
    def sequence_task(context, task_id, b, scratch):
        # task ``task_id`` of sequence b: split local // Hkv of KV head local % Hkv's key tiles
        params, row_dot, dq_part, cu_q, cu_k, first_task, first_row_tile = T.meta_var(context)
        q0: T.int64 = T.Cast("int64", cu_q[b])
        k0: T.int64 = T.Cast("int64", cu_k[b])
        sq: T.int64 = T.Cast("int64", cu_q[b + 1]) - q0
        sk: T.int64 = T.Cast("int64", cu_k[b + 1]) - k0
        n_key_tiles: T.int64 = (sk + BK - 1) // BK
        per_split: T.int64 = tiles_per_split(n_key_tiles)
        split: T.int64 = (task_id - first_task[b]) // Hkv
        g: T.int64 = (task_id - first_task[b]) % Hkv
        first_row: T.int64 = q0
        # the task's own dq partial rows zeroed (no other task writes them)
        if partials:
            for hr, row in T.grid(group, sq):
                for d in T.vectorized(DP):
                    dq_part[((split * Hq + g * group + hr) * padded_rows + first_row + row) * DP + d] = T.float32(0)
        grid = T.meta_var(SequenceGrid(cfg, 1, sq, sk, Hq, Hkv, group, BQ, BK, DP, splits, n_key_tiles, per_split,
                                       0, first_row=first_row, padded_rows=padded_rows))
        kernel = T.meta_var(BackwardKernel(grid, params, PackedSequence(q0, k0, sq, sk), row_dot, dq_part))
        if partials:
            task.key_task(kernel, b, g, split, scratch)
        else:
            rows_task.task(kernel, b, g, split, scratch)

    # fmt: off
    @T.prim_func
    def fuel_flash_attn_varlen_backward_cpu(q_h: T.handle, k_h: T.handle, v_h: T.handle, do_h: T.handle,
                                            cu_seqlens_q_h: T.handle, cu_seqlens_k_h: T.handle,
                                            alibi_slopes_h: T.handle, out_h: T.handle, lse_h: T.handle,
                                            dq_h: T.handle, dk_h: T.handle, dv_h: T.handle):
        q, k, v, do, cu_seqlens_q, cu_seqlens_k, alibi_slopes, out, lse, dq, dk, dv = kernel_params(
            spec, sizes, q_h, k_h, v_h, do_h, cu_seqlens_q_h, cu_seqlens_k_h, alibi_slopes_h, out_h, lse_h, dq_h,
            dk_h, dv_h)
        check_packed_offsets(cu_seqlens_q, cu_seqlens_k, B1, total_q, total_k, OP)
        params = T.meta_var(BackwardBuffers(q=q, k=k, v=v, do=do, lse=lse, dk=dk, dv=dv,
                                            alibi=alibi_slopes if spec.has_alibi else None,
                                            dq=None if partials else dq))
        row_dot = T.alloc_buffer((Hq, total_q), F32)
        dq_part = T.alloc_buffer((splits * Hq * padded_rows * DP,) if partials else (1,), F32)
        # per sequence: its first task (Hkv per split, a split per key tile at most) and first query tile
        first_task = T.alloc_buffer((B1,), "int64")
        first_row_tile = T.alloc_buffer((B1,), "int64")
        first_task[0] = T.int64(0)
        first_row_tile[0] = T.int64(0)
        for b in range(B1 - 1):
            # a rows task per (sequence, KV head), keys or not (it writes its rows' dq)
            if partials:
                first_task[b + 1] = first_task[b] + T.min(
                    (T.Cast("int64", cu_seqlens_k[b + 1] - cu_seqlens_k[b]) + BK - 1) // BK, splits) * Hkv
            else:
                assert cu_seqlens_k[b + 1] - cu_seqlens_k[b] <= BK, too_long
                first_task[b + 1] = first_task[b] + Hkv
            first_row_tile[b + 1] = first_row_tile[b] + (T.Cast("int64", cu_seqlens_q[b + 1] - cu_seqlens_q[b])
                                                         + BQ - 1) // BQ
        q_end: T.int64 = T.Cast("int64", cu_seqlens_q[B1 - 1])
        k_end: T.int64 = T.Cast("int64", cu_seqlens_k[B1 - 1])
        # 1. D = rowsum(do * out) of every row of a sequence
        for i in T.parallel(q_end):
            for h in range(Hq):
                acc = T.alloc_buffer((1,), F32, scope="local")
                acc[0] = T.float32(0)
                for d in range(D):
                    acc[0] = acc[0] + do[i, h, d].astype(F32) * out[i, h, d].astype(F32)
                row_dot[h, i] = acc[0]
        # 2. the (sequence, KV head, split) tasks: dk, dv of their key tiles, their dq partials
        context = T.meta_var((params, row_dot, dq_part, cu_seqlens_q, cu_seqlens_k, first_task, first_row_tile))
        dealt_tasks(workers, first_task[B1 - 1], first_task, B1 - 1, 1, sequence_task, context, spread=True,
                    scratch_of=task.task_scratch if partials else rows_task.scratch)
        # 3. dq of each query tile: its sequence's partials summed in split order
        if partials:
            for t in T.parallel(first_row_tile[B1 - 1]):
                bounds = T.alloc_buffer((2,), "int64", scope="local")
                find_sequence(bounds, first_row_tile, B1 - 1, t)
                q0: T.int64 = T.Cast("int64", cu_seqlens_q[bounds[0]])
                sq: T.int64 = T.Cast("int64", cu_seqlens_q[bounds[0] + 1]) - q0
                n_splits: T.int64 = T.min((T.Cast("int64", cu_seqlens_k[bounds[0] + 1] - cu_seqlens_k[bounds[0]])
                                           + BK - 1) // BK, splits)
                for r in range(BQ):
                    if (t - first_row_tile[bounds[0]]) * BQ + r < sq:
                        for h in range(Hq):
                            for d in T.vectorized(D):
                                dq[q0 + (t - first_row_tile[bounds[0]]) * BQ + r, h, d] = split_sum(
                                    lambda c: dq_part[((c * Hq + h) * padded_rows + q0 + (t - first_row_tile[bounds[0]])
                                                       * BQ + r) * DP + d], splits, n_splits).astype(dtype)
        # rows and keys of no sequence: no gradient
        for i in T.parallel(total_q - q_end):
            for h, d in T.grid(Hq, D):
                dq[q_end + i, h, d] = T.cast(0, dtype)
        for j in T.parallel(total_k - k_end):
            for g, d in T.grid(Hkv, D):
                dk[k_end + j, g, d] = T.cast(0, dtype)
                dv[k_end + j, g, d] = T.cast(0, dtype)
    # fmt: on

    return finish(drop_params(fuel_flash_attn_varlen_backward_cpu, unused))


__all__ = ["SequenceGrid", "varlen_backward"]
