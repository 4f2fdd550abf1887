"""Inspecting CUDA builds without a GPU: the emitted source, nvcc, shared memory per kernel.

Without a CUDA driver ``tvm.compile`` only emits CUDA C (TVM compiles it when the module is
loaded on a GPU), so invalid code would go unnoticed. These helpers compile the source with nvcc
and read what each kernel uses, for the tests and ``python -m tvm_fuel gpucheck``.

Contents:
    cuda_source        -- the CUDA C of a built module (Executable or runtime.Module)
    kernel_names       -- the ``__global__`` kernels of a source
    compile_cubin      -- nvcc the source for an architecture (raises with nvcc's message)
    ptxas_report       -- registers, stack frame and spills of every kernel, as ptxas reports them
    shared_memory      -- (static, dynamic) shared-memory bytes of every kernel of a build
    build_with_shared_memory -- the build and those bytes, from one compile
    nvcc_available

(Whether this machine has a CUDA device, and its sm_XY: ``tvm_fuel.target.has_gpu``, ``device_arch``.)
"""

from __future__ import annotations

import re
import shutil
import subprocess
import tempfile
from pathlib import Path
from typing import Any

import tvm
from tvm import tirx
from tvm.ir.instrument import pass_instrument

_BYTES = {"float16": 2, "bfloat16": 2, "float32": 4, "int32": 4, "int64": 8, "bool": 1, "int8": 1, "uint8": 1}


def cuda_source(built: Any) -> str:
    """The CUDA C of ``built`` (what ``tvm.compile`` returns); '' when it holds no CUDA module
    (an unbound PrimFunc silently becomes host code, so callers assert on this)."""
    module = getattr(built, "mod", built)

    def find(mod):
        if mod.kind == "cuda":
            return mod
        for child in mod.imports:
            found = find(child)
            if found is not None:
                return found
        return None

    cuda = find(module)
    return "" if cuda is None else cuda.inspect_source()


def kernel_names(source: str) -> list[str]:
    """Names of the ``__global__`` functions defined in ``source``."""
    return sorted(set(re.findall(r"__global__ void (?:__launch_bounds__\(\d+(?:, \d+)?\) )?(\w+)\(", source)))


def nvcc_available() -> bool:
    return shutil.which("nvcc") is not None


def compile_cubin(source: str, arch: str) -> bytes:
    """The cubin nvcc makes of ``source`` for ``arch`` (e.g. "sm_90")."""
    from tvm.support import nvcc

    with tvm.target.Target({"kind": "cuda", "arch": arch}):  # nvcc reads the arch from the target scope
        return nvcc.compile_cuda(source, target_format="cubin", compiler="nvcc")


def ptxas_report(source: str, arch: str) -> dict[str, dict[str, int]]:
    """``{kernel: {"registers", "stack_frame", "spill_stores", "spill_loads"}}`` as ptxas reports
    them (``-v``) when nvcc compiles ``source`` for ``arch`` (a stack frame means local memory:
    e.g. a register array indexed by a value nvcc could not unroll into a constant)."""
    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder) / "kernels.cu"
        path.write_text(source)
        done = subprocess.run(["nvcc", "--cubin", f"-arch={arch}", "-O3", "-Xptxas", "-v", "-o",
                               str(path.with_suffix(".cubin")), str(path)], capture_output=True, text=True, check=False)
    if done.returncode:
        raise RuntimeError(f"nvcc failed: {done.stderr.strip()[:500]}")
    report, kernel = {}, None
    for line in done.stderr.splitlines():
        if match := re.search(r"Compiling entry function '(\w+)'", line):
            kernel = match.group(1)
            report[kernel] = {"registers": 0, "stack_frame": 0, "spill_stores": 0, "spill_loads": 0}
        elif kernel and (match := re.search(r"(\d+) bytes stack frame, (\d+) bytes spill stores, "
                                            r"(\d+) bytes spill loads", line)):
            report[kernel].update(stack_frame=int(match.group(1)), spill_stores=int(match.group(2)),
                                  spill_loads=int(match.group(3)))
        elif kernel and (match := re.search(r"Used (\d+) registers", line)):
            report[kernel]["registers"] = int(match.group(1))
    return report


def _sizes(stmt) -> list[tuple[str, int, str]]:
    """(kernel, bytes, scope) of every shared allocation under each outermost blockIdx launch."""
    found: list[tuple[str, int, str]] = []
    kernels = [0]

    def visit(node, kernel):
        if isinstance(node, tirx.AttrStmt) and node.attr_key == "thread_extent" and kernel is None:
            if str(getattr(node.node, "thread_tag", "")).startswith("blockIdx"):
                kernel, kernels[0] = f"kernel{kernels[0]}", kernels[0] + 1
                found.append((kernel, 0, "shared"))
        if isinstance(node, tirx.AllocBuffer) and kernel is not None:
            scope = node.buffer.scope()
            if scope in ("shared", "shared.dyn"):
                size = 1
                for dim in node.buffer.shape:
                    size *= int(dim)
                found.append((kernel, size * _BYTES.get(str(node.buffer.dtype), 4), scope))
        for child in _children(node):
            visit(child, kernel)

    visit(stmt, None)
    return found


def _children(node):
    if isinstance(node, tirx.SeqStmt):
        return list(node.seq)
    kids = []
    for name in ("body", "then_case", "else_case"):
        child = getattr(node, name, None)
        if isinstance(child, tirx.Stmt):
            kids.append(child)
    return kids


def build_with_shared_memory(mod: tvm.IRModule | tirx.PrimFunc, target: tvm.target.Target):
    """(what ``tvm.compile`` returns, ``{"<func>/kernel<i>": (static bytes, dynamic bytes)}``):
    one build, and the shared allocations TVM lowers each CUDA kernel with (dynamic ones before
    they are merged, so an upper bound)."""
    seen: dict[str, tirx.PrimFunc] = {}

    @pass_instrument
    class Capture:
        def run_before_pass(self, module, info):
            if info.name.endswith("ThreadSync") and not seen:
                seen.update({gv.name_hint: f for gv, f in module.functions.items() if isinstance(f, tirx.PrimFunc)})

    with tvm.transform.PassContext(instruments=[Capture()]):
        built = tvm.compile(mod, target=target)
    usage: dict[str, tuple[int, int]] = {}
    for name, func in seen.items():
        for kernel, size, scope in _sizes(func.body):
            static, dynamic = usage.get(f"{name}/{kernel}", (0, 0))
            usage[f"{name}/{kernel}"] = (static + size, dynamic) if scope == "shared" else (static, dynamic + size)
    return built, usage


def shared_memory(mod: tvm.IRModule | tirx.PrimFunc, target: tvm.target.Target) -> dict[str, tuple[int, int]]:
    """``{"<func>/kernel<i>": (static bytes, dynamic bytes)}`` for every CUDA kernel of ``mod``."""
    return build_with_shared_memory(mod, target)[1]


__all__ = ["cuda_source", "kernel_names", "compile_cubin", "ptxas_report", "shared_memory", "build_with_shared_memory",
           "nvcc_available"]
