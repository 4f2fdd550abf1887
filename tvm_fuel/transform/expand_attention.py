"""``ExpandAttention``: the fuel ops rewritten into Relax primitives, so Relax's own
``relax.transform.Gradient`` differentiates through them (to any order its ops allow).

Every op expands with exactly its semantics (README, "Semantics"; ``tvm_fuel.op.semantics``), in
float32 with the results cast back to the input dtype, like the floor:

* scores ``S = scale * Q K^T`` as one batched ``matmul`` per KV head: q [B, Hq, Sq, D] is viewed
  as [B, Hkv, group * Sq, D] (query head h = g * group + r), so K and V are read unrepeated;
* softcap ``c * tanh(S / c)``; ALiBi ``-slope_h * |i + delta - j|`` and an additive mask (bounded
  to ``+-2^127``) as added biases; the window, causal, bool-mask and ``-inf`` additive-mask rules
  as a ``where`` to ``-inf``, bottom-right aligned (``delta = Sk - Sq``; paged: ``context_lens[b] - Sq``);
* ``nn.softmax`` over each row, guarded: a row without a kept key gets a finite stand-in row
  (so neither the softmax nor its gradient is NaN) and its probabilities are ``where``-ed to 0,
  so its output is 0 and its ``lse`` is ``-inf``;
* the backward ops as FlashAttention-2's formulas: ``P`` from the logits and ``lse`` (the softmax
  itself when not given: the whole row is at hand), ``dP = dO V^T``, ``D = rowsum(dO * O)``
  (``rowsum(P * dP) / rowsum(P)`` without ``out``), ``dS = P * (dP - D) * softcap'`` (exactly 0
  where ``P`` is 0), ``dq = scale dS K``, ``dk = scale dS^T Q`` and ``dv = P^T dO`` summed over
  the group by the same matmul;
* ``paged_attn`` gathers the live blocks with ``take`` over the block table (ids clamped, dead
  entries read block 0) into [B, Hkv, max_blocks * block_size, D] and masks keys past
  ``context_lens[b]``; ``softmax_backward`` is ``probs * (dprobs - sum(probs * dprobs))``.

The NaN rule: a score ``matmul`` reads everything as IEEE does and the ``where`` to ``-inf`` drops
whatever a dropped key's score holds. A weight ``matmul`` (P V, dS K, dS^T Q, P^T dO) cannot skip
a zero weight, so with ``skip_zero_weights`` (the default) it is taken on the non-finite elements
zeroed and redone as it is only for the entries where a non-zero weight meets a non-finite
element (two extra matmuls). There the result is IEEE's sum over all keys: a NaN or Inf of a
dropped key in the same column then counts too (a visible Inf next to a dropped NaN reads NaN).
Gradients taken by ``Gradient`` through the expansion follow IEEE only: a NaN or Inf anywhere
in q, k, v reaches every row of its head group (``matmul``'s gradient cannot skip zeros either).
Only ops with a registered ``FPrimalGradient`` sit on differentiable paths (``max``, ``arange``,
``isfinite``, ``take``'s indices and the comparisons only build conditions).

Left as the fused op (which still runs): ``flash_attn_jvp`` and ``flash_attn_double_backward``
(already the fused derivatives), calls with ``sinks`` (their first derivative is registered), and
calls with an empty dim (B, Sq, Sk, num_blocks or max_blocks = 0; the primitives' reductions have
no empty case). Refused with a ``ValueError``
naming the op and argument: an input of unknown shape, and a symbolic head dim without
``softmax_scale``. ``paged_attn`` clamps live block ids where the CPU floor raises on them (no
input reads out of bounds on either path). With symbolic lengths the ALiBi distance is computed
from ``arange`` (no gradient): the forward runs, ``Gradient`` refuses it.

Contents:
    ExpandAttention -- the module pass (``tvm_fuel.transform.ExpandAttention``)
"""

from __future__ import annotations

import numpy as np
import tvm
from tvm import relax, tirx
from tvm.relax.expr_functor import PyExprMutator, mutator

from ..op import SPECS, options_of
from ..op import semantics as sem
from ..op.config import AttnConfig
from .common import rewrite_functions

F32 = "float32"
_FUEL = "relax.fuel."
_R = relax.op


def _const(value, dtype: str = F32) -> relax.Constant:
    return relax.const(value, dtype)


def _dims(label: str, name: str, expr: relax.Expr, rank: int | None = None) -> list[tirx.PrimExpr]:
    """The dims of argument ``name``, as PrimExprs (static or symbolic)."""
    ty = expr.ty
    if not isinstance(ty, relax.TensorType) or not isinstance(ty.shape, relax.ShapeExpr):
        raise ValueError(f"{label}: ExpandAttention needs the shape of argument {name!r}, got {ty}")
    dims = list(ty.shape.values)
    if rank is not None and len(dims) != rank:
        raise ValueError(f"{label}: argument {name!r} must have rank {rank}, got shape {dims}")
    return dims


def _is_zero(dim) -> bool:
    return isinstance(dim, tirx.IntImm) and int(dim) == 0


class _Expander:
    """Emits one op's expansion through ``bb``; the methods mirror the op semantics step by step."""

    def __init__(self, bb: relax.BlockBuilder, skip_zero_weights: bool):
        self.bb, self.skip = bb, skip_zero_weights

    def emit(self, expr: relax.Expr) -> relax.Var:
        return self.bb.emit(expr)

    def f32(self, x: relax.Expr) -> relax.Expr:
        return x if str(x.ty.dtype) == F32 else self.emit(_R.astype(x, F32))

    # -- GQA views: [B, Hq, S, X] <-> [B, Hkv, group * S, X] (no copy of K or V per query head)
    def grouped(self, x, b, hkv, hq):
        _, _, s, last = _dims("", "", x, 4)
        return self.emit(_R.reshape(x, [b, hkv, (hq // hkv) * s, last]))

    def ungrouped(self, x, b, hq, s):
        return self.emit(_R.reshape(x, [b, hq, s, x.ty.shape.values[-1]]))

    @staticmethod
    def transposed(x):
        return _R.permute_dims(x, [0, 1, 3, 2])

    def weighted(self, w, x):
        """``w @ x`` where a weight of exactly 0 skips its term (``semantics.weighted``) as far as a
        ``matmul`` allows: see the module docstring."""
        plain = self.emit(_R.matmul(w, x))
        if not self.skip:
            return plain
        finite = self.emit(_R.isfinite(x))
        clean = self.emit(_R.matmul(w, _R.where(finite, x, _const(0.0))))
        weights = _R.astype(_R.not_equal(w, _const(0.0)), F32)
        hits = self.emit(_R.greater(_R.matmul(weights, _R.astype(_R.logical_not(finite), F32)), _const(0.0)))
        return self.emit(_R.where(hits, plain, clean))

    # -- scores and logits
    def scale(self, label, cfg: AttnConfig, head_dim) -> float:
        if cfg.softmax_scale is not None:
            return cfg.softmax_scale
        if not isinstance(head_dim, tirx.IntImm):
            raise ValueError(f"{label}: ExpandAttention needs a static head dim D of argument 'q' or an explicit "
                             f"softmax_scale, got D = {head_dim}")
        return cfg.scale_for(int(head_dim))

    def capped(self, qf, kf, cfg, scale, b, hq, hkv, sq):
        """``softcap(scale * q . k)`` [B, Hq, Sq, Sk] float32, the score matmul over each KV head."""
        scores = self.emit(_R.matmul(self.grouped(qf, b, hkv, hq), self.transposed(kf)))
        s = self.emit(_R.multiply(self.ungrouped(scores, b, hq, sq), _const(scale)))
        if cfg.softcap > 0:
            c = _const(cfg.softcap)
            s = self.emit(_R.multiply(_R.tanh(_R.divide(s, c)), c))
        return s

    def relative(self, sq, sk, kv_len=None):
        """``(j - (i + delta), keep_len)``: int64 [Sq, Sk] (dense) or [B, 1, Sq, Sk] (paged, with
        ``kv_len`` [B] the per-sequence length), and ``j < kv_len`` (None when dense)."""
        j = _R.arange(0, sk, 1, "int64")
        if kv_len is None:  # the diagonal of query i sits at key i + Sk - Sq
            return self.emit(_R.subtract(_R.reshape(j, [1, sk]), _R.reshape(_R.arange(sk - sq, sk, 1, "int64"),
                                                                                [sq, 1]))), None
        lens = self.emit(_R.reshape(kv_len, [-1, 1, 1, 1]))  # kv_len: int64 [B]
        diagonal = _R.add(lens, _R.reshape(_R.arange(-sq, 0, 1, "int64"), [1, 1, sq, 1]))
        j4 = self.emit(_R.reshape(j, [1, 1, 1, sk]))
        return self.emit(_R.subtract(j4, diagonal)), self.emit(_R.less(j4, lens))

    @staticmethod
    def distance(rel):
        """``|rel|`` as float32. With static lengths it is looked up (``take``, whose indices get no
        gradient) in a constant table: a computed one would pass the adjoint on to ``arange``,
        which has no gradient, and ``Gradient`` would refuse the module."""
        sq, sk = rel.ty.shape.values[-2:]
        if isinstance(sq, tirx.IntImm) and isinstance(sk, tirx.IntImm):  # |j - i - delta| <= Sq + Sk
            table = relax.const(np.arange(int(sq) + int(sk) + 1, dtype=np.float32))
            return _R.take(table, _R.abs(rel), axis=0)
        return _R.astype(_R.abs(rel), F32)

    def left_of_window(self, rel, cfg):
        """The window's left bound ``rel >= -left``; with ``sink_tokens``, or key ``j < sink_tokens``."""
        cond = _R.greater_equal(rel, _const(-cfg.window_left, "int64"))
        if not cfg.sink_tokens:
            return cond
        j = _R.arange(0, rel.ty.shape.values[-1], 1, "int64")  # broadcast over rel's leading dims
        return _R.logical_or(self.emit(cond), _R.less(j, _const(cfg.sink_tokens, "int64")))

    def logits(self, capped, cfg, rel, keep_len, alibi_slopes, attn_mask):
        """The logits [B, Hq, Sq, Sk] float32: ALiBi and the additive mask added, ``-inf`` at every
        dropped key (whatever the score there holds)."""
        keep = keep_len
        for bound, ok in ((cfg.window_left, lambda: self.left_of_window(rel, cfg)),
                          (cfg.window_right, lambda: _R.less_equal(rel, _const(cfg.window_right, "int64")))):
            if bound >= 0:
                cond = self.emit(ok())
                keep = cond if keep is None else self.emit(_R.logical_and(keep, cond))
        x = capped
        if alibi_slopes is not None:
            distance = self.emit(self.distance(rel))
            slopes = _R.reshape(self.f32(alibi_slopes), [1, -1, 1, 1])
            x = self.emit(_R.subtract(x, _R.multiply(slopes, distance)))
        if attn_mask is not None:
            if str(attn_mask.ty.dtype) == "bool":
                keep = attn_mask if keep is None else self.emit(_R.logical_and(keep, attn_mask))
            else:  # a -inf entry drops its key even where the score is NaN; bounded (semantics.add_mask)
                mask = self.emit(self.f32(attn_mask))
                bound = sem.BIAS_BOUND
                bounded = _R.where(_R.less(mask, _const(-bound)), _const(-bound),
                                   _R.where(_R.greater(mask, _const(bound)), _const(bound), mask))
                x = self.emit(_R.where(_R.equal(mask, _const(float("-inf"))), _const(float("-inf")),
                                       _R.add(x, bounded)))
        if keep is not None:
            x = self.emit(_R.where(keep, x, _const(float("-inf"))))
        return x

    def softmax(self, x):
        """(P, lse, any kept key) of the logits: P 0 and lse ``-inf`` on rows without a kept key."""
        neg_inf = _const(float("-inf"))
        kept = self.emit(_R.not_equal(x, neg_inf))  # NaN logits count as kept: they reach the row
        row_any = self.emit(_R.greater(_R.max(_R.astype(kept, F32), axis=-1, keepdims=True), _const(0.0)))
        safe = self.emit(_R.where(row_any, x, _const(0.0)))  # an empty row gets a finite stand-in
        p = self.emit(_R.where(row_any, _R.nn.softmax(safe, axis=-1), _const(0.0)))
        # lse = x_j - log_softmax_j for every kept j; their P-weighted mean keeps it differentiable
        # (Relax's max has no gradient; log_softmax is stable)
        per_key = self.emit(_R.where(kept, _R.subtract(safe, _R.nn.log_softmax(safe, axis=-1)), _const(0.0)))
        lse = self.emit(_R.where(_R.squeeze(row_any, [-1]), _R.sum(_R.multiply(p, per_key), axis=[-1]), neg_inf))
        return p, lse

    def probability(self, x, lse):
        """``exp(x - lse)``, exactly 0 at dropped keys and on rows whose lse is ``-inf`` (even where
        the lse is NaN); both ``where`` branches stay finite so a gradient through them does too."""
        neg_inf, zero = _const(float("-inf")), _const(0.0)
        lse4 = self.emit(_R.expand_dims(lse, [-1]))
        drop = self.emit(_R.logical_or(_R.equal(x, neg_inf), _R.equal(lse4, neg_inf)))
        shifted = _R.subtract(_R.where(drop, zero, x), _R.where(_R.equal(lse4, neg_inf), zero, lse4))
        return self.emit(_R.where(drop, zero, _R.exp(shifted)))


def _expand_flash_attn(ex: _Expander, call: relax.Call, spec, cfg: AttnConfig) -> relax.Expr | None:
    args = spec.split_args(call)
    q, k, v = args["q"], args["k"], args["v"]
    b, hq, sq, d = _dims(spec.label, "q", q, 4)
    _, hkv, sk, _ = _dims(spec.label, "k", k, 4)
    if any(_is_zero(n) for n in (b, sq, sk)):
        return None
    scale = ex.scale(spec.label, cfg, d)
    qf, kf, vf = ex.f32(q), ex.f32(k), ex.f32(v)
    rel, _ = ex.relative(sq, sk)
    x = ex.logits(ex.capped(qf, kf, cfg, scale, b, hq, hkv, sq), cfg, rel, None, args["alibi_slopes"],
                  args["attn_mask"])
    p, lse = ex.softmax(x)
    out = ex.ungrouped(ex.weighted(ex.grouped(p, b, hkv, hq), vf), b, hq, sq)
    out = ex.emit(_R.astype(out, str(q.ty.dtype))) if str(q.ty.dtype) != F32 else out
    return relax.Tuple([out, lse]) if bool(call.attrs["return_lse"]) else out


def _expand_backward(ex: _Expander, call: relax.Call, spec, cfg: AttnConfig) -> relax.Expr | None:
    args = spec.split_args(call)
    q, k, v, do = args["q"], args["k"], args["v"], args["do"]
    b, hq, sq, d = _dims(spec.label, "q", q, 4)
    _, hkv, sk, _ = _dims(spec.label, "k", k, 4)
    if any(_is_zero(n) for n in (b, sq, sk)):
        return None
    scale = ex.scale(spec.label, cfg, d)
    qf, kf, vf, dof = ex.f32(q), ex.f32(k), ex.f32(v), ex.f32(do)
    rel, _ = ex.relative(sq, sk)
    capped = ex.capped(qf, kf, cfg, scale, b, hq, hkv, sq)
    x = ex.logits(capped, cfg, rel, None, args["alibi_slopes"], args["attn_mask"])
    p = ex.probability(x, args["lse"]) if args["lse"] is not None else ex.softmax(x)[0]
    zero = _const(0.0)
    grouped_do = ex.grouped(dof, b, hkv, hq)
    dp = ex.ungrouped(ex.emit(_R.matmul(grouped_do, ex.transposed(vf))), b, hq, sq)
    if args["out"] is not None:  # FlashAttention-2's D = rowsum(dO * O)
        row = ex.emit(_R.sum(_R.multiply(dof, ex.f32(args["out"])), axis=[-1], keepdims=True))
    else:  # rowsum(P * dP) / rowsum(P): the forward's O, as the kernels take it (P from an lse too
        # large to hold log(n) does not sum to 1)
        mass = ex.emit(_R.sum(p, axis=[-1], keepdims=True))
        total = _R.sum(_R.where(_R.equal(p, zero), zero, _R.multiply(p, dp)), axis=[-1], keepdims=True)
        empty = ex.emit(_R.equal(mass, zero))  # a row without a visible key: D = 0 (no 0 / 0)
        row = ex.emit(_R.where(empty, zero, _R.divide(total, _R.where(empty, _const(1.0), mass))))
    ds = _R.multiply(p, _R.subtract(dp, row))
    if cfg.softcap > 0:  # d(c tanh(s / c))/ds = 1 - (capped / c)^2 (semantics.softcap_grad)
        ratio = _R.divide(capped, _const(cfg.softcap))
        ds = _R.multiply(ds, _R.subtract(_const(1.0), _R.multiply(ratio, ratio)))
    # exactly 0 where P is 0: a dropped key's dP or capped score may hold NaN (semantics.score_grad)
    ds = ex.emit(_R.where(_R.equal(p, zero), zero, _R.multiply(ds, _const(scale))))
    grads = []
    for grad in spec.grads:
        if grad == "dq":
            result, like = ex.ungrouped(ex.weighted(ex.grouped(ds, b, hkv, hq), kf), b, hq, sq), q
        else:  # one matmul sums over the group's query heads and all rows: [B, Hkv, Sk, D]
            weight, rhs = (ds, qf) if grad == "dk" else (p, dof)
            result = ex.weighted(ex.emit(ex.transposed(ex.grouped(weight, b, hkv, hq))), ex.grouped(rhs, b, hkv, hq))
            like = k if grad == "dk" else v
        grads.append(ex.emit(_R.astype(result, str(like.ty.dtype))) if str(like.ty.dtype) != F32 else result)
    return relax.Tuple(grads) if len(grads) > 1 else grads[0]


def _expand_paged_attn(ex: _Expander, call: relax.Call, spec, cfg: AttnConfig) -> relax.Expr | None:
    args = spec.split_args(call)
    q, k_cache, v_cache, table, lens = (args[n] for n in ("q", "k_cache", "v_cache", "block_table", "context_lens"))
    b, hq, sq, d = _dims(spec.label, "q", q, 4)
    num_blocks, block_size, hkv, _ = _dims(spec.label, "k_cache", k_cache, 4)
    _, max_blocks = _dims(spec.label, "block_table", table, 2)
    if any(_is_zero(n) for n in (b, sq, num_blocks, max_blocks)):
        return None
    scale = ex.scale(spec.label, cfg, d)
    # live entries (n * block_size < context_lens[b]) clamped into the cache, dead ones read block 0
    # (decompose.sanitize_block_table); keys past context_lens[b] are masked below
    sk = max_blocks * block_size
    lens64 = ex.emit(_R.astype(lens, "int64"))
    first_token = _R.arange(0, sk, block_size, "int64")  # aranges also hold dims that may be symbolic
    live = ex.emit(_R.less(_R.reshape(first_token, [1, max_blocks]), _R.reshape(lens64, [b, 1])))
    last = _R.arange(num_blocks - 1, num_blocks, 1, "int64")
    ids = _R.minimum(_R.maximum(_R.astype(table, "int64"), _const(0, "int64")), last)
    safe = ex.emit(_R.reshape(ex.emit(_R.where(live, ids, _const(0, "int64"))), [-1]))

    def gather(cache):  # [B * max_blocks, block_size, Hkv, D] -> [B, Hkv, max_blocks * block_size, D]
        pages = _R.reshape(_R.take(cache, safe, axis=0), [b, sk, hkv, d])
        return ex.f32(ex.emit(_R.permute_dims(pages, [0, 2, 1, 3])))

    qf, kf, vf = ex.f32(q), gather(k_cache), gather(v_cache)
    rel, keep_len = ex.relative(sq, sk, lens64)
    x = ex.logits(ex.capped(qf, kf, cfg, scale, b, hq, hkv, sq), cfg, rel, keep_len, args["alibi_slopes"], None)
    p, _ = ex.softmax(x)
    out = ex.ungrouped(ex.weighted(ex.grouped(p, b, hkv, hq), vf), b, hq, sq)
    return ex.emit(_R.astype(out, str(q.ty.dtype))) if str(q.ty.dtype) != F32 else out


def _expand_softmax_backward(ex: _Expander, call: relax.Call, spec, cfg) -> relax.Expr:
    args = spec.split_args(call)
    probs, dprobs = ex.f32(args["probs"]), ex.f32(args["dprobs"])
    axis = int(call.attrs["axis"])
    dot = _R.sum(_R.multiply(probs, dprobs), axis=[axis], keepdims=True)
    grad = ex.emit(_R.multiply(probs, _R.subtract(dprobs, dot)))
    dtype = str(args["probs"].ty.dtype)
    return ex.emit(_R.astype(grad, dtype)) if dtype != F32 else grad


_EXPANSIONS = {
    "flash_attn": _expand_flash_attn,
    "paged_attn": _expand_paged_attn,
    "softmax_backward": _expand_softmax_backward,
    **{name: _expand_backward for name in SPECS if name.startswith("flash_attn_backward")},
}


@mutator
class _Expand(PyExprMutator):
    def __init__(self, mod: tvm.IRModule, skip_zero_weights: bool = True):
        super().__init__(mod)
        self.skip_zero_weights = skip_zero_weights

    def visit_call_(self, call: relax.Call) -> relax.Expr:
        call = super().visit_call_(call)
        if not (isinstance(call.op, tvm.ir.Op) and call.op.name.startswith(_FUEL)):
            return call
        spec = SPECS[call.op.name[len(_FUEL):]]
        cfg = AttnConfig.create(spec.label, **options_of(call)) if spec.attention else None
        expand = _EXPANSIONS.get(spec.name)
        if expand is None:  # flash_attn_jvp, flash_attn_double_backward: already the fused derivatives
            return call
        if spec.split_args(call).get("sinks") is not None:  # kept fused: its gradient is registered (first order)
            return call
        expanded = expand(_Expander(self.builder_, self.skip_zero_weights), call, spec, cfg)
        return call if expanded is None else expanded


@tvm.transform.module_pass(opt_level=0, name="tvm_fuel.ExpandAttention")
class ExpandAttention:
    """Rewrite every fuel op (``flash_attn``, the four backward ops, ``paged_attn``,
    ``softmax_backward``) into Relax primitives with the same semantics (module docstring), so
    ``relax.transform.Gradient`` differentiates through them and any Relax backend runs them.
    flash_attn_jvp and flash_attn_double_backward are kept: they are already the fused derivatives
    (they still run, through their own legalization).

    Parameters
    ----------
    skip_zero_weights : bool
        Keep the NaN rule's zero-weight skip in the weight matmuls (two extra matmuls each);
        ``False`` takes them plain (a NaN or Inf of a dropped value then reaches its rows).

    Example
    -------
    >>> expanded = tvm_fuel.transform.ExpandAttention()(mod)                 # doctest: +SKIP
    >>> adjoint = relax.transform.Gradient("main")(expanded)                # doctest: +SKIP
    """

    def __init__(self, skip_zero_weights: bool = True):
        self.skip_zero_weights = bool(skip_zero_weights)

    def transform_module(self, mod: tvm.IRModule, ctx: tvm.transform.PassContext) -> tvm.IRModule:
        expanded = rewrite_functions(mod, lambda m: _Expand(m, self.skip_zero_weights))
        return relax.transform.DeadCodeElimination()(expanded)
