"""``bench --gemm``: each row builds nn.Linear's matmul as tvm_fuel does and checks it against the
float64 product before timing it (awkward shapes: M 0, 1, 17; K 1, 577; N 1, 7); the command writes
gemm.json beside nothing else. The timings themselves are the benchmark's, never a test's."""

from __future__ import annotations

import json

import pytest

from tvm_fuel import cli
from tvm_fuel.bench import gemm

pytestmark = pytest.mark.integration

ROW_KEYS = {"M", "K", "N", "weight", "seconds", "gflops", "weight_gbps", "vs_torch", "max_rel_error"}


@pytest.mark.parametrize("M,K,N,weight", [(17, 577, 7, "parameter"), (1, 40, 1, "constant"), (0, 1, 7, "parameter"),
                                          (4, 64, 33, "constant")])
def test_a_row_computes_the_product_and_times_both(M, K, N, weight):
    row = gemm.gemm_row(M, K, N, weight)
    assert set(row) == ROW_KEYS and (row["M"], row["K"], row["N"], row["weight"]) == (M, K, N, weight)
    assert row["max_rel_error"] < 1e-5
    assert all(row["seconds"][name] > 0 for name in ("tvm_fuel", "torch"))
    assert row["vs_torch"] == pytest.approx(row["seconds"]["tvm_fuel"] / row["seconds"]["torch"])


def test_the_report_relates_each_row_to_the_probes():
    peaks = {"fma_gflops": 100.0, "read_gbps": 10.0}
    report = gemm.gemm_rows([(2, 16, 8)], ("parameter",), peaks=peaks)
    (row,) = report["rows"]
    assert report["peaks"] is peaks and report["threads"] >= 1
    assert row["fma_fraction"] == pytest.approx(row["gflops"]["tvm_fuel"] / 100.0)
    assert row["read_fraction"] == pytest.approx(row["weight_gbps"]["tvm_fuel"] / 10.0)


def test_a_weight_kind_it_does_not_know_is_refused():
    with pytest.raises(ValueError, match="bench gemm: weight must be one of"):
        gemm.gemm_row(1, 8, 8, "tied")


def test_the_command_writes_gemm_json_only(tmp_path, monkeypatch, capsys):
    report = {"what": "stub", "threads": 2, "peaks": {"fma_gflops": 1.0, "read_gbps": 1.0}, "rows": []}
    monkeypatch.setattr(gemm, "gemm_rows", lambda: report)
    out = tmp_path / "results"
    assert cli.main(["bench", "--gemm", "--out", str(out)]) == 0
    assert json.loads((out / "gemm.json").read_text()) == report
    assert sorted(path.name for path in out.iterdir() if not path.name.startswith(".")) == ["gemm.json"]
    assert "[GEMM] stub" in capsys.readouterr().out


def test_gemm_replaces_the_kernel_rows_and_excludes_the_other_replacements(capsys):
    with pytest.raises(SystemExit):
        cli.main(["bench", "--gemm", "--tvm-cache"])
    assert "not allowed with argument" in capsys.readouterr().err
