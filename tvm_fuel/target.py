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
    threads of TVM's pool, ``tvm_fuel.threads.thread_count``: the physical cores unless set)."""
    from .threads import thread_count

    return tvm.target.Target({"kind": "llvm", "mcpu": tvm.target.codegen.llvm_get_system_cpu(),
                              "num-cores": num_cores or thread_count()})
