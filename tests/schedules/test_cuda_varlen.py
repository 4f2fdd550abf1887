"""The CUDA kernel of FlashAttention's packed variable-length forward (``schedules.cuda.varlen``).

Without a GPU: its one-thread emulation (built for llvm) against ``reference.flash_attn_varlen``
(float64) on one batch of sequences of 0, 1, 3, 17 and 97 queries (keys unequal to queries in
some, a sequence with queries and no keys) and two rows past the last sequence, GQA groups 1, 3
and 7, every option, float32 and float16; the grid's cover of the packed rows; empty and
malformed offsets (in-bounds reads and writes: guard rows of NaN around every tensor stay
unread and unwritten). Slow: more tile shapes and pipeline depths, and nvcc builds for sm_80 and
sm_90 (float16, float32) that fit the architecture's launchable shared memory.
"""

from __future__ import annotations

import numpy as np
import pytest
import tvm
from helpers import (assert_guards_intact, assert_varlen_matches, buffers_growing_with, guarded, launchable, randn,
                     run_varlen_kernel, varlen_kernel_inputs)

from tvm_fuel.deploy import nvcc as cuda
from tvm_fuel.op.config import AttnConfig
from tvm_fuel.schedules.cuda.device import Launch
from tvm_fuel.schedules.cuda.rules import CudaFlashForward
from tvm_fuel.schedules.cuda.tiles import CudaTiles
from tvm_fuel.schedules.cuda.varlen import varlen_blocks, varlen_forward
from tvm_fuel.schedules.workload import KernelSpec, Workload

pytestmark = pytest.mark.numerics

Q_LENS, K_LENS = [17, 0, 97, 1, 3], [33, 5, 97, 1, 0]
EXTRA_ROWS = 2  # q rows past the last sequence: out 0, lse -inf
ARCHS = ("sm_80", "sm_90")
needs_nvcc = pytest.mark.skipif(not cuda.nvcc_available(), reason="nvcc is not installed")




def _spec(dtype="float32", Hq=2, Hkv=1, D=64, *, alibi=False, return_lse=True, **options) -> KernelSpec:
    return KernelSpec(dtype, Hq, Hkv, D, AttnConfig(**options), has_alibi=alibi, return_lse=return_lse)


def rule_tiles(spec: KernelSpec, target=None) -> CudaTiles:
    """The tiles fuel's dense CUDA forward picks for this dtype and head dim (symbolic sizes: no
    split-KV); ``target`` None: the emulation's (sm_90's limits)."""
    rule = CudaFlashForward(emulated=target is None)
    workload = Workload("flash_attn", spec, (("B", None), ("Sq", None), ("Sk", None)))
    return CudaTiles(**rule.default_knobs(workload, target or tvm.target.Target("llvm")))


def _emulated(spec: KernelSpec, tiles: CudaTiles | None = None):
    return tvm.compile(varlen_forward(spec, tiles or rule_tiles(spec), launch=Launch.emulated()), target="llvm")






CASES = {
    "group1_D64": _spec(Hq=2, Hkv=2, D=64),
    "group3_D40_causal": _spec(Hq=3, Hkv=1, D=40, causal=True),
    "group7_D128_causal_window": _spec(Hq=7, Hkv=1, D=128, causal=True, window_size=(32, 0)),
    "group3_D64_window_softcap": _spec(Hq=6, Hkv=2, D=64, window_size=(16, 8), softcap=5.0),
    "group1_D64_alibi_causal_scale": _spec(Hq=2, Hkv=2, D=64, alibi=True, causal=True, softmax_scale=0.3),
    "group3_D64_sink_tokens_window": _spec(Hq=3, Hkv=1, D=64, causal=True, window_size=(16, 0), sink_tokens=4),
    "float16_group3_D64_causal_alibi_softcap": _spec("float16", Hq=6, Hkv=2, D=64, causal=True, alibi=True,
                                                     softcap=8.0),
    "float16_group7_D128_window": _spec("float16", Hq=7, Hkv=1, D=128, window_size=(16, 8)),
    "float16_group1_D40_no_lse_sink_tokens": _spec("float16", Hq=3, Hkv=3, D=40, window_size=(32, 0),
                                                   sink_tokens=3, return_lse=False),
}


@pytest.mark.parametrize("name", list(CASES))
def test_emulation_matches_the_reference(name):
    """The tiles the dense forward's rule picks (float16: 64 x 64 register tiles on four warps)."""
    spec = CASES[name]
    inputs = varlen_kernel_inputs(spec, Q_LENS, K_LENS, extra=EXTRA_ROWS)
    assert_varlen_matches(spec, *run_varlen_kernel(_emulated(spec), spec, inputs), inputs)


# small tiles: many row and key tiles per sequence, a key-split warp layout, every pipeline depth
TILES = {
    "16x16_one_warp_3_stages": CudaTiles(block_q=16, block_k=16, threads=32, stages=3),
    "16x32_two_key_warps": CudaTiles(block_q=16, block_k=32, threads=64, stages=2),
    "32x16_one_stage": CudaTiles(block_q=32, block_k=16, threads=64, stages=1),
}


@pytest.mark.parametrize("dtype", ["float32", "float16"])
@pytest.mark.parametrize("tiles", list(TILES))
def test_small_tiles_match_the_reference(tiles, dtype):
    spec = _spec(dtype, Hq=3, Hkv=1, D=40, causal=True, window_size=(32, 0), sink_tokens=2, softcap=6.0)
    inputs = varlen_kernel_inputs(spec, Q_LENS, K_LENS, extra=EXTRA_ROWS, seed=1)
    assert_varlen_matches(spec, *run_varlen_kernel(_emulated(spec, TILES[tiles]), spec, inputs), inputs)


@pytest.mark.slow
@pytest.mark.parametrize("name", ["group7_D128_causal_window", "group3_D64_window_softcap",
                                  "float16_group3_D64_causal_alibi_softcap", "float16_group7_D128_window"])
@pytest.mark.parametrize("tiles", list(TILES))
def test_every_tile_shape_matches_the_reference(tiles, name):
    spec = CASES[name]
    inputs = varlen_kernel_inputs(spec, Q_LENS, K_LENS, extra=EXTRA_ROWS, seed=2)
    assert_varlen_matches(spec, *run_varlen_kernel(_emulated(spec, TILES[tiles]), spec, inputs), inputs)


def test_longer_sequences_and_no_extra_rows():
    spec = _spec("float16", Hq=4, Hkv=2, D=64, causal=True)
    inputs = varlen_kernel_inputs(spec, [130, 64, 2], [200, 64, 1], extra=0, seed=3)
    assert_varlen_matches(spec, *run_varlen_kernel(_emulated(spec), spec, inputs), inputs)


def test_the_grid_covers_every_row_tile_once():
    """Virtual sequence v's row tiles start at floor(start_v * group / block_q) + v: they never
    overlap and ``varlen_blocks`` of them cover the rows before the first sequence, every
    sequence and the rows past the last (the kernel's binary search inverts this map)."""
    rng = np.random.default_rng(4)
    for _ in range(200):
        B, group, block_q = int(rng.integers(0, 6)), int(rng.integers(1, 8)), int(rng.choice([16, 32, 64]))
        lens = rng.integers(0, 150, B)
        first, extra = int(rng.integers(0, 3)), int(rng.integers(0, 40))
        offsets = first + np.concatenate([[0], np.cumsum(lens)]).astype(int)
        total_q = int(offsets[-1]) + extra
        starts = [0, *offsets, total_q]  # virtual sequences: before, each sequence, past
        owner = {}
        for vseq in range(len(starts) - 1):
            tile0 = starts[vseq] * group // block_q + vseq
            for tile in range(tile0, tile0 + -(-(starts[vseq + 1] - starts[vseq]) * group // block_q)):
                assert tile not in owner, (tile, vseq, owner[tile])
                owner[tile] = vseq
        assert max(owner, default=-1) < varlen_blocks(total_q, B, group, block_q)


def test_signature_follows_the_spec():
    tiles = CudaTiles(block_q=16, block_k=16, threads=32)

    def names(spec):
        return [p.name for p in varlen_forward(spec, tiles).params]

    assert names(_spec(alibi=True)) == ["q", "k", "v", "cu_seqlens_q", "cu_seqlens_k", "alibi_slopes", "out", "lse"]
    assert names(_spec(return_lse=False)) == ["q", "k", "v", "cu_seqlens_q", "cu_seqlens_k", "out"]
    func = varlen_forward(_spec(causal=True), tiles)
    assert func.attrs["global_symbol"] == "fuel_flash_attn_varlen_cuda" and func.attrs["tirx.is_scheduled"]
    assert buffers_growing_with(func, "total_q", "total_k") == []  # nothing of B * max^2 or total_q * total_k
    with pytest.raises(ValueError, match="split-KV"):
        varlen_forward(_spec(), CudaTiles(splits=2))
    with pytest.raises(ValueError, match="attn_mask"):
        varlen_forward(KernelSpec("float32", 2, 1, 64, AttnConfig(), mask_dtype="bool"), tiles)
    with pytest.raises(ValueError, match="multiple"):
        varlen_forward(_spec(Hq=3, Hkv=2), tiles)
    with pytest.raises(ValueError, match="key slices"):  # 4 warps over 2 row strips: 8-key slices
        varlen_forward(_spec("float16"), CudaTiles(block_q=32, block_k=16, threads=128))


@pytest.mark.parametrize("dtype", ["float32", "float16"])
def test_any_offsets_read_and_write_in_bounds(dtype):
    """No assertion on a device: empty and malformed offsets (negative, decreasing, past the packed
    rows, 2^30) are clamped. Valid empty batches give 0 and -inf; the others any finite rows, and
    the NaN guard rows around q, k, v and out are never read (no NaN comes out) nor written."""
    spec = _spec(dtype, Hq=2, Hkv=1, D=16, causal=True, return_lse=True)
    lib = _emulated(spec, CudaTiles(block_q=16, block_k=16, threads=32))
    rng = np.random.default_rng(5)
    cases = [(7, 5, [0], [0]), (4, 3, [], []), (0, 0, [0, 0], [0, 0]), (0, 4, [0, 0, 0], [0, 2, 4]),
             (5, 5, [3, -7, 100, 2], [9, 1 << 30, -5, 4]), (6, 5, [0, 2, 6], [0, -8, 2]),
             (40, 3, [0, 40, 1, 39], [0, 3, 0, 2]), (9, 9, [-(1 << 30), 5, 1 << 30], [(1 << 31) - 1, 4, -1])]
    for total_q, total_k, cu_q, cu_k in cases:
        (q_all, q), (k_all, k), (v_all, v) = (guarded((n, 2 if t == "q" else 1, 16), dtype, randn(
            rng, (n, 2 if t == "q" else 1, 16), dtype)) for t, n in (("q", total_q), ("k", total_k), ("v", total_k)))
        out_all, out = guarded((total_q, 2, 16), dtype, 0)
        lse = tvm.runtime.tensor(np.zeros((2, total_q), np.float32))
        args = [tvm.runtime.from_dlpack(x) for x in (q, k, v)]
        args += [tvm.runtime.tensor(np.asarray(c, np.int32)) for c in (cu_q, cu_k)]
        lib(*args, tvm.runtime.from_dlpack(out), lse)
        what = f"total_q {total_q}, total_k {total_k}, cu_q {cu_q}, cu_k {cu_k}"
        assert np.isfinite(out.astype(np.float64)).all(), what
        assert not np.isnan(lse.numpy()).any(), what
        for whole in (out_all, q_all, k_all, v_all):
            assert_guards_intact(whole, what)
        if len(cu_q) <= 1 or total_q == 0:  # no sequence: every row 0, lse -inf
            assert not out.any() and np.isneginf(lse.numpy()).all(), what


@pytest.mark.slow
@needs_nvcc
@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("dtype", ["float16", "float32"])
@pytest.mark.parametrize("head_dim", [40, 64, 128])
def test_compiles_with_nvcc_and_fits_the_architecture(head_dim, dtype, arch):
    """bfloat16 takes the float16 code path (as in test_cuda_kernels, not built here)."""
    target = tvm.target.Target({"kind": "cuda", "arch": arch})
    spec = _spec(dtype, Hq=8, Hkv=2, D=head_dim, alibi=True, causal=True, softcap=5.0, window_size=(64, 0),
                 sink_tokens=4)
    func = varlen_forward(spec, rule_tiles(spec, target))
    built, usage = cuda.build_with_shared_memory(tvm.IRModule({"fuel_flash_attn_varlen_cuda": func}), target)
    source = cuda.cuda_source(built)
    assert any(name.startswith("fuel_flash_attn_varlen_cuda_kernel") for name in cuda.kernel_names(source))
    assert cuda.compile_cubin(source, arch)
    assert usage and all(launchable(static, dynamic, arch) for static, dynamic in usage.values()), usage
    assert "cp.async.cg.shared.global" in source and "cp.async.wait_group" in source
    if dtype == "float16":  # register tiles
        assert "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32" in source
        assert "ldmatrix.sync.aligned.m8n8.x4.shared.b16" in source
