"""tvm_fuel.kv_cache.PagedKVCache with fp8 and int8 caches: every appended row lands in its slot
as exactly ``reference.quantize_fp8`` / ``reference.quantize_int8`` of it (bit for bit, int8's
scales too), saturation and NaN follow vLLM's rule, bad scales and rows are refused by name, and
the GPU kernels build for CUDA."""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest
import tvm

from tvm_fuel import reference
from tvm_fuel.deploy import nvcc as cuda
from tvm_fuel.kv_cache import PagedKVCache, append_kernel

pytestmark = pytest.mark.integration

QUANT = ("float8_e4m3fn", "float8_e5m2", "int8")
BS = 16


def _stored(cache: PagedKVCache, seq: int, layer: int = 0):
    """The sequence's stored (k, v) elements [T, Hkv, D] and, for int8, their scales [T, Hkv], slot by
    slot through its block table."""
    table = cache.block_table([seq]).numpy()[0] + layer * cache.num_blocks
    pages = [(t // BS, t % BS) for t in range(cache.length(seq))]
    codes = [np.stack([x[table[p], o] for p, o in pages]) for x in (cache.k_cache.numpy(), cache.v_cache.numpy())]
    if cache.dtype != "int8":
        return codes, None
    return codes, [np.stack([s[table[p], o] for p, o in pages]) for s in (cache.k_scale.numpy(), cache.v_scale.numpy())]


def _assert_quantized(cache: PagedKVCache, seq: int, rows, layer: int = 0, scales=(1.0, 1.0)):
    """The stored elements of ``seq`` equal the reference quantization of ``rows`` ((k, v) [T, Hkv, D])."""
    codes, stored_scales = _stored(cache, seq, layer)
    for name, got, x, scale in zip("kv", codes, rows, scales):
        if cache.dtype == "int8":
            want, want_scale = reference.quantize_int8(x)
            np.testing.assert_array_equal(got, want, err_msg=f"{name} codes")
            got_scale = stored_scales["kv".index(name)]
            np.testing.assert_array_equal(got_scale, want_scale, err_msg=f"{name} scales")  # NaN equals NaN
        else:
            want = reference.quantize_fp8(x, cache.dtype, scale)
            np.testing.assert_array_equal(got.view(np.uint8), want.view(np.uint8), err_msg=f"{name} codes")


def _rows(rng, shape, dtype=np.float32):
    """Normal values spread over 2^-14 .. 2^9: fp8's subnormals, normals and saturation alike."""
    return (rng.standard_normal(shape) * 2.0 ** rng.integers(-14, 9, shape)).astype(dtype)


@pytest.mark.parametrize("dtype", QUANT)
@pytest.mark.parametrize("hkv, d, layers", [(1, 40, 1), (3, 128, 2)])
def test_appends_store_the_reference_quantization(dtype, hkv, d, layers):
    rng = np.random.default_rng(hkv * 7 + layers)
    scales = {} if dtype == "int8" else dict(k_scale=0.375, v_scale=3.0)
    cache = PagedKVCache(num_blocks=24, block_size=BS, num_kv_heads=hkv, head_dim=d, num_layers=layers, dtype=dtype,
                         **scales)
    seqs = [cache.add_sequence() for _ in range(2)]
    history = {(s, layer): ([], []) for s in seqs for layer in range(layers)}
    for chosen, tokens in (([seqs[0]], 97), ([seqs[1]], 17), (seqs, 1), ([seqs[1]], 97), (seqs, 1), ([seqs[0]], 17)):
        ks, vs = ([_rows(rng, (len(chosen), hkv, tokens, d)) for _ in range(layers)] for _ in range(2))
        cache.append(chosen, ks if layers > 1 else ks[0], vs if layers > 1 else vs[0])
        for layer in range(layers):
            for row, s in enumerate(chosen):
                history[s, layer][0].append(ks[layer][row].transpose(1, 0, 2))  # [T, Hkv, D]
                history[s, layer][1].append(vs[layer][row].transpose(1, 0, 2))
    assert [cache.length(s) for s in seqs] == [116, 116]
    for (s, layer), (k, v) in history.items():
        _assert_quantized(cache, s, (np.concatenate(k), np.concatenate(v)), layer, (0.375, 3.0))


@pytest.mark.parametrize("dtype", ["float8_e4m3fn", "float8_e5m2"])
def test_fp8_saturates_and_keeps_nan(dtype):
    limit = {"float8_e4m3fn": 448.0, "float8_e5m2": 57344.0}[dtype]
    cache = PagedKVCache(num_blocks=2, block_size=BS, num_kv_heads=1, head_dim=10, dtype=dtype, v_scale=0.5)
    seq = cache.add_sequence()
    k = np.array([limit, limit * 1.04, -limit * 3, 1e30, -np.inf, np.inf, np.nan, -np.nan, 0.0, -2.0 ** -20],
                 np.float32)
    cache.append([seq], k[None, None, None], k[None, None, None])
    (got_k, got_v), _ = _stored(cache, seq)
    values = got_k[0, 0].astype(np.float64)
    np.testing.assert_array_equal(values[:6], [limit, limit, -limit, limit, -limit, limit])
    assert np.isnan(values[6:8]).all() and values[8] == 0 and not np.signbit(values[8])
    np.testing.assert_array_equal(got_v[0, 0].astype(np.float64)[:3], [limit, limit, -limit])  # 2x past the limit
    _assert_quantized(cache, seq, (k[None, None], k[None, None]), scales=(1.0, 0.5))


def test_int8_zero_row_and_nan_row():
    cache = PagedKVCache(num_blocks=2, block_size=BS, num_kv_heads=3, head_dim=8, dtype="int8")
    seq = cache.add_sequence()
    k = np.zeros((1, 3, 2, 8), np.float32)
    k[0, 0, 1] = -0.0
    k[0, 1, :] = np.linspace(-4, 3, 8)  # absmax 4: scale 4 / 127, -4 -> -127
    k[0, 2, 1, 3] = np.nan
    cache.append([seq], k, -k)
    (got_k, _), (scale_k, scale_v) = _stored(cache, seq)
    assert (scale_k[:, 0] == 0).all() and (got_k[:, 0] == 0).all()  # a zero row: scale 0, codes 0
    assert got_k[0, 1, 0] == -127 and got_k[0, 1, -1] == round(3 / (4 / 127))
    assert np.isnan(scale_k[1, 2]) and np.isnan(scale_v[1, 2]) and (got_k[1, 2] == 0).all()
    _assert_quantized(cache, seq, (k[0].transpose(1, 0, 2), -k[0].transpose(1, 0, 2)))


def test_fp8_per_head_scales():
    rng = np.random.default_rng(3)
    k_scale = [0.25, 1.0, 40.0]
    cache = PagedKVCache(num_blocks=4, block_size=BS, num_kv_heads=3, head_dim=40, dtype="float8_e4m3fn",
                         k_scale=np.array(k_scale), v_scale=2.0)
    assert cache.k_scale.shape == (3,) and cache.v_scale.shape == (3,)  # the scalar broadcast alongside
    np.testing.assert_array_equal(cache.k_scale.numpy(), np.float32(k_scale))
    seq = cache.add_sequence()
    k, v = _rows(rng, (1, 3, 33, 40)), _rows(rng, (1, 3, 33, 40))
    cache.append([seq], k, v)
    _assert_quantized(cache, seq, (k[0].transpose(1, 0, 2), v[0].transpose(1, 0, 2)),
                      scales=(np.float32(k_scale), np.float32([2.0] * 3)))
    scalar = PagedKVCache(num_blocks=1, block_size=BS, num_kv_heads=3, head_dim=8, dtype="float8_e5m2", k_scale=2)
    assert scalar.k_scale.shape == () and scalar.k_scale.numpy() == 2 and scalar.v_scale.numpy() == 1


@pytest.mark.parametrize("dtype", ["float8_e5m2", "int8"])
def test_bfloat16_rows(dtype):
    rng = np.random.default_rng(4)
    cache = PagedKVCache(num_blocks=4, block_size=BS, num_kv_heads=2, head_dim=40, dtype=dtype,
                         input_dtype="bfloat16")
    seq = cache.add_sequence()
    k, v = (_rows(rng, (1, 2, 20, 40), ml_dtypes.bfloat16) for _ in range(2))
    cache.append([seq], k, v)
    _assert_quantized(cache, seq, (k[0].transpose(1, 0, 2).astype(np.float32),
                                   v[0].transpose(1, 0, 2).astype(np.float32)))
    with pytest.raises(ValueError, match=r"k must be \[B=1, Hkv=2, T, D=40\] bfloat16, got \[1, 2, 20, 40\] float32"):
        cache.append([seq], k.astype(np.float32), v)


def test_a_float_cache_casts_float32_rows():
    rng = np.random.default_rng(6)
    cache = PagedKVCache(num_blocks=2, block_size=BS, num_kv_heads=2, head_dim=8, dtype="float16",
                         input_dtype="float32")
    seq = cache.add_sequence()
    k = _rows(rng, (1, 2, 5, 8))
    k[0, 0, 0, :2] = [1 + 2.0 ** -11, 1 + 3 * 2.0 ** -11]  # halfway between float16s: to even, 1 and 1 + 2^-9
    cache.append([seq], k, k)
    assert cache.k_scale is None and cache.v_scale is None
    (got, _), _ = _stored(cache, seq)
    np.testing.assert_array_equal(got, k[0].transpose(1, 0, 2).astype(np.float16))
    assert list(got[0, 0, :2]) == [1, 1 + 2.0 ** -9]


def _cache(**kwargs):
    return PagedKVCache(num_blocks=1, block_size=BS, num_kv_heads=3, head_dim=8, **kwargs)


@pytest.mark.parametrize("kwargs, message", [
    (dict(dtype="float8_e4m3fn", k_scale=0.0), "k_scale must be a float or 3 floats"),
    (dict(dtype="float8_e4m3fn", v_scale=-1.0), "v_scale must be .* each finite and > 0 in float32, got -1.0"),
    (dict(dtype="float8_e5m2", k_scale=float("nan")), "k_scale must be .* got nan"),
    (dict(dtype="float8_e5m2", k_scale=1e300), "k_scale must be .* got 1e\\+300"),
    (dict(dtype="float8_e5m2", k_scale=1e-50), "k_scale must be .* got 1e-50"),
    (dict(dtype="float8_e4m3fn", v_scale=[1.0, 2.0]), r"v_scale must be a float or 3 floats \(one per KV head\)"),
    (dict(dtype="float8_e4m3fn", k_scale=[[1.0, 2.0, 3.0]]), "k_scale must be a float or 3 floats"),
    (dict(dtype="float8_e4m3fn", k_scale="2"), "k_scale must be a float or 3 floats"),
    (dict(dtype="int8", k_scale=1.0), "k_scale is only for fp8 caches .* not int8 .*per token"),
    (dict(dtype="float32", k_scale=1.0, v_scale=1.0), "k_scale and v_scale are only for fp8 caches .* not float32"),
    (dict(dtype="float8_e4m3fnuz"), "dtype must be .* or int8, got 'float8_e4m3fnuz'"),
    (dict(dtype="int8", input_dtype="int8"), "input_dtype must be float32, float16 or bfloat16, got 'int8'"),
])
def test_bad_arguments_are_refused(kwargs, message):
    with pytest.raises(ValueError, match="PagedKVCache: " + message):
        _cache(**kwargs)


def test_rows_of_the_wrong_dtype_and_bad_kernel_arguments_are_refused():
    cache = _cache(dtype="float8_e4m3fn")
    seq = cache.add_sequence()
    rows = np.zeros((1, 3, 1, 8), np.float16)
    with pytest.raises(ValueError, match=r"PagedKVCache.append: k must be \[B=1, Hkv=3, T, D=8\] float32, got .* "
                                         r"float16"):
        cache.append([seq], rows, rows.astype(np.float32))
    assert cache.length(seq) == 0
    with pytest.raises(ValueError, match="append_kernel: scale_per_head is for fp8 caches, not int8"):
        append_kernel("int8", 3, 8, False, scale_per_head=True)


def test_the_int8_kernel_refuses_a_slot_outside_the_cache():
    cache = _cache(dtype="int8")
    rows = tvm.runtime.tensor(np.zeros((1, 3, 1, 8), "float32"))
    with pytest.raises(Exception, match=r"slots\[b, t\] must be in \[0, num_blocks \* block_size\)"):
        cache._append(cache.k_cache, cache.v_cache, rows, rows, tvm.runtime.tensor(np.array([[BS]], "int64")),  # noqa: SLF001 (the kernel alone, past the host check)
                      cache.k_scale, cache.v_scale)


@pytest.mark.skipif(not cuda.nvcc_available(), reason="nvcc is not installed")
@pytest.mark.parametrize("dtype, kwargs", [("float8_e4m3fn", dict(scale_per_head=True)), ("float8_e5m2", {}),
                                           ("int8", dict(input_dtype="bfloat16"))])
def test_the_quantized_append_kernels_build_for_cuda(dtype, kwargs):
    target = tvm.target.Target({"kind": "cuda", "arch": "sm_90"})
    source = cuda.cuda_source(tvm.compile(append_kernel(dtype, 8, 128, True, **kwargs), target=target))
    assert cuda.kernel_names(source) and cuda.compile_cubin(source, "sm_90")
