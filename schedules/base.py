"""The contract of a performance-path kernel rule (dlight's, applied to a Relax call).

A rule matches one fuel op on one kind of target and builds its hand-scheduled PrimFunc;
``apply`` returns None when the call is not its to handle (another rule, or the floor, then
serves it). Rules never raise on a mismatch.
"""

from __future__ import annotations

from typing import Sequence

import tvm
from tvm import relax, tirx


class KernelRule:
    """Base class: ``apply(call, target) -> PrimFunc | None`` for the op named ``op``."""

    op: str = ""
    target_kinds: Sequence[str] = ()
    needs_forward_state = False  # the kernel takes the forward's out and lse (backward kernels)

    def is_target_available(self, target: tvm.target.Target) -> bool:
        return target.kind.name in self.target_kinds

    def apply(self, call: relax.Call, target: tvm.target.Target) -> tirx.PrimFunc | None:
        raise NotImplementedError


def static_dims(expr: relax.Expr) -> list[int | None] | None:
    """The dims of a tensor argument, None for a symbolic one; None if the shape is unknown."""
    ty = expr.ty
    if not isinstance(ty, relax.TensorType) or ty.shape is None:
        return None
    return [int(d) if isinstance(d, tirx.IntImm) else None for d in ty.shape.values]
