"""What the gradients share: constants in an operand's dtype, a norm's axes, weights broadcast
against data and summed back to their shape.

Contents:
    const, bound_value, tuple_adjoints, normalized_axes, broadcast_weight, weight_sum, composition_vjp
"""

from __future__ import annotations

from tvm import relax

R = relax.op


def const(value: float, like: relax.Expr) -> relax.Expr:
    """``value`` as a scalar constant of ``like``'s dtype."""
    return relax.const(value, str(like.ty.dtype))


def bound_value(binder, expr: relax.Expr) -> relax.Expr:
    """What ``expr`` is bound to, following variables through ``binder.lookup_binding`` (a
    BlockBuilder, or an expression mutator of the function being rewritten)."""
    while isinstance(expr, relax.Var):
        value = binder.lookup_binding(expr)
        if value is None:
            break
        expr = value
    return expr


def tuple_adjoints(ctx: relax.BlockBuilder, output_grad: relax.Expr, count: int) -> list[relax.Expr]:
    """The adjoints of a tuple-valued op's ``count`` outputs: the fields of the tuple Gradient
    bound (followed through variables), else items of it."""
    bound = bound_value(ctx, output_grad)
    if isinstance(bound, relax.Tuple):
        return list(bound.fields)
    return [relax.TupleGetItem(output_grad, i) for i in range(count)]


def normalized_axes(call: relax.Call) -> list[int]:
    """A norm call's ``axes`` attribute, non-negative and sorted."""
    ndim = call.args[0].ty.ndim
    return sorted(int(a) % ndim for a in call.attrs.axes)


def broadcast_weight(weight: relax.Expr, axes: list[int], ndim: int) -> relax.Expr:
    """A weight of shape ``data.shape[axes]`` with unit dims elsewhere: it broadcasts against data
    whichever axes are normalized (numpy's rule aligns trailing dims only)."""
    others = [a for a in range(ndim) if a not in axes]
    return R.expand_dims(weight, axis=others) if others and axes != list(range(ndim - len(axes), ndim)) else weight


def weight_sum(x: relax.Expr, axes: list[int], ndim: int) -> relax.Expr:
    """``x`` (``ndim`` dims) summed over every axis but ``axes``: a weight's shape."""
    others = [a for a in range(ndim) if a not in axes]
    return R.sum(x, axis=others) if others else x





def composition_vjp(ctx: relax.BlockBuilder, compose, args: list[relax.Expr],
                    cotangents: list[relax.Expr]) -> list[relax.Expr]:
    """The VJP of ``compose(*args)`` (a list of tensors built from Relax primitives) with
    ``cotangents``, emitted into ``ctx``: ``Gradient`` differentiates ``compose`` in a function of
    its own, whose bindings are then emitted here with its parameters bound to ``args``. A fused
    op's gradient is its composition's this way, so it differentiates to any order."""
    params = [relax.Var(f"a{i}", arg.ty) for i, arg in enumerate(args)]
    seeds = [relax.Var(f"c{i}", c.ty) for i, c in enumerate(cotangents)]
    bb = relax.BlockBuilder()
    with bb.function("composition", params + seeds):
        with bb.dataflow():
            outs = compose(*params)
            loss = None
            for out, seed in zip(outs, seeds):
                term = R.sum(R.multiply(out, seed))
                loss = term if loss is None else R.add(loss, term)
            loss = bb.emit_output(loss)
        bb.emit_func_output(loss)
    from tvm.relax.transform import Gradient  # (the pass that is calling us: reentrant)

    adjoint = Gradient("composition", require_grads=params)(bb.get())["composition_adjoint"]
    adjoint = adjoint.bind_params(dict(zip(adjoint.params, list(args) + list(cotangents))))
    (block,) = adjoint.body.blocks
    for binding in block.bindings:
        ctx.emit_normalized(binding)
    result = adjoint.body.body
    while isinstance(result, relax.Var) and any(b.var.same_as(result) for b in block.bindings):
        result = next(b.value for b in block.bindings if b.var.same_as(result))
    grads = result.fields[1]
    return [grads.fields[i] if isinstance(grads, relax.Tuple) else relax.TupleGetItem(grads, i)
            for i in range(len(args))]

__all__ = ["const", "bound_value", "tuple_adjoints", "normalized_axes", "broadcast_weight", "weight_sum",
           "composition_vjp"]
