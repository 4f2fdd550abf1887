"""``tvm_fuel.frontend``: PyTorch programs into Relax, as PyTorch means them.

Contents:
    from_exported_program -- TVM's ``from_exported_program`` with PyTorch's cumsum typing
                             (``tvm_fuel.compat.torch_importer``), then
                             RepairImportedProgram and (``fuse=True``) FuseAttention
"""

from __future__ import annotations

from typing import Any

import tvm

from .compat import torch_importer
from .transform.fuse_attention import FuseAttention
from .transform.repair_imported_program import RepairImportedProgram


def from_exported_program(exported_program: Any, *, fuse: bool = True, custom_convert_map: dict | None = None,
                          **options) -> tvm.IRModule:
    """A ``torch.export.ExportedProgram`` as a Relax module: TVM's
    ``relax.frontend.torch.from_exported_program`` (``options`` passed on) with ``cumsum`` typed as
    PyTorch types it (``tvm_fuel.compat.torch_importer``), what TVM 0.27's importer mistranslates
    otherwise repaired (``RepairImportedProgram``: negative ``take`` indices), and with ``fuse`` its attention fused
    (``FuseAttention``). ``custom_convert_map`` is TVM's, taking precedence over ours.

    A Hugging Face ``transformers`` model exports with its cache off (``use_cache=False`` passed
    to ``forward`` exports, but the import then fails), from token ids, and with an attention
    mask where rows are padded::

        model.config.use_cache = False
        ep = torch.export.export(model.eval(), (input_ids,), {"attention_mask": attention_mask})
        mod = tvm_fuel.frontend.from_exported_program(ep, keep_params_as_input=False)
        ex = tvm_fuel.compile(mod, tvm_fuel.host_target(), kernels="tuned")
    """
    from tvm.relax.frontend.torch import from_exported_program as tvm_from_exported_program

    converters = torch_importer.convert_map(custom_convert_map)
    try:
        mod = tvm_from_exported_program(exported_program, custom_convert_map=converters, **options)
    except ValueError as err:
        if "Cannot view a tensor" not in str(err):
            raise
        # PyTorch's own run_decompositions (TVM's importer calls it) fails on a view of SDPA's
        # non-contiguous output: GPT-2's sdpa attention with a padded batch
        raise ValueError("tvm_fuel.frontend.from_exported_program: PyTorch's run_decompositions cannot view "
                         "a non-contiguous tensor of this program (scaled_dot_product_attention's output "
                         "reshaped with view, as GPT-2's sdpa attention does with an attention mask); export "
                         "the model with attn_implementation='eager'") from err
    mod = RepairImportedProgram()(mod)
    return FuseAttention()(mod) if fuse else mod


__all__ = ["from_exported_program"]
