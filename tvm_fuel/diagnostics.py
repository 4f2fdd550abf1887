"""The warnings tvm_fuel issues (its errors are ValueError / TypeError naming the op and the
argument). Imported by every layer, so it imports nothing of tvm_fuel.

Contents:
    TuningLogWarning -- a tuning log or record was skipped
    FloorWarning     -- a call a kernel serves in general is left to the floor (it does not fit)
"""


class TuningLogWarning(UserWarning):
    """A tuning log or record was skipped (unreadable, another target, or knobs that do not build)."""


class FloorWarning(UserWarning):
    """A call of an op that has a kernel on this target goes to the floor, because no tile shape
    of the kernel fits the target (e.g. a head dim whose tiles outgrow a block's shared memory)."""
