"""Misuse that must fail cleanly or not matter, on the floor, the CPU kernels and the CUDA kernels'
emulation (the ``kernels`` fixture): symbolic dims that disagree at run time raise before any
read; NaN and Inf follow the NaN rule (README, "Non-finite inputs")."""

from __future__ import annotations

import functools

import numpy as np
import pytest
from helpers import HOST, NP_DTYPE, Runner, build, randn
from tvm import tirx

import tvm_fuel
from tvm_fuel import op

pytestmark = pytest.mark.numerics

# --- run-time dim checks ---------------------------------------------------------------------------


def _var(name):
    return tirx.Var(name, "int64")


def test_flash_attn_key_lengths_checked_at_run_time(kernels):
    """k and v with separately symbolic key lengths: equal ones run, unequal ones raise (the floor
    read v past its end with m = 32, n = 2 and returned garbage)."""
    m, n = _var("m"), _var("n")
    runner = Runner(build(lambda q, k, v: op.flash_attn(q, k, v),
                          dict(q=((1, 4, 8, 16), "float32"), k=((1, 2, m, 16), "float32"),
                               v=((1, 2, n, 16), "float32"))), HOST, kernels=kernels)
    rng = np.random.default_rng(0)
    q = randn(rng, (1, 4, 8, 16))
    (out,) = runner(q, randn(rng, (1, 2, 5, 16)), randn(rng, (1, 2, 5, 16)))
    assert out.shape == (1, 4, 8, 16)
    with pytest.raises(ValueError, match=r"fuel\.flash_attn: the key length Sk of 'v' \(v\.shape\[2\]\) must "
                                         r"equal that of 'k' \(k\.shape\[2\]\)"):
        runner(q, randn(rng, (1, 2, 32, 16)), randn(rng, (1, 2, 2, 16)))


def test_backward_query_length_of_do_checked(kernels):
    s, t = _var("s"), _var("t")
    shapes = dict(q=((1, 2, s, 16), "float32"), k=((1, 2, s, 16), "float32"), v=((1, 2, s, 16), "float32"),
                  do=((1, 2, t, 16), "float32"))
    runner = Runner(build(lambda q, k, v, do: op.flash_attn_backward(q, k, v, do), shapes), HOST, kernels=kernels)
    rng = np.random.default_rng(1)
    qkv = [randn(rng, (1, 2, 7, 16)) for _ in range(3)]
    assert len(runner(*qkv, randn(rng, (1, 2, 7, 16)))) == 3
    with pytest.raises(ValueError, match=r"fuel\.flash_attn_backward: the query length Sq of 'do'"):
        runner(*qkv, randn(rng, (1, 2, 3, 16)))


def test_paged_v_cache_with_fewer_blocks_raises(kernels):
    """Block ids are validated against k_cache; v_cache must then have as many blocks."""
    nk, nv = _var("num_blocks"), _var("v_blocks")
    shapes = dict(q=((1, 2, 1, 16), "float32"), k_cache=((nk, 4, 1, 16), "float32"),
                  v_cache=((nv, 4, 1, 16), "float32"), block_table=((1, 3), "int32"), context_lens=((1,), "int32"))
    runner = Runner(build(lambda **a: op.paged_attn(**a), shapes), HOST, kernels=kernels)
    rng = np.random.default_rng(2)
    q, table, lens = randn(rng, (1, 2, 1, 16)), np.array([[5, 1, 7]], "int32"), np.array([12], "int32")
    (out,) = runner(q, randn(rng, (8, 4, 1, 16)), randn(rng, (8, 4, 1, 16)), table, lens)
    assert np.isfinite(out).all()
    with pytest.raises(ValueError, match=r"fuel\.paged_attn: the block count num_blocks of 'v_cache'"):
        runner(q, randn(rng, (8, 4, 1, 16)), randn(rng, (2, 4, 1, 16)), table, lens)


def test_softmax_backward_dims_checked():
    n, m = _var("n"), _var("m")
    runner = Runner(build(lambda p, dp: op.softmax_backward(p, dp),
                          dict(p=((2, n), "float32"), dp=((2, m), "float32"))), HOST)
    with pytest.raises(ValueError, match=r"fuel\.softmax_backward: the dim 1 of 'dprobs'"):
        runner(np.ones((2, 9), "float32"), np.ones((2, 4), "float32"))


def test_no_check_where_type_inference_proved_the_dims():
    """Static (or identical symbolic) dims need no run-time check: none is emitted."""
    s = _var("s")
    shapes = dict(q=((1, 4, s, 16), "float32"), k=((1, 2, s, 16), "float32"), v=((1, 2, s, 16), "float32"))
    for kernels in ("decomposed", "tuned"):
        mod = tvm_fuel.transform.legalize(build(lambda q, k, v: op.flash_attn(q, k, v), shapes), HOST, kernels=kernels)
        assert not [gv.name_hint for gv in mod.functions if "check_dims" in gv.name_hint]


# --- the NaN rule ----------------------------------------------------------------------------------

B, HQ, HKV, D = 1, 2, 1, 16


def _dense(rng, sq, sk, dtype="float32"):
    return [randn(rng, shape, dtype) for shape in ((B, HQ, sq, D), (B, HKV, sk, D), (B, HKV, sk, D), (B, HQ, sq, D))]


def _forward_runner(kernels, sq, sk, options, mask_dtype=None, dtype="float32"):
    shapes = dict(q=((B, HQ, sq, D), dtype), k=((B, HKV, sk, D), dtype), v=((B, HKV, sk, D), dtype))
    if mask_dtype is None:
        return Runner(build(lambda q, k, v: op.flash_attn(q, k, v, return_lse=True, **options), shapes), HOST,
                      kernels=kernels)
    shapes["mask"] = ((sq, sk), mask_dtype)
    return Runner(build(lambda q, k, v, mask: op.flash_attn(q, k, v, None, mask, return_lse=True, **options),
                        shapes), HOST, kernels=kernels)


def _backward_runner(kernels, sq, sk, options, mask_dtype=None, dtype="float32"):
    shapes = dict(q=((B, HQ, sq, D), dtype), k=((B, HKV, sk, D), dtype), v=((B, HKV, sk, D), dtype),
                  do=((B, HQ, sq, D), dtype))
    if mask_dtype is None:
        return Runner(build(lambda q, k, v, do: op.flash_attn_backward(q, k, v, do, **options), shapes), HOST,
                      kernels=kernels)
    shapes["mask"] = ((sq, sk), mask_dtype)
    return Runner(build(lambda q, k, v, do, mask: op.flash_attn_backward(q, k, v, do, None, mask, **options),
                        shapes), HOST, kernels=kernels)


def _rows_with_nan(x):
    """[heads, rows] -> bool: the (head, row) pairs holding a NaN."""
    return np.isnan(x[0]).any(axis=-1) if x.ndim == 4 else np.isnan(x[0])


@pytest.mark.parametrize("tensor,dtype", [("q", "float32"), ("k", "float32"), ("v", "float32"), ("v", "bfloat16")])
def test_nan_reaches_exactly_the_rows_that_see_it(kernels, tensor, dtype):
    """Causal, GQA group 2: a NaN at key (or query) 9 makes NaN exactly the rows that see it (both
    heads of the group read the KV head); every other row is bit-identical to the clean run; the
    lse is NaN where q or k is (v does not enter it)."""
    sq = sk = 17
    forward = _forward_runner(kernels, sq, sk, dict(causal=True), dtype=dtype)

    def runner(*args):
        return [x.astype(np.float32) for x in forward(*args)]

    q, k, v, _ = _dense(np.random.default_rng(3), sq, sk, dtype)
    clean_out, clean_lse = runner(q, k, v)
    dirty = dict(q=q.copy(), k=k.copy(), v=v.copy())
    if tensor == "q":
        dirty["q"][0, 1, 9, 4] = np.nan
        expected = np.zeros((HQ, sq), bool)
        expected[1, 9] = True
    else:
        dirty[tensor][0, 0, 9, 4] = np.nan
        sees = tvm_fuel.reference.visible_keys(sq, sk, causal=True)[:, 9]
        expected = np.broadcast_to(sees, (HQ, sq))
    out, lse = runner(dirty["q"], dirty["k"], dirty["v"])
    np.testing.assert_array_equal(_rows_with_nan(out), expected)
    np.testing.assert_array_equal(_rows_with_nan(lse), expected if tensor != "v" else np.zeros_like(expected))
    np.testing.assert_array_equal(out[0][~expected], clean_out[0][~expected])
    np.testing.assert_array_equal(lse[0][~expected], clean_lse[0][~expected])


# (options, Sq, Sk, mask dtype, a mask that hides key 3 from every row or None, keys no row sees)
_HIDDEN = {
    "window": (dict(window_size=(4, 0)), 8, 24, None, [0, 3, 11]),  # row 0 sees keys 12..16
    "bool mask": (dict(), 9, 20, "bool", [3, 19]),
    "additive -inf": (dict(), 9, 20, "float32", [3, 19]),
}


@functools.cache
def _hidden_runners(kernels: str, case: str, dtype: str):
    """The forward and backward runners of a ``_HIDDEN`` case (built once for every poison value)."""
    options, sq, sk, mask_dtype, _ = _HIDDEN[case]
    return (_forward_runner(kernels, sq, sk, options, mask_dtype, dtype),
            _backward_runner(kernels, sq, sk, options, mask_dtype, dtype))


def _mask(mask_dtype, sq, sk, hidden):
    if mask_dtype is None:
        return []
    rng = np.random.default_rng(4)
    if mask_dtype == "bool":
        mask = rng.random((sq, sk)) < 0.8
        mask[:, hidden] = False
    else:
        mask = (rng.standard_normal((sq, sk)) * 0.5).astype("float32")
        mask[:, hidden] = -np.inf
    return [mask]


@pytest.mark.parametrize("case", sorted(_HIDDEN))
@pytest.mark.parametrize("dtype,poison", [("float32", np.nan), ("float32", np.inf), ("float32", -np.inf),
                                          ("bfloat16", np.nan), ("bfloat16", -np.inf)])
def test_keys_no_row_sees_never_matter(kernels, case, dtype, poison):
    """NaN or Inf in K and V at keys every row drops (outside the window, masked by a bool mask
    or a -inf additive mask) leave out, lse, dq, dk and dv bit-identical to the clean run
    (bfloat16: the CUDA kernels' tensor-core path)."""
    options, sq, sk, mask_dtype, hidden = _HIDDEN[case]
    q, k, v, do = _dense(np.random.default_rng(5), sq, sk, dtype)
    mask = _mask(mask_dtype, sq, sk, hidden)
    forward, backward = _hidden_runners(kernels, case, dtype)
    k_dirty, v_dirty = k.copy(), v.copy()
    k_dirty[:, :, hidden, ::3] = poison
    v_dirty[:, :, hidden, 1::2] = poison
    for clean, dirty in zip(forward(q, k, v, *mask) + backward(q, k, v, do, *mask),
                            forward(q, k_dirty, v_dirty, *mask) + backward(q, k_dirty, v_dirty, do, *mask)):
        assert not np.isnan(clean.astype(np.float32)).any()
        np.testing.assert_array_equal(dirty.astype(np.float32), clean.astype(np.float32))


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_causal_future_keys_and_a_nan_row_of_do(kernels, dtype):
    """Causal: NaN in K and V at key 12 leaves the rows before it (out, lse, dq) bit-identical;
    a NaN row of do reaches only that row's dq and the dk, dv of the keys the row sees."""
    sq = sk = 17
    q, k, v, do = (x.astype(np.float32) for x in _dense(np.random.default_rng(6), sq, sk, dtype))
    forward = _forward_runner(kernels, sq, sk, dict(causal=True), dtype=dtype)
    backward = _backward_runner(kernels, sq, sk, dict(causal=True), dtype=dtype)
    q, k, v, do = (x.astype(NP_DTYPE[dtype]) for x in (q, k, v, do))

    def f32(results):
        return [r.astype(np.float32) for r in results]

    forward_, backward_ = forward, backward
    forward = lambda *a: f32(forward_(*a))  # noqa: E731
    backward = lambda *a: f32(backward_(*a))  # noqa: E731
    clean = forward(q, k, v) + backward(q, k, v, do)
    k_dirty, v_dirty = k.copy(), v.copy()
    k_dirty[0, 0, 12, :] = np.nan
    v_dirty[0, 0, 12, 5] = np.inf
    dirty = forward(q, k_dirty, v_dirty) + backward(q, k_dirty, v_dirty, do)
    for name, before, after in zip(("out", "lse", "dq"), (clean[0], clean[1], clean[2]),
                                   (dirty[0], dirty[1], dirty[2])):
        np.testing.assert_array_equal(after[:, :, :12], before[:, :, :12], err_msg=name)
        # rows 12.. see key 12: out, lse and dq are NaN there (every column: the NaN is in k)
        assert np.isnan(after[:, :, 12:]).all(), name
    do_dirty = do.copy()
    do_dirty[0, 1, 6, :] = np.nan
    dq, dk, dv = backward(q, k, v, do_dirty)
    rows = np.ones((HQ, sq), bool)
    rows[1, 6] = False
    np.testing.assert_array_equal(dq[0][rows], clean[2][0][rows])
    assert np.isnan(dq[0, 1, 6]).all()
    for before, after in ((clean[3], dk), (clean[4], dv)):
        np.testing.assert_array_equal(after[:, :, 7:], before[:, :, 7:])  # row 6 sees keys 0..6
        assert np.isnan(after[:, :, :7]).any(axis=-1).all()


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_paged_slots_no_row_sees_never_matter(kernels, dtype):
    """Paged decode and multi-query with a window: NaN in the cache at slots past context_lens
    (in the last live block) and left of the window leaves the output bit-identical."""
    block, blocks = 4, 8
    rng = np.random.default_rng(7)
    table = np.array([[5, 2, 7, 1], [3, 0, 6, 4]], "int32")
    lens = np.array([14, 9], "int32")
    for sq in (1, 5):
        shapes = dict(q=((2, HQ, sq, D), dtype), k_cache=((blocks, block, HKV, D), dtype),
                      v_cache=((blocks, block, HKV, D), dtype), block_table=((2, 4), "int32"),
                      context_lens=((2,), "int32"))
        runner = Runner(build(lambda **a: op.paged_attn(**a, causal=True, window_size=(3, 0)), shapes), HOST,
                        kernels=kernels)
        q = randn(rng, (2, HQ, sq, D), dtype)
        k_cache, v_cache = randn(rng, (blocks, block, HKV, D), dtype), randn(rng, (blocks, block, HKV, D), dtype)
        (clean,) = runner(q, k_cache, v_cache, table, lens)
        k_dirty, v_dirty = k_cache.copy(), v_cache.copy()
        # sequence 0: tokens 14, 15 are past its length (block 1, slots 2, 3); token 2 (block 5,
        # slot 2) is left of every row's window; sequence 1: token 0 (block 3, slot 0)
        for blk, slot in ((1, 2), (1, 3), (5, 2), (3, 0)):
            k_dirty[blk, slot] = np.nan
            v_dirty[blk, slot] = np.nan
        (dirty,) = runner(q, k_dirty, v_dirty, table, lens)
        assert not np.isnan(clean.astype(np.float32)).any()
        np.testing.assert_array_equal(dirty.astype(np.float32), clean.astype(np.float32))


def test_nan_key_reaches_only_the_key_gradients_of_rows_that_see_it(kernels):
    """Window (4, 0): a NaN at key 12 reaches rows 12..15, which see keys 8..15; dk and dv of keys
    0..7 (seen only by rows that never see key 12) stay bit-identical, on every path and in the
    reference (a dropped key's weight is 0 even where the row's lse is NaN)."""
    sq = sk = 16
    options = dict(window_size=(4, 0))
    q, k, v, do = _dense(np.random.default_rng(8), sq, sk)
    k_dirty = k.copy()
    k_dirty[0, 0, 12, :] = np.nan
    backward = _backward_runner(kernels, sq, sk, options)
    clean, dirty = backward(q, k, v, do), backward(q, k_dirty, v, do)
    want = tvm_fuel.reference.flash_attn_backward(q, k_dirty, v, do, **options)
    for name, before, after, reference in zip(("dq", "dk", "dv"), clean, dirty, want):
        if name == "dq":
            np.testing.assert_array_equal(after[:, :, :12], before[:, :, :12], err_msg=name)
            continue
        np.testing.assert_array_equal(after[:, :, :8], before[:, :, :8], err_msg=name)
        assert np.isnan(after[:, :, 8:]).any(axis=-1).all(), name
        assert not np.isnan(reference[:, :, :8]).any() and np.isnan(reference[:, :, 8:]).any(axis=-1).all(), name


# --- no keys at all ---------------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["flash_attn", "flash_attn_backward", "flash_attn_jvp", "flash_attn_double_backward"])
@pytest.mark.parametrize("options", [dict(), dict(causal=True, softcap=2.0)], ids=["plain", "causal-softcap"])
def test_no_keys_gives_empty_rows_in_the_reference_and_compiled(kernels, name, options):
    """Issue 29, item 7: Sk = 0 (every row sees no key): out = 0, lse = -inf and every gradient
    and tangent 0 (k's and v's empty), in the numpy reference exactly as on every compiled path."""
    if "cuda" in str(kernels) and name in ("flash_attn_jvp", "flash_attn_double_backward"):
        pytest.skip(f"{name} has no CUDA kernel: the floor, covered by the llvm paths")
    rng = np.random.default_rng(11)
    q, k, v, do = _dense(rng, 5, 0)
    args = {"flash_attn": dict(q=q, k=k, v=v),
            "flash_attn_backward": dict(q=q, k=k, v=v, do=do),
            "flash_attn_jvp": dict(q=q, k=k, v=v, q_dot=randn(rng, q.shape), k_dot=k.copy(), v_dot=v.copy()),
            "flash_attn_double_backward": dict(q=q, k=k, v=v, do=do, dq_bar=randn(rng, q.shape), dk_bar=k.copy(),
                                               dv_bar=v.copy())}[name]
    extra = dict(return_lse=True) if name in ("flash_attn", "flash_attn_jvp") else {}
    want = getattr(tvm_fuel.reference, name)(*args.values(), **options, **extra)
    got = Runner(build(lambda **a: getattr(op, name)(**a, **options, **extra),
                       {n: (a.shape, str(a.dtype)) for n, a in args.items()}), HOST, kernels=kernels)(*args.values())
    assert len(got) == len(want)
    for index, (g, w) in enumerate(zip(got, want)):
        is_lse = bool(extra) and index == len(want) - 1
        assert g.shape == w.shape, (index, g.shape, w.shape)
        assert np.all(np.isneginf(w)) if is_lse else np.all(w == 0), index
        np.testing.assert_array_equal(g.astype(np.float64), w, err_msg=f"{name} output {index}")
