"""Rules that put the CPU kernels in place of the floor for fuel calls on llvm targets.

Contents:
    FlashForward, FlashBackward, PagedAttention -- one rule per kernel pattern (dlight style)
"""

from __future__ import annotations

from dataclasses import asdict, replace

import tvm
from tvm import relax, tirx

from ...op import SPECS
from ..base import KernelRule, Knobs, dense_workload, paged_workload
from ..workload import Workload
from .backward import flash_backward
from .forward import dense_forward, paged_forward
from .tiles import STREAMING_ROWS, CpuTiles, cores, streaming_space, tile_space, tiles_for


def _rows(workload: Workload) -> int | None:
    """Static query rows of one KV head's tasks (positions x heads of the group)."""
    sq = workload.dim["Sq"]
    return None if sq is None else sq * workload.spec.group


class _CpuRule(KernelRule):
    target_kinds = ("llvm",)

    def check_knobs(self, workload: Workload, knobs: Knobs) -> str | None:
        try:
            tiles = CpuTiles(**knobs)
        except (TypeError, ValueError) as err:
            return str(err)
        if tiles.lanes & (tiles.lanes - 1):
            return f"lanes {tiles.lanes} is not a power of two"
        if workload.spec.num_kv_heads % tiles.kv_heads:
            return f"kv_heads {tiles.kv_heads} does not divide the {workload.spec.num_kv_heads} KV heads"
        return None


class _DenseRule(_CpuRule):
    """Shared by the dense kernels: workload from the call's q and k, register-tiled space."""

    def _dense_workload(self, call: relax.Call, target: tvm.target.Target, **extra) -> Workload | None:
        if not self.is_target_available(target):
            return None
        return dense_workload(self.op, call, return_lse=bool(call.attrs.get("return_lse", False)), **extra)

    def knob_space(self, workload: Workload, target: tvm.target.Target) -> dict[str, tuple[int, ...]]:
        return tile_space(target, rows=_rows(workload))


class FlashForward(_DenseRule):
    """flash_attn on llvm: tiled online softmax, K/V packed once per KV head."""

    op = "flash_attn"

    def workload(self, call: relax.Call, target: tvm.target.Target) -> Workload | None:
        return self._dense_workload(call, target)

    def default_knobs(self, workload: Workload, target: tvm.target.Target) -> dict[str, int]:
        return asdict(tiles_for(target, head_dim=workload.spec.head_dim, rows=_rows(workload)))

    def kernel(self, workload: Workload, knobs: Knobs, *, static: bool = False) -> tirx.PrimFunc:
        return dense_forward(workload.spec, CpuTiles(**knobs), dims=workload.dim if static else None)


class FlashBackward(_DenseRule):
    """flash_attn_backward (and its single-gradient forms) on llvm: one pass over the key tiles.

    The kernel takes the forward's out and lse; where the call lacks them the forward kernel
    runs first (``needs_forward_state``).
    """

    needs_forward_state = True

    def __init__(self, op: str):
        self.op = op

    def workload(self, call: relax.Call, target: tvm.target.Target) -> Workload | None:
        return self._dense_workload(call, target, grads=SPECS[self.op].grads)

    def default_knobs(self, workload: Workload, target: tvm.target.Target) -> dict[str, int]:
        batch = workload.dim["B"]
        # enough (batch, kv head, split) tasks for every core twice over; one split when unknown
        splits = 1 if batch is None else max(1, -(-2 * cores(target) // (batch * workload.spec.num_kv_heads)))
        return asdict(replace(tiles_for(target, head_dim=workload.spec.head_dim, rows=None), splits=splits))

    def knob_space(self, workload: Workload, target: tvm.target.Target) -> dict[str, tuple[int, ...]]:
        space = tile_space(target, rows=None)
        sk = workload.dim["Sk"]
        most = 16 if sk is None else max(1, -(-sk // 32))  # no more splits than key tiles
        return {**space, "splits": tuple(n for n in (1, 2, 4, 8, 16) if n <= most)}

    def kernel(self, workload: Workload, knobs: Knobs, *, static: bool = False) -> tirx.PrimFunc:
        return flash_backward(workload.spec, CpuTiles(**knobs), grads=workload.grads,
                              dims=workload.dim if static else None)


class PagedAttention(_CpuRule):
    """paged_attn on llvm: key tiles read through the block table, live blocks only."""

    op = "paged_attn"

    def workload(self, call: relax.Call, target: tvm.target.Target) -> Workload | None:
        if not self.is_target_available(target):
            return None
        return paged_workload(call)

    def default_knobs(self, workload: Workload, target: tvm.target.Target) -> dict[str, int]:
        spec = workload.spec
        return asdict(tiles_for(target, head_dim=spec.head_dim, rows=_rows(workload),
                                num_kv_heads=spec.num_kv_heads, batch=workload.dim["B"],
                                element_bytes=tvm.DataType(spec.dtype).bits // 8))

    def knob_space(self, workload: Workload, target: tvm.target.Target) -> dict[str, tuple[int, ...]]:
        rows = _rows(workload)
        if rows is not None and rows <= STREAMING_ROWS:
            return streaming_space(target, num_kv_heads=workload.spec.num_kv_heads)
        return tile_space(target, rows=rows)

    def kernel(self, workload: Workload, knobs: Knobs, *, static: bool = False) -> tirx.PrimFunc:
        return paged_forward(workload.spec, CpuTiles(**knobs), dims=workload.dim if static else None)


RULES = (FlashForward(), PagedAttention(), *(FlashBackward(op) for op in (
    "flash_attn_backward", "flash_attn_backward_q", "flash_attn_backward_k", "flash_attn_backward_v")))
