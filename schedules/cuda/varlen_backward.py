"""CUDA kernel of FlashAttention's packed variable-length backward (``flash_attn_varlen_func``'s
gradient): q, do, out, dq [total_q, Hq, D], k, v, dk, dv [total_k, Hkv, D] in the input dtype
(float16, bfloat16 or float32), lse [Hq, total_q] float32 (natural log), cu_seqlens_q and
cu_seqlens_k [B + 1] int32; sequence b at q rows ``cu_seqlens_q[b]:cu_seqlens_q[b + 1]`` and k, v
rows ``cu_seqlens_k[b]:cu_seqlens_k[b + 1]``.

Every option applies per sequence, as ``reference.flash_attn_varlen_backward`` and the floor
(``tvm_fuel.op.ragged``) apply it: bottom-right causal, window, softcap, sink tokens, ALiBi
``-slope_h * |i + Sk_b - Sq_b - j|``, GQA. Rows of q in no sequence get dq = 0, rows of k, v in
no sequence (or in a sequence without queries) dk = dv = 0.

The three kernels of fuel's dense CUDA backward (``backward.BackwardMacros``: FlashAttention-2,
register tiles for float16/bfloat16, SIMT for float32, ``cp.async`` pipelines) over packed rows:

1. ``D = rowsum(do * out)`` over the total_q x Hq rows (one thread per row) into a float32
   scratch [total_q, Hq].
2. dk / dv: the grid's x blocks tile the rows of k as the forward's tile the rows of q
   (``varlen.sequence_search``): virtual key sequences v = 0 (rows before cu_seqlens_k[0]),
   b + 1 (sequence b), B + 1 (rows past cu_seqlens_k[B]), ``block_k`` keys a tile,
   ``floor(total_k / block_k) + B + 2`` blocks; y: the KV heads. A block walks only the query
   tiles of its sequence (every head of the GQA group) that see its key tile
   (``query_tile_range`` with Sq_b, Sk_b): the cost follows sum_b Sq_b * Sk_b.
3. dq: the same over the rows of q (``block_q`` queries a tile), y the query heads; a block walks
   the key tiles of its sequence its rows see (deterministic: no atomics).

A block past its virtual sequence's tiles (at most one per virtual sequence, and the grid's
tail) walks nothing and writes nothing. The blocks index the packed tensors through
``varlen.PackedRows`` (position i of the block's sequence is row start + i), so the dense
kernel's macros run unchanged.

Safety: a device kernel cannot assert: every offset read is clamped (``sequence_search``), so
no buffer is read or written out of bounds whatever the offsets; offsets that decrease or
overrun give garbage rows, never a fault. The host (CPU targets: the floor) checks them. No
attention sinks (a call with sinks is given the sinks' out and lse: ``tuned_legalize_map``), no mask.

Shared memory per block: the dense backward's (``tiles.backward_smem``). Registers: a block
holds its sequence facts (int64) beside the dense kernel's state; the float32 (SIMT) blocks are
``__launch_bounds__(threads, 1)`` so ptxas keeps them in registers (at its default occupancy
target it spilled a few bytes on sm_80).

Contents:
    varlen_backward -- PrimFunc fuel_flash_attn_varlen_backward_cuda(q, k, v, do, cu_seqlens_q,
                       cu_seqlens_k, [alibi_slopes], out, lse, dq, dk, dv)
"""

from __future__ import annotations

from tvm import tirx
from tvm.script import tirx as T

from ..common import KernelSpec, check_packed, drop_params, finish, kernel_params
from .backward import BackwardBuffers, BackwardMacros, KeyBlock, QueryBlock
from .device import F32, HALF_TYPES, Launch
from .tiles import CudaTiles, backward_strips
from .varlen import (LEN, OTHER_LEN, OTHER_START, ROW0, SEQ, START, PackedRows, sequence_search,
                     varlen_blocks)

GRADS = ("dq", "dk", "dv")


def _check(spec: KernelSpec, tiles: CudaTiles):
    check_packed(spec, "varlen_backward")
    problem = backward_strips(tiles) if spec.dtype in HALF_TYPES else None
    if problem:  # register tiles (float16/bfloat16): every warp owns whole 16-row strips
        raise ValueError(f"varlen_backward: {problem}")


def _packed(bufs: BackwardBuffers, q_start, k_start) -> BackwardBuffers:
    """The kernel's buffers as one sequence's dense [B, H, S, D] tensors (lse and D as [B, Hq, S]; the
    batch index unused): its queries from row ``q_start``, its keys from ``k_start``."""
    queries, keys = (lambda x: PackedRows(x, q_start)), (lambda x: PackedRows(x, k_start))
    return BackwardBuffers(q=queries(bufs.q), k=keys(bufs.k), v=keys(bufs.v), do=queries(bufs.do), alibi=bufs.alibi,
                           mask=None, out=None, lse=queries(bufs.lse), row_dot=queries(bufs.row_dot),
                           dq=queries(bufs.dq), dk=keys(bufs.dk), dv=keys(bufs.dv))


def varlen_backward(spec: KernelSpec, tiles: CudaTiles, *, launch: Launch | None = None) -> tirx.PrimFunc:
    """``fuel_flash_attn_varlen_backward_cuda(q [total_q, Hq, D], k, v [total_k, Hkv, D], do
    [total_q, Hq, D], cu_seqlens_q [B + 1] int32, cu_seqlens_k [B + 1] int32, alibi_slopes [Hq]
    float32 (``spec.has_alibi``), out [total_q, Hq, D], lse [Hq, total_q] float32, dq [total_q,
    Hq, D], dk [total_k, Hkv, D], dv [total_k, Hkv, D])``, q's dtype throughout but lse and
    alibi_slopes; total_q, total_k and B symbolic (module docstring). ``tiles`` as for
    ``backward.flash_backward`` at this dtype and head dim; ``launch`` defaults to
    ``tiles.threads`` threads a block."""
    _check(spec, tiles)
    launch = launch or Launch(tiles.threads)
    body = BackwardMacros(spec, tiles, launch, GRADS)
    Hq, Hkv, BQ, BK, NT, local = spec.num_q_heads, spec.num_kv_heads, tiles.block_q, tiles.block_k, launch.threads, \
        launch.local
    # the dk/dv blocks tile the keys (one KV head each), the dq blocks the queries (one query head each)
    key_sequence, query_sequence = sequence_search(1, BK), sequence_search(1, BQ)
    total_q, total_k, B1 = (tirx.Var(name, "int64") for name in ("total_q", "total_k", "B1"))  # B1: B + 1
    sizes = dict(total_q=total_q, total_k=total_k, B1=B1)

    @T.macro
    def sequence_blocks(total, block, heads, find_sequence, cu_rows, cu_other, total_other, block_body):
        # x: the tiles of `block` rows of every virtual sequence of the rows `cu_rows` offsets (B1 + 1
        # of them); y: the heads. block_body(seq, head, tx) with the block's sequence facts in seq
        for bx in launch.grid(varlen_blocks(total, B1 - 1, 1, block), "x"):
            for by in launch.grid(heads, "y"):
                for tx in launch.block():
                    seq = T.alloc_buffer((8,), "int64", scope=local)
                    find_sequence(seq, cu_rows, cu_other, total, total_other, B1, T.Cast("int64", bx))
                    if seq[ROW0] >= seq[LEN]:  # past its sequence's tiles: an empty block (walks, writes nothing)
                        seq[LEN] = T.int64(0)
                        seq[OTHER_LEN] = T.int64(0)
                        seq[ROW0] = T.int64(0)
                    # #pragma unroll for nvcc instead of TVM's expansion (see forward.py)
                    with T.attr(T.int32(0), "pragma_unroll_explicit", T.int32(0)):
                        if spec.dtype in HALF_TYPES:
                            block_body(seq, T.Cast("int64", by), tx)
                        else:
                            # SIMT: __launch_bounds__(threads, 1) lets ptxas keep the sequence facts in
                            # registers (its default occupancy target spilled them on sm_80)
                            with T.attr(T.int32(0), "tirx.launch_bounds_min_blocks_per_sm", T.int32(1)):
                                block_body(seq, T.Cast("int64", by), tx)

    @T.macro
    def key_block(bufs, seq, g, tx):
        # the key tile at seq[ROW0] of sequence seq[SEQ]: keys from seq[START], queries from seq[OTHER_START]
        prm = T.meta_var(_packed(bufs, seq[OTHER_START], seq[START]))
        body.key_block(prm, KeyBlock(b=seq[SEQ], g=g, j0=seq[ROW0], Sq=seq[OTHER_LEN], Sk=seq[LEN]), tx)

    @T.macro
    def query_block(bufs, seq, h, tx):
        # the query tile at seq[ROW0] of sequence seq[SEQ]: queries from seq[START], keys from seq[OTHER_START]
        prm = T.meta_var(_packed(bufs, seq[START], seq[OTHER_START]))
        body.query_block(prm, QueryBlock(b=seq[SEQ], h=h, i0=seq[ROW0], Sq=seq[LEN], Sk=seq[OTHER_LEN]), tx)

    # fmt: off
    @T.prim_func
    def fuel_flash_attn_varlen_backward_cuda(q_h: T.handle, k_h: T.handle, v_h: T.handle, do_h: T.handle,
                                             cu_seqlens_q_h: T.handle, cu_seqlens_k_h: T.handle,
                                             alibi_slopes_h: T.handle, out_h: T.handle, lse_h: T.handle,
                                             dq_h: T.handle, dk_h: T.handle, dv_h: T.handle):
        q, k, v, do, cu_seqlens_q, cu_seqlens_k, alibi_slopes, out, lse, dq, dk, dv = kernel_params(
            spec, sizes, q_h, k_h, v_h, do_h, cu_seqlens_q_h, cu_seqlens_k_h, alibi_slopes_h, out_h, lse_h, dq_h,
            dk_h, dv_h)
        # the blocks read lse[h, row] as [row, h], the layout of the D scratch
        lse_rows = T.decl_buffer((total_q, Hq), F32, data=lse.data, strides=(1, total_q))
        row_dot = T.alloc_buffer((total_q, Hq), F32)
        # T.meta_var: the bundle stays a Python value (an assignment would make it a TIR variable)
        bufs = T.meta_var(BackwardBuffers(q, k, v, do, alibi_slopes if spec.has_alibi else None, None, out,
                                          lse_rows, row_dot, dq, dk, dv))
        # 1. D = rowsum(do * out) of every row of q (at least one block: a grid of 0 blocks does not launch)
        for bx in launch.grid(T.max((total_q * Hq + NT - 1) // NT, 1), "x"):
            for tx in launch.block():
                body.row_dots(bufs, total_q * Hq, lambda e: (e // Hq, e % Hq), bx, tx)
        # 2. dk, dv: one block per (key tile of a virtual key sequence, KV head)
        sequence_blocks(total_k, BK, Hkv, key_sequence, cu_seqlens_k, cu_seqlens_q, total_q,
                        lambda seq, g, tx: key_block(bufs, seq, g, tx))
        # 3. dq: one block per (query tile of a virtual query sequence, query head)
        sequence_blocks(total_q, BQ, Hq, query_sequence, cu_seqlens_q, cu_seqlens_k, total_k,
                        lambda seq, h, tx: query_block(bufs, seq, h, tx))
    # fmt: on

    return finish(drop_params(fuel_flash_attn_varlen_backward_cuda, set() if spec.has_alibi else {"alibi_slopes"}))


__all__ = ["varlen_backward"]
