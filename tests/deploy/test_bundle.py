"""Deploy bundles: built here, run where only Python, numpy and the bundle's runtime-only TVM are.

The llvm bundle runs end to end in a fresh virtual environment holding numpy and the tvm_ffi
wheel only (no apache-tvm): export, load, run and compare without a GPU. The CUDA bundle is
built and checked here (every module has its nvcc cubin, no compiler library, the size); run
here, without a GPU, it refuses in one line. ``tune --import`` turns a bundle's measurements
into records that ``tvm_fuel.compile`` applies.
"""

from __future__ import annotations

import gzip
import json
import math
import os
import re
import shutil
import statistics
import subprocess
import sys
from pathlib import Path

import pytest
import tvm

import tvm_fuel
from tvm_fuel.deploy import nvcc as cuda
from tvm_fuel.deploy import suites
from tvm_fuel.cli import main
from tvm_fuel.deploy import bundle as bundle_module
from tvm_fuel.deploy.bundle import build_bundle, tune_bucket
from tvm_fuel.deploy.imports import import_results
from tvm_fuel.deploy.node.environment import CubinStore, cubin_name, source_key
from tvm_fuel.deploy.suites import tune_buckets
from tvm_fuel.kv_cache import TVM_SLOTS
from tvm_fuel.schedules import rule_for
from tvm_fuel.tuning.buckets import bucket_module
from tvm_fuel.dispatch.records import TuningRecords
from tvm_fuel.tuning.kernels import workloads_of

# its module-scoped fixtures tune or build bundles: one worker runs the module, so they are built once
pytestmark = [pytest.mark.integration, pytest.mark.slow, pytest.mark.xdist_group("test_deploy")]

needs_nvcc = pytest.mark.skipif(not cuda.nvcc_available(), reason="nvcc is not installed")


@pytest.fixture(scope="module")
def venv(tmp_path_factory) -> Path:
    """A virtual environment with numpy only (tvm_ffi comes from the bundle); no apache-tvm."""
    folder = tmp_path_factory.mktemp("venv")
    subprocess.run([sys.executable, "-m", "venv", str(folder)], check=True)
    python = folder / "bin" / "python"
    subprocess.run([str(python), "-m", "pip", "install", "-q", "numpy"], check=True)
    probe = subprocess.run([str(python), "-c", "import tvm"], capture_output=True, text=True)
    assert "No module named 'tvm'" in probe.stderr
    return python


@pytest.fixture(scope="module")
def llvm_bundle(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("bundle") / "llvm"
    manifest = build_bundle(out, target="llvm", suite="all", small=True, log=lambda line: None)
    assert {c["stage"] for c in manifest["cases"]} == {"smoke", "check", "bench"}  # no tune stage on CPUs
    return out


def _run(python: Path, bundle: Path, *args: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "TVM_USE_RUNTIME_LIB")}
    return subprocess.run([str(python), str(bundle / "run.py"), *args], capture_output=True, text=True, env=env,
                          cwd=bundle.parent, timeout=600)


def test_llvm_bundle_passes_its_check_stage_without_apache_tvm(venv, llvm_bundle, tmp_path):
    """In a venv with numpy only: bfloat16 comes from the bundle's ml_dtypes wheel, tvm_ffi from its own."""
    results = tmp_path / "results.json"
    done = _run(venv, llvm_bundle, "--out", str(results))
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    report = json.loads(results.read_text())
    assert report["ok"] and report["device"]["kind"] == "cpu"
    manifest = json.loads((llvm_bundle / "manifest.json").read_text())
    for stage in ("smoke", "check", "bench"):
        cases = report["stages"][stage]["cases"]
        assert len(cases) == sum(c["stage"] == stage for c in manifest["cases"])
        assert f"{stage}: {len(cases)}/{len(cases)} passed" in done.stdout
        for case in cases:
            assert case["status"] == "pass" and case["checks"], case
            assert all(check["ok"] for check in case["checks"])
    assert {c["dtype"] for c in manifest["cases"]} == {"float32", "float16", "bfloat16"}
    specs = {c["name"]: c for c in manifest["cases"]}
    slots = {name for name, c in specs.items() if c["kind"] == "tvm_slots"}
    for case in report["stages"]["check"]["cases"]:  # ops against the reference, TVM-cache slots against TVM's
        assert ("vs TVM's kernel" if case["name"] in slots else "reference") in case["checks"][-1]["what"]
    for case in report["stages"]["bench"]["cases"]:  # timed (no PyTorch in this venv), checked against the floor
        assert set(case["timings"]) == ({"tuned", "tvm"} if case["name"] in slots else {"tuned", "floor"})
        for timing in case["timings"].values():  # a finite time, and the rate of the case's own FLOP count
            assert math.isfinite(timing["ms"])
            assert timing["tflops"] == pytest.approx(specs[case["name"]]["flops"] / timing["ms"] / 1e9, rel=1e-12)
        assert any(("vs TVM's kernel" if case["name"] in slots else "vs floor") in check["what"]
                   for check in case["checks"])
    ops = {c["op"] for c in manifest["cases"] if c["kind"] == "op"}
    assert ops == {"flash_attn", "flash_attn_backward", "paged_attn", "flash_attn_varlen", "flash_attn_varlen_backward"}
    # every attention slot of TVM's cache, fuel's kernel beside TVM's, checked and timed (prefill, decode)
    assert {slot for name in slots for slot in specs[name]["slots"]} == set(TVM_SLOTS)
    assert {c["stage"] for c in specs.values() if c["kind"] == "tvm_slots"} == {"check", "bench"}
    assert all({f"{side}_{slot}" for side in ("fuel", "tvm") for slot in specs[name]["slots"]} == set(
        specs[name]["kernels"]) for name in slots)
    # every case module runs the kernels, not the floor
    assert all(c["kernels"] and "fuel_flash_attn" not in c["kernels"] for c in manifest["cases"])
    assert not list(llvm_bundle.rglob("libtvm_compiler.so"))


def test_a_wrong_answer_a_crash_and_a_foreign_results_file_are_reported(venv, llvm_bundle, tmp_path):
    bundle = tmp_path / "edited"
    shutil.copytree(llvm_bundle, bundle)
    manifest = json.loads((bundle / "manifest.json").read_text())
    cases = [c for c in manifest["cases"] if c["stage"] == "check"]
    wrong, crashing, hanging = cases[0], cases[1], cases[2]
    wrong["options"]["causal"] = not wrong["options"].get("causal", False)  # the reference now disagrees
    for case, body in ((crashing, "abort();"), (hanging, "sleep(600);")):  # a library whose loading crashes or hangs
        source = tmp_path / "bad.c"
        source.write_text("#include <stdlib.h>\n#include <unistd.h>\n"
                          f"__attribute__((constructor)) static void bad(void) {{ {body} }}\n")
        library = bundle / "modules" / f"bad{len(body)}.so"
        subprocess.run(["cc", "-shared", "-fPIC", "-o", str(library), str(source)], check=True)
        case["module"] = f"modules/{library.name}"
    (bundle / "manifest.json").write_text(json.dumps(manifest))
    results = tmp_path / "results.json"
    done = _run(venv, bundle, "--stages", "check", "--case-timeout", "20", "--out", str(results))
    assert done.returncode == 1, done.stdout[-3000:]
    statuses = {c["name"]: c for c in json.loads(results.read_text())["stages"]["check"]["cases"]}
    assert statuses[wrong["name"]]["status"] == "fail"
    assert statuses[crashing["name"]]["status"] == "crashed" and "SIGABRT" in statuses[crashing["name"]]["error"]
    assert statuses[hanging["name"]]["status"] == "timeout"
    # every other case still ran and passed, and the summary line counts them
    assert [c["status"] for c in statuses.values()].count("pass") == len(cases) - 3
    assert re.search(r"^check: (\d+)/(\d+) passed", done.stdout, re.M).groups() == (str(len(cases) - 3),
                                                                                   str(len(cases)))
    assert "NOT every check passed" in done.stdout

    report = json.loads(results.read_text())
    report["bundle_id"] = "another"
    results.write_text(json.dumps(report))
    done = _run(venv, bundle, "--out", str(results))
    assert done.returncode == 2 and "holds the results of bundle another" in done.stderr
    assert done.stderr.count("\n") == 1


def _refused(done: subprocess.CompletedProcess, prefix: str) -> None:
    """run.py said no in one line with exit status 2, and ran nothing."""
    assert done.returncode == 2, done.stdout[-2000:] + done.stderr[-2000:]
    assert done.stderr.startswith(prefix) and done.stderr.count("\n") == 1, done.stderr
    assert "Traceback" not in done.stderr and "passed" not in done.stdout


@pytest.mark.parametrize("args, says", [
    (["--stages", ""], "argument --stages: '' names no stage"),
    (["--stages", ","], "argument --stages: ',' names no stage"),
    (["--stages", "smoke,smoke"], "names a stage twice"),
    (["--stages", "tune"], "argument --stages: tune not in this bundle"),
    (["--only", "no such case"], "argument --only: 'no such case' matches no case"),
    (["--stages", "bench", "--only", "smoke/"], "matches no case of the stages bench"),
    (["--case-timeout", "-1"], "argument --case-timeout: expected seconds > 0, got '-1'"),
    (["--case-timeout", "0"], "expected seconds > 0"),
    (["--case-timeout", "nan"], "expected seconds > 0"),
    (["--verify-top", "-1"], "argument --verify-top: expected an integer >= 0"),
    (["--verify-rounds", "0"], "argument --verify-rounds: expected an integer >= 1"),
])
def test_run_py_refuses_arguments_that_would_run_nothing_or_crash(llvm_bundle, tmp_path, args, says):
    results = tmp_path / "results.json"
    done = _run(Path(sys.executable), llvm_bundle, *args, "--out", str(results))
    _refused(done, "run.py: error: ")
    assert says in done.stderr and not results.exists()


def test_run_py_refuses_a_bad_manifest_or_results_file_before_running(llvm_bundle, tmp_path):
    manifest = json.loads((llvm_bundle / "manifest.json").read_text())
    ours = {"bundle_id": manifest["bundle_id"], "bundle": manifest["bundle"]}
    results = tmp_path / "results.json"
    for broken, says in (
            (ours, "it has no 'stages' object"),
            ({**ours, "stages": {"smoke": {"cases": 3, "not_passed": 0}}},
             "stages.smoke lacks its cases list or not_passed count"),
            ({**ours, "stages": {"smoke": {"cases": [{"name": "x"}], "not_passed": 0}}},
             "stages.smoke.cases holds an entry without a status"),
            ({**ours, "stages": {"warmup": {"cases": [], "not_passed": 0}}}, "stages.warmup is not a stage of"),
            ({**ours, "stages": {"tune": {"cases": [], "not_passed": 0, "buckets": [{"points": [{}]}]}}},
             "stages.tune.buckets holds a bucket whose points lack status or hand_picked")):
        results.write_text(json.dumps(broken))
        done = _run(Path(sys.executable), llvm_bundle, "--stages", "smoke", "--out", str(results))
        _refused(done, "run.py: cannot run this bundle here: ")
        assert f"--out {results} is a results file of this bundle, but {says}" in done.stderr
        assert "smoke:" not in done.stdout and json.loads(results.read_text()) == broken  # nothing ran or changed
    copy = tmp_path / "copy"  # run.py and its code, with a manifest missing, not JSON, of another schema, cut
    copy.mkdir()
    shutil.copy(llvm_bundle / "run.py", copy / "run.py")
    shutil.copytree(llvm_bundle / "fuel_node", copy / "fuel_node")
    for text, says in ((None, f"{copy} holds no manifest.json"), ("[1", "cannot be read as JSON"),
                       ("[1]", "a JSON list, not an object"),
                       (json.dumps({**manifest, "schema": "tvm_fuel-bundle/0"}), "schema 'tvm_fuel-bundle/0'"),
                       (json.dumps({**manifest, "cases": 3}), "'cases' is missing or not a list"),
                       (json.dumps({**manifest, "files": ["../thesis.tex"]}), "'../thesis.tex' is not a plain")):
        if text is not None:
            (copy / "manifest.json").write_text(text)
        done = _run(Path(sys.executable), copy, "--out", str(tmp_path / "r.json"))
        _refused(done, "run.py: cannot run this bundle here: ")
        assert says in done.stderr


def _snapshot(folder: Path) -> dict:
    return {str(p.relative_to(folder)): p.read_bytes() if p.is_file() else None for p in sorted(folder.rglob("*"))}


def test_bundle_out_refuses_a_folder_that_is_not_an_earlier_bundle(tmp_path, capsys):
    """The folder of issue 29: a manifest.json of the user's own next to their thesis."""
    thesis = tmp_path / "thesis"
    (thesis / "src").mkdir(parents=True)
    (thesis / "manifest.json").write_text(json.dumps({"title": "my thesis", "bundle_id": "0123456789ab"}))
    (thesis / "src" / "thesis.tex").write_text("\\chapter{One}\n")
    text = tmp_path / "notes.txt"
    text.write_text("notes\n")
    before = _snapshot(tmp_path)
    for out in (thesis, text):
        assert main(["bundle", "--target", "llvm", "--suite", "smoke", "--small", "--out", str(out)]) == 2
    assert _snapshot(tmp_path) == before  # nothing removed, nothing left behind
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 2
    assert err[0].startswith(f"python -m tvm_fuel bundle: error: --out {thesis} is not empty and is not an earlier "
                             "bundle: ") and "schema None" in err[0]
    assert err[1] == f"python -m tvm_fuel bundle: error: --out {text} is a file; give a folder (choose another --out)"


def test_bundle_replaces_an_earlier_bundle_only_when_it_holds_nothing_else(venv, llvm_bundle, tmp_path, capsys,
                                                                         monkeypatch):
    out = tmp_path / "bundle"
    shutil.copytree(llvm_bundle, out)
    earlier = json.loads((out / "manifest.json").read_text())
    # run here with the results kept inside: the node's unpacked wheels are the bundle's, the results are not
    done = _run(venv, out, "--stages", "smoke", "--out", str(out / "results.json"))
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    assert (out / "runtime" / "unpacked-apache_tvm_ffi" / ".unpacked").exists()
    results = (out / "results.json").read_bytes()
    options = ["bundle", "--target", "llvm", "--suite", "smoke", "--out", str(out)]
    before = _snapshot(out)
    assert main(options) == 2
    assert _snapshot(out) == before
    (err,) = capsys.readouterr().err.strip().splitlines()
    assert err == (f"python -m tvm_fuel bundle: error: --out {out} holds an earlier bundle ({earlier['bundle_id']}) "
                   "and 1 entry it did not write (results.json); move them out or choose another --out")
    (out / "results.json").rename(tmp_path / "results.json")
    assert sorted(p.relative_to(out).as_posix() for p in out.rglob("*") if p.is_file() and "__pycache__" not in
                  p.parts and not any(part.startswith("unpacked-") for part in p.parts)) == earlier["files"]

    def nvcc_fails(*args):
        raise RuntimeError("tvm_fuel bundle: nvcc failed on module source 0123456789ab")

    before = _snapshot(out)  # a build that fails leaves the earlier bundle, and nothing of its own
    monkeypatch.setattr(bundle_module, "_build", nvcc_fails)
    assert main(options) == 2
    monkeypatch.undo()
    assert _snapshot(out) == before and sorted(p.name for p in tmp_path.iterdir()) == ["bundle", "results.json"]
    assert "nvcc failed" in capsys.readouterr().err

    manifest = build_bundle(out, target="llvm", suite="smoke", log=lambda line: None)
    assert manifest["bundle_id"] != earlier["bundle_id"]
    # the earlier bundle's check and bench modules and the unpacked wheels are gone; only the new files are there
    assert sorted(p.relative_to(out).as_posix() for p in out.rglob("*") if p.is_file()) == manifest["files"]
    assert ({c["stage"] for c in manifest["cases"]} == {"smoke"}
            and not (out / "runtime" / "unpacked-ml_dtypes").exists())
    assert (tmp_path / "results.json").read_bytes() == results
    assert sorted(p.name for p in tmp_path.iterdir()) == ["bundle", "results.json"]


@needs_nvcc
def test_cuda_bundle_holds_a_cubin_per_module(tmp_path, venv):
    out = tmp_path / "cuda"
    manifest = build_bundle(out, target="cuda", arch="sm_90", suite="smoke", python="3.12", log=lambda line: None)
    modules = {c["module"]: c["cubin"] for c in manifest["cases"]}
    assert len(modules) == 3 and all(key and (out / "cubins" / cubin_name(key)).exists() for key in modules.values())
    assert not list(out.rglob("libtvm_compiler.so")) and not (out / "runtime" / "tvm" / "3rdparty").exists()
    assert (out / "runtime" / "tvm" / "lib" / "libtvm_runtime_cuda.so").exists()
    assert all("cp312" in wheel for wheel in manifest["runtime"]["wheels"].values())
    assert sum(f.stat().st_size for f in out.rglob("*") if f.is_file()) < 48e6
    if sys.version_info[:2] != (3, 12):  # a Python without tvm_ffi cannot run a 3.12 bundle: it says so
        done = _run(venv, out)
        assert done.returncode == 2 and "rebuild it with --python" in done.stderr
    # an existing cubin is looked up by its source's hash; another source is compiled here
    built = tvm_fuel.compile(bucket_module("flash_attn", dict(B=1, H=2, S=64, D=64, dtype="float16")),
                             tvm.target.Target({"kind": "cuda", "arch": "sm_90"}), kernels="tuned")
    source = cuda.cuda_source(built)
    # TVM stores a CUDA module's source as length-prefixed bytes and hands exactly those to the
    # compile callback when the node loads it: the key the node computes is the bundle's
    path = tmp_path / "flash.so"
    built.export_library(str(path))
    assert len(source).to_bytes(8, "little") + source.encode() in path.read_bytes()
    store = CubinStore(out / "cubins", "sm_90")
    (out / "cubins" / cubin_name(source_key(source))).write_bytes(gzip.compress(b"stored"))
    assert store.compile(source) == b"stored" and store.hits == 1
    assert store.compile(source + "\n// another source\n")[:4] == b"\x7fELF" and store.misses == 1


def test_cuda_suite_holds_tvm_cache_slots_beside_tvms_gpu_kernels():
    """The GPU bundle checks every attention slot of TVM's cache against TVM's own GPU kernel
    (GQA 4, 7 and 1; float16 and float32; no RoPE in the kernel, which fuel's CUDA slots refuse)
    and times one layer's prefill and decode at the issue's sizes, fuel's beside TVM's."""
    found = [c for c in suites.cases("all", "cuda") if isinstance(c, suites.SlotCase)]
    checks, timed = [c for c in found if c.stage == "check"], [c for c in found if c.timed]
    assert len(checks) == 3 and all(set(c.slots) == set(TVM_SLOTS) and c.rotary_modes == (0,) for c in checks)
    assert {(c.config["num_qo_heads"] // c.config["num_kv_heads"], c.dtype) for c in checks} == {
        (4, "float16"), (7, "float32"), (1, "float16")}
    assert sorted(c.slots for c in timed) == [("decode",), ("prefill",)]
    prefill = next(c for c in timed if c.slots == ("prefill",))
    assert prefill.config["cached"] == [1536] * 8 and prefill.config["new"] == [512] * 8 and prefill.causal == (0,)
    target = tvm.target.Target({"kind": "cuda", "arch": "sm_90"})
    mod = checks[0].module(target)
    names = {f"{side}_{slot}" for side in ("fuel", "tvm") for slot in TVM_SLOTS}
    assert {gv.name_hint for gv in mod.functions} == names
    assert all(str(mod[name].attrs["global_symbol"]) == name for name in names)


def test_cuda_check_suite_holds_the_varlen_backward_through_its_kernel():
    """The GPU bundle checks flash_attn_varlen_backward in every dtype (GQA 3; causal with ALiBi,
    window with softcap, causal with sinks; lengths 0, 1, 17, 97), each module the varlen forward's and backward's
    kernels (the bundle refuses a floor); CPU bundles too (the CPU kernel), the small one in float32."""
    found = [c for c in suites.cases("check", "cuda") if getattr(c, "op", "") == "flash_attn_varlen_backward"]
    assert {c.dtype for c in found} == {"float16", "bfloat16", "float32"} and len(found) == 9
    assert sum("sinks" in {t["name"] for t in c.inputs} for c in found) == 3
    assert {c.options.get("causal", False) for c in found} == {True, False}
    assert all(c.spec()["outputs"] == ["dq", "dk", "dv"] and c.scale == 4 for c in found)
    small = [c for c in suites.cases("all", "llvm", small=True) if getattr(c, "op", "") == "flash_attn_varlen_backward"]
    assert {c.dtype for c in small} == {"float32"} and len(small) == 3
    target = tvm.target.Target({"kind": "cuda", "arch": "sm_90"})
    for case in found[:2]:
        names = {gv.name_hint for gv in tvm_fuel.transform.legalize(suites.case_module(case), target,
                                                                     kernels="tuned").functions}
        assert {"fuel_flash_attn_varlen_kernel", "fuel_flash_attn_varlen_backward_kernel"} <= names, names
        assert not names & {f"fuel_{op}" for op in suites.OUTPUTS}, names  # no floor of an op with kernels


@needs_nvcc
def test_cuda_bundle_without_a_gpu_fails_in_one_line(tmp_path):
    out = tmp_path / "cuda"
    build_bundle(out, target="cuda", arch="sm_80", suite="smoke", log=lambda line: None)
    done = _run(Path(sys.executable), out, "--out", str(tmp_path / "r.json"))
    assert done.returncode == 2, done.stdout + done.stderr
    assert done.stderr.startswith("run.py: cannot run this bundle here:") and done.stderr.count("\n") == 1


def test_bad_bundle_options_get_one_line(tmp_path, capsys):
    assert main(["bundle", "--arch", "sm_75", "--out", str(tmp_path / "x")]) == 2
    assert main(["bundle", "--target", "llvm", "--suite", "tune", "--out", str(tmp_path / "y")]) == 2
    assert main(["tune", "--import", str(tmp_path / "missing.json")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 3
    assert "unknown --arch 'sm_75'" in err[0] and "tune suite measures CUDA kernels" in err[1]
    assert "cannot read" in err[2]


def _fake_node_results(manifest: dict, arch: str) -> dict:
    """What run.py writes after the tune stage, with made-up times (this machine has no GPU)."""
    buckets = []
    for bucket in manifest["tune_buckets"]:
        points = [c for c in manifest["cases"] if c.get("bucket") == bucket["id"]]
        rows = [{"function": c["function"], "knobs": c["knobs"], "hand_picked": c["hand_picked"], "status": "pass",
                 "seconds": 1e-3 * (2 if c["hand_picked"] else 1 + i / 10)} for i, c in enumerate(points)]
        rows[-1].update(status="crashed", seconds=None)
        verified = {"id": 1234, "rounds": 2, "status": "pass",
                    "seconds": {r["function"]: [r["seconds"]] * 2 for r in rows if r["status"] == "pass"}}
        buckets.append({**bucket, "points": rows, "verified": verified})
    return {"bundle_id": manifest["bundle_id"], "bundle": manifest["bundle"], "device": {"arch": arch},
            "stages": {"tune": {"buckets": buckets, "not_passed": 0}}}


@needs_nvcc
def test_tune_import_turns_node_measurements_into_applied_records(tmp_path, capsys):
    manifest = build_bundle(tmp_path / "b", target="cuda", arch="sm_90", suite="tune", tune_points=3,
                            log=lambda line: None)
    assert len(manifest["tune_buckets"]) == len(tune_buckets()) == 5
    results = tmp_path / "results.json"
    results.write_text(json.dumps(_fake_node_results(manifest, "sm_90")))
    logs = tmp_path / "logs"
    assert main(["tune", "--import", str(results), "--work-dir", str(logs)]) == 0
    assert (logs / "cuda-sm90" / "flash_attn" / "database_tuning_record.json").exists()
    bucket = manifest["tune_buckets"][0]
    fastest = next(c["knobs"] for c in manifest["cases"] if c.get("function") == "point_1"
                   and c["bucket"] == bucket["id"])
    op, shape = tune_buckets()[0]
    target = tvm.target.Target({"kind": "cuda", "arch": "sm_90"})
    legalized = tvm_fuel.transform.legalize(bucket_module(op, shape), target, kernels="tuned", database=logs)
    (kernel,) = [f for f in legalized.functions.values() if f.attrs is not None and "fuel.knobs" in f.attrs]
    assert str(logs) in str(kernel.attrs["fuel.knobs"])  # the record, not the hand-picked knobs
    (workload,) = workloads_of(bucket_module(op, shape), target)
    knobs = TuningRecords([logs]).lookup(workload, target).knobs
    hand = next(c["knobs"] for c in manifest["cases"] if c.get("bucket") == bucket["id"] and c["hand_picked"])
    assert knobs == {name: fastest[name] for name in knobs} != {name: hand[name] for name in knobs}
    capsys.readouterr()
    assert main(["tune", "--import", str(results), "--work-dir", str(logs)]) == 2  # imported once only
    other = _fake_node_results(manifest, "sm_80")
    results.write_text(json.dumps(other))
    assert main(["tune", "--import", str(results), "--work-dir", str(tmp_path / "other")]) == 2
    err = capsys.readouterr().err
    assert "already in" in err and "built for sm_90 but measured on sm_80" in err


def test_tune_stage_measures_points_side_by_side_and_imports_them(venv, llvm_bundle, tmp_path):
    """The tune stage's path on this CPU (the CPU kernels' knobs stand in for the CUDA ones):
    every point timed, the best and the hand-picked re-measured in rounds, then imported as records."""
    bundle = tmp_path / "tuned"
    shutil.copytree(llvm_bundle, bundle)
    manifest = json.loads((bundle / "manifest.json").read_text())
    target = tvm.target.Target("llvm")
    (workload,) = workloads_of(bucket_module("flash_attn", dict(B=1, H=2, S=64, D=32, causal=1)), target)
    rule = rule_for("flash_attn", target)
    points = [rule.knobs(workload, target, knobs) for knobs in ({}, {"block_q": 32}, {"block_k": 32})]
    bucket, cases = tune_bucket(bundle, "bucket0", workload, points, target)
    manifest["tune_buckets"], manifest["cases"] = [bucket], manifest["cases"] + cases
    (bundle / "manifest.json").write_text(json.dumps(manifest))
    results = tmp_path / "results.json"
    done = _run(venv, bundle, "--stages", "tune", "--verify-top", "2", "--verify-rounds", "3", "--out", str(results))
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-2000:]
    stage = json.loads(results.read_text())["stages"]["tune"]
    (measured,) = stage["buckets"]
    assert [p["status"] for p in measured["points"]] == ["pass"] * 3
    runs = {c["name"].rsplit("/", 1)[1]: c["runs"] for c in stage["cases"]}
    for point in measured["points"]:  # each point's time is the median of its three repeats
        assert len(runs[point["function"]]) == 3 and point["seconds"] == statistics.median(runs[point["function"]])
    verified = measured["verified"]
    assert verified["status"] == "pass" and len(verified["seconds"]) == 3
    assert all(len(times) == 3 for times in verified["seconds"].values())
    logs = tmp_path / "logs"
    rows = import_results(results, logs, log=lambda line: None)
    medians = {function: statistics.median(times) for function, times in verified["seconds"].items()}
    best = min(medians, key=medians.get)
    assert rows[0]["hand_picked_s"] == medians["point_0"] and rows[0]["best_s"] == medians[best]
    assert rows[0]["best_knobs"] == points[int(best.split("_")[1])]
    found = TuningRecords([logs]).lookup(workload, target)
    knobs, source = found.knobs, found.source
    assert source.startswith(str(logs / "llvm-generic" / "flash_attn"))
    assert knobs == {name: rows[0]["best_knobs"][name] for name in knobs}
