"""Gradients of elementwise ops: rsqrt, erf, gelu (exact and tanh-approximate), dropout.

    relax.rsqrt           d rsqrt(x) = -rsqrt(x)^3 / 2
    relax.erf             d erf(x) = 2 / sqrt(pi) exp(-x^2)
    relax.nn.gelu         x Phi(x):          Phi(x) + x phi(x)                (exact, via erf)
    relax.nn.gelu_tanh    x (1 + tanh(u)) / 2, u = sqrt(2/pi) (x + 0.044715 x^3)
    relax.nn.dropout      outputs (y, mask) with y = x * mask (TVM's legalization: y = x, mask all
                          ones; a training legalization's mask holds the kept elements' 1 / (1 - rate)
                          and zeros): dx = dy * mask; the mask does not depend on x
"""

from __future__ import annotations

import math

from tvm import relax

from .common import const, tuple_adjoints

R = relax.op


def _rsqrt_gradient(orig_var, orig_call, output_grad, ctx):
    y = orig_var
    return [R.multiply(output_grad, R.multiply(const(-0.5, y), R.multiply(y, R.multiply(y, y))))]


def _erf_gradient(orig_var, orig_call, output_grad, ctx):
    x = orig_call.args[0]
    return [R.multiply(output_grad, R.multiply(const(2.0 / math.sqrt(math.pi), x),
                                               R.exp(R.negative(R.multiply(x, x)))))]


def _gelu_gradient(orig_var, orig_call, output_grad, ctx):
    x = orig_call.args[0]
    cdf = R.multiply(const(0.5, x), R.add(const(1.0, x), R.erf(R.multiply(x, const(1 / math.sqrt(2.0), x)))))
    pdf = R.multiply(const(1 / math.sqrt(2 * math.pi), x), R.exp(R.multiply(const(-0.5, x), R.multiply(x, x))))
    return [R.multiply(output_grad, R.add(cdf, R.multiply(x, pdf)))]


def _gelu_tanh_gradient(orig_var, orig_call, output_grad, ctx):
    x = orig_call.args[0]
    c, a = math.sqrt(2 / math.pi), 0.044715
    x2 = R.multiply(x, x)
    t = ctx.emit(R.tanh(R.multiply(const(c, x), R.add(x, R.multiply(const(a, x), R.multiply(x2, x))))))
    du = R.multiply(const(c, x), R.add(const(1.0, x), R.multiply(const(3 * a, x), x2)))
    sech2 = R.subtract(const(1.0, x), R.multiply(t, t))
    grad = R.add(R.multiply(const(0.5, x), R.add(const(1.0, x), t)),
                 R.multiply(R.multiply(const(0.5, x), x), R.multiply(sech2, du)))
    return [R.multiply(output_grad, grad)]


def _dropout_gradient(orig_var, orig_call, output_grad, ctx):
    dy, _ = tuple_adjoints(ctx, output_grad, 2)
    return [R.multiply(dy, relax.TupleGetItem(orig_var, 1))]


GRADIENTS = {
    "relax.rsqrt": _rsqrt_gradient,
    "relax.erf": _erf_gradient,
    "relax.nn.gelu": _gelu_gradient,
    "relax.nn.gelu_tanh": _gelu_tanh_gradient,
    "relax.nn.dropout": _dropout_gradient,
}
