"""paged_attn, the decomposition and the CPU kernel: against the numpy reference, against the
compiled flash_attn on the gathered blocks, and the runtime checks of the block table."""

from __future__ import annotations

import numpy as np
import pytest
from helpers import BLOCK, HOST, Runner, assert_close, build, legalize_checked, paged_inputs, run
import tvm_ffi
from tvm import s_tir, tirx

from tvm_fuel import op
from tvm_fuel import reference as ref

pytestmark = pytest.mark.numerics

LENS = [0, 1, BLOCK, 3 * BLOCK, 37, 5 * BLOCK + 7]  # empty, one token, exact block multiples, ragged


@pytest.mark.parametrize("sq,causal", [(1, False), (1, True), (5, True), (5, False)])
def test_matches_reference(sq, causal, kernels):
    rng = np.random.default_rng(sq)
    inputs = paged_inputs(rng, LENS, Sq=sq)
    (out,) = run(lambda **a: op.paged_attn(**a, causal=causal), inputs, kernels=kernels)
    assert_close(out, ref.paged_attn(*inputs.values(), causal=causal), "float32")
    assert np.all(out[0] == 0)  # context length 0


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_low_precision_gqa7_head_dim_128(dtype, kernels):
    rng = np.random.default_rng(1)
    inputs = paged_inputs(rng, [17, 64, 97], Hq=7, Hkv=1, D=128, Sq=3, dtype=dtype, max_blocks=7)
    (out,) = run(lambda **a: op.paged_attn(**a, causal=True), inputs, kernels=kernels)
    assert_close(out, ref.paged_attn(*inputs.values(), causal=True), dtype)


@pytest.mark.parametrize("options", [dict(softcap=3.0), dict(window_size=(20, -1), causal=True),
                                     dict(window_size=(4, 2)), dict(softmax_scale=0.3)])
def test_options_and_alibi(options, kernels):
    rng = np.random.default_rng(2)
    inputs = paged_inputs(rng, [1, 40, 97], Hq=9, Hkv=3, Sq=4, D=64, max_blocks=7)
    inputs["alibi_slopes"] = (rng.random(9) * 0.2).astype(np.float32)
    (out,) = run(lambda **a: op.paged_attn(**a, **options), inputs, kernels=kernels)
    assert_close(out, ref.paged_attn(*inputs.values(), **options), "float32")


@pytest.mark.parametrize("options", [dict(window_size=(40, -1)), dict(softcap=2.0, causal=True)])
def test_decode_one_sequence_with_window(options, kernels):
    """Decode (few rows per KV head) of a single sequence: the kernel splits the KV heads over
    tasks to fill the cores, and the window skips whole interior tiles."""
    rng = np.random.default_rng(12)
    inputs = paged_inputs(rng, [5 * BLOCK + 7], Hq=8, Hkv=4, Sq=2, D=64)
    (out,) = run(lambda **a: op.paged_attn(**a, **options), inputs, kernels=kernels)
    assert_close(out, ref.paged_attn(*inputs.values(), **options), "float32")


@pytest.mark.parametrize("table_dtype", ["uint32", "int64"])
def test_index_dtypes(table_dtype, kernels):
    rng = np.random.default_rng(3)
    inputs = paged_inputs(rng, [5, 33], table_dtype=table_dtype)
    (out,) = run(lambda **a: op.paged_attn(**a), inputs, kernels=kernels)
    assert_close(out, ref.paged_attn(*inputs.values()), "float32")


@pytest.mark.parametrize("sq,causal", [(1, False), (4, True)])
def test_matches_flash_attn_on_gathered_blocks(sq, causal, kernels):
    """Paged vs dense on gathered blocks, one compiled flash_attn with symbolic Sk for every sequence."""
    rng = np.random.default_rng(4)
    lens = [1, 2 * BLOCK, 50, 90]
    inputs = paged_inputs(rng, lens, Hq=6, Hkv=3, Sq=sq, D=64)
    inputs["alibi_slopes"] = (rng.random(6) * 0.2).astype(np.float32)
    options = dict(causal=causal, softcap=8.0)
    (paged,) = run(lambda **a: op.paged_attn(**a, **options), inputs, kernels=kernels)
    sk = tirx.Var("sk", "int64")
    dense = Runner(build(lambda **a: op.flash_attn(**a, **options),
                         dict(q=((1, 6, sq, 64), "float32"), k=((1, 3, sk, 64), "float32"),
                              v=((1, 3, sk, 64), "float32"), alibi_slopes=((6,), "float32"))))
    for b, n in enumerate(lens):
        k = ref.gather_pages(inputs["k_cache"], inputs["block_table"][b], n)[None]
        v = ref.gather_pages(inputs["v_cache"], inputs["block_table"][b], n)[None]
        (want,) = dense(inputs["q"][b:b + 1], k, v, inputs["alibi_slopes"])
        np.testing.assert_allclose(paged[b:b + 1], want, atol=1e-6, rtol=1e-6)


def test_dead_table_entries_are_never_read(kernels):
    """Garbage past the live blocks changes nothing (and cannot crash)."""
    rng = np.random.default_rng(5)
    inputs = paged_inputs(rng, [3, 20, 0])
    (clean,) = run(lambda **a: op.paged_attn(**a), inputs, kernels=kernels)
    table = inputs["block_table"].copy()
    table[0, 1:] = np.iinfo(np.int32).max
    table[1, 2:] = -123456
    table[2, :] = np.iinfo(np.int32).min
    (dirty,) = run(lambda **a: op.paged_attn(**a), {**inputs, "block_table": table}, kernels=kernels)
    np.testing.assert_array_equal(clean, dirty)


@pytest.fixture(scope="module")
def symbolic_runner(kernels):
    """paged_attn with symbolic batch, cache size and table width: one build for many inputs."""
    B, N, M = tirx.Var("B", "int64"), tirx.Var("num_blocks", "int64"), tirx.Var("max_blocks", "int64")
    params = dict(q=((B, 6, 1, 40), "float32"), k_cache=((N, BLOCK, 2, 40), "float32"),
                  v_cache=((N, BLOCK, 2, 40), "float32"), block_table=((B, M), "int32"),
                  context_lens=((B,), "int32"))
    return Runner(build(lambda **a: op.paged_attn(**a), params), HOST, kernels=kernels)


def test_symbolic_batch(symbolic_runner, kernels):
    rng = np.random.default_rng(6)
    for lens in ([7], [0, 33, 96]):
        inputs = paged_inputs(rng, lens)
        (out,) = symbolic_runner(*inputs.values())
        assert_close(out, ref.paged_attn(*inputs.values()), "float32")


@pytest.mark.parametrize("bad_id", [-1, 24, 10**6])
def test_live_block_id_out_of_range_raises(symbolic_runner, bad_id, kernels):
    inputs = paged_inputs(np.random.default_rng(7), [20, 40])
    inputs["block_table"][1, 2] = bad_id  # block 2 holds tokens 32..39: live
    with pytest.raises(RuntimeError, match=r"fuel\.paged_attn: block_table\[b, n\] of a live block"):
        symbolic_runner(*inputs.values())


@pytest.mark.parametrize("bad_len", [6 * BLOCK + 1, -1])
def test_context_length_beyond_capacity_raises(symbolic_runner, bad_len, kernels):
    inputs = paged_inputs(np.random.default_rng(8), [20, 40])
    inputs["context_lens"][0] = bad_len
    with pytest.raises(RuntimeError, match=r"fuel\.paged_attn: context_lens\[b\] must be in \[0, max_blocks"):
        symbolic_runner(*inputs.values())


def test_empty_cache(symbolic_runner, kernels):
    """No blocks at all and every context empty: zeros, and nothing read from the empty cache."""
    inputs = paged_inputs(np.random.default_rng(9), [0, 0], num_blocks=1)
    inputs["k_cache"], inputs["v_cache"] = inputs["k_cache"][:0], inputs["v_cache"][:0]
    inputs["block_table"][:] = -1
    (out,) = symbolic_runner(*inputs.values())
    assert out.shape == inputs["q"].shape and np.all(out == 0)


def _capacity_sized(mod, table_width) -> list[str]:
    """Loops and buffers (other than the block table itself) of ``mod``'s PrimFuncs whose size
    grows with the table width (a symbolic dim's name, or a static width: then any constant
    size that large): the work and memory that scale with the table's capacity instead of the
    live context."""
    found = []

    def grows(expr) -> bool:
        if isinstance(table_width, int):
            return isinstance(expr, tirx.IntImm) and expr.value >= table_width
        return table_width in {var.name for var in tirx.analysis.undefined_vars(expr)}

    for gvar, func in mod.functions.items():
        if not isinstance(func, tirx.PrimFunc):
            continue

        def visit(node, where=gvar.name_hint):
            if isinstance(node, tirx.For) and grows(node.extent):
                found.append(f"{where}: loop {node.loop_var.name}")
            buffers = node.alloc_buffers if isinstance(node, s_tir.SBlock) else [node.buffer] if isinstance(
                node, (tirx.AllocBuffer, tirx.DeclBuffer)) else []
            found.extend(f"{where}: buffer {b.name}" for b in buffers
                         if b.name != "block_table" and any(grows(dim) for dim in b.shape))

        tvm_ffi.structural_walk(func.body, ((tirx.For, s_tir.SBlock, tirx.AllocBuffer, tirx.DeclBuffer), visit),
                                order="post")
    return found


def _legalized(params, kernels):
    return legalize_checked(build(lambda **a: op.paged_attn(**a), params), HOST, kernels)


def test_host_check_and_floor_scale_with_the_live_context(kernels):
    """Issue 29, item 6: the block-table check walks each sequence's live blocks only, and no loop
    or buffer (the floor's gathered K/V, its scores, its sanitized table) grows with the table's
    width: a sequence of 10 blocks in a million-block table costs what it costs in a small one."""
    B, N, M = tirx.Var("B", "int64"), tirx.Var("num_blocks", "int64"), tirx.Var("max_blocks", "int64")
    params = dict(q=((B, 6, 1, 40), "float32"), k_cache=((N, BLOCK, 2, 40), "float32"),
                  v_cache=((N, BLOCK, 2, 40), "float32"), block_table=((B, M), "int32"),
                  context_lens=((B,), "int32"))
    assert _capacity_sized(_legalized(params, kernels), "max_blocks") == []


def test_a_million_block_table_decodes_its_live_blocks(kernels):
    """Ten live blocks in a table of 2**20 entries per sequence (garbage past them): the right
    answer, with memory and work bounded by the live context (asserted first: a floor that gathers
    the capacity would need tens of GB)."""
    rng = np.random.default_rng(10)
    lens = [37, 10 * BLOCK]
    inputs = paged_inputs(rng, lens, max_blocks=10)
    table = np.full((len(lens), 1 << 20), -1, np.int32)
    table[:, :10] = inputs["block_table"]
    table[:, 10:] = rng.integers(-(1 << 30), 1 << 30, size=(len(lens), (1 << 20) - 10))
    inputs["block_table"] = table
    params = {name: (a.shape, str(a.dtype)) for name, a in inputs.items()}
    assert _capacity_sized(_legalized(params, kernels), 1 << 20) == []
    (out,) = run(lambda **a: op.paged_attn(**a), inputs, kernels=kernels)
    assert_close(out, ref.paged_attn(*inputs.values()), "float32")
