"""The README's main command: ``python -m tvm_fuel demo``."""

from __future__ import annotations

import pytest

from tvm_fuel.cli import main

from helpers import has_torch

pytestmark = [pytest.mark.integration, pytest.mark.slow]


# the demo's checks and the most each may be: a bound loosened in the demo fails here
DEMO_BOUNDS = {
    **{name: 1e-4 for name in ("flash_attn out", "flash_attn lse", "flash_attn_backward dq",
                               "flash_attn_backward dk", "flash_attn_backward dv", "flash_attn_backward_q",
                               "flash_attn_backward_k", "flash_attn_backward_v", "paged_attn", "softmax_backward",
                               "paged decode vs no-cache full sequence", "tuned vs floor logits",
                               "Hessian-vector product vs reference")},
    "final loss / first loss": 0.5, "steps where the loss rose": 0.0, "decoder: final loss / first loss": 0.1,
    "penalized loss fell": 0.0,
}
TORCH_CHECKS = {"greedy tokens differing from PyTorch's", "full-sequence logits vs PyTorch",
                "loss curve vs PyTorch autograd + Adam", "decoder loss curve vs PyTorch autograd + Adam",
                "fused vs PyTorch math double backward"}


def test_demo_runs_the_ops_the_decoder_training_and_second_order(capsys, monkeypatch):
    """``demo`` exits 0, and every check it made is one we expect, within its bound, with its number."""
    from tvm_fuel import demo

    made = []
    real = demo.run_demo
    monkeypatch.setattr(demo, "run_demo", lambda **kw: made.extend(real(**kw)) or made)
    assert main(["demo"]) == 0
    printed = capsys.readouterr().out
    checks = {c.name: c for c in made}
    assert len(checks) == len(made), "a check name printed twice"
    expected = set(DEMO_BOUNDS) | {"fused vs expanded penalized loss"} | (TORCH_CHECKS if has_torch() else set())
    assert set(checks) == expected
    for name, bound in DEMO_BOUNDS.items():
        assert checks[name].tolerance <= bound and checks[name].error <= checks[name].tolerance, checks[name]
    for name in checks.keys() & TORCH_CHECKS:
        assert checks[name].ok, checks[name]
    if has_torch():
        assert checks["greedy tokens differing from PyTorch's"].error == 0
    assert f"all {len(made)} checks hold" in printed


def test_demo_fails_on_a_check_out_of_tolerance(capsys, monkeypatch):
    from tvm_fuel import demo

    monkeypatch.setattr(demo, "run_demo", lambda **kw: [demo.Check("made up", 2e-4, 1e-4), demo.Check("fine", 0, 1)])
    assert main(["demo", "--quick"]) == 1
    assert "MISMATCH in made up" in capsys.readouterr().err


def test_tune_then_logs_report_the_record(tmp_path, capsys):
    shape = "B=2,Hq=4,Hkv=2,D=64,block_size=16,ctx=64"
    assert main(["tune", "--op", "paged_attn", "--shapes", shape, "--trials", "2", "--trials-per-iter", "2",
                 "--work-dir", str(tmp_path)]) == 0
    printed = capsys.readouterr().out
    assert "trials 0/2" in printed and "GB/s" in printed and "hand-picked" in printed
    assert main(["logs", "--database", str(tmp_path), "--no-shipped", "--op", "paged_attn", "--shapes", shape,
                 "B=4,Hq=4,Hkv=2,D=64,block_size=16,ctx=64"]) == 0
    printed = capsys.readouterr().out
    assert printed.count(" record ") == 1 and printed.count(" fallback ") == 1 and str(tmp_path) in printed


def test_logs_reports_a_module_file(tmp_path, capsys):
    from tvm_fuel.tuning.buckets import bucket_module

    path = tmp_path / "model.py"
    path.write_text(bucket_module("flash_attn", dict(B=1, H=2, S=17, D=64)).script())
    assert main(["logs", "--no-shipped", "--module", str(path)]) == 0
    printed = capsys.readouterr().out
    assert "fuel_flash_attn_kernel" in printed and " fallback " in printed


def test_tune_model_misuse_is_refused_by_name(tmp_path, capsys):
    lonely = tmp_path / "lonely.py"
    lonely.write_text("X = 1\n")
    work = ["--work-dir", str(tmp_path / "logs")]
    assert main(["tune", "--at", "prefill:batch=1", *work]) == 2
    assert main(["tune", "--model", str(lonely), *work]) == 2
    assert main(["tune", "--model", "no_such_module_anywhere", *work]) == 2
    assert main(["tune", "--model", "tvm_fuel.models.llama", "--op", "flash_attn", *work]) == 2
    err = capsys.readouterr().err
    assert "--at goes with --model" in err and "has no tuning_module()" in err
    assert "neither a file nor an importable module" in err and "give no --op or --shapes" in err
    with pytest.raises(SystemExit):
        main(["tune", "--model", "tvm_fuel.models.llama", "--at", "prefill:batch=zero", *work])
    assert "is not FUNC:NAME=VALUE" in capsys.readouterr().err


def test_cuda_commands_without_a_device_say_so(capsys):
    from tvm_fuel.target import has_gpu

    if has_gpu():
        pytest.skip("this machine has a CUDA device")
    assert main(["bench", "--target", "cuda"]) == 2
    assert main(["gpucheck"]) == 2
    assert main(["tune", "--op", "paged_attn", "--target", '{"kind": "cuda", "arch": "sm_90"}', "--trials", "1",
                 "--work-dir", "unused"]) == 2
    err = capsys.readouterr().err
    assert "no CUDA device" in err and "needs a CUDA device" in err
