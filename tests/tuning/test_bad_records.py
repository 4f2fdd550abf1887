"""What a tuning log can do to a build: a bad line costs only that line, an out-of-space knob only
its record; neither crashes nor stalls the build, and each warns naming the file and the line.

The logs are written here record by record (no measuring): a record's knobs are block annotations,
so any value, even one the design space never offers, can be put in a log.
"""

from __future__ import annotations

import json
import re
import time
import warnings

import pytest
from helpers import HOST

import tvm
from tvm import s_tir
from tvm.s_tir import meta_schedule as ms

import tvm_fuel
from tvm_fuel.schedules import rule_for
from tvm_fuel.schedules.cuda.rules import cuda_rules
from tvm_fuel.tuning import TuningLogWarning, TuningRecords, target_key
from tvm_fuel.tuning.buckets import bucket_module
from tvm_fuel.tuning.report import TIR_FUNCTION, tuning_report
from tvm_fuel.dispatch.records import BLOCK, KNOB_PREFIX, kernel_family, replay
from tvm_fuel.dispatch.log_database import RECORD_FILE, WORKLOAD_FILE, LogDatabase
from tvm_fuel.tuning.space import ValidKnobs, workload_module
from tvm_fuel.tuning.kernels import commit_record, workloads_of

pytestmark = pytest.mark.numerics

# decode: the streaming kernel's knobs (lanes, block_k, kv_heads, value_tokens, prefetch)
PAGED = dict(B=3, Hq=7, Hkv=1, D=40, block_size=16, ctx=97)


def _paged():
    mod = bucket_module("paged_attn", PAGED)
    (workload,) = workloads_of(mod, HOST)
    return mod, workload


def _schedule(workload, knobs: dict) -> s_tir.Schedule:
    """The tuning task of ``workload`` with ``knobs`` annotated as given (not sampled from the space)."""
    sch = s_tir.Schedule(workload_module(workload, HOST))
    block = sch.get_sblock(BLOCK)
    for name, value in knobs.items():
        sch.annotate(block, KNOB_PREFIX + name, value)
    return sch


def _write_log(root, workload, points) -> tuple:
    """A log folder for HOST under ``root`` with one record per (knobs, seconds) point, in order;
    returns its (workload file, record file)."""
    folder = root / target_key(HOST) / kernel_family(workload.op)
    folder.mkdir(parents=True)
    database = ms.database.JSONDatabase(path_workload=str(folder / WORKLOAD_FILE),
                                        path_tuning_record=str(folder / RECORD_FILE))
    task = workload_module(workload, HOST)
    for knobs, seconds in points:
        commit_record(database, task, _schedule(workload, knobs), [seconds], HOST)
    return folder / WORKLOAD_FILE, folder / RECORD_FILE


def _line_warned(caught, path, line: int) -> bool:
    pattern = re.compile(re.escape(f"{path}, line {line}:"))
    return any(pattern.search(str(w.message)) for w in caught if issubclass(w.category, TuningLogWarning))


def _all_knobs(root) -> list[dict]:
    return sorted((record.knobs for record in TuningRecords([root]).all(HOST)), key=lambda k: sorted(k.items()))


def test_truncated_last_line_keeps_the_records_before_it(tmp_path):
    """A tuning run killed mid-write leaves half a line at the end (no newline)."""
    _, workload = _paged()
    _, records = _write_log(tmp_path, workload, [({"block_k": 256}, 3e-4), ({"block_k": 32}, 1e-4),
                                                 ({"block_k": 64}, 2e-4)])
    lines = records.read_text().splitlines()
    records.write_text("\n".join(lines) + "\n" + lines[1][: len(lines[1]) // 2])
    with pytest.warns(TuningLogWarning) as caught:
        found = TuningRecords([tmp_path]).lookup(workload, HOST)
    assert (found.knobs, found.source) == ({"block_k": 32}, str(records))
    assert _line_warned(caught, records, 4), [str(w.message) for w in caught]
    assert not _line_warned(caught, records, 3)


def test_bad_lines_in_the_middle_cost_only_themselves(tmp_path):
    """Records before and after bad lines (not JSON, wrong shape, a missing workload, an
    unparsable record) load; the fastest, after them, wins; each bad line is warned by number."""
    _, workload = _paged()
    points = [({"block_k": 32}, 3e-4), ({"value_tokens": 2}, 4e-4), ({"block_k": 64}, 1e-4), ({"block_k": 256}, 5e-4)]
    _, records = _write_log(tmp_path, workload, points)
    good = records.read_text().splitlines()
    index, record = json.loads(good[0])
    bad = ['[0, [["not a trace"', '{"a": 1}', json.dumps([7, record]), json.dumps([index, [1, 2, 3, 4]])]
    records.write_text("\n".join(good[:2] + bad + good[2:]) + "\n")
    with pytest.warns(TuningLogWarning) as caught:
        assert _all_knobs(tmp_path) == [{"block_k": 32}, {"block_k": 64}, {"block_k": 256}, {"value_tokens": 2}]
    for line in (3, 4, 5, 6):
        assert _line_warned(caught, records, line), (line, [str(w.message) for w in caught])
    with warnings.catch_warnings():  # the same bad lines again: warned once per file and process
        warnings.simplefilter("error", TuningLogWarning)
        found = TuningRecords([tmp_path]).lookup(workload, HOST)
        assert (found.knobs, found.source) == ({"block_k": 64}, str(records))


def test_bad_workload_line_skips_only_the_records_that_point_to_it(tmp_path):
    """Records name their workload by its line in the workload file (0-based, bad lines counted)."""
    _, workload = _paged()
    workloads, records = _write_log(tmp_path, workload, [({"block_k": 64}, 3e-4), ({"block_k": 32}, 1e-4)])
    workloads.write_text('["123", "not base64 json"]\n' + workloads.read_text())
    lines = [json.loads(line) for line in records.read_text().splitlines()]
    # the first record now points to the bad workload line, the second to the good one
    records.write_text("\n".join(json.dumps([n, record]) for n, (_, record) in zip((0, 1), lines)) + "\n")
    with pytest.warns(TuningLogWarning) as caught:
        assert _all_knobs(tmp_path) == [{"block_k": 32}]
    assert _line_warned(caught, workloads, 1), [str(w.message) for w in caught]
    assert _line_warned(caught, records, 1), [str(w.message) for w in caught]
    assert not _line_warned(caught, records, 2)


def _as_json_literal(records, name: str, value) -> None:
    """Rewrite the annotation of knob ``name`` in every record as the JSON literal ``value``
    (TVM itself writes a bool annotation as 1)."""
    lines = []
    for line in records.read_text().splitlines():
        index, record = json.loads(line)
        for inst in record[0][0]:
            if inst[0] == "Annotate" and inst[2] == [KNOB_PREFIX + name]:
                inst[1][1] = value
        lines.append(json.dumps([index, record]))
    records.write_text("\n".join(lines) + "\n")


@pytest.mark.parametrize("knob, value", [
    ("block_k", 65536),      # compile failed: "Cannot broadcast lanes=0"
    ("block_k", 2**15),      # compile failed on "lanes < 32768"
    ("value_tokens", 1000),  # compile took 81 s instead of 2 s
    ("value_tokens", 8000),  # compile ran for minutes
    ("block_k", 48),         # builds, but no tuner would pick it: not in the space either
    ("value_tokens", True),  # a bool, not a knob value
    ("prefetch", -8),
])
def test_out_of_space_record_warns_and_builds_with_hand_picked_knobs(tmp_path, knob, value):
    mod, workload = _paged()
    _, records = _write_log(tmp_path, workload, [({knob: 1 if value is True else value}, 1e-5)])
    if value is True:
        _as_json_literal(records, knob, True)
    start = time.perf_counter()
    with pytest.warns(TuningLogWarning) as caught:
        legalized = tvm_fuel.transform.legalize(mod, HOST, kernels="tuned", database=tmp_path, shipped_logs=False)
    tvm.compile(legalized, target=HOST)
    elapsed = time.perf_counter() - start
    (kernel,) = [f for f in legalized.functions.values()
                 if isinstance(f, tvm.tirx.PrimFunc) and f.attrs is not None and "fuel.knobs" in f.attrs]
    assert str(kernel.attrs["fuel.knobs"]) == "hand-picked"
    messages = [str(w.message) for w in caught]
    assert any(str(records) in m and knob in m and str(value) in m for m in messages), messages
    assert elapsed < 20, f"the build with a {knob}={value} record took {elapsed:.0f} s"


def test_knobs_outside_the_space_are_rejected_naming_knob_and_candidates():
    _, workload = _paged()
    rule = rule_for("paged_attn", HOST)
    space, defaults = rule.knob_space(workload, HOST), rule.default_knobs(workload, HOST)
    assert rule.knobs(workload, HOST, {"block_k": 32, "value_tokens": 2})["block_k"] == 32
    for knob, value in (("block_k", 65536), ("block_k", 48), ("value_tokens", 1000), ("prefetch", -8),
                        ("value_tokens", True), ("lanes", 16.0)):
        with pytest.raises(ValueError) as err:
            rule.knobs(workload, HOST, {knob: value})
        message = str(err.value)
        candidates = sorted({*space[knob], defaults[knob]})
        assert "paged_attn" in message and knob in message and repr(value) in message, message
        assert str(candidates) in message, message


def test_hand_picked_value_is_allowed_outside_the_listed_candidates():
    """The tuner's space is the candidates plus the hand-picked point (``workload_module``), so
    a record of the hand-picked point is valid even where the candidates lack its value."""
    # 8 KV heads of dim 80 in float32: the hand-picked prefetch is 64 KiB / 2560 B = 25 tokens
    (workload,) = workloads_of(bucket_module("paged_attn", dict(B=64, Hq=8, Hkv=8, D=80, block_size=16, ctx=64)),
                               HOST)
    rule = rule_for("paged_attn", HOST)
    prefetch = rule.default_knobs(workload, HOST)["prefetch"]
    assert prefetch not in rule.knob_space(workload, HOST)["prefetch"]
    assert rule.knobs(workload, HOST, {"prefetch": prefetch})["prefetch"] == prefetch


def test_cuda_rules_check_values_too():
    _, workload = _paged()
    target = tvm.target.Target("llvm")
    rule = next(r for r in cuda_rules(emulated=True) if r.op == "paged_attn")
    assert rule.knobs(workload, target, {"threads": 64})["threads"] == 64
    for knob, value in (("threads", 1024), ("block_k", 65536), ("stages", 0)):
        with pytest.raises(ValueError, match=rf"{knob} = {value}\b.*\[") as err:
            rule.knobs(workload, target, {knob: value})
        assert str(value) in str(err.value)


def test_tuner_rejects_out_of_space_candidates_before_measuring():
    """The tuner's validity check is the same ``rule.knobs`` that records pass."""
    _, workload = _paged()
    assert ValidKnobs(HOST).apply(_schedule(workload, {"block_k": 32}))
    assert not ValidKnobs(HOST).apply(_schedule(workload, {"block_k": 65536}))
    assert not ValidKnobs(HOST).apply(_schedule(workload, {"value_tokens": 1000}))


def test_record_with_a_time_of_zero_is_skipped(tmp_path):
    """A zero (or negative, or NaN) time is no measurement: it would win every lookup."""
    _, workload = _paged()
    _, records = _write_log(tmp_path, workload, [({"block_k": 32}, 0.0), ({"block_k": 64}, 1e-4)])
    with pytest.warns(TuningLogWarning, match=re.escape(str(records)) + ".*line 1: .*not positive"):
        found = TuningRecords([tmp_path]).lookup(workload, HOST)
        assert (found.knobs, found.source) == ({"block_k": 64}, str(records))


def _tear(path, half_of: str) -> None:
    """What a kill during a write leaves: half of ``half_of`` after the last whole line, no newline."""
    with open(path, "a") as log:
        log.write(half_of[: len(half_of) // 2])


def _builds(rule, workload, knobs: dict) -> bool:
    try:
        rule.knobs(workload, HOST, knobs)
    except ValueError:
        return False
    return True


def test_log_database_resumes_past_a_torn_line_and_appends_whole_lines(tmp_path):
    """The tuner's database (tune, tune --model, tune --import) reads the whole lines of a log whose
    last line a kill cut, names the dropped line, and appends after it without joining it."""
    _, workload = _paged()
    other = workloads_of(bucket_module("paged_attn", dict(PAGED, B=2)), HOST)[0]
    workloads, records = _write_log(tmp_path, workload, [({"block_k": 256}, 3e-4), ({"block_k": 32}, 2e-4)])
    folder = records.parent
    _tear(records, records.read_text().splitlines()[1])
    _tear(workloads, workloads.read_text().splitlines()[0])
    with pytest.warns(TuningLogWarning) as caught:
        database = LogDatabase(folder)
    assert _line_warned(caught, records, 3) and _line_warned(caught, workloads, 2), [str(w.message) for w in caught]
    task = workload_module(workload, HOST)
    assert [replay(r).knobs for r in database.get_top_k(database.commit_workload(task), 10)] == [
        {"block_k": 32}, {"block_k": 256}]  # fastest first, as JSONDatabase orders them
    commit_record(database, task, _schedule(workload, {"block_k": 64}), [1e-4], HOST)
    # a block_k of other's space that builds on this machine, not its hand-picked one (block_k must fill
    # key_vecs vectors: 16 builds on AVX2, not on AVX-512)
    rule = rule_for("paged_attn", HOST)
    other_knobs = next({"block_k": v} for v in rule.knob_space(other, HOST)["block_k"]
                       if v != rule.default_knobs(other, HOST)["block_k"] and _builds(rule, other, {"block_k": v}))
    commit_record(database, workload_module(other, HOST), _schedule(other, other_knobs), [1e-4], HOST)
    # the torn lines stay one bad line each; the new workload is line 3, after the torn one
    assert len(records.read_text().splitlines()) == 5 and len(workloads.read_text().splitlines()) == 3
    assert json.loads(records.read_text().splitlines()[4])[0] == 2
    with pytest.warns(TuningLogWarning) as caught:
        again = LogDatabase(folder)
    assert len(again) == 4
    assert [_line_warned(caught, records, n) for n in range(1, 6)] == [False, False, True, False, False]
    assert [_line_warned(caught, workloads, n) for n in range(1, 4)] == [False, True, False]
    with warnings.catch_warnings():  # (the build's reader warns for the same two lines)
        warnings.simplefilter("ignore", TuningLogWarning)
        found = {w: TuningRecords([tmp_path]).lookup(w, HOST).knobs for w in (workload, other)}
    assert found == {workload: {"block_k": 64}, other: other_knobs}


def _function_task():
    """The one unscheduled TIR function of silu(x @ w) and its tuning module."""
    from tvm import relax

    from tvm_fuel.tuning.model import function_tasks

    x, w = relax.Var("x", relax.TensorType((16, 32), "float32")), relax.Var("w", relax.TensorType((32, 8), "float32"))
    bb = relax.BlockBuilder()
    with bb.function("main", [x, w]):
        with bb.dataflow():
            y = bb.emit_output(relax.op.nn.silu(relax.op.matmul(x, w)))
        bb.emit_func_output(y)
    mod = bb.get()
    ((name, task),) = function_tasks(mod, HOST).items()
    return mod, name, task


def test_one_bad_line_of_a_model_log_costs_that_line_only(tmp_path):
    """A model log (MetaSchedule's records of a model's other TIR functions) with a bad line in
    the middle and a torn last line: the build still applies the good record, and warns by line."""
    mod, name, task = _function_task()
    folder = tmp_path / target_key(HOST) / "model"
    folder.mkdir(parents=True)
    database = ms.database.JSONDatabase(path_workload=str(folder / WORKLOAD_FILE),
                                        path_tuning_record=str(folder / RECORD_FILE))
    sch = s_tir.Schedule(task)  # (a record of no instructions is no record to MetaSchedule)
    sch.parallel(sch.get_loops(sch.get_sblock("T_multiply"))[0])
    commit_record(database, task, sch, [1e-4], HOST)
    records = folder / RECORD_FILE
    good = records.read_text().splitlines()
    records.write_text("\n".join(['{"half": ', good[0]]) + "\n" + good[0][:40])
    with pytest.warns(TuningLogWarning) as caught:
        rows = tuning_report(mod, HOST, database=tmp_path, shipped_logs=False, functions=True)
    assert [(r["function"], r["knobs"]) for r in rows if r["workload"] == TIR_FUNCTION] == [(name, str(records))]
    assert _line_warned(caught, records, 1) and _line_warned(caught, records, 3), [str(w.message) for w in caught]
    assert not _line_warned(caught, records, 2)
