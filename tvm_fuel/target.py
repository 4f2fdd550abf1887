"""Targets: what ``tvm_fuel.compile`` accepts as one, llvm for this machine's CPU, and whether
this machine has a CUDA device (``has_gpu``) and of which architecture (``device_arch``).
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
    threads of TVM's pool, ``tvm_fuel.compat.threads.thread_count``: the physical cores unless set).

    LLVM names the CPU from its family and model alone; a virtual machine may hide some of that
    CPU's extensions (a Zen 4 without AVX-512: its instructions fault), so every instruction-set
    feature of the named CPU that Linux does not report is turned off (``mattr``). Elsewhere
    (no ``/proc/cpuinfo``) the CPU's name stands as LLVM gives it."""
    from .compat.threads import thread_count

    cpu = tvm.target.codegen.llvm_get_system_cpu()
    config = {"kind": "llvm", "mcpu": cpu, "num-cores": num_cores or thread_count()}
    hidden = hidden_cpu_features(cpu, _reported_cpu_flags())
    if hidden:
        config["mattr"] = [f"-{feature}" for feature in hidden]
    return tvm.target.Target(config)


# the LLVM features whose instructions compiled code may use freely (vector units and the scalar
# extensions LLVM emits by itself: BMI's shlx, lzcnt, movbe, ...), by LLVM's name prefix
CHECKED_FEATURES = ("avx", "amx", "fma", "f16c", "gfni", "vaes", "vpclmulqdq", "sse", "ssse3", "aes", "pclmul",
                    "sha", "bmi", "lzcnt", "popcnt", "movbe", "adx")
# LLVM's names that Linux spells otherwise (after dropping "_", "-" and ".")
_LINUX_NAMES = {"bmi": "bmi1", "lzcnt": "abm", "sse3": "pni", "pclmul": "pclmulqdq", "sha": "shani"}


def hidden_cpu_features(cpu: str, reported: frozenset[str] | None) -> list[str]:
    """The features of ``CHECKED_FEATURES`` that LLVM enables for ``cpu`` and ``reported`` (the
    kernel's CPU flags, ``/proc/cpuinfo``'s spelling; None: unknown, nothing is turned off) lacks.
    Names compare without ``_``, ``-`` and ``.`` (LLVM's ``avx512bf16`` is Linux's ``avx512_bf16``),
    through ``_LINUX_NAMES`` where the names differ."""
    if reported is None:
        return []
    reported = {_plain(flag) for flag in reported}
    features = tvm.target.codegen.llvm_get_cpu_features(tvm.target.Target({"kind": "llvm", "mcpu": cpu}))
    return sorted(f for f in features if f.startswith(CHECKED_FEATURES) and linux_name(f) not in reported)


def linux_name(feature: str) -> str:
    """An LLVM feature's name as ``/proc/cpuinfo`` spells it, without ``_``, ``-`` and ``.``."""
    plain = _plain(feature)
    return _LINUX_NAMES.get(plain, plain)


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


def has_gpu() -> bool:
    """Whether CUDA device 0 exists (False without a CUDA runtime or driver)."""
    try:
        return bool(tvm.cuda(0).exist)
    except Exception:  # noqa: BLE001 (no CUDA runtime in this TVM build or no driver)
        return False


def device_arch() -> str:
    """``sm_XY`` of device 0."""
    return "sm_" + tvm.cuda(0).compute_version.replace(".", "")
