"""Gradients of indexing ops: arange, repeat, strided_slice.

    relax.arange          reads no tensor (start, end and step are integers): no gradient flows
                          (an exported model's positions, RoPE's and a causal mask's indices)

    relax.repeat          each input element's repeats summed (a reshape, then a sum)
    relax.strided_slice   y = x[idx_1, ..., idx_k] on the sliced axes, idx = range(b, e, s) after
                          the forward's clamping (b, e += n if negative; then clamped to [0, n], or
                          to [-1, n - 1] for s < 0): dx = dy scattered back along each sliced axis,
                          zeros elsewhere: dx = take(concat(dy, 0), pos) with pos[i] = k where
                          idx_k = i, else the appended zero (a contiguous run: concat(0, dy, 0))
"""

from __future__ import annotations

import numpy as np
import tvm
from tvm import relax

R = relax.op


def _arange_gradient(orig_var, orig_call, output_grad, ctx):
    return [R.grad.no_grad(arg) for arg in orig_call.args]


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


def _static_ints(call: relax.Call, index: int, name: str) -> list[int]:
    """``strided_slice``'s argument ``index`` (axes, begin, end, strides) as Python ints."""
    arg = call.args[index]
    if not isinstance(arg, relax.Tuple) or not all(isinstance(f, tvm.tirx.IntImm) for f in arg.fields):
        raise ValueError(f"relax.strided_slice: {name} must be a tuple of static integers for the gradient, got {arg}")
    return [int(f.value) for f in arg.fields]


def _clamp(index: int, n: int, step: int) -> int:
    """topi's ``CanonicalizeIndex``: wrap a negative index once, then clamp to [0, n] (step > 0)
    or [-1, n - 1] (step < 0, where -1 is "past the front")."""
    index = index + n if index < 0 else index
    return min(max(index, -1 if step < 0 else 0), n - 1 if step < 0 else n)


def _slice_plan(call: relax.Call) -> list[tuple[int, int, list[int]]]:
    """(axis, n, the indices it reads) for each sliced axis of a ``strided_slice`` call, as the
    forward computes them; a ValueError for what the gradient cannot take (dynamic arguments or
    sizes, zero steps, an output shape the indices disagree with)."""
    x = call.args[0]
    ndim = x.ty.ndim
    axes, begin, end = (_static_ints(call, i, name) for i, name in ((1, "axes"), (2, "begin"), (3, "end")))
    steps = _static_ints(call, 4, "strides") if len(call.args) > 4 else [1] * len(axes)
    if x.ty.shape is None:
        raise ValueError(f"relax.strided_slice: data must have a known shape for the gradient, got {x.ty}")
    out_shape = call.ty.shape.values if isinstance(call.ty, relax.TensorType) and call.ty.shape is not None else None
    plan = []
    for axis, b, e, s in zip(axes, begin, end, steps):
        axis %= ndim
        n = x.ty.shape[axis]
        if not isinstance(n, tvm.tirx.IntImm):
            raise ValueError(f"relax.strided_slice: the sliced axis {axis} must have a static size for the "
                             f"gradient, got {n}")
        n = int(n)
        if s == 0:
            raise ValueError(f"relax.strided_slice: strides must be nonzero, got {steps}")
        indices = list(range(_clamp(b, n, s), _clamp(e, n, s), s))
        # With assume_inbound the output shape is inferred unclamped: out-of-range indices make it
        # disagree with what the forward computes (it always clamps static indices).
        got = out_shape[axis] if out_shape is not None else None
        if isinstance(got, tvm.tirx.IntImm) and int(got) != len(indices):
            hint = (f"with assume_inbound=True begin and end must lie in [0, {n}]" if call.attrs.assume_inbound
                    else "a reversed range")
            raise ValueError(f"relax.strided_slice: axis {axis} reads {len(indices)} elements "
                             f"(begin={b}, end={e}, stride={s}, size {n}) but the output shape says {int(got)}: "
                             f"{hint}")
        plan.append((axis, n, indices))
    return plan


def _scatter(g: relax.Expr, axis: int, n: int, indices: list[int], ctx) -> relax.Expr:
    """``g`` (len(indices) long on ``axis``) placed at ``indices`` of a zero tensor ``n`` long."""
    m = len(indices)
    if indices == list(range(n)):
        return g
    shape = list(g.ty.shape.values)
    dtype = str(g.ty.dtype)

    def zeros(size):
        return R.zeros(relax.ShapeExpr(shape[:axis] + [size] + shape[axis + 1:]), dtype)

    if m and indices == list(range(indices[0], indices[0] + m)):  # a contiguous run: zeros around it
        before, after = indices[0], n - indices[0] - m
        return ctx.emit(R.concat(([zeros(before)] if before else []) + [g] + ([zeros(after)] if after else []),
                                 axis=axis))
    # Any other pattern (steps, reversed): gather from dy with one zero appended; concat and
    # take both have gradients, so this differentiates again.
    position = np.full(n, m, dtype="int64")
    position[indices] = np.arange(m)
    padded = ctx.emit(R.concat([g, zeros(1)], axis=axis))
    # (the positions are in range: "clip" only spares the warning "fast" mode prints)
    return ctx.emit(R.take(padded, relax.const(position, "int64"), axis=axis, mode="clip"))


def _strided_slice_gradient(orig_var, orig_call, output_grad, ctx):
    """Scatter ``dy`` back one sliced axis at a time (the axes are independent)."""
    grad = output_grad
    for axis, n, indices in _slice_plan(orig_call):
        grad = _scatter(grad, axis, n, indices, ctx)
    # axes, begin, end (and strides) are static index tuples, not tensors: no gradient
    return [grad] + [R.grad.no_grad(arg) for arg in orig_call.args[1:]]


GRADIENTS = {
    "relax.arange": _arange_gradient,
    "relax.repeat": _repeat_gradient,
    "relax.strided_slice": _strided_slice_gradient,
}
