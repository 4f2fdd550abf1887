"""Head dims 1..256 (FlashAttention serves every one; Gemma uses 256, many models 80, 96, 112):
flash_attn, its backward and paged decode through each path of the ``kernels`` fixture (the
floor, the CPU kernels, the CUDA kernels' emulation) against the numpy reference. Odd dims take
the kernels' padded loads (a partial vector of lanes, or a partial 16-wide MMA step)."""

from __future__ import annotations

import numpy as np
import pytest
from helpers import assert_close, dense_inputs, paged_inputs, run

from tvm_fuel import op
from tvm_fuel import reference as ref

pytestmark = pytest.mark.numerics

# (head dim, GQA group, dtype): every dim the issue names, the smallest ones, dtypes and groups mixed
DIMS = [(1, 1, "float32"), (8, 3, "float16"), (80, 7, "bfloat16"), (96, 1, "float16"), (112, 3, "float32"),
        (160, 1, "bfloat16"), (192, 3, "float16"), (256, 7, "float32"), (256, 1, "float16")]


@pytest.mark.parametrize("head_dim,group,dtype", DIMS)
def test_forward_and_backward(head_dim, group, dtype, kernels):
    rng = np.random.default_rng(head_dim * 10 + group)
    hkv = 2 if group < 7 else 1
    inputs = dense_inputs(rng, 1, hkv * group, hkv, 17, 33, head_dim, dtype, with_do=True)
    q, k, v, do = inputs.values()
    out, lse = run(lambda q, k, v, do: op.flash_attn(q, k, v, causal=True, softcap=5.0, return_lse=True), inputs,
                   kernels=kernels)
    want_out, want_lse = ref.flash_attn(q, k, v, causal=True, softcap=5.0, return_lse=True)
    assert out.shape == q.shape and out.dtype == q.dtype
    assert_close(out, want_out, dtype, what="out")
    np.testing.assert_allclose(lse, want_lse, atol=1e-5, rtol=1e-5, err_msg="lse")
    grads = run(lambda **a: op.flash_attn_backward(**a, causal=True, softcap=5.0), inputs, kernels=kernels)
    want = ref.flash_attn_backward(q, k, v, do, causal=True, softcap=5.0)
    for name, got, expected, like in zip(("dq", "dk", "dv"), grads, want, (q, k, v)):
        assert got.shape == like.shape and got.dtype == like.dtype
        assert_close(got, expected, dtype, scale=2.0, what=name)  # test_flash_attn_backward's scale


@pytest.mark.parametrize("head_dim,group,dtype", [(1, 3, "float32"), (80, 7, "float16"), (160, 1, "float32"),
                                                  (256, 3, "bfloat16")])
def test_paged_decode(head_dim, group, dtype, kernels):
    rng = np.random.default_rng(head_dim)
    inputs = paged_inputs(rng, [0, 1, 17, 97], Hq=2 * group, Hkv=2, D=head_dim, Sq=2, dtype=dtype, max_blocks=7,
                          num_blocks=28)
    (out,) = run(lambda **a: op.paged_attn(**a, causal=True), inputs, kernels=kernels)
    assert_close(out, ref.paged_attn(*inputs.values(), causal=True), dtype)
    assert np.all(out[0] == 0)  # context length 0
