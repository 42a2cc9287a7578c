"""Heterogeneous layouts (per-module TP/DP/PP, colocated or not) train exactly like the 1-rank run (FP32)."""

import copy

import pytest
import torch

from mimo.config import ConfigError, load_config
from mimo.runtime import run_on_ranks, select_runtime
from mimo.training.parity import compare, merge_ranks, record_run
from test_training_parity import assert_same_run
from tiny import TINY

STEPS = 2


def layout(**modules):
    """TINY with per-module parallelism (modules not named get the defaults)."""
    raw = copy.deepcopy(TINY)
    raw["parallelism"] = {m: dict(modules.get(m, {})) for m in ("language", "images", "audio")}
    return raw


def _train(raw, steps, sabotage=None):
    from mimo.training import Trainer

    cfg = load_config(raw)
    trainer = Trainer(cfg, select_runtime("cpu"))
    if sabotage == "reverse_boundary_grad":  # the LLM side hands back its boundary gradients reversed
        for comm in trainer.comms.values():
            comm.backward = lambda g, backward=comm.backward: backward(None if g is None else g.flip(0))
    dtypes = sorted({str(p.dtype) for m in trainer.parts.values() for p in m.parameters()})
    return dict(record_run(trainer, steps), type=type(trainer).__name__, dtypes=dtypes)


_merge = merge_ranks  # every rank's record_run, merged into one run


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
    assert {r["type"] for r in results} == {"Trainer"}
    got = _merge(results)
    assert set(got["params"]) == set(ref["params"])
    assert_same_run(ref, got)
    # And by tools/parity.py's own criterion (max relative difference per tensor).
    report = compare(ref, {**got, "world_size": world, "placement": "-"}, 1e-4)
    assert report["ok"], report


@pytest.mark.slow
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
    # Step 0 only (its loss and gradients); the losses still agree, the encoder gradients must not.
    with pytest.raises(AssertionError, match="grad images"):
        assert_same_run(dict(reference, losses=reference["losses"][:1], params={}), got)


@pytest.mark.slow
def test_parity_catches_a_wrong_gradient_route_into_a_pipelined_colocated_encoder(deeper_reference):
    # The reversed rows reach the encoders through phase 3's chunked pipeline backward.
    raw = deeper(language=dict(pp=2), images=dict(pp=2), audio=dict(pp=2))
    got = _merge(run_on_ranks(_train, 2, raw, 1, "reverse_boundary_grad", timeout_s=240))
    with pytest.raises(AssertionError, match="grad (images|audio)"):
        assert_same_run(dict(deeper_reference, losses=deeper_reference["losses"][:1], params={}), got)


def test_noncolocated_fan_out_with_llm_pp2(reference):
    # LLM pp2 x dp2 (ranks 0-3) fed by images dp1 (fan-out) and audio tp2 x dp1 (fan-out).
    _check(reference, layout(language=dict(pp=2, dp=2), images=dict(rank_offset=4), audio=dict(tp=2, rank_offset=5)),
           7)


# -m slow: colocated encoders feeding a pipelined LLM stay covered by test_every_module_pipelined_on_the_same_ranks.
@pytest.mark.slow
def test_colocated_with_llm_pp2(reference):
    _check(reference, layout(language=dict(pp=2, dp=2), images=dict(dp=4), audio=dict(tp=2, dp=2)), 4)


def test_encoders_with_different_pipeline_depths_and_a_frozen_edge(deep_reference):
    # Paths of different length into the join: images pp2 -> LLM pp3, audio pp1 -> LLM pp3 (no backward).
    _check(deep_reference, deep(language=dict(pp=3), images=dict(pp=2, rank_offset=3), audio=dict(rank_offset=5)), 6)
    assert not any(k.startswith("audio.") for k in deep_reference["grads"])


def deeper(**modules):
    """deep() with a 2-layer trainable audio encoder, so both encoders can be pipelined."""
    raw = deep(**modules)
    audio = raw["model"]["encoders"]["audio"]
    audio.update(num_layers=2, frozen=False)
    audio["projector"]["frozen"] = False
    return raw


def deeper_frozen_images(**modules):
    raw = deeper(**modules)
    raw["model"]["encoders"]["images"]["frozen"] = True
    return raw


@pytest.fixture(scope="module")
def deeper_reference():
    return run_on_ranks(_train, 1, deeper(), STEPS)[0]


def test_encoders_sharing_ranks_away_from_the_llm(reference):
    # images dp2 and audio tp2 on the same ranks 1-2 (lock-step nodes), LLM on rank 0: fan-in from both.
    _check(reference, layout(images=dict(dp=2, rank_offset=1), audio=dict(tp=2, rank_offset=1)), 3)


def test_colocated_and_noncolocated_encoders_in_one_model(reference):
    # images colocated with the LLM (three-phase, fan-in dp4 -> dp2), audio on its own ranks 4-5 (fan-out).
    _check(reference, layout(language=dict(tp=2, dp=2), images=dict(dp=4), audio=dict(rank_offset=4, tp=2)), 6)


def test_every_module_pipelined_on_the_same_ranks(deeper_reference):
    # Homogeneous PP2 with encoders: each encoder streams its chunks through its own two stages in phase 1.
    _check(deeper_reference, deeper(language=dict(pp=2), images=dict(pp=2), audio=dict(pp=2)), 2)


def test_encoders_of_different_depths_sharing_ranks_run_as_an_island(deeper_reference):
    # images pp2 and audio pp1 x dp2 on the same ranks 2-3 (rank 2 holds images stage 0 and an audio
    # shard, rank 3 images stage 1 and the other): all forwards, then all backwards; LLM pp2 on 0-1.
    _check(deeper_reference, deeper(language=dict(pp=2), images=dict(pp=2, rank_offset=2),
                                    audio=dict(dp=2, rank_offset=2)), 4)


@pytest.mark.slow
def test_pipelined_encoders_sharing_ranks_and_a_colocated_pipelined_encoder(deeper_reference):
    # images pp2 x dp2 colocated with LLM pp2 x dp2 (ranks 0-3); audio pp2 on ranks 4-5.
    _check(deeper_reference, deeper(language=dict(pp=2, dp=2), images=dict(pp=2, dp=2),
                                    audio=dict(pp=2, rank_offset=4)), 6)
    # Both encoders pp2 on ranks 2-5 (tp2 and dp2), LLM pp2 on ranks 0-1.
    _check(deeper_reference, deeper(language=dict(pp=2), images=dict(pp=2, tp=2, rank_offset=2),
                                    audio=dict(pp=2, dp=2, rank_offset=2)), 6)
    # An island with a frozen encoder: images pp2 (frozen encoder, trainable projector: only its last
    # stage has gradients) and audio pp1 x tp2 on ranks 2-3; LLM tp2 on ranks 0-1.
    raw = deeper_frozen_images(language=dict(tp=2), images=dict(pp=2, rank_offset=2),
                               audio=dict(tp=2, rank_offset=2))
    _check(run_on_ranks(_train, 1, deeper_frozen_images(), STEPS)[0], raw, 4)


@pytest.mark.slow
def test_colocated_frozen_encoder_and_projector(deep_reference):
    _check(deep_reference, deep(language=dict(tp=2, dp=2), images=dict(dp=4), audio=dict(dp=4)), 4)


# -- layouts that are refused, and deadlock freedom ------------------------------------------


def test_every_valid_layout_kind_is_accepted():
    from mimo.schedule.plan_build import island_encoders
    from mimo.training import layout_problems

    def problems(raw):
        return "\n".join(layout_problems(load_config(raw)))

    # LLM context parallelism behind the boundary runs (tests/test_cp_behind_boundary.py).
    cp = layout(language=dict(cp=2), images=dict(rank_offset=2), audio=dict(rank_offset=3))
    cp["model"]["language"]["attention"] = "bitfield"  # the config contract's precondition for cp > 1
    assert not problems(cp)
    # A colocated pipelined encoder, mixed placements, encoders sharing ranks (equal or different pp).
    assert not problems(deep(language=dict(dp=2), images=dict(pp=2), audio=dict(dp=2)))
    assert not problems(layout(language=dict(dp=2), images=dict(dp=2), audio=dict(rank_offset=2)))
    assert not problems(layout(images=dict(rank_offset=1), audio=dict(rank_offset=1)))
    shared = deeper(images=dict(pp=2, rank_offset=1), audio=dict(dp=2, rank_offset=1))
    assert not problems(shared)
    assert not problems(deep(language=dict(pp=3), images=dict(pp=2, rank_offset=3), audio=dict(rank_offset=5)))
    # Only a shared range with different pipeline depths runs as an island (all forwards, then all backwards).
    assert island_encoders(load_config(shared)) == ["images", "audio"]
    assert island_encoders(load_config(layout(images=dict(rank_offset=1), audio=dict(rank_offset=1)))) == []
    # The config contract still refuses what no schedule could run, naming the field.
    with pytest.raises(ConfigError, match="parallelism.audio.cp"):
        load_config(layout(images=dict(rank_offset=1), audio=dict(cp=2, rank_offset=2)))


def random_layout(rng):
    """A random valid layout of the deeper model on at most 8 ranks: each encoder colocated with the
    LLM or on its own ranks (then possibly sharing them with the other encoder), any of them pipelined,
    either encoder frozen or not."""
    from mimo.config import ConfigError
    from mimo.training import layout_problems

    while True:
        lang = dict(tp=rng.choice([1, 2]), pp=rng.choice([1, 2, 3]), dp=rng.choice([1, 2]))
        n_lang = lang["tp"] * lang["pp"] * lang["dp"]
        mods, off, shared = {}, n_lang, rng.random() < 0.4
        for name in ("images", "audio"):
            tp, pp = rng.choice([1, 2]), rng.choice([1, 2])
            if rng.random() < 0.4:  # colocated: the LLM's ranks under the encoder's own grid
                mods[name] = dict(tp=tp, pp=pp, dp=max(1, n_lang // (tp * pp)))
                continue
            other = next((p for p in mods.values() if "rank_offset" in p), None)
            if shared and other is not None:  # the other encoder's ranks, same pp or (an island) not
                size = other["tp"] * other["pp"] * other["dp"]
                pp = other["pp"] if rng.random() < 0.5 or size % 2 else 3 - other["pp"]
                tp = rng.choice([t for t in (1, 2) if (size // pp) % t == 0])
                mods[name] = dict(tp=tp, pp=pp, dp=size // (pp * tp), rank_offset=other["rank_offset"])
                continue
            mods[name] = dict(tp=tp, pp=pp, dp=rng.choice([1, 2, 4]), rank_offset=off)
            off += tp * pp * mods[name]["dp"]
        raw = deeper(language=lang, **mods)
        raw["training"]["micro_batch_size"] = rng.choice([1, 2])
        for name in ("images", "audio"):
            if rng.random() < 0.4:
                raw["model"]["encoders"][name]["frozen"] = True
                raw["model"]["encoders"][name]["projector"]["frozen"] = rng.random() < 0.5
        if off > 8:
            continue
        try:
            cfg = load_config(raw, world_size=off)  # valid by the config contract
        except ConfigError:
            continue
        if not layout_problems(cfg):
            return raw, off


def _losses(raw, steps):
    out = _train(raw, steps)
    return out["losses"]


# Seed 2: 3 ranks, images colocated with an LLM dp2, audio on its own rank (fan-out), frozen audio encoder.
@pytest.mark.parametrize("seed", [2])
def test_random_layouts_do_not_deadlock(seed):
    import random

    raw, world = random_layout(random.Random(seed))
    losses = run_on_ranks(_losses, world, raw, 1, timeout_s=120)
    assert all(x == losses[0] for x in losses)


@pytest.mark.slow
@pytest.mark.parametrize("seed", [0, 1, 3, 4, 5, 6, 29, 30, 39, 59])  # 29-59: islands
def test_more_random_layouts_do_not_deadlock(seed):
    test_random_layouts_do_not_deadlock(seed)


# -- BF16 --------------------------------------------------------------------------------------


def bf16(raw):
    raw["training"]["precision"] = "bf16"
    return raw


def test_bf16_mixed_placement_matches_the_single_rank_bf16_run(reference):
    """BF16 compute and BF16 boundary wire on both communicator kinds (images colocated, audio on
    its own ranks): losses and step-0 gradients match the 1-rank BF16 run to BF16 accuracy, and the
    loss is the FP32 run's to within BF16 rounding."""
    from mimo.training.parity import max_rel_diff

    ref = run_on_ranks(_train, 1, bf16(layout()), STEPS)[0]
    got = _merge(run_on_ranks(_train, 4, bf16(layout(language=dict(dp=2), images=dict(dp=2),
                                                     audio=dict(tp=2, rank_offset=2))), STEPS, timeout_s=240))
    assert set(got["grads"]) == set(ref["grads"])
    assert "torch.bfloat16" in got["dtypes"]  # megatron keeps the LLM's layernorm weights in FP32
    torch.testing.assert_close(torch.tensor(got["losses"]), torch.tensor(ref["losses"]), rtol=1e-3, atol=0)
    torch.testing.assert_close(torch.tensor(got["losses"]), torch.tensor(reference["losses"]), rtol=1e-2, atol=0)
    assert max_rel_diff(got["grads"], ref["grads"]) < 2e-2


def frozen_llm(**modules):
    """A frozen LLM under trainable image modules, one sample per microbatch: some microbatches hold no
    image, so nothing before the LLM's first stage needs a gradient there (its backward does nothing)."""
    raw = layout(**modules)
    raw["model"]["language"]["frozen"] = True
    raw["training"]["micro_batch_size"] = 1
    return raw


def test_a_frozen_llm_with_microbatches_without_trainable_items():
    ref = run_on_ranks(_train, 1, frozen_llm(), STEPS)[0]
    assert not any(k.startswith("language.") for k in ref["grads"]) and any(k.startswith("images.") for k in ref["grads"])
    _check(ref, frozen_llm(language=dict(pp=2), images=dict(rank_offset=2), audio=dict(rank_offset=3)), 4)


def _train_watching_inputs(raw, steps):
    """_train, recording whether each received encoder activation was marked to need a gradient."""
    from mimo.schedule.plan import ACTIVATION
    from mimo.training.step_work import RankStep

    seen = set()
    arrived = RankStep.arrived

    def watched(self, a, t):
        arrived(self, a, t)
        if a.tensor == ACTIVATION and a.module != "language":
            seen.add((a.module, a.stage, self.x[(a.module, a.mb)].requires_grad))

    RankStep.arrived = watched  # this rank process only
    return dict(_train(raw, steps), inputs_need_grad=sorted(seen))


def test_a_frozen_pipelined_encoder_computes_no_input_gradient():
    """images: a frozen 2-stage encoder under a trainable projector (on its last stage), on its own ranks
    and colocated with the LLM. Its last stage takes no input gradient (nothing before it trains), and the
    run matches the 1-rank run. Control: the trainable encoder's last stage does."""
    ref = run_on_ranks(_train, 1, deeper_frozen_images(), STEPS)[0]
    for raw, world in ((deeper_frozen_images(language=dict(pp=2), images=dict(pp=2, rank_offset=2),
                                             audio=dict(pp=2, rank_offset=4)), 6),
                       (deeper_frozen_images(language=dict(pp=2), images=dict(pp=2), audio=dict(pp=2)), 2)):
        results = run_on_ranks(_train_watching_inputs, world, raw, STEPS, timeout_s=240)
        seen = {x for r in results for x in r["inputs_need_grad"]}
        assert seen == {("images", 1, False), ("audio", 1, True)}, seen
        got = _merge(results)
        assert_same_run(ref, got)
