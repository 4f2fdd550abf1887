"""Gradients of Relax ops TVM leaves without one (``tvm_fuel.autodiff``: rsqrt, erf, gelu,
gelu_tanh, repeat, rms_norm, layer_norm): first derivatives from
``Gradient`` against central finite differences of a float64 numpy forward (and PyTorch's
autograd where installed), second derivatives (``Gradient`` of the adjoint: a Hessian-vector
product) against finite differences of the compiled first derivative; odd sizes, several and
non-trailing axes, layer norm without center or scale; float32 at its own tolerance."""

from __future__ import annotations

import math

import numpy as np
import pytest
import tvm
from tvm import relax

import tvm_fuel
from tvm_fuel.transform import gradient, with_objective

from helpers import HOST

R = relax.op


def _erf(x):
    return np.vectorize(math.erf)(x)


def _norm_axes(x, axes):
    return tuple(a % x.ndim for a in axes)


def _weight(w, x, axes):
    axes = _norm_axes(x, axes)
    return w.reshape([x.shape[a] if a in axes else 1 for a in range(x.ndim)])


# op -> (numpy forward of (x, *weights), Relax call, the weights' shapes from x's shape and the axes)
CASES = {
    "rsqrt": (lambda x: 1 / np.sqrt(x), lambda x: R.rsqrt(x)),
    "erf": (_erf, lambda x: R.erf(x)),
    "gelu": (lambda x: 0.5 * x * (1 + _erf(x / math.sqrt(2))), lambda x: R.nn.gelu(x)),
    "gelu_tanh": (lambda x: 0.5 * x * (1 + np.tanh(math.sqrt(2 / math.pi) * (x + 0.044715 * x ** 3))),
                  lambda x: R.nn.gelu_tanh(x)),
    "repeat_axis1": (lambda x: np.repeat(x, 3, axis=1), lambda x: R.repeat(x, 3, axis=1)),
    "repeat_axis-1": (lambda x: np.repeat(x, 2, axis=-1), lambda x: R.repeat(x, 2, axis=-1)),
    "repeat_flat": (lambda x: np.repeat(x, 2), lambda x: R.repeat(x, 2)),
}


def _rms(x, w, axes, eps):
    ax = _norm_axes(x, axes)
    return x / np.sqrt((x * x).mean(ax, keepdims=True) + eps) * _weight(w, x, axes)


def _layer(x, g, b, axes, eps, center, scale):
    ax = _norm_axes(x, axes)
    y = (x - x.mean(ax, keepdims=True)) / np.sqrt(x.var(ax, keepdims=True) + eps)
    return y * (_weight(g, x, axes) if scale else 1) + (_weight(b, x, axes) if center else 0)


def _module(make, shapes: list[tuple], dtype: str, cotangent: np.ndarray) -> tvm.IRModule:
    """main(inputs...) = sum(make(inputs) * cotangent): its gradient is the VJP with cotangent."""
    params = [relax.Var(f"a{i}", relax.TensorType(shape, dtype)) for i, shape in enumerate(shapes)]
    bb = relax.BlockBuilder()
    with bb.function("main", params):
        with bb.dataflow():
            y = bb.emit(make(*params))
            loss = bb.emit_output(R.sum(R.multiply(y, relax.const(cotangent.astype(dtype), dtype))))
        bb.emit_func_output(loss)
    return bb.get()


def _run(mod: tvm.IRModule, func: str, inputs: list[np.ndarray]):
    vm = relax.VirtualMachine(tvm_fuel.compile(mod, HOST), tvm.cpu())
    loss, grads = vm[func](*map(tvm.runtime.tensor, inputs))
    return float(loss.numpy()), [g.numpy() for g in grads]


def _finite_differences(f, inputs: list[np.ndarray], h: float = 1e-6) -> list[np.ndarray]:
    grads = []
    for i, x in enumerate(inputs):
        g = np.zeros_like(x)
        for index in np.ndindex(x.shape):
            plus = [a.copy() for a in inputs]
            minus = [a.copy() for a in inputs]
            plus[i][index] += h
            minus[i][index] -= h
            g[index] = (f(*plus) - f(*minus)) / (2 * h)
        grads.append(g)
    return grads


def _case(name: str, shape, rng):
    """(numpy forward, Relax maker, inputs) of one case."""
    if name in CASES:
        forward, make = CASES[name]
        x = rng.uniform(0.3, 2.0, shape) if name == "rsqrt" else rng.standard_normal(shape)
        return forward, make, [x]
    kind, axes, *flags = name
    x = rng.standard_normal(shape)
    w = [rng.standard_normal([shape[a % len(shape)] for a in axes]) + 1 for _ in range(1 if kind == "rms" else 2)]
    if kind == "rms":
        return (lambda x, w: _rms(x, w, axes, 1e-5),
                lambda x, w: R.nn.rms_norm(x, w, axes=list(axes), epsilon=1e-5), [x, *w])
    center, scale = flags
    return (lambda x, g, b: _layer(x, g, b, axes, 1e-5, center, scale),
            lambda x, g, b: R.nn.layer_norm(x, g, b, axes=list(axes), epsilon=1e-5, center=center, scale=scale),
            [x, *w])


# (rms_norm over a non-trailing axis alone fails in TVM's own forward legalization; layer_norm's
# forward takes float32 and float16 only, so its cases run in float32)
FIRST_ORDER = [("rsqrt", (3, 5)), ("erf", (7,)), ("gelu", (2, 9)), ("gelu_tanh", (2, 9)),
               ("repeat_axis1", (2, 3, 5)), ("repeat_axis-1", (3, 4)), ("repeat_flat", (2, 3)),
               (("rms", (-1,)), (2, 3, 7)), (("rms", (1, 2)), (3, 4, 5)),
               (("layer", (-1,), True, True), (2, 3, 7)), (("layer", (0, 2), True, True), (3, 2, 5)),
               (("layer", (-1,), False, True), (4, 6)), (("layer", (-1,), True, False), (4, 6))]


@pytest.mark.parametrize("name,shape", FIRST_ORDER, ids=lambda v: str(v).replace(" ", ""))
def test_first_derivatives_match_finite_differences(name, shape):
    rng = np.random.default_rng(0)
    forward, make, inputs = _case(name, shape, rng)
    cotangent = rng.standard_normal(np.shape(forward(*inputs)))
    expected = _finite_differences(lambda *a: float((forward(*a) * cotangent).sum()), inputs)
    if name[0] != "layer":
        mod = gradient(_module(make, [a.shape for a in inputs], "float64", cotangent))
        loss, grads = _run(mod, "main_adjoint", inputs)
        # (TVM's rms_norm legalization computes in float32 even for float64 data: its loss is ~1e-7 off)
        assert loss == pytest.approx(float((forward(*inputs) * cotangent).sum()), rel=1e-6)
        for got, want in zip(grads, expected):
            np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-8)
    # float32: the same composition at float32's tolerance
    mod32 = gradient(_module(make, [a.shape for a in inputs], "float32", cotangent))
    _, grads32 = _run(mod32, "main_adjoint", [a.astype("float32") for a in inputs])
    for got, want in zip(grads32, expected):
        np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4)


SECOND_ORDER = [("gelu", (2, 5)), ("gelu_tanh", (2, 5)), ("rsqrt", (4,)), (("rms", (-1,)), (2, 5)),
                ("erf", (3, 4)),
                (("rms", (1, 2)), (2, 3, 4))]


@pytest.mark.parametrize("name,shape", SECOND_ORDER, ids=lambda v: str(v).replace(" ", ""))
def test_second_derivatives_through_gradient_of_the_adjoint(name, shape):
    """``Gradient`` of <dloss/dx, v> (a Hessian-vector product in x) against central differences
    of the compiled first derivative along v."""
    rng = np.random.default_rng(1)
    forward, make, inputs = _case(name, shape, rng)
    cotangent = rng.standard_normal(np.shape(forward(*inputs)))
    direction = rng.standard_normal(inputs[0].shape)
    adjoint = gradient(_module(make, [a.shape for a in inputs], "float64", cotangent))

    def along(result):
        dx = result.fields[1].fields[0]
        return R.sum(R.multiply(dx, relax.const(direction, "float64")))

    second = gradient(with_objective(adjoint, "main_adjoint", "directional", along), "directional")
    vm = relax.VirtualMachine(tvm_fuel.compile(second, HOST), tvm.cpu())
    _, hvp = vm["directional_adjoint"](*map(tvm.runtime.tensor, inputs))

    def first(x):
        return _run(adjoint, "main_adjoint", [x, *inputs[1:]])[1][0]

    h = 1e-5
    expected = (first(inputs[0] + h * direction) - first(inputs[0] - h * direction)) / (2 * h)
    np.testing.assert_allclose(hvp[0].numpy(), expected, rtol=1e-5, atol=1e-7)


def test_layer_norm_second_derivatives_against_pytorch():
    """layer_norm runs in float32 only (TVM's forward), so its double backward is checked against
    PyTorch's float64 one at float32's tolerance, where PyTorch is installed."""
    torch = pytest.importorskip("torch")
    rng = np.random.default_rng(3)
    x, g, b = rng.standard_normal((3, 7)), rng.standard_normal(7) + 1, rng.standard_normal(7)
    cotangent, direction = rng.standard_normal(x.shape), rng.standard_normal(x.shape)
    adjoint = gradient(_module(lambda x, g, b: R.nn.layer_norm(x, g, b, axes=[-1], epsilon=1e-5),
                               [x.shape, g.shape, b.shape], "float32", cotangent))
    second = gradient(with_objective(adjoint, "main_adjoint", "directional", lambda result: R.sum(
        R.multiply(result.fields[1].fields[0], relax.const(direction.astype("float32"), "float32")))), "directional")
    vm = relax.VirtualMachine(tvm_fuel.compile(second, HOST), tvm.cpu())
    _, hvp = vm["directional_adjoint"](*(tvm.runtime.tensor(a.astype("float32")) for a in (x, g, b)))
    tx, tg, tb = (torch.tensor(a, requires_grad=True) for a in (x, g, b))
    y = torch.nn.functional.layer_norm(tx, (7,), tg, tb, 1e-5)
    (dx,) = torch.autograd.grad((y * torch.tensor(cotangent)).sum(), tx, create_graph=True)
    want = torch.autograd.grad((dx * torch.tensor(direction)).sum(), (tx, tg, tb), allow_unused=True)
    for got, expected, like in zip(hvp, want, (x, g, b)):  # beta does not reach dx: None, a zero
        expected = np.zeros_like(like) if expected is None else expected.numpy()
        np.testing.assert_allclose(got.numpy(), expected, rtol=1e-3, atol=1e-4)


def test_pytorch_agrees_where_installed():
    torch = pytest.importorskip("torch")
    rng = np.random.default_rng(2)
    x = rng.standard_normal((3, 4, 6))
    g, b = rng.standard_normal(6), rng.standard_normal(6)
    cotangent = rng.standard_normal(x.shape)
    mod = gradient(_module(lambda x, g, b: R.nn.gelu(R.nn.layer_norm(x, g, b, axes=[-1], epsilon=1e-5)),
                           [x.shape, g.shape, b.shape], "float32", cotangent))
    _, grads = _run(mod, "main_adjoint", [a.astype("float32") for a in (x, g, b)])
    tx, tg, tb = (torch.tensor(a, requires_grad=True) for a in (x, g, b))
    y = torch.nn.functional.gelu(torch.nn.functional.layer_norm(tx, (6,), tg, tb, 1e-5))
    (y * torch.tensor(cotangent)).sum().backward()
    for got, want in zip(grads, (tx.grad, tg.grad, tb.grad)):
        np.testing.assert_allclose(got, want.numpy(), rtol=1e-4, atol=1e-4)


def test_tvm_gradients_are_not_overridden():
    from tvm_fuel import autodiff

    assert autodiff.register() == []  # registered once, on import
    for name in autodiff.GRADIENTS:
        assert tvm.ir.Op.get(name).get_attr("FPrimalGradient") is not None
