"""tools/gpu_check.py --layouts (issue #40 item 4) on a machine without GPUs.

* every layout the tool would run under torchrun is a valid config for exactly its GPU count, with
  the placement its name says (the 4- and 8-GPU ones cannot run here, so they are checked as configs);
* `--layouts` without GPUs lists every layout as not checked, still runs the 1-rank CPU FP32
  reference, and exits 0;
* `--cpu-self-check` runs the same comparison on gloo CPU ranks: a 2-rank layout agrees with the
  1-rank run, and the control run (another init seed) is caught — if the comparison stopped
  comparing, the control row would fail and the tool would exit 1;
* the torchrun path itself (launch, gather on rank 0, compare) runs on gloo CPU ranks through the
  hidden `--torchrun-cpu` switch. What needs GPUs (NCCL, the CUDA kernels, TF32 off) is not run here.
"""

import importlib.util
import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TOOL = os.path.join(ROOT, "tools", "gpu_check.py")


def _tool_module():
    spec = importlib.util.spec_from_file_location("gpu_check_tool", TOOL)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _run(*args):
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_PORT")}
    env["CUDA_VISIBLE_DEVICES"] = ""  # the CPU path, also on a machine with GPUs
    proc = subprocess.run([sys.executable, TOOL, *args], capture_output=True, text=True, env=env, cwd=ROOT,
                          timeout=300)
    rows = [json.loads(x) for x in proc.stdout.splitlines() if x.strip().startswith("{")]
    return proc, rows


def test_layouts_are_valid_configs_for_their_gpu_counts():
    from mimo.config import load_config
    from mimo.training.parity import placement_of

    tool = _tool_module()
    assert {g for g, _, _ in tool.LAYOUTS.values()} == {2, 4, 8}
    for name, (gpus, par, _) in tool.LAYOUTS.items():
        cfg = load_config(tool.layout_config(name, 2))
        assert cfg.world_size == gpus, name
        assert cfg.training.precision == "fp32" and cfg.training.init == "sharded"
        kind = placement_of(cfg)
        assert (kind == "colocated") == name.startswith(("homogeneous", "colocated")), (name, kind)
    assert any(p["language"].get("pp", 1) > 1 for _, p, _ in tool.LAYOUTS.values())
    assert any(p["language"].get("cp", 1) > 1 for _, p, _ in tool.LAYOUTS.values())
    ref = load_config(tool.reference_config(2))
    assert ref.world_size == 1


def test_without_gpus_says_what_it_cannot_check():
    proc, rows = _run("--layouts", "--steps", "1")
    assert proc.returncode == 0, proc.stderr[-3000:]
    *layouts, summary = rows
    skipped = [r for r in layouts if r.get("status") == "not checked"]
    assert {r["layout"] for r in skipped} == set(_tool_module().LAYOUTS)
    assert all(r["reason"].startswith(f"needs {r['gpus']} GPUs, 0 present") for r in skipped)
    ref = [r for r in layouts if r["layout"] == "cpu_reference"]
    assert ref and len(ref[0]["losses"]) == 1 and ref[0]["losses"][0] > 0
    assert summary["summary"] and summary["checked"] == 0 and summary["ok"]
    assert "nothing was compared on a GPU" in summary["message"]


def test_cpu_self_check_agrees_and_catches_the_control():
    proc, rows = _run("--cpu-self-check", "--only", "homogeneous_tp2", "--steps", "1")
    assert proc.returncode == 0, proc.stderr[-3000:] + proc.stdout[-2000:]
    layout, control, summary = rows
    assert layout["layout"] == "homogeneous_tp2" and layout["ok"] and layout["max_rel_diff"] < 1e-4
    assert control["layout"].startswith("homogeneous_tp2 (control") and control["ok"]
    assert control["max_rel_diff"] > 1e-2  # another seed: far outside the tolerance
    assert summary["ok"] and summary["checked"] == 2 and summary["failed"] == 0


def test_unknown_layout_is_an_error():
    proc, _ = _run("--layouts", "--only", "nope")
    assert proc.returncode == 2 and "unknown layout" in proc.stderr


@pytest.mark.parametrize("argv, line", [
    (["--cpu-self-check", "--cpu-rtol", "-1"], "error: --cpu-rtol: must be > 0, got -1.0"),  # every layout "differed"
    (["--layouts", "--only", ","], "error: --only ',': an empty layout name"),
    (["--seqlens", "abc"], "error: --seqlens 'abc': expected comma-separated integers"),  # a GPU traceback before
    (["--layouts", "--timeout", "0"], "error: --timeout: must be > 0, got 0.0"),
])
def test_a_bad_flag_is_one_line_before_any_check(capsys, argv, line):
    assert _tool_module().main(argv) == 2
    out = capsys.readouterr()
    assert out.out == "" and out.err == line + "\n", out


def test_torchrun_launch_gather_and_compare_on_cpu():
    """The GPU path's machinery — torchrun launch of the layout worker, every rank's record gathered on
    rank 0, compared with the 1-rank CPU run — on gloo CPU ranks (hidden `--torchrun-cpu`), since no
    NCCL is available here."""
    proc, rows = _run("--layouts", "--torchrun-cpu", "--only", "homogeneous_tp2", "--steps", "1")
    assert proc.returncode == 0, proc.stderr[-3000:] + proc.stdout[-2000:]
    row, summary = rows
    assert row["layout"] == "homogeneous_tp2" and row["status"] == "checked" and row["ok"], row
    assert row["max_rel_diff"] < 1e-4 and row["loss"] == pytest.approx(row["cpu_loss"], rel=1e-5)
    assert summary["checked"] == 1 and summary["ok"]
