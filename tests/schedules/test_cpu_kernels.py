"""Structure of the CPU performance path: the kernels are really used, never hold a buffer
that grows with Sq * Sk, and survive fusion. (Numerics: test_flash_attn.py, test_paged_attn.py.)"""

from __future__ import annotations

import numpy as np
import pytest
import tvm
from helpers import HOST, build, buffers_growing_with, run
from tvm import relax, tirx

import tvm_fuel
from tvm_fuel import op

pytestmark = pytest.mark.numerics

SQ, SK = tirx.Var("sq", "int64"), tirx.Var("sk", "int64")


def _flash_module(**options):
    params = dict(q=((1, 8, SQ, 64), "float16"), k=((1, 2, SK, 64), "float16"), v=((1, 2, SK, 64), "float16"),
                  slopes=((8,), "float32"), mask=((SQ, SK), "bool"))
    return build(lambda q, k, v, slopes, mask: op.flash_attn(q, k, v, slopes, mask, return_lse=True, **options),
                 params)


def _paged_module():
    nb, mb = tirx.Var("num_blocks", "int64"), tirx.Var("max_blocks", "int64")
    params = dict(q=((4, 8, SQ, 64), "float32"), k_cache=((nb, 16, 2, 64), "float32"),
                  v_cache=((nb, 16, 2, 64), "float32"), block_table=((4, mb), "int32"), context_lens=((4,), "int32"))
    return build(lambda **a: op.paged_attn(**a, causal=True), params)


def _prim_funcs(mod):
    return {gv.name_hint: f for gv, f in mod.functions.items() if isinstance(f, tirx.PrimFunc)}


@pytest.mark.parametrize("options", [dict(), dict(causal=True, softcap=5.0, window_size=(64, -1))])
def test_flash_attn_uses_the_kernel_without_score_buffers(options):
    funcs = _prim_funcs(tvm_fuel.transform.legalize(_flash_module(**options), HOST, kernels="tuned"))
    assert list(funcs) == ["fuel_flash_attn_kernel"]
    kernel = funcs["fuel_flash_attn_kernel"]
    assert kernel.attrs["tirx.is_scheduled"]
    assert buffers_growing_with(kernel, "sq", "sk") == []


@pytest.mark.parametrize("given", [(), ("out", "lse")])
def test_flash_attn_backward_uses_the_kernel_without_score_buffers(given):
    """Without out/lse the forward kernel runs first; either way no [Sq, Sk] buffer exists."""
    params = dict(q=((2, 6, SQ, 40), "float32"), k=((2, 2, SK, 40), "float32"), v=((2, 2, SK, 40), "float32"),
                  do=((2, 6, SQ, 40), "float32"), out=((2, 6, SQ, 40), "float32"), lse=((2, 6, SQ), "float32"))

    def make(q, k, v, do, out, lse):
        state = {"out": out, "lse": lse} if given else {}
        return op.flash_attn_backward(q, k, v, do, causal=True, softcap=2.0, **state)

    funcs = _prim_funcs(tvm_fuel.transform.legalize(build(make, params), HOST, kernels="tuned"))
    expected = {"fuel_flash_attn_backward_kernel"} | (set() if given else {"fuel_flash_attn_kernel"})
    assert set(funcs) == expected
    for func in funcs.values():
        assert buffers_growing_with(func, "sq", "sk") == []


def test_the_score_buffer_check_catches_the_floor():
    """The same inspection flags the decomposition, which materializes [B, Hq, Sq, Sk] scores, and
    sees the kernel's own buffers that grow with one length (the packed key tiles)."""
    funcs = _prim_funcs(tvm_fuel.transform.legalize(_flash_module(), HOST, kernels="decomposed"))
    assert buffers_growing_with(funcs["fuel_flash_attn"], "sq", "sk")
    kernel = _prim_funcs(tvm_fuel.transform.legalize(_flash_module(), HOST, kernels="tuned"))["fuel_flash_attn_kernel"]
    assert {"k_tiles", "v_tiles"} <= set(buffers_growing_with(kernel, "sk", "sk"))


def test_paged_attn_uses_the_kernel_without_gathering():
    funcs = _prim_funcs(tvm_fuel.transform.legalize(_paged_module(), HOST, kernels="tuned"))
    assert set(funcs) == {"fuel_paged_attn_kernel", "fuel_paged_attn_check"}
    kernel = funcs["fuel_paged_attn_kernel"]
    assert buffers_growing_with(kernel, "sq", "max_blocks") == []
    assert buffers_growing_with(kernel, "max_blocks", "max_blocks") == []  # no gathered copy of the cache
    assert "k_cache[block" in kernel.script()  # key tiles read straight from the pages


def test_kernels_stay_unfused_with_neighbours():
    params = dict(q=((1, 4, 17, 32), "float32"), k=((1, 4, 17, 32), "float32"), v=((1, 4, 17, 32), "float32"))

    def make(q, k, v):
        return relax.op.add(op.flash_attn(relax.op.multiply(q, q), k, v), v)

    bb = relax.BlockBuilder()
    variables = [relax.Var(n, relax.TensorType(s, d)) for n, (s, d) in params.items()]
    with bb.function("main", variables):
        with bb.dataflow():
            q, k, v = variables
            x = bb.emit(relax.op.multiply(q, q))
            y = bb.emit(op.flash_attn(x, k, v))
            out = bb.emit_output(relax.op.add(y, v))
        bb.emit_func_output(out)
    legalized = tvm_fuel.transform.legalize(bb.get(), HOST, kernels="tuned")
    with HOST:
        fused = tvm.transform.Sequential([relax.transform.AnnotateTIROpPattern(), relax.transform.FuseOps(),
                                          relax.transform.FuseTIR()])(legalized)
    funcs = _prim_funcs(fused)
    assert "fuel_flash_attn_kernel" in funcs and funcs["fuel_flash_attn_kernel"].attrs["tirx.is_scheduled"]
    assert not any("fuel_flash_attn" in name and name != "fuel_flash_attn_kernel" for name in funcs)


def test_rules_decline_what_they_cannot_serve():
    """Symbolic head dim -> the floor, on llvm and on cuda; the CPU rules never serve a cuda target."""
    d = tirx.Var("d", "int64")
    mod = build(lambda **a: op.flash_attn(**a), dict(q=((1, 2, 5, d), "float32"), k=((1, 2, 5, d), "float32"),
                                                     v=((1, 2, 5, d), "float32")))
    cuda = tvm.target.Target({"kind": "cuda", "arch": "sm_80"})
    for target in (HOST, cuda):
        assert "fuel_flash_attn" in _prim_funcs(tvm_fuel.transform.legalize(mod, target, kernels="tuned"))
    from tvm_fuel.schedules import rules_for

    assert all(rule.target_kinds == ("cuda",) for rule in rules_for(cuda))


def test_generic_llvm_target_still_correct():
    """Plain "llvm" (baseline x86-64, 4 lanes) builds the kernels with narrower vectors."""
    rng = np.random.default_rng(0)
    q, k, v = (rng.standard_normal((1, 2, 33, 40)).astype("float32") for _ in range(3))
    mod = build(lambda **a: op.flash_attn(**a, causal=True), dict(q=(q.shape, "float32"), k=(k.shape, "float32"),
                                                                   v=(v.shape, "float32")))
    vm = relax.VirtualMachine(tvm_fuel.compile(mod, "llvm", kernels="tuned"), tvm.cpu())
    out = vm["main"](*map(tvm.runtime.tensor, (q, k, v))).numpy()
    np.testing.assert_allclose(out, tvm_fuel.reference.flash_attn(q, k, v, causal=True), atol=2e-5, rtol=2e-5)


@pytest.mark.parametrize("which", ["flash_attn", "flash_attn_backward", "paged_attn"])
def test_tuned_matches_the_decomposition(which):
    """The layer below directly: the CPU kernel against the compiled floor on one awkward case."""
    rng = np.random.default_rng(11)
    if which == "paged_attn":
        table = np.full((3, 7), -1, np.int32)
        table[0, :2], table[1, :7], table[2, :1] = [4, 9], rng.permutation(12)[:7], [4]
        inputs = dict(q=rng.standard_normal((3, 7, 3, 40)).astype(np.float32),
                      k_cache=rng.standard_normal((12, 16, 1, 40)).astype(np.float32),
                      v_cache=rng.standard_normal((12, 16, 1, 40)).astype(np.float32),
                      block_table=table, context_lens=np.array([17, 97, 1], np.int32))
        make = lambda **a: op.paged_attn(**a, causal=True, softcap=4.0)  # noqa: E731
    else:
        inputs = dict(q=rng.standard_normal((2, 6, 97, 40)).astype(np.float32),
                      k=rng.standard_normal((2, 2, 17, 40)).astype(np.float32),
                      v=rng.standard_normal((2, 2, 17, 40)).astype(np.float32))
        if which == "flash_attn_backward":
            inputs["do"] = rng.standard_normal((2, 6, 97, 40)).astype(np.float32)
        make = lambda **a: getattr(op, which)(**a, causal=True, window_size=(9, -1), softcap=4.0)  # noqa: E731
    tuned = run(make, inputs, kernels="tuned")
    floor = run(make, inputs, kernels="decomposed")
    for t, f in zip(tuned, floor):
        np.testing.assert_allclose(t, f, atol=1e-5, rtol=1e-5)


def test_avx512_targets_get_16_lane_kernels():
    """Built (not run: this CPU may lack AVX-512) for an AVX-512 target, the kernels use zmm registers."""
    target = tvm.target.Target({"kind": "llvm", "mcpu": "skylake-avx512", "num-cores": 2})
    legalized = tvm_fuel.transform.legalize(_flash_module(causal=True), target, kernels="tuned")
    kernel = _prim_funcs(legalized)["fuel_flash_attn_kernel"]
    assembly = tvm.compile(kernel, target=target).mod.inspect_source("asm")
    assert "zmm" in assembly and "vfmadd" in assembly


def test_hand_picked_register_tiles_follow_the_vector_registers():
    """AVX-512's 32 registers take 8 x 2-vector register tiles over 128-key tiles (16 accumulators:
    the FMA chains its latency needs), AVX2's 16 take 4 x 2 over 64 keys; decode rows (streamed, no
    GEMM) are not padded (a group of 1 padded to 4 rows did 4x its FMAs), add 4 value rows per
    accumulator pass and prefetch ~64 KiB of rows ahead; int8 decode's integer q.k is AVX2's."""
    from tvm_fuel.schedules.cpu.tiles import tiles_for, vector_registers

    avx512 = tvm.target.Target({"kind": "llvm", "mcpu": "skylake-avx512"})
    avx2 = tvm.target.Target({"kind": "llvm", "mcpu": "haswell"})
    assert (vector_registers(avx512), vector_registers(avx2)) == (32, 16)
    wide = tiles_for(avx512, head_dim=128, rows=None)
    assert (wide.lanes, wide.micro_rows, wide.key_vecs, wide.dim_vecs, wide.block_k) == (16, 8, 2, 2, 128)
    narrow = tiles_for(avx2, head_dim=128, rows=None)
    assert (narrow.lanes, narrow.micro_rows, narrow.key_vecs, narrow.dim_vecs, narrow.block_k) == (8, 4, 2, 2, 64)
    decode = tiles_for(avx512, head_dim=128, rows=4, num_kv_heads=8, batch=8)
    assert (decode.block_q, decode.value_tokens, decode.prefetch) == (4, 4, 16)
    assert tiles_for(avx512, head_dim=128, rows=4, num_kv_heads=8, batch=8, element_bytes=2).prefetch == 32
    for rows, micro_rows in ((1, 1), (2, 2), (3, 1), (6, 2), (7, 1), (8, 4)):  # up to STREAMING_ROWS
        tiles = tiles_for(avx2, head_dim=128, rows=rows)
        assert (tiles.block_q, tiles.micro_rows) == (rows, micro_rows)  # dense GEMMs get whole micro tiles
    # int8 decode's integer q.k: AVX2 only (its vpmaddwd; measured there)
    targets = {"haswell": 1, "znver3": 1, "skylake-avx512": 0, "sandybridge": 0}
    for mcpu, expected in targets.items():
        assert tiles_for(tvm.target.Target({"kind": "llvm", "mcpu": mcpu}), head_dim=64, rows=1).int16_dot == expected
    assert tiles_for(tvm.target.Target("llvm"), head_dim=64, rows=1).int16_dot == 0
    arm = tvm.target.Target({"kind": "llvm", "mtriple": "aarch64-linux-gnu", "mcpu": "cortex-a72"})
    assert tiles_for(arm, head_dim=64, rows=1).int16_dot == 0
    assert tiles_for(avx512, head_dim=128, rows=None).prefetch == 0  # GEMM paths stream nothing
    assert tiles_for(avx512, head_dim=128, rows=17).block_q == 24  # GEMM rows: whole register tiles


@pytest.mark.parametrize("rows, lanes", [(1, 16), (3, 16), (4, 16), (6, 8), (8, 4), (8, 16), (5, 1), (16, 4)])
def test_row_sums_shuffle_tree_matches_numpy(rows, lanes):
    """Decode's q.k ends in horizontal sums folded across rows by shuffles: every row's sum lands
    where the kernel reads it, for padded row counts, rows beyond the lanes, and scalar lanes."""
    from tvm.script import tirx as T

    from tvm_fuel.schedules.cpu.micro import store_row_sums

    padded = 1 << (rows - 1).bit_length()

    @T.prim_func
    def row_sums(x: T.Buffer((rows, lanes), "float32"), out: T.Buffer((rows,), "float32")):
        acc = T.alloc_buffer((rows, lanes), "float32", scope="local")
        sums = T.alloc_buffer((padded,), "float32", scope="local")
        for r in T.unroll(rows):
            for v in T.vectorized(lanes):
                acc[r, v] = x[r, v]
        store_row_sums(sums, acc, rows, lanes)
        for r in range(rows):
            out[r] = sums[r]

    x = np.random.default_rng(rows * lanes).standard_normal((rows, lanes)).astype(np.float32)
    out = tvm.runtime.tensor(np.zeros(rows, np.float32))
    tvm.compile(row_sums, target=HOST)(tvm.runtime.tensor(x), out)
    np.testing.assert_allclose(out.numpy(), x.sum(axis=1), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("n", [1, 2, 5, 16, 17])
def test_balanced_order_pairs_light_and_heavy_tiles(n):
    """Causal tasks are ordered 0, n-1, 1, n-2, ...: a permutation, so that each contiguous chunk
    a thread takes holds tiles whose causal work sums evenly."""
    from tvm_fuel.schedules.common import balanced_order

    analyzer = tvm.sym.Analyzer()
    order = [int(analyzer.simplify(balanced_order(tirx.const(j, "int64"), tirx.const(n, "int64")))) for j in range(n)]
    assert sorted(order) == list(range(n))
    work = [t + 1 for t in order]  # causal work of row tile t
    halves = sum(work[: (n + 1) // 2]), sum(work[(n + 1) // 2:])
    assert max(halves) <= min(halves) + n  # in order, the second half would carry ~3x the first


@pytest.mark.parametrize("softcap", [0.0, 30.0])
def test_kernels_call_no_scalar_libm_exp(softcap):
    """Every exp of the CPU kernels stays in vector registers: LLVM lowers a vector ``exp`` to one
    libm ``expf`` call per lane, which had cost the backward a third of its time."""
    from tvm_fuel.op.config import AttnConfig
    from tvm_fuel.schedules.cpu.backward import flash_backward
    from tvm_fuel.schedules.cpu.forward import dense_forward
    from tvm_fuel.schedules.cpu.tiles import tiles_for
    from tvm_fuel.schedules.workload import KernelSpec

    spec = KernelSpec(dtype="float32", num_q_heads=4, num_kv_heads=2, head_dim=64,
                      cfg=AttnConfig(causal=True, softcap=softcap))
    tiles = tiles_for(HOST, head_dim=64, rows=None)
    dims = dict(B=1, Sq=128, Sk=128)
    for kernel in (dense_forward(spec, tiles, dims=dims),
                   flash_backward(spec, tiles, grads=("dq", "dk", "dv"), dims=dims)):
        lib = tvm.compile(tvm.IRModule({"main": kernel}), target=HOST)
        asm = (lib.mod if hasattr(lib, "mod") else lib).inspect_source("asm")
        assert "expf" not in asm and "tanhf" not in asm


@pytest.mark.parametrize("name", ["fast_exp", "fast_exp2", "fast_tanh"])
def test_vectorized_transcendentals_match_numpy(name):
    """The kernels' own exp, exp2 and tanh (they vectorize where LLVM's call libm per lane): within
    a few float32 ulp of numpy in float64, exactly 0 far below (and at -inf), NaN kept NaN."""
    from tvm import te

    from tvm_fuel.op import semantics as sem

    fn, exact, lo, hi, floor = {"fast_exp": (sem.fast_exp, np.exp, -90.0, 88.0, -87.0),
                                "fast_exp2": (sem.fast_exp2, np.exp2, -130.0, 127.0, -126.0),
                                "fast_tanh": (sem.fast_tanh, np.tanh, -12.0, 12.0, None)}[name]
    x = te.placeholder((1 << 16,), "float32")
    y = te.compute(x.shape, lambda i: fn(x[i]))
    built = tvm.compile(te.create_prim_func([x, y]), target=HOST)
    xs = np.concatenate([np.linspace(lo, hi, (1 << 16) - 2, dtype=np.float32), [-np.inf, np.nan]]).astype(np.float32)
    out = tvm.runtime.tensor(np.zeros_like(xs))
    built(tvm.runtime.tensor(xs), out)
    got, want = out.numpy()[:-2].astype(np.float64), exact(xs[:-2].astype(np.float64))
    if name == "fast_tanh":
        np.testing.assert_allclose(got, want, atol=2e-7)
        assert out.numpy()[-2] == -1.0
    else:
        normal = want > 1e-37
        assert np.max(np.abs(got[normal] - want[normal]) / want[normal]) < 4e-7
        assert np.all(got[xs[:-2] < floor] == 0) and out.numpy()[-2] == 0.0
    assert np.isnan(out.numpy()[-1])


@pytest.mark.parametrize("which", ["flash_attn", "paged_attn"])
def test_a_nan_key_makes_exactly_the_rows_that_see_it_nan(which):
    """IEEE: a NaN in a key reaches every output row that attends to it (kernel and floor alike);
    causal rows before it stay finite and equal to the floor."""
    rng = np.random.default_rng(5)
    if which == "paged_attn":
        k_cache = rng.standard_normal((4, 16, 1, 64)).astype(np.float32)
        k_cache[1, 3, 0, 7] = np.nan  # token 19 of the sequence
        inputs = dict(q=rng.standard_normal((1, 2, 24, 64)).astype(np.float32), k_cache=k_cache,
                      v_cache=rng.standard_normal((4, 16, 1, 64)).astype(np.float32),
                      block_table=np.array([[0, 1]], np.int32), context_lens=np.array([24], np.int32))
        make = lambda **a: op.paged_attn(**a, causal=True)  # noqa: E731
        nan_from = 19
    else:
        k = rng.standard_normal((1, 1, 40, 64)).astype(np.float32)
        k[0, 0, 29, 3] = np.nan
        inputs = dict(q=rng.standard_normal((1, 2, 40, 64)).astype(np.float32), k=k,
                      v=rng.standard_normal((1, 1, 40, 64)).astype(np.float32))
        make = lambda **a: op.flash_attn(**a, causal=True)  # noqa: E731
        nan_from = 29
    (tuned,), (floor,) = run(make, inputs, kernels="tuned"), run(make, inputs, kernels="decomposed")
    rows_nan = np.isnan(tuned).any(axis=-1)
    assert rows_nan[..., nan_from:].all() and not rows_nan[..., :nan_from].any()
    np.testing.assert_array_equal(np.isnan(floor).any(axis=-1), rows_nan)
    np.testing.assert_allclose(tuned[..., :nan_from, :], floor[..., :nan_from, :], atol=1e-5, rtol=1e-5)
