"""``tvm_fuel.compile``: build a Relax module that holds fuel ops.

Contents:
    compile        -- tvm.compile with the kernel path chosen explicitly
    as_target      -- str / dict / Target -> Target
    KERNEL_PATHS   -- the accepted ``kernels`` values
"""

from __future__ import annotations

from typing import Any

import tvm
from tvm import relax

from .op import SPECS

KERNEL_PATHS = ("decomposed", "tuned")
_FUEL_OPS = {spec.op_name for spec in SPECS.values()}


def as_target(target: Any) -> tvm.target.Target:
    """Accept ``"llvm"``, ``{"kind": "cuda", "arch": "sm_90"}`` or a Target."""
    if isinstance(target, tvm.target.Target):
        return target
    if isinstance(target, str):
        return tvm.target.Target({"kind": target} if target.isidentifier() else target)
    if isinstance(target, dict):
        return tvm.target.Target(target)
    raise TypeError(f"tvm_fuel.compile: target must be a str, dict or tvm.target.Target, got {type(target).__name__}")


def _remaining_fuel_calls(mod: tvm.IRModule) -> list[str]:
    found: list[str] = []

    def visit(expr):
        if isinstance(expr, relax.Call) and isinstance(expr.op, tvm.ir.Op) and expr.op.name in _FUEL_OPS:
            found.append(expr.op.name)

    for _, func in mod.functions.items():
        if isinstance(func, relax.Function):
            relax.analysis.post_order_visit(func, visit)
    return found


def compile(mod: tvm.IRModule, target: Any = "llvm", *, kernels: str = "decomposed", **compile_options):  # noqa: A001
    """Build ``mod`` for ``target`` and return what ``tvm.compile`` returns.

    Parameters
    ----------
    mod : tvm.IRModule
        A Relax module; its fuel ops may appear anywhere.
    target : str, dict or tvm.target.Target
        ``"llvm"``, ``{"kind": "cuda", "arch": "sm_90"}``, ...
    kernels : str
        ``"decomposed"``: every fuel op runs its TE decomposition (the correctness floor).
        ``"tuned"``: the performance-path kernels (not available yet).
    compile_options :
        Passed on to ``tvm.compile``.

    Examples
    --------
    >>> import tvm_fuel
    >>> ex = tvm_fuel.compile(mod, "llvm")                      # doctest: +SKIP
    >>> vm = tvm.relax.VirtualMachine(ex, tvm.cpu())            # doctest: +SKIP
    """
    if kernels not in KERNEL_PATHS:
        raise ValueError(f"tvm_fuel.compile: kernels must be one of {KERNEL_PATHS}, got {kernels!r}")
    if kernels == "tuned":
        raise NotImplementedError(
            "tvm_fuel.compile: kernels='tuned' needs the performance-path kernels, which are not part of this "
            "release yet; use kernels='decomposed'")
    target = as_target(target)
    with target:
        legalized = relax.transform.LegalizeOps()(mod)
    leftover = _remaining_fuel_calls(legalized)
    if leftover:
        raise ValueError(
            f"tvm_fuel.compile: could not legalize {sorted(set(leftover))}: an argument has an unknown shape; "
            "give it a shape with R.match_cast first")
    return tvm.compile(legalized, target=target, **compile_options)
