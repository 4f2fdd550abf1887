"""The CUDA kernel of FlashAttention's packed variable-length backward (``schedules.cuda.varlen_backward``).

Without a GPU: its one-thread emulation (built for llvm), NaN-prefilled dq, dk, dv, against
``reference.flash_attn_varlen_backward`` (float64) on one batch of sequences of 0, 1, 3, 17 and 97
queries (keys unequal to queries in some, a sequence with queries and no keys, one with keys and
no queries), rows of q and k past the last sequence (and, kernel alone, before the first), GQA
groups 1, 3 and 7, every option, float32 and float16 (register tiles); the op through the rule
(given the forward's out and lse, or recomputing them with the varlen forward kernel); empty and
malformed offsets (in-bounds reads and writes: guard rows of NaN around every tensor stay unread
and unwritten). Slow: more tile shapes, a 513-query sequence, and nvcc builds for sm_80 and sm_90
(float16, bfloat16, float32) that fit the architecture's launchable shared memory and spill no
register.
"""

from __future__ import annotations

import numpy as np
import pytest
import tvm
from helpers import (assert_guards_intact, assert_varlen_backward_matches, build, buffers_growing_with, guarded,
                     launchable, legalize_cuda_emulated, randn, run_varlen_backward_kernel,
                     varlen_backward_kernel_inputs)
from tvm import relax

import tvm_fuel
from tvm_fuel import op
from tvm_fuel.deploy import nvcc as cuda
from tvm_fuel.dispatch import kernel_call, workload_of
from tvm_fuel.op.config import AttnConfig
from tvm_fuel.schedules.cuda.device import Launch
from tvm_fuel.schedules.cuda.rules import CudaFlashBackward, CudaVarlenBackward
from tvm_fuel.schedules.cuda.tiles import CudaTiles
from tvm_fuel.schedules.cuda.varlen_backward import varlen_backward
from tvm_fuel.schedules.workload import KernelSpec, Workload

pytestmark = pytest.mark.numerics

Q_LENS, K_LENS = [17, 0, 97, 1, 3, 0], [33, 5, 97, 1, 0, 6]
EXTRA_ROWS = 2  # q and k rows past the last sequence: dq, dk, dv 0
ARCHS = ("sm_80", "sm_90")
VARLEN_DIMS = (("total_q", None), ("total_k", None), ("B1", None))
needs_nvcc = pytest.mark.skipif(not cuda.nvcc_available(), reason="nvcc is not installed")


def _spec(dtype="float32", Hq=2, Hkv=1, D=64, *, alibi=False, **options) -> KernelSpec:
    return KernelSpec(dtype, Hq, Hkv, D, AttnConfig(**options), has_alibi=alibi)


def _workload(spec: KernelSpec) -> Workload:
    return Workload("flash_attn_varlen_backward", spec, VARLEN_DIMS, ("dq", "dk", "dv"))


def rule_tiles(spec: KernelSpec, target=None) -> CudaTiles:
    """The tiles the rule picks (the dense backward's); ``target`` None: the emulation's (sm_90's limits)."""
    rule = CudaVarlenBackward(emulated=target is None)
    return CudaTiles(**rule.knobs(_workload(spec), target or tvm.target.Target("llvm")))


def _emulated(spec: KernelSpec, tiles: CudaTiles | None = None):
    return tvm.compile(varlen_backward(spec, tiles or rule_tiles(spec), launch=Launch.emulated()), target="llvm")


def _inputs(spec, q_lens=Q_LENS, k_lens=K_LENS, *, extra=EXTRA_ROWS, first=0, seed=0) -> dict:
    """``varlen_backward_kernel_inputs`` with ``extra`` rows of k and v past the last sequence and
    ``first`` rows of q, do, out, lse, k and v before the first (offsets shifted; finite values)."""
    inputs = varlen_backward_kernel_inputs(spec, q_lens, k_lens, extra=extra, seed=seed)
    rng = np.random.default_rng(seed + 2)

    def pad(x, before, after, axis=0):
        shape = lambda n: x.shape[:axis] + (n,) + x.shape[axis + 1:]  # noqa: E731
        return np.concatenate([randn(rng, shape(before), str(x.dtype)), x, randn(rng, shape(after), str(x.dtype))],
                              axis=axis)

    for name in ("q", "do", "out"):
        inputs[name] = pad(inputs[name], first, 0)
    inputs["lse"] = pad(inputs["lse"], first, 0, axis=1)
    for name in ("k", "v"):
        inputs[name] = pad(inputs[name], first, extra)
    for name in ("cu_seqlens_q", "cu_seqlens_k"):
        inputs[name] = (inputs[name] + first).astype(np.int32)
    return inputs


CASES = {
    "group1_D64": _spec(Hq=2, Hkv=2, D=64),
    "group3_D40_causal": _spec(Hq=3, Hkv=1, D=40, causal=True),
    "group7_D64_causal_window": _spec(Hq=7, Hkv=1, D=64, causal=True, window_size=(32, 0)),
    "group3_D64_window_softcap": _spec(Hq=6, Hkv=2, D=64, window_size=(16, 8), softcap=5.0),
    "group1_D64_alibi_causal_scale": _spec(Hq=2, Hkv=2, D=64, alibi=True, causal=True, softmax_scale=0.3),
    "group3_D64_sink_tokens_window": _spec(Hq=3, Hkv=1, D=64, causal=True, window_size=(16, 0), sink_tokens=4),
    "float16_group3_D64_causal_alibi_softcap": _spec("float16", Hq=6, Hkv=2, D=64, causal=True, alibi=True,
                                                     softcap=8.0),
    "float16_group7_D64_window": _spec("float16", Hq=7, Hkv=1, D=64, window_size=(16, 8)),
    "float16_group1_D40_sink_tokens": _spec("float16", Hq=2, Hkv=2, D=40, window_size=(32, 0), sink_tokens=3),
}


@pytest.mark.parametrize("name", list(CASES))
def test_emulation_matches_the_reference(name):
    """The tiles the rule picks (float16: register tiles), rows before the first sequence and past the last."""
    spec = CASES[name]
    inputs = _inputs(spec, first=3, seed=len(name))
    assert_varlen_backward_matches(spec, run_varlen_backward_kernel(_emulated(spec), inputs), inputs)


# small tiles: many query and key tiles per sequence, several warps, every pipeline depth
TILES = {
    "16x16_one_warp_3_stages": CudaTiles(block_q=16, block_k=16, threads=32, stages=3),
    "32x16_one_stage": CudaTiles(block_q=32, block_k=16, threads=32, stages=1),
    "32x32_two_warps": CudaTiles(block_q=32, block_k=32, threads=64, stages=2),
}


@pytest.mark.parametrize("dtype", ["float32", "float16"])
def test_small_tiles_match_the_reference(dtype):
    spec = _spec(dtype, Hq=3, Hkv=1, D=40, causal=True, window_size=(32, 0), sink_tokens=2, softcap=6.0)
    inputs = _inputs(spec, [17, 0, 40, 1], [33, 5, 40, 0], seed=1)  # several tiles a sequence, a shorter batch
    tiles = TILES["16x16_one_warp_3_stages" if dtype == "float32" else "32x32_two_warps"]
    grads = run_varlen_backward_kernel(_emulated(spec, tiles), inputs)
    assert_varlen_backward_matches(spec, grads, inputs)


@pytest.mark.slow
@pytest.mark.parametrize("name", ["group7_D64_causal_window", "group3_D64_window_softcap",
                                  "float16_group3_D64_causal_alibi_softcap", "float16_group7_D128_window"])
@pytest.mark.parametrize("tiles", list(TILES))
def test_every_tile_shape_matches_the_reference(tiles, name):
    spec = CASES.get(name) or _spec("float16", Hq=7, Hkv=1, D=128, window_size=(16, 8))
    inputs = _inputs(spec, seed=2)
    assert_varlen_backward_matches(spec, run_varlen_backward_kernel(_emulated(spec, TILES[tiles]), inputs), inputs)


@pytest.mark.slow
@pytest.mark.parametrize("dtype", ["float32", "float16"])
def test_a_long_sequence(dtype):
    spec = _spec(dtype, Hq=6, Hkv=2, D=64, causal=True, alibi=True)
    inputs = _inputs(spec, [513, 17, 0, 1], [513, 97, 4, 1], seed=3)
    assert_varlen_backward_matches(spec, run_varlen_backward_kernel(_emulated(spec), inputs), inputs)


def _op_module(spec: KernelSpec, inputs, *, given: bool):
    """main(q, k, v, do, cu_seqlens_q, cu_seqlens_k, [alibi_slopes], [out, lse]) -> (dq, dk, dv)."""
    names = ["q", "k", "v", "do", "cu_seqlens_q", "cu_seqlens_k"] + (["alibi_slopes"] if spec.has_alibi else [])
    names += ["out", "lse"] if given else []
    cfg = spec.cfg
    options = dict(softmax_scale=cfg.softmax_scale, causal=cfg.causal, window_size=cfg.window_size,
                   softcap=cfg.softcap, sink_tokens=cfg.sink_tokens)
    return build(lambda **a: op.flash_attn_varlen_backward(**a, **options),
                 {name: (inputs[name].shape, str(inputs[name].dtype)) for name in names}), names


@pytest.mark.parametrize("state,dtype", [("given", "float16"), ("recomputed", "float32")])
def test_the_op_runs_the_kernel(state, dtype):
    """The op through the rule: the kernel serves it (not the floor); without out and lse the varlen
    forward kernel computes them first."""
    spec = _spec(dtype, Hq=6, Hkv=2, D=40, causal=True, alibi=True, window_size=(24, 4), softcap=6.0)
    inputs = varlen_backward_kernel_inputs(spec, [17, 0, 97, 1], [33, 5, 97, 1], extra=1, seed=4)
    mod, names = _op_module(spec, inputs, given=state == "given")
    target = tvm.target.Target("llvm")
    legalized = legalize_cuda_emulated(mod, target)
    funcs = {gv.name_hint: f for gv, f in legalized.functions.items() if isinstance(f, tvm.tirx.PrimFunc)}
    assert "fuel_flash_attn_varlen_backward" not in funcs, "the floor served the backward"
    kernel = funcs["fuel_flash_attn_varlen_backward_kernel"]
    assert str(kernel.attrs["fuel.workload"]).startswith("flash_attn_varlen_backward")
    assert ("fuel_flash_attn_varlen_kernel" in funcs) == (state == "recomputed")
    assert "fuel_flash_attn_varlen" not in funcs
    vm = relax.VirtualMachine(tvm.compile(legalized, target=target), tvm.cpu())
    grads = [g.numpy().astype(np.float64) for g in vm["main"](*(tvm.runtime.tensor(inputs[n]) for n in names))]
    assert_varlen_backward_matches(spec, grads, inputs)


def test_the_gradient_runs_the_kernel():
    """flash_attn_varlen's registered gradient (tvm_fuel.transform.gradient) through the rules: the
    forward and backward kernels, dq, dk, dv as the reference's."""
    spec = _spec("float32", Hq=6, Hkv=2, D=40, causal=True)
    inputs = varlen_backward_kernel_inputs(spec, [17, 0, 97, 1], [33, 5, 97, 1], extra=1, seed=6)
    names = ["q", "k", "v", "do", "cu_seqlens_q", "cu_seqlens_k"]

    def loss(q, k, v, do, cu_seqlens_q, cu_seqlens_k):
        out = op.flash_attn_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, causal=True)
        return relax.op.sum(relax.op.multiply(out, do))

    mod = build(loss, {name: (inputs[name].shape, str(inputs[name].dtype)) for name in names})
    mod = tvm_fuel.transform.gradient(mod, require_grads=list(mod["main"].params[:3]))
    target = tvm.target.Target("llvm")
    legalized = legalize_cuda_emulated(mod, target)
    funcs = {gv.name_hint for gv, f in legalized.functions.items() if isinstance(f, tvm.tirx.PrimFunc)}
    assert {"fuel_flash_attn_varlen_kernel", "fuel_flash_attn_varlen_backward_kernel"} <= funcs, sorted(funcs)
    assert not funcs & {"fuel_flash_attn_varlen", "fuel_flash_attn_varlen_backward"}, sorted(funcs)
    vm = relax.VirtualMachine(tvm.compile(legalized, target=target), tvm.cpu())
    _, grads = vm["main_adjoint"](*(tvm.runtime.tensor(inputs[n]) for n in names))
    assert_varlen_backward_matches(spec, [g.numpy().astype(np.float64) for g in grads], inputs)


def test_the_rule():
    """The dense backward's tiles; a call with sinks is served without them (the sinks' out and lse);
    tiles that would not launch are refused."""
    target = tvm.target.Target({"kind": "cuda", "arch": "sm_90"})
    dense, varlen = CudaFlashBackward("flash_attn_backward"), CudaVarlenBackward()
    assert varlen.op == "flash_attn_varlen_backward" and varlen.needs_forward_state and not varlen.tunable
    for dtype in ("float16", "bfloat16", "float32"):
        for head_dim in (40, 64, 128, 256):
            spec = _spec(dtype, Hq=6, Hkv=2, D=head_dim, causal=True)
            wl = Workload("flash_attn_backward", spec, (("B", None), ("Sq", None), ("Sk", None)), ("dq", "dk", "dv"))
            assert varlen.default_knobs(_workload(spec), target) == dense.default_knobs(wl, target)
    big = {"block_q": 128, "block_k": 64, "splits": 1, "threads": 128, "stages": 3}
    assert "shared memory" in varlen.check_fit(_workload(_spec(D=256)), target, big)

    def call(sinks=False):
        q, kv = relax.TensorType((20, 6, 64), "float16"), relax.TensorType((30, 2, 64), "float16")
        cu = relax.TensorType((4,), "int32")
        sink = relax.Var("sinks", relax.TensorType((6,), "float32")) if sinks else None
        return op.flash_attn_varlen_backward(relax.Var("q", q), relax.Var("k", kv), relax.Var("v", kv),
                                             relax.Var("do", q), relax.Var("cu_q", cu), relax.Var("cu_k", cu),
                                             sinks=sink, causal=True)

    name = "flash_attn_varlen_backward"
    served = workload_of(name, relax.BlockBuilder().normalize(call()))
    assert served is not None and served.grads == ("dq", "dk", "dv") and varlen.serves(served, target)
    # no kernel takes sinks: such a call as it stands has no workload, and the sink-free call the
    # legalize map gives it (with the sinks' out and lse) has the plain call's
    with_sinks = relax.BlockBuilder().normalize(call(sinks=True))
    assert workload_of(name, with_sinks) is None
    plain = relax.BlockBuilder().normalize(kernel_call(name, with_sinks))
    assert workload_of(name, plain) == served
    assert not varlen.serves(served, tvm.target.Target("llvm"))


def test_signature_follows_the_spec():
    tiles = CudaTiles(block_q=16, block_k=16, threads=32)

    def names(spec):
        return [p.name for p in varlen_backward(spec, tiles).params]

    common = ["q", "k", "v", "do", "cu_seqlens_q", "cu_seqlens_k"]
    assert names(_spec(alibi=True)) == common + ["alibi_slopes", "out", "lse", "dq", "dk", "dv"]
    assert names(_spec()) == common + ["out", "lse", "dq", "dk", "dv"]
    func = varlen_backward(_spec(causal=True), tiles)
    assert func.attrs["global_symbol"] == "fuel_flash_attn_varlen_backward_cuda" and func.attrs["tirx.is_scheduled"]
    assert buffers_growing_with(func, "total_q", "total_k") == []  # nothing of B * max^2 or total_q * total_k
    with pytest.raises(ValueError, match="attn_mask"):
        varlen_backward(KernelSpec("float32", 2, 1, 64, AttnConfig(), mask_dtype="bool"), tiles)
    with pytest.raises(ValueError, match="multiple"):
        varlen_backward(_spec(Hq=3, Hkv=2), tiles)
    with pytest.raises(ValueError, match="whole 16-row strips"):  # 4 warps over 2 query strips
        varlen_backward(_spec("float16"), CudaTiles(block_q=32, block_k=64, threads=128))


@pytest.mark.parametrize("dtype", ["float32", "float16"])
def test_any_offsets_read_and_write_in_bounds(dtype):
    """No assertion on a device: empty and malformed offsets (negative, decreasing, past the packed
    rows, 2^30) are clamped. Valid empty batches give zero gradients; the others any finite rows,
    and the NaN guard rows around every tensor are never read (no NaN comes out) nor written."""
    spec = _spec(dtype, Hq=2, Hkv=1, D=16, causal=True)
    lib = _emulated(spec, CudaTiles(block_q=16, block_k=16, threads=32))
    rng = np.random.default_rng(5)
    cases = [(7, 5, [0], [0]), (4, 3, [], []), (0, 0, [0, 0], [0, 0]), (0, 4, [0, 0, 0], [0, 2, 4]),
             (5, 0, [0, 2, 5], [0, 0, 0]), (5, 5, [3, -7, 100, 2], [9, 1 << 30, -5, 4]),
             (6, 5, [0, 2, 6], [0, -8, 2]), (40, 3, [0, 40, 1, 39], [0, 3, 0, 2]),
             (9, 9, [-(1 << 30), 5, 1 << 30], [(1 << 31) - 1, 4, -1]), (3, 40, [0, 3, 1, 2], [0, 40, 2, 39])]
    for total_q, total_k, cu_q, cu_k in cases:
        rows = dict(q=(total_q, 2), do=(total_q, 2), out=(total_q, 2), k=(total_k, 1), v=(total_k, 1))
        tensors = {name: guarded((n, h, 16), dtype, randn(rng, (n, h, 16), dtype)) for name, (n, h) in rows.items()}
        tensors["lse"] = guarded((2 * total_q,), "float32", 5.0)  # finite: P = exp(s - 5) stays finite
        grads = {name: guarded((n, h, 16), dtype, 0) for name, (n, h) in
                 dict(dq=(total_q, 2), dk=(total_k, 1), dv=(total_k, 1)).items()}
        args = [tvm.runtime.from_dlpack(tensors[n][1]) for n in ("q", "k", "v", "do")]
        args += [tvm.runtime.tensor(np.asarray(c, np.int32)) for c in (cu_q, cu_k)]
        args.append(tvm.runtime.from_dlpack(tensors["out"][1]))
        # lse [2, total_q] as a view of the guarded rows (an empty one: a fresh tensor, strides as TVM wants)
        args.append(tvm.runtime.from_dlpack(tensors["lse"][1].reshape(2, total_q)) if total_q else
                    tvm.runtime.tensor(np.zeros((2, 0), np.float32)))
        lib(*args, *(tvm.runtime.from_dlpack(grads[n][1]) for n in ("dq", "dk", "dv")))
        what = f"total_q {total_q}, total_k {total_k}, cu_q {cu_q}, cu_k {cu_k}"
        for name, (whole, middle) in {**tensors, **grads}.items():
            assert_guards_intact(whole, f"{name}: {what}")
        for name, (_, middle) in grads.items():
            assert np.isfinite(middle.astype(np.float64)).all(), f"{name}: {what}"
            if len(cu_q) <= 1 or total_q == 0 or total_k == 0:  # no sequence: no gradient
                assert not middle.any(), f"{name}: {what}"


@pytest.mark.slow
@needs_nvcc
@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("dtype", ["float16", "bfloat16", "float32"])
def test_compiles_with_nvcc_fits_the_architecture_and_spills_nothing(dtype, arch):
    """Head dim 128 (the largest register tiles the benchmark runs), every option."""
    target = tvm.target.Target({"kind": "cuda", "arch": arch})
    spec = _spec(dtype, Hq=8, Hkv=2, D=128, alibi=True, causal=True, softcap=5.0, window_size=(64, 0),
                 sink_tokens=4)
    func = varlen_backward(spec, rule_tiles(spec, target))
    built, usage = cuda.build_with_shared_memory(tvm.IRModule({"fuel_flash_attn_varlen_backward_cuda": func}), target)
    source = cuda.cuda_source(built)
    names = cuda.kernel_names(source)
    assert len([n for n in names if n.startswith("fuel_flash_attn_varlen_backward_cuda_kernel")]) == 3, names
    assert usage and all(launchable(static, dynamic, arch) for static, dynamic in usage.values()), usage
    assert "cp.async.cg.shared.global" in source and "cp.async.wait_group" in source
    if dtype != "float32":  # register tiles
        ptx = "bf16" if dtype == "bfloat16" else "f16"
        assert f"mma.sync.aligned.m16n8k16.row.col.f32.{ptx}.{ptx}.f32" in source
        assert "ldmatrix.sync.aligned.m8n8.x4.shared.b16" in source
    if dtype == "float32":  # the SIMT blocks ask for one block per SM (registers over occupancy: no spill)
        assert source.count(f"__launch_bounds__({rule_tiles(spec, target).threads}, 1)") == 4  # 2 declared, 2 defined
    report = cuda.ptxas_report(source, arch)
    assert len(report) == 3 and all(k["registers"] > 0 for k in report.values()), report
    spilled = {name: k for name, k in report.items() if k["spill_stores"] or k["spill_loads"] or k["stack_frame"]}
    assert not spilled, spilled
