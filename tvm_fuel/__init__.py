"""tvm_fuel: fused attention operators for Apache TVM Relax.

Importing the package registers the ops (``R.fuel.*``): their type rules, their legalization to
TE compute (the always-correct floor) and their TVMScript parsing. It also sizes TVM's CPU
thread pool to the physical cores where the user set neither ``TVM_NUM_THREADS`` nor
``OMP_NUM_THREADS`` (``tvm_fuel.threads``; TVM alone would use half of them).

Contents:
    op         -- Relax constructors: flash_attn, flash_attn_backward(_q/_k/_v), paged_attn,
                  softmax_backward
    reference  -- numpy references of every op (the oracle)
    compile    -- build a Relax module holding fuel ops (kernels="tuned": the performance path,
                  with the knobs of matching tuning records)
    transform  -- Relax passes: FuseAttention, ShareForwardState, UseSoftmaxBackward, gradient
                  (flash_attn's gradient is registered)
    nn         -- FlashAttention, PagedAttention modules for tvm.relax.frontend.nn (import tvm_fuel.nn)
    kv_cache   -- PagedKVCache: blocks, appends through the block table, frees (import tvm_fuel.kv_cache)
    models     -- end-to-end: a Llama-style decoder served over the paged cache, a training run
                  through the Gradient pass (import tvm_fuel.models.llama / .engine / .train)
    tune       -- MetaSchedule auto-tuning of the kernels' knobs (tvm_fuel.tuning)
    tuning_report -- which kernels of a module use a tuning record
    host_target   -- llvm for this machine's CPU
    AttnConfig -- the validated attention options
"""

from . import threads

threads.configure()  # before any TVM kernel starts the runtime's thread pool

from . import op, reference, transform  # noqa: E402
from .build import compile, host_target, pipeline  # noqa: A004,E402  (mirrors tvm.compile)
from .config import AttnConfig  # noqa: E402
from .registry import register as _register  # noqa: E402

_register()



def tune(*args, **kwargs):
    """``tvm_fuel.tuning.tune`` (imported on first use: it loads MetaSchedule)."""
    from .tuning import tune as _tune

    return _tune(*args, **kwargs)


def tuning_report(*args, **kwargs):
    """``tvm_fuel.tuning.tuning_report``."""
    from .tuning import tuning_report as _report

    return _report(*args, **kwargs)


__all__ = ["op", "reference", "transform", "compile", "pipeline", "host_target", "tune", "tuning_report", "AttnConfig"]
__version__ = "0.1.0"
