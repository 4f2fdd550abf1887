"""tvm_fuel.transform.FuseAttention: R.nn.attention -> flash_attn where the semantics match exactly
(outputs equal before and after), left untouched where they do not."""

from __future__ import annotations

import numpy as np
import pytest
import tvm
from helpers import HOST
from tvm import relax

import tvm_fuel
from tvm_fuel.transform import FuseAttention


def _ops(mod: tvm.IRModule) -> set[str]:
    """The ops ``main`` calls, R.nn.attention_bias counted as R.nn.attention."""
    found = set()
    relax.analysis.post_order_visit(mod["main"], lambda e: found.add(e.op.name.replace("attention_bias", "attention"))
                                    if isinstance(e, relax.Call) and isinstance(e.op, tvm.ir.Op) else None)
    return found


def _run(mod: tvm.IRModule, arrays) -> np.ndarray:
    vm = relax.VirtualMachine(tvm_fuel.compile(mod, HOST, kernels="tuned"), tvm.cpu())
    return vm["main"](*map(tvm.runtime.tensor, arrays)).numpy()


def _attention_module(sq: int, sk: int, *, bias: bool = False, **attrs) -> tuple[tvm.IRModule, list[np.ndarray]]:
    rng = np.random.default_rng(0)
    shapes = [(2, sq, 4, 16), (2, sk, 4, 16), (2, sk, 4, 16)] + ([(2, 4, sq, sk)] if bias else [])
    arrays = [rng.standard_normal(s).astype("float32") for s in shapes]
    bb = relax.BlockBuilder()
    params = [relax.Var(n, relax.TensorType(s, "float32")) for n, s in zip("qkvb", shapes)]
    with bb.function("main", params):
        with bb.dataflow():
            out = bb.emit_output(relax.op.nn.attention(*params[:3], params[3] if bias else None, **attrs))
        bb.emit_func_output(out)
    return bb.get(), arrays


@pytest.mark.parametrize("sq,sk,attrs", [
    (17, 17, dict(causal_mask="TopLeft")),
    (17, 23, dict(causal_mask="BottomRight", scale=0.3)),
    (23, 17, dict(causal_mask="TopLeft")),  # more queries than keys: a right-bounded window
    (5, 9, dict()),
])
@pytest.mark.parametrize("bias", [False, True])
def test_rewrites_and_keeps_the_outputs(sq, sk, attrs, bias):
    mod, arrays = _attention_module(sq, sk, bias=bias, **attrs)
    fused = FuseAttention()(mod)
    assert "relax.nn.attention" not in _ops(fused) and "relax.fuel.flash_attn" in _ops(fused)
    np.testing.assert_allclose(_run(fused, arrays), _run(mod, arrays), atol=2e-5, rtol=2e-5)


@pytest.mark.parametrize("sq,sk,attrs", [
    (9, 17, dict(causal_mask="TopLeft")),  # j <= i with more keys than queries: no fuel window says it
    (17, 17, dict(causal_mask="TopLeft", window_size=4)),  # TVM's own sliding-window convention
])
def test_leaves_what_it_cannot_express(sq, sk, attrs):
    mod, _ = _attention_module(sq, sk, **attrs)
    fused = FuseAttention()(mod)
    assert "relax.nn.attention" in _ops(fused) and "relax.fuel.flash_attn" not in _ops(fused)


@pytest.mark.parametrize("causal", [False, True])
def test_a_torch_sdpa_block_imported_through_fx(causal):
    torch = pytest.importorskip("torch")
    from tvm.relax.frontend.torch import from_fx

    class Block(torch.nn.Module):
        def forward(self, q, k, v):
            return torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=causal)

    rng = np.random.default_rng(1)
    arrays = [rng.standard_normal((2, 4, 13, 16)).astype("float32") for _ in range(3)]
    mod = from_fx(torch.fx.symbolic_trace(Block()), [((2, 4, 13, 16), "float32")] * 3)
    fused = FuseAttention()(mod)
    assert "relax.nn.attention" not in _ops(fused) and "relax.fuel.flash_attn" in _ops(fused)
    want = Block()(*map(torch.from_numpy, arrays)).numpy()
    np.testing.assert_allclose(_run(fused, arrays), want, atol=2e-5, rtol=2e-5)
    np.testing.assert_allclose(_run(mod, arrays), want, atol=2e-5, rtol=2e-5)


def _exported(block, arrays):
    torch = pytest.importorskip("torch")
    from torch.export import export
    from tvm.relax.frontend.torch import from_exported_program

    return from_exported_program(export(block, tuple(map(torch.from_numpy, arrays))))


def _blocks():
    torch = pytest.importorskip("torch")

    class Sdpa(torch.nn.Module):
        def __init__(self, causal=False):
            super().__init__()
            self.causal = causal

        def forward(self, q, k, v):
            return torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=self.causal)

    class ByHand(torch.nn.Module):
        def forward(self, q, k, v):
            return torch.softmax(q @ k.transpose(-2, -1) / 4.0, dim=-1) @ v

    class ByHandMasked(torch.nn.Module):
        def forward(self, q, k, v):
            scores = q @ k.transpose(-2, -1) * 0.25
            return torch.softmax(scores + torch.ones_like(scores).triu(1) * -1e4, dim=-1) @ v

    return torch, Sdpa, ByHand, ByHandMasked


@pytest.mark.parametrize("which", ["sdpa", "by_hand"])
def test_exported_programs_are_fused(which):
    torch, Sdpa, ByHand, _ = _blocks()
    block = Sdpa() if which == "sdpa" else ByHand()
    rng = np.random.default_rng(2)
    arrays = [rng.standard_normal(s).astype("float32") for s in ((2, 4, 13, 16), (2, 4, 9, 16), (2, 4, 9, 16))]
    mod = _exported(block, arrays)
    fused = FuseAttention()(mod)
    assert "relax.fuel.flash_attn" in _ops(fused) and "relax.nn.softmax" not in _ops(fused)
    want = block(*map(torch.from_numpy, arrays)).numpy()
    run = lambda m: relax.VirtualMachine(tvm_fuel.compile(m, HOST, kernels="tuned"), tvm.cpu())["main"](  # noqa: E731
        *map(tvm.runtime.tensor, arrays))[0].numpy()
    np.testing.assert_allclose(run(fused), want, atol=2e-5, rtol=2e-5)
    np.testing.assert_allclose(run(mod), want, atol=2e-5, rtol=2e-5)


@pytest.mark.parametrize("which", ["causal_sdpa", "masked_by_hand"])
def test_masked_exported_programs_are_left_untouched(which):
    torch, Sdpa, _, ByHandMasked = _blocks()
    block = Sdpa(causal=True) if which == "causal_sdpa" else ByHandMasked()
    arrays = [np.ones((2, 4, 9, 16), "float32")] * 3
    fused = FuseAttention()(_exported(block, arrays))
    assert "relax.fuel.flash_attn" not in _ops(fused) and "relax.nn.softmax" in _ops(fused)
