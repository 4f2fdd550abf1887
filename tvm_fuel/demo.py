"""``python -m tvm_fuel demo``: one small Relax module that uses every fuel op, built and run.

It prints, per output, the largest difference from ``tvm_fuel.reference`` and the per-dtype
tolerance, and returns a non-zero exit status if any output disagrees.

Contents:
    build_demo_module, demo_inputs, run_demo
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import numpy as np
import tvm
from tvm import relax

from . import op
from . import reference as ref
from .build import compile as fuel_compile

B, HQ, HKV, SQ, SK, D = 2, 6, 2, 17, 40, 64
NUM_BLOCKS, BLOCK_SIZE, MAX_BLOCKS = 12, 16, 4
OPTIONS = dict(causal=True, softcap=20.0)


@dataclass(frozen=True)
class Agreement:
    name: str
    max_abs_err: float
    tolerance: float

    @property
    def ok(self) -> bool:
        return self.max_abs_err <= self.tolerance


def build_demo_module() -> tvm.IRModule:
    """A training-and-serving flavoured graph: forward with lse, its backward, paged decode."""
    ty = relax.TensorType
    params = [
        relax.Var("q", ty((B, HQ, SQ, D), "float32")), relax.Var("k", ty((B, HKV, SK, D), "float32")),
        relax.Var("v", ty((B, HKV, SK, D), "float32")), relax.Var("do", ty((B, HQ, SQ, D), "float32")),
        relax.Var("alibi_slopes", ty((HQ,), "float32")),
        relax.Var("k_cache", ty((NUM_BLOCKS, BLOCK_SIZE, HKV, D), "float32")),
        relax.Var("v_cache", ty((NUM_BLOCKS, BLOCK_SIZE, HKV, D), "float32")),
        relax.Var("block_table", ty((B, MAX_BLOCKS), "int32")), relax.Var("context_lens", ty((B,), "int32")),
    ]
    q, k, v, do, slopes, k_cache, v_cache, table, lens = params
    bb = relax.BlockBuilder()
    with bb.function("main", params):
        with bb.dataflow():
            fwd = bb.emit(op.flash_attn(q, k, v, slopes, **OPTIONS, return_lse=True))
            out, lse = bb.emit(relax.TupleGetItem(fwd, 0)), bb.emit(relax.TupleGetItem(fwd, 1))
            grads = bb.emit(op.flash_attn_backward(q, k, v, do, slopes, out=out, lse=lse, **OPTIONS))
            dq_only = bb.emit(op.flash_attn_backward_q(q, k, v, do, slopes, **OPTIONS))
            dk_only = bb.emit(op.flash_attn_backward_k(q, k, v, do, slopes, **OPTIONS))
            dv_only = bb.emit(op.flash_attn_backward_v(q, k, v, do, slopes, **OPTIONS))
            decode = bb.emit(op.paged_attn(q, k_cache, v_cache, table, lens, slopes, **OPTIONS))
            probs = bb.emit(relax.op.nn.softmax(q, axis=-1))
            dlogits = bb.emit(op.softmax_backward(probs, do))
            result = bb.emit_output(relax.Tuple([out, lse, grads, dq_only, dk_only, dv_only, decode, dlogits]))
        bb.emit_func_output(result)
    return bb.get()


def demo_inputs(seed: int = 0) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    table = np.full((B, MAX_BLOCKS), -1, np.int32)  # -1 pads the dead entries
    table[0, :2] = [7, 2]
    table[1, :4] = [7, 11, 0, 5]  # block 7 shared by both sequences
    f32 = np.float32
    return dict(
        q=rng.standard_normal((B, HQ, SQ, D)).astype(f32), k=rng.standard_normal((B, HKV, SK, D)).astype(f32),
        v=rng.standard_normal((B, HKV, SK, D)).astype(f32), do=rng.standard_normal((B, HQ, SQ, D)).astype(f32),
        alibi_slopes=(rng.random(HQ) * 0.1).astype(f32),
        k_cache=rng.standard_normal((NUM_BLOCKS, BLOCK_SIZE, HKV, D)).astype(f32),
        v_cache=rng.standard_normal((NUM_BLOCKS, BLOCK_SIZE, HKV, D)).astype(f32),
        block_table=table, context_lens=np.array([20, 61], np.int32))


def _expected(x: dict[str, np.ndarray]) -> list[tuple[str, np.ndarray]]:
    qkv = (x["q"], x["k"], x["v"])
    out, lse = ref.flash_attn(*qkv, x["alibi_slopes"], **OPTIONS, return_lse=True)
    dq, dk, dv = ref.flash_attn_backward(*qkv, x["do"], x["alibi_slopes"], **OPTIONS)
    logits = x["q"].astype(np.float64)
    probs = np.exp(logits - logits.max(-1, keepdims=True))
    probs /= probs.sum(-1, keepdims=True)
    decode = ref.paged_attn(x["q"], x["k_cache"], x["v_cache"], x["block_table"], x["context_lens"],
                            x["alibi_slopes"], **OPTIONS)
    return [("flash_attn out", out), ("flash_attn lse", lse), ("flash_attn_backward dq", dq),
            ("flash_attn_backward dk", dk), ("flash_attn_backward dv", dv), ("flash_attn_backward_q", dq),
            ("flash_attn_backward_k", dk), ("flash_attn_backward_v", dv), ("paged_attn", decode),
            ("softmax_backward", ref.softmax_backward(probs, x["do"]))]


def _flatten(value) -> list[np.ndarray]:
    if isinstance(value, tvm.runtime.Tensor):
        return [value.numpy()]
    return [array for item in value for array in _flatten(item)]


def run_demo(*, target: str = "llvm", seed: int = 0, tolerance: float = 1e-4) -> list[Agreement]:
    """Build the demo module through the correctness floor, run it, compare with the reference."""
    mod = build_demo_module()
    start = time.perf_counter()
    executable = fuel_compile(mod, target)
    built = time.perf_counter() - start
    inputs = demo_inputs(seed)
    vm = relax.VirtualMachine(executable, tvm.cpu())
    start = time.perf_counter()
    outputs = _flatten(vm["main"](*[tvm.runtime.tensor(a) for a in inputs.values()]))
    ran = time.perf_counter() - start
    results = []
    for got, (name, want) in zip(outputs, _expected(inputs)):
        finite = np.isfinite(want)
        same_inf = bool(np.array_equal(np.isfinite(got), finite))
        err = float(np.abs(got[finite] - want[finite]).max()) if finite.any() else 0.0
        results.append(Agreement(name, err if same_inf else float("inf"), tolerance))
    print(f"tvm_fuel demo: B={B} Hq={HQ} Hkv={HKV} Sq={SQ} Sk={SK} D={D} causal softcap ALiBi, "
          f"paged block_size={BLOCK_SIZE}; target {target}, kernels=decomposed")
    print(f"built in {built:.2f} s, ran in {ran * 1e3:.1f} ms")
    print(f"{'output':<26} {'max |err| vs reference':>24} {'tolerance':>10}  verdict")
    for r in results:
        print(f"{r.name:<26} {r.max_abs_err:>24.3e} {r.tolerance:>10.0e}  {'ok' if r.ok else 'MISMATCH'}")
    return results
