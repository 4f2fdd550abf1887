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

Registering a gradient on one of TVM's own ops patches TVM: that is ``tvm_fuel.compat.relax_gradients``
(``RELAX_GRADIENTS``, through ``register_missing``); ``register`` registers the fuel ops' own.

Contents:
    GRADIENTS        -- op name -> FPrimalGradient: RELAX_GRADIENTS and FUEL_GRADIENTS
    RELAX_GRADIENTS  -- those of TVM's own Relax ops (registered by ``tvm_fuel.compat.relax_gradients``)
    FUEL_GRADIENTS   -- those of the fuel ops (``relax.fuel.*``)
    register_missing -- register a table's gradients where the op has none
    register         -- register FUEL_GRADIENTS (idempotent; runs on ``import tvm_fuel``, after the ops)
"""

from __future__ import annotations

from typing import Callable, Mapping

import tvm
from tvm.relax.op.base import register_gradient

from . import attention, elementwise, fuel_ops, indexing, norms, spatial

RELAX_GRADIENTS = {**elementwise.GRADIENTS, **norms.GRADIENTS, **indexing.GRADIENTS, **spatial.GRADIENTS,
                   **attention.GRADIENTS}
FUEL_GRADIENTS = fuel_ops.GRADIENTS
GRADIENTS = {**RELAX_GRADIENTS, **FUEL_GRADIENTS}


def register_missing(gradients: Mapping[str, Callable]) -> list[str]:
    """Register each of ``gradients`` (op name -> FPrimalGradient) where the op has none (one it has,
    TVM's own included, always wins); returns the ops that gained one in this call."""
    added = []
    for name, gradient in gradients.items():
        if tvm.ir.Op.get(name).get_attr("FPrimalGradient") is None:
            register_gradient(name, gradient)
            added.append(name)
    return added


def register() -> list[str]:
    """Register the fuel ops' gradients (the ops registered first: ``tvm_fuel.op.register``); returns
    the ops that gained one in this call. Those of TVM's ops: ``tvm_fuel.compat.relax_gradients``."""
    return register_missing(FUEL_GRADIENTS)


__all__ = ["GRADIENTS", "RELAX_GRADIENTS", "FUEL_GRADIENTS", "register_missing", "register"]
