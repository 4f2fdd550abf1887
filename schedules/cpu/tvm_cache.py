"""CPU kernels for TVM's own paged KV cache: the attention slots of ``relax.frontend.nn.llm``'s
``PagedKVCache`` (``vm.builtin.paged_attention_kv_cache_create``, what MLC-LLM serves from), with
the signatures and semantics of TVM 0.27's kernels for those slots, so the runtime calls them in
TVM's place.

TVM's cache is read through ``schedules.layouts`` (its pages, CSR page tables and ``length_info``
forms) and each slot's parameters are declared by ``schedules.tvm_params`` (the CUDA kernels'
too, ``schedules.cuda.tvm_cache``). Its semantics:

* scores in log2 units, ``s = q . k * sm_scale * log2 e``: ``lse = m + log2(sum 2^(s - m))``, and
  ``-5e4`` with an output of 0 for a sequence without keys (TVM's initial running max);
* ``rotary_mode`` 1 (TVM's RopeMode.INLINE): q rotated at ``q_rope_position[b]`` and key j at
  ``k_rope_pos_offset[b] + j``, over the whole head dim, at the frequencies ``rope_freq`` gives
  (the cache's ``rope_scaling`` through TVM's ``position_embedding.switch_rope_freq_func``, which
  ``tvm_fuel.kv_cache`` passes; default: ``ragged.default_rope_freq``), each rotated value rounded to
  the cache dtype as TVM's kernels round it.

A decode task is one (sequence, KV head): its GQA group's query rows, the keys packed a tile at a
time into registers-friendly [D, block_k] and [block_k, D] tiles (through the page table, rotated
where asked) and run through the forward kernels' online-softmax macros (``ForwardMacros``). A
prefill task is one (sequence, KV head, row tile) over key tiles packed once per (sequence, KV
head). Both are ``ragged``'s (``RaggedTask``, ``prefill_phases``), which ``varlen`` shares.

Contents:
    decode       -- PrimFunc batch_decode_paged_kv_cpu (and ``_sliding_window``)
    prefill      -- PrimFunc batch_prefill_paged_kv_cpu (cached keys; ``_sliding_window``) or
                    batch_prefill_ragged_kv
    tree_attention -- PrimFunc batch_tree_attn (ragged) or tree_attn_paged_kv_cpu
    merge_state  -- PrimFunc merge_state_inplace_cpu: (v, s) <- the merge of two partial states
"""

from __future__ import annotations

from dataclasses import replace
from typing import Callable

from tvm import tirx
from tvm.script import tirx as T

from tvm_fuel.op.config import AttnConfig
from ..common import finish, KernelSpec
from ..tvm_params import merge_kernel, prefill_causal_rule, tvm_kernel
from .forward import ForwardBuffers, RowTile
from .ragged import prefill_phases, RaggedTask, task_scratch
from .tiles import CpuTiles, STREAMING_ROWS


def _check(where: str, spec: KernelSpec, tiles: CpuTiles):
    if tiles.block_q < spec.group or tiles.kv_heads != 1:
        raise ValueError(f"tvm_cache.{where}: tiles must hold the GQA group of {spec.group} rows (block_q "
                         f"{tiles.block_q}) for one KV head a task (kv_heads {tiles.kv_heads})")


def decode(spec: KernelSpec, tiles: CpuTiles, *, page_size: int, sliding_window: bool,
           rope_freq: Callable | None = None) -> tirx.PrimFunc:
    """TVM's ``batch_decode_paged_kv_cpu`` (``_sliding_window``): q [B, Hq, D] against each
    sequence's cached keys; output [B, Hq, D] (q's dtype), lse [B, Hq] float32 (log2 units).

    A group of at most ``STREAMING_ROWS`` rows streams K and V in place (``PagedTile.stream_tile``,
    the decode of fuel's own paged kernel); a larger group, and keys rotated in the kernel
    (rotary_mode 1), pack each key tile and run the register-tiled GEMMs."""
    _check("decode", spec, tiles)
    Hkv, D, group = spec.num_kv_heads, spec.head_dim, spec.group
    BK = tiles.block_k
    streaming = tiles.block_q <= STREAMING_ROWS
    task = RaggedTask(spec, tiles, rope_freq)

    @T.macro
    def body(a, causal, rotary_mode, rope_scale, rope_theta, sm_scale):
        q, output, lse, q_rope_position, B = T.meta_var((a.q, a.output, a.lse, a.q_rope_position, a.B))
        params = T.meta_var(ForwardBuffers(q=q, out=output))
        for task_id in T.parallel(B * Hkv):
            b: T.int64 = T.Cast("int64", task_id // Hkv)
            g: T.int64 = T.Cast("int64", task_id % Hkv)
            kv_len: T.int64 = a.kv_len(b)
            heads, Kt, Vt = T.meta_var(task_scratch(tiles, D))
            scratch = T.meta_var(heads.view(0))
            tile = T.meta_var(RowTile(group, b, g, T.int64(0), T.int64(group), kv_len=kv_len, delta=kv_len - 1,
                                      first_pos=T.int64(0), last_pos=T.int64(0)))
            cache = T.meta_var(a.keys(b))
            task.load_queries(scratch.Qs, q, lambda position: b, lambda position: q_rope_position[b], tile,
                              rotary_mode, rope_scale, rope_theta, sm_scale)
            task.body.init_state(scratch.O, scratch.m, scratch.l)
            lo, hi = T.meta_var(tile.key_tiles(spec.cfg, BK))
            for kt in range(lo, hi):
                if streaming and rotary_mode != 1:
                    task.paged.stream_tile(heads, params, cache, tile, kt)
                else:
                    task.packed_tile(scratch, Kt, Vt, params, cache, tile, kt, rotary_mode, rope_scale, rope_theta)
            task.store(scratch, output, lse, lambda position: b, tile)

    name = "batch_decode_paged_kv_cpu" + ("_sliding_window" if sliding_window else "")
    return finish(tvm_kernel("decode", spec, body, name=name, page_size=page_size, sliding_window=sliding_window))


def prefill(spec: KernelSpec, tiles: CpuTiles, *, keys: str, page_size: int = 16, sliding_window: bool = False,
            sliding_window_size: int = 1024, rope_freq: Callable | None = None) -> tirx.PrimFunc:
    """TVM's ``batch_prefill_paged_kv_cpu`` (``keys="paged"``: each sequence's cached keys) or
    ``batch_prefill_ragged_kv`` (``keys="ragged"``: k, v [total_kv, Hkv, D] by ``kv_indptr``):
    q [total_q, Hq, D] by ``q_indptr``, bottom-right causal where the run-time ``causal`` is
    non-zero; output [total_q, Hq, D], lse [total_q, Hq] float32 (log2 units).

    ``sliding_window`` (paged keys): TVM's ``batch_prefill_paged_kv_cpu_sliding_window``, the
    new tokens against the cached ones of a sliding-window sequence (length_info [3, B], sinks
    first), its causal rule TVM's cross-window one (``tvm_params.prefill_causal_rule``).

    Two parallel phases, as fuel's dense forward: every (sequence, KV head) packs its key tiles
    once (rotated where rotary_mode is 1) into workspaces of O(total keys * D); then every
    (sequence, KV head, tile of block_q rows) runs the register-tiled GEMMs over the tiles it sees."""
    if keys not in ("paged", "ragged"):
        raise ValueError(f"tvm_cache.prefill: keys must be 'paged' or 'ragged', got {keys!r}")
    if sliding_window and keys != "paged":
        raise ValueError("tvm_cache.prefill: sliding_window reads paged keys (keys='paged')")
    _check("prefill", spec, tiles)
    plain = RaggedTask(replace(spec, cfg=AttnConfig()), tiles, rope_freq)
    causal_cfg, after_keys = prefill_causal_rule(sliding_window, sliding_window_size)
    causal_task = RaggedTask(replace(spec, cfg=causal_cfg), tiles, rope_freq, queries_after_keys=after_keys)
    run = prefill_phases(spec, tiles, plain, causal_task)

    @T.macro
    def body(a, causal, rotary_mode, rope_scale, rope_theta, sm_scale):
        run(a, ForwardBuffers(q=a.q, out=a.output), causal, rotary_mode, rope_scale, rope_theta, sm_scale)

    if keys == "ragged":
        return finish(tvm_kernel("ragged", spec, body, name="batch_prefill_ragged_kv"))
    name = "batch_prefill_paged_kv_cpu" + ("_sliding_window" if sliding_window else "")
    return finish(tvm_kernel("paged", spec, body, name=name, page_size=page_size, sliding_window=sliding_window))


def tree_attention(spec: KernelSpec, tiles: CpuTiles, *, keys: str, page_size: int = 16,
                   rope_freq: Callable | None = None) -> tirx.PrimFunc:
    """TVM's tree attention (speculative decoding: the new tokens are a token tree), q
    [total_q, Hq, D] by ``q_indptr``; output [total_q, Hq, D], lse [total_q, Hq] float32 (log2):

    * ``keys="ragged"``: ``batch_tree_attn(q, q_indptr, k [total_kv, Hkv, D], v, kv_indptr,
      q_rope_position, mn_indptr [B + 1], mask [n, 2] int32, output, lse, rotary_mode, rope_scale,
      rope_theta, sm_scale)``: the tree's tokens among themselves, key j rotated at its node's
      position ``q_rope_position[kv_indptr[b] + j]``;
    * ``keys="paged"``: ``tree_attn_paged_kv_cpu(q, q_indptr, pages, page_indptr, page_values,
      length_info [B], k_rope_pos_offset, q_rope_position, output, lse, rotary_mode, rope_scale,
      rope_theta, sm_scale, tree_order_indptr [B + 1], tree_order [n, 2] int32)``: against the
      sequence's cached keys, the tree's nodes their last.

    The tree rule is a boolean mask (``TreeMask``) read per score; otherwise ``prefill``'s kernel."""
    if keys not in ("paged", "ragged"):
        raise ValueError(f"tvm_cache.tree_attention: keys must be 'paged' or 'ragged', got {keys!r}")
    _check("tree_attention", spec, tiles)
    masked = RaggedTask(replace(spec, cfg=AttnConfig(), mask_dtype="bool"), tiles, rope_freq)
    run = prefill_phases(spec, tiles, masked, None)

    @T.macro
    def body(a, causal, rotary_mode, rope_scale, rope_theta, sm_scale):
        run(a, ForwardBuffers(q=a.q, out=a.output, mask=a.tree_mask()), causal, rotary_mode, rope_scale, rope_theta,
            sm_scale)

    if keys == "ragged":
        return finish(tvm_kernel("tree", spec, body, name="batch_tree_attn"))
    return finish(tvm_kernel("tree_paged", spec, body, name="tree_attn_paged_kv_cpu", page_size=page_size))


def merge_state(dtype: str, lanes: int) -> tirx.PrimFunc:
    """TVM's ``merge_state_inplace_cpu`` (``tvm_params.merge_kernel``): rows in parallel, the head
    dim vectorized."""

    @T.macro
    def rows(extent, merge_row):
        for row in T.parallel(extent):
            merge_row(row)

    return finish(merge_kernel(dtype, rows, name="merge_state_inplace_cpu", lanes=lanes))


__all__ = ["decode", "prefill", "tree_attention", "merge_state"]
