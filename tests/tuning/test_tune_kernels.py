"""MetaSchedule tuning of the kernels' knobs, and the logs applied at build.

A few trials of each required kernel are tuned into a temporary log root; the build then uses
those records (the report says so) and its outputs match the numpy reference and the floor.
Random points of every design space are checked the same way, since any of them may be the one
a record selects. Logs that are corrupt, or tuned for another target, fall back with a warning, once per file.
"""

from __future__ import annotations

import json
import random
import re
import shutil
import warnings

import numpy as np
import pytest
from helpers import HOST, PinnedKnobs, Runner, assert_close, assert_pinned, build, randn

import tvm
from tvm import relax, s_tir

import tvm_fuel
from tvm_fuel import reference as ref
from tvm_fuel.dispatch import tuned_legalize_map
from tvm_fuel.schedules import rule_for
from tvm_fuel.tuning import TuningLogWarning, shipped_logs, target_key, tune, tuning_report
from tvm_fuel.tuning.buckets import TUNABLE_OPS, benchmark_buckets, bucket_module, parse_bucket
from tvm_fuel.dispatch.records import knobs_of, replay
from tvm_fuel.dispatch.log_database import RECORD_FILE, WORKLOAD_FILE, LogDatabase
from tvm_fuel.tuning.space import ValidKnobs, design_space, workload_module
from tvm_fuel.tuning.kernels import workloads_of

# its module-scoped fixtures tune or build bundles: one worker runs the module, so they are built once
pytestmark = [pytest.mark.integration, pytest.mark.slow, pytest.mark.xdist_group("test_tuning")]

# awkward shapes: GQA groups 3 and 7, head dims 40 and 64, lengths 17 and 97
BUCKETS = {
    "paged_attn": dict(B=3, Hq=7, Hkv=1, D=40, block_size=16, ctx=97),
    "flash_attn_backward": dict(B=1, Hq=6, Hkv=2, Sq=17, Sk=97, D=40, causal=1),
    "flash_attn": dict(B=2, Hq=3, Hkv=1, Sq=17, Sk=97, D=64, window=(7, 2)),
}


def _inputs(op: str, rng) -> dict:
    """Valid inputs for BUCKETS[op] (a paged table of distinct live blocks, ragged context lengths)."""
    b = BUCKETS[op]
    if op == "paged_attn":
        max_blocks = -(-b["ctx"] // b["block_size"])
        cache = (b["B"] * max_blocks, b["block_size"], b["Hkv"], b["D"])
        return dict(q=randn(rng, (b["B"], b["Hq"], 1, b["D"])), k_cache=randn(rng, cache), v_cache=randn(rng, cache),
                    block_table=rng.permutation(cache[0]).reshape(b["B"], max_blocks).astype("int32"),
                    context_lens=np.array([1, 17, 97], "int32"))
    q = randn(rng, (b["B"], b["Hq"], b["Sq"], b["D"]))
    k, v = (randn(rng, (b["B"], b["Hkv"], b["Sk"], b["D"])) for _ in range(2))
    if op == "flash_attn":
        return dict(q=q, k=k, v=v)
    out, lse = ref.flash_attn(q, k, v, causal=True, return_lse=True)
    return dict(q=q, k=k, v=v, do=randn(rng, q.shape), out=out.astype("float32"), lse=lse.astype("float32"))


def _expected(op: str, inputs: dict) -> list[np.ndarray]:
    a = list(inputs.values())
    if op == "paged_attn":
        return [ref.paged_attn(*a)]
    if op == "flash_attn":
        return [ref.flash_attn(*a, window_size=(7, 2))]
    return list(ref.flash_attn_backward(*a[:4], causal=True))


@pytest.fixture(scope="module")
def tuned_root(tmp_path_factory):
    """A log root with a few trials of each required kernel (and flash forward) at BUCKETS: one
    ``tune`` over the three workloads, as a model's are tuned (one builder and runner for all)."""
    root = tmp_path_factory.mktemp("logs")
    workloads = [w for op, bucket in BUCKETS.items() for w in workloads_of(bucket_module(op, bucket), HOST)]
    results = {}
    for result in tune(workloads, HOST, trials=4, trials_per_iter=4, work_dir=root, log=lambda line: None):
        results.setdefault(result.workload.op, []).append(result)
    assert set(results) == set(BUCKETS)
    return root, results


def _records(folder) -> list:
    """The records of a log folder in file order (``logs.replay``: None for a failed measurement)."""
    return [replay(raw) for raw in LogDatabase(folder, warn=False).get_all_tuning_records()]


def _is_default(op: str, knobs: dict) -> bool:
    (workload,) = workloads_of(bucket_module(op, BUCKETS[op]), HOST)
    defaults = rule_for(op, HOST).default_knobs(workload, HOST)
    return all(defaults.get(name) == value for name, value in knobs.items())


def _check_verification(result, records: list, op: str) -> list:
    """``result`` reports its latest side-by-side verification's records exactly: the hand-picked
    point's median, and the fastest median with its knobs, among other points than the hand-picked."""
    session = max(r.verified for r in records if r is not None)
    verified = [r for r in records if r is not None and r.verified == session]
    hand = [r.seconds for r in verified if _is_default(op, r.knobs)]
    assert len(hand) == 1 and result.hand_picked_s == hand[0]
    assert any(not _is_default(op, r.knobs) for r in verified), "only the hand-picked point was verified"
    fastest = min(verified, key=lambda r: r.seconds)
    assert (result.best_s, result.best_knobs) == (fastest.seconds, fastest.knobs)
    return verified


@pytest.mark.parametrize("op", list(BUCKETS))
def test_tuned_records_build_and_match_the_floor(tuned_root, op):
    root, results = tuned_root
    (result,) = results[op]
    assert result.trials == 4
    records = _records(root / target_key(HOST) / op)
    verified = _check_verification(result, records, op)
    # the hand-picked point measured alone, the 4 trials, then the verification
    assert len(records) == 1 + 4 + len(verified) and records[0] is not None and _is_default(op, records[0].knobs)
    assert len({tuple(sorted(r.knobs.items())) for r in records if r is not None}) >= 3  # distinct points
    mod = bucket_module(op, BUCKETS[op])
    (row,) = tuning_report(mod, HOST, database=root, shipped_logs=False)
    assert row["knobs"] == str(root / target_key(HOST) / op / RECORD_FILE)
    inputs = _inputs(op, np.random.default_rng(0))
    tuned = Runner(mod, HOST, kernels="tuned", database=root, shipped_logs=False)(*inputs.values())
    floor = Runner(mod, HOST, kernels="decomposed")(*inputs.values())
    for got, low, want in zip(tuned, floor, _expected(op, inputs)):
        assert_close(got, want, "float32", scale=4, what=f"{op} tuned vs reference")
        assert_close(got, low.astype(np.float64), "float32", scale=4, what=f"{op} tuned vs floor")


@pytest.mark.parametrize("op", list(BUCKETS))
def test_build_uses_the_latest_side_by_side_verification(tuned_root, op):
    """compile takes the best knobs of the verification round, not a lucky single measurement."""
    from tvm_fuel.tuning import TuningRecords

    root, results = tuned_root
    (result,) = results[op]
    (workload,) = workloads_of(bucket_module(op, BUCKETS[op]), HOST)
    found = TuningRecords([root]).lookup(workload, HOST)
    assert found.exact and found.knobs == result.best_knobs and found.source.endswith(RECORD_FILE)


def test_tuning_resumes_from_its_database(tuned_root, tmp_path):
    root = tmp_path / "logs"
    shutil.copytree(tuned_root[0], root)  # the fixture's log stays as it was for the other tests
    folder = root / target_key(HOST) / "paged_attn"
    before = _records(folder)
    lines = []
    (again,) = tune(bucket_module("paged_attn", BUCKETS["paged_attn"]), HOST, trials=2, trials_per_iter=2,
                    work_dir=root, log=lines.append)
    after = _records(folder)
    # the previous records count from the first line on (a fresh log says "no valid trial yet")
    best_before = min(r.seconds for r in before if r is not None)
    assert re.search(rf": trials 0/2, best {best_before * 1e3:.2f} ms \(", lines[0]), (lines[0], best_before)
    # resumed: the hand-picked point is not measured alone again; 2 trials, then a new verification
    assert after[:len(before)] == before
    verified = _check_verification(again, after, "paged_attn")
    assert len(after) == len(before) + 2 + len(verified)
    assert re.search(rf"hand-picked {again.hand_picked_s * 1e3:.2f} ms, best {again.best_s * 1e3:.2f} ms", lines[-1])


@pytest.mark.parametrize("op", list(BUCKETS))
def test_random_points_of_the_space_are_correct(op):
    """Every valid knob combination must compute the same thing: a record may select any."""
    mod = bucket_module(op, BUCKETS[op])
    (workload,) = workloads_of(mod, HOST)
    task = workload_module(workload, HOST)
    rule = rule_for(workload.op, HOST)
    inputs = _inputs(op, np.random.default_rng(1))
    expected = _expected(op, inputs)
    rng, checked = random.Random(op), 0
    while checked < 4:
        sch = s_tir.Schedule(task, seed=rng.randrange(1, 2**30))
        design_space(sch)
        _, knobs = knobs_of(sch.mod)
        if rule.check_knobs(workload, {**rule.default_knobs(workload, HOST), **knobs}):
            continue
        for got, want in zip(_run_with_knobs(mod, knobs, inputs), expected):
            assert_close(got, want, "float32", scale=4, what=f"{op} at {knobs}")
        checked += 1


def _run_with_knobs(mod, knobs: dict, inputs: dict) -> list[np.ndarray]:
    with HOST, warnings.catch_warnings():
        warnings.simplefilter("error", TuningLogWarning)  # pinned knobs outside the space would not apply
        legalized = relax.transform.LegalizeOps(tuned_legalize_map(HOST, PinnedKnobs(**knobs)))(mod)
    kernels = [f for f in legalized.functions.values() if f.attrs is not None and "fuel.knob_values" in f.attrs]
    assert kernels, "the floor ran, not a kernel"
    for kernel in kernels:
        assert_pinned(kernel, **knobs)
    vm = relax.VirtualMachine(tvm.compile(legalized, target=HOST), tvm.cpu())
    outputs = vm["main"](*[tvm.runtime.tensor(a) for a in inputs.values()])
    return [t.numpy() for t in ([outputs] if isinstance(outputs, tvm.runtime.Tensor) else outputs)]


def _shipped_paged_knobs() -> dict:
    """The knobs the shipped log gives the benchmark's decode shape (if this CPU class has one)."""
    from tvm_fuel.tuning import TuningRecords

    (bench,) = benchmark_buckets("paged_attn")
    (workload,) = workloads_of(bucket_module("paged_attn", bench), HOST)
    found = TuningRecords([shipped_logs()]).lookup(workload, HOST)
    return dict(found.knobs) if found else dict(value_tokens=4, block_k=256, kv_heads=4)


@pytest.mark.parametrize("dtype", ["float32", "float16"])
@pytest.mark.parametrize("knobs", [dict(value_tokens=4, prefetch=4, block_k=16, lanes=8, kv_heads=2),
                                   dict(value_tokens=2, prefetch=16, block_k=32, lanes=4, kv_heads=4),
                                   dict(value_tokens=1, block_k=64, kv_heads=1), "shipped"])
def test_streaming_decode_knobs(knobs, dtype):
    """Decode's own knobs (KV heads per task, tokens per value pass, prefetch distance) with
    4 KV heads of dim 40, ragged lengths 1, 17, 97 and a 16-token page."""
    knobs = _shipped_paged_knobs() if knobs == "shipped" else knobs
    knobs = {k: v for k, v in knobs.items() if k != "kv_heads" or 4 % v == 0}
    rng = np.random.default_rng(3)
    B, Hq, Hkv, D, max_blocks = 3, 8, 4, 40, 7
    cache = (B * max_blocks, 16, Hkv, D)
    inputs = dict(q=randn(rng, (B, Hq, 1, D), dtype), k_cache=randn(rng, cache, dtype),
                  v_cache=randn(rng, cache, dtype),
                  block_table=rng.permutation(cache[0]).reshape(B, max_blocks).astype("int32"),
                  context_lens=np.array([1, 17, 97], "int32"))
    params = {name: (a.shape, str(a.dtype)) for name, a in inputs.items()}
    mod = build(lambda **a: tvm_fuel.op.paged_attn(**a), params)
    (out,) = _run_with_knobs(mod, knobs, inputs)
    assert_close(out, ref.paged_attn(*inputs.values()), dtype, what=str(knobs))


@pytest.mark.parametrize("knobs", [dict(value_tokens=1, block_k=16, kv_heads=2, lanes=8),
                                   dict(value_tokens=2, block_k=32, kv_heads=4, prefetch=4),
                                   dict(value_tokens=4, block_k=128, kv_heads=1)])
def test_int8_streaming_decode_knobs(knobs):
    """int8 decode's knobs with head dim 64, its q.k and P.V in integers on AVX2 (pairs of tokens
    per vpmaddwd: one token per value pass, a pair in odd passes): within the integer roundings
    (~1e-4 here) of the dequantized reference (a value pass of no pair left every row 0)."""
    rng = np.random.default_rng(5)
    B, Hq, Hkv, D, max_blocks = 3, 8, 4, 64, 7
    cache = (B * max_blocks, 16, Hkv, D)
    (k_cache, k_scale), (v_cache, v_scale) = (ref.quantize_int8(randn(rng, cache)) for _ in range(2))
    inputs = dict(q=randn(rng, (B, Hq, 1, D)), k_cache=k_cache, v_cache=v_cache,
                  block_table=rng.permutation(cache[0]).reshape(B, max_blocks).astype("int32"),
                  context_lens=np.array([1, 17, 97], "int32"), k_scale=k_scale, v_scale=v_scale)
    params = {name: (a.shape, str(a.dtype)) for name, a in inputs.items()}
    mod = build(lambda **a: tvm_fuel.op.paged_attn(**a), params)
    (out,) = _run_with_knobs(mod, knobs, inputs)
    want = ref.paged_attn(*list(inputs.values())[:5], k_scale=k_scale, v_scale=v_scale)
    np.testing.assert_allclose(out, want, atol=1e-3, rtol=1e-3, err_msg=str(knobs))


def test_invalid_points_are_rejected_before_measuring():
    """Only the knob under test moves off the hand-picked point (the others are pinned to it,
    so the verdict does not hang on what else was sampled: lanes 16 on AVX-512 rule out other
    combinations) and the rejection names the reason."""
    (workload,) = workloads_of(bucket_module("flash_attn", BUCKETS["flash_attn"]), HOST)
    rule = rule_for(workload.op, HOST)
    pinned = rule.default_knobs(workload, HOST)
    for micro_rows, valid in ((8, False), (4, True)):  # 52 rows are no whole number of 8-row tiles
        sch = s_tir.Schedule(workload_module(workload, HOST))
        design_space(sch, fixed={**pinned, "block_q": 52, "micro_rows": micro_rows})
        _, knobs = knobs_of(sch.mod)
        assert (knobs["block_q"], knobs["micro_rows"]) == (52, micro_rows)
        assert ValidKnobs(HOST).apply(sch) is valid
        if not valid:
            with pytest.raises(ValueError, match="micro_rows"):
                rule.knobs(workload, HOST, knobs)


def _copy_log(source, root, key: str, op: str):
    folder = root / key / op
    folder.mkdir(parents=True)
    for name in (WORKLOAD_FILE, RECORD_FILE):
        shutil.copy(source / target_key(HOST) / op / name, folder / name)
    return folder


@pytest.mark.parametrize("damage", ["garbage", "truncated", "wrong-shape"])
def test_corrupt_log_warns_and_falls_back(tuned_root, tmp_path, damage):
    folder = _copy_log(tuned_root[0], tmp_path, target_key(HOST), "paged_attn")
    records = folder / RECORD_FILE
    text = records.read_text()
    records.write_text({"garbage": "not json at all\n", "truncated": text[: len(text) // 2],
                        "wrong-shape": '{"a": 1}\n'}[damage])
    mod = bucket_module("paged_attn", BUCKETS["paged_attn"])
    with pytest.warns(TuningLogWarning, match=str(records)):
        (row,) = tuning_report(mod, HOST, database=tmp_path, shipped_logs=False)
    # a log cut mid-line keeps the records of its whole lines (tests/tuning/test_bad_records.py)
    assert row["knobs"] == (str(records) if damage == "truncated" else "hand-picked")
    inputs = _inputs("paged_attn", np.random.default_rng(2))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", TuningLogWarning)
        (out,) = Runner(mod, HOST, kernels="tuned", database=tmp_path, shipped_logs=False)(*inputs.values())
    assert_close(out, _expected("paged_attn", inputs)[0], "float32")


def test_record_of_another_target_is_never_applied(tuned_root, tmp_path):
    """A record whose own target has another key is ignored even in this target's folder."""
    folder = _copy_log(tuned_root[0], tmp_path, target_key(HOST), "paged_attn")
    records = folder / RECORD_FILE
    lines = []
    other_cpu = "znver3" if target_key(HOST) == "llvm-x86-avx512" else "skylake-avx512"
    other = tvm.target.Target({"kind": "llvm", "mcpu": other_cpu, "num-cores": 2})
    for line in records.read_text().splitlines():
        index, (trace, seconds, target, args) = json.loads(line)
        target = dict({k: v for k, v in target.items() if k != "mattr"}, mcpu=other_cpu)  # HOST's mattr would stay
        lines.append(json.dumps([index, [trace, seconds, target, args]]))
    records.write_text("\n".join(lines) + "\n")
    mod = bucket_module("paged_attn", BUCKETS["paged_attn"])
    with pytest.warns(TuningLogWarning, match=target_key(other)):
        (row,) = tuning_report(mod, HOST, database=tmp_path, shipped_logs=False)
    assert row["knobs"] == "hand-picked"
    # and a log folder of another key is not even read
    (row,) = tuning_report(mod, other, database=tuned_root[0], shipped_logs=False)
    assert row["knobs"] == "hand-picked"


def test_record_tuned_for_another_core_count_applies(tuned_root):
    """Records are keyed by instruction set, not core count: the knobs that set the task count
    are re-derived for the machine (tests/tuning/test_record_portability.py)."""
    wider = tvm.target.Target(dict(HOST.export(), **{"num-cores": 64}))
    mod = bucket_module("paged_attn", BUCKETS["paged_attn"])
    with warnings.catch_warnings():
        warnings.simplefilter("error", TuningLogWarning)
        (row,) = tuning_report(mod, wider, database=tuned_root[0], shipped_logs=False)
    assert row["knobs"] == str(tuned_root[0] / target_key(HOST) / "paged_attn" / RECORD_FILE)


def test_shipped_logs_hit_the_benchmark_shapes():
    key = target_key(HOST)
    if not (shipped_logs() / key).is_dir():
        pytest.skip(f"no logs shipped for this CPU class ({key}); shipped: "
                    f"{sorted(p.name for p in shipped_logs().iterdir() if p.is_dir())}")
    with warnings.catch_warnings():
        warnings.simplefilter("error", TuningLogWarning)  # shipped logs must load cleanly
        for op in TUNABLE_OPS:
            for bucket in benchmark_buckets(op):
                rows = tuning_report(bucket_module(op, bucket), HOST)
                assert [r["knobs"] for r in rows] == [str(shipped_logs() / key / op / RECORD_FILE)], (op, bucket)


def test_decode_record_does_not_fit_a_multi_query_call(tuned_root):
    """A decode record (streaming knobs) found for a call whose Sq is symbolic warns and falls back."""
    b = BUCKETS["paged_attn"]
    Sq = tvm.tirx.Var("Sq", "int64")
    cache = (b["B"] * 7, b["block_size"], b["Hkv"], b["D"])
    params = {"q": ((b["B"], b["Hq"], Sq, b["D"]), "float32"), "k_cache": (cache, "float32"),
              "v_cache": (cache, "float32"), "block_table": ((b["B"], 7), "int32"),
              "context_lens": ((b["B"],), "int32")}
    mod = build(lambda **a: tvm_fuel.op.paged_attn(**a), params)
    with pytest.warns(TuningLogWarning, match="not in this kernel's space"):
        (row,) = tuning_report(mod, HOST, database=tuned_root[0], shipped_logs=False)
    assert row["knobs"] == "hand-picked"


def test_symbolic_call_uses_the_largest_matching_bucket(tuned_root):
    """A decode module with a symbolic batch and table width takes the knobs tuned for its heads."""
    root, results = tuned_root
    b = BUCKETS["paged_attn"]
    B, W = tvm.tirx.Var("B", "int64"), tvm.tirx.Var("W", "int64")
    cache = (b["B"] * 7, b["block_size"], b["Hkv"], b["D"])
    params = {"q": ((B, b["Hq"], 1, b["D"]), "float32"), "k_cache": (cache, "float32"),
              "v_cache": (cache, "float32"), "block_table": ((B, W), "int32"), "context_lens": ((B,), "int32")}
    mod = build(lambda **a: tvm_fuel.op.paged_attn(**a), params)
    (row,) = tuning_report(mod, HOST, database=root, shipped_logs=False)
    assert row["knobs"].endswith(RECORD_FILE)


def test_bucket_parsing_names_the_bad_item():
    assert parse_bucket("B=1,H=8,S=1024,D=64,causal=1") == dict(B=1, H=8, S=1024, D=64, causal=1)
    with pytest.raises(ValueError, match="Sq"):
        parse_bucket("Sq=ten")
    with pytest.raises(ValueError, match="unknown shape key 'heads'"):
        parse_bucket("heads=8")
    with pytest.raises(ValueError, match="rpc_tracker and rpc_key"):
        tune(bucket_module("flash_attn", BUCKETS["flash_attn"]), HOST, rpc_tracker="127.0.0.1:9190")


# tune's input handling: each mistake is one line naming the argument, exit 2 (no traceback)

def _tune_error(capsys, *argv) -> str:
    from tvm_fuel.cli import main

    capsys.readouterr()
    assert main(["tune", *argv]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("python -m tvm_fuel tune: error: "), err
    return err[0]


MODEL = ("from tvm_fuel.tuning.buckets import bucket_module\n"
         "MOD = bucket_module('flash_attn', dict(B=1, H=2, S=17, D=64))\n")


@pytest.mark.parametrize("body, expected", [
    ("def tuning_module():\n    return 42\n", "must return an IRModule or (IRModule, shape points), got int 42"),
    ("def tuning_module():\n    return MOD, ['prefill:batch=1']\n",
     "shape point 0 must be a tvm_fuel.ShapePoint, got str 'prefill:batch=1'"),
    ("def tuning_module():\n    return MOD, 5\n", "shape points must be a list of tvm_fuel.ShapePoint, got int 5"),
    ("def tuning_module():\n    raise RuntimeError('no weights here')\n",
     "tuning_module() raised RuntimeError: no weights here"),
    ("def tuning_module(:\n", "loading it failed: SyntaxError: "),
])
def test_a_bad_model_file_is_one_line_naming_model(tmp_path, capsys, body, expected):
    path = tmp_path / "model.py"
    path.write_text(MODEL + body)
    line = _tune_error(capsys, "--model", str(path), "--work-dir", str(tmp_path / "logs"))
    assert f"--model {path}: " in line and expected in line, line
    if "SyntaxError" in expected:
        assert f"{path}, line 3)" in line, line  # where the mistake is
    assert not (tmp_path / "logs").exists()  # nothing tuned, nothing written


@pytest.mark.parametrize("content", [b"this is not TVMScript {\n", b"\xff\xfe\x00garbage"])
def test_a_garbage_module_file_names_model(tmp_path, capsys, content):
    path = tmp_path / "model.tvm"
    path.write_bytes(content)
    line = _tune_error(capsys, "--model", str(path), "--work-dir", str(tmp_path / "logs"))
    assert f"--model {path} is not a Relax module in TVMScript" in line and "--module" not in line, line


def test_a_dim_given_twice_in_a_point_is_refused(tmp_path, capsys):
    from tvm_fuel.cli import main

    with pytest.raises(SystemExit) as done:  # (--op: where the point were taken, the run stops before tuning)
        main(["tune", "--model", "tvm_fuel.models.llama", "--at", "main:n=1,n=2", "--op", "flash_attn",
              "--work-dir", str(tmp_path)])
    assert done.value.code == 2
    assert "argument --at: 'main:n=1,n=2' gives the dim n twice" in capsys.readouterr().err


def _results(tmp_path, bucket) -> str:
    """A bundle results file whose tune stage holds ``bucket`` (the checks before it pass)."""
    path = tmp_path / "results.json"
    path.write_text(json.dumps({"bundle_id": "b1", "bundle": {"arch": "sm_90"}, "device": {"arch": "sm_90"},
                                "stages": {"tune": {"buckets": [bucket]}}}))
    return str(path)


@pytest.mark.parametrize("change, expected", [
    (dict(target=None), "tune bucket 0 lacks 'target'"),
    (dict(points=None), "tune bucket 0 lacks 'points'"),
    (dict(target="no_such_kind"), "tune bucket 0 has no valid target and workload key"),
    (dict(points=[{"function": "point_0", "hand_picked": True, "status": "pass", "seconds": 1e-3}]),
     "point 0 is not {function: str, knobs: object"),
    (dict(points=[{"function": "point_0", "knobs": {}, "hand_picked": True, "status": "pass"}]),
     "point 0 passed without a positive time"),
    (dict(verified={"status": "pass", "seconds": {"point_7": [1e-3]}}), "a verification whose seconds are not"),
])
def test_import_of_a_results_file_lacking_fields_is_one_line(tmp_path, capsys, change, expected):
    (workload,) = workloads_of(bucket_module("flash_attn", BUCKETS["flash_attn"]), HOST)
    bucket = {"target": {"kind": "cuda", "arch": "sm_90"}, "workload": workload.key,
              "points": [{"function": "point_0", "knobs": {}, "hand_picked": True, "status": "pass", "seconds": 1e-3}]}
    bucket.update(change)
    bucket = {key: value for key, value in bucket.items() if value is not None}
    line = _tune_error(capsys, "--import", _results(tmp_path, bucket), "--work-dir", str(tmp_path / "logs"))
    assert expected in line and str(tmp_path / "results.json") in line, line
    assert not (tmp_path / "logs").exists()  # refused before any record is written
