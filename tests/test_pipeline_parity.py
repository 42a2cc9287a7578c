"""Pipeline-parallel LLM (1F1B) equals the single-rank run; stage_layers are honoured."""

import copy
import os

import pytest

from mimo.runtime import run_on_ranks
from test_training_parity import _train, assert_same_run
from mimo.training.parity import merge_ranks
from tiny import TINY

STEPS = 2


def text_only(**layout):
    raw = copy.deepcopy(TINY)
    raw["model"]["language"]["num_layers"] = 4
    raw["model"]["encoders"] = {}
    raw["parallelism"] = {"language": dict(layout)}
    return raw


_merge = merge_ranks  # every rank's record_run, merged into one run


@pytest.fixture(scope="module")
def text_reference():
    return run_on_ranks(_train, 1, text_only(), STEPS)[0]


# The default run keeps pp2-uneven (1F1B over two stages, stage_layers honoured). The rest run with
# -m slow; their combinations stay covered by default tests: PP x TP by
# test_memory_knobs.py::test_noncolocated_llm_pp2_sp_selective_recompute_of_bitfield_attention (LLM tp2 x pp2),
# PP x DP by test_item_parallel.py::test_colocated_encoder_dp_over_items (LLM pp3 x dp2).
@pytest.mark.parametrize("layout,world", [
    pytest.param(dict(pp=2), 2, marks=pytest.mark.slow),
    (dict(pp=2, stage_layers=[3, 1]), 2),
    pytest.param(dict(pp=4), 4, marks=pytest.mark.slow),
    pytest.param(dict(tp=2, pp=2), 4, marks=pytest.mark.slow),
    pytest.param(dict(pp=2, dp=2), 4, marks=pytest.mark.slow),
], ids=["pp2", "pp2-uneven", "pp4", "tp2xpp2", "pp2xdp2"])
def test_pipeline_equals_single_rank(text_reference, layout, world):
    results = run_on_ranks(_train, world, text_only(**layout), STEPS)
    got = _merge(results)
    assert set(got["params"]) == set(text_reference["params"])
    assert_same_run(text_reference, got)
    # Every rank reports the same global loss.
    for r in results:
        assert r["losses"] == results[0]["losses"]


def _stage_layers(raw):
    from mimo.config import load_config
    from mimo.runtime import select_runtime
    from mimo.training import Trainer

    t = Trainer(load_config(raw), select_runtime("cpu"))
    return t.topo.grid("language").coords["pp"], len(t.parts["language"].decoder.layers), t.layer_offsets["language"]


def test_stage_layers_decide_what_each_stage_builds():
    got = run_on_ranks(_stage_layers, 2, text_only(pp=2, stage_layers=[3, 1]))
    assert got == [(0, 3, 0), (1, 1, 3)]
    got = run_on_ranks(_stage_layers, 3, text_only(pp=3))  # 4 layers: remainder on the first stage
    assert got == [(0, 2, 0), (1, 1, 2), (2, 1, 3)]


def text_only_bitfield(**layout):
    raw = text_only(**layout)
    raw["model"]["language"].update(attention="bitfield", cp_block_size=16)
    return raw


@pytest.fixture(scope="module")
def bitfield_reference():
    saved = os.environ.get("TRITON_INTERPRET")
    os.environ["TRITON_INTERPRET"] = "0"  # dense attention backend: fast on CPU, same semantics
    try:
        return run_on_ranks(_train, 1, text_only_bitfield(), STEPS)[0]
    finally:
        if saved is None:
            os.environ.pop("TRITON_INTERPRET")
        else:
            os.environ["TRITON_INTERPRET"] = saved


# cp2xtp2 runs with -m slow: TP x CP stays in the default run through
# tests/attention/test_cp_model.py::test_gpt_model_cp_matches_cp1 (a TP2 x CP2 GPTModel vs CP1).
@pytest.mark.parametrize("layout,world", [
    (dict(cp=2), 2),
    pytest.param(dict(cp=2, tp=2), 4, marks=pytest.mark.slow),
    (dict(cp=2, pp=2), 4),
], ids=["cp2", "cp2xtp2", "cp2xpp2"])
def test_context_parallel_training_equals_cp1(bitfield_reference, layout, world, monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    got = _merge(run_on_ranks(_train, world, text_only_bitfield(**layout), STEPS))
    assert_same_run(bitfield_reference, got)


@pytest.mark.parametrize("policy", ["zigzag", pytest.param("contiguous", marks=pytest.mark.slow)])
def test_context_parallel_policies_agree(bitfield_reference, monkeypatch, policy):
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    raw = text_only_bitfield(cp=2)
    raw["model"]["language"]["cp_policy"] = policy
    assert_same_run(bitfield_reference, _merge(run_on_ranks(_train, 2, raw, STEPS)))
