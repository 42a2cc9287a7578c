"""data.balance reorders a step's samples; the loss (normalised over the global batch) and the
gradients stay those of the 1-rank run up to float summation order (FP32, CPU ranks)."""

import copy

import pytest

from mimo.config import load_config
from mimo.runtime import run_on_ranks
from test_balance import positions
from test_heterogeneous_parity import _merge, _train, layout
from test_training_parity import assert_same_run

STEPS = 2
# Non-colocated and pipelined: LLM pp2 on ranks 0-1, the (trainable) image encoder on rank 2.
PIPELINED = dict(language=dict(pp=2), images=dict(rank_offset=2))
WORLD = 3


def balanced(raw, policy):
    """Images only (3 ranks keep the test light); up to 2 images per sample, so work varies."""
    raw = copy.deepcopy(raw)
    raw["data"]["balance"] = policy
    del raw["model"]["encoders"]["audio"], raw["parallelism"]["audio"]
    return raw


@pytest.fixture(scope="module")
def reference():
    return run_on_ranks(_train, 1, balanced(layout(), "none"), STEPS)[0]


def _order_changes(raw):
    from mimo.balance.step import StepBalancer
    from mimo.data import PAD_ID, build_dataset

    cfg = load_config(raw)
    data, G = build_dataset(cfg), cfg.training.global_batch_size
    a = StepBalancer(cfg).assignment([data.sample(i) for i in range(G)], PAD_ID)
    return positions(a) != list(range(G))


def test_mmscale_single_rank_equals_none(reference):
    raw = balanced(layout(), "mmscale")
    assert _order_changes(raw)  # the policy really reorders this step
    assert_same_run(reference, run_on_ranks(_train, 1, raw, STEPS)[0])


@pytest.mark.parametrize("policy", [pytest.param("none", marks=pytest.mark.slow), "mmscale"])
def test_pipelined_noncolocated_equals_single_rank(reference, policy):
    raw = balanced(layout(**PIPELINED), policy)
    got = _merge(run_on_ranks(_train, WORLD, raw, STEPS, timeout_s=240))
    assert set(got["params"]) == set(reference["params"])
    assert_same_run(reference, got)


def _train_encoders_unbalanced(raw, steps):
    """Negative control: the LLM takes the balanced order, the encoders' windows the plain one."""
    from mimo.balance.assignment import contiguous
    from mimo.training.windows import KEPT, StepWindows

    balanced_shards = StepWindows._shards

    def plain_shards(self, name, mb, part):
        if part != KEPT:
            return balanced_shards(self, name, mb, part)
        dp, M = len(self.kept), len(self.kept[0])
        plain = contiguous(sum(len(m) for rank in self.kept for m in rank), dp, M)
        return [plain.llm[j][mb] for j in range(dp)]

    StepWindows._shards = plain_shards  # this rank process only
    return _train(raw, steps)


@pytest.mark.slow
def test_parity_catches_encoders_out_of_step_with_the_llm(reference):
    """Items routed by the plain order to LLM microbatches built from the balanced one: the run
    fails (placeholder/item count mismatch) or, where counts happen to agree, differs."""
    from mimo.runtime.launch import RankFailed

    raw = balanced(layout(**PIPELINED), "mmscale")
    with pytest.raises((AssertionError, RankFailed)):
        assert_same_run(reference, _merge(run_on_ranks(_train_encoders_unbalanced, WORLD, raw, STEPS, timeout_s=240)))


@pytest.mark.slow
def test_pipelined_colocated_mmscale_equals_single_rank(reference):
    # The three-phase schedule: LLM pp2 and the image encoder dp2 on the same two ranks.
    raw = balanced(layout(language=dict(pp=2), images=dict(dp=2)), "mmscale")
    got = _merge(run_on_ranks(_train, 2, raw, STEPS, timeout_s=240))
    assert_same_run(reference, got)
