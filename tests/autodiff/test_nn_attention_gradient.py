"""The gradient of TVM's ``R.nn.attention`` / ``attention_bias`` (``tvm_fuel.autodiff.attention``):
``flash_attn_backward`` where FuseAttention's rule says the call is ``flash_attn`` exactly, the VJP
of the primitive expansion elsewhere (window_size, TopLeft with more keys, BottomRight with more
queries, head dims that differ, float64, GQA, symbolic sizes)."""

from __future__ import annotations

import numpy as np
import pytest
import tvm
from tvm import relax, tirx

import tvm_fuel
from tvm_fuel import reference
from tvm_fuel.transform.gradient import gradient

from gradcheck import check_gradients, finite_differences, loss_module, run_adjoint
from helpers import HOST

pytestmark = pytest.mark.numerics

try:
    import torch
    from torch.nn.attention import SDPBackend, sdpa_kernel
except ImportError:  # PyTorch is optional (the bench extra): numpy and finite differences remain
    torch = None

R = relax.op
FLASH = "R.fuel.flash_attn_backward"


def _sdpa(q, k, v, bias, scale, causal):
    """numpy attention in [B, S, H, D] (float64): softmax(scale q k^T + bias, bottom-right or
    top-left causal) v."""
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
    assert FLASH in adjoint["main_adjoint"].script()
    _, grads = run_adjoint(adjoint, "main_adjoint", [x.astype("float32") for x in inputs])
    expected = finite_differences(lambda q, k, v: float((_sdpa(q, k, v, bias, scale, causal) * cotangent).sum()),
                                   [q, k, v])  # (the bias gets no gradient)
    for got, want in zip(grads[:3], expected):
        np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4)


# --- the primitive expansion -------------------------------------------------------------------


def _keep(sq, sk, causal, window=None):
    """Bool [Sq, Sk]: TVM's mask. TopLeft: j <= i; BottomRight: j <= i + |Sq - Sk| (the
    legalization's tril offset); a window w >= 1 also drops j < i + |Sq - Sk| - (w - 1)."""
    rel = np.arange(sk)[None, :] - np.arange(sq)[:, None]  # j - i
    if causal is None:
        return np.ones((sq, sk), dtype=bool)
    hi = 0 if causal == "TopLeft" else abs(sq - sk)
    keep = rel <= hi
    return keep & (rel >= hi - (window - 1)) if window is not None and window >= 1 else keep


def _tvm_attention(q, k, v, bias=None, *, scale=None, causal=None, window=None):
    """numpy R.nn.attention in [B, S, H, D] (float64) with TVM's semantics: scale (default
    1/sqrt(D of q)), then the bias broadcast, then the mask, softmax, times v (Dv may differ from
    D; a kv head serves Hq / Hkv consecutive query heads)."""
    hq, d = q.shape[2], q.shape[3]
    k, v = np.repeat(k, hq // k.shape[2], axis=2), np.repeat(v, hq // v.shape[2], axis=2)
    logits = np.einsum("bihd,bjhd->bhij", q, k)
    logits = logits * scale if scale is not None else logits / np.sqrt(d)
    if bias is not None:
        logits = logits + bias
    logits = np.where(_keep(q.shape[1], k.shape[1], causal, window), logits, -np.inf)
    weights = np.exp(logits - logits.max(axis=-1, keepdims=True))
    weights = weights / weights.sum(axis=-1, keepdims=True)
    return np.einsum("bhij,bjhd->bihd", weights, v)


def _torch_attention(q, k, v, bias=None, *, scale=None, causal=None, window=None):
    """PyTorch's scaled_dot_product_attention on [B, S, H, D] tensors, TVM's mask as a float
    attn_mask (-inf where dropped, plus the bias)."""
    sq, sk = q.shape[1], k.shape[1]
    mask = torch.zeros(sq, sk, dtype=q.dtype).masked_fill(~torch.from_numpy(_keep(sq, sk, causal, window)), -np.inf)
    if bias is not None:
        mask = mask + bias.to(q.dtype)
    heads = lambda x: x.transpose(1, 2)  # noqa: E731
    with sdpa_kernel(SDPBackend.MATH):  # the CPU flash kernel's backward has no derivative
        out = torch.nn.functional.scaled_dot_product_attention(heads(q), heads(k), heads(v), attn_mask=mask,
                                                               scale=scale, enable_gqa=k.shape[2] != q.shape[2])
    return heads(out)


def _torch_vjp(inputs, cotangent, **options):
    """PyTorch's float64 VJP of q, k, v."""
    tensors = [torch.tensor(x, dtype=torch.float64, requires_grad=i < 3) for i, x in enumerate(inputs)]
    out = _torch_attention(*tensors, **options)
    return [g.numpy() for g in torch.autograd.grad((out * torch.from_numpy(cotangent)).sum(), tensors[:3])]


def _inputs(rng, b, sq, sk, hq, d, *, hkv=None, dv=None, bias=None, bias_dtype="float64"):
    hkv, dv = hkv or hq, dv or d
    inputs = [rng.standard_normal((b, sq, hq, d)), rng.standard_normal((b, sk, hkv, d)),
              rng.standard_normal((b, sk, hkv, dv))]
    if bias is not None:  # float64 values the bias dtype holds, so every party adds the same numbers
        inputs.append(rng.standard_normal(bias).astype(bias_dtype).astype("float64"))
    return inputs, rng.standard_normal((b, sq, hq, dv))


def _assert_close(got, want, what):
    for i, (g, w) in enumerate(zip(got, want)):
        np.testing.assert_allclose(g, w, rtol=1e-6, atol=1e-8 * max(1.0, np.abs(w).max()),
                                   err_msg=f"{what}, input {i}")


def _check_first_derivatives(grads, inputs, cotangent, options):
    """grads (q, k, v) against central differences of the numpy reference and PyTorch's autograd."""
    bias = inputs[3] if len(inputs) > 3 else None
    loss = lambda q, k, v: float((_tvm_attention(q, k, v, bias, **options) * cotangent).sum())  # noqa: E731
    _assert_close(grads, finite_differences(loss, inputs[:3]), "finite differences")
    if torch is not None:
        _assert_close(grads, _torch_vjp(inputs, cotangent, **options), "PyTorch")


# (case, B, Sq, Sk, Hq, D, extra inputs, R.nn.attention options) where TVM compiles the forward
EXPANSION = [
    ("topleft_more_keys", 2, 3, 5, 2, 4, {}, dict(causal_mask="TopLeft", scale=0.3)),
    ("topleft_more_queries_dv", 1, 5, 3, 2, 4, dict(dv=6), dict(causal_mask="TopLeft")),  # Dv != D
    ("bottomright_more_queries", 2, 5, 3, 1, 4, {}, dict(causal_mask="BottomRight")),  # |Sq - Sk|
    ("bias_broadcast", 2, 4, 5, 3, 4, dict(bias=(1, 3, 1, 5), bias_dtype="float32"), {}),  # f32 bias, f64 q
]


@pytest.mark.parametrize("case,b,sq,sk,hq,d,extra,attrs", EXPANSION, ids=[c[0] for c in EXPANSION])
def test_expansion_matches_tvm_numpy_and_torch(case, b, sq, sk, hq, d, extra, attrs):
    """No flash_attn equivalent (or float64): the adjoint is the expansion's VJP, in float64,
    against finite differences of a numpy reference that TVM's compiled forward reproduces, and
    against PyTorch's autograd."""
    inputs, cotangent = _inputs(np.random.default_rng(7), b, sq, sk, hq, d, **extra)
    dtypes = ["float64"] * 3 + [extra.get("bias_dtype", "float64")] * (len(inputs) - 3)
    options = dict(scale=attrs.get("scale"), causal=attrs.get("causal_mask"))

    def make(q, k, v, *bias):
        return R.nn.attention(q, k, v, *bias, **attrs)

    mod = loss_module(make, [x.shape for x in inputs], "float64", [cotangent], dtypes=dtypes)
    adjoint = gradient(mod, require_grads=mod["main"].params[:3])
    assert FLASH not in adjoint["main_adjoint"].script()
    adjoint["forward"] = _forward_only(mod)  # one build for both
    vm = relax.VirtualMachine(tvm_fuel.compile(adjoint, HOST), tvm.cpu())
    args = [tvm.runtime.tensor(x.astype(t)) for x, t in zip(inputs, dtypes)]
    expected = _tvm_attention(*inputs, **options)
    np.testing.assert_allclose(vm["forward"](*args).numpy(), expected, rtol=1e-10, atol=1e-12)  # TVM's op
    loss, grads = vm["main_adjoint"](*args)
    np.testing.assert_allclose(float(loss.numpy()), float((expected * cotangent).sum()), rtol=1e-10)
    grads = [g.numpy() for g in grads]
    _check_first_derivatives(grads, inputs, cotangent, options)


def _forward_only(mod: tvm.IRModule) -> relax.Function:
    """``loss_module``'s attention call alone, as a function of fresh parameters."""
    call = mod["main"].body.blocks[0].bindings[0].value
    assert call.op.name.startswith("relax.nn.attention")
    params = [relax.Var(f"x{i}", p.ty) for i, p in enumerate(mod["main"].params)]
    bb = relax.BlockBuilder()
    with bb.function("forward", params):
        with bb.dataflow():
            out = bb.emit_output(relax.Call(call.op, params, call.attrs))
        bb.emit_func_output(out)
    return bb.get()["forward"]


def _gradients_only(adjoint: tvm.IRModule) -> tvm.IRModule:
    """The adjoint returning only the gradients, with the forward attention (which TVM cannot
    legalize with a window, and legalizes wrongly with GQA) dropped as dead code: the expansion's
    VJP recomputes what it needs."""
    func = adjoint["main_adjoint"]
    grads = func.body.body.fields[1]
    body = relax.SeqExpr(func.body.blocks, grads)
    mod = tvm.IRModule({"main_adjoint": relax.Function(func.params, body, grads.ty, attrs=func.attrs)})
    mod = relax.transform.DeadCodeElimination()(relax.transform.Normalize()(mod))
    assert "R.nn.attention" not in mod.script()
    return mod


# (case, B, Sq, Sk, Hq, Hkv, D, R.nn.attention options) where TVM's CPU forward does not exist
WITHOUT_TVM_FORWARD = [
    ("window", 1, 4, 6, 2, 2, 4, dict(causal_mask="BottomRight", window_size=3)),
    ("window_gqa", 2, 3, 3, 3, 1, 4, dict(causal_mask="BottomRight", window_size=2)),
    ("gqa_topleft", 1, 3, 5, 2, 1, 4, dict(causal_mask="TopLeft")),
]


@pytest.mark.parametrize("case,b,sq,sk,hq,hkv,d,attrs", WITHOUT_TVM_FORWARD, ids=[c[0] for c in WITHOUT_TVM_FORWARD])
def test_expansion_of_the_window_and_gqa(case, b, sq, sk, hq, hkv, d, attrs):
    """TVM runs window_size only in its CUTLASS flash kernel (left = w - 1, right = 0, bottom-right)
    and GQA only there (query head h reads kv head h // (Hq / Hkv)): the numpy reference is checked
    against tvm_fuel's flash_attn reference in those conventions instead of a compiled forward."""
    inputs, cotangent = _inputs(np.random.default_rng(11), b, sq, sk, hq, d, hkv=hkv)
    window = attrs.get("window_size")
    options = dict(causal=attrs["causal_mask"], window=window)
    expected = _tvm_attention(*inputs, **options)
    heads = lambda x: x.transpose(0, 2, 1, 3)  # noqa: E731
    topleft = np.where(_keep(sq, sk, "TopLeft"), 0.0, -np.inf) if attrs["causal_mask"] == "TopLeft" else None
    flash = reference.flash_attn(*map(heads, inputs), attn_mask=topleft,
                                 window_size=(window - 1, 0) if window else (-1, -1))
    np.testing.assert_allclose(expected, heads(flash), rtol=1e-12, atol=1e-12)

    mod = loss_module(lambda q, k, v: R.nn.attention(q, k, v, **attrs), [x.shape for x in inputs], "float64",
                      [cotangent])
    adjoint = relax.transform.Gradient("main")(mod)
    assert FLASH not in adjoint["main_adjoint"].script()
    vm = relax.VirtualMachine(tvm_fuel.compile(_gradients_only(adjoint), HOST), tvm.cpu())
    grads = [g.numpy() for g in vm["main_adjoint"](*map(tvm.runtime.tensor, inputs))]
    _check_first_derivatives(grads, inputs, cotangent, options)


def test_expansion_with_symbolic_sizes():
    """Symbolic B, Sq, Sk and D (BottomRight, offset |Sq - Sk| symbolic, scale 1/sqrt(D) of a
    symbolic D): one executable, run with more keys and with more queries, against TVM's forward
    (the loss) and finite differences of the numpy reference."""
    b, sq, sk, d = (tirx.Var(name, "int64") for name in ("b", "sq", "sk", "d"))
    ty = lambda *shape: relax.TensorType(shape, "float64")  # noqa: E731
    q, k, v = relax.Var("q", ty(b, sq, 2, d)), relax.Var("k", ty(b, sk, 2, d)), relax.Var("v", ty(b, sk, 2, d))
    cot = relax.Var("cot", ty(b, sq, 2, d))
    bb = relax.BlockBuilder()
    with bb.function("main", [q, k, v, cot]):
        with bb.dataflow():
            out = bb.emit(R.nn.attention(q, k, v, causal_mask="BottomRight"))
            loss = bb.emit_output(R.sum(R.multiply(out, cot)))
        bb.emit_func_output(loss)
    adjoint = relax.transform.Gradient("main", require_grads=[q, k, v])(bb.get())
    assert FLASH not in adjoint["main_adjoint"].script()  # flash's diagonal Sk - Sq: not provably TVM's
    vm = relax.VirtualMachine(tvm_fuel.compile(adjoint, HOST), tvm.cpu())
    rng = np.random.default_rng(5)
    for shape in ((2, 3, 5, 4), (1, 5, 3, 3)):
        nb, nq, nk, nd = shape
        inputs, cotangent = _inputs(rng, nb, nq, nk, 2, nd)
        loss, grads = vm["main_adjoint"](*map(tvm.runtime.tensor, inputs + [cotangent]))
        expected = _tvm_attention(*inputs, causal="BottomRight")
        np.testing.assert_allclose(float(loss.numpy()), float((expected * cotangent).sum()), rtol=1e-10)
        _check_first_derivatives([g.numpy() for g in grads], inputs, cotangent, dict(causal="BottomRight"))


REFUSED = [
    ("window without BottomRight", (1, 3, 2, 4), (1, 5, 2, 4), dict(causal_mask="TopLeft", window_size=2)),
    ("window with more queries", (1, 5, 2, 4), (1, 3, 2, 4), dict(causal_mask="BottomRight", window_size=2)),
    ("no such mask", (1, 3, 2, 4), (1, 5, 2, 4), dict(causal_mask="Diagonal")),
]


@pytest.mark.parametrize("case,q_shape,k_shape,attrs", REFUSED, ids=[c[0] for c in REFUSED])
def test_expansion_refuses_what_tvm_does_not_define(case, q_shape, k_shape, attrs):
    """Where TVM defines no forward (its kernel asserts, or its two implementations disagree), the
    gradient says so instead of guessing."""
    mod = loss_module(lambda q, k, v: R.nn.attention(q, k, v, **attrs), [q_shape, k_shape, k_shape], "float32",
                      [np.zeros(q_shape)])
    with pytest.raises(Exception, match="relax.nn.attention: no gradient for this call"):
        gradient(mod)


# --- second derivatives (tests/gradcheck.py) ---------------------------------------------------

SECOND_ORDER = [  # (case, B, Sq, Sk, H, D, Dv, options, expansion?), float32
    ("expansion_topleft_more_keys", 1, 3, 5, 2, 4, 4, dict(causal_mask="TopLeft", scale=0.4), True),
    # TVM's diagonal |Sq - Sk| above the main one: flash_attn with the window (-1, 2 (Sq - Sk))
    ("flash_bottomright_more_queries", 1, 4, 3, 2, 4, 4, dict(causal_mask="BottomRight"), False),
    ("flash_bottomright", 1, 3, 4, 2, 4, 4, dict(causal_mask="BottomRight"), False),
]


@pytest.mark.parametrize("without_torch", [False, True], ids=["torch", "finite-differences"])
@pytest.mark.parametrize("case,b,sq,sk,h,d,dv,attrs,expansion", SECOND_ORDER, ids=[c[0] for c in SECOND_ORDER])
def test_second_derivatives(case, b, sq, sk, h, d, dv, attrs, expansion, without_torch):
    """Hessian-vector products of both paths against PyTorch's float64 autograd (float32: the
    flash path's dtype), and against float64 differences of TVM's semantics in numpy (the path a
    machine without PyTorch takes)."""
    if not without_torch and torch is None:
        pytest.skip("PyTorch is not installed")
    rng = np.random.default_rng(3)
    inputs = [rng.standard_normal((b, sq, h, d)), rng.standard_normal((b, sk, h, d)),
              rng.standard_normal((b, sk, h, dv))]
    options = dict(scale=attrs.get("scale"), causal=attrs.get("causal_mask"))

    def make(q, k, v):
        return R.nn.attention(q, k, v, **attrs)

    adjoint = gradient(loss_module(make, [x.shape for x in inputs], "float32", [np.ones((b, sq, h, dv))]))
    assert (FLASH in adjoint["main_adjoint"].script()) != expansion
    check_gradients(make, inputs, numpy_forward=lambda q, k, v: _tvm_attention(q, k, v, **options),
                    torch_forward=None if without_torch else lambda q, k, v: _torch_attention(q, k, v, **options),
                    dtypes=("float32",), second=True, wrt=[0, 1, 2])
