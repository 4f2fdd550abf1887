"""Gradients of the normalizations: rms_norm, layer_norm, group_norm, batch_norm.

    relax.nn.rms_norm     y = x r w, r = rsqrt(mean(x^2) + eps):
                          dx = r (g - x_hat mean(g x_hat)), g = dy w; dw = sum(dy x_hat)
    relax.nn.layer_norm   y = x_hat gamma + beta, x_hat = (x - mean) r:
                          dx = r (g - mean(g) - x_hat mean(g x_hat)), g = dy gamma;
                          dgamma = sum(dy x_hat), dbeta = sum(dy)

    relax.nn.group_norm   layer_norm's over each group's channels and ``axes`` (data viewed with the
                          channel axis split in (groups, channels / groups)); gamma, beta per channel.
                          TVM's forward applies gamma and beta whatever center / scale say: those
                          flags off are refused
    relax.nn.batch_norm   outputs (y, new moving mean, new moving var); statistics over every axis
                          but ``axis``. training: layer_norm's dx with batch mean mu and biased
                          variance var, plus m dmean_new / n + 2 m dvar_new (x - mu) / n;
                          dmoving = (1 - m) dmoving_new. Inference: y = (x - mm) rm gamma + beta,
                          rm = rsqrt(mv + eps): dx = dy gamma rm, dmm = -sum(dy gamma rm) + dmm_new,
                          dmv = -sum(dy gamma (x - mm)) rm^3 / 2 + dmv_new

At first order, rms_norm and layer_norm (with center and scale) over trailing axes call the fused
``fuel.rms_norm_backward`` / ``fuel.layer_norm_backward`` on the [N, C] view (C the normalized
axes flattened), their statistics computed here in float32 (float64 for float64 data); those
ops' own gradients (``FUSED_GRADIENTS``) are the VJPs of ``rms_norm_backward`` /
``layer_norm_backward`` below, the same math in primitives, so ``Gradient`` of an adjoint
differentiates the composition (second and higher order).

(``mean`` over the normalized axes; ``sum`` over every other axis, which leaves the weights'
shape: Relax requires the weights to be ``data.shape[axes]``.)
"""

from __future__ import annotations

import numpy as np
import tvm
from tvm import relax

from .. import op
from ..op.infer import norm_stats_dtype
from .common import broadcast_weight, composition_vjp, const, normalized_axes, tuple_adjoints, weight_sum

R = relax.op


def _rows(x: relax.Expr, axes: list[int]) -> tuple[list, list] | None:
    """(lead dims, normalized dims) of ``x`` where ``axes`` are its trailing ones, else None."""
    ndim = x.ty.ndim
    if axes != list(range(ndim - len(axes), ndim)) or len(axes) == ndim:
        return None
    shape = list(x.ty.shape.values)
    return shape[:ndim - len(axes)], shape[ndim - len(axes):]


def _product(dims: list):
    total = dims[0]
    for d in dims[1:]:
        total = total * d
    return total


def _fused_norm_gradient(ctx, x, weight, output_grad, eps: float, rows: tuple[list, list], center: bool):
    """The gradients of a norm over ``x``'s trailing axes from the fused op on its [N, C] view:
    [dx, dweight] (+ dbias where ``center``). Statistics in ``norm_stats_dtype``."""
    lead, features = rows
    view = [_product(lead), _product(features)]
    x2, dy2, w1 = R.reshape(x, view), R.reshape(output_grad, view), R.reshape(weight, view[1:])
    acc = norm_stats_dtype(str(x.ty.dtype))
    xa = ctx.emit(x2 if str(x.ty.dtype) == acc else R.astype(x2, acc))
    eps_c = relax.const(eps, acc)
    if center:
        mean = ctx.emit(R.mean(xa, axis=[1]))
        rstd = ctx.emit(R.rsqrt(R.add(R.variance(xa, axis=[1]), eps_c)))
        grads = ctx.emit(op.layer_norm_backward(dy2, x2, w1, mean, rstd))
    else:
        rstd = ctx.emit(R.rsqrt(R.add(R.mean(R.multiply(xa, xa), axis=[1]), eps_c)))
        grads = ctx.emit(op.rms_norm_backward(dy2, x2, w1, rstd))
    shapes = [list(x.ty.shape.values)] + [list(weight.ty.shape.values)] * (2 if center else 1)
    return [R.reshape(relax.TupleGetItem(grads, i), shape) for i, shape in enumerate(shapes)]


def _rms_norm_gradient(orig_var, orig_call, output_grad, ctx):
    x, weight = orig_call.args
    axes, eps = normalized_axes(orig_call), float(orig_call.attrs.epsilon)
    rows = _rows(x, axes)
    if rows is not None:
        return _fused_norm_gradient(ctx, x, weight, output_grad, eps, rows, center=False)
    r = ctx.emit(R.rsqrt(R.add(R.mean(R.multiply(x, x), axis=axes, keepdims=True), const(eps, x))))
    x_hat = ctx.emit(R.multiply(x, r))
    g = ctx.emit(R.multiply(output_grad, broadcast_weight(weight, axes, x.ty.ndim)))
    dx = R.multiply(r, R.subtract(g, R.multiply(x_hat, R.mean(R.multiply(g, x_hat), axis=axes, keepdims=True))))
    return [dx, weight_sum(R.multiply(output_grad, x_hat), axes, x.ty.ndim)]


def _layer_norm_gradient(orig_var, orig_call, output_grad, ctx):
    x, gamma, beta = orig_call.args
    axes, eps = normalized_axes(orig_call), float(orig_call.attrs.epsilon)
    rows = _rows(x, axes)
    if rows is not None and bool(orig_call.attrs.scale) and bool(orig_call.attrs.center):
        return _fused_norm_gradient(ctx, x, gamma, output_grad, eps, rows, center=True)
    centered = ctx.emit(R.subtract(x, R.mean(x, axis=axes, keepdims=True)))
    r = ctx.emit(R.rsqrt(R.add(R.mean(R.multiply(centered, centered), axis=axes, keepdims=True), const(eps, x))))
    x_hat = ctx.emit(R.multiply(centered, r))
    scaled = R.multiply(output_grad, broadcast_weight(gamma, axes, x.ty.ndim))
    g = ctx.emit(scaled if bool(orig_call.attrs.scale) else output_grad)
    dx = _normalize_backward(g, x_hat, r, axes)
    # gamma and beta always come as arguments; unused (scale / center off) they get zeros
    ndim = x.ty.ndim
    dgamma = (weight_sum(R.multiply(output_grad, x_hat), axes, ndim) if bool(orig_call.attrs.scale)
              else R.zeros_like(gamma))
    dbeta = weight_sum(output_grad, axes, ndim) if bool(orig_call.attrs.center) else R.zeros_like(beta)
    return [dx, dgamma, dbeta]


def _normalize_backward(g, x_hat, r, axes):
    """dx of x_hat = (x - mean(x)) r over ``axes`` given g = dL/dx_hat: r (g - mean(g) - x_hat mean(g x_hat))."""
    mean = lambda e: R.mean(e, axis=axes, keepdims=True)  # noqa: E731
    return R.multiply(r, R.subtract(R.subtract(g, mean(g)), R.multiply(x_hat, mean(R.multiply(g, x_hat)))))


def _group_norm_gradient(orig_var, orig_call, output_grad, ctx):
    x, gamma, beta = orig_call.args
    attrs = orig_call.attrs
    if not (bool(attrs.center) and bool(attrs.scale)):
        raise ValueError("relax.nn.group_norm: no gradient with center=False or scale=False: TVM's forward "
                         "applies gamma and beta regardless (pass ones / zeros instead)")
    ndim, groups = x.ty.ndim, int(attrs.num_groups)
    channel = int(attrs.channel_axis) % ndim
    shape = list(x.ty.shape.values)
    # the channel axis split in (groups, channels per group): axes after it move one up
    split = shape[:channel] + [groups, shape[channel] // groups] + shape[channel + 1:]
    moved = lambda a: a + 1 if a > channel else a  # noqa: E731
    axes = sorted([channel + 1] + [moved(int(a) % ndim) for a in attrs.axes])
    eps = float(attrs.epsilon)
    xs, dys = R.reshape(x, split), R.reshape(output_grad, split)
    centered = ctx.emit(R.subtract(xs, R.mean(xs, axis=axes, keepdims=True)))
    r = ctx.emit(R.rsqrt(R.add(R.mean(R.multiply(centered, centered), axis=axes, keepdims=True), const(eps, x))))
    x_hat = ctx.emit(R.multiply(centered, r))
    per_channel = [channel, channel + 1]  # gamma viewed as (groups, channels per group) on those axes
    weight = lambda w: broadcast_weight(R.reshape(w, split[channel:channel + 2]), per_channel, ndim + 1)  # noqa: E731
    dx = R.reshape(_normalize_backward(ctx.emit(R.multiply(dys, weight(gamma))), x_hat, r, axes), shape)
    to_channels = lambda e: R.reshape(weight_sum(e, per_channel, ndim + 1), [shape[channel]])  # noqa: E731
    return [dx, to_channels(R.multiply(dys, x_hat)), to_channels(dys)]


def _batch_norm_gradient(orig_var, orig_call, output_grad, ctx):
    x, gamma, beta, moving_mean, moving_var = orig_call.args
    attrs = orig_call.attrs
    ndim, axis = x.ty.ndim, int(attrs.axis) % x.ty.ndim
    eps, momentum = float(attrs.epsilon), float(attrs.momentum)
    dy, dmean_new, dvar_new = tuple_adjoints(ctx, output_grad, 3)
    others = [a for a in range(ndim) if a != axis]
    channel = lambda w: broadcast_weight(w, [axis], ndim)  # noqa: E731
    to_channel = lambda e: weight_sum(e, [axis], ndim)  # noqa: E731
    g = ctx.emit(R.multiply(dy, channel(gamma)) if bool(attrs.scale) else dy)
    dbeta = to_channel(dy) if bool(attrs.center) else R.zeros_like(beta)
    if bool(attrs.training):
        dims = [x.ty.shape.values[a] for a in others]
        if all(isinstance(d, tvm.tirx.IntImm) for d in dims):
            count = const(float(np.prod([int(d) for d in dims])), x)
        else:  # symbolic: the element count as a tensor
            count = R.sum(R.ones_like(x), axis=others, keepdims=True)
        centered = ctx.emit(R.subtract(x, R.mean(x, axis=others, keepdims=True)))
        r = ctx.emit(R.rsqrt(R.add(R.mean(R.multiply(centered, centered), axis=others, keepdims=True), const(eps, x))))
        x_hat = ctx.emit(R.multiply(centered, r))
        # the moving statistics' update: m * mean and m * biased variance of the batch
        stats = R.add(channel(dmean_new),
                      R.multiply(R.multiply(const(2.0, x), channel(dvar_new)), centered))
        dx = R.add(_normalize_backward(g, x_hat, r, others),
                   R.divide(R.multiply(const(momentum, x), stats), count))
        dgamma = to_channel(R.multiply(dy, x_hat)) if bool(attrs.scale) else R.zeros_like(gamma)
        keep = const(1.0 - momentum, x)
        return [dx, dgamma, dbeta, R.multiply(keep, dmean_new), R.multiply(keep, dvar_new)]
    r = ctx.emit(R.rsqrt(R.add(moving_var, const(eps, x))))
    centered = ctx.emit(R.subtract(x, channel(moving_mean)))
    gr = ctx.emit(R.multiply(g, channel(r)))
    dgamma = to_channel(R.multiply(dy, R.multiply(centered, channel(r)))) if bool(attrs.scale) else R.zeros_like(gamma)
    dmoving_mean = R.add(R.negative(to_channel(gr)), dmean_new)
    r3 = R.multiply(r, R.multiply(r, r))
    dmoving_var = R.add(R.multiply(R.multiply(to_channel(R.multiply(g, centered)), r3), const(-0.5, x)), dvar_new)
    return [gr, dgamma, dbeta, dmoving_mean, dmoving_var]


GRADIENTS = {
    "relax.nn.rms_norm": _rms_norm_gradient,
    "relax.nn.layer_norm": _layer_norm_gradient,
    "relax.nn.group_norm": _group_norm_gradient,
    "relax.nn.batch_norm": _batch_norm_gradient,
}


def layer_norm_backward(dy, x, gamma, mean, rstd) -> list[relax.Expr]:
    """``fuel.layer_norm_backward``'s math in Relax primitives (its higher-order path): [dx,
    dgamma, dbeta] of [N, C] data, in the statistics' dtype, cast back to x's."""
    return _norm_backward_composition(dy, x, gamma, mean, rstd)


def rms_norm_backward(dy, x, weight, rstd) -> list[relax.Expr]:
    """``fuel.rms_norm_backward``'s math in Relax primitives: [dx, dweight]."""
    return _norm_backward_composition(dy, x, weight, None, rstd)


def _norm_backward_composition(dy, x, weight, mean, rstd):
    dtype, acc = str(x.ty.dtype), str(rstd.ty.dtype)
    widen = (lambda e: e) if dtype == acc else (lambda e: R.astype(e, acc))
    narrow = (lambda e: e) if dtype == acc else (lambda e: R.astype(e, dtype))
    dya, xa = widen(dy), widen(x)
    r = R.expand_dims(rstd, [1])
    x_hat = R.multiply(xa if mean is None else R.subtract(xa, R.expand_dims(mean, [1])), r)
    g = R.multiply(dya, widen(weight))
    row_mean = lambda e: R.mean(e, axis=[1], keepdims=True)  # noqa: E731
    centered = g if mean is None else R.subtract(g, row_mean(g))
    dx = R.multiply(r, R.subtract(centered, R.multiply(x_hat, row_mean(R.multiply(g, x_hat)))))
    grads = [narrow(dx), narrow(R.sum(R.multiply(dya, x_hat), axis=[0]))]
    return grads + ([] if mean is None else [narrow(R.sum(dya, axis=[0]))])


def _fused_gradient(composition, count: int):
    def gradient(orig_var, orig_call, output_grad, ctx):
        return composition_vjp(ctx, composition, list(orig_call.args), tuple_adjoints(ctx, output_grad, count))

    return gradient


# the fused ops' gradients (registered with the fuel ops, ``tvm_fuel.autodiff.fuel_ops``)
FUSED_GRADIENTS = {
    "layer_norm_backward": _fused_gradient(layer_norm_backward, 3),
    "rms_norm_backward": _fused_gradient(rms_norm_backward, 2),
}
