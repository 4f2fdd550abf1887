"""Shared test helpers: build a one-op Relax module, run it on llvm, compare per dtype."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path
from typing import Callable, Mapping

import ml_dtypes
import numpy as np
import tvm
import tvm_ffi
from tvm import relax, s_tir, tirx

import tvm_fuel
from tvm_fuel.testing.compare import TOLERANCE
from tvm_fuel.dispatch.records import KnobMatch  # one table: this suite's and the GPU node's
from tvm_fuel.schedules.cuda.device import SHARED_MEMORY_LIMIT

NP_DTYPE = {"float32": np.float32, "float16": np.float16, "bfloat16": ml_dtypes.bfloat16}


def randn(rng: np.random.Generator, shape, dtype: str = "float32", scale: float = 1.0) -> np.ndarray:
    return (rng.standard_normal(shape) * scale).astype(NP_DTYPE.get(dtype, dtype))


def int16_rounded(x: np.ndarray) -> np.ndarray:
    """``x`` (float32 rows) as the integer decode rounds it: each row to int16 with the unit
    max|row| / 32767, in float32's arithmetic as the kernel does it (float64 result)."""
    x = x.astype(np.float32)
    largest = np.abs(x).max(axis=-1, keepdims=True)
    nonzero = largest > 0
    codes = np.round(x * np.where(nonzero, np.float32(32767) / np.where(nonzero, largest, 1), np.float32(1)))
    return codes.astype(np.float64) * np.where(nonzero, largest * np.float32(1 / 32767), np.float32(1))


def integer_decode(q, k_cache, v_cache, block_table, context_lens, k_scale, v_scale) -> tuple[np.ndarray, np.ndarray]:
    """Causal decode over an int8 cache as the AVX2 kernel takes it in integers (float64): q rounded
    per row to int16 (``int16_rounded``, after its softmax scale), and each key tile's weights (the
    online softmax's 2^(s - running max) times the token's V scale) rounded per row to int16 with
    the unit max weight / 32767 before they multiply V's codes (key tiles of HOST's decode tiles).
    (out, slack), both [B, Hq, Sq, D]: slack is what a weight within float32's error of a half unit
    moves out by if the kernel rounds it the other way (a unit times its token's codes)."""
    from tvm_fuel import reference
    from tvm_fuel.schedules.cpu.tiles import tiles_for

    B, Hq, Sq, D = q.shape
    group = Hq // k_cache.shape[2]
    block_k = tiles_for(HOST, head_dim=D, rows=Sq * group).block_k
    out, slack = np.zeros((B, Hq, Sq, D)), np.zeros((B, Hq, Sq, D))
    for b in range(B):
        n = int(context_lens[b])
        k, v = (reference.gather_pages(c.astype(np.float64), block_table[b], n) for c in (k_cache, v_cache))
        ks, vs = (reference.gather_pages(s[..., None].astype(np.float64), block_table[b], n)[..., 0]
                  for s in (k_scale, v_scale))
        for h in range(Hq):
            g = h // group
            scores = int16_rounded(q[b, h].astype(np.float32) * np.float32(np.log2(np.e) / np.sqrt(D))) @ k[g].T * ks[g]
            scores[np.arange(n)[None, :] > np.arange(Sq)[:, None] + n - Sq] = -np.inf
            m, l, o, ties = np.full((Sq, 1), -np.inf), np.zeros((Sq, 1)), np.zeros((Sq, D)), np.zeros((Sq, D))
            for t in range(0, n, block_k):
                tile = scores[:, t:t + block_k]
                m_new = np.maximum(m, tile.max(axis=1, keepdims=True))
                shift = np.where(np.isfinite(m_new), m_new, 0)
                p, alpha = np.exp2(tile - shift), np.exp2(m - shift)
                l, o, ties, m = l * alpha + p.sum(axis=1, keepdims=True), o * alpha, ties * alpha, m_new
                weights = p * vs[g, t:t + block_k]
                unit = weights.max(axis=1, keepdims=True) / 32767
                units = weights / np.where(unit > 0, unit, 1)
                o += np.round(units) * unit @ v[g, t:t + block_k]
                # within float32's error of a half unit: the kernel's weight (exp2 to ~2e-7, its score
                # to float32's rounding) is off by up to ~1e-6 of itself
                ties += (np.abs(units % 1 - 0.5) < 1e-3 + 2e-6 * units) * unit @ np.abs(v[g, t:t + block_k])
            out[b, h], slack[b, h] = o / np.where(l > 0, l, 1), ties / np.where(l > 0, l, 1)
    return out, slack


def assert_integer_decode(out, inputs: dict, tol: float = 1e-5):
    """``out`` is ``integer_decode(**inputs)`` within float32's ``tol`` (absolute and relative) plus
    its near-tie slack."""
    emulated, ties = integer_decode(**inputs)
    assert np.all(np.abs(out - emulated) <= ties + tol + tol * np.abs(emulated))


def integer_q_k(head_dim: int, rows: int) -> bool:
    """Whether the tuned int8 decode on HOST takes q.k in integers (``int16_rounded`` q): an AVX2
    target (``CpuTiles.int16_dot``) and a head dim of whole 16-element vpmaddwd vectors, up to 256."""
    from tvm_fuel.schedules.cpu.tiles import tiles_for

    return bool(tiles_for(HOST, head_dim=head_dim, rows=rows).int16_dot) and head_dim % 16 == 0 and head_dim <= 256


def build(make: Callable[..., relax.Expr], params: Mapping[str, tuple], *, target="llvm") -> tvm.IRModule:
    """A module whose ``main(**params)`` returns ``make(**vars)``; params map name -> (shape, dtype)."""
    bb = relax.BlockBuilder()
    variables = {name: relax.Var(name, relax.TensorType(shape, dtype)) for name, (shape, dtype) in params.items()}
    with bb.function("main", list(variables.values())):
        with bb.dataflow():
            result = bb.emit_output(make(**variables))
        bb.emit_func_output(result)
    return bb.get()


def flatten(value) -> list[np.ndarray]:
    """A VM result (a tensor or nested tuples of them) as a flat list of numpy arrays."""
    if isinstance(value, tvm.runtime.Tensor):
        return [value.numpy()]
    return [array for item in value for array in flatten(item)]


def dense_inputs(rng: np.random.Generator, B: int, Hq: int, Hkv: int, Sq: int, Sk: int, D: int,
                 dtype: str = "float32", *, with_do: bool = False) -> dict[str, np.ndarray]:
    """Random q [B, Hq, Sq, D], k, v [B, Hkv, Sk, D] (and do like q): the dense ops' inputs."""
    inputs = dict(q=randn(rng, (B, Hq, Sq, D), dtype), k=randn(rng, (B, Hkv, Sk, D), dtype),
                  v=randn(rng, (B, Hkv, Sk, D), dtype))
    if with_do:
        inputs["do"] = randn(rng, (B, Hq, Sq, D), dtype)
    return inputs


BLOCK = 16  # the tests' paged block size


def paged_inputs(rng, lens, *, Hq=6, Hkv=2, Sq=1, D=40, dtype="float32", num_blocks=24, max_blocks=6,
                  shared_block=True, table_dtype="int32"):
    """paged_attn's inputs for sequences of context lengths ``lens``: a random cache of
    ``num_blocks`` blocks of BLOCK tokens, non-contiguous, permuted block tables padded with -1.

    With ``shared_block`` the first block of every sequence is the same id (a shared prefix).
    """
    B = len(lens)
    table = np.full((B, max_blocks), -1, np.int64)
    ids = rng.permutation(num_blocks)
    cursor = 1
    for b, n in enumerate(lens):
        live = -(-n // BLOCK)
        assert live <= max_blocks
        for i in range(live):
            if i == 0 and shared_block:
                table[b, i] = ids[0]
            else:
                table[b, i] = ids[cursor % num_blocks]
                cursor += 1
    return dict(q=randn(rng, (B, Hq, Sq, D), dtype),
                k_cache=randn(rng, (num_blocks, BLOCK, Hkv, D), dtype),
                v_cache=randn(rng, (num_blocks, BLOCK, Hkv, D), dtype),
                block_table=table.astype(table_dtype),
                context_lens=np.asarray(lens, table_dtype if table_dtype != "int64" else "int32"))


HOST = tvm_fuel.host_target()
# the floor's PrimFunc names of the ops the CPU rules serve (softmax_backward has no kernel)
FLOORS_WITH_CPU_KERNELS = {"fuel_flash_attn", "fuel_paged_attn", "fuel_flash_attn_backward",
                           "fuel_flash_attn_backward_q", "fuel_flash_attn_backward_k", "fuel_flash_attn_backward_v",
                           "fuel_flash_attn_jvp", "fuel_flash_attn_double_backward", "fuel_flash_attn_varlen",
                           "fuel_flash_attn_varlen_backward",
                           "fuel_layer_norm_backward_dx", "fuel_rms_norm_backward_dx"}


CUDA_EMULATED = "cuda-emulated"  # the CUDA kernels' one-thread emulation, built for llvm


def legalize_cuda_emulated(mod: tvm.IRModule, target: tvm.target.Target, records=None) -> tvm.IRModule:
    """``mod`` with its fuel ops lowered to the emulation of the CUDA kernels (for ``target``, an
    llvm target); ``records`` (a ``KnobSource``) may pin knobs."""
    from tvm_fuel.dispatch import tuned_legalize_map
    from tvm_fuel.schedules.cuda.rules import cuda_rules

    with target:
        return relax.transform.LegalizeOps(
            customize_legalize_map=tuned_legalize_map(target, records, rules=cuda_rules(emulated=True)))(mod)


def legalize_checked(mod: tvm.IRModule, target, kernels: str, **logs) -> tvm.IRModule:
    """``mod`` lowered through ``kernels`` (decomposed, tuned or cuda-emulated); a kernel path
    must not silently run the floor of an op that has a kernel (asserted)."""
    target = tvm_fuel.target.as_target(target)
    if kernels == CUDA_EMULATED:
        legalized = legalize_cuda_emulated(mod, target)
    else:
        legalized = tvm_fuel.transform.legalize(mod, target, kernels=kernels, **logs)
    if kernels != "decomposed":
        floors = [gv.name_hint for gv in legalized.functions if gv.name_hint in FLOORS_WITH_CPU_KERNELS]
        assert not floors, f"kernels={kernels!r} fell back to the floor for {floors}"
    return legalized


def matmul_rules(mod: tvm.IRModule, target, *, pack_params: bool = False) -> dict[str, str]:
    """The default rule (``schedules.cpu.generic.RULES``, the first that schedules it) of each fused
    TIR function of ``mod`` (its fuel ops on the tuned path; its weight parameters in panels where
    ``pack_params``) whose name holds "matmul": name -> rule."""
    from tvm_fuel.schedules.cpu.generic import RULES
    from tvm_fuel.transform.legalize_and_fuse import fuse
    from tvm_fuel.transform.pack_linear_weights import PackLinearParams

    target = tvm_fuel.target.as_target(target)
    if pack_params:
        mod = PackLinearParams(target)(mod)
    fused = fuse(tvm_fuel.transform.legalize(mod, target, kernels="tuned"), target)
    rules = {}
    for gvar, func in fused.functions_items():
        if isinstance(func, tvm.tirx.PrimFunc) and "matmul" in gvar.name_hint:
            rule = next((r for r in RULES if r.apply(func, target, False) is not None), None)
            rules[gvar.name_hint] = type(rule).__name__ if rule is not None else "none"
    return rules


class Runner:
    """A compiled module that runs on numpy arrays and returns a flat list of numpy outputs."""

    def __init__(self, mod: tvm.IRModule, target="llvm", *, kernels: str = "decomposed", **logs):
        target = tvm_fuel.target.as_target(target)
        legalized = legalize_checked(mod, target, kernels, **logs)
        self.vm = relax.VirtualMachine(tvm.compile(legalized, target=target), tvm.cpu())

    def __call__(self, *arrays: np.ndarray) -> list[np.ndarray]:
        # np.require keeps a 0-d array 0-d (ascontiguousarray makes it 1-d)
        return flatten(self.vm["main"](*[tvm.runtime.tensor(np.require(a, requirements="C")) for a in arrays]))


def run(make: Callable[..., relax.Expr], inputs: Mapping[str, np.ndarray], *,
        kernels: str = "decomposed") -> list[np.ndarray]:
    """Build ``make`` over static-shape inputs, compile for this CPU and run it once."""
    params = {name: (a.shape, str(a.dtype)) for name, a in inputs.items()}
    return Runner(build(make, params), HOST, kernels=kernels)(*inputs.values())


def assert_close(actual: np.ndarray, expected: np.ndarray, dtype: str, *, scale: float = 1.0, what: str = ""):
    """Per-dtype comparison; ``scale`` widens the tolerance for outputs that sum many terms."""
    atol, rtol = TOLERANCE[dtype]
    actual = np.asarray(actual).astype(np.float64)
    assert not np.isnan(actual).any(), f"{what}: NaN in the output"
    np.testing.assert_allclose(actual, expected, atol=atol * scale, rtol=rtol * scale, err_msg=what)


def varlen_offsets(lens) -> np.ndarray:
    """cu_seqlens [B + 1] int32 of sequences of ``lens``."""
    return np.concatenate([[0], np.cumsum(lens)]).astype(np.int32)


def varlen_kernel_inputs(spec, q_lens, k_lens, *, extra: int = 0, seed: int = 0) -> dict:
    """A varlen kernel's inputs for ``spec``: packed q (``extra`` rows past the last sequence), k, v,
    both offsets and, where the spec has ALiBi, slopes."""
    rng = np.random.default_rng(seed)
    cu_q, cu_k = varlen_offsets(q_lens), varlen_offsets(k_lens)
    Hq, Hkv, D, dtype = spec.num_q_heads, spec.num_kv_heads, spec.head_dim, spec.dtype
    inputs = dict(q=randn(rng, (cu_q[-1] + extra, Hq, D), dtype), k=randn(rng, (cu_k[-1], Hkv, D), dtype),
                  v=randn(rng, (cu_k[-1], Hkv, D), dtype), cu_seqlens_q=cu_q, cu_seqlens_k=cu_k)
    if spec.has_alibi:
        inputs["alibi_slopes"] = rng.uniform(0.0, 0.5, Hq).astype(np.float32)
    return inputs


def run_varlen_kernel(lib, spec, inputs: Mapping[str, np.ndarray]):
    """(out, lse or None) of a compiled varlen kernel; both start as NaN, so every element must be written."""
    total_q, Hq, D = inputs["q"].shape
    out = tvm.runtime.tensor(np.full((total_q, Hq, D), np.nan, inputs["q"].dtype))
    lse = tvm.runtime.tensor(np.full((Hq, total_q), np.nan, np.float32))
    lib(*(tvm.runtime.tensor(a) for a in inputs.values()), out, *([lse] if spec.return_lse else []))
    return out.numpy().astype(np.float64), (lse.numpy().astype(np.float64) if spec.return_lse else None)


def assert_varlen_matches(spec, out: np.ndarray, lse: np.ndarray | None, inputs: Mapping[str, np.ndarray]):
    """A varlen kernel's out (and lse [Hq, total_q], None without) against ``reference.flash_attn_varlen``
    for ``spec``'s options: rows without keys exactly -inf."""
    from tvm_fuel import reference
    from tvm_fuel.testing.compare import LSE_TOLERANCE

    cfg = spec.cfg
    q, k, v = (np.asarray(inputs[n]).astype(np.float64) for n in "qkv")
    want_out, want_lse = reference.flash_attn_varlen(
        q, k, v, inputs["cu_seqlens_q"], inputs["cu_seqlens_k"], inputs.get("alibi_slopes"),
        softmax_scale=cfg.softmax_scale, causal=cfg.causal, window_size=cfg.window_size, softcap=cfg.softcap,
        sink_tokens=cfg.sink_tokens, return_lse=True)
    assert_close(out, want_out, spec.dtype, what="out")
    if lse is not None:
        empty = np.isneginf(want_lse)
        np.testing.assert_array_equal(np.isneginf(lse), empty, err_msg="lse: the rows without keys")
        np.testing.assert_allclose(lse[~empty], want_lse[~empty], atol=4 * LSE_TOLERANCE[0],
                                   rtol=4 * LSE_TOLERANCE[1], err_msg="lse")


def varlen_backward_kernel_inputs(spec, q_lens, k_lens, *, extra: int = 0, seed: int = 0) -> dict:
    """A varlen backward kernel's inputs for ``spec``, in its parameter order: ``varlen_kernel_inputs``
    (q with ``extra`` rows past the last sequence), do like q (before the offsets), and the
    reference forward's out (q's dtype) and lse [Hq, total_q] float32."""
    from tvm_fuel import reference

    forward = varlen_kernel_inputs(spec, q_lens, k_lens, extra=extra, seed=seed)
    cfg = spec.cfg
    out, lse = reference.flash_attn_varlen(
        *(np.asarray(forward[n]).astype(np.float64) for n in "qkv"), forward["cu_seqlens_q"],
        forward["cu_seqlens_k"], forward.get("alibi_slopes"), softmax_scale=cfg.softmax_scale, causal=cfg.causal,
        window_size=cfg.window_size, softcap=cfg.softcap, sink_tokens=cfg.sink_tokens, return_lse=True)
    inputs = dict(q=forward["q"], k=forward["k"], v=forward["v"],
                  do=randn(np.random.default_rng(seed + 1), forward["q"].shape, spec.dtype))
    inputs.update({name: value for name, value in forward.items() if name not in inputs})
    inputs.update(out=out.astype(NP_DTYPE[spec.dtype]), lse=lse.astype(np.float32))
    return inputs


def run_varlen_backward_kernel(lib, inputs: Mapping[str, np.ndarray]) -> list[np.ndarray]:
    """[dq, dk, dv] (float64) of a compiled varlen backward kernel; they start as NaN, so every
    element must be written."""
    q, k = inputs["q"], inputs["k"]
    grads = [tvm.runtime.tensor(np.full(x.shape, np.nan, x.dtype)) for x in (q, k, k)]
    lib(*(tvm.runtime.tensor(a) for a in inputs.values()), *grads)
    return [g.numpy().astype(np.float64) for g in grads]


def assert_varlen_backward_matches(spec, grads, inputs: Mapping[str, np.ndarray], *, scale: float = 4.0):
    """A varlen backward's dq, dk, dv against ``reference.flash_attn_varlen_backward`` for ``spec``'s options."""
    from tvm_fuel import reference

    cfg = spec.cfg
    want = reference.flash_attn_varlen_backward(
        *(np.asarray(inputs[n]).astype(np.float64) for n in ("q", "k", "v", "do")), inputs["cu_seqlens_q"],
        inputs["cu_seqlens_k"], inputs.get("alibi_slopes"), softmax_scale=cfg.softmax_scale, causal=cfg.causal,
        window_size=cfg.window_size, softcap=cfg.softcap, sink_tokens=cfg.sink_tokens)
    for name, got, expected in zip(("dq", "dk", "dv"), grads, want):
        assert_close(got, expected, spec.dtype, scale=scale, what=name)


GUARD = 16  # NaN rows around a tensor (``guarded``): a read there would turn an output NaN, a write would show


def guarded(shape, dtype, fill) -> tuple[np.ndarray, np.ndarray]:
    """(array with GUARD NaN rows before and after, its 64-byte aligned middle [shape], filled):
    the middle is a kernel's tensor, the guard rows catch its reads and writes out of bounds."""
    rows = (shape[0] + 2 * GUARD,) + tuple(shape[1:])
    size = int(np.prod(rows))
    raw = np.full(size + 64, np.nan, dtype)
    skip = (-raw.ctypes.data % 64) // raw.itemsize
    whole = raw[skip:skip + size].reshape(rows)
    middle = whole[GUARD:GUARD + shape[0]]
    middle[...] = fill
    return whole, middle


def assert_guards_intact(whole: np.ndarray, what: str = ""):
    """The GUARD rows of a ``guarded`` array are still NaN (nothing wrote there)."""
    assert np.isnan(whole[:GUARD].astype(np.float64)).all(), what
    assert np.isnan(whole[-GUARD:].astype(np.float64)).all(), what


def buffers_growing_with(func: tirx.PrimFunc, a: str, b: str) -> list[str]:
    """Buffers allocated or declared inside ``func`` whose size depends on both variables ``a`` and ``b``
    (names compared case-insensitively: the kernels call their dims Sq, Sk, the floor keeps sq, sk)."""
    found = []

    def check(buffer):
        size = 1
        for dim in buffer.shape:
            size = size * dim
        if {a.lower(), b.lower()} <= {var.name.lower() for var in tirx.analysis.undefined_vars(size)}:
            found.append(buffer.name)

    tvm_ffi.structural_walk(func.body, ((tirx.AllocBuffer, tirx.DeclBuffer), lambda n: check(n.buffer)), order="post")
    def check_block(block):
        for buffer in block.alloc_buffers:
            check(buffer)

    tvm_ffi.structural_walk(func.body, (s_tir.SBlock, check_block), order="post")
    return found


class PinnedKnobs:
    """A KnobSource giving every kernel the same knobs (a point of its space); ``applied_knobs``
    reads back what a kernel was built with."""

    def __init__(self, **knobs):
        self.knobs = knobs

    def lookup(self, workload, target):
        return KnobMatch(dict(self.knobs), f"pinned {self.knobs}")


def kernel_llvm_ir(lib, kernel: str) -> str:
    """The LLVM IR of an executable built by ``tvm_fuel.compile`` for a CPU, after asserting that
    ``kernel``'s compute function is in it (the fuel kernel ran, not the floor)."""
    llvm_ir = lib.mod.imports[0].inspect_source("ll")
    assert re.search(rf"define .*@{kernel}_compute_\(", llvm_ir), f"no {kernel} was built (the floor ran)"
    return llvm_ir


def applied_knobs(func: tirx.PrimFunc) -> dict:
    """The knobs a performance-path kernel was built with (its ``fuel.knob_values``)."""
    return json.loads(str(func.attrs["fuel.knob_values"]))


def assert_pinned(func: tirx.PrimFunc, **knobs):
    """The kernel was built with these knob values (no silent fallback to other knobs)."""
    applied = applied_knobs(func)
    assert {name: applied.get(name) for name in knobs} == knobs, (applied, knobs)


def launchable(static: int, dynamic: int, arch: str) -> bool:
    """What TVM 0.27's runtime launches, written apart from the rules' ``shared_memory_fits``: static
    bytes within 48 KiB, the total within the architecture's block limit, and dynamic bytes that
    either fit the driver's default (48 KiB less the static) or exceed 48 KiB (only then does the
    runtime raise the kernel's limit; 8448 + 40960 bytes failed to launch on an H200)."""
    return (static <= 48 * 1024 and static + dynamic <= SHARED_MEMORY_LIMIT[arch]
            and (static + dynamic <= 48 * 1024 or dynamic > 48 * 1024))


def has_torch() -> bool:
    """Whether PyTorch (the peer the suite compares against) is importable."""
    try:
        import torch  # noqa: F401
    except ImportError:
        return False
    return True


# the attention windows the forward tests sweep (the floor's, the kernels', the expansion's)
WINDOWS = {
    "full": dict(),
    "causal": dict(causal=True),
    "left": dict(window_size=(5, -1)),
    "right": dict(window_size=(-1, 3)),
    "two_sided": dict(window_size=(4, 2)),
    "causal_left": dict(causal=True, window_size=(6, -1)),
}


def suite_conftest(folder: Path):
    """The suite's conftest.py and the modules it installs, copied into ``folder`` (a test suite of
    a test's own, run in a fresh pytest)."""
    for name in ("conftest.py", "compile_cache.py", "compile_clock.py"):
        shutil.copy(Path(__file__).parent / name, Path(folder) / name)
