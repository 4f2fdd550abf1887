"""Rules that put the CPU kernels in place of the floor for fuel calls on llvm targets.

Contents:
    FlashForward, PagedAttention -- one rule per kernel pattern (dlight style)
"""

from __future__ import annotations

import tvm
from tvm import relax, tirx

from ...config import AttnConfig
from ...op import SPECS
from ..base import KernelRule, static_dims
from .common import KernelSpec
from .forward import dense_forward, paged_forward
from .tiles import tiles_for


class _CpuRule(KernelRule):
    target_kinds = ("llvm",)


class FlashForward(_CpuRule):
    """flash_attn on llvm: tiled online softmax, K/V packed once per KV head."""

    op = "flash_attn"

    def apply(self, call: relax.Call, target: tvm.target.Target) -> tirx.PrimFunc | None:
        if not self.is_target_available(target):
            return None
        args = SPECS[self.op].split_args(call)
        q, k = static_dims(args["q"]), static_dims(args["k"])
        if q is None or k is None or None in (q[1], q[3], k[1]):
            return None  # heads and head dim must be static
        spec = KernelSpec(
            dtype=str(args["q"].ty.dtype), num_q_heads=q[1], num_kv_heads=k[1], head_dim=q[3],
            cfg=AttnConfig.from_attrs(SPECS[self.op].label, call.attrs),
            has_alibi=args["alibi_slopes"] is not None, return_lse=bool(call.attrs["return_lse"]))
        mask = args["attn_mask"]
        if mask is not None:
            dims = static_dims(mask)
            if dims is None:
                return None
            spec = KernelSpec(**{**spec.__dict__, "mask_dtype": str(mask.ty.dtype),
                                  "mask_broadcast": tuple(d == 1 for d in dims)})
        rows = q[2] * spec.group if q[2] is not None else None
        return dense_forward(spec, tiles_for(target, head_dim=spec.head_dim, rows=rows))


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


RULES = (FlashForward(), PagedAttention())
