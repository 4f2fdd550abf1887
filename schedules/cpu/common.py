"""Pieces of the CPU kernels that are not TVMScript macros (the rest is shared: ``schedules.common``).

Contents:
    prefetch      -- software prefetch of a cache line
    named_buffer  -- a buffer allocated and named outside a TVMScript body (a task's scratch)
    absent_inputs -- the optional inputs (ALiBi, mask, sinks, cache scales) a spec does not use
    Buffers       -- base of the frozen bundles of parameter buffers handed to the task macros
"""

from __future__ import annotations

from tvm.script import tirx as T
from tvm.script.ir_builder import IRBuilder

from ..common import KernelSpec


def prefetch(address):
    """Software prefetch of the cache line at ``address`` into all cache levels (for reading)."""
    return T.evaluate(T.call_llvm_intrin("void", "llvm.prefetch.p0", address, 0, 2, 1))


def named_buffer(name: str, shape, dtype: str = "float32", scope: str = "global"):
    """``T.alloc_buffer`` named ``name`` where it is called in a prim_func, as TVMScript names an
    assigned one: a plain function's buffers (a run of tasks' scratch, allocated once for them) are
    otherwise unnamed, and the built IR and its tests read the names."""
    buffer = T.alloc_buffer(shape, dtype, scope=scope)
    IRBuilder.name(name, buffer)
    return buffer


def absent_inputs(spec: KernelSpec) -> set[str]:
    """The optional inputs ("alibi", "mask", "sinks", "k_scale", "v_scale") ``spec`` does not use: the kernels drop them
    from their signature, and their bundles hold None in their place."""
    absent = {"sinks"} if not spec.has_sinks else set()
    if not spec.kv_scale:
        absent |= {"k_scale", "v_scale"}
    if not spec.has_alibi:
        absent.add("alibi")
    if len(spec.mask_broadcast) == 0:
        absent.add("mask")
    return absent


class Buffers:
    """Base of the frozen dataclasses that bundle a kernel's parameter buffers for its macros.

    Built inside a ``@T.prim_func`` body as ``T.meta_var(Bundle.of(absent, name=buffer, ...))``:
    ``T.meta_var`` keeps the parser from binding the bundle as a TIR value.
    """

    @classmethod
    def of(cls, absent: set[str], **buffers):
        """The bundle of ``buffers``, with None for the ``absent`` ones (a macro then cannot read a
        parameter the kernel drops)."""
        return cls(**{name: None if name in absent else buffer for name, buffer in buffers.items()})
