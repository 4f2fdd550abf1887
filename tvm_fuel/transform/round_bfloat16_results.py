"""``RoundBfloat16Results``: each op's computed bfloat16 results rounded where it stores them.
"""

from __future__ import annotations

import tvm

from .common import unscheduled


def _rounded_to_bfloat16(value):
    """``value`` (bfloat16) rounded as BF16StorageLegalize rounds a stored bfloat16 (nearest even: the
    float32 bits plus 0x7fff plus the lowest kept bit, the low half cleared), in float32 arithmetic that
    BF16ComputeLegalize keeps; rounding a rounded value changes no bit."""
    bits = tvm.tirx.reinterpret("uint32", tvm.tirx.Cast("float32", value))
    lowest_kept = tvm.tirx.bitwise_and(tvm.tirx.shift_right(bits, tvm.tirx.const(16, "uint32")),
                                       tvm.tirx.const(1, "uint32"))
    rounded = tvm.tirx.bitwise_and(bits + tvm.tirx.const(0x7FFF, "uint32") + lowest_kept,
                                   tvm.tirx.const(0xFFFF0000, "uint32"))
    return tvm.tirx.Cast("bfloat16", tvm.tirx.reinterpret("float32", rounded))


def _bfloat16_bits_rounded(value: float) -> float:
    """``_rounded_to_bfloat16`` of a constant."""
    import numpy as np

    bits = int(np.array(value, np.float32).view(np.uint32))
    bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000
    return float(np.array(bits & 0xFFFFFFFF, np.uint32).view(np.float32))


@tvm.transform.module_pass(opt_level=0, name="tvm_fuel.RoundBfloat16Results")
class RoundBfloat16Results:
    """Each op's computed bfloat16 results rounded explicitly where it stores them.

    TVM computes bfloat16 in float32 and rounds where a value is stored to memory of the dtype: a
    function's parameters. FuseOps turns the results ops pass each other into buffers inside one
    function, which BF16ComputeLegalize makes float32, so without this an op's result reached the
    next op unrounded ((x.bfloat16() * y.bfloat16()).float() gave 689.0625 for 26.25^2, not 688) and a
    bfloat16 sum accumulated in float32. Rounded in the store itself, the rounding stays wherever
    fusion and the schedules move the value: results equal TVM's unfused build. Runs on the op
    functions LegalizeOps made (the fuel kernels, already scheduled, keep their own numerics)."""

    def transform_module(self, mod: tvm.IRModule, _ctx: tvm.transform.PassContext) -> tvm.IRModule:
        rounded = {gvar: _round_results(func) for gvar, func in unscheduled(mod).items()}
        for gvar, func in rounded.items():
            if func is not None:
                mod[gvar] = func
        return mod


def _round_results(func: tvm.tirx.PrimFunc):
    """``func`` with its computed stores into bfloat16 parameters rounded, or None where it has none."""
    import tvm_ffi

    outputs = [param for param in func.params
               if isinstance(param.ty, tvm.tirx.BufferType) and str(param.dtype) == "bfloat16"]
    changed = []

    def store(node):
        if not any(node.buffer.same_as(buf) for buf in outputs) or isinstance(node.value, tvm.ir.expr.TensorLoad):
            return node  # (a copy is rounded already)
        changed.append(node)
        if isinstance(node.value, tvm.tirx.FloatImm):  # a constant: rounded here
            value = tvm.tirx.FloatImm("bfloat16", _bfloat16_bits_rounded(node.value.value))
        else:
            value = _rounded_to_bfloat16(node.value)
        return tvm.tirx.BufferStore(node.buffer, value, node.indices)

    body = tvm_ffi.structural_map(func.body, (tvm.tirx.BufferStore, store)) if outputs else func.body
    return func.with_body(body) if changed else None
