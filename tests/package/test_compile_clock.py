"""The suite's clock of compile and JIT time (tests/compile_clock.py)."""

import json
import subprocess
import sys

import pytest

from compile_clock import summary
from helpers import suite_conftest

pytestmark = pytest.mark.unit


def test_the_summary_sums_each_module_and_its_share(tmp_path):
    rows = [("tests/op/test_a.py::test_x[1]", "compile", 2.0), ("tests/op/test_a.py::test_x[2]", "jit", 1.0),
            ("tests/op/test_b.py::test_y", "compile", 0.5)]
    (tmp_path / "r.gw0").write_text("".join(json.dumps(dict(test=t, phase=p, seconds=s)) + "\n" for t, p, s in rows))
    (tmp_path / "j.xml").write_text('<testsuites><testsuite><testcase classname="tests.op.test_a" name="test_x[1]" '
                                    'time="4.0"/><testcase classname="tests.op.test_b" name="test_y" time="2.0"/>'
                                    "</testsuite></testsuites>")
    text = summary([str(tmp_path / "r.gw0")], str(tmp_path / "j.xml"))
    assert text.splitlines() == ["compile 0.0 min, VM creation (LLVM JIT) 0.0 min of the tests' 0.1 min",
                                 "  tests/op/test_a.py: compile 2 s, jit 1 s of 4 s",
                                 "  tests/op/test_b.py: compile 0 s, jit 0 s of 2 s"]


def test_a_run_with_the_report_writes_each_compile(tmp_path, pytestconfig):
    (tmp_path / "test_one.py").write_text(
        "import numpy as np, pytest, tvm\nfrom tvm import relax\npytestmark = pytest.mark.unit\n\n"
        "def test_build():\n    x = relax.Var('x', relax.TensorType((2,), 'float32'))\n"
        "    bb = relax.BlockBuilder()\n    with bb.function('main', [x]):\n        bb.emit_func_output(x)\n"
        "    relax.VirtualMachine(tvm.compile(bb.get(), 'llvm'), tvm.cpu())\n")
    suite_conftest(tmp_path)
    run = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--compile-report",
                          str(tmp_path / "report"), "."], cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stdout + run.stderr
    (report,) = tmp_path.glob("report.*")  # report.main, or report.gw0 where this suite's xdist worker is inherited
    phases = [json.loads(line)["phase"] for line in report.read_text().splitlines()]
    assert phases == ["compile", "jit"]
