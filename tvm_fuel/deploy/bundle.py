"""``python -m tvm_fuel bundle``: build a suite's modules here, for a node without TVM or a network.

The bundle folder holds::

    run.py, manifest.json     the entry point and every case (inputs as seeded fills, no data)
    fuel_node/                the node's code: tvm_fuel.deploy.node, the tvm_fuel.testing modules it
                              imports (arrays, compare, peers) and tvm_fuel.reference (``node_code``)
    modules/*.so              exported Relax executables (kernels and floor), libraries of TVM-cache
                              slot kernels (fuel's and TVM's); tune/*.so kernel points
    cubins/<sha256>.cubin.gz  nvcc's cubin of each CUDA module's source (gzip), by the source's hash
    runtime/tvm/              TVM without its compiler library (runtime-only)
    runtime/wheels/*.whl      the apache-tvm-ffi and ml_dtypes wheels for the node's Python

The manifest (``node.manifest``: its schema) lists every file the build wrote. A build into a
folder that holds an earlier bundle removes exactly those files and what that bundle's run.py
wrote (unpacked wheels, ``__pycache__``), and only when the folder holds nothing else: a results
file kept inside, a user's notes or any other folder make it refuse and leave everything as it
was. The new bundle is written beside ``--out`` and moved in only when complete, so a failed
build leaves the earlier bundle whole.

Every case's module is built with ``tvm_fuel.compile``'s legalization and checked to run the
performance-path kernels (a silent fall back to the floor is an error here, not a surprise on
the node). The tune stage's modules hold every knob point of a CUDA kernel's space that fits
the architecture (``CudaRule.knob_points``), one PrimFunc each.

Contents:
    build_bundle -- the folder for a target, arch, suite and node Python
    tune_bucket  -- one tune bucket's module and cases
    ARCHS
"""

from __future__ import annotations

import gzip
import json
import os
import random
import re
import shutil
import sys
import time
import uuid
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Callable

import tvm
from tvm import tirx
from tvm.s_tir import meta_schedule as ms

from .. import __version__
from ..outputs import check_output_dir
from . import nvcc as cuda
from ..transform.legalize_fuel import legalize
from ..schedules import rule_for
from ..schedules.cuda.device import SHARED_MEMORY_LIMIT
from ..tuning.buckets import bucket_module
from ..tuning.measure import input_specs
from ..tuning.kernels import workloads_of
from . import suites
from .runtime import node_runtime
from .node.environment import NodeError, cubin_name, source_key, written_by_node
from .node.manifest import SCHEMA, bundle_files, read_manifest
from .node_code import write_node

ARCHS = tuple(SHARED_MEMORY_LIMIT)  # the CUDA architectures the kernels have rules for
LIMIT_BYTES = 48_000_000  # 48 MB, counted the strict way
TUNE_POINTS = 64  # knob points per tune bucket by default (each costs ~60 KB of source and cubin)
_RUN_PY = '''#!/usr/bin/env python3
"""Runs this tvm_fuel bundle here: python3 run.py [--stages smoke,check,bench,tune] [--out results.json]"""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from fuel_node.main import main  # noqa: E402

sys.exit(main())
'''


def _target(kind: str, arch: str | None) -> tuple[tvm.target.Target, str | None]:
    if kind == "cuda":
        arch = arch or "sm_90"
        if arch not in ARCHS:
            raise ValueError(f"tvm_fuel bundle: unknown --arch {arch!r} for cuda (known: {', '.join(ARCHS)})")
        return tvm.target.Target({"kind": "cuda", "arch": arch}), arch
    if kind == "llvm":
        if arch not in (None, "generic"):
            raise ValueError(f"tvm_fuel bundle: --arch {arch!r} is for cuda; an llvm bundle is built for the "
                             "generic x86-64 CPU")
        return tvm.target.Target("llvm"), None
    raise ValueError(f"tvm_fuel bundle: --target must be cuda or llvm, got {kind!r}")


def _python(version: str | None) -> tuple[int, int]:
    if version is None:
        return sys.version_info[:2]
    match = re.fullmatch(r"3\.(\d+)", version)
    if not match or int(match.group(1)) < 9:
        raise ValueError(f"tvm_fuel bundle: --python must be like 3.12, got {version!r}")
    return 3, int(match.group(1))


class _Cubins:
    """nvcc in background threads while the next modules build; one cubin per distinct source."""

    def __init__(self, folder: Path, arch: str | None):
        self.folder, self.arch = folder, arch
        self.pool = ThreadPoolExecutor(max_workers=max(1, (os.cpu_count() or 2)))
        self.jobs: dict[str, Future] = {}

    def add(self, built) -> str | None:
        """The key of ``built``'s CUDA source (its cubin compiles meanwhile); None for a CPU module."""
        source = cuda.cuda_source(built) if self.arch else ""
        if not source:
            return None
        key = source_key(source)
        if key not in self.jobs:
            self.folder.mkdir(parents=True, exist_ok=True)
            self.jobs[key] = self.pool.submit(self._compile, source, self.folder / cubin_name(key))
        return key

    def _compile(self, source: str, path: Path) -> None:
        path.write_bytes(gzip.compress(cuda.compile_cubin(source, self.arch), mtime=0))

    def wait(self) -> None:
        for key, job in self.jobs.items():
            try:
                job.result()
            except Exception as err:
                raise RuntimeError(f"tvm_fuel bundle: nvcc failed on module source {key[:12]}: {err}") from err


def _floor_names() -> set[str]:
    """The floor's PrimFunc names of the ops that have kernels (their presence means a fall back)."""
    return {f"fuel_{op}" for op in suites.OUTPUTS}


def _export(mod: tvm.IRModule, target, kernels: str, path: Path, cubins: _Cubins, what: str) -> dict:
    legalized = legalize(mod, target, kernels=kernels)
    info = {}
    if kernels == "tuned":
        funcs = {gv.name_hint: f for gv, f in legalized.functions.items() if isinstance(f, tirx.PrimFunc)}
        used = {name: str(f.attrs["fuel.knobs"]) for name, f in funcs.items()
                if f.attrs is not None and "fuel.workload" in f.attrs}
        floors = sorted(set(funcs) & _floor_names())
        if not used or floors:
            raise RuntimeError(f"tvm_fuel bundle: {what} falls back to the floor ({floors or 'no kernel'}) on {target}")
        info["kernels"] = used
    return {**_write(legalized, target, path, cubins), **info}


def _export_kernels(mod: tvm.IRModule, target, path: Path, cubins: _Cubins) -> dict:
    """A module of scheduled PrimFuncs, built and exported as it is."""
    return {**_write(mod, target, path, cubins), "kernels": sorted(gv.name_hint for gv in mod.functions)}


def _write(mod: tvm.IRModule, target, path: Path, cubins: _Cubins) -> dict:
    """``mod`` built and exported to ``path`` (its cubin compiling meanwhile): module and cubin keys."""
    built = tvm.compile(mod, target=target)
    built.export_library(str(path))
    info = {"module": str(path.relative_to(path.parent.parent))}
    key = cubins.add(built)
    if key:
        info["cubin"] = key
    return info


def _slug(name: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.-]+", "_", name).strip("_")


def _point_inputs(func: tirx.PrimFunc) -> list[dict]:
    """Valid inputs of a kernel PrimFunc (the tuner's fills), named by its parameters."""
    infos = ms.arg_info.ArgInfo.from_prim_func(func)
    specs = input_specs((info.dtype, info.shape) for info in infos)
    return [{"name": param.name, **spec} for param, spec in zip(func.params, specs)]


def _tune_stage(target, out: Path, cubins: _Cubins, limit: int | None, log) -> tuple[list[dict], list[dict]]:
    """(buckets, point cases): every fitting knob point of each tune bucket, one module per bucket."""
    buckets, cases = [], []
    for index, (op, shape) in enumerate(suites.tune_buckets()):
        (workload,) = workloads_of(bucket_module(op, shape), target)
        points = rule_for(workload.op, target).knob_points(workload, target)  # the hand-picked knobs first
        if limit and len(points) > limit:
            points = points[:1] + random.Random(index).sample(points[1:], limit - 1)
        start = time.perf_counter()
        bucket, points = tune_bucket(out, f"bucket{index}", workload, points, target, cubins.add)
        buckets.append(bucket)
        cases += points
        log(f"  tune {workload.describe()}: {len(points)} knob points built in {time.perf_counter() - start:.0f} s")
    return buckets, cases


def tune_bucket(out: Path, name: str, workload, points: list[dict], target: tvm.target.Target,
                add_cubin: Callable = lambda built: None) -> tuple[dict, list[dict]]:
    """One tune bucket of a bundle in ``out``: a module holding ``workload``'s kernel at each knob
    point (``point_<i>``; the first is the hand-picked one), and a ``kernel`` case per point."""
    rule = rule_for(workload.op, target)
    funcs = {f"point_{i}": rule.kernel(workload, knobs, static=True).with_attr("global_symbol", f"point_{i}")
             for i, knobs in enumerate(points)}
    built = tvm.compile(tvm.IRModule(funcs), target=target)
    (out / "tune").mkdir(exist_ok=True)
    built.export_library(str(out / "tune" / f"{name}.so"))
    bucket = {"id": name, "module": f"tune/{name}.so", "workload": workload.key, "describe": workload.describe(),
              "seed": 500, "inputs": _point_inputs(funcs["point_0"]), "cubin": add_cubin(built),
              "target": {"kind": target.kind.name, **({"arch": str(target.attrs["arch"])}
                                                       if target.kind.name == "cuda" else {})}}
    cases = [{"kind": "kernel", "stage": "tune", "name": f"tune/{name}/point_{i}", "module": bucket["module"],
              "function": f"point_{i}", "inputs": bucket["inputs"], "seed": bucket["seed"], "bucket": name,
              "knobs": knobs, "hand_picked": i == 0} for i, knobs in enumerate(points)]
    return bucket, cases


def _size(folder: Path) -> int:
    return sum(f.stat().st_size for f in folder.rglob("*") if f.is_file())


def build_bundle(out: str | os.PathLike, *, target: str = "cuda", arch: str | None = None, suite: str = "all",
                 python: str | None = None, small: bool = False, tune_points: int | None = None,
                 log: Callable[[str], None] = print) -> dict:
    """Build the bundle of ``suite`` for ``target`` (cuda with ``arch``, or llvm) into ``out``;
    return its manifest. ``small``: a reduced check matrix (the CI test's); ``tune_points``: at
    most this many knob points per tune bucket (the hand-picked ones and a seeded sample; default
    ``TUNE_POINTS``). ``out`` is checked first (``tvm_fuel.outputs.check_output_dir``, then
    ``_earlier_bundle``): refused now, not after minutes of building."""
    out = check_output_dir(out, "--out", who="tvm_fuel bundle")
    _earlier_bundle(out)
    tvm_target, arch = _target(target, arch)
    node_python = _python(python)
    cases = suites.cases(suite, target, small=small)  # validates the suite name
    tune = "tune" in suites.SUITES[suite] and target == "cuda"  # CPU kernels tune here (python -m tvm_fuel tune)
    if suite == "tune" and not tune:
        raise ValueError("tvm_fuel bundle: the tune suite measures CUDA kernels; CPU kernels tune locally "
                         "(python -m tvm_fuel tune)")
    tune_points = TUNE_POINTS if tune_points is None else tune_points
    if tune_points < 1:
        raise ValueError(f"tvm_fuel bundle: --tune-points must be >= 1, got {tune_points}")
    if target == "cuda" and not cuda.nvcc_available():
        raise RuntimeError("tvm_fuel bundle: a cuda bundle needs nvcc here (the node compiles nothing)")
    # built in a fresh folder beside ``out`` and moved in only when complete: a failed build
    # leaves ``out`` as it was
    real = out.resolve()
    work = real.parent / f".{real.name}.building-{uuid.uuid4().hex[:8]}"
    work.mkdir(parents=True)
    try:
        manifest, cubin_count, seconds = _fill(work, tvm_target, arch, cases, tune, tune_points, node_python,
                                               dict(target=target, suite=suite, small=small), log)
        size = _size(work)
        log(f"bundle {manifest['bundle_id']} in {out}: {len(manifest['cases'])} cases, {cubin_count} cubins, "
            f"{size / 1e6:.1f} MB, built in {seconds:.0f} s")
        if size > LIMIT_BYTES:
            raise RuntimeError(f"tvm_fuel bundle: {out} would be {size / 1e6:.1f} MB, over the 48 MB a bundle may "
                               "take (fewer --tune-points make it smaller)")
        _move_in(work, out)
    finally:
        shutil.rmtree(work, ignore_errors=True)  # this build's own folder (empty once moved in)
    return manifest


def _fill(work: Path, tvm_target, arch, cases, tune, tune_points, node_python, options: dict, log):
    """Write the bundle into the empty folder ``work``: (manifest, cubins, seconds)."""
    (work / "modules").mkdir()
    start = time.perf_counter()
    cubins = _Cubins(work / "cubins", arch)
    try:
        manifest = _build(work, tvm_target, arch, cases, cubins, tune, tune_points, log)
    finally:
        cubins.pool.shutdown(cancel_futures=True)  # a failed build does not wait for nvcc
    manifest["bundle"] = {**options, "arch": arch, "python": f"{node_python[0]}.{node_python[1]}",
                          "tvm": tvm.__version__, "tvm_fuel": __version__,
                          "built": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
    manifest["target"] = {"device": "cuda" if options["target"] == "cuda" else "cpu", "arch": arch}
    manifest["runtime"] = node_runtime(work, "runtime", node_python)
    write_node(work)
    (work / "run.py").write_text(_RUN_PY)
    # every file this build wrote: what a later build into the same folder may remove
    files = sorted(str(f.relative_to(work).as_posix()) for f in work.rglob("*") if f.is_file())
    manifest = {"schema": SCHEMA, **manifest, "files": sorted(files + ["manifest.json"])}
    (work / "manifest.json").write_text(json.dumps(manifest, indent=1))
    return manifest, len(cubins.jobs), time.perf_counter() - start


def _earlier_bundle(out: Path) -> list[Path]:
    """What must go before a bundle is written to ``out``: the files of the earlier bundle there
    (deepest first, its folders after their files); ValueError where ``out`` holds anything else.

    Only a folder whose manifest is a bundle manifest of this schema is replaced, and only when
    every entry in it is a file that bundle listed as written, or one its run.py writes (unpacked
    wheels, ``__pycache__``); anything else there (a results file, a user's notes, a symbolic
    link) makes the command refuse, so that nothing it did not write is ever removed."""
    if not out.exists() and not out.is_symlink():
        return []
    if not out.is_dir():
        raise ValueError(f"tvm_fuel bundle: --out {out} is not a folder; choose another --out")
    if not any(out.iterdir()):
        return []
    try:
        manifest = read_manifest(out)
    except NodeError as err:
        raise ValueError(f"tvm_fuel bundle: --out {out} is not empty and is not an earlier bundle: {err}; "
                         "choose another --out") from None
    listed = {str(path) for path in bundle_files(manifest)}
    holding = _folders(listed)
    by_node = written_by_node(out, manifest)
    ours, foreign = [], []
    for where, folders, names in os.walk(out, topdown=False):  # files before the folders holding them
        base = Path(where).relative_to(out)
        for name in names:
            relative = base / name
            (ours if relative.as_posix() in listed or by_node(relative) else foreign).append(relative)
        for name in folders:
            relative = base / name
            if (out / relative).is_symlink():  # never followed: its target is not the bundle's
                foreign.append(relative)
            elif any((out / relative).iterdir()) or relative.as_posix() + "/" in holding:
                ours.append(relative)  # a folder whose entries are all checked in this walk
            else:
                foreign.append(relative)  # an empty folder the bundle did not make
    if foreign:
        shown = ", ".join(str(p) for p in sorted(foreign)[:3]) + (f" and {len(foreign) - 3} more" if len(foreign) > 3
                                                                 else "")
        count = f"{len(foreign)} {'entry' if len(foreign) == 1 else 'entries'}"
        raise ValueError(f"tvm_fuel bundle: --out {out} holds an earlier bundle ({manifest['bundle_id']}) and "
                         f"{count} it did not write ({shown}); move them out or choose another --out")
    return ours


def _folders(files: set[str]) -> set[str]:
    """The folders (``a/b/``) that hold the listed files."""
    return {"/".join(f.split("/")[:i]) + "/" for f in files for i in range(1, f.count("/") + 1)}


def _move_in(work: Path, out: Path) -> None:
    """Replace the earlier bundle in ``out`` (checked again: minutes passed) by the finished ``work``."""
    earlier = _earlier_bundle(out)
    out.mkdir(parents=True, exist_ok=True)
    for path in earlier:
        target = out / path
        if target.is_dir() and not target.is_symlink():
            target.rmdir()  # empty now (OSError, and the file stays, where one appeared meanwhile)
        else:
            target.unlink()
    entries = sorted(work.iterdir(), key=lambda p: p.name == "manifest.json")  # the manifest last: complete
    for entry in entries:
        os.rename(entry, out / entry.name)


def _build(out: Path, tvm_target, arch, cases, cubins: _Cubins, tune: bool, tune_points, log) -> dict:
    """Every case's modules (and the tune stage's), their cubins compiled: the manifest's cases."""
    start = time.perf_counter()
    specs = []
    for index, case in enumerate(cases):
        spec = case.spec()
        path = out / "modules" / f"{index:03d}_{_slug(case.name)}"
        if isinstance(case, suites.SlotCase):  # PrimFuncs already scheduled: no legalization, no floor
            spec.update(_export_kernels(case.module(tvm_target), tvm_target, path.with_suffix(".so"), cubins))
            specs.append(spec)
            continue
        mod = suites.case_module(case)
        spec.update(_export(mod, tvm_target, "tuned", path.with_suffix(".so"), cubins, case.name))
        if "floor" in case.expect:
            floor = _export(mod, tvm_target, "decomposed", path.with_name(path.name + ".floor.so"), cubins, case.name)
            spec["floor"], spec["floor_cubin"] = floor["module"], floor.get("cubin")
        specs.append(spec)
    log(f"  {len(specs)} case modules built in {time.perf_counter() - start:.0f} s")
    buckets = []
    if tune:
        buckets, points = _tune_stage(tvm_target, out, cubins, tune_points, log)
        specs += points
    cubins.wait()
    return {"bundle_id": uuid.uuid4().hex[:12], "cases": specs, "tune_buckets": buckets}


__all__ = ["build_bundle", "ARCHS"]
