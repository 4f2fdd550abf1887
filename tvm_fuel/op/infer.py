"""Type inference (``FInferType``) of the fuel ops: shapes, symbolic dims and dtypes.

Every rejection names the op, the argument and what was expected. A dimension is rejected only
when it is provably wrong, so symbolic shapes pass; a tensor of unknown shape is accepted with
its rank checked, and ``tvm_fuel.compile`` reports it if it cannot be legalized.

Contents:
    INFER -- op name -> inference function ``(call, ctx) -> relax type``
"""

from __future__ import annotations

from typing import Sequence

import tvm
from tvm import relax, tirx
from tvm.ir import TupleType

from .config import FLOAT_DTYPES, INDEX_DTYPES, AttnConfig
from .dims import positive_dims
from .quant import QUANT_DTYPES
from .spec import SPECS, OpSpec


def _dim(d) -> str:
    return str(int(d)) if isinstance(d, tirx.IntImm) else str(d)


def _fmt(dims) -> str:
    return "[" + ", ".join(_dim(d) for d in dims) + "]"


class _Checker:
    """Reads the named arguments of one call and raises on the first violation."""

    def __init__(self, spec: OpSpec, call: relax.Call):
        self.spec = spec
        self.op = spec.label
        self.args = spec.split_args(call)
        self.attrs = call.attrs
        self._analyzer = tvm.sym.Analyzer()

    def tensor(self, name: str, *, layout: Sequence[str] | None, dtypes: Sequence[str]):
        """The TensorType of argument ``name`` (None if absent), rank and dtype checked."""
        arg = self.args[name]
        if arg is None:
            return None
        ty = arg.ty
        if not isinstance(ty, relax.TensorType):
            raise TypeError(f"{self.op}: argument {name!r} must be a tensor, got {ty}")
        if layout is not None and ty.ndim != -1 and ty.ndim != len(layout):
            raise ValueError(f"{self.op}: argument {name!r} must be {len(layout)}-D [{', '.join(layout)}], "
                             f"got a {ty.ndim}-D tensor")
        if str(ty.dtype) not in dtypes:
            raise TypeError(f"{self.op}: argument {name!r} must have dtype {' or '.join(dtypes)}, got {ty.dtype}")
        return ty

    def same_dtype(self, name: str, ty, ref_name: str, ref_ty):
        if ty is not None and str(ty.dtype) != str(ref_ty.dtype):
            raise TypeError(f"{self.op}: argument {name!r} must have the dtype of {ref_name!r} "
                            f"({ref_ty.dtype}), got {ty.dtype}")

    @staticmethod
    def dims(ty):
        return None if ty is None or ty.shape is None else list(ty.shape.values)

    def differ(self, a, b) -> bool:
        """True when ``a != b`` is provable (symbolic dims that may be equal pass)."""
        return bool(self._analyzer.can_prove(tirx.NE(a, b)))

    def expect_dim(self, what: str, name: str, got, ref_name: str, want):
        if self.differ(got, want):
            raise ValueError(
                f"{self.op}: {what} of {name!r} ({_dim(got)}) must equal that of {ref_name!r} ({_dim(want)})")

    def expect_shape(self, name: str, ty, want: Sequence, meaning: str):
        dims = self.dims(ty)
        if dims is None:
            return
        if len(dims) != len(want) or any(self.differ(a, b) for a, b in zip(dims, want)):
            raise ValueError(f"{self.op}: argument {name!r} must have shape {meaning} = {_fmt(want)}, got {_fmt(dims)}")

    def gqa(self, hq, hkv, kv_name: str):
        if isinstance(hq, tirx.IntImm) and isinstance(hkv, tirx.IntImm):
            if int(hkv) == 0 or int(hq) % int(hkv) != 0:
                raise ValueError(f"{self.op}: Hq ({int(hq)}) must be a multiple of Hkv ({int(hkv)}) "
                                 f"of argument {kv_name!r}")
        elif not self._analyzer.can_prove(tirx.EQ(tirx.floormod(hq, hkv), tirx.const(0, "int64"))):
            # the head map h // (Hq / Hkv) must stay inside the KV heads for every run-time shape
            raise ValueError(f"{self.op}: Hq ({_dim(hq)}) must be provably a multiple of Hkv ({_dim(hkv)}) "
                             f"of argument {kv_name!r}")

    def positive(self):
        """The dims that must be >= 1 (``tvm_fuel.op.dims``); symbolic ones are checked at run time."""
        for name, axis, what in positive_dims(self.spec.name):
            dims = self.dims(self.args[name].ty) if self.args[name] is not None else None
            if dims is not None and isinstance(dims[axis], tirx.IntImm) and int(dims[axis]) < 1:
                raise ValueError(f"{self.op}: the {what} of {name!r} must be >= 1, got {int(dims[axis])}")

    def config(self) -> AttnConfig:
        return AttnConfig.from_attrs(self.op, self.attrs)

    def alibi(self, hq):
        ty = self.tensor("alibi_slopes", layout=("Hq",), dtypes=("float32",))
        if ty is not None and hq is not None:
            self.expect_shape("alibi_slopes", ty, [hq], "[Hq]")

    def sinks(self, hq):
        """The optional ``sinks`` [Hq] float32 of the ops that take it."""
        if "sinks" not in self.args:
            return
        ty = self.tensor("sinks", layout=("Hq",), dtypes=("float32",))
        if ty is not None and hq is not None:
            self.expect_shape("sinks", ty, [hq], "[Hq]")

    def mask(self, full: Sequence | None):
        ty = self.tensor("attn_mask", layout=None, dtypes=("bool",) + FLOAT_DTYPES)
        if ty is None:
            return
        if ty.ndim in (-1, 0) or ty.ndim > 4:  # a 0-d mask would mask every logit alike: surely a mistake
            raise ValueError(f"{self.op}: argument 'attn_mask' must have 1 to 4 dims, broadcastable to "
                             f"[B, Hq, Sq, Sk], got {'unknown rank' if ty.ndim == -1 else f'{ty.ndim} dims'}")
        dims = self.dims(ty)
        if dims is None or full is None:
            return
        for got, want in zip(dims, full[4 - len(dims):]):
            # a broadcast dim must be a static 1: a symbolic one could be 1 or full at run time
            one = isinstance(got, tirx.IntImm) and int(got) == 1
            if not one and not self._analyzer.can_prove_equal(got, want):
                raise ValueError(f"{self.op}: argument 'attn_mask' of shape {_fmt(dims)} does not broadcast to "
                                 f"[B, Hq, Sq, Sk] = {_fmt(full)} (each dim must be 1 or equal the full dim)")


def _tensor(dims, dtype, ndim):
    return relax.TensorType(dims, dtype) if dims is not None else relax.TensorType(ndim=ndim, dtype=dtype)


def _dense_qkv(c: _Checker):
    """Checks q, k, v (+ alibi, mask, config) and returns their types and dims."""
    q = c.tensor("q", layout=("B", "Hq", "Sq", "D"), dtypes=FLOAT_DTYPES)
    k = c.tensor("k", layout=("B", "Hkv", "Sk", "D"), dtypes=FLOAT_DTYPES)
    v = c.tensor("v", layout=("B", "Hkv", "Sk", "D"), dtypes=FLOAT_DTYPES)
    c.same_dtype("k", k, "q", q)
    c.same_dtype("v", v, "q", q)
    c.positive()
    qd, kd, vd = c.dims(q), c.dims(k), c.dims(v)
    if qd is not None and kd is not None:
        c.expect_dim("batch B", "k", kd[0], "q", qd[0])
        c.expect_dim("head dim D", "k", kd[3], "q", qd[3])
        c.gqa(qd[1], kd[1], "k")
    if kd is not None and vd is not None:
        for axis, what in ((0, "batch B"), (1, "head count Hkv"), (2, "key length Sk")):
            c.expect_dim(what, "v", vd[axis], "k", kd[axis])
    if qd is not None and vd is not None:
        c.expect_dim("head dim D", "v", vd[3], "q", qd[3])
    c.config()
    c.alibi(qd[1] if qd is not None else None)
    c.sinks(qd[1] if qd is not None else None)
    c.mask(None if qd is None or kd is None else [qd[0], qd[1], qd[2], kd[2]])
    return q, k, v


def _infer_flash_attn(call, ctx):
    c = _Checker(SPECS["flash_attn"], call)
    q, _, _ = _dense_qkv(c)
    qd = c.dims(q)
    out = _tensor(qd, q.dtype, 4)
    if not bool(call.attrs["return_lse"]):
        return out
    return TupleType([out, _tensor(qd[:3] if qd is not None else None, "float32", 3)])


_Q_LAYOUT = ("B", "Hq", "Sq", "D")
_K_LAYOUT = ("B", "Hkv", "Sk", "D")


def _like(c: _Checker, names: Sequence[str], q, ref):
    """Checks the tensors ``names`` (those present): the dtype of q, the shape of ``ref`` (q or k)."""
    is_q = ref is q
    layout = _Q_LAYOUT if is_q else _K_LAYOUT
    meaning = "[B, Hq, Sq, D] of q" if is_q else "[B, Hkv, Sk, D] of k"
    ref_dims = c.dims(ref)
    types = []
    for name in names:
        ty = c.tensor(name, layout=layout, dtypes=FLOAT_DTYPES)
        c.same_dtype(name, ty, "q", q)
        if ty is not None and ref_dims is not None:
            c.expect_shape(name, ty, ref_dims, meaning)
        types.append(ty)
    return types


def _forward_state(c: _Checker, q):
    """Checks the backward's optional ``out`` (like q) and ``lse`` ([B, Hq, Sq] float32)."""
    _like(c, ("out",), q, q)
    qd = c.dims(q)
    lse = c.tensor("lse", layout=("B", "Hq", "Sq"), dtypes=("float32",))
    if lse is not None and qd is not None:
        c.expect_shape("lse", lse, qd[:3], "[B, Hq, Sq] of q")


def _backward_infer(name: str):
    def infer(call, ctx):
        c = _Checker(SPECS[name], call)
        q, k, v = _dense_qkv(c)
        _like(c, ("do",), q, q)
        _forward_state(c, q)
        types = dict(zip(("dq", "dk", "dv"), (_tensor(c.dims(t), t.dtype, 4) for t in (q, k, v))))
        grads = [types[g] for g in SPECS[name].grads]
        return TupleType(grads) if len(grads) > 1 else grads[0]

    return infer


def _infer_flash_attn_jvp(call, ctx):
    c = _Checker(SPECS["flash_attn_jvp"], call)
    q, k, _ = _dense_qkv(c)
    _like(c, ("q_dot",), q, q)
    _like(c, ("k_dot", "v_dot"), q, k)
    qd = c.dims(q)
    out = _tensor(qd, q.dtype, 4)
    fields = [out, out]
    if bool(call.attrs["return_lse"]):
        fields.append(_tensor(qd[:3] if qd is not None else None, "float32", 3))
    return TupleType(fields)


def _infer_flash_attn_double_backward(call, ctx):
    c = _Checker(SPECS["flash_attn_double_backward"], call)
    q, k, v = _dense_qkv(c)
    (do,) = _like(c, ("do",), q, q)
    _like(c, ("dq_bar",), q, q)
    _like(c, ("dk_bar", "dv_bar"), q, k)
    _forward_state(c, q)
    return TupleType([_tensor(c.dims(t), t.dtype, 4) for t in (q, k, v, do)])


def _infer_paged_attn(call, ctx):
    c = _Checker(SPECS["paged_attn"], call)
    q = c.tensor("q", layout=("B", "Hq", "Sq", "D"), dtypes=FLOAT_DTYPES)
    cache_layout = ("num_blocks", "block_size", "Hkv", "D")
    kc = c.tensor("k_cache", layout=cache_layout, dtypes=FLOAT_DTYPES + QUANT_DTYPES)
    vc = c.tensor("v_cache", layout=cache_layout, dtypes=FLOAT_DTYPES + QUANT_DTYPES)
    if str(kc.dtype) not in QUANT_DTYPES:
        c.same_dtype("k_cache", kc, "q", q)
    c.same_dtype("v_cache", vc, "k_cache", kc)
    table = c.tensor("block_table", layout=("B", "max_blocks"), dtypes=INDEX_DTYPES)
    lens = c.tensor("context_lens", layout=("B",), dtypes=INDEX_DTYPES)
    c.positive()
    qd, kd = c.dims(q), c.dims(kc)
    if kd is not None:
        c.expect_shape("v_cache", vc, kd, "[num_blocks, block_size, Hkv, D] of k_cache")
    if qd is not None and kd is not None:
        c.expect_dim("head dim D", "k_cache", kd[3], "q", qd[3])
        c.gqa(qd[1], kd[2], "k_cache")
    if qd is not None:
        td = c.dims(table)
        if td is not None:
            c.expect_dim("batch B", "block_table", td[0], "q", qd[0])
        c.expect_shape("context_lens", lens, qd[:1], "[B]")
    c.config()
    c.alibi(qd[1] if qd is not None else None)
    c.sinks(qd[1] if qd is not None else None)
    _kv_scales(c, kc)
    return _tensor(qd, q.dtype, 4)


def _kv_scales(c: _Checker, cache):
    """paged_attn's k_scale and v_scale: both or neither, float32; [] or [Hkv] for an fp8 cache,
    [num_blocks, block_size, Hkv] (required) for an int8 cache, none for a float cache."""
    dtype = str(cache.dtype)
    given = [name for name in ("k_scale", "v_scale") if c.args[name] is not None]
    if dtype not in QUANT_DTYPES:
        if given:
            raise ValueError(f"{c.op}: argument {given[0]!r} scales an 8-bit cache (float8_e4m3fn, float8_e5m2 "
                             f"or int8); k_cache is {dtype}")
        return
    if len(given) == 1:
        raise ValueError(f"{c.op}: k_scale and v_scale must be given together, got {given[0]!r} alone")
    if not given:
        if dtype == "int8":
            raise ValueError(f"{c.op}: an int8 cache needs k_scale and v_scale [num_blocks, block_size, Hkv] float32")
        return
    dims = c.dims(cache)
    want, meaning = ((3,), "[num_blocks, block_size, Hkv]") if dtype == "int8" else ((0, 1), "[] or [Hkv]")
    for name in given:
        ty = c.tensor(name, layout=None, dtypes=("float32",))
        if ty.ndim not in want:  # a known rank: it decides how the scale broadcasts
            raise ValueError(f"{c.op}: argument {name!r} of the {dtype} cache must be {meaning}, got "
                             f"{'a tensor of unknown rank' if ty.ndim == -1 else f'a {ty.ndim}-D tensor'}")
        if ty.ndim and dims is not None:
            c.expect_shape(name, ty, dims[3 - ty.ndim:3], f"{meaning} of the cache")
    if c.args["k_scale"].ty.ndim != c.args["v_scale"].ty.ndim:
        raise ValueError(f"{c.op}: k_scale and v_scale must have the same shape form, got "
                         f"{c.args['k_scale'].ty.ndim}-D and {c.args['v_scale'].ty.ndim}-D")


_PACKED_Q = ("total_q", "Hq", "D")


def _varlen_qkv(c: _Checker):
    """Checks flash_attn_varlen's q, k, v, cu_seqlens (+ alibi, sinks, config); returns q's type."""
    q = c.tensor("q", layout=_PACKED_Q, dtypes=FLOAT_DTYPES)
    k = c.tensor("k", layout=("total_k", "Hkv", "D"), dtypes=FLOAT_DTYPES)
    v = c.tensor("v", layout=("total_k", "Hkv", "D"), dtypes=FLOAT_DTYPES)
    c.same_dtype("k", k, "q", q)
    c.same_dtype("v", v, "q", q)
    cu_q = c.tensor("cu_seqlens_q", layout=("B + 1",), dtypes=INDEX_DTYPES)
    cu_k = c.tensor("cu_seqlens_k", layout=("B + 1",), dtypes=INDEX_DTYPES)
    c.positive()
    qd, kd, vd = c.dims(q), c.dims(k), c.dims(v)
    if qd is not None and kd is not None:
        c.expect_dim("head dim D", "k", kd[2], "q", qd[2])
        c.gqa(qd[1], kd[1], "k")
    if kd is not None:
        c.expect_shape("v", v, kd, "[total_k, Hkv, D] of k")
    elif qd is not None and vd is not None:
        c.expect_dim("head dim D", "v", vd[2], "q", qd[2])
    cd = c.dims(cu_q)
    if cd is not None:
        c.expect_shape("cu_seqlens_k", cu_k, cd, "[B + 1] of cu_seqlens_q")
    c.config()
    c.alibi(qd[1] if qd is not None else None)
    c.sinks(qd[1] if qd is not None else None)
    return q


def _packed_lse(qd):
    return _tensor([qd[1], qd[0]] if qd is not None else None, "float32", 2)


def _infer_flash_attn_varlen(call, ctx):
    c = _Checker(SPECS["flash_attn_varlen"], call)
    q = _varlen_qkv(c)
    out = _tensor(c.dims(q), q.dtype, 3)
    return TupleType([out, _packed_lse(c.dims(q))]) if bool(call.attrs["return_lse"]) else out


def _infer_flash_attn_varlen_backward(call, ctx):
    c = _Checker(SPECS["flash_attn_varlen_backward"], call)
    q = _varlen_qkv(c)
    qd = c.dims(q)
    for name in ("do", "out"):
        ty = c.tensor(name, layout=_PACKED_Q, dtypes=FLOAT_DTYPES)
        c.same_dtype(name, ty, "q", q)
        if ty is not None and qd is not None:
            c.expect_shape(name, ty, qd, "[total_q, Hq, D] of q")
    lse = c.tensor("lse", layout=("Hq", "total_q"), dtypes=("float32",))
    if lse is not None and qd is not None:
        c.expect_shape("lse", lse, [qd[1], qd[0]], "[Hq, total_q] of q")
    return TupleType([_tensor(c.dims(c.args[n].ty), q.dtype, 3) for n in ("q", "k", "v")])


def _infer_softmax_backward(call, ctx):
    c = _Checker(SPECS["softmax_backward"], call)
    p = c.tensor("probs", layout=None, dtypes=FLOAT_DTYPES)
    dp = c.tensor("dprobs", layout=None, dtypes=FLOAT_DTYPES)
    c.same_dtype("dprobs", dp, "probs", p)
    pd, dd = c.dims(p), c.dims(dp)
    if pd is not None:
        c.expect_shape("dprobs", dp, pd, "the shape of 'probs'")
    ndim = p.ndim if p.ndim != -1 else dp.ndim
    axis = int(call.attrs["axis"])
    if ndim == 0 or (ndim > 0 and not -ndim <= axis < ndim):
        raise ValueError(f"fuel.softmax_backward: axis {axis} is out of range for a {ndim}-D 'probs'")
    return _tensor(pd if pd is not None else dd, p.dtype, ndim)


def norm_stats_dtype(dtype: str) -> str:
    """The dtype of a norm's saved statistics and of its backward's accumulation."""
    return "float64" if dtype == "float64" else "float32"


def _norm_backward_infer(name: str):
    weight = "gamma" if name == "layer_norm_backward" else "weight"
    stats = ("mean", "rstd") if name == "layer_norm_backward" else ("rstd",)

    def infer(call, ctx):
        c = _Checker(SPECS[name], call)
        x = c.tensor("x", layout=("N", "C"), dtypes=FLOAT_DTYPES + ("float64",))
        dy = c.tensor("dy", layout=("N", "C"), dtypes=FLOAT_DTYPES + ("float64",))
        w = c.tensor(weight, layout=("C",), dtypes=FLOAT_DTYPES + ("float64",))
        c.same_dtype("dy", dy, "x", x)
        c.same_dtype(weight, w, "x", x)
        acc = norm_stats_dtype(str(x.dtype))
        for stat in stats:
            c.tensor(stat, layout=("N",), dtypes=(acc,))
        c.positive()
        xd = c.dims(x)
        if xd is not None:
            c.expect_shape("dy", dy, xd, "[N, C] of x")
            c.expect_shape(weight, w, xd[1:], "[C] of x")
            for stat in stats:
                c.expect_shape(stat, c.args[stat].ty, xd[:1], "[N] of x")
        row = _tensor(xd[1:] if xd is not None else None, x.dtype, 1)
        return TupleType([_tensor(xd, x.dtype, 2), row] + ([row] if name == "layer_norm_backward" else []))

    return infer


INFER = {
    "flash_attn": _infer_flash_attn,
    "flash_attn_backward": _backward_infer("flash_attn_backward"),
    "flash_attn_backward_q": _backward_infer("flash_attn_backward_q"),
    "flash_attn_backward_k": _backward_infer("flash_attn_backward_k"),
    "flash_attn_backward_v": _backward_infer("flash_attn_backward_v"),
    "paged_attn": _infer_paged_attn,
    "softmax_backward": _infer_softmax_backward,
    "flash_attn_jvp": _infer_flash_attn_jvp,
    "flash_attn_double_backward": _infer_flash_attn_double_backward,
    "flash_attn_varlen": _infer_flash_attn_varlen,
    "flash_attn_varlen_backward": _infer_flash_attn_varlen_backward,
    "layer_norm_backward": _norm_backward_infer("layer_norm_backward"),
    "rms_norm_backward": _norm_backward_infer("rms_norm_backward"),
}
