import os

import pytest

from mimo.planner import Layout, get_gpu, layout_errors, make_plan, read_model
from mimo.planner.api import load_raw

HERE = os.path.dirname(__file__)
TINY = os.path.join(HERE, "tiny_mllm.yaml")
LLAVA = os.path.join(HERE, "..", "..", "examples", "planner", "llava_like.yaml")


def _check(result, world):
    s = result.settings
    spec = result.spec
    for cand in result.candidates:
        lays = cand.layouts
        assert layout_errors(spec, lays, world, s.global_batch, s.micro_batch, s.workload.seq_length) == []
        assert cand.gpus_used <= world
        assert all(lays[e.name].cp == 1 for e in spec.encoders)
        for name, plan in cand.plans.items():
            assert sum(plan.stage_layers) == spec.module(name).num_layers
            assert len(plan.stage_layers) == plan.layout.pp and min(plan.stage_layers) >= 1
        assert cand.peak_memory <= get_gpu(result.planner.gpu.name).memory_bytes
        assert cand.step_time > 0


@pytest.mark.parametrize("gpus", [1, 2, 3, 4, 6, 8])
def test_tiny_candidates_are_valid(gpus):
    result = make_plan(TINY, gpus, "cpu")
    _check(result, gpus)
    # every GPU used whenever some valid layout can use all of them
    assert all(c.gpus_used == gpus for c in result.candidates)
    times = [c.step_time for c in result.candidates]
    assert times == sorted(times)


@pytest.mark.parametrize("gpus,gpu", [(8, "h100"), (16, "h100"), (16, "a100")])
def test_llava_candidates_are_valid(gpus, gpu):
    result = make_plan(LLAVA, gpus, gpu)
    _check(result, gpus)
    families = {c.placement for c in result.candidates}
    assert {"colocated", "non-colocated"} <= families


def test_emitted_config_has_every_module_and_stage_layers():
    result = make_plan(LLAVA, 16, "h100")
    cfg = result.config
    assert set(cfg["parallelism"]) == {"language", "images"}
    spec = read_model(cfg["model"])
    for name, entry in cfg["parallelism"].items():
        if entry["pp"] > 1:
            assert sum(entry["stage_layers"]) == spec.module(name).num_layers
            assert len(entry["stage_layers"]) == entry["pp"]
        else:
            assert "stage_layers" not in entry
    raw = load_raw(LLAVA)
    assert cfg["model"] == raw["model"]
    lays = {n: Layout(e["tp"], e["cp"], e["pp"], e["dp"], e["rank_offset"]) for n, e in cfg["parallelism"].items()}
    t = cfg["training"]
    assert layout_errors(read_model(cfg["model"]), lays, 16, t["global_batch_size"], t["micro_batch_size"],
                         cfg["data"]["seq_length"]) == []


def test_non_colocated_wins_when_encoder_is_heavy_and_trainable():
    # heavy trainable encoder, tiny LLM: giving the encoder its own ranks overlaps it with the LLM
    raw = load_raw(TINY)
    raw["model"]["encoders"] = {"images": {**raw["model"]["encoders"]["images"], "num_layers": 8,
                                           "hidden_size": 256, "num_attention_heads": 4, "ffn_hidden_size": 1024,
                                           "frozen": False}}
    result = make_plan(raw, 4, "cpu")
    _check(result, 4)
    assert result.candidates[0].step_time <= min(
        c.step_time for c in result.candidates if c.placement == "colocated")


def test_bad_inputs_raise_value_error():
    raw = load_raw(TINY)
    with pytest.raises(ValueError):
        make_plan(raw, 0, "cpu")
    with pytest.raises(ValueError):
        make_plan(raw, 4, "tpu")
    bad = {**raw, "model": {**raw["model"], "language": {**raw["model"]["language"], "num_attention_heads": 3}}}
    with pytest.raises(ValueError, match="model.language"):
        make_plan(bad, 4, "cpu")
    with pytest.raises(ValueError):
        make_plan({"model": {}}, 4, "cpu")
