"""Forward mode (``flash_attn_jvp``) and the backward's VJP (``flash_attn_double_backward``)
against their float64 references, on a covering matrix: GQA groups 1/3/7, head dims 40/64/128,
lengths 1/17/97 (Sq > Sk with causal: fully masked rows, which give 0), every mask kind, softcap,
ALiBi, absent tangents and cotangents, the forward's out/lse given or recomputed, three dtypes.
Also the type rules' rejections and the run-time dim check of a symbolic shape."""

from __future__ import annotations

import numpy as np
import pytest
import tvm
from helpers import HOST, Runner, assert_close, build, randn
from tvm import relax, tirx

import tvm_fuel
from tvm_fuel import op
from tvm_fuel import reference as ref

pytestmark = pytest.mark.numerics

# the lowering paths each case runs on (helpers.run's ``kernels``); a kernel path joins by its name
PATHS = ["decomposed", "tuned"]  # the floor, and the CPU kernels (a floor fallback fails the run)

OPTIONS = {
    "plain": dict(),
    "causal": dict(causal=True),
    "window": dict(window_size=(3, 1)),
    "softcap": dict(softcap=2.0, causal=True),
    "alibi": dict(alibi=True),
    "bool_mask": dict(mask="bool"),
    "additive_mask": dict(mask="additive"),
}

# (B, Hq, Hkv, Sq, Sk, D), option, the tangents / cotangents present, the forward state given
# (double backward) or return_lse (jvp); a covering matrix, not a product
DIRECTIONS = ("q", "k", "v")
CASES = [
    ((2, 3, 1, 17, 17, 40), "plain", "qkv", ""),
    ((1, 7, 1, 1, 97, 64), "causal", "qkv", "out,lse"),
    ((1, 1, 1, 97, 17, 128), "causal", "qkv", ""),  # rows i < 80 see no key
    ((1, 6, 2, 17, 97, 40), "window", "q", "lse"),
    ((1, 3, 1, 97, 97, 64), "softcap", "qkv", "out"),
    ((2, 7, 1, 1, 17, 40), "alibi", "v", ""),
    ((1, 3, 1, 17, 1, 64), "window", "qkv", "out"),  # one key, seen by rows 15 and 16 only
    ((1, 3, 3, 17, 17, 40), "bool_mask", "k", "out,lse"),
    ((1, 6, 2, 97, 17, 64), "additive_mask", "qv", ""),
    ((1, 3, 1, 17, 17, 40), "plain", "", "lse"),
    ((1, 7, 1, 17, 97, 128), "softcap", "qk", "lse"),
]


def _case_id(case):
    shape, option, present, state = case
    return "B{}Hq{}Hkv{}Sq{}Sk{}D{}".format(*shape) + f"-{option}-dir[{present}]-state[{state}]"


def _inputs(rng, shape, option, dtype):
    """(q, k, v, do) and the op's extra arguments (alibi_slopes, attn_mask) and options."""
    B, Hq, Hkv, Sq, Sk, D = shape
    x = dict(q=randn(rng, (B, Hq, Sq, D), dtype), k=randn(rng, (B, Hkv, Sk, D), dtype),
             v=randn(rng, (B, Hkv, Sk, D), dtype), do=randn(rng, (B, Hq, Sq, D), dtype))
    spec = OPTIONS[option]
    options = {k: v for k, v in spec.items() if k not in ("alibi", "mask")}
    extra = {}
    if spec.get("alibi"):
        extra["alibi_slopes"] = (rng.random(Hq) * 0.3).astype(np.float32)
    if spec.get("mask") == "bool":
        mask = rng.random((B, 1, Sq, Sk)) < 0.7
        mask[:, :, 0] = False  # a fully masked row
        extra["attn_mask"] = mask
    elif spec.get("mask") == "additive":
        mask = rng.standard_normal((Sq, Sk)).astype(np.float32)
        mask[rng.random((Sq, Sk)) < 0.2] = -np.inf
        mask[1] = -np.inf  # a fully masked row
        extra["attn_mask"] = mask
    return x, extra, options


def _directions(rng, x, present, dtype, names):
    """The tangents (or cotangents) named ``names`` (like q, k, v), only those in ``present``."""
    return {name: randn(rng, x[src].shape, dtype) for src, name in zip(DIRECTIONS, names) if src in present}


def _empty_rows(x, extra, options):
    """Bool [B, Hq, Sq]: the rows that see no key (the reference's lse is -inf); some case of each
    mask kind has one (causal with Sq > Sk, a window past the keys, a masked row)."""
    _, lse = ref.flash_attn(x["q"], x["k"], x["v"], extra.get("alibi_slopes"), extra.get("attn_mask"),
                            return_lse=True, **options)
    return np.isneginf(lse)


def _check_double_backward(case, dtype, kernels, scale):
    shape, option, present, state = case
    rng = np.random.default_rng(sum(shape) + len(option))
    x, extra, options = _inputs(rng, shape, option, dtype)
    bars = _directions(rng, x, present, dtype, ("dq_bar", "dk_bar", "dv_bar"))
    out, lse = ref.flash_attn(x["q"], x["k"], x["v"], extra.get("alibi_slopes"), extra.get("attn_mask"),
                              return_lse=True, **options)
    given = {name: value for name, value in (("out", out.astype(x["q"].dtype)), ("lse", lse.astype(np.float32)))
             if name in state.split(",")}
    got = Runner(build(lambda **a: op.flash_attn_double_backward(**a, **options),
                       {n: (a.shape, str(a.dtype)) for n, a in {**x, **bars, **extra, **given}.items()}),
                 HOST, kernels=kernels)(*{**x, **bars, **extra, **given}.values())
    want = ref.flash_attn_double_backward(*x.values(), bars.get("dq_bar"), bars.get("dk_bar"), bars.get("dv_bar"),
                                          extra.get("alibi_slopes"), extra.get("attn_mask"), **options)
    for name, g, w, like in zip(("q_grad", "k_grad", "v_grad", "do_grad"), got, want, ("q", "k", "v", "do")):
        assert g.dtype == x[like].dtype and g.shape == x[like].shape, name
        assert_close(g, w, dtype, scale=scale, what=name)
    empty = _empty_rows(x, extra, options)
    assert np.all(got[0][empty] == 0) and np.all(got[3][empty] == 0)  # exactly, as the backward's rows
    return got


def _check_jvp(case, dtype, kernels, scale):
    shape, option, present, state = case
    rng = np.random.default_rng(sum(shape) + 2 * len(option))
    x, extra, options = _inputs(rng, shape, option, dtype)
    del x["do"]
    dots = _directions(rng, x, present, dtype, ("q_dot", "k_dot", "v_dot"))
    return_lse = bool(state)
    got = Runner(build(lambda **a: op.flash_attn_jvp(**a, **options, return_lse=return_lse),
                       {n: (a.shape, str(a.dtype)) for n, a in {**x, **dots, **extra}.items()}),
                 HOST, kernels=kernels)(*{**x, **dots, **extra}.values())
    want = ref.flash_attn_jvp(*x.values(), dots.get("q_dot"), dots.get("k_dot"), dots.get("v_dot"),
                              extra.get("alibi_slopes"), extra.get("attn_mask"), return_lse=return_lse, **options)
    assert len(got) == (3 if return_lse else 2)
    for name, g, w in zip(("out", "out_dot"), got, want):
        assert g.dtype == x["q"].dtype and g.shape == x["q"].shape, name
        assert_close(g, w, dtype, scale=scale, what=name)
    if return_lse:
        assert got[2].dtype == np.float32 and got[2].shape == x["q"].shape[:3]
        np.testing.assert_allclose(got[2], want[2], atol=1e-5, rtol=1e-5, err_msg="lse")  # -inf rows agree exactly
    empty = _empty_rows(x, extra, options)
    assert np.all(got[0][empty] == 0) and np.all(got[1][empty] == 0)
    if return_lse:
        assert np.all(np.isneginf(got[2][empty]))
    return got


@pytest.mark.parametrize("kernels", PATHS)
@pytest.mark.parametrize("case", CASES, ids=_case_id)
def test_double_backward_matches_reference(case, kernels):
    _check_double_backward(case, "float32", kernels, scale=5.0)


@pytest.mark.parametrize("kernels", PATHS)
@pytest.mark.parametrize("case", CASES, ids=_case_id)
def test_jvp_matches_reference(case, kernels):
    _check_jvp(case, "float32", kernels, scale=5.0)


LOW_PRECISION = [
    ("float16", ((1, 7, 1, 17, 33, 64), "softcap", "qkv", "out,lse")),
    ("bfloat16", ((2, 3, 1, 17, 17, 40), "causal", "qk", "")),
]


@pytest.mark.parametrize("kernels", PATHS)
@pytest.mark.parametrize("dtype,case", LOW_PRECISION, ids=[d for d, _ in LOW_PRECISION])
def test_low_precision(dtype, case, kernels):
    # inputs are rounded alike for the reference; the outputs' rounding (and out's, entering D) is left
    _check_double_backward(case, dtype, kernels, scale=2.0)
    _check_jvp(case, dtype, kernels, scale=2.0)


def test_double_backward_without_cotangents_is_zero():
    """No dq_bar, dk_bar, dv_bar: every gradient is exactly 0 (no term is built)."""
    got = _check_double_backward(((1, 3, 1, 17, 17, 40), "causal", "", ""), "float32", PATHS[0], scale=1.0)
    assert all(np.all(g == 0) for g in got)


# --- type inference and the run-time dim check -------------------------------------------------------


def _var(name, shape, dtype="float32"):
    return relax.Var(name, relax.TensorType(shape, dtype))


def _qkv(dtype="float32"):
    return _var("q", (2, 8, 17, 64), dtype), _var("k", (2, 2, 97, 64), dtype), _var("v", (2, 2, 97, 64), dtype)


def _infer(call):
    return relax.BlockBuilder().normalize(call).ty


def test_result_types():
    q, k, v = _qkv("float16")
    do = _var("do", (2, 8, 17, 64), "float16")
    ty = _infer(op.flash_attn_double_backward(q, k, v, do, dv_bar=_var("dv_bar", (2, 2, 97, 64), "float16")))
    assert [str(t.dtype) for t in ty.fields] == ["float16"] * 4
    assert [list(t.shape.values) for t in ty.fields] == [[2, 8, 17, 64], [2, 2, 97, 64], [2, 2, 97, 64],
                                                          [2, 8, 17, 64]]
    ty = _infer(op.flash_attn_jvp(q, k, v, q_dot=_var("q_dot", (2, 8, 17, 64), "float16"), return_lse=True))
    assert [str(t.dtype) for t in ty.fields] == ["float16", "float16", "float32"]
    assert list(ty.fields[2].shape.values) == [2, 8, 17]
    assert len(_infer(op.flash_attn_jvp(q, k, v)).fields) == 2


BAD = [
    ("dq_bar shape", lambda: op.flash_attn_double_backward(*_qkv(), _var("do", (2, 8, 17, 64)),
                                                           _var("dq_bar", (2, 8, 16, 64))),
     ValueError, r"fuel\.flash_attn_double_backward: argument 'dq_bar' must have shape \[B, Hq, Sq, D\] of q = "
                 r"\[2, 8, 17, 64\], got \[2, 8, 16, 64\]"),
    ("dk_bar shape", lambda: op.flash_attn_double_backward(*_qkv(), _var("do", (2, 8, 17, 64)),
                                                           dk_bar=_var("dk_bar", (2, 8, 97, 64))),
     ValueError, r"fuel\.flash_attn_double_backward: argument 'dk_bar' must have shape \[B, Hkv, Sk, D\] of k"),
    ("dv_bar dtype", lambda: op.flash_attn_double_backward(*_qkv(), _var("do", (2, 8, 17, 64)),
                                                           dv_bar=_var("dv_bar", (2, 2, 97, 64), "float16")),
     TypeError, r"fuel\.flash_attn_double_backward: argument 'dv_bar' must have the dtype of 'q' \(float32\)"),
    ("lse shape", lambda: op.flash_attn_double_backward(*_qkv(), _var("do", (2, 8, 17, 64)),
                                                        lse=_var("lse", (2, 8, 16))),
     ValueError, r"fuel\.flash_attn_double_backward: argument 'lse' must have shape \[B, Hq, Sq\] of q"),
    ("k_dot dtype", lambda: op.flash_attn_jvp(*_qkv(), k_dot=_var("k_dot", (2, 2, 97, 64), "bfloat16")),
     TypeError, r"fuel\.flash_attn_jvp: argument 'k_dot' must have the dtype of 'q' \(float32\), got bfloat16"),
    ("q_dot rank", lambda: op.flash_attn_jvp(*_qkv(), q_dot=_var("q_dot", (2, 8, 17))),
     ValueError, r"fuel\.flash_attn_jvp: argument 'q_dot' must be 4-D \[B, Hq, Sq, D\]"),
    ("v_dot shape", lambda: op.flash_attn_jvp(*_qkv(), v_dot=_var("v_dot", (2, 2, 96, 64))),
     ValueError, r"fuel\.flash_attn_jvp: argument 'v_dot' must have shape \[B, Hkv, Sk, D\] of k"),
    ("return_lse", lambda: op.flash_attn_jvp(*_qkv(), return_lse=1),
     TypeError, r"fuel\.flash_attn_jvp: return_lse must be a bool"),
]


@pytest.mark.parametrize("make,error,message", [c[1:] for c in BAD], ids=[c[0] for c in BAD])
def test_rejects(make, error, message):
    with pytest.raises(error, match=message):
        _infer(make())


def test_symbolic_cotangent_length_checked_at_run_time():
    """dk_bar with its own symbolic key length: equal lengths run, unequal ones raise before any read."""
    s, t = tirx.Var("s", "int64"), tirx.Var("t", "int64")
    kv = ((1, 1, s, 16), "float32")
    shapes = dict(q=((1, 3, 5, 16), "float32"), k=kv, v=kv, do=((1, 3, 5, 16), "float32"),
                  dk_bar=((1, 1, t, 16), "float32"))
    runner = Runner(build(lambda q, k, v, do, dk_bar: op.flash_attn_double_backward(q, k, v, do, dk_bar=dk_bar),
                          shapes), HOST)
    rng = np.random.default_rng(3)
    q, do = randn(rng, (1, 3, 5, 16)), randn(rng, (1, 3, 5, 16))
    k, v, dk_bar = (randn(rng, (1, 1, 7, 16)) for _ in range(3))
    got = runner(q, k, v, do, dk_bar)
    want = ref.flash_attn_double_backward(q, k, v, do, None, dk_bar, None)
    for g, w in zip(got, want):
        assert_close(g, w, "float32", scale=5.0)
    with pytest.raises(ValueError, match=r"fuel\.flash_attn_double_backward: the key length Sk of 'dk_bar'"):
        runner(q, k, v, do, randn(rng, (1, 1, 6, 16)))


# --- the Relax layers around them --------------------------------------------------------------------


def _both_ops_module():
    """main(q, k, v, do, dq_bar, k_dot) -> (double backward, jvp with lse), GQA 3, causal."""
    t, kv = ((1, 3, 5, 16), "float32"), ((1, 1, 7, 16), "float32")

    def make(q, k, v, do, dq_bar, k_dot):
        return relax.Tuple([op.flash_attn_double_backward(q, k, v, do, dq_bar, causal=True),
                            op.flash_attn_jvp(q, k, v, k_dot=k_dot, causal=True, return_lse=True)])

    return build(make, dict(q=t, k=kv, v=kv, do=t, dq_bar=t, k_dot=kv))


def test_printed_module_parses_back():
    mod = _both_ops_module()
    text = mod.script()
    assert "R.fuel.flash_attn_double_backward(" in text and "R.fuel.flash_attn_jvp(" in text
    tvm.ir.assert_structural_equal(mod, tvm.script.from_source(text))


def test_expand_attention_keeps_them_and_they_run():
    """They are already the fused derivatives: ExpandAttention leaves both calls as they are."""
    mod = _both_ops_module()
    expanded = tvm_fuel.transform.ExpandAttention()(mod)
    text = expanded.script()
    assert "R.fuel.flash_attn_double_backward(" in text and "R.fuel.flash_attn_jvp(" in text
    rng = np.random.default_rng(5)
    x = dict(q=randn(rng, (1, 3, 5, 16)), k=randn(rng, (1, 1, 7, 16)), v=randn(rng, (1, 1, 7, 16)),
             do=randn(rng, (1, 3, 5, 16)), dq_bar=randn(rng, (1, 3, 5, 16)), k_dot=randn(rng, (1, 1, 7, 16)))
    got = Runner(expanded, HOST)(*x.values())
    want = [*ref.flash_attn_double_backward(x["q"], x["k"], x["v"], x["do"], x["dq_bar"], causal=True),
            *ref.flash_attn_jvp(x["q"], x["k"], x["v"], None, x["k_dot"], None, causal=True, return_lse=True)]
    assert len(got) == len(want) == 7
    for g, w in zip(got, want):
        assert_close(g, w, "float32", scale=5.0)
