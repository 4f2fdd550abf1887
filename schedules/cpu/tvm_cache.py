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
  ``k_rope_pos_offset[b] + j``, over the whole head dim, with the cache's ``rope_scaling``
  (TVM's ``position_embedding.switch_rope_freq_func``), each rotated value rounded to the cache
  dtype as TVM's kernels round it.

A decode task is one (sequence, KV head): its GQA group's query rows, the keys packed a tile at a
time into registers-friendly [D, block_k] and [block_k, D] tiles (through the page table, rotated
where asked) and run through the forward kernels' online-softmax macros (``ForwardMacros``).

Contents:
    decode       -- PrimFunc batch_decode_paged_kv_cpu (and ``_sliding_window``)
    prefill      -- PrimFunc batch_prefill_paged_kv_cpu (cached keys; ``_sliding_window``) or
                    batch_prefill_ragged_kv
    tree_attention -- PrimFunc batch_tree_attn (ragged) or tree_attn_paged_kv_cpu
    merge_state  -- PrimFunc merge_state_inplace_cpu: (v, s) <- the merge of two partial states
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

from tvm import tirx
from tvm.relax.frontend.nn.llm.position_embedding import switch_rope_freq_func
from tvm.script import tirx as T

from ...op import semantics as sem
from ...op.config import AttnConfig
from ..common import F32, finish, KernelSpec, row_position
from ..layouts import EMPTY_LSE
from ..tvm_params import merge_kernel, prefill_causal_rule, tvm_kernel
from .forward import ForwardBuffers, ForwardMacros, PagedTile, RowTile, Scratch
from .tiles import CpuTiles, STREAMING_ROWS



def _rope(load, d, position, head_dim: int, rope_scale, rope_theta, dtype: str, rope_scaling: dict[str, Any]):
    """Element d of a row rotated at ``position`` (TVM's ``_rope`` over the whole head dim):
    ``load(i)`` reads element i of the row."""
    cos_freq, sin_freq, bindings = switch_rope_freq_func(rope_scaling)(position * rope_scale, d, head_dim,
                                                                       rope_theta, "float32")
    half = head_dim // 2
    partner = tirx.if_then_else(d < half, -load(d + half), load(d - half))
    value = (cos_freq * load(d).astype(F32) + sin_freq * partner.astype(F32)).astype(dtype)
    for var, bound in bindings.items():
        value = tirx.Let(var, bound, value)
    return value


class _Task:
    """The macros of one (sequence, KV head, row tile) task over TVM's tokens, for one attention
    config (causal or not): queries loaded (rotated where asked) and scaled by the run-time
    sm_scale, key tiles packed (``packed_tile``, rotated where asked) or streamed (``paged``), the
    output and TVM's log2 lse stored. Rows pack (query position, head of the group) as fuel's
    forward kernels do."""

    def __init__(self, spec: KernelSpec, tiles: CpuTiles, rope_scaling: dict[str, Any], *,
                 queries_after_keys: bool = False):
        # queries_after_keys: the rows are the tokens after all of the keys (the sliding-window
        # prefill over cached keys only), not its last tokens
        D, group, dtype = spec.head_dim, spec.group, spec.dtype
        BQ, BK = tiles.block_q, tiles.block_k
        body = ForwardMacros(spec, tiles)
        paged = PagedTile(spec, tiles, body)
        self.body, self.paged = body, paged
        log2e = T.float32(sem.LOG2E)

        def rotated(load, d, position, rope_scale, rope_theta):
            return _rope(load, d, position, D, rope_scale, rope_theta, dtype, rope_scaling).astype(F32)

        @T.macro
        def load_queries(Qs, q, q_row, q_position, tile, rotary_mode, rope_scale, rope_theta, sm_scale):
            # row r: query head tile.row_head(r) of token q_row(position), rotated at q_position(position)
            for r, d in T.grid(BQ, D):
                Qs[r, d] = T.float32(0)
            for r in range(BQ):
                if tile.r0 + r < tile.head_rows:
                    for d in range(D):
                        if rotary_mode == 1:
                            Qs[r, d] = rotated(lambda i: q[q_row(tile.row_position(r)), tile.row_head(r), i], d,
                                               q_position(tile.row_position(r)), rope_scale, rope_theta)
                        else:
                            Qs[r, d] = q[q_row(tile.row_position(r)), tile.row_head(r), d].astype(F32)
                        Qs[r, d] = Qs[r, d] * sm_scale * log2e

        @T.macro
        def pack_tile(Kt, Vt, nonfinite, cache, g, kv_len, kt, rotary_mode, rope_scale, rope_theta):
            # the paged kernels' packing (PagedTile.pack_tile), then the keys rotated in place where
            # rotary_mode is 1: key j at cache.rope_position(j), rounded to the cache dtype as TVM rounds
            paged.pack_tile(Kt, Vt, nonfinite, cache, g, kv_len, kt)
            if rotary_mode == 1:
                row = T.alloc_buffer((D,), F32, scope="local")
                for c in range(BK):
                    j: T.int64 = kt * BK + c  # (bound first: LLVM codegen fails on the loop vars in RoPE's Lets)
                    if j < kv_len:
                        for d in range(D):
                            row[d] = Kt[d, c]
                        for d in range(D):
                            Kt[d, c] = rotated(lambda i: row[i], d, cache.rope_position(j), rope_scale, rope_theta)

        @T.macro
        def packed_tile(scratch, Kt, Vt, params, cache, tile, kt, rotary_mode, rope_scale, rope_theta):
            # key tile kt packed, then both GEMMs over it
            nonfinite = T.alloc_buffer((1,), F32, scope="local")
            pack_tile(Kt, Vt, nonfinite, cache, tile.g, tile.kv_len, kt, rotary_mode, rope_scale, rope_theta)
            body.attend_tile(scratch, Kt, Vt, params, tile, kt * BK, nonfinite[0] == T.float32(0))

        @T.macro
        def store(scratch, output, lse, q_row, tile):
            for r in range(BQ):
                if tile.r0 + r < tile.head_rows:
                    for d in range(D):
                        output[q_row(tile.row_position(r)), tile.row_head(r), d] = sem.normalize(
                            scratch.O[r, d], scratch.l[r]).astype(dtype)
                    lse[q_row(tile.row_position(r)), tile.row_head(r)] = T.Select(
                        scratch.l[r] == T.float32(0), T.float32(EMPTY_LSE),
                        sem.safe_row_max(scratch.m[r]) + T.log2(scratch.l[r]))

        @T.macro
        def attend_rows(q, output, lse, params, packed, b, g, t, kv_len, qo_len, q_start, q_rope_position,
                        rotary_mode, rope_scale, rope_theta, sm_scale):
            # row tile t of (sequence b, KV head g): its rows' queries against the sequence's key
            # tiles, packed beforehand (``packed.tile(kt)``: Kt, Vt and Vt's non-finite count)
            rows: T.int64 = qo_len * group
            if t * BQ < rows:
                scratch = T.meta_var(_scratch(tiles, D, packed=False)[0].view(0))
                tile = T.meta_var(RowTile(group, b, g, t * BQ, rows, kv_len=kv_len,
                                          delta=kv_len if queries_after_keys else kv_len - qo_len,
                                          first_pos=row_position(t * BQ, group),
                                          last_pos=row_position(T.min(t * BQ + BQ, rows) - 1, group)))
                load_queries(scratch.Qs, q, lambda position: q_start + position,
                             lambda position: q_rope_position[q_start + position], tile, rotary_mode, rope_scale,
                             rope_theta, sm_scale)
                body.init_state(scratch.O, scratch.m, scratch.l)
                lo, hi = T.meta_var(tile.key_tiles(spec.cfg, BK))
                for kt in range(lo, hi):
                    Kt, Vt, nonfinite = T.meta_var(packed.tile(kt))
                    body.attend_tile(scratch, Kt, Vt, params, tile, kt * BK, nonfinite[0] == T.float32(0))
                store(scratch, output, lse, lambda position: q_start + position, tile)

        self.load_queries, self.pack_tile, self.packed_tile, self.store = load_queries, pack_tile, packed_tile, store
        self.attend_rows = attend_rows


def _scratch(tiles: CpuTiles, D: int, packed: bool = True):
    """A task's buffers, allocated where it is called in a prim_func: the [1, ...] scratch
    (``PagedTile`` indexes per head) and, with ``packed``, a packed K and V tile."""
    BQ, BK, DP = tiles.block_q, tiles.block_k, tiles.padded_dim(D)
    scratch = Scratch(T.alloc_buffer((1, BQ, D), F32), T.alloc_buffer((1, BQ, BK), F32),
                      T.alloc_buffer((1, BQ, DP), F32), T.alloc_buffer((1, BQ), F32), T.alloc_buffer((1, BQ), F32),
                      T.alloc_buffer((1, BQ), F32))
    if not packed:
        return scratch, None, None
    return scratch, T.alloc_buffer((D, BK), F32), T.alloc_buffer((BK, DP), F32)


@dataclass(frozen=True)
class _PackedKeys:
    """Every (key tile, KV head) of a prefill's sequences, packed once into flat workspaces: sequence
    b's key tile kt of head g at index ``(first_tile + kt) * Hkv + g`` (``first_tile``: the key
    tiles of the sequences before b). ``tile(kt)`` gives its Kt [D, BK], Vt [BK, DP] and Vt's
    non-finite count [1] as views."""

    k_tiles: tirx.Buffer
    v_tiles: tirx.Buffer
    nonfinite: tirx.Buffer
    first_tile: tirx.PrimExpr
    g: tirx.PrimExpr
    num_kv_heads: int
    dims: tuple[int, int, int]  # D, BK, DP

    def tile(self, kt):
        D, BK, DP = self.dims
        index = (self.first_tile + kt) * self.num_kv_heads + self.g
        return (T.decl_buffer((D, BK), F32, data=self.k_tiles.data, elem_offset=index * (D * BK)),
                T.decl_buffer((BK, DP), F32, data=self.v_tiles.data, elem_offset=index * (BK * DP)),
                T.decl_buffer((1,), F32, data=self.nonfinite.data, elem_offset=index))


def _check(where: str, spec: KernelSpec, tiles: CpuTiles):
    if tiles.block_q < spec.group or tiles.kv_heads != 1:
        raise ValueError(f"tvm_cache.{where}: tiles must hold the GQA group of {spec.group} rows (block_q "
                         f"{tiles.block_q}) for one KV head a task (kv_heads {tiles.kv_heads})")


def decode(spec: KernelSpec, tiles: CpuTiles, *, page_size: int, sliding_window: bool,
           rope_scaling: dict[str, Any] | None = None) -> tirx.PrimFunc:
    """TVM's ``batch_decode_paged_kv_cpu`` (``_sliding_window``): q [B, Hq, D] against each
    sequence's cached keys; output [B, Hq, D] (q's dtype), lse [B, Hq] float32 (log2 units).

    A group of at most ``STREAMING_ROWS`` rows streams K and V in place (``PagedTile.stream_tile``,
    the decode of fuel's own paged kernel); a larger group, and keys rotated in the kernel
    (rotary_mode 1), pack each key tile and run the register-tiled GEMMs."""
    _check("decode", spec, tiles)
    Hkv, D, group = spec.num_kv_heads, spec.head_dim, spec.group
    BK = tiles.block_k
    streaming = tiles.block_q <= STREAMING_ROWS
    task = _Task(spec, tiles, rope_scaling or {})

    @T.macro
    def body(a, causal, rotary_mode, rope_scale, rope_theta, sm_scale):
        q, output, lse, q_rope_position, B = T.meta_var((a.q, a.output, a.lse, a.q_rope_position, a.B))
        params = T.meta_var(ForwardBuffers(q=q, out=output))
        for task_id in T.parallel(B * Hkv):
            b: T.int64 = T.Cast("int64", task_id // Hkv)
            g: T.int64 = T.Cast("int64", task_id % Hkv)
            kv_len: T.int64 = a.kv_len(b)
            heads, Kt, Vt = T.meta_var(_scratch(tiles, D))
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


def _prefill_phases(spec: KernelSpec, tiles: CpuTiles, plain: _Task, causal_task: _Task | None):
    """The macro of every prefill kernel: key tiles packed once per (sequence, KV head), then the
    (sequence, KV head, row tile) tasks over them (``causal_task`` where the run-time ``causal`` is
    non-zero; None: ``plain`` always)."""
    Hkv, D, group = spec.num_kv_heads, spec.head_dim, spec.group
    BQ, BK, DP = tiles.block_q, tiles.block_k, tiles.padded_dim(D)

    @T.macro
    def run(a, params, causal, rotary_mode, rope_scale, rope_theta, sm_scale):
        # a (TvmArgs): the kernel's parameters; max_tiles: a bound on the key tiles of all sequences,
        # from the parameters' shapes (the workspaces are allocated with the function, before any
        # statement runs): each sequence's keys fill its pages (its rows of k) but the last
        B = T.meta_var(a.B)
        max_tiles = T.meta_var((T.Cast("int64", a.nnz_pages) * a.page_size if a.pages is not None
                                else T.Cast("int64", a.total_kv)) // BK + B)
        # counts: first key tile of each sequence (and the total), the most row tiles of a sequence
        first_tile = T.alloc_buffer((B + 1,), "int64")
        most_rows = T.alloc_buffer((1,), "int64")
        first_tile[0] = T.int64(0)
        most_rows[0] = T.int64(0)
        for b in range(B):
            first_tile[b + 1] = first_tile[b] + (a.kv_len(b) + BK - 1) // BK
            most_rows[0] = T.max(most_rows[0], (a.q_len(b) * group + BQ - 1) // BQ)
        assert first_tile[B] <= max_tiles, "tvm_cache.prefill: the sequences' keys exceed their pages (indptr)"
        n_row_tiles: T.int64 = most_rows[0]
        k_tiles = T.alloc_buffer((max_tiles * Hkv * D * BK,), F32)
        v_tiles = T.alloc_buffer((max_tiles * Hkv * BK * DP,), F32)
        nonfinite = T.alloc_buffer((max_tiles * Hkv,), F32)
        for pack in T.parallel(T.Cast("int64", B) * Hkv):
            pb: T.int64 = pack // Hkv
            pg: T.int64 = pack % Hkv
            tiles_of = T.meta_var(_PackedKeys(k_tiles, v_tiles, nonfinite, first_tile[pb], pg, Hkv, (D, BK, DP)))
            for kt in range(first_tile[pb + 1] - first_tile[pb]):
                Kt, Vt, count = T.meta_var(tiles_of.tile(kt))
                plain.pack_tile(Kt, Vt, count, a.keys(pb), pg, a.kv_len(pb), kt, rotary_mode, rope_scale, rope_theta)
        for task_id in T.parallel(T.Cast("int64", B) * Hkv * n_row_tiles):
            b: T.int64 = task_id // (Hkv * n_row_tiles)
            g: T.int64 = task_id // n_row_tiles % Hkv
            packed = T.meta_var(_PackedKeys(k_tiles, v_tiles, nonfinite, first_tile[b], g, Hkv, (D, BK, DP)))
            args = T.meta_var((a.q, a.output, a.lse, params, packed, b, g, task_id % n_row_tiles, a.kv_len(b),
                               a.q_len(b), a.q_start(b), a.q_rope_position, rotary_mode, rope_scale, rope_theta,
                               sm_scale))
            if causal_task is None:
                plain.attend_rows(*args)
            elif causal > 0:
                causal_task.attend_rows(*args)
            else:
                plain.attend_rows(*args)

    return run


def prefill(spec: KernelSpec, tiles: CpuTiles, *, keys: str, page_size: int = 16, sliding_window: bool = False,
            sliding_window_size: int = 1024, rope_scaling: dict[str, Any] | None = None) -> tirx.PrimFunc:
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
    plain = _Task(replace(spec, cfg=AttnConfig()), tiles, rope_scaling or {})
    causal_cfg, after_keys = prefill_causal_rule(sliding_window, sliding_window_size)
    causal_task = _Task(replace(spec, cfg=causal_cfg), tiles, rope_scaling or {}, queries_after_keys=after_keys)
    run = _prefill_phases(spec, tiles, plain, causal_task)

    @T.macro
    def body(a, causal, rotary_mode, rope_scale, rope_theta, sm_scale):
        run(a, ForwardBuffers(q=a.q, out=a.output), causal, rotary_mode, rope_scale, rope_theta, sm_scale)

    if keys == "ragged":
        return finish(tvm_kernel("ragged", spec, body, name="batch_prefill_ragged_kv"))
    name = "batch_prefill_paged_kv_cpu" + ("_sliding_window" if sliding_window else "")
    return finish(tvm_kernel("paged", spec, body, name=name, page_size=page_size, sliding_window=sliding_window))


def tree_attention(spec: KernelSpec, tiles: CpuTiles, *, keys: str, page_size: int = 16,
                   rope_scaling: dict[str, Any] | None = None) -> tirx.PrimFunc:
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
    masked = _Task(replace(spec, cfg=AttnConfig(), mask_dtype="bool"), tiles, rope_scaling or {})
    run = _prefill_phases(spec, tiles, masked, None)

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
