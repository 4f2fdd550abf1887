"""The contract of a performance-path kernel rule (dlight's, applied to a Relax call).

A rule matches one fuel op on one kind of target. ``workload`` says which kernel instance a call
needs (None when the call is not the rule's to handle: another rule, or the floor, then serves
it); ``kernel`` builds that instance from knobs (tile sizes, vector width, splits, ...);
``default_knobs`` are the hand-picked ones and ``knob_space`` the candidates MetaSchedule samples
(the hand-picked knobs are one point of it). Rules never raise on a mismatch.
"""

from __future__ import annotations

from typing import Mapping, Sequence

import tvm
from tvm import relax, tirx

from .workload import Workload

Knobs = Mapping[str, int]


class KernelRule:
    """Base class: ``apply(call, target) -> PrimFunc | None`` for the op named ``op``."""

    op: str = ""
    target_kinds: Sequence[str] = ()
    needs_forward_state = False  # the kernel takes the forward's out and lse (backward kernels)

    def is_target_available(self, target: tvm.target.Target) -> bool:
        return target.kind.name in self.target_kinds

    def workload(self, call: relax.Call, target: tvm.target.Target) -> Workload | None:
        """The kernel instance ``call`` needs on ``target``; None if this rule does not serve it."""
        raise NotImplementedError

    def default_knobs(self, workload: Workload, target: tvm.target.Target) -> dict[str, int]:
        """The hand-picked knobs (every knob the kernel reads)."""
        raise NotImplementedError

    def knob_space(self, workload: Workload, target: tvm.target.Target) -> dict[str, tuple[int, ...]]:
        """Candidates per tunable knob; each contains the hand-picked value."""
        raise NotImplementedError

    def check_knobs(self, workload: Workload, knobs: Knobs) -> str | None:
        """Why ``knobs`` cannot build this workload's kernel, or None when they can."""
        raise NotImplementedError

    def knobs(self, workload: Workload, target: tvm.target.Target, tuned: Knobs | None = None) -> dict[str, int]:
        """The hand-picked knobs with ``tuned`` values in place; ``tuned`` may only set knobs of this
        workload's space. ValueError (naming op and reason) when the result cannot build the kernel."""
        space = self.knob_space(workload, target)
        tuned = dict(tuned or {})
        foreign = sorted(set(tuned) - set(space))
        if foreign:
            raise ValueError(f"{self.op}: knobs {foreign} are not in this kernel's space {sorted(space)}")
        full = {**self.default_knobs(workload, target), **tuned}
        problem = self.check_knobs(workload, full)
        if problem:
            raise ValueError(f"{self.op}: {problem}")
        return full

    def kernel(self, workload: Workload, knobs: Knobs, *, static: bool = False) -> tirx.PrimFunc:
        """The PrimFunc for ``workload`` with ``knobs``; ``static`` fixes the runtime dims to
        the workload's (what tuning measures); otherwise they stay symbolic."""
        raise NotImplementedError

    def apply(self, call: relax.Call, target: tvm.target.Target) -> tirx.PrimFunc | None:
        """The kernel for ``call`` with the hand-picked knobs, or None."""
        workload = self.workload(call, target)
        return None if workload is None else self.kernel(workload, self.default_knobs(workload, target))


def static_dims(expr: relax.Expr) -> list[int | None] | None:
    """The dims of a tensor argument, None for a symbolic one; None if the shape is unknown."""
    ty = expr.ty
    if not isinstance(ty, relax.TensorType) or ty.shape is None:
        return None
    return [int(d) if isinstance(d, tirx.IntImm) else None for d in ty.shape.values]
