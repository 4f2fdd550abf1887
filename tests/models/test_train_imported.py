"""Training a model exported from PyTorch through Relax, as the README shows it:
``torch.export`` -> ``from_exported_program`` (parameters kept as inputs) -> ``FuseAttention`` ->
``tvm_fuel.transform.gradient`` -> ``tvm_fuel.compile`` -> SGD steps, against PyTorch training the
same module from the same weights.

The model is a pre-LayerNorm transformer block (q/k/v/o projections with bias, causal
``scaled_dot_product_attention`` over 2 heads, GELU MLP, residuals) under a mean-squared-error loss
against a fixed target; the loss is part of the exported module, so ``main`` returns the scalar
``Gradient`` differentiates.
"""

from __future__ import annotations

import copy
import math

import numpy as np
import pytest

torch = pytest.importorskip("torch")

import tvm  # noqa: E402
from tvm import relax  # noqa: E402
from tvm.relax.frontend import detach_params  # noqa: E402
from tvm.relax.frontend.torch import from_exported_program  # noqa: E402

import tvm_fuel  # noqa: E402

pytestmark = pytest.mark.numerics

F = torch.nn.functional
BATCH, SEQ, HIDDEN, HEADS = 2, 7, 16, 2
STEPS, LR = 5, 0.1
ATTENTION = {"decomposed": ("fuel_flash_attn", "fuel_flash_attn_backward"),  # the PrimFuncs each path builds
             "tuned": ("fuel_flash_attn_kernel", "fuel_flash_attn_backward_kernel")}


class Block(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.ln1, self.ln2 = torch.nn.LayerNorm(HIDDEN), torch.nn.LayerNorm(HIDDEN)
        self.q, self.k, self.v, self.o = (torch.nn.Linear(HIDDEN, HIDDEN) for _ in range(4))
        self.up, self.down = torch.nn.Linear(HIDDEN, 4 * HIDDEN), torch.nn.Linear(4 * HIDDEN, HIDDEN)

    def forward(self, x):
        b, s, e = x.shape
        h = self.ln1(x)
        q, k, v = (proj(h).view(b, s, HEADS, e // HEADS).transpose(1, 2) for proj in (self.q, self.k, self.v))
        attn = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.o(attn.transpose(1, 2).reshape(b, s, e))
        return x + self.down(F.gelu(self.up(self.ln2(x))))


class WithLoss(torch.nn.Module):
    def __init__(self, block: torch.nn.Module):
        super().__init__()
        self.block = block

    def forward(self, x, y):
        return F.mse_loss(self.block(x), y)


def _ops(func: relax.Function) -> list[str]:
    """The names of the ops ``func`` calls, one entry per call."""
    found = []
    relax.analysis.post_order_visit(func, lambda e: found.append(e.op.name) if isinstance(e, relax.Call)
                                    and isinstance(e.op, tvm.ir.Op) else None)
    return found


def _without_gradient(func: relax.Function) -> list[str]:
    return sorted({name for name in _ops(func) if tvm.ir.Op.get(name).get_attr("FPrimalGradient") is None})


@pytest.fixture(scope="module")
def imported():
    """The exported loss module imported, its attention fused, and its adjoint; the model, data
    and the importer's weights (``detach_params``) with the torch parameter each var stands for."""
    torch.manual_seed(0)
    model = WithLoss(Block())
    x, y = torch.randn(BATCH, SEQ, HIDDEN), torch.randn(BATCH, SEQ, HIDDEN)
    program = torch.export.export(model, (x, y))
    raw = from_exported_program(program, keep_params_as_input=True, unwrap_unit_return_tuple=True)
    mod, params = detach_params(raw)
    mod = tvm_fuel.transform.FuseAttention()(mod)
    n_inputs = int(mod["main"].attrs["num_input"])  # x, y; then one var per parameter
    weights = mod["main"].params[n_inputs:]
    adjoint = tvm_fuel.transform.gradient(mod, "main", require_grads=weights)
    targets = {spec.arg.name: spec.target for spec in program.graph_signature.input_specs}
    return dict(model=model, x=x, y=y, raw=raw, mod=mod, adjoint=adjoint, n_inputs=n_inputs,
                initial=[p.numpy() for p in params["main"]], torch_names=[targets[w.name] for w in weights])


def test_sdpa_imports_unfused_and_becomes_one_causal_flash_attn(imported):
    raw_ops, fused_ops = _ops(imported["raw"]["main"]), _ops(imported["mod"]["main"])
    assert "relax.nn.softmax" in raw_ops and not [n for n in raw_ops if n.startswith("relax.fuel.")]
    assert fused_ops.count("relax.fuel.flash_attn") == 1 and "relax.nn.softmax" not in fused_ops
    # the causal mask's index arithmetic and SDPA's empty-row guard went with the scores
    assert not {"relax.arange", "relax.where", "relax.max", "relax.logical_not"} & set(fused_ops)
    (call,) = [b.value for b in imported["mod"]["main"].body.blocks[0].bindings
               if getattr(getattr(b.value, "op", None), "name", None) == "relax.fuel.flash_attn"]
    assert bool(call.attrs["causal"]) and not bool(call.attrs["has_attn_mask"])
    # PyTorch's decomposition scales q and k^T by head_dim ** -0.25 each; their product is the scale
    assert float(call.attrs["softmax_scale"]) == pytest.approx(1 / math.sqrt(HIDDEN // HEADS), rel=1e-6)
    assert [int(d) for d in call.args[0].ty.shape] == [BATCH, HEADS, SEQ, HIDDEN // HEADS]


def test_every_op_left_to_differentiate_has_a_gradient(imported):
    """What the importer emits, fused, is differentiable op by op (layer_norm and gelu from
    tvm_fuel.autodiff); the ops without one are all on the causal mask's bool/int path, which
    FuseAttention folds into flash_attn's ``causal``."""
    assert _without_gradient(imported["mod"]["main"]) == []
    assert set(_without_gradient(imported["raw"]["main"])) <= {"relax.arange", "relax.logical_and",
                                                                "relax.logical_not", "relax.max"}


def test_the_importer_weights_are_torch_parameters_in_argument_order(imported):
    named = dict(imported["model"].named_parameters())
    assert sorted(imported["torch_names"]) == sorted(named)
    for name, value in zip(imported["torch_names"], imported["initial"], strict=True):
        np.testing.assert_array_equal(value, named[name].detach().numpy(), err_msg=name)


def test_attention_trains_through_flash_attn_backward(imported):
    """gradient ran ShareForwardState: the forward returns its lse, and the backward reads the
    forward's out and lse instead of recomputing them; no softmax is differentiated."""
    calls = {}
    relax.analysis.post_order_visit(imported["adjoint"]["main_adjoint"], lambda e: calls.setdefault(
        e.op.name, []).append(e) if isinstance(e, relax.Call) and isinstance(e.op, tvm.ir.Op) else None)
    (forward,), (backward,) = calls["relax.fuel.flash_attn"], calls["relax.fuel.flash_attn_backward"]
    assert bool(forward.attrs["return_lse"])
    assert bool(backward.attrs["has_out"]) and bool(backward.attrs["has_lse"]) and bool(backward.attrs["causal"])
    assert "relax.nn.softmax" not in calls and "relax.fuel.softmax_backward" not in calls


def _torch_curve(imported) -> tuple[list[float], list[np.ndarray]]:
    """PyTorch's SGD from the same weights: the loss before each step, and the first step's gradients."""
    model = copy.deepcopy(imported["model"])
    named = dict(model.named_parameters())
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    losses, first = [], None
    for _ in range(STEPS):
        optimizer.zero_grad()
        loss = model(imported["x"], imported["y"])
        loss.backward()
        losses.append(loss.item())
        if first is None:
            first = [named[name].grad.numpy().copy() for name in imported["torch_names"]]
        optimizer.step()
    return losses, first


@pytest.mark.parametrize("kernels", ["decomposed", "tuned"])
def test_training_follows_torch(imported, kernels):
    # the adjoint alone: a training loop calls nothing else (main's flash_attn, without lse, is another kernel)
    adjoint = tvm.IRModule({"main_adjoint": imported["adjoint"]["main_adjoint"]})
    ex = tvm_fuel.compile(adjoint, tvm_fuel.host_target(), kernels=kernels)
    other = "tuned" if kernels == "decomposed" else "decomposed"
    for name in ATTENTION[kernels]:  # the path asked for built the attention, not the other one
        assert ex.mod.implements_function(name, True), name
    for name in ATTENTION[other]:
        assert not ex.mod.implements_function(name, True), name
    vm = relax.VirtualMachine(ex, tvm.cpu())
    data = [tvm.runtime.tensor(t.numpy()) for t in (imported["x"], imported["y"])]
    weights = [w.copy() for w in imported["initial"]]
    losses, first = [], None
    for _ in range(STEPS):
        loss, grads = vm["main_adjoint"](*data, *[tvm.runtime.tensor(w) for w in weights])
        grads = [g.numpy() for g in grads]
        losses.append(float(loss.numpy()))
        first = grads if first is None else first
        weights = [w - np.float32(LR) * g for w, g in zip(weights, grads, strict=True)]

    torch_losses, torch_first = _torch_curve(imported)
    scale = max(float(np.abs(g).max()) for g in torch_first)
    for name, ours, theirs in zip(imported["torch_names"], first, torch_first, strict=True):
        # k's bias has no effect on a softmax over keys: both gradients are rounding noise around 0
        np.testing.assert_allclose(ours, theirs, rtol=1e-4, atol=1e-5 * scale, err_msg=name)
    np.testing.assert_allclose(losses, torch_losses, rtol=1e-4)
    assert losses[-1] < 0.9 * losses[0] and all(b < a for a, b in zip(losses, losses[1:])), losses
