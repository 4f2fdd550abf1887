"""The benchmark's Hugging Face rows (``python -m tvm_fuel bench --models``): an exported model
built by tvm_fuel against PyTorch eager and ``torch.compile`` (inductor).

The model is a SmolLM-135M-shaped Llama cut to 4 layers (hidden 576, 9 query and 3 KV heads of
64, MLP 1536, vocabulary 49152; random weights, nothing downloaded), run on token ids. For each
row (sequence length, batch, dtype) it is exported with ``torch.export``, imported through
``tvm_fuel.frontend.from_exported_program`` (every layer one causal ``flash_attn``) and built with
``tvm_fuel.compile(kernels="tuned")``; PyTorch runs the same module eagerly and compiled by
inductor, on the same thread count (``torch.set_num_threads`` = TVM's pool). Each contender's
time is a whole call, logits out as numpy (float32 logits a view on both sides), runs alternated
in blocks (``timing.in_blocks``); the first-call time of each (export, import and build for
tvm_fuel, the first compiled call for inductor) is reported beside it.

The decode rows serve the same shape (its head untied, as ``models.llama`` has it) over a KV cache:
``batch`` prompts of ``seq`` tokens, then greedy steps at M = ``batch``, the way MLC-LLM's engine
runs ``batch_decode``: tvm_fuel's ``models.engine.LlamaEngine`` (its paged cache; the decode
function's batch symbolic; its weights parameters, laid out in panels once at load:
``pack_params``) against transformers' LlamaForCausalLM with a
``DynamicCache`` and the same weights, eagerly (torch.compile is not timed here: a DynamicCache
grows every step). Runs of both go in blocks of two that take turns (``timing.in_blocks``, the
first of each block dropped); the row gives each phase's median seconds (prefill:
tvm_fuel prefills its prompts one by one, as its engine does) and how many tokens both chose alike.

The mask rows (issue 55, item 5) time the same model, exported once with the all-ones
``attention_mask`` every Hugging Face pipeline passes (fused as causal plus a bool [B, 1, 1, S] key
mask) and once without it, both built by tvm_fuel and timed in blocks that take turns: the key
mask's cost is their ratio.

Contents:
    MODEL_ROWS  -- the rows: (sequence length, batch, dtype)
    MASK_ROWS   -- the mask rows: (sequence length, batch, dtype)
    DECODE_ROWS -- the decode rows: (prompt length, batch, new tokens)
    model_rows  -- run the rows (and the mask and decode rows), return their report
    mask_row    -- one mask row: with and without the all-ones attention_mask
    decode_row  -- one decode row: prompts, then greedy steps over a KV cache, against transformers
    hf_name     -- a ``models.llama`` weight's name in transformers' LlamaForCausalLM
    print_rows  -- the rows as text
"""

from __future__ import annotations

import time

import numpy as np

from ..target import host_target
from .timing import SETTLE_SECONDS, in_blocks

MODEL_ROWS = tuple((seq, batch, dtype) for dtype in ("float32", "bfloat16") for seq in (512, 2048)
                   for batch in (1, 4))
MASK_ROWS = ((512, 1, "float32"),)
DECODE_ROWS = ((512, 1, 128), (512, 4, 128))  # prompt length, batch, new tokens
SMOLLM_4 = dict(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=4,
                num_attention_heads=9, num_key_value_heads=3, max_position_embeddings=4096, tie_word_embeddings=True)


def _model(dtype: str, seed: int):
    import torch
    import transformers

    torch.manual_seed(seed)
    config = transformers.LlamaConfig(**SMOLLM_4, attn_implementation="sdpa")
    model = transformers.LlamaForCausalLM(config).eval().to(getattr(torch, dtype))
    model.config.use_cache = False
    return model


def _row(seq: int, batch: int, dtype: str, seed: int) -> dict:
    import torch
    import tvm
    from tvm import relax

    from .. import frontend
    from ..build import compile as fuel_compile
    from ..models.engine import as_numpy

    model = _model(dtype, seed)
    ids = torch.randint(0, SMOLLM_4["vocab_size"], (batch, seq), generator=torch.Generator().manual_seed(seed))
    start = time.perf_counter()
    with torch.no_grad():
        program = torch.export.export(model, (ids,))
    mod = frontend.from_exported_program(program, keep_params_as_input=False)
    vm = relax.VirtualMachine(fuel_compile(mod, host_target(), kernels="tuned"), tvm.cpu())
    ids_tvm = tvm.runtime.tensor(ids.numpy())
    fused = str(mod["main"]).count("R.fuel.flash_attn(")

    def fuel():
        return as_numpy(vm["main"](ids_tvm)[0])

    fuel()
    fuel_first = time.perf_counter() - start
    compiled = torch.compile(model)

    def eager():
        with torch.no_grad():
            return model(ids).logits.float().numpy()

    def inductor():
        with torch.no_grad():
            return compiled(ids).logits.float().numpy()

    start = time.perf_counter()
    inductor()
    inductor_first = time.perf_counter() - start
    reference = eager()
    error = float(np.abs(fuel().astype(np.float32) - reference).max() / np.abs(reference).max())
    runs: dict = {}
    timed = {name: (lambda fn=fn, name=name: runs.setdefault(name, []).append(_seconds(fn)))
             for name, fn in (("tvm_fuel", fuel), ("eager", eager), ("inductor", inductor))}
    in_blocks(timed, runs)
    seconds = {name: float(np.median(times)) for name, times in runs.items()}
    faster = min(seconds["eager"], seconds["inductor"])
    return {"seq": seq, "batch": batch, "dtype": dtype, "seconds": seconds,
            "vs_faster_torch": seconds["tvm_fuel"] / faster, "first_call_seconds":
            {"tvm_fuel": fuel_first, "inductor": inductor_first}, "fused_attention_layers": fused,
            "max_rel_error_vs_eager": error}


def mask_row(seq: int, batch: int, dtype: str, seed: int) -> dict:
    """The model exported with its all-ones attention_mask and without it, both built by tvm_fuel:
    whole calls timed in blocks that take turns (the logits of both must agree)."""
    import torch
    import tvm
    from tvm import relax

    from .. import frontend
    from ..build import compile as fuel_compile
    from ..models.engine import as_numpy

    model = _model(dtype, seed)
    ids = torch.randint(0, SMOLLM_4["vocab_size"], (batch, seq), generator=torch.Generator().manual_seed(seed))
    calls, fused, masks = {}, {}, {}
    for name, kwargs in (("with_mask", {"attention_mask": torch.ones_like(ids)}), ("without_mask", {})):
        with torch.no_grad():
            program = torch.export.export(model, (ids,), kwargs)
        mod = frontend.from_exported_program(program, keep_params_as_input=False)
        fused[name] = str(mod["main"]).count("R.fuel.flash_attn(")
        masks[name] = _fused_mask(mod)
        vm = relax.VirtualMachine(fuel_compile(mod, host_target(), kernels="tuned"), tvm.cpu())
        args = [tvm.runtime.tensor(t.numpy()) for t in (ids, *kwargs.values())]
        calls[name] = lambda vm=vm, args=args: as_numpy(vm["main"](*args)[0])
    logits = {name: call() for name, call in calls.items()}
    difference = float(np.abs(logits["with_mask"] - logits["without_mask"]).max()
                       / np.abs(logits["without_mask"]).max())
    runs: dict = {}
    timed = {name: (lambda fn=fn, name=name: runs.setdefault(name, []).append(_seconds(fn)))
             for name, fn in calls.items()}
    in_blocks(timed, runs)
    seconds = {name: float(np.median(times)) for name, times in runs.items()}
    return {"seq": seq, "batch": batch, "dtype": dtype, "seconds": seconds,
            "with_over_without": seconds["with_mask"] / seconds["without_mask"], "fused_attention_layers": fused,
            "fused_mask": masks, "max_rel_difference": difference}


def hf_name(name: str) -> str:
    """``models.llama``'s weight name as transformers' LlamaForCausalLM names it."""
    if name == "embed.weight":
        return "model.embed_tokens.weight"
    if name == "lm_head.weight":
        return name
    name = name.replace("post_attn_norm", "post_attention_layernorm").replace("input_norm", "input_layernorm")
    return "model." + name.replace(".attn.", ".self_attn.")


def decode_row(seq: int, batch: int, new_tokens: int, seed: int, *, pack_params: bool = True) -> dict:
    """``batch`` prompts of ``seq`` tokens, then ``new_tokens`` greedy steps at M = ``batch`` (module
    docstring): tvm_fuel's ``LlamaEngine`` against transformers' LlamaForCausalLM with a DynamicCache,
    the same weights, in blocks that take turns; seconds per phase (medians) and the tokens both chose.
    ``pack_params=False``: the engine's weights as initialized (its matmuls pack them at every call)."""
    import torch
    import transformers

    from ..models import llama
    from ..models.engine import LlamaEngine

    config = llama.LlamaConfig(vocab_size=SMOLLM_4["vocab_size"], hidden_size=SMOLLM_4["hidden_size"],
                               intermediate_size=SMOLLM_4["intermediate_size"],
                               num_layers=SMOLLM_4["num_hidden_layers"], num_heads=SMOLLM_4["num_attention_heads"],
                               num_kv_heads=SMOLLM_4["num_key_value_heads"], head_dim=64)
    blocks = -(-batch * (seq + new_tokens) // 16)
    engine = LlamaEngine(config, target=host_target(), kernels="tuned", num_blocks=blocks, block_size=16, seed=seed,
                         pack_params=pack_params)
    hf_config = transformers.LlamaConfig(**{**SMOLLM_4, "tie_word_embeddings": False}, rms_norm_eps=config.rms_norm_eps,
                                         rope_theta=config.rope_theta, attn_implementation="sdpa")
    model = transformers.LlamaForCausalLM(hf_config).eval()
    state = {hf_name(name): torch.from_numpy(value) for name, value in engine.weights.items()}
    missing, unexpected = model.load_state_dict(state, strict=False)
    if [m for m in missing if "rotary" not in m] or unexpected:
        raise RuntimeError(f"bench decode row: weights do not map onto LlamaForCausalLM: missing {missing}, "
                           f"unexpected {unexpected}")
    prompts = np.random.default_rng(seed).integers(0, config.vocab_size, (batch, seq))

    def fuel():
        generation = engine.generate(prompts.tolist(), max_new_tokens=new_tokens)
        return generation.prefill_s, generation.decode_s, np.array(generation.tokens)

    def torch_eager():
        ids = torch.from_numpy(prompts)
        with torch.no_grad():
            start = time.perf_counter()
            out = model(ids, past_key_values=transformers.DynamicCache(), use_cache=True)
            tokens = [out.logits[:, -1].argmax(-1)]
            prefill_s = time.perf_counter() - start
            start = time.perf_counter()
            for _ in range(new_tokens - 1):
                out = model(tokens[-1][:, None], past_key_values=out.past_key_values, use_cache=True)
                tokens.append(out.logits[:, -1].argmax(-1))
            decode_s = time.perf_counter() - start
        return prefill_s, decode_s, torch.stack(tokens, 1).numpy()

    runs: dict = {"tvm_fuel": [], "eager": []}
    chosen: dict = {}

    def timed(name, fn):
        *seconds, chosen[name] = fn()
        runs[name].append(seconds)

    in_blocks({"tvm_fuel": lambda: timed("tvm_fuel", fuel), "eager": lambda: timed("eager", torch_eager)}, runs,
              block=2, settle=SETTLE_SECONDS)
    prefill = {name: float(np.median([r[0] for r in times])) for name, times in runs.items()}
    decode = {name: float(np.median([r[1] for r in times])) / (new_tokens - 1) for name, times in runs.items()}
    same = chosen["tvm_fuel"] == chosen["eager"]
    return {"seq": seq, "batch": batch, "new_tokens": new_tokens, "dtype": "float32", "pack_params": pack_params,
            "prefill_seconds": prefill, "decode_step_seconds": decode,
            "decode_vs_eager": decode["tvm_fuel"] / decode["eager"],
            "prefill_vs_eager": prefill["tvm_fuel"] / prefill["eager"],
            "tokens_equal": int(same.sum()), "tokens": int(same.size),
            "first_differing_step": int(np.argmin(same.all(0))) if not same.all() else None}


def _fused_mask(mod) -> str | None:
    """The mask type of the module's first fused attention (None: it has none)."""
    from tvm import relax

    found = []

    def visit(expr):
        if isinstance(expr, relax.Call) and getattr(expr.op, "name", "") == "relax.fuel.flash_attn" and not found:
            found.append(expr)

    relax.analysis.post_order_visit(mod["main"], visit)
    if not found or not bool(found[0].attrs["has_attn_mask"]):
        return None
    mask = found[0].args[3 + bool(found[0].attrs["has_alibi_slopes"])]  # present arguments only
    return f"{mask.ty.dtype}{[int(d) for d in mask.ty.shape]}"


def _seconds(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def model_rows(rows=MODEL_ROWS, *, seed: int = 0, mask_rows=MASK_ROWS, decode_rows=DECODE_ROWS) -> dict:
    """The report of ``rows`` and ``mask_rows`` (sequence length, batch, dtype) and ``decode_rows``
    (prompt length, batch, new tokens) on this machine (module docstring)."""
    import torch

    from ..compat.threads import thread_count

    torch.set_num_threads(thread_count())
    return {"model": "SmolLM-135M shape, 4 layers", "config": SMOLLM_4, "threads": torch.get_num_threads(),
            "rows": [_row(seq, batch, dtype, seed) for seq, batch, dtype in rows],
            "mask_rows": [mask_row(seq, batch, dtype, seed) for seq, batch, dtype in mask_rows],
            "decode_rows": [decode_row(seq, batch, new, seed) for seq, batch, new in decode_rows]}


def print_rows(report: dict) -> None:
    print(f"\n[Hugging Face models] {report['model']}, exported from ids; {report['threads']} threads; whole calls, "
          "logits out as numpy")
    for row in report["rows"]:
        s, first = row["seconds"], row["first_call_seconds"]
        print(f"  S={row['seq']:5d} B={row['batch']} {row['dtype']:<8}  tvm_fuel {s['tvm_fuel'] * 1e3:8.1f} ms   "
              f"eager {s['eager'] * 1e3:8.1f} ms   inductor {s['inductor'] * 1e3:8.1f} ms   "
              f"{row['vs_faster_torch']:4.2f}x the faster PyTorch   first call: tvm_fuel {first['tvm_fuel']:5.1f} s, "
              f"inductor {first['inductor']:5.1f} s   (fused layers {row['fused_attention_layers']}, "
              f"error {row['max_rel_error_vs_eager']:.1e})")
    for row in report.get("mask_rows", []):
        s = row["seconds"]
        print(f"  S={row['seq']:5d} B={row['batch']} {row['dtype']:<8}  tvm_fuel with the all-ones attention_mask "
              f"{s['with_mask'] * 1e3:8.1f} ms   without {s['without_mask'] * 1e3:8.1f} ms   "
              f"{row['with_over_without']:4.2f}x   (fused mask {row['fused_mask']['with_mask']}, "
              f"logits differ by {row['max_rel_difference']:.1e})")
    for row in report.get("decode_rows", []):
        prefill, step = row["prefill_seconds"], row["decode_step_seconds"]
        print(f"  S={row['seq']:5d} B={row['batch']} then {row['new_tokens']} tokens, float32 (KV cache, untied head): "
              f"decode step tvm_fuel {step['tvm_fuel'] * 1e3:6.2f} ms   eager {step['eager'] * 1e3:6.2f} ms   "
              f"{row['decode_vs_eager']:4.2f}x eager's time   prefill tvm_fuel {prefill['tvm_fuel'] * 1e3:7.1f} ms   "
              f"eager {prefill['eager'] * 1e3:7.1f} ms   (same tokens {row['tokens_equal']} of {row['tokens']})")


__all__ = ["DECODE_ROWS", "MASK_ROWS", "MODEL_ROWS", "decode_row", "hf_name", "mask_row", "model_rows", "print_rows"]
