"""On a machine with a CUDA device: ``python -m tvm_fuel gpucheck`` and ``bench --target cuda``.

Both build the deploy bundle for the local device's architecture (``tvm_fuel.deploy``) and run
it with its own ``run.py``: the path an air-gapped GPU node takes, so a GPU with TVM installed
checks exactly what a node without TVM runs. ``gpucheck`` runs every stage (smoke, check,
bench, tune); ``bench --target cuda`` the smoke and bench stages. Results go to
``<out>/results.json`` (``tune --import`` reads its tune stage).

``<out>`` is checked before anything runs (``tvm_fuel.outputs``). A rerun replaces the earlier
run's bundle (``bundle-<arch>``, as ``bundle --out`` does) and its ``results.json``: only a
results file of that very bundle, which a run of this command wrote. Any other ``results.json``
there (another bundle's, a user's, not JSON) is never removed: the command refuses up front.

Contents:
    has_gpu, device_arch -- from tvm_fuel.target
    run_gpucheck -- build the bundle of a suite for this device and run it; run.py's exit status
    RESULTS
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from ..outputs import check_output_dir
from ..target import device_arch, has_gpu
from .node.environment import NodeError
from .node.manifest import read_manifest

RESULTS = "results.json"


def run_gpucheck(*, out_dir: str | Path = "bench_results", suite: str = "all") -> int:
    """Build the bundle of ``suite`` for the local device into ``<out_dir>/bundle-<arch>`` and run it
    (results in ``<out_dir>/results.json``); ValueError, before anything is built, where ``out_dir``
    cannot take them or holds a ``results.json`` that is not the earlier bundle's."""
    from .bundle import ARCHS, build_bundle

    out_dir = check_output_dir(out_dir, "--out", who="tvm_fuel gpucheck")
    if not has_gpu():
        raise RuntimeError("no CUDA device here (tvm.cuda(0).exist is False); for a GPU node without TVM, build a "
                           "bundle here (python -m tvm_fuel bundle --target cuda --arch sm_90 --out DIR) and run "
                           "python3 DIR/run.py there")
    arch = device_arch()
    if arch not in ARCHS:
        raise RuntimeError(f"the local device is {arch}; the CUDA kernels serve {', '.join(ARCHS)}")
    bundle, results = out_dir / f"bundle-{arch}", out_dir / RESULTS
    earlier = _earlier_results(results, bundle)  # refused now, not after minutes of building
    build_bundle(bundle, target="cuda", arch=arch, suite=suite)
    if earlier is not None:  # the results of the bundle this one replaced (checked again: minutes passed)
        if _results_bundle_id(results) != earlier:
            raise RuntimeError(f"tvm_fuel gpucheck: {results} changed while the bundle was built; left it as it is "
                               f"(run python3 {bundle / 'run.py'} --out OTHER.json)")
        results.unlink()
    return subprocess.run([sys.executable, str(bundle / "run.py"), "--out", str(results)], check=False).returncode


def _results_bundle_id(results: Path) -> str | None:
    """The ``bundle_id`` of a results file run.py wrote (None where ``results`` is not one)."""
    if results.is_symlink() or not results.is_file():
        return None
    try:
        report = json.loads(results.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError):
        return None
    return report.get("bundle_id") if isinstance(report, dict) and isinstance(report.get("bundle_id"), str) else None


def _earlier_results(results: Path, bundle: Path) -> str | None:
    """The bundle id of ``results`` where it holds the results of the bundle in ``bundle`` (an
    earlier run's, replaced with it); None where there is no results file; ValueError for any
    other file of that name."""
    if not results.exists() and not results.is_symlink():
        return None
    try:
        earlier = read_manifest(bundle)["bundle_id"] if bundle.is_dir() else None
    except NodeError:
        earlier = None
    held = _results_bundle_id(results)
    if earlier is None or held != earlier:
        whose = f"the results of bundle {held}" if held else "not a results file of a bundle"
        raise ValueError(f"tvm_fuel gpucheck: --out {results.parent} holds {RESULTS} ({whose}), not the results of "
                         f"an earlier gpucheck's {bundle.name}; choose another --out or move {RESULTS} out of it")
    return earlier

