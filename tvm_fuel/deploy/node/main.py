"""``python DIR/run.py``: run a tvm_fuel bundle's stages on this node and write the results.

Needs Python, numpy and (for a CUDA bundle) the NVIDIA driver only; PyTorch is used when present.
Stages, in order: ``smoke`` (one tiny kernel per op; a bundle whose smoke stage fails stops
there), ``check`` (every kernel against the float64 reference, the floor and PyTorch),
``bench`` (kernels, floor and PyTorch timed on the benchmark shapes), ``tune`` (every knob point
of the CUDA kernel spaces timed, then the best few and the hand-picked knobs re-measured side by
side; ``python -m tvm_fuel tune --import results.json`` turns them into tuning records).

Cases run in worker processes (``worker``, ``supervisor``); a worker that crashes, hangs past
``--case-timeout`` or meets an error on the GPU is replaced and the rest go on, so every case
gets a result.
Results of a bundle accumulate in one file (a stage run again replaces its earlier results); a
results file of another bundle, or one this run could not extend, is refused before anything
runs. Exit status: 0 when every smoke, check and bench case passed and every hand-picked tune
point ran; 1 otherwise; 2, with one line saying why, when the bundle cannot run here, its
manifest is missing or not of its schema, or the arguments would run no case.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from pathlib import Path

from .environment import NodeError, worker_environment
from .manifest import STAGES, read_manifest
from .supervisor import Workers


def _summary(result: dict) -> str:
    if result["status"] in ("error", "crashed", "timeout"):
        return " ".join(result.get("error", "").split())[:300]
    parts = []
    checks = result.get("checks", [])
    failed = [c for c in checks if not c["ok"]]
    for check in failed:
        parts.append(f"{check['what']}: {check['why']}")
    if checks and not failed:
        parts.append(f"{len(checks)} comparisons, worst {max(c['max_excess'] for c in checks):.2f}x tolerance")
    timings = result.get("timings", {})
    if "tuned" in timings:
        tuned = timings["tuned"]
        parts.append(f"{tuned['ms']:.3f} ms {tuned['tflops']:.1f} TFLOP/s")
        if "gbps" in tuned:
            parts.append(f"{tuned['gbps']:.0f} GB/s")
        for peer in ("floor", "torch", "tvm"):
            if peer in timings:
                parts.append(f"{peer}/tuned {timings[peer]['ms'] / tuned['ms']:.2f}x")
    if "seconds" in result and isinstance(result["seconds"], float):
        parts.append(f"{result['seconds'] * 1e3:.3f} ms")
    parts += result.get("skipped", [])
    return " ".join("; ".join(parts).split())


def _tune_buckets(manifest: dict, points: list[dict], results: list[dict]) -> list[dict]:
    buckets = []
    for bucket in manifest["tune_buckets"]:
        rows = [{"function": case["function"], "knobs": case["knobs"], "hand_picked": case["hand_picked"],
                 "status": result["status"], "seconds": result.get("seconds"), "error": result.get("error")}
                for case, result in zip(points, results) if case["bucket"] == bucket["id"]]
        buckets.append({**bucket, "points": rows})
    return buckets


def _verify_cases(buckets: list[dict], top: int, rounds: int) -> list[dict]:
    cases = []
    for bucket in buckets:
        ran = sorted((p for p in bucket["points"] if p["status"] == "pass"), key=lambda p: p["seconds"])
        chosen = [p for p in ran if p["hand_picked"]] + [p for p in ran if not p["hand_picked"]][:top]
        if len(chosen) > 1:
            cases.append({"kind": "verify", "name": f"tune/verify/{bucket['id']}", "module": bucket["module"],
                          "functions": [p["function"] for p in chosen], "inputs": bucket["inputs"],
                          "seed": bucket["seed"], "rounds": rounds, "bucket": bucket["id"]})
    return cases


def _previous(out: Path, manifest: dict) -> dict | None:
    """The results this bundle already wrote to ``out`` (None for a new file); NodeError for a
    file that is not this bundle's or a folder that cannot take it."""
    if not out.exists():
        if not out.parent.is_dir():
            raise NodeError(f"--out {out}: folder {out.parent} does not exist")
        try:
            out.write_text("{}")  # can be written: found out now, not after a stage's GPU time
            out.unlink()
        except OSError as err:
            raise NodeError(f"--out {out}: cannot write it ({err.strerror})") from err
        return None
    try:
        previous = json.loads(out.read_text())
    except (OSError, json.JSONDecodeError) as err:
        raise NodeError(f"--out {out} exists and is not a results file of a bundle ({err}); choose another --out") \
            from err
    if not isinstance(previous, dict) or previous.get("bundle_id") != manifest["bundle_id"]:
        other = previous.get("bundle_id") if isinstance(previous, dict) else None
        raise NodeError(f"{out} holds the results of bundle {other}, not of this bundle {manifest['bundle_id']}: "
                        "choose another --out")
    problem = _results_problem(previous)
    if problem:  # found now: after a stage has run, its results would be lost with the crash
        raise NodeError(f"--out {out} is a results file of this bundle, but {problem}; repair it or choose "
                        "another --out")
    return previous


def _results_problem(report: dict) -> str | None:
    """What in an earlier results file the run cannot extend (None when nothing): the fields that
    ``_run`` and ``_ok`` read of every stage it holds."""
    stages = report.get("stages")
    if not isinstance(stages, dict):
        return "it has no 'stages' object"
    if not isinstance(report.get("bundle"), dict):
        return "it has no 'bundle' object"
    for name, stage in stages.items():
        where = f"stages.{name}"
        if name not in STAGES:
            return f"{where} is not a stage of {list(STAGES)}"
        if not isinstance(stage, dict) or not isinstance(stage.get("cases"), list) \
                or type(stage.get("not_passed")) is not int:
            return f"{where} lacks its cases list or not_passed count"
        if not all(isinstance(c, dict) and isinstance(c.get("status"), str) for c in stage["cases"]):
            return f"{where}.cases holds an entry without a status"
        if name == "tune":
            buckets = stage.get("buckets", [])
            if not isinstance(buckets, list) or not all(
                    isinstance(b, dict) and isinstance(b.get("points"), list)
                    and all(isinstance(p, dict) and isinstance(p.get("status"), str) and "hand_picked" in p
                            for p in b["points"]) for b in buckets):
                return f"{where}.buckets holds a bucket whose points lack status or hand_picked"
    return None


def _write(out: Path, report: dict) -> None:
    temporary = out.with_name(out.name + ".tmp")
    temporary.write_text(json.dumps(report, indent=1))
    os.replace(temporary, out)  # a run killed mid-write leaves the previous file whole


class _Parser(argparse.ArgumentParser):
    """argparse whose errors are one line (``run.py: error: argument ...``), exit status 2."""

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {' '.join(message.split())}\n")


def _number(kind, low: float, what: str):
    """An argparse type: a finite ``kind`` of at least (``kind`` float: more than) ``low``."""

    def parse(text: str):
        try:
            value = kind(text)
        except ValueError:
            value = None
        if value is None or not math.isfinite(value) or value < low or (kind is float and value == low):
            raise argparse.ArgumentTypeError(f"expected {what}, got {text!r}")
        return value

    return parse


def _stages(parser: _Parser, text: str, held: list[str]) -> list[str]:
    """The stages ``--stages`` names, each once; at least one, every one held by the bundle."""
    stages = [s.strip() for s in text.split(",") if s.strip()]
    if not stages:
        parser.error(f"argument --stages: {text!r} names no stage (this bundle holds {','.join(held)})")
    unknown = [s for s in stages if s not in held]
    if unknown:
        parser.error(f"argument --stages: {','.join(unknown)} not in this bundle (it holds {','.join(held)})")
    if len(set(stages)) < len(stages):
        parser.error(f"argument --stages: {text!r} names a stage twice")
    return stages


def main(argv: list[str] | None = None) -> int:
    bundle = Path(__file__).resolve().parent.parent
    try:
        manifest = read_manifest(bundle)
    except NodeError as err:
        print(f"run.py: cannot run this bundle here: {err}", file=sys.stderr)
        return 2
    held = [s for s in STAGES if any(c["stage"] == s for c in manifest["cases"])]
    parser = _Parser(prog="run.py", description=__doc__.split("\n")[0])
    parser.add_argument("--stages", default=",".join(held), help=f"comma-separated, of {held} (default: all)")
    parser.add_argument("--out", default="results.json", help="results file (default results.json)")
    parser.add_argument("--only", default="", help="run only the cases whose name contains this")
    parser.add_argument("--case-timeout", type=_number(float, 0, "seconds > 0"), default=180.0,
                        help="seconds one case may take")
    parser.add_argument("--verify-top", type=_number(int, 0, "an integer >= 0"), default=3,
                        help="tune: best points re-measured side by side")
    parser.add_argument("--verify-rounds", type=_number(int, 1, "an integer >= 1"), default=5)
    args = parser.parse_args(argv)
    stages = _stages(parser, args.stages, held)
    selected = {stage: [c for c in manifest["cases"] if c["stage"] == stage and args.only in c["name"]]
                for stage in stages}
    if not any(selected.values()):  # nothing would run: not a pass
        parser.error(f"argument --only: {args.only!r} matches no case of the stages {','.join(stages)}")
    try:
        try:
            import numpy  # noqa: F401
        except ImportError:
            raise NodeError("numpy is not installed for this Python") from None
        out = Path(args.out)
        previous = _previous(out, manifest)
        workers = Workers(bundle, worker_environment(bundle, manifest), args.case_timeout)
        return _run(manifest, workers, selected, out, previous, args)
    except NodeError as err:
        print(f"run.py: cannot run this bundle here: {err}", file=sys.stderr)
        return 2


def _reporter(start: float, label: str, total: int):
    done = [0]

    def show(case, result):
        done[0] += 1
        print(f"[{time.perf_counter() - start:7.1f}s] {label} {done[0]}/{total} {case['name']}: "
              f"{result['status']}  {_summary(result)}", flush=True)

    return show


def _run(manifest, workers: Workers, selected: dict[str, list[dict]], out: Path, previous, args) -> int:
    start = time.perf_counter()
    report = previous or {"bundle_id": manifest["bundle_id"], "bundle": manifest["bundle"], "stages": {}}
    print(f"bundle {manifest['bundle_id']}: {manifest['bundle']['target']} {manifest['bundle'].get('arch') or ''}, "
          f"stages {list(selected)}", flush=True)
    for stage, cases in selected.items():
        if not cases:  # --only leaves none of this stage: it did not run, so it neither passes nor fails
            print(f"{stage}: no case matches --only {args.only!r}; not run", flush=True)
            continue
        stage_start = time.perf_counter()
        results = workers.run(cases, _reporter(start, stage, len(cases)))
        if workers.device and "device" not in report:
            report["device"] = workers.device
            print(f"device: {workers.device}", flush=True)
        entry = {"seconds": time.perf_counter() - stage_start,
                 "cases": [{"name": c["name"], **r} for c, r in zip(cases, results)]}
        if stage == "tune":
            entry["buckets"] = _tune_buckets(manifest, cases, results)
            verify = _verify_cases(entry["buckets"], args.verify_top, args.verify_rounds)
            for case, result in zip(verify, workers.run(verify, _reporter(start, "tune-verify", len(verify)))):
                bucket = next(b for b in entry["buckets"] if b["id"] == case["bucket"])
                bucket["verified"] = {"rounds": case["rounds"], "status": result["status"],
                                      "seconds": result.get("seconds"), "error": result.get("error")}
        passed = sum(r["status"] == "pass" for r in results)
        entry.update(passed=passed, not_passed=len(results) - passed)
        report["stages"][stage] = entry
        print(f"{stage}: {passed}/{len(results)} passed in {entry['seconds']:.0f} s", flush=True)
        _write(out, report)
        if stage == "smoke" and passed < len(results):
            print("smoke stage failed: the later stages are skipped", flush=True)
            break
    report["ok"] = _ok(report)
    _write(out, report)
    print(f"wrote {out}; {'every check passed' if report['ok'] else 'NOT every check passed'}", flush=True)
    return 0 if report["ok"] else 1


def _ok(report: dict) -> bool:
    for name, stage in report["stages"].items():
        if name == "tune":
            if any(p["hand_picked"] and p["status"] != "pass" for b in stage.get("buckets", []) for p in b["points"]):
                return False
        elif name == "bench":  # timings without any comparison are still timings
            if any(c["status"] not in ("pass", "unchecked") for c in stage["cases"]):
                return False
        elif stage["not_passed"]:
            return False
    return True
