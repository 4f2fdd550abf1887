"""Gradients (``FPrimalGradient``) for Relax ops that TVM 0.27 leaves without one, so that
``relax.transform.Gradient`` trains models that use them.

Each gradient is a composition of Relax primitives that have gradients themselves (these
included), so ``Gradient`` of an adjoint differentiates it again (second derivatives). The
semantics are the forward op's own: its axes (any, negative ones too), its epsilon, layer norm's
``center`` / ``scale`` flags.

    relax.rsqrt           d rsqrt(x) = -rsqrt(x)^3 / 2
    relax.erf             d erf(x) = 2 / sqrt(pi) exp(-x^2)
    relax.nn.gelu         x Phi(x):          Phi(x) + x phi(x)                (exact, via erf)
    relax.nn.gelu_tanh    x (1 + tanh(u)) / 2, u = sqrt(2/pi) (x + 0.044715 x^3)
    relax.repeat          each input element's repeats summed (a reshape, then a sum)
    relax.nn.attention,   ``flash_attn_backward`` on the [B, H, S, D] views where its semantics are
    attention_bias        the op's exactly (``nn_attention.flash_options``: FuseAttention's rule);
                          elsewhere (TVM's sliding window, top-left causal with more keys than
                          queries) a clear error: run ``tvm_fuel.transform.ExpandAttention`` after
                          ``FuseAttention``, or differentiate a model without that mask. The bias
                          gets no gradient (a mask, as ``flash_attn``'s attn_mask)
    relax.nn.rms_norm     y = x r w, r = rsqrt(mean(x^2) + eps):
                          dx = r (g - x_hat mean(g x_hat)), g = dy w; dw = sum(dy x_hat)
    relax.nn.layer_norm   y = x_hat gamma + beta, x_hat = (x - mean) r:
                          dx = r (g - mean(g) - x_hat mean(g x_hat)), g = dy gamma;
                          dgamma = sum(dy x_hat), dbeta = sum(dy)

(``mean`` over the normalized axes; ``sum`` over every other axis, which leaves the weights'
shape: Relax requires the weights to be ``data.shape[axes]``.)

Contents:
    GRADIENTS -- op name -> FPrimalGradient
    register  -- register them where TVM has none (idempotent; runs on ``import tvm_fuel``)
"""

from __future__ import annotations

import math

import tvm
from tvm import relax
from tvm.relax.op.base import register_gradient
from tvm.relax.op.grad import no_grad

from . import op
from .nn_attention import flash_options

R = relax.op


def _const(value: float, like: relax.Expr) -> relax.Expr:
    return relax.const(value, str(like.ty.dtype))


def _rsqrt_gradient(orig_var, orig_call, output_grad, ctx):
    y = orig_var
    return [R.multiply(output_grad, R.multiply(_const(-0.5, y), R.multiply(y, R.multiply(y, y))))]


def _erf_gradient(orig_var, orig_call, output_grad, ctx):
    x = orig_call.args[0]
    return [R.multiply(output_grad, R.multiply(_const(2.0 / math.sqrt(math.pi), x), R.exp(R.negative(R.multiply(x, x)))))]


def _gelu_gradient(orig_var, orig_call, output_grad, ctx):
    x = orig_call.args[0]
    cdf = R.multiply(_const(0.5, x), R.add(_const(1.0, x), R.erf(R.multiply(x, _const(1 / math.sqrt(2.0), x)))))
    pdf = R.multiply(_const(1 / math.sqrt(2 * math.pi), x), R.exp(R.multiply(_const(-0.5, x), R.multiply(x, x))))
    return [R.multiply(output_grad, R.add(cdf, R.multiply(x, pdf)))]


def _gelu_tanh_gradient(orig_var, orig_call, output_grad, ctx):
    x = orig_call.args[0]
    c, a = math.sqrt(2 / math.pi), 0.044715
    x2 = R.multiply(x, x)
    t = ctx.emit(R.tanh(R.multiply(_const(c, x), R.add(x, R.multiply(_const(a, x), R.multiply(x2, x))))))
    du = R.multiply(_const(c, x), R.add(_const(1.0, x), R.multiply(_const(3 * a, x), x2)))
    sech2 = R.subtract(_const(1.0, x), R.multiply(t, t))
    grad = R.add(R.multiply(_const(0.5, x), R.add(_const(1.0, x), t)),
                 R.multiply(R.multiply(_const(0.5, x), x), R.multiply(sech2, du)))
    return [R.multiply(output_grad, grad)]


def _repeat_gradient(orig_var, orig_call, output_grad, ctx):
    """``repeat`` puts element i's copies at i * repeats + j along ``axis`` (of the flattened data
    when ``axis`` is None): split that axis into (n, repeats) and sum the copies."""
    x = orig_call.args[0]
    repeats, axis = int(orig_call.attrs.repeats), orig_call.attrs.axis
    shape = [int(d) if isinstance(d, tvm.tirx.IntImm) else d for d in x.ty.shape]
    if axis is None:
        total = 1
        for d in shape:
            total = total * d
        return [R.reshape(R.sum(R.reshape(output_grad, [total, repeats]), axis=[1]), shape)]
    axis = int(axis) % len(shape)
    split = shape[:axis] + [shape[axis], repeats] + shape[axis + 1:]
    return [R.sum(R.reshape(output_grad, split), axis=[axis + 1])]


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


def _normalized_axes(call: relax.Call) -> list[int]:
    ndim = call.args[0].ty.ndim
    return sorted(int(a) % ndim for a in call.attrs.axes)


def _broadcast(weight: relax.Expr, axes: list[int], ndim: int) -> relax.Expr:
    """A weight of shape ``data.shape[axes]`` with unit dims elsewhere: it broadcasts against data
    whichever axes are normalized (numpy's rule aligns trailing dims only)."""
    others = [a for a in range(ndim) if a not in axes]
    return R.expand_dims(weight, axis=others) if others and axes != list(range(ndim - len(axes), ndim)) else weight


def _weight_sum(x: relax.Expr, axes: list[int], ndim: int) -> relax.Expr:
    """``x`` (``ndim`` dims) summed over every axis but the normalized ones: the weights' shape."""
    others = [a for a in range(ndim) if a not in axes]
    return R.sum(x, axis=others) if others else x


def _rms_norm_gradient(orig_var, orig_call, output_grad, ctx):
    x, weight = orig_call.args
    axes, eps = _normalized_axes(orig_call), float(orig_call.attrs.epsilon)
    r = ctx.emit(R.rsqrt(R.add(R.mean(R.multiply(x, x), axis=axes, keepdims=True), _const(eps, x))))
    x_hat = ctx.emit(R.multiply(x, r))
    g = ctx.emit(R.multiply(output_grad, _broadcast(weight, axes, x.ty.ndim)))
    dx = R.multiply(r, R.subtract(g, R.multiply(x_hat, R.mean(R.multiply(g, x_hat), axis=axes, keepdims=True))))
    return [dx, _weight_sum(R.multiply(output_grad, x_hat), axes, x.ty.ndim)]


def _layer_norm_gradient(orig_var, orig_call, output_grad, ctx):
    x, gamma, beta = orig_call.args
    axes, eps = _normalized_axes(orig_call), float(orig_call.attrs.epsilon)
    centered = ctx.emit(R.subtract(x, R.mean(x, axis=axes, keepdims=True)))
    r = ctx.emit(R.rsqrt(R.add(R.mean(R.multiply(centered, centered), axis=axes, keepdims=True), _const(eps, x))))
    x_hat = ctx.emit(R.multiply(centered, r))
    scaled = R.multiply(output_grad, _broadcast(gamma, axes, x.ty.ndim))
    g = ctx.emit(scaled if bool(orig_call.attrs.scale) else output_grad)
    mean = lambda e: R.mean(e, axis=axes, keepdims=True)  # noqa: E731
    dx = R.multiply(r, R.subtract(R.subtract(g, mean(g)), R.multiply(x_hat, mean(R.multiply(g, x_hat)))))
    # gamma and beta always come as arguments; unused (scale / center off) they get zeros
    ndim = x.ty.ndim
    dgamma = (_weight_sum(R.multiply(output_grad, x_hat), axes, ndim) if bool(orig_call.attrs.scale)
              else R.zeros_like(gamma))
    dbeta = _weight_sum(output_grad, axes, ndim) if bool(orig_call.attrs.center) else R.zeros_like(beta)
    return [dx, dgamma, dbeta]


GRADIENTS = {
    "relax.rsqrt": _rsqrt_gradient,
    "relax.erf": _erf_gradient,
    "relax.nn.gelu": _gelu_gradient,
    "relax.nn.gelu_tanh": _gelu_tanh_gradient,
    "relax.repeat": _repeat_gradient,
    "relax.nn.attention": _attention_gradient,
    "relax.nn.attention_bias": _attention_gradient,
    "relax.nn.rms_norm": _rms_norm_gradient,
    "relax.nn.layer_norm": _layer_norm_gradient,
}


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
