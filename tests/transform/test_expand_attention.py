"""ExpandAttention: every fuel op rewritten into Relax primitives against the float64 reference
(``tvm_fuel.reference``, as the floor and the kernels are in the op tests), on the floor tests'
configurations; Relax's Gradient through the expansion against the fused backward's reference
(first order) and against float64 finite differences of the reference (second order)."""

from __future__ import annotations

import numpy as np
import pytest
import tvm
from helpers import BLOCK, HOST, WINDOWS, Runner, assert_close, build, dense_inputs, paged_inputs, randn
from tvm import relax

from tvm_fuel import op
from tvm_fuel import reference as ref
from tvm_fuel.transform.expand_attention import ExpandAttention

pytestmark = pytest.mark.numerics



def _fuel_ops(mod: tvm.IRModule) -> list[str]:
    found = []

    def visit(expr):
        if isinstance(expr, relax.Call) and isinstance(expr.op, tvm.ir.Op) and expr.op.name.startswith("relax.fuel."):
            found.append(expr.op.name)

    for _, func in mod.functions_items():
        if isinstance(func, relax.Function):
            relax.analysis.post_order_visit(func, visit)
    return found


def _expanded(mod: tvm.IRModule) -> tvm.IRModule:
    """``mod`` expanded, asserted to hold no fuel op (so the primitives are what runs)."""
    assert _fuel_ops(mod), "the module under test holds no fuel op"
    expanded = ExpandAttention()(mod)
    assert not _fuel_ops(expanded), _fuel_ops(expanded)
    return expanded


def _reference(name: str, inputs: dict, options: dict) -> list[np.ndarray]:
    """What ``fuel.<name>`` computes on ``inputs`` with ``options``, float64 (a backward's given
    out and lse are its forward's: the reference recomputes them)."""
    arrays = {n: a for n, a in inputs.items() if n not in ("out", "lse")}
    if name.startswith("flash_attn_backward_"):  # a single-gradient form: one of (dq, dk, dv)
        return [ref.flash_attn_backward(**arrays, **options)["qkv".index(name[-1])]]
    want = getattr(ref, name)(**arrays, **options)
    return list(want) if isinstance(want, tuple) else [want]


def _compare(name: str, inputs: dict, dtype="float32", *, scale=2.0, **options) -> list[np.ndarray]:
    """``fuel.<name>(**inputs, **options)`` expanded, built and run, against the reference; each
    output of the declared dtype and shape. Returns the expanded outputs."""
    params = {n: (a.shape, str(a.dtype)) for n, a in inputs.items()}
    mod = build(lambda **a: getattr(op, name)(**a, **options), params)
    declared = mod["main"].ret_ty
    declared = declared.fields if isinstance(declared, tvm.ir.TupleType) else [declared]
    got = Runner(_expanded(mod), HOST)(*inputs.values())
    want = _reference(name, inputs, options)
    assert len(got) == len(want) == len(declared)
    for index, (g, w, info) in enumerate(zip(got, want, declared)):
        assert str(g.dtype) == str(info.dtype) and g.shape == tuple(int(n) for n in info.shape) == w.shape, (
            index, g.dtype, g.shape, info, w.shape)
        if g.ndim == 3 and g.dtype == np.float32 and np.isneginf(w).any():  # lse: empty rows are -inf
            np.testing.assert_array_equal(np.isneginf(g), np.isneginf(w))
            g, w = np.where(np.isneginf(w), 0, g), np.where(np.isneginf(w), 0, w)
        assert_close(g, w, dtype, scale=scale, what=f"output {index}")
    return got


def _flash(inputs, dtype="float32", **options):
    return _compare("flash_attn", inputs, dtype, **options, return_lse=True)


@pytest.mark.parametrize("window", list(WINDOWS))
@pytest.mark.parametrize("sq,sk", [(17, 97), (97, 17)])
def test_masks_and_lengths(window, sq, sk):
    rng = np.random.default_rng(sq * 131 + sk)
    _flash(dense_inputs(rng, 2, 6, 2, sq, sk, 40), **WINDOWS[window])


def test_one_query():
    _flash(dense_inputs(np.random.default_rng(1), 2, 6, 2, 1, 97, 40), causal=True)


@pytest.mark.parametrize("head_dim,group,dtype", [(40, 1, "float32"), (64, 3, "float32"), (128, 7, "float32"),
                                                  (64, 3, "float16"), (128, 7, "bfloat16")])
def test_dtypes_head_dims_groups(head_dim, group, dtype):
    rng = np.random.default_rng(head_dim + group)
    hkv = 2 if group < 7 else 1
    _flash(dense_inputs(rng, 1, hkv * group, hkv, 17, 33, head_dim, dtype), dtype, causal=True)


@pytest.mark.parametrize("dtype", ["float16"])
def test_softcap(dtype):
    inputs = dense_inputs(np.random.default_rng(7), 2, 4, 2, 17, 40, 64, dtype)
    inputs["q"] = (inputs["q"].astype(np.float32) * 4).astype(inputs["q"].dtype)  # logits beyond the cap
    _flash(inputs, dtype, softcap=5.0, **WINDOWS["two_sided"])


@pytest.mark.parametrize("sq,sk", [(17, 40), (40, 17)])
def test_alibi(sq, sk):
    rng = np.random.default_rng(11)
    inputs = dense_inputs(rng, 2, 6, 3, sq, sk, 40)
    inputs["alibi_slopes"] = (rng.random(6) * 0.3).astype(np.float32)
    _flash(inputs, causal=True, window_size=(5, -1))


@pytest.mark.parametrize("mask_shape,kind", [((2, 6, 17, 33), "bool"), ((17, 33), "additive"),
                                             ((2, 1, 1, 33), "bool"), ((6, 1, 33), "additive")])
def test_masks(mask_shape, kind):
    rng = np.random.default_rng(len(mask_shape))
    inputs = dense_inputs(rng, 2, 6, 3, 17, 33, 40)
    if kind == "bool":
        inputs["attn_mask"] = rng.random(mask_shape) < 0.7
    else:
        inputs["attn_mask"] = (rng.standard_normal(mask_shape) * 2).astype(np.float32)
    _flash(inputs, causal=True)


def test_mask_softcap_alibi_together_fp16():
    rng = np.random.default_rng(3)
    inputs = dense_inputs(rng, 1, 6, 2, 17, 97, 64, "float16")
    inputs["alibi_slopes"] = (rng.random(6) * 0.1).astype(np.float32)
    inputs["attn_mask"] = rng.standard_normal((1, 6, 17, 97)).astype(np.float16)
    _flash(inputs, "float16", softcap=10.0, window_size=(40, 5), softmax_scale=0.2)


def test_fully_masked_rows_are_zero_with_neg_inf_lse():
    rng = np.random.default_rng(5)
    inputs = dense_inputs(rng, 1, 2, 2, 9, 4, 16)
    inputs["attn_mask"] = np.ones((9, 4), bool)
    inputs["attn_mask"][7] = False
    out, lse = _flash(inputs, causal=True)
    assert np.all(out[:, :, :5] == 0) and np.all(np.isneginf(lse[:, :, :5]))
    assert np.all(out[:, :, 7] == 0) and np.all(np.isneginf(lse[:, :, 7]))
    inputs["attn_mask"] = np.zeros((9, 4), np.float32)
    inputs["attn_mask"][2] = -np.inf
    out, lse = _flash(inputs)
    assert np.all(out[:, :, 2] == 0) and np.all(np.isneginf(lse[:, :, 2]))


def test_nan_in_dropped_keys_never_reaches_a_row():
    """The NaN rule: NaN in the keys and values a row drops leaves it as it is (the zero-weight skip)."""
    rng = np.random.default_rng(6)
    inputs = dense_inputs(rng, 1, 4, 2, 5, 12, 16)
    inputs["k"][:, :, -1] = np.nan  # dropped by the causal window of every row but the last
    inputs["v"][:, :, -1] = np.nan
    params = {name: (a.shape, str(a.dtype)) for name, a in inputs.items()}
    out, lse = Runner(_expanded(build(lambda **a: op.flash_attn(**a, causal=True, return_lse=True), params)),
                      HOST)(*inputs.values())
    # the first 4 rows against 11 keys: the same bottom-right diagonal (delta = 7), the NaN key cut off
    want_out, want_lse = ref.flash_attn(*(a[:, :, :-1] for a in inputs.values()), causal=True, return_lse=True)
    assert_close(out[:, :, :-1], want_out, "float32")
    assert_close(lse[:, :, :-1], want_lse, "float32")
    assert np.isnan(out[:, :, -1]).all() and np.isnan(lse[:, :, -1]).all()


BACKWARD = {
    "plain": dict(),
    "causal": dict(causal=True),
    "window": dict(window_size=(3, 1)),
    "softcap": dict(softcap=2.0, causal=True),
}


@pytest.mark.parametrize("case,sq,sk", [("plain", 17, 40), ("causal", 40, 17), ("window", 17, 40),
                                        ("softcap", 40, 17)])
def test_backward(case, sq, sk):
    rng = np.random.default_rng(sq + sk)
    _compare("flash_attn_backward", dense_inputs(rng, 2, 6, 2, sq, sk, 40, with_do=True), **BACKWARD[case])


@pytest.mark.parametrize("dtype,head_dim,group", [("float16", 64, 7), ("bfloat16", 128, 1)])
def test_backward_low_precision(dtype, head_dim, group):
    rng = np.random.default_rng(head_dim)
    _compare("flash_attn_backward", dense_inputs(rng, 1, group, 1, 17, 33, head_dim, dtype, with_do=True), dtype,
             scale=4.0, causal=True)


def test_backward_alibi_masks_softcap():
    rng = np.random.default_rng(9)
    inputs = dense_inputs(rng, 2, 6, 3, 17, 33, 40, with_do=True)
    inputs["alibi_slopes"] = (rng.random(6) * 0.3).astype(np.float32)
    inputs["attn_mask"] = rng.random((2, 1, 17, 33)) < 0.8
    _compare("flash_attn_backward", inputs, softcap=4.0, window_size=(8, 2))
    inputs["attn_mask"] = rng.standard_normal((17, 33)).astype(np.float32)
    _compare("flash_attn_backward", inputs, causal=True)


@pytest.mark.parametrize("given", ["out", "lse", "both"])
def test_backward_with_forward_state_and_empty_rows(given):
    """Sq > Sk causal (rows without keys); out and lse from the forward, lse -inf on those rows."""
    rng = np.random.default_rng(2)
    inputs = dense_inputs(rng, 1, 6, 2, 9, 4, 16, with_do=True)
    out, lse = ref.flash_attn(inputs["q"], inputs["k"], inputs["v"], causal=True, return_lse=True)
    state = dict(out=out.astype(np.float32), lse=lse.astype(np.float32))
    inputs.update({name: value for name, value in state.items() if given in (name, "both")})
    dq, dk, dv = _compare("flash_attn_backward", inputs, causal=True)
    assert np.all(dq[:, :, :5] == 0)


@pytest.mark.parametrize("variant", ["q", "k", pytest.param("v", marks=pytest.mark.quick)])
def test_single_gradient_variants(variant):
    rng = np.random.default_rng(ord(variant))
    inputs = dense_inputs(rng, 2, 6, 2, 17, 33, 40, with_do=True)
    inputs["alibi_slopes"] = (rng.random(6) * 0.2).astype(np.float32)
    _compare(f"flash_attn_backward_{variant}", inputs, causal=True, window_size=(9, -1), softcap=6.0)


LENS = [0, 1, BLOCK, 3 * BLOCK, 37, 5 * BLOCK + 7]


@pytest.mark.parametrize("sq,causal", [(1, False), (5, True)])
def test_paged(sq, causal):
    inputs = paged_inputs(np.random.default_rng(sq), LENS, Sq=sq)
    (out,) = _compare("paged_attn", inputs, causal=causal)
    assert np.all(out[0] == 0)  # context length 0


@pytest.mark.parametrize("options", [dict(softcap=3.0), dict(window_size=(20, -1), causal=True),
                                     dict(window_size=(4, 2), softmax_scale=0.3)])
def test_paged_options_and_alibi(options):
    rng = np.random.default_rng(2)
    inputs = paged_inputs(rng, [1, 40, 97], Hq=9, Hkv=3, Sq=4, D=64, max_blocks=7)
    inputs["alibi_slopes"] = (rng.random(9) * 0.2).astype(np.float32)
    _compare("paged_attn", inputs, **options)


def test_paged_low_precision_gqa7_head_dim_128_garbage_table():
    rng = np.random.default_rng(1)
    inputs = paged_inputs(rng, [17, 64, 97], Hq=7, Hkv=1, D=128, Sq=3, dtype="float16", max_blocks=7)
    inputs["block_table"][0, 2:] = np.iinfo(np.int32).max  # dead entries: never read
    _compare("paged_attn", inputs, "float16", causal=True)


def test_softmax_backward():
    rng = np.random.default_rng(8)
    logits = rng.standard_normal((2, 3, 5, 7))
    probs = np.exp(logits) / np.exp(logits).sum(axis=1, keepdims=True)
    inputs = dict(probs=probs.astype(np.float32), dprobs=randn(rng, (2, 3, 5, 7)))
    _compare("softmax_backward", inputs, axis=1)


def test_bad_input_names_op_and_argument():
    import tvm_fuel.transform.expand_attention

    q = relax.Var("q", relax.TensorType(ndim=4, dtype="float32"))
    with pytest.raises(ValueError, match=r"fuel\.flash_attn: .*argument 'q'"):
        tvm_fuel.transform.expand_attention._dims("fuel.flash_attn", "q", q, 4)  # noqa: SLF001 (the shape check, alone)


# -- Gradient through the expansion


def _loss_module(inputs, options):
    """main(q, k, v, do, ...) = sum(flash_attn(q, k, v, ...) * do), expanded."""
    params = {name: (a.shape, str(a.dtype)) for name, a in inputs.items()}
    return _expanded(build(lambda q, k, v, do, **extra: relax.op.sum(
        relax.op.multiply(op.flash_attn(q, k, v, **extra, **options), do)), params))


def _grad_qkv(mod: tvm.IRModule) -> tvm.IRModule:
    return relax.transform.Gradient("main", require_grads=list(mod["main"].params[:3]))(mod)


def _run_adjoint(adjoint: tvm.IRModule, *arrays) -> list[np.ndarray]:
    """``main_adjoint`` alone, compiled as ``main``: (loss, *gradients)."""
    func = adjoint["main_adjoint"].with_attr("global_symbol", "main")
    return Runner(tvm.IRModule({"main": func}), HOST)(*arrays)


@pytest.mark.parametrize("case", ["gqa3_causal_rows_without_keys", "softcap_alibi_mask_window"])
def test_first_order_gradient_matches_fused_backward(case):
    rng = np.random.default_rng(12)
    if case.startswith("gqa3"):
        inputs, options = dense_inputs(rng, 1, 6, 2, 9, 5, 16, with_do=True), dict(causal=True)
    else:
        inputs = dense_inputs(rng, 2, 6, 3, 17, 33, 40, with_do=True)
        inputs["alibi_slopes"] = (rng.random(6) * 0.3).astype(np.float32)
        inputs["attn_mask"] = rng.standard_normal((17, 33)).astype(np.float32)
        options = dict(softcap=4.0, window_size=(8, 2))
    adjoint = _grad_qkv(_loss_module(inputs, options))
    (_, dq, dk, dv) = _run_adjoint(adjoint, *inputs.values())
    want = ref.flash_attn_backward(**inputs, **options)  # the fused backward's float64 reference
    for name, g, w in zip(("dq", "dk", "dv"), (dq, dk, dv), want):
        assert np.isfinite(g).all(), name
        assert_close(g, w.astype(np.float64), "float32", scale=2.0, what=name)


def _second_order_module(adjoint: relax.Function, grad_index: int) -> tuple[tvm.IRModule, relax.Var]:
    """main(*params, w) = sum(grad_index-th gradient of the adjoint * w), one dataflow block."""
    (block,) = adjoint.body.blocks
    grad = adjoint.body.body.fields[1].fields[grad_index]
    w = relax.Var("w", grad.ty)
    product = relax.DataflowVar("product", grad.ty)
    loss = relax.Var("loss2", relax.TensorType((), "float32"))
    body = relax.DataflowBlock(list(block.bindings) + [relax.VarBinding(product, relax.op.multiply(grad, w)),
                                                       relax.VarBinding(loss, relax.op.sum(product))])
    func = relax.Function(list(adjoint.params) + [w], relax.SeqExpr([body], loss), loss.ty)
    return tvm.IRModule({"main": relax.BlockBuilder().normalize(func)}), w


def test_second_order_gradient_matches_finite_differences():
    """d/d(q, k, v) of sum(dq * w), dq from Gradient of the expansion, against central differences
    of the float64 reference's dq along a random direction."""
    rng = np.random.default_rng(13)
    inputs = dense_inputs(rng, 1, 4, 2, 5, 7, 8, with_do=True)
    options = dict(causal=True, softcap=3.0)
    first = _grad_qkv(_loss_module(inputs, options))["main_adjoint"]
    second, _ = _second_order_module(first, 0)
    adjoint = relax.transform.Gradient("main", require_grads=list(second["main"].params[:3]))(second)
    assert not _fuel_ops(adjoint)
    weight = randn(rng, inputs["q"].shape)
    _, *hessian_w = _run_adjoint(adjoint, *inputs.values(), weight)

    arrays = [inputs[n].astype(np.float64) for n in ("q", "k", "v")]
    direction = [rng.standard_normal(a.shape) for a in arrays]

    def f(eps):
        q, k, v = (a + eps * d for a, d in zip(arrays, direction))
        return float((ref.flash_attn_backward(q, k, v, inputs["do"], **options)[0] * weight).sum())

    eps = 1e-5
    numeric = (f(eps) - f(-eps)) / (2 * eps)
    analytic = sum(float((h.astype(np.float64) * d).sum()) for h, d in zip(hessian_w, direction))
    np.testing.assert_allclose(analytic, numeric, rtol=2e-3, atol=2e-3)
