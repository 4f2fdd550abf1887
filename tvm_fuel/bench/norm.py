"""The benchmark's norm rows (``python -m tvm_fuel bench``): the norms' backward, fused or not.

``layer_norm_backward`` and ``rms_norm_backward`` over [N, C] float32 rows (dx, dgamma, dbeta from
dy, x, gamma and the saved statistics), timed side by side in one process:

- ``kernel``: the fused op on the CPU kernel (``kernels="tuned"``): one pass over each row;
- ``floor``: the fused op's TE floor (row means, dx and column sums, each a default schedule);
- ``composition``: the same math as Relax primitives with the default schedules: what a
  gradient of primitives costs (``autodiff.norms.layer_norm_backward``, the fused op's
  higher-order path);
- ``torch``: PyTorch's CPU kernels (``native_layer_norm_backward``; RMS norm's backward through
  autograd of ``torch.nn.functional.rms_norm``).

Contents:
    NORM_CASES -- the (N, C) shapes
    norm_rows  -- run the rows, return their report
    print_rows -- the rows as text
"""

from __future__ import annotations

import numpy as np

NORM_CASES = ((4096, 768), (4096, 4096), (16384, 1024))


def _module(kind: str, rows: int, features: int, fused: bool):
    """main(dy, x, gamma, [mean,] rstd) -> (dx, dgamma[, dbeta]): the fused op or its composition."""
    import tvm
    from tvm import relax

    from .. import op
    from ..autodiff import norms

    ty = relax.TensorType
    names = ["dy", "x", "gamma"] + (["mean"] if kind == "layer" else []) + ["rstd"]
    shapes = {"dy": (rows, features), "x": (rows, features), "gamma": (features,), "mean": (rows,), "rstd": (rows,)}
    params = [relax.Var(n, ty(shapes[n], "float32")) for n in names]
    bb = relax.BlockBuilder()
    with bb.function("main", params):
        with bb.dataflow():
            if fused:
                call = op.layer_norm_backward if kind == "layer" else op.rms_norm_backward
                out = bb.emit_output(call(*params))
            else:
                compose = norms.layer_norm_backward if kind == "layer" else norms.rms_norm_backward
                out = bb.emit_output(relax.Tuple([bb.emit(e) for e in compose(*params)]))
        bb.emit_func_output(out)
    return tvm.IRModule(bb.get().functions), names


def _inputs(kind: str, rows: int, features: int, seed: int) -> dict:
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((rows, features)).astype("float32")
    mean = x.mean(1) if kind == "layer" else np.zeros(rows, "float32")
    var = ((x - mean[:, None]) ** 2).mean(1) if kind == "layer" else (x * x).mean(1)
    arrays = {"dy": rng.standard_normal((rows, features)).astype("float32"), "x": x,
              "gamma": rng.standard_normal(features).astype("float32"), "mean": mean.astype("float32"),
              "rstd": (1 / np.sqrt(var + 1e-5)).astype("float32")}
    if kind == "rms":
        del arrays["mean"]
    return arrays


def _torch_backward(kind: str, arrays: dict):
    """PyTorch's backward of the same call, or None without PyTorch."""
    try:
        import torch
    except ImportError:
        return None
    t = {k: torch.from_numpy(v) for k, v in arrays.items()}
    features = t["x"].shape[1]
    if kind == "layer":
        bias = torch.zeros(features)
        return lambda: torch.ops.aten.native_layer_norm_backward(
            t["dy"], t["x"], [features], t["mean"][:, None], t["rstd"][:, None], t["gamma"], bias, [True, True, True])
    x, w = t["x"].clone().requires_grad_(), t["gamma"].clone().requires_grad_()
    y = torch.nn.functional.rms_norm(x, [features], w, 1e-5)
    return lambda: torch.autograd.grad(y, (x, w), t["dy"], retain_graph=True)


def norm_rows(*, seed: int = 0) -> dict:
    """Milliseconds of each implementation per (kind, N, C), and each one's time over the kernel's."""
    import tvm
    from tvm import relax

    from .attention import measure_side_by_side
    from ..build import compile as fuel_compile
    from ..target import host_target

    target = host_target()
    rows = []
    for kind in ("layer", "rms"):
        for n, c in NORM_CASES:
            arrays = _inputs(kind, n, c, seed)
            fns = {}
            for name, fused, kernels in (("kernel", True, "tuned"), ("floor", True, "decomposed"),
                                         ("composition", False, "decomposed")):
                mod, names = _module(kind, n, c, fused)
                vm = relax.VirtualMachine(fuel_compile(mod, target, kernels=kernels), tvm.cpu())
                tensors = [tvm.runtime.tensor(arrays[k]) for k in names]
                fns[name] = lambda vm=vm, tensors=tensors: vm["main"](*tensors)
            torch_fn = _torch_backward(kind, arrays)
            if torch_fn is not None:
                fns["torch"] = torch_fn
            timed = measure_side_by_side(fns, min_seconds=0.3)
            ms = {name: seconds * 1e3 for name, (seconds, _) in timed.items()}
            # a row times the same answer or it times nothing: each one's largest difference from the
            # kernel's outputs, relative to the kernel's largest magnitude
            got = {name: [np.asarray(o.numpy() if hasattr(o, "numpy") else o) for o in fn()]
                   for name, fn in fns.items()}
            scale = {i: max(float(np.abs(o).max(initial=0.0)), 1e-30) for i, o in enumerate(got["kernel"])}
            errors = {name: max(float(np.abs(o - got["kernel"][i]).max(initial=0.0)) / scale[i]
                                for i, o in enumerate(outs))
                      for name, outs in got.items() if name != "kernel"}
            # bytes the backward must move at least: read dy and x, write dx (float32)
            gbps = 3 * 4 * n * c / (ms["kernel"] * 1e-3) / 1e9
            rows.append({"kind": kind, "N": n, "C": c, "ms": ms, "kernel_gbps": gbps, "error_vs_kernel": errors,
                         "runs": {name: runs for name, (_, runs) in timed.items()},
                         "over_kernel": {name: t / ms["kernel"] for name, t in ms.items() if name != "kernel"}})
    return {"rows": rows}


def print_rows(report: dict) -> None:
    print(f"\n{'norm backward (float32)':<30} {'kernel':>10} {'floor':>10} {'composition':>12} {'torch':>10} "
          f"{'GB/s':>7} {'torch/kernel':>13} {'composition/kernel':>19}")
    for r in report["rows"]:
        ms = r["ms"]
        cell = lambda name: f"{ms[name]:8.2f}ms" if name in ms else f"{'-':>10}"  # noqa: E731
        ratio = lambda name: f"{r['over_kernel'][name]:.2f}x" if name in r["over_kernel"] else "-"  # noqa: E731
        print(f"{r['kind'] + ' N=' + str(r['N']) + ' C=' + str(r['C']):<30} {cell('kernel')} {cell('floor')} "
              f"{cell('composition'):>12} {cell('torch')} {r['kernel_gbps']:7.1f} {ratio('torch'):>13} "
              f"{ratio('composition'):>19}")
    print("(x/kernel > 1: the fused kernel is faster; GB/s: dy and x read and dx written once, by the kernel)")


__all__ = ["NORM_CASES", "norm_rows", "print_rows"]
