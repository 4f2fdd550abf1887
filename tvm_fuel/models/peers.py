"""The end-to-end models outside TVM: numpy (float64, attention through ``tvm_fuel.reference``) and
PyTorch (its own attention), given the same weights by name.

Contents:
    llama_logits        -- numpy logits [B, S, vocab] of the decoder over whole sequences
    torch_llama_logits  -- the same in PyTorch (``scaled_dot_product_attention``, GQA)
    torch_llama_fit     -- the decoder's next-token loss curve under PyTorch autograd and Adam
    TorchGeneration, torch_generate -- greedy generation in PyTorch eager over a KV cache (the
                           serving loop of ``LlamaEngine.generate``, timed the same way)
    regressor_forward   -- numpy output of the training model
    torch_fit           -- the training model's loss curve under PyTorch autograd and Adam
"""

from __future__ import annotations

import numpy as np

import time
from dataclasses import dataclass

from .. import reference
from .llama import LlamaConfig
from .train import TrainConfig

# ---------------------------------------------------------------------------------------- numpy


def _rms_norm(x, w, eps):
    return x / np.sqrt((x * x).mean(-1, keepdims=True) + eps) * w


def _rope(x, positions, theta):
    """x [B, S, H, D], rotate-half form, ``positions`` [S]."""
    half = x.shape[-1] // 2
    inv_freq = theta ** (-2.0 * np.arange(half) / x.shape[-1])
    angle = np.concatenate([positions[:, None] * inv_freq] * 2, -1)[None, :, None, :]
    rotated = np.concatenate([-x[..., half:], x[..., :half]], -1)
    return x * np.cos(angle) + rotated * np.sin(angle)


def llama_logits(config: LlamaConfig, weights: dict[str, np.ndarray], tokens: np.ndarray) -> np.ndarray:
    """Logits [B, S, vocab] (float64) of token ids [B, S]."""
    c, w = config, {name: value.astype(np.float64) for name, value in weights.items()}
    b, s = tokens.shape
    x = w["embed.weight"][tokens]
    positions = np.arange(s, dtype=np.float64)
    for i in range(c.num_layers):
        p = f"layers.{i}."
        h = _rms_norm(x, w[p + "input_norm.weight"], c.rms_norm_eps)
        heads = lambda name, n: (h @ w[p + name].T).reshape(b, s, n, c.head_dim)  # noqa: E731
        q = _rope(heads("attn.q_proj.weight", c.num_heads), positions, c.rope_theta)
        k = _rope(heads("attn.k_proj.weight", c.num_kv_heads), positions, c.rope_theta)
        v = heads("attn.v_proj.weight", c.num_kv_heads)
        out = reference.flash_attn(*(t.transpose(0, 2, 1, 3) for t in (q, k, v)), causal=True)
        x = x + out.transpose(0, 2, 1, 3).reshape(b, s, -1) @ w[p + "attn.o_proj.weight"].T
        h = _rms_norm(x, w[p + "post_attn_norm.weight"], c.rms_norm_eps)
        gate = h @ w[p + "mlp.gate_proj.weight"].T
        x = x + (gate / (1 + np.exp(-gate)) * (h @ w[p + "mlp.up_proj.weight"].T)) @ w[p + "mlp.down_proj.weight"].T
    return _rms_norm(x, w["norm.weight"], c.rms_norm_eps) @ w["lm_head.weight"].T


def regressor_forward(config: TrainConfig, weights: dict[str, np.ndarray], x: np.ndarray) -> np.ndarray:
    """The training model's output [B, S, model_dim] (float64)."""
    c, w = config, {name: value.astype(np.float64) for name, value in weights.items()}
    b, s, _ = x.shape
    heads = lambda name, n: (x @ w[name].T).reshape(b, s, n, c.head_dim).transpose(0, 2, 1, 3)  # noqa: E731
    out = reference.flash_attn(heads("q_proj.weight", c.num_heads), heads("k_proj.weight", c.num_kv_heads),
                               heads("v_proj.weight", c.num_kv_heads), causal=True, softcap=c.softcap)
    return out.transpose(0, 2, 1, 3).reshape(b, s, -1) @ w["o_proj.weight"].T


# -------------------------------------------------------------------------------------- PyTorch


def _torch_llama(config: LlamaConfig, w: dict, tok, positions=None, attend=None):
    """The decoder's logits [B, T, vocab] in PyTorch from weights ``w`` (torch tensors) and ids
    ``tok`` [B, T] at ``positions`` [B, T] (default 0..T-1); ``attend(layer, q, k, v)`` on
    [B, H, T, D] after RoPE (default: causal SDPA over the T tokens)."""
    import torch
    import torch.nn.functional as F

    c = config
    b, s = tok.shape
    positions = torch.arange(s)[None] if positions is None else positions
    inv_freq = 1.0 / c.rope_theta ** (torch.arange(0, c.head_dim, 2).float() / c.head_dim)
    angle = torch.cat([positions[..., None].float() * inv_freq] * 2, -1)[:, None]  # [B, 1, T, D]
    cos, sin = angle.cos(), angle.sin()

    def rope(t):  # [B, H, T, D]
        t1, t2 = t.chunk(2, -1)
        return t * cos + torch.cat([-t2, t1], -1) * sin

    def causal(layer, q, k, v):
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)

    attend = attend or causal
    x = F.embedding(tok, w["embed.weight"])
    for i in range(c.num_layers):
        p = f"layers.{i}."
        h = F.rms_norm(x, (c.hidden_size,), w[p + "input_norm.weight"], c.rms_norm_eps)
        q, k, v = (F.linear(h, w[p + f"attn.{n}_proj.weight"]).view(b, s, -1, c.head_dim).transpose(1, 2)
                   for n in "qkv")
        out = attend(i, rope(q), rope(k), v)
        x = x + F.linear(out.transpose(1, 2).reshape(b, s, -1), w[p + "attn.o_proj.weight"])
        h = F.rms_norm(x, (c.hidden_size,), w[p + "post_attn_norm.weight"], c.rms_norm_eps)
        mlp = F.silu(F.linear(h, w[p + "mlp.gate_proj.weight"])) * F.linear(h, w[p + "mlp.up_proj.weight"])
        x = x + F.linear(mlp, w[p + "mlp.down_proj.weight"])
    x = F.rms_norm(x, (c.hidden_size,), w["norm.weight"], c.rms_norm_eps)
    return F.linear(x, w["lm_head.weight"])


def torch_llama_logits(config: LlamaConfig, weights: dict[str, np.ndarray], tokens: np.ndarray) -> np.ndarray:
    """Logits [B, S, vocab] (float32) of the decoder in PyTorch (its SDPA, GQA by enable_gqa)."""
    import torch

    w = {name: torch.from_numpy(value).float() for name, value in weights.items()}
    with torch.no_grad():
        return _torch_llama(config, w, torch.from_numpy(np.asarray(tokens, "int64"))).numpy()


def torch_llama_fit(config: LlamaConfig, weights: dict[str, np.ndarray], tokens: np.ndarray, targets: np.ndarray,
                    *, steps: int, lr: float) -> list[float]:
    """The loss before each of ``steps`` full-batch Adam steps (PyTorch's, defaults but ``lr``) of
    the decoder's mean next-token cross entropy: token ids [B, S] in, target ids [B, S]."""
    import torch
    import torch.nn.functional as F

    params = {name: torch.tensor(value, requires_grad=True) for name, value in weights.items()}
    tok, tgt = torch.from_numpy(np.asarray(tokens, "int64")), torch.from_numpy(np.asarray(targets, "int64"))
    optimizer = torch.optim.Adam(params.values(), lr=lr)
    losses = []
    for _ in range(steps):
        logits = _torch_llama(config, params, tok)
        loss = F.cross_entropy(logits.reshape(-1, config.vocab_size), tgt.reshape(-1))
        losses.append(float(loss.detach()))
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    return losses


@dataclass(frozen=True)
class TorchGeneration:
    """What ``torch_generate`` returns: each sequence's new tokens, and the wall-clock seconds of
    the prefill and decode phases (as ``engine.Generation``)."""

    tokens: list[list[int]]
    prefill_s: float
    decode_s: float

    @property
    def decode_tokens_per_s(self) -> float:
        steps = len(self.tokens[0]) - 1 if self.tokens else 0
        return steps * len(self.tokens) / self.decode_s if self.decode_s else 0.0


def torch_generate(config: LlamaConfig, weights: dict[str, np.ndarray], prompts: list[list[int]], *,
                   max_new_tokens: int) -> TorchGeneration:
    """Greedy generation of the decoder in PyTorch eager, the loop ``LlamaEngine.generate`` runs:
    each prompt prefilled alone (SDPA, causal), its K/V kept in a per-layer cache [B, Hkv, L, D]
    (L: the longest prompt plus the new tokens); then every sequence decodes together, one token a
    step, attending to its own cached positions (a padding mask over the cache up to the longest
    context, as Hugging Face's static cache does)."""
    import torch
    import torch.nn.functional as F

    c = config
    w = {name: torch.from_numpy(np.ascontiguousarray(value)).float() for name, value in weights.items()}
    batch, capacity = len(prompts), max(len(p) for p in prompts) + max_new_tokens
    caches = [(torch.zeros(batch, c.num_kv_heads, capacity, c.head_dim),
               torch.zeros(batch, c.num_kv_heads, capacity, c.head_dim)) for _ in range(c.num_layers)]

    def run(tokens, positions, rows, attend):
        """tokens [b, T] at positions [b, T] of the sequences ``rows`` -> logits [b, T, vocab]."""
        return _torch_llama(c, w, tokens, positions,
                            lambda layer, q, k, v: attend(q, k, v, *caches[layer], rows, positions))

    def prefill_attend(q, k, v, k_cache, v_cache, rows, positions):
        k_cache[rows, :, :k.shape[2]], v_cache[rows, :, :v.shape[2]] = k[0], v[0]
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)

    lengths = torch.tensor([len(p) for p in prompts])
    rows = torch.arange(batch)

    def decode_attend(q, k, v, k_cache, v_cache, rows, positions):
        k_cache[rows, :, positions[:, 0]], v_cache[rows, :, positions[:, 0]] = k[:, :, 0], v[:, :, 0]
        span = int(positions.max()) + 1
        mask = (torch.arange(span)[None, :] <= positions)[:, None, None, :]  # [B, 1, 1, span]
        return F.scaled_dot_product_attention(q, k_cache[:, :, :span], v_cache[:, :, :span], attn_mask=mask,
                                              enable_gqa=True)

    with torch.no_grad():
        start = time.perf_counter()
        next_tokens = []
        for row, prompt in enumerate(prompts):
            tokens = torch.tensor([prompt])
            logits = run(tokens, torch.arange(len(prompt))[None], row, prefill_attend)
            next_tokens.append(int(logits[0, -1].argmax()))
        prefill_s = time.perf_counter() - start
        generated = [next_tokens]
        tokens = torch.tensor(next_tokens)[:, None]
        start = time.perf_counter()
        for step in range(max_new_tokens - 1):
            logits = run(tokens, (lengths + step)[:, None], rows, decode_attend)
            tokens = logits[:, -1].argmax(-1, keepdim=True)
            generated.append(tokens[:, 0].tolist())
        decode_s = time.perf_counter() - start
    return TorchGeneration([list(row) for row in zip(*generated)], prefill_s, decode_s)


def torch_fit(config: TrainConfig, weights: dict[str, np.ndarray], x: np.ndarray, y: np.ndarray, *,
              steps: int) -> list[float]:
    """The loss before each of ``steps`` full-batch Adam steps (PyTorch's, same lr) of the training
    model, its attention written out (softcap, causal, GQA by repeating K/V heads)."""
    import torch
    import torch.nn.functional as F

    c = config
    params = {name: torch.tensor(value, requires_grad=True) for name, value in weights.items()}
    xt, yt = torch.from_numpy(x), torch.from_numpy(y)
    b, s, _ = x.shape
    optimizer = torch.optim.Adam(params.values(), lr=c.lr)
    causal = torch.ones(s, s, dtype=torch.bool).tril()
    losses = []
    for _ in range(steps):
        heads = lambda n: F.linear(xt, params[f"{n}_proj.weight"]).view(b, s, -1, c.head_dim).transpose(1, 2)  # noqa: E731
        q, k, v = heads("q"), heads("k"), heads("v")
        group = c.num_heads // c.num_kv_heads
        k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
        logits = q @ k.transpose(-1, -2) / c.head_dim ** 0.5
        logits = (c.softcap * torch.tanh(logits / c.softcap)).masked_fill(~causal, float("-inf"))
        out = torch.softmax(logits, -1) @ v
        loss = F.mse_loss(F.linear(out.transpose(1, 2).reshape(b, s, -1), params["o_proj.weight"]), yt)
        losses.append(float(loss.detach()))
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    return losses
