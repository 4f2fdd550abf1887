"""Hand-written TensorIR kernels of the fuel ops, per target (installed as ``tvm_fuel.schedules``).

``tuned_legalize_map(target, records)`` maps each fuel op to a legalization that asks the
target's rules for a kernel and falls back to the TE decomposition (the floor) when every rule
declines. A kernel's knobs come from a tuning record that matches its workload and target
(``records.lookup``: the same dims, else a record of the same shape bucket), else they are the
rule's hand-picked ones; each kernel PrimFunc says which in its ``fuel.knobs`` attribute
("hand-picked" or the record's log file), the knobs it was built with in ``fuel.knob_values``
(JSON) and, for a record, whether it was tuned at the call's dims or a bucket neighbour's
(``fuel.match``: "exact" or "bucket") and at which (``fuel.tuned_at``).

Contents:
    base      -- KernelRule, the dlight-style contract
    workload  -- KernelSpec, Workload (what a kernel is built for; keys of tuning records)
    common    -- pieces every target's kernels share (tile ranges, masking, GQA row packing)
    cpu       -- llvm kernels (forward, backward, paged, JVP, double backward, norm backward) and their rules
    cuda      -- sm_80/sm_90 kernels (forward, backward, paged) and their rules
    script    -- TVMScript's macro expansion without reading every outer frame (installed on import)
    KnobSource, KnobMatch -- where tuned knobs come from, and what a lookup finds
    rules_for, rule_for, kernel_call, tuned_legalize_map
"""

from __future__ import annotations

import json
import warnings
from dataclasses import dataclass
from typing import Callable, Mapping, Protocol, Sequence

import tvm
from tvm import relax, tirx

from ..diagnostics import TuningLogWarning
from .base import KernelRule
from .cpu.rules import RULES as CPU_RULES
from .cuda.rules import RULES as CUDA_RULES
from .script import fast_entry_stacks, fast_macro_lookup
from .workload import Workload

fast_macro_lookup()  # before any kernel is built: each T.macro call otherwise costs ~0.35 s
fast_entry_stacks()  # each parse during an import otherwise scans sys.modules per frame (script.py)


def rules_for(target: tvm.target.Target, rules: Sequence[KernelRule] | None = None) -> list[KernelRule]:
    """The kernel rules (default: every target's) that may serve ``target``, in priority order."""
    return [rule for rule in (rules if rules is not None else (*CPU_RULES, *CUDA_RULES))
            if rule.is_target_available(target)]


def rule_for(op: str, target: tvm.target.Target) -> KernelRule | None:
    """The first rule serving ``op`` on ``target`` (None: the floor serves it)."""
    return next((rule for rule in rules_for(target) if rule.op == op), None)


@dataclass(frozen=True)
class KnobMatch:
    """What a knob lookup found: the knobs, where they came from (a log file) and the workload
    they were tuned at (None: unknown). ``exact``: tuned at the call's own dims, not a bucket
    neighbour's."""

    knobs: Mapping[str, int]
    source: str
    tuned: Workload | None = None
    exact: bool = True


class KnobSource(Protocol):
    """Where tuned knobs come from (``tvm_fuel.tuning.TuningRecords``)."""

    def lookup(self, workload: Workload, target: tvm.target.Target) -> KnobMatch | None:
        """The best record for ``workload`` on ``target``, or None."""


def tuned_legalize_map(target: tvm.target.Target, records: KnobSource | None = None, *,
                       rules: Sequence[KernelRule] | None = None) -> dict[str, Callable]:
    """op name -> legalization through the performance path (floor where no rule applies);
    ``rules`` replaces the default rules (the tests pass the CUDA rules' llvm emulation)."""
    from ..op.legalize import LEGALIZE, emit_kernel
    from ..op import SPECS

    rules = rules_for(target, rules)
    # kernels built in this map, by (rule, workload, knobs): a model's identical calls (one per
    # layer) parse one TVMScript kernel, not one each (~0.5 s a kernel)
    built: dict[tuple, tirx.PrimFunc] = {}

    def kernel(rule: KernelRule, workload: Workload, knobs: Mapping[str, int]) -> tirx.PrimFunc:
        key = (id(rule), workload, tuple(sorted(knobs.items())))
        if key not in built:
            built[key] = rule.kernel(workload, knobs)
        return built[key]

    def legalize_with(name: str):
        candidates = [rule for rule in rules if rule.op == name]

        def legalize(bb: relax.BlockBuilder, call: relax.Call) -> relax.Expr:
            has_sinks = SPECS[name].split_args(call).get("sinks") is not None
            if has_sinks and name in _SINK_RESCALED:
                return _with_sinks(bb, name, call, legalize_with)
            for rule in candidates:
                workload = rule.workload(call, target)
                if workload is None:
                    continue
                knobs, source, match = rule.knobs(workload, target), "hand-picked", None
                found = records.lookup(workload, target) if records is not None else None
                if found is not None:
                    try:
                        knobs, source, match = rule.knobs(workload, target, found.knobs), found.source, found
                    except ValueError as err:
                        # a bucket neighbour's knobs may not fit (e.g. decode knobs for more rows):
                        # normal, silent; an exact record that does not fit is worth a warning
                        if found.exact:
                            warnings.warn(f"tvm_fuel: record in {found.source} does not fit {workload.describe()} "
                                          f"({err}); hand-picked knobs are used", TuningLogWarning, stacklevel=2)
                func = kernel(rule, workload, knobs).with_attr("fuel.knobs", source)
                func = func.with_attr("fuel.knob_values", json.dumps(knobs, sort_keys=True))  # what was built
                func = func.with_attr("fuel.workload", workload.describe())
                if match is not None:
                    func = func.with_attr("fuel.match", "exact" if match.exact else "bucket")
                    if match.tuned is not None:
                        func = func.with_attr("fuel.tuned_at", match.tuned.dims_label())
                args = _with_forward_state(bb, name, call, legalize_with) if rule.needs_forward_state else None
                return emit_kernel(bb, name, call, func, args)
            return LEGALIZE[name](bb, call)

        return legalize

    return {spec.op_name: legalize_with(name) for name, spec in SPECS.items()}


# the ops whose kernels serve sinks through a rescale (forwards) or the sinks' out and lse (backwards);
# the paged kernels take the sinks themselves
_SINK_FORWARDS = ("flash_attn", "flash_attn_varlen")
_SINK_RESCALED = (*_SINK_FORWARDS, "flash_attn_backward", "flash_attn_backward_q", "flash_attn_backward_k",
                  "flash_attn_backward_v", "flash_attn_varlen_backward")


def kernel_call(name: str, call: relax.Call) -> relax.Call:
    """The call whose kernel serves ``call`` (of op ``name``): a dense or varlen call with sinks runs
    the sink-free kernels (the forward's with lse, which the rescale needs); any other call is itself.
    What tuning measures for it."""
    from ..op import SPECS

    spec = SPECS[name]
    if name not in _SINK_RESCALED or spec.split_args(call).get("sinks") is None:
        return call
    return spec.replace(call, {"sinks": None}, **({"return_lse": True} if name in _SINK_FORWARDS else {}))


def _with_sinks(bb: relax.BlockBuilder, name: str, call: relax.Call, legalize_with) -> relax.Expr:
    """A call with sinks through the sink-free kernels (``tvm_fuel.op.sinks``): the forward
    kernel's out and lse rescaled; the backward kernels given the sinks' out and lse."""
    from ..op import SPECS, rescale_by_sinks
    from ..op.legalize import checked_dims

    spec = SPECS[name]
    # the run-time dims check (sinks' length too) before the sinks leave the call
    args = checked_dims(bb, name, spec.split_args(call))
    # sinks [Hq] as q's heads (axis 1 in both layouts): the rescale's broadcasts need the shape (a
    # symbolic length would leave them unknown)
    args["sinks"] = bb.match_cast(args["sinks"], relax.TensorType([args["q"].ty.shape[1]], "float32"))
    call = bb.normalize(spec.replace(call, args))
    if name in _SINK_FORWARDS:
        plain = bb.normalize(kernel_call(name, call))
        both = bb.emit(legalize_with(name)(bb, plain))
        # packed rows from cu_seqlens_q[B] on belong to no sequence
        rows = _last(bb, args["cu_seqlens_q"]) if name == "flash_attn_varlen" else None
        out, lse = rescale_by_sinks(bb, bb.emit(relax.TupleGetItem(both, 0)), bb.emit(relax.TupleGetItem(both, 1)),
                                    args["sinks"], rows=rows)
        return relax.Tuple([out, lse]) if bool(call.attrs["return_lse"]) else out
    args = _with_forward_state(bb, name, call, legalize_with)  # the forward with the same sinks
    return legalize_with(name)(bb, bb.normalize(spec.replace(call, {**args, "sinks": None})))


def _last(bb: relax.BlockBuilder, offsets: relax.Expr) -> relax.Expr:
    """The last element of the 1-D ``offsets`` as a 0-d tensor."""
    last = relax.op.strided_slice(offsets, axes=[0], begin=[-1], end=[offsets.ty.shape[0]])
    return bb.emit(relax.op.reshape(last, []))


def _with_forward_state(bb: relax.BlockBuilder, name: str, call: relax.Call, legalize_with) -> dict:
    """The backward call's arguments, with out and lse from a forward pass where it lacks them."""
    from .. import op
    from ..op import SPECS

    args = SPECS[name].split_args(call)
    if args["out"] is not None and args["lse"] is not None:
        return args
    if name == "flash_attn_varlen_backward":  # max_seqlen as the backward's: the forward enforces them too
        limits = {n: int(call.attrs[n]) or None for n in ("max_seqlen_q", "max_seqlen_k")}
        forward = bb.normalize(op.flash_attn_varlen(args["q"], args["k"], args["v"], args["cu_seqlens_q"],
                                                    args["cu_seqlens_k"], args["alibi_slopes"], sinks=args["sinks"],
                                                    return_lse=True, **limits, **op.options_of(call)))
    else:
        forward = bb.normalize(op.flash_attn(args["q"], args["k"], args["v"], args["alibi_slopes"],
                                             args["attn_mask"], sinks=args.get("sinks"), return_lse=True,
                                             **op.options_of(call)))
    state = bb.emit(legalize_with(forward.op.name[len("relax.fuel."):])(bb, forward))
    if args["out"] is None:
        args["out"] = bb.emit(relax.TupleGetItem(state, 0))
    if args["lse"] is None:
        args["lse"] = bb.emit(relax.TupleGetItem(state, 1))
    return args
