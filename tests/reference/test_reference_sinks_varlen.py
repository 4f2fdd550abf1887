"""The reference's sinks and packed variable-length batches against PyTorch (skipped without it).

Sinks: transformers' gpt-oss eager attention (the sink column concatenated to the scores, the
softmax taken, the column dropped), forward and autograd in float64. Varlen: PyTorch SDPA run
sequence by sequence, with FlashAttention's bottom-right causal mask built here by hand.
"""

from __future__ import annotations

import math

import numpy as np
import pytest

from tvm_fuel import reference as ref

pytestmark = pytest.mark.numerics

torch = pytest.importorskip("torch")
F = torch.nn.functional


def _keep(sq, sk, window_size, causal):
    """True = attend; FlashAttention's local mask, bottom-right aligned."""
    left, right = window_size[0], 0 if causal else window_size[1]
    row = torch.arange(sq)[:, None] + sk - sq
    col = torch.arange(sk)[None, :]
    keep = torch.ones(sq, sk, dtype=torch.bool)
    if right >= 0:
        keep &= col <= row + right
    if left >= 0:
        keep &= col >= row - left
    return keep


def _gpt_oss_attention(q, k, v, sinks, keep):
    """transformers' gpt-oss ``eager_attention_forward``, [B, H, S, D] float64 tensors."""
    group = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    scores = torch.einsum("bhid,bhjd->bhij", q, k) / math.sqrt(q.shape[-1])
    scores = scores.masked_fill(~keep, float("-inf"))
    sink = sinks.reshape(1, -1, 1, 1).expand(q.shape[0], -1, q.shape[2], 1)
    combined = torch.cat([scores, sink], dim=-1)
    combined = combined - combined.max(dim=-1, keepdim=True).values
    probs = torch.softmax(combined, dim=-1)[..., :-1]
    return torch.einsum("bhij,bhjd->bhid", probs, v)


def test_sinks_are_not_capped_scaled_or_masked():
    """The sink column holds sinks[h] as given, whatever softcap, softmax_scale and the window do
    to the scores (gpt-oss has no softcap: the rule is written out here by hand)."""
    rng = np.random.default_rng(3)
    q, k, v = rng.standard_normal((1, 2, 5, 8)), rng.standard_normal((1, 2, 9, 8)), rng.standard_normal((1, 2, 9, 8))
    sinks = np.array([3.0, -40.0])
    options = dict(softcap=0.5, softmax_scale=0.7, window_size=(2, 0))
    _, logits = ref.flash_attn(q, k, v, return_lse=True, **options)  # the lse without the sink
    out, lse = ref.flash_attn(q, k, v, sinks=sinks, return_lse=True, **options)
    np.testing.assert_allclose(lse, np.logaddexp(logits, sinks[None, :, None]), rtol=1e-12)
    weight = np.exp(logits - lse)  # the keys' share of each row; the sink takes the rest
    np.testing.assert_allclose(out, ref.flash_attn(q, k, v, **options) * weight[..., None], rtol=1e-12)


@pytest.mark.parametrize("sq,sk,group,options", [(17, 33, 3, dict(causal=True)), (33, 17, 1, dict(causal=True)),
                                                 (1, 97, 7, dict()), (17, 40, 2, dict(window_size=(8, 0)))])
def test_sinks_match_gpt_oss(sq, sk, group, options):
    rng = np.random.default_rng(sq + sk + group)
    q, do = rng.standard_normal((2, 2 * group, sq, 24)), rng.standard_normal((2, 2 * group, sq, 24))
    k, v = rng.standard_normal((2, 2, sk, 24)), rng.standard_normal((2, 2, sk, 24))
    sinks = rng.standard_normal(2 * group) * 2
    tq, tk, tv, tsinks = (torch.tensor(a, requires_grad=True) for a in (q, k, v, sinks))
    out_t = _gpt_oss_attention(tq, tk, tv, tsinks, _keep(sq, sk, options.get("window_size", (-1, -1)),
                                                         options.get("causal", False)))
    out_t.backward(torch.tensor(do))
    out, lse = ref.flash_attn(q, k, v, sinks=sinks, return_lse=True, **options)
    np.testing.assert_allclose(out, out_t.detach().numpy(), atol=1e-12, rtol=1e-10)
    assert np.all(np.isfinite(lse))  # a row that keeps no key still has its sink
    grads = ref.flash_attn_backward(q, k, v, do, sinks=sinks, **options)
    for name, got, want in zip(("dq", "dk", "dv", "dsinks"), grads, (tq, tk, tv, tsinks)):
        np.testing.assert_allclose(got, want.grad.numpy(), atol=1e-10, rtol=1e-8, err_msg=name)
    if sq > sk and options.get("causal"):  # rows i < Sq - Sk keep no key: 0, lse = the sink
        np.testing.assert_array_equal(out[:, :, : sq - sk], 0)
        empty = lse[:, :, : sq - sk]
        np.testing.assert_allclose(empty, np.broadcast_to(sinks[None, :, None], empty.shape))


def _sdpa_sequence(q, k, v, slopes, options):
    """One sequence [1, H, S, D] through PyTorch: SDPA with an additive mask (window, causal,
    ALiBi); softcap by hand, as SDPA has none. Rows that keep no key are 0. Also the rows' lse
    [H, S] (by hand; -inf for rows that keep no key)."""
    sq, sk = q.shape[2], k.shape[2]
    keep = _keep(sq, sk, options.get("window_size", (-1, -1)), options.get("causal", False))
    distance = (torch.arange(sq)[:, None] + sk - sq - torch.arange(sk)[None, :]).abs()
    bias = (-slopes[None, :, None, None] * distance).masked_fill(~keep, float("-inf"))
    bias = bias.masked_fill(~keep.any(-1, keepdim=True), 0.0)  # no NaN (nor NaN gradient) from empty rows
    group = q.shape[1] // k.shape[1]
    kr, vr = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    s = torch.einsum("bhid,bhjd->bhij", q, kr) / math.sqrt(q.shape[-1])
    if options.get("softcap", 0) > 0:
        cap = options["softcap"]
        s = cap * torch.tanh(s / cap)
        out = torch.einsum("bhij,bhjd->bhid", torch.softmax(s + bias, dim=-1), vr)
    else:
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=bias, enable_gqa=group > 1)
    rows = keep.any(-1)
    lse = torch.where(rows[None, None], torch.logsumexp((s + bias).masked_fill(~keep, float("-inf")), dim=-1),
                      float("-inf"))
    return torch.where(rows[None, None, :, None], out, torch.zeros_like(out)), lse[0].detach().numpy()


SEQLENS = [(17, 97), (0, 5), (1, 1), (97, 17), (513, 513), (5, 0)]  # (Sq, Sk) of each packed sequence


@pytest.mark.parametrize("group", [1, 3, 7])
@pytest.mark.parametrize("options", [dict(causal=True), dict(window_size=(32, 4)), dict(softcap=4.0, causal=True),
                                     dict(alibi=True)])
def test_varlen_matches_sdpa_per_sequence(group, options):
    options = dict(options)
    alibi = options.pop("alibi", False)
    rng = np.random.default_rng(group)
    hkv, d = 2, 16
    cu_q, cu_k = (np.concatenate([[0], np.cumsum([s[i] for s in SEQLENS])]).astype(np.int32) for i in (0, 1))
    q, do = rng.standard_normal((cu_q[-1], hkv * group, d)), rng.standard_normal((cu_q[-1], hkv * group, d))
    k, v = rng.standard_normal((cu_k[-1], hkv, d)), rng.standard_normal((cu_k[-1], hkv, d))
    slopes = rng.random(hkv * group) * 0.3 if alibi else np.zeros(hkv * group)
    out, lse = ref.flash_attn_varlen(q, k, v, cu_q, cu_k, slopes if alibi else None, return_lse=True, **options)
    grads = ref.flash_attn_varlen_backward(q, k, v, do, cu_q, cu_k, slopes if alibi else None, **options)
    assert out.shape == q.shape and lse.shape == (hkv * group, cu_q[-1])
    for b in range(len(SEQLENS)):
        rows_q, rows_k = slice(cu_q[b], cu_q[b + 1]), slice(cu_k[b], cu_k[b + 1])
        tq, tk, tv = (torch.tensor(np.swapaxes(x[rows], 0, 1)[None], requires_grad=True)
                      for x, rows in ((q, rows_q), (k, rows_k), (v, rows_k)))
        want, want_lse = _sdpa_sequence(tq, tk, tv, torch.tensor(slopes), options)
        np.testing.assert_allclose(out[rows_q], np.swapaxes(want.detach().numpy()[0], 0, 1), atol=1e-10, rtol=1e-8,
                                   err_msg=f"sequence {b}")
        np.testing.assert_allclose(lse[:, rows_q], want_lse, atol=1e-10, rtol=1e-10, err_msg=f"lse of sequence {b}")
        if want.numel():
            want.backward(torch.tensor(np.swapaxes(do[rows_q], 0, 1)[None]))
        for name, got, t, rows in zip(("dq", "dk", "dv"), grads, (tq, tk, tv), (rows_q, rows_k, rows_k)):
            expected = np.zeros(got[rows].shape) if t.grad is None else np.swapaxes(t.grad.numpy()[0], 0, 1)
            np.testing.assert_allclose(got[rows], expected, atol=1e-10, rtol=1e-8, err_msg=f"{name} of sequence {b}")


def test_varlen_with_sinks_is_each_sequence_with_sinks():
    rng = np.random.default_rng(5)
    cu = np.array([0, 3, 3, 20], np.int32)
    q, k, v, do = (rng.standard_normal((20, 4, 8)) for _ in range(4))
    sinks = rng.standard_normal(4)
    out, lse = ref.flash_attn_varlen(q, k, v, cu, cu, sinks=sinks, causal=True, return_lse=True)
    dq, dk, dv, dsinks = ref.flash_attn_varlen_backward(q, k, v, do, cu, cu, sinks=sinks, causal=True)
    total = np.zeros(4)
    for start, stop in ((0, 3), (3, 20)):
        batch = [np.swapaxes(x[start:stop], 0, 1)[None] for x in (q, k, v, do)]
        o, l_ = ref.flash_attn(*batch[:3], sinks=sinks, causal=True, return_lse=True)
        np.testing.assert_allclose(out[start:stop], np.swapaxes(o[0], 0, 1), rtol=1e-12)
        np.testing.assert_allclose(lse[:, start:stop], l_[0], rtol=1e-12)
        total += ref.flash_attn_backward(*batch, sinks=sinks, causal=True)[3]
    np.testing.assert_allclose(dsinks, total, rtol=1e-12)
