"""Gradients of the shape-changing ops TVM leaves without one (``tvm_fuel.autodiff``: strided_slice,
conv2d_transpose, adaptive_avg_pool2d): first derivatives (float64 to 1e-6, float32 to 1e-4) and
second derivatives (``Gradient`` of the adjoint) against PyTorch's float64 autograd, or central
differences of the numpy forward without it (``gradcheck.check_gradients``). Awkward cases: negative
and out-of-range indices, negative and >1 steps, several axes; strides 2-3 with asymmetric padding,
output_padding, dilation, groups 2, NHWC and other kernel layouts; non-divisible and upsampling
adaptive bins. The tricky forwards compiled by TVM are checked against the numpy forwards, so the
gradients are tested against the op as TVM computes it. The linear ops are squared in the checked
function, so that their second derivatives are not trivially zero. TVM 0.27 lowers conv2d_transpose
only as NCHW / IOHW and adaptive pooling only with out_layout == layout: the other layouts' forwards
are compiled as permutations around those (``_CanonicalForward``), after ``Gradient`` has
differentiated the ops in their own layouts.
"""

from __future__ import annotations

import numpy as np
import pytest
import tvm
from tvm import relax, tirx
from tvm.relax.expr_functor import PyExprMutator, mutator

import tvm_fuel
from tvm_fuel.transform.gradient import gradient

from gradcheck import check_gradients
from helpers import HOST

pytestmark = pytest.mark.numerics

R = relax.op
BOTH, F64 = ("float64", "float32"), ("float64",)


def _torch():
    try:
        import torch
    except ImportError:
        return None
    return torch


def _square(make):
    """``make``'s output squared: a linear op's Hessian-vector product is then nonzero."""
    def squared(*args):
        y = make(*args)
        return R.multiply(y, y)
    return squared


def _forward(make, inputs: list[np.ndarray]) -> np.ndarray:
    """``make(inputs)`` compiled by TVM for the host and run."""
    params = [relax.Var(f"a{i}", relax.TensorType(a.shape, str(a.dtype))) for i, a in enumerate(inputs)]
    bb = relax.BlockBuilder()
    with bb.function("main", params):
        with bb.dataflow():
            out = bb.emit_output(make(*params))
        bb.emit_func_output(out)
    vm = relax.VirtualMachine(tvm_fuel.compile(bb.get(), HOST), tvm.cpu())
    return vm["main"](*map(tvm.runtime.tensor, inputs)).numpy()


# ---------------------------------------------------------------------------------------------------
# strided_slice

def _slice_maker(axes, begin, end, strides, assume_inbound=False):
    return lambda x: R.strided_slice(x, axes, begin, end, strides, assume_inbound=assume_inbound)


def _np_slice(x, axes, begin, end, strides):
    """Python's slicing clamps exactly as topi's strided_slice does (negative indices wrap once,
    then clamp to [0, n] going forward, [-1, n - 1] going backward)."""
    index = [slice(None)] * x.ndim
    for a, b, e, s in zip(axes, begin, end, strides or [1] * len(axes)):
        index[a % x.ndim] = slice(b, e, s)
    return x[tuple(index)]


def _torch_slice(x, axes, begin, end, strides):
    torch = _torch()  # no negative steps in torch: gather the positions numpy selects
    for a, b, e, s in zip(axes, begin, end, strides or [1] * len(axes)):
        a %= x.ndim
        x = x.index_select(a, torch.tensor(np.arange(x.shape[a])[b:e:s].tolist()))
    return x


SLICES = {
    # axis 0: -1 -> 4, -6 -> -1, step -2 (4, 2, 0); axis 2: 10 -> 6, -100 -> -1, step -3 (6, 3, 0);
    # axis 1: a contiguous run (1, 2)
    "negative-steps-clamped": ((5, 4, 7), [0, -1, 1], [-1, 10, 1], [-6, -100, 3], [-2, -3, 1], False),
    # steps 2 and 3: axis 0 from -6 -> 1 to 100 -> 7 (1, 3, 5); axis 2 from -100 -> 0 to 4 (0, 3)
    "steps": ((7, 3, 5), [0, 2], [-6, -100], [100, 4], [2, 3], False),
    # assume_inbound with in-range indices; strides omitted (all ones)
    "inbound-default-strides": ((3, 5), [1], [1], [4], None, True),
}


def _slice_case(name):
    shape, axes, begin, end, strides, inbound = SLICES[name]
    make = _slice_maker(axes, begin, end, strides, inbound)
    return (shape, make, lambda x: _np_slice(x, axes, begin, end, strides),
            lambda x: _torch_slice(x, axes, begin, end, strides))


@pytest.mark.parametrize("name", list(SLICES))
def test_strided_slice(name):
    """The forward TVM compiles equals numpy's slicing; then first and second derivatives of the
    slice squared (float32 too in the first case; float64 only in the others, to keep the file fast)."""
    shape, make, numpy_forward, torch_forward = _slice_case(name)
    x = np.random.default_rng(0).standard_normal(shape)
    np.testing.assert_array_equal(_forward(make, [x]), numpy_forward(x))
    check_gradients(_square(make), [x], numpy_forward=lambda x: numpy_forward(x) ** 2,
                    torch_forward=_torch() and (lambda x: torch_forward(x) ** 2),
                    dtypes=BOTH if name == "negative-steps-clamped" else F64)


def test_strided_slice_finite_differences_without_pytorch():
    """The path a machine without PyTorch takes: central differences of the numpy forward (first
    derivatives) and of the compiled first derivative (second)."""
    shape, make, numpy_forward, _ = _slice_case("negative-steps-clamped")
    x = np.random.default_rng(1).standard_normal(shape)
    check_gradients(_square(make), [x], numpy_forward=lambda x: numpy_forward(x) ** 2, torch_forward=None,
                    dtypes=F64)


# ---------------------------------------------------------------------------------------------------
# conv2d_transpose

def _out_size(size, stride, pad_before, pad_after, kernel, dilation, output_padding):
    return (size - 1) * stride - pad_before - pad_after + dilation * (kernel - 1) + 1 + output_padding


def _np_conv2d_transpose(x, w, strides, padding, output_padding, dilation, groups):
    """NCHW / IOHW by its definition: x[n, c, i, j] w[c, o, a, b] lands on output channel
    group(c) * O/g + o at (s i - pt + d a, s j - pl + d b)."""
    (n, c, h, w_in), (_, og, kh, kw) = x.shape, w.shape
    pt, pl, pb, pr = padding
    cg = c // groups
    ho = _out_size(h, strides[0], pt, pb, kh, dilation[0], output_padding[0])
    wo = _out_size(w_in, strides[1], pl, pr, kw, dilation[1], output_padding[1])
    full = np.zeros((n, groups * og, pt + ho + (h - 1) * strides[0] + dilation[0] * kh,
                     pl + wo + (w_in - 1) * strides[1] + dilation[1] * kw))
    for g in range(groups):
        xg, wg = x[:, g * cg:(g + 1) * cg], w[g * cg:(g + 1) * cg]
        for a in range(kh):
            for b in range(kw):
                rows = slice(a * dilation[0], a * dilation[0] + (h - 1) * strides[0] + 1, strides[0])
                cols = slice(b * dilation[1], b * dilation[1] + (w_in - 1) * strides[1] + 1, strides[1])
                full[:, g * og:(g + 1) * og, rows, cols] += np.einsum("nchw,co->nohw", xg, wg[:, :, a, b])
    return full[:, :, pt:pt + ho, pl:pl + wo]


def _torch_conv2d_transpose(x, w, strides, padding, output_padding, dilation, groups):
    """torch's padding is symmetric: transpose unpadded, extend by output_padding, crop."""
    F = _torch().nn.functional
    pt, pl, pb, pr = padding
    ho = _out_size(x.shape[2], strides[0], pt, pb, w.shape[2], dilation[0], output_padding[0])
    wo = _out_size(x.shape[3], strides[1], pl, pr, w.shape[3], dilation[1], output_padding[1])
    full = F.conv_transpose2d(x, w, stride=strides, dilation=dilation, groups=groups)
    full = F.pad(full, (0, output_padding[1], 0, output_padding[0]))
    return full[:, :, pt:pt + ho, pl:pl + wo]


def _permutation(source, target):
    return [source.index(c) for c in target]


CONVS = {
    # strides 2, 3; asymmetric padding (bottom >= output_padding on H, right < on W); groups 2
    "groups2-dilated": dict(x=(1, 4, 3, 2), w=(4, 2, 3, 2), strides=(2, 3), padding=(1, 0, 2, 1),
                            output_padding=(1, 2), dilation=(2, 2), groups=2),
    # NHWC data, OHWI kernel, NCHW output; padding given as 2 values; output_padding 2 at stride 3
    "nhwc-ohwi": dict(x=(2, 3, 2, 3), w=(2, 3, 2, 3), strides=(3, 1), padding=(0, 1), output_padding=(2, 0),
                      dilation=(1, 2), groups=1, data_layout="NHWC", kernel_layout="OHWI", out_layout="NCHW"),
}


def _conv_case(name):
    """(input shapes, Relax maker, numpy forward, torch forward) in the case's own layouts."""
    case = dict(CONVS[name])
    xs, ws = case.pop("x"), case.pop("w")
    layouts = (case.get("data_layout", "NCHW"), case.get("kernel_layout", "IOHW"), case.get("out_layout", "NCHW"))
    padding = case["padding"] if len(case["padding"]) == 4 else tuple(case["padding"]) * 2
    attrs = (case["strides"], padding, case["output_padding"], case["dilation"], case["groups"])
    to_x, to_w = _permutation(layouts[0], "NCHW"), _permutation(layouts[1], "IOHW")
    from_y = _permutation("NCHW", layouts[2])

    def numpy_forward(x, w):
        return _np_conv2d_transpose(x.transpose(to_x), w.transpose(to_w), *attrs).transpose(from_y)

    def torch_forward(x, w):
        return _torch_conv2d_transpose(x.permute(to_x), w.permute(to_w), *attrs).permute(from_y)

    return [xs, ws], lambda x, w: R.nn.conv2d_transpose(x, w, **case), numpy_forward, torch_forward


@mutator
class _CanonicalForward(PyExprMutator):
    """conv2d_transpose and adaptive_avg_pool2d in other layouts as permutations around the
    NCHW / IOHW op (TVM 0.27 lowers only that: NCHW data, IOHW kernel, out_layout == layout)."""

    def visit_call_(self, call):
        call = super().visit_call_(call)
        name = call.op.name if isinstance(call.op, tvm.ir.Op) else None
        if name == "relax.nn.conv2d_transpose":
            a = call.attrs
            layouts = (str(a.data_layout), str(a.kernel_layout), str(a.out_layout))
            if layouts == ("NCHW", "IOHW", "NCHW"):
                return call
            x = self.builder_.emit(R.permute_dims(call.args[0], _permutation(layouts[0], "NCHW")))
            w = self.builder_.emit(R.permute_dims(call.args[1], _permutation(layouts[1], "IOHW")))
            y = self.builder_.emit(R.nn.conv2d_transpose(
                x, w, strides=a.strides, padding=a.padding, output_padding=a.output_padding, dilation=a.dilation,
                groups=a.groups))
            return R.permute_dims(y, _permutation("NCHW", layouts[2]))
        if name == "relax.nn.adaptive_avg_pool2d" and str(call.attrs.out_layout) != str(call.attrs.layout):
            layout, out_layout = str(call.attrs.layout), str(call.attrs.out_layout)
            y = self.builder_.emit(R.nn.adaptive_avg_pool2d(call.args[0], call.attrs.output_size, layout=layout))
            return R.permute_dims(y, _permutation(layout, out_layout))
        return call


def _canonical_forward(mod: tvm.IRModule) -> tvm.IRModule:
    rewriter = _CanonicalForward(mod)
    for gvar, func in mod.functions.items():
        if isinstance(func, relax.Function):
            rewriter.builder_.update_func(gvar, rewriter.visit_expr(func))
    return rewriter.builder_.get()


@pytest.fixture
def canonical_forward(monkeypatch):
    """Compile with the other layouts' forwards rewritten by ``_CanonicalForward`` (after
    ``Gradient`` has run: the gradients checked are those of the ops in their own layouts)."""
    compile_ = tvm_fuel.compile
    monkeypatch.setattr(tvm_fuel, "compile", lambda mod, *a, **kw: compile_(_canonical_forward(mod), *a, **kw))


@pytest.mark.parametrize("name", list(CONVS))
def test_conv2d_transpose(name, canonical_forward):
    """The forward equals the numpy definition (for NCHW / IOHW as TVM lowers it itself); first
    derivatives of data and weight, and their Hessian-vector product (the op is bilinear)."""
    shapes, make, numpy_forward, torch_forward = _conv_case(name)
    rng = np.random.default_rng(0)
    inputs = [rng.standard_normal(s) for s in shapes]
    np.testing.assert_allclose(_forward(make, inputs), numpy_forward(*inputs), rtol=1e-12, atol=1e-12)
    check_gradients(make, inputs, numpy_forward=numpy_forward, torch_forward=_torch() and torch_forward,
                    dtypes=BOTH if name == "groups2-dilated" else F64)


# ---------------------------------------------------------------------------------------------------
# adaptive_avg_pool2d

def _np_adaptive_avg_pool2d(x, out):
    """NCHW, topi's (and torch's) bins: [floor(i H / oh), ceil((i + 1) H / oh))."""
    (h, w), (oh, ow) = x.shape[2:], out
    y = np.zeros(x.shape[:2] + (oh, ow))
    for i in range(oh):
        for j in range(ow):
            rows = slice(i * h // oh, -(-(i + 1) * h // oh))
            cols = slice(j * w // ow, -(-(j + 1) * w // ow))
            y[:, :, i, j] = x[:, :, rows, cols].mean(axis=(2, 3))
    return y


POOLS = {
    # 7 -> 3 and 5 -> 4: uneven, overlapping bins
    "7x5-to-3x4": dict(x=(2, 1, 7, 5), output_size=(3, 4)),
    # NHWC in, NCHW out; an int output size: 5 -> 4 (overlapping) and 3 -> 4 (upsampling)
    "nhwc-to-nchw": dict(x=(1, 5, 3, 2), output_size=4, layout="NHWC", out_layout="NCHW"),
    # NHWC; output_size None: the input's own size (1 -> 1, 3 -> 3)
    "nhwc-same-size": dict(x=(2, 1, 3, 2), output_size=None, layout="NHWC"),
}


def _pool_case(name):
    case = dict(POOLS[name])
    shape = case.pop("x")
    layout = case.get("layout", "NCHW")
    out_layout = case.get("out_layout", layout)
    size = case["output_size"]
    to_x, from_y = _permutation(layout, "NCHW"), _permutation("NCHW", out_layout)
    spatial = [shape[layout.index(a)] for a in "HW"]
    out = spatial if size is None else (size, size) if isinstance(size, int) else size

    def numpy_forward(x):
        return _np_adaptive_avg_pool2d(x.transpose(to_x), out).transpose(from_y)

    def torch_forward(x):
        return _torch().nn.functional.adaptive_avg_pool2d(x.permute(to_x), out).permute(from_y)

    return shape, lambda x: R.nn.adaptive_avg_pool2d(x, **case), numpy_forward, torch_forward


@pytest.mark.parametrize("name", list(POOLS))
def test_adaptive_avg_pool2d(name, canonical_forward):
    """The forward equals the numpy bins; first and second derivatives of the pooling squared."""
    shape, make, numpy_forward, torch_forward = _pool_case(name)
    x = np.random.default_rng(0).standard_normal(shape)
    np.testing.assert_allclose(_forward(make, [x]), numpy_forward(x), rtol=1e-12, atol=1e-12)
    check_gradients(_square(make), [x], numpy_forward=lambda x: numpy_forward(x) ** 2,
                    torch_forward=_torch() and (lambda x: torch_forward(x) ** 2),
                    dtypes=BOTH if name == "7x5-to-3x4" else F64, second=name != "nhwc-same-size")


# ---------------------------------------------------------------------------------------------------
# what the gradients refuse

def _adjoint(make, params):
    bb = relax.BlockBuilder()
    with bb.function("main", params):
        with bb.dataflow():
            loss = bb.emit_output(R.sum(make(*params)))
        bb.emit_func_output(loss)
    return gradient(bb.get())


@pytest.mark.parametrize("make, params, message", [
    (_slice_maker([0], [0], [2], [1]), [((tirx.Var("n", "int64"), 3), "float32")],
     r"^relax\.strided_slice: the sliced axis 0 must have a static size"),
    (_slice_maker([1], [0], [9], [1], assume_inbound=True), [((2, 4), "float32")],
     r"^relax\.strided_slice: axis 1 reads 4 elements .* the output shape says 9: with assume_inbound"),
    (lambda x, w: R.nn.conv2d_transpose(x, w, out_dtype="float64"),
     [((1, 2, 3, 3), "float32"), ((2, 1, 2, 2), "float32")],
     r"^relax\.nn\.conv2d_transpose: out_dtype must be the data's dtype \(float32\)"),
    (lambda x, w: R.nn.conv2d_transpose(x, w), [((tirx.Var("n", "int64"), 2, 3, 3), "float32"),
                                                ((2, 1, 2, 2), "float32")],
     r"^relax\.nn\.conv2d_transpose: data must have a static shape"),
    (lambda x: R.nn.adaptive_avg_pool2d(x, 2), [((1, 2, tirx.Var("h", "int64"), 4), "float32")],
     r"^relax\.nn\.adaptive_avg_pool2d: the data's H and W must be static"),
    (lambda x: R.nn.adaptive_avg_pool2d(x, 2, layout="NCHW4c"), [((1, 2, 3, 3, 4), "float32")],
     r"^relax\.nn\.adaptive_avg_pool2d: layout must be a permutation of NCHW"),
])
def test_unsupported_cases_are_refused(make, params, message):
    """Dynamic indices or sizes, mixed precision and packed layouts raise ValueError naming the op."""
    params = [relax.Var(f"a{i}", relax.TensorType(shape, dtype)) for i, (shape, dtype) in enumerate(params)]
    with pytest.raises(ValueError, match=message):
        _adjoint(make, params)


def test_registered_where_tvm_has_none():
    """``import tvm_fuel`` gave the three ops their gradients (TVM 0.27 has none of them)."""
    from tvm_fuel.autodiff import indexing, spatial

    for name, table in (("relax.strided_slice", indexing.GRADIENTS), ("relax.nn.conv2d_transpose", spatial.GRADIENTS),
                        ("relax.nn.adaptive_avg_pool2d", spatial.GRADIENTS)):
        assert tvm.ir.Op.get(name).get_attr("FPrimalGradient") is not None
        assert name in table



def test_strided_slice_symbolic_begin_is_refused():
    """A begin that is not a constant. (Called directly: TVM's Gradient pass itself fails on the
    symbolic output shape such a slice has, before any gradient runs.)"""
    from tvm_fuel.autodiff.indexing import GRADIENTS

    m = tirx.Var("m", "int64")
    x = relax.Var("x", relax.TensorType((5, m), "float32"))
    bb = relax.BlockBuilder()
    with bb.function("main", [x]):
        call = bb.normalize(R.strided_slice(x, [0], [m], [5], assume_inbound=True))
        y = relax.Var("y", call.ty)
        with pytest.raises(ValueError, match=r"^relax\.strided_slice: begin must be a tuple of static integers"):
            GRADIENTS["relax.strided_slice"](y, call, y, bb)
        bb.emit_func_output(x)
