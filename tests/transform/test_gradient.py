"""Training through ``relax.transform.Gradient``: flash_attn's registered gradient, checked against
the reference backward (itself checked against finite differences and PyTorch elsewhere)."""

from __future__ import annotations

import numpy as np
import pytest
import tvm
import tvm_ffi
from helpers import HOST, legalize_checked
from tvm import relax

import tvm_fuel
import tvm_fuel.transform
from tvm_fuel import op, reference

pytestmark = pytest.mark.numerics

B, HQ, HKV, SQ, SK, D = 2, 6, 2, 17, 23, 16  # GQA group 3, Sq != Sk
OPTIONS = dict(causal=True, softcap=5.0)


def _model(*, alibi: bool = False, return_lse: bool = False, loss_uses_lse: bool = False) -> tvm.IRModule:
    """loss = sum(flash_attn(q, k, v) * w) (+ sum(lse) when asked)."""
    bb = relax.BlockBuilder()
    params = [relax.Var("q", relax.TensorType((B, HQ, SQ, D), "float32")),
              relax.Var("k", relax.TensorType((B, HKV, SK, D), "float32")),
              relax.Var("v", relax.TensorType((B, HKV, SK, D), "float32")),
              relax.Var("w", relax.TensorType((B, HQ, SQ, D), "float32"))]
    if alibi:
        params.append(relax.Var("slopes", relax.TensorType((HQ,), "float32")))
    with bb.function("main", params):
        with bb.dataflow():
            q, k, v, w = params[:4]
            result = bb.emit(op.flash_attn(q, k, v, params[4] if alibi else None, return_lse=return_lse, **OPTIONS))
            out = bb.emit(relax.TupleGetItem(result, 0)) if return_lse else result
            loss = bb.emit(relax.op.sum(relax.op.multiply(out, w)))
            if loss_uses_lse:
                loss = bb.emit(relax.op.add(loss, relax.op.sum(relax.TupleGetItem(result, 1))))
            loss = bb.emit_output(loss)
        bb.emit_func_output(loss)
    return bb.get()


def _inputs(mod: tvm.IRModule) -> list[np.ndarray]:
    rng = np.random.default_rng(3)
    return [rng.standard_normal([int(n) for n in p.ty.shape.values]).astype("float32") * (0.1 if p.name == "slopes"
            else 1.0) for p in mod["main"].params]


def _run_adjoint(adjoint: tvm.IRModule, arrays, kernels: str):
    executable = tvm.compile(legalize_checked(adjoint, HOST, kernels), target=HOST)
    loss, grads = relax.VirtualMachine(executable, tvm.cpu())["main_adjoint"](*map(tvm.runtime.tensor, arrays))
    return float(loss.numpy()), [g.numpy() for g in grads]


def _calls(func: relax.Function, name: str) -> list[relax.Call]:
    found = []
    relax.analysis.post_order_visit(func, lambda e: found.append(e) if isinstance(e, relax.Call) and isinstance(
        e.op, tvm.ir.Op) and e.op.name == f"relax.fuel.{name}" else None)
    return found


@pytest.mark.parametrize("alibi", [False, True])
def test_gradients_match_the_reference(alibi, kernels):
    mod = _model(alibi=alibi)
    adjoint = tvm_fuel.transform.gradient(mod, require_grads=mod["main"].params[:3])
    arrays = _inputs(mod)
    loss, (dq, dk, dv) = _run_adjoint(adjoint, arrays, kernels)
    q, k, v, w = arrays[:4]
    slopes = arrays[4] if alibi else None
    out = reference.flash_attn(q, k, v, slopes, **OPTIONS)
    want = reference.flash_attn_backward(q, k, v, w, slopes, **OPTIONS)
    np.testing.assert_allclose(loss, (out * w).sum(), rtol=1e-4, atol=1e-3)
    for name, got, expected in zip(("dq", "dk", "dv"), (dq, dk, dv), want):
        np.testing.assert_allclose(got, expected, atol=2e-4, rtol=2e-4, err_msg=name)


def test_the_backward_reuses_the_forwards_out_and_lse():
    mod = _model()
    adjoint = tvm_fuel.transform.gradient(mod, require_grads=mod["main"].params[:3])["main_adjoint"]
    (forward,) = _calls(adjoint, "flash_attn")
    (backward,) = _calls(adjoint, "flash_attn_backward")
    assert bool(forward.attrs["return_lse"])
    assert bool(backward.attrs["has_out"]) and bool(backward.attrs["has_lse"])
    # plain Gradient works too: out is reused, lse recomputed by the backward
    plain = relax.transform.Gradient("main", require_grads=mod["main"].params[:3])(mod)["main_adjoint"]
    (backward,) = _calls(plain, "flash_attn_backward")
    assert bool(backward.attrs["has_out"]) and not bool(backward.attrs["has_lse"])
    arrays = _inputs(mod)
    plain_grads = _run_adjoint(tvm.IRModule({"main_adjoint": plain}), arrays, "decomposed")[1]
    shared_grads = _run_adjoint(tvm_fuel.transform.gradient(mod, require_grads=mod["main"].params[:3]), arrays,
                                "decomposed")[1]
    for a, b in zip(plain_grads, shared_grads):
        np.testing.assert_allclose(a, b, atol=1e-5, rtol=1e-5)


def test_return_lse_models_differentiate_through_out():
    mod = _model(return_lse=True)
    adjoint = relax.transform.Gradient("main", require_grads=mod["main"].params[:3])(mod)
    arrays = _inputs(mod)
    _, grads = _run_adjoint(adjoint, arrays, "tuned")
    want = reference.flash_attn_backward(*arrays[:4], **OPTIONS)
    for got, expected in zip(grads, want):
        np.testing.assert_allclose(got, expected, atol=2e-4, rtol=2e-4)


def test_a_loss_on_lse_is_refused_by_name():
    mod = _model(return_lse=True, loss_uses_lse=True)
    with pytest.raises(Exception, match="gradient through lse is not supported"):
        relax.transform.Gradient("main", require_grads=mod["main"].params[:3])(mod)


def test_paged_attn_is_not_differentiable():
    bb = relax.BlockBuilder()
    q = relax.Var("q", relax.TensorType((1, 4, 1, 16), "float32"))
    cache = relax.Var("cache", relax.TensorType((3, 16, 2, 16), "float32"))
    table = relax.Var("table", relax.TensorType((1, 3), "int32"))
    lens = relax.Var("lens", relax.TensorType((1,), "int32"))
    with bb.function("main", [q, cache, table, lens]):
        with bb.dataflow():
            out = bb.emit(op.paged_attn(q, cache, cache, table, lens))
            loss = bb.emit_output(bb.emit(relax.op.sum(out)))
        bb.emit_func_output(loss)
    with pytest.raises(Exception, match="fuel.paged_attn is not differentiable"):
        relax.transform.Gradient("main", require_grads=[q])(bb.get())


def _softmax_model(axis: int) -> tvm.IRModule:
    """loss = sum(softmax(x @ m, axis) * w): a softmax of the model's own, outside any fuel op."""
    bb = relax.BlockBuilder()
    x, m, w = (relax.Var(n, relax.TensorType(s, "float32")) for n, s in (("x", (3, 17, 8)), ("m", (8, 7)),
                                                                          ("w", (3, 17, 7))))
    with bb.function("main", [x, m, w]):
        with bb.dataflow():
            probs = bb.emit(relax.op.nn.softmax(relax.op.matmul(x, m), axis=axis))
            loss = bb.emit_output(bb.emit(relax.op.sum(relax.op.multiply(probs, w))))
        bb.emit_func_output(loss)
    return bb.get()


@pytest.mark.parametrize("axis", [-1, 1])
def test_softmax_gradients_use_softmax_backward(axis):
    mod = _softmax_model(axis)
    plain = relax.transform.Gradient("main")(mod)  # TVM's own softmax gradient, written out
    fused = tvm_fuel.transform.gradient(mod)
    assert len(_calls(fused["main_adjoint"], "softmax_backward")) == 1
    assert int(_calls(fused["main_adjoint"], "softmax_backward")[0].attrs["axis"]) == axis
    arrays = _inputs(mod)
    want, got = (_run_adjoint(m, arrays, "decomposed") for m in (plain, fused))
    np.testing.assert_allclose(got[0], want[0], rtol=1e-6)
    for g, w in zip(got[1], want[1]):
        np.testing.assert_allclose(g, w, atol=1e-5, rtol=1e-5)


def test_require_grads_takes_what_relax_gradient_takes():
    """Issue 29, item 8: one Var (which relax.transform.Gradient accepts), a list, an Array or a
    tuple of parameters: the same adjoint, with a gradient for exactly those parameters."""
    mod = _model()
    q, k = mod["main"].params[:2]
    one = tvm_fuel.transform.gradient(mod, require_grads=q)["main_adjoint"]
    grads = one.ret_ty.fields[1]
    assert len(grads.fields) == 1 and [int(n) for n in grads.fields[0].shape.values] == [B, HQ, SQ, D]
    assert tvm_ffi.structural_equal(one, tvm_fuel.transform.gradient(mod, require_grads=[q])["main_adjoint"])
    pair = tvm_fuel.transform.gradient(mod, require_grads=[k, q])["main_adjoint"]
    for form in (tvm_ffi.convert([k, q]), (k, q)):
        assert tvm_ffi.structural_equal(pair, tvm_fuel.transform.gradient(mod, require_grads=form)["main_adjoint"])


def test_require_grads_outside_the_parameters_is_refused_by_name():
    """Issue 29, item 8: a variable of the body, another function's Var of a parameter's name, a
    parameter named twice, a non-Var, an unknown function: errors naming the function and the
    variable (were: ``z is not in list``)."""
    mod = _model()
    q = mod["main"].params[0]
    inner = mod["main"].body.blocks[0].bindings[0].var
    where = r"tvm_fuel\.transform\.gradient: "
    with pytest.raises(ValueError, match=where + rf"require_grads names '{inner.name}', which is not a parameter "
                                               r"of 'main' \(its parameters: q, k, v, w\)$"):
        tvm_fuel.transform.gradient(mod, require_grads=[inner])
    with pytest.raises(ValueError, match=where + r"require_grads names 'q', .*another Var of that name"):
        tvm_fuel.transform.gradient(mod, require_grads=relax.Var("q", q.ty))
    with pytest.raises(ValueError, match=where + r"require_grads names parameter 'q' of 'main' twice"):
        tvm_fuel.transform.gradient(mod, require_grads=[q, q])
    with pytest.raises(TypeError, match=where + r"require_grads must hold relax\.Vars, got int"):
        tvm_fuel.transform.gradient(mod, require_grads=[q, 1])
    with pytest.raises(TypeError, match=where + r"require_grads must be a relax\.Var or a list of them, got str"):
        tvm_fuel.transform.gradient(mod, require_grads="q")
    with pytest.raises(ValueError, match=where + r"no Relax function 'train' in the module "
                                               r"\(its Relax functions: main\)"):
        tvm_fuel.transform.gradient(mod, "train")
