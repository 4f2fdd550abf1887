"""Worker processes that run a bundle's cases, replaced when one dies, hangs or meets a GPU error.

A worker (``python -m fuel_node.worker BUNDLE``) reads its cases as JSON on stdin and reports
on a pipe of its own (file descriptor ``FUEL_PROTOCOL_FD``), one JSON message per line:
``{"device": ...}`` once started (or ``{"fatal": reason}``), then ``{"start": i}`` and
``{"result": ...}`` per case. Its stdout and stderr (TVM's and CUDA's own prints) go elsewhere
and only their last lines are kept, to explain a crash. Every case gets a result: a case whose
worker dies is ``crashed``, one that takes longer than the timeout is ``timeout``, and the
remaining cases go to a fresh worker.

Contents:
    Workers -- run(cases, report) -> results, one per case
"""

from __future__ import annotations

import json
import os
import queue
import signal
import subprocess
import sys
import threading
from collections import deque
from pathlib import Path

from .environment import PROTOCOL_FD, NodeError

STARTUP_SECONDS = 300  # loading TVM, PyTorch and the CUDA context once


class Workers:
    """Runs cases in worker processes; ``device`` is what the last worker reported about the device."""

    def __init__(self, bundle: Path, env: dict, timeout: float):
        self.bundle, self.env, self.timeout = bundle, env, timeout
        self.device: dict | None = None

    def run(self, cases: list[dict], report=lambda case, result: None) -> list[dict]:
        results: list[dict | None] = [None] * len(cases)
        while any(r is None for r in results):
            self._batch(cases, [i for i, r in enumerate(results) if r is None], results, report)
        return results

    def _batch(self, cases, batch, results, report) -> None:
        read, write = os.pipe()
        env = {**self.env, PROTOCOL_FD: str(write)}
        process = subprocess.Popen([sys.executable, "-m", "fuel_node.worker", str(self.bundle)], cwd=self.bundle,
                                   env=env, pass_fds=(write,), stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                   stderr=subprocess.STDOUT, text=True, start_new_session=True)
        os.close(write)
        messages: queue.Queue = queue.Queue()
        tail: deque = deque(maxlen=15)
        threading.Thread(target=_pump, args=(os.fdopen(read), messages.put), daemon=True).start()
        threading.Thread(target=_pump, args=(process.stdout, lambda line: line and tail.append(line.rstrip())),
                         daemon=True).start()
        try:
            process.stdin.write(json.dumps([cases[i] for i in batch]))
            process.stdin.close()
            self._follow(process, messages, tail, cases, batch, results, report)
        finally:
            _kill(process)

    def _follow(self, process, messages, tail, cases, batch, results, report) -> None:
        current, started = None, False
        while True:
            try:
                line = messages.get(timeout=self.timeout if started else STARTUP_SECONDS)
            except queue.Empty:
                if not started:
                    raise NodeError(f"the worker did not start within {STARTUP_SECONDS} s: {_lines(tail)}") from None
                if current is not None and results[batch[current]] is None:
                    self._lost(cases, batch[current], results, report, "timeout",
                               f"no answer within {self.timeout:.0f} s", tail)
                return  # a worker that hangs after its last result only loses its process
            if line is None:  # the worker ended
                code = process.wait()
                if not started:
                    raise NodeError(f"the worker ended before it started ({_exit(code)}): {_lines(tail)}")
                if current is not None and results[batch[current]] is None:
                    self._lost(cases, batch[current], results, report, "crashed", f"the worker died ({_exit(code)})",
                               tail)
                return
            message = json.loads(line)
            if "fatal" in message:
                raise NodeError(message["fatal"])
            if "device" in message:
                self.device, started = message["device"], True
            elif "start" in message:
                current = message["start"]
                tail.clear()
            elif "result" in message:
                results[batch[current]] = message["result"]
                report(cases[batch[current]], message["result"])

    @staticmethod
    def _lost(cases, index, results, report, status, why, tail) -> None:
        results[index] = {"status": status, "error": f"{why}: {_lines(tail)}" if tail else why}
        report(cases[index], results[index])


def _pump(stream, put) -> None:
    for line in stream:
        put(line)
    put(None)


def _lines(tail) -> str:
    return " | ".join(tail)[-1500:] or "(no output)"


def _kill(process: subprocess.Popen) -> None:
    if process.poll() is None:
        try:
            os.killpg(process.pid, signal.SIGKILL)
        except OSError:
            pass
    process.wait()


def _exit(code: int) -> str:
    return f"signal {signal.Signals(-code).name}" if code < 0 else f"exit {code}"
