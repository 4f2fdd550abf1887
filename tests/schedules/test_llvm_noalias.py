"""TVM 0.27's LLVM codegen emits every PrimFunc of a module with the ``tirx.noalias`` of the one
whose symbol sorts last (``DeclareFunctionInternal`` leaves ``is_restricted_`` at it): one without
it (a host check, VMShapeLower's ``shape_func``) strips ``noalias`` and ``noinline`` from every
kernel's ``_compute_`` function, and the CPU kernels' register tiles fall back to the stack (3-5x
slower). The check functions carry the attribute and ``tvm_fuel.pipeline`` marks the functions
with at most one buffer (``build.MarkVacuousNoAlias``): every kernel keeps its noalias params."""

from __future__ import annotations

import numpy as np
import pytest
import tvm
from helpers import HOST
from tvm import relax, tirx

import tvm_fuel
from tvm_fuel import op

pytestmark = pytest.mark.integration


def _compute_functions(ex) -> dict[str, bool]:
    """name -> whether its pointer params are all noalias, for every ``_compute_`` function of the
    executable's LLVM module."""
    source = ex.mod.imports[0].inspect_source("ll")
    found = {}
    for line in source.splitlines():
        if line.startswith("define") and "_compute_(" in line:
            name = line.split("@", 1)[1].split("(", 1)[0]
            params = line.split("(", 1)[1]
            found[name] = params.count("ptr ") == params.count("ptr noalias")
    return found


def _symbolic_dense() -> tvm.IRModule:
    """flash_attn forward with a symbolic sequence length: VMShapeLower adds a ``shape_func``."""
    n = tirx.Var("n", "int64")
    bb = relax.BlockBuilder()
    params = [relax.Var(name, relax.TensorType((1, 4, n, 64), "float32")) for name in "qkv"]
    with bb.function("main", params):
        bb.emit_func_output(bb.emit(op.flash_attn(*params, causal=True)))
    return bb.get()


def _varlen() -> tvm.IRModule:
    """flash_attn_varlen_backward given the forward's out and lse: its kernel and the host check of
    its offsets, whose symbol sorts last."""
    bb = relax.BlockBuilder()
    t = relax.TensorType((40, 4, 64), "float32")
    params = [relax.Var(name, t) for name in ("q", "k", "v", "do", "out")]
    params += [relax.Var("lse", relax.TensorType((4, 40), "float32"))]
    params += [relax.Var(name, relax.TensorType((3,), "int32")) for name in ("cu_q", "cu_k")]
    q, k, v, do, out, lse, cu_q, cu_k = params
    with bb.function("main", params):
        bb.emit_func_output(bb.emit(op.flash_attn_varlen_backward(q, k, v, do, cu_q, cu_k, out=out, lse=lse,
                                                                  causal=True)))
    return bb.get()


@pytest.mark.parametrize("make", [_symbolic_dense, _varlen], ids=["shape_func", "varlen_check"])
def test_every_kernel_keeps_its_noalias_params(make):
    ex = tvm_fuel.compile(make(), HOST, kernels="tuned")
    functions = _compute_functions(ex)
    kernels = [name for name in functions if name.startswith("fuel_")]
    assert kernels, sorted(functions)  # the kernels ran (not the floor)
    assert all(functions[name] for name in kernels), functions


def test_the_checks_and_shape_functions_are_marked():
    lowered = tvm_fuel.pipeline(HOST, kernels="tuned")(_varlen())
    funcs = {gv.name_hint: f for gv, f in lowered.functions_items() if isinstance(f, tirx.PrimFunc)}
    assert any("check" in name for name in funcs), sorted(funcs)
    missing = [name for name, f in funcs.items() if not (f.attrs and f.attrs.get("tirx.noalias"))]
    assert not missing, missing


def test_a_kernel_next_to_a_check_gives_the_reference():
    from tvm_fuel import reference

    rng = np.random.default_rng(3)
    q, k, v, do = (rng.standard_normal((40, 4, 64)).astype("float32") for _ in range(4))
    cu = np.array([0, 17, 40], np.int32)
    out, lse = (x.astype("float32") for x in reference.flash_attn_varlen(q, k, v, cu, cu, causal=True,
                                                                         return_lse=True))
    vm = relax.VirtualMachine(tvm_fuel.compile(_varlen(), HOST, kernels="tuned"), tvm.cpu())
    grads = vm["main"](*(tvm.runtime.tensor(a) for a in (q, k, v, do, out, lse, cu, cu)))
    for got, want in zip(grads, reference.flash_attn_varlen_backward(q, k, v, do, cu, cu, causal=True)):
        np.testing.assert_allclose(got.numpy(), want, atol=1e-4, rtol=1e-4)
