"""Gradients of the normalizations: rms_norm, layer_norm.

    relax.nn.rms_norm     y = x r w, r = rsqrt(mean(x^2) + eps):
                          dx = r (g - x_hat mean(g x_hat)), g = dy w; dw = sum(dy x_hat)
    relax.nn.layer_norm   y = x_hat gamma + beta, x_hat = (x - mean) r:
                          dx = r (g - mean(g) - x_hat mean(g x_hat)), g = dy gamma;
                          dgamma = sum(dy x_hat), dbeta = sum(dy)

(``mean`` over the normalized axes; ``sum`` over every other axis, which leaves the weights'
shape: Relax requires the weights to be ``data.shape[axes]``.)
"""

from __future__ import annotations

from tvm import relax

from .common import broadcast_weight, const, normalized_axes, weight_sum

R = relax.op


def _rms_norm_gradient(orig_var, orig_call, output_grad, ctx):
    x, weight = orig_call.args
    axes, eps = normalized_axes(orig_call), float(orig_call.attrs.epsilon)
    r = ctx.emit(R.rsqrt(R.add(R.mean(R.multiply(x, x), axis=axes, keepdims=True), const(eps, x))))
    x_hat = ctx.emit(R.multiply(x, r))
    g = ctx.emit(R.multiply(output_grad, broadcast_weight(weight, axes, x.ty.ndim)))
    dx = R.multiply(r, R.subtract(g, R.multiply(x_hat, R.mean(R.multiply(g, x_hat), axis=axes, keepdims=True))))
    return [dx, weight_sum(R.multiply(output_grad, x_hat), axes, x.ty.ndim)]


def _layer_norm_gradient(orig_var, orig_call, output_grad, ctx):
    x, gamma, beta = orig_call.args
    axes, eps = normalized_axes(orig_call), float(orig_call.attrs.epsilon)
    centered = ctx.emit(R.subtract(x, R.mean(x, axis=axes, keepdims=True)))
    r = ctx.emit(R.rsqrt(R.add(R.mean(R.multiply(centered, centered), axis=axes, keepdims=True), const(eps, x))))
    x_hat = ctx.emit(R.multiply(centered, r))
    scaled = R.multiply(output_grad, broadcast_weight(gamma, axes, x.ty.ndim))
    g = ctx.emit(scaled if bool(orig_call.attrs.scale) else output_grad)
    mean = lambda e: R.mean(e, axis=axes, keepdims=True)  # noqa: E731
    dx = R.multiply(r, R.subtract(R.subtract(g, mean(g)), R.multiply(x_hat, mean(R.multiply(g, x_hat)))))
    # gamma and beta always come as arguments; unused (scale / center off) they get zeros
    ndim = x.ty.ndim
    dgamma = (weight_sum(R.multiply(output_grad, x_hat), axes, ndim) if bool(orig_call.attrs.scale)
              else R.zeros_like(gamma))
    dbeta = weight_sum(output_grad, axes, ndim) if bool(orig_call.attrs.center) else R.zeros_like(beta)
    return [dx, dgamma, dbeta]


GRADIENTS = {
    "relax.nn.rms_norm": _rms_norm_gradient,
    "relax.nn.layer_norm": _layer_norm_gradient,
}
