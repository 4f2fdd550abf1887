"""``tvm_fuel.models.llama``'s decoder served from TVM's own runtime paged KV cache, as MLC-LLM's
model definitions are.

The same layers, weights and weight names as ``llama.LlamaDecoder`` (so ``llama.init_weights`` and
the PyTorch peer apply unchanged); only the attention differs: each layer hands its q, k, v
(before RoPE) to the runtime cache (``PagedKVCache.attention_with_fused_qkv``), which rotates q
and k at each token's position in its sequence (``RopeMode.NORMAL``: Llama's rotate-half form,
``config.rope_theta``), appends k and v to the sequence's pages and attends over them. The cache
is ``tvm_fuel.kv_cache.FuelPagedKVCache`` (fuel's attention kernels in its slots) or TVM's
``TIRPagedKVCache`` (``kernels="tvm"``). Which sequence each token belongs to is the runtime's
business: ``vm.builtin.kv_state_begin_forward(cache, seq_ids, lengths)`` before the call, so one
call serves prompts and decode steps of many sequences together (continuous batching).

Entry points of the exported module (``export``; weights after the inputs, in the returned order):

- ``create_paged_kv_cache(max_batch_size, max_total_seq_len, prefill_chunk_size, page_size,
  support_sliding_window)`` (ShapeTuples of one int): the runtime cache object.
- ``batch_forward(tokens, cache)``: tokens [1, n] int32, the new tokens of the step's sequences
  packed in ``begin_forward``'s order -> logits [1, n, vocab] float32 (every token's; MLC-LLM's
  ``batch_prefill`` / ``batch_verify``). Prompts, chunks and decode tokens may mix.
- ``batch_decode(tokens, cache)``: one new token per sequence, tokens [b, 1] int32 -> logits
  [b, 1, vocab] float32 (the runtime's decode kernel).

Contents:
    LlamaPagedDecoder -- the nn module (``llama.LlamaDecoder``'s layers over the runtime cache)
    export            -- its Relax module and weight names
    LlamaCacheEngine  -- built and loaded: add / remove / fork sequences, ``step`` a batch of them

Example
-------
>>> from tvm_fuel.models import llama
>>> from tvm_fuel.models.llama_tvm_cache import LlamaCacheEngine      # doctest: +SKIP
>>> engine = LlamaCacheEngine(llama.LlamaConfig(head_dim=64))
>>> engine.add_sequence(0); engine.add_sequence(1)
>>> logits = engine.step([0, 1], [[5, 6, 7], [8]])    # [3, vocab] and [1, vocab] float32
>>> engine.fork_sequence(0, 2)                         # 2 shares 0's pages
>>> logits = engine.step([0, 2], [[9], [10]])          # one decode step of both
"""

from __future__ import annotations

import numpy as np
import tvm
from tvm import relax, tirx
from tvm.relax.frontend import nn
from tvm.relax.frontend.nn.llm import kv_cache as tvm_kv

from ..kv_cache import FuelPagedKVCache, TVM_PAGE_SIZE
from ..target import host_target
from .llama import LlamaConfig, LlamaDecoder, init_weights

_CACHE_ARGS = ("max_batch_size", "max_total_seq_len", "prefill_chunk_size", "page_size", "support_sliding_window")


class LlamaPagedDecoder(LlamaDecoder):
    """``LlamaDecoder``'s layers with attention in TVM's runtime paged KV cache (module docstring).

    ``kernels``: "fuel" (``FuelPagedKVCache``) or "tvm" (``TIRPagedKVCache``); ``target``: an llvm
    target, what the cache's kernels are built for (default ``tvm_fuel.host_target()``). The
    methods inherited from ``LlamaDecoder`` (``forward`` without a cache, the fuel-cache
    ``prefill`` / ``decode``) stay; ``serving_spec`` exports only this class's."""

    def __init__(self, config: LlamaConfig, *, kernels: str = "fuel", target=None):
        if kernels not in ("fuel", "tvm"):
            raise ValueError(f"LlamaPagedDecoder: kernels must be 'fuel' or 'tvm', got {kernels!r}")
        super().__init__(config)
        self.kernels, self.target = kernels, target or host_target()

    def create_paged_kv_cache(self, max_batch_size: tirx.Var, max_total_seq_len: tirx.Var,
                              prefill_chunk_size: tirx.Var, page_size: tirx.Var,
                              support_sliding_window: tirx.Var) -> tvm_kv.PagedKVCache:
        c = self.config
        cache = FuelPagedKVCache if self.kernels == "fuel" else tvm_kv.TIRPagedKVCache
        return cache(attn_kind="mha", max_batch_size=max_batch_size, max_total_seq_len=max_total_seq_len,
                     prefill_chunk_size=prefill_chunk_size, page_size=page_size,
                     support_sliding_window=support_sliding_window,
                     layer_partition=relax.ShapeExpr([0, c.num_layers]), num_hidden_layers=c.num_layers,
                     num_attention_heads=c.num_heads, num_key_value_heads=c.num_kv_heads, qk_head_dim=c.head_dim,
                     v_head_dim=c.head_dim, mla_original_qk_head_dim=0, mla_original_v_head_dim=0,
                     # the cache rotates q and k itself, at each token's position within its sequence
                     rope_mode=tvm_kv.RopeMode.NORMAL, rope_scale=1, rope_theta=c.rope_theta, rope_scaling={},
                     rope_ext_factors=relax.prim_value(0), rotary_dim=c.head_dim, enable_disaggregation=False,
                     dtype=c.dtype, target=self.target)

    def batch_forward(self, tokens: nn.Tensor, paged_kv_cache: tvm_kv.PagedKVCache) -> nn.Tensor:
        c = self.config

        def attend(index, attn, q, k, v):
            # Attention hands over [B, H, S, D]; the cache takes the heads fused: [B, S, Hq + 2 Hkv, D]
            qkv = nn.op.concat([nn.op.permute_dims(t, [0, 2, 1, 3]) for t in (q, k, v)], dim=2)
            out = paged_kv_cache.attention_with_fused_qkv(index, qkv, c.num_heads, c.head_dim ** -0.5)
            return nn.op.permute_dims(out, [0, 2, 1, 3])

        return self._run(tokens, attend, rotate=lambda t: t)  # RoPE: the cache's (RopeMode.NORMAL)

    def batch_decode(self, tokens: nn.Tensor, paged_kv_cache: tvm_kv.PagedKVCache) -> nn.Tensor:
        """``batch_forward`` of one token per sequence, tokens [b, 1] (the runtime picks its decode
        kernel when every sequence appends one token; the shape is only the packing)."""
        return self.batch_forward(tokens, paged_kv_cache)

    def serving_spec(self) -> dict:
        """The ``export_tvm`` spec of ``create_paged_kv_cache``, ``batch_forward``, ``batch_decode``."""
        cache = nn.spec.Object(object_type=tvm_kv.PagedKVCache)
        plain = {"param_mode": "plain", "effect_mode": "none"}
        return {
            "create_paged_kv_cache": {name: int for name in _CACHE_ARGS} | {
                "$": {"param_mode": "none", "effect_mode": "none"}},
            "batch_forward": {"tokens": nn.spec.Tensor([1, "num_tokens"], "int32"), "paged_kv_cache": cache,
                              "$": plain},
            "batch_decode": {"tokens": nn.spec.Tensor(["batch", 1], "int32"), "paged_kv_cache": cache, "$": plain},
        }


def export(config: LlamaConfig, *, kernels: str = "fuel", target=None) -> tuple[tvm.IRModule, list[str]]:
    """The Relax module (module docstring) and its weight names, in the order its functions take
    them after their inputs; nn.Linear's transposed weights folded into the matmuls
    (``FuseTransposeMatmul``, as ``llama.serving_module``)."""
    model = LlamaPagedDecoder(config, kernels=kernels, target=target)
    mod, params = model.export_tvm(spec=model.serving_spec())
    return relax.transform.FuseTransposeMatmul()(mod), [name for name, _ in params]


class LlamaCacheEngine:
    """``export``'s module built for this CPU, its weights, and one runtime cache, driven as a
    serving engine drives it: sequences join (``add_sequence``), fork (``fork_sequence``) and leave
    (``remove_sequence``) at any step, and ``step`` runs one forward of any of them together.

    Parameters (keyword-only after ``config``)
    ----------
    config : llama.LlamaConfig
    kernels : "fuel" or "tvm"
        The cache's attention kernels (``FuelPagedKVCache`` or TVM's ``TIRPagedKVCache``).
    weights : dict of name -> numpy array, optional
        Default ``llama.init_weights(config, names, seed=seed)``.
    max_batch_size, max_total_seq_len, prefill_chunk_size, page_size :
        The runtime cache's: sequences per step, tokens held in all (its pages), tokens per step,
        tokens per page. ``page_size`` must be 16 (``kv_cache.TVM_PAGE_SIZE``): TVM 0.27's
        ``TIRPagedKVCache``, which both kernel sets build on, builds its append and compact kernels
        for pages of 16 whatever page size the cache is created with; refused before the build.
    """

    def __init__(self, config: LlamaConfig, *, kernels: str = "fuel", weights: dict[str, np.ndarray] | None = None,
                 seed: int = 0, max_batch_size: int = 8, max_total_seq_len: int = 2048, prefill_chunk_size: int = 512,
                 page_size: int = 16, target=None):
        if isinstance(page_size, bool) or not isinstance(page_size, (int, np.integer)) or page_size != TVM_PAGE_SIZE:
            raise ValueError(f"LlamaCacheEngine: page_size must be {TVM_PAGE_SIZE} (TVM's TIRPagedKVCache builds its "
                             f"append and compact kernels for pages of {TVM_PAGE_SIZE}), got {page_size!r}")
        self.config, self.kernels = config, kernels
        self.target = target or host_target()
        self.module, self.param_names = export(config, kernels=kernels, target=self.target)
        self.vm = relax.VirtualMachine(tvm.compile(self.module, self.target), tvm.cpu())
        self.weights = weights if weights is not None else init_weights(config, self.param_names, seed=seed)
        missing = set(self.param_names) - set(self.weights)
        if missing:
            raise ValueError(f"LlamaCacheEngine: weights lacks {sorted(missing)}")
        self._params = [tvm.runtime.tensor(np.ascontiguousarray(self.weights[name])) for name in self.param_names]
        self.max_batch_size, self.prefill_chunk_size = max_batch_size, prefill_chunk_size
        self.cache = self.vm["create_paged_kv_cache"](*(tvm.runtime.ShapeTuple([n]) for n in (
            max_batch_size, max_total_seq_len, prefill_chunk_size, page_size, 0)))
        self._kv = {name: tvm.get_global_func(f"vm.builtin.kv_state_{name}") for name in (
            "add_sequence", "remove_sequence", "fork_sequence", "begin_forward", "end_forward")}
        self._lengths: dict[int, int] = {}  # sequence id -> tokens in the cache

    # ------------------------------------------------------------------------------ sequences

    def _seq(self, where: str, name: str, seq_id, *, known: bool) -> int:
        if isinstance(seq_id, bool) or not isinstance(seq_id, (int, np.integer)) or seq_id < 0:
            raise ValueError(f"LlamaCacheEngine.{where}: {name} must be a non-negative int, got {seq_id!r}")
        seq_id = int(seq_id)
        if known and seq_id not in self._lengths:
            raise ValueError(f"LlamaCacheEngine.{where}: {name} {seq_id} is no sequence of the cache "
                             f"(it holds {sorted(self._lengths)})")
        if not known and seq_id in self._lengths:
            raise ValueError(f"LlamaCacheEngine.{where}: {name} {seq_id} is already a sequence of the cache")
        return seq_id

    def add_sequence(self, seq_id: int) -> None:
        """A new, empty sequence ``seq_id``."""
        seq_id = self._seq("add_sequence", "seq_id", seq_id, known=False)
        self._kv["add_sequence"](self.cache, seq_id)
        self._lengths[seq_id] = 0

    def remove_sequence(self, seq_id: int) -> None:
        """Drop ``seq_id``; its pages return to the pool (those a fork still shares stay)."""
        seq_id = self._seq("remove_sequence", "seq_id", seq_id, known=True)
        self._kv["remove_sequence"](self.cache, seq_id)
        del self._lengths[seq_id]

    def fork_sequence(self, parent: int, child: int) -> None:
        """A new sequence ``child`` holding all of ``parent``'s tokens (their pages shared, the last
        partial page copied); each continues on its own."""
        parent = self._seq("fork_sequence", "parent", parent, known=True)
        child = self._seq("fork_sequence", "child", child, known=False)
        self._kv["fork_sequence"](self.cache, parent, child, -1)
        self._lengths[child] = self._lengths[parent]

    def length(self, seq_id: int) -> int:
        """The tokens ``seq_id`` holds in the cache."""
        return self._lengths[self._seq("length", "seq_id", seq_id, known=True)]

    # ----------------------------------------------------------------------------------- step

    def step(self, seq_ids: list[int], tokens: list[list[int]]) -> list[np.ndarray]:
        """Append ``tokens[i]`` to sequence ``seq_ids[i]``, all in one forward (prompts, chunks and
        decode tokens alike), and return each sequence's logits [len(tokens[i]), vocab] float32
        (row j: the next token's after ``tokens[i][j]``)."""
        where, vocab = "LlamaCacheEngine.step", self.config.vocab_size
        if not isinstance(seq_ids, (list, tuple)) or not seq_ids:
            raise ValueError(f"{where}: seq_ids must be a non-empty list of sequence ids, got {seq_ids!r}")
        ids = [self._seq("step", "seq_ids entry", seq, known=True) for seq in seq_ids]
        if len(set(ids)) != len(ids):
            raise ValueError(f"{where}: seq_ids must not repeat a sequence, got {ids}")
        if len(ids) > self.max_batch_size:
            raise ValueError(f"{where}: seq_ids holds {len(ids)} sequences, more than max_batch_size "
                             f"{self.max_batch_size}")
        if not isinstance(tokens, (list, tuple)) or len(tokens) != len(ids):
            raise ValueError(f"{where}: tokens must be a list of one token list per sequence ({len(ids)})")
        rows = []
        for seq, row in zip(ids, tokens):
            row = np.asarray(row)
            if row.ndim != 1 or row.size == 0 or not np.issubdtype(row.dtype, np.integer):
                raise ValueError(f"{where}: tokens for sequence {seq} must be a non-empty list of int ids, "
                                 f"got {row.tolist()!r}")
            if row.min() < 0 or row.max() >= vocab:
                raise ValueError(f"{where}: token ids must be in [0, vocab_size={vocab}), got {row.tolist()} "
                                 f"for sequence {seq}")
            rows.append(row.astype("int32"))
        lengths = [len(row) for row in rows]
        if sum(lengths) > self.prefill_chunk_size:
            raise ValueError(f"{where}: tokens hold {sum(lengths)} tokens, more than prefill_chunk_size "
                             f"{self.prefill_chunk_size} (split the prompts over steps)")
        decode = all(n == 1 for n in lengths)
        packed = np.concatenate(rows)[:, None] if decode else np.concatenate(rows)[None, :]
        self._kv["begin_forward"](self.cache, tvm.runtime.ShapeTuple(ids), tvm.runtime.ShapeTuple(lengths), None)
        try:
            logits = self.vm["batch_decode" if decode else "batch_forward"](
                tvm.runtime.tensor(packed), self.cache, *self._params).numpy()
        finally:  # the runtime's step state closed even when the forward raised
            self._kv["end_forward"](self.cache)
        for seq, n in zip(ids, lengths):
            self._lengths[seq] += n
        logits = logits.reshape(-1, vocab)
        return np.split(logits, np.cumsum(lengths)[:-1])
