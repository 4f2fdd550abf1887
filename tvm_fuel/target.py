"""Targets: what ``tvm_fuel.compile`` accepts as one, and llvm for this machine's CPU.
"""

from __future__ import annotations

from typing import Any

import tvm


def as_target(target: Any) -> tvm.target.Target:
    """Accept ``"llvm"``, ``{"kind": "cuda", "arch": "sm_90"}`` or a Target."""
    if isinstance(target, tvm.target.Target):
        return target
    if isinstance(target, str):
        return tvm.target.Target({"kind": target} if target.isidentifier() else target)
    if isinstance(target, dict):
        return tvm.target.Target(target)
    raise TypeError(f"tvm_fuel.compile: target must be a str, dict or tvm.target.Target, got {type(target).__name__}")


def host_target(num_cores: int | None = None) -> tvm.target.Target:
    """llvm for this machine's CPU (its vector units), using ``num_cores`` threads (default: the
    threads of TVM's pool, ``tvm_fuel.threads.thread_count``: the physical cores unless set).

    LLVM names the CPU from its family and model alone; a virtual machine may hide some of that
    CPU's vector extensions (a Zen 4 without AVX-512: its instructions fault), so every vector
    feature of the named CPU that the kernel does not report is turned off (``mattr``)."""
    from .threads import thread_count

    cpu = tvm.target.codegen.llvm_get_system_cpu()
    config = {"kind": "llvm", "mcpu": cpu, "num-cores": num_cores or thread_count()}
    hidden = hidden_vector_features(cpu, _reported_cpu_flags())
    if hidden:
        config["mattr"] = [f"-{feature}" for feature in hidden]
    return tvm.target.Target(config)


# the feature families whose instructions a kernel's vector code may use (LLVM's names)
VECTOR_FEATURES = ("avx", "amx", "fma", "f16c", "gfni", "vaes", "vpclmulqdq")


def hidden_vector_features(cpu: str, reported: frozenset[str] | None) -> list[str]:
    """The vector features LLVM enables for ``cpu`` that ``reported`` (the kernel's CPU flags,
    ``/proc/cpuinfo``'s spelling; None: unknown, nothing is turned off) lacks. Names compare
    without ``_``, ``-`` and ``.`` (LLVM's ``avx512bf16`` is the kernel's ``avx512_bf16``)."""
    if reported is None:
        return []
    reported = {_plain(flag) for flag in reported}
    features = tvm.target.codegen.llvm_get_cpu_features(tvm.target.Target({"kind": "llvm", "mcpu": cpu}))
    return sorted(f for f in features if f.startswith(VECTOR_FEATURES) and _plain(f) not in reported)


def _plain(name: str) -> str:
    return name.replace("_", "").replace("-", "").replace(".", "")


def _reported_cpu_flags() -> frozenset[str] | None:
    """The x86 CPU flags Linux reports (None elsewhere, or without an x86 ``flags`` line)."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as info:
            for line in info:
                if line.startswith("flags"):
                    return frozenset(line.partition(":")[2].split())
    except OSError:
        return None
    return None
