"""Gradients of indexing ops: repeat.

    relax.repeat          each input element's repeats summed (a reshape, then a sum)
"""

from __future__ import annotations

import tvm
from tvm import relax

R = relax.op


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


GRADIENTS = {
    "relax.repeat": _repeat_gradient,
}
