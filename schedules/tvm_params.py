"""The parameters of TVM's paged-KV-cache kernels, declared once for every target: each slot's
buffers matched from its handles, in TVM 0.27's order and layout (``schedules.layouts`` reads
them). Called first in a ``@T.prim_func`` body, as ``common.kernel_params`` is.

Forms (TVM's kernels of the slots, after the handles: the scalars ``causal`` (prefills),
``rotary_mode``, ``rope_scale``, ``rope_theta``, ``sm_scale``):

* "decode": q [B, Hq, D], pages [max_num_pages, 2, Hkv, page_size, D], page_indptr [B + 1],
  page_values [nnz_pages], length_info [B] or [3, B], k_rope_pos_offset [B], q_rope_position [B],
  output [B, Hq, D], lse [B, Hq] float32;
* "paged" (a prefill over cached keys): q [total_q, Hq, D], q_indptr [B + 1], the pages as
  decode's, k_rope_pos_offset [B], q_rope_position [total_q], output, lse;
* "ragged": q, q_indptr, k, v [total_kv, Hkv, D], kv_indptr [B + 1], q_rope_position,
  k_rope_pos_offset, output, lse;
* "tree": q, q_indptr, k, v, kv_indptr, q_rope_position, mn_indptr, mask [n, 2] int32, output,
  lse (the indptrs [B + 1] of a batch known only from them);
* "tree_paged": "paged"'s, then tree_order_indptr [B + 1], tree_order [n, 2] int32.

Contents:
    TvmArgs, tvm_params -- the parameters of a form as buffers
    prefill_causal_rule -- what a prefill's run-time ``causal`` flag means (sliding window or not)
    tvm_kernel          -- a PrimFunc of a form's signature around a body macro
    merge_kernel        -- merge_state_inplace (the merge of two partial states) around a row loop
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from tvm import tirx
from tvm.script import tirx as T

from tvm_fuel.op.config import AttnConfig
from .layouts import RaggedKeys, TreeMask, tvm_cached_keys, tvm_kv_len, tvm_lengths
from .workload import KernelSpec

FORMS = ("decode", "paged", "ragged", "tree", "tree_paged")


@dataclass(frozen=True)
class TvmArgs:
    """One kernel's parameter buffers (None where its form has none) and its batch size ``B``;
    sequence b's keys as a layout (``keys(b)``) and their count (``kv_len(b)``). The ragged form's
    fields alone (no rotary positions) describe FlashAttention's packed batch (``cpu.varlen``)."""

    B: Any
    q: Any
    output: Any
    lse: Any
    total_q: Any
    q_indptr: Any = None
    pages: Any = None
    page_indptr: Any = None
    page_values: Any = None
    length_info: Any = None
    k: Any = None
    v: Any = None
    kv_indptr: Any = None
    total_kv: Any = None
    nnz_pages: Any = None
    k_rope_pos_offset: Any = None
    q_rope_position: Any = None
    tree_order: Any = None
    tree_order_indptr: Any = None
    page_size: int = 16
    sliding_window: bool = False
    positions: bool = False  # ragged keys rotated at their queries' positions (tree attention)

    def keys(self, b):
        """Sequence b's keys: its cached pages (``TvmPages``) or its rows of k, v (``RaggedKeys``)."""
        if self.pages is not None:
            return tvm_cached_keys(self.pages, self.page_values, self.page_indptr, self.length_info,
                                   self.k_rope_pos_offset, b, self.sliding_window, self.page_size)
        if self.positions:
            return RaggedKeys(self.k, self.v, self.kv_indptr[b], positions=self.q_rope_position)
        offset = 0 if self.k_rope_pos_offset is None else self.k_rope_pos_offset[b]  # None: never rotated
        return RaggedKeys(self.k, self.v, self.kv_indptr[b], offset)

    def kv_len(self, b):
        """Sequence b's keys, int64."""
        if self.pages is not None:
            return tvm_kv_len(self.page_indptr[b + 1] - self.page_indptr[b],
                              tvm_lengths(self.length_info, b, self.sliding_window), self.page_size)
        return T.Cast("int64", self.kv_indptr[b + 1] - self.kv_indptr[b])

    def q_start(self, b):
        """Sequence b's first row of q (decode: row b)."""
        return T.Cast("int64", b if self.q_indptr is None else self.q_indptr[b])

    def q_len(self, b):
        """Sequence b's query rows (decode: 1)."""
        return T.int64(1) if self.q_indptr is None else T.Cast("int64", self.q_indptr[b + 1] - self.q_indptr[b])

    def tree_mask(self) -> TreeMask:
        """The tree rule of the tree forms (``TreeMask``)."""
        return TreeMask(self.tree_order, self.tree_order_indptr, self.q_indptr, self.kv_len)


def _size(name: str) -> tirx.Var:
    return tirx.Var(name, "int32")


def _indexes(handle, extent):
    """An int32 index buffer of ``extent`` (any element offset: the runtime passes views)."""
    return T.match_buffer(handle, (extent,), "int32", elem_offset=_size(f"{handle.name}_offset"))


def tvm_params(form: str, spec: KernelSpec, *handles, page_size: int = 16, sliding_window: bool = False) -> TvmArgs:
    """The buffers of ``handles`` (the form's, in TVM's order; module docstring)."""
    if form not in FORMS:
        raise ValueError(f"tvm_params: form must be one of {FORMS}, got {form!r}")
    T.func_attr({"tirx.noalias": True})
    Hq, Hkv, D, dtype = spec.num_q_heads, spec.num_kv_heads, spec.head_dim, spec.dtype
    if form == "tree":
        q_h, q_indptr_h, k_h, v_h, kv_indptr_h, q_position_h, mn_indptr_h, mask_h, output_h, lse_h = handles
        B1, total_q, total_kv, tree_size = (_size(n) for n in ("B1", "total_q", "total_kv", "tree_size"))  # B1: B + 1
        return TvmArgs(B=B1 - 1, q=T.match_buffer(q_h, (total_q, Hq, D), dtype),
                       output=T.match_buffer(output_h, (total_q, Hq, D), dtype),
                       lse=T.match_buffer(lse_h, (total_q, Hq), "float32"), total_q=total_q,
                       q_indptr=_indexes(q_indptr_h, B1), k=T.match_buffer(k_h, (total_kv, Hkv, D), dtype),
                       v=T.match_buffer(v_h, (total_kv, Hkv, D), dtype), kv_indptr=_indexes(kv_indptr_h, B1),
                       total_kv=total_kv, q_rope_position=_indexes(q_position_h, total_q),
                       tree_order_indptr=_indexes(mn_indptr_h, B1),
                       tree_order=T.match_buffer(mask_h, (tree_size, 2), "int32", elem_offset=_size("mask_offset")),
                       positions=True)
    B, total_q = _size("B"), _size("total_q")
    if form == "ragged":
        q_h, q_indptr_h, k_h, v_h, kv_indptr_h, q_position_h, k_offset_h, output_h, lse_h = handles
        total_kv = _size("total_kv")
        return TvmArgs(B=B, q=T.match_buffer(q_h, (total_q, Hq, D), dtype),
                       output=T.match_buffer(output_h, (total_q, Hq, D), dtype),
                       lse=T.match_buffer(lse_h, (total_q, Hq), "float32"), total_q=total_q,
                       q_indptr=_indexes(q_indptr_h, B + 1), k=T.match_buffer(k_h, (total_kv, Hkv, D), dtype),
                       v=T.match_buffer(v_h, (total_kv, Hkv, D), dtype), kv_indptr=_indexes(kv_indptr_h, B + 1),
                       total_kv=total_kv, q_rope_position=_indexes(q_position_h, total_q),
                       k_rope_pos_offset=_indexes(k_offset_h, B))
    if form == "decode":
        q_h, pages_h, page_indptr_h, page_values_h, info_h, k_offset_h, q_position_h, output_h, lse_h = handles
        rows, q_shape, q_indptr = B, (B, Hq, D), None
    else:
        (q_h, q_indptr_h, pages_h, page_indptr_h, page_values_h, info_h, k_offset_h, q_position_h, output_h, lse_h,
         *tree) = handles
        rows, q_shape, q_indptr = total_q, (total_q, Hq, D), _indexes(q_indptr_h, B + 1)
    nnz_pages, max_num_pages = _size("nnz_pages"), _size("max_num_pages")
    args = dict(B=B, q=T.match_buffer(q_h, q_shape, dtype), output=T.match_buffer(output_h, q_shape, dtype),
                lse=T.match_buffer(lse_h, q_shape[:2], "float32"), total_q=rows, q_indptr=q_indptr,
                pages=T.match_buffer(pages_h, (max_num_pages, 2, Hkv, page_size, D), dtype,
                                     elem_offset=_size("pages_offset")),  # a view, as TVM's GPU kernels allow
                page_indptr=_indexes(page_indptr_h, B + 1), page_values=_indexes(page_values_h, nnz_pages),
                nnz_pages=nnz_pages, page_size=page_size, sliding_window=sliding_window,
                length_info=T.match_buffer(info_h, (3, B) if sliding_window else (B,), "int32",
                                           elem_offset=_size("length_info_offset")),
                k_rope_pos_offset=_indexes(k_offset_h, B), q_rope_position=_indexes(q_position_h, rows))
    if form == "tree_paged":
        order_indptr_h, order_h = tree
        args.update(tree_order_indptr=_indexes(order_indptr_h, B + 1),
                    tree_order=T.match_buffer(order_h, (_size("tree_size"), 2), "int32",
                                              elem_offset=_size("tree_order_offset")))
    return TvmArgs(**args)



def prefill_causal_rule(sliding_window: bool, sliding_window_size: int) -> tuple[AttnConfig, bool]:
    """(config, queries after the keys) of a prefill where its run-time ``causal`` is non-zero:
    bottom-right causal; for the sliding-window prefill over cached keys, TVM's
    ``_causal_or_sliding_cross_mask``: the queries follow the cached keys and row i sees the last
    ``sliding_window_size - 1 - i`` of them, the window (W - 1, 0) with delta = kv_len (a size of
    0: bottom-right causal)."""
    if sliding_window and sliding_window_size > 0:
        return AttnConfig(causal=True, window_size=(sliding_window_size - 1, 0)), True
    return AttnConfig(causal=True), False


def tvm_kernel(form: str, spec: KernelSpec, body, *, name: str, page_size: int = 16,
               sliding_window: bool = False) -> tirx.PrimFunc:
    """A PrimFunc with the signature of TVM's kernel of ``form`` (module docstring), global symbol
    ``name``, whose body is the macro ``body(args, causal, rotary_mode, rope_scale, rope_theta,
    sm_scale)`` (``args``: the parameters' ``TvmArgs``; ``causal`` 0 where the form has none)."""
    options = dict(page_size=page_size, sliding_window=sliding_window)
    if form not in FORMS:
        raise ValueError(f"tvm_kernel: form must be one of {FORMS}, got {form!r}")
    # fmt: off
    if form == "decode":
        @T.prim_func
        def decode(q_h: T.handle, pages_h: T.handle, page_indptr_h: T.handle, page_values_h: T.handle,
                   length_info_h: T.handle, k_rope_pos_offset_h: T.handle, q_rope_position_h: T.handle,
                   output_h: T.handle, lse_h: T.handle, rotary_mode: T.int32, rope_scale: T.float32,
                   rope_theta: T.float32, sm_scale: T.float32):
            body(tvm_params("decode", spec, q_h, pages_h, page_indptr_h, page_values_h, length_info_h,
                            k_rope_pos_offset_h, q_rope_position_h, output_h, lse_h, **options),
                 T.int32(0), rotary_mode, rope_scale, rope_theta, sm_scale)

        func = decode
    elif form == "paged":
        @T.prim_func
        def paged(q_h: T.handle, q_indptr_h: T.handle, pages_h: T.handle, page_indptr_h: T.handle,
                  page_values_h: T.handle, length_info_h: T.handle, k_rope_pos_offset_h: T.handle,
                  q_rope_position_h: T.handle, output_h: T.handle, lse_h: T.handle, causal: T.int32,
                  rotary_mode: T.int32, rope_scale: T.float32, rope_theta: T.float32, sm_scale: T.float32):
            body(tvm_params("paged", spec, q_h, q_indptr_h, pages_h, page_indptr_h, page_values_h, length_info_h,
                            k_rope_pos_offset_h, q_rope_position_h, output_h, lse_h, **options),
                 causal, rotary_mode, rope_scale, rope_theta, sm_scale)

        func = paged
    elif form == "ragged":
        @T.prim_func
        def ragged(q_h: T.handle, q_indptr_h: T.handle, k_h: T.handle, v_h: T.handle, kv_indptr_h: T.handle,
                   q_rope_position_h: T.handle, k_rope_pos_offset_h: T.handle, output_h: T.handle, lse_h: T.handle,
                   causal: T.int32, rotary_mode: T.int32, rope_scale: T.float32, rope_theta: T.float32,
                   sm_scale: T.float32):
            body(tvm_params("ragged", spec, q_h, q_indptr_h, k_h, v_h, kv_indptr_h, q_rope_position_h,
                            k_rope_pos_offset_h, output_h, lse_h),
                 causal, rotary_mode, rope_scale, rope_theta, sm_scale)

        func = ragged
    elif form == "tree":
        @T.prim_func
        def tree(q_h: T.handle, q_indptr_h: T.handle, k_h: T.handle, v_h: T.handle, kv_indptr_h: T.handle,
                 q_rope_position_h: T.handle, mn_indptr_h: T.handle, mask_h: T.handle, output_h: T.handle,
                 lse_h: T.handle, rotary_mode: T.int32, rope_scale: T.float32, rope_theta: T.float32,
                 sm_scale: T.float32):
            body(tvm_params("tree", spec, q_h, q_indptr_h, k_h, v_h, kv_indptr_h, q_rope_position_h, mn_indptr_h,
                            mask_h, output_h, lse_h), T.int32(0), rotary_mode, rope_scale, rope_theta, sm_scale)

        func = tree
    elif form == "tree_paged":
        @T.prim_func
        def tree_paged(q_h: T.handle, q_indptr_h: T.handle, pages_h: T.handle, page_indptr_h: T.handle,
                       page_values_h: T.handle, length_info_h: T.handle, k_rope_pos_offset_h: T.handle,
                       q_rope_position_h: T.handle, output_h: T.handle, lse_h: T.handle, rotary_mode: T.int32,
                       rope_scale: T.float32, rope_theta: T.float32, sm_scale: T.float32,
                       tree_order_indptr_h: T.handle, tree_order_h: T.handle):
            body(tvm_params("tree_paged", spec, q_h, q_indptr_h, pages_h, page_indptr_h, page_values_h,
                            length_info_h, k_rope_pos_offset_h, q_rope_position_h, output_h, lse_h,
                            tree_order_indptr_h, tree_order_h, **options),
                 T.int32(0), rotary_mode, rope_scale, rope_theta, sm_scale)

        func = tree_paged
    # fmt: on
    return func.with_attr("global_symbol", name)


def merge_kernel(dtype: str, rows, *, name: str, lanes: int = 1) -> tirx.PrimFunc:
    """TVM's ``merge_state_inplace``: v [N, H, D] (``dtype``) and s [N, H] float32 (log2 units)
    become the merge of themselves with ``v_other``, ``s_other``: ``s = log2(2^s + 2^s_other)``,
    v weighted by each side's share. ``rows(extent, merge_row)``: the target's loop over the
    ``extent`` = N * H rows, calling ``merge_row(row)`` for each; the head dim in vectors of
    ``lanes``."""

    def weighted(x, other, mine, theirs):  # the two sides by their shares, rounded to the dtype
        return (x.astype("float32") * (mine / (mine + theirs))
                + other.astype("float32") * (theirs / (mine + theirs))).astype(dtype)

    @T.macro
    def merge_row(v, s, v_other, s_other, row, H, D):
        n: T.int64 = row // H
        h: T.int64 = row % H
        top: T.float32 = T.max(s[n, h], s_other[n, h])
        mine: T.float32 = T.exp2(s[n, h] - top)
        theirs: T.float32 = T.exp2(s_other[n, h] - top)
        for d0 in range(D // lanes):
            for lane in T.vectorized(lanes):
                v[n, h, d0 * lanes + lane] = weighted(v[n, h, d0 * lanes + lane], v_other[n, h, d0 * lanes + lane],
                                                      mine, theirs)
        for d in range(D // lanes * lanes, D):
            v[n, h, d] = weighted(v[n, h, d], v_other[n, h, d], mine, theirs)
        s[n, h] = T.log2(mine + theirs) + top

    # fmt: off
    @T.prim_func
    def merge_state_inplace(v_h: T.handle, s_h: T.handle, v_other_h: T.handle, s_other_h: T.handle):
        T.func_attr({"tirx.noalias": True})
        N, H, D = T.int32(), T.int32(), T.int32()
        v = T.match_buffer(v_h, (N, H, D), dtype)
        s = T.match_buffer(s_h, (N, H), "float32")
        v_other = T.match_buffer(v_other_h, (N, H, D), dtype)
        s_other = T.match_buffer(s_other_h, (N, H), "float32")
        rows(T.Cast("int64", N) * H, lambda row: merge_row(v, s, v_other, s_other, row, H, D))
    # fmt: on

    return merge_state_inplace.with_attr("global_symbol", name)


__all__ = ["TvmArgs", "tvm_params", "prefill_causal_rule", "tvm_kernel", "merge_kernel", "FORMS"]
