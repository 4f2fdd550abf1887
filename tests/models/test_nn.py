"""tvm_fuel.nn: the ops as relax.frontend.nn modules, exported and compiled like any nn model."""

from __future__ import annotations

import numpy as np
import pytest
import tvm
from helpers import HOST, assert_integer_decode, integer_q_k, legalize_checked
from tvm import relax
from tvm.relax.frontend import nn

import tvm_fuel
import tvm_fuel.nn
from tvm_fuel import reference

pytestmark = pytest.mark.integration


class _Attention(nn.Module):
    def __init__(self, **options):
        self.attn = tvm_fuel.nn.FlashAttention(**options)

    def forward(self, q: nn.Tensor, k: nn.Tensor, v: nn.Tensor, slopes: nn.Tensor):
        return self.attn(q, k, v, slopes)


class _Decode(nn.Module):
    def __init__(self, **options):
        self.attn = tvm_fuel.nn.PagedAttention(**options)

    def forward(self, q: nn.Tensor, k_cache: nn.Tensor, v_cache: nn.Tensor, table: nn.Tensor, lens: nn.Tensor):
        return self.attn(q, k_cache, v_cache, table, lens)


class _AttentionWithSinks(nn.Module):
    def __init__(self, **options):
        self.attn = tvm_fuel.nn.FlashAttention(**options)

    def forward(self, q: nn.Tensor, k: nn.Tensor, v: nn.Tensor, sinks: nn.Tensor):
        return self.attn(q, k, v, sinks=sinks)


class _DecodeWithSinks(nn.Module):
    def __init__(self, **options):
        self.attn = tvm_fuel.nn.PagedAttention(**options)

    def forward(self, q: nn.Tensor, k_cache: nn.Tensor, v_cache: nn.Tensor, table: nn.Tensor, lens: nn.Tensor,
                sinks: nn.Tensor):
        return self.attn(q, k_cache, v_cache, table, lens, sinks=sinks)


class _QuantizedDecode(nn.Module):
    def __init__(self, **options):
        self.attn = tvm_fuel.nn.PagedAttention(**options)

    def forward(self, q: nn.Tensor, k_cache: nn.Tensor, v_cache: nn.Tensor, block_table: nn.Tensor,
                context_lens: nn.Tensor, k_scale: nn.Tensor, v_scale: nn.Tensor):
        return self.attn(q, k_cache, v_cache, block_table, context_lens, k_scale=k_scale, v_scale=v_scale)


class _Varlen(nn.Module):
    def __init__(self, **options):
        self.attn = tvm_fuel.nn.VarlenAttention(**options)

    def forward(self, q: nn.Tensor, k: nn.Tensor, v: nn.Tensor, cu_q: nn.Tensor, cu_k: nn.Tensor, slopes: nn.Tensor):
        return self.attn(q, k, v, cu_q, cu_k, slopes)


def _run(model: nn.Module, arrays: dict, kernels: str) -> list[np.ndarray]:
    mod, _ = model.export_tvm({"forward": {n: nn.spec.Tensor(a.shape, str(a.dtype)) for n, a in arrays.items()}})
    vm = relax.VirtualMachine(tvm.compile(legalize_checked(mod, HOST, kernels), target=HOST), tvm.cpu())
    result = vm["forward"](*[tvm.runtime.tensor(a) for a in arrays.values()])
    return [result.numpy()] if isinstance(result, tvm.runtime.Tensor) else [r.numpy() for r in result]


def test_flash_attention_module(kernels):
    rng = np.random.default_rng(0)
    arrays = dict(q=rng.standard_normal((2, 6, 17, 40)), k=rng.standard_normal((2, 2, 23, 40)),
                  v=rng.standard_normal((2, 2, 23, 40)), slopes=rng.uniform(0, 0.2, 6))
    arrays = {n: a.astype("float32") for n, a in arrays.items()}
    options = dict(causal=True, softcap=5.0)
    out, lse = _run(_Attention(return_lse=True, **options), arrays, kernels)
    want, want_lse = reference.flash_attn(*arrays.values(), return_lse=True, **options)
    np.testing.assert_allclose(out, want, atol=2e-5, rtol=2e-5)
    np.testing.assert_allclose(lse, want_lse, atol=2e-5, rtol=2e-5)


def test_paged_attention_module(kernels):
    rng = np.random.default_rng(1)
    table = rng.permutation(12)[:8].reshape(2, 4).astype("int32")
    arrays = dict(q=rng.standard_normal((2, 8, 1, 64)).astype("float32"),
                  k_cache=rng.standard_normal((12, 16, 2, 64)).astype("float32"),
                  v_cache=rng.standard_normal((12, 16, 2, 64)).astype("float32"),
                  table=table, lens=np.array([17, 64], "int32"))
    (out,) = _run(_Decode(window_size=(31, 0)), arrays, kernels)
    want = reference.paged_attn(*arrays.values(), window_size=(31, 0))
    np.testing.assert_allclose(out, want, atol=2e-5, rtol=2e-5)


def test_modules_take_sinks(kernels):
    rng = np.random.default_rng(2)
    sinks = rng.standard_normal(6).astype("float32") * 2
    dense = {n: rng.standard_normal(shape).astype("float32") for n, shape in
             (("q", (1, 6, 17, 40)), ("k", (1, 2, 23, 40)), ("v", (1, 2, 23, 40)))}
    (out,) = _run(_AttentionWithSinks(causal=True), {**dense, "sinks": sinks}, kernels)
    np.testing.assert_allclose(out, reference.flash_attn(*dense.values(), sinks=sinks, causal=True),
                               atol=2e-5, rtol=2e-5)
    table = rng.permutation(12)[:8].reshape(2, 4).astype("int32")
    paged = dict(q=rng.standard_normal((2, 6, 1, 64)).astype("float32"),
                 k_cache=rng.standard_normal((12, 16, 2, 64)).astype("float32"),
                 v_cache=rng.standard_normal((12, 16, 2, 64)).astype("float32"),
                 table=table, lens=np.array([0, 50], "int32"))
    (out,) = _run(_DecodeWithSinks(), {**paged, "sinks": sinks}, kernels)
    np.testing.assert_allclose(out, reference.paged_attn(*paged.values(), sinks=sinks), atol=2e-5, rtol=2e-5)


def test_paged_attention_module_reads_an_int8_cache(kernels):
    rng = np.random.default_rng(4)
    (k_cache, k_scale), (v_cache, v_scale) = (reference.quantize_int8(rng.standard_normal((12, 16, 2, 64)))
                                              for _ in range(2))
    arrays = dict(q=rng.standard_normal((2, 8, 1, 64)).astype("float32"), k_cache=k_cache, v_cache=v_cache,
                  block_table=rng.permutation(12)[:8].reshape(2, 4).astype("int32"),
                  context_lens=np.array([17, 64], "int32"), k_scale=k_scale, v_scale=v_scale)
    (out,) = _run(_QuantizedDecode(causal=True), arrays, kernels)
    if kernels == "tuned" and integer_q_k(64, 4):  # decode in integers: q and each tile's weights rounded to int16
        assert_integer_decode(out, arrays, tol=2e-5)
    else:
        want = reference.paged_attn(*list(arrays.values())[:5], k_scale=k_scale, v_scale=v_scale, causal=True)
        np.testing.assert_allclose(out, want, atol=2e-5, rtol=2e-5)


def test_modules_take_sink_tokens(kernels):
    """StreamingLLM: a window of 16 keys and the first 4 kept, through both modules."""
    rng = np.random.default_rng(3)
    options = dict(window_size=(15, 0), sink_tokens=4)
    dense = dict(q=rng.standard_normal((1, 6, 17, 40)), k=rng.standard_normal((1, 2, 60, 40)),
                 v=rng.standard_normal((1, 2, 60, 40)), slopes=np.zeros(6))
    dense = {n: a.astype("float32") for n, a in dense.items()}
    (out,) = _run(_Attention(**options), dense, kernels)
    np.testing.assert_allclose(out, reference.flash_attn(*dense.values(), **options), atol=2e-5, rtol=2e-5)
    table = rng.permutation(12)[:8].reshape(2, 4).astype("int32")
    paged = dict(q=rng.standard_normal((2, 8, 1, 64)).astype("float32"),
                 k_cache=rng.standard_normal((12, 16, 2, 64)).astype("float32"),
                 v_cache=rng.standard_normal((12, 16, 2, 64)).astype("float32"),
                 table=table, lens=np.array([30, 64], "int32"))
    (out,) = _run(_Decode(**options), paged, kernels)
    np.testing.assert_allclose(out, reference.paged_attn(*paged.values(), **options), atol=2e-5, rtol=2e-5)


def test_varlen_attention_module(kernels):
    """A packed batch (lengths 17, 0, 40) through the module, lse in FlashAttention's [Hq, total_q]."""
    rng = np.random.default_rng(5)
    cu_q, cu_k = np.array([0, 17, 17, 57], "int32"), np.array([0, 23, 30, 70], "int32")
    arrays = dict(q=rng.standard_normal((57, 6, 40)), k=rng.standard_normal((70, 2, 40)),
                  v=rng.standard_normal((70, 2, 40)))
    arrays = {**{n: a.astype("float32") for n, a in arrays.items()}, "cu_q": cu_q, "cu_k": cu_k,
              "slopes": rng.uniform(0, 0.2, 6).astype("float32")}
    options = dict(causal=True, softcap=5.0)
    out, lse = _run(_Varlen(return_lse=True, max_seqlen_q=40, max_seqlen_k=40, **options), arrays, kernels)
    want, want_lse = reference.flash_attn_varlen(*arrays.values(), return_lse=True, **options)
    np.testing.assert_allclose(out, want, atol=2e-5, rtol=2e-5)
    np.testing.assert_allclose(lse, want_lse, atol=2e-5, rtol=2e-5)


def test_bad_options_fail_at_construction_by_name():
    with pytest.raises(ValueError, match="tvm_fuel.nn.FlashAttention"):
        tvm_fuel.nn.FlashAttention(window_size=(-3, 0))
    with pytest.raises((ValueError, TypeError), match="tvm_fuel.nn.PagedAttention"):
        tvm_fuel.nn.PagedAttention(softmax_scale="big")
    with pytest.raises(ValueError, match="tvm_fuel.nn.PagedAttention: sink_tokens"):
        tvm_fuel.nn.PagedAttention(window_size=(7, 0), sink_tokens=-4)
