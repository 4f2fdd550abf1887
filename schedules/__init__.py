"""Hand-written TensorIR kernels of the fuel ops, per target (installed as ``tvm_fuel.schedules``).

``tuned_legalize_map(target, records)`` maps each fuel op to a legalization that asks the
target's rules for a kernel and falls back to the TE decomposition (the floor) when every rule
declines. A kernel's knobs come from a tuning record that matches its workload and target
(``records.lookup``), else they are the rule's hand-picked ones; each kernel PrimFunc says which
in its ``fuel.knobs`` attribute ("hand-picked" or the record's log file).

Contents:
    base      -- KernelRule, the dlight-style contract
    workload  -- KernelSpec, Workload (what a kernel is built for; keys of tuning records)
    common    -- pieces every target's kernels share (tile ranges, masking, GQA row packing)
    cpu       -- llvm kernels (forward, backward, paged) and their rules
    cuda      -- sm_80/sm_90 kernels (forward, backward, paged) and their rules
    rules_for, rule_for, tuned_legalize_map
"""

from __future__ import annotations

import warnings
from typing import Callable, Protocol, Sequence

import tvm
from tvm import relax

from ..diagnostics import TuningLogWarning
from .base import KernelRule
from .cpu.rules import RULES as CPU_RULES
from .cuda.rules import RULES as CUDA_RULES
from .workload import Workload


def rules_for(target: tvm.target.Target, rules: Sequence[KernelRule] | None = None) -> list[KernelRule]:
    """The kernel rules (default: every target's) that may serve ``target``, in priority order."""
    return [rule for rule in (rules if rules is not None else (*CPU_RULES, *CUDA_RULES))
            if rule.is_target_available(target)]


def rule_for(op: str, target: tvm.target.Target) -> KernelRule | None:
    """The first rule serving ``op`` on ``target`` (None: the floor serves it)."""
    return next((rule for rule in rules_for(target) if rule.op == op), None)


class KnobSource(Protocol):
    """Where tuned knobs come from (``tvm_fuel.tuning.TuningRecords``)."""

    def lookup(self, workload: Workload, target: tvm.target.Target) -> tuple[dict[str, int], str] | None:
        """(knobs, where they came from) of the best record for ``workload`` on ``target``."""


def tuned_legalize_map(target: tvm.target.Target, records: KnobSource | None = None, *,
                       rules: Sequence[KernelRule] | None = None) -> dict[str, Callable]:
    """op name -> legalization through the performance path (floor where no rule applies);
    ``rules`` replaces the default rules (the tests pass the CUDA rules' llvm emulation)."""
    from ..legalize import LEGALIZE, emit_kernel
    from ..op import SPECS

    rules = rules_for(target, rules)

    def legalize_with(name: str):
        candidates = [rule for rule in rules if rule.op == name]

        def legalize(bb: relax.BlockBuilder, call: relax.Call) -> relax.Expr:
            for rule in candidates:
                workload = rule.workload(call, target)
                if workload is None:
                    continue
                knobs, source = rule.knobs(workload, target), "hand-picked"
                found = records.lookup(workload, target) if records is not None else None
                if found is not None:
                    try:
                        knobs, source = rule.knobs(workload, target, found[0]), found[1]
                    except ValueError as err:  # e.g. decode knobs for a call whose Sq is symbolic
                        warnings.warn(f"tvm_fuel: record in {found[1]} does not fit {workload.describe()} ({err}); "
                                      "hand-picked knobs are used", TuningLogWarning, stacklevel=2)
                func = rule.kernel(workload, knobs).with_attr("fuel.knobs", source)
                func = func.with_attr("fuel.workload", workload.describe())
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
    forward = bb.normalize(op.flash_attn(args["q"], args["k"], args["v"], args["alibi_slopes"], args["attn_mask"],
                                         return_lse=True, **op.options_of(call)))
    state = bb.emit(legalize_with("flash_attn")(bb, forward))
    if args["out"] is None:
        args["out"] = bb.emit(relax.TupleGetItem(state, 0))
    if args["lse"] is None:
        args["lse"] = bb.emit(relax.TupleGetItem(state, 1))
    return args
