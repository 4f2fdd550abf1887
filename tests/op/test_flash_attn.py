"""flash_attn, both the compiled decomposition and the CPU kernel, against the numpy reference."""

from __future__ import annotations

import numpy as np
import pytest
from helpers import HOST, WINDOWS, Runner, assert_close, build, dense_inputs, run
from tvm import tirx

from tvm_fuel import op
from tvm_fuel import reference as ref

pytestmark = pytest.mark.numerics



def _check(inputs, dtype, kernels, *, alibi=None, mask=None, **options):
    extra = {}
    if alibi is not None:
        extra["alibi_slopes"] = alibi
    if mask is not None:
        extra["attn_mask"] = mask
    out, lse = run(lambda **a: op.flash_attn(**a, **options, return_lse=True), {**inputs, **extra}, kernels=kernels)
    want_out, want_lse = ref.flash_attn(*inputs.values(), alibi, mask, **options, return_lse=True)
    assert out.dtype == inputs["q"].dtype and lse.dtype == np.float32
    assert_close(out, want_out, dtype, what="out")
    np.testing.assert_array_equal(np.isneginf(lse), np.isneginf(want_lse))  # fully masked rows
    finite = np.isfinite(want_lse)
    np.testing.assert_allclose(lse[finite], want_lse[finite], atol=1e-5, rtol=1e-5, err_msg="lse")
    return out, lse


@pytest.mark.parametrize("window", list(WINDOWS))
@pytest.mark.parametrize("sq,sk", [(17, 97), (97, 17), (1, 97), (17, 17)])
def test_masks_and_lengths(window, sq, sk, kernels):
    rng = np.random.default_rng(sq * 131 + sk)
    _check(dense_inputs(rng, 2, 6, 2, sq, sk, 40, "float32"), "float32", kernels, **WINDOWS[window])


@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
@pytest.mark.parametrize("head_dim,group", [(40, 1), (64, 3), (128, 7)])
def test_dtypes_head_dims_groups(dtype, head_dim, group, kernels):
    rng = np.random.default_rng(head_dim + group)
    hkv = 2 if group < 7 else 1
    _check(dense_inputs(rng, 1, hkv * group, hkv, 17, 33, head_dim, dtype), dtype, kernels, causal=True)


@pytest.mark.parametrize("group", [1, 3, 7])
def test_gqa_head_mapping(group, kernels):
    """Query head h must read kv head h // group: zero all kv heads but one and check which rows see it."""
    rng = np.random.default_rng(group)
    inputs = dense_inputs(rng, 1, 3 * group, 3, 5, 9, 16, "float32")
    inputs["v"][:, [0, 2]] = 0
    (out,) = run(lambda **a: op.flash_attn(**a), inputs, kernels=kernels)
    nonzero_heads = np.flatnonzero(np.abs(out[0]).sum(axis=(1, 2)) > 0)
    np.testing.assert_array_equal(nonzero_heads, np.arange(group, 2 * group))


@pytest.mark.parametrize("dtype", ["float32", "float16"])
@pytest.mark.parametrize("window", ["full", "causal", "two_sided"])
def test_softcap(dtype, window, kernels):
    rng = np.random.default_rng(7)
    inputs = dense_inputs(rng, 2, 4, 2, 17, 40, 64, dtype)
    inputs["q"] = (inputs["q"].astype(np.float32) * 4).astype(inputs["q"].dtype)  # logits beyond the cap
    _check(inputs, dtype, kernels, softcap=5.0, **WINDOWS[window])


@pytest.mark.parametrize("window", ["full", "causal", "left"])
@pytest.mark.parametrize("sq,sk", [(17, 40), (40, 17)])
def test_alibi(window, sq, sk, kernels):
    rng = np.random.default_rng(11)
    inputs = dense_inputs(rng, 2, 6, 3, sq, sk, 40, "float32")
    slopes = (rng.random(6) * 0.3).astype(np.float32)
    _check(inputs, "float32", kernels, alibi=slopes, **WINDOWS[window])


@pytest.mark.parametrize("mask_shape", [(2, 6, 17, 33), (17, 33), (2, 1, 1, 33), (6, 1, 33)])
@pytest.mark.parametrize("kind", ["bool", "additive"])
def test_masks(mask_shape, kind, kernels):
    rng = np.random.default_rng(len(mask_shape))
    inputs = dense_inputs(rng, 2, 6, 3, 17, 33, 40, "float32")
    if kind == "bool":
        mask = rng.random(mask_shape) < 0.7
    else:
        mask = (rng.standard_normal(mask_shape) * 2).astype(np.float32)
    _check(inputs, "float32", kernels, mask=mask, causal=True)


def test_mask_softcap_alibi_together_fp16(kernels):
    rng = np.random.default_rng(3)
    inputs = dense_inputs(rng, 1, 6, 2, 17, 97, 64, "float16")
    slopes = (rng.random(6) * 0.1).astype(np.float32)
    mask = (rng.standard_normal((1, 6, 17, 97))).astype(np.float16)
    _check(inputs, "float16", kernels, alibi=slopes, mask=mask, softcap=10.0, window_size=(40, 5), softmax_scale=0.2)


def test_fully_masked_rows_are_zero_with_neg_inf_lse(kernels):
    """Sq > Sk causal, a bool mask that drops a whole row, and an additive -inf row: zeros, never NaN."""
    rng = np.random.default_rng(5)
    inputs = dense_inputs(rng, 1, 2, 2, 9, 4, 16, "float32")
    mask = np.ones((9, 4), bool)
    mask[7] = False
    out, lse = _check(inputs, "float32", kernels, mask=mask, causal=True)
    assert np.all(out[:, :, :5] == 0) and np.all(np.isneginf(lse[:, :, :5]))  # rows i < Sq - Sk
    assert np.all(out[:, :, 7] == 0) and np.all(np.isneginf(lse[:, :, 7]))

    additive = np.zeros((9, 4), np.float32)
    additive[2] = -np.inf
    out, lse = _check(inputs, "float32", kernels, mask=additive)
    assert np.all(out[:, :, 2] == 0) and np.all(np.isneginf(lse[:, :, 2]))


def test_symbolic_batch(kernels):
    """One executable with a symbolic batch serves several batch sizes."""
    batch = tirx.Var("batch", "int64")
    params = dict(q=((batch, 6, 17, 64), "float32"), k=((batch, 2, 33, 64), "float32"),
                  v=((batch, 2, 33, 64), "float32"))
    runner = Runner(build(lambda **a: op.flash_attn(**a, causal=True, return_lse=True), params), HOST, kernels=kernels)
    rng = np.random.default_rng(0)
    for b in (1, 3):
        inputs = dense_inputs(rng, b, 6, 2, 17, 33, 64, "float32")
        out, lse = runner(*inputs.values())
        want_out, want_lse = ref.flash_attn(*inputs.values(), causal=True, return_lse=True)
        assert out.shape == (b, 6, 17, 64)
        assert_close(out, want_out, "float32")
        assert_close(lse, want_lse, "float32")


def test_symbolic_sequence_lengths(kernels):
    sq, sk = tirx.Var("sq", "int64"), tirx.Var("sk", "int64")
    params = dict(q=((1, 4, sq, 40), "float32"), k=((1, 2, sk, 40), "float32"), v=((1, 2, sk, 40), "float32"))
    runner = Runner(build(lambda **a: op.flash_attn(**a, causal=True), params), HOST, kernels=kernels)
    rng = np.random.default_rng(1)
    for n_q, n_k in ((1, 97), (17, 5)):
        inputs = dense_inputs(rng, 1, 4, 2, n_q, n_k, 40, "float32")
        (out,) = runner(*inputs.values())
        assert_close(out, ref.flash_attn(*inputs.values(), causal=True), "float32")
