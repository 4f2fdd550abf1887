"""The numpy reference against PyTorch SDPA and autograd (optional: skipped without torch).

The mask is built here from FlashAttention's ``construct_local_mask`` formula, independently of
``reference.visible_keys``; ALiBi and softcap are applied by hand before SDPA sees the logits.
"""

from __future__ import annotations

import math

import numpy as np
import pytest

from tvm_fuel import reference as ref

pytestmark = pytest.mark.numerics

torch = pytest.importorskip("torch")


def _fa_local_mask(sq, sk, window_size, causal):
    """FlashAttention's tests: True = masked, aligned to the bottom-right corner."""
    left, right = window_size[0], 0 if causal else window_size[1]
    row = torch.arange(sq)[:, None]
    col = torch.arange(sk)[None, :]
    masked = torch.zeros(sq, sk, dtype=torch.bool)
    if right >= 0:
        masked |= col > row + sk - sq + right
    if left >= 0:
        masked |= col < row + sk - sq - left
    return masked


def _torch_attention(q, k, v, slopes, window_size, causal, softcap):
    """Plain autograd math with FlashAttention-2's order of operations; empty rows zeroed."""
    B, Hq, Sq, D = q.shape
    group = Hq // k.shape[1]
    k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    s = torch.einsum("bhid,bhjd->bhij", q, k) / math.sqrt(D)
    if softcap > 0:
        s = softcap * torch.tanh(s / softcap)
    Sk = k.shape[2]
    distance = (torch.arange(Sq)[:, None] + Sk - Sq - torch.arange(Sk)[None, :]).abs()
    s = s - slopes[None, :, None, None] * distance
    masked = _fa_local_mask(Sq, Sk, window_size, causal)
    s = s.masked_fill(masked, float("-inf"))
    p = torch.softmax(s, dim=-1).masked_fill(masked.all(-1, keepdim=True), 0.0)
    return torch.einsum("bhij,bhjd->bhid", p, v)


@pytest.mark.parametrize("sq,sk", [(17, 40), (40, 17), (1, 40)])
@pytest.mark.parametrize("options", [dict(causal=True), dict(window_size=(5, 2)),
                                     dict(window_size=(-1, 3), softcap=2.0)])
def test_reference_matches_torch_forward_and_autograd(sq, sk, options):
    rng = np.random.default_rng(sq + sk)
    q, k, v, do = (rng.standard_normal(s) for s in ((2, 6, sq, 16), (2, 2, sk, 16), (2, 2, sk, 16), (2, 6, sq, 16)))
    slopes = rng.random(6) * 0.3
    tq, tk, tv = (torch.tensor(a, requires_grad=True) for a in (q, k, v))
    out = _torch_attention(tq, tk, tv, torch.tensor(slopes), options.get("window_size", (-1, -1)),
                           options.get("causal", False), options.get("softcap", 0.0))
    out.backward(torch.tensor(do))
    np.testing.assert_allclose(ref.flash_attn(q, k, v, slopes, **options), out.detach().numpy(), atol=1e-10)
    for got, want in zip(ref.flash_attn_backward(q, k, v, do, slopes, **options), (tq.grad, tk.grad, tv.grad)):
        np.testing.assert_allclose(got, want.numpy(), atol=1e-10)


def test_reference_matches_torch_sdpa_with_bool_mask_and_gqa():
    rng = np.random.default_rng(0)
    q, k, v = (rng.standard_normal((2, 6, 17, 32)), rng.standard_normal((2, 3, 29, 32)),
               rng.standard_normal((2, 3, 29, 32)))
    mask = rng.random((2, 1, 17, 29)) < 0.8
    want = torch.nn.functional.scaled_dot_product_attention(
        *(torch.tensor(a) for a in (q, k, v)), attn_mask=torch.tensor(mask), enable_gqa=True)
    np.testing.assert_allclose(ref.flash_attn(q, k, v, attn_mask=mask), want.numpy(), atol=1e-10)
