"""Tuning logs: where they live, which target they belong to, and the knobs they give a kernel.

Layout (``tuning_logs/`` in the package, or any directory a user passes)::

    <root>/<target key>/<kernel>/database_workload.json        MetaSchedule JSONDatabase
    <root>/<target key>/<kernel>/database_tuning_record.json

``<target key>`` is the kind plus the arch or CPU feature set (``llvm-x86-avx2``,
``llvm-x86-avx512``, ``cuda-sm90``); ``<kernel>`` is the op family (``paged_attn``,
``flash_attn``, ``flash_attn_backward``). A directory that is itself a MetaSchedule work dir
(the two JSON files directly inside) is read too.

MetaSchedule's own lookup matches records by the structural hash of the workload and ignores the
target; here a record is matched by its ``Workload`` key (stable when a kernel template changes)
and used only when its own target has the same target key and core count (the knobs that set
tasks per core are tuned for it). A log that cannot be read, a record
for another target or knobs the kernel cannot build give a ``TuningLogWarning`` naming the file,
and the kernel keeps its hand-picked knobs.

Contents:
    target_key       -- "llvm-x86-avx2", "cuda-sm90", ...
    kernel_family    -- the log folder of an op
    shipped_logs     -- the package's tuning_logs directory
    TuningRecords    -- records of some log roots; ``lookup(workload, target)``
    replay           -- workload, knobs and time of one MetaSchedule record
    TuningLogWarning
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
from tvm.s_tir import meta_schedule as ms

from ..schedules import TuningLogWarning, rule_for
from ..schedules.cpu.tiles import cores
from ..schedules.workload import Workload
from .space import knobs_of, verification_of

WORKLOAD_FILE = "database_workload.json"
RECORD_FILE = "database_tuning_record.json"
FAILED_SECONDS = 1e9  # MetaSchedule stores a failed build or run as 1e10 s


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
    from .. import tuning_logs

    return Path(tuning_logs.__file__).parent


@dataclass(frozen=True)
class Record:
    workload: Workload
    knobs: dict
    seconds: float
    source: str  # the record file
    verified: int = 0  # id of the side-by-side re-measurement with the hand-picked point (0: none)


def _check_lines(path: Path, width: int) -> None:
    """Each line of a JSONDatabase file is a JSON list of ``width`` items (checked before TVM parses it)."""
    for number, line in enumerate(path.read_text().splitlines(), 1):
        if not line.strip():
            continue
        item = json.loads(line)
        if not isinstance(item, list) or len(item) != width:
            raise ValueError(f"line {number} is not a {width}-item list")


def replay(raw: ms.database.TuningRecord) -> Record | None:
    """The workload, knobs and median time of a MetaSchedule record; None for a failed measurement
    or a record that is not a fuel kernel's."""
    seconds = [float(s) for s in raw.run_secs or []]
    if not seconds or min(seconds) >= FAILED_SECONDS:
        return None
    try:
        sch = s_tir.Schedule(raw.workload.mod)
        raw.trace.apply_to_schedule(sch, remove_postproc=True)
        workload, knobs = knobs_of(sch.mod)
        verified = verification_of(sch.mod)
    except Exception:  # noqa: BLE001 -- not a fuel tuning record
        return None
    return Record(workload, knobs, statistics.median(seconds), "", verified)


def _usable(raw_records, target: tvm.target.Target, source: str) -> tuple[list[Record], list[str]]:
    """The records of ``target``'s key whose knobs build their kernel, and notes on the others."""
    key = f"{target_key(target)} with {cores(target)} cores"
    records, foreign, broken = [], set(), 0
    for raw in raw_records:
        try:
            # the parallel knobs (tasks per core) are tuned for a core count: it must match too
            theirs = f"{target_key(raw.target)} with {cores(raw.target)} cores"
            if theirs != key:
                foreign.add(theirs)
                continue
            record = replay(raw)
            if record is None:
                broken += bool(raw.run_secs) and float(raw.run_secs[0]) < FAILED_SECONDS
                continue
            rule = rule_for(record.workload.op, target)
            if rule is None:
                raise ValueError(f"no kernel serves {record.workload.op}")
            rule.knobs(record.workload, target, record.knobs)
        except Exception:  # noqa: BLE001 -- a record that does not build a kernel here is skipped
            broken += 1
            continue
        records.append(Record(record.workload, record.knobs, record.seconds, source, record.verified))
    notes = []
    if foreign:
        notes.append(f"{source}: records tuned for {sorted(foreign)} ignored on {key}")
    if broken:
        notes.append(f"{source}: {broken} record(s) that do not describe a buildable fuel kernel ignored")
    return records, notes


def _read_database(folder: Path, target: tvm.target.Target) -> tuple[list[Record], list[str]]:
    """The usable records of one JSONDatabase folder for ``target``, and warnings about the rest."""
    workload_file, record_file = folder / WORKLOAD_FILE, folder / RECORD_FILE
    try:
        _check_lines(workload_file, 2)
        _check_lines(record_file, 2)
        database = ms.database.JSONDatabase(path_workload=str(workload_file), path_tuning_record=str(record_file),
                                            allow_missing=False)
        raw = database.get_all_tuning_records()
    except Exception as err:  # noqa: BLE001 -- any unreadable log is skipped, never fatal
        return [], [f"{record_file}: unreadable tuning log ({type(err).__name__}: {str(err).splitlines()[0][:200]})"]
    return _usable(raw, target, str(record_file))


_CACHE: dict = {}


def _database_folders(root: Path, target: tvm.target.Target) -> list[Path]:
    folders = []
    if (root / RECORD_FILE).exists() or (root / WORKLOAD_FILE).exists():
        folders.append(root)
    per_target = root / target_key(target)
    if per_target.is_dir():
        folders += sorted(p for p in per_target.iterdir() if p.is_dir())
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
                records, notes = _usable(root.get_all_tuning_records(), target, f"database {type(root).__name__}")
            except Exception as err:  # noqa: BLE001 -- an unreadable database is skipped, never fatal
                records, notes = [], [f"database {type(root).__name__}: unreadable ({err})"]
            for note in notes:
                warnings.warn(f"tvm_fuel: {note}; hand-picked knobs are used there", TuningLogWarning, stacklevel=4)
            return records
        records: list[Record] = []
        root = Path(root)
        if not root.exists():
            warnings.warn(f"tvm_fuel: tuning log directory {root} does not exist; hand-picked knobs are used",
                          TuningLogWarning, stacklevel=4)
            return records
        for folder in _database_folders(root, target):
            files = [folder / WORKLOAD_FILE, folder / RECORD_FILE]
            stamp = (str(folder), str(target), tuple((os.stat(f).st_mtime_ns, os.stat(f).st_size) if f.exists() else 0
                                                     for f in files))
            if stamp not in _CACHE:
                _CACHE[stamp] = _read_database(folder, target)
            found, notes = _CACHE[stamp]
            for note in notes:
                warnings.warn(f"tvm_fuel: {note}; hand-picked knobs are used there", TuningLogWarning, stacklevel=4)
            records += found
        return records

    def all(self, target: tvm.target.Target) -> list[Record]:
        """Every usable record for ``target``, root by root."""
        return [record for root in self.roots for record in self._records(root, target)]

    def lookup(self, workload: Workload, target: tvm.target.Target) -> tuple[dict[str, int], str] | None:
        """(knobs, record file) of the fastest record of the best-matching tuned workload.

        A static workload needs a record of exactly its dims; a symbolic dim matches any size
        (the largest tuned bucket is taken: tuned for throughput). Where a workload has verified
        records (the search's best re-measured side by side with the hand-picked knobs), only
        those of its latest verification compete: measurements taken at different times on a
        shared machine are not comparable.
        """
        for root in self.roots:
            matching = [r for r in self._records(root, target) if workload.matches(r.workload)]
            latest: dict = {}
            for r in matching:
                latest[r.workload] = max(latest.get(r.workload, 0), r.verified)
            matching = [r for r in matching if r.verified == latest[r.workload]]
            if matching:
                def size(record: Record) -> float:
                    return math.prod(max(1, s or 1) for _, s in record.workload.dims)

                largest = max(size(r) for r in matching)
                best = min((r for r in matching if size(r) == largest), key=lambda r: r.seconds)
                return dict(best.knobs), best.source
        return None
