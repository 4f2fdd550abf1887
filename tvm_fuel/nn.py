"""The fuel ops as ``tvm.relax.frontend.nn`` modules, used the way TVM's built-in layers are.

The modules are stateless (no parameters): projections, RoPE and the cache belong to the model.

Contents:
    FlashAttention -- ``flash_attn`` over [B, Hq, Sq, D] / [B, Hkv, Sk, D] tensors
    PagedAttention -- ``paged_attn`` over a paged KV cache and its block table
    VarlenAttention -- ``flash_attn_varlen`` over a packed batch of variable-length sequences

Example
-------
>>> from tvm.relax.frontend import nn
>>> import tvm_fuel.nn
>>> class Block(nn.Module):
...     def __init__(self):
...         self.attn = tvm_fuel.nn.FlashAttention(causal=True)
...     def forward(self, q, k, v):
...         return self.attn(q, k, v)
>>> spec = {"forward": {"q": nn.spec.Tensor((1, 8, 16, 64), "float32"),
...                     "k": nn.spec.Tensor((1, 2, 16, 64), "float32"),
...                     "v": nn.spec.Tensor((1, 2, 16, 64), "float32")}}
>>> mod, _ = Block().export_tvm(spec)
"""

from __future__ import annotations

from tvm.relax.frontend import nn

from . import op
from .op.config import AttnConfig


def _expr(tensor: nn.Tensor | None):
    return None if tensor is None else tensor._expr  # noqa: SLF001 (nn.Tensor's Relax expression)


class FlashAttention(nn.Module):
    """``out = flash_attn(q, k, v, [alibi_slopes], [attn_mask], [sinks])`` (``return_lse``: ``(out, lse)``).

    Parameters (keyword-only)
    ----------
    softmax_scale, causal, window_size, softcap, sink_tokens : as ``tvm_fuel.op.flash_attn`` (validated here).
    return_lse : bool
        Also return the log-sum-exp [B, Hq, Sq] (float32).

    Inputs: q [B, Hq, Sq, D], k and v [B, Hkv, Sk, D] (float32, float16 or bfloat16, Hq a multiple
    of Hkv); alibi_slopes [Hq] float32, attn_mask (broadcastable to [B, Hq, Sq, Sk]) and sinks [Hq]
    float32 (gpt-oss's sink logits: a model's ``nn.Parameter``) optional.
    """

    def __init__(self, *, softmax_scale: float | None = None, causal: bool = False,
                 window_size: tuple[int, int] = (-1, -1), softcap: float = 0.0, return_lse: bool = False,
                 sink_tokens: int = 0):
        self.options = dict(softmax_scale=softmax_scale, causal=causal, window_size=tuple(window_size),
                            softcap=softcap, sink_tokens=sink_tokens)
        AttnConfig.create("tvm_fuel.nn.FlashAttention", **self.options)  # bad options fail here, by name
        self.return_lse = return_lse

    def forward(self, q: nn.Tensor, k: nn.Tensor, v: nn.Tensor, alibi_slopes: nn.Tensor | None = None,
                attn_mask: nn.Tensor | None = None, *, sinks: nn.Tensor | None = None):
        call = op.flash_attn(_expr(q), _expr(k), _expr(v), _expr(alibi_slopes), _expr(attn_mask),
                             sinks=_expr(sinks), return_lse=self.return_lse, **self.options)
        return nn.wrap_nested(call, name="flash_attn")


class PagedAttention(nn.Module):
    """``out = paged_attn(q, k_cache, v_cache, block_table, context_lens, [alibi_slopes], [sinks],
    [k_scale, v_scale])``.

    Parameters (keyword-only): softmax_scale, causal, window_size, softcap, sink_tokens as
    ``tvm_fuel.op.paged_attn``.

    Inputs: q [B, Hq, Sq, D] (the last Sq positions of each context), k_cache and v_cache
    [num_blocks, block_size, Hkv, D] (q's dtype, or 8-bit: float8_e4m3fn, float8_e5m2, int8),
    block_table [B, max_blocks] and context_lens [B] (int32 or int64), alibi_slopes [Hq] and sinks
    [Hq] (float32) optional; an 8-bit cache's k_scale and v_scale (float32: [] or [Hkv] for fp8,
    [num_blocks, block_size, Hkv] for int8; ``tvm_fuel.kv_cache.PagedKVCache`` holds them).
    Returns out [B, Hq, Sq, D].
    """

    def __init__(self, *, softmax_scale: float | None = None, causal: bool = False,
                 window_size: tuple[int, int] = (-1, -1), softcap: float = 0.0, sink_tokens: int = 0):
        self.options = dict(softmax_scale=softmax_scale, causal=causal, window_size=tuple(window_size),
                            softcap=softcap, sink_tokens=sink_tokens)
        AttnConfig.create("tvm_fuel.nn.PagedAttention", **self.options)

    def forward(self, q: nn.Tensor, k_cache: nn.Tensor, v_cache: nn.Tensor, block_table: nn.Tensor,
                context_lens: nn.Tensor, alibi_slopes: nn.Tensor | None = None, *,
                sinks: nn.Tensor | None = None, k_scale: nn.Tensor | None = None,
                v_scale: nn.Tensor | None = None) -> nn.Tensor:
        call = op.paged_attn(_expr(q), _expr(k_cache), _expr(v_cache), _expr(block_table), _expr(context_lens),
                             _expr(alibi_slopes), sinks=_expr(sinks), k_scale=_expr(k_scale), v_scale=_expr(v_scale),
                             **self.options)
        return nn.wrap_nested(call, name="paged_attn")


class VarlenAttention(nn.Module):
    """``out = flash_attn_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, [alibi_slopes], [sinks])``
    (``return_lse``: ``(out, lse)``): FlashAttention's ``flash_attn_varlen_func``.

    Parameters (keyword-only): softmax_scale, causal, window_size, softcap, sink_tokens,
    max_seqlen_q, max_seqlen_k as ``tvm_fuel.op.flash_attn_varlen``; return_lse also returns
    lse [Hq, total_q] (float32).

    Inputs: q [total_q, Hq, D], k and v [total_k, Hkv, D] (float32, float16 or bfloat16),
    cu_seqlens_q and cu_seqlens_k [B + 1] (int32), alibi_slopes [Hq] and sinks [Hq] (float32)
    optional. Returns out [total_q, Hq, D].
    """

    def __init__(self, *, softmax_scale: float | None = None, causal: bool = False,
                 window_size: tuple[int, int] = (-1, -1), softcap: float = 0.0, sink_tokens: int = 0,
                 max_seqlen_q: int | None = None, max_seqlen_k: int | None = None, return_lse: bool = False):
        self.options = dict(softmax_scale=softmax_scale, causal=causal, window_size=tuple(window_size),
                            softcap=softcap, sink_tokens=sink_tokens)
        AttnConfig.create("tvm_fuel.nn.VarlenAttention", **self.options)
        self.lengths = dict(max_seqlen_q=max_seqlen_q, max_seqlen_k=max_seqlen_k)
        self.return_lse = return_lse

    def forward(self, q: nn.Tensor, k: nn.Tensor, v: nn.Tensor, cu_seqlens_q: nn.Tensor, cu_seqlens_k: nn.Tensor,
                alibi_slopes: nn.Tensor | None = None, *, sinks: nn.Tensor | None = None):
        call = op.flash_attn_varlen(_expr(q), _expr(k), _expr(v), _expr(cu_seqlens_q), _expr(cu_seqlens_k),
                                    _expr(alibi_slopes), sinks=_expr(sinks), return_lse=self.return_lse,
                                    **self.lengths, **self.options)
        return nn.wrap_nested(call, name="flash_attn_varlen")
