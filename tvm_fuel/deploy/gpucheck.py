"""On a machine with a CUDA device: ``python -m tvm_fuel gpucheck`` and ``bench --target cuda``.

Both build the deploy bundle for the local device's architecture (``tvm_fuel.deploy``) and run
it with its own ``run.py``: the path an air-gapped GPU node takes, so a GPU with TVM installed
checks exactly what a node without TVM runs. ``gpucheck`` runs every stage (smoke, check,
bench, tune); ``bench --target cuda`` the smoke and bench stages. Results go to
``<out>/results.json`` (``tune --import`` reads its tune stage).

Contents:
    has_gpu, device_arch -- from tvm_fuel.deploy.nvcc
    run_gpucheck -- build the bundle of a suite for this device and run it; run.py's exit status
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from .nvcc import device_arch, has_gpu


def run_gpucheck(*, out_dir: str | Path = "bench_results", suite: str = "all") -> int:
    """Build the bundle of ``suite`` for the local device into ``<out_dir>/bundle-<arch>`` and run it."""
    from .bundle import ARCHS, build_bundle

    if not has_gpu():
        raise RuntimeError("no CUDA device here (tvm.cuda(0).exist is False); for a GPU node without TVM, build a "
                           "bundle here (python -m tvm_fuel bundle --target cuda --arch sm_90 --out DIR) and run "
                           "python3 DIR/run.py there")
    arch = device_arch()
    if arch not in ARCHS:
        raise RuntimeError(f"the local device is {arch}; the CUDA kernels serve {', '.join(ARCHS)}")
    out_dir = Path(out_dir)
    bundle = out_dir / f"bundle-{arch}"
    build_bundle(bundle, target="cuda", arch=arch, suite=suite)
    results = out_dir / "results.json"
    results.unlink(missing_ok=True)  # the results of the bundle this one replaces
    return subprocess.run([sys.executable, str(bundle / "run.py"), "--out", str(results)], check=False).returncode
