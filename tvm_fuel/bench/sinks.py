"""The benchmark's sinks rows (``python -m tvm_fuel bench``): gpt-oss's attention sinks and
StreamingLLM's sink tokens, what they cost.

Each row times, side by side in one process, fuel's tuned kernels with ``sinks`` and the same call
without them (the sinks' overhead: the dense forward rescales its (out, lse) in one elementwise
pass, the paged kernel adds each head's sink to its rows' sums), and PyTorch's eager gpt-oss
attention (transformers' formula: the sink column concatenated to the materialized scores, then
dropped after the softmax; paged: the live blocks gathered first, as vLLM's reference does).

Contents:
    SINK_ROWS  -- the rows: flash forward (causal, S 2048) and paged decode (context 4096)
    SINK_TOKEN_ROW -- StreamingLLM decode: a window and sink tokens, beside the window alone and the whole context
    sink_rows  -- run them, return their report
    print_rows -- the rows as text
"""

from __future__ import annotations

import contextlib

import numpy as np

from ..testing.cases import FlashCase, PagedCase

SINK_ROWS = (FlashCase(1, 8, 2048, 64, causal=True), PagedCase(8, 32, 8, 128, 16, 4096, 4096))


def _eager_sinks(torch, q, k, v, sinks, *, causal: bool):
    """transformers' gpt-oss eager attention over [B, H, S, D] (k and v of Hkv heads, repeated)."""
    group = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    scores = q @ k.transpose(-1, -2) * q.shape[-1] ** -0.5
    if causal:
        sq, sk = scores.shape[-2:]
        scores = scores.masked_fill(torch.ones(sq, sk, dtype=torch.bool).triu(sk - sq + 1), float("-inf"))
    column = sinks.reshape(1, -1, 1, 1).expand(q.shape[0], -1, q.shape[2], 1)
    combined = torch.cat([scores, column], dim=-1)
    combined = combined - combined.max(dim=-1, keepdim=True).values
    return torch.softmax(combined, dim=-1)[..., :-1] @ v


def _module(case, sinks: bool, **options):
    """main(inputs[, sinks]) -> out: the case's call with sinks or without (and ``options``)."""
    from tvm import relax

    from .. import op

    if isinstance(case, FlashCase):
        shapes = {n: ((case.B, case.H, case.S, case.D), "float32") for n in ("q", "k", "v")}
    else:
        blocks = case.B * case.capacity // case.block_size
        cache = ((blocks, case.block_size, case.Hkv, case.D), case.dtype)
        shapes = dict(q=((case.B, case.Hq, 1, case.D), case.dtype), k_cache=cache, v_cache=cache,
                      block_table=((case.B, case.capacity // case.block_size), "int32"),
                      context_lens=((case.B,), "int32"))
    heads = case.H if isinstance(case, FlashCase) else case.Hq
    shapes |= {"sinks": ((heads,), "float32")} if sinks else {}
    params = {n: relax.Var(n, relax.TensorType(*s)) for n, s in shapes.items()}
    bb = relax.BlockBuilder()
    with bb.function("main", list(params.values())):
        if isinstance(case, FlashCase):
            call = op.flash_attn(**params, causal=case.causal)
        else:
            call = op.paged_attn(**params, **options)
        bb.emit_func_output(bb.emit(call))
    return bb.get()


def _arrays(case, rng) -> dict:
    if isinstance(case, FlashCase):
        return {n: rng.standard_normal((case.B, case.H, case.S, case.D)).astype("float32") for n in ("q", "k", "v")}
    max_blocks = case.capacity // case.block_size
    cache = (case.B * max_blocks, case.block_size, case.Hkv, case.D)
    return dict(q=rng.standard_normal((case.B, case.Hq, 1, case.D)).astype("float32"),
                k_cache=rng.standard_normal(cache).astype("float32"),
                v_cache=rng.standard_normal(cache).astype("float32"),
                block_table=rng.permutation(case.B * max_blocks).reshape(case.B, max_blocks).astype("int32"),
                context_lens=np.full(case.B, case.context, "int32"))


def _row(case, target) -> dict:
    import tvm

    from ..testing.peers import paged_gather_sdpa
    from .attention import build_vm, measure_side_by_side, torch_with_our_threads

    rng = np.random.default_rng(0)
    arrays = _arrays(case, rng)
    heads = case.H if isinstance(case, FlashCase) else case.Hq
    sinks = (rng.standard_normal(heads) * 2).astype("float32")
    tensors = [tvm.runtime.tensor(a) for a in arrays.values()]
    with_sinks = build_vm(_module(case, True), target, "tuned")
    plain = build_vm(_module(case, False), target, "tuned")
    sink_tensor = tvm.runtime.tensor(sinks)
    fns = {"fuel_sinks": lambda: with_sinks["main"](*tensors, sink_tensor),
           "fuel_plain": lambda: plain["main"](*tensors)}
    torch = torch_with_our_threads()
    if torch is not None:
        t = {n: torch.from_numpy(a) for n, a in arrays.items()}
        t_sinks = torch.from_numpy(sinks)
        if isinstance(case, FlashCase):
            fns["torch_eager_sinks"] = lambda: _eager_sinks(torch, t["q"], t["k"], t["v"], t_sinks, causal=case.causal)
        else:
            fns["torch_eager_sinks"] = paged_gather_sdpa(
                torch, t["q"], t["k_cache"], t["v_cache"], t["block_table"], case.context,
                attend=lambda q, k, v: _eager_sinks(torch, q, k, v, t_sinks, causal=False))
    with torch.no_grad() if torch is not None else contextlib.nullcontext():
        timed = measure_side_by_side(fns)
    results = {name: {"ms": seconds * 1e3, "runs": runs} for name, (seconds, runs) in timed.items()}
    row = {"name": case.name + " sinks", "results": results,
           "sinks_over_plain": results["fuel_sinks"]["ms"] / results["fuel_plain"]["ms"]}
    if "torch_eager_sinks" in results:
        row["fuel_over_torch"] = results["fuel_sinks"]["ms"] / results["torch_eager_sinks"]["ms"]
    return row


def _sink_tokens_row(case: PagedCase, target, window: int, sink_tokens: int) -> dict:
    """StreamingLLM decode: a window of ``window`` keys with the first ``sink_tokens`` kept, beside
    the window alone and the whole context (fuel's tuned paged kernel, side by side)."""
    import tvm

    from .attention import build_vm, measure_side_by_side

    tensors = [tvm.runtime.tensor(a) for a in _arrays(case, np.random.default_rng(0)).values()]
    window_only = dict(causal=True, window_size=(window - 1, -1))
    vms = {"window_and_sink_tokens": build_vm(_module(case, False, **window_only, sink_tokens=sink_tokens),
                                              target, "tuned"),
           "window": build_vm(_module(case, False, **window_only), target, "tuned"),
           "whole_context": build_vm(_module(case, False, causal=True), target, "tuned")}
    timed = measure_side_by_side({name: (lambda vm=vm: vm["main"](*tensors)) for name, vm in vms.items()})
    results = {name: {"ms": seconds * 1e3, "runs": runs} for name, (seconds, runs) in timed.items()}
    ms = {name: r["ms"] for name, r in results.items()}
    return {"name": f"{case.name} window{window} sink_tokens{sink_tokens}", "results": results,
            "sink_tokens_over_window": ms["window_and_sink_tokens"] / ms["window"],
            "sink_tokens_over_whole_context": ms["window_and_sink_tokens"] / ms["whole_context"]}


SINK_TOKEN_ROW = (PagedCase(8, 32, 8, 128, 16, 8192, 8192), 512, 4)  # decode, window 512 of 8192 keys, 4 sinks


def sink_rows() -> dict:
    """Every row of SINK_ROWS and the sink tokens' row on this CPU (the tuned kernels, fuel's shipped logs)."""
    from ..target import host_target

    target = host_target()
    case, window, sink_tokens = SINK_TOKEN_ROW
    return {"rows": [_row(c, target) for c in SINK_ROWS],
            "sink_tokens": _sink_tokens_row(case, target, window, sink_tokens)}


def print_rows(report: dict) -> None:
    print(f"\n{'sinks row':<60} {'fuel sinks':>12} {'fuel plain':>12} {'torch eager':>12} {'sinks/plain':>12} "
          f"{'fuel/torch':>11}")
    for row in report["rows"]:
        r = row["results"]
        torch = f"{r['torch_eager_sinks']['ms']:9.2f} ms" if "torch_eager_sinks" in r else f"{'skipped':>12}"
        print(f"{row['name']:<60} {r['fuel_sinks']['ms']:9.2f} ms {r['fuel_plain']['ms']:9.2f} ms {torch} "
              f"{row['sinks_over_plain']:12.2f} {row.get('fuel_over_torch', float('nan')):11.2f}")
    print("(side by side in one process; sinks/plain: the sinks' overhead on fuel's kernels; fuel/torch < 1: fuel "
          "is faster than transformers' eager gpt-oss attention)")
    row = report.get("sink_tokens")
    if row:
        r = row["results"]
        print(f"{row['name']}: {r['window_and_sink_tokens']['ms']:.2f} ms with the sink tokens, "
              f"{r['window']['ms']:.2f} ms the window alone ({row['sink_tokens_over_window']:.2f}x), "
              f"{r['whole_context']['ms']:.2f} ms the whole context ({row['sink_tokens_over_whole_context']:.2f}x)")
