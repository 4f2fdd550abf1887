"""The route from a fused call to its kernel (``tvm_fuel.dispatch``): ``route`` names the rule that
builds a call's workload, or the floor and why; ``explain`` prints that per call of a module;
``workload_of`` reads the same workload whatever the target (a rule only says whether it serves it)."""

from __future__ import annotations

import io

import pytest
import tvm
from helpers import HOST, build
from tvm import relax

from tvm_fuel import op
from tvm_fuel.dispatch import explain, route, workload_of
from tvm_fuel.schedules.cpu.rules import FlashBackward, FlashForward

pytestmark = pytest.mark.unit

SM90 = tvm.target.Target({"kind": "cuda", "arch": "sm_90"})


def _flash(Sq=17, Sk=97, D=40, heads=(6, 2), **options):
    hq, hkv = heads
    return build(lambda q, k, v: op.flash_attn(q, k, v, **options),
                 {"q": ((2, hq, Sq, D), "float32"), "k": ((2, hkv, Sk, D), "float32"),
                  "v": ((2, hkv, Sk, D), "float32")})


def _calls(mod):
    return [b.value for block in mod["main"].body.blocks for b in block.bindings]


def test_a_static_call_routes_to_its_cpu_kernel():
    (call,) = _calls(_flash(causal=True))
    found = route("flash_attn", call, HOST)
    assert isinstance(found.rule, FlashForward) and found.why == ""
    assert found.workload == workload_of("flash_attn", call)
    assert found.workload.dim == {"B": 2, "Sq": 17, "Sk": 97} and found.workload.spec.group == 3
    # the same workload on every target: each target's rule says whether it serves it
    assert route("flash_attn", call, SM90).workload == found.workload


def test_the_floor_says_why():
    sym = tvm.tirx.Var("D", "int64")
    mod = build(lambda q, k, v: op.flash_attn(q, k, v), {n: ((1, 2, 5, sym), "float32") for n in "qkv"})
    (call,) = _calls(mod)
    found = route("flash_attn", call, HOST)
    assert found.rule is None and "head dim" in found.why and "floor" in found.describe()
    (softmax,) = _calls(build(lambda dy, y: op.softmax_backward(dy, y, axis=-1),
                              {"dy": ((3, 5), "float32"), "y": ((3, 5), "float32")}))
    found = route("softmax_backward", softmax, HOST)
    assert found.rule is None and found.why == "no kernel of softmax_backward is written for llvm"


def test_a_call_with_sinks_routes_through_the_sink_free_call():
    mod = build(lambda q, k, v, sinks: op.flash_attn(q, k, v, sinks=sinks),
                {"q": ((1, 4, 9, 32), "float32"), "k": ((1, 2, 9, 32), "float32"), "v": ((1, 2, 9, 32), "float32"),
                 "sinks": ((4,), "float32")})
    (call,) = _calls(mod)
    assert workload_of("flash_attn", call) is None  # no kernel takes sinks
    found = route("flash_attn", call, HOST)
    assert found.via_sinks and isinstance(found.rule, FlashForward) and found.workload.spec.return_lse
    assert "rescaled by the sinks" in found.describe()


def test_explain_prints_each_call_with_its_knobs_source():
    def make(q, k, v, do):
        return relax.Tuple([op.flash_attn(q, k, v, causal=True), op.flash_attn_backward(q, k, v, do, causal=True)])

    shapes = {"q": ((1, 4, 17, 40), "float32"), "k": ((1, 2, 33, 40), "float32"), "v": ((1, 2, 33, 40), "float32"),
              "do": ((1, 4, 17, 40), "float32")}
    out = io.StringIO()
    lines = explain(build(make, shapes), HOST, shipped_logs=False, file=out)
    assert len(lines) == 2 and out.getvalue().splitlines() == lines
    assert lines[0].startswith("main: flash_attn") and "kernel FlashForward (knobs: hand-picked)" in lines[0]
    assert f"kernel {FlashBackward.__name__}" in lines[1]
    floor = explain(build(make, shapes), "c", file=None)  # no kernel is written for the C target
    assert all("floor (no kernel of flash_attn" in line or "floor (no kernel of flash_attn_backward" in line
               for line in floor), floor
