"""The task skeletons the CPU kernels share, as TVMScript macros.

Contents:
    KeySplitGrid        -- the backward kernels' task grid: (batch, KV head, split of the key tiles)
    TilePair            -- one (query tile, key tile) step of a key-split task
    TASK_WORKERS, task_runs -- a kernel's tasks in parallel runs, each run's scratch allocated once
    key_split_tasks     -- the grid's tasks, run by task_runs
    visible_query_tiles -- the query tiles of a KV head's group that can see a key tile
    sum_split_partials  -- a gradient from the per-split partials of the key-split tasks (no races)
    split_sum           -- the partials of one element summed in split order, as one expression
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from tvm import tirx
from tvm.script import tirx as T

from tvm_fuel.op.config import AttnConfig
from ..common import balanced_order, query_tile_range


@dataclass(frozen=True)
class KeySplitGrid:
    """The task grid of the kernels that own key tiles (the backward, the double backward): one
    task per (batch ``b``, KV head ``g``, ``split``), a split a contiguous run of ``per_split`` of
    the ``n_key_tiles`` key tiles; each key tile meets the query tiles of every query head of g's
    group that can see it. ``padded_sq``: the partials' rows per query head (whole query tiles in
    the double backward; the backward's Sq, its tiles adding their live rows only). ``n_key_tiles``, ``per_split`` and
    ``padded_sq`` are the kernel's own bound variables; a Python value inside the kernel."""

    cfg: AttnConfig
    B: Any
    Sq: Any
    Sk: Any
    num_q_heads: int
    num_kv_heads: int
    group: int
    block_q: int
    block_k: int
    padded_dim: int
    splits: int
    n_key_tiles: Any
    per_split: Any
    padded_sq: Any

    def first_tile(self, split):
        """The first of ``split``'s run of key-tile slots."""
        return split * self.per_split

    def end_tile(self, split):
        """One past the last of ``split``'s slots (the last split's run may be short)."""
        return T.min(split * self.per_split + self.per_split, self.n_key_tiles)

    def key_tile(self, slot):
        """The key tile of a slot: causal work falls with the tile index, so the slots pair
        heavy tiles with light ones (balanced_order) and every split carries equal work."""
        return balanced_order(slot, self.n_key_tiles)

    def pair(self, b, g, split, hr, qt, kt) -> TilePair:
        """The step of query tile ``qt`` of query head ``hr`` of g's group and key tile ``kt``."""
        BQ, Hq = self.block_q, self.num_q_heads
        return TilePair(b, g * self.group + hr, qt * BQ, kt * self.block_k,
                        (((split * self.B + b) * Hq + g * self.group + hr) * self.padded_sq + qt * BQ)
                        * self.padded_dim)


@dataclass(frozen=True)
class TilePair:
    """One (query tile, key tile) step: batch ``b``, query head ``h``, the query tile's first
    position ``i0``, the key tile's first key ``key_start``, and where the task's float32 partial
    [block_q, padded_dim] of this query tile starts in the [splits, B, Hq, padded_sq, padded_dim]
    partials (the backward's dq, the double backward's q_grad)."""

    b: tirx.PrimExpr
    h: tirx.PrimExpr
    i0: tirx.PrimExpr
    key_start: tirx.PrimExpr
    partial_start: tirx.PrimExpr


TASK_WORKERS = 64  # parallel workers a kernel's tasks are cut into (contiguous runs, as threads take them)


@T.macro
def task_runs(n_tasks, scratch_of, task_body, context):
    # tasks 0 .. n_tasks - 1 in TASK_WORKERS contiguous runs, task_body(context, task, scratch) each;
    # a run allocates its tasks' scratch once (scratch_of(), or None without): TVM 0.27 makes a
    # buffer of 1 KiB or more a workspace call, and a batch of 2048 x 8 one-token rows made 16384
    # tasks of ~30 such calls each
    for worker in T.parallel(TASK_WORKERS):
        scratch = T.meta_var(scratch_of() if scratch_of is not None else None)
        for task in range(worker * n_tasks // TASK_WORKERS, (worker + 1) * n_tasks // TASK_WORKERS):
            task_body(context, task, scratch)


@T.macro
def _split_task(context, task, scratch):
    # task ``task`` of key_split_tasks: its batch, KV head and split
    grid, kernel, task_body, scratch_of = T.meta_var(context)
    b: T.int64 = task // (grid.num_kv_heads * grid.splits)
    g: T.int64 = task // grid.splits % grid.num_kv_heads
    split: T.int64 = task % grid.splits
    if scratch_of is None:
        task_body(kernel, b, g, split)
    else:
        task_body(kernel, b, g, split, scratch)


@T.macro
def key_split_tasks(grid, kernel, task_body, scratch_of=None):
    # a task per (batch, KV head, split): it owns its key tiles' dk/dv (no two tasks write one)
    # and its own query partials; run by task_runs (with ``scratch_of``, task_body takes the run's
    # scratch last)
    task_runs(grid.B * grid.num_kv_heads * grid.splits, scratch_of, _split_task,
              (grid, kernel, task_body, scratch_of))


@T.macro
def visible_query_tiles(grid, kernel, scratch, b, g, split, kt, pair_body):
    # every query head of g's group, and of each only the query tiles whose rows can see key tile kt
    for hr in range(grid.group):
        qlo, qhi = query_tile_range(grid.cfg, key_first=kt * grid.block_k,
                                    key_last=T.min(kt * grid.block_k + grid.block_k, grid.Sk) - 1,
                                    num_queries=grid.Sq, delta=grid.Sk - grid.Sq, block_q=grid.block_q)
        for qt in range(qlo, qhi):
            pair_body(kernel, scratch, grid.pair(b, g, split, hr, qt, kt))


def split_sum(partial, splits: int, live=None):
    """``partial(0) + partial(1) + ... + partial(splits - 1)`` in split order, as one expression; with
    ``live`` (a run-time count) the splits from ``live`` on count 0."""
    total = T.float32(0)
    for c in range(splits):
        total = total + (partial(c) if live is None else T.Select(c < live, partial(c), T.float32(0)))
    return total


@T.macro
def sum_split_partials(part, out, B, Hq, Sq, D, splits, dtype):
    # out[b, h, i, d] = sum over the splits c of part[c, b, h, i, d], in split order (deterministic):
    # the key-split tasks (the backward's dq, the double backward's q_grad) each write their own
    # partial, so no two tasks add into one row
    # (the sum is one expression over the splits, a vector of d at a time: a local accumulator per
    # element was a heap block per element in TVM 0.27, a million allocations at S 2048)
    for bh in T.parallel(B * Hq):
        for i in range(Sq):
            for d in T.vectorized(D):
                out[bh // Hq, bh % Hq, i, d] = split_sum(lambda c: part[c, bh // Hq, bh % Hq, i, d],
                                                         splits).astype(dtype)

