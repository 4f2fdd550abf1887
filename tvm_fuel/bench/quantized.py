"""The benchmark's quantized-cache rows (``python -m tvm_fuel bench``): paged decode over 8-bit
KV caches beside the same decode over a bfloat16 cache.

Decode reads every live key and value once, so its time follows the bytes it reads: an fp8 or
int8 cache holds half of a bfloat16 cache's bytes (int8 adds a float32 scale per token and head,
1/D more). Each row times fuel's tuned paged kernel over one context, side by side in one
process, with the cache in bfloat16, float8_e4m3fn (a scale per KV head), float8_e5m2 and int8
(a scale per token and head); the queries are bfloat16 throughout. The 8-bit caches hold the
bfloat16 cache's values quantized (``tvm_fuel.reference``'s rules).

Contents:
    QUANT_ROWS -- the decode shapes (GQA at contexts 4096 and 16384, multi-head at 4096)
    quantized_rows -- run them, return their report
    print_rows -- the rows as text
"""

from __future__ import annotations

import numpy as np

from ..testing.cases import PagedCase

# GQA groups of 4 (Llama-3-8B's heads) at two contexts, and multi-head attention (Llama-2-7B's 32
# heads, a group of 1): the same cache bytes as the first row, a quarter of its FMAs per byte
QUANT_ROWS = (PagedCase(8, 32, 8, 128, 16, 4096, 4096, "bfloat16"),
              PagedCase(2, 32, 8, 128, 16, 16384, 16384, "bfloat16"),
              PagedCase(2, 32, 32, 128, 16, 4096, 4096, "bfloat16"))
CACHES = ("bfloat16", "float8_e4m3fn", "float8_e5m2", "int8")


def _module(case: PagedCase, cache_dtype: str):
    """main(q, k_cache, v_cache, block_table, context_lens[, k_scale, v_scale]) -> out."""
    from tvm import relax

    from .. import op

    max_blocks = case.capacity // case.block_size
    cache = ((case.B * max_blocks, case.block_size, case.Hkv, case.D), cache_dtype)
    shapes = dict(q=((case.B, case.Hq, 1, case.D), "bfloat16"), k_cache=cache, v_cache=cache,
                  block_table=((case.B, max_blocks), "int32"), context_lens=((case.B,), "int32"))
    if cache_dtype != "bfloat16":
        scale = cache[0][:3] if cache_dtype == "int8" else (case.Hkv,)
        shapes.update(k_scale=(scale, "float32"), v_scale=(scale, "float32"))
    params = {n: relax.Var(n, relax.TensorType(*s)) for n, s in shapes.items()}
    bb = relax.BlockBuilder()
    with bb.function("main", list(params.values())):
        bb.emit_func_output(bb.emit(op.paged_attn(**params)))
    return bb.get()


def _arrays(case: PagedCase, rng) -> dict[str, dict]:
    """Each cache dtype's arguments: the bfloat16 cache and its 8-bit quantizations."""
    import ml_dtypes

    from .. import reference

    max_blocks = case.capacity // case.block_size
    shape = (case.B * max_blocks, case.block_size, case.Hkv, case.D)
    k, v = (rng.standard_normal(shape, np.float32).astype(ml_dtypes.bfloat16) for _ in range(2))
    q = rng.standard_normal((case.B, case.Hq, 1, case.D), np.float32).astype(ml_dtypes.bfloat16)
    table = rng.permutation(case.B * max_blocks).reshape(case.B, max_blocks).astype("int32")
    lens = np.full(case.B, case.context, "int32")

    def arguments(k_cache, v_cache, *scales):  # in the op's order
        return dict(zip(("q", "k_cache", "v_cache", "block_table", "context_lens", "k_scale", "v_scale"),
                        (q, k_cache, v_cache, table, lens, *scales)))

    found = {"bfloat16": arguments(k, v)}
    head_scale = np.full(case.Hkv, 4.0 / 448, np.float32)  # |x| < 4 spans the e4m3fn range
    for dtype in ("float8_e4m3fn", "float8_e5m2"):
        found[dtype] = arguments(reference.quantize_fp8(k, dtype, head_scale),
                                 reference.quantize_fp8(v, dtype, head_scale), head_scale, head_scale)
    (kc, ks), (vc, vs) = reference.quantize_int8(k), reference.quantize_int8(v)
    found["int8"] = arguments(kc, vc, ks, vs)
    return found


def _row(case: PagedCase, target) -> dict:
    import tvm

    from .attention import build_vm, measure_side_by_side

    arrays = _arrays(case, np.random.default_rng(0))
    fns = {}
    for dtype in CACHES:
        vm = build_vm(_module(case, dtype), target, "tuned")
        tensors = [tvm.runtime.tensor(a) for a in arrays[dtype].values()]
        fns[dtype] = lambda vm=vm, tensors=tensors: vm["main"](*tensors)
    timed = measure_side_by_side(fns)
    results = {name: {"ms": seconds * 1e3, "runs": runs} for name, (seconds, runs) in timed.items()}
    tokens = case.B * case.context * case.Hkv * 2  # K and V rows read
    for dtype, result in results.items():
        row_bytes = case.D * (2 if dtype == "bfloat16" else 1) + (4 if dtype == "int8" else 0)
        result["gb_per_s"] = tokens * row_bytes / (result["ms"] * 1e-3) / 1e9
    base = results["bfloat16"]["ms"]
    return {"name": case.name, "results": results,
            "over_bfloat16": {dtype: results[dtype]["ms"] / base for dtype in CACHES[1:]}}


def quantized_rows() -> dict:
    """Every row of QUANT_ROWS on this CPU (the tuned kernels)."""
    from ..target import host_target

    target = host_target()
    return {"rows": [_row(case, target) for case in QUANT_ROWS]}


def print_rows(report: dict) -> None:
    print(f"\n{'quantized cache row':<60} " + " ".join(f"{dtype:>16}" for dtype in CACHES)
          + "   8-bit / bfloat16")
    for row in report["rows"]:
        r = row["results"]
        ratios = ", ".join(f"{dtype} {ratio:.2f}" for dtype, ratio in row["over_bfloat16"].items())
        print(f"{row['name']:<60} " + " ".join(f"{r[d]['ms']:8.2f} ms {r[d]['gb_per_s']:4.1f}" for d in CACHES)
              + f"   {ratios}")
    print("(side by side in one process; ms and the GB/s of cache read; the target: an 8-bit cache / bfloat16 <= 0.6)")
