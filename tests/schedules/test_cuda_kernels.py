"""The CUDA performance path.

Without a GPU (CI): every kernel is built for sm_80 and sm_90, the emitted CUDA C is compiled
with nvcc to a cubin, and the source is checked: each fuel kernel is a device kernel (an unbound
PrimFunc would silently become host code), its shared memory fits the architecture, no global
buffer grows with Sq * Sk, and float16/bfloat16 kernels multiply in register tiles (ldmatrix +
mma.sync, no float32 store to shared memory inside a key or query loop).
The kernels' numerics without a GPU: the ``kernels`` fixture's "cuda-emulated" runs every
numeric test of test_flash_attn/test_paged_attn/test_backward through their llvm emulation.

On a GPU (``-m gpu``; skipped without a device): the kernels against the reference and the floor.
"""

from __future__ import annotations

import re

import numpy as np
import pytest
import tvm
import tvm_ffi
from covering import pairwise
from helpers import (PinnedKnobs, applied_knobs, assert_close, assert_pinned, build, buffers_growing_with, flatten,
                     launchable, legalize_checked, legalize_cuda_emulated, randn)
from tvm import relax, tirx

import tvm_fuel
from tvm_fuel.deploy import nvcc as cuda
from tvm_fuel.diagnostics import FloorWarning
from tvm_fuel import op, reference
from tvm_fuel.target import device_arch, has_gpu
from tvm_fuel.testing.compare import DEVICE_SCALE, LSE_TOLERANCE
from tvm_fuel.models import llama, peers
from tvm_fuel.models.engine import LlamaEngine
from tvm_fuel.schedules.cuda import mma
from tvm_fuel.schedules.cuda.device import SHARED_MEMORY_LIMIT
from tvm_fuel.schedules.cuda.rules import shared_memory_fits

pytestmark = [pytest.mark.numerics, pytest.mark.slow]

ARCHS = ("sm_80", "sm_90")
SQ, SK = tirx.Var("sq", "int64"), tirx.Var("sk", "int64")
needs_nvcc = pytest.mark.skipif(not cuda.nvcc_available(), reason="nvcc is not installed")


def _target(arch: str) -> tvm.target.Target:
    return tvm.target.Target({"kind": "cuda", "arch": arch})


def _flash(dtype, sq=SQ, sk=SK, d=128, **options):
    params = dict(q=((2, 8, sq, d), dtype), k=((2, 2, sk, d), dtype), v=((2, 2, sk, d), dtype),
                  slopes=((8,), "float32"), mask=((sq, sk), "bool"))
    return build(lambda q, k, v, slopes, mask: op.flash_attn(q, k, v, slopes, mask, return_lse=True, **options),
                 params)


def _backward(dtype, name="flash_attn_backward", sq=SQ, sk=SK, d=64):
    params = dict(q=((2, 6, sq, d), dtype), k=((2, 2, sk, d), dtype), v=((2, 2, sk, d), dtype),
                  do=((2, 6, sq, d), dtype))
    return build(lambda **a: getattr(op, name)(**a, causal=True, softcap=5.0), params)


def _paged(dtype, sq=1, d=128, sinks=False, cache_dtype=None):
    nb, mb = tirx.Var("num_blocks", "int64"), tirx.Var("max_blocks", "int64")
    cache = ((nb, 16, 8, d), cache_dtype or dtype)
    params = dict(q=((4, 32, sq, d), dtype), k_cache=cache, v_cache=cache,
                  block_table=((4, mb), "int32"), context_lens=((4,), "int32"))
    if sinks:
        params["sinks"] = ((32,), "float32")
    if cache_dtype:  # int8: a scale per token and head; fp8: one per KV head
        scale = ((nb, 16, 8), "float32") if cache_dtype == "int8" else ((8,), "float32")
        params.update(k_scale=scale, v_scale=scale)
    return build(lambda **a: op.paged_attn(**a, causal=True), params)


CASES = {
    "flash_attn": lambda dtype: _flash(dtype, causal=True, softcap=5.0),
    "flash_attn_window": lambda dtype: _flash(dtype, d=40, window_size=(64, 0)),
    "flash_attn_sink_tokens": lambda dtype: _flash(dtype, d=64, causal=True, window_size=(64, -1), sink_tokens=4),
    "flash_attn_backward": lambda dtype: _backward(dtype),
    "flash_attn_backward_q": lambda dtype: _backward(dtype, "flash_attn_backward_q", d=128),
    "flash_attn_backward_k": lambda dtype: _backward(dtype, "flash_attn_backward_k"),
    "flash_attn_backward_v": lambda dtype: _backward(dtype, "flash_attn_backward_v"),
    "paged_decode": lambda dtype: _paged(dtype),
    "paged_multi_query": lambda dtype: _paged(dtype, sq=5, d=64),
    "paged_decode_sinks": lambda dtype: _paged(dtype, sinks=True),
    "paged_decode_fp8": lambda dtype: _paged(dtype, cache_dtype="float8_e4m3fn"),
    "paged_decode_int8": lambda dtype: _paged(dtype, cache_dtype="int8"),
    "paged_multi_query_e5m2": lambda dtype: _paged(dtype, sq=5, d=64, cache_dtype="float8_e5m2"),
}
QUANTIZED = {"paged_decode_fp8", "paged_decode_int8", "paged_multi_query_e5m2"}


def _floors_left(legalized: tvm.IRModule, kernels) -> list[str]:
    """The floor PrimFuncs a legalized module still holds (the paged host check is not one)."""
    return [gv.name_hint for gv in legalized.functions if gv.name_hint.startswith("fuel_")
            and gv.name_hint not in kernels and not gv.name_hint.startswith("fuel_paged_attn_check")]


def _kernel_funcs(mod: tvm.IRModule) -> dict[str, tirx.PrimFunc]:
    return {gv.name_hint: f for gv, f in mod.functions.items()
            if isinstance(f, tirx.PrimFunc) and f.attrs is not None and "fuel.workload" in f.attrs}


def _nvcc_case(case: str, dtype: str, arch: str) -> bool:
    # bfloat16 takes the float16 code path: three ops suffice
    return dtype != "bfloat16" or case in ("flash_attn", "flash_attn_backward", "paged_decode")


# each pair of a case, a dtype and an arch (a covering sample: 29 nvcc builds, not 58)
@needs_nvcc
@pytest.mark.parametrize("case,dtype,arch", pairwise(sorted(CASES), ["float16", "bfloat16", "float32"], ARCHS,
                                                     valid=_nvcc_case))
def test_kernels_compile_with_nvcc_and_fit_the_architecture(case, dtype, arch):
    target = _target(arch)
    legalized = tvm_fuel.transform.legalize(CASES[case](dtype), target, kernels="tuned")
    kernels = _kernel_funcs(legalized)
    leftover = _floors_left(legalized, kernels)
    assert kernels and not leftover, f"floor used for {leftover}"
    for name, func in kernels.items():
        assert buffers_growing_with(func, "sq", "sk") == [], f"{name} holds an [Sq, Sk] buffer"
    built, usage = cuda.build_with_shared_memory(legalized, target)
    source = cuda.cuda_source(built)
    defined = cuda.kernel_names(source)
    for name in kernels:  # every fuel kernel is a device kernel, not host code
        assert any(kernel.startswith(f"{name}_kernel") for kernel in defined), (name, defined)
    assert cuda.compile_cubin(source, arch)
    assert usage
    for kernel, (static, dynamic) in usage.items():
        assert launchable(static, dynamic, arch), (kernel, static, dynamic)
    if dtype != "float32":  # register tiles: S, P, dP, dS and the accumulators never leave the registers
        ptx = "bf16" if dtype == "bfloat16" else "f16"
        assert f"mma.sync.aligned.m16n8k16.row.col.f32.{ptx}.{ptx}.f32" in source and "wmma" not in source
        assert "ldmatrix.sync.aligned.m8n8.x4.shared.b16" in source and "ldmatrix.sync.aligned.m8n8.x4.trans" in source
        for name, func in kernels.items():
            loops = _streaming_loops(func)
            assert len(loops) == (2 if name == "fuel_flash_attn_backward_kernel"  # dk/dv, dq
                                  else 1), (name, len(loops))
            for loop_ops, stores in loops:
                assert {"tirx.ptx_legacy.mma", "tirx.ptx_legacy.ldmatrix"} <= loop_ops, name
                assert "backward" in case or "tirx.tvm_warp_shuffle_xor" in loop_ops  # the forward's row max
                assert not [s for s in stores if _stores_accumulator(s)], (name,
                                                                            sorted({s.buffer.name for s in stores}))
    if case in QUANTIZED:  # 8-bit tiles are dequantized on their way to shared memory: no cp.async
        assert "cp.async.cg.shared.global" not in source and "cp.async.ca.shared.global" not in source
        return
    # the tiles a block walks (K/V; Q/dO in the backward's dk/dv kernel) stream through a cp.async pipeline
    assert "cp.async.cg.shared.global" in source and "cp.async.wait_group" in source
    assert source.count("_async_commit_group();") >= 2  # the prologue's group and one per tile


@pytest.mark.parametrize("operand", ["a", "b", "b_trans"])
def test_ldmatrix_addresses_give_the_mma_fragments(operand):
    """The per-lane shared-memory rows the kernels hand ldmatrix.x4 leave, by the ISA's rule, each
    lane holding the elements the mma.m16n8k16 fragment layout (and the emulation) puts there:
    Q as A, K stored n-major and V stored k-major (.trans) as two 16x8 B tiles."""
    tile = [[100 * r + c for c in range(16)] for r in range(16)]
    for lane, got in enumerate(mma.fragment_from_ldmatrix(tile, operand)):
        if operand == "a":
            want = [tile[r][c] for r, c in (mma.a_element(lane, i) for i in range(8))]
        else:
            kn = [mma.b_element(lane, i % 4) for i in range(8)]
            at = [(k, n + 8 * (i // 4)) for i, (k, n) in enumerate(kn)]
            want = [tile[k][n] if operand == "b_trans" else tile[n][k] for k, n in at]
        assert got == want, (operand, lane)


def test_fragment_layouts_cover_the_tiles_once():
    """a_owner / b_owner (the emulated mma's gathers) invert the element maps; every entry of the
    16x16 A, 16x8 B and 16x8 C tiles sits in exactly one (lane, element)."""
    for element, owner, regs, size in ((mma.a_element, mma.a_owner, 8, 256), (mma.b_element, mma.b_owner, 4, 128)):
        places = {element(lane, i): (lane, i) for lane in range(32) for i in range(regs)}
        assert len(places) == size
        assert all(owner(*place) == slot for place, slot in places.items())
    assert len({mma.c_element(lane, i) for lane in range(32) for i in range(4)}) == 128
    # and agree with TVM's own mma intrinsics (an independent statement of the ISA's layout)
    from tvm.s_tir.tensor_intrin.cuda import shared_16x16_to_ldmatrix_32x8_layout as tvm_layout

    assert all(tuple(tvm_layout(r, c)) == mma.a_owner(r, c) for r in range(16) for c in range(16))
    assert all(tuple(tvm_layout(*mma.c_element(lane, i))) == (lane, i) for lane in range(32) for i in range(4))


def _ops_in(node) -> set[str]:
    found = set()
    tvm_ffi.structural_walk(node, (tvm.ir.expr.Call,
                                   lambda n: found.add(n.op.name) if isinstance(n.op, tvm.ir.Op) else None),
                            order="post")
    return found


def _stores_accumulator(store) -> bool:
    """A float32 store into shared memory of a computed value (a row statistic copied in from
    global memory, or a constant, is not one)."""
    if store.buffer.dtype != "float32" or not store.buffer.scope().startswith("shared"):
        return False
    value = store.value
    loaded = isinstance(value, tvm.ir.expr.TensorLoad) and value.source.scope() == "global"
    return not (loaded or isinstance(value, tirx.FloatImm))


def _streaming_loops(func: tirx.PrimFunc) -> list[tuple[set[str], list]]:
    """(ops, buffer stores) of each loop that walks streamed tiles while multiplying: the
    innermost loops that both commit cp.async groups and issue mma.sync (a pipeline's steady
    state, one key or query tile per step)."""
    loops = []
    tvm_ffi.structural_walk(func.body, (tirx.For, loops.append), order="post")
    steady = [loop for loop in loops if {"tirx.ptx.cp_async_commit_group", "tirx.ptx_legacy.mma"} <= _ops_in(loop.body)]

    def inner(loop):  # the steady loops strictly inside ``loop``
        found = []
        tvm_ffi.structural_walk(loop.body, (tirx.For, found.append), order="post")
        return [other for other in found if any(other.same_as(s) for s in steady)]

    result = []
    for loop in steady:
        if not inner(loop):
            stores = []
            tvm_ffi.structural_walk(loop.body, (tirx.BufferStore, stores.append), order="post")
            result.append((_ops_in(loop.body), stores))
    return result


@pytest.mark.parametrize("stages", [1, 2, 3])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_every_pipeline_depth_gives_the_reference(stages, dtype):
    """The tile pipelines' prologue, steady state and tail (fewer tiles than stages, a window that
    starts past the first tile, split-KV, empty sequences, the backward's walk over a GQA group),
    through the kernels' emulation with ``stages`` pinned."""
    rng = np.random.default_rng(stages)
    host = tvm.target.Target("llvm")
    q, k, v = randn(rng, (1, 4, 37, 64), dtype), randn(rng, (1, 2, 150, 64), dtype), randn(rng, (1, 2, 150, 64), dtype)
    # float32 at D 64: 16-row blocks keep the pinned K/V tiles' two- and three-stage blocks launchable
    rows = dict(block_q=16) if dtype == "float32" else {}
    cases = [(dict(causal=True), dict(block_q=16, block_k=16, threads=32)),
             (dict(window_size=(40, 0)), dict(block_k=32, **rows)),
             (dict(), dict(block_k=64, splits=2, **rows))]
    for options, knobs in cases:
        mod = build(lambda **a: op.flash_attn(**a, return_lse=True, **options),
                    {n: (a.shape, dtype) for n, a in dict(q=q, k=k, v=v).items()})
        legalized = legalize_cuda_emulated(mod, host, PinnedKnobs(stages=stages, **knobs))
        (kernel,) = _kernel_funcs(legalized).values()
        assert_pinned(kernel, stages=stages, **knobs)
        vm = tvm.relax.VirtualMachine(tvm.compile(legalized, target=host), tvm.cpu())
        out, lse = flatten(vm["main"](*map(tvm.runtime.tensor, (q, k, v))))
        want, want_lse = reference.flash_attn(q, k, v, return_lse=True, **options)
        assert_close(out, want, dtype, what=f"out {options} {knobs}")
        np.testing.assert_allclose(lse, want_lse, atol=1e-5, rtol=1e-5)
    table = rng.permutation(40)[:32].reshape(4, 8).astype("int32")
    lens = np.array([0, 17, 100, 128], "int32")
    k_cache, v_cache = randn(rng, (40, 16, 2, 64), dtype), randn(rng, (40, 16, 2, 64), dtype)
    q = randn(rng, (4, 6, 1, 64), dtype)
    params = dict(q=(q.shape, dtype), k_cache=(k_cache.shape, dtype), v_cache=(v_cache.shape, dtype),
                  block_table=(table.shape, "int32"), context_lens=(lens.shape, "int32"))
    mod = build(lambda **a: op.paged_attn(**a), params)
    legalized = legalize_cuda_emulated(mod, host, PinnedKnobs(stages=stages, block_k=16, threads=32))
    vm = tvm.relax.VirtualMachine(tvm.compile(legalized, target=host), tvm.cpu())
    (out,) = flatten(vm["main"](*map(tvm.runtime.tensor, (q, k_cache, v_cache, table, lens))))
    assert_close(out, reference.paged_attn(q, k_cache, v_cache, table, lens), dtype, what="paged out")
    # the backward streams Q/dO over every head of a GQA group (dk, dv) and K/V (dq)
    q, do = randn(rng, (1, 4, 37, 64), dtype), randn(rng, (1, 4, 37, 64), dtype)
    k, v = randn(rng, (1, 2, 70, 64), dtype), randn(rng, (1, 2, 70, 64), dtype)
    mod = build(lambda **a: op.flash_attn_backward(**a, causal=True),
                {n: (a.shape, dtype) for n, a in dict(q=q, k=k, v=v, do=do).items()})
    legalized = legalize_cuda_emulated(mod, host, PinnedKnobs(stages=stages, block_q=16, block_k=16, threads=32))
    vm = tvm.relax.VirtualMachine(tvm.compile(legalized, target=host), tvm.cpu())
    got = flatten(vm["main"](*map(tvm.runtime.tensor, (q, k, v, do))))
    for name, array, want in zip("qkv", got, reference.flash_attn_backward(q, k, v, do, causal=True)):
        assert_close(array, want, dtype, scale=4, what=f"d{name}")  # test_backward's scale


@needs_nvcc
@pytest.mark.parametrize("arch", ARCHS)
def test_no_register_spills_at_the_benchmark_shapes(arch):
    from tvm_fuel.deploy.suites import tune_buckets
    from tvm_fuel.tuning.buckets import bucket_module

    for op_name, shape in tune_buckets():  # the CUDA benchmark's shapes, hand-picked knobs
        source = cuda.cuda_source(tvm_fuel.compile(bucket_module(op_name, shape), _target(arch), kernels="tuned"))
        report = cuda.ptxas_report(source, arch)
        assert report and all(k["registers"] > 0 for k in report.values()), report
        spilled = {name: k for name, k in report.items() if k["spill_stores"] or k["spill_loads"] or k["stack_frame"]}
        assert not spilled, (op_name, shape, spilled)  # the register tiles stay in registers
        assert "#pragma unroll" in source  # fragment loops left to nvcc (the CUDA C stays compact)


def test_async_copies_address_tensors_past_2_gib():
    """K and V of 2^32 bytes (B16 Hkv8 Sk64k D128 fp16): the tile copies take 64-bit source addresses
    (TVM's own async-copy lowering narrows the offset to a 32-bit int)."""
    mod = build(lambda q, k, v: op.flash_attn(q, k, v, causal=True),
                dict(q=((16, 8, 128, 128), "float16"), k=((16, 8, 65536, 128), "float16"),
                     v=((16, 8, 65536, 128), "float16")))
    source = cuda.cuda_source(tvm_fuel.compile(mod, _target("sm_90"), kernels="tuned"))
    assert "legacy" not in source
    assert re.search(r'asm volatile\("cp\.async\.cg\.shared\.global \[%0\], \[%1\], 16;" *: *: *"r"\(__dst_mem\), '
                     r'"l"\(__src_mem\)', source)


def test_rules_decline_old_architectures_and_unfit_tiles():
    mod = _flash("float16")
    for target in (tvm.target.Target({"kind": "cuda", "arch": "sm_75"}), tvm.target.Target({"kind": "cuda"})):
        legalized = tvm_fuel.transform.legalize(mod, target, kernels="tuned")
        assert not _kernel_funcs(legalized), "sm_75 has no bfloat16 mma.sync: the floor (dlight) serves it"
    # head dim 1024 in float32 fits no tile shape in shared memory: the floor serves it
    big = build(lambda q, k, v: op.flash_attn(q, k, v),
                dict(q=((1, 2, 64, 1024), "float32"), k=((1, 2, 64, 1024), "float32"),
                     v=((1, 2, 64, 1024), "float32")))
    with pytest.warns(FloorWarning, match=r"flash_attn float32 .*D1024.* on sm_80: no tile shape fits .* the floor"):
        assert not _kernel_funcs(tvm_fuel.transform.legalize(big, _target("sm_80"), kernels="tuned"))


@needs_nvcc
@pytest.mark.parametrize("head_dim", [80, 256])
def test_large_head_dims_are_kernels_that_keep_their_warps(head_dim):
    """sm_90, float16: the forward, backward and paged decode at head dims 80 and 256 are kernels
    (not the floor), compile and fit; at 256 no tile keeps to the forward's register budget (the O
    fragment alone is 128 floats a thread), and the rule takes the tile needing the fewest
    accumulators with four warps, not the one-warp 16 x 16 tile, and ptxas keeps it in registers."""
    target = _target("sm_90")
    for mod in (_flash("float16", d=head_dim, causal=True), _backward("float16", d=head_dim),
                _paged("float16", d=head_dim)):
        legalized = tvm_fuel.transform.legalize(mod, target, kernels="tuned")
        kernels = _kernel_funcs(legalized)
        leftover = _floors_left(legalized, kernels)
        assert kernels and not leftover, f"floor used for {leftover}"
        built, usage = cuda.build_with_shared_memory(legalized, target)
        assert usage and all(static + dynamic <= SHARED_MEMORY_LIMIT["sm_90"] for static, dynamic in usage.values())
        report = cuda.ptxas_report(cuda.cuda_source(built), "sm_90")
        for name, func in kernels.items():
            if "backward" in name:
                continue  # at 256 its dK and dV strips outgrow the registers (README: what is left)
            knobs = applied_knobs(func)
            assert knobs["threads"] == 128, (name, knobs)
            if head_dim == 256 and name == "fuel_flash_attn_kernel":  # the fewest accumulators: 136 a thread
                assert (knobs["block_q"], knobs["block_k"]) == (32, 32), knobs
            spilled = {k: r for k, r in report.items()
                       if k.startswith(name) and (r["spill_stores"] or r["stack_frame"])}
            assert not spilled, spilled


@pytest.mark.parametrize("arch", ARCHS)
def test_every_head_dim_up_to_256_is_a_kernel(arch):
    """The rules' tile choice alone (no nvcc): forward, backward and paged decode at head dims 1 to
    256 get a kernel on both architectures in both code paths (register tiles, SIMT)."""
    for dtype in ("float16", "float32"):
        for d in (1, 112, 192, 256):  # the smallest, a padded one, the two past 128 that FA serves
            for mod in (_flash(dtype, d=d, causal=True), _backward(dtype, d=d), _paged(dtype, d=d)):
                legalized = tvm_fuel.transform.legalize(mod, _target(arch), kernels="tuned")
                kernels = _kernel_funcs(legalized)
                leftover = _floors_left(legalized, kernels)
                assert kernels and not leftover, (arch, dtype, d, leftover)


def test_split_kv_for_long_decode_contexts():
    mod = build(lambda **a: op.paged_attn(**a),
                dict(q=((1, 8, 1, 128), "float16"), k_cache=((600, 16, 1, 128), "float16"),
                     v_cache=((600, 16, 1, 128), "float16"), block_table=((1, 512), "int32"),
                     context_lens=((1,), "int32")))
    legalized = tvm_fuel.transform.legalize(mod, _target("sm_90"), kernels="tuned")
    (kernel,) = _kernel_funcs(legalized).values()
    source = cuda.cuda_source(tvm.compile(legalized, target=_target("sm_90")))
    assert len(cuda.kernel_names(source)) == 2, "one attention kernel and the lse merge"
    assert "B1 Sq1" in str(kernel.attrs["fuel.workload"])


# ---------------------------------------------------------------------------------------------
# On a GPU

requires_gpu = pytest.mark.skipif(not has_gpu(), reason="needs a CUDA device")


def _run_on_gpu(mod, arrays, kernels):
    """Run on device 0; with kernels="tuned" every op that has a CUDA kernel must run it (no floor)."""
    target = _target(device_arch())
    legalized = legalize_checked(mod, target, kernels)
    vm = tvm.relax.VirtualMachine(tvm_fuel.compile(legalized, target, kernels=kernels), tvm.cuda(0))
    return flatten(vm["main"](*[tvm.runtime.tensor(np.ascontiguousarray(a), device=tvm.cuda(0)) for a in arrays]))


@pytest.mark.gpu
@requires_gpu
@pytest.mark.parametrize("dtype", ["float16", "bfloat16", "float32"])
@pytest.mark.parametrize("options", [dict(), dict(causal=True, softcap=5.0), dict(window_size=(16, 0))])
@pytest.mark.parametrize("sq,sk,d", [(1, 97, 64), (97, 97, 128), (17, 300, 40)])
def test_gpu_flash_attn(sq, sk, d, options, dtype):
    rng = np.random.default_rng(0)
    q, k, v = randn(rng, (2, 6, sq, d), dtype), randn(rng, (2, 2, sk, d), dtype), randn(rng, (2, 2, sk, d), dtype)
    params = {n: (a.shape, dtype) for n, a in dict(q=q, k=k, v=v).items()}
    mod = build(lambda **a: op.flash_attn(**a, return_lse=True, **options), params)
    out, lse = _run_on_gpu(mod, [q, k, v], "tuned")
    want, want_lse = reference.flash_attn(q, k, v, return_lse=True, **options)
    assert_close(out, want, dtype, scale=DEVICE_SCALE, what="out")
    atol, rtol = LSE_TOLERANCE
    np.testing.assert_allclose(lse, want_lse, atol=atol * DEVICE_SCALE, rtol=rtol * DEVICE_SCALE)
    floor, _ = _run_on_gpu(mod, [q, k, v], "decomposed")
    assert_close(out, floor.astype(np.float64), dtype, scale=DEVICE_SCALE, what="out vs floor")


@pytest.mark.gpu
@requires_gpu
@pytest.mark.parametrize("dtype", ["float16", "float32"])
@pytest.mark.parametrize("name", ["flash_attn_backward", "flash_attn_backward_q", "flash_attn_backward_k",
                                  "flash_attn_backward_v"])
def test_gpu_flash_attn_backward(name, dtype):
    rng = np.random.default_rng(1)
    q, k, v, do = (randn(rng, s, dtype) for s in ((1, 6, 97, 64), (1, 2, 130, 64), (1, 2, 130, 64), (1, 6, 97, 64)))
    params = {n: (a.shape, dtype) for n, a in dict(q=q, k=k, v=v, do=do).items()}
    mod = build(lambda **a: getattr(op, name)(**a, causal=True, softcap=5.0), params)
    got = _run_on_gpu(mod, [q, k, v, do], "tuned")
    want = dict(zip(("dq", "dk", "dv"), reference.flash_attn_backward(q, k, v, do, causal=True, softcap=5.0)))
    wanted = [g for g in ("dq", "dk", "dv") if name == "flash_attn_backward" or name.endswith("_" + g[1])]
    for grad, array in zip(wanted, got):
        assert_close(array, want[grad], dtype, scale=max(4, DEVICE_SCALE), what=grad)  # test_backward's scale


@pytest.mark.gpu
@requires_gpu
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("sq,lens", [(1, (1, 17, 300, 2048)), (4, (4, 97, 64, 1000))])
def test_gpu_paged_attn(sq, lens, dtype):
    rng = np.random.default_rng(2)
    bs, hkv, d, mb = 16, 2, 128, 128
    q = randn(rng, (4, 14, sq, d), dtype)
    k_cache, v_cache = randn(rng, (600, bs, hkv, d), dtype), randn(rng, (600, bs, hkv, d), dtype)
    table = rng.permutation(600)[: 4 * mb].reshape(4, mb).astype("int32")
    context = np.array(lens, "int32")
    params = dict(q=(q.shape, dtype), k_cache=(k_cache.shape, dtype), v_cache=(v_cache.shape, dtype),
                  block_table=(table.shape, "int32"), context_lens=(context.shape, "int32"))
    mod = build(lambda **a: op.paged_attn(**a, causal=True), params)
    (out,) = _run_on_gpu(mod, [q, k_cache, v_cache, table, context], "tuned")
    want = reference.paged_attn(q, k_cache, v_cache, table, context, causal=True)
    assert_close(out, want, dtype, scale=DEVICE_SCALE, what="paged out")


@needs_nvcc
def test_the_decoder_builds_for_cuda():
    """The Llama-style decoder in float16: the fuel kernels, the in-graph KV append and dlight's
    schedules of the rest become one CUDA module that nvcc compiles."""
    mod, _ = llama.export(llama.LlamaConfig(dtype="float16"), num_blocks=16, gpu=True)
    source = cuda.cuda_source(tvm_fuel.compile(mod, _target("sm_90"), kernels="tuned"))
    names = cuda.kernel_names(source)
    for kernel in ("fuel_flash_attn_kernel", "fuel_paged_attn_kernel", "fuel_kv_append"):
        assert any(name.startswith(kernel) for name in names), (kernel, names)
    assert cuda.compile_cubin(source, "sm_90")


@pytest.mark.gpu
@requires_gpu
def test_gpu_decoder_generation():
    """On a device: paged decode reproduces the no-cache forward, which matches numpy (float16)."""
    config = llama.LlamaConfig(dtype="float16")
    arch = device_arch()
    engine = LlamaEngine(config, target=_target(arch), kernels="tuned", num_blocks=32, device=tvm.cuda(0))
    prompts = [[5], list(range(40)), list(range(3, 100))]
    result = engine.generate(prompts, max_new_tokens=8)
    for row, prompt in enumerate(prompts):
        full = np.array([prompt + result.tokens[row][:-1]])
        logits = engine.forward(full)[0]
        np.testing.assert_allclose(logits, peers.llama_logits(config, engine.weights, full)[0], atol=5e-2)
        decoded = np.stack([step[row] for step in result.decode_logits])
        np.testing.assert_allclose(decoded, logits[len(prompt):], atol=5e-2)


@needs_nvcc
def test_fuel_pipeline_leaves_other_ops_to_tvm_dispatch():
    """``tvm_fuel.pipeline`` in ``tvm.compile``: the fuel op becomes its kernel while ``topk`` and
    ``sort`` go through TVM's own CUDA dispatch (DispatchSortScan), and nvcc compiles the whole
    module. Legalizing every op up front (as tvm_fuel.compile once did) pre-empted that dispatch."""
    target = _target("sm_90")
    params = dict(q=((1, 4, 64, 64), "float16"), k=((1, 2, 64, 64), "float16"), v=((1, 2, 64, 64), "float16"))

    def make(q, k, v):
        out = op.flash_attn(q, k, v, causal=True)
        scores = relax.op.astype(relax.op.sum(out, axis=[3]), "float32")  # [1, 4, 64]
        return relax.Tuple([relax.op.sort(scores, axis=-1), relax.op.topk(scores, k=8, axis=-1)])

    mod = build(make, params)
    lowered = tvm_fuel.transform.LegalizeFuel(target, kernels="tuned")(mod)
    assert set(_kernel_funcs(lowered)) == {"fuel_flash_attn_kernel"}
    assert "R.sort(" in lowered["main"].script() and "R.topk(" in lowered["main"].script()  # left to TVM
    ex = tvm.compile(mod, target, relax_pipeline=tvm_fuel.pipeline(target, kernels="tuned"))
    source = cuda.cuda_source(ex)
    names = cuda.kernel_names(source)
    assert any("fuel_flash_attn_kernel" in name for name in names), names
    assert any("sort" in name for name in names), names
    assert cuda.compile_cubin(source, "sm_90")


def test_launch_needs_more_than_48k_dynamic_or_48k_in_all():
    """TVM 0.27's runtime lifts a kernel's dynamic shared-memory limit only past 48 KiB of
    dynamic bytes: 8448 static + 40960 dynamic failed to launch on an H200 (float32 D64)."""
    assert not shared_memory_fits(8448, 40960, 227 * 1024)
    assert shared_memory_fits(8448, 40704, 227 * 1024) and shared_memory_fits(8448, 51200, 227 * 1024)
    assert not shared_memory_fits(8448, 227 * 1024, 227 * 1024)


@pytest.mark.parametrize("dtype", ["float32", "float16"])
@pytest.mark.parametrize("d", [40, 64, 80, 96, 112, 160, 192, 256])
def test_every_head_dim_builds_a_launchable_block(dtype, d):
    """The measured shared memory of the forward and backward kernels at each head dim can be
    launched by TVM's runtime on sm_90 (the rules' estimate is what chose the tiles)."""
    for mod in (_flash(dtype, d=d, causal=True), _backward(dtype, d=d)):
        legalized = tvm_fuel.transform.legalize(mod, _target("sm_90"), kernels="tuned")
        assert not _floors_left(legalized, _kernel_funcs(legalized))
        _, usage = cuda.build_with_shared_memory(legalized, _target("sm_90"))
        assert usage and all(launchable(static, dynamic, "sm_90") for static, dynamic in usage.values()), (d, usage)


def test_shared_memory_limit_comes_from_the_target():
    """A target's ``max_shared_memory_per_block`` bounds the tiles (the architecture's table is
    the fallback): with 48 KiB the hand-picked forward tiles shrink to fit, and a point that
    fits sm_90's 227 KiB is refused by name."""
    from tvm_fuel.dispatch import workload_of
    from tvm_fuel.schedules import rule_for
    from tvm_fuel.schedules.cuda.tiles import CudaTiles, forward_smem

    mod = _flash("float16", d=128, causal=True)
    call = mod["main"].body.blocks[0].bindings[0].value
    small = tvm.target.Target({"kind": "cuda", "arch": "sm_90", "max_shared_memory_per_block": 48 * 1024})
    rule = rule_for("flash_attn", small)
    workload = workload_of("flash_attn", call)
    assert rule.serves(workload, small)
    wide = rule.default_knobs(workload, _target("sm_90"))
    narrow = rule.default_knobs(workload, small)
    need = {name: sum(forward_smem("float16", 128, CudaTiles(**knobs))) for name, knobs in (("narrow", narrow),
                                                                                            ("wide", wide))}
    assert need["narrow"] <= 48 * 1024 < need["wide"], need
    with pytest.raises(ValueError, match=r"more than the 49152 sm_90 gives a block"):
        rule.knobs(workload, small, wide)
