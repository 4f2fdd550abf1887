"""One worker process of a bundle run: loads the runtime, runs the cases it is handed, reports each.

``python -m fuel_node.worker BUNDLE`` reads a JSON list of cases on stdin and reports on its
protocol pipe (``supervisor``): ``{"device": ...}`` once the runtime and the device are up (or
``{"fatal": reason}``), then ``{"start": i}`` and ``{"result": ...}`` per case. After an error
that involves the device it exits (a CUDA error can leave the context unusable) and the
supervisor hands the remaining cases to a fresh worker.

Case kinds (written by ``tvm_fuel.deploy.bundle``):
    op      -- a Relax executable's ``main`` on seeded inputs, compared with the float64 reference,
               the floor's executable and/or PyTorch; timed when ``time`` is set (bench)
    kernel  -- one knob point of a kernel (a PrimFunc of a tuning module), timed
    verify  -- several knob points of one bucket timed side by side, in turns, over rounds
    tvm_slots -- fuel's and TVM's kernels for the attention slots of TVM's runtime KV cache on one
               batch (``tvm_slots``): compared; timed side by side in the bench stage
"""

from __future__ import annotations

import json
import os
import re
import statistics
import sys
import time
import traceback
from pathlib import Path

import numpy as np

from . import peers, tvm_slots
from .arrays import make_arrays
from .compare import DEVICE_SCALE, LSE_TOLERANCE, TOLERANCE, compare
from .environment import PROTOCOL_FD, CubinStore, NodeError, load_cuda, load_tvm
from .manifest import read_manifest

# HBM bandwidth of the data-center parts (bytes/s), by a substring of the device name
HBM_BANDWIDTH = {"H200": 4.8e12, "H100": 3.35e12, "A100": 2.0e12}


_CHANNEL = None


def emit(**message) -> None:
    global _CHANNEL
    if _CHANNEL is None:
        _CHANNEL = os.fdopen(int(os.environ[PROTOCOL_FD]), "w", buffering=1)
    _CHANNEL.write(json.dumps(message) + "\n")


def arch_of(dev) -> str:
    return "sm_" + dev.compute_version.replace(".", "")


class Node:
    """The loaded runtime: device, module cache, the cubin store."""

    def __init__(self, bundle: Path, manifest: dict):
        self.bundle, self.manifest = bundle, manifest
        self.tvm = load_tvm(bundle, manifest)
        self.gpu = manifest["target"]["device"] == "cuda"
        self.store = None
        if self.gpu:
            self.store = CubinStore(bundle / "cubins", manifest["target"]["arch"])
            self.store.register()
            load_cuda(self.tvm)
            self.dev = self.tvm.cuda(0)
            arch, built = arch_of(self.dev), manifest["target"]["arch"]
            # a cubin runs on its architecture and the later minor versions of the same major one
            (major, minor), (built_major, built_minor) = (divmod(int(a[3:]), 10) for a in (arch, built))
            if major != built_major or minor < built_minor:
                raise NodeError(f"this device ({self.dev.device_name}) is {arch}; the bundle was built for {built}: "
                                f"rebuild it with --arch {arch}")
        else:
            self.dev = self.tvm.cpu(0)
        self.modules: dict = {}
        self._shared: tuple = (None, None)

    def describe(self) -> dict:
        info = {"kind": "cuda" if self.gpu else "cpu", "name": "cpu"}
        if self.gpu:
            info.update(name=self.dev.device_name, arch=arch_of(self.dev),
                        hbm_bytes_per_s=next((bw for key, bw in HBM_BANDWIDTH.items()
                                              if key in self.dev.device_name), None))
        return info

    def module(self, path: str):
        if path not in self.modules:
            self.modules[path] = self.tvm.runtime.load_module(str(self.bundle / path))
        return self.modules[path]

    def vm(self, path: str):
        from tvm.runtime.vm import VirtualMachine  # a submodule runtime-only TVM does not import itself

        return VirtualMachine(self.module(path), self.dev)

    def tensors(self, arrays):
        return [self.tvm.runtime.tensor(np.ascontiguousarray(a), device=self.dev) for a in arrays]

    def shared_tensors(self, case: dict):
        """The device inputs of a tune case, made once for all the points of its bucket (a paged
        bucket's caches take seconds to draw); only the latest bucket's are kept."""
        key = json.dumps([case["inputs"], case["seed"]], sort_keys=True)
        if self._shared[0] != key:
            self._shared = (None, None)  # free the previous bucket's before drawing the next
            self._shared = (key, self.tensors(make_arrays(case["inputs"], case["seed"])))
        return self._shared[1]

    def flatten(self, value) -> list[np.ndarray]:
        if isinstance(value, self.tvm.runtime.Tensor):
            return [value.numpy()]
        return [array for item in value for array in self.flatten(item)]


def _reference(case: dict, named: dict) -> dict[str, np.ndarray]:
    from . import reference

    values = getattr(reference, case["op"])(**named, **case["options"])
    values = values if isinstance(values, tuple) else (values,)
    return dict(zip(case["reference_outputs"], values))


def _tolerance(case: dict, name: str) -> tuple[float, float]:
    return LSE_TOLERANCE if name == "lse" else TOLERANCE[case["dtype"]]


def run_op(node: Node, case: dict) -> dict:
    arrays = make_arrays(case["inputs"], case["seed"])
    named = {spec["name"]: array for spec, array in zip(case["inputs"], arrays)}
    tensors = node.tensors(arrays)
    vm = node.vm(case["module"])
    got = _outputs(node, case, vm, tensors)
    result: dict = {"checks": [], "skipped": []}
    scale = max(case.get("scale", 1.0), DEVICE_SCALE) if node.gpu else case.get("scale", 1.0)
    if "reference" in case["expect"]:
        want = _reference(case, named)
        result["checks"] += [compare(f"{n} vs reference", got[n], want[n], _tolerance(case, n), scale) for n in got]
    floor_vm = node.vm(case["floor"]) if case.get("floor") else None
    if floor_vm is not None:
        floor = _outputs(node, case, floor_vm, tensors)
        # both sides carry their own rounding: twice the tolerance against the truth
        result["checks"] += [compare(f"{n} vs floor", got[n], floor[n], _tolerance(case, n), 2 * scale) for n in got]
    peer = None
    if case.get("torch"):
        peer = peers.peer_for(case, named, node.gpu)
        if isinstance(peer, str):
            result["skipped"].append(f"torch: {peer}")
            peer = None
    if peer is not None and "torch" in case["expect"]:
        try:
            values = peer[0]()
        except Exception as err:  # noqa: BLE001 -- PyTorch's failure is not the kernel's
            result["skipped"].append(f"torch failed: {type(err).__name__}: {str(err)[:200]}")
            peer = None
        else:
            values = values if isinstance(values, tuple) else (values,)
            for name, value in zip(peer[1], values):
                if name in got:
                    result["checks"].append(compare(f"{name} vs torch", got[name], value.float().cpu().numpy(),
                                                    _tolerance(case, name), 2 * scale))
    if case.get("timed"):
        result["timings"] = _timings(node, case, vm, floor_vm, tensors, peer)
    if not result["checks"]:
        result["status"] = "unchecked"  # nothing to compare with here (bench without floor or PyTorch)
    else:
        result["status"] = "pass" if all(c["ok"] for c in result["checks"]) else "fail"
    return result


def _outputs(node: Node, case: dict, vm, tensors) -> dict[str, np.ndarray]:
    values = node.flatten(vm["main"](*tensors))
    if len(values) != len(case["outputs"]):
        raise RuntimeError(f"the module returned {len(values)} outputs, expected {case['outputs']}")
    return {name: value.astype(np.float64) for name, value in zip(case["outputs"], values)}


def _timings(node: Node, case: dict, vm, floor_vm, tensors, peer) -> dict:
    """Milliseconds of the kernels ("tuned"), the floor and PyTorch on the same inputs, with
    TFLOP/s (FlashAttention's count) and, for paged decode, GB/s of K/V read."""
    timings = {}
    timer = vm.time_evaluator("main", node.dev, number=5, repeat=5, min_repeat_ms=50)
    timings["tuned"] = {"ms": timer(*tensors).median * 1e3}
    if floor_vm is not None:
        timer = floor_vm.time_evaluator("main", node.dev, number=1, repeat=3)
        timings["floor"] = {"ms": timer(*tensors).median * 1e3}
    if peer is not None:
        timings["torch"] = {"ms": peers.milliseconds(peer[0], node.gpu)}
    hbm = node.describe().get("hbm_bytes_per_s")
    for entry in timings.values():
        entry["tflops"] = case["flops"] / entry["ms"] / 1e9
        if case.get("bytes_read"):
            entry["gbps"] = case["bytes_read"] / entry["ms"] / 1e6
            entry["hbm_fraction"] = entry["gbps"] * 1e9 / hbm if hbm else None
    return timings


def run_kernel(node: Node, case: dict) -> dict:
    """One knob point: its PrimFunc timed on valid inputs."""
    module = node.module(case["module"])
    tensors = node.shared_tensors(case)
    module[case["function"]](*tensors)  # a launch error shows here, not inside the timer
    timer = module.time_evaluator(case["function"], node.dev, number=3, repeat=3, min_repeat_ms=20)
    seconds = list(timer(*tensors).results)
    return {"status": "pass", "seconds": statistics.median(seconds), "runs": seconds}


def run_verify(node: Node, case: dict) -> dict:
    """Knob points of one bucket re-measured in turns, the order rotated every round."""
    module = node.module(case["module"])
    tensors = node.shared_tensors(case)
    functions = list(case["functions"])
    rounds: dict[str, list[float]] = {f: [] for f in functions}
    for index in range(case["rounds"]):
        shift = index % len(functions)
        for function in functions[shift:] + functions[:shift]:
            timer = module.time_evaluator(function, node.dev, number=3, repeat=1, min_repeat_ms=20)
            rounds[function].append(timer(*tensors).mean)
    return {"status": "pass", "seconds": rounds}


RUNNERS = {"op": run_op, "kernel": run_kernel, "verify": run_verify, "tvm_slots": tvm_slots.run_slots}


def main(argv: list[str]) -> int:
    bundle = Path(argv[0]).resolve()
    cases = json.loads(sys.stdin.read() or "[]")
    try:
        node = Node(bundle, read_manifest(bundle))
        emit(device=node.describe())
    except NodeError as err:
        emit(fatal=str(err))
        return 2
    for index, case in enumerate(cases):
        emit(start=index)
        begin = time.perf_counter()
        try:
            result = RUNNERS[case["kind"]](node, case)
        except Exception as err:  # noqa: BLE001 -- reported per case; the supervisor decides what follows
            result = {"status": "error", "error": _message(err)}
        result["seconds_taken"] = time.perf_counter() - begin
        if node.store is not None:
            result["cubins"] = {"hits": node.store.hits, "compiled_here": node.store.misses}
        emit(result=result)
        if result["status"] == "error" and node.gpu and _DEVICE_ERROR.search(result["error"]):
            return 3  # a fresh process (and CUDA context) for the rest
    return 0


_DEVICE_ERROR = re.compile(r"CUDA|cuda|device|launch", re.IGNORECASE)


def _message(err: Exception) -> str:
    """The error's first lines: TVM appends a failing launch's whole CUDA source to its message."""
    text = "".join(traceback.format_exception_only(type(err), err))
    text = text.split("// CUDA Source")[0].split("#include")[0]
    return " ".join(text.split())[:1500]


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
