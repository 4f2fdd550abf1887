"""tvm_fuel.transform.FuseAttention: R.nn.attention and the unfused (masked, GQA) attention of exported
programs -> flash_attn where the semantics match exactly (outputs equal before and after, and the numpy
reference's), left untouched where they do not.

The exported programs are fixtures (tests/transform/fixtures/fuse_attention/<case>.tvmscript): what TVM's
``from_exported_program`` makes of each case's PyTorch block, saved as TVMScript, so these tests need no
PyTorch. Where PyTorch is installed, ``test_the_fixtures_are_what_the_importer_makes`` exports the blocks
again and checks the fixtures against them (``regenerate.py`` in that folder rewrites them).
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Callable, NamedTuple

import numpy as np
import pytest
import tvm
import tvm_ffi
from helpers import flatten, HOST
from tvm import relax

import tvm_fuel
from tvm_fuel import reference
from tvm_fuel.transform.fuse_attention import FuseAttention

pytestmark = pytest.mark.integration

FIXTURES = Path(__file__).resolve().parent / "fixtures" / "fuse_attention"


def _ops(mod: tvm.IRModule) -> set[str]:
    """The ops ``main`` calls, R.nn.attention_bias counted as R.nn.attention."""
    found = set()
    relax.analysis.post_order_visit(mod["main"], lambda e: found.add(e.op.name.replace("attention_bias", "attention"))
                                    if isinstance(e, relax.Call) and isinstance(e.op, tvm.ir.Op) else None)
    return found


def _run(mod: tvm.IRModule, arrays) -> np.ndarray:
    """``main``'s (first) output."""
    vm = relax.VirtualMachine(tvm_fuel.compile(mod, HOST, kernels="tuned"), tvm.cpu())
    return flatten(vm["main"](*map(tvm.runtime.tensor, arrays)))[0]


def _flash_attn_call(mod: tvm.IRModule) -> relax.Call:
    """The one flash_attn ``main`` calls."""
    calls = []
    relax.analysis.post_order_visit(mod["main"], lambda e: calls.append(e) if isinstance(e, relax.Call) and isinstance(
        e.op, tvm.ir.Op) and e.op.name == "relax.fuel.flash_attn" else None)
    (call,) = calls
    return call


def _flash_attn_options(mod: tvm.IRModule) -> tuple:
    """(causal, window_size, has attn_mask) of the one flash_attn ``main`` calls."""
    call = _flash_attn_call(mod)
    return bool(call.attrs["causal"]), tuple(int(x) for x in call.attrs["window_size"]), bool(
        call.attrs["has_attn_mask"])


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
    (23, 17, dict(causal_mask="BottomRight")),  # TVM's diagonal is |Sq - Sk|: above the main one
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


def test_bottom_right_with_lengths_of_unknown_order_is_left_untouched():
    """TVM's BottomRight keeps j <= i + |Sq - Sk|: fuel's causal only where Sq <= Sk is provable."""
    n, m = tvm.tirx.Var("n", "int64"), tvm.tirx.Var("m", "int64")
    q = relax.Var("q", relax.TensorType((1, n, 2, 8), "float32"))
    fused = []
    for k_len in (m, n):  # unknown order, then Sq == Sk
        k, v = (relax.Var(name, relax.TensorType((1, k_len, 2, 8), "float32")) for name in "kv")
        bb = relax.BlockBuilder()
        with bb.function("main", [q, k, v]):
            with bb.dataflow():
                out = bb.emit_output(relax.op.nn.attention(q, k, v, causal_mask="BottomRight"))
            bb.emit_func_output(out)
        fused.append("relax.fuel.flash_attn" in _ops(FuseAttention()(bb.get())))
    assert fused == [False, True]


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


# ---- exported programs ------------------------------------------------------------------------------------------


def _keep(*shape) -> Callable[[np.random.Generator], np.ndarray]:
    """A bool mask that keeps key 0 of every row: no row is left empty."""
    def make(rng):
        mask = rng.random(shape) > 0.4
        mask[..., 0] = True
        return mask
    return make


def _randn(*shape) -> Callable[[np.random.Generator], np.ndarray]:
    return lambda rng: rng.standard_normal(shape).astype("float32")


def _top_left(sq: int, sk: int) -> np.ndarray:
    """torch's is_causal: query i sees the keys j <= i."""
    return np.tri(sq, sk, 0, dtype=bool)


class Case(NamedTuple):
    dims: tuple  # (B, Hq, Hkv, Sq, Sk, D): q [B, Hq, Sq, D], k and v [B, Hkv, Sk, D]
    extra: tuple = ()  # the further inputs' makers, each given the case's generator
    reference: Callable[..., dict] | None = None  # reference.flash_attn's options (given the further inputs)
    options: tuple | None = None  # (causal, window_size, has attn_mask) of the fused flash_attn
    # reference None and options None: left untouched


_PLAIN = (False, (-1, -1), False)
_CAUSAL = (True, (-1, -1), False)
_MASKED = (False, (-1, -1), True)
_QUARTER = dict(softmax_scale=0.25)
_KEYS_KEPT = np.arange(9)  # compared with each batch row's count of kept keys
_SLOPES = np.float32(0.5) ** np.arange(1, 5, dtype=np.float32)  # ALiBi's slopes for 4 heads
CASES = {
    "sdpa": Case((2, 4, 4, 13, 9, 16), (), lambda: {}, _PLAIN),
    "by_hand": Case((2, 4, 4, 13, 9, 16), (), lambda: _QUARTER, _PLAIN),
    "causal_sdpa": Case((2, 4, 4, 17, 17, 16), (), lambda: dict(causal=True), _CAUSAL),
    # 97 x 97: the exporter's full(True) is past what FoldConstant folds; the mask is read, not evaluated
    "causal_sdpa_long": Case((1, 2, 2, 97, 97, 16), (), lambda: dict(causal=True), _CAUSAL),
    # torch's is_causal is top-left: j <= i, a window (-1, Sq - Sk) for fuel when Sq > Sk ...
    "causal_sdpa_more_queries": Case((2, 4, 4, 13, 9, 40), (), lambda: dict(attn_mask=_top_left(13, 9)),
                                     (False, (-1, 4), False)),
    # ... and no window at all when Sk > Sq: the mask goes as a tensor
    "causal_sdpa_more_keys": Case((2, 4, 4, 9, 13, 16), (), lambda: dict(attn_mask=_top_left(9, 13)), _MASKED),
    # one query and one key: the causal mask keeps everything, and the mask reader says so
    "causal_sdpa_one_query_one_key": Case((2, 4, 4, 1, 1, 16), (), lambda: dict(causal=True), _PLAIN),
    "gqa_causal_sdpa": Case((2, 4, 2, 17, 17, 16), (), lambda: dict(causal=True), _CAUSAL),
    "gqa3_causal_sdpa_one_query": Case((1, 6, 2, 1, 17, 16), (), lambda: dict(attn_mask=_top_left(1, 17)), _MASKED),
    "gqa3_repeat_interleave_by_hand": Case((1, 6, 2, 1, 17, 16), (), lambda: _QUARTER, _PLAIN),
    # row 3 keeps no key: SDPA's guard and fuel both output 0 there
    "sdpa_bool_mask": Case((2, 4, 4, 13, 9, 40), (lambda rng: np.where(np.arange(13)[:, None] == 3, False,
                                                                       rng.random((13, 9)) > 0.4),),
                           lambda m: dict(attn_mask=m), _MASKED),
    "sdpa_float_mask": Case((2, 4, 4, 13, 9, 16), (_randn(2, 1, 13, 9),), lambda m: dict(attn_mask=m), _MASKED),
    "masked_by_hand": Case((2, 4, 4, 13, 9, 16), (), lambda: dict(
        _QUARTER, attn_mask=np.triu(np.ones((13, 9), "float32"), 1) * np.float32(-1e4)), _MASKED),
    "masked_fill_by_hand": Case((2, 4, 4, 13, 9, 16), (_keep(2, 1, 13, 9),), lambda m: dict(_QUARTER, attn_mask=m),
                                _MASKED),
    "tril_by_hand": Case((2, 4, 4, 17, 17, 16), (), lambda: dict(_QUARTER, causal=True), _CAUSAL),
    # ALiBi written out as slope_h * j (Bloom), added before a causal finfo.min mask; and with the scale
    # applied after it (Falcon), which scales the slopes too; without a causal mask it is no fuel ALiBi,
    # only an additive attn_mask
    "alibi_by_hand": Case((1, 4, 4, 13, 13, 16), (), lambda: dict(_QUARTER, causal=True, alibi_slopes=_SLOPES),
                          _CAUSAL),
    "alibi_scaled_after": Case((1, 4, 4, 13, 13, 16), (), lambda: dict(
        _QUARTER, causal=True, alibi_slopes=_SLOPES * np.float32(0.25)), _CAUSAL),
    "alibi_without_causal": Case((1, 4, 4, 13, 13, 16), (), lambda: dict(
        _QUARTER, attn_mask=_SLOPES[:, None, None] * np.arange(13, dtype=np.float32)), _MASKED),
    # Falcon's eager ALiBi: scaled after it, and added again inside the finfo.min mask (where(mask < -1,
    # finfo.min, alibi / 4)): twice the slopes; and over positions that are an input, a float bias over the keys
    "alibi_in_the_mask": Case((1, 4, 4, 13, 13, 16), (), lambda: dict(
        _QUARTER, causal=True, alibi_slopes=_SLOPES * np.float32(0.5)), _CAUSAL),
    "alibi_over_positions": Case((2, 4, 4, 13, 13, 16), (lambda rng: rng.integers(0, 20, (2, 13)).astype("float32"),),
                                 lambda p: dict(_QUARTER, causal=True,
                                                attn_mask=_SLOPES[:, None, None] * p[:, None, None, :]),
                                 (True, (-1, -1), True)),
    # multi-query: k and v of one head, broadcast to the query heads by the matmuls (after k's transpose)
    "mqa_by_hand": Case((2, 4, 1, 13, 13, 16), (), lambda: dict(_QUARTER, causal=True), _CAUSAL),
    # Gemma2's softcap 30 * tanh(scores / 30): the chain's scale holds the 1 / 30
    "softcapped_by_hand": Case((2, 4, 2, 13, 13, 16), (), lambda: dict(_QUARTER, causal=True, softcap=30.0), _CAUSAL),
    # batched matmuls over [B * H] written out, the bias first and per (batch, head)
    "merged_bias_first": Case((2, 4, 4, 13, 9, 16), (_randn(8, 13, 9),),
                              lambda b: dict(_QUARTER, attn_mask=b.reshape(2, 4, 13, 9)), _MASKED),
    # gpt-oss's sinks: a column of one logit per head concatenated to the scores, the row max subtracted (or
    # not), dropped after the softmax; a batch row that keeps no key under the finfo.min fill is all sink: 0
    "sinks_by_hand": Case((2, 4, 2, 13, 13, 16), (_randn(4),), lambda s: dict(_QUARTER, causal=True, sinks=s),
                          _CAUSAL),
    "sinks_unshifted_padded": Case((2, 4, 4, 13, 9, 16), (_randn(4), lambda rng: _KEYS_KEPT < np.array([6, 0])[
        :, None, None, None]), lambda s, m: dict(_QUARTER, sinks=s, attn_mask=m), _MASKED),
    # left untouched
    "sinks_per_query": Case((2, 4, 4, 13, 13, 16), (_randn(13),)),  # a column that is no one logit per head
    "sinks_first_column_dropped": Case((2, 4, 4, 13, 13, 16), (_randn(4),)),  # a score column dropped, the sink kept
    "softmax_over_queries": Case((2, 4, 4, 13, 9, 16)),
    "mask_after_softmax": Case((2, 4, 4, 13, 9, 16), (_keep(13, 9),)),  # a where() that is not SDPA's guard
    "finite_fill": Case((2, 4, 4, 13, 9, 16), (_keep(13, 9),)),  # an empty row would be uniform, not 0
    "bias_before_scale": Case((2, 4, 4, 13, 9, 16), (_randn(13, 9),)),
    "bias_on_another_view": Case((2, 4, 4, 13, 9, 16), (_randn(52, 9),)),  # on a [B, H * Sq, Sk] view
    "scalar_bias": Case((2, 4, 4, 13, 9, 16)),  # softmax ignores it, and fuel's kernels take no 0-d mask
}
FUSED = [name for name, case in CASES.items() if case.options is not None]
UNTOUCHED = [name for name, case in CASES.items() if case.options is None]


def forward(name: str, torch) -> Callable:
    """The PyTorch block of case ``name`` (its forward)."""
    sdpa = torch.nn.functional.scaled_dot_product_attention

    def scores(q, k):
        return q @ k.transpose(-2, -1) * 0.25

    def repeated(x):
        return x.repeat_interleave(3, dim=1)

    def repeated2(x):
        return x.repeat_interleave(2, dim=1)

    def slopes():
        return torch.full((), 0.5) ** torch.arange(1, 5, dtype=torch.float32)  # computed: no tensor constant

    def alibi(n):  # [H, 1, Sk]: slope_h * key position, as Bloom builds it
        return slopes()[:, None, None] * torch.arange(n, dtype=torch.float32)

    def finfo_causal(n):
        return torch.where(torch.ones(n, n, dtype=torch.bool).tril(), 0.0, torch.finfo(torch.float32).min)

    def with_sinks(logits, column, v, shift=True, keep=slice(None, -1)):  # transformers' gpt-oss eager attention
        combined = torch.cat([logits, column.expand(logits.shape[0], logits.shape[1], logits.shape[2], 1)], dim=-1)
        if shift:
            combined = combined - combined.max(dim=-1, keepdim=True).values
        return torch.softmax(combined, dim=-1)[..., keep] @ v

    return {
        "sdpa": lambda q, k, v: sdpa(q, k, v),
        "by_hand": lambda q, k, v: torch.softmax(q @ k.transpose(-2, -1) / 4.0, dim=-1) @ v,
        "causal_sdpa": lambda q, k, v: sdpa(q, k, v, is_causal=True),
        "causal_sdpa_long": lambda q, k, v: sdpa(q, k, v, is_causal=True),
        "causal_sdpa_more_queries": lambda q, k, v: sdpa(q, k, v, is_causal=True),
        "causal_sdpa_more_keys": lambda q, k, v: sdpa(q, k, v, is_causal=True),
        "causal_sdpa_one_query_one_key": lambda q, k, v: sdpa(q, k, v, is_causal=True),
        "gqa_causal_sdpa": lambda q, k, v: sdpa(q, k, v, is_causal=True, enable_gqa=True),
        "gqa3_causal_sdpa_one_query": lambda q, k, v: sdpa(q, k, v, is_causal=True, enable_gqa=True),
        "gqa3_repeat_interleave_by_hand": lambda q, k, v: torch.softmax(scores(q, repeated(k)), dim=-1) @ repeated(v),
        "sdpa_bool_mask": lambda q, k, v, m: sdpa(q, k, v, attn_mask=m),
        "sdpa_float_mask": lambda q, k, v, m: sdpa(q, k, v, attn_mask=m),
        "masked_by_hand": lambda q, k, v: torch.softmax(
            scores(q, k) + torch.ones_like(scores(q, k)).triu(1) * -1e4, dim=-1) @ v,
        "masked_fill_by_hand": lambda q, k, v, m: torch.softmax(
            scores(q, k).masked_fill(~m, float("-inf")), dim=-1) @ v,
        "tril_by_hand": lambda q, k, v: torch.softmax(scores(q, k).masked_fill(
            ~torch.ones(17, 17, dtype=torch.bool).tril(), float("-inf")), dim=-1) @ v,
        "alibi_by_hand": lambda q, k, v: torch.softmax(scores(q, k) + alibi(13) + finfo_causal(13), dim=-1) @ v,
        "alibi_scaled_after": lambda q, k, v: torch.softmax(
            (q @ k.transpose(-2, -1) + alibi(13)) * 0.25 + finfo_causal(13), dim=-1) @ v,
        "alibi_without_causal": lambda q, k, v: torch.softmax(scores(q, k) + alibi(13), dim=-1) @ v,
        "alibi_in_the_mask": lambda q, k, v: torch.softmax((q @ k.transpose(-2, -1) + alibi(13)) * 0.25 + torch.where(
            finfo_causal(13) < -1.0, torch.finfo(torch.float32).min, alibi(13)[None] / 4.0), dim=-1) @ v,
        "alibi_over_positions": lambda q, k, v, p: torch.softmax(
            scores(q, k) + slopes()[:, None, None] * p[:, None, None, :] + finfo_causal(13), dim=-1) @ v,
        "mqa_by_hand": lambda q, k, v: torch.softmax(scores(q, k) + finfo_causal(13), dim=-1) @ v,
        "softcapped_by_hand": lambda q, k, v: torch.softmax(  # Gemma2's eager attention: a finfo.min bias
            torch.tanh(scores(q, repeated2(k)) / 30.0) * 30.0 + torch.where(
                torch.ones(13, 13, dtype=torch.bool).tril(), 0.0, torch.finfo(torch.float32).min), dim=-1)
        @ repeated2(v),
        "merged_bias_first": lambda q, k, v, b: torch.bmm(torch.softmax(
            b + torch.bmm(q.reshape(8, 13, 16), k.reshape(8, 9, 16).transpose(1, 2)) * 0.25, dim=-1),
            v.reshape(8, 9, 16)).reshape(2, 4, 13, 16),
        "sinks_by_hand": lambda q, k, v, s: with_sinks(scores(q, repeated2(k)) + finfo_causal(13),
                                                       s.reshape(1, -1, 1, 1), repeated2(v)),
        "sinks_unshifted_padded": lambda q, k, v, s, m: with_sinks(
            scores(q, k) + torch.where(m, 0.0, torch.finfo(torch.float32).min), s.reshape(1, -1, 1, 1), v, shift=False),
        "sinks_per_query": lambda q, k, v, s: with_sinks(scores(q, k), s.reshape(1, 1, -1, 1), v),
        "sinks_first_column_dropped": lambda q, k, v, s: with_sinks(scores(q, k), s.reshape(1, -1, 1, 1), v,
                                                                    keep=slice(1, None)),
        "softmax_over_queries": lambda q, k, v: torch.softmax(scores(q, k), dim=-2) @ v,
        "mask_after_softmax": lambda q, k, v, m: (lambda p: torch.where(~m, torch.zeros_like(p), p))(
            torch.softmax(scores(q, k), dim=-1)) @ v,
        "finite_fill": lambda q, k, v, m: torch.softmax(scores(q, k).masked_fill(~m, -1e9), dim=-1) @ v,
        "bias_before_scale": lambda q, k, v, b: torch.softmax((q @ k.transpose(-2, -1) + b) * 0.25, dim=-1) @ v,
        "bias_on_another_view": lambda q, k, v, b: torch.softmax(
            (scores(q, k).reshape(2, 52, 9) + b).reshape(2, 4, 13, 9), dim=-1) @ v,
        "scalar_bias": lambda q, k, v: torch.softmax(scores(q, k) + 1.5, dim=-1) @ v,
    }[name]


def inputs(name: str) -> list[np.ndarray]:
    """q, k, v, then the further inputs of case ``name``."""
    rng = np.random.default_rng(sum(map(ord, name)))
    b, hq, hkv, sq, sk, d = CASES[name].dims
    shapes = ((b, hq, sq, d), (b, hkv, sk, d), (b, hkv, sk, d))
    return [rng.standard_normal(s).astype("float32") for s in shapes] + [make(rng) for make in CASES[name].extra]


def exported(name: str) -> tvm.IRModule:
    """What ``from_exported_program`` makes of case ``name``'s block (needs PyTorch)."""
    import torch
    from torch.export import export
    from tvm.relax.frontend.torch import from_exported_program

    class Block(torch.nn.Module):
        def forward(self, *args):
            return forward(name, torch)(*args)

    return from_exported_program(export(Block(), tuple(map(torch.from_numpy, inputs(name)))))


def fixture_path(name: str) -> Path:
    return FIXTURES / f"{name}.tvmscript"


def fixture(name: str) -> tvm.IRModule:
    return tvm.script.from_source(fixture_path(name).read_text())


def fixture_text(mod: tvm.IRModule) -> str:
    """``mod`` as TVMScript that parses back: the printer spells a -inf constant ``R.const("-inf", ...)``,
    which the parser refuses; ``R.const(float("-inf"), ...)`` it takes."""
    return re.sub(r'R\.const\("(-?inf|nan)", ', r'R.const(float("\1"), ', mod.script())


def _expected(name: str, arrays) -> np.ndarray:
    return reference.flash_attn(*arrays[:3], **CASES[name].reference(*arrays[3:]))


@pytest.mark.parametrize("name", FUSED)
def test_exported_programs_are_fused(name):
    mod, arrays = fixture(name), inputs(name)
    fused = FuseAttention()(mod)
    # nothing of the unfused graph is left (a mask built from ones_like(scores) no longer needs them)
    assert "relax.fuel.flash_attn" in _ops(fused) and not {"relax.nn.softmax", "relax.matmul"} & _ops(fused)
    assert _flash_attn_options(fused) == CASES[name].options
    assert bool(_flash_attn_call(fused).attrs["has_sinks"]) == ("sinks" in CASES[name].reference(*arrays[3:]))
    want = _expected(name, arrays)
    np.testing.assert_allclose(_run(fused, arrays), want, atol=2e-5, rtol=2e-5)
    np.testing.assert_allclose(_run(mod, arrays), want, atol=2e-5, rtol=2e-5)


@pytest.mark.parametrize("name", UNTOUCHED)
def test_inexpressible_exported_programs_are_left_untouched(name):
    mod = fixture(name)
    assert "relax.nn.softmax" in _ops(mod)
    tvm.ir.assert_structural_equal(FuseAttention()(mod), mod)


@pytest.mark.parametrize("name", CASES)
def test_the_fixtures_are_what_the_importer_makes(name):
    torch = pytest.importorskip("torch")
    assert fixture_path(name).exists(), "run tests/transform/fixtures/fuse_attention/regenerate.py"
    mod = exported(name)
    assert tvm_ffi.structural_equal(mod, fixture(name)), \
        f"{fixture_path(name)} is stale: run tests/transform/fixtures/fuse_attention/regenerate.py"
    if CASES[name].reference is not None:  # and the reference the tests use is what PyTorch computes
        arrays = inputs(name)
        want = forward(name, torch)(*map(torch.from_numpy, arrays)).numpy()
        np.testing.assert_allclose(_expected(name, arrays), want, atol=2e-5, rtol=2e-5)


def test_every_fixture_is_a_case():
    assert sorted(path.stem for path in FIXTURES.glob("*.tvmscript")) == sorted(CASES)


# ---- built in Relax -----------------------------------------------------------------------------------------------


def _merged_block(dropout: bool, scale: float = 0.25) -> tvm.IRModule:
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
            p = bb.emit(relax.op.nn.softmax(bb.emit(relax.op.multiply(s, relax.const(scale, "float32")))))
            if dropout:
                p = bb.emit(relax.TupleGetItem(bb.emit(relax.op.nn.dropout(p, 0.1)), 0))
            out = bb.emit(relax.op.matmul(p, merged(v, 9, 16)))
            out = bb.emit_output(relax.op.reshape(out, [2, 4, 9, 16]))
        bb.emit_func_output(out)
    return bb.get()


@pytest.mark.parametrize("dropout", [False, True])
def test_dropout_is_left_untouched(dropout):
    mod = _merged_block(dropout)
    fused = FuseAttention()(mod)
    assert ("relax.fuel.flash_attn" in _ops(fused)) != dropout and ("relax.nn.softmax" in _ops(fused)) == dropout
    if dropout:
        tvm.ir.assert_structural_equal(fused, mod)


def test_a_zero_scale_is_left_untouched():  # every row uniform: no flash_attn softmax_scale says it
    mod = _merged_block(False, scale=0.0)
    tvm.ir.assert_structural_equal(FuseAttention()(mod), mod)


def test_unknown_shapes_are_left_untouched():
    """A bias of unknown shape makes the scores' shape unknown (and that of a full_like of them)."""
    bb = relax.BlockBuilder()
    q, k, v = (relax.Var(n, relax.TensorType((1, 2, 9, 8), "float32")) for n in "qkv")
    bias = relax.Var("bias", relax.TensorType(ndim=4, dtype="float32"))
    with bb.function("main", [q, k, v, bias]):
        with bb.dataflow():
            k_t = bb.emit(relax.op.permute_dims(k, [0, 1, 3, 2]))
            x = bb.emit(relax.op.add(bb.emit(relax.op.matmul(q, k_t)), bias))
            out = bb.emit(relax.op.reshape(bb.emit(relax.op.matmul(bb.emit(relax.op.nn.softmax(x)), v)), (1, 2, 9, 8)))
            out = bb.emit_output(relax.Tuple([out, bb.emit(relax.op.full_like(x, relax.const(0.0, "float32")))]))
        bb.emit_func_output(out)
    mod = bb.get()
    tvm.ir.assert_structural_equal(FuseAttention()(mod), mod)


@pytest.mark.parametrize("group", [1, 3])
def test_a_gqa_head_repeat_is_read_unrepeated(group):
    """k and v repeated as expand_dims(x, 2), broadcast_to [B, Hkv, group, S, D], reshape (what the
    importer makes of repeat_interleave and enable_gqa), built in Relax: a group of 1 too."""
    b, hkv, s, d = 1, 2, 17, 16
    bb = relax.BlockBuilder()
    q = relax.Var("q", relax.TensorType((b, hkv * group, 1, d), "float32"))
    k, v = (relax.Var(n, relax.TensorType((b, hkv, s, d), "float32")) for n in "kv")
    with bb.function("main", [q, k, v]):
        with bb.dataflow():
            def repeated(x):
                x = bb.emit(relax.op.broadcast_to(bb.emit(relax.op.expand_dims(x, 2)), (b, hkv, group, s, d)))
                return bb.emit(relax.op.reshape(x, (b, hkv * group, s, d)))

            k_t = bb.emit(relax.op.permute_dims(repeated(k), [0, 1, 3, 2]))
            p = bb.emit(relax.op.nn.softmax(bb.emit(relax.op.divide(bb.emit(relax.op.matmul(q, k_t)),
                                                                     relax.const(4.0, "float32")))))
            out = bb.emit_output(relax.op.reshape(bb.emit(relax.op.matmul(p, repeated(v))), (b, hkv * group, 1, d)))
        bb.emit_func_output(out)
    mod = bb.get()
    fused = FuseAttention()(mod)
    assert _ops(fused) == {"relax.fuel.flash_attn"}  # k and v unrepeated: no broadcast left
    rng = np.random.default_rng(group)
    arrays = [rng.standard_normal([int(n) for n in x.ty.shape.values]).astype("float32") for x in (q, k, v)]
    want = reference.flash_attn(*arrays, softmax_scale=0.25)
    np.testing.assert_allclose(_run(fused, arrays), want, atol=2e-5, rtol=2e-5)
    np.testing.assert_allclose(_run(mod, arrays), want, atol=2e-5, rtol=2e-5)
