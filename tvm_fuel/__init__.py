"""tvm_fuel: fused attention operators for Apache TVM Relax.

Importing the package registers the ops (``R.fuel.*``): their type rules, their legalization to
TE compute (the always-correct floor) and their TVMScript parsing. It also sizes TVM's CPU
thread pool to the physical cores where the user set neither ``TVM_NUM_THREADS`` nor
``OMP_NUM_THREADS`` (``tvm_fuel.threads``; TVM alone would use half of them).

Contents:
    op         -- the ops: Relax constructors (flash_attn, flash_attn_backward(_q/_k/_v), paged_attn,
                  softmax_backward, flash_attn_jvp (forward mode), flash_attn_double_backward (the
                  backward's vector-Jacobian product), layer_norm_backward, rms_norm_backward), their
                  type rules, floor (TE decomposition) and registration
    reference  -- numpy references of every op (the oracle)
    compile    -- build a Relax module holding fuel ops (kernels="tuned": the performance path,
                  with the knobs of matching tuning records)
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


def _map_source_layout() -> None:
    """Make ``tvm_fuel.schedules`` and ``tvm_fuel.tuning_logs`` importable from a source checkout.

    The repository keeps ``schedules/`` and ``tuning_logs/`` at its top level, beside ``tvm_fuel/``;
    pyproject.toml's package-dir puts them inside the package in a wheel (``pip install .``) and
    the editable finder maps them (``pip install -e .``). A checkout imported straight from its
    root (``PYTHONPATH=.``, or ``python -m tvm_fuel`` run there, which shadows any installed copy)
    has neither, so a meta-path finder maps exactly those two names to the folders beside this
    package. Installed with the folders inside the package, it does nothing.
    """
    import importlib.abc
    import importlib.util
    import os
    import sys

    here = os.path.dirname(os.path.abspath(__file__))
    root = os.path.dirname(here)
    mapping = {}
    for name in ("schedules", "tuning_logs"):
        init = os.path.join(root, name, "__init__.py")
        if not os.path.isdir(os.path.join(here, name)) and os.path.isfile(init):
            mapping[f"{__name__}.{name}"] = init

    class _SourceLayoutFinder(importlib.abc.MetaPathFinder):
        tvm_fuel_source_layout = True

        def find_spec(self, fullname, path=None, target=None):
            init = mapping.get(fullname)
            if init is None or (path is not None and here not in (os.path.abspath(p) for p in path)):
                return None  # not ours, or a different tvm_fuel is being imported
            return importlib.util.spec_from_file_location(fullname, init,
                                                          submodule_search_locations=[os.path.dirname(init)])

    # A re-import (another copy of tvm_fuel) replaces the finder of the previous one.
    sys.meta_path[:] = [f for f in sys.meta_path if not getattr(f, "tvm_fuel_source_layout", False)]
    if mapping:
        sys.meta_path.insert(0, _SourceLayoutFinder())  # before an editable install's finder (maybe another checkout)


_map_source_layout()  # before anything imports .schedules or .tuning_logs

from . import threads  # noqa: E402

threads.configure()  # before any TVM kernel starts the runtime's thread pool

from . import autodiff, op, reference, transform  # noqa: E402
from .build import compile, pipeline  # noqa: A004,E402  (mirrors tvm.compile)
from .op import AttnConfig  # noqa: E402
from .target import host_target  # noqa: E402
from .transform import ShapePoint, specialize  # noqa: E402

op.register()
autodiff.register()  # after the ops: their gradients, and those of the Relax ops TVM gives none


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
