"""``bench --gemm``: a model's matmuls as tvm_fuel builds them, against PyTorch's ``linear`` and
this machine's probes, in one process.

Each row is one ``y = x @ w.T`` in nn.Linear's layout, as an exported model holds it
(``matmul(x, permute_dims(w))``, x [M, K], w [N, K], float32), over the shapes of the
SmolLM-135M-shaped model ``bench --models`` runs: its projections, MLP and output layer at prefill
(M = S x B = 512) and at decode (M = B = 1, 4, 8). The weight comes two ways, as models carry it: a
``parameter`` passed at every call (``keep_params_as_input``, MLC-LLM's way) and a ``constant``
folded into the build. tvm_fuel's build (``tvm_fuel.compile``, kernels "tuned") and
``torch.nn.functional.linear`` are timed in blocks that take turns; the rates are GFLOP/s (2 M N K
per call) and the weight's GB/s (4 N K bytes per call: what decode is bound by), beside the FMA
and read probes of ``bench.attention.machine_peaks``.

Contents:
    GEMM_SHAPES -- (M, K, N) of the rows
    gemm_row    -- one shape and weight kind, timed against PyTorch
    gemm_rows   -- the report of the rows with this machine's probes
    print_rows  -- the report as text
"""

from __future__ import annotations

import time

import numpy as np

from ..target import host_target
from .timing import SETTLE_SECONDS, in_blocks

# SmolLM-135M: hidden 576, MLP 1536, vocabulary 49152 (q and o 576 -> 576, gate and up 576 -> 1536,
# down 1536 -> 576, the output layer 576 -> 49152); k and v (576 -> 192) are q's shape, narrower
_LAYERS = ((576, 576), (576, 1536), (1536, 576), (576, 49152))  # (K, N)
GEMM_SHAPES = tuple((m, k, n) for m in (512, 1, 4, 8) for k, n in _LAYERS)
WEIGHTS = ("parameter", "constant")


def _module(M: int, K: int, N: int, weight: np.ndarray | None):
    """``main(x[, w])`` returning ``matmul(x, permute_dims(w))``; ``weight``: w as a constant (else a parameter)."""
    from tvm import relax

    bb = relax.BlockBuilder()
    x = relax.Var("x", relax.TensorType((M, K), "float32"))
    params = [x]
    if weight is None:
        w = relax.Var("w", relax.TensorType((N, K), "float32"))
        params.append(w)
    else:
        w = relax.const(weight)
    with bb.function("main", params):
        with bb.dataflow():
            out = bb.emit_output(relax.op.matmul(x, relax.op.permute_dims(w)))
        bb.emit_func_output(out)
    return bb.get()


def _block_size(fn, seconds: float = 0.05) -> int:
    """Runs of ``fn`` in a block of about ``seconds`` (at least 3): small matmuls take microseconds."""
    start = time.perf_counter()
    fn()
    return max(3, min(200, int(seconds / max(time.perf_counter() - start, 1e-7))))


def gemm_row(M: int, K: int, N: int, weight: str = "parameter", *, seed: int = 0) -> dict:
    """``y = x @ w.T`` (x [M, K], w [N, K], float32) built by tvm_fuel with ``weight`` a
    "parameter" or a "constant", against ``torch.nn.functional.linear`` on the same arrays: median
    seconds of each, their GFLOP/s and weight GB/s, tvm_fuel's time over PyTorch's and its largest
    error relative to the float64 product."""
    import tvm
    from tvm import relax

    from ..build import compile as fuel_compile
    from .attention import torch_with_our_threads

    if weight not in WEIGHTS:
        raise ValueError(f"bench gemm: weight must be one of {WEIGHTS}, got {weight!r}")
    torch = torch_with_our_threads()
    if torch is None:
        raise RuntimeError("bench gemm: PyTorch is not installed (pip install -e '.[test]')")
    rng = np.random.default_rng(seed)
    x, w = (rng.standard_normal(shape).astype(np.float32) for shape in ((M, K), (N, K)))
    mod = _module(M, K, N, w if weight == "constant" else None)
    vm = relax.VirtualMachine(fuel_compile(mod, host_target(), kernels="tuned"), tvm.cpu())
    args = [tvm.runtime.tensor(x)] + ([tvm.runtime.tensor(w)] if weight == "parameter" else [])
    want = x.astype(np.float64) @ w.astype(np.float64).T
    got = vm["main"](*args).numpy()
    error = float(np.abs(got - want).max() / max(np.abs(want).max(), 1e-30)) if want.size else 0.0
    tx, tw = torch.from_numpy(x), torch.from_numpy(w)
    calls = {"tvm_fuel": lambda: vm["main"](*args), "torch": lambda: torch.nn.functional.linear(tx, tw)}
    runs: dict = {name: [] for name in calls}
    blocks = {name: _block_size(fn) for name, fn in calls.items()}

    def timed(name):
        start = time.perf_counter()
        calls[name]()
        runs[name].append(time.perf_counter() - start)

    in_blocks({name: lambda name=name: timed(name) for name in calls}, runs, block=blocks, settle=SETTLE_SECONDS)
    seconds = {name: float(np.median(times)) for name, times in runs.items()}
    flops, nbytes = 2.0 * M * N * K, 4.0 * N * K
    return {"M": M, "K": K, "N": N, "weight": weight, "seconds": seconds,
            "gflops": {name: flops / s / 1e9 for name, s in seconds.items()},
            "weight_gbps": {name: nbytes / s / 1e9 for name, s in seconds.items()},
            "vs_torch": seconds["tvm_fuel"] / seconds["torch"], "max_rel_error": error}


def gemm_rows(shapes=GEMM_SHAPES, weights=WEIGHTS, *, seed: int = 0, peaks: dict | None = None) -> dict:
    """The report of ``shapes`` x ``weights`` with this machine's FMA and read probes (``peaks``:
    ``machine_peaks``' result, measured here when None); each row's ``fma_fraction`` and
    ``read_fraction`` are tvm_fuel's rates over the probes."""
    from ..compat.threads import thread_count
    from .attention import machine_peaks

    peaks = peaks if peaks is not None else machine_peaks(host_target())
    rows = []
    for M, K, N in shapes:
        for weight in weights:
            row = gemm_row(M, K, N, weight, seed=seed)
            row["fma_fraction"] = row["gflops"]["tvm_fuel"] / peaks["fma_gflops"]
            row["read_fraction"] = row["weight_gbps"]["tvm_fuel"] / peaks["read_gbps"]
            rows.append(row)
    return {"what": "y = x @ w.T (nn.Linear), float32: tvm_fuel.compile(kernels='tuned') against "
                    "torch.nn.functional.linear", "threads": thread_count(), "peaks": peaks, "rows": rows}


def print_rows(report: dict) -> None:
    peaks = report["peaks"]
    print(f"\n[GEMM] {report['what']}; {report['threads']} threads; probes: FMA {peaks['fma_gflops']:.0f} GFLOP/s, "
          f"read {peaks['read_gbps']:.1f} GB/s")
    for row in report["rows"]:
        timed = "   ".join(f"{name} {row['seconds'][name] * 1e3:9.3f} ms ({row['gflops'][name]:6.1f} GFLOP/s, "
                           f"{row['weight_gbps'][name]:5.1f} GB/s)" for name in ("tvm_fuel", "torch"))
        print(f"  M={row['M']:4d} K={row['K']:5d} N={row['N']:6d} {row['weight']:<9}  {timed}   "
              f"{row['vs_torch']:5.2f}x torch's time   {row['fma_fraction']:4.0%} of FMA, "
              f"{row['read_fraction']:4.0%} of read   (error {row['max_rel_error']:.1e})")


__all__ = ["GEMM_SHAPES", "WEIGHTS", "gemm_row", "gemm_rows", "print_rows"]
