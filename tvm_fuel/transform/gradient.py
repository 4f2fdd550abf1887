"""``gradient`` (ShareForwardState, ``relax.transform.Gradient``, UseSoftmaxBackward) and ``with_objective``
(a function's computation with a new scalar result, for a second ``gradient``: second derivatives
through fused ops).
"""

from __future__ import annotations

from typing import Callable, Sequence

import tvm
import tvm_ffi
from tvm import relax

from .share_forward_state import ShareForwardState
from .use_softmax_backward import UseSoftmaxBackward


def _required_positions(mod: tvm.IRModule, func_name: str, require_grads) -> list[int] | None:
    """The positions of ``require_grads`` among ``func_name``'s parameters, in order. Accepts
    what ``relax.transform.Gradient`` accepts (one Var, a list or Array of them; a tuple too);
    anything else, a variable that is not a parameter or one named twice is refused by name."""
    where = "tvm_fuel.transform.gradient"
    funcs = {gvar.name_hint: func for gvar, func in mod.functions.items() if isinstance(func, relax.Function)}
    if func_name not in funcs:
        raise ValueError(f"{where}: no Relax function {func_name!r} in the module (its Relax functions: "
                         f"{', '.join(sorted(funcs)) or 'none'})")
    if require_grads is None:
        return None
    if isinstance(require_grads, relax.Var):
        require_grads = [require_grads]
    elif not isinstance(require_grads, (list, tuple, tvm_ffi.Array)):
        raise TypeError(f"{where}: require_grads must be a relax.Var or a list of them, got "
                        f"{type(require_grads).__name__}")
    params = list(funcs[func_name].params)
    positions: list[int] = []
    for var in require_grads:
        if not isinstance(var, relax.Var):
            raise TypeError(f"{where}: require_grads must hold relax.Vars, got {type(var).__name__} {var!r}")
        # by identity, as Relax compares variables: a Var of another function may share a name
        position = next((i for i, param in enumerate(params) if param.same_as(var)), None)
        if position is None:
            namesake = (f"; {var.name!r} is another Var of that name: pass the function's own "
                        f"(mod[{func_name!r}].params)" if any(p.name == var.name for p in params) else "")
            raise ValueError(f"{where}: require_grads names {var.name!r}, which is not a parameter of "
                             f"{func_name!r} (its parameters: {', '.join(p.name for p in params) or 'none'}){namesake}")
        if position in positions:
            raise ValueError(f"{where}: require_grads names parameter {var.name!r} of {func_name!r} twice")
        positions.append(position)
    return positions


def gradient(mod: tvm.IRModule, func_name: str = "main",
             require_grads: relax.Var | Sequence[relax.Var] | None = None, target_index: int = 0) -> tvm.IRModule:
    """``mod`` with ``<func_name>_adjoint`` added: ``ShareForwardState``, ``relax.transform.Gradient``,
    then ``UseSoftmaxBackward`` (softmaxes elsewhere in the model get ``softmax_backward``).
    ``require_grads``: parameters of ``func_name`` (one Var or a list, as ``Gradient`` takes).

    Example
    -------
    >>> adjoint = tvm_fuel.transform.gradient(mod)                 # doctest: +SKIP
    >>> ex = tvm_fuel.compile(adjoint, "llvm", kernels="tuned")    # doctest: +SKIP
    """
    positions = _required_positions(mod, func_name, require_grads)
    shared = ShareForwardState()(mod)
    if positions is not None:  # the same parameters, by position, in the rewritten function
        require_grads = [shared[func_name].params[i] for i in positions]
    adjoint = relax.transform.Gradient(func_name, require_grads=require_grads, target_index=target_index)(shared)
    return UseSoftmaxBackward()(adjoint)


def with_objective(mod: tvm.IRModule, func_name: str, new_name: str,
                   objective: Callable[[relax.Expr], relax.Expr]) -> tvm.IRModule:
    """``mod`` with ``new_name`` added: ``func_name``'s computation (one dataflow block, as
    ``gradient`` makes) whose result is ``objective(result)``, a scalar built from the function's
    result expression (for an adjoint, the tuple ``(loss, (grads...))``). Differentiating it is the
    second application of ``gradient``: a gradient penalty on attention inputs or a
    Hessian-vector product, through ``flash_attn_double_backward``.

    Example
    -------
    >>> adjoint = tvm_fuel.transform.gradient(mod)                              # doctest: +SKIP
    >>> def penalized(result):  # loss + 0.1 * |dloss/dq|^2
    ...     loss, grads = result.fields
    ...     dq = grads.fields[0]
    ...     return R.add(loss, R.multiply(R.const(0.1), R.sum(R.multiply(dq, dq))))
    >>> mod = tvm_fuel.transform.with_objective(adjoint, "main_adjoint", "penalty", penalized)  # doctest: +SKIP
    >>> second = tvm_fuel.transform.gradient(mod, "penalty")                    # doctest: +SKIP
    """
    func = relax.utils.copy_with_new_vars(mod[func_name])  # fresh vars: the two functions share none
    blocks = func.body.blocks
    if len(blocks) != 1 or not isinstance(blocks[0], relax.DataflowBlock):
        raise ValueError(f"with_objective: {func_name!r} must be one dataflow block (as gradient makes it), "
                         f"got {len(blocks)} blocks")
    bb = relax.BlockBuilder(mod)
    with bb.function(new_name, list(func.params)):
        with bb.dataflow():
            for binding in blocks[0].bindings:
                bb.emit_normalized(binding)
            result = bb.emit_output(objective(func.body.body))
        bb.emit_func_output(result)
    return bb.get()
