"""Hand-written TensorIR kernels of the fuel ops, per target (installed as ``tvm_fuel.schedules``).

A kernel rule (``base.KernelRule``, dlight's contract) builds one op's kernels on one kind of
target from a ``Workload`` and knobs; nothing here reads Relax. Which call gets which kernel, with
which knobs, is ``tvm_fuel.dispatch``'s. ``import tvm_fuel`` makes TVMScript's macro expansion cheap
before any kernel here is parsed (``tvm_fuel.compat.tvmscript``).

Contents:
    base      -- KernelRule, the dlight-style contract
    workload  -- KernelSpec, Workload (what a kernel is built for; keys of tuning records)
    common    -- pieces every target's kernels share (tile ranges, masking, GQA row packing)
    cpu       -- llvm kernels (forward, backward, paged, JVP, double backward, norm backward) and their rules
    cuda      -- sm_80/sm_90 kernels (forward, backward, paged) and their rules
    rules_for, rule_for -- the rules that may serve a target
"""

from __future__ import annotations

from typing import Sequence

import tvm

from .base import KernelRule
from .cpu.rules import RULES as CPU_RULES
from .cuda.rules import RULES as CUDA_RULES


def rules_for(target: tvm.target.Target, rules: Sequence[KernelRule] | None = None) -> list[KernelRule]:
    """The kernel rules (default: every target's) that may serve ``target``, in priority order."""
    return [rule for rule in (rules if rules is not None else (*CPU_RULES, *CUDA_RULES))
            if rule.is_target_available(target)]


def rule_for(op: str, target: tvm.target.Target) -> KernelRule | None:
    """The first rule serving ``op`` on ``target`` (None: the floor serves it)."""
    return next((rule for rule in rules_for(target) if rule.op == op), None)


__all__ = ["KernelRule", "rules_for", "rule_for"]
