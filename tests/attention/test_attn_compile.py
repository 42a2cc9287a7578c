"""tools/compile_attention.py: every bitfield kernel variant compiles to a Hopper (sm_90) cubin on this
CPU-only machine with the launch settings the runtime uses, and fits the GPU's shared memory and
registers; a setting that does not fit is reported and fails the run (the check can fail)."""

import json
import os
import subprocess
import sys

import pytest
import torch

from mimo.attention import KernelConfig

TOOLS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "tools")
sys.path.insert(0, TOOLS)
import compile_attention  # noqa: E402


def _compile(argv):
    """The tool as its own process, as users run it (this pytest process imported Triton for its
    interpreter, which cannot generate GPU code); TRITON_INTERPRET=1 stays in its environment."""
    proc = subprocess.run([sys.executable, os.path.join(TOOLS, "compile_attention.py"), *argv], capture_output=True,
                          text=True, timeout=600, env=dict(os.environ, TRITON_INTERPRET="1"))
    return proc.returncode, [json.loads(line) for line in proc.stdout.splitlines() if line.strip()], proc.stderr


def _run(capsys, argv):
    rc = compile_attention.main(argv)
    captured = capsys.readouterr()
    rows = [json.loads(line) for line in captured.out.splitlines() if line.strip()]
    return rc, rows, captured.err


def test_every_variant_compiles_for_sm90_with_the_runtime_settings_and_fits():
    rc, rows, err = _compile([])  # defaults: sm_90, head_dim 128, bf16
    summary = rows.pop()
    assert rc == 0, ([r for r in rows if not r["fits"]], err[-2000:])
    assert summary["summary"] and summary["ok"] and summary["failed"] == 0 and summary["compiled"] == len(rows)

    cfg = KernelConfig().resolve(128)
    launch = {"fwd_kernel": ((cfg.block_m, cfg.block_n), cfg.num_warps, cfg.num_stages),
              "merge_kernel": ((cfg.block_m, cfg.block_n), cfg.num_warps, cfg.num_stages),
              "bwd_dkdv_kernel": ((cfg.bwd_block_m, cfg.bwd_block_n), cfg.bwd_num_warps, cfg.bwd_num_stages),
              "bwd_dq_kernel": ((cfg.dq_block_m, cfg.dq_block_n), cfg.dq_num_warps, cfg.dq_num_stages)}
    seen = {(r["kernel"], r["has_doc"], r["even"]) for r in rows}
    # Masked/unmasked documents x lengths that divide the tiles or not, for each attention kernel.
    for kernel in ("fwd_kernel", "bwd_dkdv_kernel", "bwd_dq_kernel"):
        assert {(kernel, doc, even) for doc in (False, True) for even in (False, True)} <= seen
    assert ("merge_kernel", False, True) in seen
    delta = {(r["has_dlse"], r["even"]) for r in rows if r["kernel"] == "bwd_delta_kernel"}
    assert delta == {(dlse, even) for dlse in (False, True) for even in (False, True)}
    assert "bwd_kernel" not in {r["kernel"] for r in rows}  # two backward launches unless fused_backward
    classify_tiles = {(tuple(r["tiles"]), r["has_doc"]) for r in rows if r["kernel"] == "classify_kernel"}
    assert classify_tiles == {(t, doc) for t in (launch["fwd_kernel"][0], launch["bwd_dkdv_kernel"][0])
                              for doc in (False, True)}
    for r in rows:
        assert r["arch"] == "sm_90" and r["fits"] and "error" not in r, r
        assert 0 < r["shared_bytes"] <= compile_attention.SHARED_LIMIT[90], r
        assert 0 < r["registers"] <= 255 and r["spill_bytes"] >= 0, r
        if r["kernel"] in launch:
            tiles, warps, stages = launch[r["kernel"]]
            assert (tuple(r["tiles"]), r["num_warps"], r["num_stages"]) == (tiles, warps, stages), r


def test_the_one_launch_backward_compiles_with_both_plans_tiles_and_fits():
    # Its more involved grid: heads fastest (dK/dV programs over kv heads, then dQ's over query heads).
    rc, rows, err = _compile(["--kernels", "fused", "--config",
                              '{"fused_backward": true, "heads_fastest": true, "dq_block_m": 128, "dq_block_n": 32}'])
    summary = rows.pop()
    assert rc == 0 and summary["ok"] and summary["compiled"] == len(rows) == 4, err[-2000:]
    cfg = KernelConfig(fused_backward=True).resolve(128)
    for r in rows:  # the dK/dV kernel's launch settings, then each plan's tiles
        assert r["kernel"] == "bwd_kernel" and r["fits"] and "error" not in r, r
        assert r["tiles"] == [cfg.bwd_block_m, cfg.bwd_block_n, 128, 32], r
        assert (r["num_warps"], r["num_stages"]) == (cfg.bwd_num_warps, cfg.bwd_num_stages)


def test_a_setting_that_needs_too_much_shared_memory_fails():
    # 16x512 forward tiles with 2 stages of K and V need ~288 KB; an H100 gives a program 227 KB. (Small
    # query tiles: they build in half the time 128x256 take.)
    rc, rows, err = _compile(["--kernels", "fwd", "--config", '{"block_m": 16, "block_n": 512, "num_stages": 2}'])
    summary = rows.pop()
    assert rc == 1 and not summary["ok"] and summary["failed"] == len(rows) == 4, err[-2000:]
    for r in rows:
        assert r["tiles"] == [16, 512] and not r["fits"], r
        assert r["shared_bytes"] > compile_attention.SHARED_LIMIT[90]
        assert r["error"].startswith("shared memory "), r


def test_every_kernel_argument_has_a_type():
    # A kernel argument the signature table does not know is an error, never a guessed type.
    from mimo.attention.kernel_loader import kernels

    kern = kernels(False)
    for name in compile_attention.KERNELS.values():
        fn = getattr(kern, name)
        constants = {a: None for a, p in zip(fn.arg_names, fn.params) if p.is_constexpr}
        sig, _ = compile_attention.signature(fn, constants, "bf16", compile_attention._scalar_values(
            fn, 128, compile_attention.EVEN_TOKENS, 64, 64))
        assert set(sig) == set(fn.arg_names)
        assert all(sig[a] == "constexpr" for a in constants)
    with pytest.raises(KeyError, match="no type known for argument 'NEW'"):
        class Fake:
            __name__ = "fake"
            arg_names = ["NEW"]
        compile_attention.signature(Fake, {}, "bf16", {})


@pytest.mark.parametrize("argv, message", [
    (["--dtype", "int8"], "--dtype 'int8'"),
    (["--kernels", "fwd,softmax"], "--kernels"),
    (["--config", '{"block_m": 48}'], "--config: block_m: must be a power of two"),
    (["--config", '{"tile": 64}'], "--config: tile: unknown field"),
    (["--config", "[1]"], "--config: must be a mapping of KernelConfig fields"),
    (["--config", '{"num_warps": 0}'], "--config: num_warps: must be a positive integer"),  # not "the default"
    (["--config", '{"block_m": "32"}'], "--config: block_m: must be an integer"),
    (["--config", "{bad"], "--config: not JSON"),
    (["--head-dim", "abc"], "--head-dim 'abc': expected comma-separated integers"),
    (["--head-dim", "512"], "1..256"),
    ([], "TRITON_INTERPRET"),  # this process imported Triton for its interpreter: no GPU code from here
])
def test_bad_arguments_give_one_error_line_and_exit_2(capsys, argv, message):
    rc, rows, err = _run(capsys, argv)
    assert rc == 2 and rows == []
    assert err.startswith("error: ") and message in err and err.count("\n") == 1, err


def test_triton_interpret_selects_the_interpreter_for_cpu_and_cuda_tensors(monkeypatch):
    # A process that imported Triton with TRITON_INTERPRET on cannot compile GPU kernels (the
    # in-process check above); so CUDA tensors go to the interpreter then, as Triton's own do.
    from mimo.attention.kernel_loader import backend_for

    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert backend_for(torch.device("cuda")) == backend_for(torch.device("cpu")) == "interpret"
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    assert backend_for(torch.device("cuda")) == "triton" and backend_for(torch.device("cpu")) == "reference"
