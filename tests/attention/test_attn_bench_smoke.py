"""tools/bench_attention.py runs end to end in its CPU smoke mode."""

import importlib.util
import os

import torch

TOOL = os.path.join(os.path.dirname(__file__), "..", "..", "tools", "bench_attention.py")


def _load():
    spec = importlib.util.spec_from_file_location("bench_attention", TOOL)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_cpu_tiny_smoke(capsys):
    assert _load().main(["--device", "cpu", "--tiny"]) == 0
    rows = [line for line in capsys.readouterr().out.splitlines() if line.startswith("| 48 | bitfield |")]
    assert [r.split("|")[3].strip() for r in rows] == ["fwd", "fwd+bwd"]
    assert all(float(r.split("|")[4]) > 0 for r in rows)


def test_cuda_request_without_gpu_exits_clearly(capsys):
    if torch.cuda.is_available():
        return  # the CUDA run itself is the benchmark, not a unit test
    assert _load().main([]) == 2
    assert "no CUDA GPU" in capsys.readouterr().err
