"""``python -m tvm_fuel tune --import results.json``: a GPU node's measurements as tuning records.

A bundle's tune stage (``tvm_fuel.deploy``) times every fitting knob point of the CUDA kernels
on the node, then re-measures the best few and the hand-picked point side by side over rounds.
Here each measured point becomes a MetaSchedule record of its workload's tuning task, and the
side-by-side rounds become verified records (``fuel.verified``: the run's id), which are the
ones ``tvm_fuel.compile`` chooses from, as for the CPU kernels tuned here. Records go to
``<work_dir>/<target key>/<kernel>/`` (``tuning_logs/cuda-sm90/...``).

Contents:
    import_results -- write the records of a results file; one summary row per bucket
"""

from __future__ import annotations

import json
import statistics
import time
from pathlib import Path

import tvm

from ..schedules.workload import Workload
from ..dispatch.records import kernel_family, knobs_of, replay, target_key
from ..dispatch.log_database import LogDatabase
from ..tuning.space import fixed_point, workload_module
from ..tuning.kernels import commit_record, default_work_dir


def _load(path: Path) -> tuple[dict, list[dict]]:
    try:
        report = json.loads(Path(path).read_text())
    except (OSError, json.JSONDecodeError) as err:
        raise ValueError(f"tvm_fuel tune --import: cannot read {path}: {err}") from err
    try:
        bundle, stages = report["bundle"], report["stages"]
        buckets = stages.get("tune", {}).get("buckets")
        built_for, measured_on = bundle.get("arch"), (report.get("device") or {}).get("arch")
    except (KeyError, TypeError, AttributeError):
        raise ValueError(f"tvm_fuel tune --import: {path} is not the results file of a tvm_fuel bundle "
                         "(run.py --out)") from None
    if not buckets:
        raise ValueError(f"tvm_fuel tune --import: {path} holds no tune stage (run.py --stages tune)")
    if built_for != measured_on:
        raise ValueError(f"tvm_fuel tune --import: bundle {report.get('bundle_id')} was built for {built_for} but "
                         f"measured on {measured_on}")
    if not isinstance(buckets, list):
        raise ValueError(f"tvm_fuel tune --import: {path}: the tune stage's buckets must be a list, "
                         f"got {type(buckets).__name__}")
    for index, bucket in enumerate(buckets):  # all of them before any record is written
        problem = _bucket_problem(bucket)
        if problem:
            raise ValueError(f"tvm_fuel tune --import: {path}: tune bucket {index} {problem}")
    return report, buckets


def _is_number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and value > 0


def _bucket_problem(bucket) -> str | None:
    """What keeps a tune bucket of a results file from being imported (None: nothing): every field
    ``import_results`` reads, with its type."""
    if not isinstance(bucket, dict):
        return f"is a {type(bucket).__name__}, not an object"
    missing = [key for key in ("target", "workload", "points") if key not in bucket]
    if missing:
        return f"lacks {', '.join(repr(key) for key in missing)}"
    try:
        tvm.target.Target(bucket["target"])
        Workload.from_key(bucket["workload"])
    except Exception as err:  # noqa: BLE001 -- TVM's target errors are of many kinds
        return f"has no valid target and workload key ({type(err).__name__}: {str(err).splitlines()[0][:200]})"
    points = bucket["points"]
    if not isinstance(points, list) or not points:
        return "has no list of measured points"
    for n, point in enumerate(points):
        if not (isinstance(point, dict) and isinstance(point.get("function"), str)
                and isinstance(point.get("knobs"), dict) and isinstance(point.get("hand_picked"), bool)
                and isinstance(point.get("status"), str)):
            return f"point {n} is not {{function: str, knobs: object, hand_picked: bool, status: str, seconds}}"
        if point["status"] == "pass" and not _is_number(point.get("seconds")):
            return f"point {n} passed without a positive time in seconds"
    verified = bucket.get("verified") or {}
    if not isinstance(verified, dict):
        return "has a verification that is not an object"
    if verified.get("status") == "pass":
        functions = {point["function"] for point in points}
        times = verified.get("seconds")
        if not (isinstance(times, dict) and all(function in functions and isinstance(t, list) and t
                                                and all(_is_number(x) for x in t) for function, t in times.items())):
            return "has a verification whose seconds are not {point function: [positive seconds]}"
    return None


def _point(mod: tvm.IRModule, knobs: dict, **verification) -> "tvm.s_tir.Schedule":
    """The schedule of a measured knob point; ValueError where this tvm_fuel's knob space no longer
    holds it (the record would describe other knobs than were measured)."""
    sch = fixed_point(mod, knobs, **verification)
    if any(value != knobs.get(name) for name, value in knobs_of(sch.mod)[1].items()):
        raise ValueError(f"tvm_fuel tune --import: knobs {knobs} are not in this tvm_fuel's space of the kernel "
                         "(the bundle was built by another version); rebuild the bundle and measure again")
    return sch


def _already_imported(database, mod: tvm.IRModule, points: list[dict]) -> bool:
    """Whether the database holds these measurements already (the same knobs with the very same times)."""
    if not database.has_workload(mod):
        return False
    records = (replay(raw) for raw in database.get_top_k(database.commit_workload(mod), 10**6))
    held = {(tuple(sorted(r.knobs.items())), r.seconds) for r in records if r is not None}
    measured = [p for p in points if p["status"] == "pass"]
    return bool(measured) and all((tuple(sorted(_point_knobs(mod, p["knobs"]).items())), p["seconds"]) in held
                                  for p in measured)


def _point_knobs(mod: tvm.IRModule, knobs: dict) -> dict:
    """The knobs a record of this point holds (those of the tuning space)."""
    return knobs_of(fixed_point(mod, knobs).mod)[1]


def import_results(path: str | Path, work_dir: str | Path | None = None, *, log=print) -> list[dict]:
    """Records from the tune stage of a bundle's results file into ``work_dir`` (default: tune's,
    ``default_work_dir()``); returns per bucket the workload, the hand-picked and best verified
    median seconds, and the best knobs."""
    work_dir = default_work_dir() if work_dir is None else work_dir
    report, buckets = _load(Path(path))
    session = int(time.time())  # this import's verification: newer than every earlier one here
    summary = []
    for bucket in buckets:
        target = tvm.target.Target(bucket["target"])
        workload = Workload.from_key(bucket["workload"])
        mod = workload_module(workload, target)
        folder = Path(work_dir) / target_key(target) / kernel_family(workload.op)
        folder.mkdir(parents=True, exist_ok=True)
        database = LogDatabase(folder)  # as tune's: a torn line of an earlier run costs that line only
        if _already_imported(database, mod, bucket["points"]):
            raise ValueError(f"tvm_fuel tune --import: the measurements of {workload.describe()} in {path} are "
                             f"already in {folder}")
        knobs_of_function = {p["function"]: p["knobs"] for p in bucket["points"]}
        for point in bucket["points"]:
            seconds = [point["seconds"]] if point["status"] == "pass" else None
            commit_record(database, mod, _point(mod, point["knobs"]), seconds, target)
        verified = bucket.get("verified") or {}
        rows = {}
        if verified.get("status") == "pass":
            for function, seconds in verified["seconds"].items():
                sch = _point(mod, knobs_of_function[function], verification=session)
                commit_record(database, mod, sch, seconds, target)
                rows[function] = statistics.median(seconds)
        hand = next((p["function"] for p in bucket["points"] if p["hand_picked"]), None)
        best = min(rows, key=rows.get) if rows else None
        row = {"workload": workload.describe(), "folder": str(folder), "points": len(bucket["points"]),
               "hand_picked_s": rows.get(hand), "best_s": rows.get(best), "best_knobs": knobs_of_function.get(best)}
        summary.append(row)
        speedup = f"{row['hand_picked_s'] / row['best_s']:.2f}x" if rows.get(hand) and rows.get(best) else "-"
        log(f"{row['workload']}: {row['points']} points; verified side by side: hand-picked "
            f"{(row['hand_picked_s'] or 0) * 1e3:.3f} ms, best {(row['best_s'] or 0) * 1e3:.3f} ms ({speedup}), "
            f"knobs {row['best_knobs']}")
    return summary
