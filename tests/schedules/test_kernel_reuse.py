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


def test_identical_varlen_calls_share_their_offsets_check_and_kernel():
    """Two layers of flash_attn_varlen over one packed batch: one host check of the offsets and
    one kernel in the module (each used to be added once per call), both layers correct."""
    lens = [17, 0, 1, 15]
    offsets = np.concatenate([[0], np.cumsum(lens)]).astype("int32")
    total = int(offsets[-1])
    bb = relax.BlockBuilder()
    x = relax.Var("x", relax.TensorType((total, 4, 40), "float32"))
    cu = relax.Var("cu", relax.TensorType((len(lens) + 1,), "int32"))
    with bb.function("main", [x, cu]):
        h = bb.emit(op.flash_attn_varlen(x, x, x, cu, cu, causal=True))
        bb.emit_func_output(bb.emit(op.flash_attn_varlen(h, h, h, cu, cu, causal=True)))
    legalized = tvm_fuel.transform.legalize(bb.get(), HOST, kernels="tuned")
    names = [gv.name_hint for gv in legalized.functions]
    assert len([n for n in names if n.startswith("fuel_flash_attn_varlen_check")]) == 1, names
    assert len(_kernels(legalized)) == 1, _kernels(legalized)
    vm = relax.VirtualMachine(tvm.compile(legalized, target=HOST), tvm.cpu())
    packed = randn(np.random.default_rng(1), (total, 4, 40))
    want = packed.astype(np.float64)
    for _ in range(2):
        want = np.concatenate([ref.flash_attn(s[None].transpose(0, 2, 1, 3), s[None].transpose(0, 2, 1, 3),
                                              s[None].transpose(0, 2, 1, 3), causal=True)[0].transpose(1, 0, 2)
                               for s in np.split(want, offsets[1:-1])])
    got = vm["main"](tvm.runtime.tensor(packed), tvm.runtime.tensor(offsets)).numpy()
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4)
