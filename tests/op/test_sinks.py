"""Attention sinks (``sinks [Hq]``) on flash_attn, its backward and paged_attn: the floor, the
CPU kernels and the CUDA kernels' emulation against the float64 reference (an explicit softmax
with the sink column), the sinks' gradient through ``tvm_fuel.transform.gradient``, and the
errors a call with sinks gets."""

from __future__ import annotations


import numpy as np
import pytest
import tvm
from helpers import (HOST, WINDOWS, PinnedKnobs, Runner, assert_close, assert_pinned, build,
                     dense_inputs, legalize_cuda_emulated, paged_inputs, randn, run)
from tvm import relax

import tvm_fuel
from tvm_fuel import op
from tvm_fuel import reference as ref

pytestmark = pytest.mark.numerics

OPTIONS = {**WINDOWS, "softcap": dict(softcap=4.0, causal=True)}


def _sinks(rng, hq: int) -> np.ndarray:
    """Sink logits around the scores' range, one head without a sink (-inf) and one far above them."""
    sinks = (rng.standard_normal(hq) * 2).astype(np.float32)
    sinks[0] = -np.inf
    if hq > 2:
        sinks[-1] = 30.0  # the sink takes nearly all the mass: out ~ 0, lse ~ 30
    return sinks


def _assert_lse(lse, want):
    np.testing.assert_array_equal(np.isneginf(lse), np.isneginf(want))
    finite = np.isfinite(want)
    np.testing.assert_allclose(lse[finite], want[finite], atol=1e-5, rtol=1e-5, err_msg="lse")


@pytest.mark.parametrize("options", list(OPTIONS))
@pytest.mark.parametrize("group,sq,sk", [(1, 17, 97), (3, 97, 17), (7, 1, 1), (3, 5, 0)])
def test_forward(options, group, sq, sk, kernels):
    rng = np.random.default_rng(group * 1000 + sq * 7 + sk)
    inputs = dense_inputs(rng, 2, 2 * group, 2, sq, sk, 40)
    inputs["sinks"] = _sinks(rng, 2 * group)
    out, lse = run(lambda sinks, **a: op.flash_attn(**a, sinks=sinks, return_lse=True, **OPTIONS[options]),
                   inputs, kernels=kernels)
    want_out, want_lse = ref.flash_attn(inputs["q"], inputs["k"], inputs["v"], sinks=inputs["sinks"],
                                        return_lse=True, **OPTIONS[options])
    assert_close(out, want_out, "float32", what="out")
    _assert_lse(lse, want_lse)


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_forward_half_precision_with_alibi(dtype, kernels):
    rng = np.random.default_rng(5)
    inputs = dense_inputs(rng, 1, 6, 2, 17, 33, 64, dtype)
    inputs["alibi_slopes"] = np.linspace(0.1, 0.6, 6).astype(np.float32)
    inputs["sinks"] = _sinks(rng, 6)
    out, lse = run(lambda alibi_slopes, sinks, **a: op.flash_attn(
        **a, alibi_slopes=alibi_slopes, sinks=sinks, causal=True, return_lse=True), inputs, kernels=kernels)
    want_out, want_lse = ref.flash_attn(inputs["q"], inputs["k"], inputs["v"], inputs["alibi_slopes"],
                                        sinks=inputs["sinks"], causal=True, return_lse=True)
    assert out.dtype == inputs["q"].dtype
    assert_close(out, want_out, dtype, what="out")
    np.testing.assert_allclose(lse, want_lse, atol=2e-3, rtol=2e-3)


@pytest.mark.parametrize("given", ["none", pytest.param("out_lse", marks=pytest.mark.quick)])
@pytest.mark.parametrize("options,group,sq,sk", [("causal", 3, 17, 33), ("softcap", 1, 33, 17), ("full", 7, 1, 97)])
def test_backward(options, group, sq, sk, given, kernels):
    """dq, dk, dv with sinks, from the forward state the backward recomputes or is given (the forward's
    out and lse with the same sinks)."""
    rng = np.random.default_rng(group + sq + sk)
    inputs = dense_inputs(rng, 2, 2 * group, 2, sq, sk, 40, with_do=True)
    inputs["sinks"] = _sinks(rng, 2 * group)
    opts = OPTIONS[options]
    if given == "out_lse":
        inputs["out"], inputs["lse"] = (x.astype(np.float32) for x in ref.flash_attn(
            inputs["q"], inputs["k"], inputs["v"], sinks=inputs["sinks"], return_lse=True, **opts))
    grads = run(lambda q, k, v, do, sinks, **state: op.flash_attn_backward(q, k, v, do, sinks=sinks, **state, **opts),
                inputs, kernels=kernels)
    want = ref.flash_attn_backward(inputs["q"], inputs["k"], inputs["v"], inputs["do"], sinks=inputs["sinks"], **opts)
    for name, got, expected in zip(("dq", "dk", "dv"), grads, want):
        assert_close(got, expected, "float32", scale=4, what=name)


def _loss_module(B, Hq, Hkv, Sq, Sk, D, options):
    """main(q, k, v, sinks, w) -> sum(flash_attn(q, k, v, sinks) * w)."""
    params = dict(q=((B, Hq, Sq, D), "float32"), k=((B, Hkv, Sk, D), "float32"), v=((B, Hkv, Sk, D), "float32"),
                  sinks=((Hq,), "float32"), w=((B, Hq, Sq, D), "float32"))
    mod = build(lambda q, k, v, sinks, w: relax.op.sum(relax.op.multiply(op.flash_attn(q, k, v, sinks=sinks,
                                                                                      **options), w)), params)
    main = mod["main"]
    return tvm_fuel.transform.gradient(mod, require_grads=list(main.params[:4]))


@pytest.mark.parametrize("options,group", [("causal", 3), ("two_sided", 1), ("softcap", 7)])
def test_gradient_of_sinks(options, group, kernels):
    """Gradient gives (dq, dk, dv, dsinks) of a loss through flash_attn with sinks."""
    rng = np.random.default_rng(group)
    B, Hkv, Sq, Sk, D = 2, 1, 17, 33, 32
    Hq = group * Hkv
    adjoint = _loss_module(B, Hq, Hkv, Sq, Sk, D, OPTIONS[options])
    inputs = dense_inputs(rng, B, Hq, Hkv, Sq, Sk, D)
    inputs["sinks"] = (rng.standard_normal(Hq) * 2).astype(np.float32)
    inputs["w"] = randn(rng, (B, Hq, Sq, D))
    main = adjoint["main_adjoint"]
    mod = tvm.IRModule({"main": main.with_attr("global_symbol", "main")})
    loss, *grads = Runner(mod, HOST, kernels=kernels)(*inputs.values())
    want = ref.flash_attn_backward(inputs["q"], inputs["k"], inputs["v"], inputs["w"], sinks=inputs["sinks"],
                                   **OPTIONS[options])
    want_out = ref.flash_attn(inputs["q"], inputs["k"], inputs["v"], sinks=inputs["sinks"], **OPTIONS[options])
    np.testing.assert_allclose(loss, (want_out * inputs["w"]).sum(), rtol=1e-4)
    for name, got, expected in zip(("dq", "dk", "dv", "dsinks"), grads, want):
        assert_close(got, expected, "float32", scale=4, what=name)
    assert np.abs(want[3]).min() > 1e-3  # every head's sink has a gradient worth checking


def test_sinks_gradient_against_finite_differences():
    """The reference's dsinks is the derivative: central differences of the float64 loss."""
    rng = np.random.default_rng(3)
    q, k, v = (x.astype(np.float64) for x in dense_inputs(rng, 1, 3, 1, 5, 7, 8).values())
    w, sinks = rng.standard_normal(q.shape), rng.standard_normal(3)
    dsinks = ref.flash_attn_backward(q, k, v, w, sinks=sinks, causal=True)[3]
    eps = 1e-6
    for h in range(3):
        step = np.zeros(3)
        step[h] = eps
        plus, minus = ((ref.flash_attn(q, k, v, sinks=sinks + s, causal=True) * w).sum() for s in (step, -step))
        np.testing.assert_allclose(dsinks[h], (plus - minus) / (2 * eps), rtol=1e-6, atol=1e-8)


PAGED = [(1, "float32", dict(causal=True)),  # decode: the CPU kernel streams K and V rows in place
         (3, "float32", dict(window_size=(20, 0))),  # 9 rows per KV head: packed key tiles
         (1, "bfloat16", dict(causal=True, softcap=4.0)),  # the CUDA register-tile path
         (8, "float16", dict(causal=True))]


@pytest.mark.parametrize("sq,dtype,options", PAGED)
def test_paged(sq, dtype, options, kernels):
    """paged_attn with sinks on every path (the kernels add each head's sink to its rows' sums),
    contexts 0, 1, 17 and 70, against the reference's explicit sink column."""
    rng = np.random.default_rng(sq)
    inputs = paged_inputs(rng, [0, 1, 17, 70], Sq=sq, dtype=dtype)
    inputs["sinks"] = _sinks(rng, 6)
    inputs["alibi_slopes"] = (rng.random(6) * 0.2).astype(np.float32)
    (out,) = run(lambda **a: op.paged_attn(**a, **options), inputs, kernels=kernels)  # asserts: no floor
    want = ref.paged_attn(*(inputs[n] for n in ("q", "k_cache", "v_cache", "block_table", "context_lens",
                                                 "alibi_slopes")), sinks=inputs["sinks"], **options)
    assert_close(out, want, dtype, what="out")
    assert (out[0] == 0).all()  # context 0: the sinks' alone


def test_paged_split_kv_merge_adds_the_sink_once():
    """The emulated CUDA paged kernel with its keys split in four: each split's partial rows are
    sink-free and the merge adds the sink once, to the merged sum."""
    rng = np.random.default_rng(5)
    inputs = paged_inputs(rng, [0, 9, 70, 96], Sq=1)
    inputs["sinks"] = _sinks(rng, 6)
    mod = build(lambda **a: op.paged_attn(**a, causal=True), {n: (a.shape, str(a.dtype)) for n, a in inputs.items()})
    target = tvm_fuel.target.as_target(HOST)
    legalized = legalize_cuda_emulated(mod, target, PinnedKnobs(block_q=16, block_k=16, threads=32, splits=4))
    assert_pinned(legalized["fuel_paged_attn_kernel"], splits=4)
    vm = relax.VirtualMachine(tvm.compile(legalized, target=target), tvm.cpu())
    out = vm["main"](*[tvm.runtime.tensor(a) for a in inputs.values()]).numpy()
    want = ref.paged_attn(*(inputs[n] for n in ("q", "k_cache", "v_cache", "block_table", "context_lens")),
                          sinks=inputs["sinks"], causal=True)
    assert_close(out, want, "float32", what="out")


def _var(name, shape, dtype="float32"):
    return relax.Var(name, relax.TensorType(shape, dtype))


@pytest.mark.parametrize("shape,dtype,message", [((5,), "float32", "'sinks' must have shape"),
                                                 ((6,), "float16", "'sinks' must have dtype float32"),
                                                 ((1, 6), "float32", "'sinks' must be 1-D")])
def test_bad_sinks(shape, dtype, message):
    q, k = _var("q", (1, 6, 4, 8)), _var("k", (1, 2, 4, 8))
    bb = relax.BlockBuilder()
    with pytest.raises((ValueError, TypeError), match=message):
        with bb.function("main", [q, k]):
            bb.emit_func_output(bb.normalize(op.flash_attn(q, k, k, sinks=_var("sinks", shape, dtype))))


def test_second_derivative_is_refused():
    """flash_attn_double_backward takes no sinks: a second gradient says so (no silent drop)."""
    adjoint = _loss_module(1, 2, 1, 3, 3, 8, {})
    objective = tvm_fuel.transform.with_objective(adjoint, "main_adjoint", "penalty",
                                                  lambda result: relax.op.sum(result.fields[1].fields[0]))
    with pytest.raises(ValueError, match="fuel.flash_attn_backward: no second derivative with sinks"):
        tvm_fuel.transform.gradient(objective, "penalty", require_grads=objective["penalty"].params[:1])


def test_printed_call_parses_back():
    q, k, sinks = _var("q", (1, 6, 4, 8)), _var("k", (1, 2, 4, 8)), _var("sinks", (6,))
    bb = relax.BlockBuilder()
    with bb.function("main", [q, k, sinks]):
        bb.emit_func_output(bb.emit(op.flash_attn(q, k, k, sinks=sinks, causal=True)))
    mod = bb.get()
    parsed = tvm.script.from_source(mod.script())
    tvm.ir.assert_structural_equal(parsed, mod)
    assert "has_sinks=True" in mod.script()


@pytest.mark.parametrize("path", ["decomposed", "tuned"])
def test_sinks_of_symbolic_length_checked_at_run_time(path):
    """A sinks [n] whose n type inference cannot prove wrong is checked before any kernel reads it."""
    n = tvm.tirx.Var("n", "int64")
    q, k, sinks = _var("q", (1, 6, 4, 8)), _var("k", (1, 2, 4, 8)), _var("sinks", (n,))
    bb = relax.BlockBuilder()
    with bb.function("main", [q, k, sinks]):
        bb.emit_func_output(bb.emit(op.flash_attn(q, k, k, sinks=sinks)))
    vm = relax.VirtualMachine(tvm_fuel.compile(bb.get(), HOST, kernels=path), tvm.cpu())
    rng = np.random.default_rng(0)
    args = [randn(rng, (1, 6, 4, 8)), randn(rng, (1, 2, 4, 8))]
    vm["main"](*map(tvm.runtime.tensor, args + [randn(rng, (6,))]))  # the right length runs
    with pytest.raises(Exception, match="head count Hq of 'sinks'"):
        vm["main"](*map(tvm.runtime.tensor, args + [randn(rng, (5,))]))


@pytest.mark.parametrize("name", ["flash_attn", "flash_attn_backward", "paged_attn"])
def test_tuning_measures_the_kernel_a_call_with_sinks_runs(name):
    """``tune``'s workload of a call with sinks is the one its kernel is built for: the sink-free
    forward with lse and the sink-free backward (their results rescaled), paged with its sinks."""
    from tvm_fuel.tuning.kernels import workloads_of

    rng = np.random.default_rng(9)
    if name == "paged_attn":
        inputs = paged_inputs(rng, [3, 40], Sq=1)
        make = lambda **a: op.paged_attn(**a, causal=True)  # noqa: E731
    else:
        inputs = dense_inputs(rng, 1, 6, 2, 17, 33, 40)
        if name == "flash_attn_backward":
            inputs["do"] = randn(rng, inputs["q"].shape, "float32")
        make = lambda **a: getattr(op, name)(**a, causal=True)  # noqa: E731
    inputs["sinks"] = _sinks(rng, 6)
    mod = build(make, {n: (a.shape, str(a.dtype)) for n, a in inputs.items()})
    (workload,) = [w for w in workloads_of(mod, tvm_fuel.target.as_target(HOST)) if w.op == name]
    assert workload.spec.has_sinks == (name == "paged_attn")
    assert workload.spec.return_lse == (name == "flash_attn")
    legalized = tvm_fuel.transform.legalize(mod, HOST, kernels="tuned")
    assert str(legalized[f"fuel_{name}_kernel"].attrs["fuel.workload"]) == workload.describe()
