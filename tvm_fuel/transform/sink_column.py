"""gpt-oss's attention sinks as transformers writes them out, read back for ``FuseAttention``:
``softmax(concat([logits, broadcast(sinks)], -1) - rowmax)[..., :-1]``.

Contents:
    sinks_of_column -- the [H] float32 sinks a sink column broadcasts (None: no such column)
    is_row_max      -- whether an expression is the row max of a tensor (``max`` or ``topk`` k=1)
    drops_last      -- whether a ``strided_slice`` keeps all but the last entry of the last axis
"""

from __future__ import annotations

from typing import Callable

from tvm import relax

from ..op.config import FLOAT_DTYPES
from ..op.nn_attention import static_dims
from .common import int_dim, op_name

Bound = Callable[[relax.Expr], relax.Expr]  # an expression -> the value its variable is bound to


def sinks_of_column(column: relax.Expr, dims: tuple[int, int, int], bound: Bound) -> relax.Expr | None:
    """The sinks [H] (float32) of a sink ``column`` ([B, H, Sq, 1], or [B * H, Sq, 1] with B = 1)
    that is ``broadcast_to(sinks viewed as [.., H, 1, 1])``: one logit per head, the same for every
    batch row and query. None for any other column (one that may vary over batch or queries)."""
    b, h, sq = dims
    if static_dims(column) not in ([b, h, sq, 1], [b * h, sq, 1]) or (b != 1 and len(static_dims(column)) == 3):
        return None
    source = column
    if op_name(bound(column)) == "relax.broadcast_to":
        source = bound(column).args[0]
    shape = static_dims(source)
    if (len(shape) < 3 or shape[-3:] != [h, 1, 1] or any(d != 1 for d in shape[:-3])
            or str(source.ty.dtype) not in FLOAT_DTYPES):
        return None
    sinks = relax.op.reshape(source, [h])
    return sinks if str(source.ty.dtype) == "float32" else relax.op.astype(sinks, "float32")  # exact: f16, bf16


def is_row_max(shift: relax.Expr, tensor: relax.Expr, bound: Bound) -> bool:
    """Whether ``shift`` is the max over the last axis of ``tensor`` (the call it is bound to),
    kept as a dim of 1: ``max(.., axis=-1, keepdims=True)``, or the values of ``topk(.., k=1,
    axis=-1)`` (what TVM's importer makes of ``max(dim=-1)``), through the tuples it repacks."""
    value, index = bound(shift), None
    while isinstance(value, relax.TupleGetItem):
        packed = bound(value.tuple_value)
        if not isinstance(packed, relax.Tuple):
            value, index = packed, value.index
            break
        value = bound(packed.fields[value.index])
    name = op_name(value)
    if name not in ("relax.max", "relax.topk") or not bound(value.args[0]).same_as(tensor):
        return False
    rank, attrs = len(static_dims(tensor)), value.attrs
    if name == "relax.max":
        return (index is None and bool(attrs.keepdims) and attrs.axis is not None and len(attrs.axis) == 1
                and int(attrs.axis[0]) % rank == rank - 1)
    values = 0 if str(attrs.ret_type) == "both" else None  # "values": the tensor itself
    return (index == values and str(attrs.ret_type) in ("both", "values") and int(attrs.k) == 1
            and bool(attrs.largest) and int(attrs.axis) % rank == rank - 1)


def drops_last(call: relax.Call) -> bool:
    """Whether the ``strided_slice`` ``call`` keeps entries 0 .. n - 2 of its input's last axis (n
    entries) and all of the other axes."""
    if op_name(call) != "relax.strided_slice" or not all(isinstance(arg, relax.Tuple) for arg in call.args[1:]):
        return False
    ints = [[int_dim(getattr(e, "value", e)) for e in arg] for arg in call.args[1:]]
    axes, begin, end = ints[:3]
    strides = ints[3] if len(ints) > 3 else [1]
    n, rank = static_dims(call.args[0])[-1], len(static_dims(call.args[0]))
    return (n is not None and len(axes) == 1 and axes[0] is not None and axes[0] % rank == rank - 1
            and begin == [0] and end in ([-1], [n - 1]) and strides == [1])
