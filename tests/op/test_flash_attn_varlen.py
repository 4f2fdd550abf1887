"""flash_attn_varlen (FlashAttention's packed variable-length layout) and its backward: the floor,
the CPU kernel and the CUDA kernel's emulation (the ``kernels`` fixture; ``legalize_checked``
asserts a kernel path ran its kernel) against the float64 reference and PyTorch's SDPA run per
sequence, through ``tvm_fuel.transform.gradient``, with symbolic sizes, and the errors bad offsets
and shapes get."""

from __future__ import annotations

import numpy as np
import pytest
import tvm
from helpers import assert_close, build, has_torch, HOST, randn, Runner, run
from tvm import relax

import tvm_fuel
from tvm_fuel import op
from tvm_fuel import reference as ref

pytestmark = pytest.mark.numerics

# lengths 0, 1, 17, 97 and 513 in one batch; queries and keys differ per sequence (Sq > Sk too)
LENS_Q = [17, 0, 97, 1, 513, 3]
LENS_K = [33, 5, 97, 1, 513, 0]
OPTIONS = {
    "full": dict(),
    "causal": dict(causal=True),
    "window": dict(window_size=(32, 0)),
    "two_sided_softcap": dict(window_size=(16, 8), softcap=5.0),
    "sink_tokens": dict(window_size=(8, 0), sink_tokens=4),
    "alibi_causal": dict(causal=True, alibi=True),
}


def _cu(lens) -> np.ndarray:
    return np.concatenate([[0], np.cumsum(lens)]).astype(np.int32)


def _inputs(rng, Hq, Hkv, D, dtype="float32", *, lens_q=LENS_Q, lens_k=LENS_K, extra_rows=2, alibi=False):
    """Packed q (with ``extra_rows`` past the last sequence), k, v, both offsets (and ALiBi slopes)."""
    inputs = dict(q=randn(rng, (sum(lens_q) + extra_rows, Hq, D), dtype), k=randn(rng, (sum(lens_k), Hkv, D), dtype),
                  v=randn(rng, (sum(lens_k), Hkv, D), dtype), cu_seqlens_q=_cu(lens_q), cu_seqlens_k=_cu(lens_k))
    if alibi:
        inputs["alibi_slopes"] = np.linspace(0.05, 0.5, Hq).astype(np.float32)
    return inputs


def _split(options: dict) -> tuple[bool, dict]:
    options = dict(options)
    return options.pop("alibi", False), options


def _assert_lse(lse, want):
    np.testing.assert_array_equal(np.isneginf(lse), np.isneginf(want), err_msg="lse: rows without keys")
    finite = np.isfinite(want)
    np.testing.assert_allclose(lse[finite], want[finite], atol=2e-5, rtol=2e-5, err_msg="lse")


@pytest.mark.parametrize("options", list(OPTIONS))
@pytest.mark.parametrize("group", [1, 3, 7])
def test_forward_against_reference(options, group, kernels):
    alibi, opts = _split(OPTIONS[options])
    rng = np.random.default_rng(group * 31 + len(options))
    inputs = _inputs(rng, group, 1, 40, alibi=alibi)
    out, lse = run(lambda **a: op.flash_attn_varlen(**a, return_lse=True, **opts), inputs, kernels=kernels)
    want_out, want_lse = ref.flash_attn_varlen(*inputs.values(), return_lse=True, **opts)
    assert_close(out, want_out, "float32", what="out")
    _assert_lse(lse, want_lse)
    tail = sum(LENS_Q)
    assert not out[tail:].any() and np.isneginf(lse[:, tail:]).all()  # rows of no sequence: 0 and -inf


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_half_precision(dtype, kernels):
    rng = np.random.default_rng(7)
    inputs = _inputs(rng, 6, 2, 64, dtype, lens_q=[17, 1, 97], lens_k=[97, 1, 97], alibi=True)
    out = run(lambda **a: op.flash_attn_varlen(**a, causal=True, softcap=8.0), inputs, kernels=kernels)[0]
    want = ref.flash_attn_varlen(*inputs.values(), causal=True, softcap=8.0)
    assert out.dtype == inputs["q"].dtype
    assert_close(out, want, dtype, what="out")


@pytest.mark.skipif(not has_torch(), reason="PyTorch is the peer (the test extra installs it)")
@pytest.mark.parametrize("options", ["full", "causal", "window", "alibi_causal"])
def test_against_torch_sdpa_per_sequence(options, kernels):
    """PyTorch's SDPA on each sequence alone (bottom-right masks and ALiBi as a float mask)."""
    import torch
    import torch.nn.functional as F

    alibi, opts = _split(OPTIONS[options])
    rng = np.random.default_rng(11)
    inputs = _inputs(rng, 6, 2, 40, alibi=alibi, extra_rows=0)
    out = run(lambda **a: op.flash_attn_varlen(**a, **opts), inputs, kernels=kernels)[0]
    cu_q, cu_k = inputs["cu_seqlens_q"], inputs["cu_seqlens_k"]
    for b, (sq, sk) in enumerate(zip(LENS_Q, LENS_K)):
        rows = slice(cu_q[b], cu_q[b + 1])
        if sk == 0:
            assert not out[rows].any()
            continue
        keep = ref.visible_keys(sq, sk, causal=opts.get("causal", False), window_size=opts.get("window_size", (-1, -1)))
        bias = np.where(keep, 0.0, -np.inf)[None]
        if alibi:
            distance = np.abs(np.arange(sq)[:, None] + sk - sq - np.arange(sk)[None, :])
            bias = bias - inputs["alibi_slopes"][:, None, None].astype(np.float64) * distance
        q, k, v = (torch.from_numpy(x).double().transpose(0, 1)[None] for x in
                   (inputs["q"][rows], inputs["k"][cu_k[b]:cu_k[b + 1]], inputs["v"][cu_k[b]:cu_k[b + 1]]))
        want = F.scaled_dot_product_attention(q, k, v, attn_mask=torch.from_numpy(bias), enable_gqa=True)
        want = torch.nan_to_num(want, nan=0.0)[0].transpose(0, 1).numpy()  # a row without keys: 0 here
        assert_close(out[rows], want, "float32", what=f"sequence {b}")


def _loss_module(Hq, Hkv, D, total_q, total_k, n, *, alibi=False, sinks=False, **opts):
    """main(q, k, v, [sinks], w, cu_q, cu_k, [alibi]) -> sum(flash_attn_varlen(...) * w), differentiated
    for q, k, v (and the sinks)."""
    params = dict(q=((total_q, Hq, D), "float32"), k=((total_k, Hkv, D), "float32"),
                  v=((total_k, Hkv, D), "float32"))
    if sinks:
        params["sinks"] = ((Hq,), "float32")
    params.update(w=((total_q, Hq, D), "float32"), cu_q=((n,), "int32"), cu_k=((n,), "int32"))
    if alibi:
        params["alibi"] = ((Hq,), "float32")

    def loss(q, k, v, w, cu_q, cu_k, sinks=None, alibi=None):
        out = op.flash_attn_varlen(q, k, v, cu_q, cu_k, alibi, sinks=sinks, **opts)
        return relax.op.sum(relax.op.multiply(out, w))

    mod = build(loss, params)
    return tvm_fuel.transform.gradient(mod, require_grads=list(mod["main"].params[:4 if sinks else 3]))


@pytest.mark.parametrize("options", ["causal", "two_sided_softcap", "alibi_causal", "sinks"])
@pytest.mark.parametrize("group", [1, 3])
@pytest.mark.parametrize("path", ["decomposed", "tuned"])
def test_gradient(options, group, path):
    """Gradient through flash_attn_varlen gives the reference's dq, dk, dv (and dsinks); on the
    tuned path through the CPU backward kernel (with sinks too: given the sinks' out and lse)."""
    with_sinks = options == "sinks"
    alibi, opts = _split(OPTIONS.get(options, dict(causal=True)))
    rng = np.random.default_rng(group + 3 * len(options))
    Hq, lens_q, lens_k = 2 * group, [17, 0, 97, 1, 3], [33, 5, 97, 1, 0]
    inputs = _inputs(rng, Hq, 2, 40, lens_q=lens_q, lens_k=lens_k, extra_rows=1, alibi=alibi)
    sinks = (rng.standard_normal(Hq) * 2).astype(np.float32) if with_sinks else None
    w = rng.standard_normal(inputs["q"].shape).astype(np.float32)
    mod = _loss_module(Hq, 2, 40, inputs["q"].shape[0], inputs["k"].shape[0], len(lens_q) + 1, alibi=alibi,
                       sinks=with_sinks, **opts)
    args = [inputs["q"], inputs["k"], inputs["v"]] + ([sinks] if with_sinks else [])
    args += [w, inputs["cu_seqlens_q"], inputs["cu_seqlens_k"]] + ([inputs["alibi_slopes"]] if alibi else [])
    _, *grads = _adjoint(mod, args, path)
    want = ref.flash_attn_varlen_backward(inputs["q"], inputs["k"], inputs["v"], w, inputs["cu_seqlens_q"],
                                          inputs["cu_seqlens_k"], inputs.get("alibi_slopes"), sinks=sinks, **opts)
    for name, got, expected in zip(("dq", "dk", "dv", "dsinks"), grads, want):
        assert_close(got, expected, "float32", scale=4, what=name)


BACKWARD_FLOOR, BACKWARD_KERNEL = "fuel_flash_attn_varlen_backward", "fuel_flash_attn_varlen_backward_kernel"


def _legalized(mod, path: str):
    """``mod`` legalized on ``path`` (tuned: for this CPU), and its target; on the tuned path the
    varlen forward (where it runs) and backward ran their CPU kernels, not the floors."""
    target = HOST if path == "tuned" else "llvm"
    legalized = tvm_fuel.transform.legalize(mod, target, kernels=path)
    names = {gv.name_hint for gv in legalized.functions}
    if path == "tuned":
        assert BACKWARD_FLOOR not in names and any(n.startswith(BACKWARD_KERNEL) for n in names), sorted(names)
        assert "fuel_flash_attn_varlen" not in names, sorted(names)
        kernel = next(f for gv, f in legalized.functions.items() if gv.name_hint.startswith(BACKWARD_KERNEL))
        assert str(kernel.attrs["fuel.workload"]).startswith("flash_attn_varlen_backward")
    else:
        assert not any(n.startswith(BACKWARD_KERNEL) for n in names)
    return legalized, target


def _adjoint(mod, args, path: str = "decomposed"):
    legalized, target = _legalized(mod, path)
    vm = relax.VirtualMachine(tvm.compile(legalized, target=target), tvm.cpu())
    loss, grads = vm["main_adjoint"](*[tvm.runtime.tensor(a) for a in args])
    return [loss.numpy()] + [g.numpy() for g in grads]


@pytest.mark.parametrize("state", ["recomputed", pytest.param("given", marks=pytest.mark.quick)])
@pytest.mark.parametrize("path", ["decomposed", "tuned"])
def test_backward_op(state, path):
    """The backward op alone, recomputing the softmax state or given the forward's out and lse (on
    the tuned path the CPU kernel; recomputed: after the varlen forward's kernel)."""
    rng = np.random.default_rng(5)
    inputs = _inputs(rng, 6, 2, 40, lens_q=[17, 1, 0, 97], lens_k=[97, 0, 3, 33], alibi=True)
    inputs["do"] = randn(rng, inputs["q"].shape)
    opts = dict(window_size=(24, 4), softcap=6.0)
    fwd = {k: v for k, v in inputs.items() if k != "do"}
    if state == "given":
        inputs["out"], inputs["lse"] = (x.astype(np.float32) for x in ref.flash_attn_varlen(
            *fwd.values(), return_lse=True, **opts))
    mod = build(lambda q, k, v, do, cu_seqlens_q, cu_seqlens_k, alibi_slopes, **state_args:
                op.flash_attn_varlen_backward(q, k, v, do, cu_seqlens_q, cu_seqlens_k, alibi_slopes, **state_args,
                                              **opts), {name: (a.shape, str(a.dtype)) for name, a in inputs.items()})
    legalized, target = _legalized(mod, path)
    if path == "tuned" and state == "recomputed":  # the forward state from the varlen forward's kernel
        assert "fuel_flash_attn_varlen" not in {gv.name_hint for gv in legalized.functions}
    vm = relax.VirtualMachine(tvm.compile(legalized, target=target), tvm.cpu())
    grads = [g.numpy() for g in vm["main"](*[tvm.runtime.tensor(a) for a in inputs.values()])]
    want = ref.flash_attn_varlen_backward(fwd["q"], fwd["k"], fwd["v"], inputs["do"], fwd["cu_seqlens_q"],
                                          fwd["cu_seqlens_k"], fwd["alibi_slopes"], **opts)
    for name, got, expected in zip(("dq", "dk", "dv"), grads, want):
        assert_close(got, expected, "float32", scale=4, what=name)


def _symbolic_module(**opts):
    total_q, total_k, n = (tvm.tirx.Var(name, "int64") for name in ("total_q", "total_k", "n"))
    return build(lambda q, k, v, cu_q, cu_k: op.flash_attn_varlen(q, k, v, cu_q, cu_k, return_lse=True, **opts),
                 dict(q=((total_q, 6, 40), "float32"), k=((total_k, 2, 40), "float32"),
                      v=((total_k, 2, 40), "float32"), cu_q=((n,), "int32"), cu_k=((n,), "int32")))


def test_symbolic_sizes_serve_any_batch(kernels):
    """One module (symbolic total_q, total_k, B) serves batches of any lengths, B = 1 and empty ones too."""
    runner = Runner(_symbolic_module(causal=True), kernels=kernels)
    rng = np.random.default_rng(2)
    for lens_q, lens_k in ([[5], [9]], [[97, 17, 1], [97, 40, 1]], [[0, 0], [0, 0]], [[4, 2], [0, 7]]):
        inputs = _inputs(rng, 6, 2, 40, lens_q=lens_q, lens_k=lens_k, extra_rows=0)
        out, lse = runner(*inputs.values())
        want_out, want_lse = ref.flash_attn_varlen(*inputs.values(), causal=True, return_lse=True)
        assert_close(out, want_out, "float32", what=f"{lens_q} / {lens_k}")
        _assert_lse(lse, want_lse)


@pytest.mark.parametrize("cu_q,cu_k,match", [
    ([1, 3, 5], [0, 2, 4], "cu_seqlens_q must start at 0"),
    ([0, 4, 3], [0, 2, 4], "cu_seqlens_q must start at 0, never decrease"),
    ([0, 3, 6], [0, 2, 4], "end at most at q.shape"),
    ([0, 3, 5], [0, 5, 4], "cu_seqlens_k must start at 0, never decrease"),
    ([0, 3, 5], [0, 2, 9], "end at most at k.shape"),
])
@pytest.mark.parametrize("path", ["decomposed", "tuned"])
def test_bad_offsets_raise(cu_q, cu_k, match, path):
    runner = Runner(_symbolic_module(), kernels=path)
    rng = np.random.default_rng(0)
    args = [randn(rng, (5, 6, 40)), randn(rng, (4, 2, 40)), randn(rng, (4, 2, 40)), np.array(cu_q, np.int32),
            np.array(cu_k, np.int32)]
    with pytest.raises(Exception, match=match):
        runner(*args)


@pytest.mark.parametrize("dtypes", [("int64", "int64"), ("uint32", "uint32"), ("int32", "int64"), ("int64", "uint32")])
def test_offset_dtypes(dtypes, kernels):
    """int64 (PyTorch's cumsum) and uint32 offsets, alike or mixed: checked, then given to the kernels
    as int32 (``run`` asserts a kernel path ran its kernel); the backward too."""
    rng = np.random.default_rng(8)
    inputs = _inputs(rng, 6, 2, 40, lens_q=[17, 0, 5], lens_k=[9, 3, 5])
    want = ref.flash_attn_varlen(*inputs.values(), causal=True)
    do = randn(rng, inputs["q"].shape)
    want_grads = ref.flash_attn_varlen_backward(inputs["q"], inputs["k"], inputs["v"], do, inputs["cu_seqlens_q"],
                                                inputs["cu_seqlens_k"], causal=True)
    inputs["cu_seqlens_q"] = inputs["cu_seqlens_q"].astype(dtypes[0])
    inputs["cu_seqlens_k"] = inputs["cu_seqlens_k"].astype(dtypes[1])
    assert_close(run(lambda **a: op.flash_attn_varlen(**a, causal=True), inputs, kernels=kernels)[0], want,
                 "float32", what="out")
    grads = run(lambda q, k, v, cu_seqlens_q, cu_seqlens_k, do: op.flash_attn_varlen_backward(
        q, k, v, do, cu_seqlens_q, cu_seqlens_k, causal=True), {**inputs, "do": do}, kernels=kernels)
    for name, got, expected in zip(("dq", "dk", "dv"), grads, want_grads):
        assert_close(got, expected, "float32", scale=4, what=name)


@pytest.mark.parametrize("group", [1, 3, 7])
def test_sinks_on_every_path(group, kernels):
    """Sinks through each path (the kernels: the sink-free kernel's out and lse rescaled; no floor,
    ``legalize_checked``): lengths 0, 1, 17, 97 and 513, causal, a -inf sink (none), a row of a
    sequence without keys (lse = its sink) and rows of no sequence (0, lse -inf)."""
    rng = np.random.default_rng(group + 40)
    inputs = _inputs(rng, group * 2, 2, 40)
    inputs["sinks"] = (rng.standard_normal(group * 2) * 2).astype(np.float32)
    inputs["sinks"][0] = -np.inf
    out, lse = run(lambda sinks, **a: op.flash_attn_varlen(**a, sinks=sinks, causal=True, return_lse=True), inputs,
                   kernels=kernels)
    args = {k: v for k, v in inputs.items() if k != "sinks"}
    want_out, want_lse = ref.flash_attn_varlen(*args.values(), sinks=inputs["sinks"], causal=True, return_lse=True)
    assert_close(out, want_out, "float32", what="out")
    _assert_lse(lse, want_lse)
    tail, keyless = sum(LENS_Q), slice(*_cu(LENS_Q)[5:7])  # the sequence of 3 rows and no keys
    assert not out[tail:].any() and np.isneginf(lse[:, tail:]).all()
    assert not out[keyless].any() and np.array_equal(lse[1:, keyless], np.repeat(inputs["sinks"][1:, None], 3, 1))


@pytest.mark.parametrize("path", ["decomposed", "tuned"])
def test_mixed_offset_dtypes_cannot_wrap_past_the_check(path):
    """An int64 offset past total_k must raise, not wrap into range through a cast to int32 (the
    kernels' dtype)."""
    rng = np.random.default_rng(0)
    mod = build(lambda q, k, v, cu_q, cu_k: op.flash_attn_varlen(q, k, v, cu_q, cu_k),
                dict(q=((7, 2, 8), "float32"), k=((6, 2, 8), "float32"), v=((6, 2, 8), "float32"),
                     cu_q=((3,), "int32"), cu_k=((3,), "int64")))
    q, k = randn(rng, (7, 2, 8)), randn(rng, (6, 2, 8))
    with pytest.raises(Exception, match="cu_seqlens_k must start at 0"):
        Runner(mod, kernels=path)(q, k, k, np.array([0, 3, 5], np.int32), np.array([0, 2, 2 ** 32 + 6], np.int64))


def test_sinks_forward_and_rows_past_the_last_sequence():
    """lse with sinks: sinks[h] for a sequence's row without keys, -inf for a row of no sequence."""
    rng = np.random.default_rng(9)
    inputs = _inputs(rng, 6, 2, 40, lens_q=[17, 3, 5], lens_k=[9, 0, 5], extra_rows=2)
    inputs["sinks"] = (rng.standard_normal(6) * 2).astype(np.float32)
    out, lse = run(lambda sinks, **a: op.flash_attn_varlen(**a, sinks=sinks, causal=True, return_lse=True), inputs)
    args = {k: v for k, v in inputs.items() if k != "sinks"}
    want_out, want_lse = ref.flash_attn_varlen(*args.values(), sinks=inputs["sinks"], causal=True, return_lse=True)
    assert_close(out, want_out, "float32", what="out")
    _assert_lse(lse, want_lse)
    assert np.isneginf(lse[:, -2:]).all() and np.allclose(lse[:, 17:20], inputs["sinks"][:, None])


def test_max_seqlen_is_enforced():
    mod = build(lambda q, k, v, cu_q, cu_k: op.flash_attn_varlen(q, k, v, cu_q, cu_k, max_seqlen_q=3, max_seqlen_k=4),
                dict(q=((6, 2, 8), "float32"), k=((6, 2, 8), "float32"), v=((6, 2, 8), "float32"),
                     cu_q=((3,), "int32"), cu_k=((3,), "int32")))
    runner = Runner(mod)
    rng = np.random.default_rng(0)
    q = randn(rng, (6, 2, 8))
    assert runner(q, q, q, np.array([0, 3, 6], np.int32), np.array([0, 4, 6], np.int32))[0].shape == (6, 2, 8)
    with pytest.raises(Exception, match="longer than max_seqlen_k"):
        runner(q, q, q, np.array([0, 3, 6], np.int32), np.array([0, 1, 6], np.int32))
    with pytest.raises(Exception, match="longer than max_seqlen_q"):
        runner(q, q, q, np.array([0, 2, 6], np.int32), np.array([0, 3, 6], np.int32))


def _var(name, shape, dtype="float32"):
    return relax.Var(name, relax.TensorType(shape, dtype))


@pytest.mark.parametrize("make,error,match", [
    (lambda: op.flash_attn_varlen(_var("q", (5, 6, 40, 1)), _var("k", (4, 2, 40)), _var("v", (4, 2, 40)),
                                  _var("a", (3,), "int32"), _var("b", (3,), "int32")), ValueError,
     "argument 'q' must be 3-D"),
    (lambda: op.flash_attn_varlen(_var("q", (5, 6, 40)), _var("k", (4, 2, 40), "float16"), _var("v", (4, 2, 40)),
                                  _var("a", (3,), "int32"), _var("b", (3,), "int32")), TypeError, "dtype of 'q'"),
    (lambda: op.flash_attn_varlen(_var("q", (5, 6, 40)), _var("k", (4, 4, 40)), _var("v", (4, 4, 40)),
                                  _var("a", (3,), "int32"), _var("b", (3,), "int32")), ValueError, "multiple of Hkv"),
    (lambda: op.flash_attn_varlen(_var("q", (5, 6, 40)), _var("k", (4, 2, 40)), _var("v", (4, 2, 40)),
                                  _var("a", (3,), "int32"), _var("b", (4,), "int32")), ValueError, "cu_seqlens_k"),
    (lambda: op.flash_attn_varlen(_var("q", (5, 6, 40)), _var("k", (4, 2, 40)), _var("v", (4, 2, 40)),
                                  _var("a", (3,), "float32"), _var("b", (3,), "int32")), TypeError, "cu_seqlens_q"),
    (lambda: op.flash_attn_varlen_backward(_var("q", (5, 6, 40)), _var("k", (4, 2, 40)), _var("v", (4, 2, 40)),
                                           _var("do", (5, 6, 40)), _var("a", (3,), "int32"), _var("b", (3,), "int32"),
                                           lse=_var("lse", (5, 6))), ValueError, "lse"),
    (lambda: op.flash_attn_varlen(_var("q", (5, 6, 40)), _var("k", (4, 2, 40)), _var("v", (4, 2, 40)),
                                  _var("a", (3,), "int32"), _var("b", (3,), "int32"), max_seqlen_k=0), ValueError,
     "max_seqlen_k must be a positive int"),
])
def test_bad_calls_name_the_argument(make, error, match):
    with pytest.raises(error, match=match):
        relax.BlockBuilder().normalize(make())


def test_tvmscript_round_trip():
    mod = _symbolic_module(causal=True, softcap=3.0)
    parsed = tvm.script.from_source(mod.script())
    tvm.ir.assert_structural_equal(parsed, mod)


@pytest.mark.parametrize("cu_q,cu_k", [([0, 3], [2, 2]), ([2, 1], [0, 4]), ([0, 9], [3, 1]), ([5, 5], [0, 0])])
def test_floor_reads_in_bounds_on_malformed_offsets(cu_q, cu_k):
    """GPU builds run the floor without the offsets' check: every index it reads from them is clamped,
    so malformed offsets give finite values (the backward's dk, dv of a key row outside its
    sequence's columns 0), never a read outside a tensor (here: of an empty score tensor)."""
    from tvm import te

    from tvm_fuel.op import ragged
    from tvm_fuel.op.config import AttnConfig

    TQ, TK, Hq, Hkv, D = 4, 2, 2, 1, 8
    max_q, max_k = tvm.tirx.Var("max_q", "int64"), tvm.tirx.Var("max_k", "int64")
    q, do = te.placeholder((TQ, Hq, D), name="q"), te.placeholder((TQ, Hq, D), name="do")
    k, v = te.placeholder((TK, Hkv, D), name="k"), te.placeholder((TK, Hkv, D), name="v")
    cq, ck = te.placeholder((2,), "int32", name="cq"), te.placeholder((2,), "int32", name="ck")
    grads = ragged.flash_attn_varlen_backward(q, k, v, do, cq, ck, cfg=AttnConfig(), max_q=max_q, max_k=max_k)
    func = te.create_prim_func([q, k, v, do, cq, ck, *grads, max_q, max_k])
    lib = tvm.compile(tvm.IRModule({"main": func}), target="llvm")
    rng = np.random.default_rng(0)
    arrays = [randn(rng, (TQ, Hq, D)), randn(rng, (TK, Hkv, D)), randn(rng, (TK, Hkv, D)), randn(rng, (TQ, Hq, D)),
              np.array(cu_q, np.int32), np.array(cu_k, np.int32)]
    outs = [np.full(s, np.nan, np.float32) for s in ((TQ, Hq, D), (TK, Hkv, D), (TK, Hkv, D))]
    longest = [min(max(b - a, 0), total) for (a, b), total in ((cu_q, TQ), (cu_k, TK))]
    tensors = [tvm.runtime.tensor(a) for a in arrays + outs]
    lib["main"](*tensors, *longest)
    for t in tensors[-3:]:
        assert np.isfinite(t.numpy()).all()
    if cu_k[1] <= cu_k[0]:  # no sequence has a key: no key row gets a gradient (none is read)
        assert not tensors[-2].numpy().any() and not tensors[-1].numpy().any()
