"""Smoke test of tools/bench_grad_norm.py at tiny sizes: it runs, writes its figures, and the fused
fp32 norms it times agree with the fp64 per-parameter norm (a wrong view set would not)."""

import importlib.util
import json
import os

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _tool():
    spec = importlib.util.spec_from_file_location("bench_grad_norm", os.path.join(ROOT, "tools", "bench_grad_norm.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_bench_grad_norm_tiny(tmp_path, capsys):
    out = tmp_path / "gn.json"
    res = _tool().main(["--layers", "2", "--hidden", "64", "--ffn", "256", "--vocab", "96", "--repeats", "2",
                        "--json", str(out)])
    assert json.loads(out.read_text()) == json.loads(json.dumps(res))
    # 2 layers x 12 tensors + embedding, final norm (2), output layer
    assert res["param_tensors"] == 2 * 12 + 4
    assert res["params"] == 2 * 96 * 64 + 2 * (4 * 64 + 4 * 64 * 64 + 3 * 64 + 64 + 2 * 64 * 256 + 256 + 64) + 2 * 64
    v = res["variants"]
    assert set(v) == {"old", "new_tp0", "new_tp1"}
    assert res["views"] == {"new_tp0": 1, "new_tp1": 6}  # TP rank > 0: runs between the replicated weights
    for name in ("new_tp0", "new_tp1"):
        assert v[name]["rel_err_vs_fp64"] < 1e-5 and len(v[name]["times_s"]) == 2
    assert v["new_tp1"]["sq_norm"] < v["new_tp0"]["sq_norm"]
    assert abs(v["new_tp0"]["sq_norm"] - v["old"]["sq_norm"]) <= 1e-5 * v["old"]["sq_norm"]
    assert "speedup (old / new_tp0, medians)" in capsys.readouterr().out
