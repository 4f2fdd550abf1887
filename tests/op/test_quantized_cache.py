"""paged_attn over 8-bit KV caches (fp8 e4m3fn / e5m2 with a per-cache or per-head scale, int8
with a scale per token and head): the floor, the CPU kernels and the CUDA kernels' emulation
against the float64 reference on the dequantized cache; the stated error bound against the
unquantized cache; NaN in dropped tokens; fuel's PagedKVCache end to end; the errors bad scales get.

The error bound (per output row, softmax scale s, the row's query q): with every visible key's
logit off by at most E = s * sum_d |q_d| * max_j |dk_jd| and every value element by at most
max |dv|, out moves by at most ``max|dv| + (exp(2E) - 1) * max|v'|`` (the weights' ratios stay
within exp(+-2E), so they move by at most exp(2E) - 1 in L1). The quantization steps themselves:
fp8 rounds to nearest with 3 (e4m3fn) or 2 (e5m2) mantissa bits, a relative error of at most
2^-4 or 2^-3 of |x| (2^-10 or 2^-17 absolute below the normals, times the scale); int8 at most
max|row| / 254 per element. Where an int8 decode runs in integers (AVX2), q is rounded per row
to int16 too: E gains s * max|q| / 65534 * sum_d max_j |k'_jd|; and each key tile's weights are
rounded per row to int16 (unit: the tile's largest / 32767) before they multiply V's codes: out
gains at most sum over tiles of max_tile(w_j * v_scale_j) * sum_tile |code_j| / 65534 <= n * 128 *
max_j v_scale_j / 65534 (w the softmax weights, n the keys seen).
"""

from __future__ import annotations

import math
from dataclasses import replace

import numpy as np
import pytest
import tvm
from helpers import BLOCK, HOST, assert_close, assert_integer_decode, build, integer_q_k, paged_inputs, run
from tvm import relax, tirx

import tvm_fuel
from tvm_fuel import op
from tvm_fuel import reference as ref
from tvm_fuel.op import quant
from tvm_fuel.op import AttnConfig
from tvm_fuel.schedules.workload import KernelSpec, Workload

pytestmark = pytest.mark.numerics

LENS = [0, 1, 17, 97]
# "none": an fp8 cache without scales (1); e4m3fn's decoding then still folds its 2^8 into a per-token factor
FORMS = [("float8_e4m3fn", "tensor"), ("float8_e4m3fn", "head"), ("float8_e4m3fn", "none"), ("float8_e5m2", "head"),
         ("int8", "token")]


def _quantized(rng, inputs, cache_dtype: str, form: str):
    """``inputs`` (paged_inputs) with their caches quantized; also the unquantized caches."""
    k, v = inputs["k_cache"].astype(np.float32), inputs["v_cache"].astype(np.float32)
    hkv = k.shape[2]
    if cache_dtype == "int8":
        (kc, ks), (vc, vs) = ref.quantize_int8(k), ref.quantize_int8(v)
    elif form == "none":
        kc, vc = ref.quantize_fp8(k, cache_dtype), ref.quantize_fp8(v, cache_dtype)
        return dict(inputs, k_cache=kc, v_cache=vc), (k, v)
    else:
        shape = () if form == "tensor" else (hkv,)
        ks, vs = (rng.uniform(0.25, 2.0, shape).astype(np.float32) for _ in range(2))
        kc, vc = ref.quantize_fp8(k, cache_dtype, ks), ref.quantize_fp8(v, cache_dtype, vs)
    return dict(inputs, k_cache=kc, v_cache=vc, k_scale=np.asarray(ks), v_scale=np.asarray(vs)), (k, v)


@pytest.mark.parametrize("cache_dtype,form", FORMS)
@pytest.mark.parametrize("sq,hq,hkv", [(1, 6, 2), (5, 7, 1)])  # decode streams the cache; 35 rows pack it
def test_matches_dequantized_reference(cache_dtype, form, sq, hq, hkv, kernels):
    rng = np.random.default_rng(sq * 10 + len(form))
    inputs, _ = _quantized(rng, paged_inputs(rng, LENS, Hq=hq, Hkv=hkv, Sq=sq, D=40, max_blocks=7), cache_dtype, form)
    (out,) = run(lambda **a: op.paged_attn(**a, causal=True), inputs, kernels=kernels)
    assert_close(out, ref.paged_attn(**inputs, causal=True), "float32")
    assert np.all(out[0] == 0)  # context length 0


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("cache_dtype,sq", [("float8_e4m3fn", 3), ("int8", 3), ("int8", 1)])
def test_half_queries_with_options(dtype, cache_dtype, sq, kernels):
    """Half-precision queries (the CUDA register tiles) over an 8-bit cache, with ALiBi, a window,
    softcap, sinks and head dim 128 (3 queries of a group of 3 pack the tiles; int8 decode streams
    them, its q.k in integers on AVX2)."""
    rng = np.random.default_rng(5)
    inputs = paged_inputs(rng, [1, 40, 97], Hq=6, Hkv=2, Sq=sq, D=128, dtype=dtype, max_blocks=7)
    inputs, _ = _quantized(rng, inputs, cache_dtype, "head")
    inputs["alibi_slopes"] = (rng.random(6) * 0.2).astype(np.float32)
    inputs["sinks"] = rng.standard_normal(6).astype(np.float32)
    options = dict(causal=True, window_size=(30, -1), softcap=6.0)
    names = ["q", "k_cache", "v_cache", "block_table", "context_lens", "alibi_slopes", "sinks", "k_scale", "v_scale"]
    inputs = {name: inputs[name] for name in names}  # the op's argument order
    (out,) = run(lambda **a: op.paged_attn(**a, **options), inputs, kernels=kernels)
    assert_close(out, ref.paged_attn(**inputs, **options), dtype)


@pytest.mark.parametrize("cache_dtype,form", FORMS)
def test_within_the_stated_error_bound_of_the_unquantized_cache(cache_dtype, form):
    """The module docstring's bound, row by row, on the CPU kernel."""
    rng = np.random.default_rng(9)
    inputs = paged_inputs(rng, [17, 97], Hq=4, Hkv=2, Sq=2, D=64, max_blocks=7)
    inputs, (k, v) = _quantized(rng, inputs, cache_dtype, form)
    (out,) = run(lambda **a: op.paged_attn(**a, causal=True), inputs, kernels="tuned")
    exact = ref.paged_attn(inputs["q"], k, v, inputs["block_table"], inputs["context_lens"], causal=True)
    k_deq = ref.dequantize(inputs["k_cache"], inputs.get("k_scale"))
    v_deq = ref.dequantize(inputs["v_cache"], inputs.get("v_scale"))
    dk, dv = np.abs(k_deq - k).max(axis=(0, 1, 2)), np.abs(v_deq - v).max()  # dk per head-dim element
    q = inputs["q"].astype(np.float64)
    logit_error = np.einsum("bhid,d->bhi", np.abs(q), dk) / math.sqrt(q.shape[-1])
    if cache_dtype == "int8":  # the integer decode's roundings (AVX2; the terms hold on any CPU)
        logit_error += _q_rounding_error(q, k_deq)
        dv += _weights_rounding_error(inputs)
    bound = dv + np.expm1(2 * logit_error)[..., None] * np.abs(v_deq).max() + 1e-5  # + float32 rounding
    assert np.all(np.abs(out - exact) <= bound)
    assert np.abs(out - exact).max() > 1e-4  # the cache really is quantized


def _kernel_assembly(inputs) -> str:
    params = {name: (a.shape, str(a.dtype)) for name, a in inputs.items()}
    legalized = tvm_fuel.transform.legalize(build(lambda **a: op.paged_attn(**a, causal=True), params), HOST,
                                            kernels="tuned")
    kernel = legalized["fuel_paged_attn_kernel"]
    return tvm.compile(tvm.IRModule({"main": kernel}), target=HOST).mod.inspect_source("asm")


@pytest.mark.parametrize("D,hq,hkv,sq", [(64, 6, 2, 1), (128, 4, 4, 1), (256, 7, 1, 1), (80, 6, 2, 2), (40, 6, 2, 1)])
def test_int8_decode_runs_in_integers(D, hq, hkv, sq):
    """Decode over an int8 cache on an AVX2 CPU takes q.k and P.V through vpmaddwd, q rounded per
    row to int16 (``CpuTiles.int16_dot``) and each key tile's weights too, for head dims that are
    multiples of 16 (40: the float path): within the stated bound of the dequantized reference,
    and at float32's tolerance of the same roundings (``helpers.integer_decode``; groups 1, 3 and
    7; lengths 0 to 97)."""
    rng = np.random.default_rng(D + hq)
    inputs, _ = _quantized(rng, paged_inputs(rng, LENS, Hq=hq, Hkv=hkv, Sq=sq, D=D, max_blocks=7), "int8", "token")
    integer = integer_q_k(D, sq * hq // hkv)
    assert ("vpmaddwd" in _kernel_assembly(inputs)) == integer
    (out,) = run(lambda **a: op.paged_attn(**a, causal=True), inputs, kernels="tuned")
    want = ref.paged_attn(**inputs, causal=True)
    k_deq, v_deq = (ref.dequantize(inputs[f"{kind}_cache"], inputs[f"{kind}_scale"]) for kind in "kv")
    bound = np.expm1(2 * _q_rounding_error(inputs["q"].astype(np.float64), k_deq))[..., None] * np.abs(v_deq).max()
    bound += _weights_rounding_error(inputs)
    assert np.all(np.abs(out - want) <= bound + 1e-5 + 1e-5 * np.abs(want))  # + float32 rounding
    if integer:  # and exactly the kernel's rounding of q and of each tile's weights: float32's tolerance
        assert_integer_decode(out, inputs)
    assert np.all(out[0] == 0)  # context length 0


def _weights_rounding_error(inputs):
    """The bound on what rounding each key tile's weights to int16 adds to out (module docstring):
    n * 128 * max v_scale / 65534 for a row that sees n keys, [B, 1, 1, 1]."""
    largest = 128 * inputs["v_scale"].astype(np.float64).max()
    return inputs["context_lens"].astype(np.float64)[:, None, None, None] * largest / 65534


def _q_rounding_error(q, k_deq):
    """The logit error of rounding each query row to int16 (unit max|q| / 32767): half a unit per
    element times the largest |k| of each head-dim element, scaled (module docstring)."""
    unit = np.abs(q).max(axis=-1) / 32767
    return unit * np.abs(k_deq).max(axis=(0, 1, 2)).sum() / 2 / math.sqrt(q.shape[-1])


def test_int8_decode_rows_of_nonfinite_queries_are_nan():
    """A query row holding NaN or Inf gives a NaN row through the integer q.k as through the float
    one (its int16 rounding has no unit for it); the other rows keep their values."""
    rng = np.random.default_rng(4)
    inputs, _ = _quantized(rng, paged_inputs(rng, [17, 97], Hq=4, Hkv=2, D=64, max_blocks=7), "int8", "token")
    inputs["q"][0, 1, 0, 5] = np.nan
    inputs["q"][1, 2, 0, 9] = np.inf
    (out,) = run(lambda **a: op.paged_attn(**a, causal=True), inputs, kernels="tuned")
    assert np.isnan(out[0, 1]).all() and np.isnan(out[1, 2]).all()
    clean = np.ones(out.shape[:2], bool)
    clean[0, 1] = clean[1, 2] = False
    np.testing.assert_allclose(out[clean], ref.paged_attn(**inputs, causal=True)[clean], rtol=1e-3, atol=1e-4)


@pytest.mark.parametrize("sq,D", [(1, 40), (1, 64), (5, 40)])  # decode streams the cache (D 64: int8's integer
def test_nan_and_inf_in_dropped_tokens_never_reach_a_row(sq, D, kernels):  # q.k); 5 rows of a group of 2 pack it
    """NaN codes (e4m3fn), Inf codes (e5m2) and NaN / Inf scales (int8) in tokens left of the window,
    in tiles that straddle it, and past the context: every output stays finite and equal to the
    clean cache's."""
    rng = np.random.default_rng(3)
    lens = [2 * BLOCK + 5, 3 * BLOCK]
    window = dict(window_size=(6, 0))
    for cache_dtype, bad in (("float8_e4m3fn", np.nan), ("float8_e5m2", np.inf), ("int8", np.nan), ("int8", np.inf)):
        inputs, _ = _quantized(rng, paged_inputs(rng, lens, Hq=4, Hkv=2, Sq=sq, D=D, shared_block=False),
                               cache_dtype, "token" if cache_dtype == "int8" else "head")
        (clean,) = run(lambda **a: op.paged_attn(**a, **window), inputs, kernels=kernels)
        dirty = {name: np.array(a) for name, a in inputs.items()}
        for b, n in enumerate(lens):
            for t in list(range(n - sq - 6 - 9, n - sq - 6)) + list(range(n, -(-n // BLOCK) * BLOCK)):
                block, slot = dirty["block_table"][b, t // BLOCK], t % BLOCK
                if cache_dtype == "int8":
                    dirty["k_scale"][block, slot] = dirty["v_scale"][block, slot] = bad
                else:
                    dirty["k_cache"][block, slot] = dirty["v_cache"][block, slot] = bad
        (out,) = run(lambda **a: op.paged_attn(**a, **window), dirty, kernels=kernels)
        assert np.isfinite(out).all(), cache_dtype
        np.testing.assert_allclose(out, clean, rtol=1e-6, atol=1e-7, err_msg=f"{cache_dtype} {bad}")


def test_half_queries_over_large_fp8_values(kernels):
    """float16 queries, an e5m2 cache holding its largest value with scale 2 (the dequantized key
    is past float16's range): the kernels keep it in float32 (the CUDA tiles hold the decoded,
    unscaled elements; the scale joins the softmax scale), as the reference does."""
    import ml_dtypes

    rng = np.random.default_rng(1)
    inputs = paged_inputs(rng, [20], Hq=2, Hkv=1, Sq=1, D=64, dtype="float16")
    k = rng.standard_normal(inputs["k_cache"].shape).astype(np.float32)
    k[:, 3, :, 0] = 57344.0  # token 3 (block 0): e5m2's largest, times 2
    inputs.update(k_cache=k.astype(ml_dtypes.float8_e5m2), v_cache=inputs["v_cache"].astype(ml_dtypes.float8_e5m2),
                  k_scale=np.float32(2.0), v_scale=np.float32(3.0))
    q = np.zeros((1, 2, 1, 64), np.float32)
    q[0, 0, 0, 0], q[0, 1, 0, 0] = 1e-4, -1e-4  # logits of token 3: +-11.5, the rest ~0
    inputs["q"] = q.astype(np.float16)
    (out,) = run(lambda **a: op.paged_attn(**a), inputs, kernels=kernels)
    assert_close(out, ref.paged_attn(**inputs), "float16")


@pytest.mark.parametrize("cache_dtype", ["float8_e5m2", "int8"])
def test_fuel_cache_appends_then_decodes(cache_dtype):
    """PagedKVCache quantizes on append; paged_attn over its tensors matches the reference on the
    same (dequantized) cache and stays within a loose bound of the unquantized keys."""
    from tvm_fuel.kv_cache import PagedKVCache

    rng = np.random.default_rng(11)
    scales = {} if cache_dtype == "int8" else dict(k_scale=[0.5, 2.0], v_scale=0.75)
    cache = PagedKVCache(num_blocks=12, block_size=BLOCK, num_kv_heads=2, head_dim=64, dtype=cache_dtype, **scales)
    seqs = [cache.add_sequence() for _ in range(3)]
    rows = {s: [] for s in seqs}
    for tokens in (17, 1, 30):
        k = rng.standard_normal((3, 2, tokens, 64)).astype(np.float32)
        v = rng.standard_normal((3, 2, tokens, 64)).astype(np.float32)
        cache.append(seqs, k, v)
        for i, s in enumerate(seqs):
            rows[s].append((k[i], v[i]))
    q = rng.standard_normal((3, 4, 1, 64)).astype(np.float32)
    inputs = dict(q=q, k_cache=cache.k_cache.numpy(), v_cache=cache.v_cache.numpy(),
                  block_table=cache.block_table(seqs).numpy(), context_lens=cache.context_lens(seqs).numpy(),
                  k_scale=cache.k_scale.numpy(), v_scale=cache.v_scale.numpy())
    (out,) = run(lambda **a: op.paged_attn(**a), inputs, kernels="tuned")
    if cache_dtype == "int8" and integer_q_k(64, 2):  # decode in integers (AVX2): its roundings
        assert_integer_decode(out, inputs)
    else:
        assert_close(out, ref.paged_attn(**inputs), "float32")
    for i, s in enumerate(seqs):  # against the unquantized rows: the quantization error, no more
        k = np.concatenate([r[0] for r in rows[s]], axis=1)[None]
        v = np.concatenate([r[1] for r in rows[s]], axis=1)[None]
        exact = ref.flash_attn(q[i:i + 1], k, v)
        assert np.abs(out[i] - exact[0]).max() < (0.05 if cache_dtype == "int8" else 0.3)


def test_kernel_workload_names_the_cache():
    """The kernel a quantized call builds is keyed on its cache dtype and scale form; a float
    cache's key is unchanged (no new fields)."""
    nb = tirx.Var("num_blocks", "int64")
    params = dict(q=((2, 8, 1, 64), "float16"), k_cache=((nb, 16, 2, 64), "int8"), v_cache=((nb, 16, 2, 64), "int8"),
                  block_table=((2, 4), "int32"), context_lens=((2,), "int32"), k_scale=((nb, 16, 2), "float32"),
                  v_scale=((nb, 16, 2), "float32"))
    legalized = tvm_fuel.transform.legalize(build(lambda **a: op.paged_attn(**a), params), HOST, kernels="tuned")
    labels = [str(f.attrs["fuel.workload"]) for f in legalized.functions.values()
              if isinstance(f, tvm.tirx.PrimFunc) and f.attrs is not None and "fuel.workload" in f.attrs]
    assert len(labels) == 1 and labels[0].startswith("paged_attn float16") and "cache:int8/token" in labels[0]
    spec = KernelSpec(dtype="float16", num_q_heads=8, num_kv_heads=2, head_dim=64, cfg=AttnConfig(), block_size=16)
    quantized = Workload("paged_attn", replace(spec, cache_dtype="int8", kv_scale="token"), (("B", 2),))
    assert Workload.from_key(quantized.key) == quantized
    plain = Workload("paged_attn", spec, (("B", 2),)).key
    assert "cache_dtype" not in plain and "kv_scale" not in plain  # the keys of float caches are unchanged
    with pytest.raises(ValueError, match="kv_scale"):
        replace(spec, cache_dtype="int8")  # int8 without its per-token scales


def _var(name, shape, dtype):
    return relax.Var(name, relax.TensorType(shape, dtype))


@pytest.mark.parametrize("cache_dtype,scales,message", [
    ("float32", dict(k_scale=((), "float32"), v_scale=((), "float32")), "scales an 8-bit cache"),
    ("float8_e4m3fn", dict(k_scale=((2,), "float32")), "must be given together"),
    ("int8", {}, "needs k_scale and v_scale"),
    ("int8", dict(k_scale=((2,), "float32"), v_scale=((2,), "float32")), "[num_blocks, block_size, Hkv]"),
    ("float8_e5m2", dict(k_scale=((3,), "float32"), v_scale=((3,), "float32")), "[] or [Hkv]"),
    ("float8_e5m2", dict(k_scale=((2,), "float16"), v_scale=((2,), "float16")), "float32"),
    ("float8_e5m2", dict(k_scale=((), "float32"), v_scale=((2,), "float32")), "same shape form"),
    ("float8_e5m2", dict(k_scale=((1, 2), "float32"), v_scale=((1, 2), "float32")), "[] or [Hkv]"),
    ("uint8", {}, "k_cache"),
])
def test_bad_scales_and_caches_are_refused(cache_dtype, scales, message):
    cache = (8, 16, 2, 64)
    args = dict(q=_var("q", (1, 4, 1, 64), "float32"), k_cache=_var("k", cache, cache_dtype),
                v_cache=_var("v", cache, cache_dtype), block_table=_var("t", (1, 2), "int32"),
                context_lens=_var("l", (1,), "int32"))
    args.update({name: _var(name, *spec) for name, spec in scales.items()})
    with pytest.raises((ValueError, TypeError), match=r"fuel\.paged_attn") as err:
        relax.BlockBuilder().normalize(op.paged_attn(**args))
    assert message in str(err.value)


def test_every_fp8_code_decodes_exactly():
    """``quant.decode`` against ml_dtypes on all 256 codes of both formats (TVM's own float8 cast
    is wrong on zero, the subnormals and e5m2's Inf/NaN), and ``encode_fp8`` against ml_dtypes'
    round-to-nearest-even on clipped values, normals to subnormals."""
    import ml_dtypes
    from tvm.script import tirx as T

    n = 4096
    for dtype in ("float8_e4m3fn", "float8_e5m2"):
        @T.prim_func
        def codec(codes: T.Buffer((256,), dtype), decoded: T.Buffer((256,), "float32"), x: T.Buffer((n,), "float32"),
                  encoded: T.Buffer((n,), dtype)):
            for i0 in range(16):
                for i1 in T.vectorized(16):
                    decoded[i0 * 16 + i1] = quant.decode(codes[i0 * 16 + i1])
            for i0 in range(n // 16):
                for i1 in T.vectorized(16):
                    encoded[i0 * 16 + i1] = quant.encode_fp8(x[i0 * 16 + i1], dtype)

        fp8 = getattr(ml_dtypes, dtype)
        codes = np.arange(256, dtype=np.uint8).view(fp8)
        rng = np.random.default_rng(0)
        limit = quant.FP8_MAX[dtype]
        x = np.concatenate([rng.standard_normal(n - 8) * np.exp2(rng.integers(-24, 18, n - 8)),
                            [0.0, -0.0, np.inf, -np.inf, np.nan, limit * 1.05, -limit, 2.0**-30]]).astype(np.float32)
        tensors = [tvm.runtime.tensor(codes), tvm.runtime.tensor(np.zeros(256, np.float32)), tvm.runtime.tensor(x),
                   tvm.runtime.tensor(np.zeros(n, fp8))]
        tvm.compile(codec, target=HOST)(*tensors)
        decoded, want = tensors[1].numpy(), codes.astype(np.float32)
        np.testing.assert_array_equal(decoded, want)  # NaN where NaN, Inf where Inf
        assert np.array_equal(np.signbit(decoded), np.signbit(want))
        encoded = tensors[3].numpy()
        expected = np.where(np.isnan(x), np.nan, np.clip(x, -limit, limit)).astype(fp8)
        same = (encoded.view(np.uint8) == expected.view(np.uint8)) | (np.isnan(encoded.astype(np.float32))
                                                                      & np.isnan(x))
        assert same.all(), x[~same][:5]


def test_tuning_fills_an_int8_kernels_parameters_validly():
    """MetaSchedule's runners pass the kernel's parameters by (dtype, shape) alone: an int8 cache
    gets codes, the block table ids below its block count, the lengths fill the table."""
    from tvm_fuel.tuning.measure import input_specs

    q, cache, scale = (2, 8, 1, 64), (10, 16, 2, 64), (10, 16, 2)
    specs = input_specs([("float32", q), ("int8", cache), ("int8", cache), ("int32", (2, 4)), ("int32", (2,)),
                         ("float32", scale), ("float32", scale), ("float32", q)])
    assert [s["fill"] for s in specs[:5]] == ["normal", "codes", "codes", "blocks", "values"]
    assert (specs[3]["num_blocks"], specs[3]["block_size"], specs[4]["values"]) == (10, 16, [64, 64])
