"""Gradients (``FPrimalGradient``) of the fuel ops and of the Relax ops that TVM 0.27 leaves
without one, so that ``relax.transform.Gradient`` trains models that use them.

Each gradient is a composition of Relax primitives that have gradients themselves (these
included), so ``Gradient`` of an adjoint differentiates it again (second derivatives). The
semantics are the forward op's own: its axes (any, negative ones too), its epsilon, its flags.
Where a fused kernel pays, the first-order gradient calls it and the fused op's own gradient is
the composition's (see ``norms``).

One module per family, each with its ``GRADIENTS`` table and the formulas in its docstring:
    elementwise -- rsqrt, erf, gelu, gelu_tanh, dropout
    norms       -- rms_norm, layer_norm, group_norm, batch_norm
    indexing    -- arange, repeat, strided_slice
    spatial     -- conv2d_transpose, adaptive_avg_pool2d
    attention   -- nn.attention, nn.attention_bias
    fuel_ops    -- the fuel ops (flash_attn's backward, the backward's double backward, ...)
    common      -- what they share

Contents:
    GRADIENTS -- op name -> FPrimalGradient
    register  -- register them where TVM has none (idempotent; runs on ``import tvm_fuel``)
"""

from __future__ import annotations

import tvm
from tvm.relax.op.base import register_gradient

from . import attention, elementwise, fuel_ops, indexing, norms, spatial

GRADIENTS = {**elementwise.GRADIENTS, **norms.GRADIENTS, **indexing.GRADIENTS, **spatial.GRADIENTS,
             **attention.GRADIENTS, **fuel_ops.GRADIENTS}


def register() -> list[str]:
    """Register each gradient where the op has none (TVM's own always wins); returns the ops
    that gained one in this call."""
    added = []
    for name, gradient in GRADIENTS.items():
        if tvm.ir.Op.get(name).get_attr("FPrimalGradient") is None:
            register_gradient(name, gradient)
            added.append(name)
    return added


__all__ = ["GRADIENTS", "register"]
