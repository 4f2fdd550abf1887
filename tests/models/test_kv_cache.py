"""tvm_fuel.kv_cache.PagedKVCache: appends land in the right slots, paged_attn over the cache equals
dense attention over each sequence's tokens, blocks are reused after free, errors name the call."""

from __future__ import annotations

import numpy as np
import pytest
import tvm
from helpers import HOST, build
from tvm import relax

import tvm_fuel
from tvm_fuel.deploy import nvcc as cuda
from tvm_fuel import op, reference
from tvm_fuel.kv_cache import PagedKVCache, append_kernel

pytestmark = pytest.mark.integration

HKV, D, BS = 2, 16, 4


def _decode_vm(batch: int, max_blocks: int, num_blocks: int, sq: int = 1):
    params = dict(q=((batch, 6, sq, D), "float32"), k_cache=((num_blocks, BS, HKV, D), "float32"),
                  v_cache=((num_blocks, BS, HKV, D), "float32"), block_table=((batch, max_blocks), "int32"),
                  context_lens=((batch,), "int32"))
    mod = build(lambda **a: op.paged_attn(**a, causal=True), params)
    return relax.VirtualMachine(tvm_fuel.compile(mod, HOST, kernels="tuned"), tvm.cpu())


def test_appends_prefill_then_decode_match_dense_attention():
    rng = np.random.default_rng(0)
    cache = PagedKVCache(num_blocks=16, block_size=BS, num_kv_heads=HKV, head_dim=D)
    seqs = [cache.add_sequence() for _ in range(2)]
    history = {s: (np.zeros((HKV, 0, D), "float32"), np.zeros((HKV, 0, D), "float32")) for s in seqs}

    def append(chosen, tokens):
        k, v = (rng.standard_normal((len(chosen), HKV, tokens, D)).astype("float32") for _ in range(2))
        cache.append(chosen, k, v)
        for row, s in enumerate(chosen):
            history[s] = (np.concatenate([history[s][0], k[row]], 1), np.concatenate([history[s][1], v[row]], 1))

    append(seqs[:1], 7)  # prefill of different lengths, then decode steps of the batch
    append(seqs[1:], 3)
    for _ in range(3):
        append(seqs, 1)
    lens = cache.context_lens(seqs).numpy()
    assert list(lens) == [10, 6]
    table = cache.block_table(seqs, max_blocks=4)
    q = rng.standard_normal((2, 6, 1, D)).astype("float32")
    out = _decode_vm(2, 4, 16)["main"](tvm.runtime.tensor(q), cache.k_cache, cache.v_cache, table,
                                       cache.context_lens(seqs)).numpy()
    for row, s in enumerate(seqs):
        k, v = (x[None] for x in history[s])
        want = reference.flash_attn(q[row:row + 1], k, v, causal=True)
        np.testing.assert_allclose(out[row:row + 1], want, atol=2e-5, rtol=2e-5)
        # the cache holds exactly the appended rows, in order, through the table
        got_k = reference.gather_pages(cache.k_cache.numpy(), table.numpy()[row], int(lens[row]))
        np.testing.assert_array_equal(got_k, history[s][0])


def test_free_returns_blocks_and_errors_name_the_call():
    cache = PagedKVCache(num_blocks=3, block_size=BS, num_kv_heads=HKV, head_dim=D)
    a, b = cache.add_sequence(), cache.add_sequence()
    cache.append([a], np.zeros((1, HKV, 9, D), "float32"), np.zeros((1, HKV, 9, D), "float32"))
    assert cache.free_blocks == 0
    with pytest.raises(ValueError, match="PagedKVCache.reserve: needs 1 more blocks, 0 free"):
        cache.append([b], np.zeros((1, HKV, 1, D), "float32"), np.zeros((1, HKV, 1, D), "float32"))
    cache.free(a)
    assert cache.free_blocks == 3
    cache.append([b], np.zeros((1, HKV, 1, D), "float32"), np.zeros((1, HKV, 1, D), "float32"))
    with pytest.raises(KeyError, match="unknown sequence ids"):
        cache.context_lens([a])
    with pytest.raises(ValueError, match=r"k must be \[B=1, Hkv=2, T, D=16\] float32"):
        cache.append([b], np.zeros((1, 3, 1, D), "float32"), np.zeros((1, 3, 1, D), "float32"))


@pytest.mark.skipif(not cuda.nvcc_available(), reason="nvcc is not installed")
def test_the_append_kernel_builds_for_cuda():
    target = tvm.target.Target({"kind": "cuda", "arch": "sm_90"})
    source = cuda.cuda_source(tvm.compile(append_kernel("float16", 8, 128, True), target=target))
    assert cuda.kernel_names(source) and cuda.compile_cubin(source, "sm_90")


def test_layers_share_one_table_at_their_page_offset():
    rng = np.random.default_rng(5)
    cache = PagedKVCache(num_blocks=4, block_size=BS, num_kv_heads=HKV, head_dim=D, num_layers=2)
    seq = cache.add_sequence()
    ks, vs = ([rng.standard_normal((1, HKV, 6, D)).astype("float32") for _ in range(2)] for _ in range(2))
    cache.append([seq], ks, vs)
    table = cache.block_table([seq]).numpy()[0]
    for layer in range(2):
        for tensor, rows in ((cache.k_cache, ks), (cache.v_cache, vs)):
            pages = tensor.numpy()[layer * 4:(layer + 1) * 4]
            np.testing.assert_array_equal(reference.gather_pages(pages, table, 6), rows[layer][0])
    with pytest.raises(ValueError, match="PagedKVCache.append: k and v must hold 2 layers, got 1 and 1"):
        cache.append([seq], ks[0], vs[0])


def test_the_append_kernel_refuses_a_slot_outside_the_cache():
    cache = PagedKVCache(num_blocks=2, block_size=BS, num_kv_heads=HKV, head_dim=D)
    rows = tvm.runtime.tensor(np.zeros((1, HKV, 1, D), "float32"))
    with pytest.raises(Exception, match=r"slots\[b, t\] must be in \[0, num_blocks \* block_size\)"):
        cache._append(cache.k_cache, cache.v_cache, rows, rows, tvm.runtime.tensor(np.array([[2 * BS]], "int64")))  # noqa: SLF001 (the kernel alone, past the host check)


def test_repeated_ids_are_refused_and_a_failed_step_rolls_back():
    cache = PagedKVCache(num_blocks=3, block_size=BS, num_kv_heads=HKV, head_dim=D)
    a, b = cache.add_sequence(), cache.add_sequence()
    with pytest.raises(ValueError, match=r"PagedKVCache.reserve: seqs \[0, 0\] repeat a sequence id"):
        cache.reserve([a, a], 1)
    with pytest.raises(ValueError, match="PagedKVCache.block_table: seqs must name at least one sequence"):
        cache.block_table([])
    cache.reserve([a], 5)
    with pytest.raises(RuntimeError, match="the step failed"):
        with cache.rollback_on_error([a, b]):
            cache.reserve([a, b], 3)
            raise RuntimeError("the step failed")
    assert (cache.length(a), cache.length(b), cache.free_blocks) == (5, 0, 1)
    cache.truncate(a, 4)
    assert (cache.length(a), cache.free_blocks) == (4, 2)
