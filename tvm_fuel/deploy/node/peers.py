"""PyTorch's side of a comparison: SDPA forward and backward, and vLLM-style paged decode.

Used by the node's check and bench stages and by ``python -m tvm_fuel bench``. Every function
takes the ``torch`` module and torch tensors (any device) and returns a function to run or time.

Contents:
    sdpa_forward, sdpa_backward, paged_gather_sdpa
"""

from __future__ import annotations


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


def paged_gather_sdpa(torch, q, k_cache, v_cache, table, context: int):
    """Paged decode as vLLM's reference does it: gather each sequence's live blocks (every
    sequence ``context`` tokens long), then dense SDPA over them."""
    batch, block_size, kv_heads, head_dim = q.shape[0], k_cache.shape[1], k_cache.shape[2], k_cache.shape[3]
    live = -(-context // block_size)

    def gather(cache):
        pages = cache[table[:, :live].long()].reshape(batch, -1, kv_heads, head_dim)
        return pages[:, :context].transpose(1, 2)

    def run():
        return torch.nn.functional.scaled_dot_product_attention(q, gather(k_cache), gather(v_cache), enable_gqa=True)

    return run
