"""Every knob path of every kernel computes the reference: each candidate value of each knob of
the design space (split-KV included) is pinned, the test asserts the kernel was built with it
(``fuel.knob_values``: no silent fallback to the hand-picked knobs or the floor), and the result
is compared with the numpy reference. For the CPU kernels and the CUDA kernels' emulation.

The hand-picked knobs give one split at most tested shapes (they depend on the core count); here
the split counts are pinned, so the split-KV merge (forward, paged) and the summed dq partials
(backward) run whatever the machine.
"""

from __future__ import annotations

import numpy as np
import pytest
import tvm
from helpers import (HOST, PinnedKnobs, applied_knobs, assert_close, assert_pinned, build, dense_inputs, flatten,
                     legalize_cuda_emulated, paged_inputs)
from tvm import relax

from tvm_fuel import op
from tvm_fuel import reference as ref
from tvm_fuel.dispatch import tuned_legalize_map, workload_of
from tvm_fuel.schedules.cpu.rules import RULES as CPU_RULES
from tvm_fuel.schedules.cuda.rules import cuda_rules

pytestmark = pytest.mark.numerics
OPTIONS = dict(causal=True, window_size=(90, -1), softcap=4.0)


def _case(name: str, rng: np.random.Generator):
    """(make, inputs, expected outputs) of one op at awkward shapes: GQA group 3, head dim 40,
    lengths 17/97/130, a paged batch with an empty, a one-token and a multi-block sequence."""
    if name == "flash_attn":
        inputs = dense_inputs(rng, 1, 3, 1, 17, 130, 40, "float32")
        return (lambda **a: op.flash_attn(**a, return_lse=True, **OPTIONS), inputs,
                ref.flash_attn(*inputs.values(), return_lse=True, **OPTIONS))
    if name == "flash_attn_backward":
        inputs = dense_inputs(rng, 1, 3, 1, 97, 130, 40, "float32", with_do=True)
        expected = ref.flash_attn_backward(*inputs.values(), **OPTIONS)
        # out and lse given: the backward kernel alone is built (no forward kernel takes the knobs)
        out, lse = ref.flash_attn(inputs["q"], inputs["k"], inputs["v"], return_lse=True, **OPTIONS)
        inputs.update(out=out.astype("float32"), lse=lse.astype("float32"))
        return lambda **a: op.flash_attn_backward(**a, **OPTIONS), inputs, expected
    if name == "flash_attn_jvp":
        inputs = dense_inputs(rng, 1, 3, 1, 17, 130, 40, "float32")
        inputs.update(q_dot=rng.standard_normal(inputs["q"].shape).astype("float32"),
                      k_dot=rng.standard_normal(inputs["k"].shape).astype("float32"),
                      v_dot=rng.standard_normal(inputs["v"].shape).astype("float32"))
        return (lambda **a: op.flash_attn_jvp(**a, return_lse=True, **OPTIONS), inputs,
                ref.flash_attn_jvp(*inputs.values(), return_lse=True, **OPTIONS))
    if name == "flash_attn_double_backward":
        inputs = dense_inputs(rng, 1, 3, 1, 97, 130, 40, "float32", with_do=True)
        bars = {f"d{x}_bar": rng.standard_normal(inputs[x].shape).astype("float32") for x in "qkv"}
        expected = ref.flash_attn_double_backward(*inputs.values(), *bars.values(), **OPTIONS)
        out, lse = ref.flash_attn(inputs["q"], inputs["k"], inputs["v"], return_lse=True, **OPTIONS)
        inputs.update(bars, out=out.astype("float32"), lse=lse.astype("float32"))  # its kernel alone is built
        return lambda **a: op.flash_attn_double_backward(**a, **OPTIONS), inputs, expected
    inputs = paged_inputs(rng, [0, 1, 97, 160], Hq=3, Hkv=1, Sq=1 if name == "decode" else 5, num_blocks=40,
                          max_blocks=10)
    return (lambda **a: op.paged_attn(**a, causal=True, softcap=4.0), inputs,
            [ref.paged_attn(*inputs.values(), causal=True, softcap=4.0)])


def _covering_points(space: dict, valid) -> list[dict]:
    """Knob points (partial: the rest hand-picked) in which every candidate of every knob appears
    at least once where some point can carry it: point i takes candidate i of each knob; a point
    that does not build is replaced by one point per knob, that knob alone set."""
    points: list[dict] = []
    for i in range(max(len(values) for values in space.values())):
        point = {name: values[i % len(values)] for name, values in space.items()}
        if valid(point):
            points.append(point)
            continue
        for name, values in space.items():
            if i < len(values) and valid({name: values[i]}) and {name: values[i]} not in points:
                points.append({name: values[i]})
    return points


def _legalize(mod, family: str, knobs: dict) -> tvm.IRModule:
    if family == "cuda-emulated":
        return legalize_cuda_emulated(mod, HOST, PinnedKnobs(**knobs))
    with HOST:
        return relax.transform.LegalizeOps(tuned_legalize_map(HOST, PinnedKnobs(**knobs)))(mod)


def _rule_and_workload(mod, family: str):
    call = mod["main"].body.blocks[0].bindings[0].value
    rules = cuda_rules(emulated=True) if family == "cuda-emulated" else CPU_RULES
    workload = workload_of(call.op.name.split(".")[-1], call)
    for rule in rules:
        if workload is not None and rule.serves(workload, HOST):
            return rule, workload
    raise AssertionError(f"no {family} rule serves {call.op.name}")


# the higher-order ops have CPU kernels only (the CUDA rules leave them to the floor)
CASES = [(name, family) for family in ("cpu", "cuda-emulated")
         for name in ("flash_attn", "flash_attn_backward", "decode", "paged_multi_query")]
CASES += [("flash_attn_jvp", "cpu"), ("flash_attn_double_backward", "cpu")]


@pytest.mark.parametrize("name,family", CASES, ids=[f"{name}-{family}" for name, family in CASES])
def test_every_knob_value_computes_the_reference(name, family):
    rng = np.random.default_rng(len(name))
    make, inputs, expected = _case(name, rng)
    mod = build(make, {n: (a.shape, str(a.dtype)) for n, a in inputs.items()})
    rule, workload = _rule_and_workload(mod, family)
    space = rule.knob_space(workload, HOST)

    def valid(partial: dict) -> bool:
        try:
            rule.knobs(workload, HOST, partial)
        except ValueError:
            return False
        return True

    points = _covering_points(space, valid)
    seen = {name: set() for name in space}
    for knobs in points:
        legalized = _legalize(mod, family, knobs)
        kernels = [f for f in legalized.functions.values() if f.attrs is not None and "fuel.knob_values" in f.attrs]
        assert kernels, f"{name} {knobs}: the floor ran, not the {family} kernel"
        for kernel in kernels:
            assert_pinned(kernel, **knobs)
        for knob, value in applied_knobs(kernels[-1]).items():
            seen.get(knob, set()).add(value)
        vm = relax.VirtualMachine(tvm.compile(legalized, target=HOST), tvm.cpu())
        got = flatten(vm["main"](*[tvm.runtime.tensor(a) for a in inputs.values()]))
        for i, (g, w) in enumerate(zip(got, expected)):
            assert_close(g, w, "float32", scale=4, what=f"{name} output {i} at {knobs}")
    # every candidate that some point could carry was built and checked
    for knob, values in space.items():
        reachable = {v for v in values if valid({knob: v})}
        assert reachable <= seen[knob], (knob, sorted(reachable - seen[knob]))
    if "splits" in space:
        assert max(seen["splits"]) > 1  # split-KV really ran


def test_covering_points_cover_each_candidate():
    space = {"a": (1, 2, 3), "b": (10, 20)}
    points = _covering_points(space, lambda p: not (p.get("a") == 3 and p.get("b") == 10))
    assert {p["a"] for p in points if "a" in p} == {1, 2, 3} and {p["b"] for p in points if "b" in p} == {10, 20}
