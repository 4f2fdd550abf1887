"""One worker process of a bundle run: loads the runtime, runs the cases it is handed, reports each.

``python -m fuel_node.worker BUNDLE`` reads a JSON list of cases on stdin and prints, for each,
``@@fuel {"start": i}`` and then ``@@fuel {"result": ...}``; its first line is ``@@fuel
{"device": ...}`` (or ``{"fatal": reason}`` when the runtime or the device cannot start). The
parent (``main``) restarts a worker after a crash, a timeout, or any error on a GPU (a CUDA
error can leave the context unusable), so one bad kernel cannot hide the results of the others.

Case kinds (written by ``tvm_fuel.deploy.bundle``):
    op      -- a Relax executable's ``main`` on seeded inputs, compared with the float64 reference,
               the floor's executable and/or PyTorch; timed when ``time`` is set (bench)
    kernel  -- one knob point of a kernel (a PrimFunc of a tuning module), timed
    verify  -- several knob points of one bucket timed side by side, in turns, over rounds
"""

from __future__ import annotations

import json
import statistics
import sys
import time
import traceback
from pathlib import Path

import numpy as np

from .arrays import make_arrays
from .compare import LSE_TOLERANCE, TOLERANCE, compare
from .environment import CubinStore, NodeError, load_cuda, load_tvm

PREFIX = "@@fuel "
# HBM bandwidth of the data-center parts (bytes/s), by a substring of the device name
HBM_BANDWIDTH = {"H200": 4.8e12, "H100": 3.35e12, "A100": 2.0e12}


def emit(**message) -> None:
    print(PREFIX + json.dumps(message), flush=True)


class Node:
    """The loaded runtime: device, module cache, the cubin store."""

    def __init__(self, bundle: Path, manifest: dict):
        self.bundle, self.manifest = bundle, manifest
        self.tvm = load_tvm(bundle)
        self.gpu = manifest["target"]["device"] == "cuda"
        self.store = None
        if self.gpu:
            self.store = CubinStore(bundle / "cubins", manifest["target"]["arch"])
            self.store.register()
            load_cuda(self.tvm)
            self.dev = self.tvm.cuda(0)
            arch = "sm_" + self.dev.compute_version.replace(".", "")
            if arch != manifest["target"]["arch"]:  # a cubin runs on the architecture it was made for
                raise NodeError(f"this device ({self.dev.device_name}) is {arch}; the bundle was built for "
                                f"{manifest['target']['arch']}: rebuild it with --arch {arch}")
        else:
            self.dev = self.tvm.cpu(0)
        self.modules: dict = {}

    def describe(self) -> dict:
        info = {"kind": "cuda" if self.gpu else "cpu", "name": "cpu"}
        if self.gpu:
            arch = "sm_" + self.dev.compute_version.replace(".", "")
            info.update(name=self.dev.device_name, arch=arch,
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

    def flatten(self, value) -> list[np.ndarray]:
        if isinstance(value, self.tvm.runtime.Tensor):
            return [value.numpy()]
        return [array for item in value for array in self.flatten(item)]


def _reference(case: dict, named: dict) -> dict[str, np.ndarray]:
    from . import reference

    values = getattr(reference, case["op"])(**named, **case["options"])
    values = values if isinstance(values, tuple) else (values,)
    return dict(zip(case["reference_outputs"], values))


def _torch(case: dict, named: dict, gpu: bool):
    """(function to run, its output names) of PyTorch's peer, or a reason there is none."""
    try:
        import torch
    except ImportError:
        return "torch is not installed"
    if gpu and not torch.cuda.is_available():
        return "torch has no CUDA"
    from . import peers

    device = "cuda" if gpu else "cpu"
    dtype = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}[case["dtype"]]

    def tensor(name):
        array = named[name]
        if array.dtype.kind in "iu":
            return torch.from_numpy(array).to(device)
        return torch.from_numpy(np.asarray(array, np.float32)).to(device).to(dtype)

    spec = case["torch"]
    if spec["kind"] == "paged":
        run = peers.paged_gather_sdpa(torch, tensor("q"), tensor("k_cache"), tensor("v_cache"), tensor("block_table"),
                                      spec["context"])
        return run, ["out"]
    if spec["kind"] == "flash_backward":
        run = peers.sdpa_backward(torch, *map(tensor, ("q", "k", "v", "do")), causal=spec["causal"])
        return run, ["dq", "dk", "dv"]
    return peers.sdpa_forward(torch, *map(tensor, ("q", "k", "v")), causal=spec["causal"]), ["out"]


def _time_torch(run, gpu: bool, repeat: int = 20) -> float:
    """Milliseconds per call (CUDA events on a GPU, after a warm-up)."""
    import torch

    for _ in range(3):
        run()
    if gpu:
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(repeat):
            run()
        end.record()
        torch.cuda.synchronize()
        return start.elapsed_time(end) / repeat
    begin = time.perf_counter()
    for _ in range(repeat):
        run()
    return (time.perf_counter() - begin) * 1e3 / repeat


def _tolerance(case: dict, name: str) -> tuple[float, float]:
    return LSE_TOLERANCE if name == "lse" else TOLERANCE[case["dtype"]]


def run_op(node: Node, case: dict) -> dict:
    arrays = make_arrays(case["inputs"], case["seed"])
    named = {spec["name"]: array for spec, array in zip(case["inputs"], arrays)}
    tensors = node.tensors(arrays)
    vm = node.vm(case["module"])
    got = dict(zip(case["outputs"], (o.astype(np.float64) for o in node.flatten(vm["main"](*tensors)))))
    result: dict = {"checks": [], "skipped": []}
    scale = case.get("scale", 1.0)
    if "reference" in case["expect"]:
        want = _reference(case, named)
        result["checks"] += [compare(f"{n} vs reference", got[n], want[n], _tolerance(case, n), scale) for n in got]
    floor_vm = node.vm(case["floor"]) if case.get("floor") else None
    if floor_vm is not None:
        floor = dict(zip(case["outputs"], node.flatten(floor_vm["main"](*tensors))))
        # both sides carry their own rounding: twice the tolerance against the truth
        result["checks"] += [compare(f"{n} vs floor", got[n], floor[n], _tolerance(case, n), 2 * scale) for n in got]
    peer = _torch(case, named, node.gpu) if case.get("torch") else None
    if isinstance(peer, str):
        result["skipped"].append(f"torch: {peer}")
    elif peer is not None:
        run, names = peer
        values = run()
        values = values if isinstance(values, tuple) else (values,)
        for name, value in zip(names, values):
            if name in got:
                torch_value = value.float().cpu().numpy()
                result["checks"].append(compare(f"{name} vs torch", got[name], torch_value, _tolerance(case, name),
                                                2 * scale))
    if case.get("time"):
        result["timings"] = _timings(node, case, vm, floor_vm, tensors, peer)
    result["status"] = "pass" if all(c["ok"] for c in result["checks"]) else "fail"
    return result


def _timings(node: Node, case: dict, vm, floor_vm, tensors, peer) -> dict:
    """Milliseconds of the kernels ("tuned"), the floor and PyTorch on the same inputs, with
    TFLOP/s (FlashAttention's count) and, for paged decode, GB/s of K/V read."""
    timings = {}
    timer = vm.time_evaluator("main", node.dev, number=5, repeat=5, min_repeat_ms=50)
    timings["tuned"] = {"ms": timer(*tensors).median * 1e3}
    if floor_vm is not None:
        timer = floor_vm.time_evaluator("main", node.dev, number=1, repeat=3)
        timings["floor"] = {"ms": timer(*tensors).median * 1e3}
    if peer is not None and not isinstance(peer, str):
        timings["torch"] = {"ms": _time_torch(peer[0], node.gpu)}
    hbm = node.describe().get("hbm_bytes_per_s")
    for entry in timings.values():
        entry["tflops"] = case["flops"] / entry["ms"] / 1e9
        if case.get("bytes"):
            entry["gbps"] = case["bytes"] / entry["ms"] / 1e6
            entry["hbm_fraction"] = entry["gbps"] * 1e9 / hbm if hbm else None
    return timings


def run_kernel(node: Node, case: dict) -> dict:
    """One knob point: its PrimFunc timed on valid inputs."""
    module = node.module(case["module"])
    tensors = node.tensors(make_arrays(case["inputs"], case["seed"]))
    module[case["function"]](*tensors)  # a launch error shows here, not inside the timer
    timer = module.time_evaluator(case["function"], node.dev, number=3, repeat=3, min_repeat_ms=20)
    seconds = list(timer(*tensors).results)
    return {"status": "pass", "seconds": statistics.median(seconds), "runs": seconds}


def run_verify(node: Node, case: dict) -> dict:
    """Knob points of one bucket re-measured in turns, the order rotated every round."""
    module = node.module(case["module"])
    tensors = node.tensors(make_arrays(case["inputs"], case["seed"]))
    functions = list(case["functions"])
    rounds: dict[str, list[float]] = {f: [] for f in functions}
    for index in range(case["rounds"]):
        shift = index % len(functions)
        for function in functions[shift:] + functions[:shift]:
            timer = module.time_evaluator(function, node.dev, number=3, repeat=1, min_repeat_ms=20)
            rounds[function].append(timer(*tensors).mean)
    return {"status": "pass", "seconds": rounds}


RUNNERS = {"op": run_op, "kernel": run_kernel, "verify": run_verify}


def main(argv: list[str]) -> int:
    bundle = Path(argv[0]).resolve()
    manifest = json.loads((bundle / "manifest.json").read_text())
    cases = json.loads(sys.stdin.read() or "[]")
    try:
        node = Node(bundle, manifest)
        emit(device=node.describe())
    except NodeError as err:
        emit(fatal=str(err))
        return 2
    for index, case in enumerate(cases):
        emit(start=index)
        begin = time.perf_counter()
        try:
            result = RUNNERS[case["kind"]](node, case)
        except Exception as err:  # noqa: BLE001 -- reported per case; the parent decides what follows
            lines = traceback.format_exception_only(type(err), err)
            result = {"status": "error", "error": " ".join(line.strip() for line in lines)[-1500:]}
        result["seconds_taken"] = time.perf_counter() - begin
        if node.store is not None:
            result["cubins"] = {"hits": node.store.hits, "compiled_here": node.store.misses}
        emit(result=result)
        if result["status"] == "error" and node.gpu:
            return 3  # a fresh process (and CUDA context) for the rest
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
