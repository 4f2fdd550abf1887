"""The README's main command: ``python -m tvm_fuel demo``."""

from __future__ import annotations

from tvm_fuel.cli import main


def test_demo_runs_every_op_and_agrees(capsys):
    assert main(["demo"]) == 0
    printed = capsys.readouterr().out
    for name in ("flash_attn out", "flash_attn lse", "flash_attn_backward dq", "flash_attn_backward_q",
                 "flash_attn_backward_k", "flash_attn_backward_v", "paged_attn", "softmax_backward"):
        assert name in printed
    assert "MISMATCH" not in printed and "all 10 outputs agree" in printed
