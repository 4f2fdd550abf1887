"""tvm_fuel: fused attention operators for Apache TVM Relax.

Importing the package registers the ops (``R.fuel.*``): their type rules, their legalization to
TE compute (the always-correct floor) and their TVMScript parsing.

Contents:
    op         -- Relax constructors: flash_attn, flash_attn_backward(_q/_k/_v), paged_attn,
                  softmax_backward
    reference  -- numpy references of every op (the oracle)
    compile    -- build a Relax module holding fuel ops
    AttnConfig -- the validated attention options
"""

from . import op, reference
from .build import compile  # noqa: A004  (mirrors tvm.compile)
from .config import AttnConfig
from .registry import register as _register

_register()

__all__ = ["op", "reference", "compile", "AttnConfig"]
__version__ = "0.1.0"
