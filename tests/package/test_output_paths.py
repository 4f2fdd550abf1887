"""No command deletes or writes over a file it did not write, and every output path is checked before any work
(issue 55).

Each command (bench, gpucheck, bundle, tune, logs) runs in this process with its heavy function replaced by a
recorder (``run_bench``, the bundle's build, gpucheck's device and run.py, ``tune``, ``tuning_report``): a refusal
must come before it is called, as one ``error:`` line naming the option, with exit status 2, and every file that
was in the folder keeps its bytes and its modification time.
"""

from __future__ import annotations

import json
import os
import types
from pathlib import Path

import pytest

import tvm_fuel
import tvm_fuel.schedules
from tvm_fuel.bench import attention as bench_attention
from tvm_fuel.bench import higher_order as bench_higher_order
from tvm_fuel.cli import build_parser, main
from tvm_fuel.deploy import bundle as bundle_module
from tvm_fuel.deploy import gpucheck as gpucheck_module
from tvm_fuel.deploy.node.manifest import SCHEMA
from tvm_fuel.outputs import LEDGER
from tvm_fuel.tuning import kernels as tuning_kernels
from tvm_fuel.tuning import report as tuning_report_module
from tvm_fuel.tuning import shipped_logs

pytestmark = pytest.mark.unit

PACKAGE = Path(tvm_fuel.__file__).resolve().parent
PAGED = "B=1,Hq=2,Hkv=2,D=16,block_size=16,ctx=32"
BENCH_KERNELS_ONLY = ["bench", "--no-higher-order", "--no-decoder", "--no-norm", "--no-sinks", "--no-quantized",
                      "--no-varlen"]


class Called(Exception):
    """A heavy function ran where the command should have refused first (main() does not catch it)."""


def _cli(argv: list[str], capsys) -> tuple[int, str]:
    """Exit status and stderr's last line of ``python -m tvm_fuel argv``, run in this process."""
    try:
        code = main([str(a) for a in argv])
    except SystemExit as exit_:  # argparse's own errors (tune's --work-dir, logs' --database)
        code = exit_.code
    err = capsys.readouterr().err
    assert "Traceback" not in err
    return code, (err.strip().splitlines() or [""])[-1]


def _snapshot(folder: Path) -> dict:
    """Every entry under ``folder``: a file's bytes and modification time, a folder as None."""
    return {str(p.relative_to(folder)): (p.read_bytes(), p.stat().st_mtime_ns) if p.is_file() else None
            for p in sorted(folder.rglob("*"))}


def _refused(code: int, line: str, command: str, *named: str) -> None:
    assert code == 2, line
    assert line.startswith(f"python -m tvm_fuel {command}: error: "), line
    for word in named:
        assert word in line, line


@pytest.fixture
def calls(monkeypatch) -> list[str]:
    """The heavy functions of every command, each replaced by one that notes its name and stops the command."""
    called: list[str] = []

    def stop(name):
        def heavy(*args, **kwargs):
            called.append(name)
            raise Called(name)
        return heavy

    monkeypatch.setattr(bench_attention, "run_bench", stop("run_bench"))
    monkeypatch.setattr(bench_higher_order, "higher_order_rows", stop("higher_order_rows"))
    monkeypatch.setattr(bundle_module, "_fill", stop("bundle build"))
    monkeypatch.setattr(gpucheck_module, "has_gpu", stop("has_gpu"))
    monkeypatch.setattr(gpucheck_module, "subprocess", types.SimpleNamespace(run=stop("run.py")))
    monkeypatch.setattr(tuning_kernels, "tune", stop("tune"))  # tvm_fuel.tuning.tune resolves to it at each access
    monkeypatch.setattr(tuning_report_module, "tuning_report", stop("tuning_report"))
    return called


def test_the_stubs_are_gone_after_the_test(request, monkeypatch):
    """Undoing ``calls`` restores every heavy function: none of its stubs is left in a package for
    the later tests of the process (the CLI imports ``tune`` from ``tvm_fuel.tuning``)."""
    import tvm_fuel.tuning

    real_tune = tuning_kernels.tune
    request.getfixturevalue("calls")
    assert tvm_fuel.tuning.tune is not real_tune  # the stub, through the package's lazy attribute
    monkeypatch.undo()
    assert tuning_kernels.tune is real_tune and tvm_fuel.tuning.tune is real_tune
    assert "tune" not in vars(tvm_fuel.tuning)


@pytest.fixture
def foreign(tmp_path) -> Path:
    """A user's folder: notes, a sub-folder, and files by the names the commands write."""
    folder = tmp_path / "mine"
    (folder / "data").mkdir(parents=True)
    for name, text in (("notes.txt", "notes\n"), ("data/table.csv", "a,b\n1,2\n"), ("bench.json", '{"mine": 1}\n'),
                       ("results.json", '{"measured": "by hand"}\n'), ("manifest.json", '{"title": "thesis"}\n'),
                       ("higher_order.json", "[]\n")):
        (folder / name).write_text(text)
    return folder


@pytest.fixture
def a_file(foreign) -> Path:
    """An existing file given where a folder is needed: the user's own bench.json."""
    return foreign / "bench.json"


@pytest.fixture
def read_only(tmp_path) -> Path:
    """A folder this process cannot write; skipped where the mode bits do not stop it (root)."""
    folder = tmp_path / "read_only"
    folder.mkdir()
    folder.chmod(0o500)
    try:
        if os.access(folder, os.W_OK):
            pytest.skip("this user (root) writes into a folder of mode 0o500 anyway")
        yield folder
    finally:
        folder.chmod(0o755)


def _inside_package() -> list[Path]:
    return [PACKAGE / "bench_results", Path(tvm_fuel.schedules.__path__[0]) / "out",
            shipped_logs() / "bench", shipped_logs()]


# each command's argv with its output option last (the path is appended)
COMMANDS = {
    "bench": [*BENCH_KERNELS_ONLY, "--out"],
    "bench cuda": ["bench", "--target", "cuda", "--out"],
    "gpucheck": ["gpucheck", "--out"],
    "bundle": ["bundle", "--target", "llvm", "--suite", "smoke", "--small", "--out"],
    "tune": ["tune", "--op", "paged_attn", "--shapes", PAGED, "--trials", "0", "--work-dir"],
}
FLAG = {"tune": "--work-dir"}


@pytest.mark.parametrize("command", COMMANDS)
def test_an_existing_file_as_the_output_folder_is_refused_before_any_work(command, a_file, calls, capsys):
    before = _snapshot(a_file.parent)
    code, line = _cli([*COMMANDS[command], a_file], capsys)
    _refused(code, line, COMMANDS[command][0], FLAG.get(command, "--out"), str(a_file), "is a file")
    assert calls == []
    assert _snapshot(a_file.parent) == before


@pytest.mark.parametrize("command", COMMANDS)
def test_a_folder_under_a_file_is_refused_before_any_work(command, a_file, calls, capsys):
    code, line = _cli([*COMMANDS[command], a_file / "out"], capsys)
    _refused(code, line, COMMANDS[command][0], FLAG.get(command, "--out"), f"{a_file} is a file")
    assert calls == []


@pytest.mark.parametrize("command", COMMANDS)
def test_an_unwritable_output_folder_is_refused_before_any_work(command, read_only, calls, capsys):
    for path in (read_only, read_only / "new"):
        code, line = _cli([*COMMANDS[command], path], capsys)
        _refused(code, line, COMMANDS[command][0], FLAG.get(command, "--out"), str(path), "not writable")
    assert calls == []
    assert list(read_only.iterdir()) == []


@pytest.mark.parametrize("command", COMMANDS)
def test_the_package_folders_are_refused_before_any_work(command, calls, capsys):
    inside = _inside_package()
    if command == "tune":  # --work-dir tuning_logs writes the shipped logs, on purpose (README); below it, no
        inside.remove(shipped_logs())
    before = {path: path.exists() for path in inside}
    for path in inside:
        code, line = _cli([*COMMANDS[command], path], capsys)
        _refused(code, line, COMMANDS[command][0], FLAG.get(command, "--out"), str(path), "installed package")
    assert calls == []
    assert {path: path.exists() for path in inside} == before


def test_tune_may_write_the_shipped_logs_root_when_told():
    args = build_parser().parse_args(["tune", "--op", "paged_attn", "--work-dir", str(shipped_logs())])
    assert args.work_dir == str(shipped_logs())


# ---- bench --------------------------------------------------------------------------------------------------------


def test_bench_refuses_a_file_it_did_not_write_and_leaves_the_folder(foreign, calls, capsys):
    before = _snapshot(foreign)
    code, line = _cli([*BENCH_KERNELS_ONLY, "--out", foreign], capsys)
    _refused(code, line, "bench", f"--out {foreign} holds bench.json", "did not write", "choose another --out")
    code, line = _cli(["bench", "--higher-order-only", "--out", foreign], capsys)  # a row group's file
    _refused(code, line, "bench", f"--out {foreign} holds higher_order.json", "did not write")
    assert calls == []
    assert _snapshot(foreign) == before


def _fake_bench(written: list):
    def run_bench(*, out_dir, **options):
        written.append(options)
        Path(out_dir).mkdir(parents=True, exist_ok=True)
        (Path(out_dir) / "bench.json").write_text(json.dumps({"run": len(written)}))
        (Path(out_dir) / "bench.png").write_bytes(b"\x89PNG fake")
    return run_bench


def test_bench_writes_over_its_own_files_only(foreign, monkeypatch, calls, capsys):
    (foreign / "bench.json").unlink()
    (foreign / "higher_order.json").unlink()
    before = _snapshot(foreign)
    runs: list = []
    monkeypatch.setattr(bench_attention, "run_bench", _fake_bench(runs))
    monkeypatch.setattr(bench_higher_order, "higher_order_rows", lambda memory: {"rows": [], "memory": memory})
    monkeypatch.setattr(bench_higher_order, "print_rows", lambda report: None)
    argv = ["bench", "--no-decoder", "--no-norm", "--no-sinks", "--no-quantized", "--no-varlen", "--out", foreign]
    for run in (1, 2):  # the second run writes over the first's files: they are recorded as bench's
        assert _cli(argv, capsys)[0] == 0
        assert json.loads((foreign / "bench.json").read_text()) == {"run": run}
    assert json.loads((foreign / "higher_order.json").read_text()) == {"rows": [], "memory": True}
    after = _snapshot(foreign)
    assert {name: after[name] for name in before} == before  # the user's files as they were
    assert set(after) - set(before) == {"bench.json", "bench.png", "higher_order.json", LEDGER}
    (foreign / "bench.png").write_bytes(b"my own chart")  # replaced by the user: theirs now
    code, line = _cli(argv, capsys)
    _refused(code, line, "bench", "holds bench.png", "changed since tvm_fuel bench wrote it")
    assert len(runs) == 2 and (foreign / "bench.png").read_bytes() == b"my own chart"


def test_bench_refuses_a_ledger_it_cannot_read(tmp_path, calls, capsys):
    out = tmp_path / "out"
    out.mkdir()
    (out / LEDGER).write_text("not json")
    (out / "bench.json").write_text("{}")
    code, line = _cli([*BENCH_KERNELS_ONLY, "--out", out], capsys)
    _refused(code, line, "bench", LEDGER, "not tvm_fuel's record")
    assert calls == [] and (out / LEDGER).read_text() == "not json"


# ---- gpucheck and bench --target cuda -------------------------------------------------------------------------------


def _manifest(bundle_id: str) -> dict:
    return {"schema": SCHEMA, "bundle_id": bundle_id, "cases": [], "tune_buckets": [], "bundle": {"target": "cuda"},
            "target": {"device": "cuda", "arch": "sm_90"}, "runtime": {"wheels": {}}, "files": ["manifest.json"]}


@pytest.fixture
def a_gpu(monkeypatch, calls) -> list[str]:
    """gpucheck on an sm_90 device whose bundle build and run.py only record what they would write."""
    monkeypatch.setattr(gpucheck_module, "has_gpu", lambda: True)
    monkeypatch.setattr(gpucheck_module, "device_arch", lambda: "sm_90")

    def build(out, **options):
        calls.append("build_bundle")
        Path(out).mkdir(parents=True, exist_ok=True)
        (Path(out) / "manifest.json").write_text(json.dumps(_manifest("bbbbbbbbbbbb")))

    def run(command, check):
        calls.append("run.py")
        Path(command[-1]).write_text(json.dumps({"bundle_id": "bbbbbbbbbbbb"}))
        return types.SimpleNamespace(returncode=0)

    monkeypatch.setattr(bundle_module, "build_bundle", build)
    monkeypatch.setattr(gpucheck_module, "subprocess", types.SimpleNamespace(run=run))
    return calls


@pytest.mark.parametrize("command", [["gpucheck"], ["bench", "--target", "cuda"]])
@pytest.mark.parametrize("results", ['{"measured": "by hand"}\n', "not json", '{"bundle_id": "cccccccccccc"}'])
def test_gpucheck_never_removes_a_results_file_it_did_not_write(command, results, foreign, a_gpu, capsys):
    (foreign / "results.json").write_text(results)
    before = _snapshot(foreign)
    code, line = _cli([*command, "--out", foreign], capsys)
    _refused(code, line, command[0], f"--out {foreign} holds results.json", "choose another --out")
    assert a_gpu == []  # nothing built, nothing run
    assert _snapshot(foreign) == before


def test_gpucheck_refuses_results_beside_another_bundle(foreign, a_gpu, capsys):
    """The results of bundle a... beside a bundle-sm_90 of another id: not the earlier run's own pair."""
    (foreign / "bundle-sm_90").mkdir()
    (foreign / "bundle-sm_90" / "manifest.json").write_text(json.dumps(_manifest("cccccccccccc")))
    (foreign / "results.json").write_text(json.dumps({"bundle_id": "aaaaaaaaaaaa"}))
    before = _snapshot(foreign)
    code, line = _cli(["gpucheck", "--out", foreign], capsys)
    _refused(code, line, "gpucheck", "results.json", "bundle aaaaaaaaaaaa", "bundle-sm_90")
    assert a_gpu == [] and _snapshot(foreign) == before


def test_gpucheck_replaces_the_results_of_the_bundle_it_replaces(foreign, a_gpu, capsys):
    (foreign / "bundle-sm_90").mkdir()
    (foreign / "bundle-sm_90" / "manifest.json").write_text(json.dumps(_manifest("aaaaaaaaaaaa")))
    (foreign / "results.json").write_text(json.dumps({"bundle_id": "aaaaaaaaaaaa"}))
    before = _snapshot(foreign)
    assert _cli(["gpucheck", "--out", foreign], capsys)[0] == 0
    assert a_gpu == ["build_bundle", "run.py"]
    assert json.loads((foreign / "results.json").read_text()) == {"bundle_id": "bbbbbbbbbbbb"}
    after = _snapshot(foreign)
    assert {name: after[name] for name in before if "results" not in name and "bundle-" not in name} == \
        {name: before[name] for name in before if "results" not in name and "bundle-" not in name}


def test_gpucheck_in_a_fresh_folder_runs_the_bundle_there(tmp_path, a_gpu, capsys):
    out = tmp_path / "new" / "out"
    assert _cli(["gpucheck", "--out", out], capsys)[0] == 0
    assert a_gpu == ["build_bundle", "run.py"] and (out / "results.json").is_file()


# ---- bundle ---------------------------------------------------------------------------------------------------------


def test_bundle_refuses_a_folder_of_foreign_files_before_building(foreign, calls, capsys):
    before = _snapshot(foreign)
    code, line = _cli([*COMMANDS["bundle"], foreign], capsys)
    _refused(code, line, "bundle", f"--out {foreign}", "is not an earlier bundle", "choose another --out")
    assert calls == [] and _snapshot(foreign) == before


def test_bundle_refuses_an_earlier_bundle_holding_foreign_files(foreign, calls, capsys):
    (foreign / "manifest.json").write_text(json.dumps(_manifest("aaaaaaaaaaaa")))
    before = _snapshot(foreign)
    code, line = _cli([*COMMANDS["bundle"], foreign], capsys)
    _refused(code, line, "bundle", "holds an earlier bundle (aaaaaaaaaaaa)", "5 entries it did not write")
    assert calls == [] and _snapshot(foreign) == before


# ---- tune -----------------------------------------------------------------------------------------------------------


def test_tune_leaves_the_files_of_its_work_dir(foreign, monkeypatch, calls, capsys):
    tuned = []
    monkeypatch.setattr(tuning_kernels, "tune", lambda *args, **options: tuned.append(options) or [])
    before = _snapshot(foreign)
    assert _cli([*COMMANDS["tune"], foreign], capsys)[0] == 0
    assert [options["work_dir"] for options in tuned] == [str(foreign)]
    assert _snapshot(foreign) == before


# ---- logs -----------------------------------------------------------------------------------------------------------


LOGS = ["logs", "--no-shipped", "--op", "paged_attn", "--shapes", PAGED, "--database"]


def test_logs_refuses_a_database_that_is_a_file_or_missing_before_any_work(a_file, tmp_path, calls, capsys):
    code, line = _cli([*LOGS, a_file], capsys)
    _refused(code, line, "logs", "--database", str(a_file), "is a file")
    code, line = _cli([*LOGS, tmp_path / "missing"], capsys)
    _refused(code, line, "logs", "--database", "no such folder", str(tmp_path / "missing"))
    assert calls == [] and not (tmp_path / "missing").exists()


@pytest.mark.parametrize("mode", [0o755, 0o500])
def test_logs_only_reads_its_database(mode, foreign, monkeypatch, calls, capsys):
    """logs writes nothing: a read-only folder is fine to name, and no file appears or changes in it."""
    monkeypatch.setattr(tuning_report_module, "tuning_report", lambda *args, **options: [])
    foreign.chmod(mode)
    try:
        before = _snapshot(foreign)
        assert _cli([*LOGS, foreign], capsys)[0] == 0
        assert _snapshot(foreign) == before
    finally:
        foreign.chmod(0o755)


def test_logs_may_read_the_shipped_logs():
    assert build_parser().parse_args(["logs", "--database", str(shipped_logs())]).database == str(shipped_logs())
