"""Checks of registered gradients: first derivatives (``Gradient``) and second derivatives
(``Gradient`` of the adjoint) of one Relax expression against PyTorch's float64 autograd where
PyTorch is installed, and against central finite differences otherwise.

The checked module is ``main(inputs...) = sum_i sum(out_i * cotangent_i)`` (one term per output
of a tuple-valued op), so its gradient is the op's VJP. The second-order module differentiates
``sum_j <dmain/dinput_j, direction_j>``: a Hessian-vector product in every input at once.

Contents:
    loss_module, run_adjoint, finite_differences, hessian_vector_differences, second_order,
    torch_derivatives, check_gradients
"""

from __future__ import annotations

from typing import Callable, Sequence

import numpy as np
import tvm
from tvm import relax

import tvm_fuel
from tvm_fuel.transform.gradient import gradient, with_objective

from helpers import HOST

R = relax.op


def _fields(out: relax.Expr, count: int) -> list[relax.Expr]:
    return [relax.TupleGetItem(out, i) for i in range(count)] if isinstance(out.ty, relax.TupleType) else [out]


def loss_module(make: Callable[..., relax.Expr], shapes: Sequence[tuple], dtype: str,
                cotangents: Sequence[np.ndarray], dtypes: Sequence[str] | None = None) -> tvm.IRModule:
    """``main(a0, a1, ...) = sum_i sum(make(...)[i] * cotangents[i])`` (``dtypes``: per input)."""
    dtypes = dtypes or [dtype] * len(shapes)
    params = [relax.Var(f"a{i}", relax.TensorType(shape, d)) for i, (shape, d) in enumerate(zip(shapes, dtypes))]
    bb = relax.BlockBuilder()
    with bb.function("main", params):
        with bb.dataflow():
            out = bb.emit(make(*params))
            terms = [R.sum(R.multiply(field, relax.const(c.astype(dtype), dtype)))
                     for field, c in zip(_fields(out, len(cotangents)), cotangents)]
            loss = terms[0]
            for term in terms[1:]:
                loss = R.add(loss, term)
            loss = bb.emit_output(loss)
        bb.emit_func_output(loss)
    return bb.get()


def run_adjoint(mod: tvm.IRModule, func: str, inputs: Sequence[np.ndarray]) -> tuple[float, list[np.ndarray]]:
    """(loss, gradients) of ``func`` (an adjoint) built for the host and run."""
    vm = relax.VirtualMachine(tvm_fuel.compile(mod, HOST), tvm.cpu())
    loss, grads = vm[func](*map(tvm.runtime.tensor, inputs))
    return float(loss.numpy()), [g.numpy() for g in grads]


def finite_differences(f: Callable[..., float], inputs: Sequence[np.ndarray], h: float = 1e-6,
                       wrt: Sequence[int] | None = None) -> list[np.ndarray]:
    """Central differences of the scalar ``f`` in each input (those in ``wrt``; zeros elsewhere)."""
    grads = []
    for i, x in enumerate(inputs):
        g = np.zeros_like(x, dtype="float64")
        if wrt is None or i in wrt:
            for index in np.ndindex(x.shape):
                plus = [a.copy() for a in inputs]
                minus = [a.copy() for a in inputs]
                plus[i][index] += h
                minus[i][index] -= h
                g[index] = (f(*plus) - f(*minus)) / (2 * h)
        grads.append(g)
    return grads


def hessian_vector_differences(f: Callable[..., float], inputs: Sequence[np.ndarray],
                               directions: Sequence[np.ndarray], h: float = 1e-4,
                               wrt: Sequence[int] | None = None) -> list[np.ndarray]:
    """``H d`` of the scalar float64 ``f`` by mixed central differences, element by element:
    ``(f(x+h e_i+h d) - f(x+h e_i-h d) - f(x-h e_i+h d) + f(x-h e_i-h d)) / 4h^2``.

    Differences of ``f`` itself in float64, never of a compiled first derivative: a float32
    gradient differenced at a small step is rounding noise (0.56 vs 0.52 at rtol 1e-3), and h=1e-4
    keeps both the O(h^2) truncation and the eps/h^2 rounding near 1e-8 of the scale."""
    def at(i, index, si, sd):
        shifted = [a + sd * h * d for a, d in zip(inputs, directions)]
        shifted[i][index] += si * h
        return f(*shifted)

    hvp = []
    for i, x in enumerate(inputs):
        g = np.zeros_like(x, dtype="float64")
        if wrt is None or i in wrt:
            for index in np.ndindex(x.shape):
                g[index] = (at(i, index, 1, 1) - at(i, index, 1, -1) - at(i, index, -1, 1)
                            + at(i, index, -1, -1)) / (4 * h * h)
        hvp.append(g)
    return hvp


def second_order(adjoint: tvm.IRModule, directions: Sequence[np.ndarray], dtype: str) -> tvm.IRModule:
    """``directional_adjoint``: the gradient of ``sum_j <grad_j, directions_j>`` (a Hessian-vector
    product), by ``gradient`` of ``main_adjoint``."""
    def along(result):
        grads = result.fields[1]
        total = None
        for j, d in enumerate(directions):
            term = R.sum(R.multiply(grads.fields[j], relax.const(d.astype(dtype), dtype)))
            total = term if total is None else R.add(total, term)
        return total

    return gradient(with_objective(adjoint, "main_adjoint", "directional", along), "directional")


def torch_derivatives(torch_forward: Callable, inputs: Sequence[np.ndarray], cotangents: Sequence[np.ndarray],
                      directions: Sequence[np.ndarray]) -> tuple[list[np.ndarray], list[np.ndarray]] | None:
    """PyTorch's float64 (first derivatives, Hessian-vector product); None without PyTorch."""
    try:
        import torch
    except ImportError:
        return None
    tensors = [torch.tensor(a, dtype=torch.float64, requires_grad=True) for a in inputs]
    out = torch_forward(*tensors)
    out = out if isinstance(out, (tuple, list)) else (out,)
    loss = sum((o * torch.tensor(c, dtype=torch.float64)).sum() for o, c in zip(out, cotangents))
    first = torch.autograd.grad(loss, tensors, create_graph=True, allow_unused=True)
    first = [torch.zeros_like(t) if g is None else g for g, t in zip(first, tensors)]
    along = sum((g * torch.tensor(d, dtype=torch.float64)).sum() for g, d in zip(first, directions))
    second = torch.autograd.grad(along, tensors, allow_unused=True) if along.requires_grad else [None] * len(tensors)
    as_numpy = lambda gs: [np.zeros(t.shape) if g is None else g.detach().numpy() for g, t in zip(gs, tensors)]  # noqa: E731
    return as_numpy(first), as_numpy(second)


def check_gradients(make: Callable[..., relax.Expr], inputs: Sequence[np.ndarray], *,
                    numpy_forward: Callable | None = None, torch_forward: Callable | None = None,
                    dtypes: Sequence[str] = ("float64", "float32"), second: bool = True,
                    wrt: Sequence[int] | None = None, seed: int = 0) -> None:
    """Check ``make``'s registered gradient on ``inputs`` (float64 arrays).

    First derivatives in each dtype of ``dtypes`` (float64 to 1e-6 relative, float32 to 1e-4)
    against PyTorch's float64 autograd of ``torch_forward`` (a function of torch tensors) where
    installed, else central differences of ``numpy_forward``; the second derivatives of the first
    dtype the same way, else against central differences of the compiled first derivative.
    ``wrt``: the inputs compared (the others, e.g. a mask, are not differentiated).
    """
    rng = np.random.default_rng(seed)
    inputs = [np.asarray(a, dtype="float64") for a in inputs]
    outputs = numpy_forward(*inputs) if numpy_forward is not None else None
    if outputs is None:
        import torch

        outputs = torch_forward(*(torch.tensor(a) for a in inputs))
    outputs = outputs if isinstance(outputs, (tuple, list)) else (outputs,)
    cotangents = [rng.standard_normal(np.shape(o)) for o in outputs]
    directions = [rng.standard_normal(a.shape) for a in inputs]
    wrt = list(range(len(inputs))) if wrt is None else list(wrt)
    expected = torch_derivatives(torch_forward, inputs, cotangents, directions) if torch_forward else None
    if expected is None:
        def loss(*a):
            return sum(float((np.asarray(o) * c).sum()) for o, c in zip(_as_tuple(numpy_forward(*a)), cotangents))

        expected = (finite_differences(loss, inputs, wrt=wrt), None)
    first, hvp = expected
    for dtype in dtypes:
        rtol, atol = (1e-6, 1e-8) if dtype == "float64" else (1e-4, 1e-4)
        adjoint = gradient(loss_module(make, [a.shape for a in inputs], dtype, cotangents), require_grads=None)
        _, grads = run_adjoint(adjoint, "main_adjoint", [a.astype(dtype) for a in inputs])
        for i in wrt:
            np.testing.assert_allclose(grads[i], first[i], rtol=rtol, atol=atol * max(1.0, np.abs(first[i]).max()),
                                       err_msg=f"first derivative of input {i} ({dtype})")
    if not second:
        return
    dtype = dtypes[0]
    adjoint = gradient(loss_module(make, [a.shape for a in inputs], dtype, cotangents), require_grads=None)
    vm = relax.VirtualMachine(tvm_fuel.compile(second_order(adjoint, directions, dtype), HOST), tvm.cpu())
    _, got = vm["directional_adjoint"](*(tvm.runtime.tensor(a.astype(dtype)) for a in inputs))
    if hvp is None:
        hvp = hessian_vector_differences(loss, inputs, directions, wrt=wrt)
    rtol, atol = (1e-5, 1e-7) if dtype == "float64" else (1e-3, 1e-4)
    for i in wrt:
        want = hvp[i]
        np.testing.assert_allclose(got[i].numpy(), want, rtol=rtol, atol=atol * max(1.0, np.abs(want).max()),
                                   err_msg=f"second derivative of input {i} ({dtype})")


def _as_tuple(value):
    return value if isinstance(value, (tuple, list)) else (value,)
