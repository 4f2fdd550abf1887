"""CUDA kernels for TVM's own paged KV cache: the attention slots of ``relax.frontend.nn.llm``'s
``PagedKVCache`` on a GPU, with the signatures, global symbols and semantics of TVM 0.27's CUDA
kernels for those slots (the cache's formats: ``schedules.layouts``; the CPU kernels:
``schedules.cpu.tvm_cache``).

Every slot is fuel's CUDA forward kernel (``forward.ForwardMacros``: FlashAttention-2 blocks, K/V
tiles through a ``cp.async`` pipeline, tensor cores for float16/bfloat16) with TVM's I/O: ragged
queries [total_q, Hq, D] by ``q_indptr`` (decode: one row per sequence), keys read through a
layout object (``TvmPages`` for the pages, ``RaggedKeys`` for a step's new keys), the run-time
``sm_scale``, lse in log2 units (``EMPTY_LSE`` for a row without keys), the run-time ``causal``
flag (a causal and a plain grid, the one it does not choose given no rows). No split-KV. The
parameters are declared by ``schedules.tvm_params`` (the CPU kernels' too).

``rotary_mode`` 1 (RoPE in the kernel, TVM's RopeMode.INLINE) is refused by a host-side check
naming it: TVM's own FlashInfer path refuses it too; a cache rotates at append (RopeMode.NORMAL).

Contents:
    decode        -- PrimFunc batch_decode_paged_kv (``_sliding_window``)
    prefill       -- PrimFunc batch_prefill_paged_kv (``_sliding_window``) or batch_prefill_ragged_kv
    tree_attention -- PrimFunc batch_tree_attn or tree_attn_paged_kv
    merge_state   -- PrimFunc merge_state_inplace
"""

from __future__ import annotations

from dataclasses import replace

from tvm import tirx
from tvm.script import tirx as T

from tvm_fuel.op.config import AttnConfig
from ..common import finish, KernelSpec
from ..tvm_params import merge_kernel, prefill_causal_rule, TvmArgs, tvm_kernel
from .device import F32, Launch
from .forward import ForwardBuffers, ForwardMacros
from .tiles import CudaTiles

INLINE_ROPE = ("fuel's CUDA kernels for TVM's cache: rotary_mode 1 (RoPE in the kernel) is not supported; "
               "create the cache with RopeMode.NORMAL (RoPE applied as keys are appended)")


def _bodies(spec: KernelSpec, tiles: CudaTiles, launch: Launch, *, causal_cfg: AttnConfig | None,
            mask: bool = False, queries_after_keys: bool = False):
    """(plain, causal) forward bodies over a layout's keys (causal None where the kernel has none)."""
    if tiles.splits != 1:
        raise ValueError(f"tvm_cache: TVM's cache kernels run without split-KV, got splits {tiles.splits}")
    base = replace(spec, return_lse=True, mask_dtype="bool" if mask else None)
    plain = ForwardMacros(replace(base, cfg=AttnConfig()), tiles, launch, paged=True)
    causal = None if causal_cfg is None else ForwardMacros(replace(base, cfg=causal_cfg), tiles, launch, paged=True,
                                                           queries_after_keys=queries_after_keys)
    return plain, causal


def _buffers(args: TvmArgs, sm_scale, mask=None) -> ForwardBuffers:
    """TVM-cache I/O for the forward body: K and V only through ``args.keys(b)``; no split partials."""
    part_o = T.alloc_buffer((1, 1, 1, 1, 1), F32)
    part_stats = T.alloc_buffer((1, 1, 1, 1, 2), F32)
    return ForwardBuffers(args.q, None, None, args.output, part_o, part_stats, mask=mask, lse=args.lse,
                          keys=args.keys, sm_scale=sm_scale, lse_log2=True)


def _run(plain: ForwardMacros, causal: ForwardMacros | None, *, tree: bool = False):
    """The kernel body (``tvm_params.tvm_kernel``'s): the grid over (row tile, sequence, KV head);
    with a causal body both grids launch, the one the run-time flag does not choose given no rows
    (a host condition around a grid would hold its barriers); ``tree``: the tree rule as the mask."""

    @T.macro
    def run(args, causal_flag, rotary_mode, rope_scale, rope_theta, sm_scale):
        assert rotary_mode != 1, INLINE_ROPE
        prm = T.meta_var(_buffers(args, sm_scale, args.tree_mask() if tree else None))
        # the grid's rows: any sequence's query rows at most (decode: one each; a prefill's x blocks
        # past a sequence's rows walk no keys)
        rows = T.meta_var(T.int64(1) if args.q_indptr is None else T.Cast("int64", args.total_q))
        if causal is None:
            plain.launch_ragged(prm, args.B, rows, args.q_start, args.q_len, args.kv_len)
        else:
            causal.launch_ragged(prm, args.B, rows, args.q_start,
                                 lambda b: T.Select(causal_flag > 0, args.q_len(b), T.int64(0)), args.kv_len)
            plain.launch_ragged(prm, args.B, rows, args.q_start,
                                lambda b: T.Select(causal_flag > 0, T.int64(0), args.q_len(b)), args.kv_len)

    return run


def decode(spec: KernelSpec, tiles: CudaTiles, launch: Launch, *, page_size: int,
           sliding_window: bool) -> tirx.PrimFunc:
    """TVM's ``batch_decode_paged_kv`` (``_sliding_window``): q [B, Hq, D] against each sequence's
    cached keys (a block per (sequence, KV head): the group's query rows); output [B, Hq, D], lse
    [B, Hq] float32 (log2 units)."""
    body = _run(*_bodies(spec, tiles, launch, causal_cfg=None))
    name = "batch_decode_paged_kv" + ("_sliding_window" if sliding_window else "")
    return finish(tvm_kernel("decode", spec, body, name=name, page_size=page_size, sliding_window=sliding_window))


def prefill(spec: KernelSpec, tiles: CudaTiles, launch: Launch, *, keys: str, page_size: int = 16,
            sliding_window: bool = False, sliding_window_size: int = 1024) -> tirx.PrimFunc:
    """TVM's ``batch_prefill_paged_kv`` (``keys="paged"``; ``_sliding_window``) or
    ``batch_prefill_ragged_kv`` (``keys="ragged"``), the CPU kernels' semantics
    (``schedules.cpu.tvm_cache.prefill``): a block per (sequence, KV head, tile of query rows),
    the grid's x extent the step's total rows (a block past its sequence's rows does nothing; a
    batch of many short sequences launches many such blocks)."""
    if keys not in ("paged", "ragged"):
        raise ValueError(f"tvm_cache.prefill: keys must be 'paged' or 'ragged', got {keys!r}")
    if sliding_window and keys != "paged":
        raise ValueError("tvm_cache.prefill: sliding_window reads paged keys (keys='paged')")
    causal_cfg, after_keys = prefill_causal_rule(sliding_window, sliding_window_size)
    body = _run(*_bodies(spec, tiles, launch, causal_cfg=causal_cfg, queries_after_keys=after_keys))
    if keys == "ragged":
        return finish(tvm_kernel("ragged", spec, body, name="batch_prefill_ragged_kv"))
    name = "batch_prefill_paged_kv" + ("_sliding_window" if sliding_window else "")
    return finish(tvm_kernel("paged", spec, body, name=name, page_size=page_size, sliding_window=sliding_window))


def tree_attention(spec: KernelSpec, tiles: CudaTiles, launch: Launch, *, keys: str,
                   page_size: int = 16) -> tirx.PrimFunc:
    """TVM's ``batch_tree_attn`` (``keys="ragged"``) or ``tree_attn_paged_kv`` (``keys="paged"``),
    the CPU kernels' semantics (``schedules.cpu.tvm_cache.tree_attention``): the tree rule a
    boolean mask (``layouts.TreeMask``) every score is checked against."""
    if keys not in ("paged", "ragged"):
        raise ValueError(f"tvm_cache.tree_attention: keys must be 'paged' or 'ragged', got {keys!r}")
    body = _run(*_bodies(spec, tiles, launch, causal_cfg=None, mask=True), tree=True)
    if keys == "ragged":
        return finish(tvm_kernel("tree", spec, body, name="batch_tree_attn"))
    return finish(tvm_kernel("tree_paged", spec, body, name="tree_attn_paged_kv", page_size=page_size))


def merge_state(dtype: str, launch: Launch) -> tirx.PrimFunc:
    """TVM's ``merge_state_inplace`` (``tvm_params.merge_kernel``): a thread per (n, h) row."""
    NT = launch.threads

    @T.macro
    def rows(extent, merge_row):
        for bx in launch.grid((extent + NT - 1) // NT, "x"):
            for tx in launch.block():
                if T.Cast("int64", bx) * NT + tx < extent:
                    merge_row(T.Cast("int64", bx) * NT + tx)

    return finish(merge_kernel(dtype, rows, name="merge_state_inplace"))


__all__ = ["decode", "prefill", "tree_attention", "merge_state", "INLINE_ROPE"]
