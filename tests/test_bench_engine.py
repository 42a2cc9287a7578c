"""tools/bench_engine.py runs a layout end to end and reports per-rank step times and peak memory."""

import json
import os
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tools"))
import bench_engine as bench  # noqa: E402


def test_every_layout_is_a_valid_config_of_its_rank_count():
    from mimo.config import load_config

    sizes = {key: load_config(bench.layout_config(key)).world_size for key in bench.LAYOUTS}
    assert sizes == {"a": 2, "b": 2, "c": 3, "d": 2, "e": 2, "f": 2, "g": 2, "h": 2, "i": 2}
    assert bench.layout_config("b")["model"]["encoders"] == {}


def test_one_tiny_layout_reports_positive_figures_per_rank(capsys, tmp_path):
    # Colocated encoder DP2 + LLM TP2: the heterogeneous path of the old engines.
    assert bench.main(["--steps", "1", "--layouts", "d", "--tiny", "--json"]) == 0
    (row,) = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert (row["layout"], row["ranks"], row["steps"], row["tiny"]) == ("d", 2, 1, True)
    for key in ("engine", "median_step_ms", "min_step_ms", "step_ms", "peak_mib", "rss_before_mib"):
        assert len(row[key]) == 2, key
    assert all(len(times) == 1 and times[0] > 0 for times in row["step_ms"])
    assert all(t > 0 for t in row["median_step_ms"] + row["min_step_ms"])
    assert all(m > 0 for m in row["peak_mib"])
    assert row["loss"] > 0
    # The saved output renders as the markdown table, one row per layout.
    saved = tmp_path / "bench.json"
    saved.write_text(json.dumps(row) + "\n")
    assert bench.main(["--table-of", str(saved)]) == 0
    table = capsys.readouterr().out.splitlines()
    assert len(table) == 3 and table[2].startswith("| d colocated | 2 | ")


def test_unknown_layout_is_refused_by_name(capsys):
    with pytest.raises(SystemExit):
        bench.main(["--layouts", "a,z"])
    err = capsys.readouterr().err
    assert "--layouts" in err and "'z'" in err
