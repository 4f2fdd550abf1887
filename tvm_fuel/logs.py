"""Tuning logs: where they live, which target they belong to, and the knobs they give a kernel.

Layout (``tuning_logs/`` in the package, or any directory a user passes)::

    <root>/<target key>/<kernel>/database_workload.json        MetaSchedule JSONDatabase
    <root>/<target key>/<kernel>/database_tuning_record.json
    <root>/<target key>/model/database_*.json                  a model's other TIR functions
    <root>/<target key>/model/points.json                      the shape points they were tuned at

``<target key>`` is the kind plus the arch or CPU feature set (``llvm-x86-avx2``,
``llvm-x86-avx512``, ``cuda-sm90``); ``<kernel>`` is the op family (``paged_attn``,
``flash_attn``, ``flash_attn_backward``). A directory that is itself a MetaSchedule work dir
(the two JSON files directly inside) is read too.

MetaSchedule's own lookup matches records by the structural hash of the workload and ignores the
target; here a record is matched by its ``Workload`` key (stable when a kernel template changes)
and used when its own target has the same target key: what the knobs depend on (instruction set
and vector width for the CPU, arch for CUDA, whose SM count follows from it). The core count is
not part of the key. The CPU knobs that set the task count (``schedules.cpu.tiles.CORE_KNOBS``:
the backward's splits, decode's KV heads per task) are stored as tuned on the record's target and
re-derived for the using machine's core count by the rule's ``port_knobs`` (splits keep their
tasks per core; KV heads per task keep their ratio to the hand-picked rule), rounded to a value
of the knob space that builds the kernel; see ``schedules.cpu.rules``.

No record for a target is normal (a log root without this target key's folder is silent, the
kernel keeps its hand-picked knobs). Each line of a log is read on its own: a line that cannot
be read (a run killed mid-write leaves half a line), a record of another target key found in this
key's folder or knobs outside the kernel's design space give a ``TuningLogWarning`` naming the
file and line and are skipped; the other records still apply. Each such warning is given once
per file and process, however many builds read the file. The writers (``tune``, ``tune_model``,
``tune --import``) open their folders as a ``LogDatabase``: read the same way, so an interrupted
run resumes from its whole lines, and written one whole line per write.

The ``model`` folder holds MetaSchedule's own records (a trace of its design spaces per TIR
function, matched by structural hash as ``MetaScheduleApplyDatabase`` matches) for the functions
of a model that are not fuel kernels (``tvm_fuel.tuning.model``), and the ``ShapePoint``s of the
symbolic models they were tuned at: a build specializes a model at a point where the static copy
then meets a record (``tvm_fuel.specialize``).

Contents:
    target_key       -- "llvm-x86-avx2", "cuda-sm90", ...
    kernel_family    -- the log folder of an op
    shipped_logs     -- the package's tuning_logs directory
    TuningRecords    -- records of some log roots; ``lookup(workload, target)`` -> ``KnobMatch``
    replay           -- workload, knobs and time of one MetaSchedule record
    FunctionRecords  -- the ``model`` records of some log roots: ``query(func, target)``, ``points``
    write_points     -- add shape points to a ``model`` folder
    LogDatabase      -- a MetaSchedule database over one log folder: bad lines skipped, lines written whole
    TuningLogWarning
    knobs_of, verification_of -- a record's workload and knobs, read from its scheduled module
"""

from __future__ import annotations

import json
import math
import os
import statistics
import warnings
from dataclasses import dataclass
from pathlib import Path

import tvm
from tvm import s_tir
from tvm.ir.utils import derived_object
from tvm.s_tir import meta_schedule as ms

from .diagnostics import TuningLogWarning
from .schedules import KnobMatch, rule_for
from .schedules.workload import Workload

MODEL_FOLDER = "model"
POINTS_FILE = "points.json"
WORKLOAD_FILE = "database_workload.json"
RECORD_FILE = "database_tuning_record.json"
FAILED_SECONDS = 1e9  # MetaSchedule stores a failed build or run as 1e10 s
SHOWN_PER_FILE = 5  # bad lines or records named one by one per file; the rest are counted
FALLBACK = "hand-picked knobs are used where no other record fits"
STILL_APPLY = "the file's other lines still apply"

# The record format: a tuning record's trace schedules a module whose one block BLOCK carries
# the workload key and, per knob, the annotation KNOB_PREFIX + name (see tuning.space)
BLOCK = "fuel_kernel"
WORKLOAD_KEY = "fuel.workload"
SPACE_KEY = "fuel.space"
VERIFIED_KEY = "fuel.verified"  # id (a time) of the side-by-side re-measurement a record comes from
KNOB_PREFIX = "fuel."


def _kernel_block(mod: tvm.IRModule) -> s_tir.SBlock:
    found = []

    def visit(node):
        if node.name_hint == BLOCK:
            found.append(node)

    import tvm_ffi

    tvm_ffi.structural_walk(mod["main"].body, (s_tir.SBlock, visit), order="post")
    if not found:
        raise ValueError("not a tvm_fuel tuning workload (no fuel_kernel block)")
    return found[0]


def knobs_of(mod: tvm.IRModule) -> tuple[Workload, dict[str, int]]:
    """The workload of a (scheduled) tuning module and the knob values its trace annotated."""
    annotations = _kernel_block(mod).annotations
    workload = Workload.from_key(str(annotations[WORKLOAD_KEY]))
    knobs = {key[len(KNOB_PREFIX):]: int(value) for key, value in annotations.items()
             if key.startswith(KNOB_PREFIX) and key not in (WORKLOAD_KEY, SPACE_KEY, VERIFIED_KEY)}
    return workload, knobs


def verification_of(mod: tvm.IRModule) -> int:
    """The id of the verification a scheduled tuning module was measured in (0: none; see ``tune``)."""
    return int(_kernel_block(mod).annotations.get(VERIFIED_KEY, 0))


def target_key(target: tvm.target.Target) -> str:
    """Kind plus arch or CPU feature set: what a tuning record may be reused across."""
    kind = target.kind.name
    if kind == "cuda":
        arch = str(target.attrs.get("arch", "") or "")
        return f"cuda-{arch.replace('_', '')}" if arch else "cuda"
    if kind == "llvm":
        if target.attrs.get("mcpu") is None:
            return "llvm-generic"
        has = tvm.target.codegen.target_has_features
        for feature, key in (("avx512f", "llvm-x86-avx512"), ("avx2", "llvm-x86-avx2"), ("avx", "llvm-x86-avx")):
            if has(feature, target):
                return key
        if has("neon", target) or has("sve", target):
            return "llvm-arm-sve" if has("sve", target) else "llvm-arm-neon"
        return f"llvm-{target.attrs['mcpu']}"
    return kind


def kernel_family(op: str) -> str:
    """The log folder of an op: the single-gradient backward ops share flash_attn_backward's."""
    return "flash_attn_backward" if op.startswith("flash_attn_backward") else op


def shipped_logs() -> Path:
    """The tuning_logs directory installed with the package."""
    from . import tuning_logs

    return Path(tuning_logs.__file__).parent


@dataclass(frozen=True)
class Record:
    workload: Workload
    knobs: dict
    seconds: float
    source: str  # the record file
    verified: int = 0  # id of the side-by-side re-measurement with the hand-picked point (0: none)


def _mean_seconds(raw: ms.database.TuningRecord) -> float:
    seconds = [float(s) for s in raw.run_secs or []]
    return sum(seconds) / len(seconds) if seconds else 1e10  # JSONDatabase's key: no time sorts last


def _failed(raw: ms.database.TuningRecord) -> bool:
    """Whether a record stores a failed build or run (nothing to reuse, nothing wrong with the log)."""
    seconds = [float(s) for s in raw.run_secs or []]
    return not seconds or min(seconds) >= FAILED_SECONDS


def _is_int(value) -> bool:
    # knobs_of reads any number as an int: JSON true would become 1 and 2.5 would become 2
    if isinstance(value, tvm.tirx.IntImm):
        return str(value.ty).startswith(("int", "uint"))
    return isinstance(value, int) and not isinstance(value, bool)


def _record_of(raw: ms.database.TuningRecord) -> Record:
    """The workload, knobs and median time of a measured record; ValueError or TVM's error saying
    why it is not a fuel kernel's record."""
    seconds = [float(s) for s in raw.run_secs]
    if not all(math.isfinite(s) and s > 0 for s in seconds):
        raise ValueError(f"run times {seconds} are not positive numbers")  # 0 or less would win every lookup
    sch = s_tir.Schedule(raw.workload.mod)
    raw.trace.apply_to_schedule(sch, remove_postproc=True)
    workload, knobs = knobs_of(sch.mod)
    annotations = sch.get(sch.get_sblock(BLOCK)).annotations
    for name in knobs:
        if not _is_int(annotations[KNOB_PREFIX + name]):
            raise ValueError(f"knob {name} = {annotations[KNOB_PREFIX + name]!r} is not an int")
    return Record(workload, knobs, statistics.median(seconds), "", verification_of(sch.mod))


def replay(raw: ms.database.TuningRecord) -> Record | None:
    """The workload, knobs and median time of a MetaSchedule record; None for a failed measurement
    or a record that is not a fuel kernel's."""
    if _failed(raw):
        return None
    try:
        return _record_of(raw)
    except Exception:  # noqa: BLE001 -- not a fuel tuning record
        return None


def _reason(err: Exception) -> str:
    if isinstance(err, json.JSONDecodeError):
        return f"not JSON, perhaps cut short ({err.msg}; column {err.colno})"
    text = (str(err).strip().splitlines() or [""])[0][:300]
    return f"{type(err).__name__}: {text}" if text else type(err).__name__


def _shown(items: list[str]) -> str:
    more = len(items) - SHOWN_PER_FILE
    return "; ".join(items[:SHOWN_PER_FILE]) + (f"; and {more} more" if more > 0 else "")


def _ported(rule, record: Record, tuned_on: tvm.target.Target, target: tvm.target.Target) -> dict:
    """The record's knobs for ``target``: the core knobs re-derived from the record's target's core
    count where the rule knows how (the CPU rules' ``port_knobs``), else as recorded. Knobs the
    re-derivation cannot place are kept as recorded: ``rule.knobs`` then judges them."""
    port = getattr(rule, "port_knobs", None)
    if port is None:
        return dict(record.knobs)
    try:
        return port(record.workload, record.knobs, tuned_on, target)
    except Exception:  # noqa: BLE001 -- e.g. the record's target has no hand-picked point
        return dict(record.knobs)


def _usable(raw_records, target: tvm.target.Target, source: str) -> tuple[list[Record], list[str]]:
    """The records of ``target``'s key whose knobs build their kernel, and notes on the others.
    ``raw_records``: (line in ``source`` or None, MetaSchedule record) pairs."""
    key = target_key(target)
    records, foreign, broken = [], set(), []
    for line, raw in raw_records:
        try:
            theirs = target_key(raw.target)
            if theirs != key:
                foreign.add(theirs)
                continue
            if _failed(raw):
                continue
            record = _record_of(raw)
            rule = rule_for(record.workload.op, target)
            if rule is None:
                raise ValueError(f"no kernel serves {record.workload.op}")
            knobs = _ported(rule, record, raw.target, target)
            # the same check as the tuner's candidates pass: names and values of the design space
            rule.knobs(record.workload, target, knobs)
        except Exception as err:  # noqa: BLE001 -- a record that does not build a kernel here is skipped
            broken.append(f"line {line}: {_reason(err)}" if line else _reason(err))
            continue
        records.append(Record(record.workload, knobs, record.seconds, source, record.verified))
    notes = []
    if foreign:
        notes.append(f"{source}: records tuned for {sorted(foreign)} ignored on {key}; {FALLBACK}")
    if broken:
        notes.append(f"{source}: {len(broken)} record(s) that do not describe a buildable fuel kernel ignored "
                     f"({_shown(broken)}); {FALLBACK}")
    return records, notes


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
            bad.append(f"{path}, line {index + 1}: {_reason(err)}")
    if len(bad) > SHOWN_PER_FILE:
        bad = bad[:SHOWN_PER_FILE] + [f"{path}: {len(bad) - SHOWN_PER_FILE} more bad lines"]
    return parsed, [f"{note}; skipped, {then}" for note in bad]


def _parse_workload(item) -> ms.database.Workload:
    if not (isinstance(item, list) and len(item) == 2 and all(isinstance(x, str) for x in item)):
        raise ValueError("not a [hash, workload] pair")
    return ms.database.Workload.from_json(item)


def _read_folder(folder: Path, then: str = STILL_APPLY) -> tuple[dict, dict, list[str]]:
    """The two files of a JSONDatabase folder read line by line (not by ``ms.database.JSONDatabase``,
    which fails on the first bad line): {0-based line: ``ms.database.Workload``}, {0-based line:
    ``TuningRecord``} and a note per bad line naming the file and the line. A workload line is
    ``[hash, workload]``, a record line ``[workload index, record]`` with the index of its
    workload's line. OSError where a file is missing or unreadable."""
    workload_file, record_file = folder / WORKLOAD_FILE, folder / RECORD_FILE

    def parse_record(item) -> ms.database.TuningRecord:
        if not (isinstance(item, list) and len(item) == 2 and _is_int(item[0]) and isinstance(item[1], list)):
            raise ValueError("not a [workload index, record] pair")
        if item[0] not in workloads:
            where = f"line {item[0] + 1} of {workload_file}" if item[0] >= 0 else f"workload {item[0]}"
            raise ValueError(f"its workload ({where}) is missing or unreadable")
        return ms.database.TuningRecord.from_json(item[1], workloads[item[0]])

    workloads, workload_notes = _read_lines(workload_file, _parse_workload, then)
    records, record_notes = _read_lines(record_file, parse_record, then)
    return workloads, records, workload_notes + record_notes


def _read_database(folder: Path, target: tvm.target.Target) -> tuple[list[Record], list[str]]:
    """The usable records of one JSONDatabase folder for ``target``, and warnings about the rest
    (each line read on its own, ``_read_folder``)."""
    try:
        _, raw, notes = _read_folder(folder)
    except OSError as err:  # a missing or unreadable file: the whole log is skipped, never fatal
        return [], [f"{folder / RECORD_FILE}: unreadable tuning log ({type(err).__name__}: {err}); {FALLBACK}"]
    # in JSONDatabase's order (by mean time, stable): the first of equally fast records wins the lookup
    numbered = sorted(((index + 1, r) for index, r in raw.items()), key=lambda item: _mean_seconds(item[1]))
    records, usable_notes = _usable(numbered, target, str(folder / RECORD_FILE))
    return records, notes + usable_notes


def _memory_database(workloads: dict, records: dict):
    """A MemoryDatabase holding ``_read_folder``'s workloads and records in file order, and
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
        workloads, records, self.notes = _read_folder(self.folder, "tuning resumes from the file's other lines")
        self.memory, self.lines = _memory_database(workloads, records)
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


_CACHE: dict = {}
_WARNED: set = set()  # (file or database, note) pairs already warned in this process


def _warn(where: str, note: str) -> None:
    """Warn ``note`` about ``where`` once per process: every build reads the logs again."""
    if (where, note) in _WARNED:
        return
    _WARNED.add((where, note))
    warnings.warn(f"tvm_fuel: {note}", TuningLogWarning, stacklevel=5)


def _database_folders(root: Path, target: tvm.target.Target) -> list[Path]:
    folders = []
    if (root / RECORD_FILE).exists() or (root / WORKLOAD_FILE).exists():
        folders.append(root)
    per_target = root / target_key(target)
    if per_target.is_dir():
        folders += sorted(p for p in per_target.iterdir() if p.is_dir() and p.name != MODEL_FOLDER)
    return folders


class TuningRecords:
    """The records of some log roots (and MetaSchedule databases), looked up per workload.

    Parameters
    ----------
    roots : list of paths or ``ms.database.Database``
        Searched in order; a path is a log root (``<root>/<target key>/<kernel>/``) or one
        MetaSchedule work dir. The first root with a matching record wins.
    """

    def __init__(self, roots):
        self.roots = list(roots)

    def _records(self, root, target: tvm.target.Target) -> list[Record]:
        if isinstance(root, ms.database.Database):
            try:
                records, notes = _usable(((None, raw) for raw in root.get_all_tuning_records()), target,
                                         f"database {type(root).__name__}")
            except Exception as err:  # noqa: BLE001 -- an unreadable database is skipped, never fatal
                records, notes = [], [f"database {type(root).__name__}: unreadable ({err}); {FALLBACK}"]
            for note in notes:
                _warn(f"database {id(root)}", note)
            return records
        records: list[Record] = []
        root = Path(root)
        if not root.exists():
            _warn(str(root), f"tuning log directory {root} does not exist; hand-picked knobs are used")
            return records
        for folder in _database_folders(root, target):
            files = [folder / WORKLOAD_FILE, folder / RECORD_FILE]
            stamp = (str(folder), str(target), tuple((os.stat(f).st_mtime_ns, os.stat(f).st_size) if f.exists() else 0
                                                     for f in files))
            if stamp not in _CACHE:
                _CACHE[stamp] = _read_database(folder, target)
            found, notes = _CACHE[stamp]
            for note in notes:
                _warn(str(folder), note)
            records += found
        return records

    def all(self, target: tvm.target.Target) -> list[Record]:
        """Every usable record for ``target``, root by root."""
        return [record for root in self.roots for record in self._records(root, target)]

    def lookup(self, workload: Workload, target: tvm.target.Target) -> KnobMatch | None:
        """The fastest record of the best-matching tuned workload (None: no record fits).

        A static workload takes a record of exactly its dims, else one of the nearest tuned
        workload in its shape bucket (``schedules.workload.size_bucket``: each dim within the
        same power of two; ``exact`` is then False). A symbolic dim matches any size (the
        largest tuned workload is taken: tuned for throughput). Where a workload has verified
        records (the search's best re-measured side by side with the hand-picked knobs), only
        those of its latest verification compete: measurements taken at different times on a
        shared machine are not comparable.
        """
        for root in self.roots:
            records = self._records(root, target)
            exact = [r for r in records if workload.matches(r.workload)]
            if exact:
                def size(record: Record) -> float:
                    return math.prod(max(1, s or 1) for _, s in record.workload.dims)

                largest = max(size(r) for r in exact)
                best = _fastest_latest([r for r in exact if size(r) == largest])
                return KnobMatch(dict(best.knobs), best.source, best.workload, exact=True)
            near = [r for r in records if workload.in_bucket_of(r.workload)]
            if near:
                nearest = min(workload.distance(r.workload) for r in near)
                best = _fastest_latest([r for r in near if workload.distance(r.workload) == nearest])
                return KnobMatch(dict(best.knobs), best.source, best.workload, exact=False)
        return None


def _fastest_latest(records: list[Record]) -> Record:
    """The fastest of the records of each workload's latest verification (see ``lookup``)."""
    latest: dict = {}
    for r in records:
        latest[r.workload] = max(latest.get(r.workload, 0), r.verified)
    return min((r for r in records if r.verified == latest[r.workload]), key=lambda r: (r.seconds, r.workload.key))


def write_points(folder: Path, points) -> None:
    """Add ``points`` (``specialize.ShapePoint``) to ``folder``'s points file (kept sorted, no repeats)."""
    from .specialize import ShapePoint

    path = Path(folder) / POINTS_FILE
    known = {json.dumps(p.to_json(), sort_keys=True) for p in _read_points(path)}
    known |= {json.dumps(ShapePoint.to_json(p), sort_keys=True) for p in points}
    path.write_text(json.dumps([json.loads(p) for p in sorted(known)], indent=1) + "\n")


def _read_points(path: Path) -> list:
    from .specialize import ShapePoint

    if not path.exists():
        return []
    try:
        return [ShapePoint.from_json(item) for item in json.loads(path.read_text())]
    except (OSError, ValueError, TypeError, KeyError) as err:
        _warn(str(path), f"{path}: unreadable shape points ({_reason(err)}); models are built without them")
        return []


class FunctionRecords:
    """MetaSchedule records of a model's non-fuel TIR functions in some log roots (their ``model``
    folders for the target's key) or MetaSchedule databases, searched in order.

    ``query(func, target)`` -> (the function scheduled by the fastest record, its source) or None;
    ``points(target)`` -> the shape points the records were tuned at."""

    def __init__(self, roots):
        self.roots = list(roots)

    def databases(self, target: tvm.target.Target) -> list[tuple[str, ms.database.Database]]:
        found = []
        for root in self.roots:
            if isinstance(root, ms.database.Database):
                found.append((f"database {type(root).__name__}", root))
                continue
            folder = Path(root) / target_key(target) / MODEL_FOLDER
            files = [folder / WORKLOAD_FILE, folder / RECORD_FILE]
            if not all(f.exists() for f in files):
                continue
            stamp = ("model", str(folder), tuple((os.stat(f).st_mtime_ns, os.stat(f).st_size) for f in files))
            if stamp not in _CACHE:
                try:  # line by line, as the kernels' logs: a bad line costs that line only
                    workloads, records, notes = _read_folder(folder)
                    _CACHE[stamp] = _memory_database(workloads, records)[0], notes
                except OSError as err:  # an unreadable log is skipped, never fatal
                    _CACHE[stamp] = None, [f"{folder}: unreadable tuning log ({_reason(err)}); the model's "
                                           "functions keep their default schedules"]
            database, notes = _CACHE[stamp]
            for note in notes:
                _warn(str(folder), note)
            if database is not None:
                found.append((str(files[1]), database))
        return found

    def query(self, func: tvm.tirx.PrimFunc, target: tvm.target.Target):
        """``func`` scheduled by the first database with a record of it, and that database's name."""
        mod = tvm.IRModule({"main": func.with_attr("global_symbol", "main")})
        for source, database in self.databases(target):
            try:
                if not database.has_workload(mod):
                    continue
                sch = database.query_schedule(mod, target, "main")
            except Exception as err:  # noqa: BLE001 -- a record that does not replay here is skipped
                _warn(source, f"{source}: a record did not apply ({_reason(err)}); the default schedule is used")
                continue
            if sch is not None:
                return sch.mod["main"].without_attr("global_symbol"), source
        return None

    def points(self, target: tvm.target.Target) -> list:
        points = []
        for root in self.roots:
            if not isinstance(root, ms.database.Database):
                points += [p for p in _read_points(Path(root) / target_key(target) / MODEL_FOLDER / POINTS_FILE)
                           if p not in points]
        return points
