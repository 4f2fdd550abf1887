"""The llvm-only piece of the CPU kernels (the rest is shared: ``schedules.common``).

Contents:
    prefetch -- software prefetch of a cache line
"""

from __future__ import annotations

from tvm.script import tirx as T


def prefetch(address):
    """Software prefetch of the cache line at ``address`` into all cache levels (for reading)."""
    return T.evaluate(T.call_llvm_intrin("void", "llvm.prefetch.p0", address, 0, 2, 1))
