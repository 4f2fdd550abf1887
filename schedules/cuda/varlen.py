"""CUDA kernel of FlashAttention's packed variable-length forward (``flash_attn_varlen_func``'s
layout): q [total_q, Hq, D], k, v [total_k, Hkv, D], sequence b at q rows
``cu_seqlens_q[b]:cu_seqlens_q[b + 1]`` and k, v rows ``cu_seqlens_k[b]:cu_seqlens_k[b + 1]``.

Every option of the spec's config applies per sequence, as ``reference.flash_attn_varlen`` and the
CPU kernel (``schedules.cpu.varlen``) apply it: bottom-right causal (query i of a sequence of Sq_b
queries and Sk_b keys at position i + Sk_b - Sq_b), window, softcap, sink tokens, ALiBi
``-slope_h * |i + Sk_b - Sq_b - j|``, GQA; lse natural-log [Hq, total_q]; a row without a visible
key gets 0 and an lse of -inf, and so do the rows that belong to no sequence (before
``cu_seqlens_q[0]`` or past ``cu_seqlens_q[B]``).

The blocks are fuel's CUDA forward (``forward.ForwardMacros.attend``: FlashAttention-2 blocks of
``block_q`` task rows, K/V tiles through a ``cp.async`` pipeline, register tiles for
float16/bfloat16) over ragged queries, as in TVM's ragged prefill (``tvm_cache``), with a grid
whose size follows the packed rows, not B times the longest sequence:

* Virtual sequences v = 0 .. B + 1 cover the rows of q: v = 0 the rows before cu_seqlens_q[0],
  v = b + 1 sequence b, v = B + 1 the rows past cu_seqlens_q[B] (the last two with no keys).
* Virtual sequence v's row tiles (ceil(rows_v * group / block_q) of them) are the grid's x blocks
  from ``tile_start(v) = floor(start_v * group / block_q) + v``; the starts never overlap (for
  offsets that never decrease), and ``floor(total_q * group / block_q) + B + 2`` blocks cover
  them all. A block finds its v by a binary search over the offsets (log2(B) reads, the same in
  every thread of the block); a block past its sequence's tiles (at most one per virtual
  sequence, and the grid's tail) walks no keys and writes nothing. The host needs no max_seqlen
  and no prefix sum; the y blocks are the KV heads.
* A block walks only the key tiles its rows can see (``ForwardMacros.key_walk``): the cost
  follows sum_b Sq_b * Sk_b.

Safety: a device kernel cannot assert, so every index taken from cu_seqlens is clamped (offsets
into [0, total], lengths >= 0, the sequence index into [0, B]) and no buffer is read out of
bounds whatever the offsets; offsets that decrease or overrun give garbage rows, never a fault.
The host (CPU targets: the floor and ``cpu.varlen``) checks them. No split-KV (``tiles.splits``
must be 1), no attention sinks, no mask.

Contents:
    varlen_forward -- PrimFunc fuel_flash_attn_varlen_cuda(q, k, v, cu_seqlens_q, cu_seqlens_k,
                      [alibi_slopes], out, [lse])
    varlen_blocks  -- the grid's x extent for a packed batch (sizes known on the host)
    sequence_search -- the block's virtual sequence by a binary search over the offsets (shared
                      with the packed backward, ``varlen_backward``)
    PackedRows     -- a packed tensor of one sequence as the dense kernels index it
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from tvm import tirx
from tvm.script import tirx as T

from ..common import check_packed, drop_params, finish, kernel_params, KernelSpec
from .device import F32, HALF_TYPES, Launch
from .forward import ForwardBuffers, ForwardMacros, RowBlock
from .tiles import CudaTiles, WarpLayout

# a block's sequence facts, one int64 register each (computed once per block, the same in every thread):
# the sequence index, the first row and row count of its rows (the ones the grid tiles) and of the
# other side's (keys for a grid over queries, queries for one over keys), its tile's first row, and
# the search's bounds
SEQ, START, LEN, OTHER_START, OTHER_LEN, ROW0, LO, HI = range(8)


def varlen_blocks(total_q, batch, group: int, block_q: int):
    """x blocks of the grid: ``floor(total_q * group / block_q) + batch + 2`` (enough for every
    row tile of the B + 2 virtual sequences; module docstring). Python ints or int64 expressions."""
    return total_q * group // block_q + batch + 2


@dataclass(frozen=True)
class PackedRows:
    """A packed tensor [total, H, ...] (q, k, v, their gradients; lse and D as [total, H] views)
    indexed as the dense kernels index [B, H, S, ...]: position ``pos`` of the block's sequence is
    row ``start + pos``. Reads by ``[...]``, writes by ``vstore`` (a TVMScript store takes a
    buffer only)."""

    rows: Any
    start: Any

    def _at(self, index):
        _, head, pos, *rest = index
        return [self.start + pos, head, *rest]

    def __getitem__(self, index):
        return self.rows[tuple(self._at(index))]

    def vstore(self, index, value):
        return self.rows.vstore(self._at(index), value)


def _clamp(x, hi):
    return T.max(T.min(T.Cast("int64", x), hi), T.int64(0))


def sequence_search(group: int, block: int):
    """Macro ``find_sequence(seq, cu_rows, cu_other, total_rows, total_other, B1, t)``: the facts
    (``SEQ`` ..) of grid block t, whose virtual sequences tile the rows of ``cu_rows`` (``group``
    task rows per row, ``block`` task rows per tile; module docstring): the sequence b (0 for the
    virtual ones), its rows, the other side's rows (``cu_other``; none for the virtual ones) and
    the tile's first task row. Every offset read is clamped into [0, total]."""

    @T.macro
    def virtual_start(seq, slot, v, cu_rows, total_rows, B1):
        # first row of virtual sequence v (0: row 0; 1 .. B1: cu_rows[v - 1], clamped; past: total_rows)
        if v == T.int64(0):
            seq[slot] = T.int64(0)
        elif v <= B1:
            seq[slot] = _clamp(cu_rows[v - 1], total_rows)
        else:
            seq[slot] = total_rows

    @T.macro
    def find_sequence(seq, cu_rows, cu_other, total_rows, total_other, B1, t):
        # the largest v in [0, B1] whose first tile is at most t: binary search (the search's
        # bounds in seq[LO], seq[HI]; seq[START] as scratch)
        seq[LO] = T.int64(0)
        seq[HI] = B1
        while seq[LO] < seq[HI]:
            mid: T.int64 = (seq[LO] + seq[HI] + 1) // 2
            virtual_start(seq, START, mid, cu_rows, total_rows, B1)
            if seq[START] * group // block + mid <= t:
                seq[LO] = mid
            else:
                seq[HI] = mid - 1
        seq[SEQ] = seq[LO]
        virtual_start(seq, OTHER_START, seq[SEQ] + 1, cu_rows, total_rows, B1)  # scratch: the next start
        virtual_start(seq, START, seq[SEQ], cu_rows, total_rows, B1)
        seq[LEN] = T.max(seq[OTHER_START] - seq[START], T.int64(0))
        # never negative: with offsets that decrease the search's v may start past t
        seq[ROW0] = T.max(t - (seq[START] * group // block + seq[SEQ]), T.int64(0)) * block
        # the other side: sequence b = v - 1 for 1 <= v <= B1 - 1 (then b + 1 <= B1 - 1 is an offset); none else
        if tirx.all(T.int64(1) <= seq[SEQ], seq[SEQ] <= B1 - 1):
            seq[OTHER_START] = _clamp(cu_other[seq[SEQ] - 1], total_other)
            seq[OTHER_LEN] = T.max(_clamp(cu_other[seq[SEQ]], total_other) - seq[OTHER_START], T.int64(0))
        else:
            seq[OTHER_START] = T.int64(0)
            seq[OTHER_LEN] = T.int64(0)
        seq[SEQ] = T.max(seq[SEQ] - 1, T.int64(0))  # the sequence index the block reports (b)

    return find_sequence


def _check(spec: KernelSpec, tiles: CudaTiles):
    check_packed(spec, "varlen_forward")
    if tiles.splits != 1:
        raise ValueError(f"varlen_forward: no split-KV over packed rows, got splits {tiles.splits}")
    problem = WarpLayout.of(tiles).problem(tiles) if spec.dtype in HALF_TYPES else None
    if problem:  # register tiles (float16/bfloat16): the warps must tile the block evenly
        raise ValueError(f"varlen_forward: {problem}")


def _grid(spec: KernelSpec, tiles: CudaTiles, launch: Launch):
    """Macro ``grid(q, k, v, cu_q, cu_k, alibi, out, lse_rows, total_q, total_k, B1)``: the kernel
    body (B1 = B + 1 offsets; ``lse_rows`` an [total_q, Hq] view of lse, or None)."""
    body = ForwardMacros(spec, tiles, launch, paged=False)
    attend, BQ, group, local = body.attend, tiles.block_q, spec.group, launch.local
    find_sequence = sequence_search(group, BQ)

    @T.macro
    def grid(q, k, v, cu_q, cu_k, alibi, out, lse_rows, total_q, total_k, B1):
        part_o = T.alloc_buffer((1, 1, 1, 1, 1), F32)  # no split-KV: the forward's partials unused
        part_stats = T.alloc_buffer((1, 1, 1, 1, 2), F32)
        # x: the row tiles of every virtual sequence (B1 + 1 of them); y: the KV heads. A block past
        # its sequence's rows walks no keys and writes nothing: no condition holds its barriers
        for bx in launch.grid(varlen_blocks(total_q, B1 - 1, group, BQ), "x"):
            for by in launch.grid(spec.num_kv_heads, "y"):
                for tx in launch.block():
                    seq = T.alloc_buffer((8,), "int64", scope=local)
                    find_sequence(seq, cu_q, cu_k, total_q, total_k, B1, T.Cast("int64", bx))
                    prm = T.meta_var(ForwardBuffers(q, PackedRows(k, seq[OTHER_START]),
                                                    PackedRows(v, seq[OTHER_START]), out, part_o, part_stats,
                                                    alibi=alibi, lse=lse_rows))
                    with T.attr(T.int32(0), "pragma_unroll_explicit", T.int32(0)):
                        attend(prm, RowBlock(b=seq[SEQ], g=T.Cast("int64", by), r0=seq[ROW0],
                                             rows=seq[LEN] * group, split=T.int64(0), Sq=seq[LEN],
                                             kv_len=seq[OTHER_LEN], group=group, q_start=seq[START]), tx)

    return grid


def varlen_forward(spec: KernelSpec, tiles: CudaTiles, *, launch: Launch | None = None) -> tirx.PrimFunc:
    """``fuel_flash_attn_varlen_cuda(q [total_q, Hq, D], k, v [total_k, Hkv, D], cu_seqlens_q
    [B + 1] int32, cu_seqlens_k [B + 1] int32, alibi_slopes [Hq] float32 (``spec.has_alibi``),
    out [total_q, Hq, D], lse [Hq, total_q] float32 (``spec.return_lse``))``: total_q, total_k
    and B symbolic (module docstring). ``tiles`` as for ``forward.dense_forward`` at this dtype
    and head dim, with ``splits`` 1; ``launch`` defaults to ``tiles.threads`` threads a block."""
    _check(spec, tiles)
    launch = launch or Launch(tiles.threads)
    grid = _grid(spec, tiles, launch)
    total_q, total_k, B1 = (tirx.Var(name, "int64") for name in ("total_q", "total_k", "B1"))  # B1: B + 1
    sizes = dict(total_q=total_q, total_k=total_k, B1=B1)
    unused = (set() if spec.has_alibi else {"alibi_slopes"}) | (set() if spec.return_lse else {"lse"})

    # fmt: off
    @T.prim_func
    def fuel_flash_attn_varlen_cuda(q_h: T.handle, k_h: T.handle, v_h: T.handle, cu_seqlens_q_h: T.handle,
                                    cu_seqlens_k_h: T.handle, alibi_slopes_h: T.handle, out_h: T.handle,
                                    lse_h: T.handle):
        q, k, v, cu_seqlens_q, cu_seqlens_k, alibi_slopes, out, lse = kernel_params(
            spec, sizes, q_h, k_h, v_h, cu_seqlens_q_h, cu_seqlens_k_h, alibi_slopes_h, out_h, lse_h)
        alibi = T.meta_var(alibi_slopes if spec.has_alibi else None)
        if spec.return_lse:
            # the forward stores lse[row, head]: a [total_q, Hq] view of lse [Hq, total_q]
            lse_rows = T.decl_buffer((total_q, spec.num_q_heads), "float32", data=lse.data, strides=(1, total_q))
            grid(q, k, v, cu_seqlens_q, cu_seqlens_k, alibi, out, lse_rows, total_q, total_k, B1)
        else:
            grid(q, k, v, cu_seqlens_q, cu_seqlens_k, alibi, out, None, total_q, total_k, B1)
    # fmt: on

    return finish(drop_params(fuel_flash_attn_varlen_cuda, unused))


__all__ = ["varlen_forward", "varlen_blocks", "sequence_search", "PackedRows"]
