"""MetaSchedule auto-tuning of the fuel kernels (the logs it writes are read at build by
``tvm_fuel.logs``, one layer below; re-exported here).

Contents:
    space    -- kernels as design spaces (sampled knobs, mutator, features, validity check)
    measure  -- the lean builder and the valid-argument runners (local, RPC)
    tune     -- ``tune``: tasks from a module's fuel calls, search, progress, resume
    report   -- which kernels of a module use a record and which the hand-picked knobs
"""

from ..logs import TuningLogWarning, TuningRecords, shipped_logs, target_key
from .report import tuning_report
from .tune import default_work_dir, tune

__all__ = ["tune", "tuning_report", "TuningRecords", "TuningLogWarning", "shipped_logs", "target_key",
           "default_work_dir"]
