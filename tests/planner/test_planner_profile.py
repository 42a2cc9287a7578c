"""`tools/plan.py --profile FILE`: the planner's GPU constants from a tools/gpu_bench.py profile
(schema mimo.gpu_profile/1, mimo.planner.profile), on CPU with synthetic profiles.

* the measured rates replace the device's defaults; halving them slows the predicted step
  (negative control: the profile is really read);
* the per-layer calibration closes the loop: a profile whose layer and step were measured on a
  device the planner's rates misjudge (here: every rate 0.55x what the profile's GEMM/attention
  table says) is predicted within 15% of its measured one-GPU step after calibration, and not
  before (the acceptance "predicted within 15% of measured", checkable without a GPU);
* a bad file, a wrong schema or an unknown device is one `error:` line, exit 2.
"""

import json
import os
import subprocess
import sys

import pytest
import yaml

from mimo.planner.best import searcher
from mimo.planner.hardware import GPUS
from mimo.planner.megatron import Par
from mimo.planner.profile import (SCHEMA, load_profile, measured_gpu, predicted_layer_ms, profile_gpu, scaled,
                                  spec_name)

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
# tools/gpu_bench.py's GPU step model (the LLM of gpu_llava_8gpu.yaml)
MODEL = dict(num_layers=24, hidden_size=2048, num_attention_heads=16, num_query_groups=8, ffn_hidden_size=8192,
             vocab_size=32000, max_sequence_length=2048)
MB, SEQ, GBS = 1, 2048, 8


def _raw():
    return {"model": {"language": dict(MODEL), "encoders": {}}, "parallelism": {"language": {"tp": 1, "dp": 1}},
            "data": {"kind": "mock", "seq_length": SEQ},
            "training": {"global_batch_size": GBS, "micro_batch_size": MB, "precision": "bf16"}}


def _step_s(gpu) -> float:
    search, _ = searcher(_raw(), gpu, None)
    return search.evaluate({"language": Par()}).step_time


def _profile(gemm=600.0, attn_fwd=400.0, attn_bwd=340.0, bandwidth=3.0e12, layer=None, device="NVIDIA H100 80GB HBM3",
             memory_bytes=None):
    prof = {"schema": SCHEMA, "device": device, "peak_tflops": 989.0, "dtype": "bfloat16",
            "gemm_tflops": gemm, "memory_bandwidth": bandwidth, "attention_impl": "sdpa",
            "attention": [{"tokens": t, "mask": m, "impl": i, "fwd_tflops": attn_fwd * (1 if i == "sdpa" else 0.5),
                           "bwd_tflops": attn_bwd} for t in (8192, 16384) for m in ("causal", "multimodal")
                          for i in ("sdpa", "flex")]}
    if layer is not None:
        prof["layer"] = dict(layer, model=dict(MODEL, attention="sdpa"), micro_batch=MB, seq_length=SEQ)
    if memory_bytes is not None:
        prof["memory_bytes"] = memory_bytes
    return prof


def test_device_names_map_to_the_planner_specs():
    assert spec_name("NVIDIA H100 80GB HBM3") == "h100"
    assert spec_name("NVIDIA H200") == "h200"
    assert spec_name("NVIDIA A100-SXM4-80GB") == "a100"
    assert spec_name("cpu") == "cpu"
    with pytest.raises(ValueError, match="no planner GPU spec"):
        spec_name("Some Other Accelerator")
    # Another memory size, or another chip whose name holds a known one, is not planned as the spec.
    for name in ("NVIDIA A100-SXM4-40GB", "NVIDIA GH200 480GB"):
        with pytest.raises(ValueError, match="memory it does not have"):
            spec_name(name)


def test_the_profiled_memory_size_replaces_the_specs():
    assert measured_gpu(_profile()).memory_bytes == GPUS["h100"].memory_bytes  # none recorded: the spec's
    gpu = measured_gpu(_profile(device="NVIDIA H100 NVL", memory_bytes=94 * 10**9))
    assert gpu.name == "h100" and gpu.memory_bytes == 94 * 10**9
    with pytest.raises(ValueError, match="memory_bytes"):
        measured_gpu(_profile(memory_bytes=-1))


def test_measured_rates_replace_the_defaults():
    gpu = measured_gpu(_profile())
    assert gpu.name == "h100" and gpu.intra_node_bandwidth == GPUS["h100"].intra_node_bandwidth
    assert gpu.peak_flops * gpu.gemm_efficiency == pytest.approx(600e12)
    assert gpu.peak_flops * gpu.attention_efficiency == pytest.approx(400e12)  # the step's impl, causal rows
    assert gpu.attention_backward_rate == pytest.approx(340 / 400)
    assert gpu.memory_bandwidth == 3.0e12
    # an fp32 profile (the CPU smoke run): rates are the planner's fp32 rate, half its bf16 one
    cpu = measured_gpu({"schema": SCHEMA, "device": "cpu", "peak_tflops": None, "dtype": "float32",
                        "gemm_tflops": 0.05})
    assert cpu.name == "cpu" and cpu.peak_flops * cpu.gemm_efficiency * 0.5 == pytest.approx(0.05e12)


def test_halved_rates_slow_the_predicted_step():
    fast, _ = profile_gpu(_profile(), calibrate=False)
    slow, _ = profile_gpu(_profile(gemm=300.0, attn_fwd=200.0, attn_bwd=170.0, bandwidth=1.5e12), calibrate=False)
    t_fast, t_slow = _step_s(fast), _step_s(slow)
    assert 1.5 < t_slow / t_fast <= 2.0 + 1e-9


def test_calibration_closes_the_loop():
    # The "real" device: every rate 0.55x what the profile's tables say (e.g. the model's shapes run
    # slower than the bench's); its measured layer and one-GPU step are what the planner predicts on it.
    table = measured_gpu(_profile())
    real = scaled(table, 0.55)
    f, b = predicted_layer_ms(real, *_layer_model(), "bf16")
    measured_step = _step_s(real)
    prof = _profile(layer={"forward_ms": f, "backward_ms": b})

    raw_rates, _ = profile_gpu(prof, calibrate=False)
    calibrated, info = profile_gpu(prof)
    assert info["calibration"] == pytest.approx(0.55, rel=1e-6)
    assert sum(predicted_layer_ms(calibrated, *_layer_model(), "bf16")) == pytest.approx(f + b, rel=1e-9)
    assert abs(_step_s(calibrated) / measured_step - 1) < 0.15
    assert abs(_step_s(raw_rates) / measured_step - 1) > 0.15  # without calibration the loop stays open


def test_step_check_predicts_the_profiled_step():
    """`python -m mimo.planner.profile FILE`: the planner's one-GPU step for the profile's own model
    next to its measured step (the acceptance's 15%), from the calibrated rates."""
    from mimo.planner.profile import step_check

    real = scaled(measured_gpu(_profile()), 0.55)
    f, b = predicted_layer_ms(real, *_layer_model(), "bf16")
    step = {"step_ms": _step_s(real) * 1e3, "global_batch": GBS, "micro_batch": MB, "seq_length": SEQ,
            "precision": "bf16", "distributed_optimizer": True}
    prof = dict(_profile(layer={"forward_ms": f, "backward_ms": b}), step={"mimo": step})
    out = step_check(prof)
    assert out["within_15_percent"] and out["ratio"] == pytest.approx(1.0, abs=0.15)
    assert not step_check(prof, calibrate=False)["within_15_percent"]
    with pytest.raises(ValueError, match="no measured mimo step"):
        step_check(_profile())


H200 = os.path.join(ROOT, "examples", "profiles", "h200_2026-11-29.profile.json")
H200_LLAVA_LOG = os.path.join(ROOT, "examples", "profiles", "h200_2026-11-29.llava_1gpu.jsonl")


def test_the_measured_h200_profile_predicts_its_measured_steps():
    """The profile and LLaVA-style run one H200 measured (docs/benchmarks.md, 2026-11-29): a change to
    the cost model that moves either prediction out of the 15% it was measured within fails here."""
    from mimo.planner.profile import step_check

    prof = load_profile(H200)
    assert prof["device"] == "NVIDIA H200" and profile_gpu(prof)[1]["spec"] == "h200"
    text = step_check(prof)
    assert text["measured_step_ms"] == prof["step"]["mimo"]["step_ms"] and text["within_15_percent"], text
    proc = _plan("--config", os.path.join(ROOT, "examples", "configs", "gpu_llava_1gpu.yaml"), "--evaluate",
                 "--profile", H200, "--measured", H200_LLAVA_LOG, "--json")
    assert proc.returncode == 0, proc.stderr
    llava = json.loads(proc.stdout)
    from mimo.planner.profile import measured_run

    measured = measured_run(H200_LLAVA_LOG, 3)  # plan.py's default warm-up
    assert llava["measured_steps"] == measured["steps"]
    assert llava["measured_step_time_s"] == pytest.approx(measured["step_time_s"], abs=1e-6)  # printed rounded
    assert llava["within_15_percent"] and abs(llava["ratio"] - 1.0) <= 0.15, llava
    assert llava["measured_mfu"] > 0.35  # the run the MFU acceptance was measured on


def _layer_model():
    from mimo.planner.spec import read_model

    return read_model({"language": dict(MODEL), "encoders": {}}), MB, SEQ


def _plan(*args):
    return subprocess.run([sys.executable, os.path.join(ROOT, "tools", "plan.py"), *args],
                          capture_output=True, text=True, cwd=ROOT, timeout=120)


def test_plan_cli_reads_the_profile(tmp_path):
    cfg = tmp_path / "model.yaml"
    cfg.write_text(yaml.safe_dump(_raw()))
    fast, slow = tmp_path / "fast.json", tmp_path / "slow.json"
    fast.write_text(json.dumps(_profile()))
    slow.write_text(json.dumps(_profile(gemm=300.0, attn_fwd=200.0, attn_bwd=170.0, bandwidth=1.5e12)))
    steps = []
    for path in (fast, slow):
        r = _plan("--config", str(cfg), "--evaluate", "--json", "--profile", str(path))
        assert r.returncode == 0, r.stderr
        assert "NVIDIA H100 80GB HBM3 as h100" in r.stderr
        steps.append(json.loads(r.stdout)["step_time_s"])
    assert steps[1] > 1.5 * steps[0]
    default = _plan("--config", str(cfg), "--evaluate", "--json")
    assert json.loads(default.stdout)["step_time_s"] != steps[0]


@pytest.mark.parametrize("content, message", [
    ("not json", "invalid JSON"),
    (json.dumps({"schema": "mimo.gpu_profile/0", "device": "cpu"}), "expected 'mimo.gpu_profile/1'"),
    (json.dumps([1, 2]), "expected a JSON object"),
    (json.dumps({"schema": SCHEMA, "device": "TPU v5"}), "no planner GPU spec"),
    (json.dumps({"schema": SCHEMA, "device": "cpu", "gemm_tflops": -1}), "gemm_tflops: expected a positive"),
    # A dtype the rates cannot be read against (before: read as fp32 without a word), a rate above the peak.
    (json.dumps({"schema": SCHEMA, "device": "cpu", "dtype": "int8"}), "dtype: expected bfloat16 or float32"),
    (json.dumps({"schema": SCHEMA, "device": "NVIDIA H200", "peak_tflops": 989.0, "gemm_tflops": 1e9}),
     "gemm_tflops: 1000000000.0 is above the device's peak_tflops (989.0)"),
    # Hand-edited files: each a traceback or a bare KeyError before.
    (json.dumps({"schema": SCHEMA, "device": "cpu", "attention": 5}), "attention: expected a list of rows"),
    (json.dumps({"schema": SCHEMA, "device": "cpu", "layer": {"model": {}, "micro_batch": 1, "forward_ms": 1.0,
                                                              "backward_ms": 2.0}}),
     "layer.seq_length: expected a positive integer, got None"),
    (json.dumps({"schema": SCHEMA, "device": "cpu", "layer": {"model": {}, "micro_batch": "x", "seq_length": 8,
                                                              "forward_ms": 1.0, "backward_ms": 2.0}}),
     "layer.micro_batch: expected a positive integer, got 'x'"),
    (json.dumps({"schema": SCHEMA, "device": "cpu", "layer": {"model": dict(MODEL, num_attention_heads=7),
                                                              "micro_batch": 1, "seq_length": 8, "forward_ms": 1.0,
                                                              "backward_ms": 2.0}}),
     "profile layer.model: "),
])
def test_bad_profile_is_one_error_line(tmp_path, content, message):
    cfg = tmp_path / "model.yaml"
    cfg.write_text(yaml.safe_dump(_raw()))
    bad = tmp_path / "bad.json"
    bad.write_text(content)
    r = _plan("--config", str(cfg), "--evaluate", "--profile", str(bad))
    assert r.returncode == 2
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and message in lines[0], r.stderr


def test_a_layer_timing_far_from_the_planners_model_warns(tmp_path):
    """A calibration factor beyond 20x either way (a layer measured in 1e-9 ms, say) is named: every
    predicted step would otherwise print as 0.000 s without a word."""
    cfg = tmp_path / "model.yaml"
    cfg.write_text(yaml.safe_dump(_raw()))
    prof = tmp_path / "p.json"
    prof.write_text(json.dumps(_profile(layer={"forward_ms": 1e-9, "backward_ms": 1e-9})))
    r = _plan("--config", str(cfg), "--evaluate", "--json", "--profile", str(prof))
    assert r.returncode == 0, r.stderr
    assert "warning: --profile: the measured layer time is" in r.stderr and "--no-calibrate" in r.stderr
    prof.write_text(json.dumps(_profile(layer={"forward_ms": 10.0, "backward_ms": 20.0})))
    r = _plan("--config", str(cfg), "--evaluate", "--json", "--profile", str(prof))
    assert r.returncode == 0 and "warning" not in r.stderr, r.stderr


def test_missing_profile_file():
    with pytest.raises(ValueError, match="cannot read"):
        load_profile("/nonexistent/profile.json")


# ---- --evaluate --measured: the prediction next to a logged run of the same config -----------------

DEMO = os.path.join(ROOT, "examples", "configs", "cpu_demo.yaml")
@pytest.fixture(scope="module")
def demo_run(tmp_path_factory):
    """examples/pretrain_mimo.py on one CPU rank, 5 steps, its --log-json file, and the config it ran."""
    tmp = tmp_path_factory.mktemp("measured")
    log, config = tmp / "steps.jsonl", tmp / "demo_1rank.yaml"
    raw = yaml.safe_load(open(DEMO))
    for module in ("language", "images"):
        raw["parallelism"][module]["dp"] = 1
    raw["training"].update(global_batch_size=2, micro_batch_size=1)
    config.write_text(yaml.safe_dump(raw))
    r = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "1",
                        os.path.join(ROOT, "examples", "pretrain_mimo.py"), "--config", str(config), "--device", "cpu",
                        "--set", "training.train_iters=5", "--log-json", str(log)],
                       capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert r.returncode == 0, r.stderr[-3000:]
    return str(config), str(log)


def test_evaluate_sets_the_measured_median_next_to_the_prediction(demo_run):
    config, log = demo_run
    times = {row["step"]: row["step_time_s"] for row in map(json.loads, open(log))}
    assert sorted(times) == [1, 2, 3, 4, 5]
    r = _plan("--config", config, "--evaluate", "--gpu", "cpu", "--json", "--measured", log, "--warmup", "2")
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    median = sorted(times[s] for s in (3, 4, 5))[1]
    assert out["measured_steps"] == 3 and out["measured_step_time_s"] == pytest.approx(median, abs=1e-6)
    assert out["ratio"] == pytest.approx(out["step_time_s"] / median, abs=1e-4)  # both rounded in the output
    assert out["within_15_percent"] == (abs(out["ratio"] - 1) <= 0.15)
    assert out["measured_mfu"] is None  # a CPU run knows no peak
    text = _plan("--config", config, "--evaluate", "--gpu", "cpu", "--measured", log)
    assert text.returncode == 0 and "measured: step" in text.stdout and "median of 2 steps after 3 warm-up" in text.stdout


def test_a_resumed_step_counts_with_its_last_row(tmp_path):
    from mimo.planner.profile import measured_run

    log = tmp_path / "steps.jsonl"
    rows = [(1, 9.0), (2, 1.0), (3, 2.0), (3, 4.0), (4, 5.0)]  # step 3 trained twice: the resumed run's time
    log.write_text("".join(json.dumps({"step": s, "step_time_s": t, "mfu": t / 10}) + "\n" for s, t in rows))
    assert measured_run(str(log), 1) == {"step_time_s": 4.0, "steps": 3, "mfu": 0.4}


def test_a_last_line_cut_short_by_a_killed_run_is_left_out(tmp_path):
    from mimo.planner.profile import measured_run

    log = tmp_path / "steps.jsonl"
    full = "".join(json.dumps({"step": s, "step_time_s": t}) + "\n" for s, t in [(1, 9.0), (2, 1.0), (3, 3.0)])
    log.write_text(full + '{"step": 4, "step_ti')  # the run was killed while writing step 4
    assert measured_run(str(log), 1) == {"step_time_s": 2.0, "steps": 2, "mfu": None}
    log.write_text(full + '{"step": 4, "step_ti\n' + full)  # in the middle: still an error
    with pytest.raises(ValueError, match="steps.jsonl:4: not a step row"):
        measured_run(str(log), 1)


@pytest.mark.parametrize("content,args,message", [
    ("{}\n", [], "steps.jsonl:1: not a step row of --log-json"),
    ('{"step": 1, "step_time_s": -1}\n', [], "steps.jsonl:1: step 1 with step_time_s -1.0"),
    ('{"step": true, "step_time_s": 1}\n', [], "steps.jsonl:1: step True with step_time_s 1.0"),
    ('{"step": 1, "step_time_s": 0.5}\n', [], "1 steps logged, none after the 3 warm-up steps (--warmup)"),
    ('{"step": 1, "step_time_s": 0.5}\n', ["--warmup", "-1"], "--warmup: expected a non-negative integer, got -1"),
    ("[" * 100000 + "\n", [], "steps.jsonl:1: not a step row of --log-json"),  # a RecursionError traceback before
])
def test_a_bad_measured_file_is_one_error_line(tmp_path, content, args, message):
    log = tmp_path / "steps.jsonl"
    log.write_text(content)
    r = _plan("--config", DEMO, "--evaluate", "--gpu", "cpu", "--measured", str(log), *args)
    assert r.returncode == 2 and r.stderr.count("\n") == 1 and message in r.stderr, r.stderr


def test_warmup_needs_measured():
    r = _plan("--config", DEMO, "--evaluate", "--gpu", "cpu", "--warmup", "5")
    assert r.returncode == 2 and r.stderr == "error: --warmup: only with --measured\n"


def test_measured_needs_evaluate(tmp_path):
    r = _plan("--config", DEMO, "--gpus", "2", "--gpu", "cpu", "--measured", str(tmp_path / "x.jsonl"))
    assert r.returncode == 2 and r.stderr == "error: --measured: only with --evaluate\n"
