"""Hugging Face transformers models exported from PyTorch, as a user builds them:
``torch.export`` from token ids (and a left-padded attention mask) -> ``tvm_fuel.frontend.from_exported_program``
(TVM's importer, repaired, attention fused) -> ``tvm_fuel.compile``, against the model in PyTorch.

Small configs with random weights (nothing is downloaded): Llama (GQA), Mistral (a sliding window
shorter than the sequence) and Qwen2, each with ``attn_implementation`` "sdpa" and "eager"; batch 1
from ids alone, and batch 2 whose second row is left-padded. Every attention layer must be one
``flash_attn`` with the model's own options (causal; Mistral's window) and no materialized
[.., Sq, Sk] mask (at most B * Sk elements: the padding), and the logits must match PyTorch's on
every row, padded ones included, on the floor and on the kernels.
"""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

import tvm  # noqa: E402
from tvm import relax  # noqa: E402

import tvm_fuel  # noqa: E402
import tvm_fuel.frontend  # noqa: E402

pytestmark = pytest.mark.integration

SEQ, LAYERS, PADDED = 40, 2, 5  # the second row of the padded batch starts after 5 pad tokens
WINDOW = 16  # Mistral's sliding window: shorter than SEQ, so it masks
COMMON = dict(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=LAYERS,
              num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256)
MODELS = {
    "llama": (lambda impl: transformers.LlamaForCausalLM(transformers.LlamaConfig(**COMMON, attn_implementation=impl)),
              dict(causal=True, window_size=(-1, -1))),
    "mistral": (lambda impl: transformers.MistralForCausalLM(transformers.MistralConfig(
        **COMMON, sliding_window=WINDOW, attn_implementation=impl)), dict(causal=True, window_size=(WINDOW - 1, -1))),
    "qwen2": (lambda impl: transformers.Qwen2ForCausalLM(transformers.Qwen2Config(**COMMON, attn_implementation=impl)),
              dict(causal=True, window_size=(-1, -1))),
}
CASES = [(model, impl, inputs) for model in MODELS for impl in ("sdpa", "eager") for inputs in ("ids", "padded")]
KERNELS = {"decomposed": "fuel_flash_attn", "tuned": "fuel_flash_attn_kernel"}  # the PrimFunc each path builds


def _case_id(case) -> str:
    return "-".join(case)


@pytest.fixture(scope="module", params=CASES, ids=_case_id)
def exported(request):
    """The case's model exported, imported and fused; its inputs and PyTorch's logits."""
    name, impl, inputs = request.param
    torch.manual_seed(0)
    model = MODELS[name][0](impl).eval()
    model.config.use_cache = False  # the cache is no module input: export without it
    batch = 1 if inputs == "ids" else 2
    ids = torch.randint(0, COMMON["vocab_size"], (batch, SEQ))
    kwargs = {}
    if inputs == "padded":
        mask = torch.ones(batch, SEQ, dtype=torch.int64)
        mask[1, :PADDED] = 0
        kwargs["attention_mask"] = mask
    with torch.no_grad():
        program = torch.export.export(model, (ids,), kwargs)
        logits = model(ids, **kwargs).logits.numpy()
    mod = tvm_fuel.frontend.from_exported_program(program, keep_params_as_input=False)
    args = [ids.numpy()] + [t.numpy() for t in kwargs.values()]
    return dict(name=name, batch=batch, inputs=inputs, mod=mod, args=args, logits=logits)


def _calls(mod: tvm.IRModule, name: str) -> list[relax.Call]:
    found = []
    relax.analysis.post_order_visit(mod["main"], lambda e: found.append(e) if isinstance(e, relax.Call)
                                    and isinstance(e.op, tvm.ir.Op) and e.op.name == name else None)
    return found


def test_every_layer_is_one_flash_attn_with_the_models_options(exported):
    calls = _calls(exported["mod"], "relax.fuel.flash_attn")
    assert len(calls) == LAYERS
    assert not _calls(exported["mod"], "relax.nn.softmax")
    expected = MODELS[exported["name"]][1]
    for call in calls:
        assert bool(call.attrs["causal"]) == expected["causal"]
        assert tuple(int(w) for w in call.attrs["window_size"]) == expected["window_size"]
        has_mask = bool(call.attrs["has_attn_mask"])
        assert has_mask == (exported["inputs"] == "padded")  # from ids alone the mask is all options
        if has_mask:
            mask = call.args[3]
            assert str(mask.ty.dtype) == "bool"
            assert int(np.prod([int(d) for d in mask.ty.shape])) <= exported["batch"] * SEQ


@pytest.mark.parametrize("kernels", KERNELS)
def test_logits_match_torch_on_every_row(exported, kernels):
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
