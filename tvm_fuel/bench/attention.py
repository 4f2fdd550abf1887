"""``python -m tvm_fuel bench``: the floor, the tuned kernels and PyTorch, side by side in one run.

Every figure is measured in the same process, against this machine's own peaks measured in the
same run (float32 GEMM GFLOP/s, streaming read GB/s; paged decode's read fraction against a read
probe timed in turns with it, as this machine's bandwidth drifts). FLOPs follow FlashAttention: forward
``4 * B * Hq * Sq * Sk * D``, halved when causal; backward 2.5x the forward. Paged decode is
also reported in GB/s of K/V read. "tuned" kernels use the shipped tuning logs (where they hold a
record for this CPU class), "hand_picked" the same kernels with the rules' own knobs. Results go to
``bench.json`` and ``bench.png``.

Contents:
    (the shapes and their work counts live in ``tvm_fuel.testing.cases``)
    read_probe           -- a streaming all-core read, to time alongside a kernel
    machine_peaks        -- FMA peak and GEMM GFLOP/s, read GB/s of this machine (all cores)
    fma_kernel, fma_chains -- the FMA probe's kernel, and its independent chains (they fit the vector
                          registers)
    measure, measure_side_by_side -- median timings (side by side: in turns)
    torch_with_our_threads -- PyTorch (None without it) on the threads TVM uses
    peak_rss_mib, child_probe -- this process's peak resident memory; a probe run in a child process
    build_vm             -- a VirtualMachine of a module built one of the BUILDS ways
    run_bench            -- run the default suite, write JSON and PNG, return the report
"""

from __future__ import annotations

import json
import os
import platform
import resource
import statistics
import subprocess
import sys
import time
from dataclasses import asdict
from pathlib import Path
from typing import Callable

import ml_dtypes
import numpy as np
import tvm
from tvm import relax
from tvm.script import tirx as T

from .. import op
from ..build import compile as fuel_compile
from ..target import host_target
from ..testing.cases import FLOOR_MAX_SCORES, FlashCase, PagedCase, default_suite, head_dim_suite, tiny_rows_suite
from ..testing.peers import paged_gather_sdpa
from ..schedules.cpu.tiles import vector_lanes, vector_registers
from ..compat.threads import physical_cores, thread_count

def measure(fn: Callable[[], object], *, min_seconds: float = 0.5, max_runs: int = 10) -> tuple[float, int]:
    """Median seconds of ``fn`` after one warm-up run, and the number of timed runs."""
    fn()
    times: list[float] = []
    while len(times) < max_runs and (sum(times) < min_seconds or len(times) < 3):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times), len(times)


def measure_side_by_side(fns: dict[str, Callable[[], object]], *, min_seconds: float = 0.5,
                         max_runs: int = 10) -> dict[str, tuple[float, int]]:
    """Median seconds of each function, timed in turns after one warm-up each, the order reversed
    every round (A B, B A, ...: running second is not the same as running first), so a drift of
    this shared machine hits every one alike; and the number of timed runs."""
    for fn in fns.values():
        fn()
    times: dict[str, list[float]] = {name: [] for name in fns}
    order = list(fns)
    while len(times[order[0]]) < max_runs and (
            sum(map(sum, times.values())) < min_seconds * len(fns) or len(times[order[0]]) < 4):
        for name in order:
            start = time.perf_counter()
            fns[name]()
            times[name].append(time.perf_counter() - start)
        order.reverse()
    return {name: (statistics.median(t), len(t)) for name, t in times.items()}


def _timed_builds(mod, target, tensors, *, with_floor: bool = True, floor_skip: str = "",
                  alongside: dict | None = None) -> dict:
    """Tuned and hand-picked kernels timed side by side (with the ``alongside`` callables, e.g. the
    read-bandwidth probe); then the floor (or why it is skipped)."""
    vms = {impl: build_vm(mod, target, **BUILDS[impl]) for impl in ("tuned", "hand_picked")}
    timed = measure_side_by_side({**{impl: (lambda vm=vm: vm["main"](*tensors)) for impl, vm in vms.items()},
                                  **(alongside or {})})
    results = {impl: {"ms": seconds * 1e3, "runs": runs} for impl, (seconds, runs) in timed.items()}
    if with_floor:
        vm = build_vm(mod, target, **BUILDS["floor"])
        seconds, runs = measure(lambda: vm["main"](*tensors), max_runs=3)
        results["floor"] = {"ms": seconds * 1e3, "runs": runs}
    else:
        results["floor"] = {"skipped": floor_skip}
    return results


def _read_kernel(n: int, parts: int, lanes: int = 16):
    chunk = n // parts

    @T.prim_func
    def read_sum(a: T.Buffer((n,), "float32"), out: T.Buffer((parts,), "float32")):
        for p in T.parallel(parts):
            acc = T.alloc_buffer((lanes,), "float32", scope="local")
            for v in T.vectorized(lanes):
                acc[v] = T.float32(0)
            for i in range(chunk // lanes):
                for v in T.vectorized(lanes):
                    acc[v] = acc[v] + a[p * chunk + i * lanes + v]
            out[p] = T.float32(0)
            for v in range(lanes):
                out[p] = out[p] + acc[v]

    return read_sum


def fma_kernel(target: tvm.target.Target, parts: int, *, iters: int = 1 << 20):
    """``(kernel, flops)``: ``parts`` tasks of ``fma_chains(target)`` independent FMA chains of the
    target's vector width each, all in registers: the FMA units' throughput, not their latency,
    bounds it. The chains and the two operands must fit the vector registers: 16 chains on AVX2's
    16 spilled, and the probe read 126 GFLOP/s of a 182 GFLOP/s peak on a 2-core Zen 4 (AVX2)."""
    lanes, chains = vector_lanes(target), fma_chains(target)

    @T.prim_func
    def fma_peak(x: T.Buffer((2,), "float32"), out: T.Buffer((parts,), "float32")):
        T.func_attr({"tirx.noalias": True})
        for p in T.parallel(parts):
            scale = x[0]  # read once: the loop stores nothing they could alias (no reload each step)
            shift = x[1]
            acc = T.alloc_buffer((chains, lanes), "float32", scope="local")
            for c, v in T.grid(chains, lanes):
                acc[c, v] = T.Cast("float32", c * lanes + v)
            for i in range(iters):
                for c in T.unroll(chains):
                    for v in T.vectorized(lanes):
                        acc[c, v] = T.fma(acc[c, v], scale, shift)
            out[p] = T.float32(0)
            for c, v in T.grid(chains, lanes):
                out[p] = out[p] + acc[c, v]

    return fma_peak, parts * iters * chains * lanes * 2


def fma_chains(target: tvm.target.Target) -> int:
    """FMA chains for the peak probe: enough to cover the FMA latency (two units, 4 cycles: 8),
    with the operands and a spare in registers (12 of AVX2's 16, 16 of AVX-512's 32)."""
    return min(16, vector_registers(target) - 4)


def read_probe(target: tvm.target.Target):
    """``(run, bytes)``: a streaming read of 256 MiB (far beyond the caches) on all cores."""
    size = 64 * 1024 * 1024
    parts = 8 * int(target.attrs.get("num-cores", 1) or 1)
    lib = tvm.compile(_read_kernel(size, parts), target=target)
    data = tvm.runtime.tensor(np.ones(size, np.float32))
    out = tvm.runtime.tensor(np.zeros(parts, np.float32))
    return (lambda: lib(data, out)), size * 4


PROBE_RUNS = 1000  # a cap the probes' half second of runs never reaches


def machine_peaks(target: tvm.target.Target) -> dict:
    """All-core float32 FMA peak GFLOP/s (our own register-resident FMA kernel), GEMM GFLOP/s
    (best of numpy and torch) and all-core streaming read GB/s."""
    n = 2048
    a, b = np.random.rand(n, n).astype(np.float32), np.random.rand(n, n).astype(np.float32)
    gemm = {"numpy": 2 * n**3 / measure(lambda: a @ b)[0] / 1e9}
    torch = torch_with_our_threads()
    if torch is not None:
        ta, tb = torch.from_numpy(a), torch.from_numpy(b)
        gemm["torch"] = 2 * n**3 / measure(lambda: ta @ tb)[0] / 1e9
    # the probes run for their whole half second (a call of the FMA probe takes ~2 ms: ten of them,
    # measure's default, read 75-125 of 181 GFLOP/s on a 2-vCPU VM just after a GEMM, or cold)
    read_all, nbytes = read_probe(target)
    read = nbytes / measure(read_all, max_runs=PROBE_RUNS)[0] / 1e9
    cores = int(target.attrs.get("num-cores", 1) or 1)
    kernel, flops = fma_kernel(target, cores)
    fma = tvm.compile(kernel, target=target)
    scale_shift = tvm.runtime.tensor(np.array([0.999, 1e-3], np.float32))
    sums = tvm.runtime.tensor(np.zeros(cores, np.float32))
    peak = flops / measure(lambda: fma(scale_shift, sums), max_runs=PROBE_RUNS)[0] / 1e9
    return {"fma_gflops": peak, "gemm_gflops": max(gemm.values()), "gemm_gflops_by": gemm, "read_gbps": read}


def torch_with_our_threads():
    """PyTorch on TVM's thread count (None where it is not installed)."""
    try:
        import torch
    except ImportError:
        return None
    torch.set_num_threads(thread_count())  # the same threads as TVM's pool
    return torch


# implementation -> how tvm_fuel.compile builds it: "tuned" applies the shipped tuning logs,
# "hand_picked" is the same kernels with the rules' hand-picked knobs
BUILDS = {"tuned": dict(kernels="tuned"), "hand_picked": dict(kernels="tuned", shipped_logs=False),
          "floor": dict(kernels="decomposed")}


def build_vm(mod, target, kernels, **options):
    """A VirtualMachine over ``mod`` built by ``tvm_fuel.compile`` (``kernels``: one of BUILDS' ways)."""
    return relax.VirtualMachine(fuel_compile(mod, target, kernels=kernels, **options), tvm.cpu())


def _flash_module(case: FlashCase, *, return_lse: bool = False) -> tvm.IRModule:
    shape = (case.B, case.H, case.S, case.D)
    names = ["q", "k", "v"] + (["do", "out"] if case.backward else [])
    params = [relax.Var(n, relax.TensorType(shape, "float32")) for n in names]
    if case.backward:
        params.append(relax.Var("lse", relax.TensorType(shape[:3], "float32")))
    bb = relax.BlockBuilder()
    with bb.function("main", params):
        if case.backward:
            q, k, v, do, out, lse = params
            result = bb.emit(op.flash_attn_backward(q, k, v, do, out=out, lse=lse, causal=case.causal))
        else:
            result = bb.emit(op.flash_attn(*params, causal=case.causal, return_lse=return_lse))
        bb.emit_func_output(result)
    return bb.get()


def _flash_timings(case: FlashCase, target, *, with_floor: bool) -> dict:
    rng = np.random.default_rng(0)
    shape = (case.B, case.H, case.S, case.D)
    q, k, v, do = (rng.standard_normal(shape).astype(np.float32) for _ in range(4))
    mod = _flash_module(case)
    args = [q, k, v]
    if case.backward:  # the forward's state, as a training step has it
        forward = FlashCase(case.B, case.H, case.S, case.D, case.causal)
        vm_fwd = build_vm(_flash_module(forward, return_lse=True), target, "tuned")
        out, lse = (t.numpy() for t in vm_fwd["main"](*map(tvm.runtime.tensor, (q, k, v))))
        args = [q, k, v, do, out, lse]
    tensors = [tvm.runtime.tensor(a) for a in args]
    results = _timed_builds(mod, target, tensors, with_floor=with_floor, floor_skip=(
        f"would materialize {case.B * case.H * case.S * case.S:,} scores (> {FLOOR_MAX_SCORES:,}); "
        "run with --floor-all"))
    torch = torch_with_our_threads()
    if torch is None:
        results["torch"] = {"skipped": "torch is not installed (pip install -e '.[bench]')"}
    else:
        tq, tk, tv = (torch.from_numpy(a).requires_grad_(case.backward) for a in (q, k, v))
        sdpa = torch.nn.functional.scaled_dot_product_attention
        if case.backward:
            out_t = sdpa(tq, tk, tv, is_causal=case.causal)  # Sq == Sk: top-left == bottom-right
            grad = torch.from_numpy(do)
            seconds, runs = measure(lambda: torch.autograd.grad(out_t, (tq, tk, tv), grad, retain_graph=True))
        else:
            with torch.no_grad():
                seconds, runs = measure(lambda: sdpa(tq, tk, tv, is_causal=case.causal))
        results["torch"] = {"ms": seconds * 1e3, "runs": runs}
    for entry in results.values():
        if "ms" in entry:
            entry["gflops"] = case.flops / entry["ms"] / 1e6
    return results


def _paged_timings(case: PagedCase, target) -> dict:
    rng = np.random.default_rng(0)
    max_blocks = case.capacity // case.block_size
    num_blocks = case.B * max_blocks
    dtype = ml_dtypes.bfloat16 if case.dtype == "bfloat16" else np.dtype(case.dtype)
    k_cache, v_cache = (rng.standard_normal((num_blocks, case.block_size, case.Hkv, case.D)).astype(dtype)
                        for _ in range(2))
    table = rng.permutation(num_blocks).reshape(case.B, max_blocks).astype(np.int32)
    lens = np.full(case.B, case.context, np.int32)
    q = rng.standard_normal((case.B, case.Hq, 1, case.D)).astype(dtype)
    arrays = [q, k_cache, v_cache, table, lens]
    params = [relax.Var(n, relax.TensorType(a.shape, case.dtype if a.dtype == dtype else str(a.dtype)))
              for n, a in zip(("q", "k_cache", "v_cache", "block_table", "context_lens"), arrays)]
    bb = relax.BlockBuilder()
    with bb.function("main", params):
        bb.emit_func_output(bb.emit(op.paged_attn(*params)))
    mod = bb.get()
    tensors = [tvm.runtime.tensor(a) for a in arrays]
    # the machine's read bandwidth drifts by 2x within minutes here (shared memory bus): the
    # fraction of it the kernel reaches is measured against a probe timed side by side with it
    read_all, read_bytes = read_probe(target)
    results = _timed_builds(mod, target, tensors, alongside={"read_probe": read_all})
    results["read_probe"]["gbps"] = read_bytes / results["read_probe"]["ms"] / 1e6
    torch = torch_with_our_threads()
    if torch is None:
        results["torch"] = {"skipped": "torch is not installed (pip install -e '.[bench]')"}
    else:
        as_torch = [torch.from_numpy(a.astype(np.float32)) if a.dtype == dtype else torch.from_numpy(a)
                    for a in (q, k_cache, v_cache, table)]
        as_torch[:3] = [t.to(getattr(torch, case.dtype)) for t in as_torch[:3]]
        gather_sdpa = paged_gather_sdpa(torch, *as_torch, case.context)
        with torch.no_grad():
            seconds, runs = measure(gather_sdpa)
        results["torch"] = {"ms": seconds * 1e3, "runs": runs}
    for name, entry in results.items():
        if "ms" in entry and name != "read_probe":
            entry["gbps"] = case.bytes_read / entry["ms"] / 1e6
            entry["gflops"] = case.flops / entry["ms"] / 1e6
    return results


def long_context_probe(S: int = 16384, H: int = 8, D: int = 64) -> dict:
    """Tuned forward + backward at B=1, in this process; peak resident memory from the OS."""
    target = host_target()
    case = FlashCase(1, H, S, D, causal=True)
    rng = np.random.default_rng(0)
    q, k, v, do = (tvm.runtime.tensor(rng.standard_normal((1, H, S, D)).astype(np.float32)) for _ in range(4))
    fwd = build_vm(_flash_module(case, return_lse=True), target, "tuned")
    bwd = build_vm(_flash_module(FlashCase(1, H, S, D, True, backward=True)), target, "tuned")
    baseline = peak_rss_mib()
    start = time.perf_counter()
    out, lse = fwd["main"](q, k, v)
    bwd["main"](q, k, v, do, out, lse)
    seconds = time.perf_counter() - start
    peak = peak_rss_mib()
    floor_gib = 6 * H * S * S * 4 / 2**30
    return {"S": S, "H": H, "D": D, "causal": True, "fwd_bwd_s": seconds, "peak_rss_mib": peak,
            "rss_before_run_mib": baseline, "floor_estimate_gib": floor_gib}


def child_probe(module: str, flag: str) -> dict:
    """Run ``python -m module flag`` in a child process (its own peak memory) and return the JSON of
    its last output line, or ``{"error": ...}``."""
    child = subprocess.run([sys.executable, "-m", module, flag], capture_output=True, text=True, check=False)
    if child.returncode != 0:
        return {"error": child.stderr[-2000:]}
    return json.loads(child.stdout.strip().splitlines()[-1])


def peak_rss_mib() -> float:
    """This process's peak resident memory (VmHWM; unlike ru_maxrss it does not carry over exec)."""
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def _chart(report: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2), sharey=True)
    for ax, causal in zip(axes, (False, True)):
        rows = [r for r in report["sweep"] if r["causal"] == causal]
        for impl, style in (("tuned", "o-"), ("torch", "s--"), ("floor", "^:")):
            points = [(r["S"], r["results"][impl]["gflops"]) for r in rows if "gflops" in r["results"].get(impl, {})]
            if points:
                ax.plot(*zip(*points), style, label={"tuned": "tvm_fuel tuned", "torch": "PyTorch SDPA",
                                                     "floor": "tvm_fuel floor"}[impl])
        ax.axhline(report["machine"]["gemm_gflops"], color="gray", lw=0.8, ls="-.", label="fp32 GEMM (numpy/torch)")
        ax.axhline(report["machine"]["fma_gflops"], color="black", lw=0.8, ls=":", label="fp32 FMA peak")
        ax.set_xscale("log", base=2)
        ax.set_xlabel("sequence length (B=1, H=8, D=64)")
        ax.set_title(f"flash forward, {'causal' if causal else 'non-causal'}, float32")
        ax.grid(alpha=0.3)
    axes[0].set_ylabel("GFLOP/s")
    axes[1].legend(loc="lower right")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def run_bench(*, out_dir: str | Path = "bench_results", floor_all: bool = False, long_context: bool = True,
              sweep: bool = True) -> dict:
    """Run the default suite and the head-dim rows; write ``bench.json`` and ``bench.png`` into
    ``out_dir``; return the report."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    target = host_target()
    torch = torch_with_our_threads()
    report: dict = {
        "machine": {"cpu": tvm.target.codegen.llvm_get_system_cpu(), "cores": os.cpu_count(),
                    "physical_cores": physical_cores(),
                    "threads": {"tvm": tvm.runtime.num_threads(), "torch": torch.get_num_threads() if torch else None},
                    "platform": platform.platform(), "tvm": tvm.__version__,
                    "torch": torch.__version__ if torch is not None else None, "target": str(target)},
        "cases": [], "head_dims": [], "tiny_rows": [], "sweep": [],
    }
    report["machine"].update(machine_peaks(target))
    peaks = report["machine"]
    print(f"machine: {peaks['cpu']}, {peaks['cores']} cores ({peaks['physical_cores']} physical); threads: "
          f"TVM {peaks['threads']['tvm']}, PyTorch {peaks['threads']['torch']}; fp32 FMA peak "
          f"{peaks['fma_gflops']:.1f} GFLOP/s, GEMM {peaks['gemm_gflops']:.1f} GFLOP/s, "
          f"read {peaks['read_gbps']:.1f} GB/s")
    flash, paged = default_suite()
    for case in flash:
        results = _flash_timings(case, target, with_floor=floor_all or case.B * case.H * case.S**2 <= FLOOR_MAX_SCORES)
        report["cases"].append(_summarize(case, results, peaks))
    for case in paged:
        report["cases"].append(_summarize(case, _paged_timings(case, target), peaks))
    full, quarter, half_width = (c for c in report["cases"] if c["kind"] == "paged")
    report["paged_occupancy_speedup"] = full["results"]["tuned"]["ms"] / quarter["results"]["tuned"]["ms"]
    # bfloat16 reads half the bytes of float32 at the same shape: 0.5 when time follows bytes
    report["paged_bf16_time_ratio"] = half_width["results"]["tuned"]["ms"] / full["results"]["tuned"]["ms"]
    for case in head_dim_suite():
        report["head_dims"].append(_summarize(case, _flash_timings(case, target, with_floor=False), peaks))
    for case in tiny_rows_suite():  # the floor's scores are few here: it is the row's reference
        report["tiny_rows"].append(_summarize(case, _flash_timings(case, target, with_floor=True), peaks))
    if sweep:
        for s in (256, 512, 1024, 2048):
            for causal in (False, True):
                case = FlashCase(1, 8, s, 64, causal)
                results = _flash_timings(case, target, with_floor=s <= 1024)
                report["sweep"].append({"S": s, "causal": causal, "results": results})
    if long_context:
        report["long_context"] = child_probe("tvm_fuel.bench.attention", "--long-context-probe")
    _print(report)
    (out_dir / "bench.json").write_text(json.dumps(report, indent=2))
    try:
        _chart(report, out_dir / "bench.png")
    except ImportError:
        print("matplotlib is not installed: no chart (pip install -e '.[bench]')")
    print(f"wrote {out_dir / 'bench.json'} and {out_dir / 'bench.png'}")
    return report


def _summarize(case, results: dict, peaks: dict) -> dict:
    entry = {"name": case.name, "kind": "paged" if isinstance(case, PagedCase) else "flash", "shape": asdict(case),
             "flops": case.flops, "results": results}
    tuned, torch, floor = results["tuned"], results.get("torch", {}), results.get("floor", {})
    hand = results.get("hand_picked", {})
    if "ms" in hand:
        entry["tuned_speedup"] = hand["ms"] / tuned["ms"]
    if "ms" in torch:
        entry["tuned_over_torch"] = tuned["ms"] / torch["ms"]
    if "ms" in floor:
        entry["floor_over_tuned"] = floor["ms"] / tuned["ms"]
    if isinstance(case, PagedCase):
        entry["read_fraction"] = tuned["gbps"] / results["read_probe"]["gbps"]
    else:
        entry["fma_fraction"] = tuned["gflops"] / peaks["fma_gflops"]
    return entry


def _print(report: dict) -> None:
    def cell(result: dict, unit: str) -> str:
        return f"{result['ms']:9.2f} ms {result[unit]:7.1f}" if "ms" in result else f"{'skipped':>20}"

    print(f"\n{'case':<48} {'tuned':>20} {'hand-picked':>20} {'torch':>20} {'floor':>20} {'tuned/torch':>11} "
          f"{'floor/tuned':>11} {'hand/tuned':>10} {'of peak':>8}")
    for c in report["cases"] + report.get("head_dims", []) + report.get("tiny_rows", []):
        unit = "gbps" if c["kind"] == "paged" else "gflops"
        r = c["results"]
        frac = c.get("read_fraction", c.get("fma_fraction"))
        print(f"{c['name']:<48} {cell(r['tuned'], unit)} {cell(r.get('hand_picked', {}), unit)} "
              f"{cell(r.get('torch', {}), unit)} {cell(r.get('floor', {}), unit)} "
              f"{c.get('tuned_over_torch', float('nan')):11.2f} {c.get('floor_over_tuned', float('nan')):11.1f} "
              f"{c.get('tuned_speedup', float('nan')):10.2f} {frac:8.0%}")
    print("(flash: GFLOP/s; paged: GB/s of K/V read; tuned/torch < 1 means tuned is faster; tuned: knobs of the "
          "shipped tuning logs where they hold a record for this CPU, hand-picked: the rules' own knobs; of peak: "
          "flash of the all-core FMA peak, paged of the all-core read bandwidth timed alongside it)")
    for c in report["cases"]:
        if "read_probe" in c["results"]:
            print(f"{c['name']}: read probe alongside {c['results']['read_probe']['gbps']:.1f} GB/s")
    if "paged_occupancy_speedup" in report:
        print(f"paged decode, full vs quarter occupancy (same table capacity): "
              f"{report['paged_occupancy_speedup']:.2f}x")
    if "paged_bf16_time_ratio" in report:
        print(f"paged decode, bfloat16 vs float32 cache time (half the bytes): {report['paged_bf16_time_ratio']:.2f}")
    lc = report.get("long_context")
    if lc and "peak_rss_mib" in lc:
        print(f"long context fwd+bwd S={lc['S']} H={lc['H']} D={lc['D']} causal: {lc['fwd_bwd_s']:.2f} s, "
              f"peak RSS {lc['peak_rss_mib']:.0f} MiB (floor would need ~{lc['floor_estimate_gib']:.0f} GiB)")
    elif lc:
        print(f"long context probe failed: {lc.get('error', '')[-300:]}")


if __name__ == "__main__":
    if "--long-context-probe" in sys.argv:
        print(json.dumps(long_context_probe()))
