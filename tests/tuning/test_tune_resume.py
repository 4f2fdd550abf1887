"""An interrupted tuning run resumes: ``tune`` and ``tune --model`` read a log whose last line a kill
cut (or any bad line) line by line, as a build does, warn naming the file and the line dropped,
and go on from the other records. The logs are written here record by record with MetaSchedule's
own JSONDatabase (what earlier runs wrote), then torn."""

from __future__ import annotations

import json
import re

import pytest
from helpers import HOST

from tvm import s_tir
from tvm.s_tir import meta_schedule as ms

from tvm_fuel.cli import main
from tvm_fuel.dispatch.records import MODEL_FOLDER, kernel_family, knobs_of, target_key
from tvm_fuel.dispatch.log_database import RECORD_FILE, WORKLOAD_FILE, LogDatabase
from tvm_fuel.schedules import rule_for
from tvm_fuel.tuning import TuningLogWarning
from tvm_fuel.tuning.buckets import bucket_module
from tvm_fuel.tuning.model import function_tasks
from tvm_fuel.tuning.space import fixed_point, workload_module
from tvm_fuel.tuning.kernels import commit_record, workloads_of

# they measure (a few candidates): with the tuning modules, out of the quick tier
pytestmark = [pytest.mark.integration, pytest.mark.slow, pytest.mark.xdist_group("test_tune_resume")]

PAGED = "B=3,Hq=7,Hkv=1,D=40,block_size=16,ctx=97"


def _json_database(folder) -> ms.database.JSONDatabase:
    folder.mkdir(parents=True, exist_ok=True)
    return ms.database.JSONDatabase(path_workload=str(folder / WORKLOAD_FILE),
                                    path_tuning_record=str(folder / RECORD_FILE))


def _tear(path) -> None:
    """What a kill during a write leaves: half a line after the last whole one, no newline."""
    text = path.read_text()
    path.write_text(text + text.splitlines()[-1][:len(text.splitlines()[-1]) // 2])


def _warned(caught, path, line: int) -> bool:
    return any(f"{path}, line {line}:" in str(w.message) for w in caught if issubclass(w.category, TuningLogWarning))


def test_tune_resumes_a_kernel_log_whose_last_line_is_torn(tmp_path, capsys):
    """The hand-picked point and a faster one are in the log, then a torn third line: with no new
    trials, tune reports both recorded times (nothing measured) and exits 0."""
    (workload,) = workloads_of(bucket_module("paged_attn", dict(B=3, Hq=7, Hkv=1, D=40, block_size=16, ctx=97)),
                               HOST)
    folder = tmp_path / target_key(HOST) / kernel_family(workload.op)
    database, task = _json_database(folder), workload_module(workload, HOST)
    defaults = rule_for(workload.op, HOST).default_knobs(workload, HOST)
    faster = {**defaults, "block_k": 32 if defaults["block_k"] != 32 else 64}
    commit_record(database, task, fixed_point(task, defaults), [3e-4], HOST)
    commit_record(database, task, fixed_point(task, faster), [1e-4], HOST)
    commit_record(database, task, fixed_point(task, {**faster, "lanes": 4}), [2e-4], HOST)
    records = folder / RECORD_FILE
    _tear(records)
    capsys.readouterr()
    with pytest.warns(TuningLogWarning) as caught:
        assert main(["tune", "--op", "paged_attn", "--shapes", PAGED, "--trials", "0", "--verify-top", "0",
                     "--work-dir", str(tmp_path)]) == 0
    assert _warned(caught, records, 4) and not any(_warned(caught, records, n) for n in (1, 2, 3))
    printed = capsys.readouterr().out
    assert re.search(r"hand-picked 0\.30 ms, best 0\.10 ms \([0-9.]+ GB/s\), 3\.00x; knobs (\{.*\})", printed), printed
    knobs = json.loads(re.search(r"knobs (\{.*\})", printed).group(1).replace("'", '"'))
    assert knobs == knobs_of(fixed_point(task, faster).mod)[1]  # the faster record's, not the torn one's


def _matmul_silu_model(path) -> None:
    """A --model file: silu(x @ w), one TIR function to tune and no fuel kernel."""
    path.write_text(
        "from tvm import relax\n\n\n"
        "def tuning_module():\n"
        "    x = relax.Var('x', relax.TensorType((16, 32), 'float32'))\n"
        "    w = relax.Var('w', relax.TensorType((32, 8), 'float32'))\n"
        "    bb = relax.BlockBuilder()\n"
        "    with bb.function('main', [x, w]):\n"
        "        with bb.dataflow():\n"
        "            y = bb.emit_output(relax.op.nn.silu(relax.op.matmul(x, w)))\n"
        "        bb.emit_func_output(y)\n"
        "    return bb.get()\n")


def test_tune_model_resumes_logs_whose_last_lines_are_torn(tmp_path):
    """Both model logs (the search's and the verified one) end in a torn line: tune --model warns
    for each, verifies the default schedule against the search's record and appends whole lines."""
    model = tmp_path / "model.py"
    _matmul_silu_model(model)
    namespace: dict = {}
    exec(model.read_text(), namespace)  # noqa: S102 -- the test's own file
    ((_, task),) = function_tasks(namespace["tuning_module"](), HOST).items()
    root = tmp_path / "logs"
    sch = s_tir.Schedule(task)
    sch.parallel(sch.get_loops(sch.get_sblock("T_multiply"))[0])
    torn = []
    for folder in (root / "logs" / MODEL_FOLDER, root / target_key(HOST) / MODEL_FOLDER):
        database = _json_database(folder)
        commit_record(database, task, sch, [1e-4], HOST)
        commit_record(database, task, sch, [2e-4], HOST)
        _tear(folder / RECORD_FILE)
        torn.append(folder / RECORD_FILE)
    with pytest.warns(TuningLogWarning) as caught:
        assert main(["tune", "--model", str(model), "--trials", "0", "--verify-top", "1", "--work-dir", str(root)]) == 0
    for records in torn:
        assert _warned(caught, records, 3), (records, [str(w.message) for w in caught])
    # the verification's two candidates (the default schedule, the search's record) follow the torn line
    verified = torn[1].read_text().split("\n")
    assert len(verified) == 6 and verified[-1] == ""
    with pytest.raises(json.JSONDecodeError):
        json.loads(verified[2])
    assert [json.loads(line)[0] for line in verified[3:5]] == [0, 0]  # the workload of line 1
    with pytest.warns(TuningLogWarning) as caught:  # the torn line stays the only bad one
        assert len(LogDatabase(torn[1].parent)) == 4
    assert [_warned(caught, torn[1], n) for n in range(1, 6)] == [False, False, True, False, False]
