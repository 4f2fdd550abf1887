"""CPU kernel of FlashAttention's packed variable-length forward (``flash_attn_varlen_func``'s
layout): q [total_q, Hq, D], k, v [total_k, Hkv, D], sequence b at q rows
``cu_seqlens_q[b]:cu_seqlens_q[b + 1]`` and k, v rows ``cu_seqlens_k[b]:cu_seqlens_k[b + 1]``.

Every option of the spec's config applies per sequence (bottom-right causal: query i of a sequence
of Sq_b queries and Sk_b keys at position i + Sk_b - Sq_b; window, softcap, sink tokens, ALiBi
``-slope_h * |i + Sk_b - Sq_b - j|``); the lse is natural-log [Hq, total_q], and a row without a
visible key gets an output of 0 and an lse of -inf (as ``reference.flash_attn_varlen``), and so
does a row past the last sequence.

It is TVM's ragged prefill (``ragged.prefill_phases``) with FlashAttention's conventions: every
(sequence, KV head) packs its whole key tiles once into workspaces of at most total_k * D floats
per KV head (the last, partial one is packed by each task), then every
(sequence, KV head, tile of block_q rows) runs the dense forward's register-tiled online softmax
over the key tiles its rows can see, so the cost follows sum_b Sq_b * Sk_b, not B * max^2.

cu_seqlens are validated in the kernel before anything else is read (start at 0, never
decrease, end at most at the packed length): a bad one raises, naming the argument.

Contents:
    check_offsets, check_packed_offsets -- the in-kernel checks of cu_seqlens (the backward's too)
    varlen_forward -- PrimFunc fuel_flash_attn_varlen_cpu(q, k, v, cu_seqlens_q, cu_seqlens_k,
                      [alibi_slopes], out, [lse])
"""

from __future__ import annotations

from dataclasses import replace

from tvm import tirx
from tvm.script import tirx as T

from ..common import check_packed, drop_params, finish, kernel_params, KernelSpec
from ..tvm_params import TvmArgs
from .decode import RowsForward
from .forward import ForwardBuffers
from .ragged import LSE_NATURAL, prefill_phases, RaggedTask
from .row_layouts import PackedSequence
from .tasks import task_runs
from .tiles import CpuTiles, STREAMING_ROWS

OP = "fuel.flash_attn_varlen"


def _offsets_message(op: str, name: str, packed: str) -> str:
    return f"{op}: {name} must start at 0, never decrease and end at most at {packed}.shape[0]"


@T.macro
def check_offsets(offsets, B1, packed_rows, message):
    # offsets[0] == 0, offsets[b] <= offsets[b + 1], offsets[B] <= packed_rows: every sequence's
    # rows lie in [0, packed_rows)
    assert offsets[0] == 0 and T.Cast("int64", offsets[B1 - 1]) <= packed_rows, message
    for b in range(B1 - 1):
        assert offsets[b] <= offsets[b + 1], message


@T.macro
def check_packed_offsets(cu_seqlens_q, cu_seqlens_k, B1, total_q, total_k, op):
    # both offsets of a packed batch (``op`` names the kernel's op), before anything is read through them
    assert B1 >= T.int64(1), f"{op}: cu_seqlens_q and cu_seqlens_k must hold B + 1 >= 1 offsets"
    check_offsets(cu_seqlens_q, B1, total_q, _offsets_message(op, "cu_seqlens_q", "q"))
    check_offsets(cu_seqlens_k, B1, total_k, _offsets_message(op, "cu_seqlens_k", "k"))


def varlen_forward(spec: KernelSpec, tiles: CpuTiles, *, workers: int = 64, rows: bool = False) -> tirx.PrimFunc:
    """``fuel_flash_attn_varlen_cpu(q [total_q, Hq, D], k, v [total_k, Hkv, D], cu_seqlens_q
    [B + 1] int32, cu_seqlens_k [B + 1] int32, alibi_slopes [Hq] float32 (``spec.has_alibi``),
    out [total_q, Hq, D], lse [Hq, total_q] float32 (``spec.return_lse``))``: total_q, total_k
    and B symbolic (module docstring). Any ``tiles`` serve (one KV head a task: ``kv_heads`` is
    not read). ``workers``: the parallel workers the row tiles are dealt to in turn
    (``ragged.prefill_phases``): a thread's share of 64 is every 64th tile in runs of 64 / threads,
    even on 2 threads fine enough that neighbouring tiles, of like cost, balance.

    ``rows`` (the rule's choice where max_seqlen bounds every sequence to a handful of rows and
    keys): one ``decode.RowsForward`` task per (sequence, KV head) takes its rows one at a time
    against its at most block_k keys (a longer sequence raises), nothing packed."""
    check_packed(spec, "varlen_forward")
    if tiles.block_q <= STREAMING_ROWS:
        tiles = replace(tiles, kv_heads=1)  # a streaming task's one KV head (prefill_phases)
    Hq, D, dtype = spec.num_q_heads, spec.head_dim, spec.dtype
    task = RaggedTask(spec, tiles, lse=LSE_NATURAL if spec.return_lse else None)
    total_q, total_k, B1 = (tirx.Var(name, "int64") for name in ("total_q", "total_k", "B1"))  # B1: B + 1
    sizes = dict(total_q=total_q, total_k=total_k, B1=B1)
    # the workspaces (allocated before the checks run) hold every sequence's whole key tiles: at
    # most total_k // block_k (a partial tile is packed by its tasks); never negative
    run = prefill_phases(spec, tiles, task, None, where=OP, workers=workers,
                         key_tiles=lambda a, block_k: total_k // block_k, stream=tiles.block_q <= STREAMING_ROWS)
    unused = (set() if spec.has_alibi else {"alibi_slopes"}) | (set() if spec.return_lse else {"lse"})
    rows_task = RowsForward(spec, tiles) if rows else None
    too_long = f"{OP}: this kernel takes sequences of at most {tiles.block_k} keys (cu_seqlens_k)"

    @T.macro
    def sequence_task(context, task, scratch):
        # the RowsForward task of (sequence, KV head) ``task``
        params, k, v, cu_q, cu_k = T.meta_var(context)
        b: T.int64 = task // spec.num_kv_heads
        q0: T.int64 = T.Cast("int64", cu_q[b])
        k0: T.int64 = T.Cast("int64", cu_k[b])
        seq = T.meta_var(PackedSequence(q0, k0, T.Cast("int64", cu_q[b + 1]) - q0, T.Cast("int64", cu_k[b + 1]) - k0))
        rows_task.task(params, k, v, seq, b, task % spec.num_kv_heads, scratch)

    @T.macro
    def sequence_rows(params, k, v, cu_q, cu_k, B):
        for b in range(B):
            assert cu_k[b + 1] - cu_k[b] <= tiles.block_k, too_long
        task_runs(B * spec.num_kv_heads, rows_task.scratch, sequence_task, (params, k, v, cu_q, cu_k))

    # fmt: off
    @T.prim_func
    def fuel_flash_attn_varlen_cpu(q_h: T.handle, k_h: T.handle, v_h: T.handle, cu_seqlens_q_h: T.handle,
                                   cu_seqlens_k_h: T.handle, alibi_slopes_h: T.handle, out_h: T.handle,
                                   lse_h: T.handle):
        q, k, v, cu_seqlens_q, cu_seqlens_k, alibi_slopes, out, lse = kernel_params(
            spec, sizes, q_h, k_h, v_h, cu_seqlens_q_h, cu_seqlens_k_h, alibi_slopes_h, out_h, lse_h)
        check_packed_offsets(cu_seqlens_q, cu_seqlens_k, B1, total_q, total_k, OP)
        args = T.meta_var(TvmArgs(B=B1 - 1, q=q, output=out, lse=lse if spec.return_lse else None, total_q=total_q,
                                  q_indptr=cu_seqlens_q, k=k, v=v, kv_indptr=cu_seqlens_k, total_kv=total_k))
        params = T.meta_var(ForwardBuffers(q=q, out=out, alibi=alibi_slopes if spec.has_alibi else None,
                                           lse=lse if spec.return_lse else None))
        if rows:
            sequence_rows(params, k, v, cu_seqlens_q, cu_seqlens_k, B1 - 1)
        else:
            # no run-time causal flag (the config is the spec's), no rotary embedding (rotary_mode 0)
            run(args, params, 0, 0, T.float32(1), T.float32(1), T.float32(spec.scale))
        # rows past the last sequence belong to none: 0 and -inf, as rows without a visible key
        for row in T.parallel(total_q - T.Cast("int64", cu_seqlens_q[B1 - 1])):
            for h, d in T.grid(Hq, D):
                out[T.Cast("int64", cu_seqlens_q[B1 - 1]) + row, h, d] = T.cast(0, dtype)
            if spec.return_lse:
                for h in range(Hq):
                    lse[h, T.Cast("int64", cu_seqlens_q[B1 - 1]) + row] = T.float32(float("-inf"))
    # fmt: on

    return finish(drop_params(fuel_flash_attn_varlen_cpu, unused))


__all__ = ["varlen_forward", "check_offsets", "check_packed_offsets"]
