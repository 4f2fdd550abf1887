"""Static-shape copies of Relax functions, chosen at run time by their symbolic dims.

A model exported with symbolic dims (``batch``, ``seq_len``) lowers to TIR functions of symbolic
shape, which MetaSchedule cannot tune (it measures concrete arrays) and whose records, tuned at
one shape, match no symbolic function. ``specialize`` keeps the function and adds, per
``ShapePoint``, a copy with those dims bound (its TIR is static, so tuning records apply), and
makes the public function a dispatcher: a call whose dims equal a point's runs that copy, any
other call the symbolic one, so results never depend on which ran.

Contents:
    ShapePoint  -- a function name and values of its symbolic dims (``dispatch.shape_points``)
    specialize  -- the module with a static copy per point and a run-time dispatch
    symbolic_dims -- the names of a function's symbolic dims
"""

from __future__ import annotations

from typing import Sequence

import tvm
import tvm_ffi
from tvm import relax
from tvm.relax.expr_functor import PyExprMutator, mutator

from ..dispatch.shape_points import ShapePoint


def symbolic_dims(func: relax.Function) -> dict[str, tvm.tirx.Var]:
    """The symbolic dims a function's parameters define, by name (not those its body defines
    with ``R.match_cast``: they are known only once the body runs, so no call can dispatch on
    them)."""
    return {var.name: var for param in func.params for var in relax.analysis.definable_tir_vars_in_type(param.ty)}


def _body_dims(func: relax.Function) -> set[str]:
    """The names of the symbolic dims ``func``'s body defines (``R.match_cast``), not its parameters."""
    return {var.name for var in relax.analysis.defined_symbolic_vars(func)} - set(symbolic_dims(func))


@mutator
class _Retarget(PyExprMutator):
    """Calls of the TIR functions in ``mapping`` -> calls of their copies."""

    def __init__(self, mod: tvm.IRModule, mapping: dict):
        super().__init__(mod)
        self.mapping = mapping

    def visit_call_(self, call: relax.Call) -> relax.Expr:
        call = super().visit_call_(call)
        if call.args and isinstance(call.args[0], tvm.ir.GlobalVar) and call.args[0] in self.mapping:
            return relax.Call(call.op, [self.mapping[call.args[0]], *call.args[1:]], call.attrs, call.ty_args)
        return call


def _own_prim_funcs(mod: tvm.IRModule, gvar: tvm.ir.GlobalVar, suffix: str) -> tvm.IRModule:
    """``mod`` where the Relax function ``gvar`` calls copies of the TIR functions it calls (named
    with ``suffix``). A TIR function of symbolic shape made at export (a model's RoPE) and called
    from a function bound to static dims is then specialized for that function's shapes alone
    (``SpecializePrimFuncBasedOnCallSite``): shared, FuseTIR would see one buffer with two shapes."""
    called = []

    def visit(expr):
        if isinstance(expr, relax.Call) and expr.args and isinstance(expr.args[0], tvm.ir.GlobalVar):
            if isinstance(mod[expr.args[0]], tvm.tirx.PrimFunc) and expr.args[0] not in called:
                called.append(expr.args[0])

    relax.analysis.post_order_visit(mod[gvar], visit)
    if not called:
        return mod
    rewriter = _Retarget(mod, {})
    for callee in called:  # the attribute keeps add_func from handing back the shared original
        rewriter.mapping[callee] = rewriter.builder_.add_func(
            _private(mod[callee]).with_attr("tvm_fuel.called_from", gvar.name_hint), callee.name_hint + suffix)
    rewriter.builder_.update_func(gvar, rewriter.visit_expr(mod[gvar]))
    return rewriter.builder_.get()


def _private(func):
    """``func`` (Relax or TIR) without its global symbol: a copy must not export the same name."""
    return func.without_attr("global_symbol") if func.attrs and "global_symbol" in func.attrs else func


def _cast_call(callee: tvm.ir.GlobalVar, params, static: relax.Function,
               ret: relax.Type) -> relax.SeqExpr:
    """A branch: the params cast to ``static``'s parameter shapes, the call, its result cast back."""
    bindings, args = [], []
    for param, static_param in zip(params, static.params):
        if tvm_ffi.structural_equal(param.ty, static_param.ty):
            args.append(param)
            continue
        cast = relax.Var(param.name, static_param.ty)
        bindings.append(relax.MatchCast(cast, param, static_param.ty))
        args.append(cast)
    result = relax.Var("out", static.ret_ty)
    bindings.append(relax.VarBinding(result, relax.Call(callee, args)))
    back = relax.Var("out", ret)
    bindings.append(relax.MatchCast(back, result, ret))
    return relax.SeqExpr([relax.BindingBlock(bindings)], back)


def specialize(mod: tvm.IRModule, points: Sequence[ShapePoint]) -> tvm.IRModule:
    """``mod`` with each point's function run by a static copy when called at the point's dims.

    Per function ``f`` with points: ``f__generic`` (the symbolic original), ``f__at_<dims>`` per
    point (its dims bound), and ``f`` itself dispatching on its dims at run time. A point naming a
    function the module lacks, or a dim the function does not have, is skipped (a tuning log's
    points meet models they were not tuned for); a dim its body defines (``R.match_cast``), not
    its parameters, is refused by name: no call can be dispatched on it."""
    by_function: dict[str, list[ShapePoint]] = {}
    for point in points:
        by_function.setdefault(point.function, []).append(point)
    mod = tvm.IRModule(dict(mod.functions.items()), attrs=mod.attrs)
    names = {gvar.name_hint: gvar for gvar in mod.get_global_vars()}
    for name, group in by_function.items():
        func = mod[names[name]] if name in names else None
        if not isinstance(func, relax.Function):
            continue
        dims = symbolic_dims(func)
        inner = sorted({name for p in group for name in p.dims} & _body_dims(func))
        if inner:
            raise ValueError(
                f"tvm_fuel.specialize: {name}'s dim{'s' if len(inner) > 1 else ''} {', '.join(map(repr, inner))} "
                f"{'are' if len(inner) > 1 else 'is'} defined in its body (R.match_cast), not by its parameters: a "
                f"shape point takes parameter dims only ({', '.join(map(repr, sorted(dims))) or 'none'} here)")
        group = [p for p in group if p.dims and set(p.dims) <= set(dims)]
        if not group:
            continue
        bb = relax.BlockBuilder(mod)
        generic = bb.add_func(_private(relax.utils.copy_with_new_vars(func)), f"{name}__generic")
        branches = []
        for point in {p.suffix(): p for p in group}.values():
            static = _private(relax.utils.copy_with_new_vars(func).bind_symbolic_vars(dict(point.dims)))
            branches.append((point, bb.add_func(static, name + point.suffix()), static))
        statics = [callee for _, callee, _ in branches]
        params = list(func.params)
        body: relax.Expr = _cast_call(generic, params, bb.get()[generic], func.ret_ty)
        for point, callee, static in reversed(branches):
            condition = tvm.tirx.all(*[dims[k] == v for k, v in point.dims.items()])
            body = relax.SeqExpr([], relax.If(relax.prim_value(condition),
                                              _cast_call(callee, params, static, func.ret_ty), body))
        dispatcher = relax.Function(params, body, func.ret_ty, func.is_pure, func.attrs)
        mod = bb.get()
        mod[names[name]] = dispatcher
        for callee in statics:
            mod = _own_prim_funcs(mod, callee, callee.name_hint[len(name):])
    return relax.transform.SpecializePrimFuncBasedOnCallSite()(relax.transform.Normalize()(mod))


__all__ = ["ShapePoint", "specialize", "symbolic_dims"]
