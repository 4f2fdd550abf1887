"""MetaSchedule auto-tuning of the fuel kernels, and the tuning logs applied at build.

Contents:
    space    -- kernels as design spaces (sampled knobs, mutator, features, validity check)
    measure  -- the lean builder and the valid-argument runners (local, RPC)
    records  -- log layout, target keys, lookup of a workload's tuned knobs
    tune     -- ``tune``: tasks from a module's fuel calls, search, progress, resume
    report   -- which kernels of a module use a record and which the hand-picked knobs
"""

from .records import TuningLogWarning, TuningRecords, shipped_logs, target_key
from .report import tuning_report
from .tune import default_work_dir, tune

__all__ = ["tune", "tuning_report", "TuningRecords", "TuningLogWarning", "shipped_logs", "target_key",
           "default_work_dir"]
