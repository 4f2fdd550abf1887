"""TVMScript printing/parsing of the fuel ops, tvm_fuel.compile, and the floor on other targets."""

from __future__ import annotations

import shutil

import numpy as np
import pytest
import tvm
from helpers import assert_close, build, randn
from tvm import relax, tirx
from tvm.script import ir as I
from tvm.script import relax as R

import tvm_fuel
import tvm_fuel.deploy.nvcc
from tvm_fuel import op
from tvm_fuel import reference as ref

pytestmark = pytest.mark.integration


def _every_op_module():
    """One function that calls every fuel op, with optional arguments present and absent."""
    b = tirx.Var("b", "int64")
    params = dict(q=((b, 6, 5, 40), "float16"), k=((b, 2, 9, 40), "float16"), v=((b, 2, 9, 40), "float16"),
                  do=((b, 6, 5, 40), "float16"), slopes=((6,), "float32"), mask=((5, 9), "bool"),
                  k_cache=((8, 4, 2, 40), "float16"), v_cache=((8, 4, 2, 40), "float16"),
                  table=((b, 3), "uint32"), lens=((b,), "int32"), probs=((b, 5, 9), "float32"))

    def make(q, k, v, do, slopes, mask, k_cache, v_cache, table, lens, probs):
        fwd = op.flash_attn(q, k, v, slopes, mask, causal=True, window_size=(4, -1), softcap=3.5, return_lse=True)
        return relax.Tuple([
            fwd,
            op.flash_attn(q, k, v, softmax_scale=0.25),
            op.flash_attn_backward(q, k, v, do, attn_mask=mask, lse=relax.TupleGetItem(fwd, 1)),
            op.flash_attn_backward_q(q, k, v, do, out=relax.TupleGetItem(fwd, 0)),
            op.flash_attn_backward_k(q, k, v, do, slopes),
            op.flash_attn_backward_v(q, k, v, do, window_size=(-1, 2)),
            op.paged_attn(q, k_cache, v_cache, table, lens, slopes, causal=True),
            op.softmax_backward(probs, probs, axis=1),
        ])

    return build(make, params)


def test_every_op_prints_readably_and_parses_back():
    mod = _every_op_module()
    text = mod.script()
    for name in ("flash_attn", "flash_attn_backward", "flash_attn_backward_q", "flash_attn_backward_k",
                 "flash_attn_backward_v", "paged_attn", "softmax_backward"):
        assert f"R.fuel.{name}(" in text
    assert "window_size=[4, -1]" in text and "softcap=3.5" in text
    parsed = tvm.script.from_source(text)
    tvm.ir.assert_structural_equal(mod, parsed)


def test_hand_written_tvmscript_uses_the_constructor_signature():
    @I.ir_module
    class Module:
        @R.function
        def main(q: R.Tensor((1, 4, 3, 16), "float32"), k: R.Tensor((1, 2, 7, 16), "float32"),
                 v: R.Tensor((1, 2, 7, 16), "float32")):
            out = R.fuel.flash_attn(q, k, v, causal=True, softcap=2.0)
            return out

    rng = np.random.default_rng(0)
    q, k, v = randn(rng, (1, 4, 3, 16)), randn(rng, (1, 2, 7, 16)), randn(rng, (1, 2, 7, 16))
    vm = relax.VirtualMachine(tvm_fuel.compile(Module, "llvm"), tvm.cpu())
    out = vm["main"](*map(tvm.runtime.tensor, (q, k, v))).numpy()
    assert_close(out, ref.flash_attn(q, k, v, causal=True, softcap=2.0), "float32")


def test_plain_tvm_compile_legalizes_fuel_ops():
    mod = build(lambda **a: op.softmax_backward(**a), dict(probs=((3, 17), "float32"), dprobs=((3, 17), "float32")))
    vm = relax.VirtualMachine(tvm.compile(mod, target="llvm"), tvm.cpu())
    rng = np.random.default_rng(1)
    logits = rng.standard_normal((3, 17))
    probs = (np.exp(logits) / np.exp(logits).sum(-1, keepdims=True)).astype(np.float32)
    dprobs = randn(rng, (3, 17))
    out = vm["main"](tvm.runtime.tensor(probs), tvm.runtime.tensor(dprobs)).numpy()
    assert_close(out, ref.softmax_backward(probs, dprobs), "float32")


@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
@pytest.mark.parametrize("shape,axis", [((4, 97), -1), ((2, 3, 17), 1), ((1,), 0)])
def test_softmax_backward_matches_reference(dtype, shape, axis):
    rng = np.random.default_rng(len(shape))
    logits = rng.standard_normal(shape)
    probs = np.exp(logits) / np.exp(logits).sum(axis, keepdims=True)
    probs, dprobs = probs.astype(randn(rng, 1, dtype).dtype), randn(rng, shape, dtype)
    mod = build(lambda **a: op.softmax_backward(**a, axis=axis), dict(probs=(shape, dtype), dprobs=(shape, dtype)))
    vm = relax.VirtualMachine(tvm_fuel.compile(mod, "llvm"), tvm.cpu())
    out = vm["main"](tvm.runtime.tensor(probs), tvm.runtime.tensor(dprobs)).numpy()
    assert out.dtype == probs.dtype
    assert_close(out, ref.softmax_backward(probs, dprobs, axis=axis), dtype)


def test_compile_kernel_paths():
    mod = build(lambda **a: op.flash_attn(**a), dict(q=((1, 2, 3, 8), "float32"), k=((1, 2, 3, 8), "float32"),
                                                     v=((1, 2, 3, 8), "float32")))
    with pytest.raises(ValueError, match=r"kernels must be one of \('decomposed', 'tuned'\)"):
        tvm_fuel.compile(mod, "llvm", kernels="fast")
    with pytest.raises(TypeError, match="target must be"):
        tvm_fuel.compile(mod, 42)


def test_compile_reports_unknown_shapes():
    q = relax.Var("q", relax.TensorType(ndim=4, dtype="float32"))
    k = relax.Var("k", relax.TensorType((1, 2, 3, 8), "float32"))
    bb = relax.BlockBuilder()
    with bb.function("main", [q, k]):
        out = bb.emit(op.flash_attn(q, k, k))
        bb.emit_func_output(out)
    with pytest.raises(ValueError, match=r"could not legalize \['relax\.fuel\.flash_attn'\].*R\.match_cast"):
        tvm_fuel.compile(bb.get(), "llvm")


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="needs nvcc")
@pytest.mark.parametrize("arch", ["sm_80", "sm_90"])
def test_floor_builds_for_cuda(arch):
    """The decomposition is portable: dlight schedules it and nvcc compiles every kernel (no GPU needed)."""
    from tvm.support import nvcc

    target = tvm.target.Target({"kind": "cuda", "arch": arch})
    source = tvm_fuel.deploy.nvcc.cuda_source(tvm_fuel.compile(_every_op_module(), target))
    assert source.count("__global__") >= 7
    with target:
        assert len(nvcc.compile_cuda(source, target_format="cubin", compiler="nvcc")) > 0
