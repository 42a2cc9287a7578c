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
