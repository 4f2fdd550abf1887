"""TVM's CPU thread pool as tvm_fuel sets it up: every physical core unless the user chose,
and the caller's CPU affinity left whole (a PyTorch pool created afterwards gets every core)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from tvm_fuel import threads

PROBE = """
import json, os
import numpy as np
import tvm_fuel, tvm
from tvm.script import tirx as T

@T.prim_func
def double(a: T.Buffer((64,), "float32"), b: T.Buffer((64,), "float32")):
    for i in T.parallel(64):
        b[i] = a[i] * T.float32(2)

lib = tvm.compile(double, target=tvm_fuel.host_target())
a = tvm.runtime.tensor(np.arange(64, dtype="float32"))
b = tvm.runtime.tensor(np.zeros(64, "float32"))
lib(a, b)  # a parallel launch: the pool starts here
assert (b.numpy() == 2 * np.arange(64)).all()
print(json.dumps({"threads": tvm.runtime.num_threads(), "affinity": sorted(os.sched_getaffinity(0)),
                  "target_cores": int(tvm_fuel.host_target().attrs["num-cores"])}))
"""


def _probe(tmp_path, **env) -> dict:
    script = tmp_path / "probe.py"  # TVMScript reads its source from a file
    script.write_text(PROBE)
    clean = {k: v for k, v in os.environ.items() if k not in (*threads.USER_VARIABLES, "TVM_BIND_THREADS")}
    done = subprocess.run([sys.executable, str(script)], env={**clean, **env}, capture_output=True, text=True,
                          timeout=300, check=False)
    assert done.returncode == 0, done.stderr[-2000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.mark.skipif(not hasattr(os, "sched_getaffinity"), reason="needs Linux CPU affinity")
def test_the_pool_uses_every_physical_core_and_leaves_affinity_whole(tmp_path):
    before = sorted(os.sched_getaffinity(0))
    found = _probe(tmp_path)
    assert found["threads"] == threads.physical_cores() == found["target_cores"]
    assert found["affinity"] == before  # not pinned to CPU 0 by the first parallel launch


@pytest.mark.parametrize("name", threads.USER_VARIABLES)
def test_a_users_thread_setting_wins(name, tmp_path):
    found = _probe(tmp_path, **{name: "1"})
    assert found["threads"] == 1 and found["target_cores"] == 1
    # TVM binds a one-thread pool's caller to CPU 0 unless binding is off (tvm_fuel turns it off)
    assert found["affinity"] == sorted(os.sched_getaffinity(0))


def test_configure_only_fills_what_the_user_left_unset():
    env = {"OMP_NUM_THREADS": "3", "TVM_BIND_THREADS": "1"}
    assert threads.configure(env) == {} and env == {"OMP_NUM_THREADS": "3", "TVM_BIND_THREADS": "1"}
    assert threads.thread_count(env) == 3
    env = {}
    chosen = threads.configure(env)
    assert chosen == {"TVM_NUM_THREADS": str(threads.physical_cores()), "TVM_BIND_THREADS": "0"} == env
