"""Gradients of TVM's own Relax ops that TVM leaves without one.

Applies to: TVM 0.27.0. Works around: ``python/tvm/relax/op/_op_gradient.py`` (where TVM registers
its ``FPrimalGradient``s, with ``python/tvm/relax/op/base.py`` ``register_gradient``) having none
for ``relax.rsqrt``, ``erf``, ``nn.gelu``, ``nn.gelu_tanh``, ``nn.dropout``, ``nn.rms_norm``,
``nn.layer_norm``, ``nn.group_norm``, ``nn.batch_norm``, ``arange``, ``repeat``,
``strided_slice``, ``nn.conv2d_transpose``, ``nn.adaptive_avg_pool2d``, ``nn.attention`` and
``nn.attention_bias``: ``src/relax/transform/gradient.cc`` (``BackwardBindingGenerator``, which
reads each call's ``FPrimalGradient``) then refuses any model that uses one of them, as most
imported transformer models do.

The gradients themselves, and their formulas, are ``tvm_fuel.autodiff``'s (``RELAX_GRADIENTS``);
this module registers them. Where TVM has a gradient of its own (a later TVM adding one), TVM's
stays. The fuel ops' own gradients are not a patch of TVM: ``tvm_fuel.autodiff.register``
registers them, after the ops.

Contents:
    install -- register each where TVM has none (idempotent; returns the ops that gained one)
"""

from __future__ import annotations

from .. import autodiff


def install() -> list[str]:
    """Register ``tvm_fuel.autodiff.RELAX_GRADIENTS`` on the ops that have no gradient (TVM's own
    always wins); returns the ops that gained one in this call (none on a second call)."""
    return autodiff.register_missing(autodiff.RELAX_GRADIENTS)


__all__ = ["install"]
