"""Every patch tvm_fuel makes to TVM, in one place: one module per TVM 0.27.0 defect or gap.

Each module's docstring names the TVM version it applies to and the upstream file and function
it works around; each patch checks what it replaces, leaves TVM's own behaviour where TVM has it,
and applies once however often it is installed. ``import tvm_fuel`` runs ``install``; a new TVM
release is checked here, module by module.

Modules, in the order ``install`` applies them:
    threads         -- the CPU thread pool's size and binding (``src/runtime/threading_backend.cc``):
                       first, before any kernel starts TVM's pool, which reads them once
    tvmscript       -- the parser's macro lookup and entries without a frame-info walk, each source
                       read and parsed once (``python/tvm/script/parser/core/parser.py``,
                       ``diagnostics.py``): before any kernel is parsed
    relax_gradients -- the gradients of TVM's Relax ops that have none (``python/tvm/relax/op/_op_gradient.py``):
                       after TVM's ops are registered (on importing TVM: TVM's own gradients win)
and one applied per call rather than installed:
    torch_importer  -- ``aten.cumsum`` typed as PyTorch types it
                       (``python/tvm/relax/frontend/torch/base_fx_graph_translator.py``), the converter
                       ``tvm_fuel.frontend`` passes TVM's importer (TVM's own importer stays TVM's)

Contents:
    install -- apply every patch, in the order above (idempotent)
"""

from __future__ import annotations


def install() -> dict[str, object]:
    """Apply every patch of TVM, in order: the thread pool's environment first (no TVM import
    before it), then TVMScript's parser, then the gradients of TVM's ops. Idempotent: a second
    call changes nothing. Returns what each applied, by module name (see each ``install``)."""
    from . import threads

    applied: dict[str, object] = {"threads": threads.install()}  # before anything can start TVM's pool

    from . import relax_gradients, tvmscript

    applied["tvmscript"] = tvmscript.install()  # before any kernel is parsed
    applied["relax_gradients"] = relax_gradients.install()
    return applied


__all__ = ["install"]
