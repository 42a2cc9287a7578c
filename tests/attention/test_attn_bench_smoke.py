"""tools/bench_attention.py runs end to end in its CPU smoke mode."""

import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "tools"))
import bench_attention  # noqa: E402


def test_cpu_tiny_smoke(capsys):
    assert bench_attention.main(["--device", "cpu", "--tiny"]) == 0
    rows = [line for line in capsys.readouterr().out.splitlines() if line.startswith("| 48 | bitfield |")]
    assert [r.split("|")[3].strip() for r in rows] == ["fwd", "fwd+bwd"]
    assert all(float(r.split("|")[4]) > 0 for r in rows)


@pytest.mark.skipif(torch.cuda.is_available(), reason="with a GPU the CUDA run is the benchmark itself, not a unit test")
def test_cuda_request_without_gpu_exits_clearly(capsys):
    assert bench_attention.main([]) == 2
    assert "no CUDA GPU" in capsys.readouterr().err


def test_gpu_check_kernels_checks_both_backward_launches_and_can_fail(monkeypatch):
    """tools/gpu_check.py's kernel check (the first step of a GPU session) on CPU ranks through the
    interpreter at tiny sizes: the forward and both backward launches against the fp32 reference."""
    import gpu_check

    import mimo.attention.function as function

    report = gpu_check.check_kernels([64], 2, 32, 1, ("bitfield",), device="cpu")
    row = report["rows"][0]
    assert report["ok"] and row["ok"] and row["bitfield_fwd_bwd_ms"] > 0, report
    for name in ("dq", "dk", "dv"):
        assert row[f"{name}_max_err"] == row[f"fused_{name}_max_err"] < 5e-2  # the same programs, interpreted
    # A backward that computes something else is caught (delta off by one: dQ and dK wrong).
    real = function._delta
    monkeypatch.setattr(function, "_delta", lambda *a: real(*a) + 1.0)
    bad = gpu_check.check_kernels([64], 2, 32, 1, ("bitfield",), device="cpu")
    assert not bad["ok"] and bad["rows"][0]["dq_max_err"] > 5e-2
