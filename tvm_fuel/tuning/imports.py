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
from pathlib import Path

import tvm
from tvm.s_tir import meta_schedule as ms

from ..schedules.workload import Workload
from .records import RECORD_FILE, WORKLOAD_FILE, kernel_family, replay, target_key
from .space import fixed_point, workload_module
from .tune import commit_record


def _load(path: Path) -> tuple[dict, list[dict]]:
    try:
        report = json.loads(Path(path).read_text())
    except (OSError, json.JSONDecodeError) as err:
        raise ValueError(f"tvm_fuel tune --import: cannot read {path}: {err}") from err
    if not isinstance(report, dict) or "bundle_id" not in report or "stages" not in report:
        raise ValueError(f"tvm_fuel tune --import: {path} is not the results file of a tvm_fuel bundle (run.py --out)")
    buckets = report["stages"].get("tune", {}).get("buckets")
    if not buckets:
        raise ValueError(f"tvm_fuel tune --import: {path} holds no tune stage (run.py --stages tune)")
    built_for, measured_on = report["bundle"].get("arch"), (report.get("device") or {}).get("arch")
    if built_for != measured_on:
        raise ValueError(f"tvm_fuel tune --import: bundle {report['bundle_id']} was built for {built_for} but "
                         f"measured on {measured_on}")
    return report, buckets


def _imported(database, mod: tvm.IRModule, session: int) -> bool:
    if not database.has_workload(mod):
        return False
    records = (replay(raw) for raw in database.get_top_k(database.commit_workload(mod), 10**6))
    return any(record is not None and record.verified == session for record in records)


def import_results(path: str | Path, work_dir: str | Path = "tuning_logs", *, log=print) -> list[dict]:
    """Records from the tune stage of a bundle's results file; returns per bucket the workload,
    the hand-picked and best verified median seconds, and the best knobs."""
    report, buckets = _load(Path(path))
    summary = []
    for bucket in buckets:
        target = tvm.target.Target(bucket["target"])
        workload = Workload.from_key(bucket["workload"])
        mod = workload_module(workload, target)
        folder = Path(work_dir) / target_key(target) / kernel_family(workload.op)
        folder.mkdir(parents=True, exist_ok=True)
        database = ms.database.JSONDatabase(path_workload=str(folder / WORKLOAD_FILE),
                                            path_tuning_record=str(folder / RECORD_FILE))
        verified = bucket.get("verified") or {}
        session = int(verified.get("id", 0))
        if session and _imported(database, mod, session):
            raise ValueError(f"tvm_fuel tune --import: the results of run {session} are already in {folder}")
        knobs_of = {p["function"]: p["knobs"] for p in bucket["points"]}
        for point in bucket["points"]:
            seconds = [point["seconds"]] if point["status"] == "pass" else None
            commit_record(database, mod, fixed_point(mod, point["knobs"]), seconds, target)
        rows = {}
        if verified.get("status") == "pass":
            for function, seconds in verified["seconds"].items():
                commit_record(database, mod, fixed_point(mod, knobs_of[function], verification=session), seconds,
                              target)
                rows[function] = statistics.median(seconds)
        hand = next((p["function"] for p in bucket["points"] if p["hand_picked"]), None)
        best = min(rows, key=rows.get) if rows else None
        row = {"workload": workload.describe(), "folder": str(folder), "points": len(bucket["points"]),
               "hand_picked_s": rows.get(hand), "best_s": rows.get(best), "best_knobs": knobs_of.get(best)}
        summary.append(row)
        speedup = f"{row['hand_picked_s'] / row['best_s']:.2f}x" if rows.get(hand) and rows.get(best) else "-"
        log(f"{row['workload']}: {row['points']} points; verified side by side: hand-picked "
            f"{(row['hand_picked_s'] or 0) * 1e3:.3f} ms, best {(row['best_s'] or 0) * 1e3:.3f} ms ({speedup}), "
            f"knobs {row['best_knobs']}")
    return summary
