"""PyTorch's side of a comparison: SDPA forward and backward, and vLLM-style paged decode.

Used by the node's check and bench stages (a copy in the bundle's ``fuel_node/``) and by
``python -m tvm_fuel bench``. Every function takes the ``torch`` module and torch tensors (any
device) and returns a function to run or time.

Contents:
    sdpa_forward, sdpa_backward, paged_gather_sdpa
    sdpa_per_sequence -- a packed (varlen) batch, one SDPA call per sequence
    peer_for      -- the peer of a bundle case (its kind, dtype and device)
    milliseconds  -- time a peer
"""

from __future__ import annotations

import time

import numpy as np


def sdpa_forward(torch, q, k, v, *, causal: bool):
    """``scaled_dot_product_attention`` (GQA when Hq != Hkv); causal only for Sq == Sk (top-left = bottom-right)."""
    gqa = q.shape[1] != k.shape[1]

    def run():
        return torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=gqa)

    return run


def sdpa_backward(torch, q, k, v, do, *, causal: bool):
    """Autograd of SDPA: returns (dq, dk, dv) for the cotangent ``do``."""
    q, k, v = (x.detach().requires_grad_(True) for x in (q, k, v))
    out = sdpa_forward(torch, q, k, v, causal=causal)()

    def run():
        return torch.autograd.grad(out, (q, k, v), do, retain_graph=True)

    return run


def paged_gather_sdpa(torch, q, k_cache, v_cache, table, context: int, attend=None):
    """Paged decode as vLLM's reference does it: gather each sequence's live blocks (every
    sequence ``context`` tokens long), then dense SDPA over them (or ``attend(q, k, v)``, k and v
    of the KV heads)."""
    batch, block_size, kv_heads, head_dim = q.shape[0], k_cache.shape[1], k_cache.shape[2], k_cache.shape[3]
    live = -(-context // block_size)

    def gather(cache):
        pages = cache[table[:, :live].long()].reshape(batch, -1, kv_heads, head_dim)
        return pages[:, :context].transpose(1, 2)

    def run():
        if attend is not None:
            return attend(q, gather(k_cache), gather(v_cache))
        return torch.nn.functional.scaled_dot_product_attention(q, gather(k_cache), gather(v_cache), enable_gqa=True)

    return run


def sdpa_per_sequence(torch, q, k, v, cu_seqlens_q, cu_seqlens_k, *, causal: bool):
    """A packed batch (q [total_q, Hq, D], k, v [total_k, Hkv, D]) as FlashAttention's own varlen
    reference runs it: SDPA on each sequence alone (bottom-right causal), the rows joined; rows of
    no sequence 0. Each sequence's tensors are made contiguous [1, H, S, D] before the run is
    timed (PyTorch's best case)."""
    bounds = list(zip(cu_seqlens_q.tolist()[:-1], cu_seqlens_q.tolist()[1:], cu_seqlens_k.tolist()[:-1],
                      cu_seqlens_k.tolist()[1:]))
    gqa = q.shape[1] != k.shape[1]

    def prepared(a, b, c, d):
        mask = None
        if causal and b - a != d - c:  # bottom-right: query i sees keys j <= i + Sk - Sq
            rows = torch.arange(b - a, device=q.device)[:, None] + (d - c) - (b - a)
            mask = torch.arange(d - c, device=q.device)[None, :] <= rows
        heads_first = [x.transpose(0, 1)[None].contiguous() for x in (q[a:b], k[c:d], v[c:d])]
        return a, b, heads_first, mask

    work = [prepared(*bound) for bound in bounds if bound[1] > bound[0] and bound[3] > bound[2]]

    def run():
        out = torch.zeros_like(q)
        for a, b, heads_first, mask in work:
            attended = torch.nn.functional.scaled_dot_product_attention(
                *heads_first, attn_mask=mask, is_causal=causal and mask is None, enable_gqa=gqa)
            # a row that sees no key (causal with Sq > Sk) is NaN in SDPA, 0 here
            out[a:b] = (attended if mask is None else attended.nan_to_num(0.0))[0].transpose(0, 1)
        return out

    return run


def peer_for(case: dict, named: dict, gpu: bool):
    """(function to run, its output names) of PyTorch's side of a bundle case, on the inputs
    ``named`` (numpy arrays by name); or a reason there is none here."""
    try:
        import torch
    except ImportError:
        return "torch is not installed"
    if gpu and not torch.cuda.is_available():
        return "torch has no CUDA"
    device = "cuda" if gpu else "cpu"
    dtype = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}[case["dtype"]]

    def tensor(name):
        array = named[name]
        if array.dtype.kind in "iu":
            return torch.from_numpy(array).to(device)
        return torch.from_numpy(np.asarray(array, np.float32)).to(device).to(dtype)

    spec = case["torch"]
    if spec["kind"] == "paged":
        run = paged_gather_sdpa(torch, tensor("q"), tensor("k_cache"), tensor("v_cache"), tensor("block_table"),
                                spec["context"])
        return run, ["out"]
    if spec["kind"] == "varlen":
        return sdpa_per_sequence(torch, *map(tensor, ("q", "k", "v", "cu_seqlens_q", "cu_seqlens_k")),
                                 causal=spec["causal"]), ["out"]
    if spec["kind"] == "flash_backward":
        return sdpa_backward(torch, *map(tensor, ("q", "k", "v", "do")), causal=spec["causal"]), ["dq", "dk", "dv"]
    return sdpa_forward(torch, *map(tensor, ("q", "k", "v")), causal=spec["causal"]), ["out"]


def milliseconds(run, gpu: bool, repeat: int = 20) -> float:
    """Milliseconds per call of ``run`` after a warm-up (CUDA events on a GPU)."""
    import torch

    for _ in range(3):
        run()
    if gpu:
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(repeat):
            run()
        end.record()
        torch.cuda.synchronize()
        return start.elapsed_time(end) / repeat
    begin = time.perf_counter()
    for _ in range(repeat):
        run()
    return (time.perf_counter() - begin) * 1e3 / repeat
