"""Second derivatives through ``relax.transform.Gradient``: the backward ops' registered gradient is
the fused ``flash_attn_double_backward``, so ``tvm_fuel.transform.gradient`` applied to an adjoint
(through ``with_objective``) differentiates again. Checked against the float64 reference double
backward (itself checked against finite differences and PyTorch in test_reference_higher_order),
on the floor and on the CPU kernels, on a covering matrix of GQA groups, head dims, lengths, masks,
softcap and ALiBi."""

from __future__ import annotations

import numpy as np
import pytest
import tvm
from helpers import HOST, legalize_checked, randn
from tvm import relax

import tvm_fuel.transform
from tvm_fuel import op
from tvm_fuel import reference as ref

pytestmark = pytest.mark.numerics

PATHS = ["decomposed", "tuned"]  # the floor, and the CPU kernels (legalize_checked refuses a floor fallback)

# (group, D, Sq, Sk, options, extra): every group 1/3/7, head dim 40/64/128, length 1/17/97 appears;
# Sq > Sk with causal leaves fully masked rows
CASES = {
    "g1-d40-causal-additive-mask-softcap": (1, 40, 17, 97, dict(causal=True, softcap=3.0), "additive"),
    "g3-d64-softcap-alibi-masked-rows": (3, 64, 97, 17, dict(causal=True, softcap=2.0), "alibi"),
    "g7-d128-window-bool-mask-decode": (7, 128, 1, 97, dict(window_size=(3, 1)), "bool"),
}
# the single-gradient forms: Gradient's wiring on the floor for each, and through the kernels for one
# (the kernel's single-cotangent paths are checked op by op in op/test_jvp_and_double_backward), on a case
# without softcap (the backward_v kernel with softcap compiles for a minute)
SINGLE_CASE = "g7-d40-alibi"
SINGLE = [("q", "decomposed"), ("q", "tuned"), ("k", "decomposed"),
          pytest.param("v", "decomposed", marks=pytest.mark.quick)]  # the quick run's floor case: 4 s, not 7
_ALL_CASES = {**CASES, SINGLE_CASE: (7, 40, 97, 97, dict(), "alibi")}


def _inputs(case: str, rng: np.random.Generator) -> tuple[dict, dict]:
    group, D, Sq, Sk, options, extra = _ALL_CASES[case]
    Hkv = 1 if group == 7 else 2
    Hq = group * Hkv
    arrays = dict(q=randn(rng, (1, Hq, Sq, D), "float32"), k=randn(rng, (1, Hkv, Sk, D), "float32"),
                  v=randn(rng, (1, Hkv, Sk, D), "float32"), do=randn(rng, (1, Hq, Sq, D), "float32"))
    constants = {}
    if extra == "alibi":
        constants["alibi_slopes"] = (rng.random(Hq) * 0.5).astype("float32")
    elif extra == "bool":
        constants["attn_mask"] = rng.random((1, Hq, Sq, Sk)) > 0.3
    elif extra == "additive":
        mask = rng.standard_normal((Sq, Sk)).astype("float32")
        mask[min(3, Sq - 1), :] = -np.inf  # a row the mask drops entirely
        mask[:, 5] = -np.inf
        constants["attn_mask"] = mask
    return arrays, constants


def _first_order(arrays: dict, constants: dict, options: dict, grads: str) -> tvm.IRModule:
    """main(q, k, v, do, [constants], a_dq, a_dk, a_dv) -> sum(out * do) and its adjoint w.r.t. q, k,
    v, do; ``grads`` names the backward form: "all" (flash_attn's own gradient) or one of q, k, v
    (an explicit flash_attn_backward_<x>, whose gradient is the single-cotangent double backward)."""
    bb = relax.BlockBuilder()
    params = {n: relax.Var(n, relax.TensorType(a.shape, str(a.dtype))) for n, a in {**arrays, **constants}.items()}
    with bb.function("main", list(params.values())):
        with bb.dataflow():
            q, k, v, do = (params[n] for n in ("q", "k", "v", "do"))
            alibi, mask = params.get("alibi_slopes"), params.get("attn_mask")
            if grads == "all":
                out = bb.emit(op.flash_attn(q, k, v, alibi, mask, **options))
                loss = bb.emit(relax.op.sum(relax.op.multiply(out, do)))
            else:  # loss = <d(sum(out * do))/dx, do_x>: a first derivative written out explicitly
                backward = getattr(op, f"flash_attn_backward_{grads}")
                dx = bb.emit(backward(q, k, v, do, alibi, mask, **options))
                loss = bb.emit(relax.op.sum(relax.op.multiply(dx, dx)))
            result = bb.emit_output(loss)
        bb.emit_func_output(result)
    return bb.get()


def _bars(rng, arrays):
    return dict(dq_bar=randn(rng, arrays["q"].shape, "float32"), dk_bar=randn(rng, arrays["k"].shape, "float32"),
                dv_bar=randn(rng, arrays["v"].shape, "float32"))


def _penalty_adjoint(mod: tvm.IRModule, bars: dict) -> tvm.IRModule:
    """The adjoint of ``<dq, dq_bar> + <dk, dk_bar> + <dv, dv_bar>`` (gradients of main's loss, the
    bars constants bound in), w.r.t. q, k, v, do: the double backward with those cotangents."""
    adjoint = tvm_fuel.transform.gradient(mod, require_grads=mod["main"].params[:4])

    def objective(result):
        grads = result.fields[1]
        terms = [relax.op.sum(relax.op.multiply(grads.fields[i], relax.const(bars[name])))
                 for i, name in enumerate(("dq_bar", "dk_bar", "dv_bar"))]
        return relax.op.add(relax.op.add(terms[0], terms[1]), terms[2])

    penalized = tvm_fuel.transform.with_objective(adjoint, "main_adjoint", "penalty", objective)
    return tvm_fuel.transform.gradient(penalized, "penalty", require_grads=penalized["penalty"].params[:4])


def _run(mod: tvm.IRModule, func: str, values: list, kernels: str):
    legalized = legalize_checked(mod, HOST, kernels)
    executable = tvm.compile(legalized, target=HOST)
    _, grads = relax.VirtualMachine(executable, tvm.cpu())[func](*map(tvm.runtime.tensor, values))
    return [g.numpy() for g in grads], legalized


def _fused_calls(mod: tvm.IRModule, func: str) -> list[str]:
    found = []
    relax.analysis.post_order_visit(mod[func], lambda e: found.append(e.op.name) if isinstance(
        e, relax.Call) and isinstance(e.op, tvm.ir.Op) and e.op.name.startswith("relax.fuel.") else None)
    return found


def _assert_matches(got, want, what):
    for name, g, w in zip(("q_grad", "k_grad", "v_grad", "do_grad"), got, want):
        assert g.shape == w.shape, (what, name)
        # 1e-4 relative to the result's scale (float32 kernels against the float64 reference)
        np.testing.assert_allclose(g, w, rtol=1e-4, atol=1e-4 * max(1.0, np.abs(w).max()), err_msg=f"{what} {name}")


@pytest.mark.parametrize("kernels", PATHS)
# the quick run takes the decode case (8 s through the kernels; the first, with softcap, 24 s)
@pytest.mark.parametrize("case", [pytest.param(case, marks=pytest.mark.quick) if "decode" in case else case
                                  for case in CASES])
def test_gradient_of_the_adjoint_is_the_double_backward(case, kernels):
    rng = np.random.default_rng(len(case))
    arrays, constants = _inputs(case, rng)
    options = CASES[case][4]
    bars = _bars(rng, arrays)
    second = _penalty_adjoint(_first_order(arrays, constants, options, "all"), bars)
    assert "relax.fuel.flash_attn_double_backward" in _fused_calls(second, "penalty_adjoint")
    got, legalized = _run(second, "penalty_adjoint", [*arrays.values(), *constants.values()], kernels)
    if kernels == "tuned":  # the double backward's CPU kernel ran (legalize_checked: no floor fallback)
        assert any(gv.name_hint.startswith("fuel_flash_attn_double_backward_kernel") for gv in legalized.functions)
    want = ref.flash_attn_double_backward(*arrays.values(), *bars.values(), constants.get("alibi_slopes"),
                                          constants.get("attn_mask"), **options)
    _assert_matches(got, want, case)


@pytest.mark.parametrize("grad,kernels", SINGLE)
def test_single_gradient_backward_forms_differentiate(grad, kernels):
    """loss = |dx|^2 of flash_attn_backward_<x>: its gradient is the double backward with the one
    cotangent 2 dx (the others absent, their terms skipped)."""
    rng = np.random.default_rng(7)
    arrays, constants = _inputs(SINGLE_CASE, rng)
    options = _ALL_CASES[SINGLE_CASE][4]
    mod = _first_order(arrays, constants, options, grad)
    adjoint = tvm_fuel.transform.gradient(mod, require_grads=mod["main"].params[:4])
    calls = _fused_calls(adjoint, "main_adjoint")
    assert "relax.fuel.flash_attn_double_backward" in calls
    got, _ = _run(adjoint, "main_adjoint", [*arrays.values(), *constants.values()], kernels)
    slopes = constants.get("alibi_slopes")
    first = ref.flash_attn_backward(*arrays.values(), slopes, **options)
    bar = 2 * first["qkv".index(grad)]
    bars = {f"d{x}_bar": bar if x == grad else None for x in "qkv"}
    want = ref.flash_attn_double_backward(*arrays.values(), *bars.values(), slopes, **options)
    _assert_matches(got, want, f"backward_{grad}")


def test_the_double_backward_has_no_gradient():
    arrays, _ = _inputs("g1-d40-causal-additive-mask-softcap", np.random.default_rng(0))
    bb = relax.BlockBuilder()
    params = [relax.Var(n, relax.TensorType(a.shape, "float32")) for n, a in arrays.items()]
    with bb.function("main", params):
        with bb.dataflow():
            result = bb.emit(op.flash_attn_double_backward(*params, dq_bar=params[0]))
            loss = bb.emit_output(bb.emit(relax.op.sum(relax.TupleGetItem(result, 0))))
        bb.emit_func_output(loss)
    with pytest.raises(Exception, match="fuel.flash_attn_double_backward has no gradient"):
        tvm_fuel.transform.gradient(bb.get())


def test_with_objective_refuses_a_function_of_several_blocks():
    bb = relax.BlockBuilder()
    x = relax.Var("x", relax.TensorType((2,), "float32"))
    with bb.function("main", [x]):
        y = bb.emit(relax.op.sum(x))
        bb.emit_func_output(y)
    with pytest.raises(ValueError, match="with_objective: 'main' must be one dataflow block"):
        tvm_fuel.transform.with_objective(bb.get(), "main", "f", lambda result: result)


@pytest.mark.parametrize("axis", [-1, 1])
def test_softmax_backward_differentiates(axis):
    """tvm_fuel.transform.gradient writes softmax gradients as softmax_backward; a second gradient
    differentiates it (its registered VJP) and matches Relax's own second derivative of softmax."""
    rng = np.random.default_rng(axis + 5)
    x_np, w_np, u_np = (rng.standard_normal((2, 3, 5, 7)).astype("float32") for _ in range(3))
    bb = relax.BlockBuilder()
    x, w = (relax.Var(n, relax.TensorType(a.shape, "float32")) for n, a in (("x", x_np), ("w", w_np)))
    with bb.function("main", [x, w]):
        with bb.dataflow():
            loss = bb.emit_output(relax.op.sum(relax.op.multiply(relax.op.nn.softmax(x, axis=axis), w)))
        bb.emit_func_output(loss)
    mod = bb.get()

    def objective(result):
        return relax.op.sum(relax.op.multiply(result.fields[1].fields[0], relax.const(u_np)))

    results = {}
    for name, first_gradient in (("fuel", tvm_fuel.transform.gradient), ("relax", None)):
        if first_gradient is None:
            adjoint = relax.transform.Gradient("main", require_grads=mod["main"].params[:1])(mod)
        else:
            adjoint = first_gradient(mod, require_grads=mod["main"].params[:1])
            assert "relax.fuel.softmax_backward" in _fused_calls(adjoint, "main_adjoint")
        second = tvm_fuel.transform.with_objective(adjoint, "main_adjoint", "directional", objective)
        second = tvm_fuel.transform.gradient(second, "directional", require_grads=second["directional"].params)
        results[name], _ = _run(second, "directional_adjoint", [x_np, w_np], "decomposed")
    for got, want in zip(results["fuel"], results["relax"]):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
