"""CPU dense forward of decode-shaped calls: at most STREAMING_ROWS query rows per task (Sq times the
GQA group), keys and values read in place.

The paged decode's streaming task (``paged.PagedTile.attend_task``) over the dense layout
(``layouts.DenseKeys``): no key tile is packed, so no workspace exists and a call's time follows
its own Sq * Sk. The register-tiled kernel (``forward.dense_forward``) packs every KV head's keys
into whole tiles first; for many tiny rows (a batch of 2048 single-token sequences) that packing
wrote 64 keys per real one and cost 15-150x the floor's time.

A call over a handful of keys runs its rows one at a time instead (``dense_rows_forward``): per
row, each key's logit from one dot product, then the weights against their max and the value rows
added, with no tile of keys at all (the streaming task walks a whole vector of key slots and its
softmax per tile: at B 2048 x S 1 that fixed cost had left it slower than the floor).

Contents:
    dense_decode_forward -- PrimFunc(q, k, v, [alibi_slopes], [attn_mask], out, [lse]): dense_forward's,
                            its body the streaming tasks
    RowsForward          -- the task of a batch's (a sequence's) rows one at a time against its keys
    dense_rows_forward   -- the same PrimFunc, its body one RowsForward task per (batch, KV head)
"""

from __future__ import annotations

from typing import Mapping

from tvm import tirx
from tvm.script import tirx as T

from tvm_fuel.op import semantics as sem
from ..common import F32, KernelSpec, masked_logit
from ..layouts import DenseKeys
from .common import named_buffer
from .forward import dense_forward, ForwardMacros
from .micro import adds_anything, RowOps
from .paged import decode_tasks, PagedTile
from .row_layouts import DenseRows
from .tasks import task_runs
from .tiles import STREAMING_ROWS, CpuTiles


def dense_decode_forward(spec: KernelSpec, tiles: CpuTiles, *,
                         dims: Mapping[str, int | None] | None = None) -> tirx.PrimFunc:
    """Flash attention forward over q [B, Hq, Sq, D], k, v [B, Hkv, Sk, D] with tasks of at most
    STREAMING_ROWS rows (``tiles.block_q``) of ``tiles.kv_heads`` KV heads each, streaming their
    keys; ``dims`` fixes B, Sq, Sk (symbolic where absent). Same parameters as ``dense_forward``."""
    if tiles.block_q > STREAMING_ROWS:
        raise ValueError(f"dense_decode_forward: block_q {tiles.block_q} streams at most {STREAMING_ROWS} rows; "
                         "more rows take dense_forward")
    paged = PagedTile(spec, tiles, ForwardMacros(spec, tiles))

    @T.macro
    def streamed_tasks(params, B, Sq, Sk, k, v):
        decode_tasks(paged, params, B, Sq, spec, lambda b: Sk, lambda b: DenseKeys(k, v, b))

    return dense_forward(spec, tiles, dims=dims, tasks=streamed_tasks)


class RowsForward:
    """``task(params, k, v, seq, b, g, scratch)``: the forward of every row of KV head g's group
    (batch or sequence b, its rows and keys placed by ``seq``, a ``row_layouts`` layout) against its
    at most ``tiles.block_k`` keys, read in place from k, v; ``params`` a ``ForwardBuffers``.
    ``scratch()`` allocates a worker's scratch where called.

    A row's logits go into a [block_k] scratch with their max; each key whose weight
    ``exp(logit - max)`` is not 0 adds its value row (a dropped key's NaN value never counts; a NaN
    weight does). A row without a visible key gets 0 and an lse (natural log) of -inf."""

    def __init__(self, spec: KernelSpec, tiles: CpuTiles):
        D, group, cfg, dtype = spec.head_dim, spec.group, spec.cfg, spec.dtype
        BK, scale = tiles.block_k, T.float32(spec.scale)
        ops = RowOps(D, tiles.lanes)

        def scratch():
            # a worker's: one row's q and output accumulator, its logits, a dot product's lanes and
            # total, and the row's max and sum
            return (named_buffer("q_row", (D,)), named_buffer("o_row", (1, D)), named_buffer("logits", (BK,)),
                    named_buffer("lanes", (1, ops.lanes)), named_buffer("total", (1,)), named_buffer("stats", (2,)))

        @T.macro
        def task(params, k, v, seq, b, g, scratch):
            q_row, o_row, logits, lanes, total, stats = T.meta_var(scratch)
            Sq: T.let[T.int64] = seq.q_len(b)
            Sk: T.let[T.int64] = seq.k_len(b)
            for hr, i in T.grid(group, Sq):
                h: T.let[T.int64] = g * group + hr
                for d in range(D):
                    q_row[d] = seq.query(params.q, b, h, i, d).astype(F32)
                    o_row[0, d] = T.float32(0)
                stats[0] = T.float32(float("-inf"))
                for j in range(Sk):
                    ops.dot(total, lanes, q_row, lambda d: seq.key(k, b, g, j, d).astype(F32))
                    logits[j] = masked_logit(spec, sem.softcap(cfg, total[0] * scale, fast=True), params.alibi,
                                             params.mask, b, h, i, j, Sk, Sk - Sq)
                    stats[0] = T.max(stats[0], logits[j])
                shift: T.let[T.float32] = sem.safe_row_max(stats[0])
                stats[1] = T.float32(0)
                for j in range(Sk):
                    p: T.let[T.float32] = sem.probability(logits[j], shift, fast=True)
                    if adds_anything(p):
                        stats[1] = stats[1] + p
                        ops.add_row(o_row, 0, p, lambda d: seq.key(v, b, g, j, d).astype(F32))
                for d in range(D):
                    seq.store_query(params.out, sem.normalize(o_row[0, d], stats[1]).astype(dtype), b, h, i, d)
                if spec.return_lse:
                    seq.store_row(params.lse, sem.log_sum_exp(shift, stats[1]), b, h, i)

        self.task, self.scratch = task, scratch


def dense_rows_forward(spec: KernelSpec, tiles: CpuTiles, *,
                       dims: Mapping[str, int | None] | None = None) -> tirx.PrimFunc:
    """Flash attention forward over q [B, Hq, Sq, D], k, v [B, Hkv, Sk, D] with one ``RowsForward``
    task per (batch, KV head), over at most ``tiles.block_k`` keys (a longer Sk raises). Same
    parameters as ``dense_forward``; ``dims`` fixes B, Sq, Sk."""
    Hkv = spec.num_kv_heads
    rows = RowsForward(spec, tiles)
    too_many_keys = f"fuel.flash_attn: this kernel takes at most {tiles.block_k} keys (k.shape[2])"

    @T.macro
    def batch_task(context, task, scratch):
        params, k, v, seq = T.meta_var(context)
        rows.task(params, k, v, seq, task // Hkv, task % Hkv, scratch)

    @T.macro
    def row_tasks(params, B, Sq, Sk, k, v):
        assert Sk <= tiles.block_k, too_many_keys
        task_runs(B * Hkv, rows.scratch, batch_task, (params, k, v, DenseRows(Sq, Sk)))

    return dense_forward(spec, tiles, dims=dims, tasks=row_tasks)
