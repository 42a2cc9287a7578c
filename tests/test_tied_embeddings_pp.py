"""Tied input/output embeddings with the LLM pipelined: the last stage's output weight is a copy of the
first stage's embedding, summed over megatron-core's embedding group, and stays equal to it.

FP32 parity with one rank (losses, first-step gradients, final weights), the copy equal to the
embedding after the steps, a negative control without the embedding group's gradient sum, and a
checkpoint saved at PP2 resumed at PP1 and back.
"""

import copy
import sys

import pytest
import torch

from mimo.runtime import run_on_ranks
from mimo.training.parity import max_rel_diff, merge_ranks
from mimo.training.state import TIED_COPY
from tiny import PARITY_ADAM_EPS, TINY

STEPS = 3
EMB = "language.embedding.word_embeddings.weight"


def tied(encoders=False, optimizer="adam", **language):
    """TINY's LLM (4 layers) with tied embeddings, text only or with the (trainable) vision encoder."""
    raw = copy.deepcopy(TINY)
    raw["model"]["language"].update(num_layers=4, tie_embeddings=True)
    raw["model"]["encoders"] = {"images": raw["model"]["encoders"]["images"]} if encoders else {}
    raw["training"].update(optimizer=optimizer, lr=0.01 if optimizer == "adam" else 0.1, train_iters=STEPS,
                           precision="fp32", init="sharded")
    if optimizer == "adam":
        raw["training"]["adam_eps"] = PARITY_ADAM_EPS
    raw["parallelism"] = {"language": dict(language)}
    if encoders:
        # Non-colocated: the tower on the rank after the LLM's.
        from mimo.config import load_config

        n = load_config(raw | {"model": {**raw["model"], "encoders": {}}}).world_size
        raw["parallelism"]["images"] = {"rank_offset": n}
    return raw


def _train(raw, steps, sabotage=None):
    from mimo.config import load_config
    from mimo.runtime import select_runtime
    from mimo.training import Trainer
    from mimo.training.parity import record_run

    if sabotage == "no_embedding_sum":
        fmg = sys.modules["megatron.core.distributed.finalize_model_grads"]
        fmg._allreduce_word_embedding_grads = lambda *a, **k: None
    trainer = Trainer(load_config(raw), select_runtime("cpu"))
    return record_run(trainer, steps)


def run(raw, sabotage=None):
    from mimo.config import load_config

    return merge_ranks(run_on_ranks(_train, load_config(raw).world_size, raw, STEPS, sabotage, timeout_s=300))


def assert_parity(ref, got, tol=1e-4):
    torch.testing.assert_close(torch.tensor(got["losses"]), torch.tensor(ref["losses"]), rtol=tol, atol=0)
    assert EMB + TIED_COPY not in ref["params"]          # one rank: a single tied weight
    assert EMB + TIED_COPY in got["params"]              # PP > 1: the last stage holds a copy
    # The copy is the embedding, bit for bit, after the steps (both stepped with the same summed gradient).
    assert torch.equal(got["params"][EMB + TIED_COPY], got["params"][EMB])
    assert torch.equal(got["grads"][EMB + TIED_COPY], got["grads"][EMB])
    assert max_rel_diff(got["grads"], ref["grads"]) <= tol
    assert max_rel_diff(got["params"], ref["params"]) <= tol


@pytest.fixture(scope="module")
def text_reference():
    return run(tied())


@pytest.mark.parametrize("layout", [dict(pp=2), dict(pp=3), dict(tp=2, pp=2)], ids=["pp2", "pp3", "tp2xpp2"])
def test_text_only_pipelined_equals_one_rank(text_reference, layout):
    """pp3: the middle stage is in no embedding group; tp2: each TP rank's vocabulary rows are tied."""
    assert_parity(text_reference, run(tied(**layout)))


def test_text_only_pp2_dp2_distributed_optimizer_equals_one_rank(text_reference):
    raw = tied(pp=2, dp=2)
    raw["training"]["use_distributed_optimizer"] = True
    assert_parity(text_reference, run(raw))


def test_without_the_embedding_group_sum_the_pp2_run_diverges(text_reference):
    """Negative control: each stage steps its copy with its own half of the gradient."""
    got = run(tied(pp=2), sabotage="no_embedding_sum")
    assert not torch.equal(got["params"][EMB + TIED_COPY], got["params"][EMB])
    assert max_rel_diff(got["params"], text_reference["params"]) > 1e-2


def test_vision_llava_pp2_sgd_equals_one_rank():
    ref = run(tied(encoders=True, optimizer="sgd"))
    assert_parity(ref, run(tied(encoders=True, optimizer="sgd", pp=2)))


def test_the_global_grad_norm_counts_the_tied_weight_once():
    """The clip (clip_grad) sees the same norm at PP2 as on one rank: the copy is not counted."""
    from mimo.config import load_config

    def norms(raw):
        return [r for r in run_on_ranks(_norm, load_config(raw).world_size, raw, timeout_s=300)]

    one, pp2 = norms(tied()), norms(tied(pp=2))
    assert len(set(pp2)) == 1
    assert abs(pp2[0] - one[0]) <= 1e-5 * one[0]


def _norm(raw):
    from mimo.config import load_config
    from mimo.runtime import select_runtime
    from mimo.training import Trainer

    return float(Trainer(load_config(raw), select_runtime("cpu")).train_step(0).grad_norm)


def test_local_init_starts_the_copy_as_the_first_stages_embedding():
    """`training.init: local` (megatron draws each stage on its own): the first stage's embedding is
    broadcast to the last stage's copy, so they are equal after the steps too."""
    raw = tied(pp=2)
    raw["training"]["init"] = "local"
    got = run(raw)
    assert torch.equal(got["params"][EMB + TIED_COPY], got["params"][EMB])


def test_embedding_groups_pair_first_and_last_stage_of_each_coordinate():
    from mimo.topology import Layout
    from mimo.topology.grid import embedding_groups

    # tp fastest, pp slowest: ranks 0..3 are stage 0, 8..11 stage 2.
    assert embedding_groups(Layout(tp=2, dp=2, pp=3)) == [[0, 8], [1, 9], [2, 10], [3, 11]]
    assert embedding_groups(Layout(pp=2, rank_offset=1)) == [[1, 2]]
    with pytest.raises(ValueError):
        embedding_groups(Layout())


# -- checkpoints ---------------------------------------------------------------------------------


def _ckpt_train(raw, save=None, load=None, stop=None):
    from checkpoint_harness import train, with_ckpt

    return train(with_ckpt(raw, save=save, load=load, save_interval=1 if save else None), stop=stop)


def test_checkpoint_pp2_resumes_on_pp1_and_back(tmp_path):
    """Saved at PP2 after step 1, resumed at PP1 (step 2, saved), resumed at PP2 (step 3): the same
    losses and weights as an uninterrupted PP1 run; the checkpoint holds the tied weight once."""
    from mimo.checkpoint import paths

    raw = tied()
    raw["training"]["train_iters"] = 3
    ref = _ckpt_train(raw)
    a, b = str(tmp_path / "a"), str(tmp_path / "b")
    first = _ckpt_train(tied(pp=2), save=a, stop=1)
    mid = _ckpt_train(raw, save=b, load=paths.iter_dir(a, 1), stop=2)
    last = _ckpt_train(tied(pp=2), load=paths.iter_dir(b, 2))
    assert (mid["start"], last["start"]) == (1, 2)
    from torch.distributed.checkpoint import FileSystemReader

    saved = FileSystemReader(paths.iter_dir(a, 1)).read_metadata().state_dict_metadata
    assert EMB in saved and not [k for k in saved if "output_layer" in k or TIED_COPY in k]
    losses = first["losses"] + mid["losses"] + last["losses"]
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref["losses"]), rtol=1e-4, atol=0)
    assert torch.equal(last["params"][EMB + TIED_COPY], last["params"][EMB])
    assert max_rel_diff(last["params"], ref["params"]) <= 1e-4
