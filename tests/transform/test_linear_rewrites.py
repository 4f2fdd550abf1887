"""The rewrites in front of nn.Linear's path: DropMatmulBroadcasts (a matmul reads its operands where
TVM's importer broadcast them to its batch, and the weight then takes the panel path; broadcasts
that the product's shape or its last two dims depend on stay) and FuseTransposeMatmul (a transpose
with other users)."""

from __future__ import annotations

import numpy as np
import pytest
import tvm
import tvm_ffi
from helpers import HOST
from tvm import relax

import tvm_fuel
from tvm_fuel.transform import DropMatmulBroadcasts
from tvm_fuel.transform.legalize_and_fuse import fuse

pytestmark = pytest.mark.numerics

F32 = "float32"


def _module(make, shapes: dict) -> tvm.IRModule:
    bb = relax.BlockBuilder()
    params = [relax.Var(name, relax.TensorType(shape, F32)) for name, shape in shapes.items()]
    with bb.function("main", params):
        with bb.dataflow():
            out = bb.emit_output(make(bb, *params))
        bb.emit_func_output(out)
    return bb.get()


def _ops(mod: tvm.IRModule) -> list[str]:
    found = []
    relax.analysis.post_order_visit(mod["main"], lambda e: found.append(e.op.name) if isinstance(e, relax.Call)
                                    and isinstance(e.op, tvm.ir.Op) else None)
    return found


def _linear(bb, x, w, batch=4):
    """The importer's nn.Linear over x [B, S, K]: both operands broadcast to the batch first."""
    xb = bb.emit(relax.op.broadcast_to(x, x.ty.shape))
    wt = bb.emit(relax.op.permute_dims(w))
    wb = bb.emit(relax.op.broadcast_to(wt, (batch, *wt.ty.shape.values)))
    return relax.op.matmul(xb, wb)


def test_linear_reads_its_weight_once_and_takes_the_panel_path():
    rng = np.random.default_rng(0)
    x = rng.standard_normal((4, 17, 40)).astype(F32)
    w = rng.standard_normal((96, 40)).astype(F32)
    mod = _module(lambda bb, x_: _linear(bb, x_, relax.const(w)), dict(x=(4, 17, 40)))
    dropped = DropMatmulBroadcasts()(mod)
    assert "relax.broadcast_to" in _ops(mod) and "relax.broadcast_to" not in _ops(dropped), dropped
    assert tvm_ffi.structural_equal(dropped["main"].ret_ty, mod["main"].ret_ty)
    names = [gv.name_hint for gv in fuse(mod, HOST).get_global_vars()]
    assert "NT_matmul_panels" in names, names  # the weight [96, 40] laid out once, not [4, 40, 96] stored
    got = relax.VirtualMachine(tvm_fuel.compile(mod, HOST), tvm.cpu())["main"](tvm.runtime.tensor(x)).numpy()
    np.testing.assert_allclose(got, x.astype(np.float64) @ w.T.astype(np.float64), rtol=1e-5, atol=1e-5)


def test_broadcasts_the_product_needs_stay():
    """Both sources 2-D (the product would lose its batch), and a broadcast of the rows themselves
    ([1, K] to [S, K], the last two dims): unchanged."""
    both = _module(lambda bb, a, b: relax.op.matmul(bb.emit(relax.op.broadcast_to(a, (3, 5, 8))),
                                                    bb.emit(relax.op.broadcast_to(b, (3, 8, 6)))),
                   dict(a=(5, 8), b=(8, 6)))
    rows = _module(lambda bb, a, b: relax.op.matmul(bb.emit(relax.op.broadcast_to(a, (2, 5, 8))), b),
                   dict(a=(2, 1, 8), b=(8, 6)))
    for mod in (both, rows):
        assert tvm_ffi.structural_equal(DropMatmulBroadcasts()(mod), mod), mod


def test_a_transpose_with_other_users_still_fuses():
    """TVM's FuseTransposeMatmul fails where w.T has another user (a training adjoint reads it again:
    "'TupleType' object has no attribute 'dtype'"); tvm_fuel's gives the matmul its own transpose."""
    from tvm_fuel.transform import FuseTransposeMatmul

    def make(bb, x, w):
        wt = bb.emit(relax.op.permute_dims(w))
        return relax.Tuple([relax.op.matmul(x, wt), relax.op.add(wt, wt)])

    mod = _module(make, dict(x=(4, 8), w=(6, 8)))
    output = relax.BlockBuilder()  # w.T also returned as it is: a binding of one var to another
    x_, w_ = relax.Var("x", relax.TensorType((4, 8), F32)), relax.Var("w", relax.TensorType((6, 8), F32))
    with output.function("main", [x_, w_]):
        with output.dataflow():
            wt = output.emit(relax.op.permute_dims(w_))
            y = output.emit(relax.op.matmul(x_, wt))
            out = relax.Tuple([output.emit_output(wt), output.emit_output(y)])
        output.emit_func_output(out)
    assert "NT_matmul" in [gv.name_hint for gv in FuseTransposeMatmul()(output.get()).get_global_vars()]
    fused = FuseTransposeMatmul()(mod)
    assert "NT_matmul" in [gv.name_hint for gv in fused.get_global_vars()]
    rng = np.random.default_rng(1)
    x, w = rng.standard_normal((4, 8)).astype(F32), rng.standard_normal((6, 8)).astype(F32)
    y, wt2 = relax.VirtualMachine(tvm_fuel.compile(mod, HOST), tvm.cpu())["main"](*map(tvm.runtime.tensor, (x, w)))
    np.testing.assert_allclose(y.numpy(), x.astype(np.float64) @ w.T, rtol=1e-5, atol=1e-5)
    np.testing.assert_array_equal(wt2.numpy(), w.T + w.T)
