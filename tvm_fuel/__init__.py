"""tvm_fuel: fused attention operators for Apache TVM Relax.

Importing the package registers the ops (``R.fuel.*``): their type rules, their legalization to
TE compute (the always-correct floor) and their TVMScript parsing. It also applies the patches of
TVM 0.27 (``tvm_fuel.compat.install``), among them sizing TVM's CPU thread pool to the physical
cores where the user set neither ``TVM_NUM_THREADS`` nor ``OMP_NUM_THREADS`` (``tvm_fuel.threads``;
TVM alone would use half of them).

Contents:
    op         -- the ops: Relax constructors (flash_attn, flash_attn_backward(_q/_k/_v), paged_attn,
                  softmax_backward, flash_attn_jvp (forward mode), flash_attn_double_backward (the
                  backward's vector-Jacobian product), layer_norm_backward, rms_norm_backward), their
                  type rules, floor (TE decomposition) and registration
    reference  -- numpy references of every op (the oracle)
    compile    -- build a Relax module holding fuel ops (kernels="tuned": the performance path,
                  with the knobs of matching tuning records)
    dispatch   -- the route from a fused call to its kernel, or the floor and why
                  (tvm_fuel.dispatch.explain(mod, target) prints it per call)
    compat     -- the patches of TVM 0.27 (TVMScript, threads, gradients, importer), one module each
    transform  -- Relax passes, one per file: FuseAttention, ShareForwardState, UseSoftmaxBackward,
                  gradient, ExpandAttention, LegalizeFuel, ...
    autodiff   -- gradients of the fuel ops and of the Relax ops TVM leaves without one
    frontend   -- from_exported_program: TVM's PyTorch importer, repaired, attention fused
                  (import tvm_fuel.frontend)
    nn         -- FlashAttention, PagedAttention modules for tvm.relax.frontend.nn (import tvm_fuel.nn)
    kv_cache   -- PagedKVCache: blocks, appends through the block table, frees (import tvm_fuel.kv_cache)
    models     -- end-to-end: a Llama-style decoder served over the paged cache, a training run
                  through the Gradient pass (import tvm_fuel.models.llama / .engine / .train)
    tune       -- MetaSchedule auto-tuning of the kernels' knobs (tvm_fuel.tuning)
    tune_model -- every task of a model: kernels' knobs and its other TIR functions (tuning.model)
    specialize, ShapePoint -- static copies of symbolic functions, dispatched at run time
    tuning_report -- which kernels of a module use a tuning record
    host_target   -- llvm for this machine's CPU
    AttnConfig -- the validated attention options
"""


import importlib.util

# schedules/ and tuning_logs/ sit beside tvm_fuel/ in the repository; an install (pip install -e .,
# or a wheel) maps them into the package (pyproject.toml's package-dir)
if importlib.util.find_spec("tvm_fuel.schedules") is None:
    raise ImportError("tvm_fuel: tvm_fuel.schedules is missing: this checkout is not installed. Install it "
                      "(`python -m pip install -e .` in the repository) and import it from there; "
                      "PYTHONPATH=<checkout> alone does not map schedules/ and tuning_logs/ into the package")

from . import compat

compat.install()  # TVM 0.27's patches, thread pool first: before any TVM kernel starts it (tvm_fuel.compat)

from .compat import threads as threads  # noqa: E402  (tvm_fuel.threads, documented above)

from . import autodiff, op, reference, transform  # noqa: E402
from .build import compile, pipeline  # noqa: A004,E402  (mirrors tvm.compile)
from .op import AttnConfig  # noqa: E402
from .target import host_target  # noqa: E402
from .transform import ShapePoint, specialize  # noqa: E402

op.register()
autodiff.register()  # after the ops: their own gradients (those of TVM's ops: compat.relax_gradients)


def tune(*args, **kwargs):
    """``tvm_fuel.tuning.kernels.tune`` (imported on first use: it loads MetaSchedule)."""
    from .tuning import tune as _tune

    return _tune(*args, **kwargs)


def tuning_report(*args, **kwargs):
    """``tvm_fuel.tuning.tuning_report``."""
    from .tuning import tuning_report as _report

    return _report(*args, **kwargs)


def tune_model(*args, **kwargs):
    """``tvm_fuel.tuning.model.tune_model`` (imported on first use: it loads MetaSchedule)."""
    from .tuning.model import tune_model as _tune_model

    return _tune_model(*args, **kwargs)


__all__ = ["op", "reference", "transform", "compile", "pipeline", "host_target", "tune", "tune_model",
           "tuning_report", "specialize", "ShapePoint", "AttnConfig"]
__version__ = "0.1.0"
