"""The route from a fused call to its kernel: workload, knobs, rule, or the floor and why.

For each fuel call ``LegalizeFuel`` meets (``kernels="tuned"``):

1. a call with sinks (dense or varlen) runs the sink-free kernels, whose results are rescaled
   (``_with_sinks``; ``tvm_fuel.op.sinks``);
2. ``workloads.workload_of`` reads its ``Workload`` (None: a dim the kernels are specialised on is
   symbolic, and the floor serves it);
3. the target's rules (``schedules.rules_for``) are asked in priority order whether they build it
   (``KernelRule.serves``); none does: the floor (``op.legalize.LEGALIZE``);
4. its knobs: a tuning record's that matches the workload and target (``records.TuningRecords``:
   the same dims, else a record of the same shape bucket) where one fits, else the rule's
   hand-picked ones;
5. the kernel is built once per (rule, workload, knobs) and called in place of the floor, after
   the floor's own host-side checks (``emit_kernel``); a backward kernel without the forward's
   out and lse gets them from the forward kernel (``_with_forward_state``).

Each kernel PrimFunc says where its knobs came from in ``fuel.knobs`` ("hand-picked" or the
record's log file), the knobs it was built with in ``fuel.knob_values`` (JSON), its workload in
``fuel.workload`` and, for a record, whether it was tuned at the call's dims or a bucket
neighbour's (``fuel.match``: "exact" or "bucket") and at which (``fuel.tuned_at``).

Contents:
    Route             -- one call's route: its workload, the rule that builds it, or why the floor serves it
    route             -- that route for one call
    knobs_for         -- a routed kernel's knobs (a record's or hand-picked) and the attributes saying which
    tuned_legalize_map -- op name -> the legalization through the routes (``LegalizeFuel``)
    kernel_call       -- the call whose kernel serves a call (the sink-free one for a call with sinks)
    emit_kernel       -- call a kernel PrimFunc in place of the floor
"""

from __future__ import annotations

import json
import warnings
from dataclasses import dataclass
from typing import Callable, Mapping, Sequence

import tvm
from tvm import relax, tirx

from .. import op
from ..diagnostics import TuningLogWarning
from ..op import SPECS, rescale_by_sinks
from ..op.legalize import LEGALIZE, added_function, checked_context_lens, checked_cu_seqlens, checked_dims
from ..schedules import rules_for
from ..schedules.base import KernelRule
from ..schedules.workload import Workload
from .records import KnobSource
from .workloads import why_none, workload_of

# the ops whose kernels serve sinks through a rescale (forwards) or the sinks' out and lse (backwards);
# the paged kernels take the sinks themselves
_SINK_FORWARDS = ("flash_attn", "flash_attn_varlen")
_SINK_RESCALED = (*_SINK_FORWARDS, "flash_attn_backward", "flash_attn_backward_q", "flash_attn_backward_k",
                  "flash_attn_backward_v", "flash_attn_varlen_backward")


@dataclass(frozen=True)
class Route:
    """Where one fuel call goes: ``rule`` builds ``workload``'s kernel, or (``rule`` None) the floor
    serves the call for the reason ``why``. ``via_sinks``: the call has sinks and runs the
    sink-free call's route, its results rescaled."""

    op: str
    workload: Workload | None
    rule: KernelRule | None
    why: str = ""
    via_sinks: bool = False

    def describe(self) -> str:
        """One line: the op, its workload and the rule, or the floor and why."""
        head = self.workload.describe() if self.workload is not None else self.op
        sinks = " (sink-free kernels, results rescaled by the sinks)" if self.via_sinks else ""
        if self.rule is None:
            return f"{head}: floor ({self.why}){sinks}"
        return f"{head}: kernel {type(self.rule).__name__}{sinks}"


def route(name: str, call: relax.Call, target: tvm.target.Target,
          rules: Sequence[KernelRule] | None = None) -> Route:
    """The route of ``call`` (fuel op ``name``) on ``target`` through ``rules`` (default: every
    target's, ``schedules.rules_for``)."""
    candidates = [rule for rule in rules_for(target, rules) if rule.op == name]
    via_sinks = name in _SINK_RESCALED and SPECS[name].split_args(call).get("sinks") is not None
    if via_sinks:
        call = kernel_call(name, call)
    if not candidates:
        return Route(name, None, None, f"no kernel of {name} is written for {target.kind.name}", via_sinks)
    workload = workload_of(name, call)
    if workload is None:
        return Route(name, None, None, why_none(name, call), via_sinks)
    rule = next((rule for rule in candidates if rule.serves(workload, target)), None)
    why = "" if rule is not None else f"no rule for {target.kind.name} builds this workload"
    return Route(name, workload, rule, why, via_sinks)


def tuned_legalize_map(target: tvm.target.Target, records: KnobSource | None = None, *,
                       rules: Sequence[KernelRule] | None = None) -> dict[str, Callable]:
    """op name -> legalization through the performance path (floor where no rule applies);
    ``rules`` replaces the default rules (the tests pass the CUDA rules' llvm emulation)."""
    # kernels built in this map, by (rule, workload, knobs): a model's identical calls (one per
    # layer) parse one TVMScript kernel, not one each (~0.5 s a kernel)
    built: dict[tuple, tirx.PrimFunc] = {}

    def kernel(rule: KernelRule, workload: Workload, knobs: Mapping[str, int]) -> tirx.PrimFunc:
        key = (id(rule), workload, tuple(sorted(knobs.items())))
        if key not in built:
            built[key] = rule.kernel(workload, knobs)
        return built[key]

    def legalize_with(name: str):
        def legalize(bb: relax.BlockBuilder, call: relax.Call) -> relax.Expr:
            if name in _SINK_RESCALED and SPECS[name].split_args(call).get("sinks") is not None:
                return _with_sinks(bb, name, call, legalize_with)
            found = route(name, call, target, rules)
            if found.rule is None:
                return LEGALIZE[name](bb, call)
            knobs, attrs = knobs_for(found, target, records)
            func = kernel(found.rule, found.workload, knobs)
            for key, value in attrs.items():
                func = func.with_attr(key, value)
            args = _with_forward_state(bb, name, call, legalize_with) if found.rule.needs_forward_state else None
            return emit_kernel(bb, name, call, func, args)

        return legalize

    return {spec.op_name: legalize_with(name) for name, spec in SPECS.items()}


def knobs_for(found: Route, target: tvm.target.Target, records: KnobSource | None
              ) -> tuple[dict[str, int], dict[str, str]]:
    """The knobs of a routed call's kernel (a fitting record's, else the rule's hand-picked ones) and
    the attributes that say so on its PrimFunc."""
    rule, workload = found.rule, found.workload
    knobs, source, match = rule.knobs(workload, target), "hand-picked", None
    record = records.lookup(workload, target) if records is not None else None
    if record is not None:
        try:
            knobs, source, match = rule.knobs(workload, target, record.knobs), record.source, record
        except ValueError as err:
            # a bucket neighbour's knobs may not fit (e.g. decode knobs for more rows): normal,
            # silent; an exact record that does not fit is worth a warning
            if record.exact:
                warnings.warn(f"tvm_fuel: record in {record.source} does not fit {workload.describe()} "
                              f"({err}); hand-picked knobs are used", TuningLogWarning, stacklevel=3)
    attrs = {"fuel.knobs": source, "fuel.knob_values": json.dumps(knobs, sort_keys=True),
             "fuel.workload": workload.describe()}
    if match is not None:
        attrs["fuel.match"] = "exact" if match.exact else "bucket"
        if match.tuned is not None:
            attrs["fuel.tuned_at"] = match.tuned.dims_label()
    return knobs, attrs


def kernel_call(name: str, call: relax.Call) -> relax.Call:
    """The call whose kernel serves ``call`` (of op ``name``): a dense or varlen call with sinks runs
    the sink-free kernels (the forward's with lse, which the rescale needs); any other call is itself.
    What tuning measures for it."""
    spec = SPECS[name]
    if name not in _SINK_RESCALED or spec.split_args(call).get("sinks") is None:
        return call
    return spec.replace(call, {"sinks": None}, **({"return_lse": True} if name in _SINK_FORWARDS else {}))


def emit_kernel(bb: relax.BlockBuilder, name: str, call: relax.Call, func: tirx.PrimFunc,
                args: dict | None = None) -> relax.Expr:
    """Call a performance-path PrimFunc whose parameters are the op's present arguments, in
    order, followed by its outputs, after the floor's host-side checks. ``args`` overrides the
    call's arguments by name."""
    spec = SPECS[name]
    args = checked_dims(bb, name, dict(args) if args is not None else spec.split_args(call))
    if name == "paged_attn":
        args["context_lens"] = checked_context_lens(bb, args)
    if name in ("flash_attn_varlen", "flash_attn_varlen_backward"):
        # the kernels read FlashAttention's int32 offsets: wider ones pass the check first (CPU
        # targets: within the packed rows and below 2**31); on GPUs a value that wraps is clamped
        # by the kernels as any bad offset is
        args = checked_cu_seqlens(bb, call, args, int32_rows=True)
        for n in ("cu_seqlens_q", "cu_seqlens_k"):
            if str(args[n].ty.dtype) != "int32":
                args[n] = bb.emit(relax.op.astype(args[n], "int32"))
    inputs = [args[n] for n in spec.required + spec.optional if args[n] is not None]
    out_ty = list(call.ty.fields) if isinstance(call.ty, tvm.ir.TupleType) else call.ty
    gvar = added_function(bb, func, f"fuel_{name}_kernel")
    return relax.call_tir(gvar, inputs, out_ty=out_ty)


def _with_sinks(bb: relax.BlockBuilder, name: str, call: relax.Call, legalize_with) -> relax.Expr:
    """A call with sinks through the sink-free kernels (``tvm_fuel.op.sinks``): the forward
    kernel's out and lse rescaled; the backward kernels given the sinks' out and lse."""
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


__all__ = ["Route", "route", "knobs_for", "tuned_legalize_map", "kernel_call", "emit_kernel"]
