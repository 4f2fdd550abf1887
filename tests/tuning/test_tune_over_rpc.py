"""Distributed tuning over TVM's RPC: a real tracker and two servers on loopback.

Builds run locally; candidates are measured on the servers registered under the key. The test
checks the measurements are real and that no tracker, server or worker process outlives it.
"""

from __future__ import annotations

import psutil
import pytest
from helpers import HOST

from tvm_fuel.tuning import target_key, tune
from tvm_fuel.tuning.buckets import bucket_module
from tvm_fuel.dispatch.log_database import RECORD_FILE

pytestmark = [pytest.mark.integration, pytest.mark.slow]

pytest.importorskip("tornado", reason="the RPC tracker needs tornado (pip install -e '.[test]')")


def _descendants() -> set[int]:
    return {p.pid for p in psutil.Process().children(recursive=True)}


def test_tune_through_tracker_and_two_servers(tmp_path):
    from tvm.rpc.server import Server
    from tvm.rpc.tracker import Tracker

    before = _descendants()
    tracker = Tracker(host="127.0.0.1", port=9190, port_end=9290, silent=True)
    servers = []
    try:
        servers = [Server(host="127.0.0.1", port=9300, port_end=9400, key="fuel-test",
                          tracker_addr=("127.0.0.1", tracker.port), silent=True) for _ in range(2)]
        mod = bucket_module("paged_attn", dict(B=2, Hq=4, Hkv=2, D=64, block_size=16, ctx=64))
        lines = []
        (result,) = tune(mod, HOST, trials=4, trials_per_iter=4, work_dir=tmp_path,
                         rpc_tracker=f"127.0.0.1:{tracker.port}", rpc_key="fuel-test", log=lines.append)
        assert result.trials >= 4 and 0 < result.best_s < 1.0 and result.hand_picked_s < 1.0
        records = (tmp_path / target_key(HOST) / "paged_attn" / RECORD_FILE).read_text().splitlines()
        assert len(records) >= 5  # the hand-picked point and the trials, with real times
        assert any("GB/s" in line for line in lines)
    finally:
        for server in servers:
            server.terminate()
        tracker.terminate()
    psutil.wait_procs([psutil.Process(pid) for pid in _descendants() - before if psutil.pid_exists(pid)],
                      timeout=10)
    assert not (_descendants() - before), "tracker, server or worker processes left behind"
