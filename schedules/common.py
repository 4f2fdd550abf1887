"""Pieces shared by the kernels of every target: the kernel spec, tile ranges, per-element logits,
the GQA row packing, finishing.

Contents:
    KernelSpec        -- the static facts of one kernel instance (from ..workload)
    shape_vars        -- the runtime dims of a kernel: symbolic vars or constants
    kernel_sizes      -- an attention kernel's runtime sizes by name (dense or paged)
    kernel_params     -- every kernel's prologue: its parameters' buffers, laid out by name
    check_packed      -- what a packed (varlen) kernel's spec cannot have
    key_tile_range    -- the key tiles a range of query positions can see (the window's)
    KeyTiles, key_tiles -- those tiles and the sink tokens' left of them, walked as one range
    query_tile_range  -- the query tiles that can see a range of keys (backward)
    balanced_order    -- a task order whose contiguous chunks carry equal causal work
    tile_is_interior  -- whether a (rows, key tile) pair needs no masking
    row_head, row_position -- the GQA row packing of the forward kernels
    visible, biased, masked_logit, probability, shifted_logit -- the element-wise mask, logit and softmax
                      weight (via tvm_fuel.op.semantics), and the logit less the lse that the weight exponentiates
    is_key_mask, key_mask_heads, without_mask, key_term, add_key_term, key_masked_shifted_logit -- a mask the
                      same for every query row (a key mask or bias), read once per key tile instead of per score
    mask_shape, mask_at, drop_params, finish
    ceil_div, NEG_INF -- trip counts; the -inf literal of the kernels' running maxima
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from tvm import tirx
from tvm.script import tirx as T

from tvm_fuel.op import semantics as sem
from tvm_fuel.op.config import AttnConfig
from .workload import KernelSpec

F32 = "float32"
NEG_INF = float("-inf")  # a Python float: T.float32(NEG_INF) is the -inf literal


def ceil_div(a: int, b: int) -> int:
    """ceil(a / b) of two Python ints (loop trip counts, slots per thread)."""
    return -(-a // b)


def key_range(cfg: AttnConfig, *, first_pos, last_pos, kv_len, delta):
    """[lo, hi) of the keys that rows at query positions first_pos..last_pos can see."""
    lo = tirx.const(0, "int64")
    hi = sem.as_int64(kv_len)
    if cfg.window_left >= 0:
        lo = tirx.max(lo, first_pos + delta - cfg.window_left)
    if cfg.window_right >= 0:
        hi = tirx.min(hi, last_pos + delta + cfg.window_right + 1)
    return lo, hi


def key_tile_range(cfg: AttnConfig, *, first_pos, last_pos, kv_len, delta, block_k: int):
    """[lo, hi) of the key tiles that rows at query positions first_pos..last_pos can see."""
    lo, hi = key_range(cfg, first_pos=first_pos, last_pos=last_pos, kv_len=kv_len, delta=delta)
    tile_lo = tirx.floordiv(lo, block_k)
    return tile_lo, tirx.max(tile_lo, tirx.floordiv(hi + block_k - 1, block_k))


@dataclass(frozen=True)
class KeyTiles:
    """The key tiles rows can see, walked as one range ``t = 0 .. count - 1``: the sink tokens'
    tiles ``[0, sinks)`` left of the window (``sink_tokens``; none: ``sinks`` is 0), then the
    window's ``[lo, hi)``. Tiles between them hold no key the rows see, and are not walked."""

    sinks: tirx.PrimExpr | int
    lo: tirx.PrimExpr
    hi: tirx.PrimExpr

    @property
    def count(self):
        return self.hi - self.lo if isinstance(self.sinks, int) else self.sinks + (self.hi - self.lo)

    def tile(self, t):
        """The key tile of step ``t``."""
        if isinstance(self.sinks, int):
            return self.lo + t
        t = sem.as_int64(t)  # a pipeline's step may be int32
        return tirx.Select(t < self.sinks, t, t - self.sinks + self.lo)

    def bound(self, sinks, lo, first=0):
        """``tile(first + t)`` as a function of t, over ``sinks``, ``lo`` (and ``first``) that the
        caller bound to variables (``lo: T.int64 = walk.lo``). Inlined at every use of the tile index,
        the sink tokens' Select over the window's min/max expressions took TVM's simplifier 25 s
        per CUDA kernel (1 s without sink tokens)."""
        walk = KeyTiles(self.sinks if isinstance(self.sinks, int) else sinks, lo, self.hi)
        return lambda t: walk.tile(first + t)


def key_tiles(cfg: AttnConfig, *, first_pos, last_pos, kv_len, delta, block_k: int) -> KeyTiles:
    """The key tiles that rows at query positions first_pos..last_pos can see (``KeyTiles``)."""
    lo, hi = key_tile_range(cfg, first_pos=first_pos, last_pos=last_pos, kv_len=kv_len, delta=delta,
                            block_k=block_k)
    if not cfg.sink_tokens or cfg.window_left < 0:
        return KeyTiles(0, lo, hi)
    # the sink tokens' tiles left of the window's first (a sink tile inside it is the window's)
    return KeyTiles(tirx.min(tirx.const(ceil_div(cfg.sink_tokens, block_k), "int64"), lo), lo, hi)


def tile_width(cfg: AttnConfig, *, key_start, first_pos, last_pos, kv_len, delta, block_k: int, step: int):
    """Keys of the tile at ``key_start`` up to the last one the rows can see, rounded up to ``step``
    (at most block_k): a causal diagonal tile computes only its visible part."""
    _, hi = key_range(cfg, first_pos=first_pos, last_pos=last_pos, kv_len=kv_len, delta=delta)
    return tirx.min(tirx.const(block_k, "int64"), tirx.floordiv(hi - key_start + step - 1, step) * step)


def tile_is_interior(cfg: AttnConfig, *, key_start, first_pos, last_pos, kv_len, delta, block_k: int):
    """True when every row of the task sees every key of the tile (no masking needed; a tile
    of sink tokens left of the window is masked as a window tile is)."""
    cond = key_start + block_k <= sem.as_int64(kv_len)
    if cfg.window_left >= 0:
        cond = tirx.all(cond, key_start >= last_pos + delta - cfg.window_left)
    if cfg.window_right >= 0:
        cond = tirx.all(cond, key_start + block_k - 1 <= first_pos + delta + cfg.window_right)
    return cond


def query_tile_range(cfg: AttnConfig, *, key_first, key_last, num_queries, delta, block_q: int):
    """[lo, hi) of the query tiles (of block_q positions) whose rows can see keys key_first..key_last."""
    lo = tirx.const(0, "int64")
    hi = sem.as_int64(num_queries)
    if cfg.window_right >= 0:  # j <= i + delta + right  <=>  i >= j - delta - right
        lo = tirx.max(lo, key_first - delta - cfg.window_right)
    if cfg.window_left >= 0:  # j >= i + delta - left  <=>  i <= j - delta + left
        bound = key_last - delta + cfg.window_left + 1
        if cfg.sink_tokens:  # a sink token is seen by every later query
            bound = tirx.Select(key_first < cfg.sink_tokens, sem.as_int64(num_queries), bound)
        hi = tirx.min(hi, bound)
    tile_lo = tirx.floordiv(lo, block_q)
    return tile_lo, tirx.max(tile_lo, tirx.floordiv(hi + block_q - 1, block_q))


def balanced_order(j, n):
    """The ``j``-th of ``n`` tiles in the order 0, n-1, 1, n-2, ... (a bijection on [0, n)).

    Causal work grows with the tile index, and a parallel loop hands each thread a contiguous
    chunk of tasks: in this order every chunk holds light and heavy tiles in pairs, so the
    threads finish together even when B * Hkv is below the thread count (1.48x imbalanced with
    tiles in order and B * Hkv = 1 or 3)."""
    return tirx.Select(j % 2 == 0, j // 2, n - 1 - j // 2)


def shape_vars(dims, names: tuple[str, ...]) -> tuple:
    """The kernel's runtime dims: an int64 var per symbolic dim, a constant per static one.

    Made before the ``@T.prim_func`` and used there as closure values, so one template gives the
    symbolic kernel (build) and the static instances MetaSchedule measures (tuning).
    """
    return tuple(tirx.Var(name, "int64") if dims.get(name) is None else tirx.const(int(dims[name]), "int64")
                 for name in names)


DENSE_SIZES = ("B", "Sq", "Sk")
PAGED_SIZES = ("B", "Sq", "num_blocks", "max_blocks")


def kernel_sizes(dims, *, paged: bool = False) -> dict:
    """An attention kernel's runtime sizes by name (``shape_vars`` of DENSE_SIZES, or PAGED_SIZES):
    what its body loops over and what ``kernel_params`` lays its buffers out by."""
    names = PAGED_SIZES if paged else DENSE_SIZES
    return dict(zip(names, shape_vars(dims or {}, names)))


def drop_params(func: tirx.PrimFunc, names: set[str]) -> tirx.PrimFunc:
    """The PrimFunc without the (unused) buffer parameters called ``names``."""
    keep = [p for p in func.params if p.name not in names]
    return tirx.PrimFunc(keep, func.body, func.ret_type, func.attrs)


def row_head(g, row, group: int):
    """Query head of task row ``row`` of KV head ``g``: rows pack (position, head in group)."""
    return g * group + row % group


def row_position(row, group: int):
    """Query position of task row ``row`` (row = position * group + head in group)."""
    return row // group


def mask_at(mask, b, h, i, j):
    """attn_mask at (b, h, i, j). Tiles run past the last key (those lanes are dropped anyway) and
    the vectorized select reads every lane, so the key index is clamped into the mask."""
    last = sem.as_int64(mask.shape[-1]) - 1
    return mask[sem.mask_index(mask.shape, b, h, i, tirx.min(sem.as_int64(j), last))]


def visible(spec: KernelSpec, mask, b, h, i, j, kv_len, delta):
    """Whether key j is kept for query (b, h, i): length, window and boolean mask."""
    keep = sem.keep(spec.cfg, i, j, kv_len=kv_len, delta=delta)
    if spec.mask_dtype == "bool":
        keep = tirx.all(keep, mask_at(mask, b, h, i, j))
    return keep


def biased(spec: KernelSpec, capped, alibi, mask, b, h, i, j, delta):
    """The logit from the capped score: + ALiBi + additive mask (bounded by ``semantics.add_mask``,
    so a finite bias stays finite in the kernels that scale logits by log2 e)."""
    if spec.has_alibi:
        capped = capped + sem.alibi_bias(alibi[h], i, j, delta=delta)
    if spec.mask_dtype is not None and spec.mask_dtype != "bool":
        capped = sem.add_mask(capped, mask_at(mask, b, h, i, j))
    return capped


# the parameters shaped [B, Hq, Sq, D] and [B, Hkv, Sk, D] (tangents, cotangents and gradients included)
_QUERY_LIKE = ("q", "do", "out", "dq", "q_dot", "out_dot", "dq_bar", "q_grad", "do_grad")
_KEY_LIKE = ("k", "v", "dk", "dv", "k_dot", "v_dot", "dk_bar", "dv_bar", "k_grad", "v_grad")


def check_packed(spec: KernelSpec, kernel: str):
    """ValueError naming ``kernel`` where ``spec`` is no packed batch's: query heads no multiple of
    the KV heads, or a mask, a paged cache or sinks."""
    if spec.num_q_heads % spec.num_kv_heads:
        raise ValueError(f"{kernel}: num_q_heads {spec.num_q_heads} must be a multiple of num_kv_heads "
                         f"{spec.num_kv_heads}")
    if spec.mask_dtype is not None or spec.mask_broadcast or spec.block_size or spec.has_sinks:
        raise ValueError(f"{kernel}: a packed batch takes no attn_mask, paged cache or sinks")


def kernel_params(spec: KernelSpec, sizes: dict, *handles) -> tuple:
    """A kernel's prologue: declares its parameters non-aliasing and returns the buffers of its
    ``handles``, in their order, each laid out by its name (the handle's name less ``_h``: ``q_h``
    holds ``q``) for the runtime ``sizes`` (B, Sq and Sk; paged: B, Sq, num_blocks, max_blocks;
    packed (varlen): total_q, total_k and B1, the offsets' length).
    Called first in a ``@T.prim_func`` body: every target's kernels of an op share one signature,
    and the signature alone names the parameters."""
    T.func_attr({"tirx.noalias": True})
    dtype, Hq, Hkv, D = spec.dtype, spec.num_q_heads, spec.num_kv_heads, spec.head_dim
    if "total_q" in sizes:
        total_q, total_k = sizes["total_q"], sizes["total_k"]
        packed = dict(q=((total_q, Hq, D), dtype), out=((total_q, Hq, D), dtype), k=((total_k, Hkv, D), dtype),
                      v=((total_k, Hkv, D), dtype), cu_seqlens_q=((sizes["B1"],), "int32"),
                      cu_seqlens_k=((sizes["B1"],), "int32"), alibi_slopes=((Hq,), F32), lse=((Hq, total_q), F32))
        packed.update(do=packed["q"], dq=packed["q"], dk=packed["k"], dv=packed["k"])  # the backward's
        return tuple(T.match_buffer(handle, *packed[handle.name.removesuffix("_h")]) for handle in handles)
    B, Sq = sizes["B"], sizes["Sq"]
    has_mask = len(spec.mask_broadcast) > 0
    query_like = ((B, Hq, Sq, D), dtype)
    layouts = {name: query_like for name in _QUERY_LIKE}
    layouts.update(lse=((B, Hq, Sq), F32), alibi=((Hq,), F32), sinks=((Hq,), F32))
    if "Sk" in sizes:
        kv = ((B, Hkv, sizes["Sk"], D), dtype)
        layouts.update({name: kv for name in _KEY_LIKE})
        layouts.update(mask=(mask_shape(spec, B, Sq, sizes["Sk"]) if has_mask else (1,), spec.mask_dtype or "bool"))
    else:
        cache = ((sizes["num_blocks"], spec.block_size, Hkv, D), spec.kv_dtype)
        scale = {"tensor": (), "head": (Hkv,), "token": (sizes["num_blocks"], spec.block_size, Hkv)}.get(spec.kv_scale,
                                                                                                      (1,))
        layouts.update(k_cache=cache, v_cache=cache, table=((B, sizes["max_blocks"]), spec.table_dtype),
                       lens=((B,), spec.lens_dtype), k_scale=(scale, F32), v_scale=(scale, F32))
    return tuple(T.match_buffer(handle, *layouts[handle.name.removesuffix("_h")]) for handle in handles)


def masked_logit(spec: KernelSpec, capped, alibi, mask, b, h, i, j, kv_len, delta):
    """The logit of query (b, h, i) and key j from the (softcapped) score: biased, or -inf where
    the key is dropped. What every kernel computes per score element."""
    return sem.masked(visible(spec, mask, b, h, i, j, kv_len, delta),
                      biased(spec, capped, alibi, mask, b, h, i, j, delta))


def probability(spec: KernelSpec, capped, alibi, mask, b, h, i, j, kv_len, delta, lse):
    """P = exp(logit - lse) of query (b, h, i) and key j from the (softcapped) score and the row's
    lse, 0 where the key is dropped: what every backward kernel recomputes per score element (the
    CUDA kernels, whose exp is one instruction). The CPU kernels, whose vectorizing exp reads its
    argument a hundred times, store ``shifted_logit`` first and take ``semantics.exp_shifted`` of
    its load."""
    return sem.exp_shifted(shifted_logit(spec, capped, alibi, mask, b, h, i, j, kv_len, delta, lse), lse)


def shifted_logit(spec: KernelSpec, capped, alibi, mask, b, h, i, j, kv_len, delta, lse):
    """``logit - lse`` of query (b, h, i) and key j, ``-inf`` where the key is dropped: what
    ``probability`` exponentiates."""
    return T.Select(visible(spec, mask, b, h, i, j, kv_len, delta),
                    biased(spec, capped, alibi, mask, b, h, i, j, delta) - lse, sem.NEG_INF)


def is_key_mask(spec: KernelSpec) -> bool:
    """Whether the spec's mask is the same for every query row: its query dim broadcast ([B, 1, 1, Sk],
    [B, Hq, 1, Sk], [1, Sk], ...; a [Sk] mask too). Such a mask is a per-key term (``key_term``) that a
    kernel reads once per key tile and adds to whole columns of scores."""
    broadcast = spec.mask_broadcast
    return spec.mask_dtype is not None and (len(broadcast) == 1 or (len(broadcast) >= 2 and broadcast[-2]))


def key_mask_heads(spec: KernelSpec) -> int:
    """How many of a KV head's query heads have a key mask of their own: the group where the mask
    has a query-head dim, else 1 (one term per key serves every row)."""
    broadcast = spec.mask_broadcast
    return spec.group if len(broadcast) >= 3 and not broadcast[-3] else 1


def without_mask(spec: KernelSpec) -> KernelSpec:
    """The spec less its mask: the other parts of a logit (softcap, ALiBi, window, length)."""
    return replace(spec, mask_dtype=None, mask_broadcast=())


def key_term(spec: KernelSpec, mask, b, h, j, *, unit: float = 1.0):
    """The key mask's term of key j for query head h of batch b (``is_key_mask``), ``unit`` the
    logits' (LOG2E where they are in log2 units): 0 where a boolean mask keeps the key and -inf
    where it drops it; an additive mask's value bounded as ``semantics.add_mask`` bounds it, times
    ``unit`` (-inf and NaN stay as they are). ``add_key_term`` adds it to a logit."""
    value = mask_at(mask, b, h, 0, j)
    if spec.mask_dtype == "bool":
        return tirx.Select(value, tirx.const(0.0, F32), sem.NEG_INF)
    return sem.add_mask(tirx.const(0.0, F32), value) * tirx.const(unit, F32)


def add_key_term(logit, term):
    """``logit`` + a key's ``key_term``; -inf where the term is -inf, even for a NaN logit (the
    mask drops the key whatever the score)."""
    return tirx.Select(term == sem.NEG_INF, sem.NEG_INF, logit + term)


def key_masked_shifted_logit(spec: KernelSpec, capped, alibi, term, b, h, i, j, kv_len, delta, lse):
    """``shifted_logit`` under a key mask (``is_key_mask``) from key j's ``key_term`` (natural
    units), read once per key tile: ``-inf`` where the window/length rule or the term drops the key."""
    plain = without_mask(spec)
    keep = tirx.all(visible(plain, None, b, h, i, j, kv_len, delta), term != sem.NEG_INF)
    return T.Select(keep, biased(plain, capped, alibi, None, b, h, i, j, delta) + term - lse, sem.NEG_INF)


def mask_shape(spec: KernelSpec, B, Sq, Sk):
    full = (B, spec.num_q_heads, Sq, Sk)[4 - len(spec.mask_broadcast):]
    return tuple(1 if one else n for one, n in zip(spec.mask_broadcast, full))


def finish(func: tirx.PrimFunc) -> tirx.PrimFunc:
    # scheduled by hand: dlight/MetaSchedule skip it; opaque: FuseOps keeps neighbours out of it
    return func.with_attr("tirx.is_scheduled", True).with_attr("op_pattern", 8)
