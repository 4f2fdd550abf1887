"""CPU backward of short sequences: each task takes one (batch, KV head)'s rows one at a time against
its few keys, read in place, with no tiles to pack or zero and no dq partials.

The register-tiled backward (``backward``) packs a key tile, zeroes its accumulators and runs five
GEMMs per (query tile, key tile); for a batch of 2048 x 8 single-token rows that fixed cost was
twice the floor's whole time. Here a task holds its keys' dk and dv [block_k, D] and, per query
row, q, do and the row's dq in float32: per (row, key) two dot products (S = q.k, dP = do.v) and
three row updates (dv += P do, dk += dS q, dq += dS k). Each task owns all of its rows, so dq is
written once, in q's dtype.

The NaN rule (``tvm_fuel.op.semantics``): a key whose P is 0 adds nothing (its dP is not read), and
a dS of 0 adds nothing to dk or dq (0 * Inf is NaN). D = rowsum(do * out) is the backward's first
stage (``backward.flash_backward``).

Contents:
    RowsTask       -- the task macro and its scratch, over any row layout (``row_layouts``)
    rows_backward  -- PrimFunc with flash_backward's parameters, its tasks RowsTask's
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping

from tvm import tirx
from tvm.script import tirx as T

from tvm_fuel.op import semantics as sem
from ..common import F32, KernelSpec, shifted_logit
from .backward import flash_backward
from .common import named_buffer
from .micro import adds_anything, RowOps
from .tiles import CpuTiles


@dataclass(frozen=True)
class _RowScratch:
    """A task's float32 scratch: the keys' dk, dv accumulators [block_k, D]; one query row's q, do
    [D] and dq [1, D]; a dot product's lane sums [1, LD] and their total [1]; a score's shifted logit
    [1] (``semantics.exp_shifted``: stored, not bound, as TVM's simplifier substitutes a bound value
    into each of the exp's hundred reads of it)."""

    dK: tirx.Buffer
    dV: tirx.Buffer
    q_row: tirx.Buffer
    do_row: tirx.Buffer
    dq_row: tirx.Buffer
    lanes: tirx.Buffer
    total: tirx.Buffer
    shifted: tirx.Buffer


class RowsTask:
    """``task(kernel, b, g, split, scratch)``: the rows of every query head of KV head g's group
    (batch or sequence b) against its at most ``tiles.block_k`` keys; ``kernel`` a
    ``backward.BackwardKernel`` (its params hold dq, its row_dot D, its grid is not read);
    ``scratch()`` allocates a task's scratch where called."""

    def __init__(self, spec: KernelSpec, tiles: CpuTiles, grads: tuple[str, ...]):
        if tiles.splits != 1:  # the kernels run one task per (batch, KV head, split)
            raise ValueError(f"RowsTask: a rows task owns all of its keys (splits 1), got splits {tiles.splits}")
        D, group, cfg, dtype = spec.head_dim, spec.group, spec.cfg, spec.dtype
        scale = T.float32(spec.scale)
        BK = tiles.block_k
        ops = RowOps(D, tiles.lanes)
        dot, add_row, LD = ops.dot, ops.add_row, ops.lanes
        want_dq, want_dk, want_dv = "dq" in grads, "dk" in grads, "dv" in grads
        want_ds = want_dq or want_dk

        @T.macro
        def task(kernel, b, g, split, scratch):
            params, seq = T.meta_var((kernel.params, kernel.seq))
            Sq: T.let[T.int64] = seq.q_len(b)
            Sk: T.let[T.int64] = seq.k_len(b)
            for j, d in T.grid(Sk, D):
                scratch.dK[j, d] = T.float32(0)
                scratch.dV[j, d] = T.float32(0)
            for hr, i in T.grid(group, Sq):
                h: T.let[T.int64] = g * group + hr
                for d in range(D):
                    scratch.q_row[d] = seq.query(params.q, b, h, i, d).astype(F32)
                    scratch.do_row[d] = seq.query(params.do, b, h, i, d).astype(F32)
                    scratch.dq_row[0, d] = T.float32(0)
                lse_row: T.let[T.float32] = seq.row(params.lse, b, h, i)
                d_row: T.let[T.float32] = seq.row(kernel.row_dot, b, h, i)
                for j in range(Sk):
                    dot(scratch.total, scratch.lanes, scratch.q_row,
                        lambda d: seq.key(params.k, b, g, j, d).astype(F32))
                    capped: T.let[T.float32] = sem.softcap(cfg, scratch.total[0] * scale, fast=True)
                    scratch.shifted[0] = shifted_logit(spec, capped, params.alibi, params.mask, b, h, i, j, Sk, Sk - Sq,
                                                       lse_row)
                    p: T.let[T.float32] = sem.exp_shifted(scratch.shifted[0], lse_row, fast=True)
                    if adds_anything(p):
                        if want_dv:
                            add_row(scratch.dV, j, p, lambda d: scratch.do_row[d])
                        if want_ds:
                            dot(scratch.total, scratch.lanes, scratch.do_row,
                                lambda d: seq.key(params.v, b, g, j, d).astype(F32))
                            ds: T.let[T.float32] = sem.score_grad(cfg, p, scratch.total[0], d_row, capped, factor=scale)
                            if adds_anything(ds):
                                if want_dk:
                                    add_row(scratch.dK, j, ds, lambda d: scratch.q_row[d])
                                if want_dq:
                                    add_row(scratch.dq_row, 0, ds, lambda d: seq.key(params.k, b, g, j, d).astype(F32))
                if want_dq:
                    for d in range(D):
                        seq.store_query(params.dq, scratch.dq_row[0, d].astype(dtype), b, h, i, d)
            for j, d in T.grid(Sk, D):
                if want_dk:
                    seq.store_key(params.dk, scratch.dK[j, d].astype(dtype), b, g, j, d)
                if want_dv:
                    seq.store_key(params.dv, scratch.dV[j, d].astype(dtype), b, g, j, d)

        def scratch():
            return _RowScratch(named_buffer("dK", (BK, D)), named_buffer("dV", (BK, D)), named_buffer("q_row", (D,)),
                               named_buffer("do_row", (D,)), named_buffer("dq_row", (1, D)),
                               named_buffer("lanes", (1, LD)), named_buffer("total", (1,)),
                               named_buffer("shifted", (1,)))

        self.task, self.scratch = task, scratch


def rows_backward(spec: KernelSpec, tiles: CpuTiles, *, grads: tuple[str, ...],
                  dims: Mapping[str, int | None] | None = None) -> tirx.PrimFunc:
    """``flash_backward``'s kernel (same parameters) whose tasks are ``RowsTask``'s: one per
    (batch, KV head), over at most ``tiles.block_k`` keys (Sk beyond it is refused at run time)."""
    return flash_backward(spec, tiles, grads=grads, dims=dims, rows_task=RowsTask(spec, tiles, grads))


__all__ = ["RowsTask", "rows_backward"]
