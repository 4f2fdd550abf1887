"""The gradient of TVM's ``R.nn.attention`` / ``attention_bias`` ([B, S, H, D] layout).

``flash_attn_backward`` on the [B, H, S, D] views where its semantics are the op's exactly
(``nn_attention.flash_options``: FuseAttention's rule). The bias gets no gradient (a mask, as
``flash_attn``'s attn_mask).
"""

from __future__ import annotations

from tvm import relax
from tvm.relax.op.grad import no_grad

from .. import op
from ..nn_attention import flash_options

R = relax.op


def _attention_gradient(orig_var, orig_call, output_grad, ctx):
    options = flash_options(orig_call)
    if options is None:
        raise ValueError(f"{orig_call.op.name}: no gradient for this call (its window_size, mask or shapes have no "
                         f"flash_attn equivalent); rewrite it with tvm_fuel.transform.FuseAttention and "
                         f"ExpandAttention, or use causal_mask BottomRight / TopLeft with Sq >= Sk")
    heads_first = lambda x: R.permute_dims(x, [0, 2, 1, 3])  # noqa: E731 ([B, S, H, D] <-> [B, H, S, D])
    q, k, v = (heads_first(x) for x in orig_call.args[:3])
    bias = orig_call.args[3] if len(orig_call.args) > 3 else None
    grads = ctx.emit(op.flash_attn_backward(q, k, v, heads_first(output_grad), None, bias,
                                            out=heads_first(orig_var), **options))
    result = [heads_first(relax.TupleGetItem(grads, i)) for i in range(3)]
    return result + ([no_grad(bias)] if bias is not None else [])


GRADIENTS = {
    "relax.nn.attention": _attention_gradient,
    "relax.nn.attention_bias": _attention_gradient,
}
