"""fuel's own paged KV cache: the block pool, tables and tensors in the layout ``paged_attn``
reads (vLLM's), and the kernel that writes K/V rows into their slots.

Contents:
    PagedKVCache  -- the block pool, tables and tensors
    append_kernel -- the PrimFunc that writes K/V rows into their slots
"""

from __future__ import annotations

import contextlib
import functools

import numpy as np
import tvm
from tvm.script import tirx as T

from ..op.config import as_int, positive_int


@functools.lru_cache(maxsize=None)
def append_kernel(dtype: str, heads: int, head_dim: int, gpu: bool):
    """PrimFunc(k_cache, v_cache, k_new, v_new, slots): ``cache[slot // bs, slot % bs] = new[b, :, t]``
    with ``slot = slots[b, t]``, for k_new and v_new [B, Hkv, T, D] and slots [B, T] int64.

    A slot outside the cache raises on CPU builds and is skipped on GPU builds (device kernels
    cannot raise): never an out-of-bounds write."""
    threads = 256

    # fmt: off
    @T.prim_func
    def fuel_kv_append(k_cache_h: T.handle, v_cache_h: T.handle, k_new_h: T.handle, v_new_h: T.handle,
                       slots_h: T.handle):
        T.func_attr({"tirx.noalias": True})
        num_blocks, block_size, batch, tokens = T.int64(), T.int64(), T.int64(), T.int64()
        k_cache = T.match_buffer(k_cache_h, (num_blocks, block_size, heads, head_dim), dtype)
        v_cache = T.match_buffer(v_cache_h, (num_blocks, block_size, heads, head_dim), dtype)
        k_new = T.match_buffer(k_new_h, (batch, heads, tokens, head_dim), dtype)
        v_new = T.match_buffer(v_new_h, (batch, heads, tokens, head_dim), dtype)
        slots = T.match_buffer(slots_h, (batch, tokens), "int64")
        if gpu:
            for bx in T.thread_binding(T.Cast("int32", (batch * tokens * heads * head_dim + threads - 1) // threads),
                                       thread="blockIdx.x"):
                for tx in T.thread_binding(threads, thread="threadIdx.x"):
                    e: T.int64 = T.Cast("int64", bx) * threads + tx
                    b: T.int64 = e // (tokens * heads * head_dim)
                    t: T.int64 = e // (heads * head_dim) % tokens
                    h: T.int64 = e // head_dim % heads
                    if e < batch * tokens * heads * head_dim:
                        slot: T.int64 = slots[b, t]
                        if slot >= T.int64(0) and slot < num_blocks * block_size:
                            k_cache[slot // block_size, slot % block_size, h,
                                    e % head_dim] = k_new[b, h, t, e % head_dim]
                            v_cache[slot // block_size, slot % block_size, h,
                                    e % head_dim] = v_new[b, h, t, e % head_dim]
        else:
            for b, t in T.grid(batch, tokens):
                assert slots[b, t] >= T.int64(0) and slots[b, t] < num_blocks * block_size, \
                    "fuel_kv_append: slots[b, t] must be in [0, num_blocks * block_size) (a slot of the cache)"
                for h, d in T.grid(heads, head_dim):
                    k_cache[slots[b, t] // block_size, slots[b, t] % block_size, h, d] = k_new[b, h, t, d]
                    v_cache[slots[b, t] // block_size, slots[b, t] % block_size, h, d] = v_new[b, h, t, d]
    # fmt: on

    # written by hand: dlight (CUDA builds) must not reschedule it; opaque: FuseOps keeps others out
    return fuel_kv_append.with_attr("tirx.is_scheduled", True).with_attr("op_pattern", 8)


class PagedKVCache:
    """K and V caches with a block pool and per-sequence block tables, for every layer of a model.

    Layer ``l``'s pages are rows ``[l * num_blocks, (l + 1) * num_blocks)`` of the two tensors
    ``[num_layers * num_blocks, block_size, Hkv, D]``: every layer shares one block table (offset
    by ``l * num_blocks``), so a model takes two cache tensors, whatever its depth, and writes and
    reads them in place.

    Parameters (keyword-only)
    ----------
    num_blocks, block_size, num_kv_heads, head_dim : int
        Blocks per layer, tokens per block, KV heads, head dim.
    num_layers : int
        Layers sharing the block tables (default 1).
    dtype : str
        float32, float16 or bfloat16.
    device : tvm.runtime.Device
        Where the tensors live (``tvm.cpu()`` or ``tvm.cuda()``).
    target : str, dict or Target, optional
        What the append kernel is built for (default: llvm, or sm of the device for CUDA).
    """

    def __init__(self, *, num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int, num_layers: int = 1,
                 dtype: str = "float32", device=None, target=None):
        num_blocks, block_size, num_kv_heads, head_dim, num_layers = (
            positive_int("PagedKVCache", name, value)
            for name, value in (("num_blocks", num_blocks), ("block_size", block_size),
                                ("num_kv_heads", num_kv_heads), ("head_dim", head_dim), ("num_layers", num_layers)))
        if dtype not in ("float32", "float16", "bfloat16"):
            raise ValueError(f"PagedKVCache: dtype must be float32, float16 or bfloat16, got {dtype!r}")
        self.num_blocks, self.block_size, self.num_kv_heads, self.head_dim = (
            num_blocks, block_size, num_kv_heads, head_dim)
        self.num_layers, self.dtype = num_layers, dtype
        self.device = device or tvm.cpu()
        self.gpu = self.device.dlpack_device_type() != tvm.cpu().dlpack_device_type()
        if target is None:
            target = ({"kind": "cuda", "arch": "sm_" + self.device.compute_version.replace(".", "")} if self.gpu
                      else {"kind": "llvm"})
        from ..target import as_target

        self._append = tvm.compile(append_kernel(dtype, num_kv_heads, head_dim, self.gpu), target=as_target(target))
        shape = (num_layers * num_blocks, block_size, num_kv_heads, head_dim)
        self.k_cache = tvm.runtime.empty(shape, dtype, self.device)
        self.v_cache = tvm.runtime.empty(shape, dtype, self.device)
        self._free = list(range(num_blocks - 1, -1, -1))  # pop() hands out low ids first
        self._blocks: dict[int, list[int]] = {}
        self._lens: dict[int, int] = {}
        self._next_id = 0

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
        """Write ``k``, ``v`` (numpy or tvm tensors [B, Hkv, T, D], B = len(seqs); a list of
        num_layers of them when the cache has several layers) as the next T tokens of each sequence."""
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
                self._append(self.k_cache, self.v_cache, k_new, v_new, layer_slots)

    def _rows(self, x, name: str, batch: int) -> tvm.runtime.Tensor:
        x = x if isinstance(x, tvm.runtime.Tensor) else tvm.runtime.tensor(np.ascontiguousarray(x), device=self.device)
        if x.device != self.device:
            raise ValueError(f"PagedKVCache.append: {name} is on {x.device}, the cache on {self.device}")
        shape = tuple(x.shape)
        if (len(shape) != 4 or shape[0] != batch or shape[1] != self.num_kv_heads or shape[3] != self.head_dim
                or shape[2] < 1 or str(x.dtype) != self.dtype):
            raise ValueError(f"PagedKVCache.append: {name} must be [B={batch}, Hkv={self.num_kv_heads}, T, "
                             f"D={self.head_dim}] {self.dtype}, got {list(shape)} {x.dtype}")
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
