"""Where a paged kernel's tokens live, for every target: one small object per layout with the
methods the kernels read tokens through (``page(j)``, ``slot(j)``, ``k(page, slot, g, d)``,
``v(...)``, ``stored(kind, ...)`` (the element's load, for prefetches); ``rope_position(j)`` where
keys may be rotated in the kernel; ``page_dtype``, the integer dtype a kernel keeps page ids in).

* vLLM's layout (fuel's own paged ops): caches [num_blocks, block_size, Hkv, D] and a block
  table [B, max_blocks] (``BlockTable``); an 8-bit cache's ``k`` and ``v`` are dequantized, and
  ``raw`` and ``scale`` give the decoded element and what multiplies it (a streaming decode
  applies the scale per token).
* fuel's dense k, v [B, Hkv, Sk, D] (``DenseKeys``): a decode-shaped dense call streams its keys
  in place as a paged decode does.
* TVM's runtime cache (``relax.frontend.nn.llm``'s PagedKVCache, MLC-LLM's): pages
  [max_num_pages, 2, Hkv, page_size, D] (K, then V), a sequence's pages in CSR form
  (``page_indptr`` [B + 1] into ``page_values``), ``length_info`` [B] (the last page's used
  slots) or, with sliding windows, [3, B] (last page's slots, window offset, sink length): logical
  key j < sink at offset j, later ones at j - sink + offset (``TvmPages``, ``tvm_lengths``,
  ``tvm_kv_len``, ``tvm_cached_keys``); the keys of a step not yet paged, [total_kv, Hkv, D] by
  ``kv_indptr`` (``RaggedKeys``); speculative decoding's token trees (``TreeMask``); an empty
  sequence's lse, ``EMPTY_LSE`` (log2 units).

Contents:
    BlockTable, DenseKeys, TvmPages, RaggedKeys, TreeMask, tvm_lengths, tvm_kv_len, tvm_cached_keys, EMPTY_LSE
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from tvm import tirx
from tvm.script import tirx as T

from tvm_fuel.op import quant, semantics as sem

EMPTY_LSE = -5e4  # TVM's lse of a sequence without keys (its online softmax starts from m = -5e4, d = 1)


@dataclass(frozen=True)
class BlockTable:
    """Where a paged task's tokens live, in vLLM's layout: caches [num_blocks, block_size, Hkv, D]
    and a block table [B, max_blocks] (the sequence is ``b``). ``page(j)`` and ``slot(j)`` place
    token j; ``k`` and ``v`` read a head's element there. Another cache layout (TVM's pages) is
    another object with these four methods."""

    table: tirx.Buffer
    k_cache: tirx.Buffer
    v_cache: tirx.Buffer
    b: tirx.PrimExpr
    num_blocks: tirx.PrimExpr
    block_size: int
    k_scale: tirx.Buffer | None = None  # an 8-bit cache's scales ([], [Hkv] or [num_blocks, block_size, Hkv])
    v_scale: tirx.Buffer | None = None

    @property
    def quantized(self) -> bool:
        return str(self.k_cache.dtype) in quant.QUANT_DTYPES

    @property
    def page_dtype(self) -> str:
        """The dtype a kernel keeps page ids in: the table's (int64 only where the caller's is)."""
        return str(self.table.dtype)

    def page(self, j):
        # a live token's block id was validated before the kernel (CPU check); clamp all the same
        return T.max(T.min(T.Cast("int64", self.table[self.b, j // self.block_size]), self.num_blocks - 1),
                     T.int64(0))

    def slot(self, j):
        return j % self.block_size

    def k(self, page, slot, g, d):
        """K at (page, slot, head g, d): the cache's element, float32 and scaled for an 8-bit cache."""
        return self._scaled("k", page, slot, g, d)

    def v(self, page, slot, g, d):
        return self._scaled("v", page, slot, g, d)

    def stored(self, kind: str, page, slot, g, d):
        """The load of K's or V's (``kind``) stored element (its address is what a prefetch takes)."""
        return getattr(self, f"{kind}_cache")[page, slot, g, d]

    def raw(self, kind: str, page, slot, g, d):
        """K or V (``kind``) before its scale: float32 for an 8-bit cache, up to the constant
        factor ``scale`` folds in (``quant.decode_parts``), else the cache's element."""
        value = self.stored(kind, page, slot, g, d)
        return quant.decode_parts(value)[0] if self.quantized else value

    def scale(self, kind: str, page, slot, g):
        """What multiplies ``raw`` of K or V (``kind``) at (page, slot, head g): its scale (and the
        decoding's factor); None where that is 1."""
        factor = quant.decode_factor(self.k_cache.dtype)
        scale = getattr(self, f"{kind}_scale")
        if scale is None:
            return None if factor == 1 else T.float32(factor)
        scale = quant.scale_at(scale, page, slot, g)
        return scale if factor == 1 else scale * T.float32(factor)

    def _scaled(self, kind: str, page, slot, g, d):
        value, scale = self.raw(kind, page, slot, g, d), self.scale(kind, page, slot, g)
        return value if scale is None else value * scale


@dataclass(frozen=True)
class DenseKeys:
    """Batch b's keys of the dense k, v [B, Hkv, Sk, D] as ``BlockTable``'s methods read them: token
    j's "page" is its row, its slot 0 (a head's rows of one batch are one contiguous run)."""

    k_rows: tirx.Buffer
    v_rows: tirx.Buffer
    b: tirx.PrimExpr
    page_dtype = "int64"  # a row of Sk, an int64 dim

    def page(self, j):
        return sem.as_int64(j)

    def slot(self, j):
        return tirx.const(0, "int64")

    def k(self, page, slot, g, d):
        return self.k_rows[self.b, g, page, d]

    def v(self, page, slot, g, d):
        return self.v_rows[self.b, g, page, d]

    def stored(self, kind: str, page, slot, g, d):
        return getattr(self, kind)(page, slot, g, d)


@dataclass(frozen=True)
class TvmPages:
    """Where a sequence's tokens live in TVM's cache (the ``BlockTable`` methods ``PagedTile``
    reads): logical key j at offset j (a sink) or j - sink + window_offset, page
    ``page_values[first_page + offset // page_size]``, slot ``offset % page_size``."""

    pages: tirx.Buffer
    page_values: tirx.Buffer
    first_page: tirx.PrimExpr
    sink: tirx.PrimExpr
    window_offset: tirx.PrimExpr
    page_size: int
    rope_offset: tirx.PrimExpr  # key j is rotated at rope_offset + j (k_rope_pos_offset[b])

    def rope_position(self, j):
        return self.rope_offset + T.Cast("int32", j)

    @property
    def page_dtype(self) -> str:
        return str(self.page_values.dtype)  # TVM's int32: MLC-LLM's ForceNarrowIndexToInt32 refuses int64 buffers

    def offset(self, j):
        j = T.Cast("int32", j)
        return T.if_then_else(j < self.sink, j, j - self.sink + self.window_offset)

    def page(self, j):
        return T.Cast("int64", self.page_values[self.first_page + self.offset(j) // self.page_size])

    def slot(self, j):
        return self.offset(j) % self.page_size

    def k(self, page, slot, g, d):
        return self.pages[page, 0, g, slot, d]

    def v(self, page, slot, g, d):
        return self.pages[page, 1, g, slot, d]

    def stored(self, kind: str, page, slot, g, d):
        return getattr(self, kind)(page, slot, g, d)


@dataclass(frozen=True)
class RaggedKeys:
    """The keys of ``prefill_ragged`` (k, v [total_kv, Hkv, D], sequence b's from ``start``) as
    ``TvmPages``' methods read them: token j's "page" is its row, its slot 0. Key j is rotated at
    ``rope_offset + j``, or at ``positions[start + j]`` where the keys' positions are given (tree
    attention: the positions of the tree's nodes)."""

    k_rows: tirx.Buffer
    v_rows: tirx.Buffer
    start: tirx.PrimExpr
    rope_offset: tirx.PrimExpr = 0
    positions: tirx.Buffer | None = None

    def rope_position(self, j):
        if self.positions is not None:
            return self.positions[self.start + T.Cast("int32", j)]
        return self.rope_offset + T.Cast("int32", j)

    @property
    def page_dtype(self) -> str:
        return str(self.k_rows.shape[0].ty.dtype)  # a row of k, in its row dim's dtype (TVM's total_kv: int32)

    def page(self, j):
        return T.Cast("int64", self.start) + T.Cast("int64", j)

    def slot(self, j):
        return T.int32(0)

    def k(self, page, slot, g, d):
        return self.k_rows[page, g, d]

    def v(self, page, slot, g, d):
        return self.v_rows[page, g, d]

    def stored(self, kind: str, page, slot, g, d):
        return getattr(self, kind)(page, slot, g, d)


def tvm_lengths(length_info, b, sliding_window: bool):
    """(last page's used slots, window offset, sink length) of sequence b."""
    if sliding_window:
        return length_info[0, b], length_info[1, b], length_info[2, b]
    return length_info[b], T.int32(0), T.int32(0)


def tvm_kv_len(num_pages, lengths, page_size: int):
    """Keys of a sequence of ``num_pages`` pages and ``lengths`` (``tvm_lengths``), int64."""
    last_page_len, window_offset, sink = lengths
    return T.Cast("int64", T.if_then_else(num_pages > 0, (num_pages - 1) * page_size + last_page_len - window_offset
                                          + sink, 0))


def tvm_cached_keys(pages, page_values, page_indptr, length_info, k_rope_pos_offset, b, sliding_window: bool,
                 page_size: int) -> TvmPages:
    """Sequence b's cached keys in TVM's pages."""
    _, window_offset, sink = tvm_lengths(length_info, b, sliding_window)
    return TvmPages(pages, page_values, page_indptr[b], sink, window_offset, page_size, k_rope_pos_offset[b])


@dataclass(frozen=True)
class TreeMask:
    """TVM's tree-attention rule (``_check_tree_order``) as the boolean mask [B, 1, rows, keys]
    that ``common.visible`` reads, the sequence b of each element its own: the last ``tree_len``
    keys of sequence b are its tree's nodes (its queries the last ``qo_len`` of them), every key
    before them is visible, and node p is visible to node c iff p is c or an ancestor of c
    (``semantics.in_subtree`` of the nodes' depth-first (enter, exit) numbers, ``order`` [n, 2]
    int32 rows ``order_indptr[b]`` on). ``kv_len(b)``: the sequence's keys."""

    order: tirx.Buffer
    order_indptr: tirx.Buffer
    q_indptr: tirx.Buffer
    kv_len: Callable

    @property
    def shape(self):  # nominal: every index is clamped into the sequence's nodes below (an int32 bound: the
        n = tirx.const(2**31 - 1, "int64")  # readers' clamps to it stay int32 when MLC-LLM narrows indices)
        return (n, tirx.const(1, "int64"), n, n)

    def __getitem__(self, index):
        b, _, i, j = index
        i, j = sem.as_int64(i), sem.as_int64(j)
        first = sem.as_int64(self.order_indptr[b])
        tree_len = sem.as_int64(self.order_indptr[b + 1]) - first
        qo_len = sem.as_int64(self.q_indptr[b + 1] - self.q_indptr[b])
        tree_start = sem.as_int64(self.kv_len(b)) - tree_len
        last = sem.as_int64(self.order.shape[0]) - 1

        def node(n):  # row of node n (clamped: a vectorized select reads every lane, visible or not)
            return tirx.max(tirx.min(first + tirx.max(n, 0), last), 0)

        child, parent = node(i + tree_len - qo_len), node(j - tree_start)
        return tirx.any(j < tree_start, sem.in_subtree(self.order[child, 0], self.order[parent, 0],
                                                       self.order[parent, 1]))


__all__ = ["BlockTable", "DenseKeys", "TvmPages", "RaggedKeys", "TreeMask", "tvm_lengths", "tvm_kv_len",
           "tvm_cached_keys", "EMPTY_LSE"]
