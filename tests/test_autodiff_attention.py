"""The gradient of TVM's ``R.nn.attention`` / ``attention_bias`` (``tvm_fuel.autodiff.attention``):
``flash_attn_backward`` where FuseAttention's rule says the call is ``flash_attn`` exactly."""

from __future__ import annotations

import numpy as np
import pytest
from tvm import relax

from tvm_fuel.transform import gradient

from gradcheck import finite_differences, loss_module, run_adjoint

R = relax.op


def _sdpa(q, k, v, bias, scale, causal):
    """numpy attention in [B, S, H, D] (float64): softmax(scale q k^T + bias, bottom-right or
    top-left causal) v."""
    from tvm_fuel import reference

    heads = lambda x: x.transpose(0, 2, 1, 3)  # noqa: E731
    sq, sk = q.shape[1], k.shape[1]
    mask = None
    if causal == "TopLeft":
        mask = np.where(np.arange(sk)[None, :] <= np.arange(sq)[:, None], 0.0, -np.inf)
    extra = bias if mask is None else (mask if bias is None else bias + mask)
    out = reference.flash_attn(heads(q), heads(k), heads(v), attn_mask=extra, softmax_scale=scale,
                               causal=causal == "BottomRight")
    return heads(out)


ATTENTION = [("BottomRight", 5, 7, False, None), ("TopLeft", 6, 6, False, 0.3), ("TopLeft", 7, 4, False, None),
             (None, 4, 6, True, None)]


@pytest.mark.parametrize("causal,sq,sk,with_bias,scale", ATTENTION, ids=str)
def test_relax_attention_gradient_runs_the_fused_backward(causal, sq, sk, with_bias, scale):
    """``R.nn.attention``'s gradient is flash_attn_backward on the [B, H, S, D] views (asserted in
    the adjoint), against finite differences of numpy attention."""
    rng = np.random.default_rng(4)
    b, h, d = 2, 3, 8
    q, k, v = rng.standard_normal((b, sq, h, d)), rng.standard_normal((b, sk, h, d)), rng.standard_normal((b, sk, h, d))
    bias = rng.standard_normal((b, h, sq, sk)) if with_bias else None
    cotangent = rng.standard_normal(q.shape[:3] + (d,))

    def make(q, k, v, *rest):
        return R.nn.attention(q, k, v, rest[0] if rest else None, scale=scale, causal_mask=causal)

    inputs = [q, k, v] + ([bias] if with_bias else [])
    adjoint = gradient(loss_module(make, [x.shape for x in inputs], "float32", [cotangent]),
                       require_grads=None)
    assert "R.fuel.flash_attn_backward" in adjoint["main_adjoint"].script()
    _, grads = run_adjoint(adjoint, "main_adjoint", [x.astype("float32") for x in inputs])
    expected = finite_differences(lambda q, k, v: float((_sdpa(q, k, v, bias, scale, causal) * cotangent).sum()),
                                   [q, k, v])  # (the bias gets no gradient)
    for got, want in zip(grads[:3], expected):
        np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4)


def test_relax_attention_without_a_flash_equivalent_says_so():
    ty = relax.TensorType
    q = relax.Var("q", ty((1, 5, 2, 8), "float32"))
    k = relax.Var("k", ty((1, 7, 2, 8), "float32"))
    bb = relax.BlockBuilder()
    with bb.function("main", [q, k]):
        with bb.dataflow():
            loss = bb.emit_output(R.sum(R.nn.attention(q, k, k, causal_mask="TopLeft")))  # more keys: no window
        bb.emit_func_output(loss)
    with pytest.raises(Exception, match="relax.nn.attention: no gradient for this call"):
        gradient(bb.get())
