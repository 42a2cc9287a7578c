"""tools/gpu_bench.py on CPU: the no-CUDA message, and the --cpu-smoke run of every code path
(attention table through the Triton interpreter, mimo and plain megatron-core training steps,
profiled step, planner profile file) with the GPU run's JSON schema.

On CPU the mimo and megatron-core step benches train the same tiny text-only GPT (same
TransformerConfig, layer spec, seed, data, Adam, distributed optimizer) in fp32; their losses must
agree, which is what makes the GPU run's step-time ratio a like-for-like comparison.
"""

import dataclasses
import json
import os
import subprocess
import sys

import pytest

from mimo.config.kernel import KernelConfig

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TOOL = os.path.join(ROOT, "tools", "gpu_bench.py")

ATTENTION_KEYS = {"device", "bench", "tokens", "mask", "impl", "fwd_ms", "fwd_bwd_ms", "fwd_tflops", "fwd_bwd_tflops"}
STEP_KEYS = {"device", "bench", "impl", "model", "step_ms", "tokens_per_s", "mfu", "peak_memory_gb"}
PROFILE_KEYS = {"device", "bench", "kernel", "ms", "share"}


def _env():
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_PORT")}
    env["CUDA_VISIBLE_DEVICES"] = ""  # the CPU paths, also on a machine with a GPU
    return env


def test_without_cuda_says_so_and_exits_0(tmp_path):
    out = tmp_path / "results" / "bench.jsonl"  # the line goes to --out as well: the file says nothing was measured
    proc = subprocess.run([sys.executable, TOOL, "--out", str(out)], capture_output=True, text=True, env=_env(),
                          cwd=ROOT, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    lines = [x for x in proc.stdout.splitlines() if x.strip()]
    assert len(lines) == 1 and out.read_text() == lines[0] + "\n"
    row = json.loads(lines[0])
    assert row["cuda"] is False and row["device"] == "cpu"
    assert "nothing measured" in row["message"]
    assert os.listdir(out.parent) == ["bench.jsonl"]  # nothing measured: no planner profile next to it


@pytest.fixture(scope="module")
def smoke(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("gpu_bench")
    out = tmp / "bench.jsonl"
    proc = subprocess.run([sys.executable, TOOL, "--cpu-smoke", "--out", str(out)], capture_output=True, text=True,
                          env=_env(), cwd=ROOT, timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]
    stdout_rows = [json.loads(x) for x in proc.stdout.splitlines() if x.strip()]
    file_rows = [json.loads(x) for x in out.read_text().splitlines() if x.strip()]
    with open(tmp / "bench.profile.json") as f:
        profile = json.load(f)
    return stdout_rows, file_rows, profile, proc.stderr


def test_smoke_rows_and_schema(smoke):
    rows, file_rows, _, _ = smoke
    assert rows == file_rows  # stdout and --out carry the same lines
    assert all(r["device"] == "cpu" for r in rows)
    env = [r for r in rows if r["bench"] == "env"]
    assert len(env) == 1 and env[0]["megatron_core"] and env[0]["gemm_tflops"] > 0
    att = [r for r in rows if r["bench"] == "attention"]
    assert {(r["mask"], r["impl"]) for r in att} == {(m, i) for m in ("causal", "multimodal")
                                                      for i in ("bitfield", "flex", "sdpa")}
    for r in att:
        assert ATTENTION_KEYS <= set(r)
        if r["impl"] in ("bitfield", "sdpa"):  # flex has no CPU backward: its row says why
            assert r["fwd_ms"] > 0 and r["fwd_bwd_ms"] > 0 and r["fwd_tflops"] is not None, r
        else:
            assert r["fwd_ms"] is not None or r.get("error"), r
    assert next(r for r in att if r["mask"] == "causal")["allowed_pairs"] == 48 * 49 // 2

    steps = {r["impl"]: r for r in rows if r["bench"] == "step"}
    assert set(steps) == {"mimo", "megatron"}
    for r in steps.values():
        assert STEP_KEYS <= set(r), r
        assert "error" not in r, r
        assert r["step_ms"] > 0 and r["tokens_per_s"] > 0
        assert r["mfu"] is None and r["peak_memory_gb"] is None  # no peak / no CUDA memory on CPU
    assert steps["megatron"]["ratio_mimo_over_megatron"] > 0
    assert steps["mimo"]["model"] == steps["megatron"]["model"]

    prof = [r for r in rows if r["bench"] == "profile"]
    assert 1 <= len(prof) <= 10
    for r in prof:
        assert PROFILE_KEYS <= set(r) and r["ms"] >= 0 and 0 <= r["share"] <= 1


def test_mimo_and_megatron_train_the_same_model(smoke):
    """Same init (mimo's LLM seed, megatron's CPU initialisation), same batches, same optimizer:
    the same losses, step after step (the second step also checks the update)."""
    rows, _, _, _ = smoke
    steps = {r["impl"]: r for r in rows if r["bench"] == "step"}
    a, b = steps["mimo"]["losses"], steps["megatron"]["losses"]
    assert len(a) == len(b) == 2
    assert a == pytest.approx(b, rel=1e-5, abs=1e-6)


def test_profile_file(smoke):
    _, _, profile, _ = smoke
    assert profile["schema"] == "mimo.gpu_profile/1"
    for key in ("device", "peak_tflops", "gemm", "gemm_tflops", "gemm_efficiency", "attention", "attention_impl",
                "attention_efficiency", "attention_backward_rate", "layer", "step", "kernels", "memory_bandwidth",
                "large_gemm_tflops"):
        assert key in profile, key
    assert {g["name"] for g in profile["gemm"]} == {"qkv", "proj", "fc1", "fc2", "head"}
    layer = profile["layer"]
    # backward = (fwd + bwd) - fwd: may come out null on a busy CPU at this size
    assert layer["forward_ms"] > 0 and "backward_ms" in layer and layer["model"]["num_layers"] == 2
    assert set(profile["step"]) == {"mimo", "megatron"}
    assert profile["errors"] == {}
    assert profile["memory_bandwidth"] > 0



def test_planner_reads_the_smoke_profile(smoke, tmp_path):
    """The file the bench writes is the one `tools/plan.py --profile` reads (mimo.planner.profile):
    the CPU smoke profile maps to the planner's cpu spec with the measured fp32 GEMM rate."""
    from mimo.planner.profile import profile_gpu

    _, _, profile, _ = smoke
    gpu, info = profile_gpu(profile)
    assert info["spec"] == gpu.name == "cpu" and info["precision"] == "fp32"
    if profile["layer"].get("backward_ms"):  # the layer calibration needs both timings
        assert info["calibration"] is not None and info["calibration"] > 0
    else:
        assert info["calibration"] is None
        assert gpu.peak_flops * gpu.gemm_efficiency * 0.5 == pytest.approx(profile["gemm_tflops"] * 1e12)
    from mimo.planner.profile import step_check

    check = step_check(profile)  # predicted vs measured step of the profiled model (a CPU smoke: no bound)
    assert check["predicted_step_ms"] > 0 and check["measured_step_ms"] == profile["step"]["mimo"]["step_ms"]


def test_kernel_config_file_sets_the_bitfield_rows_settings(tmp_path):
    """--kernel-config: the file tune_attention.py --json-out writes sets the bitfield kernels' launch
    settings of the attention table, and each bitfield row records the resolved settings it ran."""
    tuned = tmp_path / "tuned.json"
    fields = {"block_m": 32, "block_n": 16, "num_warps": 4, "num_stages": 2, "bwd_block_m": 16,
              "bwd_block_n": 32, "dq_block_m": 32, "dq_block_n": 16, "fused_backward": True}
    tuned.write_text(json.dumps({"device": "cpu", "kernel_config": fields, "ms": {}}))
    out = tmp_path / "new" / "deeper" / "bench.jsonl"  # also: a directory not made yet is made
    proc = subprocess.run([sys.executable, TOOL, "--cpu-smoke", "--skip", "step", "--kernel-config", str(tuned),
                           "--out", str(out)],
                          capture_output=True, text=True, env=_env(), cwd=ROOT, timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]
    rows = [json.loads(x) for x in proc.stdout.splitlines() if x.strip()]
    assert rows == [json.loads(x) for x in out.read_text().splitlines()]
    assert (out.parent / "bench.profile.json").is_file()
    bitfield = [r for r in rows if r["bench"] == "attention" and r["impl"] == "bitfield"]
    assert len(bitfield) == 2
    resolved = dataclasses.asdict(KernelConfig(**fields).resolve(16))  # the file's fields, the defaults for the rest
    for r in bitfield:
        assert r["fwd_bwd_ms"] > 0 and r["kernel_config"] == resolved, r
    assert {k: resolved[k] for k in fields} == fields
    assert not [r for r in rows if r["bench"] == "step"]


def _tool():
    """tools/gpu_bench.py as a module, for the checks that end before anything runs."""
    sys.path.insert(0, os.path.join(ROOT, "tools"))
    import gpu_bench

    return gpu_bench


def test_a_tuned_file_for_another_attention_shape_is_named(tmp_path):
    gpu_bench = _tool()
    tuned = {"heads": 16, "kv_heads": 16, "head_dim": 128, "kernel_config": {}}
    assert gpu_bench.tuned_shape_mismatch(tuned, 16, 8, 128) == "kv_heads 16 there, 8 here"
    assert gpu_bench.tuned_shape_mismatch(tuned, 16, 16, 128) == ""
    # A plain object of fields says nothing about the shape.
    assert gpu_bench.tuned_shape_mismatch({"block_m": 64}, 16, 8, 128) == ""


@pytest.mark.parametrize("content, message", [
    ('{"kernel_config": {"block_m": 64, "warps": 4}}', "warps: unknown field"),
    ('{"block_m": "64"}', "block_m: must be an integer"),
    ('{"block_m": 48}', "block_m: must be a power of two"),
    ('{"num_warps": 0}', "num_warps: must be a positive integer"),
    ('{"fused_backward": "yes"}', "fused_backward: must be true or false"),
    ('{"fused_backward": true, "dq_num_stages": 3}', "fused_backward: needs the dK/dV and dQ kernels' warps"),
    ('[1, 2]', "must be a mapping of KernelConfig fields"),
    ("{not json", "cannot read it as JSON"),
])
def test_a_bad_kernel_config_file_is_one_error_line(tmp_path, capsys, monkeypatch, content, message):
    monkeypatch.setenv("TRITON_INTERPRET", "1")  # what --cpu-smoke sets: restored after the test
    bad = tmp_path / "k.json"
    bad.write_text(content)
    assert _tool().main(["--cpu-smoke", "--kernel-config", str(bad), "--out", str(tmp_path / "b.jsonl")]) == 2
    out = capsys.readouterr()
    assert out.out == "" and out.err.startswith(f"error: --kernel-config {bad}: ") and message in out.err
    assert out.err.count("\n") == 1, out.err


@pytest.mark.parametrize("flag", ["--out", "--profile-out"])
def test_an_output_path_that_cannot_be_written_stops_before_the_run(tmp_path, capsys, flag):
    assert _tool().main(["--cpu-smoke", flag, str(tmp_path)]) == 2
    out = capsys.readouterr()
    assert out.out == "" and out.err == f"error: {flag}: {tmp_path} is a directory; name the file to write\n"


@pytest.mark.parametrize("argv, line", [
    (["--skip", "foo"], "error: --skip: unknown part(s) foo (parts: attention, step, profile)"),
    (["--masks", "causal,foo"], "error: --masks 'causal,foo': expected comma-separated names from causal, multimodal"),
    (["--seqlens", "abc"], "error: --seqlens 'abc': expected comma-separated integers"),
    (["--seqlens", "0"], "error: --seqlens '0': each length must be >= 1"),
    (["--heads", "16", "--kv-heads", "3"], "error: --kv-heads: must divide --heads (16), got 3"),
    (["--attn-iters", "0"], "error: --attn-iters: must be >= 1, got 0"),
    (["--warmup", "8"], "error: --warmup: must be >= 0 and below --steps (8), got 8"),
    (["--global-batch", "3", "--micro-batch", "2"], "error: --global-batch: must be a multiple of --micro-batch (2), got 3"),
    (["--budget-s", "-1"], "error: --budget-s: must be > 0, got -1.0"),
])
def test_a_bad_flag_is_one_line_before_anything_runs_in_every_mode(capsys, argv, line):
    gpu_bench = _tool()
    for mode in ([], ["--cpu-smoke"]):  # without CUDA too: a GPU run would meet it minutes in
        assert gpu_bench.main(mode + argv) == 2
        out = capsys.readouterr()
        assert out.out == "" and out.err == line + "\n", out
