"""Greedy generation with the Llama-style decoder over a paged KV cache.

``LlamaEngine`` compiles ``tvm_fuel.models.llama`` for a target (the floor or the tuned kernels),
holds the weights on the device and a ``PagedKVCache``, and runs the serving loop: each prompt
is prefilled on its own (``flash_attn``, K/V written into the cache), then all sequences decode
together, one token per step (``paged_attn`` over each sequence's blocks, whatever its length).

Contents:
    Generation, LlamaEngine
    as_numpy -- a TVM tensor as numpy, float32 as a view (logits are large)

Example
-------
>>> from tvm_fuel.models import llama
>>> from tvm_fuel.models.engine import LlamaEngine           # doctest: +SKIP
>>> engine = LlamaEngine(llama.LlamaConfig(), target="llvm", kernels="tuned")
>>> result = engine.generate([[1, 2, 3], [4, 5, 6, 7, 8]], max_new_tokens=8)
>>> result.tokens         # each sequence's new tokens
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import numpy as np
import tvm
from tvm import relax

from ..build import compile as fuel_compile
from ..kv_cache import PagedKVCache
from . import llama


def as_numpy(tensor: tvm.runtime.Tensor) -> np.ndarray:
    """``tensor`` as numpy, as PyTorch's ``.numpy()`` gives a float32 tensor: a view (DLPack), no
    copy; other dtypes copied. A prompt's logits are large (512 tokens over a 49152 vocabulary: 100
    MB, 10-20 ms to copy, a tenth of the prefill)."""
    return np.from_dlpack(tensor) if str(tensor.dtype) == "float32" else tensor.numpy()


@dataclass(frozen=True)
class Generation:
    """What ``LlamaEngine.generate`` returns.

    tokens: each sequence's generated tokens (greedy). prefill_logits: each prompt's logits
    [S, vocab] (float32). decode_logits: per decode step, [B, vocab] for the batch.
    prefill_s, decode_s: wall-clock seconds of the two phases. attention_s: seconds spent in the
    attention ops (flash_attn, paged_attn) per phase, when ``generate(time_attention=True)``.
    """

    tokens: list[list[int]]
    prefill_logits: list[np.ndarray] = field(repr=False)
    decode_logits: list[np.ndarray] = field(repr=False)
    prefill_s: float
    decode_s: float
    attention_s: dict[str, float] | None = None

    @property
    def decode_tokens_per_s(self) -> float:
        return len(self.decode_logits) * len(self.tokens) / self.decode_s if self.decode_s else 0.0


class LlamaEngine:
    """The compiled decoder, its weights and a paged KV cache on one device.

    Parameters (keyword-only after ``config``)
    ----------
    config : llama.LlamaConfig
    target : str, dict or Target
        What to build for (``tvm_fuel.host_target()`` for this CPU's vector width).
    kernels : "decomposed" or "tuned"
        The correctness floor or the performance-path kernels (``tvm_fuel.compile``).
    num_blocks, block_size : int
        The cache: blocks per layer, tokens per block.
    seed : int
        Seed of the random weights.
    device : tvm.runtime.Device
        Default ``tvm.cpu()``.
    shipped_logs, relax_pipeline, pack_params :
        As ``tvm_fuel.compile``'s: the logs shipped with the package (their records for the demo's
        shapes), the pipeline after the fuel ops (default: ``build.default_pipeline``), and whether
        the weights are laid out once, here, in the panels the CPU matmuls read (the build's
        ``transform_params``; default: passed as initialized, the matmuls packing them per call).
    """

    def __init__(self, config: llama.LlamaConfig, *, target="llvm", kernels: str = "decomposed",
                 num_blocks: int = 64, block_size: int = 16, seed: int = 0, device=None, shipped_logs: bool = True,
                 relax_pipeline="default", pack_params: bool = False):
        self.config, self.device = config, device or tvm.cpu()
        self.cache = PagedKVCache(num_blocks=num_blocks, block_size=block_size, num_kv_heads=config.num_kv_heads,
                                  head_dim=config.head_dim, num_layers=config.num_layers, dtype=config.dtype,
                                  device=self.device, target=target)  # first: bad sizes fail before the build
        mod, names = llama.serving_module(config, num_blocks=num_blocks, block_size=block_size, gpu=self.cache.gpu)
        self.module, self.target, self.kernels, self.shipped_logs = mod, target, kernels, shipped_logs
        self.pack_params = pack_params
        start = time.perf_counter()
        self.vm = relax.VirtualMachine(fuel_compile(mod, target, kernels=kernels, shipped_logs=shipped_logs,
                                                    relax_pipeline=relax_pipeline, pack_params=pack_params),
                                       self.device)
        self.build_s = time.perf_counter() - start
        self.weights = llama.init_weights(config, names, seed=seed)
        # the weights as the build's functions take them: as initialized, or laid out once by transform_params
        self.params = [tvm.runtime.tensor(self.weights[name], device=self.device) for name in names]
        if pack_params:
            self.params = list(self.vm["transform_params"](self.params))

    def records(self) -> dict:
        """What the build took from tuning logs (the shipped ones): ``kernels`` of ``kernel_total``
        attention kernels with recorded knobs, ``functions`` of ``function_total`` other TIR
        functions with a MetaSchedule record, and the logs (``sources``); see ``tuning_report``."""
        from ..tuning.report import TIR_FUNCTION, tuning_report

        rows = (tuning_report(self.module, self.target, functions=True, shipped_logs=self.shipped_logs,
                              pack_params=self.pack_params)
                if self.kernels == "tuned" else [])
        kernels = [r for r in rows if r["workload"] != TIR_FUNCTION]
        functions = [r for r in rows if r["workload"] == TIR_FUNCTION]
        recorded = [r for r in rows if r["match"] is not None]
        return {"kernels": sum(r["match"] is not None for r in kernels), "kernel_total": len(kernels),
                "functions": sum(r["match"] is not None for r in functions), "function_total": len(functions),
                "sources": sorted({_short(r["knobs"]) for r in recorded})}

    def _tokens(self, tokens, what: str) -> tvm.runtime.Tensor:
        tokens = np.asarray(tokens)
        if tokens.ndim != 2 or tokens.shape[1] == 0 or tokens.dtype.kind not in "iu":
            raise ValueError(f"LlamaEngine.{what}: tokens must be integer ids [B, S] with S >= 1, "
                             f"got {tokens.dtype} {list(tokens.shape)}")
        if tokens.size and (tokens.min() < 0 or tokens.max() >= self.config.vocab_size):
            raise ValueError(f"LlamaEngine.{what}: token ids must be in [0, vocab_size={self.config.vocab_size}), "
                             f"got {tokens.min()}..{tokens.max()}")
        return tvm.runtime.tensor(tokens.astype("int32"), device=self.device)

    def forward(self, tokens: np.ndarray) -> np.ndarray:
        """Logits [B, S, vocab] of whole sequences [B, S] without the cache (``flash_attn``)."""
        return as_numpy(self.vm["forward"](self._tokens(tokens, "forward"), *self.params))

    def prefill(self, seq: int, prompt: list[int]) -> np.ndarray:
        """Run the prompt of the empty sequence ``seq`` and keep its K/V in the cache; returns
        logits [S, vocab] float32."""
        tokens = self._tokens([prompt], "prefill")
        if self.cache.length(seq):  # prefill's positions start at 0 and it attends to the prompt alone
            raise ValueError(f"LlamaEngine.prefill: sequence {seq} already holds {self.cache.length(seq)} tokens "
                             f"(continue it with decode)")
        with self.cache.rollback_on_error([seq]):
            slots = self.cache.reserve([seq], len(prompt))
            logits, _, _ = self.vm["prefill"](tokens, self.cache.k_cache, self.cache.v_cache, slots, *self.params)
        return as_numpy(logits)[0]

    def decode(self, seqs: list[int], tokens: np.ndarray) -> np.ndarray:
        """The next T tokens [B, T] of each sequence over its cached context (``decode`` for T = 1,
        ``extend`` for a chunk); returns logits [B, T, vocab] float32."""
        tokens = self._tokens(tokens, "decode")
        if tokens.shape[0] != len(seqs):
            raise ValueError(f"LlamaEngine.decode: tokens must have one row per sequence ({len(seqs)}), "
                             f"got {tokens.shape[0]}")
        with self.cache.rollback_on_error(seqs):
            slots = self.cache.reserve(seqs, int(tokens.shape[1]))
            func = self.vm["decode" if tokens.shape[1] == 1 else "extend"]
            logits, _, _ = func(tokens, self.cache.k_cache, self.cache.v_cache, self.cache.block_table(seqs),
                                self.cache.context_lens(seqs), slots, *self.params)
        return as_numpy(logits)

    def generate(self, prompts: list[list[int]], *, max_new_tokens: int, time_attention: bool = False) -> Generation:
        """Greedy decoding of every prompt for ``max_new_tokens`` tokens; the cache is freed after.

        ``time_attention``: also sum the time of the attention ops per phase (their kernels and
        paged_attn's table check, not the K/V append; a VM instrument around every call, which
        slows the run a little: time tokens/s without it)."""
        if not prompts or any(len(p) == 0 for p in prompts):
            raise ValueError("LlamaEngine.generate: prompts must be a non-empty list of non-empty token lists")
        if max_new_tokens < 1:
            raise ValueError(f"LlamaEngine.generate: max_new_tokens must be >= 1, got {max_new_tokens}")
        seqs = [self.cache.add_sequence() for _ in prompts]
        timer = _KernelTimer(("fuel_flash_attn", "fuel_paged_attn")) if time_attention else None
        if timer:
            self.vm.set_instrument(timer)
        try:
            start = time.perf_counter()
            prefill_logits = [self.prefill(seq, prompt) for seq, prompt in zip(seqs, prompts)]
            prefill_s = time.perf_counter() - start
            attention_s = {"prefill": timer.take()} if timer else None
            next_tokens = np.array([logits[-1].argmax() for logits in prefill_logits], "int32")
            generated, decode_logits = [next_tokens], []
            start = time.perf_counter()
            for _ in range(max_new_tokens - 1):
                logits = self.decode(seqs, next_tokens[:, None])[:, -1]
                decode_logits.append(logits)
                next_tokens = logits.argmax(-1).astype("int32")
                generated.append(next_tokens)
            decode_s = time.perf_counter() - start
            if timer:
                attention_s["decode"] = timer.take()
        finally:
            for seq in seqs:
                self.cache.free(seq)
            if timer:
                self.vm.set_instrument(None)
        tokens = np.stack(generated, 1)
        return Generation([row.tolist() for row in tokens], prefill_logits, decode_logits, prefill_s, decode_s,
                          attention_s)


def _short(path: str) -> str:
    """A log file as ``<target key>/<kernel>`` (its folder's last two parts)."""
    parts = path.replace("\\", "/").split("/")
    return "/".join(parts[-3:-1]) if len(parts) >= 3 else path


class _KernelTimer:
    """A VM instrument summing the wall time of the calls whose symbol starts with one of ``prefixes``."""

    def __init__(self, prefixes: tuple[str, ...]):
        self.prefixes, self.total, self._start = prefixes, 0.0, 0.0

    def __call__(self, func, symbol: str, before_run: bool, ret_value, *args) -> int:
        if symbol.startswith(self.prefixes):
            if before_run:
                self._start = time.perf_counter()
            else:
                self.total += time.perf_counter() - self._start
        return 0  # VMInstrumentReturnKind.NoOp: run the call as usual

    def take(self) -> float:
        total, self.total = self.total, 0.0
        return total
