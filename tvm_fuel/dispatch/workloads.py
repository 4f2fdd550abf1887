"""A fuel call's ``Workload``: the kernel instance it needs, read from its Relax types and attributes.

The first step of the route (``dispatch.routing``): the same for every target, so a rule only says
whether it builds the workload (``KernelRule.serves``). None where no kernel can take the call:
a dim the kernels are specialised on is symbolic (heads, head dim, a paged cache's block size, a
norm's features), or the call has sinks (``routing.tuned_legalize_map`` gives the kernels the
sink-free call and rescales their results).

Contents:
    workload_of    -- op name + call -> Workload | None (every op a rule serves)
    why_none       -- why ``workload_of`` gave None, in words (``dispatch.explain``)
    static_dims    -- a tensor argument's dims, None for a symbolic one
    dense_spec     -- the KernelSpec of a dense attention call
"""

from __future__ import annotations

from tvm import relax, tirx

from ..op import SPECS
from ..op.config import AttnConfig
from ..schedules.cpu.tangent import COTANGENTS, JVP_TANGENTS
from ..schedules.workload import KernelSpec, NormSpec, Workload

_DENSE_BACKWARDS = ("flash_attn_backward", "flash_attn_backward_q", "flash_attn_backward_k", "flash_attn_backward_v")
_NORM_BACKWARDS = ("layer_norm_backward", "rms_norm_backward")


def static_dims(expr: relax.Expr) -> list[int | None] | None:
    """The dims of a tensor argument, None for a symbolic one; None if the shape is unknown."""
    ty = expr.ty
    if not isinstance(ty, relax.TensorType) or ty.shape is None:
        return None
    return [int(d) if isinstance(d, tirx.IntImm) else None for d in ty.shape.values]


def workload_of(op: str, call: relax.Call) -> Workload | None:
    """The workload of a call of fuel op ``op`` (its name without ``relax.fuel.``); None where no
    kernel can take it (``why_none`` says why) or no kernel exists for the op."""
    if op == "flash_attn":
        return _dense(op, call)
    if op in _DENSE_BACKWARDS:
        return _dense(op, call, grads=SPECS[op].grads)
    if op == "flash_attn_jvp":
        return _dense(op, call, grads=_present(call, op, JVP_TANGENTS))
    if op == "flash_attn_double_backward":
        return _dense(op, call, grads=_present(call, op, COTANGENTS))
    if op == "paged_attn":
        return _paged(call)
    if op in ("flash_attn_varlen", "flash_attn_varlen_backward"):
        return _varlen(op, call)
    if op in _NORM_BACKWARDS:
        return _norm(op, call)
    return None


def why_none(op: str, call: relax.Call) -> str:
    """Why ``workload_of(op, call)`` is None, in words."""
    args = SPECS[op].split_args(call)
    if args.get("sinks") is not None and op != "paged_attn":
        return "a call with sinks runs the sink-free kernels (its own workload is theirs)"
    if op in _NORM_BACKWARDS:
        return "x must be 2-D [N, C] with a static C"
    if op == "paged_attn":
        return "the heads, head dim and block size must be static"
    if op in ("flash_attn_varlen", "flash_attn_varlen_backward", "flash_attn", "flash_attn_jvp",
              "flash_attn_double_backward", *_DENSE_BACKWARDS):
        return "the heads and head dim (and an attn_mask's shape) must be static"
    return f"no kernel is written for {op}"


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


def _dense(op: str, call: relax.Call, *, grads: tuple[str, ...] = ()) -> Workload | None:
    """A dense attention call (forward or backward): dims B, Sq, Sk."""
    spec = dense_spec(op, call, return_lse=bool(call.attrs.get("return_lse", False)))
    if spec is None:
        return None
    q, k = static_dims(call.args[0]), static_dims(call.args[1])
    return Workload(op, spec, _runtime_dims(B=q[0], Sq=q[2], Sk=k[2]), grads)


def _paged(call: relax.Call) -> Workload | None:
    """A paged_attn call; None if its heads, head dim or block size is symbolic."""
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


def _varlen(op: str, call: relax.Call) -> Workload | None:
    """A flash_attn_varlen or flash_attn_varlen_backward call (dims total_q, total_k, B + 1, and the
    call's max_seqlen_q, max_seqlen_k; the backward's grads dq, dk, dv). Offsets of any integer
    dtype: the kernels are given them as int32 (``dispatch.routing.emit_kernel``)."""
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


def _norm(op: str, call: relax.Call) -> Workload | None:
    """A layer_norm_backward or rms_norm_backward call over x [N, C] with a static C: dim N."""
    x = static_dims(SPECS[op].split_args(call)["x"])
    if x is None or len(x) != 2 or x[1] is None:
        return None
    return Workload(op, NormSpec(str(call.args[1].ty.dtype), x[1]), (("N", x[0] or None),))


def _present(call: relax.Call, op: str, names: tuple[str, ...]) -> tuple[str, ...]:
    """Which of the optional arguments ``names`` (tangents or cotangents) the call passes."""
    args = SPECS[op].split_args(call)
    return tuple(name for name in names if args[name] is not None)


def _runtime_dims(**dims: int | None) -> tuple[tuple[str, int | None], ...]:
    """A workload's runtime dims; a static 0 is kept symbolic: the tile sizes derived from a
    static dim assume at least one row, and the symbolic kernel handles empty tensors."""
    return tuple((name, size or None) for name, size in dims.items())


__all__ = ["workload_of", "why_none", "static_dims", "dense_spec"]
