"""The node's TVM: the bundle's runtime-only package, tvm_ffi from the bundle's wheel, CUDA loaded by hand.

Nothing here is installed: ``worker_environment`` puts the bundle's ``runtime/`` (TVM without its
compiler library) and the unpacked tvm_ffi wheel first on ``PYTHONPATH`` of each worker process,
with ``TVM_USE_RUNTIME_LIB=1``. In a worker, ``load_tvm`` checks that the TVM it imported is the
bundle's and runs runtime-only; ``load_cuda`` loads ``libtvm_runtime_cuda.so`` (runtime-only TVM
loads no device backend) after a ``libcudart.so.13`` it finds, and ``CubinStore`` answers TVM's
``tvm_callback_cuda_compile`` with the cubins nvcc made at bundle time, looked up by the SHA-256
of the CUDA source; a source it does not hold is compiled here (nvcc, else NVRTC) and counted.

Contents:
    NodeError            -- a one-line reason the node cannot run the bundle
    worker_environment   -- os.environ for a worker process
    written_by_node      -- what run.py writes inside the bundle (a rebuild may remove it)
    load_tvm, load_cuda  -- in a worker
    CubinStore           -- the compile callback over the bundle's cubins
"""

from __future__ import annotations

import ctypes
import glob
import gzip
import hashlib
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path


class NodeError(RuntimeError):
    """The node cannot run (part of) the bundle; the message says why in one line."""


PROTOCOL_FD = "FUEL_PROTOCOL_FD"  # the worker's report pipe (supervisor)


def _python_tag() -> str:
    return f"cp{sys.version_info.major}{sys.version_info.minor}"


def _unpack_folder(wheel: str) -> str:
    """The name of the folder a wheel is unpacked into (not the package's: runtime/ is on the path)."""
    return f"unpacked-{Path(wheel).name.split('-')[0]}"


def _unpacked(bundle: Path, manifest: dict, wheel: Path) -> Path:
    """The folder holding ``wheel`` unpacked (once; in the bundle, or a temporary folder when the
    bundle is read-only)."""
    for parent in (bundle / "runtime", Path(tempfile.gettempdir()) / f"tvm_fuel_bundle_{manifest['bundle_id']}"):
        target = parent / _unpack_folder(wheel.name)
        if (target / ".unpacked").exists():
            return target
        try:
            target.mkdir(parents=True, exist_ok=True)
            with zipfile.ZipFile(wheel) as archive:
                archive.extractall(target)
            (target / ".unpacked").touch()
            return target
        except OSError:
            continue
    raise NodeError(f"cannot unpack {wheel} (no writable folder)")


def written_by_node(bundle: Path, manifest: dict):
    """A test of a path relative to ``bundle``: whether the node's run.py writes such a file there
    (the wheels' unpacked files, ``.unpacked``, and Python's ``__pycache__/*.pyc`` in its code), so
    that a rebuild may remove it as the bundle's own."""
    unpacked = set()
    for wheel in manifest["runtime"]["wheels"].values():
        folder = Path("runtime") / _unpack_folder(wheel)
        try:
            with zipfile.ZipFile(bundle / wheel) as archive:
                names = [name for name in archive.namelist() if not name.endswith("/")]
        except (OSError, zipfile.BadZipFile):
            continue  # without its wheel nothing in that folder is known to be the node's
        unpacked |= {str(folder / name) for name in names} | {str(folder / ".unpacked")}

    def test(path) -> bool:
        parts = Path(path).parts
        if len(parts) > 2 and parts[0] in ("fuel_node", "runtime") and parts[-2] == "__pycache__":
            return parts[-1].endswith(".pyc")
        return str(Path(path)) in unpacked

    return test


def _for_this_python(bundle: Path, manifest: dict, name: str) -> Path | None:
    """The bundle's wheel of package ``name`` if it was built for this Python, else None."""
    wheel = manifest["runtime"]["wheels"].get(name)
    return bundle / wheel if wheel and f"-{_python_tag()}-" in wheel else None


def _ffi_path(bundle: Path, manifest: dict) -> Path | None:
    """Where the bundle's tvm_ffi is for this Python, or None where an installed tvm_ffi of the
    same version is used instead (the bundle's wheel is for another Python)."""
    wheel = _for_this_python(bundle, manifest, "apache-tvm-ffi")
    if wheel is not None:
        return _unpacked(bundle, manifest, wheel)
    try:
        import importlib.metadata as metadata

        installed = metadata.version("apache-tvm-ffi")
    except Exception:  # noqa: BLE001 (not installed)
        installed = None
    if installed == manifest["runtime"]["ffi_version"]:
        return None
    raise NodeError(f"the bundle's tvm_ffi wheel is for Python {manifest['bundle']['python']}, this is "
                    f"{sys.version.split()[0]}; "
                    f"rebuild it with --python {sys.version_info.major}.{sys.version_info.minor}")


def worker_environment(bundle: Path, manifest: dict) -> dict[str, str]:
    """Environment of a worker process: the bundle's TVM and tvm_ffi first on the path, runtime-only."""
    ffi = _ffi_path(bundle, manifest)
    paths = [str(bundle / "runtime")] + ([str(ffi)] if ffi else []) + [str(bundle)]
    env = dict(os.environ)
    if env.get("PYTHONPATH"):
        paths.append(env["PYTHONPATH"])
    env["PYTHONPATH"] = os.pathsep.join(paths)
    env["TVM_USE_RUNTIME_LIB"] = "1"
    return env


def _fallbacks(bundle: Path, manifest: dict) -> None:
    """What TVM needs and the node may lack, from the bundle, behind the node's own packages."""
    try:
        import typing_extensions  # noqa: F401 -- tvm_ffi needs it
    except ImportError:
        sys.path.append(str(bundle / "runtime" / "fallback"))
    try:
        import ml_dtypes  # noqa: F401 -- bfloat16 arrays (numpy has no bfloat16)
    except ImportError:
        wheel = _for_this_python(bundle, manifest, "ml_dtypes")
        if wheel is not None:
            sys.path.append(str(_unpacked(bundle, manifest, wheel)))


def load_tvm(bundle: Path, manifest: dict):
    """``import tvm``, checked to be the bundle's runtime-only package."""
    _fallbacks(bundle, manifest)
    try:
        import tvm
    except Exception as err:
        raise NodeError(f"the bundle's TVM runtime does not import here: {type(err).__name__}: {err}") from err
    where = Path(tvm.__file__).resolve()
    if (bundle / "runtime").resolve() not in where.parents:
        raise NodeError(f"tvm was imported from {where.parent}, not from the bundle")
    if not tvm.base._RUNTIME_ONLY:  # noqa: SLF001 (TVM says it only there)
        raise NodeError("the bundle's TVM did not start runtime-only")
    return tvm


def _cudart_candidates() -> list[str]:
    found = ["libcudart.so.13"]  # the system's, where the loader finds it
    roots = [os.environ.get("CUDA_HOME", ""), "/usr/local/cuda", *sorted(glob.glob("/usr/local/cuda-13*"))]
    found += [str(Path(root) / sub / "libcudart.so.13") for root in roots if root for sub in ("lib64", "lib")]
    for entry in sys.path:  # PyTorch's CUDA wheels bring their own runtime
        found += sorted(glob.glob(os.path.join(entry, "nvidia", "*", "lib", "libcudart.so.13")))
    return found


def load_cuda(tvm) -> None:
    """Load TVM's CUDA backend into this runtime-only process; NodeError when it cannot run."""
    errors = []
    for candidate in _cudart_candidates():
        try:
            ctypes.CDLL(candidate, mode=ctypes.RTLD_GLOBAL)
            break
        except OSError as err:
            errors.append(str(err))
    else:
        raise NodeError(f"no libcudart.so.13 found (CUDA 13 runtime): {errors[0]}")
    library = Path(tvm.__file__).parent / "lib" / "libtvm_runtime_cuda.so"
    try:
        ctypes.CDLL(str(library), mode=ctypes.RTLD_GLOBAL)
    except OSError as err:
        raise NodeError(f"TVM's CUDA backend does not load (driver missing?): {err}") from err
    try:
        exists = tvm.cuda(0).exist
    except Exception as err:
        raise NodeError(f"CUDA does not start: {err}") from err
    if not exists:
        raise NodeError("no CUDA device is visible (tvm.cuda(0).exist is False)")


def source_key(source: str) -> str:
    """The key of a CUDA source (its SHA-256), which names its cubin (``cubin_name``): bundle and
    node agree on it."""
    return hashlib.sha256(source.encode()).hexdigest()


class CubinStore:
    """``tvm_callback_cuda_compile``: the bundle's cubin for a source (``<key>.cubin.gz``, gzip:
    cubins shrink ~5x, which keeps a whole suite within what a node takes), else a compile here."""

    def __init__(self, folder: Path, arch: str):
        self.folder, self.arch = folder, arch
        self.hits, self.misses = 0, 0

    def register(self) -> None:
        import tvm_ffi

        tvm_ffi.register_global_func("tvm_callback_cuda_compile", self.compile, override=True)

    def compile(self, source, *_target) -> bytes:
        source = str(source)
        cubin = self.folder / cubin_name(source_key(source))
        if cubin.exists():
            self.hits += 1
            return gzip.decompress(cubin.read_bytes())
        self.misses += 1
        return compile_here(source, self.arch)


def cubin_name(key: str) -> str:
    """The file of the cubin of the source whose key is ``key``, in a bundle's cubins/."""
    return f"{key}.cubin.gz"


def compile_here(source: str, arch: str) -> bytes:
    """A cubin of ``source`` made on this node: nvcc where it is on the PATH, else NVRTC."""
    nvcc = shutil.which("nvcc") or next(iter(glob.glob("/usr/local/cuda*/bin/nvcc")), None)
    if nvcc:
        with tempfile.TemporaryDirectory() as tmp:
            src, out = Path(tmp) / "kernel.cu", Path(tmp) / "kernel.cubin"
            src.write_text(source)
            done = subprocess.run([nvcc, "--cubin", "-O3", f"-arch={arch}", "-std=c++17", "-o", str(out), str(src)],
                                  capture_output=True, text=True, check=False)
            if done.returncode:
                raise NodeError(f"nvcc failed on a kernel: {done.stderr.strip()[:400]}")
            return out.read_bytes()
    return _nvrtc(source, arch)


def _nvrtc(source: str, arch: str) -> bytes:
    try:
        from cuda.bindings import nvrtc
    except ImportError as err:
        raise NodeError("a kernel's cubin is not in the bundle and neither nvcc nor cuda-bindings is here") from err

    def check(result):
        if result[0] != nvrtc.nvrtcResult.NVRTC_SUCCESS:
            raise NodeError(f"NVRTC: {result[0]}")
        return result[1:]

    (program,) = check(nvrtc.nvrtcCreateProgram(source.encode(), b"kernel.cu", 0, [], []))
    options = [f"-arch={arch}".encode(), b"-std=c++17", b"-default-device"]
    result = nvrtc.nvrtcCompileProgram(program, len(options), options)
    if result[0] != nvrtc.nvrtcResult.NVRTC_SUCCESS:
        (size,) = check(nvrtc.nvrtcGetProgramLogSize(program))
        log = b" " * size
        check(nvrtc.nvrtcGetProgramLog(program, log))
        raise NodeError(f"NVRTC failed on a kernel: {log.decode(errors='replace').strip()[:400]}")
    (size,) = check(nvrtc.nvrtcGetCUBINSize(program))
    cubin = b" " * size
    check(nvrtc.nvrtcGetCUBIN(program, cubin))
    return cubin
