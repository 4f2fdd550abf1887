"""Rules that put the CPU kernels in place of the floor for fuel calls on llvm targets.

Contents:
    FlashForward, FlashBackward, PagedAttention -- one rule per kernel pattern (dlight style)
"""

from __future__ import annotations

import tvm
from tvm import relax, tirx

from ...config import AttnConfig
from ...op import SPECS
from ..base import KernelRule, static_dims
from .backward import flash_backward
from .common import KernelSpec
from .forward import dense_forward, paged_forward
from .tiles import tiles_for


class _CpuRule(KernelRule):
    target_kinds = ("llvm",)


def _dense_spec(op: str, call: relax.Call, *, return_lse: bool = False) -> KernelSpec | None:
    """The spec of a dense attention call (forward or backward); None if a dim it needs is symbolic."""
    args = SPECS[op].split_args(call)
    q, k = static_dims(args["q"]), static_dims(args["k"])
    if q is None or k is None or None in (q[1], q[3], k[1]):
        return None  # heads and head dim must be static
    mask, mask_dtype, broadcast = args["attn_mask"], None, ()
    if mask is not None:
        dims = static_dims(mask)
        if dims is None:
            return None
        mask_dtype, broadcast = str(mask.ty.dtype), tuple(d == 1 for d in dims)
    return KernelSpec(
        dtype=str(args["q"].ty.dtype), num_q_heads=q[1], num_kv_heads=k[1], head_dim=q[3],
        cfg=AttnConfig.from_attrs(SPECS[op].label, call.attrs), has_alibi=args["alibi_slopes"] is not None,
        mask_dtype=mask_dtype, mask_broadcast=broadcast, return_lse=return_lse)


class FlashForward(_CpuRule):
    """flash_attn on llvm: tiled online softmax, K/V packed once per KV head."""

    op = "flash_attn"

    def apply(self, call: relax.Call, target: tvm.target.Target) -> tirx.PrimFunc | None:
        if not self.is_target_available(target):
            return None
        spec = _dense_spec(self.op, call, return_lse=bool(call.attrs["return_lse"]))
        if spec is None:
            return None
        sq = static_dims(call.args[0])[2]
        rows = sq * spec.group if sq is not None else None
        return dense_forward(spec, tiles_for(target, head_dim=spec.head_dim, rows=rows))


class FlashBackward(_CpuRule):
    """flash_attn_backward (and its single-gradient forms) on llvm: one pass over the key tiles.

    The kernel takes the forward's out and lse; where the call lacks them the forward kernel
    runs first (``needs_forward_state``).
    """

    needs_forward_state = True

    def __init__(self, op: str):
        self.op = op
        self.grads = SPECS[op].grads

    def apply(self, call: relax.Call, target: tvm.target.Target) -> tirx.PrimFunc | None:
        if not self.is_target_available(target):
            return None
        spec = _dense_spec(self.op, call)
        if spec is None:
            return None
        batch = static_dims(call.args[0])[0]
        cores = int(target.attrs.get("num-cores", 0) or 1)
        # enough (batch, kv head, split) tasks for every core twice over; one split when unknown
        splits = 1 if batch is None else max(1, -(-2 * cores // (batch * spec.num_kv_heads)))
        return flash_backward(spec, tiles_for(target, head_dim=spec.head_dim, rows=None), grads=self.grads,
                              splits=splits)


class PagedAttention(_CpuRule):
    """paged_attn on llvm: key tiles read through the block table, live blocks only."""

    op = "paged_attn"

    def apply(self, call: relax.Call, target: tvm.target.Target) -> tirx.PrimFunc | None:
        if not self.is_target_available(target):
            return None
        args = SPECS[self.op].split_args(call)
        q, cache = static_dims(args["q"]), static_dims(args["k_cache"])
        if q is None or cache is None or None in (q[1], q[3], cache[1], cache[2]):
            return None
        spec = KernelSpec(
            dtype=str(args["q"].ty.dtype), num_q_heads=q[1], num_kv_heads=cache[2], head_dim=q[3],
            cfg=AttnConfig.from_attrs(SPECS[self.op].label, call.attrs),
            has_alibi=args["alibi_slopes"] is not None, block_size=cache[1],
            table_dtype=str(args["block_table"].ty.dtype), lens_dtype=str(args["context_lens"].ty.dtype))
        rows = q[2] * spec.group if q[2] is not None else None
        tiles = tiles_for(target, head_dim=spec.head_dim, rows=rows, num_kv_heads=spec.num_kv_heads, batch=q[0])
        return paged_forward(spec, tiles)


RULES = (FlashForward(), PagedAttention(), *(FlashBackward(op) for op in (
    "flash_attn_backward", "flash_attn_backward_q", "flash_attn_backward_k", "flash_attn_backward_v")))
