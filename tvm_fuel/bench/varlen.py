"""The benchmark's varlen row (``python -m tvm_fuel bench``): a packed batch of prompts of very
different lengths, attended without padding.

Side by side in one process, on the same packed batch (causal, float32):

* ``fuel_varlen``: ``flash_attn_varlen`` through fuel's kernels (the floor where no kernel serves it);
* ``fuel_padded``: fuel's dense ``flash_attn`` over the batch padded to the longest prompt, a
  bool mask dropping the padding (what a model without varlen runs);
* ``torch_per_sequence``: PyTorch's SDPA called once per prompt (FlashAttention's own varlen
  reference does this), each prompt's tensors made contiguous before the timing;
* ``torch_padded``: PyTorch's SDPA over the padded batch with the same mask;
* ``fuel_floor``: the decomposition (``kernels="decomposed"``), where its total x longest scores are
  few (the many-short row).

And its backward (``flash_attn_varlen_backward`` given the forward's out and lse):

* ``fuel_kernel``: the CPU kernel (cost sum_b S_b^2);
* ``fuel_floor``: the decomposition, where its scores are few (not VARLEN_ROW's: ~44 s a call here);
* ``torch_per_sequence``: PyTorch's SDPA backward per prompt (``autograd.grad`` of a kept graph).

Every call passes max_seqlen_q and max_seqlen_k, as FlashAttention's ``flash_attn_varlen_func``
requires: the kernels size their tiles by them.

Contents:
    VARLEN_ROW  -- the row: prompt lengths, heads and head dim
    varlen_rows -- run it (and its backward), return its report
    print_rows  -- the report as text
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class VarlenCase:
    lens: tuple[int, ...]
    Hq: int
    Hkv: int
    D: int

    @property
    def name(self) -> str:
        lens = f"S{self.lens[0]}" if len(set(self.lens)) == 1 else f"S{'/'.join(map(str, self.lens))}"
        return f"varlen causal B{len(self.lens)} {lens} Hq{self.Hq} Hkv{self.Hkv} D{self.D}"

    @property
    def flops(self) -> float:
        """The causal work of the packed batch: 4 D per visible (query, key) pair and head."""
        return sum(4.0 * self.D * self.Hq * s * (s + 1) / 2 for s in self.lens)


VARLEN_ROW = VarlenCase((1536, 512, 96, 17, 1024, 1), 8, 2, 64)
# many tiny sequences (issue 55): each costs its own row and key, not a whole tile
MANY_SHORT_ROW = VarlenCase((1,) * 2048, 8, 8, 64)


def _with_floor(case: VarlenCase) -> bool:
    """Whether the decomposition's [B, Hq, longest, longest] scores are few enough to time."""
    from ..testing.cases import FLOOR_MAX_SCORES

    return len(case.lens) * case.Hq * max(case.lens) ** 2 <= FLOOR_MAX_SCORES


def _modules(case: VarlenCase):
    from tvm import relax

    from .. import op

    total, longest, B = sum(case.lens), max(case.lens), len(case.lens)

    def function(params, call):
        bb = relax.BlockBuilder()
        variables = [relax.Var(n, relax.TensorType(*s)) for n, s in params.items()]
        with bb.function("main", variables):
            bb.emit_func_output(bb.emit(call(*variables)))
        return bb.get()

    packed = function(dict(q=((total, case.Hq, case.D), "float32"), k=((total, case.Hkv, case.D), "float32"),
                           v=((total, case.Hkv, case.D), "float32"), cu_q=((B + 1,), "int32"),
                           cu_k=((B + 1,), "int32")),
                      lambda q, k, v, cu_q, cu_k: op.flash_attn_varlen(q, k, v, cu_q, cu_k, causal=True,
                                                                       max_seqlen_q=longest, max_seqlen_k=longest))
    padded = function(dict(q=((B, case.Hq, longest, case.D), "float32"), k=((B, case.Hkv, longest, case.D), "float32"),
                           v=((B, case.Hkv, longest, case.D), "float32"), mask=((B, 1, longest, longest), "bool")),
                      lambda q, k, v, mask: op.flash_attn(q, k, v, attn_mask=mask))
    return packed, padded


def _padded(case: VarlenCase, packed: np.ndarray, heads: int) -> np.ndarray:
    """[total, H, D] -> [B, H, longest, D], zeros past each prompt."""
    out = np.zeros((len(case.lens), heads, max(case.lens), case.D), packed.dtype)
    start = 0
    for b, n in enumerate(case.lens):
        out[b, :, :n] = np.swapaxes(packed[start:start + n], 0, 1)
        start += n
    return out


def _mask(case: VarlenCase) -> np.ndarray:
    """[B, 1, longest, longest] bool: causal within each prompt; a padding row keeps its own key
    (a row of padding is then finite for every peer; its output is dropped)."""
    longest = max(case.lens)
    i, j = np.arange(longest)[:, None], np.arange(longest)[None, :]
    mask = np.stack([(j <= i) & ((j < n) | (j == i)) for n in case.lens])
    return mask[:, None]


def _row(case: VarlenCase, target) -> dict:
    import tvm

    from .attention import build_vm, measure_side_by_side, torch_with_our_threads

    rng = np.random.default_rng(0)
    total = sum(case.lens)
    q = rng.standard_normal((total, case.Hq, case.D)).astype("float32")
    k, v = (rng.standard_normal((total, case.Hkv, case.D)).astype("float32") for _ in range(2))
    cu = np.concatenate([[0], np.cumsum(case.lens)]).astype("int32")
    padded = dict(q=_padded(case, q, case.Hq), k=_padded(case, k, case.Hkv), v=_padded(case, v, case.Hkv),
                  mask=_mask(case))
    packed_mod, padded_mod = _modules(case)
    packed_vm, padded_vm = build_vm(packed_mod, target, "tuned"), build_vm(padded_mod, target, "tuned")
    packed_args = [tvm.runtime.tensor(a) for a in (q, k, v, cu, cu)]
    padded_args = [tvm.runtime.tensor(a) for a in padded.values()]
    fns = {"fuel_varlen": lambda: packed_vm["main"](*packed_args),
           "fuel_padded": lambda: padded_vm["main"](*padded_args)}
    if _with_floor(case):
        floor_vm = build_vm(packed_mod, target, "decomposed")
        fns["fuel_floor"] = lambda: floor_vm["main"](*packed_args)
    torch = torch_with_our_threads()
    if torch is not None:
        import torch.nn.functional as F

        group = case.Hq // case.Hkv
        # each prompt's q, k, v as contiguous [1, H, S, D] copies made before the timing: PyTorch's
        # best case (a strided slice of the packed layout takes a slower path, ~4x here)
        per_prompt = [[torch.from_numpy(np.ascontiguousarray(np.swapaxes(x[a:b], 0, 1)[None])) for x in (q, k, v)]
                      for a, b in zip(cu[:-1], cu[1:])]

        def per_sequence():
            return [F.scaled_dot_product_attention(*qkv, is_causal=True, enable_gqa=group > 1) for qkv in per_prompt]

        pq, pk, pv, pmask = (torch.from_numpy(a) for a in padded.values())
        fns["torch_per_sequence"] = per_sequence
        fns["torch_padded"] = lambda: F.scaled_dot_product_attention(pq, pk, pv, attn_mask=pmask, enable_gqa=group > 1)
    with torch.no_grad() if torch is not None else contextlib.nullcontext():
        timed = measure_side_by_side(fns)
    results = {name: {"ms": seconds * 1e3, "runs": runs, "gflops": case.flops / seconds / 1e9}
               for name, (seconds, runs) in timed.items()}
    row = {"name": case.name, "results": results}
    for peer in ("fuel_floor", "fuel_padded", "torch_per_sequence", "torch_padded"):
        if peer in results:
            row[f"varlen_over_{peer}"] = results["fuel_varlen"]["ms"] / results[peer]["ms"]
    return row


def _backward_module(case: VarlenCase):
    from tvm import relax

    from .. import op

    total, B, Hq, Hkv, D = sum(case.lens), len(case.lens), case.Hq, case.Hkv, case.D
    params = dict(q=((total, Hq, D), "float32"), k=((total, Hkv, D), "float32"), v=((total, Hkv, D), "float32"),
                  do=((total, Hq, D), "float32"), cu_q=((B + 1,), "int32"), cu_k=((B + 1,), "int32"),
                  out=((total, Hq, D), "float32"), lse=((Hq, total), "float32"))
    bb = relax.BlockBuilder()
    variables = [relax.Var(n, relax.TensorType(*shape)) for n, shape in params.items()]
    with bb.function("main", variables):
        q, k, v, do, cu_q, cu_k, out, lse = variables
        bb.emit_func_output(bb.emit(op.flash_attn_varlen_backward(
            q, k, v, do, cu_q, cu_k, out=out, lse=lse, causal=True, max_seqlen_q=max(case.lens),
            max_seqlen_k=max(case.lens))))
    return bb.get()


def backward_row(case: VarlenCase, target) -> dict:
    """The backward of ``case``: the CPU kernel, the floor (where its scores are few) and PyTorch per
    prompt, side by side."""
    import tvm

    from .. import reference
    from .attention import build_vm, measure_side_by_side, torch_with_our_threads

    rng = np.random.default_rng(1)
    total = sum(case.lens)
    q, do = (rng.standard_normal((total, case.Hq, case.D)).astype("float32") for _ in range(2))
    k, v = (rng.standard_normal((total, case.Hkv, case.D)).astype("float32") for _ in range(2))
    cu = np.concatenate([[0], np.cumsum(case.lens)]).astype("int32")
    out, lse = (x.astype("float32") for x in reference.flash_attn_varlen(q, k, v, cu, cu, causal=True,
                                                                         return_lse=True))
    args = [tvm.runtime.tensor(a) for a in (q, k, v, do, cu, cu, out, lse)]
    mod = _backward_module(case)
    kernel_vm = build_vm(mod, target, "tuned")
    fns = {"fuel_kernel": lambda: kernel_vm["main"](*args)}
    if _with_floor(case):
        floor_vm = build_vm(mod, target, "decomposed")
        fns["fuel_floor"] = lambda: floor_vm["main"](*args)
    torch = torch_with_our_threads()
    if torch is not None:
        import torch.nn.functional as F

        graphs = []
        for a, b in zip(cu[:-1], cu[1:]):
            leaves = [torch.from_numpy(np.ascontiguousarray(np.swapaxes(x[a:b], 0, 1)[None])).requires_grad_()
                      for x in (q, k, v)]
            result = F.scaled_dot_product_attention(*leaves, is_causal=True, enable_gqa=case.Hq > case.Hkv)
            graphs.append((result, leaves, torch.from_numpy(np.ascontiguousarray(np.swapaxes(do[a:b], 0, 1)[None]))))
        fns["torch_per_sequence"] = lambda: [torch.autograd.grad(r, leaves, g, retain_graph=True)
                                             for r, leaves, g in graphs]
    timed = measure_side_by_side(fns)
    flops = 2.5 * case.flops  # five GEMMs to the forward's two
    results = {name: {"ms": seconds * 1e3, "runs": runs, "gflops": flops / seconds / 1e9}
               for name, (seconds, runs) in timed.items()}
    row = {"name": f"backward {case.name}", "results": results}
    for peer in ("fuel_floor", "torch_per_sequence"):
        if peer in results:
            row[f"kernel_over_{peer}"] = results["fuel_kernel"]["ms"] / results[peer]["ms"]
    return row


def varlen_rows() -> dict:
    """The varlen row and its backward on this CPU (fuel's tuned build, its shipped logs)."""
    from ..target import host_target

    return {"rows": [_row(case, host_target()) for case in (VARLEN_ROW, MANY_SHORT_ROW)],
            "backward_rows": [backward_row(case, host_target()) for case in (VARLEN_ROW, MANY_SHORT_ROW)]}


def _print_row(row: dict, names: tuple[str, ...], subject: str, prefix: str, meaning: str) -> None:
    # one row's timings (skipped where a peer is absent), then its ratios (keys ``prefix + peer``)
    r = row["results"]
    cells = "".join(f"{r[n]['ms']:11.2f} ms {r[n]['gflops']:4.0f}GF" if n in r else f"{'skipped':>20}" for n in names)
    print(f"{row['name']:<62}{cells}")
    ratios = ", ".join(f"{key[len(prefix):]} {value:.2f}" for key, value in row.items() if key.startswith(prefix))
    print(f"  {subject} over: {ratios} (side by side in one process; < 1: {meaning})")


def print_rows(report: dict) -> None:
    names = ("fuel_varlen", "fuel_floor", "fuel_padded", "torch_per_sequence", "torch_padded")
    print(f"\n{'varlen row':<62}" + "".join(f"{n:>20}" for n in names))
    for row in report["rows"]:
        _print_row(row, names, "fuel_varlen", "varlen_over_", "the packed batch is faster")
    names = ("fuel_kernel", "fuel_floor", "torch_per_sequence")
    for row in report.get("backward_rows", []):
        print(f"\n{'varlen backward row':<62}" + "".join(f"{n:>20}" for n in names))
        _print_row(row, names, "fuel_kernel", "kernel_over_", "the kernel is faster")
