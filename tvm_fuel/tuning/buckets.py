"""Static shape buckets to tune: parsed from the command line or taken from the benchmark.

A bucket is ``key=value`` pairs separated by commas:

- dense ops (flash_attn, flash_attn_backward): ``B, Hq, Hkv, Sq, Sk, D`` (``H`` sets Hq and Hkv,
  ``S`` sets Sq and Sk), ``causal=1``, ``window=L:R``, ``softcap=X``, ``dtype=float16``
- paged_attn: ``B, Hq, Hkv, D, block_size, ctx`` (the table capacity per sequence; tuning
  measures every sequence at that length), ``Sq`` (query tokens per sequence, default 1)

Contents:
    TUNABLE_OPS        -- the ops ``tune`` accepts
    parse_bucket       -- "B=1,H=8,S=1024,D=64,causal=1" -> dict
    bucket_module      -- a one-call Relax module of an op at a bucket
    benchmark_buckets  -- the buckets of ``python -m tvm_fuel bench``
"""

from __future__ import annotations

import tvm
from tvm import relax

from .. import op as fuel_op

TUNABLE_OPS = ("paged_attn", "flash_attn_backward", "flash_attn")
_INT_KEYS = {"B", "H", "Hq", "Hkv", "S", "Sq", "Sk", "D", "block_size", "ctx", "causal"}


def parse_bucket(text: str) -> dict:
    """``"B=1,H=8,S=1024,D=64,causal=1"`` -> ``{"B": 1, "H": 8, ...}`` (ValueError names the bad item)."""
    bucket: dict = {}
    for item in filter(None, (part.strip() for part in text.split(","))):
        key, sep, value = item.partition("=")
        if not sep:
            raise ValueError(f"tvm_fuel tune: shape item {item!r} is not key=value (in {text!r})")
        if key in _INT_KEYS:
            if not value.isdigit():
                raise ValueError(f"tvm_fuel tune: {key} must be a non-negative int, got {value!r}")
            bucket[key] = int(value)
        elif key == "window":
            left, _, right = value.partition(":")
            bucket[key] = (int(left), int(right))
        elif key == "softcap":
            bucket[key] = float(value)
        elif key == "dtype":
            bucket[key] = value
        else:
            raise ValueError(f"tvm_fuel tune: unknown shape key {key!r} "
                             f"(known: {sorted(_INT_KEYS)}, window, softcap, dtype)")
    return bucket


def _need(bucket: dict, *keys: str) -> list[int]:
    missing = [k for k in keys if k not in bucket]
    if missing:
        raise ValueError(f"tvm_fuel tune: shape {bucket} lacks {missing}")
    for key in keys:  # a 0 would divide (the block count) or build an empty kernel
        if isinstance(bucket[key], bool) or not isinstance(bucket[key], int) or bucket[key] < 1:
            raise ValueError(f"tvm_fuel tune: {key} must be an int >= 1, got {bucket[key]!r}")
    return [bucket[k] for k in keys]


def bucket_module(op: str, bucket: dict) -> tvm.IRModule:
    """A Relax module whose main calls ``op`` once, with the static shapes of ``bucket``."""
    if op not in TUNABLE_OPS:
        raise ValueError(f"tvm_fuel tune: op must be one of {TUNABLE_OPS}, got {op!r}")
    dtype = bucket.get("dtype", "float32")
    hq = bucket.get("Hq", bucket.get("H"))
    hkv = bucket.get("Hkv", bucket.get("H", hq))
    B, D = _need(bucket, "B", "D")
    if hq is None:
        raise ValueError(f"tvm_fuel tune: shape {bucket} lacks Hq (or H)")

    def var(name, shape, dt=dtype):
        return relax.Var(name, relax.TensorType(shape, dt))

    bb = relax.BlockBuilder()
    if op == "paged_attn":
        block_size, ctx = _need(bucket, "block_size", "ctx")
        max_blocks = -(-ctx // block_size)
        cache = (B * max_blocks, block_size, hkv, D)
        params = [var("q", (B, hq, bucket.get("Sq", 1), D)), var("k_cache", cache), var("v_cache", cache),
                  var("block_table", (B, max_blocks), "int32"), var("context_lens", (B,), "int32")]
        with bb.function("main", params):
            bb.emit_func_output(bb.emit(fuel_op.paged_attn(*params)))
        return bb.get()
    sq = bucket.get("Sq", bucket.get("S"))
    sk = bucket.get("Sk", bucket.get("S", sq))
    if sq is None:
        raise ValueError(f"tvm_fuel tune: shape {bucket} lacks Sq (or S)")
    options = dict(causal=bool(bucket.get("causal", 0)), window_size=bucket.get("window", (-1, -1)),
                   softcap=bucket.get("softcap", 0.0))
    q, k, v = var("q", (B, hq, sq, D)), var("k", (B, hkv, sk, D)), var("v", (B, hkv, sk, D))
    if op == "flash_attn":
        with bb.function("main", [q, k, v]):
            bb.emit_func_output(bb.emit(fuel_op.flash_attn(q, k, v, **options)))
        return bb.get()
    do, out, lse = var("do", (B, hq, sq, D)), var("out", (B, hq, sq, D)), var("lse", (B, hq, sq), "float32")
    with bb.function("main", [q, k, v, do, out, lse]):
        bb.emit_func_output(bb.emit(fuel_op.flash_attn_backward(q, k, v, do, out=out, lse=lse, **options)))
    return bb.get()


def benchmark_buckets(op: str) -> list[dict]:
    """The shapes ``python -m tvm_fuel bench`` runs for ``op``."""
    from ..testing.cases import default_suite

    flash, paged = default_suite()
    if op == "paged_attn":
        # the quarter-occupancy case shares the full one's shapes (and knobs); the float32 cache's
        return [dict(B=c.B, Hq=c.Hq, Hkv=c.Hkv, D=c.D, block_size=c.block_size, ctx=c.capacity)
                for c in paged if c.context == c.capacity and c.dtype == "float32"]
    backward = op == "flash_attn_backward"
    return [dict(B=c.B, H=c.H, S=c.S, D=c.D, causal=int(c.causal)) for c in flash if c.backward == backward]
