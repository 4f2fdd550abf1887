"""Where the suite's time goes: each test's seconds in ``tvm.compile`` and in creating its Relax
VMs (where LLVM JIT-compiles the kernels), written by ``pytest --compile-report FILE`` (one JSON
line per call, to ``FILE.<worker>``) and summed by ``python tests/compile_clock.py FILE.* [--junit
XML]`` (with pytest's ``--junitxml``: the share of the tests' time).

The clock wraps the cache (tests/compile_cache.py): a hit costs ~0 and is counted as such.
"""

from __future__ import annotations

import argparse
import collections
import functools
import json
import os
import time
import xml.etree.ElementTree as ElementTree


class CompileClock:
    """Installs timing wrappers around ``tvm.compile`` and ``relax.VirtualMachine.__init__``."""

    def __init__(self, path: str):
        self.path = path

    def _write(self, phase: str, seconds: float):
        test = os.environ.get("PYTEST_CURRENT_TEST", "").rsplit(" (", 1)[0]
        with open(self.path, "a") as out:
            out.write(json.dumps({"test": test, "phase": phase, "seconds": round(seconds, 4)}) + "\n")

    def _timed(self, phase: str, function):
        @functools.wraps(function)
        def timed(*args, **kwargs):
            start = time.perf_counter()
            try:
                return function(*args, **kwargs)
            finally:
                self._write(phase, time.perf_counter() - start)
        return timed

    def install(self):
        import tvm
        from tvm import relax

        tvm.compile = self._timed("compile", tvm.compile)
        relax.VirtualMachine.__init__ = self._timed("jit", relax.VirtualMachine.__init__)


def summary(paths: list[str], junit: str | None = None, top: int = 15) -> str:
    """Compile and JIT seconds by test module (and their share of the tests' time with ``junit``)."""
    by_module = collections.defaultdict(collections.Counter)
    for path in paths:
        with open(path) as lines:
            for line in lines:
                row = json.loads(line)
                by_module[row["test"].split("::")[0]][row["phase"]] += row["seconds"]
    spent = collections.Counter()
    if junit:
        for case in ElementTree.parse(junit).iter("testcase"):
            spent[case.get("classname").replace(".", "/") + ".py"] += float(case.get("time"))
    compile_s = sum(c["compile"] for c in by_module.values())
    jit_s = sum(c["jit"] for c in by_module.values())
    lines = [f"compile {compile_s / 60:.1f} min, VM creation (LLVM JIT) {jit_s / 60:.1f} min"
             + (f" of the tests' {sum(spent.values()) / 60:.1f} min" if spent else "")]
    ranked = sorted(by_module.items(), key=lambda item: -(item[1]["compile"] + item[1]["jit"]))
    for module, phases in ranked[:top]:
        share = f" of {spent[module]:.0f} s" if module in spent else ""
        lines.append(f"  {module}: compile {phases['compile']:.0f} s, jit {phases['jit']:.0f} s{share}")
    return "\n".join(lines)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("reports", nargs="+")
    parser.add_argument("--junit")
    args = parser.parse_args()
    print(summary(args.reports, args.junit))
