"""fuel's own paged KV cache: the block pool, tables and tensors in the layout ``paged_attn``
reads (vLLM's), and the kernel that writes K/V rows into their slots.

Quantized caches (``dtype`` float8_e4m3fn, float8_e5m2 or int8; vLLM's convention, the formats'
math in ``op.quant``): ``append`` takes float rows (``input_dtype``, float32 by default) and the
kernel quantizes them as it writes them; the cache element ``x`` stands for ``x * scale``:

* fp8: ``k_scale``, ``v_scale`` float32 ``[]`` or ``[Hkv]`` (per KV head), given to the cache and
  fixed; the element is ``x / scale`` rounded to nearest even, saturating at +-448 (e4m3fn) /
  +-57344 (e5m2); NaN stays NaN.
* int8: ``k_scale``, ``v_scale`` float32 ``[num_layers * num_blocks, block_size, Hkv]``, one per
  (block, token, KV head), written with the token: ``scale = max |x| over D / 127`` (float32),
  the element ``x / scale`` rounded to nearest even, clamped to [-127, 127]; a row of zeros gets
  scale 0 and codes 0 (a row holding NaN: a NaN scale).

``reference.quantize_fp8`` and ``reference.quantize_int8`` are the same rules in numpy.

Contents:
    PagedKVCache  -- the block pool, tables and tensors
    append_kernel -- the PrimFunc that writes K/V rows into their slots (quantizing them)
"""

from __future__ import annotations

import contextlib
import functools

import numpy as np
import tvm
from tvm.script import tirx as T

from ..op import quant
from ..op.config import as_int, positive_int


FLOAT_DTYPES = ("float32", "float16", "bfloat16")


@functools.lru_cache(maxsize=None)
def append_kernel(dtype: str, heads: int, head_dim: int, gpu: bool, *, input_dtype: str | None = None,
                  scale_per_head: bool = False):
    """PrimFunc(k_cache, v_cache, k_new, v_new, slots[, k_scale, v_scale]): ``cache[slot // bs,
    slot % bs] = new[b, :, t]`` with ``slot = slots[b, t]``, for k_new and v_new [B, Hkv, T, D]
    ``input_dtype`` (default: float32 for a quantized cache, else ``dtype``) and slots [B, T] int64.

    A float cache (float32, float16, bfloat16) takes the five tensors and stores the rows cast to
    ``dtype``. A quantized cache takes its scales too (float32): fp8 (float8_e4m3fn, float8_e5m2)
    ``k_scale``, ``v_scale`` [] (or [Hkv] with ``scale_per_head``), read: the element is
    ``quant.encode_fp8(x / scale[h])``; int8 ``k_scale``, ``v_scale`` [num_blocks, block_size, Hkv],
    written: each (b, t, h) row gets ``scale = max |x| / 127`` at its slot and the codes
    ``quant.encode_int8(x / scale)`` (a row of zeros: scale 0, codes 0).

    A slot outside the cache raises on CPU builds and is skipped on GPU builds (device kernels
    cannot raise): never an out-of-bounds write."""
    if dtype not in FLOAT_DTYPES + quant.QUANT_DTYPES:
        raise ValueError(f"append_kernel: dtype must be one of {FLOAT_DTYPES + quant.QUANT_DTYPES}, got {dtype!r}")
    int8, fp8 = dtype == "int8", quant.is_fp8(dtype)
    input_dtype = input_dtype or ("float32" if int8 or fp8 else dtype)
    if input_dtype not in FLOAT_DTYPES:
        raise ValueError(f"append_kernel: input_dtype must be float32, float16 or bfloat16, got {input_dtype!r}")
    if scale_per_head and not fp8:
        raise ValueError(f"append_kernel: scale_per_head is for fp8 caches, not {dtype}")
    threads = 256
    per_row = 1 if int8 else head_dim  # GPU threads (and CPU inner iterations) per (b, t, h): int8 reduces the row

    def scale_shape(num_blocks, block_size):  # a float cache's unused scales are dropped below
        return (num_blocks, block_size, heads) if int8 else (heads,) if scale_per_head else ()

    def nonzero(scale):  # a zero row's divisor: 1, its codes are 0 anyway (no division by zero)
        return T.Select(scale == T.float32(0), T.float32(1), scale)

    @T.macro
    def write(cache, scale, new, slot, b, t, h, d):
        if int8:
            absmax = T.alloc_buffer((1,), "uint32", scope="local")
            # the max of the magnitudes' bits (monotonic for floats >= 0): a NaN wins, giving a NaN scale
            absmax[0] = T.uint32(0)
            for i in range(head_dim):
                absmax[0] = T.max(absmax[0], T.reinterpret("uint32", new[b, h, t, i].astype("float32"))
                                  & T.uint32(0x7FFFFFFF))
            row_scale: T.float32 = quant.int8_scale(T.reinterpret("float32", absmax[0]))
            scale[slot // cache.shape[1], slot % cache.shape[1], h] = row_scale
            for i in range(head_dim):
                x: T.float32 = new[b, h, t, i].astype("float32") / nonzero(row_scale)
                cache[slot // cache.shape[1], slot % cache.shape[1], h, i] = quant.encode_int8(x)
        elif fp8:
            x: T.float32 = new[b, h, t, d].astype("float32") / (scale[h] if scale_per_head else scale[()])
            cache[slot // cache.shape[1], slot % cache.shape[1], h, d] = quant.encode_fp8(x, dtype)
        else:
            cache[slot // cache.shape[1], slot % cache.shape[1], h, d] = new[b, h, t, d].astype(dtype)

    # fmt: off
    @T.prim_func
    def fuel_kv_append(k_cache_h: T.handle, v_cache_h: T.handle, k_new_h: T.handle, v_new_h: T.handle,
                       slots_h: T.handle, k_scale_h: T.handle, v_scale_h: T.handle):
        T.func_attr({"tirx.noalias": True})
        num_blocks, block_size, batch, tokens = T.int64(), T.int64(), T.int64(), T.int64()
        k_cache = T.match_buffer(k_cache_h, (num_blocks, block_size, heads, head_dim), dtype)
        v_cache = T.match_buffer(v_cache_h, (num_blocks, block_size, heads, head_dim), dtype)
        k_new = T.match_buffer(k_new_h, (batch, heads, tokens, head_dim), input_dtype)
        v_new = T.match_buffer(v_new_h, (batch, heads, tokens, head_dim), input_dtype)
        slots = T.match_buffer(slots_h, (batch, tokens), "int64")
        k_scale = T.match_buffer(k_scale_h, scale_shape(num_blocks, block_size), "float32")
        v_scale = T.match_buffer(v_scale_h, scale_shape(num_blocks, block_size), "float32")
        if gpu:
            for bx in T.thread_binding(T.Cast("int32", (batch * tokens * heads * per_row + threads - 1) // threads),
                                       thread="blockIdx.x"):
                for tx in T.thread_binding(threads, thread="threadIdx.x"):
                    e: T.int64 = T.Cast("int64", bx) * threads + tx
                    b: T.int64 = e // (tokens * heads * per_row)
                    t: T.int64 = e // (heads * per_row) % tokens
                    h: T.int64 = e // per_row % heads
                    if e < batch * tokens * heads * per_row:
                        slot: T.int64 = slots[b, t]
                        if slot >= T.int64(0) and slot < num_blocks * block_size:
                            write(k_cache, k_scale, k_new, slot, b, t, h, e % per_row)
                            write(v_cache, v_scale, v_new, slot, b, t, h, e % per_row)
        else:
            for b, t in T.grid(batch, tokens):
                assert slots[b, t] >= T.int64(0) and slots[b, t] < num_blocks * block_size, \
                    "fuel_kv_append: slots[b, t] must be in [0, num_blocks * block_size) (a slot of the cache)"
                for h, d in T.grid(heads, per_row):
                    write(k_cache, k_scale, k_new, slots[b, t], b, t, h, d)
                    write(v_cache, v_scale, v_new, slots[b, t], b, t, h, d)
    # fmt: on

    func = fuel_kv_append
    if not (int8 or fp8):  # a float cache keeps its five-tensor signature (models' call_tir_inplace)
        func = tvm.tirx.PrimFunc(func.params[:5], func.body, func.ret_type, func.attrs)
    # written by hand: dlight (CUDA builds) must not reschedule it; opaque: FuseOps keeps others out
    return func.with_attr("tirx.is_scheduled", True).with_attr("op_pattern", 8)


class PagedKVCache:
    """K and V caches with a block pool and per-sequence block tables, for every layer of a model.

    Layer ``l``'s pages are rows ``[l * num_blocks, (l + 1) * num_blocks)`` of the two tensors
    ``[num_layers * num_blocks, block_size, Hkv, D]``: every layer shares one block table (offset
    by ``l * num_blocks``), so a model takes two cache tensors, whatever its depth, and writes and
    reads them in place.

    Parameters (keyword-only)
    ----------
    num_blocks, block_size, num_kv_heads, head_dim : int
        Blocks per layer, tokens per block, KV heads (Hkv), head dim (D).
    num_layers : int
        Layers sharing the block tables (default 1).
    dtype : str
        The caches' element type: float32, float16, bfloat16, or a quantized one (``paged_attn``
        reads them with ``k_scale``, ``v_scale``): float8_e4m3fn, float8_e5m2, int8.
    input_dtype : str, optional
        The dtype of the K/V rows ``append`` takes: float32, float16 or bfloat16 (default: float32
        for a quantized cache, else ``dtype``).
    k_scale, v_scale : float or sequence of Hkv floats, optional
        fp8 caches only: the element ``x`` stands for ``x * scale`` (default 1.0); each finite and
        > 0 (in float32). One per KV head when a sequence (the other is then broadcast to [Hkv]).
    device : tvm.runtime.Device
        Where the tensors live (``tvm.cpu()`` or ``tvm.cuda()``).
    target : str, dict or Target, optional
        What the append kernel is built for (default: llvm, or sm of the device for CUDA).

    Attributes
    ----------
    k_cache, v_cache : tvm.runtime.Tensor
        ``[num_layers * num_blocks, block_size, Hkv, D]`` of ``dtype``.
    k_scale, v_scale : tvm.runtime.Tensor or None
        float32. fp8 caches: ``[]`` (one scale) or ``[Hkv]`` (per KV head), fixed. int8 caches:
        ``[num_layers * num_blocks, block_size, Hkv]``, one per (block, token, KV head), zero until
        ``append`` writes the token (``max |x|`` over D / 127). Float caches: None.
    """

    def __init__(self, *, num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int, num_layers: int = 1,
                 dtype: str = "float32", input_dtype: str | None = None, k_scale=None, v_scale=None, device=None,
                 target=None):
        num_blocks, block_size, num_kv_heads, head_dim, num_layers = (
            positive_int("PagedKVCache", name, value)
            for name, value in (("num_blocks", num_blocks), ("block_size", block_size),
                                ("num_kv_heads", num_kv_heads), ("head_dim", head_dim), ("num_layers", num_layers)))
        if dtype not in FLOAT_DTYPES + quant.QUANT_DTYPES:
            raise ValueError(f"PagedKVCache: dtype must be float32, float16, bfloat16, float8_e4m3fn, float8_e5m2 "
                             f"or int8, got {dtype!r}")
        input_dtype = input_dtype or ("float32" if dtype in quant.QUANT_DTYPES else dtype)
        if input_dtype not in FLOAT_DTYPES:
            raise ValueError(f"PagedKVCache: input_dtype must be float32, float16 or bfloat16, got {input_dtype!r}")
        self.num_blocks, self.block_size, self.num_kv_heads, self.head_dim = (
            num_blocks, block_size, num_kv_heads, head_dim)
        self.num_layers, self.dtype, self.input_dtype = num_layers, dtype, input_dtype
        self.device = device or tvm.cpu()
        self.gpu = self.device.dlpack_device_type() != tvm.cpu().dlpack_device_type()
        scales = self._scales(k_scale, v_scale)
        if target is None:
            target = ({"kind": "cuda", "arch": "sm_" + self.device.compute_version.replace(".", "")} if self.gpu
                      else {"kind": "llvm"})
        from ..target import as_target

        kernel = append_kernel(dtype, num_kv_heads, head_dim, self.gpu, input_dtype=input_dtype,
                               scale_per_head=quant.is_fp8(dtype) and scales[0].ndim == 1)
        self._append = tvm.compile(kernel, target=as_target(target))
        shape = (num_layers * num_blocks, block_size, num_kv_heads, head_dim)
        self.k_cache = tvm.runtime.empty(shape, dtype, self.device)
        self.v_cache = tvm.runtime.empty(shape, dtype, self.device)
        self.k_scale, self.v_scale = (None, None) if scales is None else (
            tvm.runtime.tensor(scale, device=self.device) for scale in scales)
        self._free = list(range(num_blocks - 1, -1, -1))  # pop() hands out low ids first
        self._blocks: dict[int, list[int]] = {}
        self._lens: dict[int, int] = {}
        self._next_id = 0

    def _scales(self, k_scale, v_scale) -> tuple[np.ndarray, np.ndarray] | None:
        """The initial float32 k_scale, v_scale (fp8: [] or [Hkv]; int8: zeros) or None (float caches)."""
        if not quant.is_fp8(self.dtype):
            given = [name for name, value in (("k_scale", k_scale), ("v_scale", v_scale)) if value is not None]
            if given:
                verb = "are" if len(given) > 1 else "is"
                per_token = " (its scales are per token, set by append)" if self.dtype == "int8" else ""
                raise ValueError(f"PagedKVCache: {' and '.join(given)} {verb} only for fp8 caches (float8_e4m3fn, "
                                 f"float8_e5m2), not {self.dtype}{per_token}")
            if self.dtype != "int8":
                return None
            zeros = np.zeros((self.num_layers * self.num_blocks, self.block_size, self.num_kv_heads), "float32")
            return zeros, zeros
        scales = []
        for name, value in (("k_scale", k_scale), ("v_scale", v_scale)):
            try:
                with np.errstate(over="ignore"):  # 1e300 -> inf, refused below
                    scale = np.asarray(1.0 if value is None else value, dtype="float64").astype("float32")
            except (TypeError, ValueError):
                scale = None
            # float32, the kernel's: 1e-50 or 1e300 would pass in float64 and divide by 0 or inf
            if (scale is None or isinstance(value, (str, bytes, bool, np.bool_)) or scale.ndim > 1
                    or (scale.ndim == 1 and scale.shape[0] != self.num_kv_heads)
                    or not (np.isfinite(scale).all() and (scale > 0).all())):
                raise ValueError(f"PagedKVCache: {name} must be a float or {self.num_kv_heads} floats (one per KV "
                                 f"head), each finite and > 0 in float32, got {value!r}")
            scales.append(scale)
        if scales[0].ndim != scales[1].ndim:  # the kernel reads both alike: a scalar becomes one per head
            scales = [np.broadcast_to(scale, (self.num_kv_heads,)).copy() for scale in scales]
        return scales[0], scales[1]

    @property
    def free_blocks(self) -> int:
        return len(self._free)

    def add_sequence(self) -> int:
        """A new, empty sequence; returns its id."""
        seq = self._next_id
        self._next_id += 1
        self._blocks[seq], self._lens[seq] = [], 0
        return seq

    def free(self, seq: int) -> None:
        """Return the sequence's blocks to the pool and forget it."""
        (seq,) = self._check([seq], "free")
        self._free.extend(reversed(self._blocks.pop(seq)))
        del self._lens[seq]

    def length(self, seq: int) -> int:
        """The sequence's token count."""
        (seq,) = self._check([seq], "length")
        return self._lens[seq]

    def truncate(self, seq: int, length: int) -> None:
        """Forget the sequence's tokens from ``length`` on, returning the blocks they alone used
        (a failed step rolls back with it)."""
        (seq,) = self._check([seq], "truncate")
        length = as_int("PagedKVCache.truncate", "length", length)
        if not 0 <= length <= self._lens[seq]:
            raise ValueError(f"PagedKVCache.truncate: length must be in [0, {self._lens[seq]}], got {length}")
        blocks = self._blocks[seq]
        keep = -(-length // self.block_size)
        self._free.extend(reversed(blocks[keep:]))
        del blocks[keep:]
        self._lens[seq] = length

    @contextlib.contextmanager
    def rollback_on_error(self, seqs: list[int]):
        """Within the block, an exception truncates ``seqs`` back to their lengths at entry."""
        seqs = self._check(seqs, "rollback_on_error")
        lengths = {seq: self._lens[seq] for seq in seqs}
        try:
            yield
        except BaseException:
            for seq, length in lengths.items():
                if seq in self._lens:
                    self.truncate(seq, length)
            raise

    def reserve(self, seqs: list[int], tokens: int) -> tvm.runtime.Tensor:
        """Make room for the next ``tokens`` tokens of each sequence (allocating blocks as they fill)
        and count them in its length. Returns their slots ``[B, tokens]`` int64 (``block * block_size
        + offset``, layer 0; layer ``l`` adds ``l * num_blocks * block_size``), what a model's
        in-graph append (``append_kernel``) writes to."""
        return tvm.runtime.tensor(self._reserve(seqs, tokens), device=self.device)

    def _reserve(self, seqs: list[int], tokens: int) -> np.ndarray:
        seqs = self._check(seqs, "reserve")
        tokens = positive_int("PagedKVCache.reserve", "tokens", tokens)
        needed = sum(-(-(self._lens[s] + tokens) // self.block_size) - len(self._blocks[s]) for s in seqs)
        if needed > len(self._free):
            raise ValueError(f"PagedKVCache.reserve: needs {needed} more blocks, {len(self._free)} free "
                             f"(free finished sequences or make the cache larger)")
        slots = np.empty((len(seqs), tokens), "int64")
        for row, seq in enumerate(seqs):
            blocks, start = self._blocks[seq], self._lens[seq]
            while len(blocks) * self.block_size < start + tokens:
                blocks.append(self._free.pop())
            positions = np.arange(start, start + tokens)
            slots[row] = np.asarray(blocks, "int64")[positions // self.block_size] * self.block_size + (
                positions % self.block_size)
            self._lens[seq] = start + tokens
        return slots

    def append(self, seqs: list[int], k, v) -> None:
        """Write ``k``, ``v`` (numpy or tvm tensors [B, Hkv, T, D] of ``input_dtype``, B = len(seqs);
        a list of num_layers of them when the cache has several layers) as the next T tokens of each
        sequence: cast to ``dtype``, or quantized (int8: their scales written alongside)."""
        seqs = self._check(seqs, "append")
        ks, vs = ([x] if self.num_layers == 1 and not isinstance(x, (list, tuple)) else list(x) for x in (k, v))
        if len(ks) != self.num_layers or len(vs) != self.num_layers:
            raise ValueError(f"PagedKVCache.append: k and v must hold {self.num_layers} layers, "
                             f"got {len(ks)} and {len(vs)}")
        ks, vs = ([self._rows(x, name, len(seqs)) for x in xs] for name, xs in (("k", ks), ("v", vs)))
        if any(tuple(x.shape) != tuple(ks[0].shape) for x in ks + vs):
            raise ValueError(f"PagedKVCache.append: every k and v must be {list(ks[0].shape)}")
        with self.rollback_on_error(seqs):
            slots = self._reserve(seqs, int(ks[0].shape[2]))
            for layer, (k_new, v_new) in enumerate(zip(ks, vs)):
                layer_slots = tvm.runtime.tensor(slots + layer * self.num_blocks * self.block_size, device=self.device)
                scales = () if self.k_scale is None else (self.k_scale, self.v_scale)
                self._append(self.k_cache, self.v_cache, k_new, v_new, layer_slots, *scales)

    def _rows(self, x, name: str, batch: int) -> tvm.runtime.Tensor:
        x = x if isinstance(x, tvm.runtime.Tensor) else tvm.runtime.tensor(np.ascontiguousarray(x), device=self.device)
        if x.device != self.device:
            raise ValueError(f"PagedKVCache.append: {name} is on {x.device}, the cache on {self.device}")
        shape = tuple(x.shape)
        if (len(shape) != 4 or shape[0] != batch or shape[1] != self.num_kv_heads or shape[3] != self.head_dim
                or shape[2] < 1 or str(x.dtype) != self.input_dtype):
            raise ValueError(f"PagedKVCache.append: {name} must be [B={batch}, Hkv={self.num_kv_heads}, T, "
                             f"D={self.head_dim}] {self.input_dtype}, got {list(shape)} {x.dtype}")
        return x

    def block_table(self, seqs: list[int], max_blocks: int | None = None) -> tvm.runtime.Tensor:
        """[B, max_blocks] int32: each sequence's blocks, padded with -1 (never read: past its length)."""
        seqs = self._check(seqs, "block_table")
        width = (max(1, max(len(self._blocks[s]) for s in seqs)) if max_blocks is None
                 else as_int("PagedKVCache.block_table", "max_blocks", max_blocks))
        if width < 1:
            raise ValueError(f"PagedKVCache.block_table: max_blocks must be >= 1, got {max_blocks}")
        table = np.full((len(seqs), width), -1, "int32")
        for row, seq in enumerate(seqs):
            blocks = self._blocks[seq]
            if len(blocks) > width:
                raise ValueError(f"PagedKVCache.block_table: sequence {seq} holds {len(blocks)} blocks "
                                 f"> max_blocks {width}")
            table[row, :len(blocks)] = blocks
        return tvm.runtime.tensor(table, device=self.device)

    def context_lens(self, seqs: list[int]) -> tvm.runtime.Tensor:
        """[B] int32: each sequence's token count."""
        seqs = self._check(seqs, "context_lens")
        return tvm.runtime.tensor(np.array([self._lens[s] for s in seqs], "int32"), device=self.device)

    def _check(self, seqs, what: str) -> list[int]:
        """``seqs`` as a list of known, distinct sequence ids (numpy integers qualify, bools do not)."""
        if isinstance(seqs, (int, np.integer)) or not hasattr(seqs, "__iter__"):  # a bare id, not a list
            raise TypeError(f"PagedKVCache.{what}: seqs must be a list of sequence ids, got {seqs!r}")
        seqs = [as_int(f"PagedKVCache.{what}", "a sequence id", s) for s in seqs]
        if not seqs:
            raise ValueError(f"PagedKVCache.{what}: seqs must name at least one sequence")
        unknown = [s for s in seqs if s not in self._blocks]
        if unknown:
            raise KeyError(f"PagedKVCache.{what}: unknown sequence ids {unknown} (add_sequence first)")
        if len(set(seqs)) != len(seqs):  # one sequence twice in a batch would get two slots per position
            raise ValueError(f"PagedKVCache.{what}: seqs {seqs} repeat a sequence id")
        return seqs


__all__ = ["PagedKVCache", "append_kernel"]
