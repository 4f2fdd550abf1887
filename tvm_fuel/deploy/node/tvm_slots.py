"""The attention slots of TVM's runtime KV cache, fuel's kernel against TVM's own, on one batch.

numpy only (the node has no TVM compiler): the batch is drawn from a seed wherever it runs, the
kernels are whatever functions the caller hands in (a bundle's module on the node; CPU kernels
compiled here in the tests). A batch holds ``B`` sequences with ``cached[b]`` keys in TVM's
pages and ``new[b]`` query tokens:

    q            [total_q, Hq, D]      dtype, the new tokens' queries (``q_indptr`` [B + 1])
    k, v         [total_q, Hkv, D]     dtype, the new tokens' keys and values (ragged slots)
    pages        [num_pages, 2, Hkv, page_size, D]   dtype, K and V; pages in random order, 3 spare
    page_indptr  [B + 1], page_values [nnz_pages]    int32, each sequence's pages
    last         [B]                   int32, tokens in each sequence's last page
    window       [3, B]                int32, (last page length, window offset, sink length)
    k_offset     [B], q_position [total_q]           int32, RoPE positions
    tree_order   [total_q, 2]          int32, each new token's depth-first (enter, exit) numbers in
                                       its sequence's random token tree
    merge        v, v_other [total_q, Hq, D] dtype, s, s_other [total_q, Hq] float32: two states

A call is one kernel invocation, ``kernel(*args)``, whose ``outputs`` (indices into ``args``) are
compared: fuel's must be finite; out within the dtype's tolerance and lse (float32, log2 units)
within 1e-4 where fuel's row saw a key. A row where fuel's saw none must be fuel's convention
(out 0, lse -5e4) and one where TVM's saw none too (its lse -5e4 or less, or not finite: its CPU
sliding prefill leaves NaN there).

Contents:
    slot_batch   -- a batch of TVM-cache inputs from a generator
    slot_calls   -- each slot's calls on a batch (prefills causal 0 and 1, rotary modes, trees)
    check_slots  -- run fuel's and TVM's kernel of each call on fresh copies; the comparisons
    run_slots    -- a bundle's ``tvm_slots`` case on a node: checks and (bench) timings
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .arrays import numpy_dtype
from .compare import DEVICE_SCALE, compare

EMPTY_LSE = -5e4  # fuel's lse of a row that saw no key (and TVM's where it sets one): ~0 weight in a merge
# TVM's GPU decode (_attention_decode) scores masked slots -5e4 and starts merged partials at
# m = -5e4, d = 1, so an empty row's sum counts them: lse -5e4 + log2(count), above -5e4 + 1 on an H200
EMPTY_LSE_SLACK = 32.0
SLOT_TOLERANCE = {"float32": (1e-5, 1e-5), "float16": (1e-3, 1e-3), "bfloat16": (1e-2, 1e-2)}
SLOT_LSE_TOLERANCE = (1e-4, 1e-4)


@dataclass(frozen=True)
class Call:
    slot: str
    label: str
    args: tuple  # arrays (copied to the device fresh for each kernel) and Python scalars
    outputs: tuple[int, ...]  # indices of (out, lse) in args


def _tree(rng: np.random.Generator, n: int) -> list[int]:
    """A random token forest of n nodes: each node's parent precedes it (-1: a root)."""
    return [-1] + [int(rng.integers(-1, node)) for node in range(1, n)] if n else []


def tree_order(parents: list[int]) -> np.ndarray:
    """[n, 2] int32: each node's depth-first (enter, exit) numbers (TVM's tree_order)."""
    children: list[list[int]] = [[] for _ in parents]
    for node, parent in enumerate(parents):
        if parent != -1:
            children[parent].append(node)
    order, counter = np.zeros((len(parents), 2), "int32"), 0
    stack = [(root, False) for root in reversed([n for n, p in enumerate(parents) if p == -1])]
    while stack:  # iterative: trees of thousands of nodes
        node, leaving = stack.pop()
        if leaving:
            order[node, 1] = counter
            continue
        order[node, 0], counter = counter, counter + 1
        stack.append((node, True))
        stack += [(child, False) for child in reversed(children[node])]
    return order


def slot_batch(rng: np.random.Generator, num_qo_heads: int, num_kv_heads: int, head_dim: int, dtype: str,
               page_size: int, cached, new) -> dict:
    """The batch's arrays (module docstring); window offsets and sinks grow with the sequence
    (none below 8 keys; a window offset past the sinks from 65 keys)."""
    hq, hkv, d, dtype = num_qo_heads, num_kv_heads, head_dim, numpy_dtype(dtype)
    cached, new = [int(n) for n in cached], [int(n) for n in new]
    num_pages = [-(-n // page_size) for n in cached]
    page_indptr = np.cumsum([0] + num_pages).astype("int32")
    pages = rng.standard_normal((page_indptr[-1] + 3, 2, hkv, page_size, d), dtype="float32").astype(dtype)
    page_values = rng.permutation(len(pages))[:page_indptr[-1]].astype("int32")
    last = np.array([n - (p - 1) * page_size if p else 0 for n, p in zip(cached, num_pages)], "int32")
    sinks = [min(n // 8, 4) for n in cached]
    offsets = [s + (n > 64) for s, n in zip(sinks, cached)]
    q_indptr = np.cumsum([0] + new).astype("int32")
    total = int(q_indptr[-1])
    q = rng.standard_normal((total, hq, d), dtype="float32").astype(dtype)
    k, v = (rng.standard_normal((total, hkv, d), dtype="float32").astype(dtype) for _ in range(2))
    trees = [_tree(rng, n) for n in new]
    # two states of the new rows to merge, a side that saw no key among them
    merge = [rng.standard_normal((total, hq, d), dtype="float32").astype(dtype) for _ in range(2)]
    merge += [rng.standard_normal((total, hq)).astype("float32") * 4 for _ in range(2)]
    merge[2][::3], merge[3][1::5] = EMPTY_LSE, EMPTY_LSE
    return dict(merge=merge, cached=cached, new=new, q=q,
                q_indptr=q_indptr, k=k, v=v, pages=pages, page_indptr=page_indptr, page_values=page_values, last=last,
                window=np.stack([last, offsets, sinks]).astype("int32"),
                tree_order=np.concatenate([tree_order(t) for t in trees] or [np.zeros((0, 2), "int32")]),
                q_position=rng.integers(0, 50, total).astype("int32"),
                k_offset=rng.integers(0, 32, len(cached)).astype("int32"))


def slot_calls(batch: dict, slots, *, rotary_modes=(0,), theta: float = 1e4, causal=(0, 1)) -> list[Call]:
    """Each of ``slots``' calls on ``batch``: the prefills with each ``causal`` flag, every slot
    with each rotary mode (TVM's tree kernel over pages has none); the paged tree over the
    sequences that hold at least their new tokens (the tree's nodes the pages' last keys);
    ``merge_state`` of two states of the new tokens' rows, some of them empty."""
    b = batch
    (_, hq, d), scale = b["q"].shape, b["q"].shape[-1] ** -0.5
    rows = lambda n: (np.zeros((n, hq, d), b["q"].dtype), np.zeros((n, hq), "float32"))  # noqa: E731
    starts = b["q_indptr"][:-1]  # decode: each sequence's first new token
    paged = (b["q"], b["q_indptr"], b["pages"], b["page_indptr"], b["page_values"])
    forms = {
        "prefill": (paged + (b["last"], b["k_offset"], b["q_position"]), causal),
        "prefill_sliding_window": (paged + (b["window"], b["k_offset"], b["q_position"]), causal),
        "prefill_ragged": ((b["q"], b["q_indptr"], b["k"], b["v"], b["q_indptr"], b["q_position"], b["k_offset"]),
                           causal),
        "decode": ((b["q"][starts],) + paged[2:] + (b["last"], b["k_offset"], b["q_position"][starts]), (None,)),
        "decode_sliding_window": ((b["q"][starts],) + paged[2:] + (b["window"], b["k_offset"],
                                                                  b["q_position"][starts]), (None,)),
        "prefill_with_tree_mask": ((b["q"], b["q_indptr"], b["k"], b["v"], b["q_indptr"], b["q_position"],
                                    b["q_indptr"], b["tree_order"]), (None,)),
    }
    unknown = set(slots) - set(forms) - {"prefill_with_tree_mask_paged_kv_cache", "merge_state"}
    if unknown:
        raise ValueError(f"tvm_slots: unknown slots {sorted(unknown)}")
    if any(slot.startswith("decode") for slot in slots) and min(b["new"], default=1) < 1:
        raise ValueError(f"tvm_slots: the decode slots need a new token in every sequence, got new {b['new']}")
    calls = []
    for slot, (before, flags) in forms.items():
        if slot not in slots:
            continue
        n = len(before[0])
        for mode in rotary_modes:
            for flag in flags:
                after = (() if flag is None else (flag,)) + (mode, 1.0, theta, scale)
                label = f"{slot}, rotary_mode {mode}" + ("" if flag is None else f", causal {flag}")
                calls.append(Call(slot, label, before + rows(n) + after, (len(before), len(before) + 1)))
    if "prefill_with_tree_mask_paged_kv_cache" in slots:
        calls.append(_paged_tree_call(b, theta, scale, rows))
    if "merge_state" in slots:
        v, v_other, s, s_other = b["merge"]
        calls.append(Call("merge_state", "merge_state", (v, s, v_other, s_other), (0, 1)))
    return calls


def _paged_tree_call(b: dict, theta: float, scale: float, rows) -> Call:
    keep = [i for i, (n, m) in enumerate(zip(b["cached"], b["new"])) if n >= m > 0]
    if not keep:
        raise ValueError("tvm_slots: the paged tree slot needs a sequence holding at least its new tokens")
    q_rows = np.concatenate([np.arange(b["q_indptr"][i], b["q_indptr"][i + 1]) for i in keep] or [np.zeros(0, int)])
    page_rows = np.concatenate([np.arange(b["page_indptr"][i], b["page_indptr"][i + 1]) for i in keep]
                               or [np.zeros(0, int)])
    q_indptr = np.cumsum([0] + [b["new"][i] for i in keep]).astype("int32")
    page_indptr = np.cumsum([0] + [b["page_indptr"][i + 1] - b["page_indptr"][i] for i in keep]).astype("int32")
    before = (b["q"][q_rows], q_indptr, b["pages"], page_indptr, b["page_values"][page_rows], b["last"][keep],
              b["k_offset"][keep], b["q_position"][q_rows])
    after = (0, 1.0, theta, scale, q_indptr, b["tree_order"][q_rows])
    return Call("prefill_with_tree_mask_paged_kv_cache", "prefill_with_tree_mask_paged_kv_cache",
                before + rows(len(q_rows)) + after, (len(before), len(before) + 1))


def device_args(call: Call, tensor) -> list:
    """The call's arguments, each array a fresh device copy made by ``tensor(array)``."""
    return [tensor(np.ascontiguousarray(a)) if isinstance(a, np.ndarray) else a for a in call.args]


def _run(kernel, call: Call, tensor) -> list[np.ndarray]:
    args = device_args(call, tensor)
    kernel(*args)
    return [args[i].numpy() for i in call.outputs]


def check_slots(calls: list[Call], fuel, tvm, tensor, dtype: str, scale: float = 1.0) -> list[dict]:
    """Each call run by ``fuel(slot)`` and ``tvm(slot)`` (functions) on fresh device copies made
    by ``tensor(array)``; the comparisons (``compare``'s dicts), fuel's empty rows checked as such."""
    checks = []
    for call in calls:
        (out, lse), (tvm_out, tvm_lse) = _run(fuel(call.slot), call, tensor), _run(tvm(call.slot), call, tensor)
        out, tvm_out = out.astype(np.float64), tvm_out.astype(np.float64)
        finite = bool(np.isfinite(out).all() and np.isfinite(lse).all())
        checks.append(_verdict(f"{call.label}: finite", finite, "fuel's out or lse is not finite"))
        empty = lse <= EMPTY_LSE if call.slot != "merge_state" else np.zeros(lse.shape, bool)
        if empty.any():
            ours = bool((out[empty] == 0).all() and (lse[empty] == EMPTY_LSE).all())
            theirs = bool(((tvm_lse[empty] <= EMPTY_LSE + EMPTY_LSE_SLACK) | ~np.isfinite(tvm_lse[empty])).all())
            checks.append(_verdict(f"{call.label}: rows with no key", ours and theirs,
                                   "fuel's not out 0 and lse -5e4" if not ours else
                                   f"TVM's kernel saw keys there (lse up to {tvm_lse[empty].max():.6g})"))
        seen = ~empty
        checks.append(compare(f"{call.label}: out vs TVM's kernel", out[seen], tvm_out[seen], SLOT_TOLERANCE[dtype],
                              scale))
        checks.append(compare(f"{call.label}: lse vs TVM's kernel", lse[seen], tvm_lse[seen], SLOT_LSE_TOLERANCE,
                              scale))
    return checks


def _verdict(what: str, ok: bool, why: str) -> dict:
    return {"what": what, "ok": ok, "max_abs_err": 0.0, "max_excess": 0.0, "why": "" if ok else why}


def run_slots(node, case: dict) -> dict:
    """A ``tvm_slots`` case: its module's ``fuel_<slot>`` and ``tvm_<slot>`` kernels on the case's
    batch, compared; a timed case also times the two kernels of each call (the first call of each
    slot), with TFLOP/s (prefills) and GB/s of K/V read (decode)."""
    module = node.module(case["module"])
    config = case["config"]
    batch = slot_batch(np.random.default_rng(case["seed"]), config["num_qo_heads"], config["num_kv_heads"],
                       config["head_dim"], case["dtype"], config["page_size"], config["cached"], config["new"])
    calls = slot_calls(batch, case["slots"], rotary_modes=tuple(case["rotary_modes"]), causal=tuple(case["causal"]))
    tensor = lambda a: node.tensors([a])[0]  # noqa: E731
    checks = check_slots(calls, lambda slot: module[f"fuel_{slot}"], lambda slot: module[f"tvm_{slot}"], tensor,
                         case["dtype"], DEVICE_SCALE if node.gpu else 1.0)
    result = {"checks": checks, "skipped": [], "status": "pass" if all(c["ok"] for c in checks) else "fail"}
    if case.get("timed"):
        call = calls[0]
        args = device_args(call, tensor)
        timings = {}
        for side, name in (("tuned", f"fuel_{call.slot}"), ("tvm", f"tvm_{call.slot}")):
            timer = module.time_evaluator(name, node.dev, number=3, repeat=5, min_repeat_ms=50)
            ms = timer(*args).median * 1e3
            timings[side] = {"ms": ms, "tflops": case["flops"] / ms / 1e9}
            if case.get("bytes_read"):
                timings[side]["gbps"] = case["bytes_read"] / ms / 1e6
        result["timings"] = timings
    return result


__all__ = ["Call", "EMPTY_LSE", "tree_order", "slot_batch", "slot_calls", "device_args", "check_slots", "run_slots"]
