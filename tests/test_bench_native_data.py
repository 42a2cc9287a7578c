"""Smoke test of tools/bench_native_data.py: a few native-resolution images through the data pipeline,
and the encoder DP imbalance of item-level against sample-level division (seconds, not a benchmark)."""

import json
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "tools"))
import bench_native_data  # noqa: E402


def test_bench_runs_small_and_item_level_division_beats_sample_level(capsys):
    args = ["--images", "3", "--median-side", "96", "--steps", "4", "--samples", "8", "--dp", "2", "4"]
    assert bench_native_data.main(args) == 0
    lines = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    pipe, imb = lines[0]["pipeline"], lines[1]["imbalance"]
    assert pipe["images"] == 3 and all(v > 0 for v in pipe["items_per_s"].values())
    assert [r["encoder_dp"] for r in imb["rows"]] == [2, 4]
    for row in imb["rows"]:
        assert 1.0 <= row["item_tokens"]["mean"] <= row["sample_tokens"]["mean"]
        assert row["item_vit_work"]["mean"] >= 1.0


def test_bad_arguments_are_one_error_line(capsys):
    assert bench_native_data.main(["--images", "0", "--skip-pipeline"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and len(err.strip().splitlines()) == 1
