"""Heterogeneous layouts (per-module TP/DP/PP, colocated or not) train exactly like the 1-rank run (FP32)."""

import copy

import pytest

from mimo.config import load_config
from mimo.runtime import run_on_ranks, select_runtime
from mimo.training import full_state
from test_training_parity import assert_same_run
from tiny import TINY

STEPS = 2


def layout(**modules):
    """TINY with per-module parallelism (modules not named get the defaults)."""
    raw = copy.deepcopy(TINY)
    raw["parallelism"] = {m: dict(modules.get(m, {})) for m in ("language", "images", "audio")}
    return raw


def _train(raw, steps, sabotage=None):
    from mimo.training.heterogeneous import make_trainer

    cfg = load_config(raw)
    trainer = make_trainer(cfg, select_runtime("cpu"))
    if sabotage == "reverse_boundary_grad":
        trainer.on_boundary_grad = lambda name, g: g.flip(0)
    tp_groups = {n: trainer.topo.grid(n).groups["tp"] for n in trainer.parts}
    losses, grads = [], None
    for s in range(steps):
        losses.append(trainer.train_step(s).loss)
        if s == 0:
            grads = full_state(trainer.parts, tp_groups, grads=True, layer_offsets=trainer.layer_offsets)
    params = full_state(trainer.parts, tp_groups, layer_offsets=trainer.layer_offsets)
    return dict(losses=losses, grads=grads, params=params, type=type(trainer).__name__)


def _merge(results):
    """Union of every rank's module/stage dicts; every rank must report the same losses."""
    for r in results:
        assert r["losses"] == results[0]["losses"]
    out = dict(results[0])
    for key in ("grads", "params"):
        out[key] = {}
        for r in results:
            out[key].update(r[key])
    return out


def deep(**modules):
    """A deeper variant (LLM 4 layers, images 2) whose audio projector is frozen too: audio sends no gradient."""
    raw = layout(**modules)
    raw["model"]["language"]["num_layers"] = 4
    raw["model"]["encoders"]["images"]["num_layers"] = 2
    raw["model"]["encoders"]["audio"]["projector"]["frozen"] = True
    return raw


@pytest.fixture(scope="module")
def reference():
    return run_on_ranks(_train, 1, layout(), STEPS)[0]


@pytest.fixture(scope="module")
def deep_reference():
    return run_on_ranks(_train, 1, deep(), STEPS)[0]


def _check(ref, raw, world, steps=STEPS):
    results = run_on_ranks(_train, world, raw, steps, timeout_s=240)
    assert {r["type"] for r in results} == {"HeterogeneousTrainer"}
    got = _merge(results)
    assert set(got["params"]) == set(ref["params"])
    assert_same_run(ref, got)


def test_noncolocated_fan_in_and_tp_difference(reference):
    # LLM tp2 (ranks 0-1), images dp2 feeding LLM dp1 (fan-in), audio tp1: three disjoint ranges.
    _check(reference, layout(language=dict(tp=2), images=dict(dp=2, rank_offset=2), audio=dict(rank_offset=4)), 5)


def test_colocated_fan_in_three_phase(reference):
    # Same 4 ranks: images dp4 -> LLM tp2 x dp2 (fan-in), audio tp2 x dp2 (equal).
    _check(reference, layout(language=dict(tp=2, dp=2), images=dict(dp=4), audio=dict(tp=2, dp=2)), 4)


def test_parity_catches_a_wrong_gradient_route(reference):
    raw = layout(images=dict(dp=2, rank_offset=1), audio=dict(rank_offset=3))
    # Reversed boundary gradient rows: images shard 0 gets shard 1's gradient and vice versa.
    got = _merge(run_on_ranks(_train, 4, raw, 1, "reverse_boundary_grad", timeout_s=240))
    with pytest.raises(AssertionError):
        assert_same_run(dict(reference, losses=reference["losses"][:1]), got)


def test_noncolocated_fan_out_with_llm_pp2(reference):
    # LLM pp2 x dp2 (ranks 0-3) fed by images dp1 (fan-out) and audio tp2 x dp1 (fan-out).
    _check(reference, layout(language=dict(pp=2, dp=2), images=dict(rank_offset=4), audio=dict(tp=2, rank_offset=5)),
           7)


def test_colocated_with_llm_pp2(reference):
    _check(reference, layout(language=dict(pp=2, dp=2), images=dict(dp=4), audio=dict(tp=2, dp=2)), 4)


def test_encoders_with_different_pipeline_depths_and_a_frozen_edge(deep_reference):
    # Paths of different length into the join: images pp2 -> LLM pp3, audio pp1 -> LLM pp3 (no backward).
    _check(deep_reference, deep(language=dict(pp=3), images=dict(pp=2, rank_offset=3), audio=dict(rank_offset=5)), 6)
    assert not any(k.startswith("audio.") for k in deep_reference["grads"])


@pytest.mark.slow
def test_colocated_frozen_encoder_and_projector(deep_reference):
    _check(deep_reference, deep(language=dict(tp=2, dp=2), images=dict(dp=4), audio=dict(dp=4)), 4)


# -- layouts that are refused, and deadlock freedom ------------------------------------------


def test_unsupported_layouts_are_refused_naming_the_field():
    from mimo.training.heterogeneous import heterogeneous_problems

    def problems(raw):
        return "\n".join(heterogeneous_problems(load_config(raw)))

    # LLM context parallelism behind the boundary runs (tests/test_cp_behind_boundary.py).
    cp = layout(language=dict(cp=2), images=dict(rank_offset=2), audio=dict(rank_offset=3))
    cp["model"]["language"]["attention"] = "bitfield"  # the config contract's precondition for cp > 1
    assert not problems(cp)
    # A colocated encoder split into pipeline stages.
    assert "parallelism.images.pp" in problems(deep(language=dict(dp=2), images=dict(pp=2), audio=dict(dp=2)))
    # images colocated with the LLM, audio on its own ranks.
    assert "all colocated" in problems(layout(language=dict(dp=2), images=dict(dp=2), audio=dict(rank_offset=2)))
    # Both encoders on rank 1, disjoint from the LLM on rank 0.
    assert "parallelism.audio.rank_offset" in problems(layout(images=dict(rank_offset=1), audio=dict(rank_offset=1)))
    assert not problems(deep(language=dict(pp=3), images=dict(pp=2, rank_offset=3), audio=dict(rank_offset=5)))


def random_layout(rng):
    """A random valid layout of the deep model on at most 8 ranks (non-colocated or colocated)."""
    while True:
        m = rng.choice([1, 2])
        lang = dict(tp=rng.choice([1, 2]), pp=rng.choice([1, 2, 3]), dp=rng.choice([1, 2]))
        n_lang = lang["tp"] * lang["pp"] * lang["dp"]
        dl = lang["dp"]
        if rng.random() < 0.3:  # colocated: encoders re-shard the LLM's ranks with pp = 1
            mods = {}
            for name in ("images", "audio"):
                tp = rng.choice([t for t in (1, 2) if n_lang % t == 0])
                mods[name] = dict(tp=tp, dp=n_lang // tp)
            if any(8 % p["dp"] for p in mods.values()) or any(
                    p["dp"] % dl and dl % p["dp"] for p in mods.values()) or 8 % (m * dl):
                continue
            raw = deep(language=lang, **mods)
            world = n_lang
        else:
            off, mods = n_lang, {}
            for name, max_pp in (("images", 2), ("audio", 1)):
                p = dict(tp=rng.choice([1, 2]), pp=rng.choice(range(1, max_pp + 1)), dp=rng.choice([1, 2, 4]),
                         rank_offset=off)
                off += p["tp"] * p["pp"] * p["dp"]
                mods[name] = p
            world = off
            de = [p["dp"] for p in mods.values()]
            if world > 8 or 8 % (m * dl) or any(d % dl and dl % d for d in de) or any(
                    d > dl and (m * dl) % d for d in de):
                continue
            raw = deep(language=lang, **mods)
        raw["training"]["micro_batch_size"] = m
        if rng.random() < 0.5:
            raw["model"]["encoders"]["images"]["frozen"] = True
            raw["model"]["encoders"]["images"]["projector"]["frozen"] = rng.random() < 0.5
        load_config(raw, world_size=world)  # valid by the config contract
        return raw, world


def _losses(raw, steps):
    out = _train(raw, steps)
    return out["losses"]


@pytest.mark.parametrize("seed", [0])
def test_random_layouts_do_not_deadlock(seed):
    import random

    raw, world = random_layout(random.Random(seed))
    losses = run_on_ranks(_losses, world, raw, 1, timeout_s=120)
    assert all(x == losses[0] for x in losses)


@pytest.mark.slow
@pytest.mark.parametrize("seed", [1, 2, 3, 4, 5])
def test_more_random_layouts_do_not_deadlock(seed):
    test_random_layouts_do_not_deadlock(seed)
