"""The contract of a performance-path kernel rule (dlight's, applied to a Relax call).

A rule matches one fuel op on one kind of target. ``workload`` says which kernel instance a call
needs (None when the call is not the rule's to handle: another rule, or the floor, then serves
it); ``kernel`` builds that instance from knobs (tile sizes, vector width, splits, ...);
``default_knobs`` are the hand-picked ones and ``knob_space`` the candidates MetaSchedule samples
(the hand-picked knobs are one point of it). Rules never raise on a mismatch.
"""

from __future__ import annotations

from typing import Mapping, Sequence

import tvm
from tvm import relax, tirx

from ..op.config import AttnConfig
from ..op import SPECS
from .workload import KernelSpec, Workload

Knobs = Mapping[str, int]


class KernelRule:
    """Base class: ``apply(call, target) -> PrimFunc | None`` for the op named ``op``."""

    op: str = ""
    target_kinds: Sequence[str] = ()
    needs_forward_state = False  # the kernel takes the forward's out and lse (backward kernels)
    tunable = True  # MetaSchedule tunes its knobs (``tvm_fuel.tune``); else hand-picked only

    def is_target_available(self, target: tvm.target.Target) -> bool:
        return target.kind.name in self.target_kinds

    def workload(self, call: relax.Call, target: tvm.target.Target) -> Workload | None:
        """The kernel instance ``call`` needs on ``target``; None if this rule does not serve it."""
        raise NotImplementedError

    def default_knobs(self, workload: Workload, target: tvm.target.Target) -> dict[str, int]:
        """The hand-picked knobs (every knob the kernel reads)."""
        raise NotImplementedError

    def knob_space(self, workload: Workload, target: tvm.target.Target) -> dict[str, tuple[int, ...]]:
        """Candidates per tunable knob; each contains the hand-picked value."""
        raise NotImplementedError

    def check_knobs(self, workload: Workload, knobs: Knobs) -> str | None:
        """Why ``knobs`` cannot build this workload's kernel, or None when they can."""
        raise NotImplementedError

    def knobs(self, workload: Workload, target: tvm.target.Target, tuned: Knobs | None = None) -> dict[str, int]:
        """The hand-picked knobs with ``tuned`` values in place; ``tuned`` may only set knobs of this
        workload's space, each to one of its candidates or its hand-picked value (the points the
        tuner samples). ValueError (naming op and reason) when the result cannot build the kernel."""
        space = self.knob_space(workload, target)
        tuned = dict(tuned or {})
        foreign = sorted(set(tuned) - set(space))
        if foreign:
            raise ValueError(f"{self.op}: knobs {foreign} are not in this kernel's space {sorted(space)}")
        defaults = self.default_knobs(workload, target)
        for name, value in tuned.items():
            # a value the space does not offer may build, but may also fail to compile or compile for
            # minutes (value_tokens 1000: 81 s): a record is trusted no further than the tuner's own points
            allowed = sorted({*space[name], defaults[name]})
            if isinstance(value, bool) or not isinstance(value, int) or value not in allowed:
                raise ValueError(f"{self.op}: knob {name} = {value!r} is not one of its candidates {allowed}")
        full = {**defaults, **tuned}
        problem = self.check_knobs(workload, full)
        if problem:
            raise ValueError(f"{self.op}: {problem}")
        return full

    def kernel(self, workload: Workload, knobs: Knobs, *, static: bool = False) -> tirx.PrimFunc:
        """The PrimFunc for ``workload`` with ``knobs``; ``static`` fixes the runtime dims to
        the workload's (what tuning measures); otherwise they stay symbolic."""
        raise NotImplementedError

    def apply(self, call: relax.Call, target: tvm.target.Target) -> tirx.PrimFunc | None:
        """The kernel for ``call`` with the hand-picked knobs, or None."""
        workload = self.workload(call, target)
        return None if workload is None else self.kernel(workload, self.default_knobs(workload, target))


def static_dims(expr: relax.Expr) -> list[int | None] | None:
    """The dims of a tensor argument, None for a symbolic one; None if the shape is unknown."""
    ty = expr.ty
    if not isinstance(ty, relax.TensorType) or ty.shape is None:
        return None
    return [int(d) if isinstance(d, tirx.IntImm) else None for d in ty.shape.values]


def dense_spec(op: str, call: relax.Call, *, return_lse: bool = False) -> KernelSpec | None:
    """The spec of a dense attention call (forward or backward); None if a dim it needs is symbolic."""
    args = SPECS[op].split_args(call)
    q, k = static_dims(args["q"]), static_dims(args["k"])
    if q is None or k is None or None in (q[1], q[3], k[1]):
        return None  # heads and head dim must be static
    if args.get("sinks") is not None:
        return None  # no kernel takes sinks: tuned_legalize_map rescales the sink-free kernels' results
    mask, mask_dtype, broadcast = args["attn_mask"], None, ()
    if mask is not None:
        dims = static_dims(mask)
        if dims is None:
            return None
        mask_dtype, broadcast = str(mask.ty.dtype), tuple(d == 1 for d in dims)
    return KernelSpec(
        dtype=str(args["q"].ty.dtype), num_q_heads=q[1], num_kv_heads=k[1], head_dim=q[3],
        cfg=AttnConfig.from_attrs(SPECS[op].label, call.attrs), has_alibi=args["alibi_slopes"] is not None,
        mask_dtype=mask_dtype, mask_broadcast=broadcast, return_lse=return_lse)


def paged_workload(call: relax.Call) -> Workload | None:
    """The workload of a paged_attn call; None if its heads, head dim or block size is symbolic."""
    args = SPECS["paged_attn"].split_args(call)
    q, cache, table = static_dims(args["q"]), static_dims(args["k_cache"]), static_dims(args["block_table"])
    if q is None or cache is None or table is None or None in (q[1], q[3], cache[1], cache[2]):
        return None
    cache_dtype = str(args["k_cache"].ty.dtype)
    scale = args["k_scale"]
    kv_scale = "" if scale is None else {0: "tensor", 1: "head", 3: "token"}[scale.ty.ndim]  # ranks type-checked
    spec = KernelSpec(
        dtype=str(args["q"].ty.dtype), num_q_heads=q[1], num_kv_heads=cache[2], head_dim=q[3],
        cfg=AttnConfig.from_attrs(SPECS["paged_attn"].label, call.attrs),
        has_alibi=args["alibi_slopes"] is not None, block_size=cache[1], has_sinks=args["sinks"] is not None,
        table_dtype=str(args["block_table"].ty.dtype), lens_dtype=str(args["context_lens"].ty.dtype),
        cache_dtype=cache_dtype if cache_dtype != str(args["q"].ty.dtype) else "", kv_scale=kv_scale)
    return Workload("paged_attn", spec, _runtime_dims(B=q[0], Sq=q[2], num_blocks=cache[0], max_blocks=table[1]))


def varlen_workload(call: relax.Call, op: str = "flash_attn_varlen") -> Workload | None:
    """The workload of a flash_attn_varlen (or, ``op``, flash_attn_varlen_backward) call (dims
    total_q, total_k, B + 1, and the call's max_seqlen_q, max_seqlen_k; the backward's grads dq, dk,
    dv); None where its heads or head dim are symbolic, or it has sinks (no kernel takes them:
    ``tuned_legalize_map`` gives the kernels the sink-free call and rescales their results). Offsets
    of any integer dtype: the kernels are given them as int32 (``op.legalize.emit_kernel``)."""
    args = SPECS[op].split_args(call)
    q, k, cu = static_dims(args["q"]), static_dims(args["k"]), static_dims(args["cu_seqlens_q"])
    if q is None or k is None or cu is None or None in (q[1], q[2], k[1]):
        return None
    if args["sinks"] is not None:
        return None
    backward = op == "flash_attn_varlen_backward"
    spec = KernelSpec(dtype=str(args["q"].ty.dtype), num_q_heads=q[1], num_kv_heads=k[1], head_dim=q[2],
                      cfg=AttnConfig.from_attrs(SPECS[op].label, call.attrs),
                      has_alibi=args["alibi_slopes"] is not None,
                      return_lse=False if backward else bool(call.attrs["return_lse"]))
    # the call's max_seqlen (0: not given) bound every sequence (the run-time check enforces them):
    # a batch of short sequences can take tiles of their size
    return Workload(op, spec, _runtime_dims(total_q=q[0], total_k=k[0], B1=cu[0],
                                            max_seqlen_q=int(call.attrs["max_seqlen_q"]),
                                            max_seqlen_k=int(call.attrs["max_seqlen_k"])),
                    ("dq", "dk", "dv") if backward else ())


def dense_workload(op: str, call: relax.Call, *, return_lse: bool = False, grads: tuple[str, ...] = ()
                   ) -> Workload | None:
    """The workload of a dense attention call (forward or backward): dims B, Sq, Sk."""
    spec = dense_spec(op, call, return_lse=return_lse)
    if spec is None:
        return None
    q, k = static_dims(call.args[0]), static_dims(call.args[1])
    return Workload(op, spec, _runtime_dims(B=q[0], Sq=q[2], Sk=k[2]), grads)


def _runtime_dims(**dims: int | None) -> tuple[tuple[str, int | None], ...]:
    """A workload's runtime dims; a static 0 is kept symbolic: the tile sizes derived from a
    static dim assume at least one row, and the symbolic kernel handles empty tensors."""
    return tuple((name, size or None) for name, size in dims.items())
