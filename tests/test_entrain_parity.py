"""`data.balance: entrain` in training: deferred LLM work and the split encoder backward.

The data are LLaVA records of very different sizes (0-2 images, 1-30 words), so entrain's
assignment has microbatches of 3-6 samples and defers a sample with an image from an overloaded
microbatch to its partner in both steps. The loss is normalised over the global batch, so every
policy must give the 1-rank `none` run up to float summation order (FP32, CPU ranks).
"""

import json
import os
import random
import sys

import pytest

from mimo.config import load_config
from mimo.runtime import run_on_ranks
from mimo.training.parity import merge_ranks
from test_heterogeneous_parity import _train
from test_llava_data import llava_raw
from test_training_parity import assert_same_run

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "tools"))
import make_sample_data  # noqa: E402

STEPS = 2
WORDS = "a the on of in is what picture shape colour background two same yes no".split()
# LLM pp2 on ranks 0-1; the trainable image encoder, not colocated, on ranks 2-3 (encoder DP over items).
NONCOLOCATED = ({"language": {"pp": 2}, "images": {"dp": 2, "rank_offset": 2}}, 4)


def skewed_records(seed: int = 73, n: int = 32):
    rng = random.Random(seed)
    out = []
    for i in range(n):
        images = rng.choice([0, 0, 1, 2])
        question = " ".join(rng.choice(WORDS) for _ in range(rng.choice([1, 2, 3, 30 - 4 * images])))
        rec = {"id": f"r{i}", "conversations": [{"from": "human", "value": "<image>\n" * images + question},
                                                 {"from": "gpt", "value": "yes ."}]}
        if images:
            rec["image"] = [f"images/img{j:04d}.png" for j in range(images)]
        out.append(rec)
    return out


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory):
    out = str(tmp_path_factory.mktemp("skewed"))
    assert make_sample_data.main([out, "--records", "8", "--image-size", "16"]) == 0
    with open(os.path.join(out, "skewed.json"), "w") as f:
        json.dump(skewed_records(), f)
    return out


def config(data_dir, policy, parallelism=None, image_layers=1, frozen=False):
    raw = llava_raw(data_dir, os.path.join(data_dir, "skewed.json"), packing=False, shuffle=False,
                    image_root=data_dir, balance=policy)
    images = raw["model"]["encoders"]["images"]
    images["num_layers"] = image_layers
    if frozen:  # encoder and projector: no gradient crosses the boundary
        images["frozen"] = True
        images["projector"]["frozen"] = True
    raw["training"].update(global_batch_size=16, micro_batch_size=4)
    raw["parallelism"] = parallelism or {"language": {}, "images": {}}
    return raw


def assignments(raw):
    from mimo.balance.step import StepBalancer
    from mimo.data import PAD_ID, build_dataset

    cfg = load_config(raw)
    data, G = build_dataset(cfg), cfg.training.global_batch_size
    balancer = StepBalancer(cfg)
    return [(balancer.assignment([data.sample(s * G + i) for i in range(G)], PAD_ID),
             [data.sample(s * G + i).count("images") for i in range(G)]) for s in range(STEPS)]


@pytest.fixture(scope="module")
def reference(data_dir):
    return run_on_ranks(_train, 1, config(data_dir, "none"), STEPS)[0]


def test_the_data_makes_entrain_defer_samples_with_images(data_dir):
    """Without this the parity below would not exercise deferral."""
    for a, images in assignments(config(data_dir, "entrain", NONCOLOCATED[0])):
        assert len({len(mb) for mb in a.llm[0]}) > 1  # microbatches of different sizes
        moved = [s for k in range(1, a.microbatches) for s in a.llm[0][k] if s not in a.encoder[0][k]]
        assert moved and any(images[s] for s in moved), (a.encoder, a.llm)


@pytest.mark.parametrize("policy", ["none", "mmscale", "entrain"])
def test_noncolocated_pipelined_equals_single_rank(data_dir, reference, policy):
    parallelism, world = NONCOLOCATED
    got = merge_ranks(run_on_ranks(_train, world, config(data_dir, policy, parallelism), STEPS, timeout_s=240))
    assert set(got["params"]) == set(reference["params"])
    assert_same_run(reference, got)


def _train_counting_pending(raw, steps):
    """A run, and how many boundary forwards each edge still holds for a backward afterwards."""
    from mimo.runtime import select_runtime
    from mimo.training import Trainer
    from mimo.training.parity import record_run

    trainer = Trainer(load_config(raw), select_runtime("cpu"))
    return dict(record_run(trainer, steps), pending={n: c.pending for n, c in trainer.comms.items()})


def test_pipelined_encoder_and_cp_llm_entrain_equals_single_rank(data_dir):
    """Encoder DP 2 x PP 2: the deferred rows travel between encoder stages with the kept ones (a DP
    rank may hold none of one half), split again on arrival, and their gradients come back the same
    way; the LLM's first stage is CP 2, so both windows are broadcast to, and their gradients summed
    over, its CP ranks."""
    reference = run_on_ranks(_train, 1, config(data_dir, "none", image_layers=2), STEPS)[0]
    raw = config(data_dir, "entrain", {"language": {"pp": 2, "cp": 2}, "images": {"dp": 2, "pp": 2, "rank_offset": 4}},
                 image_layers=2)
    ranks = run_on_ranks(_train_counting_pending, 8, raw, STEPS, timeout_s=300)
    assert_same_run(reference, merge_ranks(ranks))
    assert all(r["pending"] == {"images": 0} for r in ranks)


def test_frozen_edge_entrain_equals_single_rank_and_keeps_no_boundary_state(data_dir):
    """No gradient crosses a frozen edge: its forwards (deferred windows included) keep nothing."""
    reference = run_on_ranks(_train, 1, config(data_dir, "none", frozen=True), STEPS)[0]
    parallelism, world = NONCOLOCATED
    ranks = run_on_ranks(_train_counting_pending, world, config(data_dir, "entrain", parallelism, frozen=True),
                         STEPS, timeout_s=240)
    assert_same_run(reference, merge_ranks(ranks))
    assert all(r["pending"] == {"images": 0} for r in ranks)


def test_colocated_pipelined_entrain_equals_single_rank(data_dir, reference):
    """Three phases: the encoder runs the whole step, the LLM its microbatches of different sizes."""
    raw = config(data_dir, "entrain", {"language": {"pp": 2}, "images": {"dp": 2}})
    assert_same_run(reference, merge_ranks(run_on_ranks(_train, 2, raw, STEPS, timeout_s=240)))


def _train_deferred_first(raw, steps):
    """Negative control: LLM microbatches list their deferred samples before the kept ones, while the
    boundary still delivers the kept window first, so image tokens land on the wrong samples."""
    from mimo.training.windows import StepWindows

    StepWindows.llm_indices = lambda self, d: [l + k for k, l in zip(self.kept[d], self.late[d])]
    return _train(raw, steps)  # this rank process only


def test_parity_catches_deferred_rows_routed_to_the_wrong_samples(data_dir, reference):
    parallelism, world = NONCOLOCATED
    raw = config(data_dir, "entrain", parallelism)
    with pytest.raises(AssertionError):  # the run completes, with image rows on the wrong samples
        assert_same_run(reference, merge_ranks(run_on_ranks(_train_deferred_first, world, raw, STEPS,
                                                            timeout_s=240)))


def _train_without_deferred_backward(raw, steps):
    """Negative control: the encoder drops the deferred rows before its backward (no split backward)."""
    from mimo.training.step_work import RankStep

    backward, dropped = RankStep.backward, []

    def without_late(self, a):
        dropped.extend(self.late_y)
        self.late_y.clear()
        return backward(self, a)

    RankStep.backward = without_late  # this rank process only
    return dict(_train(raw, steps), dropped=len(dropped))


def test_parity_needs_the_deferred_rows_backward(data_dir, reference):
    parallelism, world = NONCOLOCATED
    ranks = run_on_ranks(_train_without_deferred_backward, world, config(data_dir, "entrain", parallelism), STEPS,
                         timeout_s=240)
    assert sum(r["dropped"] for r in ranks) > 0  # deferred rows were really encoded apart
    with pytest.raises(AssertionError):
        assert_same_run(reference, merge_ranks(ranks))


def test_windows_split_kept_and_deferred_samples_and_refuse_other_distances():
    from mimo.balance.assignment import StepAssignment
    from mimo.training.windows import split_deferred

    # DP 1, 3 microbatches: sample 2 is encoded in microbatch 0 and run by the LLM in microbatch 1.
    kept, late = split_deferred(StepAssignment([[[0, 1, 2], [3], [4, 5]]], [[[0, 1], [3, 2], [4, 5]]]))
    assert kept == [[[0, 1], [3], [4, 5]]] and late == [[[], [2], []]]
    # Two microbatches later is no deferral the trainer runs.
    with pytest.raises(ValueError, match="LLM microbatch 2 of DP rank 0 runs samples \\[2\\]"):
        split_deferred(StepAssignment([[[0, 1, 2], [3], [4, 5]]], [[[0, 1], [3], [4, 5, 2]]]))
