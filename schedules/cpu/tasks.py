"""The task skeletons the CPU kernels share, as TVMScript macros.

Contents:
    sum_split_partials -- a gradient from the per-split partials of the key-split tasks (no races)
"""

from __future__ import annotations

from tvm.script import tirx as T

from ..common import F32


@T.macro
def sum_split_partials(part, out, B, Hq, Sq, D, splits, dtype):
    # out[b, h, i, d] = sum over the splits c of part[c, b, h, i, d], in split order (deterministic):
    # the key-split tasks (the backward's dq, the double backward's q_grad) each write their own
    # partial, so no two tasks add into one row
    for bh in T.parallel(B * Hq):
        for i, d in T.grid(Sq, D):
            total = T.alloc_buffer((1,), F32, scope="local")
            total[0] = T.float32(0)
            for c in range(splits):
                total[0] = total[0] + part[c, bh // Hq, bh % Hq, i, d]
            out[bh // Hq, bh % Hq, i, d] = total[0].astype(dtype)
