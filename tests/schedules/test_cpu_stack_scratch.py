"""TVM 0.27 lowers every ``local``-scope buffer of a CPU PrimFunc, and every mutable TVMScript scalar
(``x: T.int64 = e``, ``x = e``: a ``local`` buffer of one element), to a ``TVMBackendAllocWorkspace``
heap block (``LowerTVMBuiltin`` keeps only small ``global`` buffers as allocas). LLVM cannot keep
such a block in registers or drop its dead stores, and must assume it aliases every other one: the
int8 decode stored, zeroed and reloaded its score accumulators for every token and head, and the
online softmax called the allocator for every row and key tile. The paged kernel allocates its own
scratch in the default scope (an alloca, promoted to registers) and binds its per-tile and
per-token scalars with ``T.let``; so do the softmax and int16 rounding macros. The FMA probe of
``bench`` (the "of peak" figures) must not spill its chains either."""

from __future__ import annotations

import re

import pytest
import tvm
from helpers import build, HOST, kernel_llvm_ir

import tvm_fuel
from tvm_fuel import op
from tvm_fuel.bench.attention import fma_chains, fma_kernel

pytestmark = pytest.mark.integration

# a call through TVM's workspace allocator: (name, bytes)
_HEAP = re.compile(r"%([\w.]+) = tail call ptr %\d+\(i32 1, i32 %dev_id, i64 (\d+)")
# the per-row scratch of the softmax and int16 rounding macros (micro.py) that every kernel shares
ROW_SCRATCH = {"part_max", "part_sum", "row", "stats", "shift"}
# the decode kernel's own per-tile and per-token scratch and scalars (its per-task scalars stay
# mutable: as T.let bindings they cost TVM's passes 28 % of the build)
PAGED_SCRATCH = {"acc", "acc_i", "sums", "sums_i", "codes", "pages", "pages_ahead", "ahead", "kt", "live",
                 "block"} | ROW_SCRATCH


def _heap_blocks(llvm_ir: str) -> dict[str, int]:
    # the workspace calls of a built module's LLVM IR, by buffer name (LLVM's numeric suffixes dropped)
    return {re.sub(r"\d+$", "", name): int(size) for name, size in _HEAP.findall(llvm_ir)}


def _decode_module(cache_dtype: str) -> tvm.IRModule:
    cache = ((24, 16, 2, 64), cache_dtype)
    shapes = dict(q=((2, 8, 1, 64), "bfloat16"), k_cache=cache, v_cache=cache, block_table=((2, 6), "int32"),
                  context_lens=((2,), "int32"))
    if cache_dtype == "int8":
        shapes.update(k_scale=((24, 16, 2), "float32"), v_scale=((24, 16, 2), "float32"))
    elif cache_dtype.startswith("float8"):
        shapes.update(k_scale=((2,), "float32"), v_scale=((2,), "float32"))
    return build(op.paged_attn, shapes)


# built, never run: the integer decode (and its int16 rounding) exists on AVX2 targets only
AVX2 = tvm.target.Target({"kind": "llvm", "mcpu": "znver3", "num-cores": 2})


@pytest.mark.parametrize("cache_dtype", ["int8", "bfloat16", "float8_e4m3fn"])
def test_the_decode_kernel_keeps_its_scratch_off_the_heap(cache_dtype):
    llvm_ir = kernel_llvm_ir(tvm_fuel.compile(_decode_module(cache_dtype), AVX2, kernels="tuned"),
                             "fuel_paged_attn_kernel")
    heap = _heap_blocks(llvm_ir)
    assert "S_all" in heap  # the task's large buffers stay heap blocks: the pattern finds them
    if cache_dtype == "int8":  # the integer path, which rounds rows to int16, is the one built
        assert "llvm.x86.avx2.pmadd.wd" in llvm_ir
    assert not {name: size for name, size in heap.items() if name in PAGED_SCRATCH}


@pytest.mark.parametrize("causal", [False, True])
def test_the_forward_keeps_its_row_scratch_off_the_heap(causal):
    shape = ((1, 4, 37, 64), "float32")
    mod = build(lambda q, k, v: op.flash_attn(q, k, v, causal=causal), dict(q=shape, k=shape, v=shape))
    llvm_ir = kernel_llvm_ir(tvm_fuel.compile(mod, HOST, kernels="tuned"), "fuel_flash_attn_kernel")
    heap = _heap_blocks(llvm_ir)
    assert "S" in heap  # the score tile (over 1 KiB) stays a heap block: the pattern finds it
    assert not {name: size for name, size in heap.items() if name in ROW_SCRATCH}


@pytest.mark.parametrize("mcpu", ["znver3", "znver4"])  # AVX2 (16 vector registers), AVX-512 (32)
def test_the_fma_probe_keeps_its_chains_in_registers(mcpu):
    target = tvm.target.Target({"kind": "llvm", "mcpu": mcpu, "num-cores": 2})
    kernel, _ = fma_kernel(target, 2, iters=64)
    asm = tvm.compile(kernel, target=target).mod.inspect_source("asm")
    fma_lines = [line for line in asm.splitlines() if "vfmadd" in line]
    assert len(fma_lines) >= fma_chains(target)
    # the loop body: from the first FMA to the last, no load or store of a spilled chain
    body = asm[asm.index(fma_lines[0]):asm.rindex(fma_lines[-1])]
    assert "(%rsp)" not in body


def test_the_peak_probes_run_for_their_whole_half_second(monkeypatch):
    # ten ~2 ms calls of the FMA probe (measure's default cap) read 75-125 of a 2-vCPU VM's
    # 181 GFLOP/s when cold or just after a GEMM: the probes' runs must fill measure's half second
    from tvm_fuel.bench import attention

    calls = []

    def fake_measure(fn, *, min_seconds=0.5, max_runs=10):
        calls.append((fn, min_seconds, max_runs))
        return 1e-3, 1

    monkeypatch.setattr(attention, "measure", fake_measure)
    monkeypatch.setattr(attention, "torch_with_our_threads", lambda: None)
    monkeypatch.setattr(attention, "read_probe", lambda target: ((lambda: None), 1 << 20))
    peaks = attention.machine_peaks(HOST)
    assert set(peaks) >= {"fma_gflops", "read_gbps", "gemm_gflops"}
    numpy_gemm, read, fma = calls  # torch is patched away: numpy's GEMM, then the two probes
    assert numpy_gemm[2] == 10  # a 2048^3 GEMM takes ~50 ms: ten runs fill the half second
    for _, min_seconds, max_runs in (read, fma):
        assert min_seconds >= 0.5 and max_runs * 2e-3 >= 2 * min_seconds  # 2 ms runs never hit the cap
