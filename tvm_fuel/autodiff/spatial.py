"""Gradients of spatial ops: conv2d_transpose, adaptive_avg_pool2d.

In the canonical layouts (x: N C H W, w: C O/g kh kw, i.e. NCHW / IOHW), with strides s,
padding (pt, pl, pb, pr), output_padding op, dilation d, groups g, channel c in group g(c):

    relax.nn.conv2d_transpose    y[n, g(c) O/g + o, s i - pt + d a, ...] += x[n, c, i, ...] w[c, o, a, ...]
                                 dx = conv2d(dy, w; s, p, d, g)       (w read as OIHW: O = C)
                                 dw[c, o, a, b] = sum_{n,i,j} x[n, c, i, j]
                                                   dy[n, g(c) O/g + o, s i - pt + d a, s j - pl + d b]
                                    = conv2d(dy as (O/g, g N, Ho, Wo), x as (C, N, H, W);
                                             strides d, dilation s, groups g), cropped to kh x kw
    relax.nn.adaptive_avg_pool2d y = Ph x Pw^T per (n, c), Ph[i, h] = 1 / |bin_i| on
                                 bin_i = [floor(i H / oh), ceil((i + 1) H / oh)) (as topi bins):
                                 dx = Ph^T dy Pw

Other layouts are permuted to these and back. Every conv2d emitted has dilation 1 (a dilation is
materialized by inserting zeros): TVM's conv2d gradient sizes its conv2d_transpose ignoring
dilation, so a dilated conv2d here would break the second derivative.
"""

from __future__ import annotations

import numpy as np
import tvm
from tvm import relax

R = relax.op

_CONV_T = "relax.nn.conv2d_transpose"
_POOL = "relax.nn.adaptive_avg_pool2d"


def _static_shape(expr: relax.Expr, op: str, name: str) -> list[int]:
    shape = expr.ty.shape
    if shape is None or not all(isinstance(d, tvm.tirx.IntImm) for d in shape.values):
        raise ValueError(f"{op}: {name} must have a static shape for the gradient, got {expr.ty}")
    return [int(d) for d in shape.values]


def _check_layout(layout: str, canonical: str, op: str, name: str) -> str:
    layout = str(layout)
    if len(layout) != len(canonical) or sorted(layout) != sorted(canonical):
        raise ValueError(f"{op}: {name} must be a permutation of {canonical} for the gradient "
                         f"(packed layouts are not supported), got {layout!r}")
    return layout


def _permute(t: relax.Expr, source: str, target: str, ctx=None) -> relax.Expr:
    """``t`` (dims named by ``source``) with its dims in ``target``'s order (emitted into ``ctx``
    if given)."""
    if source == target:
        return t
    permuted = R.permute_dims(t, [source.index(c) for c in target])
    return ctx.emit(permuted) if ctx is not None else permuted


def _dilate(t: relax.Expr, axis: int, factor: int, ctx) -> relax.Expr:
    """``factor - 1`` zeros between consecutive elements along ``axis``: n -> (n - 1) factor + 1.
    Built from expand_dims, concat, reshape and strided_slice, which all have gradients (and
    no arithmetic: exact)."""
    shape = list(t.ty.shape.values)
    n = int(shape[axis])
    if factor == 1 or n == 1:
        return t
    zeros = R.zeros(relax.ShapeExpr(shape[:axis + 1] + [factor - 1] + shape[axis + 1:]), str(t.ty.dtype))
    spread = R.concat([R.expand_dims(t, axis + 1), zeros], axis=axis + 1)  # (.., n, factor, ..)
    flat = ctx.emit(R.reshape(spread, shape[:axis] + [n * factor] + shape[axis + 1:]))
    return ctx.emit(R.strided_slice(flat, [axis], [0], [(n - 1) * factor + 1]))


def _conv2d_transpose_gradient(orig_var, orig_call, output_grad, ctx):
    """The data gradient is conv2d, the adjoint of conv2d_transpose; the weight gradient is
    conv2d's weight gradient with dy and x in its data and output-gradient roles."""
    op, attrs = _CONV_T, orig_call.attrs
    x, w = orig_call.args
    data_layout = _check_layout(attrs.data_layout, "NCHW", op, "data_layout")
    kernel_layout = _check_layout(attrs.kernel_layout, "IOHW", op, "kernel_layout")
    out_layout = _check_layout(attrs.out_layout, "NCHW", op, "out_layout")
    dtype = str(x.ty.dtype)
    if str(w.ty.dtype) != dtype:
        raise ValueError(f"{op}: data and weight must have one dtype for the gradient, got {dtype} and {w.ty.dtype}")
    if attrs.out_dtype is not None and str(attrs.out_dtype) not in ("", "void", dtype):
        raise ValueError(f"{op}: out_dtype must be the data's dtype ({dtype}) for the gradient, got {attrs.out_dtype}")
    sh, sw = (int(v) for v in attrs.strides)
    dh, dw_ = (int(v) for v in attrs.dilation)
    pt, pl, pb, pr = (int(v) for v in attrs.padding)
    oph, opw = (int(v) for v in attrs.output_padding)
    groups = int(attrs.groups)
    _static_shape(x, op, "data")
    _static_shape(w, op, "weight")

    xc = _permute(x, data_layout, "NCHW", ctx)
    wc = _permute(w, kernel_layout, "IOHW", ctx)  # (C, O/g, kh, kw)
    dy = _permute(output_grad, out_layout, "NCHW", ctx)  # (N, O, Ho, Wo)
    n = int(xc.ty.shape[0])
    _, o, ho, wo = (int(v) for v in dy.ty.shape.values)
    kh, kw = (int(v) for v in wc.ty.shape.values[2:])
    og = o // groups

    # dx: conv2d of dy with w as an OIHW kernel (O = C); output_padding < strides, so its
    # floor((Ho + pt + pb - d (kh - 1) - 1) / s) + 1 is exactly H
    w_dilated = _dilate(_dilate(wc, 2, dh, ctx), 3, dw_, ctx)
    dx = ctx.emit(R.nn.conv2d(dy, w_dilated, strides=(sh, sw), padding=(pt, pl, pb, pr), groups=groups,
                              data_layout="NCHW", kernel_layout="OIHW", out_dtype=dtype))

    # dw: dy regrouped as data (batch O/g, channels g * N: group k's channels are its N images),
    # x as the kernel (C, N, H, W) dilated by the strides; the conv's strides are the dilation.
    # Bottom/right padding pb - op covers every dy row read and gives exactly kh rows; when
    # op > pb no padding is needed and the extra rows are cropped.
    data = R.reshape(R.permute_dims(R.reshape(dy, [n, groups, og, ho, wo]), [2, 1, 0, 3, 4]), [og, groups * n, ho, wo])
    kernel = _dilate(_dilate(ctx.emit(R.permute_dims(xc, [1, 0, 2, 3])), 2, sh, ctx), 3, sw, ctx)
    dwc = ctx.emit(R.nn.conv2d(ctx.emit(data), kernel, strides=(dh, dw_),
                               padding=(pt, pl, max(pb - oph, 0), max(pr - opw, 0)), groups=groups,
                               data_layout="NCHW", kernel_layout="OIHW", out_dtype=dtype))  # (O/g, C, >=kh, >=kw)
    if tuple(int(v) for v in dwc.ty.shape.values[2:]) != (kh, kw):
        dwc = ctx.emit(R.strided_slice(dwc, [2, 3], [0, 0], [kh, kw]))
    dwc = ctx.emit(R.permute_dims(dwc, [1, 0, 2, 3]))  # (C, O/g, kh, kw): IOHW
    return [_permute(dx, "NCHW", data_layout), _permute(dwc, "IOHW", kernel_layout)]


def _bins(size: int, out: int) -> np.ndarray:
    """(out, size) averaging matrix of topi's adaptive pooling: row i is 1 / |bin| on
    [floor(i size / out), ceil((i + 1) size / out))."""
    matrix = np.zeros((out, size))
    for i in range(out):
        start, end = (i * size) // out, -((-(i + 1) * size) // out)
        matrix[i, start:end] = 1.0 / (end - start)
    return matrix


def _adaptive_avg_pool2d_gradient(orig_var, orig_call, output_grad, ctx):
    """Pooling is separable, y = Ph x Pw^T over the spatial dims, so dx = Ph^T dy Pw: two matmuls
    with constant matrices (matmul has a gradient; N and C broadcast and may be symbolic)."""
    op, attrs = _POOL, orig_call.attrs
    x = orig_call.args[0]
    layout = _check_layout(attrs.layout, "NCHW", op, "layout")
    out_layout = _check_layout(attrs.out_layout, "NCHW", op, "out_layout")
    shape = x.ty.shape
    spatial = [shape[layout.index(a)] for a in "HW"] if shape is not None else None
    if spatial is None or not all(isinstance(d, tvm.tirx.IntImm) for d in spatial):
        raise ValueError(f"{op}: the data's H and W must be static for the gradient, got {x.ty}")
    h, w = (int(d) for d in spatial)
    oh, ow = (h, w) if attrs.output_size is None else (int(v) for v in attrs.output_size)
    dtype = str(x.ty.dtype)
    dy = _permute(output_grad, out_layout, "NCHW")  # (N, C, oh, ow)
    ph_t = relax.const(_bins(h, oh).T.astype(dtype), dtype)  # (H, oh)
    pw = relax.const(_bins(w, ow).astype(dtype), dtype)  # (ow, W)
    dx = ctx.emit(R.matmul(ctx.emit(R.matmul(ph_t, dy)), pw))  # (N, C, H, W)
    return [_permute(dx, "NCHW", layout)]


GRADIENTS = {
    _CONV_T: _conv2d_transpose_gradient,
    _POOL: _adaptive_avg_pool2d_gradient,
}
