"""``bench --models``' decode rows: ``models.llama``'s weights reach transformers' LlamaForCausalLM
by name, every one of them, and the printed row reads its report."""

from __future__ import annotations

import pytest

from tvm_fuel.bench import models as bench_models
from tvm_fuel.models import llama

pytestmark = pytest.mark.unit


def test_every_llama_weight_has_its_transformers_name():
    transformers = pytest.importorskip("transformers")
    config = llama.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=48, num_layers=2, num_heads=4,
                               num_kv_heads=2, head_dim=8)
    names = [name for name, _ in llama.LlamaDecoder(config).named_parameters()]
    hf = transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, tie_word_embeddings=False))
    assert sorted(map(bench_models.hf_name, names)) == sorted(hf.state_dict())


def test_decode_rows_print(capsys):
    row = {"seq": 512, "batch": 4, "new_tokens": 128, "prefill_seconds": {"tvm_fuel": 0.5, "eager": 0.6},
           "decode_step_seconds": {"tvm_fuel": 0.004, "eager": 0.005}, "decode_vs_eager": 0.8, "tokens_equal": 512,
           "tokens": 512}
    bench_models.print_rows({"model": "m", "threads": 2, "rows": [], "decode_rows": [row]})
    out = capsys.readouterr().out
    assert "decode step tvm_fuel   4.00 ms   eager   5.00 ms   0.80x eager's time" in out and "512 of 512" in out
