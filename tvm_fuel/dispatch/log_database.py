"""``LogDatabase``: a MetaSchedule database over one log folder, read line by line and written one
whole line per write, so an interrupted run resumes from its whole lines.

Contents:
    LogDatabase     -- the database (``ms.database.JSONDatabase``'s two files and format)
    read_folder     -- the two files of a folder read line by line: a bad line costs that line only
    WORKLOAD_FILE, RECORD_FILE -- the two files
    describe_error  -- an exception as one line of a note
    is_int          -- an int that is not a bool
"""

from __future__ import annotations

import json
import os
import warnings
from pathlib import Path

import tvm
from tvm.ir.utils import derived_object
from tvm.s_tir import meta_schedule as ms

from ..diagnostics import TuningLogWarning

WORKLOAD_FILE = "database_workload.json"


RECORD_FILE = "database_tuning_record.json"


SHOWN_PER_FILE = 5  # bad lines or records named one by one per file; the rest are counted


STILL_APPLY = "the file's other lines still apply"


def is_int(value) -> bool:
    # knobs_of reads any number as an int: JSON true would become 1 and 2.5 would become 2
    if isinstance(value, tvm.tirx.IntImm):
        return str(value.ty).startswith(("int", "uint"))
    return isinstance(value, int) and not isinstance(value, bool)


def describe_error(err: Exception) -> str:
    if isinstance(err, json.JSONDecodeError):
        return f"not JSON, perhaps cut short ({err.msg}; column {err.colno})"
    text = (str(err).strip().splitlines() or [""])[0][:300]
    return f"{type(err).__name__}: {text}" if text else type(err).__name__


def _read_lines(path: Path, parse, then: str = STILL_APPLY) -> tuple[dict[int, object], list[str]]:
    """``parse`` of each line of a JSONDatabase file on its own: {0-based line index: result} and a
    note per line it fails on, naming the file and the line (and ``then``: what happens next)."""
    parsed, bad = {}, []
    # numbered as TVM numbers them: every "\n" ends a line, blank lines included
    for index, line in enumerate(path.read_text(errors="replace").split("\n")):
        if not line.strip():
            continue
        try:
            parsed[index] = parse(json.loads(line))
        except Exception as err:  # noqa: BLE001 -- a bad line costs that line only
            bad.append(f"{path}, line {index + 1}: {describe_error(err)}")
    if len(bad) > SHOWN_PER_FILE:
        bad = bad[:SHOWN_PER_FILE] + [f"{path}: {len(bad) - SHOWN_PER_FILE} more bad lines"]
    return parsed, [f"{note}; skipped, {then}" for note in bad]


def _parse_workload(item) -> ms.database.Workload:
    if not (isinstance(item, list) and len(item) == 2 and all(isinstance(x, str) for x in item)):
        raise ValueError("not a [hash, workload] pair")
    return ms.database.Workload.from_json(item)


def read_folder(folder: Path, then: str = STILL_APPLY) -> tuple[dict, dict, list[str]]:
    """The two files of a JSONDatabase folder read line by line (not by ``ms.database.JSONDatabase``,
    which fails on the first bad line): {0-based line: ``ms.database.Workload``}, {0-based line:
    ``TuningRecord``} and a note per bad line naming the file and the line. A workload line is
    ``[hash, workload]``, a record line ``[workload index, record]`` with the index of its
    workload's line. OSError where a file is missing or unreadable."""
    workload_file, record_file = folder / WORKLOAD_FILE, folder / RECORD_FILE

    def parse_record(item) -> ms.database.TuningRecord:
        if not (isinstance(item, list) and len(item) == 2 and is_int(item[0]) and isinstance(item[1], list)):
            raise ValueError("not a [workload index, record] pair")
        if item[0] not in workloads:
            where = f"line {item[0] + 1} of {workload_file}" if item[0] >= 0 else f"workload {item[0]}"
            raise ValueError(f"its workload ({where}) is missing or unreadable")
        return ms.database.TuningRecord.from_json(item[1], workloads[item[0]])

    workloads, workload_notes = _read_lines(workload_file, _parse_workload, then)
    records, record_notes = _read_lines(record_file, parse_record, then)
    return workloads, records, workload_notes + record_notes


def memory_database(workloads: dict, records: dict):
    """A MemoryDatabase holding ``read_folder``'s workloads and records in file order, and
    [(its workload, the first line of that workload in the file)]."""
    memory = ms.database.MemoryDatabase()
    lines: list = []
    for line, workload in sorted(workloads.items()):
        known = memory.has_workload(workload.mod)  # the same workload twice: the first line is its index
        committed = memory.commit_workload(workload.mod)
        if not known:
            lines.append((committed, line))
    for _, raw in sorted(records.items()):
        # the one workload object per structure: GetTopK then matches records by identity
        workload = memory.commit_workload(raw.workload.mod)
        memory.commit_tuning_record(ms.database.TuningRecord(raw.trace, workload, raw.run_secs, raw.target,
                                                             raw.args_info))
    return memory, lines


def _append_line(path: Path, text: str) -> None:
    """Append ``text`` as one line of ``path`` with one write to an O_APPEND descriptor: a record is
    written whole or, where the process dies mid-write, leaves one torn last line. A torn last
    line (no newline at the end, whoever wrote it) is ended first, in the same write: it stays one
    bad line that readers skip, and this line does not join it."""
    data = (text + "\n").encode()
    fd = os.open(path, os.O_RDWR | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        size = os.fstat(fd).st_size
        if size and os.pread(fd, 1, size - 1) != b"\n":
            data = b"\n" + data
        written = os.write(fd, data)
        while written < len(data):  # a short write (a full disk raises instead): the rest follows at once
            written += os.write(fd, data[written:])
    finally:
        os.close(fd)


def _as_json(kind: str, obj):
    """MetaSchedule's own JSON of a Workload or TuningRecord, as TVM objects (the Python ``as_json``
    converts them and fails on a trace's IndexMap)."""
    return tvm.get_global_func(f"s_tir.meta_schedule.{kind}AsJSON")(obj)


def _json_line(value) -> str:
    """A workload's or record's ``as_json`` as MetaSchedule's JSONDumps writes it, on one line:
    integer and float constants as numbers, other objects of a trace (an IndexMap) as their JSON
    graph in a string, which the trace's reader loads back."""
    import tvm_ffi

    def plain(item):  # booleans as JSONDumps writes them: a bool as 1 or 0, a bool IntImm as true or false
        if isinstance(item, bool):
            return int(item)
        if item is None or isinstance(item, (int, float, str)):
            return item
        if isinstance(item, tvm.tirx.IntImm):
            return bool(item.value) if str(item.ty) == "bool" else int(item.value)
        if isinstance(item, tvm.tirx.FloatImm):
            return float(item.value)
        if isinstance(item, (list, tuple, tvm_ffi.Array)):
            return [plain(x) for x in item]
        if isinstance(item, (dict, tvm_ffi.Map)):
            return {str(k): plain(v) for k, v in item.items()}
        return tvm.ir.save_json(item)

    return json.dumps(plain(value), separators=(",", ":"))


def _line_count(path: Path) -> int:
    """The index the next appended line of ``path`` gets (a torn last line counts: it is ended first)."""
    data = path.read_bytes()
    return data.count(b"\n") + (1 if data and not data.endswith(b"\n") else 0)


@derived_object
class LogDatabase(ms.database.PyDatabase):
    """A MetaSchedule database over one log folder, in ``ms.database.JSONDatabase``'s two files and
    format, that an interrupted run can resume from.

    Opening reads each line on its own, as a build does (``JSONDatabase`` stops at the first bad
    line, e.g. the half line a kill during a write leaves): a bad line is skipped, and named by
    file and line in ``notes`` (and in a ``TuningLogWarning`` unless ``warn=False``); the other
    records load. Each commit appends its line with a single write (``_append_line``), so a record
    is in the file whole or not at all, and a torn last line is ended before the next line follows,
    so no line index, which records name their workload by, moves. The files are created if missing.
    """

    def __init__(self, folder: str | os.PathLike, *, warn: bool = True):
        self.folder = Path(folder)
        self.workload_file, self.record_file = self.folder / WORKLOAD_FILE, self.folder / RECORD_FILE
        for path in (self.workload_file, self.record_file):
            os.close(os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644))
        workloads, records, self.notes = read_folder(self.folder, "tuning resumes from the file's other lines")
        self.memory, self.lines = memory_database(workloads, records)
        self.next_line = _line_count(self.workload_file)
        if warn:
            for note in self.notes:
                warnings.warn(f"tvm_fuel: {note}", TuningLogWarning, stacklevel=3)

    def _line_of(self, mod: tvm.IRModule) -> tuple[ms.database.Workload, int]:
        """The workload of ``mod`` and its line in the workload file, appended if new."""
        workload = self.memory.commit_workload(mod)
        for known, line in self.lines:
            if known.same_as(workload):
                return workload, line
        _append_line(self.workload_file, _json_line(_as_json("Workload", workload)))
        self.lines.append((workload, self.next_line))
        self.next_line += 1
        return workload, self.next_line - 1

    def has_workload(self, mod: tvm.IRModule) -> bool:
        return self.memory.has_workload(mod)

    def commit_workload(self, mod: tvm.IRModule) -> ms.database.Workload:
        return self._line_of(mod)[0]

    def commit_tuning_record(self, record: ms.database.TuningRecord) -> None:
        workload, line = self._line_of(record.workload.mod)
        record = ms.database.TuningRecord(record.trace, workload, record.run_secs, record.target, record.args_info)
        _append_line(self.record_file, _json_line([line, _as_json("TuningRecord", record)]))
        self.memory.commit_tuning_record(record)  # after the write: memory holds what the file holds

    def get_top_k(self, workload: ms.database.Workload, top_k: int) -> list:
        return self.memory.get_top_k(workload, top_k)

    def get_all_tuning_records(self) -> list:
        return self.memory.get_all_tuning_records()

    def __len__(self) -> int:
        return len(self.memory)
