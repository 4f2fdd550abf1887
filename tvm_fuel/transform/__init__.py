"""Relax passes around the fuel ops, one per file (``tvm_fuel.transform``).

Contents:
    FuseAttention        -- R.nn.attention (FX import) and unfused softmax(mask(scale Q K^T)) V graphs
                            (exported programs: masks read from their programs, softcap, ALiBi and other
                            biases over the keys, GQA and multi-query) -> flash_attn, where the semantics
                            match exactly (helpers: mask_program, view_chains)
    RepairImportedProgram -- what TVM 0.27's PyTorch importer mistranslates (bool cumsum, negative take
                            indices), made what PyTorch means
    ShareForwardState    -- flash_attn returns its lse too, so its gradient reuses out and lse
    UseSoftmaxBackward   -- the softmax gradient Gradient writes out -> one softmax_backward
    gradient             -- ShareForwardState, relax.transform.Gradient, then UseSoftmaxBackward
    with_objective       -- a function's computation with a new scalar result (a gradient penalty on
                            an adjoint), for a second ``gradient``: second derivatives through fused ops
    ExpandAttention      -- the fuel ops as Relax primitives, which Gradient differentiates to any order
    LegalizeFuel, legalize -- the fuel ops alone lowered to kernels or the floor
    RoundBfloat16Results -- each op's bfloat16 results rounded where it stores them (fusion keeps it)
    PackLinearWeights    -- nn.Linear's constant weights laid out at build in the CPU matmul's panels
    DropMatmulBroadcasts -- a matmul reads its operands, not their broadcasts to its batch dims
    FuseTransposeMatmul  -- TVM's nn.Linear fusion, where a transposed weight with other users does not break it
    ApplyTunedFunctions  -- unscheduled TIR functions take their MetaSchedule records
    SpecializeAtTunedShapes, specialize, ShapePoint -- static copies of symbolic functions at the
                            shape points a model was tuned at, dispatched at run time
    fuse                 -- TVM's CPU legalization and fusion: the TIR functions a build schedules
"""

from .apply_tuned_functions import ApplyTunedFunctions
from .drop_matmul_broadcasts import DropMatmulBroadcasts
from .expand_attention import ExpandAttention
from .fuse_attention import FuseAttention
from .fuse_transpose_matmul import FuseTransposeMatmul
from .gradient import gradient, with_objective
from .legalize_and_fuse import fuse
from .legalize_fuel import KERNEL_PATHS, LegalizeFuel, legalize
from .pack_linear_weights import PackLinearWeights
from .repair_imported_program import RepairImportedProgram
from .round_bfloat16_results import RoundBfloat16Results
from .share_forward_state import ShareForwardState
from .specialize import ShapePoint, specialize
from .specialize_at_tuned_shapes import SpecializeAtTunedShapes
from .use_softmax_backward import UseSoftmaxBackward

__all__ = ["FuseAttention", "RepairImportedProgram", "ShareForwardState", "UseSoftmaxBackward", "gradient",
           "with_objective", "ExpandAttention", "LegalizeFuel", "legalize", "KERNEL_PATHS", "RoundBfloat16Results",
           "PackLinearWeights", "DropMatmulBroadcasts", "FuseTransposeMatmul", "ApplyTunedFunctions",
           "SpecializeAtTunedShapes", "specialize", "ShapePoint", "fuse"]
