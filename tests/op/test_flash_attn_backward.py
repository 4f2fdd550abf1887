"""Backward: the reference against finite differences; the decomposition and the CPU kernel
against the reference; the single-gradient variants against the tuple op."""

from __future__ import annotations

import numpy as np
import pytest
from helpers import assert_close, dense_inputs, run

from tvm_fuel import op
from tvm_fuel import reference as ref

pytestmark = pytest.mark.numerics

CASES = {
    "plain": dict(),
    "causal": dict(causal=True),
    "window": dict(window_size=(3, 1)),
    "softcap": dict(softcap=2.0, causal=True),
}


def _loss(q, k, v, do, extra, options):
    return float((ref.flash_attn(q, k, v, *extra, **options) * do).sum())


def _finite_difference(arrays, index, extra, options, eps=1e-6):
    x = arrays[index]
    grad = np.zeros_like(x)
    for pos in np.ndindex(x.shape):
        saved = x[pos]
        x[pos] = saved + eps
        plus = _loss(*arrays, extra, options)
        x[pos] = saved - eps
        minus = _loss(*arrays, extra, options)
        x[pos] = saved
        grad[pos] = (plus - minus) / (2 * eps)
    return grad


@pytest.mark.parametrize("case", list(CASES) + ["alibi_mask"])
@pytest.mark.parametrize("sq,sk", [(3, 5), (5, 3)])
def test_reference_backward_matches_finite_differences(case, sq, sk):
    """Tiny float64 shapes, GQA group 2; (5, 3) with causal has fully masked rows."""
    rng = np.random.default_rng(sq * 10 + sk)
    q, k, v = rng.standard_normal((1, 4, sq, 3)), rng.standard_normal((1, 2, sk, 3)), rng.standard_normal((1, 2, sk, 3))
    do = rng.standard_normal((1, 4, sq, 3))
    extra, options = (), CASES.get(case, dict(causal=True))
    if case == "alibi_mask":
        extra = (rng.random(4) * 0.5, rng.standard_normal((sq, sk)))
    grads = ref.flash_attn_backward(q, k, v, do, *extra, **options)
    arrays = [q, k, v, do]
    for index, grad in enumerate(grads):
        np.testing.assert_allclose(grad, _finite_difference(arrays, index, extra, options), atol=1e-7, rtol=1e-6)


def _check(inputs, dtype, kernels, extra=None, **options):
    extra = extra or {}
    got = run(lambda **a: op.flash_attn_backward(**a, **options), {**inputs, **extra}, kernels=kernels)
    want = ref.flash_attn_backward(*inputs.values(), extra.get("alibi_slopes"), extra.get("attn_mask"), **options)
    for name, g, w, src in zip(("dq", "dk", "dv"), got, want, ("q", "k", "v")):
        assert g.dtype == inputs[src].dtype and g.shape == inputs[src].shape
        assert_close(g, w, dtype, scale=2.0, what=name)
    return got


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("sq,sk", [(17, 40), (40, 17), (1, 40)])
def test_matches_reference(case, sq, sk, kernels):
    rng = np.random.default_rng(sq + sk)
    _check(dense_inputs(rng, 2, 6, 2, sq, sk, 40, "float32", with_do=True), "float32", kernels, **CASES[case])


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("head_dim,group", [(64, 7), (128, 1)])
def test_low_precision(dtype, head_dim, group, kernels):
    rng = np.random.default_rng(head_dim)
    _check(dense_inputs(rng, 1, group, 1, 17, 33, head_dim, dtype, with_do=True), dtype, kernels, causal=True)


def test_alibi_masks_softcap(kernels):
    rng = np.random.default_rng(9)
    inputs = dense_inputs(rng, 2, 6, 3, 17, 33, 40, "float32", with_do=True)
    extra = dict(alibi_slopes=(rng.random(6) * 0.3).astype(np.float32),
                 attn_mask=rng.random((2, 1, 17, 33)) < 0.8)
    _check(inputs, "float32", kernels, extra, softcap=4.0, window_size=(8, 2))
    extra["attn_mask"] = rng.standard_normal((17, 33)).astype(np.float32)
    _check(inputs, "float32", kernels, extra, causal=True)


def test_fully_masked_rows_get_zero_gradient(kernels):
    rng = np.random.default_rng(4)
    inputs = dense_inputs(rng, 1, 3, 1, 9, 4, 16, "float32", with_do=True)
    dq, dk, dv = _check(inputs, "float32", kernels, causal=True)
    assert np.all(dq[:, :, :5] == 0)  # rows i < Sq - Sk see no key
    # the masked rows' do must not reach dv: changing it leaves dv unchanged
    inputs["do"][:, :, :5] = 1e3
    _, _, dv2 = run(lambda **a: op.flash_attn_backward(**a, causal=True), inputs, kernels=kernels)
    np.testing.assert_array_equal(dv, dv2)


@pytest.mark.parametrize("dtype", ["float32", "float16"])
@pytest.mark.parametrize("given", ["out", "lse", "both"])
def test_forward_state_is_reused(dtype, given, kernels):
    """With out/lse from the forward, the gradients equal the recomputing ones."""
    rng = np.random.default_rng(2)
    inputs = dense_inputs(rng, 1, 4, 2, 17, 33, 64, dtype, with_do=True)
    options = dict(causal=True, softcap=3.0)
    fwd = {name: inputs[name] for name in ("q", "k", "v")}
    out, lse = run(lambda **a: op.flash_attn(**a, **options, return_lse=True), fwd, kernels=kernels)
    state = {"out": out, "lse": lse} if given == "both" else {given: {"out": out, "lse": lse}[given]}

    def make(q, k, v, do, **s):
        return op.flash_attn_backward(q, k, v, do, **s, **options)

    got = run(make, {**inputs, **state}, kernels=kernels)
    want = ref.flash_attn_backward(*inputs.values(), **options)
    for g, w in zip(got, want):
        # out rounded to the dtype enters D = rowsum(do * out): one more rounding than the reference
        assert_close(g, w, dtype, scale=4.0)


@pytest.mark.parametrize("variant,index", [("q", 0), ("k", 1), ("v", 2)])
def test_single_gradient_variants_match_tuple(variant, index, kernels):
    rng = np.random.default_rng(index)
    inputs = dense_inputs(rng, 2, 6, 2, 17, 33, 40, "float32", with_do=True)
    options = dict(causal=True, window_size=(9, -1), softcap=6.0)
    slopes = (rng.random(6) * 0.2).astype(np.float32)
    whole = run(lambda **a: op.flash_attn_backward(**a, **options), {**inputs, "alibi_slopes": slopes}, kernels=kernels)
    single = getattr(op, f"flash_attn_backward_{variant}")
    (one,) = run(lambda **a: single(**a, **options), {**inputs, "alibi_slopes": slopes}, kernels=kernels)
    np.testing.assert_array_equal(one, whole[index])


@pytest.mark.parametrize("sq,sk,options", [(130, 200, dict(causal=True, window_size=(70, -1), softcap=3.0)),
                                           (200, 70, dict(causal=True)), (97, 130, dict(window_size=(20, 40)))])
def test_many_key_tiles_and_splits(sq, sk, options, kernels):
    """Several 64-key tiles and several query tiles per key tile (MQA, batch 1). How many split-KV
    partials dq sums follows the machine's cores here; test_knob_paths pins every split count."""
    rng = np.random.default_rng(sq + sk)
    _check(dense_inputs(rng, 1, 3, 1, sq, sk, 40, "float32", with_do=True), "float32", kernels, **options)
