import json
import os

from mimo.planner.api import load_raw
import subprocess
import sys

import pytest
import yaml

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
TINY = os.path.join(ROOT, "tests", "planner", "tiny_mllm.yaml")
LLAVA = os.path.join(ROOT, "examples", "planner", "llava_like.yaml")


def _plan(*args):
    return subprocess.run([sys.executable, os.path.join(ROOT, "tools", "plan.py"), *args],
                          capture_output=True, text=True, cwd=ROOT, timeout=120)


def _yaml_tail(stdout):
    return yaml.safe_load(stdout.split("# best config", 1)[1].split("\n", 1)[1])


def test_plan_end_to_end_tiny(tmp_path):
    out = tmp_path / "planned.yaml"
    r = _plan("--config", TINY, "--gpus", "4", "--gpu", "cpu", "--top", "3", "--out", str(out))
    assert r.returncode == 0, r.stderr
    assert "placement" in r.stdout and "step s" in r.stdout
    written = yaml.safe_load(out.read_text())
    assert written == _yaml_tail(r.stdout)
    assert set(written["parallelism"]) == {"language", "images", "audio"}
    for entry in written["parallelism"].values():
        assert entry["rank_offset"] + entry["tp"] * entry["cp"] * entry["pp"] * entry["dp"] <= 4
        assert ("stage_layers" in entry) == (entry["pp"] > 1)


def test_plan_llava_example_8_gpus_emits_full_config():
    r = _plan("--config", LLAVA, "--gpus", "8")
    assert r.returncode == 0, r.stderr
    cfg = _yaml_tail(r.stdout)
    assert {"model", "parallelism", "data", "training"} <= set(cfg)
    assert cfg["training"]["global_batch_size"] % (cfg["training"]["micro_batch_size"]
                                                    * cfg["parallelism"]["language"]["dp"]) == 0


def test_plan_with_profiled_samples(tmp_path):
    # --samples sets the encoder workload: more images per sample, slower best step
    light, heavy = tmp_path / "light.json", tmp_path / "heavy.json"
    light.write_text(json.dumps([[100, 0, 0], [60, 1, 0]] * 5))
    heavy.write_text(json.dumps([[20, 2, 1], [60, 1, 2]] * 5))
    times = []
    for path in (light, heavy):
        r = _plan("--config", TINY, "--gpus", "4", "--gpu", "cpu", "--samples", str(path), "--json")
        assert r.returncode == 0, r.stderr
        times.append(json.loads(r.stdout)["candidates"][0]["step_time_s"])
    assert times[0] < times[1]


@pytest.mark.parametrize("args", [
    ["--config", "/nonexistent.yaml", "--gpus", "4"],
    ["--config", TINY, "--gpus", "0"],
    ["--config", TINY, "--gpus", "4", "--gpu", "tpu"],
    ["--config", TINY],
    ["--config", TINY, "--gpus", "four"],
])
def test_bad_input_is_one_line_error(args):
    r = _plan(*args)
    assert r.returncode == 2
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ")
    assert "Traceback" not in r.stderr


def test_bad_model_is_one_line_error(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("model:\n  language: {num_layers: 2, hidden_size: 10, num_attention_heads: 3, vocab_size: 8}\n")
    r = _plan("--config", str(bad), "--gpus", "2", "--gpu", "cpu")
    assert r.returncode == 2
    assert r.stderr.startswith("error: model.language")


@pytest.mark.parametrize("config,gpus,gpu", [(TINY, 4, "cpu"), (LLAVA, 16, "h100")])
def test_emitted_config_passes_mimo_config_check(tmp_path, config, gpus, gpu):
    out = tmp_path / "planned.yaml"
    r = _plan("--config", config, "--gpus", str(gpus), "--gpu", gpu, "--out", str(out))
    assert r.returncode == 0, r.stderr
    chk = subprocess.run([sys.executable, "-m", "mimo.config", "check", str(out), "--world-size", str(gpus)],
                         capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert chk.returncode == 0, chk.stderr
    assert chk.stdout.strip() == "ok"


def test_every_ranked_candidate_emits_a_valid_config_cp_ones_with_bitfield_attention():
    from mimo.config import load_config
    from mimo.planner import make_plan
    from mimo.planner.emit import build_config

    plan = make_plan(LLAVA, 8, "h100")
    order = [m.name for m in plan.spec.modules]
    s = plan.settings
    seen_cp = False
    for cand in plan.candidates[:10]:
        cfg = build_config(load_raw(LLAVA), cand, order, s.workload.seq_length, s.global_batch, s.micro_batch,
                           s.precision)
        load_config(cfg, world_size=8)  # raises ConfigError naming the field if the emitted layout is invalid
        if cfg["parallelism"]["language"]["cp"] > 1:
            seen_cp = True
            assert cfg["model"]["language"]["attention"] == "bitfield"
    assert seen_cp, "the 8-GPU LLaVA plan ranks a CP candidate in its top 10 (see docs/planner.md)"
