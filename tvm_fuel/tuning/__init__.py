"""MetaSchedule auto-tuning of the fuel kernels (the records it writes are read at every build by
``tvm_fuel.dispatch.records``; ``TuningRecords``, ``shipped_logs``, ``target_key`` re-exported).

Contents:
    space    -- kernels as design spaces (sampled knobs, mutator, features, validity check)
    measure  -- the lean builder and the valid-argument runners (local, RPC)
    kernels  -- ``tune``: the kernels' knobs: tasks from a module's fuel calls, search, progress, resume
    model    -- ``tune_model``: every task of a model (kernels' knobs and its other TIR functions)
    buckets  -- the benchmark's shape buckets as tuning tasks
    report   -- which kernels of a module use a record and which the hand-picked knobs
"""

import importlib

from ..dispatch.records import TuningLogWarning, TuningRecords, shipped_logs, target_key

# imported on first use: ``kernels`` loads MetaSchedule (which
# ``import tvm_fuel`` should not pay for) and ``report`` builds
_LAZY = {"tuning_report": "report", "default_work_dir": "kernels", "tune": "kernels"}


def __getattr__(name: str):
    if name not in _LAZY:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f".{_LAZY[name]}", __name__), name)


__all__ = ["TuningLogWarning", "TuningRecords", "shipped_logs", "target_key", *_LAZY]
