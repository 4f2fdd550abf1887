"""The contract of a performance-path kernel rule (dlight's, applied to a fuel call's ``Workload``).

A rule matches one fuel op on one kind of target. ``serves`` says whether it builds a workload
(``tvm_fuel.dispatch`` reads the workload from the call; a rule that declines leaves the call to
another rule, or the floor); ``kernel`` builds that instance from knobs (tile sizes, vector width,
splits, ...); ``default_knobs`` are the hand-picked ones and ``knob_space`` the candidates
MetaSchedule samples (the hand-picked knobs are one point of it). Rules never raise on a mismatch.
Nothing here reads Relax: a rule sees workloads and targets only.
"""

from __future__ import annotations

from typing import Mapping, Sequence

import tvm
from tvm import tirx

from .workload import Workload

Knobs = Mapping[str, int]


class KernelRule:
    """Base class: ``apply(workload, target) -> PrimFunc | None`` for the op named ``op``."""

    op: str = ""
    target_kinds: Sequence[str] = ()
    needs_forward_state = False  # the kernel takes the forward's out and lse (backward kernels)
    tunable = True  # MetaSchedule tunes its knobs (``tvm_fuel.tune``); else hand-picked only

    def is_target_available(self, target: tvm.target.Target) -> bool:
        return target.kind.name in self.target_kinds

    def serves(self, workload: Workload, target: tvm.target.Target) -> bool:
        """Whether this rule builds ``workload``'s kernel on ``target`` (else another rule or the floor
        serves the call)."""
        return workload.op == self.op and self.is_target_available(target)

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
        workload's space, each to one of its candidates or its hand-picked value (the points the
        tuner samples). ValueError (naming op and reason) when the result cannot build the kernel."""
        space = self.knob_space(workload, target)
        tuned = dict(tuned or {})
        foreign = sorted(set(tuned) - set(space))
        if foreign:
            raise ValueError(f"{self.op}: knobs {foreign} are not in this kernel's space {sorted(space)}")
        defaults = self.default_knobs(workload, target)
        for name, value in tuned.items():
            # a value the space does not offer may build, but may also fail to compile or compile for
            # minutes (value_tokens 1000: 81 s): a record is trusted no further than the tuner's own points
            allowed = sorted({*space[name], defaults[name]})
            if isinstance(value, bool) or not isinstance(value, int) or value not in allowed:
                raise ValueError(f"{self.op}: knob {name} = {value!r} is not one of its candidates {allowed}")
        full = {**defaults, **tuned}
        problem = self.check_knobs(workload, full)
        if problem:
            raise ValueError(f"{self.op}: {problem}")
        return full

    def kernel(self, workload: Workload, knobs: Knobs, *, static: bool = False) -> tirx.PrimFunc:
        """The PrimFunc for ``workload`` with ``knobs``; ``static`` fixes the runtime dims to
        the workload's (what tuning measures); otherwise they stay symbolic."""
        raise NotImplementedError

    def apply(self, workload: Workload, target: tvm.target.Target) -> tirx.PrimFunc | None:
        """The kernel for ``workload`` with the hand-picked knobs, or None where the rule declines."""
        if not self.serves(workload, target):
            return None
        return self.kernel(workload, self.default_knobs(workload, target))
