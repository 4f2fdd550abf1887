"""The warnings tvm_fuel issues (its errors are ValueError / TypeError naming the op and the
argument). Imported by every layer, so it imports nothing of tvm_fuel.

Contents:
    TuningLogWarning -- a tuning log or record was skipped
"""


class TuningLogWarning(UserWarning):
    """A tuning log or record was skipped (unreadable, another target, or knobs that do not build)."""
