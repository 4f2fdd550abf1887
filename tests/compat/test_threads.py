"""TVM's CPU thread pool as tvm_fuel sets it up (``tvm_fuel.compat.threads``): every physical core
unless the user chose, and the caller's CPU affinity left whole (a PyTorch pool created afterwards
gets every core)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from tvm_fuel.compat import threads

# each probe builds and runs kernels in a fresh process (~4 s: importing tvm_fuel, TVM and PyTorch)
pytestmark = pytest.mark.integration

PROBE = """
import json, os, warnings
import numpy as np
warnings.simplefilter("always")  # each warning tvm_fuel gives is seen (and counted), not deduplicated
import tvm_fuel, tvm
from tvm_fuel.compat import threads
from tvm.script import tirx as T

@T.prim_func
def double(a: T.Buffer((64,), "float32"), b: T.Buffer((64,), "float32")):
    for i in T.parallel(64):
        b[i] = a[i] * T.float32(2)

@T.prim_func
def who(ids: T.Buffer((256,), "uint64")):
    for i in T.parallel(256):  # one chunk per task, each run by one thread of the pool
        ids[i] = T.call_extern("uint64", "pthread_self")

lib = tvm.compile(double, target=tvm_fuel.host_target())
a = tvm.runtime.tensor(np.arange(64, dtype="float32"))
b = tvm.runtime.tensor(np.zeros(64, "float32"))
lib(a, b)  # a parallel launch: the pool starts here
assert (b.numpy() == 2 * np.arange(64)).all()
ids = tvm.runtime.tensor(np.zeros(256, "uint64"))
tvm.compile(who, target="llvm")(ids)
print(json.dumps({"threads": tvm.runtime.num_threads(), "ran_on": len(set(ids.numpy().tolist())),
                  "count": threads.thread_count(), "affinity": sorted(os.sched_getaffinity(0)),
                  "target_cores": int(tvm_fuel.host_target().attrs["num-cores"])}))
"""


def _probe(tmp_path, **env) -> dict:
    """The probe's findings in a fresh process under ``env``, and ``warnings``: tvm_fuel's warning lines."""
    script = tmp_path / "probe.py"  # TVMScript reads its source from a file
    script.write_text(PROBE)
    clean = {k: v for k, v in os.environ.items() if k not in (*threads.USER_VARIABLES, "TVM_BIND_THREADS")}
    done = subprocess.run([sys.executable, str(script)], env={**clean, **env}, capture_output=True, text=True,
                          timeout=300, check=False)
    assert done.returncode == 0, done.stderr[-2000:]
    found = json.loads(done.stdout.strip().splitlines()[-1])
    found["warnings"] = [line for line in done.stderr.splitlines() if "RuntimeWarning: tvm_fuel:" in line]
    return found


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
    env = {"OMP_NUM_THREADS": "1", "TVM_BIND_THREADS": "1"}
    assert threads.configure(env) == {} and env == {"OMP_NUM_THREADS": "1", "TVM_BIND_THREADS": "1"}
    assert threads.thread_count(env) == 1
    env = {}
    chosen = threads.configure(env)
    assert chosen == {"TVM_NUM_THREADS": str(threads.physical_cores()), "TVM_BIND_THREADS": "0"} == env


# (environment, the threads TVM's pool runs, whether tvm_fuel warns): what TVM 0.27's runtime does
# with each (threading_backend.cc: TVM_NUM_THREADS if set, even empty, else OMP_NUM_THREADS, read
# with atoi, at least 1, at most the CPUs at the top frequency)
_ONE = {"warns": True, "threads": 1}
SETTINGS = [
    ({"TVM_NUM_THREADS": "0"}, _ONE),
    ({"TVM_NUM_THREADS": "-1"}, _ONE),
    ({"TVM_NUM_THREADS": "abc"}, _ONE),
    ({"TVM_NUM_THREADS": "abc", "OMP_NUM_THREADS": "2"}, _ONE),  # the set TVM_NUM_THREADS hides OMP's
    ({"TVM_NUM_THREADS": "", "OMP_NUM_THREADS": "2"}, _ONE),  # set but empty: hides it too
    ({"OMP_NUM_THREADS": "abc"}, _ONE),
    ({"TVM_NUM_THREADS": "1e3"}, _ONE),  # atoi: 1
    ({"TVM_NUM_THREADS": ""}, {"warns": False, "threads": None}),  # as unset: tvm_fuel's default
    ({"TVM_NUM_THREADS": str((os.cpu_count() or 1) + 3)}, {"warns": True, "threads": None}),  # more than run
]


@pytest.mark.parametrize("env,expected", SETTINGS, ids=[" ".join(f"{k}={v!r}" for k, v in env.items())
                                                        for env, _ in SETTINGS])
def test_every_thread_count_agrees_with_the_pool(env, expected, tmp_path):
    """Issue 29, item 12: under settings TVM does not run as written, thread_count(), host_target()
    and the threads a parallel launch runs on agree with TVM's pool (were: 2 counted, 1 run), and
    tvm_fuel warns once."""
    found = _probe(tmp_path, **env)
    assert found["count"] == found["target_cores"] == found["threads"] == found["ran_on"], found
    if expected["threads"] is not None:
        assert found["threads"] == expected["threads"], found
    assert len(found["warnings"]) == (1 if expected["warns"] else 0), found["warnings"]
    for name, value in env.items():
        if expected["warns"] and name == next(n for n in threads.USER_VARIABLES if n in env):
            assert f"{name}={value!r}" in found["warnings"][0], found["warnings"]


def test_thread_count_reads_the_variables_as_tvm_does():
    """The same rules on a given environment, without a process (warned about, once a message)."""
    with pytest.warns(RuntimeWarning, match=r"TVM_NUM_THREADS='abc' is not a positive integer: TVM's runtime reads "
                                            r"it with atoi as 0 and runs 1 thread \(OMP_NUM_THREADS='3' is not read"):
        assert threads.thread_count({"TVM_NUM_THREADS": "abc", "OMP_NUM_THREADS": "3"}) == 1
    assert threads.thread_count({"TVM_NUM_THREADS": " +1"}) == 1  # atoi takes a sign and leading blanks
    assert threads.thread_count({"OMP_NUM_THREADS": "1"}) == 1
