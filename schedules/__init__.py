"""Hand-written TensorIR kernels of the fuel ops, per target (installed as ``tvm_fuel.schedules``).

``tuned_legalize_map(target)`` maps each fuel op to a legalization that asks the target's rules
for a kernel and falls back to the TE decomposition (the floor) when every rule declines.

Contents:
    base     -- KernelRule, the dlight-style contract
    cpu      -- llvm kernels (forward, paged) and their rules
    rules_for, tuned_legalize_map
"""

from __future__ import annotations

from typing import Callable

import tvm
from tvm import relax

from .base import KernelRule
from .cpu.rules import RULES as CPU_RULES


def rules_for(target: tvm.target.Target) -> list[KernelRule]:
    """The kernel rules that may serve ``target``, in priority order."""
    return [rule for rule in CPU_RULES if rule.is_target_available(target)]


def tuned_legalize_map(target: tvm.target.Target) -> dict[str, Callable]:
    """op name -> legalization through the performance path (floor where no rule applies)."""
    from ..legalize import LEGALIZE, emit_kernel
    from ..op import SPECS

    rules = rules_for(target)

    def legalize_with(name: str):
        candidates = [rule for rule in rules if rule.op == name]

        def legalize(bb: relax.BlockBuilder, call: relax.Call) -> relax.Expr:
            for rule in candidates:
                func = rule.apply(call, target)
                if func is not None:
                    args = _with_forward_state(bb, name, call, legalize_with) if rule.needs_forward_state else None
                    return emit_kernel(bb, name, call, func, args)
            return LEGALIZE[name](bb, call)

        return legalize

    return {spec.op_name: legalize_with(name) for name, spec in SPECS.items()}


def _with_forward_state(bb: relax.BlockBuilder, name: str, call: relax.Call, legalize_with) -> dict:
    """The backward call's arguments, with out and lse from a forward pass where it lacks them."""
    from .. import op
    from ..op import SPECS

    args = SPECS[name].split_args(call)
    if args["out"] is not None and args["lse"] is not None:
        return args
    options = {key: call.attrs[key] for key in ("softmax_scale", "causal", "softcap")}
    forward = bb.normalize(op.flash_attn(args["q"], args["k"], args["v"], args["alibi_slopes"], args["attn_mask"],
                                         window_size=list(call.attrs["window_size"]), return_lse=True, **options))
    state = bb.emit(legalize_with("flash_attn")(bb, forward))
    if args["out"] is None:
        args["out"] = bb.emit(relax.TupleGetItem(state, 0))
    if args["lse"] is None:
        args["lse"] = bb.emit(relax.TupleGetItem(state, 1))
    return args
