"""The benchmark's TVM-cache rows (``python -m tvm_fuel bench --tvm-cache``): one layer's prefill and
decode inside TVM's own paged KV cache (``vm.builtin.paged_attention_kv_cache_create``, MLC-LLM's
runtime), its attention slots filled by TVM 0.27's CPU kernels and by fuel's (``TVM_SLOTS``), side
by side in this process.

Shapes as issue 32 measured TVM's cache: 32 query and 4 KV heads of 128, float32, pages of 16.
Prefill: 8 sequences of 1024 cached tokens each take 512 new ones (the runtime's ragged attention
over the new tokens, the paged one over the cached, and their merge). Decode: 8 sequences of 2048
cached tokens take one each, beside a streaming read probe timed in turns with it (decode reads
every cached K and V once: GB/s and the fraction of the probe). A timed step is the runtime's own:
``begin_forward``, ``attention_with_fused_qkv`` of layer 0, ``end_forward``, then ``popn`` to
undo the step (sequence lengths stay as they were).

Contents:
    tvm_cache_rows -- run the rows, return their report
    print_rows     -- the rows as text
"""

from __future__ import annotations

import numpy as np
import tvm

from ..kv_cache import runtime_cache, runtime_kernels
from ..target import host_target
from .attention import measure_side_by_side, read_probe

HQ, HKV, D, DTYPE, LAYERS = 32, 4, 128, "float32", 1
PREFILL = dict(batch=8, cached=1024, new=512)
DECODE = dict(batch=8, cached=2048, new=1)


class _Cache:
    """One runtime cache holding ``batch`` sequences of ``cached`` tokens, and its timed step."""

    def __init__(self, slots: dict, batch: int, cached: int, new: int, rng: np.random.Generator):
        self.cache = runtime_cache(slots, num_kv_heads=HKV, num_qo_heads=HQ, head_dim=D, dtype=DTYPE,
                                   num_layers=LAYERS, max_batch_size=batch,
                                   max_total_seq_len=batch * (cached + new + 32), prefill_chunk_size=batch * cached)
        self.seqs = tvm.runtime.ShapeTuple(list(range(batch)))
        self.batch, self.new = batch, new
        for seq in range(batch):
            _call("kv_state_add_sequence", self.cache, seq)
        self._forward(cached, rng)  # fill the cache
        self.qkv = tvm.runtime.tensor(rng.standard_normal((batch * new, HQ + 2 * HKV, D)).astype(DTYPE))
        self.out = tvm.runtime.empty((batch * new, HQ, D), DTYPE, tvm.cpu())

    def _forward(self, n: int, rng: np.random.Generator, qkv=None, out=None):
        _call("kv_state_begin_forward", self.cache, self.seqs, tvm.runtime.ShapeTuple([n] * self.batch), None)
        if qkv is None:
            qkv = tvm.runtime.tensor(rng.standard_normal((self.batch * n, HQ + 2 * HKV, D)).astype(DTYPE))
            out = tvm.runtime.empty((self.batch * n, HQ, D), DTYPE, tvm.cpu())
        _call("attention_kv_cache_attention_with_fused_qkv", self.cache, 0, D ** -0.5, qkv, out)
        _call("kv_state_end_forward", self.cache)

    def step(self):
        self._forward(self.new, None, self.qkv, self.out)
        for seq in range(self.batch):
            _call("kv_state_popn", self.cache, seq, self.new)


def _call(name: str, *args):
    return tvm.get_global_func(f"vm.builtin.{name}")(*args)


def _row(kind: str, shape: dict, slots: dict, probe=None) -> dict:
    # the same tokens in both caches (one generator each, same seed): their outputs are compared
    caches = {who: _Cache(slots[who], rng=np.random.default_rng(0), **shape) for who in ("tvm", "fuel")}
    outputs = {}
    for who, cache in caches.items():
        cache.step()
        outputs[who] = cache.out.numpy()
    fns = {who: cache.step for who, cache in caches.items()}
    if probe is not None:
        fns["read_probe"] = probe[0]
    timed = measure_side_by_side(fns, min_seconds=0.5, max_runs=4 if kind == "prefill" else 10)
    row = {"kind": kind, **shape, "ms": {who: seconds * 1e3 for who, (seconds, _) in timed.items()},
           "runs": {who: runs for who, (_, runs) in timed.items()},
           "max_abs_difference": float(np.abs(outputs["fuel"] - outputs["tvm"]).max())}
    row["speedup"] = row["ms"]["tvm"] / row["ms"]["fuel"]
    if probe is not None:
        read = shape["batch"] * shape["cached"] * HKV * D * np.dtype(DTYPE).itemsize * 2  # every cached K and V
        row["gbps"] = {who: read / row["ms"][who] / 1e6 for who in ("tvm", "fuel")}
        row["gbps"]["read_probe"] = probe[1] / row["ms"]["read_probe"] / 1e6
        row["fraction_of_probe"] = row["gbps"]["fuel"] / row["gbps"]["read_probe"]
    return row


def tvm_cache_rows() -> dict:
    """The report of the prefill and decode rows on this machine (module docstring)."""
    slots = {who: runtime_kernels(HKV, HQ, D, DTYPE, num_layers=LAYERS, kernels=who) for who in ("tvm", "fuel")}
    return {"shape": dict(Hq=HQ, Hkv=HKV, D=D, dtype=DTYPE, page_size=16),
            "rows": [_row("prefill", PREFILL, slots), _row("decode", DECODE, slots, read_probe(host_target()))]}


def print_rows(report: dict) -> None:
    shape = report["shape"]
    print(f"\n[TVM's paged KV cache] one layer, Hq {shape['Hq']} Hkv {shape['Hkv']} D {shape['D']} {shape['dtype']}, "
          "TVM's kernels vs fuel's in its slots")
    for row in report["rows"]:
        ms = row["ms"]
        line = (f"  {row['kind']:<7} B={row['batch']} cached {row['cached']:5d} + {row['new']:3d}   "
                f"TVM {ms['tvm']:9.1f} ms   fuel {ms['fuel']:7.2f} ms   {row['speedup']:5.1f}x   "
                f"(max |difference| {row['max_abs_difference']:.1e})")
        if "gbps" in row:
            gbps = row["gbps"]
            line += (f"   fuel {gbps['fuel']:5.1f} GB/s, TVM {gbps['tvm']:5.2f} GB/s, read probe "
                     f"{gbps['read_probe']:5.1f} GB/s ({row['fraction_of_probe']:.0%})")
        print(line)


__all__ = ["tvm_cache_rows", "print_rows"]
