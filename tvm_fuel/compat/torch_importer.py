"""TVM's PyTorch importer, typing ``aten.cumsum`` as PyTorch types it.

Applies to: TVM 0.27.0. Works around: ``python/tvm/relax/frontend/torch/base_fx_graph_translator.py``
``BaseFXGraphImporter._cumsum`` (``"cumsum.default"`` of ``exported_program_translator.py``
``ExportedProgramImporter.create_convert_map``), which keeps the input's dtype where no ``dtype``
is given. PyTorch counts an integral or bool input in int64: imported as TVM has it, a bool count
is bool (TVM cannot build a bool cumsum), and constants meeting it downstream are converted to
bool too (``count * 10`` becomes ``count * True``), past repair once imported.

The converter is passed per import, through ``custom_convert_map`` (``tvm_fuel.frontend``
``from_exported_program``, the one importer of tvm_fuel): TVM's own
``relax.frontend.torch.from_exported_program`` is left as TVM has it, so this module has no
``install``. What the importer gets wrong in a module already imported (a bool cumsum, negative
``take`` indices) is repaired by a Relax pass: ``tvm_fuel.transform.RepairImportedProgram``
(``transform/repair_imported_program.py``), which ``tvm_fuel.frontend`` and ``tvm_fuel.compile``
run.

Contents:
    cumsum      -- the ``aten.cumsum`` converter, PyTorch's typing
    CONVERTERS  -- aten op name -> converter, every one this module gives
    convert_map -- CONVERTERS with a caller's ``custom_convert_map`` over them
"""

from __future__ import annotations

from typing import Callable, Mapping

from tvm import relax


def cumsum(node, importer) -> relax.Var:
    """``aten.cumsum`` as PyTorch types it: an integral or bool input counts in int64 (TVM 0.27's
    importer keeps the input's type, so a bool count is bool, and constants meeting it downstream
    are converted to bool too: ``count * 10`` becomes ``count * True``)."""
    x = importer.env[node.args[0]]
    dim = node.args[1] if len(node.args) > 1 else node.kwargs.get("dim")
    dtype = node.kwargs.get("dtype")
    if dtype is not None:
        dtype = str(dtype).removeprefix("torch.")
    elif str(x.ty.dtype) == "bool" or str(x.ty.dtype).startswith(("int", "uint")):
        dtype = "int64"
    if dtype is not None and str(x.ty.dtype) == "bool":
        x = importer.block_builder.emit(relax.op.astype(x, dtype))
    return importer.block_builder.emit(relax.op.cumsum(x, dim, dtype))


CONVERTERS: Mapping[str, Callable] = {"cumsum.default": cumsum}


def convert_map(custom: Mapping[str, Callable] | None = None) -> dict[str, Callable]:
    """The ``custom_convert_map`` to pass TVM's ``from_exported_program``: ``CONVERTERS``, with the
    caller's own ``custom`` (TVM's argument) taking precedence."""
    return {**CONVERTERS, **(custom or {})}


__all__ = ["cumsum", "CONVERTERS", "convert_map"]
