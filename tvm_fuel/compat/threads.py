"""TVM's CPU thread pool: one worker per physical core unless the user says otherwise.

Applies to: TVM 0.27.0. Works around: ``src/runtime/threading_backend.cc``: ``MaxConcurrency``
(the pool's size), ``ThreadGroup::Impl::InitSortedOrder`` (the CPUs at the top frequency) and
``ThreadGroup::Impl::SetAffinity`` (``TVM_BIND_THREADS``), read when ``thread_pool.cc``'s
``ThreadPool`` first starts.

TVM's runtime sizes its pool, when it first starts, from ``TVM_NUM_THREADS`` if it is set (even
empty), else ``OMP_NUM_THREADS``, read with C's ``atoi``, and at least 1; without either it
takes half of ``hardware_concurrency()`` on x86-64, assuming two hyper-threads per core. The
pool then runs no more threads than there are CPUs at the machine's top ``cpuinfo_max_freq``
(every CPU where the frequencies are equal or unknown). So ``abc``, ``0``, ``-1`` or an empty
value run 1 thread, and an empty ``TVM_NUM_THREADS`` hides ``OMP_NUM_THREADS``. On a machine
with one thread per core the default halves the cores every kernel runs on (2 cores: 1
thread). TVM also binds the launching thread to CPU 0 on the first parallel launch, and a
PyTorch pool created afterwards inherits that one-core mask.

``install`` (``configure`` on the process's environment) runs when tvm_fuel is imported
(``tvm_fuel.compat.install``, before any kernel can start the pool): where the user set neither
variable it sets ``TVM_NUM_THREADS`` to the physical core count, and where ``TVM_BIND_THREADS``
is unset it turns binding off. A user's own setting always wins; one TVM would not run as
written (not a positive integer) gets a warning, once, and one asking for more threads than the
pool runs is lowered to what runs (a worker is started per thread asked for: a huge value
exhausts the memory), with a warning. Import tvm_fuel before running any TVM kernel in the
process: a pool already started keeps its size.

Contents:
    physical_cores -- cores of this machine (not hyper-threads)
    thread_count   -- the threads TVM's pool runs, computed as TVM computes them
    configure      -- the import-time setting (returns what it set)
    install        -- ``configure`` on ``os.environ`` (idempotent: a second call sets nothing)
    USER_VARIABLES -- the variables a user sizes the pool with, in TVM's order
"""

from __future__ import annotations

import os
import platform
import re
import warnings
from typing import Mapping, MutableMapping

USER_VARIABLES = ("TVM_NUM_THREADS", "OMP_NUM_THREADS")

_warned: set[str] = set()


def physical_cores() -> int:
    """Physical cores of this machine (psutil; the logical count where it cannot tell)."""
    try:
        import psutil

        count = psutil.cpu_count(logical=False)
    except ImportError:  # psutil is a dependency; a stripped environment still gets a pool
        count = None
    return max(1, count or os.cpu_count() or 1)


def _hardware_concurrency() -> int:
    """``std::thread::hardware_concurrency()``: the online CPUs (glibc's get_nprocs, as os.cpu_count)."""
    return os.cpu_count() or 1


def _top_frequency_cpus() -> int:
    """The CPUs at the highest ``cpuinfo_max_freq`` (TVM's ``big_count_``): TVM's pool runs no more
    threads. A missing file reads as 0 and an unreadable one as -1, as TVM reads them."""
    frequencies = []
    for cpu in range(_hardware_concurrency()):
        try:
            with open(f"/sys/devices/system/cpu/cpu{cpu}/cpufreq/cpuinfo_max_freq") as file:
                found = re.match(r"\s*[+-]?\d+", file.read())
            frequencies.append(int(found.group()) if found else -1)
        except OSError:
            frequencies.append(0)
    return frequencies.count(max(frequencies)) if frequencies else 1


def _atoi(text: str) -> int:
    """C's ``atoi`` as glibc runs it, ``(int) strtol(text, NULL, 10)``: leading white space, a sign,
    the digits up to the first other character (none: 0), clamped to a long, cut to 32 bits."""
    found = re.match(r"[ \t\n\v\f\r]*([+-]?\d+)", text)
    if not found:
        return 0
    value = max(-(2 ** 63), min(2 ** 63 - 1, int(found.group(1))))
    value &= 0xFFFFFFFF
    return value - 2 ** 32 if value >= 2 ** 31 else value


def _pool(environ: Mapping[str, str]) -> tuple[int, str | None]:
    """(the threads TVM's pool runs under ``environ``, why it differs from the setting or None)."""
    name = next((n for n in USER_VARIABLES if n in environ), None)  # set, even empty: getenv's non-NULL
    cap = _top_frequency_cpus()
    if name is None:
        halved = platform.machine().lower() in ("x86_64", "amd64")  # TVM assumes two hyper-threads a core
        return min(max(_hardware_concurrency() // (2 if halved else 1), 1), cap), None
    value = environ[name]
    asked = max(_atoi(value), 1)
    threads = min(asked, cap)
    why = None
    if not re.fullmatch(r"\s*\+?\d+\s*", value) or int(value) < 1:
        hidden = "OMP_NUM_THREADS" if name == "TVM_NUM_THREADS" and "OMP_NUM_THREADS" in environ else None
        why = (f"{name}={value!r} is not a positive integer: TVM's runtime reads it with atoi as {_atoi(value)} "
               f"and runs {threads} thread{'s' if threads > 1 else ''}"
               + (f" ({hidden}={environ[hidden]!r} is not read while {name} is set)" if hidden else "")
               + "; set a positive integer")
    elif asked > cap:
        why = (f"{name}={value!r} asks for more threads than TVM's pool runs on this machine: it runs {cap} "
               f"(its CPUs at the top frequency)")
    return threads, why


def _warn_once(why: str | None) -> None:
    if why is not None and why not in _warned:
        _warned.add(why)
        warnings.warn(f"tvm_fuel: {why}", RuntimeWarning, stacklevel=3)


def thread_count(environ: Mapping[str, str] = os.environ) -> int:
    """The threads TVM's pool runs with under ``environ``, computed as TVM's runtime computes them
    (``TVM_NUM_THREADS``, else ``OMP_NUM_THREADS``, read with atoi, at least 1 and at most the CPUs
    at the top frequency; after ``configure``, the physical cores unless the user chose). A
    setting TVM does not run as written is warned about, once."""
    threads, why = _pool(environ)
    _warn_once(why)
    return threads


def configure(environ: MutableMapping[str, str] = os.environ) -> dict[str, str]:
    """Size TVM's pool to the physical cores and leave threads unbound, where the user did not
    choose; returns the variables it set. A user's setting TVM would not run as written is warned
    about here, at import, once."""
    chosen: dict[str, str] = {}
    cap = _top_frequency_cpus()
    if not any(environ.get(name, "").strip() for name in USER_VARIABLES):
        # capped as the pool caps it, so the setting is what runs (hybrid CPUs: the fast cores)
        chosen["TVM_NUM_THREADS"] = str(min(physical_cores(), cap))
    else:
        name = next(n for n in USER_VARIABLES if n in environ)
        if _atoi(environ[name]) > cap:
            # the pool runs `cap` threads either way, but starts a worker per thread asked for:
            # 99999999999 (atoi: 1215752191) allocates until the process is killed
            _warn_once(f"{name}={environ[name]!r} asks for more threads than TVM's pool runs on this machine "
                       f"({cap}, its CPUs at the top frequency): TVM_NUM_THREADS is set to {cap}, the threads "
                       f"that run either way, so no idle workers are started")
            chosen["TVM_NUM_THREADS"] = str(cap)
    if "TVM_BIND_THREADS" not in environ:
        chosen["TVM_BIND_THREADS"] = "0"  # keep the caller's affinity (and a later PyTorch pool's) whole
    environ.update(chosen)
    _warn_once(_pool(environ)[1])
    return chosen


def install() -> dict[str, str]:
    """``configure`` the process's environment (what ``import tvm_fuel`` runs first); returns what it
    set, nothing on a second call (the first call's settings are then the user's)."""
    return configure(os.environ)


__all__ = ["physical_cores", "thread_count", "configure", "install", "USER_VARIABLES"]
