"""The suite's ``xdist_group`` marks hold: with ``-n 2`` (the README's test command) a group's tests
run on one worker, so a module's costly module-scoped fixtures (bundles, tuned models, TVM's KV-cache
slots) are built once. pytest 9 with pytest-xdist 3.8 silently breaks this (each worker builds them):
the test extra pins pytest below 9, and this test fails if the pin is lost or a new pair breaks it."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

pytestmark = pytest.mark.unit

GROUPED = """
import os, pytest
pytestmark = pytest.mark.xdist_group("one")

@pytest.mark.parametrize("i", range(6))
def test_grouped(i):
    with open(os.environ["WORKERS_SEEN"], "a") as f:
        f.write(os.environ["PYTEST_XDIST_WORKER"] + "\\n")
"""


def test_a_group_runs_on_one_worker(tmp_path):
    (tmp_path / "test_grouped.py").write_text(GROUPED)
    (tmp_path / "pytest.ini").write_text("[pytest]\n")  # none of this repository's options
    seen = tmp_path / "workers.txt"
    command = [sys.executable, "-m", "pytest", "-n", "2", "--dist", "loadgroup", "-q", "-p", "no:cacheprovider"]
    run = subprocess.run(command + [str(tmp_path)], cwd=tmp_path, capture_output=True, text=True, timeout=300,
                         env={**os.environ, "WORKERS_SEEN": str(seen)})
    assert run.returncode == 0, run.stdout + run.stderr
    workers = seen.read_text().split()
    assert len(workers) == 6 and len(set(workers)) == 1, f"the group ran on {sorted(set(workers))}"
