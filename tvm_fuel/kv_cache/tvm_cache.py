"""TVM's own paged KV cache (``relax.frontend.nn.llm``, MLC-LLM's): fuel's kernels for its
attention slots, TVM's own kernels for the same slots, the runtime cache made of either without a
Relax model, and ``FuelPagedKVCache`` for models written with ``relax.frontend.nn``.

Contents:
    TVM_SLOTS        -- the attention slots fuel fills
    TVM_PAGE_SIZE    -- 16, the page size TVM 0.27 builds into its own cache's kernels
    tvm_kernels      -- fuel's kernels for them (llvm; cuda sm_80+; the CUDA emulation)
    tvm_own_kernels  -- TVM 0.27's kernels for them, for a target (what fuel's are checked against)
    runtime_kernels, runtime_cache -- every slot compiled (fuel's or TVM's), and the runtime cache
    FuelPagedKVCache -- TVM's TIRPagedKVCache with those slots filled by fuel
"""

from __future__ import annotations

import functools
import inspect
import math

import tvm
from tvm import relax
from tvm.relax.frontend.nn.llm import kv_cache as tvm_llm_kv

from ..op.config import as_int, positive_int


# the attention slots of TVM's PagedKVCache, all filled by fuel's kernels (append, copy, rotary and debug stay TVM's)
TVM_SLOTS = ("prefill", "decode", "prefill_sliding_window", "decode_sliding_window", "prefill_ragged",
             "prefill_with_tree_mask", "prefill_with_tree_mask_paged_kv_cache", "merge_state")
# the page size TVM 0.27 builds into its own cache: TIRPagedKVCache's append and compact kernels and its
# tree-attention kernels over pages (relax/frontend/nn/llm/kv_cache.py, tree_attn.py) take pages of 16
TVM_PAGE_SIZE = 16


def tvm_kernels(num_kv_heads: int, num_qo_heads: int, head_dim: int, dtype: str, target, *, page_size: int = 16,
                sliding_window_size: int = 1024, rope_scaling: dict | None = None,
                emulate_cuda: bool = False) -> dict[str, tvm.tirx.PrimFunc]:
    """fuel's kernels for the attention slots of TVM's own paged KV cache
    (``relax.frontend.nn.llm.kv_cache.PagedKVCache``, created by
    ``vm.builtin.paged_attention_kv_cache_create``; what MLC-LLM serves from): slot name -> a
    scheduled PrimFunc with the signature, global symbol and semantics of TVM 0.27's kernel for
    that slot, to be passed to the runtime in its place.

    Slots (``TVM_SLOTS``):

    * ``decode``, ``decode_sliding_window``: ``batch_decode_paged_kv_cpu(q [B, Hq, D], pages
      [max_num_pages, 2, Hkv, page_size, D], page_indptr [B + 1], page_values [nnz_pages],
      length_info [B] or [3, B] (last page length, window offset, sink length), k_rope_pos_offset
      [B], q_rope_position [B], output [B, Hq, D], lse [B, Hq] float32 (log2 units), rotary_mode,
      rope_scale, rope_theta, sm_scale)``; each (sequence, KV head) a parallel task that reads
      its group's K and V rows once, in place (``rotary_mode`` 1 rotates keys as it packs them);
    * ``prefill``: ``batch_prefill_paged_kv_cpu(q [total_q, Hq, D], q_indptr [B + 1], pages,
      page_indptr, page_values, length_info [B], k_rope_pos_offset [B], q_rope_position [total_q],
      output [total_q, Hq, D], lse [total_q, Hq], causal, rotary_mode, rope_scale, rope_theta,
      sm_scale)``: each sequence's queries against its cached keys, bottom-right causal where
      ``causal`` is non-zero;
    * ``prefill_sliding_window``: ``batch_prefill_paged_kv_cpu_sliding_window``, ``prefill``'s
      signature with length_info [3, B]: the new tokens against a sliding-window sequence's cached
      keys (sinks first); where ``causal`` is non-zero, TVM's cross-window rule: new token i sees
      the last ``sliding_window_size - 1 - i`` cached keys (``sliding_window_size`` 0: causal);
    * ``prefill_ragged``: ``batch_prefill_ragged_kv(q, q_indptr, k [total_kv, Hkv, D], v,
      kv_indptr [B + 1], q_rope_position, k_rope_pos_offset, output, lse, causal, rotary_mode,
      rope_scale, rope_theta, sm_scale)``: the same over keys not yet in pages (the runtime merges
      the two states of a prefill over a cached prefix);
    * ``prefill_with_tree_mask``: ``batch_tree_attn(q, q_indptr, k [total_kv, Hkv, D], v,
      kv_indptr, q_rope_position, mn_indptr [B + 1], mask [n, 2] int32, output, lse, rotary_mode,
      rope_scale, rope_theta, sm_scale)``: speculative decoding's token trees among themselves, a
      token seeing its ancestors and itself (``mask``: each node's depth-first enter/exit numbers);
    * ``prefill_with_tree_mask_paged_kv_cache``: ``tree_attn_paged_kv_cpu(q, q_indptr, pages,
      page_indptr, page_values, length_info [B], k_rope_pos_offset, q_rope_position, output, lse,
      rotary_mode, rope_scale, rope_theta, sm_scale, tree_order_indptr, tree_order)``: the same
      against the cached keys, the tree's earlier nodes the pages' last;
    * ``merge_state``: ``merge_state_inplace_cpu(v [N, H, D], s [N, H], v_other, s_other)``.

    On llvm targets the prefill and tree tasks are (sequence, KV head, tile of query rows), the
    key tiles packed once and run through the register-tiled GEMMs. On cuda targets (sm_80 or
    newer) every slot is fuel's CUDA forward kernel with TVM's I/O, under TVM's GPU global symbols
    (no ``_cpu`` suffix); ``rotary_mode`` 1 is refused there by a host-side check.
    ``emulate_cuda`` (llvm target): the CUDA kernels' emulation, one thread per block, for checking
    them without a GPU.

    Example
    -------
    >>> kernels = tvm_fuel.kv_cache.tvm_kernels(4, 32, 128, "float16", tvm_fuel.host_target())
    >>> decode = tvm.compile(tvm.IRModule({"main": kernels["decode"]}), target)["batch_decode_paged_kv_cpu"]
    """
    from ..op.config import AttnConfig
    from ..schedules.workload import KernelSpec
    from ..target import as_target

    where = "kv_cache.tvm_kernels"
    num_kv_heads, num_qo_heads, head_dim, page_size = (
        positive_int(where, name, value) for name, value in (("num_kv_heads", num_kv_heads),
                                                              ("num_qo_heads", num_qo_heads), ("head_dim", head_dim),
                                                              ("page_size", page_size)))
    sliding_window_size = max(as_int(where, "sliding_window_size", sliding_window_size), 0)  # <= 0: none, as TVM
    if num_qo_heads % num_kv_heads:
        raise ValueError(f"{where}: num_qo_heads ({num_qo_heads}) must be a multiple of num_kv_heads ({num_kv_heads})")
    if dtype not in ("float32", "float16", "bfloat16"):
        raise ValueError(f"{where}: dtype must be float32, float16 or bfloat16, got {dtype!r}")
    target = as_target(target)
    if target.kind.name not in ("llvm", "cuda") or (emulate_cuda and target.kind.name != "llvm"):
        raise ValueError(f"{where}: target must be an llvm (CPU) or cuda target (llvm with emulate_cuda), got "
                         f"{target.kind.name!r}")
    spec = KernelSpec(dtype, num_qo_heads, num_kv_heads, head_dim, AttnConfig())
    if target.kind.name == "cuda" or emulate_cuda:
        return _cuda_tvm_kernels(spec, target, page_size=page_size, sliding_window_size=sliding_window_size,
                                 emulated=emulate_cuda)
    return _cpu_tvm_kernels(spec, target, page_size=page_size, sliding_window_size=sliding_window_size,
                            rope_scaling=rope_scaling)


def _cpu_tvm_kernels(spec, target, *, page_size: int, sliding_window_size: int, rope_scaling) -> dict:
    from tvm.relax.frontend.nn.llm.position_embedding import switch_rope_freq_func

    from ..schedules.cpu import tvm_cache
    from ..schedules.cpu.tiles import tiles_for, vector_lanes

    dtype, head_dim = spec.dtype, spec.head_dim
    # decode: one query row per head of the group (streamed in place); prefill: row tiles of many
    decode_tiles = tiles_for(target, head_dim=head_dim, rows=spec.group, num_kv_heads=1,
                             element_bytes=tvm.DataType(dtype).bits // 8)
    prefill_tiles = tiles_for(target, head_dim=head_dim, rows=None, num_kv_heads=1)
    rope_freq = switch_rope_freq_func(rope_scaling or {})  # the cache's RoPE frequencies, as TVM's kernels take them
    return _slot_kernels(functools.partial(tvm_cache.decode, spec, decode_tiles, rope_freq=rope_freq),
                         functools.partial(tvm_cache.prefill, spec, prefill_tiles, rope_freq=rope_freq),
                         functools.partial(tvm_cache.tree_attention, spec, prefill_tiles, rope_freq=rope_freq),
                         functools.partial(tvm_cache.merge_state, dtype, vector_lanes(target)),
                         page_size=page_size, sliding_window_size=sliding_window_size)


def _cuda_tvm_kernels(spec, target, *, page_size: int, sliding_window_size: int, emulated: bool) -> dict:
    """The slots on CUDA (``schedules.cuda.tvm_cache``), tiles as fuel's CUDA rules pick them for
    the target (a dense forward's for the prefills, a decode's for decode); ``emulated``: their
    llvm emulation (one thread per block), for checking without a GPU."""
    from dataclasses import replace

    from ..schedules.cuda import tvm_cache
    from ..schedules.cuda.rules import arch_of, CudaFlashForward, CudaPagedAttention
    from ..schedules.cuda.tiles import CudaTiles
    from ..schedules.workload import Workload

    if not emulated and arch_of(target) is None:
        raise ValueError(f"kv_cache.tvm_kernels: a cuda target needs an arch of sm_80 or newer, got "
                         f"{target.attrs.get('arch')!r}")
    dense, paged = CudaFlashForward(emulated=emulated), CudaPagedAttention(emulated=emulated)
    lse = replace(spec, return_lse=True)
    prefill_knobs = dense.default_knobs(Workload("flash_attn", lse, (("B", None), ("Sq", None), ("Sk", None))), target)
    decode_knobs = paged.default_knobs(Workload("paged_attn", replace(spec, block_size=page_size), (
        ("B", None), ("Sq", 1), ("num_blocks", None), ("max_blocks", None))), target)
    prefill_tiles, decode_tiles = (replace(CudaTiles(**knobs), splits=1) for knobs in (prefill_knobs, decode_knobs))
    prefill_launch, decode_launch = dense.launch(prefill_knobs), paged.launch(decode_knobs)
    return _slot_kernels(functools.partial(tvm_cache.decode, spec, decode_tiles, decode_launch),
                         functools.partial(tvm_cache.prefill, spec, prefill_tiles, prefill_launch),
                         functools.partial(tvm_cache.tree_attention, spec, prefill_tiles, prefill_launch),
                         functools.partial(tvm_cache.merge_state, spec.dtype, decode_launch),
                         page_size=page_size, sliding_window_size=sliding_window_size)


def _slot_kernels(decode, prefill, tree_attention, merge_state, *, page_size: int, sliding_window_size: int) -> dict:
    """Slot (``TVM_SLOTS``) -> PrimFunc from one target's four kernel factories (their target's
    arguments bound): which factory, keys and window each slot takes."""
    return {"prefill": prefill(keys="paged", page_size=page_size),
            "decode": decode(page_size=page_size, sliding_window=False),
            "prefill_sliding_window": prefill(keys="paged", page_size=page_size, sliding_window=True,
                                              sliding_window_size=sliding_window_size),
            "decode_sliding_window": decode(page_size=page_size, sliding_window=True),
            "prefill_ragged": prefill(keys="ragged", page_size=page_size),
            "prefill_with_tree_mask": tree_attention(keys="ragged", page_size=page_size),
            "prefill_with_tree_mask_paged_kv_cache": tree_attention(keys="paged", page_size=page_size),
            "merge_state": merge_state()}


def tvm_own_kernels(num_kv_heads: int, num_qo_heads: int, head_dim: int, dtype: str, target, *,
                    page_size: int = 16, sliding_window_size: int = 1024) -> dict[str, tvm.tirx.PrimFunc]:
    """TVM 0.27's own kernels for ``TVM_SLOTS``, as ``TIRPagedKVCache`` makes them for ``target``:
    its CPU kernels on llvm (``_scheduled``), its GPU kernels on cuda; pages of 16. What fuel's
    slots are checked and timed against."""
    from ..target import as_target

    target = as_target(target)
    if page_size != TVM_PAGE_SIZE:  # TVM's tree kernels read pages of 16 whatever they are given
        raise ValueError(f"kv_cache.tvm_own_kernels: page_size must be {TVM_PAGE_SIZE} (TVM's kernels are built for "
                         f"pages of {TVM_PAGE_SIZE}), got {page_size}")
    hkv, hq, d = num_kv_heads, num_qo_heads, head_dim
    if target.kind.name == "cuda":
        funcs = dict(
            prefill=tvm_llm_kv._attention_prefill(hkv, hq, d, dtype, False, {}, target, page_size),  # noqa: SLF001
            decode=tvm_llm_kv._attention_decode(hkv, hq, d, dtype, False, {}, target, page_size),  # noqa: SLF001
            prefill_sliding_window=tvm_llm_kv._attention_prefill(  # noqa: SLF001
                hkv, hq, d, dtype, True, {}, target, page_size, sliding_window_size=sliding_window_size),
            decode_sliding_window=tvm_llm_kv._attention_decode(  # noqa: SLF001
                hkv, hq, d, dtype, True, {}, target, page_size),
            prefill_ragged=tvm_llm_kv._attention_prefill_ragged(hkv, hq, d, d, dtype, {}, target),  # noqa: SLF001
            prefill_with_tree_mask=tvm_llm_kv.tree_attn(hkv, hq, d, dtype, {}, target),
            prefill_with_tree_mask_paged_kv_cache=tvm_llm_kv.tree_attn_with_paged_kv_cache(hkv, hq, d, dtype, {},
                                                                                            target),
            merge_state=tvm_llm_kv._merge_state_inplace(hq, d, dtype, target))  # noqa: SLF001
    else:
        funcs = dict(
            prefill=tvm_llm_kv._attention_prefill_cpu(hkv, hq, d, dtype, False, {}, page_size),  # noqa: SLF001
            decode=tvm_llm_kv._attention_decode_cpu(hkv, hq, d, dtype, False, {}, page_size),  # noqa: SLF001
            prefill_sliding_window=tvm_llm_kv._attention_prefill_cpu(  # noqa: SLF001
                hkv, hq, d, dtype, True, {}, page_size, sliding_window_size=sliding_window_size),
            decode_sliding_window=tvm_llm_kv._attention_decode_cpu(  # noqa: SLF001
                hkv, hq, d, dtype, True, {}, page_size),
            prefill_ragged=tvm_llm_kv._attention_prefill_ragged_cpu(hkv, hq, d, d, dtype, {}),  # noqa: SLF001
            prefill_with_tree_mask=tvm_llm_kv.tree_attn_cpu(hkv, hq, d, dtype, {}),
            prefill_with_tree_mask_paged_kv_cache=tvm_llm_kv.tree_attn_with_paged_kv_cache_cpu(hkv, hq, d, dtype,
                                                                                                {}),
            merge_state=tvm_llm_kv._merge_state_inplace_cpu(dtype))  # noqa: SLF001
    return {slot: _scheduled(func, target) for slot, func in funcs.items()}


def _scheduled(func: tvm.tirx.PrimFunc, target) -> tvm.tirx.PrimFunc:
    """``func`` as TVM's tests build its KV-cache kernels: as it is when scheduled, else under
    dlight's fallback schedule (TVM's CPU kernels are plain loops)."""
    from tvm.s_tir import dlight as dl

    if func.attrs.get("tirx.is_scheduled", False):
        return func
    with target:
        return dl.ApplyDefaultSchedule(dl.gpu.Fallback())(tvm.IRModule({"main": func}))["main"]


def runtime_kernels(num_kv_heads: int, num_qo_heads: int, head_dim: int, dtype: str, *, num_layers: int,
                    kernels: str = "fuel", rope_theta: float = 1e4, rope_scale: float = 1.0,
                    page_size: int = 16, sliding_window_size: int = 1024) -> dict[str, tvm.runtime.Function]:
    """Every slot of TVM's runtime cache compiled for this CPU, by slot name: TVM 0.27's CPU
    kernels (as ``TIRPagedKVCache`` builds them for llvm, scheduled as TVM's tests do), with fuel's
    in ``TVM_SLOTS`` unless ``kernels`` is "tvm". For driving the runtime cache without a Relax
    model (``runtime_cache``: benchmarks, tests); a model uses ``FuelPagedKVCache``.

    ``page_size``: the tokens per page every slot is built for; the answer's ``page_size``
    attribute records it, and ``runtime_cache`` refuses any other. With fuel's kernels any
    positive size: TVM 0.27's append, copy and compact kernels take the page size as a parameter
    (it is passed to them here; ``relax/frontend/nn/llm/_page_kernels.py``), its debug kernel
    reads it from the pages. With ``kernels="tvm"`` only 16: TVM's tree-attention kernel over
    pages (``tree_attn_with_paged_kv_cache_cpu``, ``tree_attn.py``) has pages of 16 built in.
    """
    from ..target import host_target

    where = "kv_cache.runtime_kernels"
    if kernels not in ("fuel", "tvm"):
        raise ValueError(f"{where}: kernels must be 'fuel' or 'tvm', got {kernels!r}")
    page_size = positive_int(where, "page_size", page_size)
    if kernels == "tvm" and page_size != TVM_PAGE_SIZE:  # refused before anything is built
        raise ValueError(f"{where}: page_size must be {TVM_PAGE_SIZE} with kernels='tvm' (TVM 0.27's tree-attention "
                         f"kernel over pages is built for pages of {TVM_PAGE_SIZE}), got {page_size}; "
                         "kernels='fuel' serves any page size")
    hkv, hq, d = num_kv_heads, num_qo_heads, head_dim
    target = host_target()
    # the other slots' CPU kernels: TIRPagedKVCache builds them from these (TVM's own tests import them too)
    funcs = dict(
        transpose_append=tvm_llm_kv._kv_cache_transpose_append(hkv, d, dtype, page_size),  # noqa: SLF001
        debug_get_kv=tvm_llm_kv._kv_cache_debug_get_kv(num_layers, hkv, d, dtype),  # noqa: SLF001
        split_rotary=tvm_llm_kv.llama_rope_with_position_map(rope_theta, rope_scale, d, hq, hkv, dtype, {}),
        copy_single_page=tvm_llm_kv._copy_single_page_cpu(hkv, page_size, d, dtype),  # noqa: SLF001
        compact_kv_copy=tvm_llm_kv._compact_kv_copy_cpu(hkv, d, dtype, page_size))  # noqa: SLF001
    slots = tvm_own_kernels if kernels == "tvm" else tvm_kernels
    funcs |= slots(hkv, hq, d, dtype, target, page_size=page_size, sliding_window_size=sliding_window_size)
    built = _RuntimeSlots(page_size)
    for slot, func in funcs.items():
        symbol = str(func.attrs["global_symbol"]) if "global_symbol" in func.attrs else "main"
        built[slot] = tvm.compile(tvm.IRModule({"main": _scheduled(func, target)}), target=target)[symbol]
    return built


class _RuntimeSlots(dict):
    """``runtime_kernels``' answer: slot name -> compiled function, and ``page_size``, the tokens
    per page they were built for (what ``runtime_cache`` checks its own ``page_size`` against)."""

    def __init__(self, page_size: int):
        super().__init__()
        self.page_size = page_size


def runtime_cache(slots: dict, *, num_kv_heads: int, num_qo_heads: int, head_dim: int, dtype: str, num_layers: int,
                  max_batch_size: int = 8, max_total_seq_len: int = 32768, prefill_chunk_size: int = 4096,
                  page_size: int = 16, sliding_window: bool = False, rope_mode: int = 0, rope_theta: float = 1e4,
                  rope_scale: float = 1.0, layer_kinds: list[str] | None = None, layer_sliding_window_size: int = 1024):
    """TVM's runtime cache (``vm.builtin.paged_attention_kv_cache_create``, what a model's
    ``create_paged_kv_cache`` returns) with ``slots`` (``runtime_kernels``; any function will
    do, e.g. one that counts its calls), driven by ``vm.builtin.kv_state_*`` and
    ``attention_kv_cache_attention_with_fused_qkv``. No KV transfer; ``layer_kinds``: each
    layer's "mha" (the default) or "mha_sliding" (a window of ``layer_sliding_window_size``, the
    size the slots' sliding-window kernels were built for).

    ``page_size`` must be the one the slots were built for: their append, copy and attention
    kernels take pages of that fixed size, and the runtime's pages of any other fail in the first
    forward. Checked against ``slots.page_size`` where ``slots`` is ``runtime_kernels``' answer
    (a dict of other functions is taken as built for ``page_size``)."""
    where = "kv_cache.runtime_cache"
    page_size = positive_int(where, "page_size", page_size)
    built_for = getattr(slots, "page_size", None)
    if built_for is not None and page_size != built_for:
        raise ValueError(f"{where}: page_size must be {built_for}, the page size runtime_kernels built these slots "
                         f"for (TVM's append and copy kernels index pages of that size), got {page_size}")
    kinds = layer_kinds or ["mha"] * num_layers
    if len(kinds) != num_layers or not set(kinds) <= {"mha", "mha_sliding"}:
        raise ValueError(f"{where}: layer_kinds must be {num_layers} of 'mha' / 'mha_sliding', "
                         f"got {layer_kinds!r}")
    create = tvm.get_global_func("vm.builtin.paged_attention_kv_cache_create")
    shape = tvm.runtime.ShapeTuple
    return create(
        shape([max_batch_size, max_total_seq_len, prefill_chunk_size, page_size, int(sliding_window),
               layer_sliding_window_size]),
        shape([0, num_layers]), num_qo_heads, num_kv_heads, head_dim, head_dim,
        shape([int(getattr(tvm_llm_kv.AttnKind, kind.upper())) for kind in kinds]), False, rope_mode, rope_scale,
        rope_theta, None,
        tvm.runtime.empty((), dtype, device=tvm.cpu()), slots["transpose_append"], None,
        ["tirx", slots["prefill_ragged"]], ["tirx", slots["prefill"]], ["tirx", slots["decode"]],
        ["tirx", slots["prefill_sliding_window"]], ["tirx", slots["decode_sliding_window"]],
        ["tirx", slots["prefill_with_tree_mask_paged_kv_cache"]], ["tirx", slots["prefill_with_tree_mask"]], [],
        [slots["merge_state"]], slots["split_rotary"], slots["copy_single_page"], slots["debug_get_kv"],
        slots["compact_kv_copy"])


# the functions TVM 0.27's TIRPagedKVCache adds for the attention slots (llvm, then cuda targets)
_TVM_SLOT_FUNCTIONS = {"tir_attention_prefill_ragged_cpu": "prefill_ragged", "tir_attention_prefill_cpu": "prefill",
                       "tir_attention_decode_cpu": "decode",
                       "tir_attention_decode_cpu_sliding_window": "decode_sliding_window",
                       "tir_attention_prefill_cpu_sliding_window": "prefill_sliding_window",
                       "tir_attention_prefill_with_tree_mask_cpu": "prefill_with_tree_mask",
                       "tir_attention_prefill_with_tree_mask_with_paged_kv_cache_cpu":
                           "prefill_with_tree_mask_paged_kv_cache",
                       "tir_attention_merge_state_cpu": "merge_state",
                       "tir_attention_prefill_ragged": "prefill_ragged", "tir_attention_prefill": "prefill",
                       "tir_attention_decode": "decode", "tir_attention_decode_sliding_window": "decode_sliding_window",
                       "tir_attention_prefill_sliding_window": "prefill_sliding_window",
                       "tir_attention_prefill_with_tree_mask": "prefill_with_tree_mask",
                       "tir_attention_prefill_with_tree_mask_with_paged_kv_cache":
                           "prefill_with_tree_mask_paged_kv_cache",
                       "tir_attention_merge_state": "merge_state"}


class _FuelSlots(tvm_llm_kv.PagedKVCache):
    """In ``FuelPagedKVCache``'s MRO between ``TIRPagedKVCache`` and ``PagedKVCache``: the cache's
    creation call (``vm.builtin.paged_attention_kv_cache_create``) that TIRPagedKVCache builds, its
    attention slots pointed at fuel's kernels (``self._fuel_kernels``) before it is emitted."""

    _fuel_kernels: dict

    def __init__(self, *, _expr: relax.Expr, _name: str):
        bb = relax.BlockBuilder.current()
        replaced = {}

        def swap(expr):
            if isinstance(expr, relax.GlobalVar) and expr.name_hint in _TVM_SLOT_FUNCTIONS:
                slot = _TVM_SLOT_FUNCTIONS[expr.name_hint]
                name = f"fuel_{expr.name_hint}"  # TVM's own kernel, now unused, keeps its symbol in the module
                replaced[slot] = bb.add_func(self._fuel_kernels[slot].with_attr("global_symbol", name), name)
                return replaced[slot]
            if isinstance(expr, relax.Tuple):
                return relax.Tuple([swap(field) for field in expr.fields])
            return expr

        _expr = relax.Call(_expr.op, [swap(arg) for arg in _expr.args], _expr.attrs, _expr.ty_args)
        missing = set(TVM_SLOTS) - set(replaced)
        if missing:  # TVM named its slot functions otherwise: never a cache that claims fuel's kernels and has TVM's
            raise RuntimeError(f"FuelPagedKVCache: TIRPagedKVCache added no function for the slots {sorted(missing)}")
        super().__init__(_expr=_expr, _name=_name)


class FuelPagedKVCache(tvm_llm_kv.TIRPagedKVCache, _FuelSlots):
    """TVM's ``TIRPagedKVCache`` (same arguments; ``relax.frontend.nn`` models, MLC-LLM's) with
    every attention slot (``TVM_SLOTS``) filled by fuel's kernels (``tvm_kernels``), the other
    slots (append, copy, rotary, debug) TVM's. A model switches by its one constructor call::

        cache = tvm_fuel.kv_cache.FuelPagedKVCache(attn_kind="mha", ..., dtype="float32", target=target)

    llvm and cuda (sm_80 or newer) targets, "mha" attention, equal q/k and v head dims, pages of
    16 and, on cuda, RoPE applied at append (RopeMode.NORMAL or NONE, as TVM's FlashInfer path
    requires): anything else is a ValueError naming the argument.
    """

    def __init__(self, *args, **kwargs):
        bound = inspect.signature(tvm_llm_kv.TIRPagedKVCache.__init__).bind(self, *args, **kwargs)
        bound.apply_defaults()
        a = bound.arguments
        where = "FuelPagedKVCache"
        kinds = a["attn_kind"] if isinstance(a["attn_kind"], list) else [a["attn_kind"]]
        if not set(kinds) <= {"mha", "mha_sliding"}:
            raise ValueError(f"{where}: attn_kind must be 'mha' (or per layer 'mha' / 'mha_sliding'), got "
                             f"{a['attn_kind']!r}")
        if a["qk_head_dim"] != a["v_head_dim"]:
            raise ValueError(f"{where}: v_head_dim ({a['v_head_dim']}) must equal qk_head_dim ({a['qk_head_dim']})")
        page_size = a["page_size"]  # mostly a tirx.Var, given at run time: LlamaCacheEngine checks that one
        if isinstance(page_size, (int, tvm.tirx.IntImm)) and int(page_size) != TVM_PAGE_SIZE:
            raise ValueError(f"{where}: page_size must be {TVM_PAGE_SIZE} (TIRPagedKVCache builds its append and "
                             f"compact kernels, and fuel's slots here, for pages of {TVM_PAGE_SIZE}), got "
                             f"{int(page_size)}")
        from ..target import as_target

        if as_target(a["target"]).kind.name == "cuda" and int(a["rope_mode"]) == int(tvm_llm_kv.RopeMode.INLINE):
            raise ValueError(f"{where}: rope_mode INLINE (RoPE in the kernel) is not served by fuel's CUDA kernels; "
                             "use RopeMode.NORMAL (RoPE applied as keys are appended)")
        rope_scaling = dict(a["rope_scaling"] or {})
        if rope_scaling.get("rope_type") == "yarn" and "inv_theta_log_scale" not in rope_scaling:
            rope_scaling["inv_theta_log_scale"] = 1.0 / (2 * math.log(float(a["rope_theta"])))  # as TVM prepares it
        self._fuel_kernels = tvm_kernels(a["num_key_value_heads"], a["num_attention_heads"], a["qk_head_dim"],
                                         a["dtype"], a["target"], rope_scaling=rope_scaling,
                                         sliding_window_size=a["layer_sliding_window_size"])
        super().__init__(*args, **kwargs)


__all__ = ["TVM_SLOTS", "tvm_kernels", "tvm_own_kernels", "runtime_kernels", "runtime_cache",
           "FuelPagedKVCache"]
