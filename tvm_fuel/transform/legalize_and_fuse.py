"""TVM's CPU legalization and fusion as ``default_pipeline`` runs them before it schedules: the TIR
functions a build schedules or tunes.
"""

from __future__ import annotations

from typing import Any

import tvm

from ..target import as_target
from .drop_matmul_broadcasts import DropMatmulBroadcasts
from .fuse_transpose_matmul import FuseTransposeMatmul
from .pack_linear_weights import PackLinearWeights
from .round_bfloat16_results import RoundBfloat16Results


def fuse(mod: tvm.IRModule, target: Any) -> tvm.IRModule:
    """``mod`` (fuel ops already lowered) legalized and fused as ``default_pipeline`` does before
    it schedules: the TIR functions a build tunes or schedules (``tvm_fuel.tuning.model``'s tasks)."""
    from tvm.relax.backend.cpu_generic import pipeline as cpu_backend

    target = as_target(target)
    with target:
        return tvm.transform.Sequential(cpu_backend.library_dispatch_passes(target)
                                        + cpu_legalize_passes(target))(mod)


def cpu_legalize_passes(target: tvm.target.Target) -> list:
    """TVM's CPU legalization and fusion, each op's bfloat16 results rounded where the op stores them
    (``RoundBfloat16Results``, before FuseOps), behind nn.Linear's rewrites:

    * ``DropMatmulBroadcasts``: a matmul reads its operands where the importer broadcast them to its
      batch (the weight would be stored once per batch row);
    * ``FuseTransposeMatmul`` (TVM's, where a shared transpose does not break it):
      ``matmul(x, permute_dims(w))`` becomes one NT_matmul reading w [N, K] as stored, as MLC-LLM's
      pipeline does. Legalized apart, a weight passed as a parameter was transposed at every call
      (one decode row of a 576 x 49152 output layer: 89 ms, the NT_matmul 4.6 ms) and the decode
      rows could not read it along K (``schedules.cpu.matmul.DecodeMatmul``);
    * ``PackLinearWeights``: a constant weight laid out once in the panels the matmul's register
      tile reads.
    """
    from tvm.relax.backend.cpu_generic import pipeline as cpu_backend

    passes = cpu_backend.legalize_passes(target)
    # after the op patterns are read (the rounding would hide a reduction's pattern from FuseOps)
    at = next(i for i, p in enumerate(passes) if p.info.name == "AnnotateTIROpPattern") + 1
    return ([DropMatmulBroadcasts(), FuseTransposeMatmul(), PackLinearWeights(target)] + passes[:at]
            + [RoundBfloat16Results()] + passes[at:])
