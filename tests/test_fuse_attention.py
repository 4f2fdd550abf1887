"""tvm_fuel.transform.FuseAttention: R.nn.attention and the unfused (masked, GQA) attention of exported
programs -> flash_attn where the semantics match exactly (outputs equal before and after, and torch's),
left untouched where they do not."""

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


def _case(name: str):
    """(torch block, its inputs) for an exported-program case: q [2, 4, Sq, D], k and v [2, Hkv, Sk, D],
    then a mask where the block takes one."""
    torch = pytest.importorskip("torch")
    sdpa = torch.nn.functional.scaled_dot_product_attention
    rng = np.random.default_rng(sum(map(ord, name)))

    def scores(q, k):
        return q @ k.transpose(-2, -1) * 0.25

    def keep(*shape):  # a bool mask that keeps key 0 of every row: no row is left empty
        mask = rng.random(shape) > 0.4
        mask[..., 0] = True
        return mask

    cases = {  # name: (forward, (Sq, Sk, D, Hkv), extra inputs)
        "sdpa": (lambda q, k, v: sdpa(q, k, v), (13, 9, 16, 4), []),
        "by_hand": (lambda q, k, v: torch.softmax(q @ k.transpose(-2, -1) / 4.0, dim=-1) @ v, (13, 9, 16, 4), []),
        "causal_sdpa": (lambda q, k, v: sdpa(q, k, v, is_causal=True), (17, 17, 16, 4), []),
        # torch's is_causal is top-left: j <= i, a window (-1, Sq - Sk) for fuel when Sq > Sk ...
        "causal_sdpa_more_queries": (lambda q, k, v: sdpa(q, k, v, is_causal=True), (13, 9, 40, 4), []),
        # ... and no window at all when Sk > Sq: the mask goes as a tensor
        "causal_sdpa_more_keys": (lambda q, k, v: sdpa(q, k, v, is_causal=True), (9, 13, 16, 4), []),
        "gqa_causal_sdpa": (lambda q, k, v: sdpa(q, k, v, is_causal=True, enable_gqa=True), (17, 17, 16, 2), []),
        # row 3 keeps no key: SDPA's guard and fuel both output 0 there
        "sdpa_bool_mask": (lambda q, k, v, m: sdpa(q, k, v, attn_mask=m), (13, 9, 40, 4),
                           [np.where(np.arange(13)[:, None] == 3, False, rng.random((13, 9)) > 0.4)]),
        "sdpa_float_mask": (lambda q, k, v, m: sdpa(q, k, v, attn_mask=m), (13, 9, 16, 4),
                            [rng.standard_normal((2, 1, 13, 9)).astype("float32")]),
        "masked_by_hand": (lambda q, k, v: torch.softmax(
            scores(q, k) + torch.ones_like(scores(q, k)).triu(1) * -1e4, dim=-1) @ v, (13, 9, 16, 4), []),
        "masked_fill_by_hand": (lambda q, k, v, m: torch.softmax(
            scores(q, k).masked_fill(~m, float("-inf")), dim=-1) @ v, (13, 9, 16, 4), [keep(2, 1, 13, 9)]),
        "tril_by_hand": (lambda q, k, v: torch.softmax(scores(q, k).masked_fill(
            ~torch.ones(17, 17, dtype=torch.bool).tril(), float("-inf")), dim=-1) @ v, (17, 17, 16, 4), []),
        # batched matmuls over [B * H] written out, the bias first and per (batch, head)
        "merged_bias_first": (lambda q, k, v, b: torch.bmm(torch.softmax(
            b + torch.bmm(q.reshape(8, 13, 16), k.reshape(8, 9, 16).transpose(1, 2)) * 0.25, dim=-1),
            v.reshape(8, 9, 16)).reshape(2, 4, 13, 16), (13, 9, 16, 4),
            [rng.standard_normal((8, 13, 9)).astype("float32")]),
        # left untouched
        "softmax_over_queries": (lambda q, k, v: torch.softmax(scores(q, k), dim=-2) @ v, (13, 9, 16, 4), []),
        # a where() on the probabilities that is not SDPA's empty-row guard
        "mask_after_softmax": (lambda q, k, v, m: (lambda p: torch.where(~m, torch.zeros_like(p), p))(
            torch.softmax(scores(q, k), dim=-1)) @ v, (13, 9, 16, 4), [keep(13, 9)]),
        # an empty row would be uniform, not 0
        "finite_fill": (lambda q, k, v, m: torch.softmax(
            scores(q, k).masked_fill(~m, -1e9), dim=-1) @ v, (13, 9, 16, 4), [keep(13, 9)]),
        "bias_before_scale": (lambda q, k, v, b: torch.softmax(
            (q @ k.transpose(-2, -1) + b) * 0.25, dim=-1) @ v, (13, 9, 16, 4),
            [rng.standard_normal((13, 9)).astype("float32")]),
        # a bias added on a [B, H * Sq, Sk] view of the scores
        "bias_on_another_view": (lambda q, k, v, b: torch.softmax(
            (scores(q, k).reshape(2, 52, 9) + b).reshape(2, 4, 13, 9), dim=-1) @ v, (13, 9, 16, 4),
            [rng.standard_normal((52, 9)).astype("float32")]),
        # softmax ignores it, and fuel's kernels take no 0-d mask
        "scalar_bias": (lambda q, k, v: torch.softmax(scores(q, k) + 1.5, dim=-1) @ v, (13, 9, 16, 4), []),
    }
    forward, (sq, sk, d, hkv), extra = cases[name]

    class Block(torch.nn.Module):
        def forward(self, *args):
            return forward(*args)

    shapes = ((2, 4, sq, d), (2, hkv, sk, d), (2, hkv, sk, d))
    return Block(), [rng.standard_normal(s).astype("float32") for s in shapes] + extra


def _flash_attn_options(mod: tvm.IRModule) -> tuple:
    """(causal, window_size, has attn_mask) of the one flash_attn ``main`` calls."""
    calls = []
    relax.analysis.post_order_visit(mod["main"], lambda e: calls.append(e) if isinstance(e, relax.Call) and isinstance(
        e.op, tvm.ir.Op) and e.op.name == "relax.fuel.flash_attn" else None)
    (call,) = calls
    return bool(call.attrs["causal"]), tuple(int(x) for x in call.attrs["window_size"]), bool(
        call.attrs["has_attn_mask"])


@pytest.mark.parametrize("name,options", [
    ("sdpa", (False, (-1, -1), False)),
    ("by_hand", (False, (-1, -1), False)),
    ("causal_sdpa", (True, (-1, -1), False)),
    ("causal_sdpa_more_queries", (False, (-1, 4), False)),
    ("causal_sdpa_more_keys", (False, (-1, -1), True)),
    ("gqa_causal_sdpa", (True, (-1, -1), False)),
    ("sdpa_bool_mask", (False, (-1, -1), True)),
    ("sdpa_float_mask", (False, (-1, -1), True)),
    ("masked_by_hand", (False, (-1, -1), True)),
    ("masked_fill_by_hand", (False, (-1, -1), True)),
    ("tril_by_hand", (True, (-1, -1), False)),
    ("merged_bias_first", (False, (-1, -1), True)),
])
def test_exported_programs_are_fused(name, options):
    torch = pytest.importorskip("torch")
    block, arrays = _case(name)
    mod = _exported(block, arrays)
    fused = FuseAttention()(mod)
    # nothing of the unfused graph is left (a mask built from ones_like(scores) no longer needs them)
    assert "relax.fuel.flash_attn" in _ops(fused) and not {"relax.nn.softmax", "relax.matmul"} & _ops(fused)
    assert _flash_attn_options(fused) == options
    want = block(*map(torch.from_numpy, arrays)).numpy()
    run = lambda m: relax.VirtualMachine(tvm_fuel.compile(m, HOST, kernels="tuned"), tvm.cpu())["main"](  # noqa: E731
        *map(tvm.runtime.tensor, arrays))[0].numpy()
    np.testing.assert_allclose(run(fused), want, atol=2e-5, rtol=2e-5)
    np.testing.assert_allclose(run(mod), want, atol=2e-5, rtol=2e-5)


@pytest.mark.parametrize("name", ["softmax_over_queries", "mask_after_softmax", "finite_fill", "bias_before_scale",
                                  "bias_on_another_view", "scalar_bias"])
def test_inexpressible_exported_programs_are_left_untouched(name):
    fused = FuseAttention()(_exported(*_case(name)))
    assert "relax.fuel.flash_attn" not in _ops(fused) and "relax.nn.softmax" in _ops(fused)


def _merged_block(dropout: bool) -> tvm.IRModule:
    """softmax(Q K^T / 4) V over merged [B * H] dims, built in Relax: PyTorch's importer drops
    dropout, so a training-mode R.nn.dropout only comes from Relax itself."""
    bb = relax.BlockBuilder()
    q, k, v = (relax.Var(n, relax.TensorType((2, 4, 9, 16), "float32")) for n in "qkv")
    with bb.function("main", [q, k, v]):
        with bb.dataflow():
            def merged(x, *tail):
                return bb.emit(relax.op.reshape(x, [8, *tail]))

            k_t = bb.emit(relax.op.permute_dims(k, [0, 1, 3, 2]))
            s = bb.emit(relax.op.matmul(merged(q, 9, 16), merged(k_t, 16, 9)))
            p = bb.emit(relax.op.nn.softmax(bb.emit(relax.op.multiply(s, relax.const(0.25, "float32")))))
            if dropout:
                p = bb.emit(relax.TupleGetItem(bb.emit(relax.op.nn.dropout(p, 0.1)), 0))
            out = bb.emit(relax.op.matmul(p, merged(v, 9, 16)))
            out = bb.emit_output(relax.op.reshape(out, [2, 4, 9, 16]))
        bb.emit_func_output(out)
    return bb.get()


@pytest.mark.parametrize("dropout", [False, True])
def test_dropout_is_left_untouched(dropout):
    fused = FuseAttention()(_merged_block(dropout))
    assert ("relax.fuel.flash_attn" in _ops(fused)) != dropout and ("relax.nn.softmax" in _ops(fused)) == dropout
