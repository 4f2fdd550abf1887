"""TVM's CPU thread pool: one worker per physical core unless the user says otherwise.

TVM's runtime sizes its pool, when it first starts, from ``TVM_NUM_THREADS`` or
``OMP_NUM_THREADS``; without either it takes half of ``hardware_concurrency()`` on x86-64,
assuming two hyper-threads per core. On a machine with one thread per core that halves the
cores every kernel runs on (2 cores: 1 thread). It also binds the launching thread to CPU 0 on
the first parallel launch, and a PyTorch pool created afterwards inherits that one-core mask.

``configure`` runs when tvm_fuel is imported (before any kernel can start the pool): where the
user set neither variable it sets ``TVM_NUM_THREADS`` to the physical core count, and where
``TVM_BIND_THREADS`` is unset it turns binding off. A user's own setting always wins. Import
tvm_fuel before running any TVM kernel in the process: a pool already started keeps its size.

Contents:
    physical_cores -- cores of this machine (not hyper-threads)
    thread_count   -- the threads TVM's pool runs (the user's setting, else the physical cores)
    configure      -- the import-time setting (returns what it set)
"""

from __future__ import annotations

import os
from typing import MutableMapping

USER_VARIABLES = ("TVM_NUM_THREADS", "OMP_NUM_THREADS")


def physical_cores() -> int:
    """Physical cores of this machine (psutil; the logical count where it cannot tell)."""
    try:
        import psutil

        count = psutil.cpu_count(logical=False)
    except ImportError:  # psutil is a dependency; a stripped environment still gets a pool
        count = None
    return max(1, count or os.cpu_count() or 1)


def thread_count(environ: MutableMapping[str, str] = os.environ) -> int:
    """The threads TVM's pool runs with: ``TVM_NUM_THREADS``, else ``OMP_NUM_THREADS`` (as TVM
    reads them), else the physical cores."""
    for name in USER_VARIABLES:
        value = environ.get(name, "").strip()
        if value.isdigit() and int(value) > 0:
            return int(value)
    return physical_cores()


def configure(environ: MutableMapping[str, str] = os.environ) -> dict[str, str]:
    """Size TVM's pool to the physical cores and leave threads unbound, where the user did not
    choose; returns the variables it set."""
    chosen: dict[str, str] = {}
    if not any(environ.get(name, "").strip() for name in USER_VARIABLES):
        chosen["TVM_NUM_THREADS"] = str(physical_cores())
    if "TVM_BIND_THREADS" not in environ:
        chosen["TVM_BIND_THREADS"] = "0"  # keep the caller's affinity (and a later PyTorch pool's) whole
    environ.update(chosen)
    return chosen


__all__ = ["physical_cores", "thread_count", "configure", "USER_VARIABLES"]
