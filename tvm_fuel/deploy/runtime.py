"""What the node's Python needs besides the bundle's modules: a runtime-only TVM and two wheels.

TVM's Python package is copied without the compiler library and what only the compiler uses
(``import tvm`` then runs runtime-only); the ``apache-tvm-ffi`` wheel (a compiled extension, so
one per Python version) and the ``ml_dtypes`` one (bfloat16 arrays; used only where the node
lacks it) come for the node's Python, fetched with pip once and cached, or packed from this
installation when it is for the same Python.

Contents:
    node_runtime -- fill ``<bundle>/runtime``; the manifest's ``runtime`` entry
"""

from __future__ import annotations

import importlib
import importlib.metadata as metadata
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

import tvm

# what runtime-only TVM never loads: the compiler library and what only the compiler uses (its
# Python front ends, sources, third-party code, build files), and the extra library that only a
# full TVM loads
_COMPILER_ONLY = {"libtvm_compiler.so", "libtvm_runtime_extra.so", "3rdparty", "src", "include", "cmake", "lib64",
                  "relax", "topi", "s_tir", "contrib", "exec", "testing", "web", "__pycache__"}


def _copy_runtime(folder: Path) -> None:
    """TVM's python package as runtime-only TVM uses it (``load_module``, the VM, ``time_evaluator``):
    of ``tvm.backend`` only the loader (runtime-only TVM loads no backend's Python; the bundle
    loads the CUDA library itself)."""
    source = Path(tvm.__file__).parent
    top = {source, source / "lib"}

    def ignore(where, names):
        if Path(where) == source / "backend":
            return [n for n in names if (source / "backend" / n).is_dir()]
        return [n for n in names if n == "__pycache__" or (Path(where) in top and n in _COMPILER_ONLY)]

    shutil.copytree(source, folder / "tvm", ignore=ignore)
    try:
        import typing_extensions  # tvm_ffi needs it; the node may lack it (used only if so)

        (folder / "fallback").mkdir(parents=True, exist_ok=True)
        shutil.copy(typing_extensions.__file__, folder / "fallback" / "typing_extensions.py")
    except ImportError:
        pass


def _wheel(dist: str, package: str, python: tuple[int, int], folder: Path) -> Path:
    """The wheel of the installed version of ``dist`` for ``python`` (cached; fetched with pip,
    or packed from this installation when it is for the same Python)."""
    version = metadata.version(dist)
    tag = f"cp{python[0]}{python[1]}"
    cache = Path(os.environ.get("TVM_FUEL_CACHE", Path.home() / ".cache" / "tvm_fuel")) / "wheels"
    cache.mkdir(parents=True, exist_ok=True)
    pattern = f"{dist.replace('-', '_')}-{version}-{tag}-*.whl"
    found = sorted(cache.glob(pattern))
    errors = ""
    if not found:
        command = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "--python-version",
                   f"{python[0]}.{python[1]}", "--platform", f"manylinux_2_28_{platform.machine()}", "-d", str(cache),
                   f"{dist}=={version}"]
        done = subprocess.run(command, capture_output=True, text=True, check=False)
        errors = (done.stderr.strip().splitlines() or [""])[-1] if done.returncode else ""
        found = sorted(cache.glob(pattern))
    if not found and python == sys.version_info[:2]:
        found = [_pack_installed(package, cache / f"{dist.replace('-', '_')}-{version}-{tag}-{tag}-linux.whl")]
    if not found:
        raise RuntimeError(f"tvm_fuel bundle: no {dist} {version} wheel for Python {python[0]}.{python[1]} "
                           f"(pip download: {errors or 'nothing found'}); put one in {cache}")
    folder.mkdir(parents=True, exist_ok=True)
    shutil.copy(found[-1], folder / found[-1].name)
    return folder / found[-1].name


def _pack_installed(package: str, path: Path) -> Path:
    """A wheel-shaped zip of an installed package (its files as pip installed them)."""
    root = Path(importlib.import_module(package).__file__).parent
    with tempfile.NamedTemporaryFile(dir=path.parent, delete=False) as tmp, zipfile.ZipFile(tmp, "w",
                                                                                          zipfile.ZIP_DEFLATED) as z:
        for file in root.rglob("*"):
            if file.is_file() and "__pycache__" not in file.parts and "3rdparty" not in file.parts:
                z.write(file, Path(package) / file.relative_to(root))
    os.replace(tmp.name, path)
    return path


def node_runtime(bundle: Path, folder: str, python: tuple[int, int]) -> dict:
    """Copy the runtime-only TVM and the node Python's wheels into ``bundle / folder``."""
    wheels = {dist: _wheel(dist, package, python, bundle / folder / "wheels")
              for dist, package in (("apache-tvm-ffi", "tvm_ffi"), ("ml_dtypes", "ml_dtypes"))}
    _copy_runtime(bundle / folder)
    return {"wheels": {dist: str(path.relative_to(bundle)) for dist, path in wheels.items()},
            "ffi_version": metadata.version("apache-tvm-ffi")}
