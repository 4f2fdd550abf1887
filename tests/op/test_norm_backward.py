"""The fused norm backward ops (``fuel.layer_norm_backward``, ``fuel.rms_norm_backward``): the floor
and the CPU kernel against the float64 reference, the reference against PyTorch's
``native_layer_norm_backward`` where installed; awkward sizes, every dtype, symbolic rows; bad
input refused by name."""

from __future__ import annotations

import numpy as np
import pytest
import tvm
from tvm import relax

import tvm_fuel
from tvm_fuel import op
from tvm_fuel import reference as ref

from helpers import HOST, NP_DTYPE, Runner, assert_close, has_torch

pytestmark = pytest.mark.numerics

TOLERANCE_SCALE = {"float64": 1e-6}  # (float64 is not in the suite's per-dtype table)


def _inputs(rng, rows: int, features: int, dtype: str, layer: bool) -> dict:
    np_dtype = NP_DTYPE.get(dtype, dtype)
    x = (rng.standard_normal((rows, features)) * 2 + 0.5).astype(np_dtype)
    acc = "float64" if dtype == "float64" else "float32"
    x64 = x.astype("float64")
    mean = x64.mean(1) if layer else np.zeros(rows)
    var = ((x64 - mean[:, None]) ** 2).mean(1) if layer else (x64 ** 2).mean(1)
    arrays = dict(dy=rng.standard_normal((rows, features)).astype(np_dtype), x=x,
                  gamma=(rng.standard_normal(features) + 1).astype(np_dtype))
    if layer:
        arrays["mean"] = mean.astype(acc)
    arrays["rstd"] = (1 / np.sqrt(var + 1e-5)).astype(acc)
    return arrays


def _module(arrays: dict, layer: bool, symbolic_rows: bool) -> tvm.IRModule:
    n = tvm.tirx.Var("n", "int64") if symbolic_rows else None
    params = {}
    for name, a in arrays.items():
        shape = [n if (symbolic_rows and name != "gamma" and axis == 0) else d for axis, d in enumerate(a.shape)]
        params[name] = relax.Var(name, relax.TensorType(shape, str(a.dtype)))
    bb = relax.BlockBuilder()
    with bb.function("main", list(params.values())):
        p = params
        call = (op.layer_norm_backward(p["dy"], p["x"], p["gamma"], p["mean"], p["rstd"]) if layer
                else op.rms_norm_backward(p["dy"], p["x"], p["gamma"], p["rstd"]))
        bb.emit_func_output(bb.emit(call))
    return bb.get()


def _check(rows, features, dtype, layer, kernels, symbolic_rows=False, seed=0):
    arrays = _inputs(np.random.default_rng(seed), rows, features, dtype, layer)
    got = Runner(_module(arrays, layer, symbolic_rows), HOST, kernels=kernels)(*arrays.values())
    want = (ref.layer_norm_backward if layer else ref.rms_norm_backward)(*arrays.values())
    for name, g, w in zip(("dx", "dgamma", "dbeta"), got, want):
        assert g.dtype == arrays["x"].dtype
        # dgamma / dbeta sum over the rows: their rounding grows with N
        scale = (1.0 if name == "dx" else max(1.0, np.sqrt(rows))) * (2 if dtype != "float64" else 1)
        if dtype == "float64":
            np.testing.assert_allclose(g, w, rtol=1e-10, atol=1e-10 * scale, err_msg=name)
        else:
            assert_close(g, w, dtype, scale=scale, what=name)


@pytest.mark.parametrize("kernels", ["decomposed", "tuned"])
@pytest.mark.parametrize("layer", [True, False], ids=["layer", "rms"])
@pytest.mark.parametrize("rows,features", [(1, 1), (17, 40), (97, 97), (3, 768)])
def test_matches_the_reference(rows, features, layer, kernels):
    _check(rows, features, "float32", layer, kernels)


@pytest.mark.parametrize("kernels", ["decomposed", "tuned"])
@pytest.mark.parametrize("dtype", ["float16", "bfloat16", "float64"])
def test_dtypes(dtype, kernels):
    _check(33, 64, dtype, True, kernels)
    _check(7, 40, dtype, False, kernels)


@pytest.mark.parametrize("kernels", ["decomposed", "tuned"])
def test_symbolic_rows_and_no_rows(kernels):
    for rows in (0, 1, 17):
        _check(rows, 24, "float32", True, kernels, symbolic_rows=True, seed=rows)


def test_reference_matches_pytorch():
    torch = pytest.importorskip("torch")
    arrays = _inputs(np.random.default_rng(5), 9, 13, "float64", True)
    t = {k: torch.tensor(v) for k, v in arrays.items()}
    want = torch.ops.aten.native_layer_norm_backward(
        t["dy"], t["x"], [13], t["mean"][:, None], t["rstd"][:, None], t["gamma"], torch.zeros(13, dtype=torch.float64),
        [True, True, True])
    for got, expected in zip(ref.layer_norm_backward(*arrays.values()), want):
        np.testing.assert_allclose(got, expected.numpy(), rtol=1e-12, atol=1e-12)


def _call(make, **shapes_and_dtypes):
    return make(**{name: relax.Var(name, relax.TensorType(shape, dtype))
                   for name, (shape, dtype) in shapes_and_dtypes.items()})


@pytest.mark.parametrize("args,message", [
    (dict(dy=((4, 8), "float32"), x=((4, 8, 1), "float32")), "argument 'x' must be 2-D"),
    (dict(dy=((4, 8), "float16"), x=((4, 8), "float32")), "argument 'dy' must have the dtype of 'x'"),
    (dict(dy=((4, 8), "float32"), x=((4, 8), "float32"), rstd=((4,), "float16")),
     "argument 'rstd' must have dtype float32"),
    (dict(dy=((4, 8), "float32"), x=((4, 8), "float32"), gamma=((7,), "float32")), "argument 'gamma' must have shape"),
    (dict(dy=((4, 8), "float32"), x=((4, 8), "float32"), mean=((5,), "float32")), "argument 'mean' must have shape"),
    (dict(dy=((4, 8), "float32"), x=((4, 0), "float32")), "feature count C of 'x' must be >= 1"),
    (dict(dy=((4, 8), "int32"), x=((4, 8), "int32")), "argument 'x' must have dtype"),
])
def test_bad_input_is_refused_by_name(args, message):
    shapes = dict(dy=((4, 8), "float32"), x=((4, 8), "float32"), gamma=((8,), "float32"), mean=((4,), "float32"),
                  rstd=((4,), "float32"))
    shapes.update(args)
    if "gamma" not in args and shapes["x"][0][-1:] == (0,):
        shapes["gamma"] = ((0,), "float32")
    bb = relax.BlockBuilder()
    with pytest.raises((TypeError, ValueError), match="fuel.layer_norm_backward: .*" + message.replace("(", r"\(")):
        with bb.function("main", []):
            bb.emit_func_output(bb.emit(_call(op.layer_norm_backward, **shapes)))


def test_symbolic_dims_that_differ_are_refused_at_run_time():
    n, m = tvm.tirx.Var("n", "int64"), tvm.tirx.Var("m", "int64")
    params = [relax.Var("dy", relax.TensorType((n, 8), "float32")), relax.Var("x", relax.TensorType((n, 8), "float32")),
              relax.Var("w", relax.TensorType((8,), "float32")), relax.Var("rstd", relax.TensorType((m,), "float32"))]
    bb = relax.BlockBuilder()
    with bb.function("main", params):
        bb.emit_func_output(bb.emit(op.rms_norm_backward(*params)))
    vm = relax.VirtualMachine(tvm_fuel.compile(bb.get(), HOST), tvm.cpu())
    arrays = [np.ones((3, 8), "float32"), np.ones((3, 8), "float32"), np.ones(8, "float32"), np.ones(4, "float32")]
    with pytest.raises(ValueError, match="fuel.rms_norm_backward: the row count N of 'rstd'"):
        vm["main"](*map(tvm.runtime.tensor, arrays))


def test_the_benchmark_rows_run(monkeypatch):
    """``bench``'s norm rows on a small shape: each implementation timed, ratios to the kernel."""
    from tvm_fuel.bench import norm as bench_norm

    monkeypatch.setattr(bench_norm, "NORM_CASES", ((33, 40),))
    report = bench_norm.norm_rows()
    assert [(r["kind"], r["N"], r["C"]) for r in report["rows"]] == [("layer", 33, 40), ("rms", 33, 40)]
    for row in report["rows"]:
        assert set(row["ms"]) == {"kernel", "floor", "composition"} | ({"torch"} if has_torch() else set())
        assert min(row["runs"].values()) >= 4  # the timing loop's floor of rounds
        # every timed implementation gave the kernel's answer
        assert max(row["error_vs_kernel"].values()) < 1e-5, row["error_vs_kernel"]
        assert row["kernel_gbps"] == pytest.approx(3 * 4 * 33 * 40 / (row["ms"]["kernel"] * 1e-3) / 1e9)
        for name, ratio in row["over_kernel"].items():
            assert ratio == pytest.approx(row["ms"][name] / row["ms"]["kernel"])
    bench_norm.print_rows(report)
