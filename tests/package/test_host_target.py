"""host_target() names only vector features this machine runs: LLVM names the CPU from its family
and model, and a virtual machine may hide that CPU's AVX-512 (a Zen 4 reported with AVX2 only;
the kernels built for "znver4" alone died of an illegal instruction there)."""

from __future__ import annotations

import platform

import pytest
import tvm

import tvm_fuel
from tvm_fuel.target import VECTOR_FEATURES, hidden_vector_features
from tvm_fuel.tuning.records import target_key

pytestmark = pytest.mark.unit

ZEN4_AVX512 = {"avx512f", "avx512dq", "avx512ifma", "avx512cd", "avx512bw", "avx512vl", "avx512_bf16", "avx512vbmi",
               "avx512_vbmi2", "gfni", "vaes", "vpclmulqdq", "avx512_vnni", "avx512_bitalg", "avx512_vpopcntdq"}
ZEN4_BASE = {"avx", "avx2", "fma", "f16c", "sse4_1", "sse4_2", "sha_ni", "bmi1", "bmi2"}


def test_a_hidden_avx512_is_turned_off():
    hidden = hidden_vector_features("znver4", frozenset(ZEN4_BASE | {"vaes", "vpclmulqdq"}))
    assert {"avx512f", "avx512bw", "avx512bf16", "avx512vnni", "gfni"} <= set(hidden)
    assert not {"avx2", "fma", "f16c", "vaes", "vpclmulqdq"} & set(hidden)
    target = tvm.target.Target({"kind": "llvm", "mcpu": "znver4", "mattr": [f"-{f}" for f in hidden]})
    has = tvm.target.codegen.target_has_features
    assert not has("avx512f", target) and not has("avx512bw", target) and has("avx2", target)
    assert target_key(target) == "llvm-x86-avx2"  # the AVX2 tuning logs apply


def test_reported_features_are_kept():
    assert hidden_vector_features("znver4", frozenset(ZEN4_BASE | ZEN4_AVX512)) == []  # spelled as Linux does
    assert hidden_vector_features("znver4", None) == []  # nothing known: LLVM's CPU as it is


@pytest.mark.skipif(platform.system() != "Linux" or platform.machine() not in ("x86_64", "AMD64"),
                    reason="reads /proc/cpuinfo's x86 flags")
def test_host_target_enables_only_reported_vector_features():
    with open("/proc/cpuinfo", encoding="utf-8") as info:
        flags = next(line for line in info if line.startswith("flags")).partition(":")[2].split()
    reported = {f.replace("_", "") for f in flags}
    target = tvm_fuel.host_target()
    enabled = {f for f in tvm.target.codegen.llvm_get_cpu_features(target) if f.startswith(VECTOR_FEATURES)}
    assert {f.replace("-", "").replace(".", "") for f in enabled} <= reported, target
