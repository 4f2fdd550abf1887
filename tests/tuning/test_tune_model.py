"""Whole-model tuning and its records at build: shape-point specialization (static copy vs the
symbolic function vs numpy), a module with a fuel op and a matmul tuned for a few trials (both
kinds of records, applied and listed), points that meet no record left alone, and the demo
decoder's shipped records."""

from __future__ import annotations

import json
import statistics

import numpy as np
import pytest
import tvm
from tvm import relax

import tvm_fuel
from tvm_fuel import op, reference
from tvm_fuel.dispatch.records import MODEL_FOLDER, POINTS_FILE, target_key
from tvm_fuel.dispatch.log_database import LogDatabase
from tvm_fuel.models import llama, peers
from tvm_fuel.transform.specialize import ShapePoint, specialize
from tvm_fuel.tuning.model import function_tasks, tune_model
from tvm_fuel.tuning.report import TIR_FUNCTION, tuning_report

from helpers import HOST

# its module-scoped fixtures tune or build bundles: one worker runs the module, so they are built once
pytestmark = [pytest.mark.integration, pytest.mark.slow, pytest.mark.xdist_group("test_model_tuning")]

B, H, S, D, N = 1, 2, 17, 32, 48


class _Symbols:
    """A VM instrument collecting the symbols of the functions a call ran."""

    def __init__(self):
        self.names = set()

    def __call__(self, func, symbol, before_run, ret_value, *args):
        self.names.add(symbol)
        return 0


def _attention_then_projection() -> tvm.IRModule:
    """silu(flash_attn(q, k, v) @ w): a fuel op and a matmul with an epilogue."""
    ty = relax.TensorType
    q, k, v = (relax.Var(name, ty((B, H, S, D), "float32")) for name in "qkv")
    w = relax.Var("w", ty((D, N), "float32"))
    bb = relax.BlockBuilder()
    with bb.function("main", [q, k, v, w]):
        with bb.dataflow():
            out = bb.emit(op.flash_attn(q, k, v, causal=True))
            y = bb.emit_output(relax.op.nn.silu(relax.op.matmul(out, w)))
        bb.emit_func_output(y)
    return bb.get()


@pytest.fixture(scope="module")
def tuned(tmp_path_factory):
    """The module tuned for 2 trials per task into a fresh log root (one verification round)."""
    root = tmp_path_factory.mktemp("model_logs")
    lines = []
    result = tune_model(_attention_then_projection(), HOST, trials=2, trials_per_iter=2, verify_top=1,
                        verify_rounds=1, work_dir=root, log=lines.append)
    return root, result, lines


def test_tuning_covers_both_kinds_of_task(tuned):
    root, result, lines = tuned
    assert [r.workload.op for r in result.kernels] == ["flash_attn"]
    assert [f.name for f in result.functions] == ["fused_matmul_silu"]
    function = result.functions[0]
    assert function.trials == 2
    # the verification: the default schedule's record, then the search's best (another schedule)
    default, searched = LogDatabase(root / target_key(HOST) / MODEL_FOLDER, warn=False).get_all_tuning_records()
    assert str(default.trace) != str(searched.trace)
    medians = [statistics.median(float(s) for s in r.run_secs) for r in (default, searched)]
    assert function.default_s == medians[0] and function.best_s == min(medians)
    # the search's best is the fastest mean of the candidates its log holds
    (task,) = function_tasks(_attention_then_projection(), HOST).values()
    search = LogDatabase(root / "logs" / MODEL_FOLDER, warn=False)
    runs = [[float(s) for s in r.run_secs] for r in search.get_top_k(search.commit_workload(task), 100)]
    assert len(runs) == 2 and function.searched_best_s == min(sum(r) / len(r) for r in runs)
    assert (f"function fused_matmul_silu: default {function.default_s * 1e3:.3f} ms, best "
            f"{function.best_s * 1e3:.3f} ms") in "\n".join(lines)  # the verification line says the same


def test_build_applies_both_kinds_and_the_report_lists_them(tuned):
    root, _, _ = tuned
    mod = _attention_then_projection()
    rows = tuning_report(mod, HOST, database=root, shipped_logs=False, functions=True)
    by_kind = {row["workload"] == TIR_FUNCTION: row for row in rows}
    assert str(root) in by_kind[False]["knobs"] and "flash_attn" in by_kind[False]["knobs"]
    assert str(root / target_key(HOST) / MODEL_FOLDER) in by_kind[True]["knobs"]
    untuned = tuning_report(mod, HOST, shipped_logs=False, functions=True)
    assert {row["knobs"] for row in untuned} == {"hand-picked", "default schedule"}

    vm = relax.VirtualMachine(tvm_fuel.compile(mod, HOST, kernels="tuned", database=root), tvm.cpu())
    rng = np.random.default_rng(0)
    q, k, v = (rng.standard_normal((B, H, S, D)).astype("float32") for _ in range(3))
    w = rng.standard_normal((D, N)).astype("float32")
    got = vm["main"](*map(tvm.runtime.tensor, (q, k, v, w))).numpy()
    y = reference.flash_attn(q, k, v, causal=True) @ w
    np.testing.assert_allclose(got, y / (1 + np.exp(-y)), rtol=1e-4, atol=1e-5)


def test_tasks_leave_out_kernels_reshapes_and_index_readers():
    mod, points = llama.tuning_module()
    names = list(function_tasks(specialize(mod, points), HOST))
    assert names and all("fuel" not in n and "take" not in n and "offset" not in n for n in names)
    assert any(n.startswith("fused_NT_matmul") and "__at_batch1_seqlen1000" in n for n in names)
    assert not any(n.startswith("reshape") for n in names)
    assert function_tasks(mod, HOST) == {}  # the symbolic model alone has nothing to measure


@pytest.fixture(scope="module")
def decoder():
    config = llama.LlamaConfig(num_layers=1, hidden_size=64, intermediate_size=96, num_heads=3, num_kv_heads=1,
                               head_dim=16, vocab_size=50)
    mod, names = llama.serving_module(config, num_blocks=8)
    return config, mod, names, llama.init_weights(config, names, seed=1)


def test_specialized_copy_runs_at_its_point_and_the_symbolic_one_elsewhere(decoder):
    config, mod, names, weights = decoder
    at = specialize(mod, [ShapePoint("forward", {"batch": 1, "seq_len": 17}), ShapePoint("forward", {"batch": 2})])
    assert {"forward__generic", "forward__at_batch1_seqlen17", "forward__at_batch2"} <= {
        g.name_hint for g in at.get_global_vars()}
    vm = relax.VirtualMachine(tvm_fuel.compile(at, HOST, kernels="tuned", shipped_logs=False), tvm.cpu())
    params = [tvm.runtime.tensor(weights[n]) for n in names]
    rng = np.random.default_rng(2)
    for shape, copy in (((1, 17), "__at_batch1_seqlen17"), ((2, 5), "__at_batch2"), ((1, 5), None)):
        tokens = rng.integers(0, config.vocab_size, shape).astype("int32")
        symbols = _Symbols()
        vm.set_instrument(symbols)
        got = vm["forward"](tvm.runtime.tensor(tokens), *params).numpy()
        vm.set_instrument(None)
        np.testing.assert_allclose(got, peers.llama_logits(config, weights, tokens), rtol=1e-4, atol=1e-4)
        ran = {name for name in symbols.names if "__at_" in name}
        if copy is None:
            assert not ran, f"{shape} matches no point but ran {sorted(ran)}"
        else:
            assert ran and all(copy in name for name in ran), (shape, sorted(ran))


def test_bad_points_are_refused_or_skipped(decoder):
    _, mod, _, _ = decoder
    with pytest.raises(ValueError, match="dim batch of forward must be a positive int"):
        ShapePoint("forward", {"batch": 0})
    same = specialize(mod, [ShapePoint("no_such_function", {"batch": 1}), ShapePoint("forward", {"width": 3})])
    assert {g.name_hint for g in same.get_global_vars()} == {g.name_hint for g in mod.get_global_vars()}


def test_points_that_meet_no_record_leave_a_model_as_it_is(tuned, decoder, tmp_path):
    root, _, _ = tuned
    _, mod, _, _ = decoder
    folder = root / target_key(HOST) / MODEL_FOLDER
    # the tuned log root's records are of another module: the decoder's point finds none
    (folder / POINTS_FILE).write_text(json.dumps([{"function": "forward", "dims": {"batch": 1, "seq_len": 17}}]))
    try:
        rows = tuning_report(mod, HOST, database=root, shipped_logs=False, functions=True)
    finally:
        (folder / POINTS_FILE).unlink()
    assert rows and not any("__at_" in row["function"] for row in rows)
    assert all(row["knobs"] in ("hand-picked", "default schedule") for row in rows)


AVX512 = {"kind": "llvm", "mcpu": "skylake-avx512", "num-cores": 2}


def test_the_demo_decoder_build_takes_its_shipped_records():
    """The shipped logs were tuned for the demo's decoder on an AVX-512 machine: a build for that
    target key specializes prefill and decode at the demo's shapes and takes the records (lowering
    only, so any machine checks it); a decoder of other sizes finds none and stays as it is."""
    mod, _ = llama.serving_module(llama.LlamaConfig())
    rows = tuning_report(mod, AVX512, functions=True)
    functions = [r for r in rows if r["workload"] == TIR_FUNCTION]
    recorded = [r for r in functions if r["match"] == "exact"]
    assert any("__at_batch1_seqlen1000" in r["function"] for r in recorded)  # prefill's copy
    assert any("__at_batch4" in r["function"] for r in recorded)  # decode's
    assert all("tuning_logs" in r["knobs"] and "llvm-x86-avx512/model" in r["knobs"] for r in recorded)
    assert any("Sq1000" in r["workload"] and r["match"] == "exact" for r in rows if r["workload"] != TIR_FUNCTION)
    other, _ = llama.serving_module(llama.LlamaConfig(hidden_size=128, intermediate_size=384, num_heads=4,
                                                      num_kv_heads=2, head_dim=16))
    rows = [r for r in tuning_report(other, AVX512, functions=True) if r["workload"] == TIR_FUNCTION]
    assert rows and not any(r["match"] or "__at_" in r["function"] for r in rows)  # not even specialized
