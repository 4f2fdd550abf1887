"""Legalization (``FLegalize``) of the fuel ops to the TE decomposition: the correctness floor.

Each rule is a thin adapter: read the call's arguments and config, and emit ``bb.call_te`` on the
matching function of ``tvm_fuel.op.decompose``. Two host-side checks run first, on the floor and
before every kernel alike, so bad input raises instead of reading out of bounds:

- the dims that must agree (``tvm_fuel.op.dims``) but that type inference could not prove equal
  (symbolic ones) are compared when the module runs;
- paged attention's block table and context lengths are validated on CPU targets (a bad live
  block id or an oversized context), and so are varlen's cu_seqlens.

Contents:
    LEGALIZE     -- op name -> legalization function ``(bb, call) -> relax.Expr`` (the floor)
    checked_dims -- the run-time check of the dims type inference could not prove equal
    checked_cu_seqlens -- varlen's cu_seqlens validated (CPU targets)
    checked_context_lens -- paged attention's context_lens validated with its block table (CPU targets)
    added_function -- a PrimFunc added to the module once (an equal one is reused)

``tvm_fuel.dispatch`` runs the same checks before a kernel (``dispatch.routing.emit_kernel``).
"""

from __future__ import annotations

import functools

import tvm
import tvm_ffi
from tvm import relax, tirx
from tvm.script import tirx as T

from . import decompose, ragged
from .config import AttnConfig
from .dims import DimRule, dim_rules, positive_dims
from .spec import SPECS


def _config(name: str, call: relax.Call) -> AttnConfig:
    return AttnConfig.from_attrs(SPECS[name].label, call.attrs)


def _unproven(name: str, args: dict) -> tuple[list[DimRule], list[tuple[str, int, str]]]:
    """The rules between present arguments whose dims type inference could not prove equal, and
    the dims that must be >= 1 but are symbolic (static ones were checked by type inference)."""
    analyzer = tvm.sym.Analyzer()
    first = SPECS[name].required[0]
    pairs = []
    scale = args.get("k_scale")
    for rule in dim_rules(name, args[first].ty.ndim, scale_ndim=0 if scale is None else scale.ty.ndim):
        a, b = args.get(rule.arg), args.get(rule.ref)
        if a is None or b is None:
            continue
        if not analyzer.can_prove_equal(a.ty.shape.values[rule.axis], b.ty.shape.values[rule.ref_axis]):
            pairs.append(rule)
    positive = [(arg, axis, what) for arg, axis, what in positive_dims(name)
                if not isinstance(args[arg].ty.shape.values[axis], tirx.IntImm)]
    return pairs, positive


# Noalias note: the host check functions below carry tirx.noalias like every legalized kernel (it
# holds: they only read their inputs and write fresh outputs). In TVM 0.27 one PrimFunc without it
# that sorts last by symbol strips noalias from every PrimFunc of the LLVM module (see
# build.MarkVacuousNoAlias): the CPU kernels built next to a check ran 3-5x slower.


@functools.lru_cache(maxsize=None)
def _dims_check_func(op: str, rules: tuple[DimRule, ...], positive: tuple[tuple[str, int, str], ...],
                     tensors: tuple[tuple[str, str, int], ...]):
    """A host PrimFunc over ``tensors`` ((name, dtype, ndim), the first one passed through in
    place) that raises ValueError naming the op and the arguments when a rule's dims differ or a
    dim that must be positive is 0. It reads shapes only, never data: it runs on the host for
    any target."""
    # written as TVMScript text: the number of parameters varies with the arguments present
    dims = {name: [f"{name}_shape{axis}" for axis in range(ndim)] for name, _, ndim in tensors}
    lines = ["@T.prim_func(private=True)", f"def check({', '.join(f'{n}_handle: T.handle' for n, _, _ in tensors)}):",
             '    T.func_attr({"tirx.is_scheduled": True, "tirx.noalias": True})']  # see the noalias note above
    lines += [f"    {d} = T.int64()" for names in dims.values() for d in names]
    lines += [f"    T.match_buffer({n}_handle, ({', '.join(dims[n])},), {dtype!r})" for n, dtype, _ in tensors]
    checks = [(f"{dims[arg][axis]} >= T.int64(1)", f"{op}: the {what} of {arg!r} ({arg}.shape[{axis}]) must be >= 1")
              for arg, axis, what in positive]
    checks += [(f"{dims[r.arg][r.axis]} == {dims[r.ref][r.ref_axis]}", r.message(op)) for r in rules]
    lines += [f"    assert {condition}, ('ValueError', [{message!r}])" for condition, message in checks]
    return tvm.script.from_source("\n".join(lines), extra_vars={"T": T})


def checked_dims(bb: relax.BlockBuilder, name: str, args: dict) -> dict:
    """``args`` with its first tensor passed through a run-time check of the dims that must agree
    but that type inference could not prove equal (nothing is emitted where it proved them all).
    The check is one host call per op call; the pass-through orders it before the op's reads."""
    spec = SPECS[name]
    first = spec.required[0]
    rules, positive = _unproven(name, args)
    if not rules and not positive:
        return args
    names = [first] + sorted(({n for r in rules for n in (r.arg, r.ref)} | {p[0] for p in positive}) - {first})
    tensors = tuple((n, str(args[n].ty.dtype), args[n].ty.ndim) for n in names)
    check = _dims_check_func(spec.label, tuple(rules), tuple(positive), tensors)
    gvar = bb.add_func(check, f"fuel_{name}_check_dims")
    checked = dict(args)
    # in place: the check writes nothing, so its "output" is the first tensor itself (no copy), and
    # the op reads it through the check: a data dependency that orders the check first
    checked[first] = bb.emit(relax.call_tir_inplace(gvar, [args[n] for n in names], 0, args[first].ty))
    return checked


def _flash_attn(bb: relax.BlockBuilder, call: relax.Call) -> relax.Expr:
    a = checked_dims(bb, "flash_attn", SPECS["flash_attn"].split_args(call))
    fn = functools.partial(decompose.flash_attn, cfg=_config("flash_attn", call),
                           return_lse=bool(call.attrs["return_lse"]))
    return bb.call_te(fn, a["q"], a["k"], a["v"], a["alibi_slopes"], a["attn_mask"], a["sinks"],
                      primfunc_name_hint="fuel_flash_attn")


def _backward(name: str):
    grads = SPECS[name].grads

    def legalize(bb: relax.BlockBuilder, call: relax.Call) -> relax.Expr:
        a = checked_dims(bb, name, SPECS[name].split_args(call))
        fn = functools.partial(decompose.flash_attn_backward, cfg=_config(name, call), grads=grads)
        return bb.call_te(fn, a["q"], a["k"], a["v"], a["do"], a["alibi_slopes"], a["attn_mask"], a["out"],
                          a["lse"], a["sinks"], primfunc_name_hint=f"fuel_{name}")

    return legalize


@functools.lru_cache(maxsize=None)
def _paged_check_func(cache_dtype: str, table_dtype: str, lens_dtype: str) -> tvm.tirx.PrimFunc:
    """A host PrimFunc that validates the live part of the block table and returns context_lens."""

    # fmt: off
    @T.prim_func
    def fuel_paged_attn_check(k_cache: T.handle, block_table: T.handle, context_lens: T.handle,
                              checked_lens: T.handle):
        T.func_attr({"tirx.noalias": True})  # see the noalias note above _dims_check_func
        num_blocks, block_size, hkv, d = T.int64(), T.int64(), T.int64(), T.int64()
        batch, max_blocks = T.int64(), T.int64()
        T.match_buffer(k_cache, (num_blocks, block_size, hkv, d), cache_dtype)
        table = T.match_buffer(block_table, (batch, max_blocks), table_dtype)
        lens = T.match_buffer(context_lens, (batch,), lens_dtype)
        out = T.match_buffer(checked_lens, (batch,), lens_dtype)
        for b in range(batch):
            assert T.Cast("int64", lens[b]) >= T.int64(0) and T.Cast("int64", lens[b]) <= max_blocks * block_size, \
                "fuel.paged_attn: context_lens[b] must be in [0, max_blocks * block_size] (the block table's capacity)"
            # the live blocks alone (what the kernels read): a table's capacity may be millions of entries
            for n in range((T.Cast("int64", lens[b]) + block_size - T.int64(1)) // block_size):
                assert T.Cast("int64", table[b, n]) >= T.int64(0) and T.Cast("int64", table[b, n]) < num_blocks, \
                    "fuel.paged_attn: block_table[b, n] of a live block must be a block id in [0, num_blocks)"
            out[b] = lens[b]
    # fmt: on

    return fuel_paged_attn_check


def _on_gpu() -> bool:
    target = tvm.target.Target.current(allow_none=True)
    return target is not None and "gpu" in [str(key) for key in target.keys]


def checked_context_lens(bb: relax.BlockBuilder, args: dict) -> relax.Expr:
    """context_lens, validated with the block table first on CPU targets (see module docstring)."""
    lens = args["context_lens"]
    if _on_gpu():  # device kernels cannot assert; there the kernels only clamp
        return lens
    check = _paged_check_func(str(args["k_cache"].ty.dtype), str(args["block_table"].ty.dtype), str(lens.ty.dtype))
    gvar = bb.add_func(check, "fuel_paged_attn_check")
    return bb.emit(relax.call_tir(gvar, [args["k_cache"], args["block_table"], lens], out_ty=lens.ty))


def _live_len(bb: relax.BlockBuilder, args: dict, lens: relax.Expr) -> tirx.Var:
    """A variable bound at run time to the longest context (``decompose.paged_live_len``): the
    floor's buffers are sized by it, so they scale with the live context, not the table."""
    longest = bb.emit(bb.call_te(decompose.paged_live_len, args["block_table"], lens, args["k_cache"].ty.shape[1],
                                 primfunc_name_hint="fuel_paged_attn_live_len"))
    live_len = tirx.Var("live_len", "int64")
    bb.match_cast(bb.emit(relax.op.tensor_to_shape(longest)), relax.ShapeType([live_len]))
    return live_len


def _paged_attn(bb: relax.BlockBuilder, call: relax.Call) -> relax.Expr:
    a = checked_dims(bb, "paged_attn", SPECS["paged_attn"].split_args(call))
    lens = checked_context_lens(bb, a)
    fn = functools.partial(decompose.paged_attn, cfg=_config("paged_attn", call))
    # live_len through call_te (not the partial): call_te passes the variables it is given to the PrimFunc
    return bb.call_te(fn, a["q"], a["k_cache"], a["v_cache"], a["block_table"], lens, a["alibi_slopes"],
                      a["sinks"], a["k_scale"], a["v_scale"], live_len=_live_len(bb, a, lens),
                      primfunc_name_hint="fuel_paged_attn")


@functools.lru_cache(maxsize=None)
def _varlen_check_func(op: str, q_dtype: str, cu_dtype: str, max_seqlen_q: int, max_seqlen_k: int,
                       int32_rows: bool = False) -> tvm.tirx.PrimFunc:
    """A host PrimFunc that validates both cu_seqlens (start at 0, never decrease, end within the
    packed rows, each sequence within max_seqlen where given; ``int32_rows``: end below 2**31, as
    the kernels' int32 offsets must) and returns them."""
    order = op + ": {} must start at 0, never decrease and end at most at {}.shape[0]"
    order_q, order_k = order.format("cu_seqlens_q", "q"), order.format("cu_seqlens_k", "k")
    bound_q = f"{op}: a sequence of cu_seqlens_q is longer than max_seqlen_q"
    bound_k = f"{op}: a sequence of cu_seqlens_k is longer than max_seqlen_k"
    limit_q, limit_k = max_seqlen_q if max_seqlen_q > 0 else 2 ** 62, max_seqlen_k if max_seqlen_k > 0 else 2 ** 62
    rows = f"{op}: the kernels take int32 offsets: cu_seqlens must end below 2**31 (kernels='decomposed' takes more)"

    # fmt: off
    @T.prim_func
    def fuel_flash_attn_varlen_check(q: T.handle, k: T.handle, cu_q: T.handle, cu_k: T.handle, cu_q_out: T.handle,
                                     cu_k_out: T.handle):
        T.func_attr({"tirx.noalias": True})  # see the noalias note above _dims_check_func
        total_q, hq, d, n = T.int64(), T.int64(), T.int64(), T.int64()
        total_k, hkv, dk = T.int64(), T.int64(), T.int64()
        T.match_buffer(q, (total_q, hq, d), q_dtype)
        T.match_buffer(k, (total_k, hkv, dk), q_dtype)
        offsets_q = T.match_buffer(cu_q, (n,), cu_dtype)
        offsets_k = T.match_buffer(cu_k, (n,), cu_dtype)
        checked_q = T.match_buffer(cu_q_out, (n,), cu_dtype)
        checked_k = T.match_buffer(cu_k_out, (n,), cu_dtype)
        assert T.Cast("int64", offsets_q[0]) == T.int64(0) and T.Cast("int64", offsets_q[n - 1]) <= total_q, order_q
        assert T.Cast("int64", offsets_k[0]) == T.int64(0) and T.Cast("int64", offsets_k[n - 1]) <= total_k, order_k
        if int32_rows:  # a wider offset past int32 would wrap in the kernels' cast
            assert T.Cast("int64", offsets_q[n - 1]) < T.int64(2 ** 31), rows
            assert T.Cast("int64", offsets_k[n - 1]) < T.int64(2 ** 31), rows
        for b in range(n - 1):
            len_q: T.int64 = T.Cast("int64", offsets_q[b + 1]) - T.Cast("int64", offsets_q[b])
            len_k: T.int64 = T.Cast("int64", offsets_k[b + 1]) - T.Cast("int64", offsets_k[b])
            assert len_q >= T.int64(0), order_q
            assert len_k >= T.int64(0), order_k
            assert len_q <= T.int64(limit_q), bound_q
            assert len_k <= T.int64(limit_k), bound_k
        for b in range(n):
            checked_q[b] = offsets_q[b]
            checked_k[b] = offsets_k[b]
    # fmt: on

    return fuel_flash_attn_varlen_check


def checked_cu_seqlens(bb: relax.BlockBuilder, call: relax.Call, args: dict, *, int32_rows: bool = False) -> dict:
    """``args`` with both cu_seqlens validated first on CPU targets (device kernels cannot
    assert; there the floor and the kernels clamp every index they read from them)."""
    if _on_gpu():
        return args
    cu_q, cu_k = args["cu_seqlens_q"], args["cu_seqlens_k"]
    if str(cu_q.ty.dtype) != str(cu_k.ty.dtype):  # both widened to int64: a narrowing cast could wrap a bad offset
        cu_q, cu_k = (bb.emit(relax.op.astype(cu, "int64")) for cu in (cu_q, cu_k))
    check = _varlen_check_func(call.op.name.replace("relax.", ""), str(args["q"].ty.dtype), str(cu_q.ty.dtype),
                               int(call.attrs["max_seqlen_q"]), int(call.attrs["max_seqlen_k"]),
                               int32_rows and str(cu_q.ty.dtype) != "int32")
    # the forward's and the backward's checks differ in their messages: each keeps its own symbol
    gvar = added_function(bb, check, "fuel_flash_attn_varlen_check")
    both = bb.emit(relax.call_tir(gvar, [args["q"], args["k"], cu_q, cu_k], out_ty=[cu_q.ty, cu_q.ty]))
    return {**args, "cu_seqlens_q": bb.emit(relax.TupleGetItem(both, 0)),
            "cu_seqlens_k": bb.emit(relax.TupleGetItem(both, 1))}


def _varlen_live_lens(bb: relax.BlockBuilder, args: dict) -> tuple[tirx.Var, tirx.Var]:
    """Variables bound at run time to the longest query and key sequences (``ragged.varlen_live_lens``)."""
    longest = bb.emit(bb.call_te(ragged.varlen_live_lens, args["q"], args["k"], args["cu_seqlens_q"],
                                 args["cu_seqlens_k"], primfunc_name_hint="fuel_flash_attn_varlen_live_lens"))
    max_q, max_k = tirx.Var("max_q", "int64"), tirx.Var("max_k", "int64")
    bb.match_cast(bb.emit(relax.op.tensor_to_shape(longest)), relax.ShapeType([max_q, max_k]))
    return max_q, max_k


def _flash_attn_varlen(bb: relax.BlockBuilder, call: relax.Call) -> relax.Expr:
    a = checked_cu_seqlens(bb, call, checked_dims(bb, "flash_attn_varlen", SPECS["flash_attn_varlen"].split_args(call)))
    _, max_k = _varlen_live_lens(bb, a)
    fn = functools.partial(ragged.flash_attn_varlen, cfg=_config("flash_attn_varlen", call),
                           return_lse=bool(call.attrs["return_lse"]))
    return bb.call_te(fn, a["q"], a["k"], a["v"], a["cu_seqlens_q"], a["cu_seqlens_k"], a["alibi_slopes"],
                      a["sinks"], max_k=max_k, primfunc_name_hint="fuel_flash_attn_varlen")


def _flash_attn_varlen_backward(bb: relax.BlockBuilder, call: relax.Call) -> relax.Expr:
    name = "flash_attn_varlen_backward"
    a = checked_cu_seqlens(bb, call, checked_dims(bb, name, SPECS[name].split_args(call)))
    max_q, max_k = _varlen_live_lens(bb, a)
    fn = functools.partial(ragged.flash_attn_varlen_backward, cfg=_config(name, call))
    return bb.call_te(fn, *(a[n] for n in SPECS[name].required + SPECS[name].optional), max_q=max_q, max_k=max_k,
                      primfunc_name_hint=f"fuel_{name}")


def added_function(bb: relax.BlockBuilder, func: tirx.PrimFunc, name: str) -> relax.GlobalVar:
    """The global var of ``func`` (a kernel or a host check) in the module: the one of an equal
    function added before (a model's layers call one kernel, compiled once), else a new one named
    from ``name``. Its symbol is the global var's name (two instances of one template would
    otherwise share the template's), which is why BlockBuilder's own deduplication, before the
    symbol is set, never finds the first."""
    plain = func.without_attr("global_symbol")
    for gvar, existing in bb.get().functions.items():
        if (gvar.name_hint.startswith(name) and isinstance(existing, tirx.PrimFunc)
                and tvm_ffi.structural_equal(existing.without_attr("global_symbol"), plain)):
            return gvar
    gvar = bb.add_func(plain, name)
    bb.update_func(gvar, func.with_attr("global_symbol", gvar.name_hint))
    return gvar


def _flash_attn_jvp(bb: relax.BlockBuilder, call: relax.Call) -> relax.Expr:
    a = checked_dims(bb, "flash_attn_jvp", SPECS["flash_attn_jvp"].split_args(call))
    fn = functools.partial(decompose.flash_attn_jvp, cfg=_config("flash_attn_jvp", call),
                           return_lse=bool(call.attrs["return_lse"]))
    return bb.call_te(fn, a["q"], a["k"], a["v"], a["q_dot"], a["k_dot"], a["v_dot"], a["alibi_slopes"],
                      a["attn_mask"], primfunc_name_hint="fuel_flash_attn_jvp")


def _flash_attn_double_backward(bb: relax.BlockBuilder, call: relax.Call) -> relax.Expr:
    name = "flash_attn_double_backward"
    a = checked_dims(bb, name, SPECS[name].split_args(call))
    fn = functools.partial(decompose.flash_attn_double_backward, cfg=_config(name, call))
    return bb.call_te(fn, *(a[n] for n in SPECS[name].required + SPECS[name].optional),
                      primfunc_name_hint=f"fuel_{name}")


def _softmax_backward(bb: relax.BlockBuilder, call: relax.Call) -> relax.Expr:
    a = checked_dims(bb, "softmax_backward", SPECS["softmax_backward"].split_args(call))
    fn = functools.partial(decompose.softmax_backward, axis=int(call.attrs["axis"]))
    return bb.call_te(fn, a["probs"], a["dprobs"], primfunc_name_hint="fuel_softmax_backward")


def _norm_backward(name: str):
    """The floor of layer_norm_backward / rms_norm_backward: one PrimFunc per reduction or map
    (row means, dx, column sums), each a pattern the default schedules serve."""
    weight = "gamma" if name == "layer_norm_backward" else "weight"

    def legalize(bb: relax.BlockBuilder, call: relax.Call) -> relax.Expr:
        a = checked_dims(bb, name, SPECS[name].split_args(call))
        dy, x, w, mean, rstd = a["dy"], a["x"], a[weight], a.get("mean"), a["rstd"]

        def te(fn, *args, hint, **kwargs):
            return bb.emit(bb.call_te(functools.partial(fn, **kwargs), *args, primfunc_name_hint=f"fuel_{name}_{hint}"))

        row_mean = functools.partial(te, decompose.norm_backward_row_mean, dy, x, w, mean, rstd)
        g_mean = None if mean is None else row_mean(hint="g_mean", times_x_hat=False)
        gx_mean = row_mean(hint="gx_mean", times_x_hat=True)
        dx = te(decompose.norm_backward_dx, dy, x, w, mean, rstd, g_mean, gx_mean, hint="dx")
        column_sum = functools.partial(te, decompose.norm_backward_column_sum, dy, x, mean, rstd)
        grads = [dx, column_sum(hint="dweight", times_x_hat=True)]
        if mean is not None:
            grads.append(column_sum(hint="dbias", times_x_hat=False))
        return relax.Tuple(grads)

    return legalize


LEGALIZE = {
    "flash_attn": _flash_attn,
    "flash_attn_backward": _backward("flash_attn_backward"),
    "flash_attn_backward_q": _backward("flash_attn_backward_q"),
    "flash_attn_backward_k": _backward("flash_attn_backward_k"),
    "flash_attn_backward_v": _backward("flash_attn_backward_v"),
    "paged_attn": _paged_attn,
    "flash_attn_varlen": _flash_attn_varlen,
    "flash_attn_varlen_backward": _flash_attn_varlen_backward,
    "softmax_backward": _softmax_backward,
    "flash_attn_jvp": _flash_attn_jvp,
    "flash_attn_double_backward": _flash_attn_double_backward,
    "layer_norm_backward": _norm_backward("layer_norm_backward"),
    "rms_norm_backward": _norm_backward("rms_norm_backward"),
}
