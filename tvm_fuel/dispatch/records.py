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
    KnobMatch        -- what a lookup found: knobs, their log file, the workload they were tuned at
    replay           -- workload, knobs and time of one MetaSchedule record
    FunctionRecords  -- the ``model`` records of some log roots: ``query(func, target)``, ``points``
    write_points     -- add shape points to a ``model`` folder
    KnobSource       -- what ``routing.tuned_legalize_map`` takes knobs from (TuningRecords; the tests' pins)
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
from typing import Any, Mapping, Protocol

import tvm
from tvm import s_tir
from tvm.s_tir import meta_schedule as ms

from ..diagnostics import TuningLogWarning
from .shape_points import ShapePoint
from ..schedules import rule_for
from ..schedules.workload import Workload
from .log_database import (RECORD_FILE, SHOWN_PER_FILE, WORKLOAD_FILE, describe_error, is_int, memory_database,
                           read_folder)

MODEL_FOLDER = "model"
POINTS_FILE = "points.json"
FAILED_SECONDS = 1e9  # MetaSchedule stores a failed build or run as 1e10 s
FALLBACK = "hand-picked knobs are used where no other record fits"

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
    from .. import tuning_logs

    return Path(tuning_logs.__file__).parent


@dataclass(frozen=True)
class KnobMatch:
    """What a knob lookup found: the knobs, where they came from (a log file) and the workload
    they were tuned at (None: unknown). ``exact``: tuned at the call's own dims, not a bucket
    neighbour's."""

    knobs: Mapping[str, int]
    source: str
    tuned: Workload | None = None
    exact: bool = True


class KnobSource(Protocol):
    """Where tuned knobs come from: ``TuningRecords``, or anything that looks a workload up."""

    def lookup(self, workload: Workload, target: tvm.target.Target) -> KnobMatch | None:
        """The best record for ``workload`` on ``target``, or None."""


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
        if not is_int(annotations[KNOB_PREFIX + name]):
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
            broken.append(f"line {line}: {describe_error(err)}" if line else describe_error(err))
            continue
        records.append(Record(record.workload, knobs, record.seconds, source, record.verified))
    notes = []
    if foreign:
        notes.append(f"{source}: records tuned for {sorted(foreign)} ignored on {key}; {FALLBACK}")
    if broken:
        notes.append(f"{source}: {len(broken)} record(s) that do not describe a buildable fuel kernel ignored "
                     f"({_shown(broken)}); {FALLBACK}")
    return records, notes


def _read_database(folder: Path, target: tvm.target.Target) -> tuple[list[Record], list[str]]:
    """The usable records of one JSONDatabase folder for ``target``, and warnings about the rest
    (each line read on its own, ``read_folder``)."""
    try:
        _, raw, notes = read_folder(folder)
    except OSError as err:  # a missing or unreadable file: the whole log is skipped, never fatal
        return [], [f"{folder / RECORD_FILE}: unreadable tuning log ({type(err).__name__}: {err}); {FALLBACK}"]
    # in JSONDatabase's order (by mean time, stable): the first of equally fast records wins the lookup
    numbered = sorted(((index + 1, r) for index, r in raw.items()), key=lambda item: _mean_seconds(item[1]))
    records, usable_notes = _usable(numbered, target, str(folder / RECORD_FILE))
    return records, notes + usable_notes


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
    """Add ``points`` (``ShapePoint``) to ``folder``'s points file (kept sorted, no repeats)."""
    path = Path(folder) / POINTS_FILE
    known = {json.dumps(p.to_json(), sort_keys=True) for p in _read_points(path)}
    known |= {json.dumps(ShapePoint.to_json(p), sort_keys=True) for p in points}
    path.write_text(json.dumps([json.loads(p) for p in sorted(known)], indent=1) + "\n")


def _read_points(path: Path) -> list:
    if not path.exists():
        return []
    try:
        return [ShapePoint.from_json(item) for item in json.loads(path.read_text())]
    except (OSError, ValueError, TypeError, KeyError) as err:
        _warn(str(path), f"{path}: unreadable shape points ({describe_error(err)}); models are built without them")
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
                    workloads, records, notes = read_folder(folder)
                    _CACHE[stamp] = memory_database(workloads, records)[0], notes
                except OSError as err:  # an unreadable log is skipped, never fatal
                    _CACHE[stamp] = None, [f"{folder}: unreadable tuning log ({describe_error(err)}); the model's "
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
                _warn(source, f"{source}: a record did not apply ({describe_error(err)}); the default schedule is used")
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


def log_roots(database: Any, shipped: bool) -> list:
    """The log roots a build reads, in order: ``database`` (if any), then the shipped logs."""
    return ([database] if database is not None else []) + ([shipped_logs()] if shipped else [])
