"""Gradients of Relax ops TVM leaves without one (``tvm_fuel.autodiff``: rsqrt, erf, gelu,
gelu_tanh, dropout, repeat, rms_norm, layer_norm, group_norm, batch_norm): first and second
derivatives through ``Gradient`` (``tests/gradcheck.py``) against PyTorch's float64 autograd and
double backward where PyTorch is installed, central finite differences otherwise; odd sizes,
several and non-trailing axes, flags off, both batch_norm modes; float64 (1e-6) and float32
(1e-4) where TVM's forward takes them."""

from __future__ import annotations

import math

import numpy as np
import pytest
import tvm
from tvm import relax

from tvm_fuel.transform.gradient import gradient

from gradcheck import check_gradients, loss_module

pytestmark = pytest.mark.numerics

R = relax.op
EPS = 1e-5


def _torch():
    try:
        import torch
    except ImportError:
        return None
    return torch


def _erf(x):
    return np.vectorize(math.erf)(x)


def _shape_of(x, axes):
    """Where a weight over ``axes`` of x broadcasts: x's dims on those axes, 1 elsewhere."""
    axes = [a % x.ndim for a in axes]
    return [x.shape[a] if a in axes else 1 for a in range(x.ndim)]


def _layer_norm(x, g, b, axes, center=True, scale=True):
    """numpy or torch (the same expression): layer norm over ``axes``, biased variance."""
    ax = tuple(a % x.ndim for a in axes)
    mu = x.mean(ax, keepdims=True) if isinstance(x, np.ndarray) else x.mean(ax, keepdim=True)
    var = (((x - mu) ** 2).mean(ax, keepdims=True) if isinstance(x, np.ndarray)
           else ((x - mu) ** 2).mean(ax, keepdim=True))
    y = (x - mu) / (var + EPS) ** 0.5
    return y * (g.reshape(_shape_of(x, axes)) if scale else 1) + (b.reshape(_shape_of(x, axes)) if center else 0)


def _rms_norm(x, w, axes):
    ax = tuple(a % x.ndim for a in axes)
    ms = (x * x).mean(ax, keepdims=True) if isinstance(x, np.ndarray) else (x * x).mean(ax, keepdim=True)
    return x / (ms + EPS) ** 0.5 * w.reshape(_shape_of(x, axes))


def _group_norm(x, g, b, groups, channel, axes):
    """Channel axis split in (groups, channels / groups); normalized over that and ``axes``."""
    shape = list(x.shape)
    split = shape[:channel] + [groups, shape[channel] // groups] + shape[channel + 1:]
    moved = [channel + 1] + [a + 1 if a > channel else a for a in axes]
    y = _layer_norm(x.reshape(split), None, None, moved, center=False, scale=False).reshape(shape)
    per_channel = [shape[channel] if a == channel else 1 for a in range(len(shape))]
    return y * g.reshape(per_channel) + b.reshape(per_channel)


def _batch_norm(x, g, b, mm, mv, axis=1, training=True, momentum=0.1, center=True, scale=True):
    """TVM's batch_norm: (y, new moving mean, new moving var), biased batch variance."""
    others = tuple(a for a in range(x.ndim) if a != axis)
    per = [x.shape[a] if a == axis else 1 for a in range(x.ndim)]
    if training:
        keep = {"keepdims": True} if isinstance(x, np.ndarray) else {"keepdim": True}
        mu = x.mean(others, **keep)
        var = ((x - mu) ** 2).mean(others, **keep)
        new_mean, new_var = ((1 - momentum) * mm + momentum * mu.reshape(-1),
                             (1 - momentum) * mv + momentum * var.reshape(-1))
    else:
        mu, var, new_mean, new_var = mm.reshape(per), mv.reshape(per), mm * 1, mv * 1
    y = (x - mu) / (var + EPS) ** 0.5 * (g.reshape(per) if scale else 1) + (b.reshape(per) if center else 0)
    return y, new_mean, new_var


def _gelu_tanh(x, tanh):
    return 0.5 * x * (1 + tanh(math.sqrt(2 / math.pi) * (x + 0.044715 * x ** 3)))


def _cases():
    """name -> (Relax maker, numpy forward, torch forward, input shapes, dtypes, input kinds)."""
    torch = _torch()
    F = torch.nn.functional if torch else None
    t = (lambda f: f) if torch else (lambda f: None)
    both, f32 = ("float64", "float32"), ("float32",)
    cases = {
        "rsqrt": (R.rsqrt, lambda x: 1 / np.sqrt(x), t(lambda x: torch.rsqrt(x)), [(3, 5)], both, "positive"),
        "erf": (R.erf, _erf, t(lambda x: torch.erf(x)), [(7,)], both, None),
        "gelu": (R.nn.gelu, lambda x: 0.5 * x * (1 + _erf(x / math.sqrt(2))), t(lambda x: F.gelu(x)),
                 [(2, 9)], both, None),
        "gelu_tanh": (R.nn.gelu_tanh, lambda x: _gelu_tanh(x, np.tanh), t(lambda x: F.gelu(x, approximate="tanh")),
                      [(2, 9)], both, None),
        "dropout": (lambda x: R.nn.dropout(x, 0.3), lambda x: (x, np.ones_like(x)),
                    t(lambda x: (F.dropout(x, 0.3, training=False), torch.ones_like(x))), [(3, 5)], both, None),
        "repeat_axis1": (lambda x: R.repeat(x, 3, axis=1), lambda x: np.repeat(x, 3, axis=1),
                         t(lambda x: torch.repeat_interleave(x, 3, dim=1)), [(2, 3, 5)], both, None),
        "repeat_axis-1": (lambda x: R.repeat(x, 2, axis=-1), lambda x: np.repeat(x, 2, axis=-1),
                          t(lambda x: torch.repeat_interleave(x, 2, dim=-1)), [(3, 4)], both, None),
        "repeat_flat": (lambda x: R.repeat(x, 2), lambda x: np.repeat(x, 2),
                        t(lambda x: torch.repeat_interleave(x.reshape(-1), 2)), [(2, 3)], both, None),
    }
    for axes, shape, dtypes in (((-1,), (2, 3, 7), both), ((1, 2), (3, 4, 5), both[:1])):
        # (rms_norm over one non-trailing axis fails in TVM's own legalization)
        weight = [shape[a] for a in axes]
        cases[f"rms_norm{list(axes)}"] = (
            lambda x, w, axes=axes: R.nn.rms_norm(x, w, axes=list(axes), epsilon=EPS),
            lambda x, w, axes=axes: _rms_norm(x, w, axes), t(lambda x, w, axes=axes: _rms_norm(x, w, axes)),
            [shape, weight], dtypes, "weights")
    # layer_norm, group_norm: TVM's forward takes float32 and float16 only
    for axes, shape, center, scale in (((-1,), (2, 3, 7), True, True), ((0, 2), (3, 2, 5), True, True),
                                       ((-1,), (4, 6), False, True), ((-1,), (4, 6), True, False),
                                       ((1, 2), (2, 3, 5), True, True)):
        weight = [shape[a] for a in axes]
        cases[f"layer_norm{list(axes)}{'' if center else '-center'}{'' if scale else '-scale'}"] = (
            lambda x, g, b, a=axes, c=center, s=scale: R.nn.layer_norm(x, g, b, axes=list(a), epsilon=EPS,
                                                                      center=c, scale=s),
            lambda x, g, b, a=axes, c=center, s=scale: _layer_norm(x, g, b, a, c, s),
            t(lambda x, g, b, a=axes, c=center, s=scale: _layer_norm(x, g, b, a, c, s)),
            [shape, weight, weight], f32, "weights")
    for groups, channel, axes, shape in ((3, 1, [2, 3], (2, 6, 3, 5)), (2, 2, [1], (3, 5, 4)), (1, 1, [2], (2, 3, 4))):
        cases[f"group_norm{groups}-c{channel}"] = (
            lambda x, g, b, n=groups, c=channel, a=axes: R.nn.group_norm(x, g, b, num_groups=n, channel_axis=c,
                                                                        axes=a, epsilon=EPS),
            lambda x, g, b, n=groups, c=channel, a=axes: _group_norm(x, g, b, n, c, a),
            t(lambda x, g, b, n=groups, c=channel, a=axes: _group_norm(x, g, b, n, c, a)),
            [shape, (shape[channel],), (shape[channel],)], f32, "weights")
    for training, axis, shape, center, scale in ((True, 1, (3, 4, 5), True, True), (False, 1, (3, 4, 5), True, True),
                                                 (True, -1, (5, 3), False, True), (True, 0, (3, 2, 2), True, False),
                                                 (False, 2, (2, 3, 4), False, False)):
        channels = (shape[axis],)
        kwargs = dict(axis=axis % len(shape), training=training, center=center, scale=scale)
        cases[f"batch_norm-{'train' if training else 'infer'}-axis{axis}-{center:d}{scale:d}"] = (
            lambda x, g, b, mm, mv, kw=kwargs: R.nn.batch_norm(x, g, b, mm, mv, epsilon=EPS, momentum=0.1, **kw),
            lambda *a, kw=kwargs: _batch_norm(*a, **kw), t(lambda *a, kw=kwargs: _batch_norm(*a, **kw)),
            # float32 for one configuration of each mode (float64 checks them all)
            [shape] + [channels] * 4, both if axis == 1 else both[:1], "moving")
    return cases


CASES = _cases()


def _inputs(kind, shapes, rng):
    arrays = [rng.standard_normal(s) for s in shapes]
    if kind == "positive":
        arrays[0] = rng.uniform(0.3, 2.0, shapes[0])
    elif kind == "weights":
        arrays[1] = arrays[1] + 1
    elif kind == "moving":
        arrays[4] = rng.uniform(0.5, 2.0, shapes[4])  # a variance
    return arrays


@pytest.mark.parametrize("name", list(CASES))
def test_first_and_second_derivatives(name):
    """First derivatives in float64 (1e-6) and float32 (1e-4; one configuration per op where
    float64 runs), second derivatives (a Hessian-vector product in every input, ``Gradient`` of
    the adjoint) in the first dtype."""
    make, numpy_forward, torch_forward, shapes, dtypes, kind = CASES[name]
    inputs = _inputs(kind, shapes, np.random.default_rng(0))
    check_gradients(make, inputs, numpy_forward=numpy_forward, torch_forward=torch_forward, dtypes=dtypes)


@pytest.mark.parametrize("name", ["gelu", "rms_norm[-1]", "batch_norm-train-axis1-11",
                                  # float32 only (TVM's forward): second derivatives in float32
                                  "layer_norm[-1]", "layer_norm[0, 2]", "layer_norm[-1]-scale",
                                  "group_norm3-c1", "group_norm2-c2"])
def test_finite_differences_without_pytorch(name):
    """The path a machine without PyTorch takes: central differences of the numpy forward (for
    second derivatives, mixed differences of it in float64, also where the op runs in float32)."""
    make, numpy_forward, _, shapes, dtypes, kind = CASES[name]
    inputs = _inputs(kind, shapes, np.random.default_rng(1))
    check_gradients(make, inputs, numpy_forward=numpy_forward, torch_forward=None, dtypes=dtypes[:1])


def test_first_order_norms_call_the_fused_backward():
    """rms_norm and layer_norm over trailing axes differentiate through the fused ops at first
    order; over other axes (and layer_norm with a flag off) through the composition."""
    def adjoint(make, shapes):
        return gradient(loss_module(make, shapes, "float32", [np.ones(shapes[0])]), require_grads=None).script()

    assert "R.fuel.rms_norm_backward" in adjoint(lambda x, w: R.nn.rms_norm(x, w, axes=[-1]), [(2, 3, 8), (8,)])
    assert "R.fuel.layer_norm_backward" in adjoint(lambda x, g, b: R.nn.layer_norm(x, g, b, axes=[1, 2]),
                                                   [(2, 3, 8), (3, 8), (3, 8)])
    assert "R.fuel" not in adjoint(lambda x, g, b: R.nn.layer_norm(x, g, b, axes=[0]), [(2, 3), (2,), (2,)])
    assert "R.fuel" not in adjoint(lambda x, g, b: R.nn.layer_norm(x, g, b, axes=[-1], center=False),
                                   [(2, 3), (3,), (3,)])


def test_group_norm_without_gamma_or_beta_is_refused():
    """TVM's group_norm applies gamma and beta whatever its flags say: no gradient to disagree with it."""
    make = lambda x, g, b: R.nn.group_norm(x, g, b, num_groups=2, channel_axis=1, axes=[2], center=False)  # noqa: E731
    with pytest.raises(Exception, match="relax.nn.group_norm: no gradient with center=False"):
        gradient(loss_module(make, [(2, 4, 3), (4,), (4,)], "float32", [np.ones((2, 4, 3))]))


def test_tvm_gradients_are_not_overridden():
    from tvm_fuel import autodiff

    assert autodiff.register() == []  # registered once, on import
    for name in autodiff.GRADIENTS:
        assert tvm.ir.Op.get(name).get_attr("FPrimalGradient") is not None


def test_arange_reads_no_tensor_and_passes_no_gradient():
    """loss = sum(x * arange(5)): the positions of an exported model, which Gradient had refused
    (no FPrimalGradient for relax.arange); dx is the positions."""
    x = relax.Var("x", relax.TensorType([2, 5], "float32"))
    bb = relax.BlockBuilder()
    with bb.function("main", [x]):
        with bb.dataflow():
            positions = bb.emit(R.astype(R.arange(0, 5, 1, "int64"), "float32"))
            loss = bb.emit_output(bb.emit(R.sum(R.multiply(x, positions))))
        bb.emit_func_output(loss)
    adjoint = relax.transform.Gradient("main")(bb.get())
    vm = relax.VirtualMachine(tvm.compile(adjoint, "llvm"), tvm.cpu())
    _, (dx,) = vm["main_adjoint"](tvm.runtime.tensor(np.ones((2, 5), "float32")))
    np.testing.assert_array_equal(dx.numpy(), np.broadcast_to(np.arange(5, dtype="float32"), (2, 5)))
