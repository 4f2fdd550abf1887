"""Tuning logs travel between machines of one instruction set, whatever their core count (issue 15).

Records are matched by target key (instruction set and vector width), not by core count. The knobs
that set the task count are re-derived for the using machine: the backward's splits keep their
tasks per core, decode's KV heads per task keep their ratio to the hand-picked rule. A machine
without records builds silently with hand-picked knobs; a record of another key in this key's
folder warns once per file, however many builds read it. A record serves the lengths of its
shape bucket (powers of two: 1000 takes the record tuned at 1024), and ``logs`` says so.
"""

from __future__ import annotations

import json
import shutil
import warnings

import numpy as np
import pytest
from helpers import HOST, Runner, assert_close, randn

import tvm

import tvm_fuel
from tvm_fuel import reference as ref
from tvm_fuel.schedules import rule_for
from tvm_fuel.schedules.cpu.rules import FlashBackward
from tvm_fuel.tuning import TuningLogWarning, TuningRecords, shipped_logs, target_key
from tvm_fuel.tuning.buckets import TUNABLE_OPS, benchmark_buckets, bucket_module
from tvm_fuel.dispatch.log_database import RECORD_FILE, WORKLOAD_FILE
from tvm_fuel.schedules.workload import size_bucket
from tvm_fuel.tuning.kernels import workloads_of

pytestmark = pytest.mark.integration

AVX2 = "llvm-x86-avx2"
TUNED_CORES = 2  # the shipped AVX2 logs were tuned on a 2-core znver3 target
BACKWARD = dict(B=1, H=8, S=1024, D=64, causal=1)  # a benchmark bucket: 1 x 8 KV heads, 32 key tiles of 32
PAGED = dict(B=8, Hq=32, Hkv=8, D=128, block_size=16, ctx=4096)  # the benchmark's decode bucket


def _avx2(cores: int) -> tvm.target.Target:
    return tvm.target.Target({"kind": "llvm", "mcpu": "znver3", "num-cores": cores})


def _record_file(op: str) -> str:
    return str(shipped_logs() / AVX2 / op / RECORD_FILE)


def _lookup(op: str, bucket: dict, target: tvm.target.Target):
    (workload,) = workloads_of(bucket_module(op, bucket), target)
    return TuningRecords([shipped_logs()]).lookup(workload, target)


def _kernels(legalized: tvm.IRModule) -> list[tvm.tirx.PrimFunc]:
    return [f for f in legalized.functions.values()
            if isinstance(f, tvm.tirx.PrimFunc) and f.attrs is not None and "fuel.knobs" in f.attrs]


def test_shipped_logs_are_avx2_logs_of_two_cores():
    """What the expectations below rest on: every shipped AVX2 record was tuned on 2 cores."""
    for op in TUNABLE_OPS:
        for line in (shipped_logs() / AVX2 / op / RECORD_FILE).read_text().splitlines():
            target = json.loads(line)[1][2]
            assert target_key(tvm.target.Target(target)) == AVX2 and target["num-cores"] == TUNED_CORES


@pytest.mark.parametrize("cores", [2, 4, 16])
def test_shipped_avx2_logs_apply_on_any_core_count(cores):
    """Every benchmark shape finds its record on 2, 4 and 16 cores, without a warning; only the
    core knobs differ from the record as tuned, and they scale with the core count."""
    tuned_on, target = _avx2(TUNED_CORES), _avx2(cores)
    with warnings.catch_warnings():
        warnings.simplefilter("error", TuningLogWarning)
        for op in TUNABLE_OPS:
            for bucket in benchmark_buckets(op):
                found = _lookup(op, bucket, target)
                assert found is not None and found.source == _record_file(op), (op, bucket, cores, found)
                as_tuned = _lookup(op, bucket, tuned_on).knobs
                knobs = found.knobs
                moved = {name for name in knobs if knobs[name] != as_tuned[name]}
                assert moved <= {"splits", "kv_heads"}, (op, bucket, cores, as_tuned, knobs)
                if "splits" in knobs:  # tasks per core kept: splits x cores / 2, at most the space's 16
                    assert knobs["splits"] == min(16, as_tuned["splits"] * cores // TUNED_CORES), (bucket, knobs)


def test_core_knobs_scaled_for_sixteen_cores():
    """The values a 16-core AVX2 machine builds the benchmark's backward and decode with."""
    backward = _lookup("flash_attn_backward", BACKWARD, _avx2(TUNED_CORES)).knobs
    assert backward["splits"] == 4  # 32 tasks on 2 cores: 16 per core
    assert _lookup("flash_attn_backward", BACKWARD, _avx2(4)).knobs["splits"] == 8  # 16 per core again
    # 16 per core would be 32 splits: more than the space's 16 (2 key tiles of 32 per split)
    assert _lookup("flash_attn_backward", BACKWARD, _avx2(16)).knobs == {**backward, "splits": 16}
    decode = _lookup("paged_attn", PAGED, _avx2(TUNED_CORES)).knobs
    assert decode["kv_heads"] == 8  # whole page rows (the hand-picked value for 8 sequences on 2 cores)
    assert _lookup("paged_attn", PAGED, _avx2(4)).knobs == decode  # 8 sequences still fill 4 cores
    # on 16 cores the rule halves the heads per task (16 tasks for 16 cores); the record follows it
    assert rule_for("paged_attn", _avx2(16)).default_knobs(
        workloads_of(bucket_module("paged_attn", PAGED), _avx2(16))[0], _avx2(16))["kv_heads"] == 4
    assert _lookup("paged_attn", PAGED, _avx2(16)).knobs == {**decode, "kv_heads": 4}


def test_port_knobs_lands_on_the_space():
    """Scaling rounds to a candidate, never past the space; a record's hand-picked value outside
    the candidates (prefetch, from the KV heads per task) becomes this machine's hand-picked one."""
    small, big = _avx2(2), _avx2(256)
    (workload,) = workloads_of(bucket_module("paged_attn", dict(B=64, Hq=8, Hkv=8, D=80, block_size=16, ctx=64)),
                               small)
    rule = rule_for("paged_attn", small)
    theirs, ours = rule.default_knobs(workload, small), rule.default_knobs(workload, big)
    assert (theirs["kv_heads"], theirs["prefetch"]) == (8, 25) and (ours["kv_heads"], ours["prefetch"]) == (2, 64)
    ported = rule.port_knobs(workload, {"kv_heads": 8, "prefetch": 25, "block_k": 64}, small, big)
    assert ported == {"kv_heads": 2, "prefetch": 64, "block_k": 64}
    assert rule.knobs(workload, big, ported)["kv_heads"] == 2
    assert rule.port_knobs(workload, {"kv_heads": 4}, small, big) == {"kv_heads": 1}
    assert rule.port_knobs(workload, {"kv_heads": 2}, big, small) == {"kv_heads": 8}
    (backward,) = workloads_of(bucket_module("flash_attn_backward", dict(B=1, H=2, S=100, D=64)), small)
    rule = rule_for("flash_attn_backward", small)
    assert rule.knob_space(backward, big)["splits"] == (1, 2, 4)  # 4 key tiles of 32
    # 16 per core would be 16 splits on 16 cores (also the hand-picked value there): 4 at most
    assert rule.port_knobs(backward, {"splits": 2, "block_k": 32}, small, _avx2(16)) == {"splits": 4, "block_k": 32}
    assert rule.port_knobs(backward, {"splits": 2}, small, _avx2(4)) == {"splits": 4}
    assert rule.port_knobs(backward, {"splits": 4}, big, small) == {"splits": 1}
    assert rule.port_knobs(backward, {"splits": 4}, _avx2(6), _avx2(4)) == {"splits": 2}  # 2.67: nearest 2


def test_sixteen_core_build_uses_the_record_with_scaled_splits(monkeypatch):
    """The kernel is built from the record (its fuel.knobs names the log) with the scaled splits,
    and computes the reference's gradients."""
    built = []
    kernel = FlashBackward.kernel

    def spy(self, workload, knobs, **kwargs):
        built.append(dict(knobs))
        return kernel(self, workload, knobs, **kwargs)

    monkeypatch.setattr(FlashBackward, "kernel", spy)
    target = _avx2(16)
    mod = bucket_module("flash_attn_backward", BACKWARD)
    with warnings.catch_warnings():
        warnings.simplefilter("error", TuningLogWarning)
        legalized = tvm_fuel.transform.legalize(mod, target, kernels="tuned")
    (func,) = _kernels(legalized)
    assert str(func.attrs["fuel.knobs"]) == _record_file("flash_attn_backward")
    knobs = _lookup("flash_attn_backward", BACKWARD, target).knobs
    assert built == [rule_for("flash_attn_backward", target).knobs(
        workloads_of(mod, target)[0], target, knobs)] and built[0]["splits"] == 16
    if target_key(HOST) not in (AVX2, "llvm-x86-avx512"):
        pytest.skip(f"this CPU ({target_key(HOST)}) cannot run AVX2 code")
    monkeypatch.undo()
    rng = np.random.default_rng(15)
    shape = (BACKWARD["B"], BACKWARD["H"], BACKWARD["S"], BACKWARD["D"])
    q, k, v, do = (randn(rng, shape) for _ in range(4))
    out, lse = ref.flash_attn(q, k, v, causal=True, return_lse=True)
    got = Runner(mod, target, kernels="tuned")(q, k, v, do, out.astype("float32"), lse.astype("float32"))
    for name, g, want in zip("qkv", got, ref.flash_attn_backward(q, k, v, do, causal=True)):
        assert_close(g, want, "float32", scale=4, what=f"d{name} with splits 16")


@pytest.mark.parametrize("target", [
    {"kind": "llvm", "mtriple": "aarch64-linux-gnu", "mcpu": "cortex-a72", "num-cores": 4},
    {"kind": "llvm", "mcpu": "x86-64", "num-cores": 4},
], ids=["cortex-a72", "x86-64"])
def test_no_warning_on_a_machine_without_records(target):
    target = tvm.target.Target(target)
    assert not (shipped_logs() / target_key(target)).exists()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for op in TUNABLE_OPS:
            (bucket, *_) = benchmark_buckets(op)
            (func,) = _kernels(tvm_fuel.transform.legalize(bucket_module(op, bucket), target, kernels="tuned"))
            assert str(func.attrs["fuel.knobs"]) == "hand-picked"
    assert not [str(w.message) for w in caught if issubclass(w.category, TuningLogWarning)]


def test_four_core_avx2_build_is_silent_and_tuned():
    """The issue's machine: a 4-core AVX2 build of each benchmark shape uses the shipped record."""
    target = _avx2(4)
    with warnings.catch_warnings():
        warnings.simplefilter("error", TuningLogWarning)
        for op in TUNABLE_OPS:
            for bucket in benchmark_buckets(op):
                (func,) = _kernels(tvm_fuel.transform.legalize(bucket_module(op, bucket), target, kernels="tuned"))
                assert str(func.attrs["fuel.knobs"]) == _record_file(op), (op, bucket)


def test_foreign_record_in_this_keys_folder_warns_once_per_file(tmp_path):
    """A record of another key (here AVX-512) in the AVX2 folder is skipped; the others apply. The
    warning names the file once, across builds and core counts."""
    folder = tmp_path / AVX2 / "paged_attn"
    folder.mkdir(parents=True)
    for name in (WORKLOAD_FILE, RECORD_FILE):
        shutil.copy(shipped_logs() / AVX2 / "paged_attn" / name, folder / name)
    records = folder / RECORD_FILE
    lines = records.read_text().splitlines()
    index, (trace, seconds, target, args) = json.loads(lines[-1])
    lines[-1] = json.dumps([index, [trace, seconds, dict(target, mcpu="skylake-avx512"), args]])
    records.write_text("\n".join(lines) + "\n")
    mod = bucket_module("paged_attn", PAGED)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for cores in (4, 4, 16):
            (func,) = _kernels(tvm_fuel.transform.legalize(mod, _avx2(cores), kernels="tuned", database=tmp_path,
                                                       shipped_logs=False))
            assert str(func.attrs["fuel.knobs"]) == str(records)
    messages = [str(w.message) for w in caught if issubclass(w.category, TuningLogWarning)]
    assert len(messages) == 1 and str(records) in messages[0] and "llvm-x86-avx512" in messages[0], messages


def test_size_bucket_ladder():
    assert [size_bucket(n) for n in (0, 1, 2, 3, 4, 5, 8, 9, 513, 1000, 1024, 1025)] == \
        [0, 1, 2, 4, 4, 8, 8, 16, 1024, 1024, 1024, 2048]


@pytest.mark.parametrize("cores", [2, 4, 16])
def test_a_length_within_the_bucket_uses_the_record(cores):
    """Sequence length 1000 (and 513) builds with the record tuned at 1024, on any core count, with
    the knobs an exact 1024 call gets; 512 is another bucket's."""
    target = _avx2(cores)
    with warnings.catch_warnings():
        warnings.simplefilter("error", TuningLogWarning)
        for op in ("flash_attn", "flash_attn_backward"):
            exact = _lookup(op, BACKWARD, target)
            for length in (1000, 513):
                near = _lookup(op, {**BACKWARD, "S": length}, target)
                assert not near.exact and near.tuned.dim == exact.tuned.dim == {"B": 1, "Sq": 1024, "Sk": 1024}
                assert near.knobs == exact.knobs and near.source == exact.source == _record_file(op)
            other = _lookup(op, {**BACKWARD, "S": 512}, target)
            assert other is None or other.tuned.dim["Sq"] != 1024
        mod = bucket_module("flash_attn", {**BACKWARD, "S": 1000})
        (func,) = _kernels(tvm_fuel.transform.legalize(mod, target, kernels="tuned"))
    assert str(func.attrs["fuel.knobs"]) == _record_file("flash_attn") and str(func.attrs["fuel.match"]) == "bucket"
    assert str(func.attrs["fuel.tuned_at"]) == "B1 Sq1024 Sk1024"


def test_logs_command_names_the_bucket_that_served(capsys):
    from tvm_fuel.cli import main

    target = json.dumps({"kind": "llvm", "mcpu": "znver3", "num-cores": 4})
    assert main(["logs", "--target", target, "--op", "flash_attn", "--shapes", "B=1,H=8,S=1000,D=64,causal=1"]) == 0
    text = capsys.readouterr().out
    assert "bucket" in text and "tuned at B1 Sq1024 Sk1024 (same shape bucket)" in text, text
    assert _record_file("flash_attn") in text
