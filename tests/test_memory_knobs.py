"""Sequence parallelism and activation recompute (`parallelism.<module>.sp` / `.recompute`) keep FP32 parity.

Every run is compared with the 1-rank baseline by tools/parity.py's criterion
(max relative difference <= 1e-4 per loss, gradient and parameter). Each
distributed run also reports the megatron settings its modules were built
with, so a test cannot pass by ignoring the fields.
"""

import itertools

import pytest
from megatron.core.transformer.transformer_block import TransformerBlock

from mimo.config import load_config
from mimo.runtime import run_on_ranks, select_runtime
from mimo.training.parity import compare, record_run
from test_heterogeneous_parity import STEPS, _merge, deeper, layout
from test_training_parity import assert_same_run

COMBOS = [(sp, rc) for sp, rc in itertools.product((False, True), ("none", "selective", "full"))
          if (sp, rc) != (False, "none")]


def knobs(raw, sp, recompute):
    """Every module (LLM and encoders) with the same sp / recompute setting."""
    for m in raw["parallelism"].values():
        m.update(sp=sp, recompute=recompute)
    return raw


def trainable(raw):
    """Both encoders trainable, so encoder recompute and SP reach the gradients."""
    audio = raw["model"]["encoders"]["audio"]
    audio["frozen"] = False
    audio["projector"]["frozen"] = False
    return raw


def bitfield(raw):
    """Bitfield core attention in the LLM and the encoders."""
    raw["model"]["language"]["attention"] = "bitfield"
    for enc in raw["model"]["encoders"].values():
        enc["attention"] = "bitfield"
    return raw


def _train(raw, steps, skip_sp_grad_sum=False):
    import importlib

    from mimo.training import Trainer

    if skip_sp_grad_sum:  # negative control: the TP sum of sequence-parallel weights' gradients left out
        # (the module, not the function of the same name that megatron.core.distributed exports)
        finalize = importlib.import_module("megatron.core.distributed.finalize_model_grads")
        finalize._allreduce_non_tensor_model_parallel_grads = lambda *args, **kwargs: None
    trainer = Trainer(load_config(raw), select_runtime("cpu"))
    built = {}
    for name, part in trainer.parts.items():
        built[name] = sorted({(m.config.sequence_parallel, m.config.recompute_granularity)
                              for m in part.modules() if isinstance(m, TransformerBlock)}, key=str)
    return dict(record_run(trainer, steps), built=built)


def run(raw, world, steps=STEPS, skip_sp_grad_sum=False):
    results = run_on_ranks(_train, world, raw, steps, skip_sp_grad_sum, timeout_s=300)
    built = {}
    for r in results:
        for name, b in r["built"].items():
            built.setdefault(name, set()).update(map(tuple, b))
    return _merge(results), built


def check(ref, raw, world):
    got, built = run(raw, world)
    assert set(got["params"]) == set(ref["params"])
    assert_same_run(ref, got)
    report = compare(ref, {**got, "world_size": world, "placement": "-"}, 1e-4)
    assert report["ok"], report
    return built


def expected(raw, name):
    p = raw["parallelism"][name]
    return (bool(p["sp"] and p.get("tp", 1) > 1), None if p["recompute"] == "none" else p["recompute"])


def check_knobs(ref, raw, world):
    built = check(ref, raw, world)
    for name in raw["parallelism"]:
        assert built[name] == {expected(raw, name)}, (name, built[name])


@pytest.fixture(scope="module")
def reference():
    return run_on_ranks(_train, 1, trainable(layout()), STEPS)[0]


@pytest.fixture(scope="module")
def deeper_reference():
    return run_on_ranks(_train, 1, deeper(), STEPS)[0]


@pytest.fixture(scope="module")
def bitfield_reference():
    return run_on_ranks(_train, 1, bitfield(trainable(layout())), STEPS)[0]


# Layouts of the acceptance list (all with both encoders trainable).
def colocated_tp2():
    return trainable(layout(language=dict(tp=2), images=dict(tp=2), audio=dict(tp=2))), 2


def colocated_fan_in():
    # LLM tp2 x dp2, images dp4 (fan-in into the LLM's DP), audio tp2 x dp2, all on ranks 0-3.
    return trainable(layout(language=dict(tp=2, dp=2), images=dict(dp=4), audio=dict(tp=2, dp=2))), 4


def noncolocated_pp2():
    # LLM tp2 x pp2 on ranks 0-3; both encoders tp2 on ranks 4-5 (sharing them).
    return trainable(layout(language=dict(tp=2, pp=2), images=dict(tp=2, rank_offset=4),
                            audio=dict(tp=2, rank_offset=4))), 6


def cp2_bitfield():
    # LLM tp2 x cp2 (bitfield attention, balanced CP) on ranks 0-3; encoders tp2 on ranks 4-5.
    return bitfield(trainable(layout(language=dict(tp=2, cp=2), images=dict(tp=2, rank_offset=4),
                                     audio=dict(tp=2, rank_offset=4)))), 6


def test_colocated_tp2_sp_full_recompute(reference):
    raw, world = colocated_tp2()
    check_knobs(reference, knobs(raw, True, "full"), world)


def test_noncolocated_llm_pp2_sp_selective_recompute_of_bitfield_attention(bitfield_reference):
    # Selective recompute re-runs mimo's own core attention (bitfield masks in tensor form).
    raw, world = noncolocated_pp2()
    check_knobs(bitfield_reference, knobs(bitfield(raw), True, "selective"), world)


@pytest.mark.slow
def test_bitfield_attention_colocated_tp2(bitfield_reference):
    raw, world = colocated_tp2()
    for sp, recompute in COMBOS:
        check_knobs(bitfield_reference, knobs(bitfield(raw), sp, recompute), world)


def test_parity_catches_missing_tp_sum_of_sequence_parallel_gradients(reference):
    raw, world = colocated_tp2()
    got, _ = run(knobs(raw, True, "none"), world, steps=1, skip_sp_grad_sum=True)
    with pytest.raises(AssertionError, match="grad"):
        assert_same_run(dict(reference, losses=reference["losses"][:1], params={}), got)


@pytest.mark.slow
@pytest.mark.parametrize("sp,recompute", COMBOS)
@pytest.mark.parametrize("make", [colocated_tp2, colocated_fan_in, noncolocated_pp2])
def test_every_combination(reference, make, sp, recompute):
    raw, world = make()
    check_knobs(reference, knobs(raw, sp, recompute), world)


@pytest.mark.slow
@pytest.mark.parametrize("sp,recompute", COMBOS)
def test_every_combination_cp2_bitfield(bitfield_reference, sp, recompute):
    raw, world = cp2_bitfield()
    check_knobs(bitfield_reference, knobs(raw, sp, recompute), world)


@pytest.mark.slow
@pytest.mark.parametrize("sp,recompute", [(True, "full"), (True, "selective")])
def test_pipelined_encoders_exchange_sequence_shards(deeper_reference, sp, recompute):
    # LLM tp2 on ranks 0-1; images and audio both pp2 x tp2 on ranks 2-5 (lock-step stage nodes):
    # between encoder stages each item travels as its tokens / tp shard.
    raw = deeper(language=dict(tp=2), images=dict(pp=2, tp=2, rank_offset=2), audio=dict(pp=2, tp=2, rank_offset=2))
    check_knobs(deeper_reference, knobs(raw, sp, recompute), 6)
