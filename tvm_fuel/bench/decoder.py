"""The benchmark's end-to-end rows (``python -m tvm_fuel bench``): the demo decoder against PyTorch.

The demo's Llama-style decoder (``models.llama``, default ``LlamaConfig``) built three ways --
``default`` (the performance-path kernels and default schedules for every other function, no
tuning log), ``tuned`` (the same with the shipped logs: records of this machine class for the
demo's shapes) and the TVM llvm pipeline of before (``tvm``: the kernels, the rest unscheduled)
-- against PyTorch eager with the same weights, timed side by side in one process:

- prefill of one 1000-token prompt (``LlamaEngine.generate(max_new_tokens=1)`` against
  ``peers.torch_generate``): tokens/s;
- decode of 4 sequences with contexts 17 to 1000 tokens (the demo's prompts), 32 steps: tokens/s.

Each runs in blocks of consecutive runs, the blocks taking turns over a few rounds
(``timing.in_blocks``).

Contents:
    decoder_rows -- run the rows, return their report
    print_rows   -- the rows as text
"""

from __future__ import annotations

import numpy as np

from ..target import host_target
from .timing import in_blocks

PREFILL_TOKENS = 1000
DECODE_PROMPTS = (17, 200, 500, 1000)
DECODE_STEPS = 32


def decoder_rows(*, seed: int = 0) -> dict:
    """Tokens/s of each build and of PyTorch eager, and the ratios (see the module docstring)."""
    from tvm import relax

    from ..models import llama
    from ..models.engine import LlamaEngine
    from ..models.peers import torch_generate

    config, target = llama.LlamaConfig(), host_target()
    rng = np.random.default_rng(seed)
    prompt = [int(t) for t in rng.integers(0, config.vocab_size, PREFILL_TOKENS)]
    prompts = [[int(t) for t in rng.integers(0, config.vocab_size, n)] for n in DECODE_PROMPTS]
    blocks = sum(-(-(n + DECODE_STEPS) // 16) for n in DECODE_PROMPTS)
    engines = {"default": LlamaEngine(config, target=target, kernels="tuned", num_blocks=blocks, seed=seed,
                                      shipped_logs=False),
               "tuned": LlamaEngine(config, target=target, kernels="tuned", num_blocks=blocks, seed=seed),
               "tvm": LlamaEngine(config, target=target, kernels="tuned", num_blocks=blocks, seed=seed,
                                  shipped_logs=False, relax_pipeline=relax.get_pipeline("default"))}
    weights = engines["tuned"].weights
    runs: dict = {}

    def generate(name):
        if name == "torch":
            return lambda: runs.setdefault("torch", []).append(
                torch_generate(config, weights, [prompt], max_new_tokens=1))
        return lambda: runs.setdefault(name, []).append(engines[name].generate([prompt], max_new_tokens=1))

    names = [*engines, "torch"]
    in_blocks({name: generate(name) for name in names}, runs)
    prefill = {name: PREFILL_TOKENS / float(np.median([r.prefill_s for r in runs[name]])) for name in names}
    runs.clear()

    def serve(name):
        if name == "torch":
            return lambda: runs.setdefault("torch", []).append(
                torch_generate(config, weights, prompts, max_new_tokens=DECODE_STEPS))
        return lambda: runs.setdefault(name, []).append(engines[name].generate(prompts, max_new_tokens=DECODE_STEPS))

    in_blocks({name: serve(name) for name in names}, runs)
    decode = {name: float(np.median([r.decode_tokens_per_s for r in runs[name]])) for name in names}
    same = all(r.tokens == runs["torch"][0].tokens for name in engines for r in runs[name][:1])
    records = engines["tuned"].records()
    return {"prefill_tokens": PREFILL_TOKENS, "decode_contexts": list(DECODE_PROMPTS), "decode_steps": DECODE_STEPS,
            "prefill_tokens_per_s": prefill, "decode_tokens_per_s": decode,
            "prefill_vs_torch": {name: prefill[name] / prefill["torch"] for name in engines},
            "decode_vs_torch": {name: decode[name] / decode["torch"] for name in engines},
            "same_tokens_as_torch": same, "tuned_records": records}


def print_rows(report: dict) -> None:
    print(f"\n[decoder end to end] demo decoder, float32, this CPU; prefill of one {report['prefill_tokens']}-token "
          f"prompt, decode of {len(report['decode_contexts'])} sequences (contexts "
          f"{report['decode_contexts'][0]}-{report['decode_contexts'][-1]}), {report['decode_steps']} steps")
    labels = {"tvm": "TVM llvm pipeline (rest unscheduled)", "default": "default schedules, no log",
              "tuned": "shipped logs", "torch": "PyTorch eager"}
    for name, label in labels.items():
        prefill, decode = report["prefill_tokens_per_s"][name], report["decode_tokens_per_s"][name]
        ratios = "" if name == "torch" else (f"   {report['prefill_vs_torch'][name]:5.2f}x / "
                                             f"{report['decode_vs_torch'][name]:5.2f}x PyTorch")
        print(f"  {label:<38} prefill {prefill:9.0f} tokens/s   decode {decode:7.0f} tokens/s{ratios}")
    r = report["tuned_records"]
    print(f"  shipped logs applied: {r['functions']} of {r['function_total']} TIR functions, {r['kernels']} of "
          f"{r['kernel_total']} kernels; same greedy tokens as PyTorch: {report['same_tokens_as_torch']}")
