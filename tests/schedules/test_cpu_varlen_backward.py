"""The CPU kernel of FlashAttention's packed variable-length backward (``schedules.cpu.varlen_backward``),
built and run directly (dq, dk, dv NaN-prefilled) against ``reference.flash_attn_varlen_backward``
(float64): one batch of sequences of 0, 1, 17, 97 and 513 queries (keys unequal to queries in
some, a sequence without keys), rows past the last sequence, GQA groups 1, 3 and 7, every option;
cu_seqlens checked before anything is read."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest
import tvm
from helpers import (assert_varlen_backward_matches, buffers_growing_with, HOST, run_varlen_backward_kernel,
                     varlen_backward_kernel_inputs)

from tvm_fuel.op.config import AttnConfig
from tvm_fuel.schedules.cpu.backward_rows import RowsTask
from tvm_fuel.schedules.cpu.tiles import CpuTiles, tiles_for, vector_lanes
from tvm_fuel.schedules.cpu.varlen_backward import varlen_backward
from tvm_fuel.schedules.workload import KernelSpec

pytestmark = pytest.mark.numerics

Q_LENS, K_LENS = [17, 0, 97, 1, 513, 4], [33, 5, 97, 1, 513, 0]
EXTRA = 3  # q rows past the last sequence: dq 0
HOST_LANES = vector_lanes(HOST)


def _spec(dtype="float32", Hq=2, Hkv=1, D=64, *, alibi=False, **options) -> KernelSpec:
    return KernelSpec(dtype, Hq, Hkv, D, AttnConfig(**options), has_alibi=alibi)


def _kernel(spec: KernelSpec, tiles=None, splits: int = 3):
    tiles = tiles or replace(tiles_for(HOST, head_dim=spec.head_dim, rows=None), splits=splits)
    return tvm.compile(varlen_backward(spec, tiles), target=HOST)


CASES = {
    "group1_D64_full": _spec(Hq=2, Hkv=2, D=64),
    "group3_D40_causal": _spec(Hq=3, Hkv=1, D=40, causal=True),
    "group7_D128_causal_window": _spec(Hq=7, Hkv=1, D=128, causal=True, window_size=(32, 0)),
    "group3_D40_window_softcap": _spec(Hq=6, Hkv=2, D=40, window_size=(16, 8), softcap=5.0),
    "group1_D64_alibi_causal_scale": _spec(Hq=2, Hkv=2, D=64, alibi=True, causal=True, softmax_scale=0.3),
    "group3_D64_sinks_window": _spec(Hq=3, Hkv=1, D=64, causal=True, window_size=(16, 0), sink_tokens=4),
    "bfloat16_group3_D64_causal_alibi_softcap": _spec("bfloat16", Hq=6, Hkv=2, D=64, causal=True, alibi=True,
                                                      softcap=8.0),
}


# each case builds its own kernel (12-40 s of LLVM here): the ones whose options other tests also
# reach (ALiBi: the op tests' tuned gradients; sinks: test_any_tiles_and_splits_serve) are slow
SLOW = {"group1_D64_full", "group1_D64_alibi_causal_scale", "group3_D64_sinks_window"}


@pytest.mark.parametrize("name", [pytest.param(n, marks=pytest.mark.slow) if n in SLOW else n for n in CASES])
def test_matches_the_reference(name):
    spec = CASES[name]
    inputs = varlen_backward_kernel_inputs(spec, Q_LENS, K_LENS, extra=EXTRA, seed=len(name))
    dq, dk, dv = run_varlen_backward_kernel(_kernel(spec), inputs)
    assert_varlen_backward_matches(spec, (dq, dk, dv), inputs)
    assert not dq[sum(Q_LENS):].any()  # rows of no sequence


def test_any_tiles_and_splits_serve():
    """Short tiles (many key tiles per sequence, splits of unequal length, more splits than some
    sequences' key tiles), and keys past the last sequence (dk, dv 0)."""
    spec = _spec(Hq=14, Hkv=2, D=40, causal=True, window_size=(40, 0), sink_tokens=5)
    tiles = CpuTiles(block_q=8, block_k=16, micro_rows=4, key_vecs=2, dim_vecs=1, lanes=8, splits=5)
    inputs = varlen_backward_kernel_inputs(spec, Q_LENS, K_LENS, extra=2, seed=2)
    k_rows = sum(K_LENS)
    for name in ("k", "v"):  # keys past cu_seqlens_k[B]
        inputs[name] = np.concatenate([inputs[name], np.ones((4, 2, 40), np.float32)])
    dq, dk, dv = run_varlen_backward_kernel(_kernel(spec, tiles), inputs)
    assert not dk[k_rows:].any() and not dv[k_rows:].any()
    inputs.update(k=inputs["k"][:k_rows], v=inputs["v"][:k_rows])
    assert_varlen_backward_matches(spec, (dq, dk[:k_rows], dv[:k_rows]), inputs)


SHORT_Q, SHORT_K = [1, 0, 3, 16, 2, 5], [1, 4, 16, 16, 0, 2]  # at most 16 keys: a rows task each


@pytest.mark.parametrize("name", ["group3_D40_causal", "group3_D40_window_softcap", "group3_D64_sinks_window",
                                  "bfloat16_group3_D64_causal_alibi_softcap"])
def test_rows_tasks_match_the_reference(name):
    """Sequences of at most 16 keys through the rows tasks (``backward_rows``: one task per sequence
    and KV head, dq written in place): sequences without keys or queries, rows past the last one."""
    spec = CASES[name]
    tiles = CpuTiles(block_q=4, block_k=16, micro_rows=4, key_vecs=1, dim_vecs=1, lanes=16 if HOST_LANES == 16 else 8)
    func = varlen_backward(spec, tiles, rows_task=RowsTask(spec, tiles, ("dq", "dk", "dv")))
    assert "q_row" in func.script() and "dq_part[" not in func.script()  # no partials read or written
    inputs = varlen_backward_kernel_inputs(spec, SHORT_Q, SHORT_K, extra=EXTRA, seed=len(name))
    dq, dk, dv = run_varlen_backward_kernel(tvm.compile(func, target=HOST), inputs)
    assert_varlen_backward_matches(spec, (dq, dk, dv), inputs)
    assert not dq[sum(SHORT_Q):].any()
    inputs = varlen_backward_kernel_inputs(spec, [2, 3], [17, 3])  # a sequence longer than the tasks' keys
    with pytest.raises(RuntimeError, match="at most 16 keys"):
        run_varlen_backward_kernel(tvm.compile(func, target=HOST), inputs)


def test_no_sequences_and_empty_ones():
    """B = 0 (cu_seqlens [0]), with and without rows (total_q = total_k = 0: empty workspaces), and
    sequences without queries or keys: every gradient exactly 0."""
    spec = SMALL
    lib = _small_kernel(spec)
    for q_lens, k_lens, extra in (([], [], 2), ([], [], 0), ([0, 0], [0, 3], 2), ([2, 0], [0, 0], 2)):
        inputs = varlen_backward_kernel_inputs(spec, q_lens, k_lens, extra=extra)
        grads = run_varlen_backward_kernel(lib, inputs)
        assert all(not g.any() for g in grads), (q_lens, k_lens)


def test_signature_and_workspaces():
    tiles = tiles_for(HOST, head_dim=64, rows=None)
    names = lambda spec: [p.name for p in varlen_backward(spec, tiles).params]  # noqa: E731
    assert names(_spec(alibi=True)) == ["q", "k", "v", "do", "cu_seqlens_q", "cu_seqlens_k", "alibi_slopes", "out",
                                        "lse", "dq", "dk", "dv"]
    assert names(_spec()) == ["q", "k", "v", "do", "cu_seqlens_q", "cu_seqlens_k", "out", "lse", "dq", "dk", "dv"]
    func = varlen_backward(_spec(causal=True), tiles)
    assert func.attrs["global_symbol"] == "fuel_flash_attn_varlen_backward_cpu" and func.attrs["tirx.is_scheduled"]
    assert buffers_growing_with(func, "total_q", "total_k") == []  # nothing of B * max^2 or total_q * total_k
    with pytest.raises(ValueError, match="attn_mask"):
        varlen_backward(KernelSpec("float32", 2, 1, 64, AttnConfig(), mask_dtype="bool"), tiles)


@pytest.mark.parametrize("cu_q, cu_k, named", [
    ([0, 5, 3], [0, 2, 4], "cu_seqlens_q"),  # decreasing
    ([0, 3, 5], [1, 2, 4], "cu_seqlens_k"),  # not starting at 0
    ([0, 3, 6], [0, 2, 4], "cu_seqlens_q"),  # past q's rows
    ([0, 3, 5], [0, 2, 2**31 - 1], "cu_seqlens_k"),  # past k's rows
    ([], [], "cu_seqlens_q and cu_seqlens_k"),  # no offsets at all
])
def test_bad_cu_seqlens_raise_naming_the_argument(cu_q, cu_k, named):
    spec = SMALL
    inputs = varlen_backward_kernel_inputs(spec, [3, 2], [2, 2])
    inputs.update(cu_seqlens_q=np.array(cu_q, np.int32), cu_seqlens_k=np.array(cu_k, np.int32))
    with pytest.raises(RuntimeError, match=f"fuel.flash_attn_varlen_backward: {named}"):
        run_varlen_backward_kernel(_small_kernel(spec), inputs)


SMALL = _spec("float16", Hq=2, Hkv=1, D=16, causal=True)  # float16 here, bfloat16 in CASES
_BUILT = {}


def _small_kernel(spec):
    if spec not in _BUILT:
        _BUILT[spec] = _kernel(spec)
    return _BUILT[spec]
