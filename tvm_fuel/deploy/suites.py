"""The cases a bundle holds: what each stage runs, on which shapes, compared with what.

A ``Case`` is one Relax module (one fuel call over named inputs) plus how the node makes its
inputs (seeded fills, ``testing.arrays``) and what its outputs must match: the float64 reference
(small shapes), the floor's module and PyTorch (large shapes). The check matrix follows the CPU
suite: GQA groups 1, 3 and 7; head dims 40, 64, 80, 96, 128 and 256; causal, windows (with sink
tokens), softcap, ALiBi, bool and additive masks; rows with no visible key; every dtype; the four
backward forms; paged decode (with sinks) and multi-query over permuted block tables with −1
padding, lengths 0, 1, 17 and long enough for split-KV. Tune buckets are the benchmark's shapes.

A ``SlotCase`` is fuel's kernels for the attention slots of TVM's runtime KV cache beside TVM's
own for the same slots, in one module, run on one batch in TVM's layouts (``node.tvm_slots``):
compared, and timed side by side in the bench stage.

Contents:
    Case, tensor       -- a case and one input of it
    SlotCase           -- TVM-cache slot kernels, fuel's and TVM's, on one batch
    cases              -- the cases of a suite for a target kind
    varlen_cases, varlen_bench_cases -- flash_attn_varlen's (and its backward's) check and bench
                       cases (packed batches)
    quantized_bench_cases -- paged decode over 8-bit caches, timed beside the bfloat16 cache's row
    case_module        -- the Relax module of a case (``SlotCase.module``: a slot case's PrimFuncs)
    tune_workloads     -- the static kernel workloads the tune stage measures
    SUITES
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field

import tvm
from tvm import relax

from .. import op as fuel_op
from ..kv_cache import TVM_SLOTS, tvm_kernels, tvm_own_kernels
from ..testing.cases import (FLOOR_MAX_SCORES, FlashCase, PagedCase, attention_flops, cuda_suite,
                             default_suite, kv_bytes)

SUITES = {"smoke": ("smoke",), "check": ("smoke", "check"), "bench": ("smoke", "bench"), "tune": ("smoke", "tune"),
          "all": ("smoke", "check", "bench", "tune")}
OUTPUTS = {"flash_attn": ("out", "lse"), "flash_attn_backward": ("dq", "dk", "dv"), "flash_attn_backward_q": ("dq",),
           "flash_attn_backward_k": ("dk",), "flash_attn_backward_v": ("dv",), "paged_attn": ("out",),
           "flash_attn_varlen": ("out", "lse"), "flash_attn_varlen_backward": ("dq", "dk", "dv")}


def tensor(name: str, shape, dtype: str, fill: str = "normal", **extra) -> dict:
    return {"name": name, "shape": [int(s) for s in shape], "dtype": dtype, "fill": fill, **extra}


@dataclass(frozen=True)
class Case:
    """One module of a bundle and how the node checks or times it."""

    stage: str
    name: str
    op: str  # the fuel op (its constructor in tvm_fuel.op)
    dtype: str
    inputs: tuple  # of tensor(...) dicts, in the op's argument order
    options: dict = field(default_factory=dict)  # the op's attributes (and the reference's keywords)
    expect: tuple = ("reference",)  # reference, floor, torch
    torch: dict | None = None  # {"kind": flash|flash_backward|paged, "causal": .., "context": ..}
    timed: bool = False
    scale: float = 1.0  # tolerance scale (outputs summing many terms)
    flops: float = 0.0
    bytes_read: float = 0.0
    seed: int = 0

    @property
    def outputs(self) -> tuple[str, ...]:
        names = OUTPUTS[self.op]
        returns_lse = self.op not in ("flash_attn", "flash_attn_varlen") or self.options.get("return_lse")
        return names if returns_lse else names[:1]

    def spec(self) -> dict:
        """The case as the manifest holds it (modules are added by the bundle)."""
        reference_op = "flash_attn_backward" if self.op.startswith("flash_attn_backward") else self.op
        return {"kind": "op", "stage": self.stage, "name": self.name, "op": reference_op, "dtype": self.dtype,
                "inputs": list(self.inputs), "seed": self.seed, "options": dict(self.options),
                "outputs": list(self.outputs), "reference_outputs": list(OUTPUTS[reference_op]),
                "expect": list(self.expect), "torch": self.torch, "timed": self.timed, "scale": self.scale,
                "flops": self.flops, "bytes_read": self.bytes_read}


@dataclass(frozen=True)
class SlotCase:
    """Attention slots of TVM's runtime KV cache: fuel's kernel (``fuel_<slot>``) and TVM's own
    (``tvm_<slot>``) for each, run on the batch ``node.tvm_slots.slot_batch`` draws from ``config``
    (num_qo_heads, num_kv_heads, head_dim, page_size, cached, new) and ``seed``."""

    stage: str
    name: str
    dtype: str
    config: dict
    slots: tuple = TVM_SLOTS
    rotary_modes: tuple = (0,)  # 1 (RoPE in the kernel) on CPUs only: fuel's CUDA slots refuse it
    causal: tuple = (0, 1)
    sliding_window_size: int = 24  # small enough that the sliding prefill's rows drop keys
    timed: bool = False  # the first call (one slot, one flag) timed, fuel's and TVM's side by side
    flops: float = 0.0
    bytes_read: float = 0.0
    seed: int = 0

    def spec(self) -> dict:
        return {"kind": "tvm_slots", "stage": self.stage, "name": self.name, "dtype": self.dtype,
                "config": dict(self.config), "slots": list(self.slots), "rotary_modes": list(self.rotary_modes),
                "causal": list(self.causal), "expect": ["tvm"], "timed": self.timed, "flops": self.flops,
                "bytes_read": self.bytes_read, "seed": self.seed}

    def module(self, target: tvm.target.Target) -> tvm.IRModule:
        """fuel's and TVM's kernel of each slot for ``target``, as ``fuel_<slot>`` and ``tvm_<slot>``."""
        c = self.config
        shape = (c["num_kv_heads"], c["num_qo_heads"], c["head_dim"], self.dtype, target)
        options = dict(page_size=c["page_size"], sliding_window_size=self.sliding_window_size)
        funcs = {}
        for side, kernels in (("fuel", tvm_kernels(*shape, **options)), ("tvm", tvm_own_kernels(*shape, **options))):
            funcs |= {f"{side}_{slot}": kernels[slot].with_attr("global_symbol", f"{side}_{slot}")
                      for slot in self.slots}
        return tvm.IRModule(funcs)


def case_module(case: Case) -> tvm.IRModule:
    """``main(*inputs)`` calling the case's op once."""
    named = {t["name"]: relax.Var(t["name"], relax.TensorType(t["shape"], t["dtype"])) for t in case.inputs}
    bb = relax.BlockBuilder()
    with bb.function("main", list(named.values())):
        bb.emit_func_output(bb.emit(getattr(fuel_op, case.op)(**named, **case.options)))
    return bb.get()


# ---------------------------------------------------------------------------------------------
# shapes

def _dense(B, Hq, Hkv, Sq, Sk, D, dtype, *, backward=False, alibi=False, mask=None, state=False) -> tuple:
    inputs = [tensor("q", (B, Hq, Sq, D), dtype), tensor("k", (B, Hkv, Sk, D), dtype),
              tensor("v", (B, Hkv, Sk, D), dtype)]
    if backward:
        inputs.append(tensor("do", (B, Hq, Sq, D), dtype))
    if alibi:
        inputs.append(tensor("alibi_slopes", (Hq,), "float32", "slopes"))
    if mask == "bool":  # broadcast over heads
        inputs.append(tensor("attn_mask", (B, 1, Sq, Sk), "bool", "keep", p=0.7))
    elif mask == "additive":
        inputs.append(tensor("attn_mask", (Sq, Sk), "float32", scale=2.0))
    if state:  # the forward's out and a finite lse (timing the backward alone)
        inputs += [tensor("out", (B, Hq, Sq, D), dtype), tensor("lse", (B, Hq, Sq), "float32", "lse", keys=Sk)]
    return tuple(inputs)


def _paged(B, Hq, Hkv, Sq, D, block_size, lens, dtype, *, capacity=None, num_blocks=None) -> tuple:
    capacity = capacity or max(max(lens), 1)
    max_blocks = -(-capacity // block_size)
    num_blocks = num_blocks or B * max_blocks + 3
    cache = (num_blocks, block_size, Hkv, D)
    return (tensor("q", (B, Hq, Sq, D), dtype), tensor("k_cache", cache, dtype), tensor("v_cache", cache, dtype),
            tensor("block_table", (B, max_blocks), "int32", "blocks", num_blocks=num_blocks, lens=list(lens),
                   block_size=block_size),
            tensor("context_lens", (B,), "int32", "values", values=list(lens)))


def _label(options: dict) -> str:
    parts = []
    if options.get("causal"):
        parts.append("causal")
    if tuple(options.get("window_size", (-1, -1))) != (-1, -1):
        parts.append("window{}:{}".format(*options["window_size"]))
    if options.get("softcap"):
        parts.append(f"softcap{options['softcap']:g}")
    if options.get("sink_tokens"):
        parts.append(f"sink_tokens{options['sink_tokens']}")
    return "-".join(parts) or "full"


def smoke_cases(dtype: str) -> list[Case]:
    """One tiny kernel per op: the first thing a node runs."""
    return [
        Case("smoke", f"smoke/flash_attn/{dtype}", "flash_attn", dtype, _dense(1, 2, 1, 16, 16, 64, dtype),
             dict(causal=True, return_lse=True), seed=1),
        Case("smoke", f"smoke/flash_attn_backward/{dtype}", "flash_attn_backward", dtype,
             _dense(1, 2, 1, 16, 16, 64, dtype, backward=True), dict(causal=True), seed=2, scale=4),
        Case("smoke", f"smoke/paged_attn/{dtype}", "paged_attn", dtype,
             _paged(2, 4, 2, 1, 64, 16, (5, 20), dtype), dict(causal=True), seed=3),
    ]


# (B, Hq, Hkv, Sq, Sk, D, options, extras): GQA 1/3/7, head dims 40/64/80/96/128/256, masks, empty rows
# (every bundle, CPU ones too; the seeds count up through the lists, so a row added shifts the later ones)
_FORWARD = [
    (2, 2, 2, 97, 97, 64, dict(causal=True), {}),
    (1, 6, 2, 17, 300, 128, dict(window_size=(16, 0)), {}),
    (2, 7, 1, 1, 97, 40, dict(), {}),
    (1, 6, 2, 97, 17, 64, dict(causal=True), {}),  # Sq > Sk: rows with no visible key
    (1, 3, 1, 64, 64, 128, dict(causal=True, softcap=5.0), {}),
    (1, 6, 2, 33, 65, 64, dict(causal=True), dict(alibi=True)),
    (2, 4, 4, 40, 70, 64, dict(window_size=(8, 4)), dict(mask="bool")),
    (1, 6, 2, 33, 47, 64, dict(), dict(mask="additive")),
    (1, 6, 2, 65, 130, 256, dict(causal=True), {}),  # head dims beyond 128 (Gemma) and between (80)
    (1, 4, 4, 33, 97, 80, dict(softcap=5.0), {}),
    (1, 6, 2, 64, 400, 64, dict(causal=True, window_size=(16, -1), sink_tokens=4), {}),  # tiles skipped between
]
_BACKWARD = [
    (1, 6, 2, 97, 130, 64, dict(causal=True, softcap=5.0), {}),
    (2, 2, 2, 17, 17, 128, dict(window_size=(8, 0)), {}),
    (1, 7, 1, 33, 33, 40, dict(causal=True), dict(alibi=True)),
    (1, 3, 3, 40, 56, 64, dict(), dict(mask="bool")),
    (1, 4, 2, 33, 65, 256, dict(causal=True), {}),
    (1, 3, 1, 40, 40, 96, dict(), {}),
    (1, 3, 1, 64, 400, 64, dict(causal=True, window_size=(16, -1), sink_tokens=40), {}),
]
# (Sq, Hq, Hkv, D, block size, context lengths): decode, multi-query, split-KV, empty sequences
_PAGED = [
    (1, 8, 8, 128, 16, (1, 17, 300, 2048)),
    (1, 14, 2, 128, 16, (0, 33, 97, 1000)),
    (1, 7, 1, 64, 32, (5, 64, 700, 1)),
    (4, 6, 2, 64, 16, (4, 97, 64, 1000)),
    (5, 12, 4, 128, 16, (5, 17, 250, 40)),
    (1, 8, 2, 256, 16, (1, 97, 600, 33)),
]


# TVM-cache slots (Hq, Hkv, D, dtype): GQA groups 4, 7 and 1, head dims 64 and 128, float16 and
# float32 (TVM's kernels serve no bfloat16), each module ~1.3 MB of cubin and ~1 MB of library
_SLOTS = [(8, 2, 64, "float16"), (7, 1, 128, "float32"), (4, 4, 128, "float16")]


def _slot_config(hq: int, hkv: int, d: int, cached, new) -> dict:
    return dict(num_qo_heads=hq, num_kv_heads=hkv, head_dim=d, page_size=16, cached=list(cached), new=list(new))


def slot_check_cases(gpu: bool, *, small: bool = False) -> list[SlotCase]:
    """Every attention slot, fuel's against TVM's, on sequences of 0, 1, 17 and 97 cached keys;
    RoPE in the kernel (rotary mode 1) on CPUs, where fuel's kernels serve it."""
    found = []
    for index, (hq, hkv, d, dtype) in enumerate([(8, 2, 64, "float32")] if small else _SLOTS):
        found.append(SlotCase("check", f"check/tvm_cache/{dtype}/Hq{hq}-Hkv{hkv}-D{d}/ctx0_1_17_97", dtype,
                              _slot_config(hq, hkv, d, (0, 1, 17, 97), (3, 1, 5, 9)),
                              rotary_modes=(0,) if gpu else (0, 1), seed=600 + index))
    return found


def slot_bench_cases(gpu: bool, *, small: bool = False) -> list[SlotCase]:
    """One layer's prefill (the new tokens against the cached keys: causal 0, as the runtime calls
    the paged slot when the new tokens' own keys go to the ragged one) and decode step in
    TVM's cache, fuel's kernel and TVM's timed side by side: on a GPU the issue's sizes (8
    sequences, Hq 32, Hkv 8, D 128, float16: 512 new tokens over 1536 cached; a decode at 2048);
    on a CPU a prefill small enough for TVM's CPU kernel."""
    if small:
        hq, hkv, d, dtype, batch, prefill, decode = 4, 2, 64, "float32", 2, (100, 16), 100
    elif gpu:
        hq, hkv, d, dtype, batch, prefill, decode = 32, 8, 128, "float16", 8, (1536, 512), 2048
    else:
        hq, hkv, d, dtype, batch, prefill, decode = 32, 8, 128, "float32", 8, (256, 64), 2048
    (cached, new), size = prefill, 2 if dtype == "float16" else 4
    label = f"{dtype}/B{batch}-Hq{hq}-Hkv{hkv}-D{d}"
    return [SlotCase("bench", f"bench/tvm_cache/prefill/{label}/new{new}-ctx{cached}", dtype,
                     _slot_config(hq, hkv, d, [cached] * batch, [new] * batch), slots=("prefill",), causal=(0,),
                     timed=True, flops=attention_flops(batch, hq, new, cached, d, causal=False, backward=False),
                     seed=700),
            SlotCase("bench", f"bench/tvm_cache/decode/{label}/ctx{decode}", dtype,
                     _slot_config(hq, hkv, d, [decode] * batch, [1] * batch), slots=("decode",), timed=True,
                     flops=attention_flops(batch, hq, 1, decode, d, causal=False, backward=False),
                     bytes_read=kv_bytes(batch, decode, hkv, d, size), seed=701)]


def check_cases(dtypes: tuple[str, ...], *, small: bool = False) -> list[Case]:
    found: list[Case] = []
    forward, backward, paged = (_FORWARD[:3], _BACKWARD[:1], _PAGED[:2]) if small else (_FORWARD, _BACKWARD, _PAGED)
    seed = 100
    for dtype in dtypes:
        for B, Hq, Hkv, Sq, Sk, D, options, extra in forward:
            seed += 1
            name = f"check/flash_attn/{dtype}/B{B}-Hq{Hq}-Hkv{Hkv}-Sq{Sq}-Sk{Sk}-D{D}/{_label(options)}"
            name += "".join(f"-{k}" if v is True else f"-{v}" for k, v in extra.items())
            found.append(Case("check", name, "flash_attn", dtype, _dense(B, Hq, Hkv, Sq, Sk, D, dtype, **extra),
                              dict(options, return_lse=True), seed=seed))
        for B, Hq, Hkv, Sq, Sk, D, options, extra in backward:
            seed += 1
            name = f"B{B}-Hq{Hq}-Hkv{Hkv}-Sq{Sq}-Sk{Sk}-D{D}/{_label(options)}"
            name += "".join(f"-{k}" if v is True else f"-{v}" for k, v in extra.items())
            inputs = _dense(B, Hq, Hkv, Sq, Sk, D, dtype, backward=True, **extra)
            found.append(Case("check", f"check/flash_attn_backward/{dtype}/{name}", "flash_attn_backward", dtype,
                              inputs, options, seed=seed, scale=4))
        if dtype != "bfloat16" and not small:  # the single-gradient forms share the tuple op's code path
            for grad in "qkv":
                seed += 1
                B, Hq, Hkv, Sq, Sk, D, options, _ = _BACKWARD[0]
                found.append(Case("check", f"check/flash_attn_backward_{grad}/{dtype}/B{B}-Hq{Hq}-Hkv{Hkv}-Sq{Sq}"
                                           f"-Sk{Sk}-D{D}/{_label(options)}", f"flash_attn_backward_{grad}", dtype,
                                  _dense(B, Hq, Hkv, Sq, Sk, D, dtype, backward=True), options, seed=seed, scale=4))
        for Sq, Hq, Hkv, D, block_size, lens in paged:
            seed += 1
            name = f"check/paged_attn/{dtype}/Sq{Sq}-Hq{Hq}-Hkv{Hkv}-D{D}-bs{block_size}/ctx{'_'.join(map(str, lens))}"
            found.append(Case("check", name, "paged_attn", dtype,
                              _paged(len(lens), Hq, Hkv, Sq, D, block_size, lens, dtype),
                              dict(causal=True), seed=seed))
        # gpt-oss's sinks: each head's sink logit added to its rows' sums (the first paged shape)
        Sq, Hq, Hkv, D, block_size, lens = paged[0]
        seed += 1
        found.append(Case("check", f"check/paged_attn/{dtype}/Sq{Sq}-Hq{Hq}-Hkv{Hkv}-D{D}-bs{block_size}/ctx"
                                   f"{'_'.join(map(str, lens))}/sinks", "paged_attn", dtype,
                          _paged(len(lens), Hq, Hkv, Sq, D, block_size, lens, dtype)
                          + (tensor("sinks", (Hq,), "float32"),), dict(causal=True), seed=seed))
        # 8-bit caches, dequantized in the kernels' loads: fp8 with a scale per KV head (vLLM's),
        # int8 with one per token and head
        for cache_dtype in ("float8_e4m3fn", "int8"):
            seed += 1
            q, k_cache, v_cache, table, lens_ = _paged(len(lens), Hq, Hkv, Sq, D, block_size, lens, dtype)
            cache = dict(k_cache, dtype=cache_dtype, **({"fill": "codes"} if cache_dtype == "int8" else {}))
            scale_shape = tuple(k_cache["shape"][:3]) if cache_dtype == "int8" else (Hkv,)
            low, high = (0.5 / 127, 1.5 / 127) if cache_dtype == "int8" else (0.25, 2.0)
            scales = tuple(tensor(name, scale_shape, "float32", "uniform", low=low, high=high)
                           for name in ("k_scale", "v_scale"))
            found.append(Case("check", f"check/paged_attn/{dtype}/Sq{Sq}-Hq{Hq}-Hkv{Hkv}-D{D}-bs{block_size}/ctx"
                                       f"{'_'.join(map(str, lens))}/{cache_dtype}", "paged_attn", dtype,
                              (q, cache, dict(cache, name="v_cache"), table, lens_) + scales, dict(causal=True),
                              seed=seed))
    return found


# packed batches: lengths 0, 1, 17, 97 (queries and keys differ; a sequence without keys, rows past the last)
# (lens_q, lens_k, Hq, Hkv, D, options, alibi, sinks)
_VARLEN = (((17, 0, 97, 1, 3), (33, 5, 97, 1, 0), 6, 2, 64, dict(causal=True), True, False),
           ((17, 0, 97, 1, 3), (33, 5, 97, 1, 0), 7, 1, 128, dict(window_size=(16, 8), softcap=5.0), False, False),
           ((97, 1), (97, 40), 6, 6, 40, dict(window_size=(8, 0), sink_tokens=4), False, False),
           ((17, 0, 97, 1, 3), (33, 5, 97, 1, 0), 6, 2, 64, dict(causal=True), False, True))


def _varlen(lens_q, lens_k, Hq, Hkv, D, dtype, *, alibi: bool, sinks: bool = False, backward: bool = False) -> tuple:
    total_q, total_k = sum(lens_q) + 2, sum(lens_k)
    offsets = [[0, *itertools.accumulate(lens)] for lens in (lens_q, lens_k)]
    inputs = [tensor("q", (total_q, Hq, D), dtype), tensor("k", (total_k, Hkv, D), dtype),
              tensor("v", (total_k, Hkv, D), dtype)]
    if backward:
        inputs.append(tensor("do", (total_q, Hq, D), dtype))
    inputs += [tensor("cu_seqlens_q", (len(lens_q) + 1,), "int32", "values", values=offsets[0]),
              tensor("cu_seqlens_k", (len(lens_k) + 1,), "int32", "values", values=offsets[1])]
    if alibi:
        inputs.append(tensor("alibi_slopes", (Hq,), "float32", "slopes"))
    if sinks:  # gpt-oss's sink logits (the kernels' out and lse rescaled; the backward given both)
        inputs.append(tensor("sinks", (Hq,), "float32", scale=2.0))
    return tuple(inputs)


# the backward's: GQA 3; causal with ALiBi, window with softcap, causal with sinks; the forward's lengths
_VARLEN_BACKWARD = (((17, 0, 97, 1, 3), (33, 5, 97, 1, 0), 6, 2, 64, dict(causal=True), True, False),
                    ((17, 0, 97, 1, 3), (33, 5, 97, 1, 0), 3, 1, 128, dict(window_size=(16, 8), softcap=5.0), False,
                     False),
                    ((17, 0, 97, 1, 3), (33, 5, 97, 1, 0), 6, 2, 64, dict(causal=True), False, True))


def varlen_cases(dtypes: tuple[str, ...], seed: int = 400, *, backward: bool = False) -> list[Case]:
    """flash_attn_varlen on packed batches (``_VARLEN``) against the float64 reference; ``backward``:
    flash_attn_varlen_backward (``_VARLEN_BACKWARD``; out and lse from the varlen forward in the
    same module)."""
    op = "flash_attn_varlen_backward" if backward else "flash_attn_varlen"
    found = []
    for dtype in dtypes:
        for lens_q, lens_k, Hq, Hkv, D, options, alibi, sinks in (_VARLEN_BACKWARD if backward else _VARLEN):
            seed += 1
            name = (f"check/{op}/{dtype}/Hq{Hq}-Hkv{Hkv}-D{D}/q{'_'.join(map(str, lens_q))}"
                    f"-k{'_'.join(map(str, lens_k))}/{_label(options)}{'-alibi' if alibi else ''}"
                    f"{'-sinks' if sinks else ''}")
            found.append(Case("check", name, op, dtype,
                              _varlen(lens_q, lens_k, Hq, Hkv, D, dtype, alibi=alibi, sinks=sinks, backward=backward),
                              dict(options) if backward else dict(options, return_lse=True), seed=seed,
                              scale=4.0 if backward else 1.0))
    return found


def varlen_bench_cases(gpu: bool, *, small: bool = False) -> list[Case]:
    """A packed batch of prompts of very different lengths, causal: fuel's varlen kernel timed
    beside PyTorch's SDPA run per prompt (FlashAttention's varlen reference)."""
    if small:
        lens, Hq, Hkv, D, dtype = (100, 17, 60), 4, 2, 64, "float32"
    elif gpu:
        lens, Hq, Hkv, D, dtype = (2048, 1024, 512, 1536, 256, 3072, 128, 768), 32, 8, 128, "bfloat16"
    else:
        lens, Hq, Hkv, D, dtype = (1536, 512, 96, 17, 1024, 1), 8, 2, 64, "float32"
    flops = sum(4.0 * D * Hq * s * (s + 1) / 2 for s in lens)
    inputs = _varlen(lens, lens, Hq, Hkv, D, dtype, alibi=False)
    name = f"bench/flash_attn_varlen/{dtype}/Hq{Hq}-Hkv{Hkv}-D{D}/B{len(lens)}-total{sum(lens)}-max{max(lens)}/causal"
    # the floor beside them only at the small shapes (the full ones' scores would take tens of GB)
    expect = ("floor", "torch") if small else ("torch",)
    return [Case("bench", name, "flash_attn_varlen", dtype, inputs, dict(causal=True), expect=expect,
                 torch=dict(kind="varlen", causal=True), timed=True, flops=flops, seed=450)]


def quantized_bench_cases(gpu: bool, *, small: bool = False) -> list[Case]:
    """Paged decode over 8-bit caches (fp8 e4m3fn / e5m2 with a scale per KV head, int8 with one per
    token and head) at the bench's first paged shape, timed in the same run as that shape's row
    (``bench_cases``; on CUDA a bfloat16 cache, on CPUs float32): decode reads every live K/V byte
    once, so an 8-bit cache should take about half a bfloat16 cache's time where the decode is bound
    by memory."""
    if small:
        B, Hq, Hkv, D, block_size, context, dtype = 2, 4, 2, 64, 16, 100, "float32"
    else:
        c = (cuda_suite() if gpu else default_suite())[1][0]
        B, Hq, Hkv, D, block_size, context, dtype = c.B, c.Hq, c.Hkv, c.D, c.block_size, c.context, c.dtype
    found = []
    for index, cache_dtype in enumerate(("float8_e4m3fn", "float8_e5m2", "int8")):
        q, k_cache, v_cache, table, lens = _paged(B, Hq, Hkv, 1, D, block_size, [context] * B, dtype)
        cache = dict(k_cache, dtype=cache_dtype, **({"fill": "codes"} if cache_dtype == "int8" else {}))
        per_token = cache_dtype == "int8"
        scale_shape = tuple(k_cache["shape"][:3]) if per_token else (Hkv,)
        low, high = (0.5 / 127, 1.5 / 127) if per_token else (0.25, 2.0)
        scales = tuple(tensor(name, scale_shape, "float32", "uniform", low=low, high=high)
                       for name in ("k_scale", "v_scale"))
        # K and V bytes of the live tokens, and int8's float32 scale per (token, head) of each
        read = kv_bytes(B, context, Hkv, D, itemsize=1) + (2.0 * B * context * Hkv * 4 if per_token else 0.0)
        found.append(Case("bench", f"bench/paged_attn/{dtype}-q/B{B}-Hq{Hq}-Hkv{Hkv}-D{D}-bs{block_size}/ctx{context}/"
                                   f"{cache_dtype}", "paged_attn", dtype,
                          (q, cache, dict(cache, name="v_cache"), table, lens) + scales, expect=("floor",),
                          timed=True, flops=4.0 * B * Hq * context * D, bytes_read=read, seed=470 + index))
    return found


def large_cases(dtype: str) -> list[Case]:
    """Shapes too large for the reference on the node's CPU: against the floor and PyTorch."""
    return [
        Case("check", f"check/large/flash_attn/{dtype}/B2-Hq16-Hkv4-S1024-D128/causal", "flash_attn", dtype,
             _dense(2, 16, 4, 1024, 1024, 128, dtype), dict(causal=True), expect=("floor", "torch"),
             torch=dict(kind="flash", causal=True), seed=201),
        Case("check", f"check/large/flash_attn_backward/{dtype}/B1-H8-S1024-D64/causal", "flash_attn_backward", dtype,
             _dense(1, 8, 8, 1024, 1024, 64, dtype, backward=True), dict(causal=True), expect=("floor", "torch"),
             torch=dict(kind="flash_backward", causal=True), scale=4, seed=202),
        Case("check", f"check/large/paged_attn/{dtype}/B16-Hq32-Hkv8-D128-bs16/ctx2048", "paged_attn", dtype,
             _paged(16, 32, 8, 1, 128, 16, [2048] * 16, dtype), expect=("floor", "torch"),
             torch=dict(kind="paged", context=2048), seed=203),
    ]


def bench_cases(flash: list[FlashCase], paged: list[PagedCase], *, floor_everywhere: bool) -> list[Case]:
    """The benchmark's shapes: kernels, floor and PyTorch timed on the same inputs. The backward
    is timed alone (given out and a finite lse), as PyTorch's autograd backward is."""
    found = []
    for index, c in enumerate(flash):
        scores = c.B * c.H * c.S * c.S
        floor = floor_everywhere or scores <= FLOOR_MAX_SCORES
        expect = ("floor",) if floor else ()
        if c.backward:
            found.append(Case("bench", f"bench/{c.name}", "flash_attn_backward", c.dtype,
                              _dense(c.B, c.H, c.H, c.S, c.S, c.D, c.dtype, backward=True, state=True),
                              dict(causal=c.causal), expect=expect, torch=dict(kind="flash_backward", causal=c.causal),
                              timed=True, scale=4, flops=c.flops, seed=300 + index))
        else:
            found.append(Case("bench", f"bench/{c.name}", "flash_attn", c.dtype,
                              _dense(c.B, c.H, c.H, c.S, c.S, c.D, c.dtype), dict(causal=c.causal),
                              expect=expect + ("torch",), torch=dict(kind="flash", causal=c.causal), timed=True,
                              flops=c.flops, seed=300 + index))
    for index, c in enumerate(paged):
        found.append(Case("bench", f"bench/{c.name}", "paged_attn", c.dtype,
                          _paged(c.B, c.Hq, c.Hkv, 1, c.D, c.block_size, [c.context] * c.B, c.dtype,
                                 capacity=c.capacity, num_blocks=c.B * (c.capacity // c.block_size)),
                          expect=("floor", "torch"), torch=dict(kind="paged", context=c.context), timed=True,
                          flops=c.flops, bytes_read=c.bytes_read, seed=400 + index))
    return found


def small_bench_shapes() -> tuple[list[FlashCase], list[PagedCase]]:
    """A quick bench stage (the CI test's): every kind of timed case at small shapes."""
    return ([FlashCase(1, 2, 128, 64, True), FlashCase(1, 2, 128, 64, False, backward=True)],
            [PagedCase(2, 4, 2, 64, 16, 100, 128)])


def cases(suite: str, target_kind: str, *, small: bool = False) -> list[Case | SlotCase]:
    """Every case of ``suite`` (smoke, check, bench, tune, all) for a cuda or llvm target; ``small``:
    the reduced matrix and bench shapes (in every dtype the target serves)."""
    if suite not in SUITES:
        raise ValueError(f"tvm_fuel bundle: suite must be one of {sorted(SUITES)}, got {suite!r}")
    stages = SUITES[suite]
    gpu = target_kind == "cuda"
    dtypes = ("float16", "bfloat16", "float32") if gpu else ("float32", "float16", "bfloat16")
    found = smoke_cases("float16" if gpu else "float32")
    if "check" in stages:
        found += check_cases(dtypes, small=small)
        found += varlen_cases(dtypes[:1] if small else dtypes)
        found += varlen_cases(dtypes[:1] if small else dtypes, 420, backward=True)
        if not small:
            found += large_cases("bfloat16" if gpu else "float32")
        found += slot_check_cases(gpu, small=small)
    if "bench" in stages:
        flash, paged = small_bench_shapes() if small else cuda_suite() if gpu else default_suite()
        found += bench_cases(flash, paged, floor_everywhere=gpu or small)
        found += slot_bench_cases(gpu, small=small)
        found += varlen_bench_cases(gpu, small=small)
        found += quantized_bench_cases(gpu, small=small)
    return found


def tune_buckets() -> list[tuple[str, dict]]:
    """(op, bucket) of the tune stage: the CUDA benchmark's shapes (paged: its full table)."""
    flash, paged = cuda_suite()
    buckets = [("flash_attn_backward" if c.backward else "flash_attn",
                dict(B=c.B, H=c.H, S=c.S, D=c.D, causal=int(c.causal), dtype=c.dtype)) for c in flash]
    return buckets + [("paged_attn", dict(B=c.B, Hq=c.Hq, Hkv=c.Hkv, D=c.D, block_size=c.block_size, ctx=c.capacity,
                                          dtype=c.dtype)) for c in paged if c.context == c.capacity]


__all__ = ["Case", "SlotCase", "tensor", "cases", "case_module", "tune_buckets", "SUITES"]
