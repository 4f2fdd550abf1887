"""host_target() names only instruction-set features this machine runs: LLVM names the CPU from its family
and model, and a virtual machine may hide that CPU's AVX-512 (a Zen 4 reported with AVX2 only;
the kernels built for "znver4" alone died of an illegal instruction there)."""

from __future__ import annotations

import platform

import pytest
import tvm

import tvm_fuel
from tvm_fuel.target import CHECKED_FEATURES, hidden_cpu_features, linux_name
from tvm_fuel.dispatch.records import target_key

pytestmark = pytest.mark.unit

ZEN4_AVX512 = {"avx512f", "avx512dq", "avx512ifma", "avx512cd", "avx512bw", "avx512vl", "avx512_bf16", "avx512vbmi",
               "avx512_vbmi2", "gfni", "vaes", "vpclmulqdq", "avx512_vnni", "avx512_bitalg", "avx512_vpopcntdq"}
ZEN4_BASE = {"sse", "sse2", "pni", "ssse3", "sse4_1", "sse4_2", "sse4a", "avx", "avx2", "fma", "f16c", "sha_ni",
             "bmi1", "bmi2", "abm", "popcnt", "movbe", "adx", "aes", "pclmulqdq"}


def test_a_hidden_avx512_is_turned_off():
    hidden = hidden_cpu_features("znver4", frozenset(ZEN4_BASE | {"vaes", "vpclmulqdq"}))
    assert set(hidden) == {"avx512f", "avx512dq", "avx512ifma", "avx512cd", "avx512bw", "avx512vl", "avx512bf16",
                           "avx512vbmi", "avx512vbmi2", "avx512vnni", "avx512bitalg", "avx512vpopcntdq", "gfni"}
    target = tvm.target.Target({"kind": "llvm", "mcpu": "znver4", "mattr": [f"-{f}" for f in hidden]})
    has = tvm.target.codegen.target_has_features
    assert not has("avx512f", target) and not has("avx512bw", target) and has("avx2", target)
    assert target_key(target) == "llvm-x86-avx2"  # the AVX2 tuning logs apply


def test_reported_features_are_kept():
    assert hidden_cpu_features("znver4", frozenset(ZEN4_BASE | ZEN4_AVX512)) == []  # spelled as Linux does
    assert hidden_cpu_features("znver4", None) == []  # nothing known: LLVM's CPU as it is
    # a hidden scalar extension LLVM emits by itself (BMI2's shlx, lzcnt) is turned off too
    assert hidden_cpu_features("znver4", frozenset(ZEN4_BASE | ZEN4_AVX512) - {"bmi2", "abm"}) == ["bmi2", "lzcnt"]


@pytest.mark.skipif(platform.system() != "Linux" or platform.machine() not in ("x86_64", "AMD64"),
                    reason="reads /proc/cpuinfo's x86 flags")
def test_host_target_enables_only_reported_features():
    with open("/proc/cpuinfo", encoding="utf-8") as info:
        flags = next(line for line in info if line.startswith("flags")).partition(":")[2].split()
    reported = {f.replace("_", "") for f in flags}
    target = tvm_fuel.host_target()
    enabled = {f for f in tvm.target.codegen.llvm_get_cpu_features(target) if f.startswith(CHECKED_FEATURES)}
    assert {"avx2", "sse2"} & enabled or not {"avx2", "sse2"} & reported  # the names compare at all
    assert {linux_name(f) for f in enabled} <= reported, target
