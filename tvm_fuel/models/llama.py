"""A small Llama-style decoder as a ``tvm.relax.frontend.nn`` module over the fuel ops.

Llama's architecture (pre-norm RMSNorm, rotary position embedding in the rotate-half form,
grouped-query attention, SwiGLU MLP, untied LM head), small enough to build and run on a laptop
CPU in seconds. Four entry points share one layer stack:

- ``forward(tokens)``: logits of whole sequences, attention through ``flash_attn`` (causal), no
  cache. The oracle the cached paths must reproduce.
- ``prefill(tokens, k_cache, v_cache, slots)``: the same over a batch of prompts, writing each
  layer's K/V into the paged cache (in place, at ``slots``) for the decode steps that follow.
- ``decode(tokens, k_cache, v_cache, block_table, context_lens, slots)``: the next token of each
  sequence (tokens [B, 1]), K/V written at ``slots``, attention through ``paged_attn`` over the
  cache (the query is the last token of ``context_lens``, which already counts it).
- ``extend(...)``: the same for T > 1 new tokens per sequence (a chunk; multi-query ``paged_attn``,
  bottom-right causal).

The cache is ``tvm_fuel.kv_cache.PagedKVCache``'s layout: K and V ``[num_layers * num_blocks,
block_size, Hkv, D]``, layer ``l`` in pages ``[l * num_blocks, (l + 1) * num_blocks)``, one block
table for every layer (offset in-graph), ``slots`` from ``PagedKVCache.reserve``.

Contents:
    LlamaConfig, LlamaDecoder, export, serving_module, init_weights, rope_table, rope
    rope_angles, rope_differentiable -- RoPE for training (the table an input, the rotation in primitives)
    DEMO_POINTS, tuning_module -- what ``python -m tvm_fuel tune --model tvm_fuel.models.llama`` tunes

Example
-------
>>> from tvm_fuel.models import llama
>>> config = llama.LlamaConfig()
>>> mod, param_names = llama.export(config)
>>> weights = llama.init_weights(config, param_names, seed=0)   # name -> numpy array
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import tvm
from tvm import relax, te
from tvm.relax.frontend import nn

from ..kv_cache import append_kernel
from ..nn import FlashAttention, PagedAttention


@dataclass(frozen=True)
class LlamaConfig:
    """The decoder's shape. ``Hq = num_heads``, ``Hkv = num_kv_heads`` (a GQA group of Hq / Hkv)."""

    vocab_size: int = 256
    hidden_size: int = 192
    intermediate_size: int = 512
    num_layers: int = 2
    num_heads: int = 6
    num_kv_heads: int = 2
    head_dim: int = 32
    rope_theta: float = 10000.0
    rms_norm_eps: float = 1e-5
    dtype: str = "float32"

    def __post_init__(self):
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads", "num_kv_heads",
                     "head_dim"):
            if not isinstance(getattr(self, name), int) or getattr(self, name) < 1:
                raise ValueError(f"LlamaConfig: {name} must be a positive int, got {getattr(self, name)!r}")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"LlamaConfig: num_heads {self.num_heads} must be a multiple of num_kv_heads "
                             f"{self.num_kv_heads}")
        if self.dtype not in ("float32", "float16"):
            raise ValueError(f"LlamaConfig: dtype must be float32 or float16 (numpy weights), got {self.dtype!r}")
        if self.head_dim % 2:
            raise ValueError(f"LlamaConfig: head_dim {self.head_dim} must be even (RoPE rotates pairs)")


def rope_table(tokens: nn.Tensor, head_dim: int, theta: float, context_lens: nn.Tensor | None = None) -> nn.Tensor:
    """cos and sin of the rotary angles of tokens [B, S]: [2, B', S, head_dim] float32 (B' = 1
    without ``context_lens``: every sequence starts at position 0). Position ``s``, or
    ``context_lens[b] - S + s`` when the S tokens are the last of each context. Made once per
    forward pass and shared by every layer's q and k (the transcendentals dominate RoPE's cost)."""

    def compute(tok: te.Tensor, lens: te.Tensor | None = None) -> te.Tensor:
        batch, seq_len = tok.shape
        half = head_dim // 2

        def angle_fn(part, b, s, i):
            f32 = lambda e: tvm.tirx.Cast("float32", e)  # noqa: E731 (positions are exact below 2^24)
            pos = f32(s) if lens is None else f32(lens[b]) - f32(seq_len) + f32(s)
            # inv_freq = theta^(-2j / D), j = i mod D/2
            angle = pos * te.exp((i % half).astype("float32") * (-2.0 * math.log(theta) / head_dim))
            return tvm.tirx.Select(part == 0, te.cos(angle), te.sin(angle))

        rows = 1 if lens is None else batch
        return te.compute((2, rows, seq_len, head_dim), angle_fn, name="rope_table")

    return nn.op.tensor_expr_op(compute, "rope_table", [tokens] if context_lens is None else [tokens, context_lens])


def rope(x: nn.Tensor, table: nn.Tensor) -> nn.Tensor:
    """Rotary embedding (rotate-half form) of x [B, S, H, D] by ``rope_table``'s cos and sin."""

    def compute(x: te.Tensor, t: te.Tensor) -> te.Tensor:
        dim = x.shape[3]
        half = dim // 2
        shared = t.shape[1] == 1  # positions of every sequence alike

        def rotated(b, s, h, i):
            row = 0 if shared else b
            partner = x[b, s, h, (i + half) % dim].astype("float32")
            partner = tvm.tirx.Select(i < half, -partner, partner)
            value = x[b, s, h, i].astype("float32") * t[0, row, s, i] + partner * t[1, row, s, i]
            return value.astype(x.dtype)

        return te.compute(x.shape, rotated, name="rope")

    return nn.op.tensor_expr_op(compute, "rope", [x, table])


def rope_angles(seq_len: int, head_dim: int, theta: float) -> np.ndarray:
    """``rope_table``'s values for positions 0..seq_len-1 in numpy: [2, 1, seq_len, head_dim] float32
    (cos, sin), the input of ``LlamaDecoder.loss``."""
    inv_freq = np.exp((np.arange(head_dim) % (head_dim // 2)).astype("float32")
                      * np.float32(-2.0 * math.log(theta) / head_dim))
    angle = np.arange(seq_len, dtype="float32")[:, None] * inv_freq[None, :]
    return np.stack([np.cos(angle), np.sin(angle)])[:, None].astype("float32")


def rope_differentiable(x: nn.Tensor, table: nn.Tensor) -> nn.Tensor:
    """``rope`` in Relax primitives that have gradients (split, concat, multiply), for training:
    x [B, S, H, D], table [2, 1, S, D] (``rope_angles``, an input: a TIR function has no gradient)."""
    seq_len, dim = x.shape[1], x.shape[3]
    cos, sin = (nn.op.reshape(t, [1, seq_len, 1, dim]) for t in nn.op.split(table, 2, axis=0))
    first, second = nn.op.split(x, 2, axis=3)
    rotated = nn.op.concat([nn.op.negative(second), first], dim=3)
    return x * cos + rotated * sin


def _offset(ids: nn.Tensor, amount: int) -> nn.Tensor:
    """ids + amount, keeping negative (padding) entries as they are."""
    if amount == 0:
        return ids

    def compute(t: te.Tensor) -> te.Tensor:
        return te.compute(t.shape, lambda *i: tvm.tirx.Select(t(*i) < 0, t(*i), t(*i) + amount), name="offset")

    return nn.op.tensor_expr_op(compute, "page_offset", [ids])


class _Cache:
    """The cache tensors as they flow through the layers (each write returns the updated ones)."""

    def __init__(self, k_cache: nn.Tensor, v_cache: nn.Tensor, slots: nn.Tensor, gpu: bool):
        self.k, self.v, self.slots, self.gpu = k_cache, v_cache, slots, gpu

    def pages_per_layer(self, num_layers: int):
        return self.k.shape[0] // num_layers

    def write(self, layer: int, num_layers: int, k: nn.Tensor, v: nn.Tensor) -> None:
        """Write k, v [B, Hkv, T, D] at the layer's slots, in place."""
        _, heads, _, head_dim = k.shape
        pages, block_size = self.pages_per_layer(num_layers), self.k.shape[1]
        slots = _offset(self.slots, layer * pages * block_size)
        self.k, self.v = nn.op.tensor_ir_inplace_op(
            append_kernel(str(k.dtype), int(heads), int(head_dim), self.gpu), "kv_append",
            [self.k, self.v, k, v, slots], [0, 1],
            [nn.Tensor.placeholder(self.k.shape, self.k.dtype), nn.Tensor.placeholder(self.v.shape, self.v.dtype)])


class Embedding(nn.Embedding):
    """``nn.Embedding`` whose lookup clamps the ids: an id outside the vocabulary must never read
    out of bounds (``nn.Embedding``'s fast ``take`` would; ``LlamaEngine`` rejects such ids first)."""

    def forward(self, x: nn.Tensor) -> nn.Tensor:
        rows = relax.op.take(self.weight._expr, nn.op.reshape(x, [-1])._expr, axis=0, mode="clip")  # noqa: SLF001
        return nn.op.reshape(nn.op.wrap_nested(rows, name="embed"), [*x.shape, self.weight.shape[1]])


class Attention(nn.Module):
    def __init__(self, config: LlamaConfig):
        c = config
        self.config = c
        self.q_proj = nn.Linear(c.hidden_size, c.num_heads * c.head_dim, bias=False, dtype=c.dtype)
        self.k_proj = nn.Linear(c.hidden_size, c.num_kv_heads * c.head_dim, bias=False, dtype=c.dtype)
        self.v_proj = nn.Linear(c.hidden_size, c.num_kv_heads * c.head_dim, bias=False, dtype=c.dtype)
        self.o_proj = nn.Linear(c.num_heads * c.head_dim, c.hidden_size, bias=False, dtype=c.dtype)
        self.flash = FlashAttention(causal=True)
        self.paged = PagedAttention(causal=True)

    def forward(self, x: nn.Tensor, attend, rotate) -> nn.Tensor:
        """x [B, S, hidden] -> [B, S, hidden]; ``attend(q, k, v)`` on [B, H, S, D] after RoPE
        (``rotate`` of [B, S, H, D])."""
        c = self.config
        b, s, _ = x.shape
        heads = lambda proj, n: nn.op.reshape(proj(x), [b, s, n, c.head_dim])  # noqa: E731
        q = rotate(heads(self.q_proj, c.num_heads))
        k = rotate(heads(self.k_proj, c.num_kv_heads))
        v = heads(self.v_proj, c.num_kv_heads)
        q, k, v = (nn.op.permute_dims(t, [0, 2, 1, 3]) for t in (q, k, v))
        out = nn.op.permute_dims(attend(self, q, k, v), [0, 2, 1, 3])
        return self.o_proj(nn.op.reshape(out, [b, s, c.num_heads * c.head_dim]))


class MLP(nn.Module):
    def __init__(self, config: LlamaConfig):
        c = config
        self.gate_proj = nn.Linear(c.hidden_size, c.intermediate_size, bias=False, dtype=c.dtype)
        self.up_proj = nn.Linear(c.hidden_size, c.intermediate_size, bias=False, dtype=c.dtype)
        self.down_proj = nn.Linear(c.intermediate_size, c.hidden_size, bias=False, dtype=c.dtype)

    def forward(self, x: nn.Tensor) -> nn.Tensor:
        return self.down_proj(nn.op.silu(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nn.Module):
    def __init__(self, config: LlamaConfig):
        c = config
        self.input_norm = nn.RMSNorm(c.hidden_size, -1, c.rms_norm_eps, bias=False, dtype=c.dtype)
        self.attn = Attention(c)
        self.post_attn_norm = nn.RMSNorm(c.hidden_size, -1, c.rms_norm_eps, bias=False, dtype=c.dtype)
        self.mlp = MLP(c)

    def forward(self, x: nn.Tensor, attend, rotate) -> nn.Tensor:
        x = x + self.attn(self.input_norm(x), attend, rotate)
        return x + self.mlp(self.post_attn_norm(x))


class LlamaDecoder(nn.Module):
    """Token ids [B, S] int32 -> logits [B, S, vocab_size] float32 (see the module docstring)."""

    def __init__(self, config: LlamaConfig, *, gpu: bool = False):
        c = config
        self.config, self.gpu = c, gpu
        self.embed = Embedding(c.vocab_size, c.hidden_size, dtype=c.dtype)
        self.layers = nn.ModuleList([DecoderLayer(c) for _ in range(c.num_layers)])
        self.norm = nn.RMSNorm(c.hidden_size, -1, c.rms_norm_eps, bias=False, dtype=c.dtype)
        self.lm_head = nn.Linear(c.hidden_size, c.vocab_size, bias=False, dtype=c.dtype)

    def _run(self, tokens: nn.Tensor, attend, context_lens: nn.Tensor | None = None, rotate=None) -> nn.Tensor:
        x = self.embed(tokens)
        if rotate is None:
            table = rope_table(tokens, self.config.head_dim, self.config.rope_theta, context_lens)
            rotate = lambda t: rope(t, table)  # noqa: E731
        for index, layer in enumerate(self.layers):
            x = layer(x, lambda attn, q, k, v, index=index: attend(index, attn, q, k, v), rotate)
        return nn.op.astype(self.lm_head(self.norm(x)), "float32")

    def forward(self, tokens: nn.Tensor) -> nn.Tensor:
        return self._run(tokens, lambda index, attn, q, k, v: attn.flash(q, k, v))

    def loss(self, tokens: nn.Tensor, targets: nn.Tensor, rope_table: nn.Tensor) -> nn.Tensor:
        """Mean next-token cross entropy: tokens [B, S] int32, targets [B, S, vocab] float32 (one-hot,
        or any distribution), rope_table [2, 1, S, D] (``rope_angles``); everything on the way has
        a gradient (RoPE in primitives), so ``tvm_fuel.transform.gradient`` differentiates it."""
        logits = self._run(tokens, lambda index, attn, q, k, v: attn.flash(q, k, v),
                           rotate=lambda t: rope_differentiable(t, rope_table))
        log_probs = nn.op.wrap_nested(relax.op.nn.log_softmax(logits._expr, axis=-1), name="log_probs")  # noqa: SLF001
        batch, seq_len = tokens.shape
        return nn.op.sum(log_probs * targets) * (-1.0 / (int(batch) * int(seq_len)))

    def prefill(self, tokens: nn.Tensor, k_cache: nn.Tensor, v_cache: nn.Tensor, slots: nn.Tensor):
        cache = _Cache(k_cache, v_cache, slots, self.gpu)

        def attend(index, attn, q, k, v):
            cache.write(index, self.config.num_layers, k, v)
            return attn.flash(q, k, v)

        logits = self._run(tokens, attend)
        return logits, cache.k, cache.v

    def decode(self, tokens: nn.Tensor, k_cache: nn.Tensor, v_cache: nn.Tensor, block_table: nn.Tensor,
               context_lens: nn.Tensor, slots: nn.Tensor):
        cache = _Cache(k_cache, v_cache, slots, self.gpu)
        layers = self.config.num_layers

        def attend(index, attn, q, k, v):
            cache.write(index, layers, k, v)
            table = _offset(block_table, index * cache.pages_per_layer(layers))
            return attn.paged(q, cache.k, cache.v, table, context_lens)

        logits = self._run(tokens, attend, context_lens)
        return logits, cache.k, cache.v

    def extend(self, tokens: nn.Tensor, k_cache: nn.Tensor, v_cache: nn.Tensor, block_table: nn.Tensor,
               context_lens: nn.Tensor, slots: nn.Tensor):
        """``decode`` for T > 1 new tokens per sequence (a chunk): multi-query ``paged_attn``."""
        return self.decode(tokens, k_cache, v_cache, block_table, context_lens, slots)

    def spec(self, *, num_pages: int, block_size: int) -> dict:
        """The ``export_tvm`` spec: batch, sequence length and table width symbolic, but one token
        per sequence in ``decode`` (the kernels pick their decode form for a static Sq = 1;
        ``extend`` takes any T); the cache ``[num_pages, block_size, Hkv, D]`` (num_pages =
        num_layers * blocks per layer)."""
        c = self.config
        tokens = nn.spec.Tensor(["batch", "seq_len"], "int32")
        cache = nn.spec.Tensor([num_pages, block_size, c.num_kv_heads, c.head_dim], c.dtype)
        slots = nn.spec.Tensor(["batch", "seq_len"], "int64")
        plain = {"param_mode": "plain", "effect_mode": "none"}

        def over_cache(seq_len):
            return {"tokens": nn.spec.Tensor(["batch", seq_len], "int32"), "k_cache": cache, "v_cache": cache,
                    "block_table": nn.spec.Tensor(["batch", "max_blocks"], "int32"),
                    "context_lens": nn.spec.Tensor(["batch"], "int32"),
                    "slots": nn.spec.Tensor(["batch", seq_len], "int64"), "$": plain}

        return {
            "forward": {"tokens": tokens, "$": plain},
            "prefill": {"tokens": tokens, "k_cache": cache, "v_cache": cache, "slots": slots, "$": plain},
            "decode": over_cache(1),
            "extend": over_cache("seq_len"),
        }


def export(config: LlamaConfig, *, num_blocks: int = 64, block_size: int = 16,
           gpu: bool = False) -> tuple[tvm.IRModule, list[str]]:
    """The decoder's Relax module (``forward``, ``prefill``, ``decode``, ``extend``; each takes
    its inputs and then the weights, in the order of the returned names) for a cache of
    ``num_blocks`` blocks per layer of ``block_size`` tokens."""
    model = LlamaDecoder(config, gpu=gpu)
    mod, params = model.export_tvm(model.spec(num_pages=config.num_layers * num_blocks, block_size=block_size))
    return mod, [name for name, _ in params]


def serving_module(config: LlamaConfig, *, num_blocks: int = 64, block_size: int = 16,
                   gpu: bool = False) -> tuple[tvm.IRModule, list[str]]:
    """``export``'s module as ``LlamaEngine`` builds it: nn.Linear transposes its weight on every
    call, and TVM's ``FuseTransposeMatmul`` folds that into the matmul."""
    mod, names = export(config, num_blocks=num_blocks, block_size=block_size, gpu=gpu)
    return relax.transform.FuseTransposeMatmul()(mod), names


# The demo's serving shapes (``tvm_fuel.demo.run_decoder``): a 1000-token prompt prefilled alone,
# then 4 sequences decoding together. Its shipped logs were tuned here (tuning_logs/README.md).
DEMO_POINTS = (("prefill", {"batch": 1, "seq_len": 1000}), ("decode", {"batch": 4}))


def tuning_module():
    """The demo decoder (default ``LlamaConfig``) and its shape points, for ``tune --model``."""
    from ..transform.specialize import ShapePoint

    mod, _ = serving_module(LlamaConfig())
    return mod, [ShapePoint(function, dims) for function, dims in DEMO_POINTS]


def init_weights(config: LlamaConfig, names: list[str], *, seed: int = 0) -> dict[str, np.ndarray]:
    """Random weights for ``names``: norms near 1, embeddings N(0, 1), projections N(0, 1/fan_in)."""
    rng = np.random.default_rng(seed)
    shapes = {name: tuple(int(d) for d in param.shape) for name, param in LlamaDecoder(config).named_parameters()}
    weights = {}
    for name in names:
        shape = shapes[name]
        if "norm" in name:
            value = 1.0 + 0.1 * rng.standard_normal(shape)
        elif name.startswith("embed"):
            value = rng.standard_normal(shape)
        else:
            value = rng.standard_normal(shape) / math.sqrt(shape[-1])
        weights[name] = value.astype(config.dtype)
    return weights
