"""The float64 references of forward mode and the double backward (issue 16) against central
finite differences of the references one order below: ``flash_attn_jvp`` against the forward,
``flash_attn_double_backward`` against the backward, over GQA groups 1/3/7, head dims
40/64/128, lengths 1/17/97, every mask kind, softcap and ALiBi."""

from __future__ import annotations

import numpy as np
import pytest

from tvm_fuel import reference as ref

pytestmark = pytest.mark.numerics
EPS = 1e-5

SHAPES = [(1, 7, 1, 1, 17, 40), (2, 3, 1, 17, 17, 64), (1, 1, 1, 97, 33, 128),
          (1, 6, 2, 17, 97, 40)]  # B Hq Hkv Sq Sk D
OPTIONS = {
    "plain": dict(),
    "causal": dict(causal=True),
    "window_softcap": dict(window_size=(9, 3), softcap=4.0),
    "alibi": dict(causal=True, alibi=True),
    "bool_mask": dict(mask="bool"),
    "additive_mask": dict(mask="additive", softcap=6.0),
}


def _inputs(rng, shape, options):
    B, Hq, Hkv, Sq, Sk, D = shape
    x = dict(q=rng.standard_normal((B, Hq, Sq, D)), k=rng.standard_normal((B, Hkv, Sk, D)),
             v=rng.standard_normal((B, Hkv, Sk, D)))
    kwargs = {k: v for k, v in options.items() if k not in ("alibi", "mask")}
    if options.get("alibi"):
        kwargs["alibi_slopes"] = rng.random(Hq) * 0.3
    if options.get("mask") == "bool":
        mask = rng.random((Sq, Sk)) < 0.7
        mask[0] = False  # a fully masked row: out, its tangent and its gradients are 0
        kwargs["attn_mask"] = mask
    elif options.get("mask") == "additive":
        mask = rng.standard_normal((Hq, Sq, Sk))
        mask[:, :, 0] = -np.inf
        kwargs["attn_mask"] = mask
    return x, kwargs


def _assert_close(got, want, what):
    scale = max(1.0, float(np.max(np.abs(want))))
    np.testing.assert_allclose(got, want, rtol=0, atol=2e-6 * scale, err_msg=what)


@pytest.mark.parametrize("case", list(OPTIONS))
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "B{}Hq{}Hkv{}Sq{}Sk{}D{}".format(*s))
def test_jvp_is_the_forwards_directional_derivative(shape, case):
    rng = np.random.default_rng(sum(shape))
    x, kwargs = _inputs(rng, shape, OPTIONS[case])
    tangent = {name: rng.standard_normal(a.shape) for name, a in x.items()}
    out, out_dot, lse = ref.flash_attn_jvp(*x.values(), *tangent.values(), return_lse=True, **kwargs)

    def forward(sign):
        moved = {name: a + sign * EPS * tangent[name] for name, a in x.items()}
        return ref.flash_attn(*moved.values(), return_lse=True, **kwargs)

    (plus, _), (minus, _) = forward(1), forward(-1)  # the JVP gives no lse tangent
    want_out, want_lse = ref.flash_attn(*x.values(), return_lse=True, **kwargs)
    np.testing.assert_array_equal(out, want_out)
    np.testing.assert_array_equal(lse, want_lse)
    _assert_close(out_dot, (plus - minus) / (2 * EPS), "out_dot")
    if OPTIONS[case].get("mask") == "bool":
        assert np.all(out_dot[:, :, 0] == 0)  # the fully masked row


@pytest.mark.parametrize("case", list(OPTIONS))
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "B{}Hq{}Hkv{}Sq{}Sk{}D{}".format(*s))
def test_double_backward_is_the_backwards_vjp(shape, case):
    """<double_backward(bar), u> = d/de <backward(x + e u), bar> for a random direction u of
    (q, k, v, do): the VJP identity, checked by central differences."""
    rng = np.random.default_rng(sum(shape) + 1)
    x, kwargs = _inputs(rng, shape, OPTIONS[case])
    x["do"] = rng.standard_normal(x["q"].shape)
    bar = dict(dq_bar=rng.standard_normal(x["q"].shape), dk_bar=rng.standard_normal(x["k"].shape),
               dv_bar=rng.standard_normal(x["v"].shape))
    grads = ref.flash_attn_double_backward(*x.values(), *bar.values(), **kwargs)
    for name, g in zip(("q", "k", "v", "do"), grads):
        assert g.shape == x[name].shape, name
    u = {name: rng.standard_normal(a.shape) for name, a in x.items()}

    def pairing(sign):
        moved = {name: a + sign * EPS * u[name] for name, a in x.items()}
        return sum(float(np.sum(g * b)) for g, b in zip(ref.flash_attn_backward(*moved.values(), **kwargs),
                                                          bar.values()))

    want = (pairing(1) - pairing(-1)) / (2 * EPS)
    got = sum(float(np.sum(g * u[name])) for name, g in zip(("q", "k", "v", "do"), grads))
    assert abs(got - want) <= 1e-6 * max(1.0, abs(want)), (got, want)


def test_absent_cotangents_count_as_zero():
    rng = np.random.default_rng(5)
    x, kwargs = _inputs(rng, (1, 6, 2, 17, 33, 40), dict(causal=True, softcap=5.0))
    do = rng.standard_normal(x["q"].shape)
    dq_bar = rng.standard_normal(x["q"].shape)
    zeros = (np.zeros(x["k"].shape), np.zeros(x["v"].shape))
    given = ref.flash_attn_double_backward(*x.values(), do, dq_bar, *zeros, **kwargs)
    absent = ref.flash_attn_double_backward(*x.values(), do, dq_bar, **kwargs)
    for a, b in zip(given, absent):
        np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize("causal", [False, True])
def test_double_backward_and_jvp_match_pytorch_math_backend(causal):
    """PyTorch's float64 SDPA (math backend, the one that has a double backward) as the peer;
    Sq = Sk, where its top-left causal is ours."""
    torch = pytest.importorskip("torch")
    rng = np.random.default_rng(11)
    q, k, v, do = (rng.standard_normal((2, 4, 17, 40)) for _ in range(4))
    bar = [rng.standard_normal((2, 4, 17, 40)) for _ in range(3)]
    tq, tk, tv = (torch.tensor(a, requires_grad=True) for a in (q, k, v))
    tdo = torch.tensor(do, requires_grad=True)
    with torch.nn.attention.sdpa_kernel(torch.nn.attention.SDPBackend.MATH):
        out = torch.nn.functional.scaled_dot_product_attention(tq, tk, tv, is_causal=causal)
        grads = torch.autograd.grad(out, (tq, tk, tv), tdo, create_graph=True)
        pairing = sum((g * torch.tensor(b)).sum() for g, b in zip(grads, bar))
        want = torch.autograd.grad(pairing, (tq, tk, tv, tdo))
        _, out_dot = torch.func.jvp(lambda a, b, c: torch.nn.functional.scaled_dot_product_attention(
            a, b, c, is_causal=causal), (tq.detach(), tk.detach(), tv.detach()),
            tuple(torch.tensor(b) for b in bar))
    got = ref.flash_attn_double_backward(q, k, v, do, *bar, causal=causal)
    for name, g, w in zip(("q", "k", "v", "do"), got, want):
        np.testing.assert_allclose(g, w.numpy(), rtol=1e-9, atol=1e-9, err_msg=name)
    np.testing.assert_allclose(ref.flash_attn_jvp(q, k, v, *bar, causal=causal)[1], out_dot.numpy(), rtol=1e-9,
                               atol=1e-9)
