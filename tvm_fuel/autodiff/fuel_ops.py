"""Gradients of the fuel ops for ``relax.transform.Gradient`` (the ``FPrimalGradient`` attribute).

``flash_attn``'s gradient emits ``flash_attn_backward`` with the forward's ``out`` and, when the
forward returns it, ``lse``: the backward kernels then neither recompute the forward nor its
softmax statistics. With ``sinks`` the gradient also returns theirs (``op.sinks_grad``), which
needs the forward's lse. Run ``tvm_fuel.transform.ShareForwardState()`` before ``Gradient`` so a
``flash_attn`` without ``return_lse`` returns it too (its users see the same output). ALiBi
slopes and masks get no gradient. The backward ops' gradient is ``flash_attn_double_backward``
(the VJP of the backward, fused), so ``Gradient`` of an adjoint, or ``tvm_fuel.transform.gradient``
applied twice, gives second derivatives through fused ops; ``softmax_backward`` differentiates in
Relax primitives and itself. ``paged_attn`` (inference over a cache), ``flash_attn_jvp`` and the
double backward itself have no gradient: ``Gradient`` reports the op by name. ``layer_norm_backward``
and ``rms_norm_backward`` differentiate as their Relax composition (``tvm_fuel.autodiff.norms``).

Contents:
    GRADIENTS -- registered op name (``relax.fuel.*``) -> its ``FPrimalGradient``
"""

from __future__ import annotations

import tvm
from tvm import relax
from tvm.relax.op.grad import no_grad

from .. import op
from .common import bound_value, tuple_adjoints
from .norms import FUSED_GRADIENTS as NORM_BACKWARD_GRADIENTS
from ..op import SPECS


def _is_zeros(ctx: relax.BlockBuilder, expr: relax.Expr) -> bool:
    """Whether ``expr`` is the zero adjoint Gradient gives an output nobody differentiates."""
    expr = bound_value(ctx, expr)
    return isinstance(expr, relax.Call) and isinstance(expr.op, tvm.ir.Op) and expr.op.name in (
        "relax.zeros", "relax.zeros_like")


def _forward_state(name: str, orig_var: relax.Var, orig_call: relax.Call, output_grad: relax.Expr,
                   ctx: relax.BlockBuilder) -> tuple[relax.Expr, relax.Expr | None, relax.Expr]:
    """(out, lse or None, the adjoint of out) of a forward call (``flash_attn`` or its varlen
    form): the lse only where the call returns it, which a call with sinks must."""
    label = SPECS[name].label
    if bool(orig_call.attrs["return_lse"]):
        out, lse = relax.TupleGetItem(orig_var, 0), relax.TupleGetItem(orig_var, 1)
        dout, dlse = tuple_adjoints(ctx, output_grad, 2)
        if not _is_zeros(ctx, dlse):
            raise ValueError(f"{label}: the gradient through lse is not supported: the loss may use out, not lse")
    else:
        out, lse, dout = orig_var, None, output_grad
    if SPECS[name].split_args(orig_call)["sinks"] is not None and lse is None:
        # the sinks' gradient needs the forward's lse
        raise ValueError(f"{label}: the gradient of a call with sinks needs its lse: run "
                         "tvm_fuel.transform.ShareForwardState() before Gradient (tvm_fuel.transform.gradient does)")
    return out, lse, dout


def _flash_attn_gradient(orig_var: relax.Var, orig_call: relax.Call, output_grad: relax.Expr,
                         ctx: relax.BlockBuilder) -> list[relax.Expr]:
    args = SPECS["flash_attn"].split_args(orig_call)
    out, lse, dout = _forward_state("flash_attn", orig_var, orig_call, output_grad, ctx)
    sinks = args["sinks"]
    grads = ctx.emit(op.flash_attn_backward(args["q"], args["k"], args["v"], dout, args["alibi_slopes"],
                                            args["attn_mask"], out=out, lse=lse, sinks=sinks,
                                            **op.options_of(orig_call)))
    result = [relax.TupleGetItem(grads, i) for i in range(3)]
    result += [no_grad(args[name]) for name in ("alibi_slopes", "attn_mask") if args[name] is not None]
    if sinks is not None:
        result.append(ctx.emit(op.sinks_grad(out, lse, dout, sinks)))
    return result


def _flash_attn_varlen_gradient(orig_var: relax.Var, orig_call: relax.Call, output_grad: relax.Expr,
                                ctx: relax.BlockBuilder) -> list[relax.Expr]:
    """``flash_attn_varlen_backward`` with the forward's out (and lse where it returns it); the
    offsets and ALiBi get no gradient, the sinks theirs (``op.sinks_grad(packed=True)``)."""
    args = SPECS["flash_attn_varlen"].split_args(orig_call)
    out, lse, dout = _forward_state("flash_attn_varlen", orig_var, orig_call, output_grad, ctx)
    sinks = args["sinks"]
    lengths = {name: int(orig_call.attrs[name]) or None for name in ("max_seqlen_q", "max_seqlen_k")}
    grads = ctx.emit(op.flash_attn_varlen_backward(
        args["q"], args["k"], args["v"], dout, args["cu_seqlens_q"], args["cu_seqlens_k"], args["alibi_slopes"],
        out=out, lse=lse, sinks=sinks, **lengths, **op.options_of(orig_call)))
    result = [relax.TupleGetItem(grads, i) for i in range(3)]
    result += [no_grad(args[name]) for name in ("cu_seqlens_q", "cu_seqlens_k", "alibi_slopes")
               if args[name] is not None]
    if sinks is not None:
        result.append(ctx.emit(op.sinks_grad(out, lse, dout, sinks, packed=True)))
    return result


def _cotangent(ctx: relax.BlockBuilder, expr: relax.Expr) -> relax.Expr | None:
    """An output's adjoint, None where it is Gradient's zero (the double backward skips its terms)."""
    return None if _is_zeros(ctx, expr) else expr


def _backward_gradient(name: str):
    """The gradient of a backward op: its VJP with the adjoints of its outputs, fused
    (``flash_attn_double_backward``). The out and lse it takes are the forward's of the same
    q, k, v, so they get no gradient: the double backward's result is already the total derivative
    through them."""
    grads = SPECS[name].grads

    def gradient(orig_var: relax.Var, orig_call: relax.Call, output_grad: relax.Expr,
                 ctx: relax.BlockBuilder) -> list[relax.Expr]:
        args = SPECS[name].split_args(orig_call)
        if args["sinks"] is not None:
            raise ValueError(f"fuel.{name}: no second derivative with sinks (flash_attn_double_backward takes "
                             "none); differentiate flash_attn with sinks once")
        adjoints = tuple_adjoints(ctx, output_grad, len(grads)) if len(grads) > 1 else [output_grad]
        bars = {f"{grad}_bar": _cotangent(ctx, adjoint) for grad, adjoint in zip(grads, adjoints)}
        result = ctx.emit(op.flash_attn_double_backward(
            args["q"], args["k"], args["v"], args["do"], alibi_slopes=args["alibi_slopes"],
            attn_mask=args["attn_mask"], out=args["out"], lse=args["lse"], **bars, **op.options_of(orig_call)))
        differentiated = [relax.TupleGetItem(result, i) for i in range(4)]
        constants = ("alibi_slopes", "attn_mask", "out", "lse")
        return differentiated + [no_grad(args[n]) for n in constants if args[n] is not None]

    return gradient


def _softmax_backward_gradient(orig_var: relax.Var, orig_call: relax.Call, output_grad: relax.Expr,
                               ctx: relax.BlockBuilder) -> list[relax.Expr]:
    """The VJP of ``y = p * (dp - sum(p * dp))`` with cotangent g: ``p_bar = g * (dp - sum(p * dp))
    - dp * sum(g * p)`` and ``dp_bar = softmax_backward(p, g)``. ``UseSoftmaxBackward`` puts the op
    into adjoints, so a second ``gradient`` meets it."""
    args = SPECS["softmax_backward"].split_args(orig_call)
    p, dp, axis = args["probs"], args["dprobs"], int(orig_call.attrs["axis"])
    R = relax.op

    def row_sum(x):
        return R.sum(x, axis=[axis], keepdims=True)

    probs_grad = R.subtract(R.multiply(output_grad, R.subtract(dp, row_sum(R.multiply(p, dp)))),
                            R.multiply(dp, row_sum(R.multiply(output_grad, p))))
    return [ctx.emit(probs_grad), ctx.emit(op.softmax_backward(p, output_grad, axis=axis))]


def _not_differentiable(why: str):
    def gradient(orig_var, orig_call, output_grad, ctx):
        raise ValueError(why)

    return gradient


# fuel op name -> FPrimalGradient
_BY_NAME = {
    "flash_attn": _flash_attn_gradient,
    "paged_attn": _not_differentiable(
        "fuel.paged_attn is not differentiable: it attends over an inference KV cache; differentiate "
        "flash_attn (training) instead"),
    **{name: _backward_gradient(name)
       for name in ("flash_attn_backward", "flash_attn_backward_q", "flash_attn_backward_k", "flash_attn_backward_v")},
    "flash_attn_varlen": _flash_attn_varlen_gradient,
    "flash_attn_varlen_backward": _not_differentiable(
        "fuel.flash_attn_varlen_backward has no gradient (no fused second derivative of the packed layout); "
        "differentiate flash_attn_varlen once"),
    "softmax_backward": _softmax_backward_gradient,
    "flash_attn_jvp": _not_differentiable(
        "fuel.flash_attn_jvp has no gradient (forward mode); differentiate flash_attn instead"),
    "flash_attn_double_backward": _not_differentiable(
        "fuel.flash_attn_double_backward has no gradient (third derivatives are not fused); run "
        "tvm_fuel.transform.ExpandAttention() before Gradient for them"),
    **NORM_BACKWARD_GRADIENTS,  # the composition's VJP: any order (tvm_fuel.autodiff.norms)
}

GRADIENTS = {SPECS[name].op_name: gradient for name, gradient in _BY_NAME.items()}
