"""The tuning builder's worker processes outlive a batch: later batches build on the same workers,
a candidate that fails is that candidate's error, and the next batch still builds."""

from __future__ import annotations

import numpy as np
import pytest
from helpers import HOST

import tvm
from tvm.s_tir import meta_schedule as ms
from tvm.script import tirx as T
from tvm.support import popen_pool

from tvm_fuel.tuning import measure

# it starts worker processes (each imports TVM): left to the whole suite with the other tuning modules
pytestmark = [pytest.mark.integration, pytest.mark.slow]


@T.prim_func
def _add_one(a: T.Buffer((17,), "float32"), b: T.Buffer((17,), "float32")):
    for i in range(17):
        b[i] = a[i] + T.float32(1)


def _run(artifact: str) -> np.ndarray:
    lib = tvm.runtime.load_module(artifact)
    a = np.arange(17, dtype="float32")
    b = tvm.runtime.tensor(np.zeros(17, "float32"))
    lib["main"](tvm.runtime.tensor(a), b)
    return b.numpy() - a


def test_batches_share_workers_and_a_failed_candidate_is_its_own_error(monkeypatch):
    starts = []
    start = popen_pool.PopenWorker._start  # noqa: SLF001 -- counts the worker processes TVM's pool starts
    monkeypatch.setattr(popen_pool.PopenWorker, "_start", lambda self: (starts.append(1), start(self))[1])
    good = ms.builder.BuilderInput(tvm.IRModule({"main": _add_one.with_attr("global_symbol", "main")}), HOST)
    # build_candidate reads a tuning module's knob annotations: a plain function has none
    bad = ms.builder.BuilderInput(tvm.IRModule({"main": _add_one}), HOST)
    kernels = measure.PooledBuilder(measure.build_candidate, workers=1)
    functions = measure.PooledBuilder(measure.build_function, workers=1)
    try:
        (failed,) = kernels.build([bad])
        assert failed.artifact_path is None and "PooledBuilder: An exception occurred" in failed.error_msg
        for _ in range(2):
            (built,) = functions.build([good])
            assert built.error_msg is None
            np.testing.assert_array_equal(_run(built.artifact_path), np.ones(17, "float32"))
        (failed,) = kernels.build([bad])  # the worker that raised builds on
        assert failed.error_msg is not None
    finally:
        kernels.close()
        functions.close()
    assert len(starts) == 2  # one worker each, for all their batches
