"""tools/tune_attention.py in its CPU smoke mode, and the launch settings it tunes (KernelConfig)."""

import contextlib
import io
import json
import os
import sys

import pytest
import torch
import yaml

from mimo.attention import KernelConfig
from mimo.attention.function import _launch_opts

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "tools"))
import tune_attention  # noqa: E402


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory):
    """One --tiny run with --json-out (its directory not made yet): (stdout, the JSON file)."""
    out_file = tmp_path_factory.mktemp("tune") / "not" / "made" / "tuned.json"
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        assert tune_attention.main(["--device", "cpu", "--tiny", "--json-out", str(out_file)]) == 0
    return printed.getvalue(), out_file


def test_cpu_tiny_smoke_times_and_checks_every_candidate(tiny_run):
    tool = tune_attention
    out = tiny_run[0]
    rows = [line for line in out.splitlines() if line.startswith("| (")]
    # dK/dV and dQ apart, then forward + backward in each launch form.
    assert len(rows) == len(tool.TINY_FORWARD) + 2 * len(tool.TINY_BACKWARD) + len(tool.LAUNCHES)
    for row in rows:
        cell = row.split("|")[2]
        assert "diff" in cell and "WRONG" not in cell and float(cell.split()[0]) > 0, row
    assert out.count("fastest ") == 4 and "\nKernelConfig(block_m=" in out and "dq_num_stages=" in out
    assert "\nlaunch (fused_backward, heads_fastest)" in out and "fused_backward=" in out and "heads_fastest=" in out
    # Each candidate is also reported as soon as it is timed (a run stopped at a time limit keeps those).
    progress = [line for line in out.splitlines() if line.startswith("measured 48 tokens ")]
    assert [line.split()[3] for line in progress] == (["forward"] * len(tool.TINY_FORWARD) + ["dkdv"] *
                                                      len(tool.TINY_BACKWARD) + ["dq"] * len(tool.TINY_BACKWARD) +
                                                      ["launch"] * len(tool.LAUNCHES))
    assert all(line.endswith(")") and " ms (diff " in line for line in progress), progress
    assert out.index(progress[-len(tool.LAUNCHES) - 1]) < out.index("| (")  # the kernels' before the first table


@pytest.mark.skipif(torch.cuda.is_available(), reason="with a GPU the CUDA run is the tuning itself, not a unit test")
def test_cuda_request_without_gpu_exits_clearly(capsys):
    assert tune_attention.main([]) == 2
    assert "no CUDA GPU" in capsys.readouterr().err


def test_backward_kernels_take_their_own_launch_settings():
    tuned = KernelConfig().resolve(128)
    assert (tuned.num_warps, tuned.num_stages, tuned.bwd_num_warps, tuned.bwd_num_stages) == (4, 3, 4, 2)
    assert _launch_opts(tuned, False) == {"num_warps": 4, "num_stages": 3}
    assert _launch_opts(tuned, False, "dkdv") == {"num_warps": 4, "num_stages": 2}
    assert _launch_opts(tuned, False, "dq") == {"num_warps": 4, "num_stages": 2}  # the dK/dV kernel's by default
    assert _launch_opts(tuned, True, "dkdv") == {}  # the interpreter takes none
    own = KernelConfig(dq_block_m=32, dq_num_warps=8, dq_num_stages=3).resolve(128)
    assert _launch_opts(own, False, "dq") == {"num_warps": 8, "num_stages": 3}
    assert (own.dq_block_m, own.dq_block_n, own.bwd_block_m) == (32, own.bwd_block_n, 64)
    # Untuned widths keep their settings; the backward follows the forward's there.
    small, big = KernelConfig().resolve(64), KernelConfig().resolve(256)
    assert (small.num_warps, small.num_stages, small.bwd_num_warps, small.bwd_num_stages) == (4, 2, 4, 2)
    assert (big.num_warps, big.num_stages, big.bwd_num_warps, big.bwd_num_stages) == (8, 1, 8, 1)
    mine = KernelConfig(num_warps=2, num_stages=4, bwd_num_warps=16, bwd_num_stages=5).resolve(128)
    assert (mine.num_warps, mine.num_stages, mine.bwd_num_warps, mine.bwd_num_stages) == (2, 4, 16, 5)


def test_the_reference_rows_are_the_defaults_for_head_dim_128():
    tool, d = tune_attention, KernelConfig().resolve(128)
    assert tool.FORWARD[0] == (d.block_m, d.block_n, d.num_warps, d.num_stages)
    assert tool.BACKWARD[0] == (d.bwd_block_m, d.bwd_block_n, d.bwd_num_warps, d.bwd_num_stages)


def test_json_out_holds_the_printed_fastest_settings(tiny_run):
    out, out_file = tiny_run  # the file's directory was made
    printed = out.split("\nKernelConfig(")[1].split(")")[0]
    saved = json.loads(out_file.read_text())
    fields = saved["kernel_config"]
    assert printed == ", ".join(f"{k}={v}" for k, v in fields.items())
    # The YAML line for a model's config says the same.
    assert yaml.safe_load(out.split("\n# in a model's YAML")[1].split("\n", 1)[1]) == {"attention_kernel": fields}
    assert set(fields) == set(KernelConfig.__dataclass_fields__) - {"split_tiles"}
    assert isinstance(fields["fused_backward"], bool) and isinstance(fields["heads_fastest"], bool)
    KernelConfig(**fields).resolve(16)  # a config the kernels take as it is
    assert set(saved["ms"]) == {"forward", "dkdv", "dq", "launch"} and all(v["48"] > 0 for v in saved["ms"].values())
    assert (saved["heads"], saved["kv_heads"], saved["head_dim"]) == (2, 1, 16)


def test_a_candidate_outside_the_tolerance_is_never_picked_nor_written(tmp_path, capsys, monkeypatch):
    tool = tune_attention
    monkeypatch.setattr(tool, "TOLERANCE", -1.0)  # every candidate, the reference included, now "differs"
    out_file = tmp_path / "tuned.json"
    assert tool.main(["--device", "cpu", "--tiny", "--json-out", str(out_file)]) == 0
    out, err = capsys.readouterr()
    assert out.count("WRONG") == len(tool.TINY_FORWARD) + 2 * len(tool.TINY_BACKWARD)  # no launch forms then
    assert "fastest" not in out and "KernelConfig(" not in out
    assert not out_file.exists() and "no candidate of forward, dkdv, dq was within the tolerance" in err


def test_one_launch_forms_are_timed_only_where_one_launch_can_run(capsys, monkeypatch):
    tool = tune_attention
    # The fastest dQ setting with other warps than the dK/dV one: one launch cannot run it.
    monkeypatch.setattr(tool, "TINY_BACKWARD", [(16, 16, 4, 2), (16, 32, 2, 2)])
    monkeypatch.setattr(tool, "_table", _pick_first_dkdv_second_dq(tool._table))
    assert tool.main(["--device", "cpu", "--tiny"]) == 0
    out = capsys.readouterr().out
    for form in ("(True, False)", "(True, True)"):
        assert f"measured 48 tokens launch {form}: n/a: one launch needs the dK/dV and dQ settings' warps" in out
    assert "fastest launch: (False, " in out and "fused_backward=False" in out


def _pick_first_dkdv_second_dq(table):
    def pick(phase, cands, seqlens, results, best):
        table(phase, cands, seqlens, results, best)
        if phase in ("dkdv", "dq"):
            best[phase] = cands[0] if phase == "dkdv" else cands[1]
    return pick


def test_a_json_out_that_cannot_be_written_stops_before_tuning(tmp_path, capsys):
    (tmp_path / "file").write_text("")
    assert tune_attention.main(["--device", "cpu", "--tiny", "--json-out", str(tmp_path / "file" / "t.json")]) == 2
    out = capsys.readouterr()
    assert out.out == "" and out.err.startswith("error: --json-out: ") and "is a file" in out.err


@pytest.mark.parametrize("argv, line", [
    (["--seqlens", "abc"], "error: --seqlens 'abc': expected comma-separated integers"),
    (["--heads", "3", "--kv-heads", "2"], "error: --kv-heads: must divide --heads (3), got 2"),
    (["--iters", "0"], "error: --iters: must be >= 1, got 0"),
    (["--head-dim", "300"], "error: --head-dim: must be 1..256 (what the kernels take), got 300"),
])
def test_a_bad_shape_flag_is_one_line_before_anything_runs(capsys, argv, line):
    assert tune_attention.main(["--device", "cpu", "--tiny"] + argv) == 2
    out = capsys.readouterr()
    assert out.out == "" and out.err == line + "\n", out
