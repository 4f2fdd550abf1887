"""The CPU kernel of FlashAttention's packed variable-length forward (``schedules.cpu.varlen``),
built and run directly against ``reference.flash_attn_varlen`` (float64): one batch of sequences
of 0, 1, 17, 97 and 513 queries (keys unequal to queries in some), GQA, every option; empty rows,
and cu_seqlens checked before anything is read."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest
import tvm
from helpers import (assert_varlen_matches, buffers_growing_with, HOST, run_varlen_kernel,
                     varlen_kernel_inputs)

from tvm_fuel.op.config import AttnConfig
from tvm_fuel.schedules.cpu.tiles import CpuTiles, fit_keys, STREAMING_ROWS, tiles_for
from tvm_fuel.schedules.cpu.varlen import varlen_forward
from tvm_fuel.schedules.workload import KernelSpec

pytestmark = pytest.mark.numerics

Q_LENS, K_LENS = [17, 0, 97, 1, 513], [33, 5, 97, 1, 513]




def _spec(dtype="float32", Hq=2, Hkv=1, D=64, *, alibi=False, return_lse=True, **options) -> KernelSpec:
    return KernelSpec(dtype, Hq, Hkv, D, AttnConfig(**options), has_alibi=alibi, return_lse=return_lse)


def _kernel(spec: KernelSpec, tiles=None):
    tiles = tiles or tiles_for(HOST, head_dim=spec.head_dim, rows=None, num_kv_heads=spec.num_kv_heads)
    return tvm.compile(varlen_forward(spec, tiles), target=HOST)


def _streaming_tiles(spec: KernelSpec) -> CpuTiles:
    """Tiles of at most STREAMING_ROWS rows (the rule's for short sequences): every task streams its
    key tiles in place, whatever its sequence's length."""
    rows = min(STREAMING_ROWS, spec.group * (STREAMING_ROWS // spec.group))
    return replace(tiles_for(HOST, head_dim=spec.head_dim, rows=rows), kv_heads=1, prefetch=0, key_vecs=1)






CASES = {
    "group1_D64": _spec(Hq=2, Hkv=2, D=64),
    "group3_D40_causal": _spec(Hq=3, Hkv=1, D=40, causal=True),
    "group7_D128_causal_window": _spec(Hq=7, Hkv=1, D=128, causal=True, window_size=(32, 0)),
    "group3_D80_window_softcap": _spec(Hq=6, Hkv=2, D=80, window_size=(16, 8), softcap=5.0),
    "group1_D64_alibi_causal_scale": _spec(Hq=2, Hkv=2, D=64, alibi=True, causal=True, softmax_scale=0.3),
    "group3_D64_sinks_window": _spec(Hq=3, Hkv=1, D=64, causal=True, window_size=(16, 0), sink_tokens=4),
    "float16_group3_D64_causal_alibi_softcap": _spec("float16", Hq=6, Hkv=2, D=64, causal=True, alibi=True,
                                                     softcap=8.0),
    "bfloat16_group7_D128_window": _spec("bfloat16", Hq=7, Hkv=1, D=128, window_size=(16, 8)),
    "float16_D40_no_lse_sinks": _spec("float16", Hq=3, Hkv=3, D=40, window_size=(32, 0), sink_tokens=3,
                                      return_lse=False),
}


@pytest.mark.parametrize("tiles", ["packed", "streaming"])
@pytest.mark.parametrize("name", list(CASES))
def test_matches_the_reference(name, tiles):
    spec = CASES[name]
    inputs = varlen_kernel_inputs(spec, Q_LENS, K_LENS)
    func = varlen_forward(spec, _streaming_tiles(spec)) if tiles == "streaming" else None
    if func is not None:
        assert "k_tiles" not in func.script()  # nothing packed: the tasks read k and v in place
    lib = tvm.compile(func, target=HOST) if func is not None else _kernel(spec)
    out, lse = run_varlen_kernel(lib, spec, inputs)
    assert_varlen_matches(spec, out, lse, inputs)


@pytest.mark.parametrize("name", ["group3_D40_causal", "group3_D80_window_softcap", "group1_D64_alibi_causal_scale",
                                  "group3_D64_sinks_window", "float16_D40_no_lse_sinks"])
def test_rows_tasks_match_the_reference(name):
    """Sequences of at most 16 keys through the rows tasks (``decode.RowsForward``: one task per
    sequence and KV head, nothing packed): empty sequences, rows past the last one; a sequence longer
    than the tasks' keys raises."""
    spec = CASES[name]
    func = varlen_forward(spec, fit_keys(_streaming_tiles(spec), 16), rows=True)
    assert "q_row" in func.script() and "k_tiles" not in func.script()
    lib = tvm.compile(func, target=HOST)
    inputs = varlen_kernel_inputs(spec, [1, 0, 3, 16, 2, 5], [1, 4, 16, 16, 0, 2], extra=2, seed=len(name))
    out, lse = run_varlen_kernel(lib, spec, inputs)
    assert_varlen_matches(spec, out, lse, inputs)
    with pytest.raises(RuntimeError, match="at most 16 keys"):
        run_varlen_kernel(lib, spec, varlen_kernel_inputs(spec, [2, 3], [17, 3]))


def test_any_tiles_serve():
    """Row tiles smaller than the GQA group and short key tiles (many tiles per sequence, and
    sequences that share none); ``kv_heads`` is not read."""
    spec = _spec(Hq=14, Hkv=2, D=40, causal=True, window_size=(40, 0), sink_tokens=5)
    tiles = CpuTiles(block_q=4, block_k=16, micro_rows=4, key_vecs=2, dim_vecs=1, lanes=8, kv_heads=2)
    inputs = varlen_kernel_inputs(spec, Q_LENS, K_LENS, seed=2)
    out, lse = run_varlen_kernel(_kernel(spec, tiles), spec, inputs)
    assert_varlen_matches(spec, out, lse, inputs)


def test_signature_follows_the_spec():
    names = lambda spec: [p.name for p in varlen_forward(spec, tiles_for(HOST, head_dim=64, rows=None)).params]  # noqa: E731
    assert names(_spec(alibi=True)) == ["q", "k", "v", "cu_seqlens_q", "cu_seqlens_k", "alibi_slopes", "out", "lse"]
    assert names(_spec(return_lse=False)) == ["q", "k", "v", "cu_seqlens_q", "cu_seqlens_k", "out"]
    func = varlen_forward(_spec(causal=True), tiles_for(HOST, head_dim=64, rows=None))
    assert func.attrs["global_symbol"] == "fuel_flash_attn_varlen_cpu" and func.attrs["tirx.is_scheduled"]
    assert buffers_growing_with(func, "total_q", "total_k") == []  # nothing of B * max^2 or total_q * total_k
    with pytest.raises(ValueError, match="attn_mask"):
        varlen_forward(KernelSpec("float32", 2, 1, 64, AttnConfig(), mask_dtype="bool"),
                       tiles_for(HOST, head_dim=64, rows=None))


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_rows_without_keys_are_exactly_zero_and_minus_inf(dtype):
    """Bottom-right causal with more queries than keys (the first Sq - Sk rows see none), sequences
    without keys, and a window that leaves a row nothing: out exactly 0, lse exactly -inf."""
    spec = _spec(dtype, Hq=3, Hkv=1, D=64, causal=True)
    inputs = varlen_kernel_inputs(spec, [40, 3, 9, 0], [8, 0, 9, 4], seed=1)
    out, lse = run_varlen_kernel(_kernel(spec), spec, inputs)
    assert_varlen_matches(spec, out, lse, inputs)
    empty_rows = np.r_[0:32, 40:43]  # sequence 0's rows before its 8 keys, sequence 1's without keys
    assert (out[empty_rows] == 0).all() and np.isneginf(lse[:, empty_rows]).all()
    assert np.isfinite(lse[:, 32:40]).all() and np.isfinite(lse[:, 43:]).all()


@pytest.fixture(scope="module")
def small_kernel():
    spec = _spec(Hq=2, Hkv=1, D=16)
    return spec, _kernel(spec)


@pytest.mark.parametrize("cu_q, cu_k, named", [
    ([0, 5, 3], [0, 2, 4], "cu_seqlens_q"),  # decreasing
    ([0, 3, 5], [1, 2, 4], "cu_seqlens_k"),  # not starting at 0
    ([0, 3, 6], [0, 2, 4], "cu_seqlens_q"),  # past q's rows
    ([0, 3, 5], [0, 2, 2**31 - 1], "cu_seqlens_k"),  # past k's rows
    ([0, 3, 5], [-4, 0, 4], "cu_seqlens_k"),  # negative
    ([], [], "cu_seqlens_q and cu_seqlens_k"),  # no offsets at all
])
def test_bad_cu_seqlens_raise_naming_the_argument(small_kernel, cu_q, cu_k, named):
    spec, lib = small_kernel
    inputs = varlen_kernel_inputs(spec, [3, 2], [2, 2])
    inputs.update(cu_seqlens_q=np.array(cu_q, np.int32), cu_seqlens_k=np.array(cu_k, np.int32))
    with pytest.raises(RuntimeError, match=f"fuel.flash_attn_varlen: {named}"):
        run_varlen_kernel(lib, spec, inputs)


def test_cu_seqlens_of_different_lengths_are_refused(small_kernel):
    spec, lib = small_kernel
    inputs = varlen_kernel_inputs(spec, [3, 2], [4])
    with pytest.raises(ValueError, match="cu_seqlens_k.shape"):
        run_varlen_kernel(lib, spec, inputs)
