"""A model's identical attention calls (one per layer) legalize to one kernel: the legalize map
builds a kernel once per (rule, workload, knobs), since parsing a TVMScript kernel costs ~0.5 s,
and every call runs it. Calls that differ in any option get their own kernel."""

from __future__ import annotations

import numpy as np
import pytest
import tvm
from helpers import HOST, randn
from tvm import relax, tirx

import tvm_fuel
from tvm_fuel import op, reference as ref
from tvm_fuel.schedules.base import KernelRule

pytestmark = pytest.mark.integration

LAYERS = 5


def _layers(causal_of_layer) -> tvm.IRModule:
    """x [1, 8, 33, 40] through LAYERS self-attention calls, layer i causal iff causal_of_layer(i)."""
    bb = relax.BlockBuilder()
    x = relax.Var("x", relax.TensorType((1, 8, 33, 40), "float32"))
    with bb.function("main", [x]):
        h = x
        for i in range(LAYERS):
            h = bb.emit(op.flash_attn(h, h, h, causal=causal_of_layer(i)))
        bb.emit_func_output(h)
    return bb.get()


def _count_kernel_builds(monkeypatch) -> list:
    built = []
    for rule_type in {type(rule) for rule in tvm_fuel.schedules.rules_for(tvm_fuel.target.as_target(HOST))}:
        original = rule_type.kernel

        def counted(self, workload, knobs, original=original):
            built.append(workload.op)
            return original(self, workload, knobs)

        monkeypatch.setattr(rule_type, "kernel", counted)
    assert issubclass(rule_type, KernelRule)
    return built


def _kernels(legalized: tvm.IRModule) -> list[str]:
    return [gv.name_hint for gv, f in legalized.functions.items()
            if isinstance(f, tirx.PrimFunc) and f.attrs is not None and "fuel.workload" in f.attrs]


@pytest.mark.parametrize("mixed", [False, True], ids=["identical", "causal-and-not"])
def test_identical_calls_build_one_kernel_and_every_layer_runs_it(monkeypatch, mixed):
    built = _count_kernel_builds(monkeypatch)
    causal_of_layer = (lambda i: i % 2 == 0) if mixed else (lambda i: True)
    legalized = tvm_fuel.transform.legalize(_layers(causal_of_layer), HOST, kernels="tuned")
    distinct = 2 if mixed else 1
    assert built == ["flash_attn"] * distinct, built
    assert len(_kernels(legalized)) == distinct, _kernels(legalized)
    vm = relax.VirtualMachine(tvm.compile(legalized, target=HOST), tvm.cpu())
    x = randn(np.random.default_rng(0), (1, 8, 33, 40))
    want = x.astype(np.float64)
    for i in range(LAYERS):
        want = ref.flash_attn(want, want, want, causal=causal_of_layer(i))
    np.testing.assert_allclose(vm["main"](tvm.runtime.tensor(x)).numpy(), want, rtol=1e-4, atol=1e-4)
