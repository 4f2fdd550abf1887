"""Hugging Face transformers models exported from PyTorch, as a user builds them:
``torch.export`` from token ids (and a left-padded attention mask) -> ``tvm_fuel.frontend.from_exported_program``
(TVM's importer, repaired, attention fused) -> ``tvm_fuel.compile``, against the model in PyTorch.

Small configs with random weights (nothing is downloaded): Llama (GQA), Mistral (a sliding window
shorter than the sequence), Qwen2, Qwen3 (q/k norms), Phi3 and GPT-2, each with
``attn_implementation`` "sdpa" and "eager"; Gemma2 (eager: softcap, sliding and full layers
alternating); Bloom (eager, ALiBi); Falcon-RW (sdpa and eager: ALiBi computed in bfloat16 and
added twice; also with 16 heads, whose slopes bfloat16 rounds); Falcon-7B (multi-query, rotary);
gpt-oss (eager: sinks, sliding and full layers alternating). Batch 1 from ids alone, and batch 2
whose second row is left-padded. Every attention layer must be one ``flash_attn`` with the
model's own options (causal; Mistral's window; Gemma2's softcap; ALiBi slopes; gpt-oss's sinks)
and no materialized [.., Sq, Sk] mask: at most B * Sk elements (the padding), or B * H * Sk for
an ALiBi whose positions come from the padding or whose bfloat16 values are no exact slopes (a
float bias over the keys, the padding folded in as -inf). The
logits must match PyTorch's on every row, padded ones included, on the kernels for every case and
on the floor for one case of each kind of fused attention (FLOOR_CASES). The cases are a pairwise
covering array of (model, attn_implementation, inputs) around the floor's: each model under each
of its implementations and from each of its inputs, each implementation from each input.
"""

from __future__ import annotations

import functools
from typing import Any, Callable, NamedTuple

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

import tvm  # noqa: E402
from tvm import relax  # noqa: E402

import tvm_fuel  # noqa: E402
import tvm_fuel.frontend  # noqa: E402
from covering import pairwise  # noqa: E402
from helpers import matmul_rules  # noqa: E402

# one worker: each case's export (~6 s) is cached per process (_export)
pytestmark = [pytest.mark.integration, pytest.mark.xdist_group("test_hf_models")]

SEQ, LAYERS, PADDED = 40, 2, 5  # the second row of the padded batch starts after 5 pad tokens
WINDOW, SOFTCAP = 16, 50.0  # Mistral's and Gemma2's sliding window (shorter than SEQ), Gemma2's softcap
T = transformers
COMMON = dict(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=LAYERS,
              num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256)
CAUSAL = dict(causal=True, window_size=(-1, -1), softcap=0.0, alibi=False, sinks=False)
SLIDING = dict(CAUSAL, window_size=(WINDOW - 1, -1))
FALCON = dict(vocab_size=128, hidden_size=64, num_hidden_layers=LAYERS, num_attention_heads=4,
              new_decoder_architecture=False)


class Model(NamedTuple):
    make: Callable[[str], Any]  # attn_implementation -> the model
    implementations: tuple[str, ...]
    options: Callable[[int], dict]  # layer -> its flash_attn's options
    inputs: tuple[str, ...] = ("ids", "padded")
    # the inputs under which the model's ALiBi is a float bias over the keys ([B, H, 1, Sk]), not slopes
    alibi_as_bias: tuple[str, ...] = ("padded",)


MODELS = {
    "llama": Model(lambda impl: T.LlamaForCausalLM(T.LlamaConfig(**COMMON, attn_implementation=impl)),
                   ("sdpa", "eager"), lambda layer: CAUSAL),
    "mistral": Model(lambda impl: T.MistralForCausalLM(T.MistralConfig(**COMMON, sliding_window=WINDOW,
                                                                       attn_implementation=impl)),
                     ("sdpa", "eager"), lambda layer: SLIDING),
    "qwen2": Model(lambda impl: T.Qwen2ForCausalLM(T.Qwen2Config(**COMMON, attn_implementation=impl)),
                   ("sdpa", "eager"), lambda layer: CAUSAL),
    "qwen3": Model(lambda impl: T.Qwen3ForCausalLM(T.Qwen3Config(**COMMON, head_dim=16, attn_implementation=impl)),
                   ("sdpa", "eager"), lambda layer: CAUSAL),  # q/k norms before the attention
    "phi3": Model(lambda impl: T.Phi3ForCausalLM(T.Phi3Config(**COMMON, pad_token_id=0, attn_implementation=impl)),
                  ("sdpa", "eager"), lambda layer: CAUSAL),
    # eager only in transformers; softcap tanh(s / 50) * 50, sliding and full layers alternating
    "gemma2": Model(lambda impl: T.Gemma2ForCausalLM(T.Gemma2Config(
        **COMMON, head_dim=16, sliding_window=WINDOW, attn_logit_softcapping=SOFTCAP, attn_implementation=impl)),
        ("eager",), lambda layer: dict(SLIDING if layer % 2 == 0 else CAUSAL, softcap=SOFTCAP)),
    # ALiBi written out (slope_h * key position, on the [B * H] view, before the finfo.min mask); with
    # padding its positions come from the mask (cumsum - 1), which fuel's relative distance equals only
    # for unbroken rows of real tokens: there it is a float bias over the keys
    "bloom": Model(lambda impl: T.BloomForCausalLM(T.BloomConfig(vocab_size=128, hidden_size=64, n_layer=LAYERS,
                                                                 n_head=4, attn_implementation=impl)),
                   ("eager",), lambda layer: dict(CAUSAL, alibi=True)),
    # Falcon-RW: ALiBi computed in bfloat16, added to the scores and again inside the mask (eager), or
    # inside SDPA's float mask where(mask < -1, finfo.min, alibi / sqrt(D)) (sdpa)
    "falcon": Model(lambda impl: T.FalconForCausalLM(T.FalconConfig(**FALCON, alibi=True, attn_implementation=impl)),
                    ("sdpa", "eager"), lambda layer: dict(CAUSAL, alibi=True)),
    # with 16 heads the slopes are no powers of two, which bfloat16 rounds: a float bias even from ids
    "falcon_16_heads": Model(lambda impl: T.FalconForCausalLM(T.FalconConfig(
        **dict(FALCON, num_attention_heads=16), alibi=True, multi_query=True, attn_implementation=impl)),
        ("eager",), lambda layer: dict(CAUSAL, alibi=True), ("ids",), ("ids",)),
    # Falcon-7B: rotary, one k and v head for all (multi-query), broadcast after k's transpose
    "falcon_mqa": Model(lambda impl: T.FalconForCausalLM(T.FalconConfig(**FALCON, multi_query=True,
                                                                         attn_implementation=impl)),
                        ("sdpa", "eager"), lambda layer: CAUSAL),
    # sinks: a column of per-head logits concatenated to the scores, the row max subtracted, dropped after the
    # softmax; sliding and full layers alternating. transformers' default MoE (histc, grouped_mm) does not import.
    "gpt_oss": Model(lambda impl: _with_sinks(T.GptOssForCausalLM(T.GptOssConfig(
        **dict(COMMON, intermediate_size=64), head_dim=16, num_local_experts=4, num_experts_per_tok=2,
        sliding_window=WINDOW, attn_implementation=impl, experts_implementation="batched_mm"))),
        ("eager",), lambda layer: dict(SLIDING if layer % 2 == 0 else CAUSAL, sinks=True)),
    "gpt2": Model(lambda impl: T.GPT2LMHeadModel(T.GPT2Config(vocab_size=128, n_embd=64, n_layer=LAYERS, n_head=4,
                                                             n_positions=128, attn_implementation=impl)),
                  ("sdpa", "eager"), lambda layer: CAUSAL),
}
KERNELS = {"decomposed": "fuel_flash_attn", "tuned": "fuel_flash_attn_kernel"}  # the PrimFunc each path builds
# The floor is checked per op against the reference at every option; through whole models it runs on one case
# of each kind of fused attention (mask from padding, window, softcap + window, ALiBi slopes, ALiBi as a bias,
# multi-query), the kernels on every case.
FLOOR_CASES = [("llama", "sdpa", "padded"), ("mistral", "eager", "ids"), ("gemma2", "eager", "padded"),
               ("bloom", "eager", "ids"), ("falcon_16_heads", "eager", "ids"), ("falcon_mqa", "sdpa", "padded"),
               ("gpt_oss", "eager", "padded")]


def _exports(model: str, impl: str, inputs: str) -> bool:
    """Whether the model has the implementation and the inputs; GPT-2's sdpa attention with a padded
    batch does not import (test_gpt2_sdpa_padded_names_the_cause)."""
    spec = MODELS[model]
    return (impl in spec.implementations and inputs in spec.inputs
            and (model, impl, inputs) != ("gpt2", "sdpa", "padded"))


# 23 cases of the product's 38 (~8 s a case to export, build and run)
CASES = pairwise(list(MODELS), ["sdpa", "eager"], ["ids", "padded"], valid=_exports, include=FLOOR_CASES)


def _case_param(case, *more):
    """A case as a parameter: a quick run (-m "not slow") takes the floor's cases, one of each kind of
    fused attention (~4 s a case and path to export and build); the whole suite takes every case."""
    return pytest.param(case, *more, marks=() if case in FLOOR_CASES else pytest.mark.slow)


def _with_sinks(model):
    """``model`` with its attention sinks drawn from N(0, 1): its own init (std 0.02) leaves them near 0."""
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.sinks.normal_()
    return model


def _case_id(case) -> str:
    return "-".join(case)


@functools.cache
def _export(name: str, impl: str, inputs: str) -> dict:
    """The case's model exported, imported and fused; its inputs and PyTorch's logits (once a case)."""
    model, ids, kwargs = _model_and_inputs(name, impl, inputs)
    batch = ids.shape[0]
    with torch.no_grad():
        program = torch.export.export(model, (ids,), kwargs)
        logits = model(ids, **kwargs).logits.numpy()
    mod = tvm_fuel.frontend.from_exported_program(program, keep_params_as_input=False)
    args = [ids.numpy()] + [t.numpy() for t in kwargs.values()]
    return dict(name=name, batch=batch, inputs=inputs, mod=mod, args=args, logits=logits)


@pytest.fixture(scope="module", params=[_case_param(case) for case in CASES], ids=_case_id)
def exported(request):
    return _export(*request.param)


def _model_and_inputs(name: str, impl: str, inputs: str):
    torch.manual_seed(0)
    model = MODELS[name].make(impl).eval()
    model.config.use_cache = False  # the cache is no module input: export without it
    batch = 1 if inputs == "ids" else 2
    ids = torch.randint(1, COMMON["vocab_size"], (batch, SEQ))
    kwargs = {}
    if inputs == "padded":
        mask = torch.ones(batch, SEQ, dtype=torch.int64)
        mask[1, :PADDED] = 0
        kwargs["attention_mask"] = mask
    return model, ids, kwargs


def _calls(mod: tvm.IRModule, name: str) -> list[relax.Call]:
    found = []
    relax.analysis.post_order_visit(mod["main"], lambda e: found.append(e) if isinstance(e, relax.Call)
                                    and isinstance(e.op, tvm.ir.Op) and e.op.name == name else None)
    return found


def test_every_layer_is_one_flash_attn_with_the_models_options(exported):
    calls = _calls(exported["mod"], "relax.fuel.flash_attn")
    assert len(calls) == LAYERS
    # no softmax over scores is left (gpt-oss's router keeps its softmax over [tokens, experts])
    assert not [call for call in _calls(exported["mod"], "relax.nn.softmax") if call.ty.ndim > 2]
    for layer, call in enumerate(calls):  # in program order: layer by layer
        expected = MODELS[exported["name"]].options(layer)
        assert bool(call.attrs["causal"]) == expected["causal"]
        assert tuple(int(w) for w in call.attrs["window_size"]) == expected["window_size"]
        assert float(call.attrs["softcap"]) == expected["softcap"]
        assert bool(call.attrs["has_sinks"]) == expected["sinks"]
        alibi_bias = expected["alibi"] and exported["inputs"] in MODELS[exported["name"]].alibi_as_bias
        assert bool(call.attrs["has_alibi_slopes"]) == (expected["alibi"] and not alibi_bias)
        has_mask = bool(call.attrs["has_attn_mask"])
        # from ids alone the mask is all options (but a bias that is no fuel ALiBi)
        assert has_mask == (exported["inputs"] == "padded" or alibi_bias)
        if has_mask:
            mask = call.args[3 + bool(call.attrs["has_alibi_slopes"])]  # present arguments only
            heads = int(call.args[0].ty.shape[1])
            dims = [int(d) for d in mask.ty.shape]
            if alibi_bias:  # the padding folded in as -inf: no [.., Sq, Sk] tensor, per head
                assert str(mask.ty.dtype) == "float32" and dims[-2] == 1
                assert int(np.prod(dims)) <= exported["batch"] * heads * SEQ
            else:
                assert str(mask.ty.dtype) == "bool" and int(np.prod(dims)) <= exported["batch"] * SEQ


def test_an_exported_llamas_linear_layers_read_their_weights_in_panels():
    """Every matmul of an exported Llama (its weights constants: q, k, v, o, the MLP and the output
    layer) is nn.Linear's over a weight laid out at build, scheduled by PackedMatmul (issue 57)."""
    rules = matmul_rules(_export("llama", "sdpa", "ids")["mod"], tvm_fuel.host_target())
    assert len(rules) >= 3, rules  # (one function per shape: q and o share one, k and v, gate and up)
    assert all("NT_matmul_panels" in name and rule == "PackedMatmul" for name, rule in rules.items()), rules


@pytest.mark.parametrize("case, kernels", [_case_param(case, kernels) for case in CASES for kernels in KERNELS
                                            if kernels == "tuned" or case in FLOOR_CASES],
                         ids=lambda v: _case_id(v) if isinstance(v, tuple) else v)
def test_logits_match_torch_on_every_row(case, kernels):
    exported = _export(*case)
    ex = tvm_fuel.compile(exported["mod"], tvm_fuel.host_target(), kernels=kernels)
    for path, name in KERNELS.items():  # the path asked for built the attention, not the other one
        assert ex.mod.implements_function(name, True) == (path == kernels), name
    vm = relax.VirtualMachine(ex, tvm.cpu())
    out = vm["main"](*[tvm.runtime.tensor(a) for a in exported["args"]])
    logits = out[0].numpy()  # the model's output tuple: (logits,)
    expected = exported["logits"]
    scale = float(np.abs(expected).max())
    worst = np.abs(logits - expected).max(axis=-1) / scale  # per (batch, position) row
    assert worst.max() <= 1e-4, f"row {np.unravel_index(worst.argmax(), worst.shape)}: {worst.max():.2e}"


def test_gpt2_sdpa_padded_names_the_cause():
    """PyTorch's run_decompositions (inside TVM's importer) cannot view SDPA's output here: the
    frontend says so, and what to export instead."""
    model, ids, kwargs = _model_and_inputs("gpt2", "sdpa", "padded")
    program = torch.export.export(model, (ids,), kwargs)
    with pytest.raises(ValueError, match="run_decompositions.*attn_implementation='eager'"):
        tvm_fuel.frontend.from_exported_program(program)


@pytest.fixture(scope="module", params=[("sdpa", "ids"), ("eager", "padded")], ids=_case_id)
def llama_training(request):
    """A Llama under a loss (mean of the squared logits of the real tokens, padding left out as
    transformers' labels=-100 does), exported with its weights as inputs, fused, and its adjoint
    over every weight; PyTorch's loss and gradients. (A padded row's fully masked queries are
    uniform in PyTorch's forward, and fuel's; PyTorch still differentiates that uniform softmax,
    fuel takes it as constant: a loss that reads those rows gets other q and k gradients.)"""
    from tvm.relax.frontend import detach_params

    impl, inputs = request.param
    model, ids, kwargs = _model_and_inputs("llama", impl, inputs)
    real = kwargs.get("attention_mask", torch.ones_like(ids))

    class WithLoss(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.model = model

        def forward(self, ids, real):
            return (self.model(ids, attention_mask=real).logits ** 2 * real[..., None]).mean()

    with_loss = WithLoss()
    program = torch.export.export(with_loss, (ids, real))
    mod, params = detach_params(tvm_fuel.frontend.from_exported_program(
        program, keep_params_as_input=True, unwrap_unit_return_tuple=True))
    weights = mod["main"].params[int(mod["main"].attrs["num_input"]):]
    adjoint = tvm_fuel.transform.gradient(mod, "main", require_grads=weights)
    loss = with_loss(ids, real)
    loss.backward()
    targets = {spec.arg.name: spec.target for spec in program.graph_signature.input_specs}
    named = dict(with_loss.named_parameters())
    torch_grads = [named[targets[w.name]].grad.numpy() for w in weights]
    return dict(inputs=[ids.numpy(), real.numpy()], adjoint=adjoint, params=params["main"], loss=loss.item(),
                grads=torch_grads)


@pytest.mark.parametrize("kernels", KERNELS)
def test_llama_trains_through_flash_attn_backward(llama_training, kernels):
    """One training step: the adjoint runs flash_attn_backward per layer (no softmax differentiated),
    and its loss and gradients match PyTorch's."""
    adjoint = tvm.IRModule({"main_adjoint": llama_training["adjoint"]["main_adjoint"]})
    assert len(_calls(tvm.IRModule({"main": adjoint["main_adjoint"]}), "relax.fuel.flash_attn_backward")) == LAYERS
    assert not _calls(tvm.IRModule({"main": adjoint["main_adjoint"]}), "relax.nn.softmax")
    ex = tvm_fuel.compile(adjoint, tvm_fuel.host_target(), kernels=kernels)
    vm = relax.VirtualMachine(ex, tvm.cpu())
    loss, grads = vm["main_adjoint"](*[tvm.runtime.tensor(x) for x in llama_training["inputs"]],
                                     *llama_training["params"])
    np.testing.assert_allclose(float(loss.numpy()), llama_training["loss"], rtol=1e-5)
    for ours, theirs in zip(grads, llama_training["grads"], strict=True):
        np.testing.assert_allclose(ours.numpy(), theirs, rtol=1e-4, atol=1e-5 * float(np.abs(theirs).max()))
