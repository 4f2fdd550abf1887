"""``python DIR/run.py``: run a tvm_fuel bundle's stages on this node and write the results.

Needs Python, numpy and (for a CUDA bundle) the NVIDIA driver only; PyTorch is used when present.
Stages, in order: ``smoke`` (one tiny kernel per op; a bundle whose smoke stage fails stops
there), ``check`` (every kernel against the float64 reference, the floor and PyTorch),
``bench`` (kernels, floor and PyTorch timed on the benchmark shapes), ``tune`` (every knob point
of the CUDA kernel spaces timed, then the best few and the hand-picked knobs re-measured side by
side; ``python -m tvm_fuel tune --import results.json`` turns them into tuning records).

Cases run in worker processes (``worker``); a worker that crashes, hangs past ``--case-timeout``
or meets an error on the GPU is replaced and the rest go on, so every case gets a result.
Results of a bundle accumulate in one file (a stage run again replaces its earlier results); a
results file of another bundle is refused. Exit status: 0 when every smoke, check and bench
case passed and every hand-picked tune point ran; 1 otherwise; 2 when the bundle cannot run here.
"""

from __future__ import annotations

import argparse
import json
import os
import queue
import signal
import subprocess
import sys
import threading
import time
from collections import deque
from pathlib import Path

from .environment import NodeError, worker_environment
from .worker import PREFIX

STAGES = ("smoke", "check", "bench", "tune")


class Workers:
    """Runs cases in worker processes, replacing a worker that dies, hangs or meets a GPU error."""

    def __init__(self, bundle: Path, env: dict, timeout: float):
        self.bundle, self.env, self.timeout = bundle, env, timeout
        self.device: dict | None = None

    def run(self, cases: list[dict], report=lambda case, result: None) -> list[dict]:
        results: list[dict | None] = [None] * len(cases)
        while any(r is None for r in results):
            batch = [i for i, r in enumerate(results) if r is None]
            self._batch(cases, batch, results, report)
        return results

    def _batch(self, cases, batch, results, report) -> None:
        process = subprocess.Popen([sys.executable, "-m", "fuel_node.worker", str(self.bundle)], cwd=self.bundle,
                                   env=self.env, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                   stderr=subprocess.STDOUT, text=True, start_new_session=True)
        lines: queue.Queue = queue.Queue()
        threading.Thread(target=_pump, args=(process.stdout, lines), daemon=True).start()
        process.stdin.write(json.dumps([cases[i] for i in batch]))
        process.stdin.close()
        tail: deque = deque(maxlen=15)
        current = None
        startup = max(self.timeout, 300)  # loading TVM (and CUDA) once
        while True:
            try:
                line = lines.get(timeout=self.timeout if current is not None else startup)
            except queue.Empty:
                _kill(process)
                why = f"no answer within {self.timeout:.0f} s" if current is not None else "the worker did not start"
                self._lost(batch, current, results, cases, report, "timeout", why, tail)
                return
            if line is None:  # the worker ended
                code = process.wait()
                if current is not None and results[batch[current]] is None:
                    why = f"the worker died ({_exit(code)})"
                    self._lost(batch, current, results, cases, report, "crashed", why, tail)
                elif current is None and results[batch[0]] is None:
                    raise NodeError(f"the worker ended before its first case ({_exit(code)}): {' | '.join(tail)}")
                return
            if not line.startswith(PREFIX):
                tail.append(line.rstrip())
                continue
            message = json.loads(line[len(PREFIX):])
            if "fatal" in message:
                _kill(process)
                raise NodeError(message["fatal"])
            if "device" in message:
                self.device = message["device"]
            elif "start" in message:
                current = message["start"]
                tail.clear()
            elif "result" in message:
                results[batch[current]] = message["result"]
                report(cases[batch[current]], message["result"])

    def _lost(self, batch, current, results, cases, report, status, why, tail) -> None:
        index = batch[current if current is not None else 0]
        output = " | ".join(tail)[-1500:]
        results[index] = {"status": status, "error": f"{why}{': ' + output if output else ''}"}
        report(cases[index], results[index])


def _pump(stream, lines: queue.Queue) -> None:
    for line in stream:
        lines.put(line)
    lines.put(None)


def _kill(process: subprocess.Popen) -> None:
    try:
        os.killpg(process.pid, signal.SIGKILL)
    except OSError:
        pass
    process.wait()


def _exit(code: int) -> str:
    return f"signal {signal.Signals(-code).name}" if code < 0 else f"exit {code}"


def _summary(result: dict) -> str:
    if result["status"] in ("error", "crashed", "timeout"):
        return result.get("error", "")[:300]
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
        for peer in ("floor", "torch"):
            if peer in timings:
                parts.append(f"{peer}/tuned {timings[peer]['ms'] / tuned['ms']:.2f}x")
    if "seconds" in result and isinstance(result["seconds"], float):
        parts.append(f"{result['seconds'] * 1e3:.3f} ms")
    parts += result.get("skipped", [])
    return "; ".join(parts)


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


def main(argv: list[str] | None = None) -> int:
    bundle = Path(__file__).resolve().parent.parent
    manifest = json.loads((bundle / "manifest.json").read_text())
    held = [s for s in STAGES if any(c["stage"] == s for c in manifest["cases"])]
    parser = argparse.ArgumentParser(prog="run.py", description=__doc__.split("\n")[0])
    parser.add_argument("--stages", default=",".join(held), help=f"comma-separated, of {held} (default: all)")
    parser.add_argument("--out", default="results.json", help="results file (default results.json)")
    parser.add_argument("--only", default="", help="run only the cases whose name contains this")
    parser.add_argument("--case-timeout", type=float, default=180.0, help="seconds one case may take")
    parser.add_argument("--verify-top", type=int, default=3, help="tune: best points re-measured side by side")
    parser.add_argument("--verify-rounds", type=int, default=5)
    args = parser.parse_args(argv)
    stages = [s for s in args.stages.split(",") if s]
    unknown = [s for s in stages if s not in held]
    try:
        if unknown:
            raise NodeError(f"--stages {unknown}: this bundle holds {held}")
        out = Path(args.out)
        previous = json.loads(out.read_text()) if out.exists() else None
        if previous is not None and previous.get("bundle_id") != manifest["bundle_id"]:
            raise NodeError(f"{out} holds the results of bundle {previous.get('bundle_id')}, not of this bundle "
                            f"{manifest['bundle_id']}: choose another --out")
        workers = Workers(bundle, worker_environment(bundle, manifest), args.case_timeout)
        return _run(manifest, workers, stages, out, previous, args)
    except NodeError as err:
        print(f"run.py: cannot run this bundle here: {err}", file=sys.stderr)
        return 2


def _run(manifest, workers: Workers, stages, out: Path, previous, args) -> int:
    start = time.perf_counter()
    report = previous or {"bundle_id": manifest["bundle_id"], "bundle": manifest["bundle"], "stages": {}}
    print(f"bundle {manifest['bundle_id']}: {manifest['bundle']['target']} {manifest['bundle'].get('arch') or ''}, "
          f"stages {stages}", flush=True)
    for stage in stages:
        cases = [c for c in manifest["cases"] if c["stage"] == stage and args.only in c["name"]]
        done = [0]

        def show(case, result, stage=stage, total=len(cases)):
            done[0] += 1
            print(f"[{time.perf_counter() - start:7.1f}s] {stage} {done[0]}/{total} {case['name']}: "
                  f"{result['status']}  {_summary(result)}", flush=True)

        stage_start = time.perf_counter()
        results = workers.run(cases, show)
        if workers.device and "device" not in report:
            report["device"] = workers.device
            print(f"device: {workers.device}", flush=True)
        entry = {"seconds": time.perf_counter() - stage_start,
                 "cases": [{"name": c["name"], **r} for c, r in zip(cases, results)]}
        if stage == "tune":
            buckets = _tune_buckets(manifest, cases, results)
            verify = _verify_cases(buckets, args.verify_top, args.verify_rounds)
            session = int(time.time())
            for case, result in zip(verify, workers.run(verify, show)):
                bucket = next(b for b in buckets if b["id"] == case["bucket"])
                bucket["verified"] = {"id": session, "rounds": case["rounds"], "status": result["status"],
                                      "seconds": result.get("seconds"), "error": result.get("error")}
            entry["buckets"] = buckets
        passed = sum(r["status"] == "pass" for r in results)
        entry.update(passed=passed, not_passed=len(results) - passed)
        report["stages"][stage] = entry
        print(f"{stage}: {passed}/{len(results)} passed in {entry['seconds']:.0f} s", flush=True)
        out.write_text(json.dumps(report, indent=1))
        if stage == "smoke" and passed < len(results):
            print("smoke stage failed: the later stages are skipped", flush=True)
            break
    report["ok"] = _ok(report)
    out.write_text(json.dumps(report, indent=1))
    print(f"wrote {out}; {'every check passed' if report['ok'] else 'NOT every check passed'}", flush=True)
    return 0 if report["ok"] else 1


def _ok(report: dict) -> bool:
    for name, stage in report["stages"].items():
        if name != "tune" and stage["not_passed"]:
            return False
        if name == "tune" and any(p["hand_picked"] and p["status"] != "pass"
                                  for b in stage.get("buckets", []) for p in b["points"]):
            return False
    return True
