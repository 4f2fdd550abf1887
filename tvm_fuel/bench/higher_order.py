"""The benchmark's higher-order rows (``python -m tvm_fuel bench``): forward mode and double backward.

Measured side by side in one process, as ratios (this machine drifts):

- ``flash_attn_jvp`` against our ``flash_attn`` forward at the forward benchmark's shapes;
- ``flash_attn_double_backward`` (q, k, v cotangents, the forward's out and lse given) against our
  fused ``flash_attn_backward`` at B1 H8 S2048 D128 causal; then the expanded-primitives path (the
  backward rewritten by ``ExpandAttention`` and differentiated by Relax's ``Gradient``: the scores
  materialized) and PyTorch's math-backend double backward (``autograd.grad`` of the first
  gradients, ``create_graph=True``) at the same shape;
- peak memory of the double backward at S = 16384 (H8 D64 causal) in a child process, next to the
  size of the [H, S, S] float32 tensors the expansion materializes.

Contents:
    higher_order_rows      -- run the rows, return their report
    double_backward_memory -- the S = 16384 memory probe (run in a child process)
    print_rows             -- the rows as text
"""

from __future__ import annotations

import json
import sys
import time

import numpy as np
import tvm
from tvm import relax

from .. import op
from .attention import build_vm, child_probe, measure, measure_side_by_side, peak_rss_mib
from ..target import host_target
from ..testing.cases import default_suite
from ..transform.expand_attention import ExpandAttention

# the double backward's benchmark shape (issue 16): B, H, S, D, causal
DOUBLE_BACKWARD_SHAPE = (1, 8, 2048, 128, True)
MEMORY_SHAPE = (1, 8, 16384, 64, True)
_ARGS = {"forward": ("q", "k", "v"), "jvp": ("q", "k", "v", "q_dot", "k_dot", "v_dot"),
         "backward": ("q", "k", "v", "do", "out", "lse"),
         "double_backward": ("q", "k", "v", "do", "dq_bar", "dk_bar", "dv_bar", "out", "lse")}


def _module(kind: str, B: int, H: int, S: int, D: int, causal: bool) -> tvm.IRModule:
    """A one-call module of ``kind`` (forward, jvp, backward, double_backward) over [B, H, S, D]."""
    shape = (B, H, S, D)
    params = {n: relax.Var(n, relax.TensorType(shape[:3] if n == "lse" else shape, "float32")) for n in _ARGS[kind]}
    p = params
    bb = relax.BlockBuilder()
    with bb.function("main", list(params.values())):
        if kind == "forward":
            call = op.flash_attn(p["q"], p["k"], p["v"], causal=causal, return_lse=True)
        elif kind == "jvp":
            call = op.flash_attn_jvp(p["q"], p["k"], p["v"], p["q_dot"], p["k_dot"], p["v_dot"], causal=causal)
        elif kind == "backward":
            call = op.flash_attn_backward(p["q"], p["k"], p["v"], p["do"], out=p["out"], lse=p["lse"], causal=causal)
        else:
            call = op.flash_attn_double_backward(p["q"], p["k"], p["v"], p["do"], p["dq_bar"], p["dk_bar"],
                                                 p["dv_bar"], out=p["out"], lse=p["lse"], causal=causal)
        bb.emit_func_output(bb.emit(call))
    return bb.get()


def _expanded_double_backward(B: int, H: int, S: int, D: int, causal: bool) -> tvm.IRModule:
    """``main_adjoint``: the gradient w.r.t. q, k, v, do of <dq, dq_bar> + <dk, dk_bar> + <dv, dv_bar>
    with (dq, dk, dv) the backward expanded to Relax primitives: the same VJP as the double backward,
    the way an autodiff system without a fused one computes it."""
    shape = (B, H, S, D)
    names = ("q", "k", "v", "do", "dq_bar", "dk_bar", "dv_bar")
    params = [relax.Var(n, relax.TensorType(shape, "float32")) for n in names]
    bb = relax.BlockBuilder()
    with bb.function("main", params):
        with bb.dataflow():
            q, k, v, do, *bars = params
            grads = bb.emit(op.flash_attn_backward(q, k, v, do, causal=causal))
            terms = [bb.emit(relax.op.sum(relax.op.multiply(relax.TupleGetItem(grads, i), bar)))
                     for i, bar in enumerate(bars)]
            total = bb.emit_output(relax.op.add(relax.op.add(terms[0], terms[1]), terms[2]))
        bb.emit_func_output(total)
    expanded = ExpandAttention()(bb.get())
    return relax.transform.Gradient("main", require_grads=expanded["main"].params[:4])(expanded)


def _arrays(names, B: int, H: int, S: int, D: int, causal: bool, target) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(0)
    shape = (B, H, S, D)
    arrays = {n: rng.standard_normal(shape).astype(np.float32) for n in names if n not in ("out", "lse")}
    if "out" in names:  # the forward's state, as a training step has it
        forward = build_vm(_module("forward", B, H, S, D, causal), target, "tuned")
        out, lse = forward["main"](*(tvm.runtime.tensor(arrays[n]) for n in ("q", "k", "v")))
        arrays.update(out=out.numpy(), lse=lse.numpy())
    return arrays


def _tensors(arrays: dict, kind: str) -> list:
    return [tvm.runtime.tensor(arrays[n]) for n in _ARGS[kind]]


def _jvp_rows(target) -> list[dict]:
    rows = []
    for case in (c for c in default_suite()[0] if not c.backward):
        dims = (case.B, case.H, case.S, case.D, case.causal)
        arrays = _arrays(_ARGS["jvp"], *dims, target)
        vms = {kind: build_vm(_module(kind, *dims), target, "tuned") for kind in ("forward", "jvp")}
        args = {kind: _tensors(arrays, kind) for kind in vms}
        timed = measure_side_by_side({kind: (lambda kind=kind: vms[kind]["main"](*args[kind])) for kind in vms})
        ms = {kind: seconds * 1e3 for kind, (seconds, _) in timed.items()}
        rows.append({"name": f"jvp {case.name}", "forward_ms": ms["forward"], "jvp_ms": ms["jvp"],
                     "jvp_over_forward": ms["jvp"] / ms["forward"]})
    return rows


def _torch_double_backward(arrays: dict, causal: bool) -> dict:
    try:
        import torch
        from torch.nn.attention import SDPBackend, sdpa_kernel
    except ImportError:
        return {"skipped": "torch is not installed (pip install -e '.[bench]')"}
    from ..compat.threads import thread_count

    torch.set_num_threads(thread_count())
    q, k, v, do = (torch.from_numpy(arrays[n]).requires_grad_(True) for n in ("q", "k", "v", "do"))
    bars = tuple(torch.from_numpy(arrays[n]) for n in ("dq_bar", "dk_bar", "dv_bar"))
    with sdpa_kernel(SDPBackend.MATH):  # the one SDPA backend with a double backward
        out = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=causal)
        first = torch.autograd.grad(out, (q, k, v), do, create_graph=True)
        seconds, runs = measure(lambda: torch.autograd.grad(first, (q, k, v, do), bars, retain_graph=True))
    return {"ms": seconds * 1e3, "runs": runs}


def _double_backward_row(target) -> dict:
    B, H, S, D, causal = DOUBLE_BACKWARD_SHAPE
    arrays = _arrays(_ARGS["double_backward"], B, H, S, D, causal, target)
    vms = {kind: build_vm(_module(kind, B, H, S, D, causal), target, "tuned")
           for kind in ("backward", "double_backward")}
    args = {kind: _tensors(arrays, kind) for kind in vms}
    timed = measure_side_by_side({kind: (lambda kind=kind: vms[kind]["main"](*args[kind])) for kind in vms})
    row = {"name": f"double backward B{B} H{H} S{S} D{D}{' causal' if causal else ''} float32",
           **{f"{kind}_ms": seconds * 1e3 for kind, (seconds, _) in timed.items()}}
    expanded = build_vm(_expanded_double_backward(B, H, S, D, causal), target, "decomposed")
    names = ("q", "k", "v", "do", "dq_bar", "dk_bar", "dv_bar")
    inputs = [tvm.runtime.tensor(arrays[n]) for n in names]
    start = time.perf_counter()  # one run: it takes minutes (its matmuls run unscheduled, one thread)
    expanded["main_adjoint"](*inputs)
    row["expanded_ms"] = (time.perf_counter() - start) * 1e3
    row["torch_math"] = _torch_double_backward(arrays, causal)
    row["double_over_backward"] = row["double_backward_ms"] / row["backward_ms"]
    row["expanded_over_double"] = row["expanded_ms"] / row["double_backward_ms"]
    if "ms" in row["torch_math"]:
        row["double_over_torch_math"] = row["double_backward_ms"] / row["torch_math"]["ms"]
    return row


def double_backward_memory(B: int = MEMORY_SHAPE[0], H: int = MEMORY_SHAPE[1], S: int = MEMORY_SHAPE[2],
                           D: int = MEMORY_SHAPE[3], causal: bool = MEMORY_SHAPE[4]) -> dict:
    """The fused double backward (tuned, out and lse from the forward kernel) at long context, in
    this process: seconds and peak resident memory; and the expansion's [H, S, S] float32 tensors."""
    target = host_target()
    arrays = _arrays(_ARGS["double_backward"], B, H, S, D, causal, target)
    vm = build_vm(_module("double_backward", B, H, S, D, causal), target, "tuned")
    args = _tensors(arrays, "double_backward")
    before = peak_rss_mib()
    start = time.perf_counter()
    vm["main"](*args)
    seconds = time.perf_counter() - start
    scores_gib = B * H * S * S * 4 / 2**30
    return {"S": S, "H": H, "D": D, "causal": causal, "seconds": seconds, "peak_rss_mib": peak_rss_mib(),
            "rss_before_run_mib": before, "expansion_score_tensor_gib": scores_gib,
            "expansion_score_tensors": _score_tensor_count()}


def _score_tensor_count() -> int:
    """How many [B, H, Sq, Sk] tensors the expanded double backward binds (counted at a small shape,
    S = 64: the expansion's structure does not depend on S)."""
    mod = _expanded_double_backward(1, 2, 64, 8, True)
    count = 0

    def visit(binding_var):
        nonlocal count
        ty = binding_var.ty
        if isinstance(ty, relax.TensorType) and ty.shape is not None and ty.ndim == 4:
            dims = [int(d) for d in ty.shape.values]
            count += dims[2:] == [64, 64]

    for block in mod["main_adjoint"].body.blocks:
        for binding in block.bindings:
            visit(binding.var)
    return count


def higher_order_rows(*, memory: bool = True) -> dict:
    """The JVP rows, the double backward row and (``memory``) the S = 16384 probe in a child process."""
    target = host_target()
    report = {"jvp": _jvp_rows(target), "double_backward": _double_backward_row(target)}
    if memory:
        report["double_backward_memory"] = child_probe("tvm_fuel.bench.higher_order", "--memory-probe")
    return report


def print_rows(report: dict) -> None:
    print(f"\n{'higher order':<48} {'ours':>12} {'reference':>12} {'ratio':>8}")
    for row in report["jvp"]:
        print(f"{row['name']:<48} {row['jvp_ms']:9.2f} ms {row['forward_ms']:9.2f} ms {row['jvp_over_forward']:8.2f}"
              "  (jvp / forward)")
    row = report["double_backward"]
    print(f"{row['name']:<48} {row['double_backward_ms']:9.2f} ms {row['backward_ms']:9.2f} ms "
          f"{row['double_over_backward']:8.2f}  (double backward / backward)")
    print(f"{'  expanded primitives (Gradient of ExpandAttention)':<48} {row['expanded_ms']:9.0f} ms "
          f"{'':>12} {row['expanded_over_double']:8.1f}  (expanded / fused)")
    torch_math = row["torch_math"]
    if "ms" in torch_math:
        print(f"{'  PyTorch math-backend double backward':<48} {torch_math['ms']:9.2f} ms {'':>12} "
              f"{row['double_over_torch_math']:8.2f}  (fused / torch)")
    else:
        print(f"  PyTorch: {torch_math['skipped']}")
    memory = report.get("double_backward_memory")
    if memory and "peak_rss_mib" in memory:
        print(f"double backward S={memory['S']} H={memory['H']} D={memory['D']} causal: {memory['seconds']:.2f} s, "
              f"peak RSS {memory['peak_rss_mib']:.0f} MiB; the expansion binds {memory['expansion_score_tensors']} "
              f"[H, S, S] float32 tensors of {memory['expansion_score_tensor_gib']:.0f} GiB each")
    elif memory:
        print(f"double backward memory probe failed: {memory.get('error', '')[-300:]}")


if __name__ == "__main__":
    if "--memory-probe" in sys.argv:
        print(json.dumps(double_backward_memory()))
