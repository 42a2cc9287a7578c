"""tools/parity.py: the DESIGN.md contract, and that its comparison can fail."""

import json
import os
import subprocess
import sys

import torch
import yaml

from mimo.training.parity import compare, max_rel_diff

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TOOL = os.path.join(ROOT, "tools", "parity.py")
PARITY = os.path.join(ROOT, "examples", "configs", "parity")


def test_parity_cli_reports_json_per_candidate():
    # The 2-rank candidate keeps this CLI run cheap; TP x DP parity is checked in-process by
    # test_heterogeneous_parity.py::test_colocated_fan_in_three_phase.
    r = subprocess.run([sys.executable, TOOL, os.path.join(PARITY, "baseline.yaml"), os.path.join(PARITY, "dp2.yaml"),
                        "--steps", "2"], capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert r.returncode == 0, r.stderr[-3000:]
    reports = [json.loads(l) for l in r.stdout.splitlines() if l.startswith("{")]
    assert len(reports) == 1
    rep = reports[0]
    for key in ("candidate", "world_size", "placement", "loss", "baseline_loss", "max_rel_loss_diff",
                "max_rel_grad_diff", "max_rel_param_diff", "ok"):
        assert key in rep
    assert rep["ok"] and rep["world_size"] == 2 and rep["placement"] == "colocated"
    assert len(rep["loss"]) == 2 and rep["max_rel_grad_diff"] <= 1e-4


def test_parity_cli_refuses_candidates_that_change_more_than_parallelism(tmp_path):
    raw = yaml.safe_load(open(os.path.join(PARITY, "dp2.yaml")))
    raw["training"]["lr"] = 0.5
    bad = tmp_path / "bad.yaml"
    bad.write_text(yaml.safe_dump(raw))
    r = subprocess.run([sys.executable, TOOL, os.path.join(PARITY, "baseline.yaml"), str(bad)], capture_output=True,
                       text=True, timeout=120, cwd=ROOT)
    assert r.returncode == 2
    assert r.stderr.startswith("error: training:") and "only parallelism may differ" in r.stderr


def test_comparison_catches_swapped_shards_and_missing_tensors():
    torch.manual_seed(0)
    grads = {"a": torch.randn(4, 3), "b": torch.randn(5)}
    base = {"losses": [2.0, 1.5], "grads": grads, "params": grads}
    same = compare(base, {**base, "world_size": 2, "placement": "colocated"}, 1e-4)
    assert same["ok"] and same["max_rel_grad_diff"] == 0.0
    swapped = dict(grads)
    swapped["a"] = torch.cat([grads["a"][2:], grads["a"][:2]])  # two TP shards in the wrong order
    rep = compare(base, {**base, "grads": swapped, "world_size": 2, "placement": "colocated"}, 1e-4)
    assert not rep["ok"] and rep["max_rel_grad_diff"] > 1e-2
    assert max_rel_diff({"a": grads["a"]}, grads) == float("inf")
    rep = compare(base, {**base, "losses": [2.0, 1.5001], "world_size": 2, "placement": "colocated"}, 1e-6)
    assert not rep["ok"]
