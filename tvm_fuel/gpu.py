"""On a CUDA device: ``python -m tvm_fuel gpucheck`` and ``python -m tvm_fuel bench --target cuda``.

``gpucheck`` runs the GPU-marked tests (every kernel against ``tvm_fuel.reference`` and the floor
on the device) and then the CUDA benchmark, in one command that fits in 8 minutes on an H200.
The benchmark times, in one process and on the same inputs: the CUDA kernels ("tuned"), the
floor (the TE decomposition as TVM's dlight schedules it for CUDA: its Fallback rule, one naive
kernel per stage) and PyTorch's CUDA SDPA where PyTorch with CUDA is installed, and checks the
kernels' output against the floor's. FLOPs follow FlashAttention (``attention_flops``); paged
decode is reported in GB/s of K/V read and as a fraction of the device's HBM bandwidth.

Contents:
    has_gpu, device_arch, use_nvcc_jit
    default_cuda_suite -- the benchmark cases (bench.FlashCase / PagedCase in bfloat16)
    run_cuda_bench -- time the suite; write gpu_bench.json; return the report
    run_gpucheck   -- GPU tests + benchmark; the exit status of the tests
"""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import time
from dataclasses import asdict
from pathlib import Path

import numpy as np
import tvm
from tvm import relax

from . import op
from .bench import FlashCase, PagedCase, torch_paged_peer
from .build import compile as fuel_compile

# HBM bandwidth of the data-center parts (bytes/s), by a substring of the device name
HBM_BANDWIDTH = {"H200": 4.8e12, "H100": 3.35e12, "A100": 2.0e12}


def has_gpu() -> bool:
    try:
        return bool(tvm.cuda(0).exist)
    except Exception:  # noqa: BLE001 (no CUDA runtime in this TVM build or no driver)
        return False


def device_arch() -> str:
    """``sm_XY`` of device 0."""
    return "sm_" + tvm.cuda(0).compute_version.replace(".", "")


def use_nvcc_jit() -> None:
    """TVM JIT-compiles CUDA with NVRTC, which needs the ``cuda-bindings`` package; without it use nvcc."""
    try:
        import cuda.bindings  # noqa: F401
    except ImportError:
        os.environ.setdefault("TVM_CUDA_COMPILE_MODE", "nvcc")


def default_cuda_suite() -> list:
    """The issue's H200 targets: bf16 flash forward/backward at 4k tokens, paged decode B64."""
    flash = [FlashCase(4, 16, 4096, 128, causal, backward, dtype="bfloat16")
             for backward in (False, True) for causal in (False, True)]
    return flash + [PagedCase(64, 32, 8, 128, 16, context, 4096, dtype="bfloat16") for context in (4096, 1024)]


def _np_dtype(dtype: str):
    import ml_dtypes

    return ml_dtypes.bfloat16 if dtype == "bfloat16" else np.dtype(dtype)


def _module(make, params: dict) -> tvm.IRModule:
    bb = relax.BlockBuilder()
    variables = [relax.Var(n, relax.TensorType(shape, dtype)) for n, (shape, dtype) in params.items()]
    with bb.function("main", variables):
        bb.emit_func_output(bb.emit(make(*variables)))
    return bb.get()


def _case_inputs(case, rng) -> tuple[tvm.IRModule, list[np.ndarray]]:
    if isinstance(case, PagedCase):
        max_blocks = case.capacity // case.block_size
        num_blocks = case.B * max_blocks
        arrays = [rng.standard_normal((case.B, case.Hq, 1, case.D)),
                  rng.standard_normal((num_blocks, case.block_size, case.Hkv, case.D)),
                  rng.standard_normal((num_blocks, case.block_size, case.Hkv, case.D))]
        arrays = [a.astype(_np_dtype(case.dtype)) for a in arrays]
        arrays += [rng.permutation(num_blocks).reshape(case.B, max_blocks).astype("int32"),
                   np.full(case.B, case.context, "int32")]
        names = ("q", "k_cache", "v_cache", "block_table", "context_lens")
        return _module(lambda *a: op.paged_attn(*a), {n: (a.shape, str(a.dtype) if a.dtype.kind == "i" else case.dtype)
                                                      for n, a in zip(names, arrays)}), arrays
    shape = (case.B, case.H, case.S, case.D)
    arrays = [rng.standard_normal(shape).astype(_np_dtype(case.dtype)) for _ in range(4 if case.backward else 3)]
    params = {n: (shape, case.dtype) for n in ("q", "k", "v", "do")[:len(arrays)]}
    if case.backward:
        return _module(lambda q, k, v, do: op.flash_attn_backward(q, k, v, do, causal=case.causal), params), arrays
    return _module(lambda q, k, v: op.flash_attn(q, k, v, causal=case.causal), params), arrays


def _first(value) -> np.ndarray:
    while not isinstance(value, tvm.runtime.Tensor):
        value = value[0]
    return value.numpy().astype(np.float32)


def _time_build(mod, target, tensors, kernels: str) -> tuple[dict, np.ndarray]:
    dev = tvm.cuda(0)
    start = time.perf_counter()
    vm = relax.VirtualMachine(fuel_compile(mod, target, kernels=kernels), dev)
    out = _first(vm["main"](*tensors))  # also the JIT compile of the kernels
    build_s = time.perf_counter() - start
    timer = vm.time_evaluator("main", dev, number=5, repeat=5, min_repeat_ms=100)
    return {"ms": timer(*tensors).median * 1e3, "build_s": build_s}, out


def _time_torch(case, arrays) -> dict:
    try:
        import torch
    except ImportError:
        return {"skipped": "torch is not installed"}
    if not torch.cuda.is_available():
        return {"skipped": "torch has no CUDA"}
    dtype = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}[case.dtype]
    sdpa = torch.nn.functional.scaled_dot_product_attention
    t = [torch.from_numpy(np.asarray(a, np.float32)).cuda().to(dtype) for a in arrays[:3]]
    if isinstance(case, PagedCase):
        run = torch_paged_peer(torch, case, *t, torch.from_numpy(arrays[3]).cuda())
    elif case.backward:
        q, k, v = (x.requires_grad_(True) for x in t)
        out = sdpa(q, k, v, is_causal=case.causal)
        grad = torch.from_numpy(np.asarray(arrays[3], np.float32)).cuda().to(dtype)

        def run():
            return torch.autograd.grad(out, (q, k, v), grad, retain_graph=True)
    else:
        def run():
            return sdpa(t[0], t[1], t[2], is_causal=case.causal)
    with contextlib.nullcontext() if getattr(case, "backward", False) else torch.no_grad():
        for _ in range(3):
            run()
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(20):
            run()
        end.record()
        torch.cuda.synchronize()
    return {"ms": start.elapsed_time(end) / 20}


def run_cuda_bench(*, out_dir: str | Path = "bench_results", cases=None, floor: bool = True) -> dict:
    """Time every case's kernels, floor (dlight) and PyTorch SDPA; write ``gpu_bench.json``."""
    if not has_gpu():
        raise RuntimeError("tvm_fuel bench --target cuda: no CUDA device (tvm.cuda(0).exist is False)")
    use_nvcc_jit()
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    dev = tvm.cuda(0)
    arch = device_arch()
    target = tvm.target.Target({"kind": "cuda", "arch": arch})
    name = dev.device_name
    hbm = next((bw for key, bw in HBM_BANDWIDTH.items() if key in name), None)
    report = {"device": name, "arch": arch, "hbm_bytes_per_s": hbm, "tvm": tvm.__version__, "cases": []}
    print(f"device: {name} ({arch})")
    rng = np.random.default_rng(0)
    for case in cases or default_cuda_suite():
        mod, arrays = _case_inputs(case, rng)
        tensors = [tvm.runtime.tensor(a, device=dev) for a in arrays]
        results = {}
        results["tuned"], tuned_out = _time_build(mod, target, tensors, "tuned")
        if floor:
            try:
                results["floor (dlight)"], floor_out = _time_build(mod, target, tensors, "decomposed")
                results["tuned"]["max_abs_err_vs_floor"] = float(np.abs(tuned_out - floor_out).max())
            except Exception as err:  # noqa: BLE001 (e.g. the floor's score buffers exceed memory)
                results["floor (dlight)"] = {"skipped": f"{type(err).__name__}: {str(err)[:200]}"}
        results["torch"] = _time_torch(case, arrays)
        for entry in results.values():
            if "ms" in entry:
                entry["tflops"] = case.flops / entry["ms"] / 1e9
                if isinstance(case, PagedCase):
                    entry["gbps"] = case.bytes_read / entry["ms"] / 1e6
                    entry["hbm_fraction"] = entry["gbps"] * 1e9 / hbm if hbm else None
        row = {"name": case.name, "shape": asdict(case), "results": results}
        floor_ms = results.get("floor (dlight)", {}).get("ms")
        if floor_ms:
            row["floor_over_tuned"] = floor_ms / results["tuned"]["ms"]
        if "ms" in results["torch"]:
            row["tuned_over_torch"] = results["tuned"]["ms"] / results["torch"]["ms"]
        report["cases"].append(row)
        print(_line(row))
    (out_dir / "gpu_bench.json").write_text(json.dumps(report, indent=2))
    print(f"wrote {out_dir / 'gpu_bench.json'}")
    return report


def _line(row: dict) -> str:
    tuned = row["results"]["tuned"]
    text = f"{row['name']:<58} tuned {tuned['ms']:8.3f} ms {tuned['tflops']:7.1f} TFLOP/s"
    if "gbps" in tuned:
        text += f" {tuned['gbps']:7.0f} GB/s"
        if tuned.get("hbm_fraction"):
            text += f" ({tuned['hbm_fraction']:.0%} of HBM)"
    if "floor_over_tuned" in row:
        text += f" | floor/tuned {row['floor_over_tuned']:6.1f}x (err {tuned.get('max_abs_err_vs_floor', 0):.2e})"
    if "tuned_over_torch" in row:
        text += f" | tuned/torch {row['tuned_over_torch']:5.2f}"
    return text


def run_gpucheck(*, out_dir: str | Path = "bench_results", workers: int = 8) -> int:
    """The GPU-marked tests (from a source checkout), then the CUDA benchmark; tests' exit status."""
    use_nvcc_jit()
    if not has_gpu():
        print("gpucheck: no CUDA device; nothing to run", file=sys.stderr)
        return 2
    status = 0
    tests = Path.cwd() / "tests" / "test_cuda_kernels.py"
    if tests.exists():
        start = time.perf_counter()
        status = subprocess.run([sys.executable, "-m", "pytest", "-q", "-m", "gpu", "-n", str(workers), str(tests)],
                                check=False).returncode
        print(f"gpu tests: exit {status} in {time.perf_counter() - start:.0f} s")
    else:
        print(f"gpucheck: {tests} not found (run from a source checkout for the tests); benchmark only")
    run_cuda_bench(out_dir=out_dir)
    return status
