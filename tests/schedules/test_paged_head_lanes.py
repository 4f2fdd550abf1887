"""The streaming decode's head-dim loops on AVX2 (8 float lanes): two vectors at a time where a task
has at most ``WIDE_ROWS`` query rows (each row's accumulators two vectors wide), one where it has
more rows or the head dim is not a multiple of 16. Built for an AVX2 CPU whatever the host (on an
AVX-512 target the decode takes none of this), its LLVM IR read for which loops were built (16-lane
FMAs only in the wide ones), then run against the float64 reference where this CPU can run it."""

from __future__ import annotations

import numpy as np
import pytest
import tvm
from helpers import assert_close, build, kernel_llvm_ir, paged_inputs
from tvm import relax

import tvm_fuel
from tvm_fuel import op
from tvm_fuel import reference as ref
from tvm_fuel.schedules.cpu.paged import WIDE_ROWS

pytestmark = pytest.mark.numerics

AVX2 = tvm.target.Target({"kind": "llvm", "mcpu": "haswell", "num-cores": 2})
# what LLVM may use in a kernel built for haswell; a host without one of them builds, but does not run it
_RUNS_AVX2 = all(tvm.target.codegen.target_has_features(feature, tvm_fuel.host_target())
                 for feature in ("avx2", "fma", "f16c", "bmi", "bmi2", "lzcnt", "movbe"))


def _inputs(cache_dtype: str, hq: int, hkv: int, head_dim: int) -> dict:
    rng = np.random.default_rng(head_dim + hq)
    query_dtype = "float32" if cache_dtype.startswith("float8") else cache_dtype
    inputs = paged_inputs(rng, [1, 17, 97, 0], Hq=hq, Hkv=hkv, D=head_dim, dtype=query_dtype, max_blocks=7,
                          num_blocks=26)
    if cache_dtype.startswith("float8"):
        scale = rng.uniform(0.25, 2.0, hkv).astype(np.float32)
        for name in ("k_cache", "v_cache"):
            inputs[name] = ref.quantize_fp8(inputs[name].astype(np.float32), cache_dtype, scale)
        inputs.update(k_scale=scale, v_scale=scale.copy())
    return inputs


@pytest.mark.parametrize("cache_dtype", ["float32", "bfloat16", "float16", "float8_e4m3fn", "float8_e5m2"])
@pytest.mark.parametrize("hq,hkv,head_dim,wide", [
    (8, 2, 128, True),  # GQA group 4: four rows, the wide loops
    (3, 3, 96, True),  # multi-head: one row
    (6, 2, 80, True),  # group 3, a head dim of five 16-lane chunks
    (16, 2, 128, False),  # group 8: more rows than WIDE_ROWS
    (6, 2, 40, False),  # 40 is not a multiple of 16
])
def test_decode_head_lanes(cache_dtype, hq, hkv, head_dim, wide):
    assert (hq // hkv <= WIDE_ROWS and head_dim % 16 == 0) == wide
    inputs = _inputs(cache_dtype, hq, hkv, head_dim)
    mod = build(op.paged_attn, {name: (a.shape, str(a.dtype)) for name, a in inputs.items()})
    lib = tvm_fuel.compile(mod, AVX2, kernels="tuned")
    llvm_ir = kernel_llvm_ir(lib, "fuel_paged_attn_kernel")
    assert ("llvm.fmuladd.v16f32" in llvm_ir) == wide
    if not _RUNS_AVX2:
        pytest.skip("this CPU cannot run a kernel built for haswell (the IR was checked)")
    out = relax.VirtualMachine(lib, tvm.cpu())["main"](*[tvm.runtime.tensor(a) for a in inputs.values()]).numpy()
    expected = ref.paged_attn(**inputs)
    assert_close(out, expected, "float32" if cache_dtype.startswith("float8") else cache_dtype)
    assert np.all(out[3] == 0)  # context length 0
