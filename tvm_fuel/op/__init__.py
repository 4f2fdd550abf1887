"""The fuel ops: what each one is, its type rule, its floor and its registration with TVM.

``tvm_fuel.op.flash_attn(...)`` and the other constructors return Relax calls that print as
``R.fuel.<name>(...)``. Importing ``tvm_fuel`` registers them (``register``).

Modules, from the bottom up:
    config       -- AttnConfig (the validated attention options), accepted dtypes, bounds
    semantics    -- the attention math on TIR expressions, shared by the floor and every kernel
    spec         -- OpSpec and SPECS: each op's name, arguments and attributes; options_of
    attention    -- the attention constructors (flash_attn, its backward, JVP and double backward,
                    paged_attn, softmax_backward, flash_attn_varlen and its backward)
    norm         -- the norms' backward constructors (layer_norm_backward, rms_norm_backward)
    sinks        -- attention sinks in Relax ops: a sink-free (out, lse) rescaled, and the sinks' gradient
    dims         -- which dims of the arguments must agree
    infer        -- type inference (FInferType)
    decompose    -- the TE compute of every op (the materialized, always-correct floor)
    ragged       -- the floor of the packed variable-length ops (flash_attn_varlen and its backward)
    legalize     -- FLegalize: host-side checks, then the floor (the kernels: tvm_fuel.dispatch)
    nn_attention -- what TVM's R.nn.attention means in flash_attn's terms
    registry     -- registers the ops with TVM and the TVMScript parser
"""

from .attention import (flash_attn, flash_attn_backward, flash_attn_backward_k, flash_attn_backward_q,
                        flash_attn_backward_v, flash_attn_double_backward, flash_attn_jvp, flash_attn_varlen,
                        flash_attn_varlen_backward, paged_attn, softmax_backward)
from .config import AttnConfig
from .norm import layer_norm_backward, rms_norm_backward
from .registry import register
from .sinks import rescale_by_sinks, sinks_grad
from .spec import SPECS, OpSpec, options_of

__all__ = ["flash_attn", "flash_attn_backward", "flash_attn_backward_q", "flash_attn_backward_k",
           "flash_attn_backward_v", "paged_attn", "softmax_backward", "flash_attn_jvp", "flash_attn_double_backward",
           "flash_attn_varlen", "flash_attn_varlen_backward",
           "layer_norm_backward", "rms_norm_backward", "sinks_grad", "rescale_by_sinks", "OpSpec", "SPECS",
           "options_of", "AttnConfig", "register"]
