"""A paged KV cache for decode loops, in the layout ``paged_attn`` reads (vLLM's).

The cache owns two tensors ``[num_layers * num_blocks, block_size, Hkv, D]`` (K and V) on a
device, a pool of free blocks and each sequence's list of blocks. ``append`` takes new K/V rows of
some sequences, allocates the blocks they need and writes the rows into their slots with a small
compiled kernel (the tensors stay on the device); models that compute K/V in-graph ``reserve``
the slots and write them with the same kernel (``append_kernel``, through
``relax.call_tir_inplace``). ``block_table`` and ``context_lens`` are the arguments
``paged_attn`` takes for a batch of sequences; ``free`` returns a sequence's blocks to the pool.

TVM's own paged KV cache (``relax.frontend.nn.llm``, MLC-LLM's) keeps its pages in C++ and calls
the kernels a model passes it slot by slot: ``tvm_kernels`` gives fuel's for its attention slots.

Contents (``pool``: fuel's own cache; ``tvm_cache``: TVM's runtime cache):
    PagedKVCache  -- the block pool, tables and tensors
    append_kernel -- the PrimFunc that writes K/V rows into their slots
    tvm_kernels   -- fuel's kernels for the attention slots of TVM's PagedKVCache (``TVM_SLOTS``)
    TVM_PAGE_SIZE -- 16, the page size TVM 0.27 builds into its own cache's kernels
    tvm_own_kernels -- TVM 0.27's own kernels for those slots, for a target
    FuelPagedKVCache -- TVM's TIRPagedKVCache (relax.frontend.nn) with those slots filled by fuel
    runtime_kernels, runtime_cache -- every slot compiled (fuel's or TVM's), and the runtime cache
                     made of them without a Relax model (benchmarks, tests)

Example
-------
>>> import numpy as np, tvm_fuel
>>> cache = tvm_fuel.kv_cache.PagedKVCache(num_blocks=64, block_size=16, num_kv_heads=2, head_dim=64)
>>> seq = cache.add_sequence()
>>> k = v = np.zeros((1, 2, 17, 64), "float32")        # [B, Hkv, T, D]: 17 new tokens of one sequence
>>> cache.append([seq], k, v)
>>> cache.context_lens([seq]).numpy()
array([17], dtype=int32)
"""

from __future__ import annotations

from .pool import PagedKVCache, append_kernel
from .tvm_cache import (FuelPagedKVCache, runtime_cache, runtime_kernels, TVM_PAGE_SIZE, TVM_SLOTS, tvm_kernels,
                        tvm_own_kernels)

__all__ = ["PagedKVCache", "append_kernel", "TVM_SLOTS", "TVM_PAGE_SIZE", "tvm_kernels", "tvm_own_kernels",
           "runtime_kernels", "runtime_cache", "FuelPagedKVCache"]
